"""Engine auto-discovery (agent/discovery.py): what it finds and what it tells the operator."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import subprocess
import sys

import pytest

from kvpressure.agent.config import parse
from kvpressure.agent.discovery import Discovery

CFG = "discovery: {host: 127.0.0.1, ports: [8000, 8080], interval_s: 60}\n"


def test_nothing_answering_is_logged_once_per_port_list(caplog: pytest.LogCaptureFixture) -> None:
    asked: list[str] = []

    def probe(url: str) -> str | None:
        asked.append(url)
        return None

    d = Discovery(probe)
    cfg = parse(CFG)
    with caplog.at_level(logging.INFO, logger="kvpressure.agent.discovery"):
        assert asyncio.run(d.once(cfg)) is False
        assert asyncio.run(d.once(cfg)) is False  # the next round: probed, not logged again
    assert asked == ["http://127.0.0.1:8000", "http://127.0.0.1:8080"] * 2
    told = [r.getMessage() for r in caplog.records]
    assert told == [
        "engine discovery: nothing answered on 127.0.0.1 ports 8000, 8080; probing again every 60 s"
    ]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="kvpressure.agent.discovery"):
        asyncio.run(d.once(parse(CFG.replace("8080]", "8080, 30000]"))))  # a reload
    assert len(caplog.records) == 1 and "8000, 8080, 30000" in caplog.records[0].getMessage()


def test_an_engine_found_is_named_by_type_and_nothing_else_is_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def probe(url: str) -> str | None:
        if url.endswith(":8080"):
            return "llamacpp"
        raise OSError("connection refused")  # a probe error means nothing there

    d = Discovery(probe)
    with caplog.at_level(logging.INFO, logger="kvpressure.agent.discovery"):
        assert asyncio.run(d.once(parse(CFG))) is True
        assert asyncio.run(d.once(parse(CFG))) is False  # known ports are not probed again
    assert set(d.found) == {"llamacpp"}
    assert d.found["llamacpp"].url == "http://127.0.0.1:8080"
    assert [r.getMessage() for r in caplog.records] == ["engine discovered"]


def test_configured_engines_mean_no_empty_discovery_line(caplog: pytest.LogCaptureFixture) -> None:
    cfg = parse(CFG + "engines: [{url: 'http://127.0.0.1:9000', type: vllm}]\n")
    with caplog.at_level(logging.INFO, logger="kvpressure.agent.discovery"):
        asyncio.run(Discovery(lambda _url: None).once(cfg))
    assert caplog.records == []


# ---- the PIDs listening on engines' ports --------------------------------------------------


def _psutil_listeners(ports: set[int]) -> dict[int, int]:
    """What the agent read before: psutil's listening TCP sockets on ``ports``."""
    import psutil

    return {
        c.pid: c.laddr.port
        for c in psutil.net_connections(kind="tcp")
        if c.pid and c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port in ports
    }


