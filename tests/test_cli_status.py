import json
import subprocess
import sys

from kvpressure.agent.cli import render_status


def _snap():
    def s(name, value, **labels):
        return {"name": name, "labels": labels, "value": value}

    eng = {"engine": "llamacpp", "instance": "127.0.0.1:8080"}
    return {
        "version": "0.1.0",
        "uptime_s": 42,
        "samplers": [
            {
                "sampler": "engine:llamacpp",
                "up": True,
                "duration_s": 0.003,
                "reason": "",
                "sources": [{"source": "metrics", "state": "ok", "reason": ""}],
            },
            {
                "sampler": "gpu",
                "up": True,
                "duration_s": 0.0001,
                "reason": "",
                "sources": [
                    {"source": "nvml", "state": "unsupported", "reason": "library_not_found"}
                ],
            },
        ],
        "samples": [
            s("kvpressure_host_memory_total_bytes", 25 * 2**30),
            s("kvpressure_host_memory_available_bytes", 20 * 2**30),
            s("kvpressure_psi_avg10_ratio", 0.012, resource="memory", kind="some", scope="system"),
            s("kvpressure_engine_up", 1, **eng),
            s("kvpressure_engine_kv_cache_usage_ratio", 0.573, model="m", **eng),
            s("kvpressure_engine_kv_cache_used_tokens", 1173, model="m", **eng),
            s("kvpressure_engine_kv_cache_capacity_tokens", 2048, model="m", **eng),
            s("kvpressure_engine_requests_running", 4, model="m", **eng),
            s("kvpressure_engine_requests_waiting", 3, model="m", **eng),
        ],
    }


def test_render_status_shows_host_engines_and_samplers():
    out = render_status(_snap())
    assert "total 25.0 GiB" in out and "available 20.0 GiB" in out
    assert "memory.some 1.2%" in out
    row = next(line for line in out.splitlines() if line.startswith("llamacpp"))
    assert "57.3%" in row and "1173/2048" in row and row.split()[-2:] == ["4", "3"]
    gpu = next(line for line in out.splitlines() if line.startswith("gpu"))
    assert "nvml:unsupported(library_not_found)" in gpu
    assert "swap used -" in out  # missing values are shown as '-', never 0


def test_render_status_without_engines():
    snap = _snap()
    snap["samples"] = [x for x in snap["samples"] if not x["name"].startswith("kvpressure_engine")]
    assert "(no engines configured or discovered)" in render_status(snap)
    assert json.dumps(snap)  # the snapshot is plain JSON


def test_status_exits_1_when_no_agent_answers():
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvpressure.agent.cli",
            "status",
            "--url",
            "http://127.0.0.1:9",
            "--timeout",
            "1",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert r.returncode == 1
    assert "no agent answering at http://127.0.0.1:9" in r.stderr


# --- issue 17: a reader that stops early (| head) gets no BrokenPipeError traceback ----------


