"""The timeline keeps only what its readers declared, and every reader declares what it reads.

Issue 15: on the 8-GPU node the timeline held 1,746 series, 960 of them the engines' latency
histograms that no reader ever read back. Each derived stage now declares the metric names
it reads (``Sampler.timeline_reads``, registered as the stage's ``reads``); the daemon keeps
the union over the enabled stages and a read of any other name raises ``NotKept``.

Here each reader runs every path that reads the timeline over a :class:`Spy` timeline that
keeps only that reader's declared names and records every name asked for: a read left
undeclared raises (and is recorded), a declared name no path reads shows as a difference.
"""

from __future__ import annotations

from array import array
from collections.abc import Mapping

import pytest

from kvpressure.agent import pipeline
from kvpressure.agent.attribution.detector import SlowDetector
from kvpressure.agent.attribution.engine import Attributor
from kvpressure.agent.attribution.rules import METRICS_READ, Params
from kvpressure.agent.attribution.sampler import TIMELINE_READS, AttributionSampler
from kvpressure.agent.attribution.store import AttributionStore
from kvpressure.agent.capacity.live import CapacitySampler
from kvpressure.agent.config import parse
from kvpressure.agent.requests.record import RequestRecord, RequestStream
from kvpressure.agent.samples import Batch, Labels, Sample, make_labels
from kvpressure.agent.state import AgentState, SamplerReport
from kvpressure.agent.timeline import NotKept, Timeline

T = 1_800_000_000.0  # a multiple of the attribution's 10 s window


class Spy(Timeline):
    """A timeline that records every metric name read from it (even one that raises)."""

    def __init__(self, *args: object, **kw: object) -> None:
        super().__init__(*args, **kw)  # type: ignore[arg-type]
        self.asked: set[str] = set()

    def columns(
        self,
        name: str,
        start: float = float("-inf"),
        end: float = float("inf"),
        match: Mapping[str, str] | None = None,
    ) -> dict[Labels, tuple[array[float], array[float]]]:
        self.asked.add(name)  # every read: window() reads through columns()
        return super().columns(name, start, end, match)


class Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def L(**kw: str) -> Labels:
    return make_labels(dict(kw))


# ---- the timeline itself ------------------------------------------------------------------


def test_a_timeline_keeps_only_the_names_it_is_told_and_refuses_to_read_others():
    t = Timeline(kept={"kept"})
    hist = "kvpressure_engine_request_latency_seconds_bucket"
    for i in range(3):
        t.append(float(i), [Sample("kept", 1.0, L(e="a")), Sample(hist, 2.0, L(le="1")),
                            Sample("kept", 3.0, L(e="b"))])  # fmt: skip
    assert len(t) == 2
    assert t.names() == {"kept"}
    assert set(t.window("kept")) == {L(e="a"), L(e="b")}
    with pytest.raises(NotKept, match="timeline_reads"):
        t.window(hist)
    assert t.dropped_samples == 0  # skipped, not dropped at the cap


def test_set_kept_drops_series_of_names_no_longer_read_and_admits_new_ones():
    t = Timeline()  # kept=None: every name (tests, benchmarks)
    t.append(1.0, [Sample("a", 1.0), Sample("b", 2.0)])
    assert t.kept is None and len(t) == 2
    assert t.set_kept({"a", "c"}) == 1
    assert t.names() == {"a"}
    t.append(2.0, [Sample("a", 1.0), Sample("b", 2.0), Sample("c", 3.0)])
    assert t.names() == {"a", "c"}
    assert t.window("a")[()] == [(1.0, 1.0), (2.0, 1.0)]
    assert t.window("c")[()] == [(2.0, 3.0)]
    # the eviction bookkeeping forgot the dropped series with them
    assert t.forget(10.0) == 2 and len(t) == 0


def test_kept_is_decided_per_name_even_when_equal_names_are_other_objects():
    """The per-run shortcut compares name objects; equal strings built apart still work."""
    t = Timeline(kept={"ab"})
    a1, a2 = "".join(["a", "b"]), "".join(["a", "b"])
    x = "".join(["x", "y"])
    assert a1 is not a2
    t.append(1.0, [Sample(a1, 1.0, L(i="1")), Sample(a2, 2.0, L(i="2")), Sample(x, 3.0),
                   Sample(a1, 4.0, L(i="3"))])  # fmt: skip
    assert t.names() == {"ab"} and len(t) == 3


