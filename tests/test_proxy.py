"""The streaming reverse proxy, with real HTTP on both sides (no mocks).

An aiohttp "engine" streams SSE with delays (OpenAI chat chunks, llama.cpp /completion
events), answers llama.cpp's real error bodies, and notices when its client goes away. The
``e2e``-marked tests do the same against the real llama.cpp server (tests/e2e fixtures).
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import logging
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import httpx
import pytest
from aiohttp import web

from kvpressure.agent.logs import LogfmtFormatter
from kvpressure.agent.requests import proxy as proxy_module
from kvpressure.agent.requests.proxy import Observer, RequestProxy, classify_error
from kvpressure.agent.requests.record import RequestRecord, RequestStream

SECRET_PROMPT = "PROMPT-7f3a9c-do-not-log"
SECRET_TOKEN = "TOKEN-b51e02-do-not-log"

# llama.cpp's real error bodies (llama-server, this repo's build; see the e2e tests).
CTX_400 = (
    b'{"error":{"code":400,"message":"request (824 tokens) exceeds the available context size'
    b' (512 tokens), try increasing it","type":"exceed_context_size_error","n_prompt_tokens":'
    b'824,"n_ctx":512}}'
)
KV_500 = b'{"error":{"code":500,"message":"Context size has been exceeded.","type":"server_error"}}'

FIRST_DELAY_S = 0.15
GAP_S = 0.05
N_TOKENS = 5


def chat_events() -> list[bytes]:
    """OpenAI chat.completion.chunk events as llama.cpp sends them; content is the secret."""
    base: dict[str, Any] = {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "model": "tiny-test",
    }
    events: list[dict[str, Any]] = [
        {**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": None}}]}
    ]
    for i in range(N_TOKENS):
        events.append(
            {**base, "choices": [{"index": 0, "delta": {"content": f"{SECRET_TOKEN}{i}"}}]}
        )
    events.append({**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    events.append(
        {
            **base,
            "choices": [],
            "usage": {
                "prompt_tokens": 42,
                "completion_tokens": N_TOKENS,
                "total_tokens": 42 + N_TOKENS,
                "prompt_tokens_details": {"cached_tokens": 16},
            },
            "timings": {
                "cache_n": 16,
                "prompt_n": 26,
                "prompt_ms": 120.5,
                "predicted_n": 5,
                "predicted_ms": 250.0,
            },
        }
    )
    return [b"data: " + json.dumps(e).encode() + b"\n\n" for e in events] + [b"data: [DONE]\n\n"]


def completion_events() -> list[bytes]:
    """llama.cpp /completion events (content + final timings)."""
    out = [
        json.dumps({"index": 0, "content": f"{SECRET_TOKEN}{i}", "stop": False}).encode()
        for i in range(3)
    ]
    out.append(
        json.dumps(
            {
                "index": 0,
                "content": "",
                "stop": True,
                "model": "gemma",
                "timings": {
                    "cache_n": 4,
                    "prompt_n": 10,
                    "prompt_ms": 50.0,
                    "predicted_n": 3,
                    "predicted_ms": 90.0,
                },
            }
        ).encode()
    )
    return [b"data: " + e + b"\n\n" for e in out]


class LoopThread:
    """An asyncio loop on a daemon thread; ``run(coro)`` waits for the result."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Any, timeout: float = 10.0) -> Any:
        fut: Future[Any] = asyncio.run_coroutine_threadsafe(coro, self.loop)
        return fut.result(timeout)

    def stop(self) -> None:
        async def cancel_rest() -> None:
            me = asyncio.current_task()
            rest = [t for t in asyncio.all_tasks() if t is not me]
            for t in rest:
                t.cancel()
            await asyncio.gather(*rest, return_exceptions=True)

        self.run(cancel_rest())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()


