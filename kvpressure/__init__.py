"""kvpressure: memory-pressure observability for LLM inference.

The installed distribution holds one import namespace, ``kvpressure``: the agent
(``kvpressure.agent``), its exporters (``kvpressure.exporters``), the Grafana dashboards
(``kvpressure.dashboards``) and the deployment files (``kvpressure.deploy``: Prometheus rules,
the systemd unit, Kubernetes manifests) as package data; ``kvpressure export`` writes the
data files out. In a source checkout they are the top-level folders ``agent/``,
``exporters/``, ``dashboards/`` and ``deploy/``; this folder holds a link to each, so the
build backend, an editable install and mypy all see the one ``kvpressure`` namespace.
"""
