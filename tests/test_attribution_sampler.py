"""The attribution sampler end to end on a synthetic timeline: settle, slow requests,
windows, counters, engine restarts and metric outages, the engine-latency window path, the
store's explain document."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvpressure.agent.attribution.detector import SlowDetector
from kvpressure.agent.attribution.engine import Attributor
from kvpressure.agent.attribution.model import Attribution
from kvpressure.agent.attribution.rules import Params
from kvpressure.agent.attribution.sampler import AttributionSampler
from kvpressure.agent.attribution.store import AttributionStore
from kvpressure.agent.requests.record import RequestRecord, RequestStream
from kvpressure.agent.samples import Batch, Sample, make_labels
from kvpressure.agent.timeline import Timeline

T = 1_800_000_000.0  # a multiple of the 10 s window
ENG = "llamacpp"
PSI = "kvpressure_psi_stall_seconds_total"


class Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


class Sink:
    def __init__(self) -> None:
        self.got: list[Attribution] = []

    def emit(self, attribution: Attribution) -> None:
        self.got.append(attribution)


def fill(tl: Timeline, lo: int, hi: int, series: dict[tuple[str, tuple], Callable[[int], float]]):
    """Append one sample per second for k in [lo, hi] (one batch per second, like samplers)."""
    for k in range(lo, hi + 1):
        tl.append(T + k, [Sample(n, fn(k), lab) for (n, lab), fn in series.items()])


def L(**kw: str):
    return make_labels(dict(kw))


def incident_timeline(lo: int = -40, hi: int = 60) -> Timeline:
    """Memory incident (all 4 slots busy, KV 97 %, 3 waiting) over [T+10, T+20]; CPU contention
    (PSI cpu some 0.9 s/s) over [T+20, T+40]; otherwise calm."""
    tl = Timeline(4096, 1000)
    cpu_total = {"v": 0.0}

    def cpu(k: int) -> float:
        cpu_total["v"] += 0.9 if 20 < k <= 40 else 0.01
        return cpu_total["v"]

    fill(tl, lo, hi, {
        ("kvpressure_engine_up", L(engine=ENG, instance="h:1")): lambda k: 1.0,
        ("kvpressure_engine_restarts_total", L(engine=ENG, instance="h:1")): lambda k: 0.0,
        ("kvpressure_engine_slots", L(engine=ENG, state="total")): lambda k: 4.0,
        ("kvpressure_engine_slots", L(engine=ENG, state="processing")):
            lambda k: 4.0 if 10 <= k <= 20 else 1.0,
        ("kvpressure_engine_requests_waiting", L(engine=ENG)):
            lambda k: 3.0 if 10 <= k <= 20 else 0.0,
        ("kvpressure_engine_kv_cache_usage_ratio", L(engine=ENG)):
            lambda k: 0.97 if 10 <= k < 20 else 0.2,
        (PSI, L(resource="cpu", kind="some", scope="system")): cpu,
    })  # fmt: skip
    return tl


def make(tl: Timeline, now: float, sink: Sink | None = None, **kw) -> tuple[
    AttributionSampler, RequestStream, Clock, AttributionStore]:  # fmt: skip
    stream = RequestStream()
    store = AttributionStore()
    clock = Clock(now)
    det = SlowDetector(slo_ttft_s=2.0, baseline_min_requests=5)
    s = AttributionSampler(
        stream, tl, store, det, Attributor(Params(), lead_in_s=2.0, min_score=0.3),
        interval_s=1.0, settle_s=1.5, window_s=10.0, span_sink=sink, clock=clock, **kw,
    )  # fmt: skip
    return s, stream, clock, store


def req(start: float, end: float, ttft: float, **kw) -> RequestRecord:
    return RequestRecord(engine=ENG, start=T + start, end=T + end, ttft_s=ttft, e2e_s=end - start,
                         **kw)  # fmt: skip


def samples(batch: Batch) -> dict[tuple[str, tuple], float]:
    return {(s.name, s.labels): s.value for s in batch.samples}


def test_slow_requests_windows_counters_and_spans():
    tl = incident_timeline()
    sink = Sink()
    s, stream, clock, store = make(tl, T + 5, sink)
    s.collect(Batch())  # first cycle: windows start at the one in progress (T+0)
    for k in range(1, 10):  # calm: 9 requests at 0.1 s make the baseline (>= 5)
        stream.submit(req(k - 0.5, k, 0.1))
    for _ in range(3):  # queued behind full slots
        stream.submit(req(12, 15, 1.5))
    for _ in range(2):  # CPU contention
        stream.submit(req(27, 29, 1.2))
    clock.t = T + 41
    b = Batch()
    s.collect(b)

    assert store.slow_counts() == {(ENG, "memory"): 3, (ENG, "compute"): 2}
    got = samples(b)
    assert got[("kvpressure_slow_requests_total", L(cause="memory", engine=ENG))] == 3
    assert got[("kvpressure_slow_requests_total", L(cause="compute", engine=ENG))] == 2
    assert got[("kvpressure_slow_requests_total", L(cause="storage", engine=ENG))] == 0
    assert got[("kvpressure_slow_requests_total", L(cause="unknown", engine=ENG))] == 0

    mem = [a for a in sink.got if a.cause == "memory"]
    assert len(sink.got) == 5 and len(mem) == 3
    assert mem[0].evidence[0].signal == "queue_while_full"
    assert mem[0].basis == "baseline" and mem[0].threshold_s < 1.0

    wins = {w.start - T: w for w in store._windows}
    assert wins[0.0].cause is None and wins[0.0].requests == 9 and wins[0.0].slow == 0
    assert wins[10.0].cause == "memory" and wins[10.0].slow == 3
    assert wins[20.0].cause == "compute" and wins[20.0].slow == 2
    assert 30.0 not in wins  # ends at T+40 > now - settle
    # the score gauges show the latest complete window (T+20..T+30)
    assert got[("kvpressure_attribution_score", L(cause="compute", engine=ENG))] == 1.0
    assert got[("kvpressure_attribution_score", L(cause="memory", engine=ENG))] < 0.3


def test_records_wait_until_their_end_is_settled():
    tl = incident_timeline()
    s, stream, clock, store = make(tl, T + 14.9)
    stream.submit(req(12, 14, 3.0))  # ended 0.9 s ago: the sample covering its end may be missing
    b = Batch()
    s.collect(b)
    assert store.slow_counts() == {}
    assert samples(b)[("kvpressure_attribution_pending_records", ())] == 1
    clock.t = T + 15.6
    s.collect(Batch())
    assert store.slow_counts() == {(ENG, "memory"): 1}  # 3.0 s > SLO 2.0 during warm-up


def test_pending_backlog_is_bounded_and_counted():
    tl = incident_timeline()
    s, stream, _, _ = make(tl, T, max_pending=3)
    for _ in range(5):
        stream.submit(req(10, 20, 0.1))  # all in the future relative to the clock
    b = Batch()
    s.collect(b)
    got = samples(b)
    assert got[("kvpressure_attribution_pending_records", ())] == 3
    assert got[("kvpressure_attribution_dropped_records_total", ())] == 2


def test_restart_outranks_the_queue_it_causes():
    tl = Timeline(4096, 1000)
    fill(tl, -40, 60, {
        ("kvpressure_engine_up", L(engine=ENG)): lambda k: 1.0,
        ("kvpressure_engine_restarts_total", L(engine=ENG)): lambda k: 1.0 if k >= 11 else 0.0,
        ("kvpressure_engine_slots", L(engine=ENG, state="total")): lambda k: 4.0,
        ("kvpressure_engine_slots", L(engine=ENG, state="processing")): lambda k: 4.0,
        ("kvpressure_engine_requests_waiting", L(engine=ENG)): lambda k: 5.0,
        ("kvpressure_engine_kv_cache_usage_ratio", L(engine=ENG)): lambda k: 0.99,
    })  # fmt: skip
    s, stream, _, store = make(tl, T + 30)
    stream.submit(req(12, 16, 5.0))
    s.collect(Batch())
    (a,) = store.attributions()
    assert a.cause == "engine_restart"
    assert a.scores["memory"] == 1.0  # the queue is still reported as evidence


def test_metrics_outage_says_unassessed_never_no_memory_pressure():
    tl = Timeline(4096, 1000)
    fill(tl, -40, 60, {
        ("kvpressure_engine_up", L(engine=ENG)): lambda k: 0.0 if 5 <= k <= 25 else 1.0,
        ("kvpressure_engine_restarts_total", L(engine=ENG)): lambda k: 0.0,
    })  # fmt: skip
    s, stream, _, store = make(tl, T + 30)
    stream.submit(req(12, 16, 5.0))
    s.collect(Batch())
    (a,) = store.attributions()
    assert a.cause == "unknown"
    assert a.unassessed == ("engine_metrics",)
    doc = store.query(T, T + 30)
    assert doc["unassessed"][0]["what"] == "engine_metrics"


def test_window_without_records_uses_the_engine_latency_quantile():
    tl = Timeline(4096, 1000)
    fill(tl, -40, 60, {
        ("kvpressure_engine_up", L(engine="vllm")): lambda k: 1.0,
        ("kvpressure_engine_latency_seconds", L(engine="vllm", phase="ttft", quantile="0.95")):
            lambda k: 5.0 if 10 <= k < 20 else 0.2,
        ("kvpressure_engine_preemptions_total", L(engine="vllm")): lambda k: float(max(0, k)),
    })  # fmt: skip
    s, _, clock, store = make(tl, T + 5)
    s.collect(Batch())
    clock.t = T + 31.6
    s.collect(Batch())
    wins = {w.start - T: w for w in store._windows}
    assert wins[10.0].p95_s == 5.0 and wins[10.0].cause == "memory"  # preempting, slow
    assert wins[20.0].p95_s == 0.2 and wins[20.0].cause is None  # preempting, but not slow


def test_store_query_document():
    tl = incident_timeline()
    s, stream, clock, store = make(tl, T + 5)
    s.collect(Batch())
    for k in range(1, 10):
        stream.submit(req(k - 0.5, k, 0.1, prefill_s=0.05, itl_s=(0.02, 0.04)))
    for _ in range(3):
        stream.submit(req(12, 15, 1.5))
    clock.t = T + 41
    s.collect(Batch())
    doc = store.query(T, T + 41, window_s=10.0)
    r = doc["requests"][ENG]
    assert r["requests"] == 12 and r["slow"] == 3
    assert r["phases"]["ttft"]["n"] == 12
    assert r["phases"]["itl"]["p50"] == pytest.approx(0.03)
    assert doc["slow_by_cause"] == {ENG: {"memory": 3}}
    assert doc["evidence"][0]["signal"] == "queue_while_full"
    assert doc["evidence"][0]["requests"] == 3
    assert doc["dominant"] == [
        {"engine": ENG, "cause": "memory", "start": T + 10, "end": T + 20, "windows": 1, "slow": 3}
    ]
    assert len(doc["attributions"]) == 3
    assert doc["totals"] == {ENG: {"memory": 3}}
    assert store.query(T + 20, T + 41)["slow_by_cause"] == {}
