"""What every source sampler uses: :class:`~agent.pipeline.Sampler` and ``LogOnce``.

Both are defined in the core (:mod:`agent.pipeline`, :mod:`agent.logs`) and re-exported here
for the samplers.
"""

from __future__ import annotations

from kvpressure.agent.logs import LogOnce
from kvpressure.agent.pipeline import Sampler

__all__ = ["LogOnce", "Sampler"]
