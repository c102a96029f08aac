"""A read-only view of the timeline for one attribution pass, with counter and gauge math.

One pass (one attribution sampler cycle) reads each metric it needs from the timeline once,
over the union of all the intervals it will look at, and then answers many small queries
("the rate of this counter over this request's lifetime") by binary search. Reading the
timeline per request would cost one scan of every series per metric per request.

Counter semantics follow Prometheus: a counter that goes down was reset, and the delta over
the reset is the new value (never negative, case 22). Gauge semantics: a value holds until
the next sample, so a gauge with no point inside an interval contributes the last point
before it.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

from kvpressure.agent.catalogue import SampleName
from kvpressure.agent.timeline import Timeline


@dataclass(frozen=True, slots=True)
class Series:
    """The points of one series: times (Unix seconds, ascending) and values.

    ``ts`` and ``vs`` are equal-length sequences: ``array('d')`` columns as the timeline
    gives them (:meth:`agent.timeline.Timeline.columns`), or tuples (tests).
    """

    labels: Mapping[str, str]
    ts: Sequence[float]
    vs: Sequence[float]

    def between(self, a: float, b: float, hold: bool = False) -> list[tuple[float, float]]:
        """Return the points with ``a <= t <= b``.

        Args:
            a: start, Unix seconds.
            b: end, Unix seconds.
            hold: also return the last point before ``a`` when no point is inside (a
                gauge's value holds until its next sample).
        """
        i = bisect.bisect_left(self.ts, a)
        j = bisect.bisect_right(self.ts, b)
        if i < j:
            return list(zip(self.ts[i:j], self.vs[i:j], strict=True))
        if hold and i > 0:
            return [(self.ts[i - 1], self.vs[i - 1])]
        return []

    def increase(self, a: float, b: float) -> tuple[float, float] | None:
        """Return ``(increase, seconds)`` of this counter over ``[a, b]``, reset-aware.

        The interval is widened to sample boundaries: from the last point at or before
        ``a`` (else the first point after it) to the first point at or after ``b`` (else
        the last point). A counter sampled every second thus reports the increase over the
        sampling intervals that overlap ``[a, b]``.

        Returns:
            ``None`` when fewer than two points bracket the interval.
        """
        ts = self.ts
        if not ts:
            return None
        i = bisect.bisect_right(ts, a) - 1
        i = max(i, 0)
        if ts[i] > b:
            return None
        j = bisect.bisect_left(ts, b)
        if j >= len(ts):
            j = len(ts) - 1
        if j <= i:
            return None
        inc = 0.0
        prev = self.vs[i]
        for k in range(i + 1, j + 1):
            v = self.vs[k]
            inc += v - prev if v >= prev else v
            prev = v
        return inc, ts[j] - ts[i]

    def rate(self, a: float, b: float) -> float | None:
        """Return the per-second rate of this counter over ``[a, b]`` (see :meth:`increase`)."""
        got = self.increase(a, b)
        if got is None or got[1] <= 0:
            return None
        return got[0] / got[1]

    def increase_events(self, a: float, b: float) -> list[tuple[float, float]]:
        """Return ``(t, delta)`` for every sample in ``(a, b]`` where this counter rose.

        A reset (value went down) counts as a rise by the new value.
        """
        out: list[tuple[float, float]] = []
        i = bisect.bisect_right(self.ts, a)
        j = bisect.bisect_right(self.ts, b)
        for k in range(max(i, 1), j):
            prev, v = self.vs[k - 1], self.vs[k]
            d = v - prev if v >= prev else v
            if d > 0:
                out.append((self.ts[k], d))
        return out


def _matches(labels: Mapping[str, str], match: Mapping[str, str] | None) -> bool:
    return match is None or all(labels.get(k) == v for k, v in match.items())


class Signals:
    """Metric series read from the timeline for one attribution pass.

    Args:
        data: metric name to its series.
    """

    def __init__(self, data: Mapping[str, list[Series]]) -> None:
        self._data = data

    @classmethod
    def from_timeline(
        cls,
        timeline: Timeline,
        names: Iterable[str],
        start: float,
        end: float,
        extended: Mapping[str, float] | None = None,
    ) -> Signals:
        """Read ``names`` from ``timeline`` over ``[start, end]``.

        Args:
            timeline: the agent's timeline.
            names: metric names to read.
            start: earliest Unix time needed (include the look-back before lead-ins).
            end: latest Unix time needed.
            extended: per-metric earlier start (e.g. a baseline that looks further back).
        """
        data: dict[str, list[Series]] = {}
        for name in names:
            s = (extended or {}).get(name, start)
            got = timeline.columns(name, s, end)
            data[name] = [Series(dict(labels), ts, vs) for labels, (ts, vs) in got.items()]
        return cls(data)

    @classmethod
    def from_points(
        cls, points: Mapping[str, Mapping[tuple[tuple[str, str], ...], list[tuple[float, float]]]]
    ) -> Signals:
        """Build from ``{name: {labels: [(t, v), ...]}}`` (tests, synthetic timelines)."""
        data: dict[str, list[Series]] = {}
        for name, series in points.items():
            data[name] = [
                Series(
                    dict(labels),
                    tuple(t for t, _ in sorted(pts)),
                    tuple(v for _, v in sorted(pts)),
                )
                for labels, pts in series.items()
            ]
        return cls(data)

    def names(self) -> list[str]:
        """Metric names held."""
        return list(self._data)

    def series(self, name: SampleName, match: Mapping[str, str] | None = None) -> Iterator[Series]:
        """Yield the series of ``name`` whose labels include ``match``."""
        for s in self._data.get(name, ()):
            if _matches(s.labels, match):
                yield s

    def has(self, name: SampleName, match: Mapping[str, str] | None = None) -> bool:
        """True when at least one series of ``name`` matches."""
        return any(True for _ in self.series(name, match))

    # --- gauges ----------------------------------------------------------------------------

    def gauge_values(
        self, name: SampleName, a: float, b: float, match: Mapping[str, str] | None = None
    ) -> list[float]:
        """All values of matching series in ``[a, b]`` (held values included)."""
        out: list[float] = []
        for s in self.series(name, match):
            out.extend(v for _, v in s.between(a, b, hold=True))
        return out

    def gauge_max(
        self, name: SampleName, a: float, b: float, match: Mapping[str, str] | None = None
    ) -> float | None:
        """Largest value of matching series over ``[a, b]``; ``None`` when there is none."""
        vals = self.gauge_values(name, a, b, match)
        return max(vals) if vals else None

    def gauge_min(
        self, name: SampleName, a: float, b: float, match: Mapping[str, str] | None = None
    ) -> float | None:
        """Smallest value of matching series over ``[a, b]``; ``None`` when there is none."""
        vals = self.gauge_values(name, a, b, match)
        return min(vals) if vals else None

    def gauge_by_time(
        self, name: SampleName, a: float, b: float, match: Mapping[str, str] | None = None
    ) -> dict[float, float]:
        """Sample time to the sum of matching series' values at that time over ``[a, b]``.

        Samples of one sampler cycle share a timestamp, so values of several gauges read by
        the same sampler can be joined on it.
        """
        out: dict[float, float] = {}
        for s in self.series(name, match):
            for t, v in s.between(a, b, hold=True):
                out[t] = out.get(t, 0.0) + v
        return out

    # --- counters --------------------------------------------------------------------------

    def counter_rate(
        self, name: SampleName, a: float, b: float, match: Mapping[str, str] | None = None
    ) -> float | None:
        """Sum over matching series of their per-second rate over ``[a, b]``.

        ``None`` when no matching series has two points around the interval.
        """
        total: float | None = None
        for s in self.series(name, match):
            r = s.rate(a, b)
            if r is not None:
                total = r if total is None else total + r
        return total

    def counter_rate_max(
        self, name: SampleName, a: float, b: float, match: Mapping[str, str] | None = None
    ) -> tuple[float, Mapping[str, str]] | None:
        """The largest per-series rate over ``[a, b]`` and that series' labels."""
        best: tuple[float, Mapping[str, str]] | None = None
        for s in self.series(name, match):
            r = s.rate(a, b)
            if r is not None and (best is None or r > best[0]):
                best = (r, s.labels)
        return best

    def counter_increase(
        self, name: SampleName, a: float, b: float, match: Mapping[str, str] | None = None
    ) -> float | None:
        """Sum over matching series of their increase over ``[a, b]``."""
        total: float | None = None
        for s in self.series(name, match):
            got = s.increase(a, b)
            if got is not None:
                total = got[0] if total is None else total + got[0]
        return total
