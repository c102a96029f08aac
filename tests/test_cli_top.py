import io
import subprocess
import sys

from rich.console import Console

from kvpressure.agent import view
from kvpressure.agent.top import Frame, StallRates, render_frame


def _text(renderable) -> str:
    c = Console(width=140, record=True, file=io.StringIO())
    c.print(renderable)
    return c.export_text()


def _snap(stall_idle: float):
    def s(metric, value, **labels):
        return {"name": metric, "labels": labels, "value": value}

    g = {"gpu": "0"}
    eng = {"engine": "vllm", "instance": "h:8000"}
    return {
        "version": "0.1.0",
        "uptime_s": 5,
        "samplers": [
            {
                "sampler": "gpu",
                "state": "up",
                "up": True,
                "duration_s": 0.001,
                "reason": "",
                "sources": [],
            }
        ],
        "samples": [
            s("kvpressure_gpu_up", 1, **g),
            s("kvpressure_gpu_memory_total_bytes", 2**30, **g),
            s(
                "kvpressure_accelerator_stall_seconds_total",
                stall_idle,
                reason="idle_with_queue",
                **g,
            ),
            s("kvpressure_accelerator_stall_seconds_total", 4.0, reason="throttled", **g),
            s("kvpressure_engine_up", 1, **eng),
            s("kvpressure_engine_latency_seconds", 0.25, phase="ttft", percentile="p50", **eng),
        ],
    }


def test_stall_rates_are_shares_of_the_elapsed_time_and_need_a_previous_frame():
    r = StallRates()
    assert r.update(10.0, view.gpus(view.Snap(_snap(1.0)))) == {}
    got = r.update(12.0, view.gpus(view.Snap(_snap(2.0))))
    assert got == {("0", "idle_with_queue"): 0.5, ("0", "throttled"): 0.0}
    assert r.update(13.0, view.gpus(view.Snap(_snap(0.0)))) == {  # counter reset: no share
        ("0", "throttled"): 0.0
    }


def test_frame_engine_latency_gauge_wins_and_request_records_fill_the_rest():
    atts = {"requests": {"vllm": {"requests": 3, "phases": {
        "ttft": {"n": 3, "p50": 9.0, "p99": 0.9}, "itl": {"n": 3, "p50": 0.02, "p99": 0.03}}}},
        "slow_by_cause": {}}  # fmt: skip
    out = _text(render_frame(Frame(1.0, _snap(1.0), atts), {("0", "throttled"): 0.25}, "u"))
    row = next(x for x in out.splitlines() if x.startswith("vllm "))
    assert row.split()[-4:] == ["250.0ms", "900.0ms*", "20.0ms*", "30.0ms*"]
    gpu = next(x for x in out.splitlines() if x.startswith("0 "))
    assert gpu.split()[-3:] == ["-", "-", "25%"]  # no share yet is '-', never 0 %
    assert "SLOW REQUESTS, LAST MINUTE  none (3 request(s) seen)" in out


def test_frame_without_agent_says_so():
    out = _text(render_frame(Frame(1.0, None, None, "no agent answering at u (refused)"), {}, "u"))
    assert "no agent answering at u (refused)" in out and "retrying" in out


def test_top_once_exits_1_without_agent():
    r = subprocess.run(
        [sys.executable, "-m", "kvpressure.agent.cli", "top", "--once", "--url", "http://127.0.0.1:9",
         "--interval", "0.1", "--timeout", "1"],
        capture_output=True, text=True, check=False, timeout=30,
    )  # fmt: skip
    assert r.returncode == 1
    # as `status`: one line on stderr, nothing on stdout, no "retrying..." from a command
    # that does not retry
    assert r.stdout == ""
    assert r.stderr.startswith("kvpressure top: no agent answering at http://127.0.0.1:9")
    assert len(r.stderr.splitlines()) == 1 and "retrying" not in r.stderr


def test_gpu_processes_are_joined_to_the_engine_they_serve():
    snap = _snap(1.0)
    snap["samples"] += [
        {"name": "kvpressure_gpu_process_memory_bytes", "value": 3 * 2**30,
         "labels": {"gpu": "0", "pid": "77", "process": "vllm", "engine": "vllm"}},
        {"name": "kvpressure_gpu_process_memory_bytes", "value": 2**30,
         "labels": {"gpu": "0", "pid": "9", "process": "python3"}},
    ]  # fmt: skip
    out = _text(render_frame(Frame(1.0, snap, None), {}, "u")).splitlines()
    rows = [x.strip() for x in out if x.strip().startswith("pid ")]
    assert rows[0].split() == ["pid", "77", "vllm", "->", "vllm", "3.0", "GiB"]  # largest first
    assert rows[1].split() == ["pid", "9", "python3", "1.0", "GiB"]


def test_an_80_column_terminal_gets_the_compact_layout_without_ellipses():
    snap = _snap(1.0)
    snap["samples"].append(
        {"name": "kvpressure_gpu_memory_used_bytes", "labels": {"gpu": "0"}, "value": 2**29}
    )
    frame = Frame(1.0, snap, None)
    c = Console(width=80, record=True, file=io.StringIO())
    c.print(render_frame(frame, {("0", "idle_with_queue"): 0.5, ("0", "throttled"): 0.0,
                                 ("0", "memory_bound"): 0.25}, "u", 80))  # fmt: skip
    lines = c.export_text().splitlines()
    assert all(len(x) <= 80 for x in lines)
    eng = next(x for x in lines if x.startswith("vllm "))
    assert "…" not in eng and "h:8000" not in eng  # the instance is left out when narrow
    gpu = next(x for x in lines if x.startswith("0 "))
    assert "…" not in gpu and gpu.split()[-1] == "50/25/0%"
    head = next(x for x in lines if x.startswith("GPU "))
    assert head.split()[-2:] == ["STALL", "i/m/t"]
