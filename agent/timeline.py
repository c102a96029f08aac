"""The bounded in-memory timeline: a ring buffer of recent points per series.

The daemon appends every sampler batch here; attribution and the capacity planner read
windows back to see what each resource did over a request's lifetime: ``columns`` gives
each series' points as two ``array('d')`` (timestamps, values), ``window`` as ``(t, v)``
pairs.

Only what is read back is kept. Each derived stage that reads the timeline declares the
metric names it reads (:attr:`agent.pipeline.Sampler.timeline_reads`, registered with the
stage); the daemon keeps the union over the stages it runs (:meth:`Timeline.set_kept`) and
:meth:`Timeline.append` skips every other name (one set lookup per run of samples of one
name). A read of a name that is not kept raises :class:`NotKept`: a reader that forgot to
declare a name fails loudly instead of reading nothing. ``kept=None`` keeps every name
(tests, benchmarks).

Memory is bounded three ways besides:

* each series keeps at most ``points_per_series`` points (oldest dropped first), in
  ``array('d')`` buffers that grow as points arrive, so a series that was written once
  costs a few hundred bytes, not 16 KiB. A series its source writes at every report (a
  GPU's memory, an engine's counters) keeps only its values, 8 bytes a point, and reads
  its timestamps from the source's :class:`Clock`, one copy for all of them; any other
  series keeps its own (16 bytes a point);
* a series not written for ``forget_after_s`` (default 15 min: longer than any window read
  back) is forgotten (a vanished PID, engine or model);
* at most ``max_series`` series exist. At the cap a new series takes the place of the series
  written least recently, if that one has not been written for ``evict_after_s`` (it is a
  label value that went away, e.g. a churning ``model``); otherwise the new series' sample
  is dropped and counted in :attr:`Timeline.dropped_samples`. So a label that changes every
  scrape keeps memory bounded without blinding the agent to new engines, models or PIDs.

A full series costs 8 or 16 KiB (1,024 points); 20,000 full series 312.5 MiB at worst. What
a node keeps is printed by ``benchmarks/node_cost.py --timeline`` (the node's series through
the real samplers, every ring full).
"""

from __future__ import annotations

import threading
from array import array
from bisect import bisect_left, bisect_right
from collections.abc import Iterable, Mapping

from kvpressure.agent.samples import Labels, Sample

SeriesKey = tuple[str, Labels]
"""``(metric name, sorted label pairs)``."""


class NotKept(LookupError):
    """A metric name was read that no running stage declared it reads (so it is not kept).

    Declare it in the reading stage's ``timeline_reads`` (see the module doc).
    """


class Clock:
    """The timestamps of one source's reports, held once for every series it writes each time.

    A sampler writes most of its series at every report (a GPU's memory, an engine's gauges),
    all with the report's timestamp. Each such series then keeps only its values and reads
    its timestamps here: 8 bytes a point instead of 16. A series that misses one of the
    source's reports, is written twice in one, or by another source, is *detached* (given its
    own timestamps, :meth:`Ring.detach`) and is an ordinary ring from then on.

    Attributes:
        key: the source (the report's ``sampler``).
        capacity: reports whose timestamps are kept: ``points_per_series + 1`` (a member
            that missed the newest report still finds its oldest point's when detached).
        tick: index of the newest report recorded (``-1`` before the first).
        members: the rings that hold no timestamps of their own and read them here; each
            was written at every report from its first point to the newest.
        open: True while the timeline records one of the source's reports.
        written: members written in the report being recorded.
        ordered: False once a report's timestamp went back (readers then scan, not bisect).

    Not thread-safe on its own: the timeline's lock guards it.
    """

    __slots__ = (
        "_registry",
        "_ts",
        "capacity",
        "key",
        "members",
        "open",
        "ordered",
        "tick",
        "written",
    )

    def __init__(self, key: str, points_per_series: int, registry: dict[str, Clock]) -> None:
        self.key = key
        self._registry = registry  # the timeline's clocks: one leaves it with its last member
        self.capacity = points_per_series + 1
        self._ts = array("d")
        self.tick = -1
        self.ordered = True
        self.open = False
        self.written = 0
        self.members: set[Ring] = set()

    def advance(self, ts: float) -> None:
        """Record the next report, taken at ``ts`` (Unix seconds)."""
        self.tick += 1
        if self._ts and ts < self._ts[(self.tick - 1) % self.capacity]:
            self.ordered = False
        if len(self._ts) < self.capacity:
            self._ts.append(ts)
        else:
            self._ts[self.tick % self.capacity] = ts

    def leave(self, ring: Ring) -> None:
        """Take ``ring`` off the members.

        A clock left with none leaves its timeline, unless its report is being recorded
        (the timeline closes it after that).
        """
        self.members.discard(ring)
        if not self.members and not self.open:
            self._registry.pop(self.key, None)

    def span(self, first: int, n: int) -> array[float]:
        """The timestamps of the ``n`` reports from tick ``first`` on, oldest first."""
        size = len(self._ts)
        i = first % size
        if i + n <= size:
            return self._ts[i : i + n]
        return self._ts[i:] + self._ts[: n - (size - i)]