class Engine:
    """A small aiohttp 'inference engine' with streaming endpoints and llama.cpp's errors."""

    def __init__(self, lt: LoopThread) -> None:
        self.lt = lt
        self.disconnected = threading.Event()
        self.last_body_sha: str | None = None
        self.last_headers: dict[str, str] = {}
        self.runner: web.AppRunner | None = None
        self.port = 0

    async def _sse(
        self,
        request: web.Request,
        events: list[bytes],
        delay0: float,
        gap: float,
        forever: bool = False,
    ) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        try:
            await asyncio.sleep(delay0)
            for i, e in enumerate(events):
                if i > 1:
                    await asyncio.sleep(gap)
                await resp.write(e)
            while forever:
                await asyncio.sleep(gap)
                await resp.write(events[1])
        except (ConnectionResetError, asyncio.CancelledError):
            self.disconnected.set()
            raise
        await resp.write_eof()
        return resp

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        self.last_body_sha = hashlib.sha256(body).hexdigest()
        self.last_headers = dict(request.headers)
        req = json.loads(body) if body[:1] == b"{" else {}
        mode = req.get("model", "stream")
        if mode == "ctx400":
            return web.Response(status=400, body=CTX_400, content_type="application/json")
        if mode == "kv500":
            return web.Response(status=500, body=KV_500, content_type="application/json")
        if mode == "kvsse":
            evs = [*chat_events()[:3], b"data: " + KV_500 + b"\n\n"]
            return await self._sse(request, evs, 0.01, 0.01)
        if mode == "json":
            return web.json_response(
                {
                    "model": "tiny-test",
                    "choices": [{"message": {"content": SECRET_TOKEN}}],
                    "usage": {"prompt_tokens": 9, "completion_tokens": 4},
                }
            )
        if mode == "forever":
            return await self._sse(request, chat_events(), 0.01, 0.02, forever=True)
        if mode == "drop":  # the engine dies mid-stream
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            await resp.write(chat_events()[1])
            await asyncio.sleep(0.05)
            assert request.transport is not None
            request.transport.close()
            return resp
        return await self._sse(request, chat_events(), FIRST_DELAY_S, GAP_S)

    async def completion(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        return await self._sse(request, completion_events(), 0.05, 0.02)

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "status": "ok",
                "query": request.raw_path,
                "hdr": request.headers.get("X-Custom"),
                "conn_hdr": request.headers.get("X-Drop-Me"),
            }
        )

    async def upload(self, request: web.Request) -> web.Response:
        h = hashlib.sha256()
        n = 0
        async for chunk in request.content.iter_chunked(65536):
            h.update(chunk)
            n += len(chunk)
        return web.json_response({"sha": h.hexdigest(), "n": n})

    async def start(self) -> None:
        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/completion", self.completion)
        app.router.add_get("/health", self.health)
        app.router.add_post("/upload", self.upload)
        self.runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@pytest.fixture(scope="module")
def lt() -> Iterator[LoopThread]:
    t = LoopThread()
    yield t
    t.stop()


@pytest.fixture(scope="module")
def engine(lt: LoopThread) -> Iterator[Engine]:
    e = Engine(lt)
    lt.run(e.start())
    yield e
    assert e.runner is not None
    lt.run(e.runner.cleanup())


@pytest.fixture
def stream() -> RequestStream:
    s = RequestStream()
    s.subscribe("test")
    return s


@pytest.fixture
def logs() -> Iterator[io.StringIO]:
    """Every log line of the agent and aiohttp at DEBUG, formatted as the agent logs them."""
    buf = io.StringIO()
    handler = logging.StreamHandler(buf)
    handler.setFormatter(LogfmtFormatter())
    root = logging.getLogger()
    old = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    yield buf
    root.removeHandler(handler)
    root.setLevel(old)


@pytest.fixture
def make_proxy(lt: LoopThread, stream: RequestStream) -> Iterator[Callable[..., RequestProxy]]:
    made: list[RequestProxy] = []

    def _make(upstream: str, engine: str = "llamacpp", **kw: Any) -> RequestProxy:
        p = RequestProxy("127.0.0.1:0", upstream, engine, stream, **kw)
        lt.run(p.start())
        made.append(p)
        return p

    yield _make
    for p in made:
        lt.run(p.close())


def wait_records(stream: RequestStream, n: int = 1, timeout: float = 5.0) -> list[RequestRecord]:
    out: list[RequestRecord] = []
    deadline = time.monotonic() + timeout
    while len(out) < n and time.monotonic() < deadline:
        out += stream.drain("test")
        time.sleep(0.01)
    assert len(out) >= n, out
    return out


def url(p: RequestProxy, path: str) -> str:
    return f"http://127.0.0.1:{p.port}{path}"


CHAT_BODY = {
    "model": "stream",
    "stream": True,
    "messages": [{"role": "user", "content": SECRET_PROMPT}],
}


# --- streaming pass-through -------------------------------------------------------------


def test_stream_is_byte_exact_and_timed(
    engine: Engine,
    make_proxy: Callable[..., RequestProxy],
    stream: RequestStream,
    logs: io.StringIO,
) -> None:
    p = make_proxy(engine.url)
    body = json.dumps(CHAT_BODY).encode()
    arrivals: list[float] = []
    got = bytearray()
    t0 = time.monotonic()
    with httpx.stream(
        "POST",
        url(p, "/v1/chat/completions"),
        content=body,
        headers={"Content-Type": "application/json"},
    ) as r:
        assert r.status_code == 200
        assert r.headers["content-type"] == "text/event-stream"
        for chunk in r.iter_raw():
            arrivals.append(time.monotonic() - t0)
            got += chunk
    assert bytes(got) == b"".join(chat_events())
    assert engine.last_body_sha == hashlib.sha256(body).hexdigest()
    # Unbuffered: the client saw several chunks, spread over the stream's lifetime.
    assert len(arrivals) >= N_TOKENS
    assert arrivals[-1] - arrivals[0] >= (N_TOKENS - 1) * GAP_S * 0.8
    (rec,) = wait_records(stream)
    assert rec.source == "proxy" and rec.engine == "llamacpp"
    assert rec.outcome == "ok" and rec.status == 200
    assert rec.model == "tiny-test"
    # TTFT is the first *content* chunk (the role-only event does not count).
    assert FIRST_DELAY_S * 0.9 <= rec.ttft_s <= FIRST_DELAY_S + 0.5  # type: ignore[operator]
    assert len(rec.itl_s) == N_TOKENS - 1
    assert all(GAP_S * 0.5 <= g <= GAP_S + 0.25 for g in rec.itl_s), rec.itl_s
    assert rec.e2e_s is not None and rec.e2e_s >= rec.ttft_s  # type: ignore[operator]
    assert (rec.input_tokens, rec.output_tokens, rec.cached_tokens) == (42, N_TOKENS, 16)
    assert rec.prefill_s == pytest.approx(0.1205) and rec.decode_s == pytest.approx(0.25)
    assert rec.upstream_connect_s is not None and 0 <= rec.upstream_connect_s < 1
    assert rec.end >= rec.start
    text = logs.getvalue()
    assert "logger=kvpressure.agent.requests.proxy" in text  # the proxy did log this request
    assert SECRET_PROMPT not in text and SECRET_TOKEN not in text


