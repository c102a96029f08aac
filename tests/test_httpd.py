"""The agent's own HTTP/1.1 listener (agent.httpd), over real sockets on 127.0.0.1.

The cap, header timeout and malformed-request rules it shares with the proxies' aiohttp
listener are in tests/test_listener.py; the API on it in tests/test_daemon.py and
tests/test_otlp_receiver.py. Here: what HTTP/1.1 asks of a server (keep-alive, pipelining,
HEAD, 404/405, 100-continue, bodies answered early) and its own bounds.
"""

from __future__ import annotations

import asyncio
import hashlib
import http.client
import logging
import socket
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest

from kvpressure.agent import httpd
from kvpressure.agent.httpd import HttpServer, Request, Response

Scenario = Callable[[int, HttpServer], Awaitable[None]]


@asynccontextmanager
async def serving(
    routes: list[httpd.Route], middlewares: list[httpd.Middleware] | None = None, **kw: Any
) -> AsyncIterator[tuple[int, HttpServer]]:
    server = HttpServer("test", routes, middlewares or [], **kw)
    port = await server.start("127.0.0.1", 0)
    try:
        yield port, server
    finally:
        await server.close()


async def ok(request: Request) -> Response:
    return Response(text=f"ok {request.method} {request.path}")


async def exchange(port: int, raw: bytes, until_eof: bool = True) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(raw)
    await writer.drain()
    try:
        return await asyncio.wait_for(reader.read() if until_eof else reader.read(65536), 5)
    finally:
        writer.close()


