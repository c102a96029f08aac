"""The listener's fast path (agent.httpd) proved equal to h11, the library it stands in for.

A plain GET or HEAD read whole skips h11 (issue 15: 20 Hz polling at 1 % of a core). Here,
on generated request heads (valid, invalid and in between: case, whitespace, bare LF,
obs-fold, repeated or missing Host, framing headers, pipelined bytes, non-ASCII) and
generated responses: whenever the fast path accepts a request, h11 reads the same method,
target, headers and keep-alive from the same bytes; whenever it writes an answer, h11
writes the same bytes; and whatever it declines, h11 handles as before. Then over a real
socket: both paths on one connection, answers equal.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Iterator

import h11
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kvpressure.agent import httpd
from kvpressure.agent.httpd import Response

DATE = b"Thu, 03 Dec 2026 23:00:00 GMT"

METHODS = [b"GET", b"HEAD", b"POST", b"get", b"OPTIONS", b"GE T", b""]
TARGETS = [
    b"/metrics",
    b"/",
    b"/api/v1/attributions?limit=5&since=60",
    b"/%2Fa%20b",
    b"*",
    b"http://host/metrics",
    b"/a b",
    b"/\xff",
    b"/\x7f",
    b"",
]
VERSIONS = [b"HTTP/1.1", b"HTTP/1.0", b"HTTP/2.0", b"HTTP/1.1 ", b"http/1.1", b"HTTP/1.10"]
NAMES = [
    b"Host",
    b"host",
    b"HOST",
    b"Accept",
    b"Accept-Encoding",
    b"User-Agent",
    b"X-Prometheus-Scrape-Timeout-Seconds",
    b"Authorization",
    b"Connection",
    b"connection",
    b"Content-Length",
    b"Transfer-Encoding",
    b"Expect",
    b"Upgrade",
    b"Bad Name",
    b"",
    b"X\xe9",
    b"Tab\t",
]
VALUES = [
    b"localhost:9400",
    b"",
    b"  padded \t",
    b"close",
    b"Close",
    b"keep-alive",
    b"Keep-Alive, close",
    b"keep-alive,",
    b"upgrade",
    b"0",
    b"5",
    b"chunked",
    b"gzip, deflate",
    b"application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5",
    b"Basic dXNlcjpwYXNz",
    b"\x01",
    b"a\x00b",
    b"\xe9t\xe9",
    b"a \t b",
    b"100-continue",
]
PIPELINED = b"GET /next HTTP/1.1\r\nHost: x\r\n\r\n"


GOOD_NAMES = NAMES[3:10]
GOOD_VALUES = VALUES[:5] + VALUES[6:8] + VALUES[12:15]


@st.composite
def _mostly(draw: st.DrawFn, good: list[bytes], other: st.SearchStrategy[bytes]) -> bytes:
    """A valid piece about seven times in eight, so that many whole heads are valid
    (hypothesis draws the ends of a range more often than the middle: 3 is the rare one)."""
    return draw(other) if draw(st.integers(0, 7)) == 3 else draw(st.sampled_from(good))


@st.composite
def heads(draw: st.DrawFn) -> bytes:
    """A request head built from pieces that are each valid, invalid or borderline."""
    line = b" ".join(
        [
            draw(_mostly([b"GET", b"HEAD"], st.sampled_from(METHODS))),
            draw(_mostly(TARGETS[:4], st.sampled_from(TARGETS))),
            draw(_mostly([b"HTTP/1.1"], st.sampled_from(VERSIONS))),
        ]
    )
    fields = draw(
        st.lists(
            st.tuples(
                _mostly(GOOD_NAMES, st.one_of(st.sampled_from(NAMES), st.binary(max_size=6))),
                _mostly(GOOD_VALUES, st.one_of(st.sampled_from(VALUES), st.binary(max_size=6))),
            ),
            max_size=5,
        )
    )
    if draw(st.integers(0, 7)) != 3:  # most generated requests get a Host
        host = draw(st.sampled_from(NAMES[:3]))
        fields.insert(draw(st.integers(0, len(fields))), (host, b"localhost:9400"))
    lines = [line] + [
        n + b":" + draw(st.sampled_from([b"", b" ", b"\t", b"  "])) + v for n, v in fields
    ]
    if fields and draw(st.integers(0, 9)) == 0:  # an obs-fold continuation line
        lines.insert(draw(st.integers(1, len(lines))), b" folded")
    sep = draw(_mostly([b"\r\n"], st.sampled_from([b"\n", b"\r"])))
    head = sep.join(lines) + sep + sep
    return head + draw(_mostly([b""], st.sampled_from([PIPELINED, b"body", b"\r\n"])))


def _h11_read(data: bytes) -> tuple[h11.Connection, list[h11.Event]] | None:
    """h11 reading ``data`` as a server: its connection and events; None: it refused."""
    conn = h11.Connection(h11.SERVER, max_incomplete_event_size=httpd.MAX_HEAD_BYTES)
    events: list[h11.Event] = []
    try:
        conn.receive_data(data)
        while True:
            ev = conn.next_event()
            if ev is h11.NEED_DATA or ev is h11.PAUSED:
                break
            events.append(ev)
            if isinstance(ev, h11.EndOfMessage):
                break
    except h11.RemoteProtocolError:
        return None
    return conn, events


@pytest.fixture(autouse=True)
def fixed_date() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(httpd, "_http_date", lambda: DATE)
        yield


@settings(max_examples=3000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(heads())
@example(b"GET /metrics HTTP/1.1\r\nHost: x\r\nAccept-Encoding: gzip\r\n\r\n")
@example(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
@example(b"HEAD / HTTP/1.1\r\nhost:x\r\nConnection:keep-alive\r\n\r\n")
@example(b"GET / HTTP/1.1\r\nHost: x\r\nHost: y\r\n\r\n")
@example(b"GET / HTTP/1.1\r\n\r\n")
def test_every_request_the_fast_path_reads_h11_reads_the_same(data: bytes) -> None:
    fast = httpd._fast_request(data)
    if fast is None:
        return  # h11 reads it, as before the fast path
    method, target, fields, close = fast
    read = _h11_read(data)
    assert read is not None, f"h11 refuses what the fast path accepted: {data!r}"
    conn, events = read
    assert len(events) == 2 and isinstance(events[0], h11.Request), events
    req, end = events
    assert isinstance(end, h11.EndOfMessage)
    assert (req.method, req.target, list(req.headers)) == (method, target, fields)
    assert conn.trailing_data == (b"", False)  # nothing after the head: no body, no pipelining
    # keep-alive as h11 decides it: after a complete answer, DONE to go on, MUST_CLOSE to close
    conn.send(h11.Response(status_code=200, headers=[(b"content-length", b"0")]))
    conn.send(h11.EndOfMessage())
    assert conn.our_state is (h11.MUST_CLOSE if close else h11.DONE)


STATUSES = [200, 201, 204, 206, 301, 304, 400, 401, 404, 405, 413, 431, 500, 503, 599, 100, 101]
OUT_NAMES = [
    "Content-Type",
    "Content-Encoding",
    "Vary",
    "Allow",
    "WWW-Authenticate",
    "Cache-Control",
    "content-length",
    "Content-Length",
    "Transfer-Encoding",
    "Connection",
    "Date",
    "Host",
    "Bad Name",
    "",
    "X-\xe9",
]
OUT_VALUES = [
    "text/plain; version=0.0.4; charset=utf-8",
    "application/openmetrics-text; version=1.0.0; charset=utf-8",
    "gzip",
    "Accept-Encoding",
    "GET, HEAD",
    'Basic realm="kvpressure"',
    "",
    " leading",
    "trailing ",
    "a\r\nInjected: yes",
    "\xe9",
    "\x01",
    "a\tb",
    "12",
]


@settings(max_examples=2000, deadline=None)
@given(
    status=st.sampled_from(STATUSES),
    headers=st.dictionaries(
        st.one_of(st.sampled_from(OUT_NAMES), st.text(max_size=4)),
        st.one_of(st.sampled_from(OUT_VALUES), st.text(max_size=4)),
        max_size=4,
    ),
    body=st.binary(max_size=64),
    method=st.sampled_from([b"GET", b"HEAD"]),
    close=st.booleans(),
)
def test_every_answer_the_fast_path_writes_h11_writes_the_same(
    status: int, headers: dict[str, str], body: bytes, method: bytes, close: bool
) -> None:
    raw = (
        method + b" /metrics HTTP/1.1\r\nHost: x\r\n" + (b"Connection: close\r\n" if close else b"")
    )
    raw += b"\r\n"
    assert httpd._fast_request(raw) is not None
    response = Response(body, status, headers=headers)
    head = method == b"HEAD"
    try:
        expected: tuple[bytes, bool] | type[BaseException] = httpd._h11_response(
            raw, response, head
        )
    except (h11.LocalProtocolError, UnicodeEncodeError) as exc:
        expected = type(exc)
    try:
        fast = httpd._fast_response(response, head, close)
    except UnicodeEncodeError as exc:
        assert expected is type(exc)  # the same failure, from the same encoding
        return
    if fast is None:
        return  # declined: the connection writes h11's answer (expected) instead
    # the same bytes, and the connection closes after them exactly when h11's would
    assert (fast, close) == expected


# ---- over a real socket: both paths on one connection ----------------------------------------
def _without_date(raw: bytes) -> bytes:
    return b"\r\n".join(x for x in raw.split(b"\r\n") if not x.lower().startswith(b"date:"))


def test_one_connection_answers_the_same_by_either_path(monkeypatch: pytest.MonkeyPatch) -> None:
    taken: list[int] = []
    fast_request = httpd._fast_request

    def counted(data: bytes):  # type: ignore[no-untyped-def]
        out = fast_request(data)
        taken.append(out is not None)
        return out

    monkeypatch.setattr(httpd, "_fast_request", counted)

    def metrics(request: httpd.Request) -> Response:
        return Response(b"x 1\n" * 3, content_type="text/plain; version=0.0.4; charset=utf-8")

    async def echo(request: httpd.Request) -> Response:
        return Response(text=f"{len(await request.content.read())} bytes")

    one = b"GET /metrics HTTP/1.1\r\nHost: x\r\nAccept-Encoding: gzip\r\n\r\n"

    async def main() -> None:
        server = httpd.HttpServer("t", [httpd.get("/metrics", metrics), httpd.post("/e", echo)], [])
        port = await server.start("127.0.0.1", 0)
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)

            async def answer(marker: bytes) -> bytes:
                return await asyncio.wait_for(reader.readuntil(marker), 5)

            writer.write(one)  # alone in its segment: the fast path
            fast = await answer(b"x 1\nx 1\nx 1\n")
            writer.write(one + one)  # pipelined: h11 reads both
            slow1 = await answer(b"x 1\nx 1\nx 1\n")
            slow2 = await answer(b"x 1\nx 1\nx 1\n")
            writer.write(b"POST /e HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc")
            posted = await answer(b"3 bytes")
            writer.write(b"HEAD /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            last = await asyncio.wait_for(reader.read(), 5)  # the fast path closes after it
            writer.close()
        finally:
            await server.close()
        assert _without_date(fast) == _without_date(slow1) == _without_date(slow2)
        assert fast.startswith(b"HTTP/1.1 200 OK\r\n") and b"content-length: 12\r\n" in fast
        assert posted.startswith(b"HTTP/1.1 200 OK\r\n")
        assert last.startswith(b"HTTP/1.1 200 OK\r\n") and last.endswith(
            b"Connection: close\r\n\r\n"
        )
        assert b"content-length: 12\r\n" in last  # HEAD: the GET's length, no body

    asyncio.run(main())
    # the lone GET and the lone HEAD by the fast path; the pipelined pair and the POST not
    assert taken == [True, False, False, True], taken


def test_a_long_run_of_blanks_costs_the_header_reader_linear_time() -> None:
    # a header line of blanks then a byte refused: with plain quantifiers the regex tried
    # every split of the run between the blanks before and after the value (quadratic:
    # 0.5 s for 16 KiB, a stalled event loop); possessive quantifiers never backtrack. The
    # line is 64 KiB (the reader is never given more than 16 KiB) so that quadratic time
    # would be minutes, not a margin against a slow machine.
    line = b"X:" + b" " * 65536 + b"\x80"
    t0 = time.process_time()
    assert httpd._FAST_FIELD.fullmatch(line) is None
    assert httpd._OUT_VALUE.fullmatch(b"a" + b" " * 65536 + b"\x80") is None
    assert time.process_time() - t0 < 1.0


def test_the_head_size_bound_does_not_depend_on_how_the_head_arrived() -> None:
    # 30 headers written without the blank after the colon: 3 bytes each on the wire,
    # counted 4 by the bound (": " and CRLF) on either path
    fill = b"a:b\r\n" * 30
    base = b"GET /x HTTP/1.1\r\nHost:x\r\n" + fill + b"X:"
    size = len(base) + 4
    head = base + b"v" * (httpd.MAX_HEAD_BYTES - 10 - size) + b"\r\n\r\n"
    assert len(head) <= httpd.MAX_HEAD_BYTES  # arrives as one read of under 16 KiB...
    assert httpd._fast_request(head) is None  # ...but counts over it: h11's path answers 431

    async def main() -> None:
        server = httpd.HttpServer("t", [httpd.get("/x", lambda r: Response(b"ok"))], [])
        port = await server.start("127.0.0.1", 0)
        try:
            for parts in ([head], [head[:100], head[100:]]):
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                for part in parts:
                    writer.write(part)
                    await writer.drain()
                    await asyncio.sleep(0.05)
                answer = await asyncio.wait_for(reader.read(), 5)
                writer.close()
                assert answer.startswith(b"HTTP/1.1 431 "), (len(parts), answer[:40])
        finally:
            await server.close()

    asyncio.run(main())


def test_an_answer_that_says_connection_close_closes_a_fast_path_connection() -> None:
    def closing(request: httpd.Request) -> Response:
        return Response(b"bye", headers={"Connection": "close"})

    async def main() -> None:
        server = httpd.HttpServer("t", [httpd.get("/bye", closing)], [])
        port = await server.start("127.0.0.1", 0)
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET /bye HTTP/1.1\r\nHost: x\r\n\r\n")  # one read: the fast path
            answer = await asyncio.wait_for(reader.read(), 5)  # EOF: the agent closed
            writer.close()
        finally:
            await server.close()
        assert answer.startswith(b"HTTP/1.1 200 OK\r\n") and answer.endswith(b"\r\n\r\nbye")
        assert b"Connection: close\r\n" in answer

    asyncio.run(main())


H11_ORIGINAL = re.compile(h11._abnf.header_field.encode("ascii"))


FIELD_PIECES = [b" ", b"\t", b"a", b"b", b"\x80", b"\x7f", b"\x01", b"\x00", b"\x0b", b"\r", b":"]


@settings(max_examples=3000, deadline=None)
@given(
    st.tuples(
        _mostly([b"X", b"a-b", b"X-Key"], st.sampled_from([b"", b"X Y", b"\x80", b"("])),
        _mostly([b":"], st.sampled_from([b"", b";", b" :"])),
        st.lists(st.sampled_from(FIELD_PIECES), max_size=20).map(b"".join),
    ).map(b"".join)
)
@example(b"X: a b\t c ")
@example(b"X:\t \x00")
@example(b"X: \x80 \x7f ")
def test_the_linear_h11_header_regex_matches_what_h11s_own_does(line: bytes) -> None:
    ours, theirs = httpd.H11_HEADER_FIELD.fullmatch(line), H11_ORIGINAL.fullmatch(line)
    assert (ours is None) == (theirs is None), line
    if ours is not None and theirs is not None:
        assert ours.groupdict() == theirs.groupdict(), line


def test_h11_reads_headers_with_the_linear_regex() -> None:
    # the agent's listener and every h11 user in the process: refused in linear time
    assert httpd.H11_LINEAR_HEADERS
    assert h11._readers.header_field_re is httpd.H11_HEADER_FIELD
    head = b"GET / HTTP/1.1\r\nHost: x\r\nX:" + b" " * 65536 + b"\x00\r\n\r\n"
    conn = h11.Connection(h11.SERVER, max_incomplete_event_size=1 << 20)
    conn.receive_data(head)
    t0 = time.process_time()
    with pytest.raises(h11.RemoteProtocolError):
        conn.next_event()
    assert time.process_time() - t0 < 1.0  # quadratic: minutes at 64 KiB
