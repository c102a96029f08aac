"""The agent's own HTTP/1.1 listener: ``h11`` on an asyncio protocol, bounded.

It serves the agent's API (``/metrics``, ``/healthz``, ``/api/v1/*``, the OTLP receiver's
``POST /v1/traces``; :mod:`agent.daemon`). The request proxies (:mod:`agent.requests.proxy`)
stream through aiohttp's client and server and keep them (:mod:`agent.listener`); aiohttp is
imported only when ``proxies:`` lists one. The reason is memory: importing aiohttp is 12-15
MiB of the agent's resident memory (its client, SSL contexts, ``attrs``, ``yarl``,
``multidict``), against issue 15's 60 MiB for a whole 8-GPU node; ``h11`` (the HTTP/1.1
state machine under httpx and uvicorn) and this module are under 1 MiB. A scrape (one plain
``GET`` or ``HEAD`` that arrives whole) is read and answered without h11 by a small fast
path proved equal to h11 (``_fast_request``, ``_fast_response``; tests/test_httpd_fastpath.py):
h11 is most of the CPU of a scrape, and issue 15 asks for 20 Hz polling at 1 % of a core
(``benchmarks/scrape_http_floor.py``). Everything else goes through h11.

What a client gets:

* **Routes.** An exact path and method (:class:`Route`); ``HEAD`` is answered for every
  ``GET`` (headers, no body); an unknown path is 404, a known path with another method 405
  with ``Allow``. Middlewares (``async (request, handler) -> Response``) wrap every request,
  the 404s and 405s included, first listed outermost. A handler that is a plain function
  answers in the event-loop iteration that read its request; a coroutine function runs on
  a task of its own.
* **Keep-alive and pipelining** as HTTP/1.1 has them: one request at a time per
  connection, the next one read after the answer; ``Connection: close`` and every HTTP/1.0
  request (h11 does not keep 1.0 connections alive) close after the answer. An answer given
  before its request's body was read (a 401, a 413) closes the connection, so an unread body
  is never taken for the next request, after reading and dropping the rest of the body for
  at most :data:`LINGER_S` (closing at once would reset the connection under a client still
  sending, which would then miss the answer). A closed connection whose client does not
  take what was written is cut off after :data:`CLOSE_DEADLINE_S`.
* **Request bodies** reach the handler as they arrive (:meth:`Body.read`), undecoded (no
  gzip inflation: the OTLP receiver inflates under its own limit); at most
  :data:`BODY_BUFFER_BYTES` wait unread, beyond which the socket is not read. A client
  sending ``Expect: 100-continue`` is told to continue when the handler first reads.
* **Bounds** (the same as :mod:`agent.listener`'s for the proxies):

  - *Cap.* At most ``max_connections`` open connections. At the cap a new connection
    makes room by closing an *idle* one (no request being answered): those that never sent
    a request first, then the oldest, as nginx reuses keep-alive connections. A connection
    whose request is being answered is never closed; when every one is, the new one gets
    a 503 and is closed.
  - *Header timeout.* A connection that has not sent a complete request head within
    ``header_timeout_s`` of being accepted is closed.
  - *Idle timeout.* A kept-alive connection with no new request head within
    ``idle_timeout_s`` is closed.
  - *Head size.* A request line plus headers over :data:`MAX_HEAD_BYTES` is refused (431).
  - *Answers not taken.* While the answers a client has not read pass the transport's
    high-water mark (64 KiB), its next requests are not read: what a client that
    pipelines requests and never reads costs is bounded per connection (one socket read
    not yet parsed, up to 256 KiB, and the answers queued), and ``max_connections`` bounds
    the connections.
  - *Pipelined floods.* At most :data:`REQUESTS_PER_PASS` pipelined requests are answered
    before the event loop serves the other clients.
  - *Smuggling.* A request with both ``Transfer-Encoding`` and ``Content-Length`` is
    refused (400) and the connection closed.
* **Errors.** A malformed request is answered 400 (or h11's more specific 4xx) and closed;
  a handler's exception 500, logged with its traceback. Evictions, refusals, header
  timeouts and malformed requests are logged at most once per :data:`LOG_PERIOD_S` per
  listener and kind, with the count since the last line (:class:`agent.logs.RateLimitedLog`).

:func:`install_accept_error_handler` does the same for the event loop's ``accept()``
errors (EMFILE), and :func:`raise_fd_limit` raises the open-files limit at start.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import ssl
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from email.utils import formatdate
from http import HTTPStatus
from typing import Any, Final, Generic, TypeVar
from urllib.parse import parse_qsl, unquote

import h11

from kvpressure.agent.logs import RateLimitedLog

log = logging.getLogger(__name__)

MAX_CONNECTIONS: Final = 1000
"""Default cap on one listener's open connections."""
HEADER_TIMEOUT_S: Final = 10.0
"""Seconds a new connection has to send its first complete request head."""
IDLE_TIMEOUT_S: Final = 60.0
"""Seconds a kept-alive connection may wait for its next request (longer than the common
Prometheus scrape intervals, so a scraper's connection is reused)."""
LOG_PERIOD_S: Final = 60.0
"""At most one log line per period for each kind of rate-limited event."""
MAX_HEAD_BYTES: Final = 16384
"""Longest request head (request line and headers), bytes; aiohttp's limit is 8,190 per
line."""
BODY_BUFFER_BYTES: Final = 1 << 20
"""Request-body bytes received but not yet read by the handler above which the socket is
not read (TCP flow control then slows the client)."""
SHUTDOWN_GRACE_S: Final = 0.5
"""Seconds :meth:`HttpServer.close` lets requests being answered finish."""
CLOSE_DEADLINE_S: Final = 5.0
"""Seconds a closed connection has to take what was written to it before it is cut off."""
LINGER_S: Final = 5.0
"""Seconds the rest of a body answered early (a 413, a 401) is read and dropped."""
LINGER_MAX_BYTES: Final = 64 << 20
"""Bytes of such a body read and dropped at most."""