def _closed_reader(*args: str) -> subprocess.CompletedProcess[str]:
    """Run ``kvpressure ARGS`` with its stdout pipe closed before it writes, as ``| head``."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvpressure.agent.cli", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # the reader is gone before the first write
    err = proc.stderr.read()
    proc.wait(30)
    return subprocess.CompletedProcess(proc.args, proc.returncode, "", err)


def test_metrics_into_a_closed_pipe_ends_quietly() -> None:
    r = _closed_reader("metrics")
    assert "Traceback" not in r.stderr and "BrokenPipeError" not in r.stderr, r.stderr
    assert r.returncode == 141  # 128 + SIGPIPE, like `cat | head`


def test_status_json_into_a_closed_pipe_ends_quietly() -> None:
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    body = json.dumps(_snap()).encode()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{srv.server_address[1]}"
        r = _closed_reader("status", "--json", "--url", url)
    finally:
        srv.shutdown()
        srv.server_close()
    assert "Traceback" not in r.stderr and "BrokenPipeError" not in r.stderr, r.stderr
    assert r.returncode == 141


def _gpu_snap():
    snap = _snap()

    def s(metric, value, **labels):
        return {"name": metric, "labels": labels, "value": value}

    g = {"gpu": "0", "uuid": "GPU-1"}
    snap["samplers"][1] = {
        "sampler": "gpu",
        "state": "up",
        "up": True,
        "duration_s": 0.002,
        "reason": "",
        "sources": [{"source": "nvml", "state": "ok", "reason": ""}],
    }
    snap["samples"] += [
        s("kvpressure_gpu_up", 1, **g),
        s("kvpressure_gpu_info", 1, name="NVIDIA H200", **g),
        s("kvpressure_gpu_memory_total_bytes", 143771 * 2**20, **g),
        s("kvpressure_gpu_memory_used_bytes", 85.3 * 2**30, **g),
        s("kvpressure_gpu_memory_reserved_bytes", 700 * 2**20, **g),
        s("kvpressure_gpu_utilization_ratio", 0.68, **g),
        s("kvpressure_gpu_process_memory_bytes", 84 * 2**30, pid="4242", process="python3", **g),
        s(
            "kvpressure_gpu_process_memory_bytes",
            2**30,
            pid="77",
            process="llama-server",
            engine="llamacpp",
            **g,
        ),
    ]
    return snap


def test_render_status_gpu_section_memory_utilization_and_processes():
    out = render_status(_gpu_snap()).splitlines()
    head = next(i for i, line in enumerate(out) if line.startswith("GPU "))
    assert out[head].split() == [
        "GPU", "NAME", "MEM", "USED", "RESERVED", "TOTAL", "USED%", "UTIL", "MEM", "BW"
    ]  # fmt: skip
    row = out[head + 1]
    assert row.startswith("0      NVIDIA H200")
    assert "85.3 GiB" in row and "700.0 MiB" in row and "140.4 GiB" in row and "68%" in row
    assert row.rstrip().endswith("-")  # no bandwidth sample: '-', not 0
    assert out[head + 2].split() == ["pid", "4242", "python3", "84.0", "GiB"]
    assert out[head + 3].split() == [
        "pid",
        "77",
        "llama-server",
        "1.0",
        "GiB",
        "engine",
        "llamacpp",
    ]


def test_status_gpu_sampler_without_nvml_reads_unsupported():
    out = render_status(_snap())  # the gpu entry carries no "state": derived from sources
    assert "GPU  unsupported (nvml: library_not_found)" in out
    gpu = next(line for line in out.splitlines() if line.startswith("gpu "))
    assert gpu.split()[1] == "unsupported"
    eng = next(line for line in out.splitlines() if line.startswith("engine:llamacpp"))
    assert eng.split()[1] == "up"


def test_snapshot_reports_a_sampler_without_device_as_unsupported():
    from kvpressure.agent.api import snapshot
    from kvpressure.agent.samples import Batch
    from kvpressure.agent.state import AgentState, SamplerReport
    from kvpressure.agent.timeline import Timeline

    state = AgentState(Timeline())
    none = Batch()
    none.source_unsupported("nvml", "library_not_found")
    state.publish(SamplerReport("gpu", 1.0, 0.001, True, batch=none))
    some = Batch()
    some.add("kvpressure_host_memory_total_bytes", 1.0)
    some.source_unsupported("psi", "kernel_without_psi")  # partial: still up
    state.publish(SamplerReport("host", 1.0, 0.001, True, batch=some))
    state.publish(SamplerReport("engine:vllm", 1.0, 2.0, False, reason="timeout"))
    got = {s["sampler"]: (s["state"], s["up"]) for s in snapshot(state)["samplers"]}
    assert got == {
        "gpu": ("unsupported", False),
        "host": ("up", True),
        "engine:vllm": ("down", False),
    }


def test_a_reader_that_leaves_early_gets_no_traceback():
    """`kvpressure metrics | head -1`: the closed pipe ends the command quietly."""
    p = subprocess.Popen(
        [sys.executable, "-m", "kvpressure.agent.cli", "metrics"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        bufsize=0,
    )
    assert p.stdout is not None and p.stdout.read(10)
    p.stdout.close()
    _, err = p.communicate(timeout=30)
    assert b"Traceback" not in err and b"BrokenPipe" not in err
    assert p.returncode in (0, 141)
