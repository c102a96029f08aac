"""One bounded HTTP GET, with every failure turned into a short reason instead of an exception.

Engine samplers and their add-ons (llama.cpp ``/slots`` and ``/props``) fetch through
:func:`http_get`, so a refused connection, a timeout or an oversized body is data
(``reason``) and never an exception out of ``collect()``.

The timeout is one wall-clock deadline for the whole GET, not a per-read timeout: an
engine that drips its headers or body a byte at a time (every read returning within the
read timeout) is cut off at the deadline with reason ``timeout``. httpx only has per-phase
timeouts, so :class:`_Deadline` watches the connection (found through httpcore's public
``trace`` extension) and shuts its socket down when the deadline passes, which wakes a read
blocked on it.

httpx itself is imported on first need: an agent whose engines all speak plain HTTP reads
them through :class:`KeptAlive` and never loads it (~1.2 MiB resident; issue 15).
:func:`url_parts` reads such an engine's URL as ``httpx.URL`` would.
"""

from __future__ import annotations

import contextlib
import email.message
import functools
import ipaddress
import re
import socket
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    import httpx

MAX_BODY_BYTES: Final = 32 * 1024 * 1024
"""Bodies larger than this are not read (reason ``too_large``); vLLM's is ~100 KiB."""


@dataclass(frozen=True, slots=True)
class HttpResult:
    """The outcome of one GET.

    Attributes:
        status: the HTTP status code; ``None`` when no response arrived.
        content_type: the ``Content-Type`` header, or ``None``.
        body: the decoded body (charset from the header, else UTF-8; undecodable bytes
            replaced); ``""`` when no response arrived.
        reason: ``""`` when a response arrived (whatever its status); otherwise
            ``"connect"`` (refused, DNS, unreachable), ``"timeout"``, ``"too_large"``,
            ``"bad_url"`` or ``"transport"`` (any other transport failure).
        raw: the undecoded body, only from :meth:`KeptAlive.get` with ``decode=False``
            (``body`` is ``""`` then); ``None`` otherwise.
    """

    status: int | None
    content_type: str | None
    body: str
    reason: str = ""
    raw: bytes | None = None

    def text(self) -> str:
        """The decoded body: ``body``, or ``raw`` decoded as :func:`http_get` would."""
        return self.body if self.raw is None else _decode(self.raw, self.content_type)

    @property
    def ok(self) -> bool:
        """True for a 2xx response."""
        return self.status is not None and 200 <= self.status < 300


Fetch = Callable[[str], HttpResult]
"""``fetch(path) -> HttpResult``: GET ``path`` (e.g. ``"/slots"``) on the engine's base URL."""


def http_get(
    client: httpx.Client,
    url: str,
    timeout_s: float,
    max_bytes: int = MAX_BODY_BYTES,
) -> HttpResult:
    """GET ``url`` with ``client`` within one wall-clock deadline; never raises.

    The request asks for ``Connection: close``, so every GET has a connection of its own
    that the deadline can cut (a kept-alive connection would not pass through ``connect``).

    Args:
        client: the sampler's HTTP client.
        url: absolute URL.
        timeout_s: seconds allowed for the whole GET (connect, request, headers and body
            together); also each phase's own httpx timeout.
        max_bytes: bodies beyond this many bytes are abandoned (reason ``too_large``).

    Returns:
        An :class:`HttpResult`; transport failures are reported in ``reason``
        (``timeout`` once the deadline has passed, whatever the read was doing).
    """
    import httpx

    guard = _Deadline(timeout_s)
    try:
        with client.stream(
            "GET",
            url,
            headers={"Connection": "close"},
            timeout=httpx.Timeout(timeout_s),
            extensions={"trace": guard.trace},
        ) as resp:
            chunks: list[bytes] = []
            size = 0
            for chunk in resp.iter_bytes():
                if guard.expired:
                    return HttpResult(None, None, "", "timeout")
                size += len(chunk)
                if size > max_bytes:
                    return HttpResult(resp.status_code, _ctype(resp), "", "too_large")
                chunks.append(chunk)
            raw = b"".join(chunks)
            encoding = resp.charset_encoding or "utf-8"
            try:
                body = raw.decode(encoding, errors="replace")
            except LookupError:  # unknown charset name in the header
                body = raw.decode("utf-8", errors="replace")
            return HttpResult(resp.status_code, _ctype(resp), body)
    except httpx.TimeoutException:
        return HttpResult(None, None, "", "timeout")
    except Exception as exc:  # noqa: BLE001 - every failure becomes a reason, by design
        return HttpResult(None, None, "", "timeout" if guard.expired else _reason(exc))
    finally:
        guard.cancel()


