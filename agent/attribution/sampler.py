"""The attribution sampler: judges finished requests, attributes the slow ones and each window.

It runs as a derived sampler named ``attribution`` on the daemon's schedule. Each cycle:

1. drains its consumer queue of the daemon's :class:`~agent.requests.record.RequestStream`
   and holds back records that ended less than ``settle_s`` ago (the samplers have not yet
   taken the sample that covers the request's end), and, up to
   :data:`HOLD_FOR_NEIGHBOURS_S`, records of an engine that ran more requests beside them
   than the agent has records of (a long prompt that held a short request up ends after
   its own decode, often long after the short one);
2. judges every phase of every ready record (:class:`~agent.attribution.detector.
   SlowDetector`), with the engine's mean batch size over the record's decode
   (``kvpressure_engine_requests_running``, unless its statistics were stale) as the size
   the decode cost is fitted against, and the engine's other known records that overlapped
   it (settled or pending: the same candidates as for a blocking prefill below) as the
   co-scheduled work its phases' expected cost includes;
3. reads the timeline once over the union of the scopes it needs
   (:class:`~agent.attribution.signals.Signals`), attributes every slow request
   (:class:`~agent.attribution.engine.Attributor`) over the span of its slow phases, with
   the engine's other recent records (at most ``MAX_NEIGHBOURS``, the last
   ``NEIGHBOUR_HORIZON_S``) as candidates for a blocking prefill, keeps it in the
   :class:`~agent.attribution.store.AttributionStore` and hands it to the span sink (the
   OTLP exporter's ``kvpressure.attribution`` spans);
4. attributes every window (default 10 s, aligned to multiples of the length) that ended at
   least ``settle_s`` ago, for every engine that has requests or engine metrics;
5. emits ``kvpressure_slow_requests_total{engine,cause}`` and
   ``kvpressure_attribution_score{engine,cause}`` (the latest window's scores).

Bounded: at most ``max_per_cycle`` records are judged per cycle (the rest wait in a pending
queue of at most ``max_pending``; overflow is dropped oldest first and counted in
``kvpressure_attribution_dropped_records_total``).
"""

from __future__ import annotations

import bisect
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from typing import NamedTuple, Protocol

from kvpressure.agent.attribution.detector import SlowDetector, Verdict
from kvpressure.agent.attribution.engine import Attributor
from kvpressure.agent.attribution.model import ALL_CAUSES, CAUSES, UNKNOWN, Attribution
from kvpressure.agent.attribution.rules import ENGINE_UP, LONG_LOOKBACK, METRICS_READ
from kvpressure.agent.attribution.signals import Series, Signals
from kvpressure.agent.attribution.store import AttributionStore, RequestSummary
from kvpressure.agent.catalogue import SampleName
from kvpressure.agent.pipeline import Sampler
from kvpressure.agent.requests.record import RequestRecord, RequestStream
from kvpressure.agent.samples import Batch
from kvpressure.agent.timeline import Timeline

log = logging.getLogger(__name__)

ENGINE_LATENCY: SampleName = "kvpressure_engine_latency_seconds"
"""Engine-reported windowed latency quantiles, used for windows without request records."""

MAX_WINDOWS_PER_CYCLE = 6
"""Windows attributed per engine per cycle at most; older due windows are skipped."""

MAX_NEIGHBOURS = 4096
"""Recent records kept (all engines) as candidates for another request's blocking prefill."""

NEIGHBOUR_HORIZON_S = 600.0
"""Records that ended longer ago than this are no candidate blockers."""

NEIGHBOUR_AFTER_S = 60.0
"""A record that ended more than this after another is not looked at as its neighbour (the
scan over the known records, sorted by end, stops there): bounds the work per record."""

HOLD_FOR_NEIGHBOURS_S = 30.0
"""A settled record waits at most this long after its end for the records of requests that
were running beside it and have not finished (:meth:`AttributionSampler._unseen_in_flight`)."""

