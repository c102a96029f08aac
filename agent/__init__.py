"""kvpressure: a memory-pressure observability agent for LLM inference.

Data flows one way: samplers (``agent.samplers``) produce :class:`agent.samples.Batch`
objects, the daemon (``agent.daemon``) stores them in the bounded timeline
(``agent.timeline``) and the latest snapshot, and exporters (``exporters``) render them.
"""

from importlib import metadata

try:
    __version__ = metadata.version("kvpressure")
except metadata.PackageNotFoundError:  # pragma: no cover - running from a source tree
    __version__ = "0.0.0+unknown"
