"""Per-request data: the :class:`~agent.requests.record.RequestRecord` stream and its sources."""
