"""Slow-request detection: the configured SLO or the rolling baseline tail, whichever is lower.

A request is judged on its TTFT, or on its end-to-end latency where TTFT is unknown (non-
streaming requests, spans without a first-token time). For engine ``e`` and phase ``p``::

    baseline(e, p) = max(baseline_factor x quantile_q(last N latencies), baseline_floor_s)
    threshold(e, p) = min(slo_p, baseline(e, p))   once >= baseline_min_requests are known
                    = slo_p                          before (warm-up)
    slow            = latency > threshold(e, p)

Defaults: ``q = 0.95``, ``baseline_factor = 1.5``, ``N = 500``, ``baseline_min_requests =
30``, ``baseline_floor_s = 0.05``, ``slo_ttft_s = 2.0``, ``slo_e2e_s = 30.0``.

The factor keeps the baseline from flagging the ordinary 5 % above the p95 (a plain p95
threshold flags 5 % of a calm workload by definition); the floor keeps millisecond jitter on
a fast engine from counting as slow.

Only requests that completed (``outcome == "ok"``) and were not slow feed the baseline, so
a long incident does not become the new normal; a lasting change to slower traffic is still
bounded by the SLO.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from agent.requests.record import RequestRecord


@dataclass(frozen=True, slots=True)
class Verdict:
    """Whether one request was slow, and why that was decided.

    Attributes:
        slow: latency exceeded the threshold.
        phase: ``ttft`` or ``e2e``.
        latency_s: the latency judged.
        threshold_s: the threshold it was compared to.
        basis: ``slo`` when the SLO was the lower (or the only) threshold, else
            ``baseline``.
    """

    slow: bool
    phase: str
    latency_s: float
    threshold_s: float
    basis: str


def quantile(sorted_values: list[float], q: float) -> float:
    """Linear-interpolated quantile of already sorted values (numpy's default method).

    Raises:
        ValueError: ``sorted_values`` is empty.
    """
    if not sorted_values:
        raise ValueError("quantile of no values")
    pos = q * (len(sorted_values) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


class _Baseline:
    """Last N latencies; the quantile is recomputed only after a change (O(N log N))."""

    __slots__ = ("_cached", "values")

    def __init__(self, size: int) -> None:
        self.values: deque[float] = deque(maxlen=size)
        self._cached: float | None = None

    def add(self, v: float) -> None:
        self.values.append(v)
        self._cached = None

    def quantile(self, q: float) -> float:
        if self._cached is None:
            self._cached = quantile(sorted(self.values), q)
        return self._cached


class SlowDetector:
    """Judges requests slow against the SLO and a per-engine, per-phase rolling baseline.

    Not thread-safe: the attribution sampler owns it.

    Args:
        slo_ttft_s: TTFT objective, seconds.
        slo_e2e_s: end-to-end objective for requests without a TTFT, seconds.
        baseline_quantile: the tail quantile ``q`` of the baseline.
        baseline_factor: multiplier on that quantile.
        baseline_requests: ``N``, requests kept per engine and phase.
        baseline_min_requests: requests needed before the baseline applies.
        baseline_floor_s: lowest baseline threshold, seconds.
    """

    def __init__(
        self,
        slo_ttft_s: float = 2.0,
        slo_e2e_s: float = 30.0,
        baseline_quantile: float = 0.95,
        baseline_factor: float = 1.5,
        baseline_requests: int = 500,
        baseline_min_requests: int = 30,
        baseline_floor_s: float = 0.05,
    ) -> None:
        self.slo = {"ttft": slo_ttft_s, "e2e": slo_e2e_s}
        self.q = baseline_quantile
        self.factor = baseline_factor
        self.size = baseline_requests
        self.min_requests = baseline_min_requests
        self.floor = baseline_floor_s
        self._base: dict[tuple[str, str], _Baseline] = {}

    def threshold(self, engine: str, phase: str) -> tuple[float, str]:
        """Return ``(threshold_s, basis)`` for ``engine`` and ``phase`` right now."""
        slo = self.slo[phase]
        b = self._base.get((engine, phase))
        if b is None or len(b.values) < self.min_requests:
            return slo, "slo"
        base = max(self.factor * b.quantile(self.q), self.floor)
        return (base, "baseline") if base < slo else (slo, "slo")

    def baseline_size(self, engine: str, phase: str) -> int:
        """Requests currently in the baseline of ``engine`` and ``phase``."""
        b = self._base.get((engine, phase))
        return 0 if b is None else len(b.values)

    def judge(self, record: RequestRecord) -> Verdict | None:
        """Judge ``record`` and learn from it.

        Returns:
            ``None`` when the record has neither TTFT nor end-to-end latency.
        """
        if record.ttft_s is not None:
            phase, latency = "ttft", record.ttft_s
        elif record.e2e_s is not None:
            phase, latency = "e2e", record.e2e_s
        else:
            return None
        thr, basis = self.threshold(record.engine, phase)
        slow = latency > thr
        if not slow and record.outcome == "ok":
            key = (record.engine, phase)
            b = self._base.get(key)
            if b is None:
                b = self._base[key] = _Baseline(self.size)
            b.add(latency)
        return Verdict(slow, phase, latency, thr, basis)
