import json
import subprocess
import sys

from agent.cli import render_status


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
            "agent.cli",
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
        [sys.executable, "-m", "agent.cli", *args],
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
