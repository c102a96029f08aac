import shutil
import subprocess

import pytest
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import CollectorRegistry

from agent import catalogue
from agent.samples import Batch
from agent.state import AgentState, SamplerReport
from agent.timeline import Timeline
from exporters.prometheus import families, make_registry, render


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
    from agent.api import snapshot

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

    from exporters import prometheus as exp

    state = _state_with(_host_batch(1.0))
    registry = make_registry(state)
    cache = exp.ExpositionCache(registry, lambda: state.version)
    calls = []
    real = registry.collect

    def counting():
        calls.append(1)
        return real()

    monkeypatch.setattr(registry, "collect", counting)
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
    ("header", "expected"),
    [
        (None, False),
        ("", False),
        ("gzip", True),
        ("deflate, gzip;q=0.5", True),
        ("gzip;q=0", False),
        ("br", False),
        ("*", True),
        ("GZIP ; q=1.0", True),
        ("gzip;q=x", False),
    ],
)
def test_accepts_gzip(header, expected):
    from exporters.prometheus import accepts_gzip

    assert accepts_gzip(header) is expected
