"""Engines found on loopback (auto-discovery) and the PIDs of local engine processes."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from urllib.parse import urlsplit

import psutil

from kvpressure.agent.config import Config, EngineConfig

log = logging.getLogger(__name__)

LOOPBACK_HOSTS: frozenset[str] = frozenset({"127.0.0.1", "localhost", "::1"})
"""Engine hosts whose listening PID :func:`engine_pids` can resolve (loopback only)."""

Probe = Callable[[str], str | None]
"""``probe(url) -> engine type | None`` (:func:`agent.samplers.engines.probe`)."""


class Discovery:
    """Engines answering on the configured loopback ports (``discovery:``).

    Args:
        probe: injectable for tests; defaults to :func:`agent.samplers.engines.probe`.
    """

    def __init__(self, probe: Probe | None = None) -> None:
        self.probe = probe
        self.found: dict[str, EngineConfig] = {}
        self._told_empty: tuple[str, tuple[int, ...]] | None = None

    def _tell_empty(self, cfg: Config) -> None:
        """Log once per host and port list that no engine answered (a new user sees the probe)."""
        key = (cfg.discovery.host, tuple(cfg.discovery.ports))
        if self.found or cfg.engines or self._told_empty == key:
            return
        self._told_empty = key
        log.info(
            "engine discovery: nothing answered on %s ports %s; probing again every %g s",
            key[0],
            ", ".join(map(str, key[1])),
            cfg.discovery.interval_s,
        )

    async def once(self, cfg: Config) -> bool:
        """Probe every port not already known; True when an engine was found.

        Each probe runs off the loop (``asyncio.to_thread``); a probe error means "nothing
        there". A new engine is named after its type, or ``<type>-<port>`` when taken.
        """
        if not (cfg.discovery.enabled and cfg.samplers.engines.enabled):
            return False
        probe = self.probe
        if probe is None:
            from kvpressure.agent.samplers.engines import probe as default_probe

            probe = default_probe
        known = {e.instance for e in cfg.engines} | {e.instance for e in self.found.values()}
        names = {e.label for e in cfg.engines} | set(self.found)
        changed = False
        for port in cfg.discovery.ports:
            url = f"http://{cfg.discovery.host}:{port}"
            if f"{cfg.discovery.host}:{port}" in known:
                continue
            try:
                kind = await asyncio.to_thread(probe, url)
            except Exception:  # noqa: BLE001 - a probe error means "nothing there"
                kind = None
            if not kind:
                continue
            name = kind if kind not in names else f"{kind}-{port}"
            names.add(name)
            self.found[name] = EngineConfig(url=url, type=kind, name=name)  # type: ignore[arg-type]
            log.info("engine discovered", extra={"kv": {"engine": name, "url": url, "type": kind}})
            changed = True
        self._tell_empty(cfg)
        return changed


def engine_pids(engines: Iterable[EngineConfig]) -> dict[int, str]:
    """Map the PID listening on each local engine's port to the engine's name.

    Source: ``psutil.net_connections(kind="tcp")`` (``/proc/net/tcp*`` and each process's
    fds); only engines on loopback addresses can be resolved. Returns ``{}`` when the
    connections cannot be read (no permission, no procfs).
    """
    ports: dict[int, str] = {}
    for e in engines:
        parts = urlsplit(e.url)
        if parts.hostname in LOOPBACK_HOSTS and parts.port:
            ports[parts.port] = e.label
    if not ports:
        return {}
    try:
        conns = psutil.net_connections(kind="tcp")
    except (psutil.Error, OSError):
        return {}
    return {
        c.pid: ports[c.laddr.port]
        for c in conns
        if c.pid and c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port in ports
    }