@functools.cache
def tls_context() -> ssl.SSLContext:
    """The one TLS context of every engine client: httpx's default (certifi, or ``SSL_CERT_FILE``).

    An ``httpx.Client`` left to itself builds its own context and loads the whole CA bundle
    into it (~0.8 MiB resident each; 16 on the standard 8-GPU node, an engine sampler and a
    gauge reader per engine). One context, built on first use, serves them all: the same
    verification, one bundle.
    """
    import httpx

    return httpx.create_ssl_context()


class LazyClient:
    """An ``httpx.Client`` made on first use, with the shared :func:`tls_context`.

    Engine samplers read plain-HTTP engines through :class:`KeptAlive` and ask httpx only
    for what it does not speak (``https``, redirects, encodings); an agent whose engines
    never need httpx never builds a client. Thread-safe.

    Args:
        transport: an ``httpx`` transport (tests inject ``httpx.MockTransport``); ``None``:
            httpx's own.
        headers: default request headers.
    """

    def __init__(
        self,
        transport: httpx.BaseTransport | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        self._transport = transport
        self._headers = headers
        self._client: httpx.Client | None = None
        self._lock = threading.Lock()

    def get(self) -> httpx.Client:
        """The client (follows redirects), built on the first call."""
        import httpx

        with self._lock:
            if self._client is None:
                self._client = httpx.Client(
                    transport=self._transport,
                    headers=self._headers,
                    follow_redirects=True,
                    verify=tls_context(),
                )
            return self._client

    def close(self) -> None:
        """Close the client if one was built; the next :meth:`get` builds another."""
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()


def _reason(exc: Exception) -> str:
    import httpx

    if isinstance(exc, httpx.ConnectError):
        return "connect"
    if isinstance(exc, (httpx.InvalidURL, httpx.UnsupportedProtocol)):
        return "bad_url"
    return "transport"  # every other failure, by design


def _ctype(resp: httpx.Response) -> str | None:
    value: str | None = resp.headers.get("content-type")
    return value


class _Deadline:
    """Cuts one GET's connection when its wall-clock budget is spent.

    A :class:`threading.Timer` fires after ``timeout_s`` seconds and shuts down the socket
    that httpcore reported through the ``trace`` extension (``connection.connect_tcp``
    completing); a socket that connects after the deadline is shut down at once.
    """

    def __init__(self, timeout_s: float) -> None:
        self.expired = False
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._timer = threading.Timer(max(0.0, timeout_s), self._expire)
        self._timer.daemon = True
        self._timer.start()

    def trace(self, event: str, info: dict[str, Any]) -> None:
        """Keep (as httpcore's ``trace`` callback) the socket of the connection just opened."""
        if event != "connection.connect_tcp.complete":
            return
        stream = info.get("return_value")
        sock = stream.get_extra_info("socket") if stream is not None else None
        if not isinstance(sock, socket.socket):
            return
        with self._lock:
            self._sock = sock
            if not self.expired:
                return
        _shutdown(sock)

    def cancel(self) -> None:
        """Stop the timer (the GET is over); idempotent."""
        self._timer.cancel()
        with self._lock:
            self._sock = None

    def _expire(self) -> None:
        with self._lock:
            self.expired = True
            sock = self._sock
        if sock is not None:
            _shutdown(sock)


_PLAIN_URL: Final = re.compile(
    r"(https?)://([A-Za-z0-9.-]+|\[[0-9A-Fa-f:.]+\])(?::([0-9]{1,5}))?(/[A-Za-z0-9._~/-]*)?"
)
"""The URLs :func:`url_parts` reads itself: ``http(s)://host[:port][/path]`` with a DNS name,
a dotted IPv4 address or a bracketed IPv6 one, and a path of unreserved characters."""
_IPV4_STYLE: Final = re.compile(r"[0-9]+\.[0-9]+\.[0-9]+\.[0-9]+")
_DEFAULT_PORTS: Final = {"http": 80, "https": 443}


def url_parts(url: str) -> tuple[str, str, int | None]:
    """Return ``(scheme, host, port)`` of ``url`` as ``httpx.URL`` gives them.

    A plain engine URL (:data:`_PLAIN_URL`: no user info, query, IDNA name or escape) is
    read here, so an agent whose engines speak plain HTTP never imports httpx; anything
    else is handed to ``httpx.URL``. Either way the result is httpx's: a DNS name lowercased,
    an IPv6 address without its brackets, the port ``None`` when absent or the scheme's
    default (``tests/test_engines_url_parts.py`` compares the two on a table of URLs).

    Args:
        url: an absolute URL, e.g. ``http://127.0.0.1:8000``.

    Returns:
        The scheme, the host and the port.

    Raises:
        httpx.InvalidURL: ``url`` is not a URL httpx accepts (e.g. an IPv4 address with an
            octet over 255); TypeError: ``url`` is not a string.
    """
    m = _PLAIN_URL.fullmatch(url)
    if m is not None and _valid_host(host := m.group(2)):
        scheme, port = m.group(1), m.group(3)
        number = None if port is None else int(port)
        host = host[1:-1] if host[0] == "[" else host.lower()  # httpx keeps IPv6's case
        return scheme, host, None if number == _DEFAULT_PORTS[scheme] else number
    import httpx

    parsed = httpx.URL(url)
    return parsed.scheme, parsed.host, parsed.port


def _valid_host(host: str) -> bool:
    """True when httpx takes the host of a :data:`_PLAIN_URL` as it is (a DNS name lowercased).

    False for an IDNA name (httpx's ``.host`` decodes it) and for an IP address that is not
    one (httpx raises ``InvalidURL``).
    """
    if "xn--" in host.lower():
        return False
    try:
        if host[0] == "[":
            ipaddress.IPv6Address(host[1:-1])
        elif _IPV4_STYLE.fullmatch(host):
            ipaddress.IPv4Address(host)
    except ValueError:
        return False
    return True


def _shutdown(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):  # already closed
        sock.shutdown(socket.SHUT_RDWR)


_HEAD_MAX: Final = 64 * 1024
"""Status line and headers beyond this many bytes: not an engine; handed to httpx."""
_RECV: Final = 256 * 1024


class KeptAlive:
    """GETs over one kept-alive plain-HTTP/1.1 connection to an engine, cheap in CPU.

    An engine sampler at 10 Hz (the KV/queue gauges, :meth:`EngineSampler.gauge_sampler
    <agent.samplers.engines.base.EngineSampler.gauge_sampler>`) GETs each engine ten times
    a second. Measured on a 51 KB vLLM exposition over loopback (``benchmarks/node_cost.py``
    prints the effect): httpx costs ~1.0 ms of client CPU per GET, ``http.client`` kept
    alive ~0.45 ms, this reader ~0.16 ms; at 8 engines x 10 Hz only the last fits the
    node's 5 %-of-a-core budget (issue 15). It speaks only what engines answer a metrics
    GET with: a status, headers and a ``Content-Length``, chunked or read-to-close body,
    uncompressed (it asks for identity). Anything else — ``https``, a redirect or other
    1xx/3xx status, a ``Content-Encoding``, headers over 64 KiB — returns ``None`` and the
    caller uses :func:`http_get` (httpx) for that GET.

    The deadline is one wall-clock budget for the whole GET, as in :func:`http_get`: every
    socket operation waits at most the time left, so an engine that drips bytes is cut at
    the deadline (reason ``timeout``) and the connection closed. A kept connection the
    engine closed while idle is reopened once. Not thread-safe: one per sampler thread.

    Args:
        url: the engine's base URL (``http://host:port``).
        headers: extra request headers (``Accept``).
    """

    def __init__(self, url: str, headers: dict[str, str] | None = None) -> None:
        scheme, host, port = url_parts(url)
        self.usable = scheme == "http" and bool(host)
        self._addr = (host, port or 80)
        bracketed = f"[{host}]" if ":" in host else host
        hostport = bracketed if port is None else f"{bracketed}:{port}"
        extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        self._head = f"Host: {hostport}\r\nAccept-Encoding: identity\r\n{extra}\r\n".encode(
            "latin-1"
        )
        self._sock: socket.socket | None = None
        self._buf = bytearray()
        self._ahead: tuple[bytes, float] | None = None  # a request sent, its response unread

    def close(self) -> None:
        """Close the kept connection (the next GET opens another)."""
        sock, self._sock = self._sock, None
        self._buf.clear()
        self._ahead = None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.close()

    def send_ahead(self, path: str) -> bool:
        """Send the GET of ``path`` now on the kept connection; :meth:`get` reads its response.

        For a thread that reads several engines in turn: with every request sent first,
        the engines answer while the thread reads the others, and it waits once, not once
        per engine (8 engines' 51 KB GETs: 1.3-1.5 -> 1.0 ms of CPU per round here, 8.7 ->
        3.5 context switches). Never blocks: only on a connection that is open, idle and
        takes the whole request at once; anything else is left to :meth:`get`. Never raises.

        Returns:
            True when the request was sent.
        """
        sock = self._sock
        if sock is None or self._ahead is not None or self._buf or not path.isascii():
            return False
        request = f"GET {path} HTTP/1.1\r\n".encode("ascii") + self._head
        try:
            sock.settimeout(0.0)
            sent = sock.send(request)
        except OSError:
            sent = -1
        if sent != len(request):
            self.close()  # a partial request would corrupt the stream: start over in get()
            return False
        self._ahead = (request, time.monotonic())
        return True

    def get(
        self,
        path: str,
        deadline: float,
        max_bytes: int = MAX_BODY_BYTES,
        decode: bool = True,
        ahead_max_age: float = 0.0,
    ) -> HttpResult | None:
        """GET ``path`` by ``deadline`` (``time.monotonic()`` seconds); never raises.

        Args:
            path: the request path, ASCII.
            deadline: ``time.monotonic()`` seconds by which the whole GET is done.
            max_bytes: bodies beyond this many bytes are not read (``too_large``).
            decode: False leaves the body undecoded in :attr:`HttpResult.raw` (a reader
                that needs a few lines of it decodes only those).
            ahead_max_age: the response of this GET sent by :meth:`send_ahead` at most this
                many seconds ago is read; an older one (or another request's) is not: the
                connection is closed and the GET sent afresh.

        Returns:
            An :class:`HttpResult` as :func:`http_get` returns it (reasons ``connect``,
            ``timeout``, ``too_large``, ``transport``), or ``None`` when this response is
            outside what this reader speaks (the caller then asks httpx).
        """
        if not self.usable or not path.isascii():
            return None
        request = f"GET {path} HTTP/1.1\r\n".encode("ascii") + self._head
        ahead, sent = self._ahead, False
        if ahead is not None:
            sent = ahead[0] == request and time.monotonic() - ahead[1] <= ahead_max_age
            if not sent:
                self.close()  # its unread response would be taken for this one's
            self._ahead = None
        reused = self._sock is not None
        try:
            try:
                return self._exchange(request, deadline, max_bytes, decode, sent)
            except _Stale:
                self.close()
                if not reused:
                    return HttpResult(None, None, "", "transport")
                return self._exchange(request, deadline, max_bytes, decode)
        except _Stale:
            self.close()
            return HttpResult(None, None, "", "transport")
        except _Unsupported:
            self.close()
            return None
        except _TooLarge as exc:
            self.close()
            return HttpResult(exc.status, exc.content_type, "", "too_large")
        except (TimeoutError, _Expired):
            self.close()
            return HttpResult(None, None, "", "timeout")
        except _ConnectFailed:
            self.close()
            return HttpResult(None, None, "", "timeout" if _left(deadline) <= 0 else "connect")
        except Exception:  # noqa: BLE001 - every failure becomes a reason, by design
            self.close()
            return HttpResult(None, None, "", "transport")

    # -- one exchange ----------------------------------------------------------------------

    def _exchange(
        self,
        request: bytes,
        deadline: float,
        max_bytes: int,
        decode: bool = True,
        sent: bool = False,
    ) -> HttpResult:
        sock = self._sock
        if sock is None:
            left = _left(deadline)
            if left <= 0:
                raise _Expired
            try:
                sock = socket.create_connection(self._addr, timeout=left)
            except TimeoutError:
                raise
            except OSError as exc:  # refused, unreachable, name not resolved
                raise _ConnectFailed(str(exc)) from exc
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._sock = sock
            self._buf.clear()
        sock.settimeout(max(0.001, _left(deadline)))
        try:
            if not sent:  # else send_ahead sent it on this connection
                sock.sendall(request)
        except (BrokenPipeError, ConnectionResetError) as exc:
            raise _Stale from exc  # the engine closed the kept connection while idle
        head_end = self._fill_until(b"\r\n\r\n", deadline, _HEAD_MAX, fresh=True)
        head = bytes(self._buf[:head_end])
        del self._buf[: head_end + 4]
        status_line, _, header_block = head.partition(b"\r\n")
        parts = status_line.split(None, 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
            raise _Unsupported
        status = int(parts[1])
        headers: dict[bytes, bytes] = {}
        for line in header_block.split(b"\r\n"):
            name, sep, value = line.partition(b":")
            if not sep:
                raise _Unsupported
            key = name.strip().lower()
            if key in headers and key in (b"content-length", b"transfer-encoding"):
                raise _Unsupported  # ambiguous framing: let httpx judge
            headers[key] = value.strip()
        encoding = headers.get(b"content-encoding", b"identity").lower()
        if status < 200 or 300 <= status < 400 or encoding not in (b"identity", b""):
            raise _Unsupported
        ctype_raw = headers.get(b"content-type")
        ctype = ctype_raw.decode("latin-1") if ctype_raw is not None else None
        keep = parts[0] != b"HTTP/1.0" and headers.get(b"connection", b"").lower() != b"close"
        te = headers.get(b"transfer-encoding", b"").lower()
        if te not in (b"", b"chunked", b"identity"):
            raise _Unsupported
        if status in (204, 304):
            raw = b""
        elif te == b"chunked":
            raw = self._chunked(deadline, max_bytes, status, ctype)
        elif b"content-length" in headers:
            text = headers[b"content-length"]
            if not text.isdigit():
                raise _Unsupported
            length = int(text)
            if length > max_bytes:
                raise _TooLarge(status, ctype)
            self._fill_size(length, deadline)
            if len(self._buf) == length:  # the usual case: the buffer holds just this body
                raw = bytes(self._buf)
                self._buf.clear()
            else:
                raw = bytes(self._buf[:length])
                del self._buf[:length]
        else:
            raw = self._to_close(deadline, max_bytes, status, ctype)
            keep = False
        if not keep:
            self.close()
        if not decode:
            return HttpResult(status, ctype, "", raw=raw)
        return HttpResult(status, ctype, _decode(raw, ctype))

    def _recv(self, deadline: float) -> bytes:
        sock = self._sock
        assert sock is not None
        left = _left(deadline)
        if left <= 0:
            raise _Expired
        sock.settimeout(left)
        return sock.recv(_RECV)

    def _fill_until(self, marker: bytes, deadline: float, limit: int, fresh: bool) -> int:
        start = 0
        while True:
            i = self._buf.find(marker, start)
            if i >= 0:
                return i
            if len(self._buf) > limit:
                raise _Unsupported
            start = max(0, len(self._buf) - len(marker) + 1)
            try:
                data = self._recv(deadline)
            except ConnectionResetError:
                if fresh and not self._buf:
                    raise _Stale from None
                raise
            if not data:
                raise _Stale if fresh and not self._buf else ConnectionResetError("closed")
            self._buf += data

    def _fill_size(self, size: int, deadline: float) -> None:
        while len(self._buf) < size:
            data = self._recv(deadline)
            if not data:
                raise ConnectionResetError("closed mid-body")
            self._buf += data

    def _chunked(self, deadline: float, max_bytes: int, status: int, ctype: str | None) -> bytes:
        out = bytearray()
        while True:
            end = self._fill_until(b"\r\n", deadline, _HEAD_MAX, fresh=False)
            size_text = bytes(self._buf[:end]).split(b";", 1)[0].strip()
            del self._buf[: end + 2]
            try:
                size = int(size_text, 16)
            except ValueError:
                raise _Unsupported from None
            if size == 0:
                # trailers, then the blank line that ends the message
                while True:
                    end = self._fill_until(b"\r\n", deadline, _HEAD_MAX, fresh=False)
                    line = bytes(self._buf[:end])
                    del self._buf[: end + 2]
                    if not line:
                        return bytes(out)
            if len(out) + size > max_bytes:
                raise _TooLarge(status, ctype)
            self._fill_size(size + 2, deadline)
            out += self._buf[:size]
            del self._buf[: size + 2]

    def _to_close(self, deadline: float, max_bytes: int, status: int, ctype: str | None) -> bytes:
        while True:
            if len(self._buf) > max_bytes:
                raise _TooLarge(status, ctype)
            data = self._recv(deadline)
            if not data:
                return bytes(self._buf)
            self._buf += data


class _Stale(Exception):
    """A kept connection ended before any byte of the response: reopen once."""


class _ConnectFailed(Exception):
    """No connection could be opened."""


class _Unsupported(Exception):
    """A response this reader does not speak: the caller asks httpx."""


class _Expired(Exception):
    """The GET's deadline passed."""


class _TooLarge(Exception):
    def __init__(self, status: int, content_type: str | None) -> None:
        super().__init__(status)
        self.status = status
        self.content_type = content_type


def _left(deadline: float) -> float:
    return deadline - time.monotonic()


def _decode(raw: bytes, content_type: str | None) -> str:
    """Decode as httpx does: the header's charset, else UTF-8; bad bytes replaced."""
    encoding = _charset(content_type) if content_type else None
    try:
        return raw.decode(encoding or "utf-8", errors="replace")
    except LookupError:  # unknown charset name in the header
        return raw.decode("utf-8", errors="replace")


def ascii_compatible(content_type: str | None) -> bool:
    """True when a body of this ``Content-Type`` decodes as UTF-8 (no charset, or UTF-8/ASCII).

    Its ASCII bytes (metric names, ``#``, newlines) are then those characters, so lines can
    be found in the undecoded bytes and only those lines decoded.
    """
    if content_type is None:
        return True
    charset = _charset(content_type)
    return charset is None or charset.lower().replace("-", "").replace("_", "") in (
        "utf8",
        "usascii",
        "ascii",
    )


@functools.lru_cache(maxsize=64)
def _charset(content_type: str) -> str | None:
    """The ``charset`` parameter of a ``Content-Type``, as httpx reads it (email.message)."""
    if "charset" not in content_type.lower():
        return None
    msg = email.message.Message()
    msg["content-type"] = content_type
    return msg.get_content_charset(failobj=None)
