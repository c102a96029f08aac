"""Agent CPU % and peak RSS over a sampling period, with a real llama.cpp engine attached.

Starts a llama-server (the e2e tests' helpers find it: scripts/ensure-llamacpp), then for each
interval runs ``kvpressure run`` with the host, engine and GPU samplers on (the GPU sampler
disables itself once on a machine without NVML) and measures the agent process alone:

- CPU %: (user + system CPU seconds over the window) / window, as a share of one core;
- peak RSS: the kernel's high-water mark (``VmHWM`` in /proc/<pid>/status).

A light load (one short completion every 2 s) keeps the engine's counters moving.

Usage::

    .venv/bin/python benchmarks/agent_footprint.py [--seconds 60] [--intervals 1,0.1]
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "e2e"))

from e2e_support import Agent, LlamaServer, find_llama_assets, free_port  # noqa: E402


def _vm_hwm_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def measure(server: LlamaServer, interval: float, seconds: float, work: Path) -> dict[str, float]:
    port = free_port()
    cfg = work / f"agent-{interval}.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "listen": f"127.0.0.1:{port}",
                "interval_s": interval,
                "discovery": {"enabled": False},
                "engines": [{"name": "llamacpp", "type": "llamacpp", "url": server.url}],
            }
        )
    )
    agent = Agent(cfg, port, work / f"agent-{interval}.err")
    agent.start()
    assert agent.proc is not None
    proc = psutil.Process(agent.proc.pid)
    time.sleep(3)  # warm-up: imports done, first cycles run
    stop = threading.Event()

    def load() -> None:
        while not stop.wait(2.0):
            with contextlib.suppress(Exception):  # load is best effort
                server.complete("Say something short about memory.", n_predict=8, timeout_s=30)

    t = threading.Thread(target=load, daemon=True)
    t.start()
    c0 = proc.cpu_times()
    w0 = time.monotonic()
    rss_max = 0
    while time.monotonic() - w0 < seconds:
        rss_max = max(rss_max, proc.memory_info().rss)
        time.sleep(0.5)
    c1 = proc.cpu_times()
    wall = time.monotonic() - w0
    hwm = _vm_hwm_bytes(proc.pid)
    samples = len(agent.scrape())
    stop.set()
    t.join(5)
    agent.stop()
    cpu = (c1.user - c0.user) + (c1.system - c0.system)
    return {
        "interval_s": interval,
        "window_s": wall,
        "cpu_seconds": cpu,
        "cpu_percent_of_one_core": 100 * cpu / wall,
        "peak_rss_mib": max(hwm, rss_max) / 2**20,
        "series_exported": samples,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--intervals", default="1,0.1")
    args = ap.parse_args()
    assets, why = find_llama_assets()
    if assets is None:
        print(f"no llama.cpp server: {why}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as d:
        work = Path(d)
        server = LlamaServer(assets, free_port(), work)
        server.start()
        try:
            intervals = [float(i) for i in args.intervals.split(",")]
            rows = [measure(server, i, args.seconds, work) for i in intervals]
        finally:
            server.stop()
    print(f"{'interval':>9} {'window':>8} {'cpu s':>7} {'cpu %':>7} {'peak RSS':>10} {'series':>7}")
    for r in rows:
        print(
            f"{r['interval_s']:>8.1f}s {r['window_s']:>7.1f}s {r['cpu_seconds']:>7.2f} "
            f"{r['cpu_percent_of_one_core']:>6.2f}% {r['peak_rss_mib']:>7.1f} MiB "
            f"{r['series_exported']:>7}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