class Ring:
    """A ring of at most ``capacity`` ``(timestamp, value)`` points, oldest overwritten first.

    The buffers grow with the points (``array.append``) until ``capacity``; then the ring
    overwrites its oldest point. A ring made with a :class:`Clock` keeps only its values and
    reads its timestamps from the clock while it is one of the clock's members (see there).

    Attributes:
        capacity: the most points kept.
    """

    __slots__ = (
        "_clock",
        "_n",
        "_next",
        "_ordered",
        "_tick",
        "_ts",
        "_vs",
        "capacity",
        "last_ts",
    )

    def __init__(self, capacity: int, clock: Clock | None = None) -> None:
        self.capacity = capacity
        self._ts: array[float] | None = None if clock is not None else array("d")
        self._vs = array("d")
        self._next = 0
        self._n = 0
        self._ordered = True  # timestamps never went backwards: points() can bisect
        self._clock = clock
        # with a clock: the tick of the newest point (the one before the current tick
        # until the first write, so that write continues the run)
        self._tick = 0
        if clock is not None:
            self._tick = clock.tick - 1
            clock.members.add(self)
        self.last_ts = float("-inf")
        """Timestamp of the newest point (Unix seconds); ``-inf`` while empty."""

    def append(self, ts: float, value: float) -> None:
        """Add a point; ``ts`` is Unix time in seconds and should not go backwards.

        A member of a clock that is open for ``ts``'s report and whose newest point is the
        clock's previous report only stores the value; any other member is detached first.
        """
        clock = self._clock
        if clock is not None:
            if not (clock.open and self._tick == clock.tick - 1):
                self.detach()
            else:
                self._tick = clock.tick
                clock.written += 1
        ts_ = self._ts  # None while on a clock: the clock holds the timestamp
        if ts_ is not None and ts < self.last_ts:
            self._ordered = False  # a clock step back: points() scans (until reordered)
        self.last_ts = ts
        if self._n < self.capacity:
            if ts_ is not None:
                ts_.append(ts)
            self._vs.append(value)
            self._n += 1
            self._next = self._n % self.capacity
            return
        i = self._next
        if ts_ is not None:
            ts_[i] = ts
        self._vs[i] = value
        self._next = (i + 1) % self.capacity

    def detach(self) -> None:
        """Leave the clock: hold this ring's own timestamps from now on (no-op without one)."""
        clock = self._clock
        if clock is None:
            return
        ts, vs = self.columns()
        if clock.open and self._tick == clock.tick:
            clock.written -= 1  # it no longer counts among the members written this report
        clock.leave(self)
        self._clock = None
        self._ts, self._vs = ts, vs
        self._n = len(ts)
        self._next = self._n % self.capacity
        self._ordered = all(a <= b for a, b in zip(self._ts, self._ts[1:], strict=False))

    @property
    def clocked(self) -> bool:
        """True while the ring reads its timestamps from a clock."""
        return self._clock is not None

    def __len__(self) -> int:
        return self._n

    def points(
        self, start: float = float("-inf"), end: float = float("inf")
    ) -> list[tuple[float, float]]:
        """Return the points with ``start <= ts <= end``, oldest first (see :meth:`columns`)."""
        ts, vs = self.columns(start, end)
        return list(zip(ts, vs, strict=True))

    def columns(
        self, start: float = float("-inf"), end: float = float("inf")
    ) -> tuple[array[float], array[float]]:
        """Return the points with ``start <= ts <= end`` as two columns, oldest first.

        Returns:
            ``(timestamps, values)``: two new ``array('d')`` of equal length (Unix seconds,
            values); no Python object per point, so a reader that indexes or bisects them
            (attribution's :class:`~agent.attribution.signals.Series`) allocates two
            buffers per series, not two floats and a tuple per point.

        Cost: two binary searches and a slice per contiguous part of the ring (at most
        two) while timestamps only went forward; a scan of every point otherwise. A ring
        on a clock first copies its span of the clock's timestamps (``memcpy``).
        """
        n = self._n
        if not n:
            return array("d"), array("d")
        vs = self._vs
        size = len(vs)
        first = (self._next - n) % size
        clock = self._clock
        if clock is not None:
            ts = clock.span(self._tick - n + 1, n)
            if first:
                vs = vs[first:] + vs[:first]
            first, size, ordered = 0, n, clock.ordered
        else:
            assert self._ts is not None
            ts, ordered = self._ts, self._ordered
        if not ordered:
            keep = [(first + k) % size for k in range(n)]
            keep = [i for i in keep if start <= ts[i] <= end]
            return array("d", [ts[i] for i in keep]), array("d", [vs[i] for i in keep])
        parts = [(first, size), (0, first)] if first else [(0, size)]
        out_ts: array[float] | None = None
        out_vs = array("d")
        for lo, hi in parts:
            a = bisect_left(ts, start, lo, hi)
            b = bisect_right(ts, end, a, hi)
            if a < b:
                if out_ts is None:
                    out_ts, out_vs = ts[a:b], vs[a:b]
                else:
                    out_ts += ts[a:b]
                    out_vs += vs[a:b]
        return (out_ts if out_ts is not None else array("d")), out_vs

    def last(self) -> tuple[float, float] | None:
        """Return the newest point, or ``None`` when empty."""
        if self._n == 0:
            return None
        return self.last_ts, self._vs[(self._next - 1) % len(self._vs)]