def _listener(host: str) -> tuple[subprocess.Popen[str], int]:
    """A child process listening on ``host`` (an ephemeral port); returns it and the port."""
    family = "socket.AF_INET6" if ":" in host else "socket.AF_INET"
    child = subprocess.Popen(
        [sys.executable, "-c", "import socket,time\n"
         f"s=socket.create_server(({host!r},0),family={family})\n"
         "print(s.getsockname()[1], flush=True)\ntime.sleep(60)"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert child.stdout is not None
    return child, int(child.stdout.readline())


def test_listening_pids_equals_psutil_on_this_hosts_sockets() -> None:
    """Real sockets: IPv4 and IPv6 listeners, each in a process of its own (here, and in
    children), connections to them (established sockets on the same ports are not
    listeners), and a port nobody listens on."""
    from kvpressure.agent.discovery import listening_pids

    v4 = socket.create_server(("127.0.0.1", 0))
    children = [_listener("127.0.0.1")]
    if socket.has_ipv6:
        children.append(_listener("::1"))
    try:
        ports = {v4.getsockname()[1], *(port for _, port in children)}
        client = socket.create_connection(v4.getsockname())
        accepted = v4.accept()[0]
        free = socket.socket()
        free.bind(("127.0.0.1", 0))
        unused = free.getsockname()[1]
        free.close()
        got = listening_pids(ports | {unused})
        assert got == _psutil_listeners(ports | {unused})
        assert got == {os.getpid(): v4.getsockname()[1], **{c.pid: p for c, p in children}}
        client.close()
        accepted.close()
    finally:
        for c, _ in children:
            c.kill()
            c.wait()
        v4.close()


def test_a_process_listening_on_several_ports_maps_to_the_lowest() -> None:
    from kvpressure.agent.discovery import listening_pids

    servers = [socket.create_server(("127.0.0.1", 0)) for _ in range(3)]
    try:
        ports = {s.getsockname()[1] for s in servers}
        for _ in range(3):  # whatever order the sockets are listed in
            assert listening_pids(ports) == {os.getpid(): min(ports)}
    finally:
        for s in servers:
            s.close()


def test_a_socket_held_by_several_processes_maps_every_holder() -> None:
    """A pre-forked server: the listening socket inherited by a worker maps both PIDs
    (psutil keeps only one of them)."""
    from kvpressure.agent.discovery import listening_pids

    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]
    worker = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"], pass_fds=(srv.fileno(),)
    )
    try:
        got = listening_pids({port})
        assert got == {os.getpid(): port, worker.pid: port}
        assert set(_psutil_listeners({port}).items()) <= set(got.items())
    finally:
        worker.kill()
        worker.wait()
        srv.close()


def test_listening_pids_reads_only_listeners_on_the_ports_and_skips_unreadable(tmp_path) -> None:
    """A procfs tree: a listener on 8000 (0x1F40) in tcp and one on 8080 (0x1F90) in tcp6, an
    established socket and a listener on another port; tcp6 may be absent (IPv6 off)."""
    from kvpressure.agent.discovery import listening_pids

    head = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"  # noqa: E501
    net = tmp_path / "net"
    net.mkdir()
    (net / "tcp").write_text(
        head
        + "   0: 0100007F:1F40 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 111 1 0 100 0 0 10 0\n"  # noqa: E501
        + "   1: 0100007F:1F40 0100007F:9C40 01 00000000:00000000 00:00000000 00000000     0        0 222 1 0 20 4 30 10 -1\n"  # noqa: E501
        + "   2: 00000000:0016 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 333 1 0 100 0 0 10 0\n"  # noqa: E501
    )
    for pid, links in {"10": ["socket:[111]", "/dev/null"], "20": ["socket:[222]"],
                       "30": ["socket:[333]"], "40": ["socket:[444]"]}.items():  # fmt: skip
        fd = tmp_path / pid / "fd"
        fd.mkdir(parents=True)
        for i, target in enumerate(links):
            (fd / str(i)).symlink_to(target)
    (tmp_path / "50").mkdir()  # a process whose fds cannot be listed: skipped
    (tmp_path / "self").mkdir()
    assert listening_pids({8000, 8080}, str(tmp_path)) == {10: 8000}
    (net / "tcp6").write_text(
        head
        + "   0: 00000000000000000000000001000000:1F90 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 444 1 0 100 0 0 10 0\n"  # noqa: E501
    )
    assert listening_pids({8000, 8080}, str(tmp_path)) == {10: 8000, 40: 8080}
    assert listening_pids({9}, str(tmp_path)) == {}
    with (net / "tcp").open("a") as f:  # a line of another format is skipped, not fatal
        f.write("   3: 0100007F:XYZ 00000000:0000 0A 0 0 0 0 0 0 555\n")
    assert listening_pids({8000, 8080}, str(tmp_path)) == {10: 8000, 40: 8080}