def test_llamacpp_completion_timings(
    engine: Engine,
    make_proxy: Callable[..., RequestProxy],
    stream: RequestStream,
) -> None:
    p = make_proxy(engine.url)
    r = httpx.post(url(p, "/completion"), json={"prompt": SECRET_PROMPT, "stream": True})
    assert r.content == b"".join(completion_events())
    (rec,) = wait_records(stream)
    assert (rec.input_tokens, rec.output_tokens, rec.cached_tokens) == (14, 3, 4)
    assert rec.prefill_s == pytest.approx(0.05) and rec.decode_s == pytest.approx(0.09)
    assert rec.model == "gemma" and 1 <= len(rec.itl_s) <= 2  # first two may share a chunk


def test_non_streamed_json_usage(
    engine: Engine,
    make_proxy: Callable[..., RequestProxy],
    stream: RequestStream,
) -> None:
    p = make_proxy(engine.url)
    r = httpx.post(url(p, "/v1/chat/completions"), json={"model": "json"})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 9
    (rec,) = wait_records(stream)
    assert (rec.input_tokens, rec.output_tokens, rec.ttft_s) == (9, 4, None)
    assert rec.outcome == "ok" and rec.e2e_s is not None


def test_keepalive_connection_is_reused(
    engine: Engine,
    make_proxy: Callable[..., RequestProxy],
    stream: RequestStream,
) -> None:
    p = make_proxy(engine.url)
    with httpx.Client() as c:
        for _ in range(3):
            assert c.post(url(p, "/v1/chat/completions"), json={"model": "json"}).status_code == 200
    recs = wait_records(stream, 3)
    assert recs[0].upstream_connect_s is not None
    assert [r.upstream_connect_s for r in recs[1:]] == [None, None]  # reused: no connect


def test_idle_connections_over_the_cap_do_not_starve_requests_or_cut_streams(
    engine: Engine,
    make_proxy: Callable[..., RequestProxy],
    stream: RequestStream,
) -> None:
    """Issue 18, point 1, on the proxy: cap 10, a stream in flight, then 60 idle client
    connections. Idle ones make room for each other and for a new request; the stream in
    flight (a busy connection) is never closed and arrives whole."""
    p = make_proxy(engine.url, max_client_connections=10)
    got: dict[str, Any] = {}

    def streamed() -> None:
        with (
            httpx.Client() as c,
            c.stream(
                "POST", url(p, "/v1/chat/completions"), json={"model": "forever"}, timeout=10
            ) as r,
        ):
            n = 0
            for _ in r.iter_bytes():
                n += 1
                if n == 1:
                    got["started"] = True
                if got.get("stop"):
                    break
            got["chunks"] = n

    t = threading.Thread(target=streamed)
    t.start()
    held: list[socket.socket] = []
    try:
        _wait_until(lambda: bool(got.get("started")))
        held = [socket.create_connection(("127.0.0.1", p.port or 0)) for _ in range(60)]
        with httpx.Client() as c:
            r = c.post(url(p, "/v1/chat/completions"), json={"model": "json"}, timeout=5)
        assert r.status_code == 200
        assert p.cap.closed_idle >= 50
        # the stream is still running (the JSON request leaves in_flight just after its reply)
        _wait_until(lambda: p.in_flight == 1)
        assert "chunks" not in got
    finally:
        got["stop"] = True
        t.join(10)
        for s in held:
            s.close()
    assert got["chunks"] > 1
    outcomes = sorted(rec.outcome for rec in wait_records(stream, 2))
    assert outcomes == ["cancelled", "ok"]


