"""OTLP export: span parenting and links, span attributes, the metric snapshot conversion,
a real OTLP/HTTP round trip, and an exporter that is down (bounded queue, dropped counts,
sampling never blocked)."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from aiohttp import web
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.metrics.export import (
    Gauge,
    Histogram,
    MetricExporter,
    MetricExportResult,
    MetricsData,
    Sum,
)
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvpressure.agent.attribution.model import Attribution, Evidence
from kvpressure.agent.samples import Batch, Sample, make_labels
from kvpressure.agent.state import AgentState
from kvpressure.agent.timeline import Timeline
from kvpressure.exporters.otlp import (
    SPAN_NAME,
    OtlpExport,
    snapshot_metrics,
    span_attributes,
)

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
SPAN = "00f067aa0ba902b7"


def attribution(trace_id: str | None = None, span_id: str | None = None, **kw) -> Attribution:
    base = {
        "engine": "llamacpp",
        "start": 1_800_000_000.0,
        "end": 1_800_000_003.5,
        "cause": "memory",
        "scores": {"memory": 1.0, "storage": 0.0, "network": 0.0, "compute": 0.2,
                   "gpu_fault": 0.0, "engine_restart": 0.0},
        "evidence": (
            Evidence("memory", "queue_while_full", "kvpressure_engine_requests_waiting", 1.0,
                     0.0, 0.5, 1.0, "ratio"),
            Evidence("compute", "psi_cpu_some", "kvpressure_psi_stall_seconds_total", 0.35, 0.25,
                     0.75, 0.2, "s/s", {"scope": "system"}),
        ),
        "unassessed": (),
        "phase": "ttft",
        "latency_s": 3.1,
        "threshold_s": 0.4,
        "basis": "baseline",
        "model": "gemma-3-270m",
        "input_tokens": 480,
        "output_tokens": 32,
        "trace_id": trace_id,
        "span_id": span_id,
    }  # fmt: skip
    base.update(kw)
    return Attribution(**base)  # type: ignore[arg-type]


@pytest.fixture
def memory_export() -> Iterator[tuple[OtlpExport, InMemorySpanExporter]]:
    mem = InMemorySpanExporter()
    exp = OtlpExport(AgentState(Timeline()), span_exporter=mem, schedule_delay_s=0.01)
    yield exp, mem
    exp.shutdown()


def test_span_is_a_child_of_the_source_span(memory_export):
    exp, mem = memory_export
    exp.emit(attribution(TRACE, SPAN))
    exp.provider.force_flush()
    (span,) = mem.get_finished_spans()
    assert span.name == SPAN_NAME
    assert span.context.trace_id == int(TRACE, 16)
    assert span.parent is not None and span.parent.span_id == int(SPAN, 16)
    assert span.parent.is_remote
    assert span.start_time == 1_800_000_000 * 10**9
    assert span.end_time == 1_800_000_003_500_000_000
    assert not span.links


def test_span_links_to_the_source_in_link_mode():
    mem = InMemorySpanExporter()
    exp = OtlpExport(AgentState(Timeline()), span_exporter=mem, span_parent="link")
    try:
        exp.emit(attribution(TRACE, SPAN))
        exp.provider.force_flush()
        (span,) = mem.get_finished_spans()
        assert span.parent is None
        assert span.context.trace_id != int(TRACE, 16)
        (link,) = span.links
        assert (link.context.trace_id, link.context.span_id) == (int(TRACE, 16), int(SPAN, 16))
    finally:
        exp.shutdown()


@pytest.mark.parametrize(("tid", "sid"), [(None, None), ("xyz", SPAN), (TRACE, "0" * 16)])
def test_unknown_or_invalid_source_ids_make_a_root_span(memory_export, tid, sid):
    exp, mem = memory_export
    exp.emit(attribution(tid, sid))
    exp.provider.force_flush()
    (span,) = mem.get_finished_spans()
    assert span.parent is None and not span.links


def test_span_attributes_carry_cause_scores_evidence_and_gen_ai_facts(memory_export):
    exp, mem = memory_export
    exp.emit(attribution(unassessed=("engine_metrics",)))
    exp.provider.force_flush()
    (span,) = mem.get_finished_spans()
    a = dict(span.attributes or {})
    assert a["kvpressure.cause"] == "memory"
    assert a["kvpressure.score.memory"] == 1.0 and a["kvpressure.score.compute"] == 0.2
    assert a["kvpressure.evidence.queue_while_full"] == 1.0
    assert a["kvpressure.evidence.psi_cpu_some"] == 0.35
    ev = json.loads(str(a["kvpressure.evidence"]))
    assert ev[0]["signal"] == "queue_while_full" and ev[0]["threshold"] == 0.0
    assert ev[1]["labels"] == {"scope": "system"}
    assert tuple(a["kvpressure.unassessed"]) == ("engine_metrics",)
    assert a["gen_ai.request.model"] == "gemma-3-270m"
    assert a["gen_ai.usage.input_tokens"] == 480 and a["gen_ai.usage.output_tokens"] == 32
    assert a["gen_ai.latency.time_to_first_token"] == 3.1
    assert a["kvpressure.threshold.basis"] == "baseline"


def test_gpu_fault_span_carries_the_xid():
    a = attribution(
        cause="gpu_fault",
        evidence=(Evidence("gpu_fault", "gpu_fault", "kvpressure_gpu_xid_errors_total", 1.0, 0.0,
                           1.0, 1.0, "1", {"gpu": "0", "xid": "79"}),),
    )  # fmt: skip
    assert span_attributes(a)["kvpressure.gpu.xid"] == "79"


# --- metrics ----------------------------------------------------------------------------------


def _state_with(samples: list[Sample]) -> AgentState:
    from kvpressure.agent.state import SamplerReport

    st = AgentState(Timeline())
    st.publish(SamplerReport("t", time.time(), 0.0, True, "", Batch(samples)))
    return st


HIST = "kvpressure_request_latency_seconds"


def _samples() -> list[Sample]:
    lab = {"engine": "llamacpp", "phase": "ttft"}
    return [
        Sample("kvpressure_host_memory_total_bytes", 16e9),
        Sample(
            "kvpressure_slow_requests_total", 7, make_labels({"engine": "e", "cause": "memory"})
        ),
        Sample(f"{HIST}_bucket", 2, make_labels({**lab, "le": "0.1"})),
        Sample(f"{HIST}_bucket", 5, make_labels({**lab, "le": "1.0"})),
        Sample(f"{HIST}_bucket", 6, make_labels({**lab, "le": "+Inf"})),
        Sample(f"{HIST}_count", 6, make_labels(lab)),
        Sample(f"{HIST}_sum", 4.2, make_labels(lab)),
        Sample("not_in_catalogue", 1.0),
    ]


def test_snapshot_conversion_uses_catalogue_kinds_units_and_histograms():
    metrics, points = snapshot_metrics(_samples(), 1, 2)
    by = {m.name: m for m in metrics}
    mem = by["system.memory.limit"]  # the catalogue's OTel name
    assert isinstance(mem.data, Gauge) and mem.unit == "By"
    slow = by["slow_requests_total"]
    assert isinstance(slow.data, Sum) and slow.data.is_monotonic
    assert dict(slow.data.data_points[0].attributes) == {"cause": "memory", "engine": "e"}
    hist = by["request_latency_seconds"]
    assert isinstance(hist.data, Histogram) and hist.unit == "s"
    dp = hist.data.data_points[0]
    assert list(dp.explicit_bounds) == [0.1, 1.0]
    assert list(dp.bucket_counts) == [2, 3, 1]  # cumulative le-buckets -> per bucket
    assert (dp.count, dp.sum) == (6, 4.2)
    assert points == 3


class _Failing(MetricExporter):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def export(self, metrics_data: MetricsData, timeout_millis: float = 10_000, **kw):
        self.calls += 1
        return MetricExportResult.FAILURE

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return True

    def shutdown(self, timeout_millis: float = 30_000, **kw) -> None:
        pass


def test_failed_metric_export_is_counted_as_dropped_points():
    failing = _Failing()
    exp = OtlpExport(_state_with(_samples()), span_exporter=InMemorySpanExporter(),
                     metric_exporter=failing)  # fmt: skip
    try:
        assert exp.metrics is not None and not exp.metrics.export_once()
        got = {(s.name, s.labels): s.value for s in exp.health_samples()}
        dropped = got[("kvpressure_otlp_export_dropped_total", (("signal", "metrics"),))]
        assert dropped >= 3 and failing.calls == 1
    finally:
        exp.shutdown()


# --- a real OTLP/HTTP endpoint ------------------------------------------------------------------


class Collector:
    """A minimal OTLP/HTTP receiver (protobuf, gzip) on a background loop."""

    def __init__(self) -> None:
        self.traces: list[ExportTraceServiceRequest] = []
        self.metrics: list[ExportMetricsServiceRequest] = []
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._main, daemon=True)

    async def _handle(self, request: web.Request) -> web.Response:
        body = await request.read()
        if body[:2] == b"\x1f\x8b":  # aiohttp usually inflates gzip request bodies itself
            body = gzip.decompress(body)
        if request.path == "/v1/traces":
            m = ExportTraceServiceRequest()
            m.ParseFromString(body)
            self.traces.append(m)
        else:
            m2 = ExportMetricsServiceRequest()
            m2.ParseFromString(body)
            self.metrics.append(m2)
        return web.Response(body=b"", content_type="application/x-protobuf")

    def _main(self) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        app.router.add_post("/v1/traces", self._handle)
        app.router.add_post("/v1/metrics", self._handle)
        runner = web.AppRunner(app)
        self._loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", 0)
        self._loop.run_until_complete(site.start())
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self._ready.set()
        self._loop.run_forever()

    def __enter__(self) -> Collector:
        self._thread.start()
        assert self._ready.wait(5)
        return self

    def __exit__(self, *exc: object) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)


def test_otlp_http_round_trip_of_spans_and_metrics():
    pytest.importorskip("opentelemetry.exporter.otlp.proto.http")
    with Collector() as col:
        url = f"http://127.0.0.1:{col.port}"
        exp = OtlpExport(_state_with(_samples()), endpoint=url, headers={"x-tenant": "t1"},
                         timeout_s=3, schedule_delay_s=0.05)  # fmt: skip
        try:
            exp.emit(attribution(TRACE, SPAN))
            assert exp.metrics is not None and exp.metrics.export_once()
            exp.provider.force_flush()
            deadline = time.monotonic() + 5
            while not col.traces and time.monotonic() < deadline:
                time.sleep(0.05)
        finally:
            exp.shutdown()
        span = col.traces[0].resource_spans[0].scope_spans[0].spans[0]
        assert span.name == SPAN_NAME
        assert span.trace_id.hex() == TRACE and span.parent_span_id.hex() == SPAN
        attrs = {kv.key: kv.value for kv in span.attributes}
        assert attrs["kvpressure.cause"].string_value == "memory"
        res = {kv.key: kv.value.string_value
               for kv in col.traces[0].resource_spans[0].resource.attributes}  # fmt: skip
        assert res["service.name"] == "kvpressure"
        ms = {m.name: m for m in col.metrics[0].resource_metrics[0].scope_metrics[0].metrics}
        h = ms["request_latency_seconds"].histogram.data_points[0]
        assert list(h.bucket_counts) == [2, 3, 1] and not h.HasField("min")
        assert ms["slow_requests_total"].sum.is_monotonic
        exported, dropped = exp.stats.snapshot()
        assert exported["traces"] == 1 and exported["metrics"] >= 3  # + the agent's own
        assert dropped == {"traces": 0, "metrics": 0}


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_exporter_down_costs_a_bounded_queue_and_a_dropped_counter():
    pytest.importorskip("opentelemetry.exporter.otlp.proto.http")
    exp = OtlpExport(AgentState(Timeline()), endpoint=f"http://127.0.0.1:{_closed_port()}",
                     queue_size=8, timeout_s=0.3, schedule_delay_s=0.05)  # fmt: skip
    try:
        t0 = time.monotonic()
        for _ in range(300):
            exp.emit(attribution(TRACE, SPAN))
        emit_s = time.monotonic() - t0
        assert emit_s < 1.0, f"emitting blocked on a dead endpoint: {emit_s:.2f}s"
        queued = exp.processor.queued()
        assert queued is not None and queued <= 8
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            exported, dropped = exp.stats.snapshot()
            if dropped["traces"] >= 292:
                break
            time.sleep(0.05)
        assert exported["traces"] == 0
        # queue overflow + failed batches; the overflow check races the export worker, so a
        # span popped for export right as the queue was full can be counted once too often
        assert 292 - 8 <= dropped["traces"] <= 305
        got = {(s.name, s.labels): s.value for s in exp.health_samples()}
        assert got[("kvpressure_otlp_export_dropped_total", (("signal", "traces"),))] >= 284
        assert ("kvpressure_otlp_export_queue_spans", ()) in got
    finally:
        t0 = time.monotonic()
        exp.shutdown(timeout_s=0.5)
        assert time.monotonic() - t0 < 1.5


def test_daemon_exports_attribution_spans_and_metrics_when_an_endpoint_is_set():
    pytest.importorskip("opentelemetry.exporter.otlp.proto.http")
    from kvpressure.agent.config import parse
    from kvpressure.agent.daemon import Daemon
    from kvpressure.agent.requests.record import RequestRecord

    with Collector() as col:
        cfg = parse(
            "listen: '127.0.0.1:0'\ninterval_s: 0.2\n"
            "samplers: {host: {enabled: false}, engines: {enabled: false}, gpu: {enabled: false}}\n"
            "discovery: {enabled: false}\n"
            "attribution: {slo_ttft_s: 1.0, settle_s: 0}\n"
            f"otlp_export: {{endpoint: 'http://127.0.0.1:{col.port}', interval_s: 1}}\n"
        )
        d = Daemon(cfg)
        loop = asyncio.new_event_loop()
        ready = threading.Event()

        def main_() -> None:
            asyncio.set_event_loop(loop)
            loop.run_until_complete(d.run(ready=ready.set))

        threading.Thread(target=main_, daemon=True).start()
        assert ready.wait(5)
        try:
            now = time.time()
            d.request_stream.submit(
                RequestRecord(
                    "llamacpp",
                    now - 3,
                    now - 1,
                    ttft_s=1.8,
                    trace_id=TRACE,
                    span_id=SPAN,
                    source="otlp",
                )
            )
            deadline = time.monotonic() + 8
            while (not col.traces or not col.metrics) and time.monotonic() < deadline:
                time.sleep(0.1)
            span = col.traces[0].resource_spans[0].scope_spans[0].spans[0]
            assert span.name == SPAN_NAME and span.parent_span_id.hex() == SPAN
            names = {m.name for m in col.metrics[-1].resource_metrics[0].scope_metrics[0].metrics}
            assert "slow_requests_total" in names
            want = 'kvpressure_otlp_exported_total{signal="traces"} 1.0'
            body = ""
            while want not in body and time.monotonic() < deadline:
                body = httpx.get(f"http://127.0.0.1:{d.bound_port}/metrics").text
                time.sleep(0.1)
            assert want in body
        finally:
            loop.call_soon_threadsafe(d.request_stop)
            time.sleep(0.5)


def test_spans_queued_for_a_hanging_exporter_at_stop_are_counted_as_dropped():
    """Issue 18, point 7: the collector accepts connections and never answers; at stop the
    spans still queued are neither sent nor lost silently."""
    pytest.importorskip("opentelemetry.exporter.otlp.proto.http")
    hang = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []

    def accept() -> None:
        with contextlib.suppress(OSError):
            while True:
                held.append(hang.accept()[0])  # never answered

    threading.Thread(target=accept, daemon=True).start()
    exp = OtlpExport(AgentState(Timeline()), endpoint=f"http://127.0.0.1:{hang.getsockname()[1]}",
                     queue_size=64, timeout_s=5.0, schedule_delay_s=0.05)  # fmt: skip
    try:
        exp.emit(attribution(TRACE, SPAN))
        deadline = time.monotonic() + 3
        while not held and time.monotonic() < deadline:  # the first batch is stuck in flight
            time.sleep(0.02)
        assert held
        for _ in range(10):
            exp.emit(attribution(TRACE, SPAN))
        queued = exp.processor.queued()
        assert queued == 10
        exp.shutdown(timeout_s=0.3)
        exported, dropped = exp.stats.snapshot()
        assert exported["traces"] == 0
        assert dropped["traces"] >= queued
    finally:
        hang.close()
        for c in held:
            c.close()