RUNNING: SampleName = "kvpressure_engine_requests_running"
STATS_STALE: SampleName = "kvpressure_engine_stats_stale"
PREEMPTIONS: SampleName = "kvpressure_engine_preemptions_total"
FINISHED: SampleName = "kvpressure_engine_finished_requests_total"
FINISHED_PREEMPTIONS: SampleName = "kvpressure_engine_finished_requests_preemptions_total"

TIMELINE_READS: frozenset[str] = frozenset(
    (*METRICS_READ, ENGINE_LATENCY, ENGINE_UP, RUNNING, STATS_STALE, PREEMPTIONS, FINISHED,
     FINISHED_PREEMPTIONS)
)  # fmt: skip
"""Every metric :class:`AttributionSampler` reads back from the timeline: the rules'
(:data:`~agent.attribution.rules.METRICS_READ`), the engines' tail latency quantiles, the
engines seen up (which engines get windows), and what the sampler itself reads to hold,
size and count requests (running, stale, preemptions, finished requests). The timeline keeps
these for it while attribution is enabled (:mod:`agent.pipeline`)."""

OWN_PREEMPTIONS_MARGIN_S = 0.1
"""A record's end must lie at least this far from both engine samples around it before the
finished-request counters between them are read as its own (the engine counts a request
when it finishes, at nearly the time its record ends; a scrape in that instant could count
it on either side)."""

OWN_PREEMPTIONS_WAIT_S = 5.0
"""A settled record of an engine that reports its finished requests' preemptions waits at
most this long after its end for the engine sample after it (the full scrape that counts
it, typically 1 s later), so its own preemptions can be read (:meth:`AttributionSampler.
_uncounted`)."""

OWN_PREEMPTIONS_LOOKBACK_S = 30.0
"""How far before the earliest ready record's end the finished-request counters are read
(covers any engine scrape interval)."""


class OwnPreemptions(NamedTuple):
    """What the engine says of one finished request's preemptions.

    Source: vLLM's ``request_num_preemptions``, read by
    :meth:`AttributionSampler._own_preemptions`.

    Attributes:
        own: how many times it was preempted; ``None`` when unknown.
        shared: when ``own`` is unknown, the preemptions of the requests that finished with
            it between two engine samples, all of them known records (this one included);
            0 when none or not known.
    """

    own: int | None
    shared: int


UNKNOWN_PREEMPTIONS = OwnPreemptions(None, 0)


def _tail_quantile(labels: Mapping[str, str]) -> bool:
    """True for a latency-quantile series at the 0.95 quantile or above."""
    q = labels.get("quantile", labels.get("q"))
    try:
        return q is not None and float(q) >= 0.95
    except ValueError:
        return False


def _around(
    counts: Iterable[Series],
    totals: Mapping[tuple[tuple[str, str], ...], Series],
    t: float,
) -> tuple[float, float, float, float] | None:
    """The engine samples around ``t`` and the two counters' increases between them.

    Args:
        counts: the engine's ``kvpressure_engine_finished_requests_total`` series.
        totals: its ``..._preemptions_total`` series by their sorted labels.
        t: a record's end, Unix seconds.

    Returns:
        ``(a, b, finished, preemptions)``: the last sample time before ``t`` and the first
        after it, each at least :data:`OWN_PREEMPTIONS_MARGIN_S` away, same in every
        series, and the increases summed over the series; ``None`` when a series has no
        such pair, the pairs differ, or a counter went down.
    """
    pair: tuple[float, float] | None = None
    finished = preemptions = 0.0
    seen = False
    for c in counts:
        p = totals.get(tuple(sorted(c.labels.items())))
        if p is None:
            return None
        k = bisect.bisect_right(c.ts, t)
        if k == 0 or k >= len(c.ts):
            return None
        a, b = c.ts[k - 1], c.ts[k]
        if t - a < OWN_PREEMPTIONS_MARGIN_S or b - t < OWN_PREEMPTIONS_MARGIN_S:
            return None
        if pair is not None and pair != (a, b):
            return None
        pair = (a, b)
        j = bisect.bisect_left(p.ts, b)
        if j == 0 or j >= len(p.ts) or p.ts[j] != b or p.ts[j - 1] != a:
            return None
        dc, dp = c.vs[k] - c.vs[k - 1], p.vs[j] - p.vs[j - 1]
        if dc < 0 or dp < 0:
            return None
        finished += dc
        preemptions += dp
        seen = True
    if not seen or pair is None:
        return None
    return pair[0], pair[1], finished, preemptions


