"""Streaming reverse proxy that times every inference request it forwards.

One :class:`RequestProxy` per ``proxies:`` entry listens on ``listen`` and forwards every
request to ``upstream``: method, path, query, headers (less hop-by-hop ones) and body
(small bodies in one piece, larger or chunked ones streamed); the response is passed back
chunk by chunk as it arrives (SSE and chunked bodies are never buffered, bytes are not
re-encoded: ``auto_decompress`` is off).

For inference paths (``POST`` to ``/v1/chat/completions``, ``/v1/completions``,
``/completion``, ``/v1/responses``, ``/v1/messages``, ``/infill``, ``/generate``,
``/generate_stream``, ``/api/generate``, ``/api/chat``) it submits one
:class:`~agent.requests.record.RequestRecord` with:

* ``upstream_connect_s``: the TCP connect to the upstream this request waited for (absent
  when it was sent on a kept-alive or pre-opened connection, see :class:`UpstreamConnector`),
* ``ttft_s``: arrival of the first content-bearing chunk (SSE ``data:`` event, or NDJSON
  line, with non-empty ``choices[].delta.content`` / ``reasoning_content`` / ``tool_calls``,
  ``choices[].text``, llama.cpp ``content``, TGI ``token.text``, Ollama ``response`` /
  ``message.content``), from the request's arrival at the proxy,
* ``itl_s``: gaps between successive network chunks that carried content,
* ``e2e_s``, ``status``, ``outcome``, ``error_type``,
* tokens from OpenAI ``usage`` (``prompt_tokens``, ``completion_tokens``,
  ``prompt_tokens_details.cached_tokens``), else llama.cpp ``timings`` (``prompt_n`` +
  ``cache_n``, ``predicted_n``, ``cache_n``) or Ollama's final line (``prompt_eval_count``,
  ``eval_count``); prefill/decode time from ``timings.prompt_ms`` / ``predicted_ms`` (or
  Ollama's ``prompt_eval_duration`` / ``eval_duration``, ns).

Outcomes: ``ok``; ``client_error`` / ``server_error`` by status; ``context_exceeded`` when
the engine says the prompt does not fit (llama.cpp 400 ``exceed_context_size_error``,
vLLM/OpenAI "maximum context length"); ``kv_exhausted`` when a shared KV pool filled
(llama.cpp 500 ``"Context size has been exceeded."``, as the body or, on a stream already
answered 200, as an SSE ``data: {"error": ...}`` event); ``upstream_down`` (a quick 502
when the upstream refuses or does not accept the connection within
``connect_timeout_s``); ``cancelled`` (the client went away: the upstream request is
closed too, so the engine stops generating).

Only the small JSON framing of each event is parsed, for booleans and numbers; prompt and
completion text is never stored or logged. Other paths (``/health``, ``/metrics``,
``/slots``, ...) pass through without a record.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import logging
import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import aiohttp
from aiohttp import ClientRequest, web
from multidict import CIMultiDict, CIMultiDictProxy
from yarl import URL

from kvpressure.agent.httpd import IDLE_TIMEOUT_S, MAX_CONNECTIONS
from kvpressure.agent.listener import BoundedSite, ConnectionCap, ServerLog
from kvpressure.agent.requests.record import MAX_ITL_GAPS, Outcome, RequestRecord, RequestStream

if TYPE_CHECKING:
    from aiohttp.client_proto import ResponseHandler
    from aiohttp.client_reqrep import ConnectionKey

log = logging.getLogger(__name__)

INFERENCE_PATH = re.compile(
    r"^/(?:v1/)?(?:chat/completions|completions|completion|responses|messages|infill)$"
    r"|^/(?:generate|generate_stream|api/generate|api/chat)$"
)
"""Paths whose POSTs are inference requests (timed and recorded)."""

HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
    }
)
"""Headers that describe one connection and are never forwarded (RFC 9110 section 7.6.1)."""

_DROP_REQUEST = HOP_BY_HOP | {"host", "expect", "content-length"}
_DROP_RESPONSE = HOP_BY_HOP | {"content-length", "date", "server"}

INLINE_BODY_MAX = 1 << 20
"""Request bodies up to this size (with a Content-Length) are read whole and sent in one
write; larger or chunked ones are streamed."""

MAX_LINE_BYTES = 1 << 20
"""A longer SSE/NDJSON line is skipped, not parsed (its bytes are still forwarded)."""

MAX_JSON_BYTES = 4 << 20
"""Largest non-streamed JSON response kept to read ``usage``/``timings``/``error`` from."""

KEEPALIVE_S = 4.0
"""Longest a kept-alive or pre-opened upstream connection waits unused before the proxy
closes it; below the idle timeouts of llama.cpp and uvicorn (5 s), so the proxy does not
send a request on a connection the engine is just closing."""

CLOSE_GRACE_S = 0.5
"""Requests still in flight this long after :meth:`RequestProxy.close` began are cut (the
agent's stop must not wait for long streams; a reload drains them first, see
:meth:`RequestProxy.drain`)."""

DOWN_LOG_EVERY_S = 10.0
"""While the upstream stays unreachable, one warning per this many seconds (with the count
of the failures not logged since), not one per request."""

_ERROR_BODY = (
    b'{"error":{"code":502,"message":"kvpressure proxy: upstream unavailable",'
    b'"type":"upstream_down"}}'
)
_TARGET_ERROR_BODY = (
    b'{"error":{"code":400,"message":"kvpressure proxy: the request target must be a path",'
    b'"type":"invalid_request_error"}}'
)


# --- response observation ---------------------------------------------------------------


def _int(v: object) -> int | None:
    if isinstance(v, bool):
        return None
    if isinstance(v, int) and v >= 0:
        return v
    if isinstance(v, float) and v >= 0 and v.is_integer():
        return int(v)
    return None


def _float(v: object) -> float | None:
    if isinstance(v, bool):
        return None
    if isinstance(v, int | float) and v >= 0:
        return float(v)
    return None


def _has_content(obj: dict[str, Any]) -> bool:
    """True when a streamed event carries generated text (not just role/usage framing)."""
    choices = obj.get("choices")
    if isinstance(choices, list):
        for c in choices:
            if not isinstance(c, dict):
                continue
            d = c.get("delta")
            if isinstance(d, dict) and (
                d.get("content")
                or d.get("reasoning_content")
                or d.get("reasoning")
                or d.get("tool_calls")
            ):
                return True
            if c.get("text"):
                return True
        return False
    if obj.get("content"):  # llama.cpp /completion
        return True
    tok = obj.get("token")  # TGI generate_stream
    if isinstance(tok, dict):
        return bool(tok.get("text")) and not tok.get("special")
    if obj.get("response"):  # Ollama /api/generate
        return True
    msg = obj.get("message")  # Ollama /api/chat
    if isinstance(msg, dict) and msg.get("content"):
        return True
    typ = obj.get("type")  # OpenAI Responses API, Anthropic messages
    if typ == "response.output_text.delta" and obj.get("delta"):
        return True
    if typ == "content_block_delta":
        d = obj.get("delta")
        return isinstance(d, dict) and bool(d.get("text") or d.get("partial_json"))
    return False


class Observer:
    """Reads timing and token framing out of a response body as it streams past.

    Feed every chunk with its arrival time (monotonic seconds); only JSON framing is
    parsed and only numbers, booleans and the engine's error type are kept.

    Args:
        mode: ``sse`` (``text/event-stream``), ``ndjson`` (``application/x-ndjson``) or
            ``json`` (one JSON document, kept up to :data:`MAX_JSON_BYTES`).
    """

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.first_content: float | None = None
        self.last_content: float | None = None
        self.gaps: list[float] = []
        self.model: str | None = None
        self.input_tokens: int | None = None
        self.output_tokens: int | None = None
        self.cached_tokens: int | None = None
        self.prefill_s: float | None = None
        self.decode_s: float | None = None
        self.error_type: str | None = None
        self.error_outcome: Outcome | None = None
        self._usage: dict[str, Any] | None = None
        self._timings: dict[str, Any] | None = None
        self._ollama: dict[str, Any] | None = None
        self._tgi_generated: int | None = None
        self._buf = bytearray()
        self._skip_line = False
        self._json_over = False

    def feed(self, chunk: bytes, t: float) -> None:
        """Observe one network chunk that arrived at monotonic time ``t``."""
        if self.mode == "json":
            if not self._json_over:
                if len(self._buf) + len(chunk) > MAX_JSON_BYTES:
                    self._json_over = True
                    self._buf.clear()
                else:
                    self._buf += chunk
            return
        content = False
        start = 0
        while True:
            nl = chunk.find(b"\n", start)
            if nl < 0:
                rest = chunk[start:]
                if not self._skip_line:
                    if len(self._buf) + len(rest) > MAX_LINE_BYTES:
                        self._skip_line = True
                        self._buf.clear()
                    else:
                        self._buf += rest
                break
            piece = chunk[start:nl]
            start = nl + 1
            if self._skip_line:
                self._skip_line = False
                self._buf.clear()
                continue
            if self._buf:
                self._buf += piece
                line = bytes(self._buf)
                self._buf.clear()
            else:
                line = piece
            if len(line) <= MAX_LINE_BYTES:
                content = self._line(line) or content
        if content:
            if self.first_content is None:
                self.first_content = t
            elif self.last_content is not None and len(self.gaps) < MAX_ITL_GAPS:
                self.gaps.append(t - self.last_content)
            self.last_content = t

    def _line(self, line: bytes) -> bool:
        """Handle one complete line; True when it carried generated content."""
        line = line.strip()
        if not line:
            return False
        if self.mode == "sse":
            if line.startswith(b"data:"):
                payload = line[5:].strip()
            elif line.startswith(b"error:"):  # older llama.cpp streams errors this way
                payload = line[6:].strip()
            else:
                return False  # event:, id:, retry:, comments
            if not payload or payload == b"[DONE]":
                return False
        else:
            payload = line
        try:
            obj = json.loads(payload)
        except (ValueError, RecursionError):
            return False
        if not isinstance(obj, dict):
            return False
        self._meta(obj)
        return _has_content(obj)

    def _meta(self, obj: dict[str, Any]) -> None:
        """Keep model, usage, timings and the error type of one event or document."""
        if self.model is None:
            m = obj.get("model")
            if isinstance(m, str) and m:
                self.model = m[:256]
        err = obj.get("error")
        if err is not None:
            self._error(err)
        u = obj.get("usage")
        if isinstance(u, dict):
            self._usage = u
        t = obj.get("timings")
        if isinstance(t, dict):
            self._timings = t
        if obj.get("done") is True:  # Ollama's final line
            self._ollama = obj
        details = obj.get("details")  # TGI's final event
        if isinstance(details, dict):
            self._tgi_generated = _int(details.get("generated_tokens"))
        resp = obj.get("response")  # OpenAI Responses API: usage sits on the response
        if isinstance(resp, dict) and isinstance(resp.get("usage"), dict):
            self._usage = resp["usage"]

    def _error(self, err: object) -> None:
        etype: str | None = None
        message = ""
        code: object = None
        if isinstance(err, dict):
            t = err.get("type")
            etype = t[:64] if isinstance(t, str) and t else None
            m = err.get("message")
            message = m[:512] if isinstance(m, str) else ""
            code = err.get("code")
        elif isinstance(err, str):
            message = err[:512]
        self.error_type = etype or self.error_type or "error"
        self.error_outcome = classify_error(etype, message, code)

    def finish(self) -> None:
        """Parse a kept JSON document and settle tokens and times (call once, at the end)."""
        if self.mode == "json" and self._buf and not self._json_over:
            try:
                obj = json.loads(bytes(self._buf))
            except (ValueError, RecursionError):
                obj = None
            self._buf.clear()
            if isinstance(obj, dict):
                self._meta(obj)
        u, t, o = self._usage, self._timings, self._ollama
        if u is not None:
            self.input_tokens = _int(u.get("prompt_tokens", u.get("input_tokens")))
            self.output_tokens = _int(u.get("completion_tokens", u.get("output_tokens")))
            details = u.get("prompt_tokens_details", u.get("input_tokens_details"))
            if isinstance(details, dict):
                self.cached_tokens = _int(details.get("cached_tokens"))
        if t is not None:
            prompt_n, cache_n = _int(t.get("prompt_n")), _int(t.get("cache_n"))
            if self.input_tokens is None and prompt_n is not None:
                self.input_tokens = prompt_n + (cache_n or 0)
            if self.output_tokens is None:
                self.output_tokens = _int(t.get("predicted_n"))
            if self.cached_tokens is None:
                self.cached_tokens = cache_n
            ms = _float(t.get("prompt_ms"))
            self.prefill_s = ms / 1000.0 if ms is not None else None
            ms = _float(t.get("predicted_ms"))
            self.decode_s = ms / 1000.0 if ms is not None else None
        if o is not None:
            if self.input_tokens is None:
                self.input_tokens = _int(o.get("prompt_eval_count"))
            if self.output_tokens is None:
                self.output_tokens = _int(o.get("eval_count"))
            ns = _float(o.get("prompt_eval_duration"))
            if self.prefill_s is None and ns is not None:
                self.prefill_s = ns / 1e9
            ns = _float(o.get("eval_duration"))
            if self.decode_s is None and ns is not None:
                self.decode_s = ns / 1e9
        if self.output_tokens is None:
            self.output_tokens = self._tgi_generated


def classify_error(error_type: str | None, message: str, code: object = None) -> Outcome:
    """Map an engine's error to an outcome.

    Args:
        error_type: the error's ``type`` field (llama.cpp ``exceed_context_size_error``,
            ``server_error``; OpenAI ``invalid_request_error``).
        message: the error's ``message`` (matched, never stored).
        code: the error's ``code`` field (llama.cpp repeats the HTTP status there).

    Returns:
        ``context_exceeded``, ``kv_exhausted``, ``client_error`` or ``server_error``.
    """
    low = message.lower()
    et = (error_type or "").lower()
    if (
        et == "exceed_context_size_error"
        or "context_length_exceeded" in et
        or "maximum context length" in low
    ):
        return "context_exceeded"
    if "context size has been exceeded" in low:
        return "kv_exhausted"
    if isinstance(code, int) and not isinstance(code, bool) and 400 <= code < 500:
        return "client_error"
    return "server_error"


def _mode(content_type: str, content_encoding: str) -> str | None:
    if content_encoding and content_encoding.lower() != "identity":
        return None  # compressed: time chunks, parse nothing
    media = content_type.split(";", 1)[0].strip().lower()
    if media == "text/event-stream":
        return "sse"
    if media in ("application/x-ndjson", "application/jsonl", "application/json-seq"):
        return "ndjson"
    if media == "application/json" or media.endswith("+json"):
        return "json"
    return None


# --- the proxy --------------------------------------------------------------------------


def _filter(headers: CIMultiDictProxy[str], drop: frozenset[str] | set[str]) -> CIMultiDict[str]:
    """Copy ``headers`` without ``drop`` and without those the Connection header names."""
    extra = {t.strip().lower() for v in headers.getall("Connection", []) for t in v.split(",")}
    out: CIMultiDict[str] = CIMultiDict()
    for k, v in headers.items():
        lk = k.lower()
        if lk not in drop and lk not in extra:
            out.add(k, v)
    return out


@dataclass
class UpstreamUse:
    """How one proxied request got its upstream connection (filled in by the connector).

    Attributes:
        connect_s: seconds the request waited for a new TCP connection (and aiohttp's
            set-up of it); None when it used a kept-alive or pre-opened one.
        template: the aiohttp request and timeout that needed a non-pooled connection, kept
            for :meth:`UpstreamConnector.preconnect` (None when the pool served it).
    """

    connect_s: float | None = None
    template: tuple[ClientRequest, aiohttp.ClientTimeout] | None = None


_UPSTREAM_USE: contextvars.ContextVar[UpstreamUse | None] = contextvars.ContextVar(
    "kvpressure_upstream_use", default=None
)
"""The :class:`UpstreamUse` of the request whose task is asking for a connection."""


class UpstreamConnector(aiohttp.TCPConnector):
    """aiohttp's TCP connector that times new connections and can open one ahead of need.

    aiohttp asks its connector for a new connection only when its keep-alive pool has none
    for the upstream. This connector times each new connection and writes the duration to
    the asking request's :class:`UpstreamUse` (found through a context variable: aiohttp
    connects in the request's own task).

    Some engines close the connection after every streamed response: llama.cpp does, though
    it answers ``Keep-Alive: timeout=5``. Each request would then wait for a TCP connect
    and aiohttp's set-up of the connection (0.3-0.4 ms on a 2-core machine) before its
    bytes leave the proxy. After a request
    that needed a new connection has ended, :meth:`preconnect` opens one spare connection,
    which the next request that finds the pool empty takes instead of connecting. At most
    one spare per upstream is open or opening; one unused for :data:`KEEPALIVE_S` is closed,
    and none is opened again until a request needs a new connection again, so an idle
    proxy holds no connection open. The cost to the engine: one idle connection for up to
    :data:`KEEPALIVE_S` after a request (llama.cpp serves each connection on one of its
    HTTP threads, ``--threads-http``).

    The hook is aiohttp's ``_create_connection(req, traces, timeout)``, the method its
    connectors implement to open a new connection (the same since aiohttp 3.0; the proxy
    tests exercise it).

    Args:
        preconnect: open spare connections (False: only time new connections).
        **kwargs: passed to :class:`aiohttp.TCPConnector`.
    """

    def __init__(self, *, preconnect: bool = True, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._preconnect = preconnect
        self._spares: dict[ConnectionKey, asyncio.Task[ResponseHandler]] = {}
        """Per upstream, the spare connection open or opening; each is dropped by a timer
        after :data:`KEEPALIVE_S`, so every one here is younger than that."""

    async def _create_connection(
        self, req: ClientRequest, traces: list[Any], timeout: aiohttp.ClientTimeout
    ) -> ResponseHandler:
        use = _UPSTREAM_USE.get()
        if use is not None and self._preconnect:
            use.template = (req, timeout)
        proto = await self._take_spare(req.connection_key, use)
        if proto is not None:
            return proto
        t0 = time.monotonic()
        proto = await super()._create_connection(req, traces, timeout)
        if use is not None:
            use.connect_s = time.monotonic() - t0
        return proto

    async def _take_spare(
        self, key: ConnectionKey, use: UpstreamUse | None
    ) -> ResponseHandler | None:
        """The spare connection for ``key`` if it is usable, else None (and it is dropped).

        A spare still connecting is waited for (it started before this request, so it is
        ready sooner than a new connection would be); the wait counts as this request's
        connect time, and its connect error is this request's error.
        """
        task = self._spares.pop(key, None)
        if task is None:
            return None
        if not task.done():
            t0 = time.monotonic()
            try:
                await task
            finally:
                if use is not None:
                    use.connect_s = time.monotonic() - t0
        elif task.cancelled() or task.exception() is not None:
            return None  # failed before this request came: it connects on its own
        proto = task.result()
        if proto.is_connected():
            return proto
        proto.close()
        return None

    def preconnect(self, use: UpstreamUse) -> None:
        """Open a spare connection like the one ``use`` needed, unless one is open or opening.

        Does nothing when the pool served the request (no ``template``), when this
        connector does not preconnect, or once it is closed. A spare that fails to connect
        is dropped quietly: the next request connects on its own and meets the error.
        """
        if use.template is None or self.closed:
            return
        req, timeout = use.template
        use.template = None
        key = req.connection_key
        if key in self._spares:
            return
        task = asyncio.get_running_loop().create_task(super()._create_connection(req, [], timeout))
        self._spares[key] = task
        task.add_done_callback(lambda t: self._spare_done(key, t))
        task.get_loop().call_later(KEEPALIVE_S, self._expire, key, task)

    def _forget(self, key: ConnectionKey, task: asyncio.Task[ResponseHandler]) -> bool:
        """Drop ``task`` as the spare of ``key`` if it still is; True when it was."""
        if self._spares.get(key) is task:
            del self._spares[key]
            return True
        return False

    def _expire(self, key: ConnectionKey, task: asyncio.Task[ResponseHandler]) -> None:
        if self._forget(key, task):
            _close_spare(task)

    def _spare_done(self, key: ConnectionKey, task: asyncio.Task[ResponseHandler]) -> None:
        if task.cancelled() or task.exception() is not None:
            self._forget(key, task)

    async def close(self, **kwargs: Any) -> None:
        """Close the spare connections, then the pool (see :meth:`aiohttp.BaseConnector.close`)."""
        for task in self._spares.values():
            _close_spare(task)
        self._spares.clear()
        await super().close(**kwargs)


def _close_spare(task: asyncio.Task[ResponseHandler]) -> None:
    if not task.done():
        task.cancel()
    elif not task.cancelled() and task.exception() is None:
        task.result().close()


def _split_listen(listen: str) -> tuple[str, int]:
    host, _, port = listen.rpartition(":")
    return host.strip("[]"), int(port)


class _Upstream:
    """One setting of a proxy's upstream and the aiohttp session that reaches it.

    Holds the engine's URL and label and a session on an :class:`UpstreamConnector`.
    A reconfigured proxy gets a new one; the old one serves the requests already sent
    through it and is closed when the last of them ends (:attr:`active`).
    """

    def __init__(
        self,
        url: str,
        engine: str,
        connect_timeout_s: float,
        preconnect: bool,
        max_connections: int,
    ) -> None:
        self.url = url.rstrip("/")
        self.engine = engine
        self.connect_timeout_s = connect_timeout_s
        self.preconnect = preconnect
        self.connector = UpstreamConnector(
            preconnect=preconnect,
            limit=max_connections,
            keepalive_timeout=KEEPALIVE_S,
            enable_cleanup_closed=False,
        )
        self.session = aiohttp.ClientSession(
            connector=self.connector,
            timeout=aiohttp.ClientTimeout(
                total=None, sock_connect=connect_timeout_s, sock_read=None
            ),
            auto_decompress=False,
            cookie_jar=aiohttp.DummyCookieJar(),
            skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding", "Content-Type"),
        )
        self.active = 0
        self.retired = False


class RequestProxy:
    """One streaming reverse proxy (see the module docstring).

    Args:
        listen: ``host:port`` to listen on (port 0 picks a free one; see :attr:`port`).
        upstream: base URL of the engine, e.g. ``http://127.0.0.1:8080``.
        engine: the ``engine`` label of the records.
        stream: where records go.
        connect_timeout_s: seconds to wait for the upstream TCP connect before answering
            502 ``upstream_down``.
        max_connections: most upstream connections at once (later requests wait).
        preconnect: open a spare upstream connection after a request that needed a new
            one (see :class:`UpstreamConnector`).
        max_client_connections: client connections open at once; at the cap an idle one
            is closed to admit a new one (see :mod:`agent.listener`), which also applies
            the header and idle timeouts.

    :meth:`reconfigure` changes everything but ``listen`` without closing the listener.
    """

    def __init__(
        self,
        listen: str,
        upstream: str,
        engine: str,
        stream: RequestStream,
        connect_timeout_s: float = 5.0,
        max_connections: int = 1024,
        preconnect: bool = True,
        max_client_connections: int = MAX_CONNECTIONS,
    ) -> None:
        self.listen = listen
        self.cap = ConnectionCap(f"proxy {listen}", max_client_connections)
        self._stream = stream
        self._max_connections = max_connections
        self._settings = (upstream.rstrip("/"), engine, connect_timeout_s, preconnect)
        self._up: _Upstream | None = None
        self._open_ups: set[_Upstream] = set()
        self._closing: set[asyncio.Task[None]] = set()
        self._down_logged_at: float | None = None
        self._down_unlogged = 0
        self._runner: web.AppRunner | None = None
        self.port: int | None = None

    @property
    def upstream(self) -> str:
        """Base URL of the engine new requests go to."""
        return self._settings[0]

    @property
    def engine(self) -> str:
        """The ``engine`` label of new requests' records."""
        return self._settings[1]

    @property
    def spec(self) -> tuple[str, str, str, float, bool]:
        """(listen, upstream, engine, connect_timeout_s, preconnect) as now configured."""
        return (self.listen, *self._settings)

    def _new_upstream(self) -> _Upstream:
        up = _Upstream(*self._settings, max_connections=self._max_connections)
        self._open_ups.add(up)
        return up

    async def reconfigure(
        self, upstream: str, engine: str, connect_timeout_s: float, preconnect: bool
    ) -> None:
        """Send new requests to ``upstream`` with these settings; the listener stays open.

        Requests already in flight finish on the old upstream session, which is closed
        when the last of them ends. Before :meth:`start` only the settings change.
        """
        self._settings = (upstream.rstrip("/"), engine, connect_timeout_s, preconnect)
        old = self._up
        if old is None:
            return
        self._up = self._new_upstream()
        old.retired = True
        if old.active == 0:
            await self._close_upstream(old)
        log.info(
            "proxy reconfigured",
            extra={
                "kv": {"address": self.listen, "upstream": self.upstream, "engine": self.engine}
            },
        )

    async def _close_upstream(self, up: _Upstream) -> None:
        self._open_ups.discard(up)
        await up.session.close()

    def _release_upstream(self, up: _Upstream) -> None:
        up.active -= 1
        if up.retired and up.active == 0 and up in self._open_ups:
            task = asyncio.get_running_loop().create_task(self._close_upstream(up))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    async def start(self) -> None:
        """Bind the listener and open the upstream session.

        Raises:
            OSError: the listen address cannot be bound.
        """
        self._up = self._new_upstream()
        app = web.Application(
            client_max_size=INLINE_BODY_MAX + 1, middlewares=[self.cap.middleware]
        )
        app.router.add_route("*", "/{tail:.*}", self._handle)
        runner = web.AppRunner(
            app,
            access_log=None,
            handle_signals=False,
            handler_cancellation=True,
            shutdown_timeout=CLOSE_GRACE_S,
            keepalive_timeout=IDLE_TIMEOUT_S,
            logger=ServerLog(self.cap.name),
        )
        await runner.setup()
        host, port = _split_listen(self.listen)
        site = BoundedSite(runner, host, port, self.cap)
        try:
            await site.start()
        except OSError:
            await runner.cleanup()
            await self._close_upstream(self._up)
            self._up = None
            raise
        self._runner = runner
        self.port = site.port
        log.info(
            "proxy listening",
            extra={
                "kv": {
                    "address": f"{host}:{self.port}",
                    "upstream": self.upstream,
                    "engine": self.engine,
                }
            },
        )

    @property
    def in_flight(self) -> int:
        """Requests being proxied now."""
        return sum(up.active for up in self._open_ups)

    async def drain(self, timeout_s: float) -> None:
        """Wait until no request is in flight, at most ``timeout_s`` seconds."""
        deadline = time.monotonic() + timeout_s
        while self.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.1)

    async def stop_listening(self) -> None:
        """Stop accepting connections now; requests in flight go on until :meth:`close`."""
        if self._runner is not None:
            for site in list(self._runner.sites):
                await site.stop()

    async def close(self) -> None:
        """Stop listening and close the upstream sessions.

        Requests in flight get :data:`CLOSE_GRACE_S` to finish; then they are cancelled
        (recorded as ``cancelled``, their upstream requests closed).
        """
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        for up in list(self._open_ups):
            await self._close_upstream(up)
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)
        self._up = None

    async def _body(self, request: web.Request) -> bytes | AsyncIterator[bytes] | None:
        if not request.body_exists:
            return None
        n = request.content_length
        if n is not None and n <= INLINE_BODY_MAX:
            return await request.read()
        return request.content.iter_chunked(65536)

    async def _open(
        self,
        up: _Upstream,
        request: web.Request,
        headers: CIMultiDict[str],
        body: bytes | AsyncIterator[bytes] | None,
        use: UpstreamUse,
    ) -> aiohttp.ClientResponse:
        url = URL(up.url + request.raw_path, encoded=True)
        token = _UPSTREAM_USE.set(use)
        try:
            for attempt in (0, 1):
                try:
                    return await up.session.request(
                        request.method,
                        url,
                        headers=headers,
                        data=body,
                        allow_redirects=False,
                        compress=None,
                    )
                except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError):
                    # A kept-alive or pre-opened connection the engine had closed: retry
                    # once on a new one when the body can be sent again.
                    if attempt or use.connect_s is not None or not isinstance(body, bytes | None):
                        raise
            raise AssertionError("unreachable")
        finally:
            _UPSTREAM_USE.reset(token)

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        t_wall = time.time()
        t0 = time.monotonic()
        inference = request.method == "POST" and INFERENCE_PATH.match(request.path) is not None
        up = self._up
        if up is None:  # closing
            return web.Response(status=502, body=_ERROR_BODY, content_type="application/json")
        if not request.raw_path.startswith("/"):
            # An absolute-form ("GET http://other/x") or asterisk-form target: this proxy
            # forwards paths to its one engine only.
            if inference:
                why = {"error_type": "bad_request_target"}
                self._record(up.engine, t_wall, t0, "client_error", 400, None, UpstreamUse(), why)
            return web.Response(
                status=400, body=_TARGET_ERROR_BODY, content_type="application/json"
            )
        up.active += 1
        use = UpstreamUse()
        rec: dict[str, Any] = {}
        outcome: Outcome = "ok"
        status: int | None = None
        observer: Observer | None = None
        upstream: aiohttp.ClientResponse | None = None
        try:
            headers = _filter(request.headers, _DROP_REQUEST)
            if request.content_length is not None and request.content_length > INLINE_BODY_MAX:
                headers["Content-Length"] = str(request.content_length)
            body = await self._body(request)
            try:
                upstream = await self._open(up, request, headers, body, use)
            except (aiohttp.ClientConnectionError, TimeoutError) as exc:
                outcome, status = "upstream_down", 502
                rec["error_type"] = type(exc).__name__
                self._log_down(up, rec["error_type"])
                return web.Response(status=502, body=_ERROR_BODY, content_type="application/json")
            status = upstream.status
            resp = web.StreamResponse(
                status=upstream.status,
                reason=upstream.reason,
                headers=_filter(upstream.headers, _DROP_RESPONSE),
            )
            if upstream.content_length is not None and request.method != "HEAD":
                resp.content_length = upstream.content_length
            if inference:
                mode = _mode(
                    upstream.headers.get("Content-Type", ""),
                    upstream.headers.get("Content-Encoding", ""),
                )
                observer = Observer(mode) if mode else None
            await resp.prepare(request)
            content = upstream.content
            while True:
                try:
                    chunk = await content.readany()
                except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError):
                    # The engine dropped the connection mid-response: end the client's
                    # response abruptly too, so the truncation is visible to it.
                    outcome = "server_error"
                    rec["error_type"] = "upstream_disconnected"
                    upstream.close()
                    if request.transport is not None:
                        request.transport.close()
                    return resp
                if not chunk:
                    break
                t = time.monotonic()
                await resp.write(chunk)  # ConnectionResetError when the client went away
                if observer is not None:
                    observer.feed(chunk, t)
            await resp.write_eof()
            return resp
        except (ConnectionResetError, asyncio.CancelledError):
            outcome = "cancelled"
            raise
        finally:
            if upstream is not None:
                if outcome == "cancelled":
                    upstream.close()  # drop the connection: the engine stops generating
                else:
                    upstream.release()
            if outcome != "upstream_down":
                # Before the record: the client may send its next request at once.
                up.connector.preconnect(use)
            self._release_upstream(up)
            if inference:
                self._record(up.engine, t_wall, t0, outcome, status, observer, use, rec)

    def _log_down(self, up: _Upstream, error: str) -> None:
        now = time.monotonic()
        last = self._down_logged_at
        if last is not None and now - last < DOWN_LOG_EVERY_S:
            self._down_unlogged += 1
            return
        kv = {"engine": up.engine, "upstream": up.url, "error": error}
        if self._down_unlogged:
            kv["failed_since_last_log"] = str(self._down_unlogged)
        log.warning("upstream unavailable", extra={"kv": kv})
        self._down_logged_at, self._down_unlogged = now, 0

    def _record(
        self,
        engine: str,
        t_wall: float,
        t0: float,
        outcome: Outcome,
        status: int | None,
        observer: Observer | None,
        use: UpstreamUse,
        rec: dict[str, Any],
    ) -> None:
        e2e = time.monotonic() - t0
        if observer is not None:
            observer.finish()
        if outcome == "ok" and status is not None:
            if observer is not None and observer.error_outcome is not None:
                outcome = observer.error_outcome
            elif status >= 500:
                outcome = "server_error"
            elif status >= 400:
                outcome = "client_error"
        o = observer
        record = RequestRecord(
            engine=engine,
            start=t_wall,
            end=t_wall + e2e,
            outcome=outcome,
            source="proxy",
            model=o.model if o else None,
            ttft_s=(o.first_content - t0) if o and o.first_content is not None else None,
            e2e_s=e2e,
            prefill_s=o.prefill_s if o else None,
            decode_s=o.decode_s if o else None,
            itl_s=tuple(o.gaps) if o else (),
            input_tokens=o.input_tokens if o else None,
            output_tokens=o.output_tokens if o else None,
            cached_tokens=o.cached_tokens if o else None,
            upstream_connect_s=use.connect_s,
            status=status,
            error_type=(o.error_type if o and o.error_type else rec.get("error_type")),
        )
        self._stream.submit(record)
        log.debug(
            "request",
            extra={
                "kv": {
                    "engine": engine,
                    "status": status,
                    "outcome": record.outcome,
                    "ttft_s": record.ttft_s,
                    "e2e_s": round(e2e, 6),
                    "output_tokens": record.output_tokens,
                }
            },
        )