# ---- the declarations and the pipeline -----------------------------------------------------


def test_the_pipeline_keeps_the_union_of_the_enabled_stages_reads():
    regs = pipeline.registry()
    assert regs["attribution"].reads == AttributionSampler.timeline_reads == TIMELINE_READS
    assert regs["capacity"].reads == CapacitySampler.timeline_reads
    for reg in regs.values():  # sources read the outside world, never the timeline
        if reg.stage is pipeline.Stage.SOURCE:
            assert reg.reads == frozenset(), reg.name
    every = pipeline.timeline_reads(parse("{}"))
    assert every == AttributionSampler.timeline_reads | CapacitySampler.timeline_reads
    no_attr = pipeline.timeline_reads(parse("samplers: {attribution: {enabled: false}}"))
    assert no_attr == CapacitySampler.timeline_reads
    none = pipeline.timeline_reads(
        parse("samplers: {attribution: {enabled: false}, capacity: {enabled: false}}")
    )
    assert none == frozenset()
    # what nobody reads back: the engines' latency histograms, the GPU bandwidth ratio
    for name in ("kvpressure_engine_request_latency_seconds_bucket",
                 "kvpressure_engine_request_latency_seconds_count",
                 "kvpressure_gpu_memory_bandwidth_utilization_ratio"):  # fmt: skip
        assert name not in every


def test_a_source_cannot_declare_timeline_reads():
    with pytest.raises(ValueError, match="only a derived stage reads the timeline"):
        pipeline.register("x-test-source", pipeline.Stage.SOURCE, "doc", reads=frozenset({"a"}))(
            lambda ctx: []
        )


def test_the_daemon_keeps_what_its_stages_read_and_follows_reloads(tmp_path):
    from kvpressure.agent.daemon import Daemon

    class Reader(pipeline.Sampler):
        name = "reader"
        timeline_reads = frozenset({"kvpressure_host_memory_total_bytes"})

        def collect(self, batch: Batch) -> None:
            pass

    quiet = "discovery: {enabled: false}\nsamplers: {host: {enabled: false}, gpu: {enabled: false}"
    cfg = tmp_path / "c.yaml"
    cfg.write_text(quiet + "}\n")
    d = Daemon(parse(cfg.read_text()), config_path=cfg, extra_samplers=[Reader()])
    tl = d.state.timeline
    assert tl.kept == pipeline.timeline_reads(d.config) | Reader.timeline_reads
    finished = "kvpressure_engine_finished_requests_total"  # read by attribution only
    assert finished in (tl.kept or ())
    tl.append(1.0, [Sample(finished, 1.0, L(engine="v"))])
    assert tl.names() == {finished}
    cfg.write_text(quiet + ", attribution: {enabled: false}}\n")
    try:
        assert d.reload()
        assert tl.kept == CapacitySampler.timeline_reads | Reader.timeline_reads
        assert finished not in tl.names()  # its series went with the stage
    finally:
        for r in d._runners.stop():
            r.join(5)


# ---- every reader reads only what it declared ----------------------------------------------