# --- errors -------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["GET", "POST"])
def test_absolute_uri_target_is_a_400_recorded_as_client_error(
    engine: Engine,
    make_proxy: Callable[..., RequestProxy],
    stream: RequestStream,
    logs: io.StringIO,
    method: str,
) -> None:
    """Issue 18, point 7: ``POST http://other/v1/chat/completions`` (absolute form) is
    refused with a 400 and, for an inference path, recorded ``client_error``; no 500, no
    traceback, nothing sent to any other host."""
    p = make_proxy(engine.url)
    body = b"{}" if method == "POST" else b""
    raw = (
        f"{method} http://other.invalid/v1/chat/completions HTTP/1.1\r\n"
        f"Host: other.invalid\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode() + body
    with socket.create_connection(("127.0.0.1", p.port or 0), timeout=5) as s:
        s.sendall(raw)
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 400 "), answer[:200]
    assert b"request target must be a path" in answer
    assert "Traceback" not in logs.getvalue()
    if method == "POST":
        (rec,) = wait_records(stream, 1)
        assert (rec.outcome, rec.status, rec.error_type) == (
            "client_error",
            400,
            "bad_request_target",
        )
    else:
        time.sleep(0.1)
        assert stream.drain("test") == []


@pytest.mark.parametrize(
    ("mode", "status", "outcome", "error_type", "body"),
    [
        ("ctx400", 400, "context_exceeded", "exceed_context_size_error", CTX_400),
        ("kv500", 500, "kv_exhausted", "server_error", KV_500),
    ],
)
def test_llamacpp_error_bodies(
    engine: Engine,
    make_proxy: Callable[..., RequestProxy],
    stream: RequestStream,
    mode: str,
    status: int,
    outcome: str,
    error_type: str,
    body: bytes,
) -> None:
    p = make_proxy(engine.url)
    r = httpx.post(url(p, "/v1/chat/completions"), json={"model": mode, "stream": True})
    assert r.status_code == status
    assert r.content == body
    (rec,) = wait_records(stream)
    assert (rec.status, rec.outcome, rec.error_type) == (status, outcome, error_type)
    assert rec.ttft_s is None


def test_kv_exhausted_inside_a_200_stream(
    engine: Engine,
    make_proxy: Callable[..., RequestProxy],
    stream: RequestStream,
) -> None:
    p = make_proxy(engine.url)
    r = httpx.post(url(p, "/v1/chat/completions"), json={"model": "kvsse", "stream": True})
    assert r.status_code == 200 and r.content.endswith(b"data: " + KV_500 + b"\n\n")
    (rec,) = wait_records(stream)
    assert (rec.status, rec.outcome, rec.error_type) == (200, "kv_exhausted", "server_error")
    assert rec.ttft_s is not None


def test_upstream_down_is_a_quick_502(
    make_proxy: Callable[..., RequestProxy],
    stream: RequestStream,
    logs: io.StringIO,
) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    p = make_proxy(f"http://127.0.0.1:{dead}")
    t0 = time.monotonic()
    r = httpx.post(url(p, "/v1/chat/completions"), json=CHAT_BODY, timeout=5)
    elapsed = time.monotonic() - t0
    assert r.status_code == 502 and elapsed < 1.0
    assert r.json()["error"]["type"] == "upstream_down"
    (rec,) = wait_records(stream)
    assert (rec.outcome, rec.status) == ("upstream_down", 502)
    assert rec.e2e_s is not None and rec.e2e_s < 1.0
    assert SECRET_PROMPT not in logs.getvalue()


def test_upstream_down_is_logged_once_per_interval_not_per_request(
    make_proxy: Callable[..., RequestProxy],
    stream: RequestStream,
    logs: io.StringIO,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(proxy_module, "DOWN_LOG_EVERY_S", 0.3)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    p = make_proxy(f"http://127.0.0.1:{dead}")
    with httpx.Client() as c:
        for _ in range(5):
            assert c.post(url(p, "/v1/completions"), json={"prompt": "x"}).status_code == 502
        time.sleep(0.35)
        assert c.post(url(p, "/v1/completions"), json={"prompt": "x"}).status_code == 502
    recs = wait_records(stream, 6)
    assert [r.outcome for r in recs] == ["upstream_down"] * 6  # every failure is counted
    lines = [ln for ln in logs.getvalue().splitlines() if "upstream unavailable" in ln]
    assert len(lines) == 2, lines
    assert "failed_since_last_log" not in lines[0]
    assert "failed_since_last_log=4" in lines[1]


def test_connect_timeout_is_a_502(
    make_proxy: Callable[..., RequestProxy],
    stream: RequestStream,
) -> None:
    # A listener whose accept queue is full: the kernel drops further SYNs, so the
    # proxy's connect hangs until connect_timeout_s.
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(0)
    port = srv.getsockname()[1]
    fill = []
    for _ in range(4):
        c = socket.socket()
        c.setblocking(False)
        try:
            c.connect(("127.0.0.1", port))
        except BlockingIOError:
            pass
        fill.append(c)
    try:
        time.sleep(0.1)
        p = make_proxy(f"http://127.0.0.1:{port}", connect_timeout_s=0.3)
        t0 = time.monotonic()
        r = httpx.post(url(p, "/v1/completions"), json={"prompt": "x"}, timeout=5)
        assert r.status_code == 502 and time.monotonic() - t0 < 1.5
        (rec,) = wait_records(stream)
        assert rec.outcome == "upstream_down"
    finally:
        for c in fill:
            c.close()
        srv.close()


def test_client_disconnect_mid_stream_is_cancelled_and_closes_upstream(
    engine: Engine,
    make_proxy: Callable[..., RequestProxy],
    stream: RequestStream,
) -> None:
    p = make_proxy(engine.url)
    engine.disconnected.clear()
    body = json.dumps({"model": "forever", "stream": True}).encode()
    assert p.port is not None
    with socket.create_connection(("127.0.0.1", p.port)) as s:
        s.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        got = b""
        while SECRET_TOKEN.encode() not in got:
            got += s.recv(65536)
    # socket closed mid-stream
    (rec,) = wait_records(stream)
    assert rec.outcome == "cancelled"
    assert rec.status == 200 and rec.ttft_s is not None
    assert engine.disconnected.wait(3), "the upstream request was not closed"


def test_upstream_dropping_mid_stream_is_a_server_error(
    engine: Engine,
    make_proxy: Callable[..., RequestProxy],
    stream: RequestStream,
) -> None:
    p = make_proxy(engine.url)
    with pytest.raises(httpx.HTTPError):
        httpx.post(url(p, "/v1/chat/completions"), json={"model": "drop", "stream": True})
    (rec,) = wait_records(stream)
    assert (rec.outcome, rec.error_type) == ("server_error", "upstream_disconnected")


# --- engines that close the connection after every response (llama.cpp) ---------------------


class ClosingEngine:
    """A raw asyncio HTTP server that closes each connection after one response, as
    llama.cpp does after a streamed one (it still answers ``Keep-Alive: timeout=5``).

    It notes when each connection was accepted and when its request arrived. With
    ``drop_idle_s`` it drops, unanswered, a connection whose request comes later than that
    after the accept: an engine closing an idle connection just as the request is sent.
    """

    RESPONSE = (
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
        b"Keep-Alive: timeout=5, max=100\r\nTransfer-Encoding: chunked\r\n\r\n"
        + b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in chat_events())
        + b"0\r\n\r\n"
    )

    def __init__(self, lt: LoopThread, drop_idle_s: float | None = None) -> None:
        self.lt = lt
        self.drop_idle_s = drop_idle_s
        self.accepted: list[float] = []
        self.requests: list[tuple[float, float]] = []  # (accepted, request arrived)
        self.dropped = 0
        self.closed_unused = 0
        self.server: asyncio.Server | None = None
        self.open: set[asyncio.StreamWriter] = set()
        self.port = 0

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted = time.monotonic()
        self.accepted.append(accepted)
        self.open.add(writer)
        try:
            await self._answer(reader, writer, accepted)
        finally:
            self.open.discard(writer)
            writer.close()

    async def _answer(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, accepted: float
    ) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, ConnectionError):
            self.closed_unused += 1
            return
        arrived = time.monotonic()
        length = 0
        for line in head.split(b"\r\n"):
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        await reader.readexactly(length)
        if self.drop_idle_s is not None and arrived - accepted > self.drop_idle_s:
            self.dropped += 1
            return
        self.requests.append((accepted, arrived))
        writer.write(self.RESPONSE)
        await writer.drain()

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        assert self.server is not None
        self.server.close()
        for w in list(self.open):  # what asyncio.Server.close_clients does (Python 3.13)
            w.close()
        await self.server.wait_closed()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@pytest.fixture
