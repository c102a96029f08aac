"""Bounded listeners (issue 18, point 1): connection cap, timeouts, quiet accept errors.

Real sockets on 127.0.0.1 only: an agent process with a low file-descriptor limit and a
client holding more idle connections than the cap (or than the limit), and in-process
listeners of both kinds for the busy/idle, header-timeout and malformed-request rules: the
agent's own (``h11``, :class:`agent.httpd.HttpServer`) and the request proxies' (aiohttp,
:class:`agent.listener.BoundedSite` with a :class:`agent.listener.ConnectionCap`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import resource
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from aiohttp import web

from kvpressure.agent import httpd
from kvpressure.agent.httpd import HttpServer, install_accept_error_handler
from kvpressure.agent.listener import BoundedSite, ConnectionCap, ServerLog
from kvpressure.agent.logs import RateLimitedLog

KINDS = ("h11", "aiohttp")
"""The agent's own listener (agent.httpd) and the request proxies' (agent.listener)."""

QUIET = (
    "samplers: {host: {enabled: false}, engines: {enabled: false}, gpu: {enabled: false}, "
    "capacity: {enabled: false}}\ndiscovery: {enabled: false}\nattribution: {enabled: false}\n"
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def _agent(tmp_path: Path, max_connections: int, nofile: int) -> Iterator[tuple[int, Path]]:
    port = _free_port()
    cfg = tmp_path / "k.yaml"
    cfg.write_text(f"listen: '127.0.0.1:{port}'\nmax_connections: {max_connections}\n{QUIET}")
    err = tmp_path / "stderr.log"
    with err.open("w") as err_f:
        # `python -m kvpressure.agent.cli run` with RLIMIT_NOFILE set first (no preexec_fn: threads)
        start = (
            "import resource, runpy, sys; "
            f"resource.setrlimit(resource.RLIMIT_NOFILE, ({nofile}, {nofile})); "
            "sys.argv[0] = 'kvpressure'; "
            "runpy.run_module('kvpressure.agent.cli', run_name='__main__')"
        )
        proc = subprocess.Popen(
            [sys.executable, "-c", start, "run", "--config", str(cfg)], stderr=err_f
        )
        try:
            deadline = time.monotonic() + 15
            while True:
                try:
                    if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=0.5).is_success:
                        break
                except httpx.HTTPError:
                    pass
                assert time.monotonic() < deadline, err.read_text()
                time.sleep(0.05)
            yield port, err
        finally:
            proc.terminate()
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)


def _hold_idle(port: int, n: int) -> list[socket.socket]:
    """Open ``n`` connections that never send a byte (what the issue's probe did)."""
    held = []
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", port), timeout=2)
        held.append(s)
    return held


def _healthz_answers(port: int, tries: int) -> list[bool]:
    out = []
    for _ in range(tries):
        try:
            ok = httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2.0).status_code == 200
        except httpx.HTTPError:
            ok = False
        out.append(ok)
        time.sleep(0.1)
    return out


@pytest.fixture(autouse=True)
def _enough_fds_for_the_client() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 1024:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(1024, hard), hard))


def test_healthz_answers_while_many_more_idle_connections_than_the_cap_are_held(
    tmp_path: Path,
) -> None:
    """The issue's flood, scaled down: the agent may open 256 files, the cap is 64 (plus a
    128-connection accept burst and the agent's own files stay under 256), and a client
    holds 300 idle connections. Each new connection closes an idle one, so the agent never
    runs out of descriptors, /healthz answers every time, and the cap is logged once
    (with a count), not once per connection."""
    with _agent(tmp_path, max_connections=64, nofile=256) as (port, err):
        held = _hold_idle(port, 300)
        try:
            answers = _healthz_answers(port, 20)
            # the oldest idle connections were closed by the agent: they read EOF
            held[0].settimeout(2)
            assert held[0].recv(1) == b""
        finally:
            for s in held:
                s.close()
        log = err.read_text()
    assert all(answers), answers
    lines = log.splitlines()
    cap_lines = [ln for ln in lines if "connection cap reached" in ln]
    assert len(cap_lines) == 1, log
    assert "count=1" in cap_lines[0]
    assert "out of system resource" not in log and "Traceback" not in log
    assert len(lines) < 15, log