_FRAMING: Final = frozenset({b"transfer-encoding", b"content-length"})
REQUESTS_PER_PASS: Final = 32
"""Pipelined requests answered in one pass of the event loop before the others are served."""
_UNANSWERED: Final = (h11.IDLE, h11.SEND_RESPONSE)
"""Our h11 states in which no response has been started."""
_REFUSE: Final = (
    b"HTTP/1.1 503 Service Unavailable\r\nConnection: close\r\nContent-Length: 0\r\n\r\n"
)


# ---- requests and responses -------------------------------------------------------------------
class Headers(Mapping[str, str]):
    """A request's headers, looked up case-insensitively; a repeated name gives its first value.

    Looked up in h11's list as asked (a request has a few headers and a handler reads one
    or two): nothing is decoded for the headers no one reads.

    Args:
        fields: ``(name, value)`` pairs as h11 gives them (names lower-cased, latin-1).
    """

    __slots__ = ("_fields",)

    def __init__(self, fields: Sequence[tuple[bytes, bytes]]) -> None:
        self._fields = fields

    def __getitem__(self, name: str) -> str:
        key = name.lower().encode("latin-1", "replace")
        for k, v in self._fields:
            if k == key:
                return v.decode("latin-1")
        raise KeyError(name)

    def get(self, name: str, default: Any = None) -> Any:  # noqa: D102 - Mapping.get
        try:
            return self[name]
        except KeyError:
            return default

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self.get(name) is not None

    def __iter__(self) -> Iterator[str]:
        return iter(dict.fromkeys(k.decode("latin-1") for k, _ in self._fields))

    def __len__(self) -> int:
        return len({k for k, _ in self._fields})


class Body:
    """A request body as it arrives from the client (``request.content``).

    :meth:`read` returns bytes as the connection receives them; the connection stops reading
    its socket while more than :data:`BODY_BUFFER_BYTES` wait here.
    """

    __slots__ = ("_buf", "_conn", "_eof", "_error", "_waiter")

    def __init__(self, conn: _Connection) -> None:
        self._conn = conn
        self._buf = bytearray()
        self._eof = False
        self._error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None

    @property
    def buffered(self) -> int:
        """Bytes received and not yet read."""
        return len(self._buf)

    async def read(self, n: int = -1) -> bytes:
        """Up to ``n`` bytes of the body (all that is buffered for ``n < 0``); ``b""`` at its end.

        Raises:
            ConnectionResetError: the client went away before the body ended.
        """
        while not self._buf and not self._eof:
            if self._error is not None:
                raise self._error
            self._conn.want_body()
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        if n < 0 or n >= len(self._buf):
            out = bytes(self._buf)
            self._buf.clear()
        else:
            out = bytes(self._buf[:n])
            del self._buf[:n]
        self._conn.want_body()
        return out

    def feed(self, data: bytes) -> None:
        """More of the body arrived (the connection calls this)."""
        self._buf += data
        self._wake()

    def end(self) -> None:
        """The body is complete."""
        self._eof = True
        self._wake()

    def fail(self, exc: BaseException) -> None:
        """The body will not complete: the next :meth:`read` that would wait raises ``exc``."""
        if not self._eof:
            self._error = exc
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)


class Request:
    """One request as a handler sees it.

    Attributes:
        method: ``GET``, ``POST``, ... (upper case, as sent).
        path: the target's path, percent-decoded (``/api/v1/snapshot``).
        query: the query string's parameters; a repeated one gives its first value.
        headers: :class:`Headers`.
        content: the body, :class:`Body` (empty for a request without one).
        content_length: the ``Content-Length`` header as an int, else None (absent,
            malformed, or a chunked body).
    """

    __slots__ = ("_qs", "_query", "content", "headers", "method", "path")

    def __init__(
        self, method: bytes, target_bytes: bytes, fields: Sequence[tuple[bytes, bytes]], body: Body
    ) -> None:
        self.method = method.decode("ascii", "replace")
        target = target_bytes.decode("latin-1")
        if not target.startswith("/"):  # absolute form: http://host/path?q
            _, _, rest = target.partition("://")
            target = "/" + rest.partition("/")[2] if rest else target
        raw_path, _, self._qs = target.partition("?")
        raw_path = raw_path.partition("#")[0]
        self.path = unquote(raw_path) if "%" in raw_path else raw_path
        self._query: Mapping[str, str] | None = None
        self.headers = Headers(fields)
        self.content = body

    @property
    def query(self) -> Mapping[str, str]:
        """The query string's parameters (parsed when first read)."""
        if self._query is None:
            query: dict[str, str] = {}
            for k, v in parse_qsl(self._qs, keep_blank_values=True):
                query.setdefault(k, v)
            self._query = query
        return self._query

    @property
    def content_length(self) -> int | None:
        """``Content-Length`` as an int; None when absent, malformed or chunked."""
        length = self.headers.get("content-length")
        return int(length) if length and length.isdigit() else None