def _attribution_timeline() -> Spy:
    """A vLLM engine with every series the attribution sampler reads, one sample a second."""
    tl = Spy(4096, 1000, kept=AttributionSampler.timeline_reads)
    eng = {"engine": "vllm", "instance": "h:1"}
    fin = {"n": 0.0}
    for k in range(-40, 61):
        fin["n"] += 1.0
        tl.append(T + k, [
            Sample("kvpressure_engine_up", 1.0, L(**eng)),
            Sample("kvpressure_engine_stats_stale", 0.0, L(**eng)),
            # running while the slow requests and the last one run (the last is held: the
            # engine still runs one after it), none once they ended
            Sample("kvpressure_engine_requests_running", 2.0 if 12 <= k <= 15 or k >= 36
                   else 0.0, L(**eng)),
            Sample("kvpressure_engine_requests_waiting", 3.0 if 10 <= k <= 20 else 0.0, L(**eng)),
            Sample("kvpressure_engine_kv_cache_usage_ratio", 0.97 if 10 <= k < 20 else 0.2,
                   L(**eng)),
            Sample("kvpressure_engine_preemptions_total", float(k // 10), L(**eng)),
            Sample("kvpressure_engine_finished_requests_total", fin["n"], L(**eng)),
            Sample("kvpressure_engine_finished_requests_preemptions_total", 0.0, L(**eng)),
            Sample("kvpressure_engine_latency_seconds", 0.5,
                   L(phase="ttft", quantile="0.95", **eng)),
            # read by nobody: skipped on append
            Sample("kvpressure_engine_request_latency_seconds_bucket", 1.0, L(le="1", **eng)),
        ])  # fmt: skip
    return tl


def test_the_attribution_sampler_reads_exactly_what_it_declares():
    tl = _attribution_timeline()
    assert "kvpressure_engine_request_latency_seconds_bucket" not in tl.names()
    stream = RequestStream()
    store = AttributionStore()
    clock = Clock(T + 5)
    s = AttributionSampler(
        stream, tl, store, SlowDetector(slo_ttft_s=2.0, baseline_min_requests=5),
        Attributor(Params(), lead_in_s=2.0, min_score=0.3),
        interval_s=1.0, settle_s=1.5, window_s=10.0, clock=clock,
    )  # fmt: skip
    s.collect(Batch())  # windows start with the one in progress
    for k in range(1, 10):  # calm baseline
        stream.submit(RequestRecord("vllm", T + k - 0.5, T + k, ttft_s=0.1, e2e_s=0.5))
    for _ in range(3):  # slow: queued while KV is full
        stream.submit(RequestRecord("vllm", T + 12, T + 15, ttft_s=2.5, e2e_s=3.0))
    # settled within the last seconds: held for a neighbour / for the engine's next count
    stream.submit(RequestRecord("vllm", T + 36, T + 39, ttft_s=0.2, e2e_s=3.0))
    clock.t = T + 41
    b = Batch()
    s.collect(b)  # every path: hold, decode load, own preemptions, requests and windows
    assert store.slow_counts(), "no slow request attributed: the scenario missed a path"
    assert tl.asked == AttributionSampler.timeline_reads
    assert set(METRICS_READ) <= tl.asked


def test_the_capacity_sampler_reads_exactly_what_it_declares():
    tl = Spy(kept=CapacitySampler.timeline_reads)
    state = AgentState(tl)
    stream = RequestStream()
    clock = Clock(1000.0)
    smp = CapacitySampler(state, interval_s=1.0, window_s=30.0, stream=stream, clock=clock)
    lab = {"engine": "vllm", "instance": "h:8000", "model": "tiny"}
    for i in range(5):  # vLLM: no used tokens (ratio x capacity), prefill counters growing
        b = Batch()
        b.add("kvpressure_engine_kv_cache_capacity_tokens", 6144, **lab)
        b.add("kvpressure_engine_kv_cache_usage_ratio", 0.5 + 0.05 * i, **lab)
        b.add("kvpressure_engine_requests_running", 4, **lab)
        b.add("kvpressure_engine_info", 1, type="vllm", **lab)
        b.add("kvpressure_engine_prefix_cache_hit_tokens_total", 100.0 * i, **lab)
        b.add("kvpressure_engine_prompt_tokens_total", 1000.0 * i, **lab)
        b.add("kvpressure_engine_prompt_seconds_total", 0.5 * i, **lab)
        b.add("kvpressure_engine_request_latency_seconds_bucket", 1.0, le="1", **lab)
        state.publish(SamplerReport("engine:vllm", 1000.0 + i, 0.01, True, "", b))
    # a request without token counts: its TTFT goes to the knee, no final footprint
    stream.submit(RequestRecord("vllm", 1001.0, 1003.0, ttft_s=0.4, itl_s=(0.01, 0.02)))
    clock.t = 1004.0
    out = Batch()
    smp.collect(out)
    assert {s.name for s in out.samples} >= {
        "kvpressure_kv_saturation_concurrency",
        "kvpressure_kv_time_to_saturation_seconds",
        "kvpressure_prefix_cache_saved_seconds_total",
    }
    assert tl.names() <= CapacitySampler.timeline_reads
    assert tl.asked == CapacitySampler.timeline_reads


def test_an_undeclared_read_fails_the_stage_loudly():
    """The trap closed: a reader that forgot a name raises instead of reading nothing."""
    tl = Timeline(kept=CapacitySampler.timeline_reads)
    state = AgentState(tl)
    smp = CapacitySampler(state, clock=Clock(1000.0))
    with pytest.raises(NotKept):
        smp._window_delta("kvpressure_engine_generation_tokens_total", "vllm", 1000.0)
