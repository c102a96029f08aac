"""The latency knee: TTFT and ITL observed per KV-occupancy band, as cumulative histograms.

Each observation is a latency (seconds) with the KV occupancy (0-1) the engine reported
while it happened; the band is one of :data:`BANDS`. Exported as
``kvpressure_kv_occupancy_latency_seconds{engine,phase,band}`` (``_bucket`` with ``le``,
``_count``, ``_sum``), so ``histogram_quantile(0.99, ...) by (band)`` shows where latency
bends as memory fills, and ``kvpressure plan`` reads the same buckets back from an agent.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Final

from kvpressure.agent.catalogue import SampleName, histogram_names
from kvpressure.agent.histograms import histogram_quantile

BANDS: tuple[tuple[str, float, float], ...] = (
    ("0-50", 0.0, 0.50),
    ("50-80", 0.50, 0.80),
    ("80-90", 0.80, 0.90),
    ("90-95", 0.90, 0.95),
    ("95-100", 0.95, 1.0),
)
"""``(label, lower, upper)``: lower inclusive, upper exclusive except the last band."""

BUCKETS: tuple[float, ...] = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)
"""Upper bounds in seconds; ``+Inf`` is implicit. Cover ITL (ms) and TTFT under load (s)."""

PHASES = ("ttft", "itl")

METRIC: Final = "kvpressure_kv_occupancy_latency_seconds"


def band_of(occupancy: float) -> str:
    """Return the band label of a KV occupancy ratio (clamped into 0-1)."""
    x = min(max(occupancy, 0.0), 1.0)
    for label, _lo, hi in BANDS[:-1]:
        if x < hi:
            return label
    return BANDS[-1][0]


def band_bounds(label: str) -> tuple[float, float]:
    """Return ``(lower, upper)`` occupancy of a band label.

    Raises:
        KeyError: unknown label.
    """
    for name, lo, hi in BANDS:
        if name == label:
            return lo, hi
    raise KeyError(label)


@dataclass(slots=True)
class _Hist:
    counts: list[int] = field(default_factory=lambda: [0] * (len(BUCKETS) + 1))
    total: float = 0.0
    n: int = 0


class KneeHistogram:
    """Cumulative latency histograms keyed by ``(engine, phase, band)``; thread-safe."""

    def __init__(self) -> None:
        self._h: dict[tuple[str, str, str], _Hist] = {}
        self._lock = threading.Lock()

    def observe(self, engine: str, phase: str, seconds: float, occupancy: float) -> None:
        """Record one latency.

        Args:
            engine: the ``engine`` label.
            phase: ``ttft`` or ``itl``.
            seconds: the latency; negative or non-finite values are ignored.
            occupancy: KV occupancy ratio (0-1) while it happened.
        """
        if not (seconds >= 0.0 and seconds != float("inf")):
            return
        key = (engine, phase, band_of(occupancy))
        i = bisect.bisect_left(BUCKETS, seconds)
        with self._lock:
            h = self._h.setdefault(key, _Hist())
            h.counts[i] += 1
            h.total += seconds
            h.n += 1

    def samples(self) -> Iterator[tuple[SampleName, float, dict[str, str]]]:
        """Yield ``(sample name, value, labels)`` for every observed key, cumulative buckets."""
        bucket, count, total_name = histogram_names(METRIC)
        with self._lock:
            items = sorted((k, list(h.counts), h.total, h.n) for k, h in self._h.items())
        for (engine, phase, band), counts, total, n in items:
            labels = {"engine": engine, "phase": phase, "band": band}
            acc = 0
            for le, c in zip((*BUCKETS, float("inf")), counts, strict=True):
                acc += c
                le_s = "+Inf" if le == float("inf") else repr(le)
                yield bucket, float(acc), {**labels, "le": le_s}
            yield count, float(n), labels
            yield total_name, total, labels


@dataclass(frozen=True, slots=True)
class BandStats:
    """Latency quantiles of one ``(phase, band)`` read back from cumulative buckets.

    Attributes:
        band: the band label.
        phase: ``ttft`` or ``itl``.
        count: observations.
        mean: ``sum / count`` in seconds.
        p50: median (linear interpolation inside the bucket, Prometheus' rule).
        p95: 95th percentile.
        p99: 99th percentile.
    """

    band: str
    phase: str
    count: float
    mean: float | None
    p50: float | None
    p95: float | None
    p99: float | None


def quantile(q: float, buckets: Iterable[tuple[float, float]]) -> float | None:
    """Return the ``q`` quantile from cumulative ``(upper bound, count)`` buckets.

    Sorts the pairs and applies :func:`agent.histograms.histogram_quantile`
    (Prometheus' rule: linear within a bucket, the lowest bucket starting at 0, the
    highest finite bound when the quantile falls in ``+Inf``). ``None`` without
    observations.
    """
    bs = sorted(buckets)
    return histogram_quantile(q, [le for le, _ in bs], [c for _, c in bs])


def stats_from_samples(
    samples: Iterable[tuple[str, Mapping[str, str], float]], engine: str | None = None
) -> list[BandStats]:
    """Rebuild per-band quantiles from exported histogram samples (e.g. an agent snapshot).

    Args:
        samples: ``(name, labels, value)`` triples; other metrics are ignored.
        engine: keep only this ``engine`` label (``None``: every engine, summed).

    Returns:
        One :class:`BandStats` per ``(phase, band)`` observed, in band order.
    """
    buckets: dict[tuple[str, str], dict[float, float]] = {}
    sums: dict[tuple[str, str], float] = {}
    counts: dict[tuple[str, str], float] = {}
    for name, labels, value in samples:
        if not name.startswith(METRIC) or (engine is not None and labels.get("engine") != engine):
            continue
        key = (labels.get("phase", ""), labels.get("band", ""))
        if name == f"{METRIC}_bucket":
            le = float(labels.get("le", "+Inf").replace("+Inf", "inf"))
            b = buckets.setdefault(key, {})
            b[le] = b.get(le, 0.0) + value
        elif name == f"{METRIC}_sum":
            sums[key] = sums.get(key, 0.0) + value
        elif name == f"{METRIC}_count":
            counts[key] = counts.get(key, 0.0) + value
    order = {b[0]: i for i, b in enumerate(BANDS)}
    out = []
    for (phase, band), b in sorted(
        buckets.items(), key=lambda kv: (kv[0][0], order.get(kv[0][1], 9))
    ):
        pts = list(b.items())
        n = counts.get((phase, band), max(b.values()))
        out.append(
            BandStats(
                band=band,
                phase=phase,
                count=n,
                mean=sums[(phase, band)] / n if n and (phase, band) in sums else None,
                p50=quantile(0.5, pts),
                p95=quantile(0.95, pts),
                p99=quantile(0.99, pts),
            )
        )
    return out
