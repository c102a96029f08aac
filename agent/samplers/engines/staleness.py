"""Stale engine statistics: token counters frozen while the gauges claim work.

An engine can keep answering ``/metrics`` with gauges that no longer describe it: vLLM
keeps its last ``num_requests_running`` and KV usage after every request aborted, a hung
scheduler keeps its last KV usage while producing nothing. Work shows in the token
counters (``kvpressure_engine_prompt_tokens_total`` + ``..._generation_tokens_total``, all
models summed) or in the work gauges themselves (requests running, KV usage ratio, KV
tokens used): an engine that runs requests moves one of them within seconds. Not every
engine counts tokens as they are made: llama-server adds a request's generated tokens to
``llamacpp:tokens_predicted_total`` when the request finishes, so a 60 s decode freezes
that counter for 60 s while its KV usage (``/slots``) grows with every token.
:class:`StaleTracker` marks the engine's statistics stale when, for at least
``stale_after_s``, neither the counters nor those gauges have changed while every scrape
claimed running requests or KV usage at or above ``kv_full``: what stale statistics look
like (the same numbers, scrape after scrape), and what a working engine never shows.

The engine sampler emits ``kvpressure_engine_stats_stale{engine,instance}`` (1 stale,
0 not) and the source ``stats`` (``ok``, or ``error`` with reason ``stale``); both are
absent for an engine without token counters, whose staleness cannot be told. Attribution
does not use the engine's gauges as evidence while they are stale, and the
``KvpressureKVCacheSaturated`` alert requires token progress.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final

from kvpressure.agent.samples import Sample

STALE: Final = "kvpressure_engine_stats_stale"
TOKEN_COUNTERS: Final = (
    "kvpressure_engine_prompt_tokens_total",
    "kvpressure_engine_generation_tokens_total",
)
RUNNING: Final = "kvpressure_engine_requests_running"
KV_RATIO: Final = "kvpressure_engine_kv_cache_usage_ratio"
KV_USED: Final = "kvpressure_engine_kv_cache_used_tokens"

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
        self._seen: tuple[float, float, float, float] | None = None
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
        kv_sum = 0.0
        kv_used = 0.0
        for s in samples:
            if s.name in TOKEN_COUNTERS:
                tokens = (tokens or 0.0) + s.value
            elif s.name == RUNNING:
                running += s.value
            elif s.name == KV_RATIO:
                kv = max(kv, s.value)
                kv_sum += s.value
            elif s.name == KV_USED:
                kv_used += s.value
        if tokens is None:
            self._seen = self._frozen_since = None
            return None
        claims_work = running > 0 or kv >= self.kv_full
        seen = (tokens, running, kv_sum, kv_used)
        if seen != self._seen or not claims_work:
            self._seen = seen
            self._frozen_since = now if claims_work else None
            return False
        if self._frozen_since is None:
            self._frozen_since = now
        return now - self._frozen_since >= self.stale_after_s