async def until(condition: Callable[[], bool], seconds: float = 3.0) -> None:
    """Wait until ``condition()`` holds or ``seconds`` passed (the caller asserts it)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    while not condition() and loop.time() < deadline:
        await asyncio.sleep(0.01)


def send_then_reset(port: int, data: bytes, times: int) -> None:
    """``times`` connections that each send ``data`` and close with a reset (RST)."""
    for _ in range(times):
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(data)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        s.close()


def test_keep_alive_and_pipelined_requests_are_answered_in_order() -> None:
    async def main() -> None:
        async with serving([httpd.get("/a", ok), httpd.get("/b", ok)]) as (port, _):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            # two requests in one write: the second waits in h11's buffer
            writer.write(b"GET /a HTTP/1.1\r\nHost: x\r\n\r\nGET /b HTTP/1.1\r\nHost: x\r\n\r\n")
            first = await asyncio.wait_for(reader.readuntil(b"ok GET /a"), 5)
            second = await asyncio.wait_for(reader.readuntil(b"ok GET /b"), 5)
            assert first.startswith(b"HTTP/1.1 200 OK\r\n")
            assert second.lstrip().startswith(b"HTTP/1.1 200 OK\r\n")
            # the same connection serves a third, later
            writer.write(b"GET /a HTTP/1.1\r\nHost: x\r\n\r\n")
            assert (await asyncio.wait_for(reader.readuntil(b"ok GET /a"), 5)).startswith(b"HTTP")
            writer.close()

    asyncio.run(main())


def test_http10_and_connection_close_end_the_connection_after_the_answer() -> None:
    async def main() -> None:
        async with serving([httpd.get("/", ok)]) as (port, _):
            for raw in (
                b"GET / HTTP/1.0\r\n\r\n",
                b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
            ):
                answer = await exchange(port, raw)  # reads to EOF: the server closed
                assert answer.split(b"\r\n")[0].endswith(b"200 OK")
                assert answer.endswith(b"ok GET /")

    asyncio.run(main())


def test_head_get_404_405_and_the_query() -> None:
    async def echo(request: Request) -> Response:
        return httpd.json_response({"path": request.path, "query": dict(request.query)})

    async def main() -> None:
        async with serving([httpd.get("/e x", echo), httpd.post("/p", ok)]) as (port, _):
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as c:
                r = await c.get("/e%20x?a=1&a=2&b=%2F&c")
                assert r.json() == {"path": "/e x", "query": {"a": "1", "b": "/", "c": ""}}
                assert r.headers["content-type"] == "application/json; charset=utf-8"
                head = await c.head("/e%20x")
                assert head.status_code == 200 and head.content == b""
                assert int(head.headers["content-length"]) > 0
                assert (await c.get("/nope")).status_code == 404
                not_allowed = await c.get("/p")
                assert not_allowed.status_code == 405
                assert not_allowed.headers["allow"] == "POST"
                assert (await c.post("/e%20x")).headers["allow"] == "GET, HEAD"

    asyncio.run(main())


def test_middlewares_wrap_every_request_first_listed_outermost() -> None:
    seen: list[str] = []

    def named(name: str) -> httpd.Middleware:
        async def mw(request: Request, handler: httpd.Handler) -> Response:
            seen.append(name)
            if request.headers.get("X-Deny"):
                return Response(text="denied", status=401)
            response = await httpd.answer(handler, request)
            response.headers[f"X-{name}"] = "1"
            return response

        return mw

    async def main() -> None:
        async with serving([httpd.get("/", ok)], [named("outer"), named("inner")]) as (port, _):
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as c:
                r = await c.get("/")
                assert r.headers["x-outer"] == "1" and r.headers["x-inner"] == "1"
                assert seen == ["outer", "inner"]
                assert (await c.get("/missing", headers={"X-Deny": "1"})).status_code == 401
                assert (await c.get("/missing")).status_code == 404

    asyncio.run(main())


def test_a_large_body_streams_to_the_handler_and_100_continue_is_answered() -> None:
    size = 5 * httpd.BODY_BUFFER_BYTES + 123
    payload = bytes(range(256)) * (size // 256) + b"x" * (size % 256)

    async def digest(request: Request) -> Response:
        await asyncio.sleep(0.3)  # more than the buffer arrives meanwhile: reading pauses
        h = hashlib.sha256()
        n = 0
        while chunk := await request.content.read(65536):
            h.update(chunk)
            n += len(chunk)
            assert request.content.buffered <= 2 * httpd.BODY_BUFFER_BYTES
        return Response(text=f"{n} {h.hexdigest()}")

    async def main() -> None:
        async with serving([httpd.post("/d", digest)]) as (port, _):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(
                b"POST /d HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
                + f"Content-Length: {size}\r\n\r\n".encode()
            )
            assert (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)).startswith(
                b"HTTP/1.1 100 "
            )
            writer.write(payload)
            await writer.drain()
            answer = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            assert answer.startswith(b"HTTP/1.1 200 ")
            length = int(answer.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            text = (await reader.readexactly(length)).decode()
            assert text == f"{size} {hashlib.sha256(payload).hexdigest()}"
            writer.close()

    asyncio.run(main())


def test_an_answer_before_the_body_was_read_closes_the_connection() -> None:
    """A 401 or 413 given before reading must not leave the body to be read as a request."""

    async def refuse(_: Request) -> Response:
        return Response(text="no", status=413)

    async def main() -> None:
        async with serving([httpd.post("/r", refuse), httpd.get("/", ok)]) as (port, server):
            answer = await exchange(
                port,
                b"POST /r HTTP/1.1\r\nHost: x\r\nContent-Length: 40\r\n\r\n"
                b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",  # inside the body, not a request
            )
            assert answer.startswith(b"HTTP/1.1 413 ")
            assert b"connection: close" in answer.lower()
            assert b"ok GET" not in answer
            await asyncio.sleep(0.05)
            assert server.connections == 0

    asyncio.run(main())


def test_a_client_gone_mid_body_fails_only_its_read() -> None:
    failures: list[BaseException] = []

    async def read_all(request: Request) -> Response:
        try:
            while await request.content.read(65536):
                pass
        except ConnectionResetError as exc:
            failures.append(exc)
            raise
        return Response(text="read")

    async def main() -> None:
        async with serving([httpd.post("/r", read_all), httpd.get("/", ok)]) as (port, server):
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"POST /r HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\nabc")
            await writer.drain()
            await asyncio.sleep(0.1)
            writer.transport.abort()
            await until(lambda: bool(failures), 1.0)
            assert failures
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as c:
                assert (await c.get("/")).text == "ok GET /"
            await asyncio.sleep(0.05)
            assert server.connections == 0

    asyncio.run(main())


def test_idle_timeout_closes_a_kept_alive_connection() -> None:
    async def main() -> None:
        async with serving([httpd.get("/", ok)], idle_timeout_s=0.3) as (port, server):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            await asyncio.wait_for(reader.readuntil(b"ok GET /"), 5)
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            assert await asyncio.wait_for(reader.read(), 5) == b""
            assert 0.2 < loop.time() - t0 < 3
            assert server.connections == 0
            writer.close()

    asyncio.run(main())


def test_a_head_over_the_limit_is_refused_431() -> None:
    async def main() -> None:
        async with serving([httpd.get("/", ok)]) as (port, _):
            big = b"X-Filler: " + b"a" * (httpd.MAX_HEAD_BYTES + 10) + b"\r\n"
            answer = await exchange(port, b"GET / HTTP/1.1\r\nHost: x\r\n" + big + b"\r\n")
            assert answer.startswith(b"HTTP/1.1 431 ")

    asyncio.run(main())


def test_a_failing_handler_is_a_500_logged_once_and_the_listener_keeps_serving(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def boom(_: Request) -> Response:
        raise RuntimeError("bug")

    async def main() -> None:
        async with serving([httpd.get("/boom", boom), httpd.get("/", ok)]) as (port, _):
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as c:
                for _ in range(5):
                    assert (await c.get("/boom")).status_code == 500
                assert (await c.get("/")).text == "ok GET /"

    with caplog.at_level(logging.ERROR, logger="kvpressure.agent.httpd"):
        asyncio.run(main())
    failed = [r for r in caplog.records if r.getMessage() == "request handler failed"]
    assert len(failed) == 1 and failed[0].exc_info is not None


def test_close_ends_busy_requests_after_the_grace() -> None:
    started = asyncio.Event()

    async def forever(_: Request) -> Response:
        started.set()
        await asyncio.sleep(3600)
        return Response()

    async def main() -> None:
        server = HttpServer("test", [httpd.get("/", forever)])
        port = await server.start("127.0.0.1", 0)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        await asyncio.wait_for(started.wait(), 5)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await server.close()
        assert loop.time() - t0 < httpd.SHUTDOWN_GRACE_S + 1
        assert await asyncio.wait_for(reader.read(), 5) == b""
        writer.close()
        with pytest.raises(OSError):
            await asyncio.open_connection("127.0.0.1", port)

    asyncio.run(main())


def test_pipelined_bytes_are_not_read_while_a_request_is_answered() -> None:
    """A client streaming pipelined requests behind a slow one cannot grow the buffers."""
    release = asyncio.Event()

    async def slow(_: Request) -> Response:
        await release.wait()
        return Response(text="slow")

    async def main() -> None:
        async with serving([httpd.get("/slow", slow), httpd.get("/", ok)]) as (port, server):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
            await writer.drain()
            while server.busy < 1:
                await asyncio.sleep(0.01)
            one = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"
            sent = 0
            writer.transport.set_write_buffer_limits(high=1 << 16)
            while sent < 64 << 20:  # 64 MiB of requests; the kernel buffers fill, then stop
                writer.write(one * 2048)
                sent += len(one) * 2048
                try:
                    await asyncio.wait_for(writer.drain(), 0.5)
                except TimeoutError:
                    break
            assert sent < 64 << 20, "the listener kept reading while a request was answered"
            (conn,) = list(server._conns)
            assert len(conn.h11.trailing_data[0]) <= 4 << 20
            release.set()
            assert (await asyncio.wait_for(reader.readuntil(b"slow"), 5)).startswith(b"HTTP")
            second = await asyncio.wait_for(reader.readuntil(b"ok GET /"), 5)
            assert second.lstrip().startswith(b"HTTP/1.1 200")
            writer.transport.abort()

    asyncio.run(main())


def test_thousands_of_pipelined_requests_to_a_plain_handler_are_all_answered() -> None:
    """A plain-function handler answers inside the loop reading the events: no recursion."""

    def plain(request: Request) -> Response:
        return Response(text=f"n{request.query.get('i')};")

    async def main() -> None:
        async with serving([httpd.get("/", plain)]) as (port, _):
            reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=1 << 22)
            n = 5000
            writer.write(
                b"".join(f"GET /?i={i} HTTP/1.1\r\nHost: x\r\n\r\n".encode() for i in range(n))
            )
            await writer.drain()
            got = await asyncio.wait_for(reader.readuntil(f"n{n - 1};".encode()), 20)
            assert got.count(b"HTTP/1.1 200 OK") == n
            assert b"n0;" in got and b"n2500;" in got
            writer.close()

    asyncio.run(main())


def test_a_client_that_never_reads_its_answers_cannot_grow_the_agents_memory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Pipelined requests for a 64 KB answer each, never read: reading stops once the
    answers not taken pass the transport's high-water mark; an idle timeout then closes the
    connection, and the close deadline cuts it off since the client takes nothing."""
    monkeypatch.setattr(httpd, "CLOSE_DEADLINE_S", 0.3)
    big = b"x" * 65536

    def answer(_: Request) -> Response:
        return Response(big)

    async def main() -> None:
        async with serving([httpd.get("/", answer)], idle_timeout_s=1.5) as (port, server):
            loop = asyncio.get_running_loop()
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.setblocking(False)
            await loop.sock_connect(sock, ("127.0.0.1", port))
            one = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" * 50
            sent = 0
            t0 = loop.time()
            while loop.time() - t0 < 1:
                try:
                    sent += sock.send(one)
                except BlockingIOError:  # the agent stopped reading: the kernel is full
                    await asyncio.sleep(0.01)
                    continue
                await asyncio.sleep(0)
            (conn,) = list(server._conns)
            assert conn.transport is not None
            queued = conn.transport.get_write_buffer_size()
            assert queued <= 4 << 20, queued  # without the bound: gigabytes
            answered = sent // len(one) * 50
            assert answered > 0
            # nothing is read: the idle timeout closes, the deadline cuts it off
            await until(lambda: server.connections == 0 and conn._lost)
            assert server.connections == 0 and conn._lost
            sock.close()

    asyncio.run(main())


