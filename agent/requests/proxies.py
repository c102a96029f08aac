"""The set of request proxies the config asks for, kept equal to it across reloads."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from kvpressure.agent.config import Config
from kvpressure.agent.requests.record import RequestStream

if TYPE_CHECKING:
    from kvpressure.agent.requests.proxy import RequestProxy

log = logging.getLogger(__name__)

PROXY_DRAIN_S = 3600.0
"""Longest a proxy removed by a reload waits for its requests in flight before closing."""


class ProxySet:
    """Start, reconfigure and retire :class:`RequestProxy` listeners (``proxies:``).

    The proxy module (aiohttp's client and server) is imported when the first proxy starts:
    an agent without proxies does not hold aiohttp in memory (issue 15).

    Args:
        stream: where every proxy submits its request records.
    """

    def __init__(self, stream: RequestStream) -> None:
        self.stream = stream
        self.proxies: dict[str, RequestProxy] = {}
        self._lock = asyncio.Lock()
        self._retiring: set[asyncio.Task[None]] = set()

    async def apply(self, cfg: Config) -> None:
        """Start, reconfigure or stop request proxies so they match ``cfg.proxies``.

        A proxy whose ``listen`` stays is reconfigured in place (its listener stays open;
        requests in flight finish on the old settings). New addresses are bound first; then
        proxies whose ``listen`` went stop listening at once and finish their requests in
        flight in the background. When a new address cannot be bound (e.g. a port typo),
        the error is logged and the proxies this reload would have removed keep serving, so
        a bad reload does not leave clients without a proxy. Reloads apply one after
        another, in the order they came.
        """
        async with self._lock:
            wanted = {p.listen: p for p in cfg.proxies}
            all_bound = True
            for listen, p in wanted.items():
                kept = self.proxies.get(listen)
                if kept is not None:
                    kept.cap.max_connections = cfg.max_connections
                    spec = (p.listen, p.upstream, p.engine, p.connect_timeout_s, p.preconnect)
                    if spec != kept.spec:
                        await kept.reconfigure(
                            p.upstream, p.engine, p.connect_timeout_s, p.preconnect
                        )
                    continue
                from kvpressure.agent.requests.proxy import RequestProxy

                proxy = RequestProxy(
                    p.listen,
                    p.upstream,
                    p.engine,
                    self.stream,
                    p.connect_timeout_s,
                    preconnect=p.preconnect,
                    max_client_connections=cfg.max_connections,
                )
                try:
                    await proxy.start()
                except OSError as exc:
                    all_bound = False
                    log.error(
                        "proxy could not listen",
                        extra={"kv": {"listen": listen, "error": f"{type(exc).__name__}: {exc}"}},
                    )
                    continue
                self.proxies[listen] = proxy
            gone = [listen for listen in self.proxies if listen not in wanted]
            if gone and not all_bound:
                log.error(
                    "proxies kept until a reload binds every new address",
                    extra={"kv": {"listen": ",".join(gone)}},
                )
                return
            for listen in gone:
                proxy = self.proxies.pop(listen)
                await proxy.stop_listening()
                log.info("proxy stopped listening", extra={"kv": {"listen": listen}})
                task = asyncio.get_running_loop().create_task(self._retire(proxy))
                self._retiring.add(task)
                task.add_done_callback(self._retiring.discard)

    async def _retire(self, proxy: RequestProxy) -> None:
        try:
            await proxy.drain(PROXY_DRAIN_S)
        finally:  # also when the agent's stop cancels the drain
            await proxy.close()
        log.info("proxy stopped", extra={"kv": {"listen": proxy.listen}})

    async def close(self) -> None:
        """Close every proxy; those still draining after a reload stop draining.

        Every proxy gets the same short grace (:meth:`RequestProxy.close`), so the agent's
        stop stays within its grace.
        """
        for task in self._retiring:
            task.cancel()
        await asyncio.gather(
            *self._retiring,
            *(proxy.close() for proxy in self.proxies.values()),
            return_exceptions=True,
        )
        self.proxies.clear()
