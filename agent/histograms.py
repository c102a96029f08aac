"""Windowed quantiles from cumulative Prometheus histograms.

Engines export latency as cumulative histograms (``<name>_bucket{le=...}``, ``_count``,
``_sum``). A quantile over the engine's whole lifetime says little about *now*, so this
module keeps a short ring of bucket snapshots per series and computes quantiles over the
observations of the last window only (the delta between the newest snapshot and the one
that opened the window), the way ``histogram_quantile(q, rate(x_bucket[60s]))`` does in
Prometheus.

Guards:

* **Reset** (engine restart, case 22): when any bucket, or the count, is lower than in
  the previous snapshot, or the bucket layout changed, the window restarts. Its baseline
  becomes an all-zero histogram, so the window holds exactly the post-reset
  observations; a delta is never negative.
* **Sparse window**: with fewer than ``min_count`` observations in the window there is
  no quantile (``None``, so the exporter shows nothing rather than a number made of one
  or two requests).
* **Interpolation**: :func:`histogram_quantile` follows Prometheus's
  ``histogram_quantile``: linear interpolation inside the bucket that holds the rank,
  the lowest bucket starting at 0 (when its upper bound is positive), and the highest
  finite bound returned when the rank falls in the ``+Inf`` bucket.

The windowing is configuration-free for now (60 s, see :data:`DEFAULT_WINDOW_S`); issue 5
reuses :class:`WindowedHistogram` for window-level attribution.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import math
import operator
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Final

DEFAULT_WINDOW_S: Final = 60.0
"""Length of the rolling window in seconds."""

DEFAULT_MIN_COUNT: Final = 5
"""Fewest observations in a window for which a quantile is computed."""

MAX_SNAPSHOTS: Final = 512
"""Snapshots kept per series (at 0.1 s sampling, about 50 s; older ones are dropped)."""


@dataclass(frozen=True, slots=True)
class HistogramSnapshot:
    """One cumulative histogram as an engine exported it at one instant.

    Attributes:
        bounds: bucket upper bounds (the ``le`` values) in base units, strictly
            increasing, the last one ``+inf``.
        cumulative: cumulative count of observations ``<= bound`` for each bound, same
            length as ``bounds``.
        sum: the ``_sum`` sample (base units), ``None`` when absent.
    """

    bounds: tuple[float, ...]
    cumulative: tuple[float, ...]
    sum: float | None = None

    @property
    def count(self) -> float:
        """Observations in the histogram (the ``+Inf`` bucket); 0 when empty."""
        return self.cumulative[-1] if self.cumulative else 0.0

    @classmethod
    def from_buckets(
        cls, buckets: Iterable[tuple[float, float]], sum_: float | None = None
    ) -> HistogramSnapshot | None:
        """Build a snapshot from ``(le, cumulative count)`` pairs in any order.

        Args:
            buckets: ``(upper bound, cumulative count)`` pairs; duplicate bounds keep
                the largest count.
            sum_: the ``_sum`` value, if known.

        Returns:
            The snapshot, or ``None`` when there is no ``+Inf`` bucket, a bound or count
            is NaN, or a count is negative (the histogram is unusable).
        """
        by_bound: dict[float, float] = {}
        for le, c in buckets:
            if math.isnan(le) or math.isnan(c) or c < 0 or math.isinf(c):
                return None
            by_bound[le] = max(c, by_bound.get(le, 0.0))
        if not by_bound or math.inf not in by_bound:
            return None
        bounds = tuple(sorted(by_bound))
        # Prometheus' ensureMonotonic: a cumulative count lower than the one before is
        # raised to it (engines exporting buckets from racing threads do this).
        cumulative: list[float] = []
        running = 0.0
        for b in bounds:
            running = max(running, by_bound[b])
            cumulative.append(running)
        return cls(bounds, tuple(cumulative), sum_)

    @classmethod
    def from_columns(
        cls, bounds: Sequence[float], counts: Sequence[float], sum_: float | None = None
    ) -> HistogramSnapshot | None:
        """:meth:`from_buckets` of ``zip(bounds, counts)``, the same snapshot, built faster.

        A series as engines write it (bounds strictly increasing up to ``+Inf``, counts
        finite, non-negative and non-decreasing) is taken as it is, with one bounds tuple
        shared by every series of that layout; anything else goes through
        :meth:`from_buckets`.

        Args:
            bounds: the ``le`` bounds in body order (base units).
            counts: the cumulative counts (floats), same length.
            sum_: the ``_sum`` value, if known.

        Returns:
            What ``from_buckets(zip(bounds, counts), sum_)`` returns.
        """
        layout = _layout(tuple(bounds)) if len(bounds) == len(counts) and counts else None
        if layout is not None:
            lo, hi = counts[0], counts[-1]
            total = sum(counts)  # NaN when a count is (sorted() cannot order NaN)
            if (
                lo >= 0
                and hi < math.inf
                and not math.isnan(total)
                and list(counts) == sorted(counts)
            ):
                if lo == 0:  # a -0.0 count reads as 0.0, as from_buckets' running max gives
                    zeros = bisect.bisect_right(counts, 0.0)
                    return cls(layout, (0.0,) * zeros + tuple(counts[zeros:]), sum_)
                return cls(layout, tuple(counts), sum_)
        return cls.from_buckets(zip(bounds, counts, strict=False), sum_)

    def minus(self, base: HistogramSnapshot) -> HistogramSnapshot | None:
        """Return ``self - base`` bucket by bucket (the observations between the two).

        Returns:
            The delta histogram, or ``None`` when the bucket layouts differ or any
            bucket would be negative (a reset between the two).
        """
        if base.bounds != self.bounds:
            return None
        # tuple() of a list, not of the map: tuple() of an iterator of unknown length grows its
        # result outside CPython's tuple free lists, and each such tuple, once freed, is kept
        # on the free list of its size (up to 2,000 per size): histogram deltas of 14, 15 and
        # 17 buckets held 0.9 MiB there on the 8-GPU node (issue 15)
        if len(self.cumulative) == len(base.cumulative):
            diff = tuple([*map(operator.sub, self.cumulative, base.cumulative)])
        else:
            diff = tuple([c - b for c, b in zip(self.cumulative, base.cumulative, strict=True)])
        if any(map(_NEGATIVE, diff)):
            return None
        s = None if self.sum is None or base.sum is None else self.sum - base.sum
        return HistogramSnapshot(self.bounds, diff, s)

    def below(self, base: HistogramSnapshot) -> bool:
        """True when :meth:`minus` gives ``None``: the layouts differ or a bucket went down.

        Answered without building the delta (a window's reset check, every scrape).
        """
        if base.bounds != self.bounds:
            return True
        if len(self.cumulative) == len(base.cumulative):
            return any(map(_ABOVE, base.cumulative, self.cumulative))
        return self.minus(base) is None

    def plus(self, other: HistogramSnapshot) -> HistogramSnapshot | None:
        """Return the bucket-wise sum (e.g. of two data-parallel ranks' window deltas).

        Returns:
            The summed histogram, or ``None`` when the bucket layouts differ.
        """
        if other.bounds != self.bounds:
            return None
        if len(self.cumulative) == len(other.cumulative):
            total = tuple([*map(operator.add, self.cumulative, other.cumulative)])
        else:
            total = tuple([a + b for a, b in zip(self.cumulative, other.cumulative, strict=True)])
        s = None if self.sum is None or other.sum is None else self.sum + other.sum
        return HistogramSnapshot(self.bounds, total, s)

    def zero(self) -> HistogramSnapshot:
        """An empty histogram with the same buckets."""
        return HistogramSnapshot(self.bounds, (0.0,) * len(self.bounds), 0.0)


_NEGATIVE: Final = (0.0).__gt__
"""``d < 0`` as a C-level callable (``False`` for NaN, as ``d < 0`` is)."""
_ABOVE: Final = operator.gt
"""``b > c``: a bucket went down from ``b`` to ``c`` exactly when ``c - b < 0`` (for the
finite or ``+inf`` non-negative counts of a snapshot: ``inf - inf`` is NaN, not below)."""

_LAYOUTS: dict[tuple[float, ...], tuple[float, ...] | None] = {}
_LAYOUTS_KEPT: Final = 4096


def _layout(bounds: tuple[float, ...]) -> tuple[float, ...] | None:
    """The one shared tuple of a bucket layout (``None`` unless strictly increasing to +Inf).

    Worked out once per layout (at most 4,096 kept); NaN bounds are never increasing.
    """
    try:
        return _LAYOUTS[bounds]
    except KeyError:
        pass
    ok = bool(bounds) and bounds[-1] == math.inf
    ok = ok and all(a < b for a, b in itertools.pairwise(bounds))
    if len(_LAYOUTS) >= _LAYOUTS_KEPT:
        _LAYOUTS.clear()
    got = _LAYOUTS[bounds] = bounds if ok else None
    return got


def histogram_quantile(
    q: float, bounds: Sequence[float], cumulative: Sequence[float]
) -> float | None:
    """Estimate the ``q`` quantile of a cumulative histogram, as Prometheus does.

    Args:
        q: the quantile, 0 <= q <= 1.
        bounds: bucket upper bounds, increasing, the last one ``+inf``.
        cumulative: cumulative counts per bound (non-decreasing).

    Returns:
        The estimate in the bounds' unit: linear interpolation inside the bucket that
        holds rank ``q * count``; the lowest bucket is taken to start at 0 when its
        upper bound is positive (else its upper bound is returned); a rank in the
        ``+Inf`` bucket returns the highest finite bound. ``None`` when ``q`` is outside
        [0, 1], the histogram is empty, has no ``+Inf`` bucket, or fewer than two
        buckets.
    """
    if not 0.0 <= q <= 1.0 or len(bounds) < 2 or len(bounds) != len(cumulative):
        return None
    if not math.isinf(bounds[-1]):
        return None
    total = cumulative[-1]
    if total <= 0:
        return None
    rank = q * total
    i = 0
    while i < len(cumulative) - 1 and cumulative[i] < rank:
        i += 1
    if i == len(bounds) - 1:
        return bounds[-2]
    upper = bounds[i]
    if i == 0:
        if upper <= 0:
            return upper
        lower, below = 0.0, 0.0
    else:
        lower, below = bounds[i - 1], cumulative[i - 1]
    in_bucket = cumulative[i] - below
    if in_bucket <= 0:
        return upper
    return lower + (upper - lower) * ((rank - below) / in_bucket)


@dataclass(frozen=True, slots=True)
class _Point:
    t: float
    snap: HistogramSnapshot


class WindowedHistogram:
    """A ring of snapshots of one cumulative histogram series, for windowed quantiles.

    Feed every scrape's snapshot to :meth:`update`; :meth:`window` returns the
    observations of the last ``window_s`` seconds. The first snapshot only opens the
    window (what happened before it is unknown), so a delta exists from the second
    snapshot on.

    Args:
        window_s: window length in seconds.
        max_snapshots: ring capacity; the oldest snapshots are dropped beyond it.
    """

    def __init__(self, window_s: float = DEFAULT_WINDOW_S, max_snapshots: int = MAX_SNAPSHOTS):
        self.window_s = window_s
        self._ring: deque[_Point] = deque(maxlen=max(2, max_snapshots))
        self.resets = 0
        """Resets seen (a bucket or the count went down, or the bucket layout changed)."""

    def update(self, t: float, snap: HistogramSnapshot) -> bool:
        """Add the snapshot taken at time ``t`` (monotonic seconds).

        Args:
            t: when the snapshot was taken; must not go backwards (an older ``t`` than
                the newest kept snapshot is ignored).
            snap: the cumulative histogram.

        Returns:
            True when the snapshot revealed a reset: the window then restarts from an
            all-zero baseline at the previous snapshot's time, so it holds only
            post-reset observations.
        """
        reset = False
        if self._ring:
            last = self._ring[-1]
            if t < last.t:
                return False
            if snap.below(last.snap):
                reset = True
                self.resets += 1
                self._ring.clear()
                self._ring.append(_Point(last.t, snap.zero()))
            elif snap == last.snap:
                # no observation since the last scrape: hold that snapshot again, not an
                # equal copy (a quiet engine's ring is then one snapshot, not 60 of ~20
                # floats each; issue 15, the node's memory)
                snap = last.snap
        self._ring.append(_Point(t, snap))
        self._expire(t)
        return reset

    def window(self, now: float | None = None) -> HistogramSnapshot | None:
        """The observations in the window: newest snapshot minus the window's baseline.

        Args:
            now: the current time; defaults to the newest snapshot's time. Snapshots are
                expired relative to it.

        Returns:
            The delta histogram, or ``None`` with fewer than two snapshots.
        """
        if now is not None:
            self._expire(now)
        if len(self._ring) < 2:
            return None
        return self._ring[-1].snap.minus(self._ring[0].snap)

    def quantile(
        self, q: float, min_count: float = DEFAULT_MIN_COUNT, now: float | None = None
    ) -> float | None:
        """The ``q`` quantile of the window's observations (see :func:`histogram_quantile`).

        Returns:
            ``None`` when there is no window yet or it holds fewer than ``min_count``
            observations.
        """
        return window_quantile(self.window(now), q, min_count)

    def _expire(self, now: float) -> None:
        # Keep exactly one snapshot at or before now - window_s: it is the baseline.
        cutoff = now - self.window_s
        while len(self._ring) >= 2 and self._ring[1].t <= cutoff:
            self._ring.popleft()


def window_quantile(
    delta: HistogramSnapshot | None, q: float, min_count: float = DEFAULT_MIN_COUNT
) -> float | None:
    """The ``q`` quantile of a window delta, or ``None`` when it is too sparse.

    Args:
        delta: the observations of a window (see :meth:`WindowedHistogram.window`).
        q: the quantile, 0-1.
        min_count: fewest observations for an answer.

    Returns:
        The estimate, or ``None`` when ``delta`` is ``None`` or holds fewer than
        ``min_count`` observations.
    """
    if delta is None or delta.count < max(min_count, 1e-12):
        return None
    return histogram_quantile(q, delta.bounds, delta.cumulative)


def sum_windows(deltas: Iterable[HistogramSnapshot | None]) -> HistogramSnapshot | None:
    """Sum window deltas of several series with the same buckets (e.g. DP ranks).

    Deltas whose bucket layout differs from the first one's are skipped.

    Returns:
        The sum, or ``None`` when no delta is given.
    """
    total: HistogramSnapshot | None = None
    for d in deltas:
        if d is None:
            continue
        if total is None:
            total = d
            continue
        summed = total.plus(d)
        if summed is not None:
            total = summed
    return total


# --- one bucket layout for aggregation ---------------------------------------------------------
#
# The OpenTelemetry GenAI semantic conventions ("Semantic conventions for generative AI
# metrics", https://opentelemetry.io/docs/specs/semconv/gen-ai/gen-ai-metrics/) advise the
# explicit bucket boundaries below for the model-server histograms. Engines each pick their
# own buckets (vLLM's inter-token buckets run to 80 s, SGLang's TTFT buckets differ from
# vLLM's, Triton's are in microseconds), and two histograms with different ``le`` sets cannot
# be summed by ``sum by (le)``; re-bucketed into these, every engine and instance can.

GENAI_TTFT_BOUNDS_S: Final = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
)  # fmt: skip
"""``gen_ai.server.time_to_first_token`` advisory bucket bounds (seconds)."""

GENAI_TPOT_BOUNDS_S: Final = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
)  # fmt: skip
"""``gen_ai.server.time_per_output_token`` advisory bucket bounds (seconds)."""

GENAI_REQUEST_DURATION_BOUNDS_S: Final = (
    0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92,
)  # fmt: skip
"""``gen_ai.server.request.duration`` advisory bucket bounds (seconds)."""

_BOUND_RTOL: Final = 1e-9
"""Relative tolerance when comparing an engine bound with a target bound (``100 ms *
1e-3`` is not exactly ``0.1`` in binary floating point)."""


def rebucket(snap: HistogramSnapshot, bounds: Sequence[float]) -> HistogramSnapshot:
    """Re-bucket a cumulative histogram into fixed upper ``bounds``, conservatively.

    Rule: the target bucket ``le=t`` counts the observations of every engine bucket whose
    upper bound is ``<= t`` (within a relative 1e-9), i.e. the engine's cumulative count at
    its largest bound not above ``t`` (0 when the engine has none). An engine bucket whose
    upper bound falls between two target bounds is thereby moved *up* to the next target
    bound, and one above the last finite target bound lands in ``+Inf``: a re-bucketed
    quantile is never lower than the engine's own buckets can justify (latency is never
    under-reported), at the price of at most one target bucket of over-estimate. Bounds
    shared by both layouts keep their exact counts; ``+Inf`` keeps the total.

    Args:
        snap: the engine's cumulative histogram (bounds in seconds, last ``+inf``).
        bounds: the target finite upper bounds, strictly increasing, in seconds.

    Returns:
        A snapshot with bounds ``(*bounds, +inf)``, the same count and ``_sum``.
    """
    target, zeros, take = _rebucket_plan(snap.bounds, tuple(bounds))
    cumulative = snap.cumulative
    out = (0.0,) * zeros + tuple([cumulative[i] for i in take]) + (snap.count,)
    return HistogramSnapshot(target, out, snap.sum)


@functools.lru_cache(maxsize=1024)
def _rebucket_plan(
    source: tuple[float, ...], bounds: tuple[float, ...]
) -> tuple[tuple[float, ...], int, tuple[int, ...]]:
    """How :func:`rebucket` maps one layout onto another, worked out once per pair.

    Returns:
        ``(target bounds with +inf, leading target buckets with no engine bound below them
        (0), engine bucket index read for each further finite target bound)``.
    """
    take: list[int] = []
    i = -1  # index of the largest engine bound <= the current target bound
    n = len(source)
    for t in bounds:
        while i + 1 < n and source[i + 1] <= t * (1.0 + _BOUND_RTOL):
            i += 1
        take.append(i)
    zeros = sum(1 for i in take if i < 0)
    return (*bounds, math.inf), zeros, tuple(take[zeros:])


class CumulativeHistogram:
    """Reset-aware re-export of one cumulative histogram series (fixed bucket layout).

    The exported histogram starts at the first snapshot seen and then grows by the
    observations between successive snapshots; when the engine restarts (any bucket or the
    count went down) the post-restart snapshot is added whole, so the export never goes
    down, like the counters re-exported by the engine normalizer.
    """

    def __init__(self) -> None:
        self._last: HistogramSnapshot | None = None
        self._total: HistogramSnapshot | None = None
        self.resets = 0
        """Engine resets seen."""

    @property
    def total(self) -> HistogramSnapshot | None:
        """The re-exported cumulative histogram, ``None`` before the first update."""
        return self._total

    def update(self, snap: HistogramSnapshot) -> bool:
        """Add the engine's newest cumulative snapshot.

        Args:
            snap: the engine's histogram, in the same bucket layout every time (re-bucket
                it with :func:`rebucket` first); a snapshot with another layout replaces
                the export (counted as a reset).

        Returns:
            True when the snapshot revealed a reset.
        """
        last, total = self._last, self._total
        self._last = snap
        if last is None or total is None:
            self._total = snap
            return False
        delta = snap.minus(last)
        reset = delta is None
        if delta is None:
            self.resets += 1
            delta = snap
        summed = total.plus(delta)
        self._total = summed if summed is not None else snap
        return reset
