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
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

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
    """

    status: int | None
    content_type: str | None
    body: str
    reason: str = ""

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


def _reason(exc: Exception) -> str:
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


def _shutdown(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):  # already closed
        sock.shutdown(socket.SHUT_RDWR)