def closing_engine(lt: LoopThread) -> Iterator[Callable[..., ClosingEngine]]:
    made: list[ClosingEngine] = []

    def _make(**kw: Any) -> ClosingEngine:
        e = ClosingEngine(lt, **kw)
        lt.run(e.start())
        made.append(e)
        return e

    yield _make
    for e in made:
        if e.server is not None and e.server.is_serving():
            lt.run(e.stop())


def _wait_until(cond: Callable[[], bool], timeout: float = 3.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.005)


def _chat(p: RequestProxy, client: httpx.Client) -> float:
    """One streamed chat through the proxy, checked byte-exact; returns when it was sent."""
    sent = time.monotonic()
    r = client.post(url(p, "/v1/chat/completions"), json=CHAT_BODY)
    assert r.status_code == 200 and r.content == b"".join(chat_events())
    return sent


def test_engine_closing_after_each_response_gets_a_preopened_connection(
    closing_engine: Callable[..., ClosingEngine],
    make_proxy: Callable[..., RequestProxy],
    stream: RequestStream,
) -> None:
    engine = closing_engine()
    p = make_proxy(engine.url)
    sent = []
    with httpx.Client() as c:
        for i in range(5):
            sent.append(_chat(p, c))
            _wait_until(lambda n=i + 2: len(engine.accepted) >= n)  # the spare is connected
            time.sleep(0.02)
    recs = wait_records(stream, 5)
    assert [r.outcome for r in recs] == ["ok"] * 5
    # The first request waited for its connect; each later one found a connection the
    # proxy had opened after the previous request, accepted before it was sent.
    assert recs[0].upstream_connect_s is not None
    assert [r.upstream_connect_s for r in recs[1:]] == [None] * 4
    assert [acc < t for (acc, _), t in zip(engine.requests[1:], sent[1:], strict=True)] == [
        True
    ] * 4
    # One spare at most: five requests, five used connections and the one now waiting.
    assert len(engine.accepted) == 6