def _last_in(
    sig: Signals, name: SampleName, a: float, b: float, match: Mapping[str, str]
) -> tuple[float, float] | None:
    """The latest sample of the matching series of ``name`` in ``[a, b]``, summed.

    Returns:
        ``(t, sum)``: the latest sample time in ``[a, b]`` over the series and the sum of
        each series' latest value in ``[a, b]``; ``None`` when no series has a sample
        there. One binary search per series.
    """
    t = -math.inf
    total = 0.0
    seen = False
    for s in sig.series(name, match):
        i = bisect.bisect_right(s.ts, b) - 1
        if i >= 0 and s.ts[i] >= a:
            t = max(t, s.ts[i])
            total += s.vs[i]
            seen = True
    return (t, total) if seen else None


def _first_in(
    sig: Signals, name: SampleName, a: float, b: float, match: Mapping[str, str]
) -> tuple[float, float] | None:
    """The earliest sample of the matching series of ``name`` in ``(a, b]``, summed.

    Returns:
        ``(t, sum)``: the latest of the series' first sample times in ``(a, b]`` and the sum
        of those samples' values; ``None`` when no series has a sample there. One binary
        search per series.
    """
    t = -math.inf
    total = 0.0
    seen = False
    for s in sig.series(name, match):
        i = bisect.bisect_right(s.ts, a)
        if i < len(s.ts) and s.ts[i] <= b:
            t = max(t, s.ts[i])
            total += s.vs[i]
            seen = True
    return (t, total) if seen else None


class SpanSink(Protocol):
    """Receives every slow-request attribution (the OTLP exporter implements it)."""

    def emit(self, attribution: Attribution) -> None:
        """Record one attribution; must not block or raise."""