class Response:
    """An answer: status, headers and a body (sent with ``Content-Length``).

    Args:
        body: the body bytes.
        status: the status code.
        text: the body as text, encoded UTF-8 (instead of ``body``); ``content_type``
            defaults to ``text/plain``.
        content_type: the ``Content-Type``; ``; charset=utf-8`` is added for ``text``.
        headers: more headers; :attr:`headers` can be changed until the handler returns.
    """

    __slots__ = ("body", "headers", "status")

    def __init__(
        self,
        body: bytes = b"",
        status: int = 200,
        *,
        text: str | None = None,
        content_type: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        self.status = status
        self.headers: dict[str, str] = dict(headers) if headers else {}
        if text is not None:
            body = text.encode()
            media = content_type or "text/plain"
            self.headers.setdefault("Content-Type", f"{media}; charset=utf-8")
        elif content_type is not None:
            self.headers.setdefault("Content-Type", content_type)
        self.body = body


def json_response(data: Any, status: int = 200) -> Response:
    """A JSON answer (``application/json; charset=utf-8``)."""
    return Response(text=json.dumps(data), status=status, content_type="application/json")


Handler = Callable[[Request], "Response | Awaitable[Response]"]
"""``(request) -> Response``, or ``async``. A plain function answers in the event-loop
iteration that read the request (``/metrics``, ``/healthz``: no task, no second loop
iteration); a coroutine function's answer is awaited on a task of its own."""
Middleware = Callable[[Request, Handler], Awaitable[Response]]
"""``async (request, handler) -> Response``: answers itself or calls ``handler(request)``
(:func:`answer` awaits what a handler returns, whichever kind it is)."""


async def answer(handler: Handler, request: Request) -> Response:
    """``handler``'s response to ``request``, awaited if the handler is a coroutine function."""
    result = handler(request)
    if isinstance(result, Response):
        return result
    return await result


@dataclass(frozen=True, slots=True)
class Route:
    """``method`` requests for exactly ``path`` go to ``handler``."""

    method: str
    path: str
    handler: Handler


def get(path: str, handler: Handler) -> Route:
    """A ``GET`` (and ``HEAD``) route."""
    return Route("GET", path, handler)


def post(path: str, handler: Handler) -> Route:
    """A ``POST`` route."""
    return Route("POST", path, handler)


def _status_line(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return ""


# ---- the fast path: one plain GET or HEAD read whole, answered without h11 ------------------
# A scrape is one GET with a few headers and no body, in one segment. h11 costs ~0.2 ms of
# CPU to read it and write the answer (benchmarks/scrape_http_floor.py: a bare h11 protocol
# 0.32 ms per scrape against 0.11 for a bare asyncio one), more than the rest of the agent's
# answer, and issue 15 asks for 20 Hz polling at 1 % of a core (0.5 ms per scrape). So a
# request that is exactly one GET or HEAD head in origin form, HTTP/1.1, one Host, visible
# ASCII only, no body, framing, Expect or Upgrade header, and nothing after it, is read by
# _fast_request, and its answer written by _fast_response when it has only plain headers.
# Anything else goes to h11; tests/test_httpd_fastpath.py proves both equal to h11 (the
# same request, the same answer bytes) on generated requests and responses.
_TOKEN: Final = rb"[-!#$%&'*+.^_`|~0-9a-zA-Z]+"
# possessive quantifiers (*+, ++): no backtracking, so a line of 16 KiB of blanks followed
# by a byte refused costs linear time (plain quantifiers took 0.5 s of event loop for it)
_VALUE: Final = rb"(?:[\x21-\x7e]++(?:[ \t]++[\x21-\x7e]++)*+)?+"
_FAST_LINE: Final = re.compile(rb"(GET|HEAD) (/[\x21-\x7e]*) HTTP/1\.1")
_FAST_FIELD: Final = re.compile(rb"(" + _TOKEN + rb"):[ \t]*+(" + _VALUE + rb")[ \t]*+")
_OUT_NAME: Final = re.compile(_TOKEN)
_OUT_VALUE: Final = re.compile(_VALUE)
_NOT_FAST_IN: Final = frozenset({b"content-length", b"transfer-encoding", b"expect", b"upgrade"})
"""Request headers that send a request to h11 (a body, 100-continue, a protocol switch)."""
_NOT_FAST_OUT: Final = frozenset(
    {"content-length", "transfer-encoding", "connection", "date", "host"}
)
"""Response headers that h11 would handle itself (framing, connection, order)."""
_KEEP_ALIVE: Final = frozenset({b"keep-alive", b""})

H11_HEADER_FIELD: Final = re.compile(
    rb"(?P<field_name>" + _TOKEN + rb"):[ \t]*+"
    rb"(?P<field_value>(?:[^\x00\s]++(?:[ \t]++[^\x00\s]++)*+)?+)[ \t]*+"
)
"""h11's header-line regex (``h11._abnf.header_field``: RFC 9110's field-line, obs-text
allowed) with possessive quantifiers: the same lines match, with the same groups (a blank
can neither start nor end a value, so no match ever needs a quantifier to give back), in
linear time. h11's own backtracks over every split of a run of blanks after the colon
when the line is refused: a 16 KiB head ``X:`` + 16,000 blanks + ``\x00`` held the event
loop 0.5 s. tests/test_httpd_fastpath.py checks both match alike on generated lines."""


def _linear_h11_headers() -> bool:
    """Give h11's header reader :data:`H11_HEADER_FIELD`; True when it took it.

    h11 reads ``h11._readers.header_field_re`` at each call, the one private name used
    here. False when this h11 has no such attribute: it is then used unchanged (still
    correct, quadratic on such lines).
    """
    from h11 import _readers

    if not isinstance(getattr(_readers, "header_field_re", None), re.Pattern):
        return False
    _readers.header_field_re = H11_HEADER_FIELD
    return True


H11_LINEAR_HEADERS: Final = _linear_h11_headers()
_STATUS_LINES: dict[int, bytes] = {}


def _fast_request(
    data: bytes,
) -> tuple[bytes, bytes, list[tuple[bytes, bytes]], bool] | None:
    """Read ``data`` as one plain request head (above), as h11 would.

    Returns:
        ``(method, target, headers, close)``: headers as h11 gives them (names lower-cased,
        values without surrounding whitespace), ``close`` true when the client asked for
        ``Connection: close``; ``None`` when ``data`` is anything else (h11 reads it).
    """
    if len(data) > MAX_HEAD_BYTES or data[-4:] != b"\r\n\r\n" or data[:1] not in (b"G", b"H"):
        return None
    lines = data[:-4].split(b"\r\n")
    m = _FAST_LINE.fullmatch(lines[0])
    if m is None:
        return None
    fields: list[tuple[bytes, bytes]] = []
    hosts = 0
    close = False
    for line in lines[1:]:
        f = _FAST_FIELD.fullmatch(line)  # also refuses an empty line, CR, LF and obs-fold
        if f is None:
            return None
        name = f[1].lower()
        if name in _NOT_FAST_IN:
            return None
        value = f[2]
        if name == b"host":
            hosts += 1
        elif name == b"connection":
            for part in value.lower().split(b","):
                token = part.strip(b" \t")
                if token == b"close":
                    close = True
                elif token not in _KEEP_ALIVE:
                    return None
        fields.append((name, value))
    if hosts != 1 or _head_size(m[2], fields) > MAX_HEAD_BYTES:
        return None  # (over the size, h11's path answers 431)
    return m[1], m[2], fields, close


def _head_size(target: bytes, fields: Iterable[tuple[bytes, bytes]]) -> int:
    """A request head's size, bytes, as both paths bound it (:data:`MAX_HEAD_BYTES`).

    The target, and each header's name and value plus 4 (``": "`` and CRLF), whatever
    blanks the client put around them.
    """
    return len(target) + sum(len(n) + len(v) + 4 for n, v in fields)


def _fast_response(response: Response, head: bool, close: bool) -> bytes | None:
    """The bytes h11 would write for ``response`` to a fast-path request, or ``None``.

    ``None`` when the response has a header h11 handles itself or refuses, or a status
    whose framing differs (1xx, 204, 304): h11 then writes it (:func:`_h11_response`).
    """
    status = response.status
    line = _STATUS_LINES.get(status)
    if line is None:
        if not 200 <= status < 600 or status in (204, 304):
            return None
        line = _STATUS_LINES[status] = b"HTTP/1.1 %d %s\r\n" % (
            status,
            _status_line(status).encode(),
        )
    out = [line]
    for k, v in response.headers.items():
        if k.lower() in _NOT_FAST_OUT:
            return None
        name, value = k.encode("latin-1"), v.encode("latin-1")
        if _OUT_NAME.fullmatch(name) is None or _OUT_VALUE.fullmatch(value) is None:
            return None
        out.append(b"%s: %s\r\n" % (name, value))
    body = response.body
    out.append(b"content-length: %d\r\ndate: %s\r\n" % (len(body), _http_date()))
    if close:
        out.append(b"Connection: close\r\n")
    out.append(b"\r\n")
    if body and not head:
        out.append(body)
    return b"".join(out)


def _h11_response(raw_head: bytes, response: Response, head: bool) -> tuple[bytes, bool]:
    """What h11 writes for ``response`` to the fast-path request ``raw_head``.

    Used when :func:`_fast_response` declines the response. Returns the bytes and whether
    the connection must close after them (the request or the response said so).

    Raises:
        h11.LocalProtocolError: h11 refuses the response (an invalid header).
    """
    conn = h11.Connection(h11.SERVER)
    conn.receive_data(raw_head)
    conn.next_event()  # the request
    conn.next_event()  # its end
    out = _serialize(conn, response, head)
    return out, conn.our_state is not h11.DONE


def _serialize(conn: h11.Connection, response: Response, head: bool) -> bytes:
    """``response`` as h11 writes it on ``conn``, with ``Content-Length`` and ``Date``.

    Raises:
        h11.LocalProtocolError: h11 refuses the response.
    """
    fields = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in response.headers.items()]
    body = response.body
    fields.append((b"content-length", str(len(body)).encode()))
    fields.append((b"date", _http_date()))
    if conn.their_state is not h11.DONE:
        # answered before the body was read: the rest of it must not become a request
        fields.append((b"connection", b"close"))
    out = conn.send(
        h11.Response(
            status_code=response.status,
            headers=fields,
            reason=_status_line(response.status).encode(),
        )
    )
    if body and not head:
        out += conn.send(h11.Data(data=body))
    return out + conn.send(h11.EndOfMessage())


# ---- the connection ---------------------------------------------------------------------------
class _Connection(asyncio.Protocol):
    """One client connection: h11's state machine, one request answered at a time.

    Reading the socket stops (:meth:`_sync_reading`) while the answers not yet taken by the
    client pass the transport's high-water mark (a client that sends requests and never
    reads the answers cannot grow the agent's memory), while a request is being answered
    (pipelined requests wait in the kernel), and while more than :data:`BODY_BUFFER_BYTES`
    of a body wait unread.
    """

    def __init__(self, server: HttpServer) -> None:
        self.server = server
        self.h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD_BYTES)
        self.transport: asyncio.Transport | None = None
        self.busy = False
        """A request is being answered (the cap never closes this connection then)."""
        self.served = False
        """A complete request head arrived at least once."""
        self._body: Body | None = None
        self._task: asyncio.Task[None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._reading = True
        self._write_paused = False
        self._closed = False
        self._lost = False
        self._eof = False
        self._tls = False
        self._lingering = False
        self._lingered = 0
        self._draining = False
        self._yielding = False
        self._answered = 0
        self._pending: h11.Request | None = None
        """A request whose head was read, dispatched at its end or when its body is due."""
        self._fast: tuple[bytes, bool] | None = None
        """The request being answered came by the fast path: (its head, Connection: close)."""

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self._tls = transport.get_extra_info("sslcontext") is not None
        if not self.server.admit(self):
            self._closed = True
            transport.write(_REFUSE)
            transport.close()
            return
        self._arm(self.server.header_timeout_s, self._header_deadline)

    def data_received(self, data: bytes) -> None:
        if self._lingering:  # the rest of a body answered early: read and dropped
            self._lingered += len(data)
            if self._lingered > LINGER_MAX_BYTES:
                self.abort()
            return
        if self._closed:
            return
        if self._fast_idle() and self._serve_fast(data):
            return
        try:
            self.h11.receive_data(data)
        except RuntimeError:  # data after the peer's EOF: nothing to do with it
            return
        self._drain()

    def _fast_idle(self) -> bool:
        """Between requests, with nothing buffered: the next one may take the fast path."""
        conn = self.h11
        return (
            not self.busy
            and not self._yielding
            and not self._write_paused
            and self._pending is None
            and conn.their_state is h11.IDLE
            and conn.our_state is h11.IDLE
            and not conn.trailing_data[0]
        )

    def _serve_fast(self, data: bytes) -> bool:
        """Answer ``data`` by the fast path if it is one plain request; False: it is not."""
        fast = _fast_request(data)
        if fast is None:
            return False
        method, target, fields, close = fast
        self._disarm()
        self.served = True
        self.busy = True
        self._body = Body(self)
        self._body.end()
        self._fast = (data, close)
        self._run(Request(method, target, fields, self._body))
        self._sync_reading()
        return True

    def eof_received(self) -> bool:
        self._eof = True
        if self._lingering:
            return False
        with contextlib.suppress(RuntimeError):
            self.h11.receive_data(b"")
        self._drain()
        # a half-closed client still gets the answer being made (asyncio cannot keep a TLS
        # connection open after the peer's close_notify: returning True would only log)
        return self.busy and not self._tls

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = True
        self._lost = True
        self._disarm()
        self.server.forget(self)
        if self._body is not None:
            self._body.fail(ConnectionResetError("client went away"))

    def pause_writing(self) -> None:
        """The client is not taking the answers: stop reading requests."""
        self._write_paused = True
        self._sync_reading()

    def resume_writing(self) -> None:
        """The client took the answers: read (and answer) its next requests."""
        self._write_paused = False
        if self._closed or self.busy:
            return
        self._sync_reading()
        self._drain()  # pipelined requests h11 holds already

    # reading
    def _go_on(self) -> None:
        self._yielding = False
        if not self._closed and not self.busy:
            self._drain()

    def _want_reading(self) -> bool:
        if self._lingering:
            return True
        if self._write_paused or self._closed or self._yielding:
            return False
        if not self.busy:
            return True
        body = self._body
        return self.h11.their_state is h11.SEND_BODY and (
            body is None or body.buffered <= BODY_BUFFER_BYTES
        )

    def _sync_reading(self) -> None:
        """Pause or resume reading the socket as :meth:`_want_reading` says."""
        want = self._want_reading()
        if want == self._reading or self.transport is None or self._lost:
            return
        self._reading = want
        if want:
            self.transport.resume_reading()
        else:
            self.transport.pause_reading()

    def _drain(self) -> None:
        """Hand the events h11 parsed so far to the request being answered or a new one.

        A request is dispatched once h11 has read its end (a request without a body: the
        event right after its head), or when its body is still to come (the handler then
        reads it as it arrives), so that an answer made at once finds the request complete.
        """
        self._draining = True
        try:
            self._drain_events()
        finally:
            self._draining = False
            if self._pending is not None and not self._closed:
                event, self._pending = self._pending, None
                self._start(event)
            self._sync_reading()

    def _drain_events(self) -> None:
        answered = self._answered
        while not self._closed and not (self._write_paused and not self.busy):
            if self._answered - answered >= REQUESTS_PER_PASS and not self.busy:
                # a pipelined flood: let the event loop serve the others, go on later
                self._yielding = True
                asyncio.get_running_loop().call_soon(self._go_on)
                return
            if self.transport is None or self.transport.is_closing():
                self._closed = True
                return
            try:
                event = self.h11.next_event()
            except h11.RemoteProtocolError as exc:
                self._pending = None
                self._malformed(exc)
                return
            if event is h11.NEED_DATA or event is h11.PAUSED:
                # PAUSED: a pipelined request waits in h11's buffer until this one is
                # answered (reading stops meanwhile: _want_reading)
                return
            if isinstance(event, h11.Request):
                self._disarm()
                self.served = True
                self.busy = True
                self._body = Body(self)
                self._pending = event
            elif isinstance(event, h11.Data):
                if self._body is not None:
                    self._body.feed(bytes(event.data))
            elif isinstance(event, h11.EndOfMessage):
                if self._body is not None:
                    self._body.end()
                if self._pending is not None:
                    event, self._pending = self._pending, None
                    self._start(event)
            elif isinstance(event, h11.ConnectionClosed):
                if not self.busy:
                    self.close()
                return

    def want_body(self) -> None:
        """The handler reads the body: ask for it (100-continue) and read the socket again."""
        if self._closed or self.transport is None:
            return
        if self.h11.they_are_waiting_for_100_continue:
            with contextlib.suppress(h11.LocalProtocolError):
                self.transport.write(
                    self.h11.send(
                        h11.InformationalResponse(status_code=100, headers=[], reason=b"Continue")
                    )
                )
        self._sync_reading()

    def _start(self, event: h11.Request) -> None:
        # h11 bounds a head that arrives in pieces; one that arrives whole is bounded here
        if _head_size(event.target, event.headers.raw_items()) > MAX_HEAD_BYTES:
            self._malformed(h11.RemoteProtocolError("request head too long", error_status_hint=431))
            return
        if event.http_version[:1] != b"1":
            # HTTP/2 with prior knowledge (PRI * HTTP/2.0): most often an OTLP exporter set
            # to gRPC; say so once a minute instead of answering 404 to the preface
            self.server.log_limited(
                "http2",
                logging.WARNING,
                "refused HTTP/2 (is an OTLP exporter set to gRPC? use http/protobuf)",
                kv={"listener": self.server.name},
            )
            self._refuse(505)
            return
        framing = {n for n, _ in event.headers.raw_items() if n.lower() in _FRAMING}
        if len(framing) > 1:
            # both Transfer-Encoding and Content-Length: a request smuggling vector behind
            # a proxy that frames by the other one (RFC 9112, 6.1: refuse, or close after)
            self._malformed(h11.RemoteProtocolError("both Transfer-Encoding and Content-Length"))
            return
        assert self._body is not None
        self._run(Request(event.method, event.target, event.headers, self._body))

    def _run(self, request: Request) -> None:
        try:
            result = self.server.dispatch(request)
        except Exception:  # noqa: BLE001 - a handler's bug costs its own request only
            result = self._failed(request)
        if isinstance(result, Response):
            self._done(request, result)  # answered now: the common case (a scrape)
        else:
            self._task = asyncio.get_running_loop().create_task(self._await(request, result))

    # answering
    async def _await(self, request: Request, pending: Awaitable[Response]) -> None:
        try:
            response = await pending
        except Exception:  # noqa: BLE001 - a handler's bug costs its own request only
            response = self._failed(request)
        self._task = None
        try:
            self._done(request, response)
        except Exception:  # noqa: BLE001 - no exception may outlive the task unretrieved
            self.server.log_limited(
                "send-error",
                logging.ERROR,
                "cannot finish a request",
                kv={"path": request.path[:200]},
                exc_info=True,
            )
            self.abort()

    def _failed(self, request: Request) -> Response:
        self.server.log_limited(
            "handler-error",
            logging.ERROR,
            "request handler failed",
            kv={"path": request.path[:200], "method": request.method[:16]},
            exc_info=True,
        )
        return Response(text="Internal Server Error\n", status=500)

    def _done(self, request: Request, response: Response) -> None:
        """Send ``response``, then wait for the next request or close."""
        self._answered += 1
        if self.transport is None or self.transport.is_closing():
            self._closed = True  # the client went away: nothing to send, nothing to log
        fast, self._fast = self._fast, None
        close = False
        if not self._closed:
            close = self._send(response, request.method == "HEAD", fast)
        self._body = None
        self.busy = False
        if self._closed:
            return
        if fast is not None:  # h11 saw nothing of it: still idle, ready for the next request
            if close or self._eof:
                self.close()
            else:
                self._arm(self.server.idle_timeout_s, self._idle_deadline)
                self._sync_reading()
            return
        conn = self.h11
        if conn.our_state is h11.DONE and conn.their_state is h11.DONE:
            conn.start_next_cycle()
            self._arm(self.server.idle_timeout_s, self._idle_deadline)
            self._sync_reading()
            if not self._draining:  # (else the loop reading events goes on by itself)
                self._drain()  # a pipelined request already received
        elif conn.their_state is h11.SEND_BODY:
            self._linger()
        else:
            self.close()

    def _send(self, response: Response, head: bool, fast: tuple[bytes, bool] | None) -> bool:
        """Write ``response``; True when a fast-path connection must close after it."""
        assert self.transport is not None
        close = False
        try:
            if fast is None:
                out = _serialize(self.h11, response, head)
            else:
                raw, close = fast
                quick = _fast_response(response, head, close)
                if quick is None:
                    out, close = _h11_response(raw, response, head)
                else:
                    out = quick
        except h11.LocalProtocolError as exc:
            self.server.log_limited(
                "bad-response", logging.ERROR, "cannot send a response", kv={"error": str(exc)}
            )
            self.close()
            return True
        self.transport.write(out)
        return close

    def _malformed(self, exc: h11.RemoteProtocolError) -> None:
        if self._eof and self.h11.their_state is not h11.IDLE:
            # the client closed in the middle of a request (an upload it gave up): not a
            # malformed request, and no one to answer
            log.debug("client closed mid-request", extra={"kv": {"listener": self.server.name}})
            if self._body is not None:
                self._body.fail(ConnectionResetError("client went away"))
            self.close()
            return
        status = exc.error_status_hint if 400 <= exc.error_status_hint < 500 else 400
        self.server.log_limited(
            "malformed",
            logging.WARNING,
            "malformed HTTP requests refused",
            kv={"listener": self.server.name, "status": status, "error": str(exc)[:120]},
        )
        self._refuse(status)

    def _refuse(self, status: int) -> None:
        """Answer ``status`` with no body unless an answer was started, and close."""
        if self.transport is not None and self._task is None and self.h11.our_state in _UNANSWERED:
            phrase = _status_line(status)
            self.transport.write(
                f"HTTP/1.1 {status} {phrase}\r\nConnection: close\r\n"
                "Content-Length: 0\r\n\r\n".encode("latin-1")
            )
        if self._body is not None:
            self._body.fail(ConnectionResetError("malformed request body"))
        self.close()

    # timers and closing
    def _arm(self, delay: float, callback: Callable[[], None]) -> None:
        self._disarm()
        self._timer = asyncio.get_running_loop().call_later(delay, callback)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _header_deadline(self) -> None:
        self._timer = None
        if self.served or self._closed:
            return
        self.server.cap.count_header_timeout()
        self.close()

    def _idle_deadline(self) -> None:
        self._timer = None
        if not self.busy:
            self.close()

    def _linger(self) -> None:
        """Answered before the request's body arrived: read and drop the rest, then close.

        Closing at once would make the kernel reset the connection while the body still
        arrives, and a client that sends its whole body before reading (Python's
        ``http.client``) would see the reset, not the answer (a 413, a 401). So the answer
        goes out, the agent's side is shut, and what the client still sends is read and
        dropped for at most :data:`LINGER_S` and :data:`LINGER_MAX_BYTES`, as nginx's
        ``lingering_close`` does.
        """
        self._lingering = True
        self._closed = True
        assert self.transport is not None
        if self.transport.can_write_eof():
            try:
                self.transport.write_eof()
            except OSError:  # the client already reset the connection (ENOTCONN)
                self.abort()
                return
        self._sync_reading()
        self._arm(LINGER_S, self.abort)

    def close(self) -> None:
        """Close the connection; what was written is still sent.

        A client that does not take it within :data:`CLOSE_DEADLINE_S` is cut off.
        """
        if self._closed and not self._lingering:
            return
        self._closed = True
        self._lingering = False
        if self.transport is not None and not self._lost:
            self.transport.close()
            self._arm(CLOSE_DEADLINE_S, self.abort)

    def abort(self) -> None:
        """Close now, dropping what was not sent, and stop the request being answered."""
        self._closed = True
        self._lingering = False
        self._disarm()
        if self.transport is not None and not self._lost:
            self.transport.abort()
        if self._task is not None:
            self._task.cancel()


_date: list[Any] = [0, b""]


def _http_date() -> bytes:
    """The ``Date`` header's value for now (formatted once a second)."""
    now = int(time.time())
    if now != _date[0]:
        _date[0], _date[1] = now, formatdate(now, usegmt=True).encode()
    return bytes(_date[1])


# ---- the cap ----------------------------------------------------------------------------------
ConnT = TypeVar("ConnT")


class CapPolicy(Generic[ConnT]):
    """The connection cap every listener of the agent applies, with its counters and log.

    The agent's own listener (:class:`HttpServer`) and the request proxies' aiohttp
    listeners (:class:`agent.listener.ConnectionCap`) keep their open connections each
    their own way; this is what they share (see the module doc, *Cap* and *Header
    timeout*): which connection is closed to make room for a new one, what is counted and
    the rate-limited log lines. ``ConnT`` is the listener's connection type.

    Args:
        name: the listener, for log lines (e.g. ``"api 127.0.0.1:9470"``).
        max_connections: open connections allowed at once (can be changed while serving).
        header_timeout_s: seconds a new connection has to send its first request head.
        logger: where the log lines go (the listener's module logger).

    Attributes:
        closed_idle: idle connections closed to make room, since start.
        refused: connections refused (503) because every open one was busy, since start.
        header_timeouts: connections closed for not sending a request head in time.
        log_limited: the listener's rate-limited log (one line per kind per
            :data:`LOG_PERIOD_S`, with the count since the last).
    """

    def __init__(
        self,
        name: str,
        max_connections: int = MAX_CONNECTIONS,
        header_timeout_s: float = HEADER_TIMEOUT_S,
        logger: logging.Logger = log,
    ) -> None:
        self.name = name
        self.max_connections = max_connections
        self.header_timeout_s = header_timeout_s
        self.closed_idle = 0
        self.refused = 0
        self.header_timeouts = 0
        self.log_limited = RateLimitedLog(logger, LOG_PERIOD_S)

    @staticmethod
    def victim(idle: Iterable[ConnT], served: Callable[[ConnT], bool]) -> ConnT | None:
        """The connection to close for a new one at the cap.

        Args:
            idle: the open connections with no request being handled, in accept order.
            served: whether a connection has sent a request.

        Returns:
            The oldest that never sent a request, else the oldest; ``None`` when every
            connection is busy (the new one is then refused).
        """
        first = None
        for conn in idle:
            if not served(conn):
                return conn
            if first is None:
                first = conn
        return first

    def count_evicted(self) -> None:
        """An idle connection was closed to make room: count and log it."""
        self.closed_idle += 1
        self.log_limited(
            "evicted",
            logging.WARNING,
            "connection cap reached: closed idle connections to admit new ones",
            kv={"listener": self.name, "max_connections": self.max_connections},
        )

    def count_refused(self) -> None:
        """A new connection was refused, every open one busy: count and log it."""
        self.refused += 1
        self.log_limited(
            "refused",
            logging.WARNING,
            "connection refused: every connection is busy",
            kv={"listener": self.name, "max_connections": self.max_connections},
        )

    def count_header_timeout(self) -> None:
        """A connection was closed for sending no request head in time: count and log it."""
        self.header_timeouts += 1
        self.log_limited(
            "header-timeout",
            logging.INFO,
            "closed connections that sent no request head in time",
            kv={"listener": self.name, "header_timeout_s": self.header_timeout_s},
        )


# ---- the server -------------------------------------------------------------------------------
class HttpServer:
    """One bounded listener serving ``routes`` (see the module docstring).

    Args:
        name: the listener, for log lines (e.g. ``"api 127.0.0.1:9470"``).
        routes: what it serves.
        middlewares: wrap every request, first listed outermost.
        max_connections: open connections allowed at once (can be changed while serving).
        header_timeout_s: seconds a new connection has to send its first request head.
        idle_timeout_s: seconds a kept-alive connection may wait for its next request.

    Attributes:
        cap: the connection cap, its counters and the listener's rate-limited log.
        port: the bound port once :meth:`start` returned.
    """

    def __init__(
        self,
        name: str,
        routes: Iterable[Route],
        middlewares: Sequence[Middleware] = (),
        max_connections: int = MAX_CONNECTIONS,
        header_timeout_s: float = HEADER_TIMEOUT_S,
        idle_timeout_s: float = IDLE_TIMEOUT_S,
    ) -> None:
        self.name = name
        self.cap: CapPolicy[_Connection] = CapPolicy(name, max_connections, header_timeout_s)
        self.log_limited = self.cap.log_limited
        self.header_timeout_s = header_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.port: int | None = None
        self._routes: dict[str, dict[str, Handler]] = {}
        for r in routes:
            self._routes.setdefault(r.path, {})[r.method.upper()] = r.handler
        self._middlewares = tuple(middlewares)
        self._conns: dict[_Connection, None] = {}  # open connections, in accept order
        self._server: asyncio.Server | None = None

    @property
    def max_connections(self) -> int:
        """Open connections allowed at once (the daemon changes it on reload)."""
        return self.cap.max_connections

    @max_connections.setter
    def max_connections(self, value: int) -> None:
        self.cap.max_connections = value

    @property
    def connections(self) -> int:
        """Connections open now."""
        return len(self._conns)

    @property
    def busy(self) -> int:
        """Connections with a request being answered now."""
        return sum(1 for c in self._conns if c.busy)

    async def start(self, host: str, port: int, ssl_context: ssl.SSLContext | None = None) -> int:
        """Bind ``host:port`` (0: any free port) and serve; returns the bound port.

        Raises:
            OSError: the address cannot be bound (nothing is left listening).
        """
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: _Connection(self),
            host,
            port,
            ssl=ssl_context,
            ssl_handshake_timeout=self.header_timeout_s if ssl_context is not None else None,
            reuse_address=True,
            backlog=128,
        )
        sockets = self._server.sockets or ()
        self.port = int(sockets[0].getsockname()[1]) if sockets else port
        return self.port

    async def close(self) -> None:
        """Stop listening; idle connections close now, busy ones within :data:`SHUTDOWN_GRACE_S`."""
        if self._server is not None:
            self._server.close()
        for conn in list(self._conns):
            if not conn.busy:
                conn.close()
        deadline = asyncio.get_running_loop().time() + SHUTDOWN_GRACE_S
        while any(c.busy for c in self._conns) and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.02)
        for conn in list(self._conns):
            conn.abort()
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), SHUTDOWN_GRACE_S)
        self._conns.clear()

    # the cap
    def admit(self, conn: _Connection) -> bool:
        """Take ``conn`` in, making room by closing an idle one at the cap; False: refuse it."""
        if len(self._conns) >= self.cap.max_connections and not self._make_room():
            self.cap.count_refused()
            return False
        self._conns[conn] = None
        return True

    def forget(self, conn: _Connection) -> None:
        """``conn`` closed."""
        self._conns.pop(conn, None)

    def _make_room(self) -> bool:
        victim = self.cap.victim((c for c in self._conns if not c.busy), lambda c: c.served)
        if victim is None:
            return False
        self._conns.pop(victim, None)
        victim.close()
        self.cap.count_evicted()
        return True

    # routing
    def dispatch(self, request: Request) -> Response | Awaitable[Response]:
        """Answer ``request``: its route's handler inside the middlewares (404, 405 if none).

        Returns the response, or an awaitable of it (a coroutine-function handler, or any
        handler inside middlewares).
        """
        methods = self._routes.get(request.path)
        handler: Handler
        if methods is None:
            handler = _not_found
        else:
            found = methods.get(request.method)
            if found is None and request.method == "HEAD":
                found = methods.get("GET")
            handler = found if found is not None else _not_allowed(methods)
        for mw in reversed(self._middlewares):
            handler = _wrapped(mw, handler)
        return handler(request)


