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
