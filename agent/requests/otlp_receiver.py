"""OTLP/HTTP trace receiver: LLM request spans in, one RequestRecord per understood span out.

Served at ``POST /v1/traces`` on the agent's own listener. Accepts the two OTLP/HTTP
encodings, ``application/x-protobuf`` (an ``ExportTraceServiceRequest``) and
``application/json`` (the OTLP JSON mapping: lowerCamelCase keys, trace and span ids as
hex strings; base64 ids are accepted too), optionally ``Content-Encoding: gzip``.

Understood spans (anything else is skipped after a look at its name and attribute keys):

* **vLLM** ``llm_request`` spans (``--otlp-traces-endpoint``): ``gen_ai.latency.time_in_queue``
  → queue, ``.time_to_first_token`` → TTFT, ``.e2e`` → end-to-end,
  ``.time_in_model_prefill`` / ``.time_in_model_decode`` → prefill / decode (seconds),
  ``gen_ai.usage.prompt_tokens`` / ``completion_tokens``, ``gen_ai.response.model`` (or
  ``gen_ai.request.model``).
* **OpenTelemetry GenAI client spans** (OpenLLMetry, OpenLIT): ``gen_ai.operation.name``
  ``chat`` / ``text_completion`` / ``generate_content`` (or OpenLLMetry's
  ``llm.request.type``); engine from ``gen_ai.provider.name`` or the older
  ``gen_ai.system``; tokens from ``gen_ai.usage.input_tokens`` / ``output_tokens`` (or the
  older ``prompt_tokens`` / ``completion_tokens``), ``gen_ai.usage.cache_read.input_tokens``;
  TTFT from ``gen_ai.response.time_to_first_chunk`` or OpenLIT's
  ``gen_ai.server.time_to_first_token``; end-to-end = span duration.
* **TGI** router spans (``generate``, ``generate_stream``, ...) carrying ``total_time``,
  ``queue_time``, ``inference_time`` as Rust ``Duration`` debug strings (``"1.234ms"``) and,
  in newer versions, ``prompt_tokens`` / ``generated_tokens``.

The engine label comes from ``otlp_receiver.service_engines`` (resource ``service.name`` →
engine), else the span's provider attribute, else the engine kind (``vllm``, ``tgi``),
bounded to :data:`~agent.requests.metrics.MAX_ENGINES` values.

One bad field never loses the record (issue 17, kind 3): a timing or token attribute that
is present but unusable (TensorRT-LLM's ``-1`` "no timing" sentinel, any negative value,
NaN, infinity, not a number, or a phase longer than the whole request: :func:`_within`)
is dropped alone, the record keeps the span's valid fields
(a dropped end-to-end time falls back to the span's duration), and the drop is counted
per attribute in ``kvpressure_otlp_span_attributes_dropped_total{attribute}``.

Answers: 200 with an ``ExportTraceServiceResponse`` in the request's encoding
(``partial_success.rejected_spans`` counts understood spans that could not be records at
all: start/end times missing or reversed, more than :data:`MAX_ATTRIBUTES_PER_SPAN`
attributes, or beyond :data:`MAX_SPANS_PER_EXPORT`; ``error_message`` also says when
attributes were dropped); 401 with ``WWW-Authenticate: Bearer`` when a bearer token is set
(``otlp_receiver.bearer_token_file``) and the export does not carry it, before any of the
body is read; 400 for undecodable bodies, 413 over ``max_body_bytes``
(compressed or not), 408 when the body takes longer than :data:`BODY_READ_TIMEOUT_S` to
arrive, 415 for other content types or encodings, 503 with ``Retry-After`` when
:data:`MAX_CONCURRENT_DECODES` exports are being decoded and :data:`MAX_WAITING_DECODES`
more wait, each with a one-line ``google.rpc.Status`` message. Nothing raised while decoding
escapes the handler. Decoding runs on worker threads, at most two at a time, so clients
sending large exports cannot take the CPU from the samplers or the event loop.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hmac
import json
import logging
import math
import re
import threading
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, Final

from kvpressure.agent import catalogue
from kvpressure.agent.httpd import Request, Response, Route, json_response, post
from kvpressure.agent.requests.metrics import MAX_ENGINES, LabelCap
from kvpressure.agent.requests.record import RequestRecord, RequestStream
from kvpressure.agent.samples import Batch, Sample

if TYPE_CHECKING:
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
        ExportTraceServiceResponse,
    )
    from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
    from opentelemetry.proto.trace.v1.trace_pb2 import Span

log = logging.getLogger(__name__)

_PROTO_LOCK = threading.Lock()
_PROTO: SimpleNamespace | None = None


def _proto() -> SimpleNamespace:
    """Protobuf and the OTLP trace messages, imported on the first export received.

    They cost ~1.5 MiB of resident memory (the message descriptors); an agent whose receiver
    is off, or that no engine sends traces to, never imports them (issue 15). Thread-safe:
    exports are decoded on worker threads.

    Returns:
        ``json_format``, ``DecodeError``, ``ExportTraceServiceRequest``,
        ``ExportTraceServiceResponse``.
    """
    global _PROTO  # noqa: PLW0603 - one import, cached for the process
    with _PROTO_LOCK:
        if _PROTO is None:
            from google.protobuf import json_format
            from google.protobuf.message import DecodeError
            from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

            _PROTO = SimpleNamespace(
                json_format=json_format,
                DecodeError=DecodeError,
                ExportTraceServiceRequest=trace_service_pb2.ExportTraceServiceRequest,
                ExportTraceServiceResponse=trace_service_pb2.ExportTraceServiceResponse,
            )
        return _PROTO


PATH = "/v1/traces"
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
PROTOBUF = "application/x-protobuf"
JSON = "application/json"

SPANS_METRIC: Final = catalogue.OTLP_SPANS_RECEIVED_TOTAL
ATTRIBUTES_DROPPED_METRIC: Final = catalogue.OTLP_SPAN_ATTRIBUTES_DROPPED_TOTAL
REQUESTS_METRIC: Final = catalogue.OTLP_REQUESTS_TOTAL

_STATUS_CODE_ERROR: Final = 2
"""OTLP ``Status.StatusCode`` ``STATUS_CODE_ERROR`` (opentelemetry/proto/trace/v1/trace.proto)."""
_GRPC_INVALID_ARGUMENT = 3
_GRPC_RESOURCE_EXHAUSTED = 8
_GRPC_UNIMPLEMENTED = 12
_GRPC_UNAVAILABLE = 14
_GRPC_UNAUTHENTICATED = 16
MAX_CONCURRENT_DECODES: Final = 2
"""Exports whose bodies are read and decoded at the same time (the rest wait their turn)."""
MAX_WAITING_DECODES: Final = 16
"""Exports waiting for a decode slot; beyond them an export is answered 503 (retryable)."""
BODY_READ_TIMEOUT_S: Final = 10.0
"""Seconds an export's body may take to arrive once its decode slot is free (408 past it)."""
MAX_SPANS_PER_EXPORT: Final = 10_000
"""Spans read from one export; the rest are rejected (``partial_success``)."""
MAX_ATTRIBUTES_PER_SPAN: Final = 512
"""A span with more attributes is rejected unread (an LLM request span has about 30)."""