def test_closing_the_proxy_closes_its_spare_connection(
    lt: LoopThread,
    closing_engine: Callable[..., ClosingEngine],
    stream: RequestStream,
) -> None:
    engine = closing_engine()
    p = RequestProxy("127.0.0.1:0", engine.url, "llamacpp", stream)
    lt.run(p.start())
    with httpx.Client() as c:
        _chat(p, c)
    _wait_until(lambda: len(engine.accepted) == 2)  # the request's connection and the spare
    time.sleep(0.02)
    lt.run(p.close())
    _wait_until(lambda: engine.closed_unused == 1)  # the spare closed without a request


def test_an_unused_spare_is_closed_after_the_keepalive_time(
    closing_engine: Callable[..., ClosingEngine],
    make_proxy: Callable[..., RequestProxy],
    stream: RequestStream,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(proxy_module, "KEEPALIVE_S", 0.2)
    engine = closing_engine()
    p = make_proxy(engine.url)
    with httpx.Client() as c:
        _chat(p, c)
    _wait_until(lambda: len(engine.accepted) == 2)
    t0 = time.monotonic()
    _wait_until(lambda: engine.closed_unused == 1)  # closed by the proxy, not replaced
    assert 0.1 <= time.monotonic() - t0 <= 1.5
    time.sleep(0.3)
    assert len(engine.accepted) == 2
    with httpx.Client() as c:  # the next request connects on its own again
        _chat(p, c)
    recs = wait_records(stream, 2)
    assert all(r.upstream_connect_s is not None for r in recs)


def test_a_spare_the_engine_drops_is_retried_on_a_new_connection(
    closing_engine: Callable[..., ClosingEngine],
    make_proxy: Callable[..., RequestProxy],
    stream: RequestStream,
) -> None:
    # The engine drops a connection whose request comes more than 50 ms after its accept,
    # just as the request is sent: the proxy cannot know beforehand, so it resends once
    # on a new connection (the body is small enough to be kept).
    engine = closing_engine(drop_idle_s=0.05)
    p = make_proxy(engine.url)
    with httpx.Client() as c:
        for _ in range(3):
            _chat(p, c)
            time.sleep(0.2)
    recs = wait_records(stream, 3)
    assert [r.outcome for r in recs] == ["ok"] * 3
    assert engine.dropped == 2
    # The retried requests waited for the new connection, and say so.
    assert all(r.upstream_connect_s is not None for r in recs)


def test_spare_to_an_engine_that_went_away_is_not_used(
    closing_engine: Callable[..., ClosingEngine],
    make_proxy: Callable[..., RequestProxy],
    stream: RequestStream,
    lt: LoopThread,
) -> None:
    engine = closing_engine()
    p = make_proxy(engine.url)
    with httpx.Client() as c:
        _chat(p, c)
        _wait_until(lambda: len(engine.accepted) == 2)
        lt.run(engine.stop())  # closes the spare too
        time.sleep(0.05)
        t0 = time.monotonic()
        r = c.post(url(p, "/v1/chat/completions"), json=CHAT_BODY)
        assert r.status_code == 502 and time.monotonic() - t0 < 1.0
    recs = wait_records(stream, 2)
    assert [r.outcome for r in recs] == ["ok", "upstream_down"]


def test_reconfigure_keeps_listening_and_lets_streams_in_flight_finish(
    lt: LoopThread,
    engine: Engine,
    closing_engine: Callable[..., ClosingEngine],
    make_proxy: Callable[..., RequestProxy],
    stream: RequestStream,
) -> None:
    # A reload that changes the upstream must not refuse new clients while an old stream
    # is still running: the listener stays, the old stream finishes on the old engine,
    # new requests go to the new one.
    p = make_proxy(engine.url, engine="old")
    new_engine = closing_engine()
    port = p.port
    got: dict[str, Any] = {}

    def slow_stream() -> None:
        with httpx.Client() as c:
            r = c.post(url(p, "/v1/chat/completions"), json=CHAT_BODY, timeout=10)
            got["status"], got["body"] = r.status_code, r.content

    engine.last_body_sha = None  # the engine is shared: forget earlier tests' requests
    t = threading.Thread(target=slow_stream)
    t.start()
    # The stream is open upstream (the old engine has read it), nothing sent back yet. A fixed
    # sleep here let a loaded machine reconfigure before the request reached the proxy.
    _wait_until(lambda: engine.last_body_sha is not None)
    lt.run(p.reconfigure(new_engine.url, "new", 5.0, True))
    assert p.port == port and p.spec[1:3] == (new_engine.url, "new")
    with httpx.Client() as c:
        sent = time.monotonic()
        _chat(p, c)  # served at once by the new engine, not refused
        assert time.monotonic() - sent < FIRST_DELAY_S
    t.join(10)
    assert got == {"status": 200, "body": b"".join(chat_events())}
    recs = sorted(wait_records(stream, 2), key=lambda r: r.engine)
    assert [(r.engine, r.outcome) for r in recs] == [("new", "ok"), ("old", "ok")]
    assert len(new_engine.requests) == 1
    _wait_until(lambda: len(p._open_ups) == 1)  # the old upstream session is closed


def test_preconnect_off_connects_for_every_request(
    closing_engine: Callable[..., ClosingEngine],
    make_proxy: Callable[..., RequestProxy],
    stream: RequestStream,
) -> None:
    engine = closing_engine()
    p = make_proxy(engine.url, preconnect=False)
    with httpx.Client() as c:
        for _ in range(3):
            _chat(p, c)
            time.sleep(0.05)
    recs = wait_records(stream, 3)
    assert all(r.upstream_connect_s is not None for r in recs)
    assert len(engine.accepted) == 3


# --- non-inference pass-through -------------------------------------------------------------


def test_other_paths_pass_through_without_a_record(
    engine: Engine,
    make_proxy: Callable[..., RequestProxy],
    stream: RequestStream,
) -> None:
    p = make_proxy(engine.url)
    r = httpx.get(
        url(p, "/health?a=1&b=%2F"),
        headers={"X-Custom": "yes", "Connection": "X-Drop-Me", "X-Drop-Me": "1"},
    )
    assert r.status_code == 200
    assert r.json() == {
        "status": "ok",
        "query": "/health?a=1&b=%2F",
        "hdr": "yes",
        "conn_hdr": None,
    }
    assert httpx.get(url(p, "/nope")).status_code == 404
    time.sleep(0.1)
    assert stream.drain("test") == []


def test_large_request_body_is_streamed_intact(
    engine: Engine,
    make_proxy: Callable[..., RequestProxy],
) -> None:
    p = make_proxy(engine.url)
    payload = bytes(range(256)) * (12 * 1024)  # 3 MiB, above the inline limit
    r = httpx.post(url(p, "/upload"), content=payload)
    assert r.json() == {"sha": hashlib.sha256(payload).hexdigest(), "n": len(payload)}

    def gen() -> Iterator[bytes]:  # chunked upload, no Content-Length
        for i in range(0, len(payload), 100_000):
            yield payload[i : i + 100_000]

    r = httpx.post(url(p, "/upload"), content=gen())
    assert r.json()["sha"] == hashlib.sha256(payload).hexdigest()


# --- the observer alone -------------------------------------------------------------------


def test_observer_is_independent_of_chunk_boundaries() -> None:
    data = b"".join(chat_events())
    whole = Observer("sse")
    whole.feed(data, 1.0)
    whole.finish()
    bytewise = Observer("sse")
    for i in range(len(data)):
        bytewise.feed(data[i : i + 1], 1.0 + i * 1e-6)
    bytewise.finish()
    for o in (whole, bytewise):
        assert (o.input_tokens, o.output_tokens, o.cached_tokens, o.model) == (
            42,
            5,
            16,
            "tiny-test",
        )
        assert o.first_content is not None
    assert len(bytewise.gaps) == N_TOKENS - 1
    assert whole.gaps == []  # one network chunk: no gap


def test_observer_bounds_long_lines_and_reads_ollama_and_tgi() -> None:
    o = Observer("ndjson")
    o.feed(b'{"response": "' + b"x" * (2 << 20) + b'"}\n', 1.0)  # too long: skipped
    o.feed(b'{"model": "llama3", "response": "hi", "done": false}\n', 2.0)
    o.feed(
        b'{"response": "", "done": true, "prompt_eval_count": 7, "eval_count": 2, '
        b'"prompt_eval_duration": 5000000, "eval_duration": 20000000}\n',
        3.0,
    )
    o.finish()
    assert (o.first_content, o.input_tokens, o.output_tokens) == (2.0, 7, 2)
    assert o.prefill_s == pytest.approx(0.005) and o.decode_s == pytest.approx(0.02)
    t = Observer("sse")
    t.feed(b'data:{"token":{"id":1,"text":"a","special":false},"details":null}\n\n', 1.0)
    t.feed(
        b'data:{"token":{"id":2,"text":"","special":true},"details":{"generated_tokens":2}}\n\n',
        2.0,
    )
    t.finish()
    assert (t.first_content, t.output_tokens, t.gaps) == (1.0, 2, [])


def test_classify_error() -> None:
    assert classify_error("exceed_context_size_error", "") == "context_exceeded"
    assert (
        classify_error("BadRequestError", "This model's maximum context length is 2048")
        == "context_exceeded"
    )
    assert classify_error("server_error", "Context size has been exceeded.") == "kv_exhausted"
    assert classify_error("invalid_request_error", "bad", 400) == "client_error"
    assert classify_error(None, "boom") == "server_error"


# --- the real llama.cpp server ------------------------------------------------------------

E2E_DIR = Path(__file__).resolve().parent / "e2e"


def _e2e_support() -> Any:
    if str(E2E_DIR) not in sys.path:
        sys.path.insert(0, str(E2E_DIR))
    import e2e_support  # type: ignore[import-not-found]

    return e2e_support


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    es = _e2e_support()
    assets, why = es.find_llama_assets()
    if assets is None:
        es.unavailable(why)
    server = es.LlamaServer(assets, es.free_port(), tmp_path_factory.mktemp("llama-proxy"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.mark.e2e
def test_real_llamacpp_stream_through_the_proxy(
    llama: Any,
    make_proxy: Callable[..., RequestProxy],
    stream: RequestStream,
    logs: io.StringIO,
) -> None:
    p = make_proxy(llama.url)
    req = {
        "messages": [{"role": "user", "content": f"Count to twenty. {SECRET_PROMPT}"}],
        "max_tokens": 24,
        "stream": True,
        "ignore_eos": True,
        "temperature": 0,
        "stream_options": {"include_usage": True},
    }
    events: list[dict[str, Any]] = []
    with httpx.stream("POST", url(p, "/v1/chat/completions"), json=req, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    (rec,) = wait_records(stream)
    assert rec.outcome == "ok" and rec.status == 200
    assert rec.ttft_s is not None and 0 < rec.ttft_s < rec.e2e_s  # type: ignore[operator]
    assert rec.output_tokens == 24 and rec.input_tokens and rec.input_tokens > 5
    assert rec.prefill_s is not None and rec.decode_s is not None
    assert len(rec.itl_s) >= 10  # one gap per token chunk after the first
    usage = [e["usage"] for e in events if e.get("usage")][-1]
    assert (rec.input_tokens, rec.output_tokens) == (
        usage["prompt_tokens"],
        usage["completion_tokens"],
    )
    generated = "".join(
        (c.get("delta") or {}).get("content") or "" for e in events for c in e.get("choices", [])
    )
    text = logs.getvalue()
    assert SECRET_PROMPT not in text
    assert generated.strip() and generated.strip() not in text


@pytest.mark.e2e
def test_real_llamacpp_exceed_context_size_through_the_proxy(
    llama: Any,
    make_proxy: Callable[..., RequestProxy],
    stream: RequestStream,
) -> None:
    p = make_proxy(llama.url)
    req = {"prompt": "hello world " * 400, "n_predict": 4, "stream": True}
    direct = httpx.post(f"{llama.url}/completion", json=req, timeout=60)
    via = httpx.post(url(p, "/completion"), json=req, timeout=60)
    assert direct.status_code == via.status_code == 400
    assert via.content == direct.content
    err = via.json()["error"]
    assert err["type"] == "exceed_context_size_error" and err["n_ctx"] == 512
    (rec,) = wait_records(stream)
    assert (rec.outcome, rec.status, rec.error_type) == (
        "context_exceeded",
        400,
        "exceed_context_size_error",
    )


@pytest.mark.e2e
def test_real_llamacpp_shared_kv_pool_exhausted_through_the_proxy(
    tmp_path: Path,
    make_proxy: Callable[..., RequestProxy],
    stream: RequestStream,
) -> None:
    """Two slots sharing one 512-token KV pool (``--kv-unified``): two long generations
    fill it, and llama.cpp ends the streams with 'Context size has been exceeded.'."""
    es = _e2e_support()
    assets, why = es.find_llama_assets()
    if assets is None:
        es.unavailable(why)

    class Unified(es.LlamaServer):  # type: ignore[misc, name-defined]
        def argv(self) -> list[str]:
            argv = list(super().argv())
            argv[argv.index("-c") + 1] = "512"
            argv[argv.index("-np") + 1] = "2"
            return [*argv, "--kv-unified"]

    server = Unified(assets, es.free_port(), tmp_path)
    server.start()
    try:
        p = make_proxy(server.url)
        words = ["apple", "river", "stone", "cloud", "green", "seven", "table", "music"]
        results: list[tuple[int, bytes]] = []

        def one(seed: int) -> None:
            prompt = " ".join(words[(seed * 7 + i * 3) % 8] for i in range(200))
            req = {
                "prompt": prompt,
                "n_predict": 300,
                "ignore_eos": True,
                "stream": True,
                "cache_prompt": False,
            }
            r = httpx.post(url(p, "/completion"), json=req, timeout=180)
            results.append((r.status_code, r.content[-200:]))

        threads = [threading.Thread(target=one, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(200)
        recs = wait_records(stream, 2, timeout=10)
    finally:
        server.stop()
    assert any(b"Context size has been exceeded." in tail for _, tail in results), results
    exhausted = [r for r in recs if r.outcome == "kv_exhausted"]
    assert exhausted, [(r.outcome, r.status, r.error_type) for r in recs]
    assert all(r.status == 200 and r.error_type == "server_error" for r in exhausted)
    assert all(r.ttft_s is not None for r in exhausted)
