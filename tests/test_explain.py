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

from kvpressure.agent.attribution.explain import fmt_seconds, fmt_value, parse_since, render
from kvpressure.agent.attribution.model import Attribution, Evidence, WindowAttribution
from kvpressure.agent.attribution.store import AttributionStore, RequestSummary
from kvpressure.agent.cli import main
from kvpressure.agent.config import parse
from kvpressure.agent.daemon import Daemon
from kvpressure.agent.requests.record import RequestRecord

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
    assert fmt_value(value, unit) == text


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
    for limit in ("100000", "-1", "abc", "1e3"):
        r = httpx.get(f"{base}/api/v1/attributions", params={"limit": limit})
        error = r.json()["error"]
        assert r.status_code == 400 and "limit must be a whole number between 0 and 1000" in error
    assert httpx.get(f"{base}/api/v1/attributions", params={"limit": "1000"}).status_code == 200


def test_explain_exit_codes(capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert main(["explain", "--url", f"http://127.0.0.1:{port}", "--timeout", "1"]) == 1
    assert "no agent answering" in capsys.readouterr().err
    assert main(["explain", "--since", "soon"]) == 2


# --- issue 16: answers that mislead ------------------------------------------------------------


def test_failed_requests_are_left_out_of_the_percentiles_and_counted():
    st = AttributionStore()
    for k in range(20):
        st.add_request(RequestSummary("llamacpp", T + k, "ok", False, (("e2e", 22.0 + k / 100),)))
    for k in range(5):  # fast failures would drag p50 down if they were mixed in
        st.add_request(
            RequestSummary("llamacpp", T + 30 + k, "server_error", False, (("e2e", 0.1),))
        )
    doc = st.query(T - 1, T + 60)
    got = doc["requests"]["llamacpp"]
    assert (got["requests"], got["ok"], got["failed"]) == (25, 20, 5)
    assert got["phases"]["e2e"]["n"] == 20
    assert got["phases"]["e2e"]["p50"] == pytest.approx(22.095, abs=0.01)
    text = render(doc)
    assert (
        "25 requests, 0 slow (0.0 %); percentiles over the 20 ok, failed left out: server_error 5"
        in text
    )


NET = Evidence(
    "network", "tcp_retransmits", "kvpressure_net_tcp_retransmitted_segments_total", 5.05, 1.0,
    20.0, 0.3, "1/s",
)  # fmt: skip
CPU = Evidence(
    "compute", "psi_cpu_some", "kvpressure_psi_stall_seconds_total", 0.6, 0.25, 0.75, 0.71,
    "s/s", {"resource": "cpu", "kind": "some", "scope": "llamacpp"},
)  # fmt: skip
SCORES = {"compute": 0.71, "network": 0.30, "memory": 0.1}


def _multi_cause_store() -> AttributionStore:
    st = AttributionStore()
    for k in range(3):
        st.add_request(RequestSummary("llamacpp", T + k, "ok", True, (("ttft", 3.0),)))
        a = Attribution(
            "llamacpp", T + k - 3, T + k, "compute", SCORES, (CPU, NET), (), "ttft", 3.0, 2.0, "slo"
        )
        st.add_attribution(a)
    return st


def test_every_cause_above_min_score_is_shown_not_only_the_primary():
    doc = _multi_cause_store().query(T - 10, T + 10, min_score=0.3)
    assert doc["slow_by_cause"] == {"llamacpp": {"compute": 3}}
    assert doc["scored_by_cause"] == {"llamacpp": {"compute": 3, "network": 3}}
    lines = render(doc).splitlines()
    at = lines.index(next(x for x in lines if x.startswith("SLOW REQUESTS BY CAUSE")))
    assert lines[at + 2].split() == ["llamacpp", "compute", "3", "100.0", "%", "#" * 20, "3"]
    assert lines[at + 3].split() == ["network", "0", "3"]  # never primary, scored in all 3
    slowest = [x for x in lines if x.endswith("(host-wide)") or "ttft 3.00s >" in x]
    assert slowest and all("compute 0.71, network 0.30" in x for x in slowest)
    assert all("memory" not in x for x in slowest)  # 0.10 is under min_score


def test_rates_of_counts_read_as_what_they_count_and_host_wide_evidence_is_marked():
    text = render(_multi_cause_store().query(T - 10, T + 10))
    assert "1/s" not in text
    assert "tcp_retransmits=5.05 segments/s (host-wide)" in text
    assert "psi_cpu_some=0.60 s/s " in text  # the engine's own cgroup: not host-wide
    lines = text.splitlines()
    cpu = next(x for x in lines if x.startswith("compute ") and "psi_cpu_some" in x)
    assert "[host-wide]" not in cpu
    net = next(x for x in lines if x.startswith("network ") and "tcp_retransmits" in x)
    assert "5.05 segments/s (threshold 1.00 segments/s) in 3/3" in net  # a secondary cause
    assert net.endswith("[host-wide]")


@pytest.mark.parametrize(
    ("value", "unit", "signal", "text"),
    [
        (5.05, "1/s", "tcp_retransmits", "5.05 segments/s"),
        (3.0, "1/s", "allocstalls", "3.00 stalls/s"),
        (1.5, "1/s", "some_new_rule", "1.50 events/s"),
    ],
)
def test_count_rates_have_a_noun(value, unit, signal, text):
    assert fmt_value(value, unit, signal) == text


def test_window_never_starts_before_the_agent_started_or_its_first_observation(daemon, capsys):
    base = f"http://127.0.0.1:{daemon.bound_port}"
    doc = httpx.get(f"{base}/api/v1/attributions", params={"since": "1h"}).json()
    assert doc["since"] == pytest.approx(daemon.state.started)
    assert doc["requested_since"] < doc["since"] - 3000
    assert main(["explain", "--url", base, "--since", "1h"]) == 0
    head = capsys.readouterr().out.splitlines()[0]
    assert "since the agent started (--since asked for 1.0h" in head
    assert "last 1.0h" not in head


def test_unknown_engine_is_named_with_the_engines_the_agent_knows(daemon, capsys):
    now = time.time()
    daemon.request_stream.submit(RequestRecord("llamacpp", now - 0.2, now - 0.1, ttft_s=0.05))
    base = f"http://127.0.0.1:{daemon.bound_port}"
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        if "llamacpp" in httpx.get(f"{base}/api/v1/attributions").json()["engines"]:
            break
        time.sleep(0.1)
    assert main(["explain", "--url", base, "--engine", "nosuch"]) == 2
    err = capsys.readouterr().err
    assert "knows no engine 'nosuch'; it knows: llamacpp" in err
    assert main(["explain", "--url", base, "--engine", "llamacpp"]) == 0


def test_html_report_holds_tables_and_charts_inline():
    from kvpressure.agent.attribution.report import render_html

    snap = {"samples": []}
    for band, ttft in (("0-50", 0.05), ("95-100", 2.0)):
        for le in ("0.1", "2.5", "+Inf"):
            n = 10.0 if float(le.replace("+Inf", "inf")) >= ttft else 0.0
            snap["samples"].append({"name": "kvpressure_kv_occupancy_latency_seconds_bucket",
                                    "labels": {"engine": "llamacpp", "phase": "ttft",
                                               "band": band, "le": le}, "value": n})  # fmt: skip
    page = render_html(_multi_cause_store().query(T - 10, T + 10), snap)
    assert page.startswith("<!DOCTYPE html>") and page.rstrip().endswith("</html>")
    assert "<script" not in page and "<link" not in page
    assert page.count("<svg") == 2  # the TTFT knee (no ITL observed) and causes over time
    assert "0-50 (10)" in page and "95-100 (10)" in page
    assert "compute 0.71, network 0.30" in page
    assert "tcp_retransmits = 5.05 segments/s" in page and "host-wide" in page


def test_html_report_says_what_is_missing_instead_of_drawing_zeros():
    from kvpressure.agent.attribution.report import render_html

    page = render_html(AttributionStore().query(T - 10, T + 10), None)
    assert "<svg" not in page
    assert "No snapshot was read, so no knee." in page
    assert "No slow requests in this window." in page
    assert "No requests in this period." in page


def test_explain_html_to_an_unwritable_path_is_one_line_and_exit_1(daemon, capsys, tmp_path):
    base = f"http://127.0.0.1:{daemon.bound_port}"
    assert main(["explain", "--url", base, "--html", str(tmp_path / "no" / "such" / "x.html")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("kvpressure explain: cannot write ") and err.count("\n") == 1
    assert main(["explain", "--url", base, "--html", str(tmp_path / "x.html")]) == 0
    assert (tmp_path / "x.html").read_text().startswith("<!DOCTYPE html>")


def test_no_range_starts_before_the_asked_start():
    """Windows are aligned to 10 s: the first one straddles the agent's start (or --since);
    the NOT ASSESSED and WHEN EACH CAUSE DOMINATED ranges start at it, never before."""
    st = AttributionStore()
    since = T + 3.0  # the agent started 3 s into the first window
    st.add_window(
        WindowAttribution(
            "llamacpp", T, T + 10, "memory", {"memory": 0.9}, (), ("engine_metrics",), 4, 2, 0.5
        )
    )
    doc = st.query(since, T + 60)
    assert [u["start"] for u in doc["unassessed"]] == [since]
    assert [d["start"] for d in doc["dominant"]] == [since]
    assert all(u["end"] == T + 10 for u in doc["unassessed"])