_INFERENCE_OPS = frozenset({"chat", "text_completion", "generate_content", "completion"})
_LLM_REQUEST_TYPES = frozenset({"chat", "completion"})
_TGI_INNER = frozenset({"queue_time", "inference_time"})
_MAX_MODEL_LEN = 256
_ZERO_TRACE = bytes(16)
_ZERO_SPAN = bytes(8)
_RUST_DURATION = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*(ns|µs|us|ms|s)\s*$")
_RUST_UNITS = {"ns": 1e-9, "µs": 1e-6, "us": 1e-6, "ms": 1e-3, "s": 1.0}


class OtlpDecodeError(ValueError):
    """The request body is not a decodable OTLP trace export (message: one line, why)."""


class _Reject(ValueError):
    """An understood LLM span that cannot be a record at all (message: why).

    Only the span's own start/end times can reject it; an unusable attribute is dropped
    alone (see :meth:`OtlpReceiver.span_record`).
    """


@dataclass
class _Counters:
    spans: dict[str, int] = field(default_factory=dict)
    requests: dict[str, int] = field(default_factory=dict)
    attributes: dict[str, int] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, kind: str, key: str, n: int = 1) -> None:
        if n <= 0:
            return
        with self.lock:
            d = {"spans": self.spans, "attributes": self.attributes}.get(kind, self.requests)
            d[key] = d.get(key, 0) + n


# --- decoding -------------------------------------------------------------------------


