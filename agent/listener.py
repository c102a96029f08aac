"""Bounded aiohttp listeners for the request proxies: a connection cap, header and idle timeouts.

Each request proxy (:mod:`agent.requests.proxy`, which streams through aiohttp's client and
server) binds through :class:`BoundedSite` with a :class:`ConnectionCap`, bounded as the
agent's own API listener (:mod:`agent.httpd`, h11) is, with the same defaults:

* **Cap.** At most ``max_connections`` open connections per listener. At the cap a new
  connection makes room by closing an *idle* one (no request being handled: one that has
  not finished sending its first request head, or is kept alive between requests), those
  that never sent a request first, oldest first, as nginx reuses keep-alive connections
  when it runs out. Connections with a request in progress (a scrape, a streamed
  completion) are never closed; when every connection is busy, the new one gets a 503 and
  is closed. So a client holding many idle connections cannot starve ``/healthz`` or
  ``/metrics``, and the file descriptors in use stay below the process limit
  (``LimitNOFILE`` in the systemd unit): a burst accepted in one go (at most the listen
  backlog, 128) can exceed the cap briefly.
* **Header timeout.** A connection that has not sent a complete request head within
  ``header_timeout_s`` of being accepted is closed.
* **Idle timeout.** aiohttp's ``keepalive_timeout``: a kept-alive connection with no new
  request head within ``idle_timeout_s`` is closed.
* **Quiet logging.** Closed and refused connections are logged at most once per
  :data:`LOG_PERIOD_S` per listener and kind, with the count since the last line
  (:class:`RateLimitedLog`), instead of one line per event (the event loop's accept
  errors: :func:`agent.httpd.install_accept_error_handler`).
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any, Final

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestHandler

from kvpressure.agent.httpd import (
    HEADER_TIMEOUT_S,
    IDLE_TIMEOUT_S,
    LOG_PERIOD_S,
    MAX_CONNECTIONS,
    CapPolicy,
)
from kvpressure.agent.logs import RateLimitedLog

log = logging.getLogger(__name__)

_REFUSE: Final = (
    b"HTTP/1.1 503 Service Unavailable\r\nConnection: close\r\nContent-Length: 0\r\n\r\n"
)


class ConnectionCap(CapPolicy[RequestHandler]):
    """The connection cap and header timeout of one aiohttp listener (see the module doc).

    Use :attr:`middleware` in the application (it marks connections busy while a request
    is handled) and :class:`BoundedSite` to bind it. The policy, the counters and the log
    lines are the agent's own listener's (:class:`agent.httpd.CapPolicy`); this keeps
    aiohttp's connections.

    Args:
        name: the listener, for log lines (e.g. ``"api 127.0.0.1:9470"``).
        max_connections: open connections allowed at once.
        header_timeout_s: seconds a new connection has to send its first request head.
    """

    def __init__(
        self,
        name: str,
        max_connections: int = MAX_CONNECTIONS,
        header_timeout_s: float = HEADER_TIMEOUT_S,
    ) -> None:
        super().__init__(name, max_connections, header_timeout_s, log)
        self._busy: Counter[RequestHandler] = Counter()
        # Connections admitted (loop time) / that sent a request / that are being closed;
        # pruned to the open ones at every accept (aiohttp's handlers take no weak refs).
        self._made: dict[RequestHandler, float] = {}
        self._served: set[RequestHandler] = set()
        self._closing: set[RequestHandler] = set()

    @web.middleware
    async def middleware(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        """Mark the request's connection busy while ``handler`` runs."""
        conn = request.protocol
        if not isinstance(conn, RequestHandler):  # pragma: no cover - aiohttp always sets one
            return await handler(request)
        self._served.add(conn)
        self._busy[conn] += 1
        try:
            return await handler(request)
        finally:
            self._busy[conn] -= 1
            if self._busy[conn] <= 0:
                del self._busy[conn]

    def protocol_factory(self, server: web.Server) -> Callable[[], asyncio.BaseProtocol]:
        """Wrap aiohttp's protocol factory ``server`` with the cap and the header timer."""
        loop = asyncio.get_running_loop()

        def factory() -> asyncio.BaseProtocol:
            now = loop.time()
            live = set(server.connections)
            # Handlers made in this burst of accepts are not registered yet (aiohttp does
            # it in connection_made, a loop iteration later): count them for up to 1 s.
            for h, made in list(self._made.items()):
                if h not in live and (h in self._closing or now - made > 1.0):
                    del self._made[h]
            self._served &= live
            self._closing &= live
            admitted = len(self._made) - len(self._closing)
            if admitted >= self.max_connections and not self._make_room(loop):
                self.count_refused()
                return _Refuse()
            handler = server()
            self._made[handler] = now
            loop.call_later(self.header_timeout_s, self._header_deadline, handler)
            return handler

        return factory

    def _make_room(self, loop: asyncio.AbstractEventLoop) -> bool:
        victim = self.victim(
            (c for c in self._made if c not in self._busy and c not in self._closing),
            self._served.__contains__,
        )
        if victim is None:
            return False
        self._closing.add(victim)
        # Soon, not now: a victim from this burst of accepts gets its transport in a
        # connection_made callback already queued; force_close before that would leave
        # the transport open.
        loop.call_soon(victim.force_close)
        self.count_evicted()
        return True

    def _header_deadline(self, handler: RequestHandler) -> None:
        if handler in self._served or handler in self._closing or handler.transport is None:
            return
        self._closing.add(handler)
        handler.force_close()
        self.count_header_timeout()


