"""``kvpressure explain``: the text, ``--json``, ``--since`` parsing, exit codes, and the
``/api/v1/attributions`` endpoint of a running daemon fed through its request stream."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httpx
import pytest

from agent.attribution.explain import _fmt_value, fmt_seconds, parse_since, render
from agent.attribution.model import Attribution, Evidence, WindowAttribution
from agent.attribution.store import AttributionStore, RequestSummary
from agent.cli import main
from agent.config import parse
from agent.daemon import Daemon
from agent.requests.record import RequestRecord

T = 1_800_000_000.0


def _att(end: float, cause: str, signal: str, value: float, unassessed=()) -> Attribution:
    e = Evidence(cause, signal, "m", value, 0.25, 0.75, 0.9, "s/s")
    return Attribution(
        "llamacpp", end - 3, end, cause, {cause: 0.9}, (e,), tuple(unassessed), "ttft", 2.5, 0.4,
        "baseline",
    )  # fmt: skip


def _store() -> AttributionStore:
    st = AttributionStore()
    for k in range(20):
        st.add_request(RequestSummary("llamacpp", T + k, "ok", False, (("ttft", 0.1 + k / 1000),)))
    for k in range(3):
        st.add_request(RequestSummary("llamacpp", T + 21 + k, "ok", True, (("ttft", 2.5),)))
        st.add_attribution(_att(T + 21 + k, "memory", "queue_while_full", 1.0))
    st.add_attribution(_att(T + 45, "compute", "psi_cpu_some", 0.8))
    st.add_attribution(_att(T + 55, "unknown", "x", 0.0, unassessed=("engine_metrics",)))
    for w in range(6):
        st.add_window(
            WindowAttribution("llamacpp", T + 10 * w, T + 10 * w + 10, None, {}, (), (), 5, 0, 0.1)
        )
    return st


def test_render_reads_like_an_incident_summary():
    text = render(_store().query(T - 1, T + 60))
    assert "kvpressure explain: last 1m01s" in text
    assert "ENGINE" in text and "ttft" in text and "P99" in text
    assert "23 requests, 3 slow (13.0 %)" in text
    assert "SLOW REQUESTS BY CAUSE" in text
    assert "memory" in text and "compute" in text
    assert "STRONGEST EVIDENCE" in text
    assert "queue_while_full" in text and "in 3/3" in text
    assert "WHEN EACH CAUSE DOMINATED" in text
    assert "NOT ASSESSED" in text and "engine metrics unavailable" in text
    assert "memory is not ruled out" in text
    assert "SLOWEST REQUESTS" in text


def test_render_without_requests_says_how_to_get_them():
    text = render(AttributionStore().query(T, T + 600))
    assert "No requests in this period" in text and "proxies:" in text


@pytest.mark.parametrize(
    ("text", "seconds"), [("10m", 600), ("90s", 90), ("1h", 3600), ("45", 45), ("2d", 172800)]
)
def test_parse_since(text, seconds):
    assert parse_since(text) == seconds


@pytest.mark.parametrize("bad", ["", "ten minutes", "-5m", "0"])
def test_parse_since_rejects(bad):
    with pytest.raises(ValueError):
        parse_since(bad)


@pytest.mark.parametrize(
    ("value", "unit", "text"),
    [
        (16.0, "1", "16"),  # a count reads as a count, not "16.00 1"
        (2.5, "1", "2.50"),
        (0.78, "s/s", "0.78 s/s"),
        (3514.0, "pages/s", "3514 pages/s"),
        (0.65, "ratio", "65%"),
        (2.2e8, "bytes/s", "220.0 MB/s"),
    ],
)
def test_evidence_values_read_with_their_units(value, unit, text):
    assert _fmt_value(value, unit) == text


def test_fmt_seconds():
    assert (fmt_seconds(0.0123), fmt_seconds(2.5), fmt_seconds(None)) == ("12.3ms", "2.50s", "-")


# --- against a running daemon ------------------------------------------------------------------


def _run(daemon: Daemon) -> asyncio.AbstractEventLoop:
    loop = asyncio.new_event_loop()
    ready = threading.Event()

    def main_() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(daemon.run(ready=ready.set))

    threading.Thread(target=main_, daemon=True).start()
    assert ready.wait(5)
    return loop


@pytest.fixture
def daemon():
    cfg = parse(
        "listen: '127.0.0.1:0'\ninterval_s: 0.2\n"
        "samplers: {host: {enabled: false}, engines: {enabled: false}, gpu: {enabled: false}}\n"
        "discovery: {enabled: false}\n"
        "attribution: {slo_ttft_s: 1.0, settle_s: 0}\n"
    )
    d = Daemon(cfg)
    loop = _run(d)
    yield d
    loop.call_soon_threadsafe(d.request_stop)
    time.sleep(0.3)


def test_explain_cli_and_api_against_a_running_agent(daemon, capsys):
    now = time.time()
    for k in range(5):
        daemon.request_stream.submit(
            RequestRecord("llamacpp", now - 5 + k * 0.1, now - 4 + k * 0.1, ttft_s=0.05)
        )
    daemon.request_stream.submit(RequestRecord("llamacpp", now - 3, now - 1, ttft_s=1.8))
    base = f"http://127.0.0.1:{daemon.bound_port}"
    deadline = time.monotonic() + 5
    doc: dict = {}
    while time.monotonic() < deadline:
        doc = httpx.get(f"{base}/api/v1/attributions", params={"since": "5m"}).json()
        if doc["attributions"]:
            break
        time.sleep(0.1)
    (a,) = doc["attributions"]
    assert a["cause"] == "unknown" and a["unassessed"] == ["engine_metrics"]
    assert doc["requests"]["llamacpp"]["requests"] == 6

    assert main(["explain", "--url", base, "--since", "5m"]) == 0
    out = capsys.readouterr().out
    assert "1 slow" in out and "engine metrics unavailable" in out

    assert main(["explain", "--url", base, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["slow_by_cause"] == {"llamacpp": {"unknown": 1}}

    metrics = httpx.get(f"{base}/metrics").text
    assert 'kvpressure_slow_requests_total{cause="unknown",engine="llamacpp"} 1.0' in metrics
    assert httpx.get(f"{base}/api/v1/attributions", params={"since": "x"}).status_code == 400
    # issue 18, point 6: the answer's size is bounded
    for limit in ("100000", "-1"):
        r = httpx.get(f"{base}/api/v1/attributions", params={"limit": limit})
        assert r.status_code == 400 and "limit must be between 0 and 1000" in r.json()["error"]
    assert httpx.get(f"{base}/api/v1/attributions", params={"limit": "1000"}).status_code == 200


def test_explain_exit_codes(capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert main(["explain", "--url", f"http://127.0.0.1:{port}", "--timeout", "1"]) == 1
    assert "no agent answering" in capsys.readouterr().err
    assert main(["explain", "--since", "soon"]) == 2