def _media_type(content_type: str | None) -> str:
    return (content_type or "").split(";", 1)[0].strip().lower()


def _gunzip(body: bytes, limit: int) -> bytes:
    """Decompress a gzip body, stopping as soon as the output passes ``limit`` bytes.

    Raises:
        OtlpDecodeError: not valid gzip.
        OverflowError: the decompressed body is larger than ``limit`` bytes.
    """
    d = zlib.decompressobj(wbits=31)
    try:
        out = d.decompress(body, limit + 1)
    except zlib.error as exc:
        raise OtlpDecodeError(f"invalid gzip body: {exc}") from None
    if len(out) > limit:
        raise OverflowError(limit)
    if not d.eof:
        raise OtlpDecodeError("truncated gzip body")
    return out


def _id_to_b64(value: object, n_bytes: int) -> object:
    """Turn an OTLP-JSON hex id into the base64 the protobuf JSON parser expects.

    A string that is not ``2 * n_bytes`` hex digits is passed through unchanged, so base64
    ids (the protobuf JSON mapping) are accepted as well; empty stays empty.
    """
    if isinstance(value, str) and len(value) == 2 * n_bytes:
        try:
            raw = bytes.fromhex(value)
        except ValueError:
            return value
        return base64.b64encode(raw).decode("ascii")
    return value


def _fix_ids(doc: Any) -> None:
    """Rewrite hex trace/span ids in an OTLP JSON document in place (spans and links)."""
    if not isinstance(doc, dict):
        raise OtlpDecodeError("JSON body is not an object")
    for rs in doc.get("resourceSpans") or []:
        if not isinstance(rs, dict):
            continue
        for ss in rs.get("scopeSpans") or []:
            if not isinstance(ss, dict):
                continue
            for span in ss.get("spans") or []:
                if not isinstance(span, dict):
                    continue
                for key, n in (("traceId", 16), ("spanId", 8), ("parentSpanId", 8)):
                    if key in span:
                        span[key] = _id_to_b64(span[key], n)
                for link in span.get("links") or []:
                    if isinstance(link, dict):
                        for key, n in (("traceId", 16), ("spanId", 8)):
                            if key in link:
                                link[key] = _id_to_b64(link[key], n)


def decode(body: bytes, media_type: str) -> ExportTraceServiceRequest:
    """Decode an (already decompressed) OTLP/HTTP trace body.

    Args:
        body: the request body.
        media_type: ``application/x-protobuf`` or ``application/json``.

    Returns:
        The decoded ``ExportTraceServiceRequest``.

    Raises:
        OtlpDecodeError: the body does not decode in that encoding.
    """
    pb = _proto()
    req: ExportTraceServiceRequest = pb.ExportTraceServiceRequest()
    if media_type == PROTOBUF:
        try:
            req.ParseFromString(body)
        except (pb.DecodeError, RuntimeError, ValueError) as exc:
            raise OtlpDecodeError(f"invalid protobuf body: {_no_data(str(exc))}") from None
        return req
    try:
        doc = json.loads(body)
    except json.JSONDecodeError as exc:
        where = f"line {exc.lineno} column {exc.colno}"
        raise OtlpDecodeError(f"invalid JSON body: {_no_data(exc.msg)} at {where}") from None
    except UnicodeDecodeError as exc:
        raise OtlpDecodeError(f"invalid JSON body: not UTF-8 at byte {exc.start}") from None
    except (ValueError, RecursionError) as exc:
        raise OtlpDecodeError(f"invalid JSON body: {type(exc).__name__}") from None
    _fix_ids(doc)
    try:
        pb.json_format.ParseDict(doc, req, ignore_unknown_fields=True)
    except (pb.json_format.ParseError, ValueError, TypeError, RecursionError) as exc:
        # protobuf's message quotes the offending value (client data): name the field only
        path = ".".join(_FIELD_IN_ERROR.findall(str(exc))) or "(top level)"
        raise OtlpDecodeError(f"invalid OTLP JSON: bad value at {path[:120]}") from None
    return req


_FIELD_IN_ERROR = re.compile(r"Failed to parse (\w{1,64}) field")
_ERROR_TEXT = re.compile(r"[^A-Za-z0-9 _.,()-]")


def _no_data(message: str, limit: int = 80) -> str:
    """A decoder's message cut before any quoted or ``:``-introduced detail, capped."""
    head = re.split(r"[:'\"]", message, maxsplit=1)[0]
    return " ".join(_ERROR_TEXT.sub(" ", head).split())[:limit]