def test_accept_errors_are_logged_once_per_period_with_a_count(tmp_path: Path) -> None:
    """A cap above the descriptor limit (a misconfiguration): accept() fails with EMFILE
    while the client holds its connections; asyncio retries every second. The agent logs
    one WARNING line for it, not one error with a traceback per retry, and serves again
    once the client lets go."""
    with _agent(tmp_path, max_connections=1000, nofile=64) as (port, err):
        held = []
        with contextlib.suppress(OSError):
            held = _hold_idle(port, 150)
        try:
            time.sleep(3.5)  # three or four accept retries
        finally:
            for s in held:
                s.close()
        answers = _healthz_answers(port, 30)
        log = err.read_text()
    assert any(answers), "the agent did not serve again after the client let go"
    accept_lines = [ln for ln in log.splitlines() if "accept failed" in ln]
    assert len(accept_lines) == 1, log
    assert "EMFILE" in accept_lines[0] or "Too many open files" in accept_lines[0]
    assert "Traceback" not in log


# --- in-process: busy connections are kept, header timeout --------------------------------------


@contextlib.asynccontextmanager
async def _listener(
    kind: str, release: asyncio.Event | None = None, **bounds: Any
) -> AsyncIterator[tuple[int, Any, Callable[[], int]]]:
    """Serve ``GET /`` ("ok") and ``GET /slow`` (waits for ``release``) on a ``kind`` listener
    bounded by ``bounds``; yields the port, the listener's :class:`httpd.CapPolicy` (the
    counters both listeners share) and how many of its connections are busy now."""
    if kind == "h11":

        async def answer(request: httpd.Request) -> httpd.Response:
            if request.path == "/slow" and release is not None:
                await release.wait()
            return httpd.Response(text="ok")

        server = HttpServer("test", [httpd.get("/", answer), httpd.get("/slow", answer)], **bounds)
        port = await server.start("127.0.0.1", 0)
        try:
            yield port, server.cap, lambda: server.busy
        finally:
            await server.close()
        return

    async def handler(request: web.Request) -> web.Response:
        if request.path == "/slow" and release is not None:
            await release.wait()
        return web.Response(text="ok")

    cap = ConnectionCap("test", **bounds)
    app = web.Application(middlewares=[cap.middleware])
    app.router.add_get("/{tail:.*}", handler)
    runner = web.AppRunner(
        app, access_log=None, handle_signals=False, keepalive_timeout=60, logger=ServerLog("test")
    )
    await runner.setup()
    site = BoundedSite(runner, "127.0.0.1", 0, cap)
    await site.start()
    try:
        yield site.port, cap, lambda: len(cap._busy)
    finally:
        await runner.cleanup()


@pytest.mark.parametrize("kind", KINDS)
def test_busy_connections_are_never_closed_and_a_full_listener_answers_503(kind: str) -> None:
    async def main() -> None:
        release = asyncio.Event()
        async with _listener(kind, release, max_connections=3) as (port, cap, busy):
            async with httpx.AsyncClient(
                base_url=f"http://127.0.0.1:{port}",
                limits=httpx.Limits(max_connections=10),
                timeout=5,
            ) as client:
                slow = [asyncio.create_task(client.get("/slow")) for _ in range(3)]
                while busy() < 3:
                    await asyncio.sleep(0.01)
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                answer = await asyncio.wait_for(reader.read(), 5)
                writer.close()
                assert answer.startswith(b"HTTP/1.1 503 ")
                assert cap.refused == 1 and cap.closed_idle == 0
                release.set()
                assert [(await t).text for t in slow] == ["ok"] * 3

    asyncio.run(main())


@pytest.mark.parametrize("kind", KINDS)
def test_at_the_cap_an_idle_connection_that_never_sent_a_request_goes_first(kind: str) -> None:
    async def main() -> None:
        async with _listener(kind, max_connections=3) as (port, cap, _):
            # two connections that were served and are kept alive, then one that never sent
            served = []
            for _ in range(2):
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
                await reader.readuntil(b"ok")
                served.append((reader, writer))
            silent_r, silent_w = await asyncio.open_connection("127.0.0.1", port)
            await asyncio.sleep(0.1)
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            assert (await asyncio.wait_for(reader.readuntil(b"ok"), 5)).startswith(b"HTTP/1.1 200")
            assert await asyncio.wait_for(silent_r.read(), 5) == b""  # closed to make room
            for r, w in served:  # the served ones stay
                w.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
                assert (await asyncio.wait_for(r.readuntil(b"ok"), 5)).startswith(b"HTTP/1.1 200")
                w.close()
            assert cap.closed_idle == 1 and cap.refused == 0
            writer.close()
            silent_w.close()

    asyncio.run(main())