class ServerLog(logging.LoggerAdapter):  # type: ignore[type-arg]
    """aiohttp's server logger for one listener, without a traceback per malformed request.

    aiohttp logs an ERROR with a traceback for every request its HTTP parser refuses with a
    4xx (a bad header, a bad URL, garbage): a client could fill the log with them. Those
    become one WARNING line per :data:`LOG_PERIOD_S` with a count and the error's type;
    everything else (a handler's own exception, a 500) is logged as aiohttp logs it.

    Args:
        name: the listener, for log lines.
    """

    def __init__(self, name: str) -> None:
        super().__init__(logging.getLogger("aiohttp.server"), {})
        self.listener = name
        self._limited = RateLimitedLog(log, LOG_PERIOD_S)

    def log(self, level: int, msg: object, *args: Any, **kwargs: Any) -> None:
        """Log as aiohttp asks, except a client's malformed request (see the class doc)."""
        exc = kwargs.get("exc_info")
        code = getattr(exc, "code", None)
        if isinstance(exc, HttpProcessingError) and isinstance(code, int) and code < 500:
            self._limited(
                "malformed",
                logging.WARNING,
                "malformed HTTP requests refused",
                kv={"listener": self.listener, "status": code, "error": type(exc).__name__},
            )
            return
        super().log(level, msg, *args, **kwargs)


class _Refuse(asyncio.Protocol):
    """Answers 503 and closes: the connection every busy listener cannot take."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if isinstance(transport, asyncio.WriteTransport):
            transport.write(_REFUSE)
        transport.close()


class BoundedSite(web.TCPSite):
    """A :class:`aiohttp.web.TCPSite` whose connections go through a :class:`ConnectionCap`.

    Args:
        runner: the set-up runner (its application must use ``cap.middleware``).
        host: address to bind.
        port: port to bind (0: any free one).
        cap: the listener's cap.
        ssl_context: serve TLS with this context (see :mod:`agent.webconfig`).

    Raises:
        OSError: from :meth:`start`, when the address cannot be bound.
    """

    def __init__(
        self,
        runner: web.BaseRunner,
        host: str,
        port: int,
        cap: ConnectionCap,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        super().__init__(runner, host, port, reuse_address=True, ssl_context=ssl_context)
        self.cap = cap

    async def start(self) -> None:
        """Bind and serve, as ``TCPSite.start`` does, with the capped protocol factory."""
        await web.BaseSite.start(self)  # registers the site with its runner
        server = self._runner.server
        assert server is not None
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            self.cap.protocol_factory(server),
            self._host,
            self._port,
            ssl=self._ssl_context,
            backlog=self._backlog,
            reuse_address=True,
        )

    @property
    def port(self) -> int:
        """The bound port (useful after binding port 0)."""
        sockets = getattr(self._server, "sockets", None) or []
        return int(sockets[0].getsockname()[1]) if sockets else int(self._port or 0)


async def start_site(
    app: web.Application,
    host: str,
    port: int,
    cap: ConnectionCap,
    ssl_context: ssl.SSLContext | None = None,
) -> tuple[web.AppRunner, int]:
    """Serve ``app`` on ``host:port`` behind ``cap``; returns the runner and the bound port.

    Raises:
        OSError: the address cannot be bound (nothing is left running).
    """
    runner = web.AppRunner(
        app,
        access_log=None,
        handle_signals=False,
        shutdown_timeout=0.5,
        keepalive_timeout=IDLE_TIMEOUT_S,
        logger=ServerLog(cap.name),
    )
    await runner.setup()
    site = BoundedSite(runner, host, port, cap, ssl_context)
    try:
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    return runner, site.port