def test_an_early_answer_reaches_a_client_that_sends_its_whole_body_first() -> None:
    """Python's http.client writes all of a body before reading: a 413 given before the
    body was read must not reach it as a connection reset."""

    def refuse(_: Request) -> Response:
        return Response(text="too large", status=413)

    async def main() -> None:
        async with serving([httpd.post("/r", refuse)]) as (port, _):

            def client() -> tuple[int, str, str | None]:
                c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
                c.request("POST", "/r", body=b"\0" * (8 << 20))
                r = c.getresponse()
                return r.status, r.read().decode(), r.getheader("Date")

            for _ in range(3):
                status, text, date = await asyncio.to_thread(client)
                assert (status, text) == (413, "too large")
                assert date is not None and date.endswith(" GMT")

    asyncio.run(main())


def test_an_early_answer_to_a_client_that_reset_is_dropped_quietly(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The client resets right after a partial body, before the early answer is made:
    shutting the agent's side then fails (ENOTCONN), which must close the connection, not
    escape the task (asyncio's "Task exception was never retrieved")."""

    async def refuse(_: Request) -> Response:
        return Response(text="no", status=404)

    async def main() -> None:
        async with serving([httpd.post("/r", refuse)]) as (port, server):
            head = b"POST /r HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\nabc"
            await asyncio.to_thread(send_then_reset, port, head, 300)
            await until(lambda: server.connections == 0)
            assert server.connections == 0

    with caplog.at_level(logging.DEBUG):
        asyncio.run(main())
    assert "Task exception was never retrieved" not in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_a_pipelined_flood_does_not_hold_the_event_loop() -> None:
    """5,000 pipelined requests in one write: another client is answered while they are,
    not after (the flood is answered REQUESTS_PER_PASS at a time)."""
    order: list[str] = []

    def record(request: Request) -> Response:
        order.append(request.path)
        return Response(text="k")

    async def main() -> None:
        async with serving([httpd.get("/a", record), httpd.get("/b", record)]) as (port, _):
            ra, wa = await asyncio.open_connection("127.0.0.1", port, limit=1 << 24)
            n = 5000
            wa.write(b"GET /a HTTP/1.1\r\nHost: x\r\n\r\n" * n)
            reading = asyncio.create_task(ra.read(1 << 30))  # take the flood's answers
            while not order:
                await asyncio.sleep(0.001)
            rb, wb = await asyncio.open_connection("127.0.0.1", port)
            wb.write(b"GET /b HTTP/1.1\r\nHost: x\r\n\r\n")
            await asyncio.wait_for(rb.readuntil(b"\r\n\r\nk"), 10)
            assert order.index("/b") < n // 2, order.index("/b")
            reading.cancel()
            wa.close()
            wb.close()

    asyncio.run(main())


def test_a_burst_then_a_reset_writes_nothing_to_the_dead_connection(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """asyncio logs a warning for every write to a socket that failed: the answers to a
    burst whose client reset must stop, not become thousands of log lines."""

    async def main() -> None:
        async with serving([httpd.get("/", ok)]) as (port, server):
            burst = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" * 3000
            await asyncio.to_thread(send_then_reset, port, burst, 3)
            await until(lambda: server.connections == 0)
            assert server.connections == 0

    with caplog.at_level(logging.WARNING):
        asyncio.run(main())
    assert caplog.text.count("socket.send() raised exception") <= 3, caplog.text[:500]


def test_a_request_with_both_transfer_encoding_and_content_length_is_refused() -> None:
    async def main() -> None:
        async with serving([httpd.post("/p", ok), httpd.get("/smuggled", ok)]) as (port, _):
            answer = await exchange(
                port,
                b"POST /p HTTP/1.1\r\nHost: x\r\nContent-Length: 40\r\n"
                b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n"
                b"GET /smuggled HTTP/1.1\r\nHost: x\r\n\r\n",
            )
            assert answer.startswith(b"HTTP/1.1 400 ")
            assert b"smuggled" not in answer

    asyncio.run(main())


def test_an_http2_preface_is_refused_505_and_named_in_the_log(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # an OTLP exporter set to gRPC speaks HTTP/2 with prior knowledge: a 404 to "PRI *"
    # would tell its operator nothing
    async def main() -> None:
        async with serving([httpd.get("/metrics", ok)]) as (port, _):
            answer = await exchange(port, b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
            assert answer.startswith(b"HTTP/1.1 505 HTTP Version Not Supported\r\n"), answer
            again = await exchange(port, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n", False)
            assert again.startswith(b"HTTP/1.1 200 ")

    with caplog.at_level(logging.WARNING, logger="kvpressure.agent.httpd"):
        asyncio.run(main())
    lines = [r.getMessage() for r in caplog.records if "HTTP/2" in r.getMessage()]
    assert len(lines) == 1 and "gRPC" in lines[0], lines
