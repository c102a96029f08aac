"""The bounded in-memory timeline: a ring buffer of recent points per series.

The daemon appends every sampler batch here; attribution and the capacity planner read
windows back (``window``) to see what each resource did over a request's lifetime. Memory
is bounded twice: each series keeps at most ``points_per_series`` points (oldest dropped
first), and at most ``max_series`` series exist; samples for new series beyond the cap are
dropped and counted in :attr:`Timeline.dropped_samples`.

Points are stored in two fixed-size ``array('d')`` buffers per series (16 bytes a point), so
10,000 series x 1,024 points costs about 160 MiB at worst and a typical single-engine host
(about 200 series) about 3 MiB.
"""

from __future__ import annotations

import threading
from array import array
from collections.abc import Iterable, Mapping

from agent.samples import Labels, Sample

SeriesKey = tuple[str, Labels]
"""``(metric name, sorted label pairs)``."""


class Ring:
    """A fixed-capacity ring of ``(timestamp, value)`` points, oldest overwritten first.

    Attributes:
        capacity: the most points kept.
    """

    __slots__ = ("_n", "_next", "_ts", "_vs", "capacity")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._ts = array("d", bytes(8 * capacity))
        self._vs = array("d", bytes(8 * capacity))
        self._next = 0
        self._n = 0

    def append(self, ts: float, value: float) -> None:
        """Add a point; ``ts`` is Unix time in seconds and should not go backwards."""
        i = self._next
        self._ts[i] = ts
        self._vs[i] = value
        self._next = (i + 1) % self.capacity
        if self._n < self.capacity:
            self._n += 1

    def __len__(self) -> int:
        return self._n

    def points(
        self, start: float = float("-inf"), end: float = float("inf")
    ) -> list[tuple[float, float]]:
        """Return the points with ``start <= ts <= end``, oldest first."""
        first = (self._next - self._n) % self.capacity
        out: list[tuple[float, float]] = []
        for k in range(self._n):
            i = (first + k) % self.capacity
            t = self._ts[i]
            if start <= t <= end:
                out.append((t, self._vs[i]))
        return out

    def last(self) -> tuple[float, float] | None:
        """Return the newest point, or ``None`` when empty."""
        if self._n == 0:
            return None
        i = (self._next - 1) % self.capacity
        return self._ts[i], self._vs[i]


class Timeline:
    """Recent history of every series the samplers produced.

    Thread-safe: samplers' worker threads append while readers take windows.

    Args:
        points_per_series: ring capacity of each series.
        max_series: the most series held; new series beyond it are dropped and counted.
    """

    def __init__(self, points_per_series: int = 1024, max_series: int = 20000) -> None:
        self.points_per_series = points_per_series
        self.max_series = max_series
        self._series: dict[SeriesKey, Ring] = {}
        self._lock = threading.Lock()
        self.dropped_samples = 0

    def append(self, ts: float, samples: Iterable[Sample]) -> None:
        """Record ``samples`` taken at Unix time ``ts`` (seconds)."""
        with self._lock:
            for s in samples:
                key = (s.name, s.labels)
                ring = self._series.get(key)
                if ring is None:
                    if len(self._series) >= self.max_series:
                        self.dropped_samples += 1
                        continue
                    ring = Ring(self.points_per_series)
                    self._series[key] = ring
                ring.append(ts, s.value)

    def __len__(self) -> int:
        with self._lock:
            return len(self._series)

    def window(
        self,
        name: str,
        start: float = float("-inf"),
        end: float = float("inf"),
        match: Mapping[str, str] | None = None,
    ) -> dict[Labels, list[tuple[float, float]]]:
        """Return the points of every series of ``name`` whose labels include ``match``.

        Args:
            name: catalogue metric name.
            start: earliest Unix time (seconds), inclusive.
            end: latest Unix time (seconds), inclusive.
            match: label values the series must carry, e.g. ``{"engine": "vllm"}``.

        Returns:
            Label set to its points ``[(ts, value), ...]``, oldest first; series with no
            point in the range are left out.
        """
        want = tuple((match or {}).items())
        out: dict[Labels, list[tuple[float, float]]] = {}
        with self._lock:
            for (n, labels), ring in self._series.items():
                if n != name:
                    continue
                ld = dict(labels)
                if any(ld.get(k) != v for k, v in want):
                    continue
                pts = ring.points(start, end)
                if pts:
                    out[labels] = pts
        return out

    def forget(self, older_than: float) -> int:
        """Drop series whose newest point is older than ``older_than`` (Unix seconds).

        Returns:
            The number of series dropped (vanished label sets: dead PIDs, removed engines).
        """
        with self._lock:
            stale = [k for k, r in self._series.items() if (r.last() or (0.0, 0.0))[0] < older_than]
            for k in stale:
                del self._series[k]
        return len(stale)