def _wrapped(mw: Middleware, inner: Handler) -> Handler:
    async def call(request: Request) -> Response:
        return await mw(request, inner)

    return call


def _not_found(_: Request) -> Response:
    return Response(text="404: Not Found\n", status=404)


def _not_allowed(methods: Mapping[str, Handler]) -> Handler:
    allowed = sorted({*methods, *(("HEAD",) if "GET" in methods else ())})

    def refuse(_: Request) -> Response:
        return Response(
            text="405: Method Not Allowed\n", status=405, headers={"Allow": ", ".join(allowed)}
        )

    return refuse


# ---- the event loop and the process -----------------------------------------------------------
def install_accept_error_handler(loop: asyncio.AbstractEventLoop) -> None:
    """Log the loop's accept errors (EMFILE, ENFILE, ENOBUFS) once per period with a count.

    asyncio reports each failed ``accept()`` through the loop's exception handler, and a
    listener out of file descriptors retries every second for as long as it lasts; this
    handler turns those into one WARNING line per listener per :data:`LOG_PERIOD_S`. Every
    other context goes to the handler that was installed before (or asyncio's default).
    """
    previous = loop.get_exception_handler()
    limited = RateLimitedLog(log, LOG_PERIOD_S)

    def handler(lp: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        message = str(context.get("message", ""))
        if message.startswith("socket.accept() out of system resource"):
            sock: Any = context.get("socket")
            where = ""
            with contextlib.suppress(AttributeError, OSError, IndexError, TypeError):
                addr = sock.getsockname()
                where = f"{addr[0]}:{addr[1]}"
            exc = context.get("exception")
            limited(
                f"accept:{where}",
                logging.WARNING,
                "accept failed: out of file descriptors or buffers; retrying",
                kv={"listener": where, "error": f"{type(exc).__name__}: {exc}" if exc else message},
            )
            return
        if previous is not None:
            previous(lp, context)
        else:
            lp.default_exception_handler(context)

    loop.set_exception_handler(handler)


def raise_fd_limit(target: int = 65536) -> tuple[int, int]:
    """Raise the soft open-files limit towards the hard one (at most ``target``).

    systemd starts services with a soft ``RLIMIT_NOFILE`` of 1,024 unless ``LimitNOFILE=``
    says otherwise, and expects programs that need more (and do not use ``select()``; the
    agent uses epoll through asyncio) to raise it themselves, as Go programs do. Each
    listener holds up to its ``max_connections`` plus one listen backlog (128) during an
    accept burst.

    Returns:
        The (soft, hard) limits now in force; unchanged where the platform refuses.
    """
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = target if hard == resource.RLIM_INFINITY else min(hard, target)
    if soft != resource.RLIM_INFINITY and soft < want:
        with contextlib.suppress(OSError, ValueError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    limits = resource.getrlimit(resource.RLIMIT_NOFILE)
    return int(limits[0]), int(limits[1])