@pytest.mark.parametrize("kind", KINDS)
def test_a_connection_without_a_request_head_is_closed_after_the_header_timeout(
    kind: str,
) -> None:
    async def main() -> None:
        async with _listener(kind, max_connections=10, header_timeout_s=0.3) as (port, cap, _):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n")  # the head never ends
            await writer.drain()
            assert await asyncio.wait_for(reader.read(), 5) == b""
            writer.close()
            assert cap.header_timeouts == 1
            # a connection that sent its request is not cut by the header timer
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            await writer.drain()
            assert (await reader.readuntil(b"ok")).startswith(b"HTTP/1.1 200 ")
            await asyncio.sleep(0.5)
            assert not reader.at_eof()
            writer.close()

    asyncio.run(main())


def test_accept_error_handler_passes_other_errors_on(caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        seen: list[str] = []
        loop.set_exception_handler(lambda _l, ctx: seen.append(ctx["message"]))
        install_accept_error_handler(loop)
        for _ in range(500):
            loop.call_exception_handler(
                {
                    "message": "socket.accept() out of system resource",
                    "exception": OSError(24, "Too many open files"),
                }
            )
        loop.call_exception_handler({"message": "something else"})
        assert seen == ["something else"]

    with caplog.at_level(logging.WARNING, logger="kvpressure.agent.httpd"):
        asyncio.run(main())
    assert [r.getMessage() for r in caplog.records].count(
        "accept failed: out of file descriptors or buffers; retrying"
    ) == 1


def test_rate_limited_log_counts_between_lines(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    limited = RateLimitedLog(logging.getLogger("t"), period_s=60, max_keys=2, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="t"):
        assert limited("a", logging.WARNING, "A") is True
        for _ in range(9):
            assert limited("a", logging.WARNING, "A") is False
        now[0] = 61.0
        assert limited("a", logging.WARNING, "A") is True
        for key in ("b", "c", "d"):  # more keys than remembered: the oldest is forgotten
            assert limited(key, logging.WARNING, key.upper()) is True
        assert limited("a", logging.WARNING, "A") is True
    counts = [(r.getMessage(), r.kv["count"]) for r in caplog.records]  # type: ignore[attr-defined]
    assert counts == [("A", 1), ("A", 10), ("B", 1), ("C", 1), ("D", 1), ("A", 1)]


@pytest.mark.parametrize("kind", KINDS)
def test_malformed_requests_are_one_warning_without_a_traceback(
    kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 18, point 7: aiohttp logged an ERROR with a traceback per malformed request."""

    async def main() -> list[bytes]:
        answers = []
        async with _listener(kind) as (port, _, _):
            for raw in [b"GET / HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n"] * 20 + [
                b"GET /\x00 HTTP/1.1\r\n\r\n"
            ] * 20:
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(raw)
                await writer.drain()
                answers.append(await asyncio.wait_for(reader.read(), 5))
                writer.close()
        return answers

    with caplog.at_level(logging.DEBUG):
        answers = asyncio.run(main())
    assert all(a.split(b"\r\n")[0].split()[1] == b"400" for a in answers), answers[:2]
    assert "Traceback" not in caplog.text
    assert not [r for r in caplog.records if r.exc_info]
    warned = [r for r in caplog.records if r.getMessage() == "malformed HTTP requests refused"]
    assert len(warned) == 1


def test_each_listener_logs_its_cap_under_its_own_module(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        ConnectionCap("proxy").count_refused()
        HttpServer("api", []).cap.count_refused()
    assert [(r.name, r.getMessage()) for r in caplog.records] == [
        ("kvpressure.agent.listener", "connection refused: every connection is busy"),
        ("kvpressure.agent.httpd", "connection refused: every connection is busy"),
    ]
