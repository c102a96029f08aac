"""Engines found on loopback (auto-discovery) and the PIDs of local engine processes."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Collection, Iterable
from typing import Final
from urllib.parse import urlsplit

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
    """Map the PIDs listening on each local engine's port to the engine's name.

    Source: :func:`listening_pids` (``/proc/net/tcp``, ``/proc/net/tcp6`` and each process's
    fds); only engines on loopback addresses can be resolved. Returns ``{}`` when the
    sockets cannot be read (no procfs).
    """
    ports: dict[int, str] = {}
    for e in engines:
        parts = urlsplit(e.url)
        if parts.hostname in LOOPBACK_HOSTS and parts.port:
            ports[parts.port] = e.label
    if not ports:
        return {}
    try:
        found = listening_pids(ports)
    except OSError:
        return {}
    return {pid: ports[port] for pid, port in found.items()}


_LISTEN: Final = b" 0A "
"""``/proc/net/tcp*``'s state column for ``TCP_LISTEN``, with the spaces around it (no other
column of a line can read so: the others are decimal, or hex joined by ``:``)."""


def listening_pids(ports: Collection[int], procfs: str = "/proc") -> dict[int, int]:
    """Map each PID that holds a TCP socket listening on one of ``ports`` to that port.

    What ``psutil.net_connections(kind="tcp")`` gives for listening sockets, read in
    constant memory: psutil builds a tuple for every TCP socket of the host and a map of
    every socket descriptor of every process, which an agent keeps as resident memory
    after the call (the node grew from 57.2 to 95.7 MiB in four minutes with ~40,000
    sockets open: ``benchmarks/node_rss.py --connections 10000``, two runs at once). Here
    ``{procfs}/net/tcp`` and ``tcp6`` are scanned line by line for listening sockets on
    ``ports`` (their inodes), then each process's ``fd`` directory for those inodes.

    A socket several processes hold (a pre-forked server's workers) maps every holder;
    psutil keeps only the highest PID. A process listening on several of ``ports`` maps to
    the lowest of them (psutil: whichever socket it lists last). Processes whose
    descriptors cannot be read (another user's, without privilege) or that exit meanwhile
    are skipped, as psutil skips them.

    Args:
        ports: TCP ports (IPv4 and IPv6 listeners alike).
        procfs: where procfs is mounted (its network namespace is the one read).

    Returns:
        ``{pid: port}``; empty when nothing listens on ``ports``.

    Raises:
        OSError: ``{procfs}/net/tcp`` cannot be read.
    """
    wanted = frozenset(ports)
    inodes: dict[bytes, int] = {}  # b"socket:[<inode>]" -> port
    for table in ("tcp", "tcp6"):
        try:
            f = open(f"{procfs}/net/{table}", "rb")  # noqa: SIM115 - read line by line
        except FileNotFoundError:
            if table == "tcp6":
                continue  # IPv6 disabled
            raise
        with f:
            next(f, None)  # the header
            for line in f:
                if _LISTEN not in line:
                    continue
                cols = line.split()
                if len(cols) < 10 or cols[3] != b"0A":
                    continue
                try:
                    port = int(cols[1].rpartition(b":")[2], 16)
                except ValueError:  # not a line of this format: skipped, the rest read
                    continue
                if port in wanted and cols[9] != b"0":
                    inodes[b"socket:[" + cols[9] + b"]"] = port
    found: dict[int, int] = {}
    if not inodes:
        return found
    try:
        entries = os.scandir(procfs)
    except OSError:
        return found
    with entries:
        for entry in entries:
            if not entry.name.isdigit():
                continue
            fd_dir = os.fsencode(f"{procfs}/{entry.name}/fd")
            try:
                fds = os.listdir(fd_dir)
            except OSError:  # gone, or another user's process
                continue
            for fd in fds:
                try:
                    target = os.readlink(fd_dir + b"/" + fd)
                except OSError:  # closed meanwhile, or not a link
                    continue
                held = inodes.get(target)
                if held is not None:
                    pid = int(entry.name)
                    known = found.get(pid)
                    if known is None or held < known:  # several ports: the lowest, always
                        found[pid] = held
    return found