# --- attribute helpers ----------------------------------------------------------------


def _value(v: AnyValue) -> Any:
    kind = v.WhichOneof("value")
    if kind == "string_value":
        return v.string_value
    if kind == "int_value":
        return v.int_value
    if kind == "double_value":
        return v.double_value
    if kind == "bool_value":
        return v.bool_value
    return None  # arrays, kvlists, bytes: never needed here


def _attrs(kvs: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    kv: KeyValue
    for kv in kvs:
        out[kv.key] = _value(kv.value)
    return out


def _seconds(attrs: Mapping[str, Any], key: str, dropped: list[str]) -> float | None:
    """A duration attribute in seconds (number, or numeric string), or None.

    A value that is present but unusable (not a number, negative such as TensorRT-LLM's
    ``-1`` "no timing" sentinel, NaN or infinite) is dropped: None is returned and ``key``
    is appended to ``dropped``; the rest of the span is kept.
    """
    if key not in attrs or attrs[key] is None:
        return None
    v = attrs[key]
    try:
        f = float(v)
    except (TypeError, ValueError, OverflowError):
        dropped.append(key)
        return None
    if isinstance(v, bool) or not math.isfinite(f) or f < 0:
        dropped.append(key)
        return None
    return f


def _rust_duration(attrs: Mapping[str, Any], key: str, dropped: list[str]) -> float | None:
    """A TGI duration attribute (Rust ``Duration`` debug string such as ``"12.5ms"``) in s.

    A value that is present but not in that format (nor a usable number) is dropped: None,
    and ``key`` appended to ``dropped``.
    """
    v = attrs.get(key)
    if v is None:
        return None
    if isinstance(v, int | float) and not isinstance(v, bool):
        return _seconds(attrs, key, dropped)
    m = _RUST_DURATION.match(str(v))
    if not m:
        dropped.append(key)
        return None
    return float(m.group(1)) * _RUST_UNITS[m.group(2)]


def _within(
    value: float | None, key: str, limit: float, dropped: list[str], share: float = 0.01
) -> float | None:
    """``value`` unless it cannot be a part of a request lasting ``limit`` seconds.

    A phase longer than the whole request (a TTFT or queue time above the end-to-end time,
    an end-to-end time far above the span's own duration, e.g. an unsigned ``-1`` read as
    1.8e19 ns) cannot be true: it is dropped (``key`` appended to ``dropped``). The
    tolerance is ``share`` of ``limit`` plus 10 ms (clocks and rounding; 1 s more for
    ``share`` >= 0.1, the end-to-end time against the span).
    """
    if value is None:
        return None
    slack = limit * share + (1.0 if share >= 0.1 else 0.01)
    if value > limit + slack:
        dropped.append(key)
        return None
    return value


def _tokens(attrs: Mapping[str, Any], dropped: list[str], *keys: str) -> int | None:
    """The first of ``keys`` present with a usable token count (int, or integral string).

    A key present with an unusable value (negative, fractional, not a number) is dropped
    (appended to ``dropped``) and the next key is tried.
    """
    for key in keys:
        v = attrs.get(key)
        if v is None:
            continue
        if isinstance(v, bool) or (isinstance(v, float) and not v.is_integer()):
            dropped.append(key)
            continue
        try:
            n = int(v)
        except (TypeError, ValueError, OverflowError):
            dropped.append(key)
            continue
        if n < 0:
            dropped.append(key)
            continue
        return n
    return None


def _text(attrs: Mapping[str, Any], *keys: str) -> str | None:
    for key in keys:
        v = attrs.get(key)
        if isinstance(v, str) and v:
            return v[:_MAX_MODEL_LEN]
    return None


def _hex_id(raw: bytes, n_bytes: int, zero: bytes) -> str | None:
    if len(raw) != n_bytes or raw == zero:
        return None
    return binascii.hexlify(raw).decode("ascii")


def _span_outcome(span: Span, attrs: Mapping[str, Any]) -> tuple[str, str | None]:
    """``(outcome, error_type)`` from the span status, ``error.type`` and HTTP status."""
    error_type = _text(attrs, "error.type")
    reasons = attrs.get("gen_ai.response.finish_reasons")
    if isinstance(reasons, str) and "abort" in reasons:
        return "cancelled", error_type
    http_status = attrs.get("http.response.status_code", attrs.get("http.status_code"))
    failed = span.status.code == _STATUS_CODE_ERROR or error_type is not None
    if not failed and not (isinstance(http_status, int) and http_status >= 400):
        return "ok", None
    low = (error_type or "").lower() + " " + span.status.message[:512].lower()
    if "context_length" in low or "exceed_context" in low or "maximum context length" in low:
        return "context_exceeded", error_type
    if "context size has been exceeded" in low:
        return "kv_exhausted", error_type
    if isinstance(http_status, int) and 400 <= http_status < 500:
        return "client_error", error_type
    return "server_error", error_type


# --- the receiver ---------------------------------------------------------------------


class OtlpReceiver:
    """Turns OTLP trace exports into RequestRecords.

    Thread-safe: :meth:`export` may run on a worker thread while the loop serves requests.

    Args:
        stream: where records go.
        max_body_bytes: largest accepted body, compressed and decompressed (413 above).
        service_engines: resource ``service.name`` → ``engine`` label.
        enabled: when False the route answers 404.
        max_engines: most distinct engine labels this receiver produces.
        bearer_token: when set, an export must carry ``Authorization: Bearer <token>``
            (compared in constant time); others get a 401 with ``WWW-Authenticate: Bearer``,
            counted ``kvpressure_otlp_requests_total{result="unauthorized"}``, before their
            body is read.
    """

    def __init__(
        self,
        stream: RequestStream,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        service_engines: Mapping[str, str] | None = None,
        enabled: bool = True,
        max_engines: int = MAX_ENGINES,
        bearer_token: bytes | None = None,
    ) -> None:
        self._stream = stream
        self.bearer_token = bearer_token
        self.max_body_bytes = max_body_bytes
        self.service_engines: dict[str, str] = dict(service_engines or {})
        self.enabled = enabled
        self._engines = LabelCap(max_engines)
        self._c = _Counters()
        self._warned: set[str] = set()
        # At most MAX_CONCURRENT_DECODES bodies read and decoded at once, and a bounded
        # number of exports waiting for their turn (more are answered 503 Retry-After).
        self._decoding = asyncio.Semaphore(MAX_CONCURRENT_DECODES)
        self._queued = 0

    def configure(
        self,
        enabled: bool,
        max_body_bytes: int,
        service_engines: Mapping[str, str],
        bearer_token: bytes | None = None,
    ) -> None:
        """Apply new settings (config reload); counters and the engine set are kept."""
        self.enabled = enabled
        self.max_body_bytes = max_body_bytes
        self.service_engines = dict(service_engines)
        self.bearer_token = bearer_token

    def authorized(self, header: str) -> bool:
        """True when no token is set or ``header`` is ``Bearer <token>`` (constant time)."""
        token = self.bearer_token
        if token is None:
            return True
        scheme, _, value = header.partition(" ")
        given = value.strip().encode("utf-8", "replace")
        return scheme.lower() == "bearer" and hmac.compare_digest(given, token)

    def routes(self) -> list[Route]:
        """The receiver's route on the agent's listener (``POST /v1/traces``)."""
        return [post(PATH, self.handle)]

    # ---- span → record ---------------------------------------------------------------
    def _engine(self, service: str | None, attrs: Mapping[str, Any], default: str) -> str:
        name = self.service_engines.get(service or "") if service else None
        if name is None:
            name = _text(attrs, "gen_ai.provider.name", "gen_ai.system") or default
        return self._engines(name)

    def span_record(
        self, span: Span, service: str | None, dropped: list[str] | None = None
    ) -> RequestRecord | None:
        """The record of one span, or None when the span is not an LLM request span.

        One bad attribute never loses the record: a timing or token attribute that is
        present but unusable (``-1`` sentinels, negative, NaN, infinite, not a number) is
        left out of the record (absent, not 0) and its key appended to ``dropped``; an
        end-to-end time that is dropped falls back to the span's own duration.

        Args:
            span: the OTLP span.
            service: the resource's ``service.name``, if any.
            dropped: receives the keys of the attributes dropped (may be None).

        Raises:
            _Reject: the span's start/end times are missing or reversed, or it has more than
                :data:`MAX_ATTRIBUTES_PER_SPAN` attributes (no record at all).
        """
        if len(span.attributes) > MAX_ATTRIBUTES_PER_SPAN:
            raise _Reject(f"more than {MAX_ATTRIBUTES_PER_SPAN} attributes")
        bad: list[str] = [] if dropped is None else dropped
        keys = {kv.key for kv in span.attributes}
        if span.name == "llm_request" or "gen_ai.latency.e2e" in keys:
            kind = "vllm"
        elif "total_time" in keys and not keys.isdisjoint(_TGI_INNER):
            kind = "tgi"
        elif "gen_ai.operation.name" in keys or "llm.request.type" in keys:
            kind = "genai"
        else:
            return None
        attrs = _attrs(span.attributes)
        if kind == "genai":
            op = attrs.get("gen_ai.operation.name")
            if op is None:
                op = attrs.get("llm.request.type")
                if op not in _LLM_REQUEST_TYPES:
                    return None
            elif op not in _INFERENCE_OPS:
                return None
        start_ns, end_ns = span.start_time_unix_nano, span.end_time_unix_nano
        if start_ns <= 0 or end_ns < start_ns:
            raise _Reject("start/end time missing or end before start")
        start, end = start_ns / 1e9, end_ns / 1e9
        outcome, error_type = _span_outcome(span, attrs)
        common: dict[str, Any] = {
            "start": start,
            "end": end,
            "outcome": outcome,
            "error_type": error_type,
            "source": "otlp",
            "trace_id": _hex_id(span.trace_id, 16, _ZERO_TRACE),
            "span_id": _hex_id(span.span_id, 8, _ZERO_SPAN),
            "model": _text(attrs, "gen_ai.response.model", "gen_ai.request.model"),
        }
        span_s = end - start
        if kind == "vllm":
            e2e = _within(
                _seconds(attrs, "gen_ai.latency.e2e", bad), "gen_ai.latency.e2e", span_s, bad, 0.1
            )
            total = e2e if e2e is not None else span_s

            def part(key: str) -> float | None:
                return _within(_seconds(attrs, key, bad), key, total, bad)

            return RequestRecord(
                engine=self._engine(service, attrs, "vllm"),
                ttft_s=part("gen_ai.latency.time_to_first_token"),
                e2e_s=total,
                queue_s=part("gen_ai.latency.time_in_queue"),
                prefill_s=part("gen_ai.latency.time_in_model_prefill"),
                decode_s=part("gen_ai.latency.time_in_model_decode"),
                input_tokens=_tokens(
                    attrs, bad, "gen_ai.usage.prompt_tokens", "gen_ai.usage.input_tokens"
                ),
                output_tokens=_tokens(
                    attrs, bad, "gen_ai.usage.completion_tokens", "gen_ai.usage.output_tokens"
                ),
                **common,
            )
        if kind == "tgi":
            tgi_total = _within(
                _rust_duration(attrs, "total_time", bad), "total_time", span_s, bad, 0.1
            )
            total = tgi_total if tgi_total is not None else span_s
            return RequestRecord(
                engine=self._engine(service, attrs, "tgi"),
                e2e_s=total,
                queue_s=_within(_rust_duration(attrs, "queue_time", bad), "queue_time", total, bad),
                input_tokens=_tokens(attrs, bad, "prompt_tokens"),
                output_tokens=_tokens(attrs, bad, "generated_tokens"),
                **common,
            )
        ttft = None
        for key in ("gen_ai.response.time_to_first_chunk", "gen_ai.server.time_to_first_token"):
            ttft = _within(_seconds(attrs, key, bad), key, span_s, bad)
            if ttft is not None:
                break
        return RequestRecord(
            engine=self._engine(service, attrs, "unknown"),
            ttft_s=ttft,
            e2e_s=span_s,
            input_tokens=_tokens(
                attrs, bad, "gen_ai.usage.input_tokens", "gen_ai.usage.prompt_tokens"
            ),
            output_tokens=_tokens(
                attrs, bad, "gen_ai.usage.output_tokens", "gen_ai.usage.completion_tokens"
            ),
            cached_tokens=_tokens(attrs, bad, "gen_ai.usage.cache_read.input_tokens"),
            **common,
        )

    def export(self, req: ExportTraceServiceRequest) -> ExportTraceServiceResponse:
        """Turn every understood span of ``req`` into a record and submit it.

        Returns:
            The response to send; ``partial_success`` is set when spans were rejected.
        """
        recorded = ignored = rejected = over = 0
        first_reason = ""
        dropped: list[str] = []
        for rs in req.resource_spans:
            service: str | None = None
            for kv in rs.resource.attributes:
                if kv.key == "service.name":
                    service = kv.value.string_value or None
                    break
            for ss in rs.scope_spans:
                for span in ss.spans:
                    if recorded + ignored + rejected >= MAX_SPANS_PER_EXPORT:
                        over += 1
                        continue
                    try:
                        record = self.span_record(span, service, dropped)
                    except _Reject as exc:
                        rejected += 1
                        first_reason = first_reason or f"span {span.name!r}: {exc}"
                        continue
                    if record is None:
                        ignored += 1
                        continue
                    self._stream.submit(record)
                    recorded += 1
        self._c.add("spans", "record", recorded)
        self._c.add("spans", "ignored", ignored)
        if over:
            rejected += over
            first_reason = first_reason or f"more than {MAX_SPANS_PER_EXPORT} spans in one export"
        self._c.add("spans", "rejected", rejected)
        for key in dropped:
            self._c.add("attributes", key)
            if f"attr:{key}" not in self._warned:
                self._warned.add(f"attr:{key}")
                log.warning(
                    "OTLP span attribute %s has an unusable value (negative, -1 sentinel, "
                    "NaN, infinite or not a number); dropped, the span is kept",
                    key,
                )
        resp: ExportTraceServiceResponse = _proto().ExportTraceServiceResponse()
        if rejected:
            resp.partial_success.rejected_spans = rejected
            resp.partial_success.error_message = (
                f"{rejected} LLM request span(s) rejected; first: {first_reason}"
            )[:512]
        elif dropped:  # a warning: every span was accepted, some attributes were not
            resp.partial_success.error_message = (
                f"{len(dropped)} span attribute(s) with unusable values dropped; "
                f"first: {dropped[0]}"
            )[:512]
        return resp

    # ---- HTTP ------------------------------------------------------------------------
    def _error(self, status: int, code: int, msg: str, media: str, result: str) -> Response:
        self._c.add("requests", result)
        level = logging.WARNING if result not in self._warned else logging.DEBUG
        self._warned.add(result)
        log.log(level, "OTLP export refused", extra={"kv": {"status": status, "error": msg}})
        if media == JSON:
            return json_response({"code": code, "message": msg}, status=status)
        return Response(_status_pb(code, msg), status=status, content_type=PROTOBUF)

    async def _read_body(self, request: Request) -> bytes | None:
        """The raw body, or None when it is longer than ``max_body_bytes``."""
        limit = self.max_body_bytes
        if request.content_length is not None and request.content_length > limit:
            return None
        chunks: list[bytes] = []
        size = 0
        while True:
            chunk = await request.content.read(65536)
            if not chunk:
                return b"".join(chunks)
            size += len(chunk)
            if size > limit:
                return None
            chunks.append(chunk)

    async def handle(self, request: Request) -> Response:
        """``POST /v1/traces``: decode, turn spans into records, answer (see module doc)."""
        if not self.enabled:
            return Response(text="OTLP receiver disabled (otlp_receiver.enabled)\n", status=404)
        media = _media_type(request.headers.get("Content-Type"))
        if not self.authorized(request.headers.get("Authorization", "")):
            unauthorized = self._error(
                401,
                _GRPC_UNAUTHENTICATED,
                "missing or wrong bearer token (otlp_receiver.bearer_token_file)",
                JSON if media == JSON else PROTOBUF,
                "unauthorized",
            )
            unauthorized.headers["WWW-Authenticate"] = 'Bearer realm="kvpressure"'
            return unauthorized
        if media not in (PROTOBUF, JSON):
            return self._error(
                415,
                _GRPC_UNIMPLEMENTED,
                f"unsupported Content-Type {media or '(none)'!r}; use {PROTOBUF} or {JSON}",
                PROTOBUF,
                "unsupported_media_type",
            )
        encoding = request.headers.get("Content-Encoding", "identity").strip().lower()
        if encoding not in ("identity", "gzip", ""):
            return self._error(
                415,
                _GRPC_UNIMPLEMENTED,
                f"unsupported Content-Encoding {encoding!r}; use gzip or none",
                media,
                "unsupported_media_type",
            )
        if self._queued >= MAX_CONCURRENT_DECODES + MAX_WAITING_DECODES:
            busy = self._error(
                503,
                _GRPC_UNAVAILABLE,
                f"busy: {MAX_CONCURRENT_DECODES} exports are being decoded; retry later",
                media,
                "busy",
            )
            busy.headers["Retry-After"] = "1"
            return busy
        self._queued += 1
        try:
            async with self._decoding:
                return await self._receive(request, media, encoding)
        finally:
            self._queued -= 1

    async def _receive(self, request: Request, media: str, encoding: str) -> Response:
        too_large = f"body larger than otlp_receiver.max_body_bytes ({self.max_body_bytes})"
        try:
            async with asyncio.timeout(BODY_READ_TIMEOUT_S):
                body = await self._read_body(request)
        except TimeoutError:
            # A body dripped in slowly must not hold a decode slot: 408, and the client
            # may retry (the OTLP exporters do).
            msg = f"body not received within {BODY_READ_TIMEOUT_S:g} s"
            return self._error(408, _GRPC_UNAVAILABLE, msg, media, "read_timeout")
        except Exception as exc:  # noqa: BLE001 - reset, truncated or undecodable upload
            msg = f"cannot read body: {type(exc).__name__}"
            return self._error(400, _GRPC_INVALID_ARGUMENT, msg, media, "bad_request")
        if body is None:
            return self._error(413, _GRPC_RESOURCE_EXHAUSTED, too_large, media, "too_large")
        try:
            resp = await asyncio.to_thread(self._decode_and_export, body, media, encoding)
        except OverflowError:
            return self._error(413, _GRPC_RESOURCE_EXHAUSTED, too_large, media, "too_large")
        except OtlpDecodeError as exc:
            msg = " ".join(str(exc).split())[:200]  # built from our own words only
            return self._error(400, _GRPC_INVALID_ARGUMENT, msg, media, "bad_request")
        except Exception as exc:  # noqa: BLE001 - a malformed export must never escape
            msg = f"cannot process export: {type(exc).__name__}"
            return self._error(400, _GRPC_INVALID_ARGUMENT, msg, media, "bad_request")
        self._c.add("requests", "partial" if resp.partial_success.rejected_spans else "ok")
        if media == JSON:
            text = _proto().json_format.MessageToJson(resp, indent=None)
            return Response(text=text, content_type=JSON)
        return Response(resp.SerializeToString(), content_type=PROTOBUF)

    def _decode_and_export(
        self, body: bytes, media: str, encoding: str
    ) -> ExportTraceServiceResponse:
        # A body without the gzip magic was already inflated by an HTTP server in front of
        # the receiver; the read limit then bounded it already.
        if encoding == "gzip" and body[:2] == b"\x1f\x8b":
            body = _gunzip(body, self.max_body_bytes)
        return self.export(decode(body, media))

    # ---- self metrics ----------------------------------------------------------------
    def checks_itself(self, request: Request) -> bool:
        """True for ``/v1/traces`` while a bearer token is set (web-config auth exemption)."""
        return request.path == PATH and self.bearer_token is not None

    def health_samples(self) -> list[Sample]:
        """The receiver's counters (:meth:`add_samples`), rendered with the agent's own."""
        batch = Batch()
        self.add_samples(batch)
        return batch.samples

    def add_samples(self, batch: Batch) -> None:
        """Add the receiver's counters to ``batch``.

        ``kvpressure_otlp_requests_total{result}``,
        ``kvpressure_otlp_spans_received_total{result}`` and
        ``kvpressure_otlp_span_attributes_dropped_total{attribute}`` (the attribute keys are
        the receiver's own fixed set, so the label is bounded).
        """
        with self._c.lock:
            requests = sorted(self._c.requests.items())
            spans = sorted(self._c.spans.items())
            attributes = sorted(self._c.attributes.items())
        for key, n in attributes:
            batch.add(ATTRIBUTES_DROPPED_METRIC, n, attribute=key)
        for result, n in requests:
            batch.add(REQUESTS_METRIC, n, result=result)
        for result, n in spans:
            batch.add(SPANS_METRIC, n, result=result)


def _status_pb(code: int, message: str) -> bytes:
    """Encode a ``google.rpc.Status`` (fields 1: code, 2: message) without its package."""
    msg = message.encode("utf-8")[:1024]
    out = bytearray(b"\x08")
    out += _varint(code)
    out += b"\x12" + _varint(len(msg)) + msg
    return bytes(out)


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


__all__ = ["PATH", "OtlpDecodeError", "OtlpReceiver", "decode"]
