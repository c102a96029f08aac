"""Agent CPU % and peak RSS over a sampling period, with a real llama.cpp engine attached.

Starts a llama-server (the e2e tests' helpers find it: scripts/ensure-llamacpp), then for each
interval runs ``kvpressure run`` with the host, engine and GPU samplers on (the GPU sampler
disables itself once on a machine without NVML) and measures the agent process alone:

- CPU %: (user + system CPU seconds over the window) / window, as a share of one core;
- peak RSS: the kernel's high-water mark (``VmHWM`` in /proc/<pid>/status).

A light load (one short completion every 2 s) keeps the engine's counters moving.

``--imports`` prints instead where the agent's resident memory at import goes: one fresh
interpreter imports the module groups below in order and prints each group's RSS increment
(``VmRSS`` from /proc/self/status; a group is charged only for what the groups before it
did not already load). The last groups are what only a feature that is switched on (or used)
imports.

Usage::

    .venv/bin/python benchmarks/agent_footprint.py [--seconds 60] [--intervals 1,0.1]
    .venv/bin/python benchmarks/agent_footprint.py --imports
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


IMPORT_GROUPS: list[tuple[str, list[str]]] = [
    ("asyncio (loads ssl) and h11: the agent's listener", ["asyncio", "h11"]),
    # pydantic's top-level import is lazy: its model machinery loads with the first model
    (
        "pydantic (with its model machinery)",
        ["pydantic", "pydantic.main", "pydantic.fields", "pydantic.types"],
    ),
    ("prometheus_client", ["prometheus_client"]),
    ("psutil, yaml", ["psutil", "yaml"]),
    ("kvpressure config (pydantic models)", ["kvpressure.agent.config"]),
    ("kvpressure daemon and cli", ["kvpressure.agent.daemon", "kvpressure.agent.cli"]),
    (
        "samplers: host, gpu (pynvml), engines, capacity",
        [
            "kvpressure.agent.samplers.host",
            "kvpressure.agent.samplers.gpu",
            "kvpressure.agent.samplers.accelerator",
            "kvpressure.agent.samplers.engines.vllm",
            "kvpressure.agent.capacity.live",
        ],
    ),
    ("httpx: an engine over https, a redirect, an encoding", ["httpx"]),
    ("with proxies: aiohttp (client and server)", ["kvpressure.agent.requests.proxy"]),
    (
        "on first OTLP export received: protobuf + OTLP messages",
        ["opentelemetry.proto.collector.trace.v1.trace_service_pb2", "google.protobuf.json_format"],
    ),
    ("with otlp_export.endpoint: opentelemetry-sdk + exporter", ["kvpressure.exporters.otlp"]),
]

IMPORTS_CHILD = r"""
import importlib, json, sys
def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
rows = [["interpreter", rss(), len(sys.modules)]]
for label, mods in json.loads(sys.argv[1]):
    for m in mods:
        importlib.import_module(m)
    rows.append([label, rss(), len(sys.modules)])
print(json.dumps(rows))
"""


def import_footprint() -> int:
    """Print the RSS each import group adds, in one fresh interpreter (this venv's)."""
    import json
    import subprocess

    out = subprocess.run(
        [sys.executable, "-c", IMPORTS_CHILD, json.dumps(IMPORT_GROUPS)],
        capture_output=True,
        text=True,
        check=True,
    )
    rows = json.loads(out.stdout)
    print(f"{'group':<58} {'+RSS':>9} {'RSS':>9} {'modules':>8}")
    prev = 0
    for label, kib, mods in rows:
        print(f"{label:<58} {(kib - prev) / 1024:>5.1f} MiB {kib / 1024:>5.1f} MiB {mods:>8}")
        prev = kib
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--intervals", default="1,0.1")
    ap.add_argument("--imports", action="store_true", help="print RSS by import group and exit")
    args = ap.parse_args()
    if args.imports:
        return import_footprint()
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