class Timeline:
    """Recent history of every series the samplers produced.

    Thread-safe: samplers' worker threads append while readers take windows.

    Args:
        points_per_series: ring capacity of each series.
        max_series: the most series held (see the module doc for what happens at the cap).
        forget_after_s: seconds after its last write that a series is forgotten.
        evict_after_s: seconds without a write after which a series may give its place to
            a new one when the cap is reached.
        kept: the metric names to keep (the readers' declared reads); ``None`` keeps every
            name. Changed later with :meth:`set_kept`.

    Attributes:
        dropped_samples: samples of new series dropped at the cap, since start.
        evicted_series: series forgotten to admit new ones at the cap, since start.
        forgotten_series: series forgotten after ``forget_after_s``, since start.
    """

    def __init__(
        self,
        points_per_series: int = 1024,
        max_series: int = 20000,
        forget_after_s: float = 900.0,
        evict_after_s: float = 10.0,
        kept: Iterable[str] | None = None,
    ) -> None:
        self.points_per_series = points_per_series
        self.max_series = max_series
        self.forget_after_s = forget_after_s
        self.evict_after_s = evict_after_s
        self._series: dict[SeriesKey, Ring] = {}
        self._by_name: dict[str, dict[Labels, Ring]] = {}  # the same rings, by metric name
        # Series by the time they were last *filed* here, oldest first (insertion order).
        # A write does not move its series (that was two dict operations and two hashes of
        # the labels per sample); the ring knows its own last write (``Ring.last_ts``), and
        # whoever reads the front for the least recently written series (forgetting,
        # eviction) re-files, at the end, each front entry written since it was filed. So
        # an entry moves at most once per reading, and only when a reader needs it.
        self._written: dict[SeriesKey, float] = {}
        self._clocks: dict[str, Clock] = {}
        self._lock = threading.Lock()
        self._last_sweep = float("-inf")
        self.dropped_samples = 0
        self.evicted_series = 0
        self.forgotten_series = 0
        self._kept: frozenset[str] | None = None if kept is None else frozenset(kept)

    @property
    def kept(self) -> frozenset[str] | None:
        """The metric names kept; ``None`` when every name is."""
        return self._kept

    def set_kept(self, names: Iterable[str] | None) -> int:
        """Keep only the series of ``names`` from now on (``None``: every name).

        Series held of a name no longer kept are dropped at once (their memory is freed); a
        newly kept name has its series from its next sample on.

        Returns:
            The number of series dropped.
        """
        kept = None if names is None else frozenset(names)
        with self._lock:
            self._kept = kept
            if kept is None:
                return 0
            gone = [key for key in self._series if key[0] not in kept]
            for key in gone:
                del self._written[key]
                self._drop(key)
            return len(gone)

    def append(self, ts: float, samples: Iterable[Sample], clock: str | None = None) -> None:
        """Record ``samples`` taken at Unix time ``ts`` (seconds); names not kept are skipped.

        A batch holds each metric's samples one after another, so whether a name is kept is
        looked up once per run of samples sharing one name object (a sampler passes the same
        ``str`` for every sample of a family), not per sample.

        Args:
            ts: when the samples were taken, Unix seconds.
            samples: the samples.
            clock: the source of the report (its ``sampler``), or ``None``. The series a
                source writes at each of its reports share one copy of their timestamps
                (:class:`Clock`); with ``None`` every series holds its own.
        """
        name: str | None = None
        skip = False
        with self._lock:
            kept = self._kept
            if ts - self._last_sweep >= min(60.0, self.forget_after_s):
                self._last_sweep = ts
                self.forgotten_series += self._forget(ts - self.forget_after_s)
            clk = None
            if clock is not None:
                clk = self._clocks.get(clock)
                if clk is None:
                    clk = self._clocks[clock] = Clock(clock, self.points_per_series, self._clocks)
                clk.advance(ts)
                clk.open = True
            series = self._series
            try:
                for s in samples:
                    if s.name is not name:
                        name = s.name
                        skip = kept is not None and name not in kept
                    if skip:
                        continue
                    key = (s.name, s.labels)
                    ring = series.get(key)
                    if ring is None:
                        if len(series) >= self.max_series and not self._evict_one(ts):
                            self.dropped_samples += 1
                            continue
                        ring = Ring(self.points_per_series, clk)
                        series[key] = ring
                        self._by_name.setdefault(s.name, {})[s.labels] = ring
                        self._written[key] = ts
                    ring.append(ts, s.value)
            finally:
                if clk is not None:
                    clk.open = False
                    self._close(clk)

    def _close(self, clock: Clock) -> None:
        """End a report of ``clock``'s source: detach the members it did not write."""
        if clock.written != len(clock.members):
            for ring in [r for r in clock.members if r._tick != clock.tick]:
                ring.detach()
        clock.written = 0
        if not clock.members:
            self._clocks.pop(clock.key, None)

    def _oldest(self) -> tuple[SeriesKey, float] | None:
        """The series written least recently and its last write; ``None`` when empty.

        Re-files at the end every front entry whose ring was written after it was filed,
        until the front entry's filing time is its last write (every later entry was filed
        no earlier, and written no earlier than filed).
        """
        written = self._written
        while written:
            key = next(iter(written))
            last = self._series[key].last_ts
            if last <= written[key]:
                return key, written[key]
            del written[key]
            written[key] = last
        return None

    def _evict_one(self, now: float) -> bool:
        oldest = self._oldest()
        if oldest is None or now - oldest[1] < self.evict_after_s:
            return False
        del self._written[oldest[0]]
        self._drop(oldest[0])
        self.evicted_series += 1
        return True

    def _forget(self, older_than: float) -> int:
        n = 0
        while (oldest := self._oldest()) is not None and oldest[1] < older_than:
            del self._written[oldest[0]]
            self._drop(oldest[0])
            n += 1
        return n

    def _drop(self, key: SeriesKey) -> None:
        ring = self._series.pop(key)
        if ring._clock is not None:
            ring._clock.leave(ring)
        same = self._by_name[key[0]]
        del same[key[1]]
        if not same:
            del self._by_name[key[0]]

    def __len__(self) -> int:
        with self._lock:
            return len(self._series)

    def names(self) -> set[str]:
        """The metric names that have series held now."""
        with self._lock:
            return set(self._by_name)

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

        Raises:
            NotKept: ``name`` is not kept (no running stage declared it reads it).
        """
        return {
            labels: list(zip(ts, vs, strict=True))
            for labels, (ts, vs) in self.columns(name, start, end, match).items()
        }

    def columns(
        self,
        name: str,
        start: float = float("-inf"),
        end: float = float("inf"),
        match: Mapping[str, str] | None = None,
    ) -> dict[Labels, tuple[array[float], array[float]]]:
        """:meth:`window` as columns: label set to ``(timestamps, values)`` arrays.

        The same series and points as :meth:`window`, each as two ``array('d')`` of equal
        length (see :meth:`Ring.columns`); series with no point in the range are left out.

        Raises:
            NotKept: ``name`` is not kept (no running stage declared it reads it).
        """
        kept = self._kept
        if kept is not None and name not in kept:
            raise NotKept(
                f"timeline: {name!r} is not kept; add it to the reading stage's timeline_reads"
            )
        want = tuple((match or {}).items())
        out: dict[Labels, tuple[array[float], array[float]]] = {}
        with self._lock:
            for labels, ring in self._by_name.get(name, {}).items():
                if want:
                    ld = dict(labels)
                    if any(ld.get(k) != v for k, v in want):
                        continue
                cols = ring.columns(start, end)
                if cols[0]:
                    out[labels] = cols
        return out

    def forget(self, older_than: float) -> int:
        """Drop series last written before ``older_than`` (Unix seconds).

        :meth:`append` does this by itself every minute with ``forget_after_s``.

        Returns:
            The number of series dropped (vanished label sets: dead PIDs, removed engines).
        """
        with self._lock:
            n = self._forget(older_than)
            self.forgotten_series += n
            return n