class AttributionSampler(Sampler):
    """Derived sampler that attributes slow requests and windows (see the module docstring).

    Args:
        stream: the daemon's request stream; this sampler subscribes as ``consumer``.
        timeline: the agent's timeline.
        store: where attributions, request summaries and counts are kept.
        detector: slow-request judge (owned by this sampler).
        attributor: cause scoring.
        interval_s: seconds between cycles.
        settle_s: a record is processed once it ended at least this long ago (one sampling
            interval or more, so the sample covering its end exists).
        window_s: window length, seconds.
        span_sink: receives each slow-request attribution, or ``None``.
        clock: Unix time source (tests).
        consumer: the stream consumer name.
        max_per_cycle: records judged per cycle at most.
        max_pending: records held back at most.
    """

    name = "attribution"
    timeline_reads = TIMELINE_READS

    def __init__(
        self,
        stream: RequestStream,
        timeline: Timeline,
        store: AttributionStore,
        detector: SlowDetector,
        attributor: Attributor,
        *,
        interval_s: float = 1.0,
        settle_s: float = 1.5,
        window_s: float = 10.0,
        span_sink: SpanSink | None = None,
        clock: Callable[[], float] = time.time,
        consumer: str = "attribution",
        max_per_cycle: int = 5000,
        max_pending: int = 50000,
    ) -> None:
        super().__init__(interval_s, timeout_s=max(5.0, 5 * interval_s))
        self.stream = stream
        self.timeline = timeline
        self.store = store
        self.detector = detector
        self.attributor = attributor
        self.settle_s = settle_s
        self.window_s = window_s
        self.span_sink = span_sink
        self.clock = clock
        self.consumer = consumer
        self.max_per_cycle = max_per_cycle
        self._pending: deque[RequestRecord] = deque()
        self._max_pending = max_pending
        self.dropped_records = 0
        self._next_window: dict[str, float] = {}
        self._window_acc: dict[tuple[str, float], tuple[list[float], int]] = {}
        self._recent: deque[RequestRecord] = deque(maxlen=MAX_NEIGHBOURS)
        stream.subscribe(consumer)

    # --- one cycle ---------------------------------------------------------------------

    def collect(self, batch: Batch) -> None:
        """Process ready records and due windows, then emit the attribution metrics."""
        now = self.clock()
        self._pending.extend(self.stream.drain(self.consumer))
        while len(self._pending) > self._max_pending:
            self._pending.popleft()
            self.dropped_records += 1
        cutoff = now - self.settle_s
        held = self._unseen_in_flight(now, cutoff) | self._uncounted(now, cutoff)
        ready: list[RequestRecord] = []
        keep: deque[RequestRecord] = deque()
        for r in self._pending:
            if r.end <= cutoff and len(ready) < self.max_per_cycle and id(r) not in held:
                ready.append(r)
            else:
                keep.append(r)
        self._pending = keep
        ready.sort(key=lambda r: r.end)

        batches, preempted = self._decode_load(ready, now)
        # the ready records are each other's neighbours: known before any is judged
        self._recent.extend(ready)
        while self._recent and self._recent[0].end < now - NEIGHBOUR_HORIZON_S:
            self._recent.popleft()
        pool = sorted((*self._recent, *self._pending), key=lambda o: o.end) if ready else []
        ends = [o.end for o in pool]
        slow: list[tuple[RequestRecord, Verdict]] = []
        own = self._own_preemptions(ready, pool, now)
        for i, r in enumerate(ready):
            v = self.detector.judge(
                r,
                batches[i],
                self._neighbours(r, pool, ends),
                preempted.get(r.engine, ()),
                own[i].own,
                own[i].shared,
            )
            is_slow = v is not None and v.slow
            self.store.add_request(
                RequestSummary.of(r, is_slow, v is not None and bool(v.slo_missed))
            )
            if v is None:
                continue
            if is_slow:
                slow.append((r, v))
            self._accumulate(r, v)

        windows = self._due_windows(now)
        if slow or windows:
            lo = min(
                [r.start - self.attributor.lead_in_s for r, _ in slow]
                + [start for _, start in windows]
            )
            cold = self.attributor.params.cold_start_s
            extended = {k: lo - v - cold for k, v in LONG_LOOKBACK.items()}
            # one sample interval of look-back so counters have a point before each scope
            sig = Signals.from_timeline(
                self.timeline,
                (*METRICS_READ, ENGINE_LATENCY),
                lo - max(self.interval_s, 1.0) * 2,
                now,
                extended,
            )
            for r, v in slow:
                a = self.attributor.attribute_request(sig, r, v, self._neighbours(r, pool, ends))
                self.store.add_attribution(a)
                if self.span_sink is not None:
                    try:
                        self.span_sink.emit(a)
                    except Exception:
                        log.exception("span sink failed")
            for engine, start in windows:
                self._attribute_window(sig, engine, start)
        self._emit(batch)

    def _unseen_in_flight(self, now: float, cutoff: float) -> set[int]:
        """``id()`` of the settled pending records to hold for a neighbour still in flight.

        A record is held while its engine ran more requests at the last engine sample
        before its end, or at the first one after it (``kvpressure_engine_requests_running``,
        summed over the engine's series), than the agent knows records that were in flight
        then (settled, pending and the record itself): a request that was running beside it
        has not finished yet, and its prefill may be what held this one up (a long prompt's
        record ends after its decode, often well after the short request it blocked; short
        prompts prefilled in a long one's last decode steps are running only after its
        end, and end seconds later behind the next long prefill). A request that started
        between the record's end and that sample holds it too, until its own record
        arrives: later, never wrongly. At most
        :data:`HOLD_FOR_NEIGHBOURS_S` after the record's end, and not while the engine's
        statistics are stale or have no sample in the record's life; an engine whose
        requests the agent sees only in part (clients that bypass the proxy) has its
        records judged that much later, never wrongly.
        """
        waiting = [
            r for r in self._pending if r.end <= cutoff and r.end > now - HOLD_FOR_NEIGHBOURS_S
        ]
        if not waiting:
            return set()
        sig = Signals.from_timeline(
            self.timeline,
            (RUNNING, STATS_STALE),
            min(r.start for r in waiting) - 2 * self.interval_s,
            now,
        )
        # per engine, the known records' starts and ends, each sorted: the records in flight
        # at t are those started by t minus those ended before t (a record that ended
        # before t started before t too), two binary searches per held candidate
        starts: dict[str, list[float]] = {}
        ends: dict[str, list[float]] = {}
        for o in (*self._recent, *self._pending):
            starts.setdefault(o.engine, []).append(o.start)
            ends.setdefault(o.engine, []).append(o.end)
        for v in (*starts.values(), *ends.values()):
            v.sort()
        held: set[int] = set()
        for r in waiting:
            m = {"engine": r.engine}
            stale = _last_in(sig, STATS_STALE, r.start, r.end, m)
            if stale is not None and stale[1] >= 1.0:
                continue
            at = _last_in(sig, RUNNING, r.start, r.end, m)
            if at is None:
                continue  # no engine sample in the record's life
            # and the first sample after its end: a request that started in the record's
            # last sampling interval (a short prompt prefilled in a long one's last decode
            # steps) is running there, and only there
            after = _first_in(sig, RUNNING, r.end, now, m)
            starts_e, ends_e = starts[r.engine], ends[r.engine]
            for t, running in (at,) if after is None else (at, after):
                known = bisect.bisect_right(starts_e, t) - bisect.bisect_left(ends_e, t)
                if running > known:
                    held.add(id(r))
                    break
        return held

    def _decode_load(
        self, ready: list[RequestRecord], now: float
    ) -> tuple[list[float | None], dict[str, list[tuple[float, float]]]]:
        """Each record's batch size over its decode, and each engine's preemption intervals.

        Returns:
            ``(batches, preempted)``: ``batches[i]`` is the mean
            ``kvpressure_engine_requests_running`` of ``ready[i]``'s engine over its
            decode (``None`` without a TTFT, with no sample, or while the engine's stats
            are stale); ``preempted[engine]`` lists the ``(a, b)`` sample intervals, Unix
            seconds, over which ``kvpressure_engine_preemptions_total`` of the engine rose
            in the records' lifetimes, merged (sorted, disjoint; absent for an engine that
            reports no preemptions).
        """
        out: list[float | None] = [None] * len(ready)
        preempted: dict[str, list[tuple[float, float]]] = {}
        if not ready:
            return out, preempted
        sig = Signals.from_timeline(
            self.timeline,
            (RUNNING, STATS_STALE, PREEMPTIONS),
            min(r.start for r in ready) - 2 * self.interval_s,
            now,
        )
        rises: dict[str, list[tuple[float, float]]] = {}
        for s in sig.series(PREEMPTIONS):
            engine = s.labels.get("engine")
            if engine is None:
                continue
            got = rises.setdefault(engine, [])
            for k in range(1, len(s.ts)):
                if s.vs[k] != s.vs[k - 1]:  # a rise, or a reset (the new value is a rise)
                    got.append((s.ts[k - 1], s.ts[k]))
        for engine, spans in rises.items():  # one engine's series merged: sorted, disjoint
            merged: list[tuple[float, float]] = []
            for a, b in sorted(spans):
                if merged and a <= merged[-1][1]:
                    merged[-1] = (merged[-1][0], max(b, merged[-1][1]))
                else:
                    merged.append((a, b))
            preempted[engine] = merged
        for i, r in enumerate(ready):
            if r.ttft_s is None:
                continue
            a, b = r.start + r.ttft_s, r.end
            m = {"engine": r.engine}
            stale = sig.gauge_values(STATS_STALE, a, b, m)
            if stale and max(stale) >= 1.0:
                continue
            vals = sig.gauge_values(RUNNING, a, b, m)
            if vals:
                out[i] = sum(vals) / len(vals)
        return out, preempted

    def _uncounted(self, now: float, cutoff: float) -> set[int]:
        """``id()`` of the settled pending records to hold for the engine sample after them.

        A record of an engine with ``kvpressure_engine_finished_requests_total`` waits,
        at most :data:`OWN_PREEMPTIONS_WAIT_S` after its end, until that series has a
        sample at least :data:`OWN_PREEMPTIONS_MARGIN_S` after its end: the scrape that
        counted its request, without which its own preemptions stay unknown
        (:meth:`_own_preemptions`). Records of other engines are never held here.
        """
        waiting = [r for r in self._pending if cutoff >= r.end > now - OWN_PREEMPTIONS_WAIT_S]
        if not waiting:
            return set()
        sig = Signals.from_timeline(
            self.timeline,
            (FINISHED,),
            min(r.end for r in waiting) - OWN_PREEMPTIONS_LOOKBACK_S,
            now,
        )
        latest: dict[str, float] = {}
        for s in sig.series(FINISHED):
            engine = s.labels.get("engine")
            if engine is not None and s.ts:
                latest[engine] = min(latest.get(engine, math.inf), s.ts[-1])
        return {
            id(r)
            for r in waiting
            if r.engine in latest and latest[r.engine] < r.end + OWN_PREEMPTIONS_MARGIN_S
        }

    def _own_preemptions(
        self, ready: list[RequestRecord], pool: list[RequestRecord], now: float
    ) -> list[OwnPreemptions]:
        """How many times each ready record's request was preempted, where the engine says.

        Source: ``kvpressure_engine_finished_requests_total`` and
        ``kvpressure_engine_finished_requests_preemptions_total`` (vLLM's
        ``request_num_preemptions`` histogram count and sum: one observation per finished
        request), summed over the engine's series. Over the two engine samples around the
        record's end (each at least :data:`OWN_PREEMPTIONS_MARGIN_S` from it), the sum's
        increase is the record's own preemptions when the count rose by exactly 1 and the
        record is the one known record of its engine that ended between them; 0 for every
        record there when the sum did not rise while the count did. Else (several finished,
        a sample missing, clients the agent does not see) unknown; when several finished and
        they are exactly the known records that ended between the samples, the sum's
        increase is shared by them (``shared``: the engine preempted at least one of the
        requests that finished with this one, and none it finished is unseen).

        Args:
            ready: the records about to be judged.
            pool: every known record (settled and pending), sorted by end.
            now: the cycle's time, Unix seconds.

        Returns:
            One entry per ready record: ``own``, the preemptions (>= 0) or ``None`` when
            unknown, and ``shared`` (>= 0; 0 unless ``own`` is unknown).
        """
        out = [UNKNOWN_PREEMPTIONS] * len(ready)
        if not ready:
            return out
        sig = Signals.from_timeline(
            self.timeline,
            (FINISHED, FINISHED_PREEMPTIONS),
            min(r.end for r in ready) - OWN_PREEMPTIONS_LOOKBACK_S,
            now,
        )
        count: dict[str, list[Series]] = {}
        total: dict[str, dict[tuple[tuple[str, str], ...], Series]] = {}
        for s in sig.series(FINISHED):
            engine = s.labels.get("engine")
            if engine is not None and s.ts:
                count.setdefault(engine, []).append(s)
        for s in sig.series(FINISHED_PREEMPTIONS):
            engine = s.labels.get("engine")
            if engine is not None:
                total.setdefault(engine, {})[tuple(sorted(s.labels.items()))] = s
        if not count:
            return out
        ends: dict[str, list[float]] = {}
        for o in pool:  # sorted by end: each engine's list is too
            ends.setdefault(o.engine, []).append(o.end)
        for i, r in enumerate(ready):
            around = _around(count.get(r.engine, ()), total.get(r.engine, {}), r.end)
            if around is None:
                continue
            a, b, finished, preemptions = around
            if finished < 1:
                continue  # the engine has not counted it (yet): nothing to read
            if preemptions == 0:
                out[i] = OwnPreemptions(0, 0)
                continue
            known = ends.get(r.engine, [])
            in_between = bisect.bisect_right(known, b) - bisect.bisect_right(known, a)
            if finished == 1 and in_between == 1:
                out[i] = OwnPreemptions(round(preemptions), 0)
            elif finished == in_between:
                out[i] = OwnPreemptions(None, round(preemptions))
        return out

    @staticmethod
    def _neighbours(
        r: RequestRecord, pool: list[RequestRecord], ends: list[float]
    ) -> list[RequestRecord]:
        """Known records of ``r``'s engine (settled, pending) that overlap its lifetime.

        Args:
            r: the record.
            pool: the known records sorted by end.
            ends: their ends, in the same order.

        Only records that ended from ``r``'s start to :data:`NEIGHBOUR_AFTER_S` after its
        end are looked at.
        """
        lo = bisect.bisect_left(ends, r.start)
        hi = bisect.bisect_right(ends, r.end + NEIGHBOUR_AFTER_S)
        return [o for o in pool[lo:hi] if o.engine == r.engine and o is not r and o.start <= r.end]

    def _accumulate(self, r: RequestRecord, v: Verdict) -> None:
        start = r.end - (r.end % self.window_s)
        nxt = self._next_window.get(r.engine)
        if nxt is not None and start < nxt:
            return  # that window was already attributed
        lat, n_slow = self._window_acc.get((r.engine, start), ([], 0))
        judged = r.latency_s
        lat.append(v.latency_s if judged is None else judged)
        self._window_acc[(r.engine, start)] = (lat, n_slow + (1 if v.slow else 0))

    def _engines(self, now: float) -> set[str]:
        engines = self.store.engines_with_requests()
        for labels in self.timeline.columns(ENGINE_UP, now - 60.0, now):  # labels only
            eng = dict(labels).get("engine")
            if eng:
                engines.add(eng)
        return engines

    def _due_windows(self, now: float) -> list[tuple[str, float]]:
        """Windows ``(engine, start)`` that ended at least ``settle_s`` ago, oldest first."""
        w = self.window_s
        limit = now - self.settle_s
        due: list[tuple[str, float]] = []
        for engine in sorted(self._engines(now)):
            nxt = self._next_window.get(engine)
            if nxt is None:
                # start with the window in progress: no back-fill of history
                self._next_window[engine] = limit - (limit % w)
                continue
            starts: list[float] = []
            while nxt + w <= limit:
                starts.append(nxt)
                nxt += w
            self._next_window[engine] = nxt
            for s in starts[:-MAX_WINDOWS_PER_CYCLE]:
                self._window_acc.pop((engine, s), None)
            due.extend((engine, s) for s in starts[-MAX_WINDOWS_PER_CYCLE:])
        return due

    def _attribute_window(self, sig: Signals, engine: str, start: float) -> None:
        lat, n_slow = self._window_acc.pop((engine, start), ([], 0))
        end = start + self.window_s
        engine_p95: float | None = None
        slo: float | None = None
        if not lat:
            vals: list[float] = []
            for phase in ("ttft", "e2e"):
                for s in sig.series(ENGINE_LATENCY, {"engine": engine, "phase": phase}):
                    if _tail_quantile(s.labels):
                        vals.extend(v for _, v in s.between(start, end))
                if vals:
                    engine_p95 = max(vals)
                    slo = self.detector.slo[phase]
                    break
        w = self.attributor.attribute_window(
            sig,
            engine,
            start,
            end,
            lat,
            n_slow,
            engine_p95_s=engine_p95,
            slo_s=slo,
        )
        self.store.add_window(w)

    def _emit(self, batch: Batch) -> None:
        counts = self.store.slow_counts()
        engines = {e for e, _ in counts} | self.store.engines_with_requests()
        for engine in sorted(engines):
            for cause in (*CAUSES, UNKNOWN):
                counts.setdefault((engine, cause), 0)
        for (engine, cause), n in sorted(counts.items()):
            batch.add("kvpressure_slow_requests_total", n, engine=engine, cause=cause)
        for engine, w in sorted(self.store.latest_windows().items()):
            for cause in ALL_CAUSES:
                batch.add(
                    "kvpressure_attribution_score", w.scores.get(cause, 0.0), engine=engine,
                    cause=cause,
                )  # fmt: skip
        batch.add("kvpressure_attribution_pending_records", len(self._pending))
        batch.add("kvpressure_attribution_dropped_records_total", self.dropped_records)
