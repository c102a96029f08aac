"""Stale engine statistics: token counters frozen while the gauges claim work.

An engine can keep answering ``/metrics`` with gauges that no longer describe it: vLLM
keeps its last ``num_requests_running`` and KV usage after every request aborted, a hung
scheduler keeps its last KV usage while producing nothing. Work shows in the token
counters (``kvpressure_engine_prompt_tokens_total`` + ``..._generation_tokens_total``, all
models summed): an engine that runs requests or holds a full KV cache moves them within
seconds. :class:`StaleTracker` marks the engine's statistics stale when, for at least
``stale_after_s``, those counters have not moved while every scrape claimed running
requests or KV usage at or above ``kv_full``.

The engine sampler emits ``kvpressure_engine_stats_stale{engine,instance}`` (1 stale,
0 not) and the source ``stats`` (``ok``, or ``error`` with reason ``stale``); both are
absent for an engine without token counters, whose staleness cannot be told. Attribution
does not use the engine's gauges as evidence while they are stale, and the
``KvpressureKVCacheSaturated`` alert requires token progress.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final

from agent.samples import Sample

STALE: Final = "kvpressure_engine_stats_stale"
TOKEN_COUNTERS: Final = (
    "kvpressure_engine_prompt_tokens_total",
    "kvpressure_engine_generation_tokens_total",
)
RUNNING: Final = "kvpressure_engine_requests_running"
KV_RATIO: Final = "kvpressure_engine_kv_cache_usage_ratio"

STALE_AFTER_S: Final = 30.0
"""Seconds of frozen token counters under claimed work before the statistics are stale."""

KV_FULL: Final = 0.90
"""KV usage that claims work (the ``kv_cache_usage`` rule's default threshold)."""


class StaleTracker:
    """Tells whether one engine's statistics are stale (see the module docstring).

    Not thread-safe: one per engine sampler, called from its collection.

    Args:
        stale_after_s: seconds the counters must stay frozen under claimed work.
        kv_full: KV usage ratio at or above which a full cache claims work.
    """

    def __init__(self, stale_after_s: float = STALE_AFTER_S, kv_full: float = KV_FULL) -> None:
        self.stale_after_s = stale_after_s
        self.kv_full = kv_full
        self._tokens: float | None = None
        self._frozen_since: float | None = None

    def update(self, now: float, samples: Iterable[Sample]) -> bool | None:
        """Take one scrape's normalized samples at monotonic time ``now`` (seconds).

        Returns:
            ``True`` stale, ``False`` not, ``None`` when the scrape has no token counter
            (staleness unknown).
        """
        tokens: float | None = None
        running = 0.0
        kv = 0.0
        for s in samples:
            if s.name in TOKEN_COUNTERS:
                tokens = (tokens or 0.0) + s.value
            elif s.name == RUNNING:
                running += s.value
            elif s.name == KV_RATIO:
                kv = max(kv, s.value)
        if tokens is None:
            self._tokens = self._frozen_since = None
            return None
        claims_work = running > 0 or kv >= self.kv_full
        if tokens != self._tokens or not claims_work:
            self._tokens = tokens
            self._frozen_since = now if claims_work else None
            return False
        if self._frozen_since is None:
            self._frozen_since = now
        return now - self._frozen_since >= self.stale_after_s
