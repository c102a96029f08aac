"""The standard 8-GPU node's resident memory over time, beside node_exporter's.

Runs ``kvpressure run`` with ``benchmarks/node_cost.py``'s ``node`` scenario (host and 8
fake GPUs at 0.1 s, 8 vLLM engine stand-ins serving the real 51 KB exposition, fully
scraped at 1 s with their gauges read at 0.1 s) for ``--minutes`` (default 17: the 1 s
timeline rings are full at 1,024 s), and prints once a minute the agent's ``VmRSS``,
``RssAnon`` and ``RssFile`` (``/proc/PID/status``) beside ``prometheus-node-exporter``'s
``VmRSS`` (started on a free port and scraped once a second, as in ``node_cost.py``).
A figure read 20 s after start (``node_cost.py``'s windows) holds rings that are still
filling; this one is the steady state issue 15's 60 MiB target is read against.

``--connections N`` opens N loopback TCP connections (2N sockets, held by a child process)
after the first minute's line and holds them to the end, as a busy inference node holds
its clients' connections: the agent's reads of the host's sockets (the engines' listening
PIDs) must not grow with them. Usage::

    flock /tmp/kvpressure-cpu.lock .venv/bin/python benchmarks/node_rss.py [--minutes 17]
        [--connections 10000] [--kvpressure OTHER_CHECKOUT/.venv/bin/kvpressure]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))

import node_cost as nc  # the sibling benchmark, by path

HOLD_CONNECTIONS = r"""
import resource, socket, sys, time
n = int(sys.argv[1])
hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
n = min(n, (hard - 64) // 2)
srv = socket.create_server(("127.0.0.1", 0), backlog=4096)
held = []
for _ in range(n):
    held.append(socket.create_connection(srv.getsockname()))
    held.append(srv.accept()[0])
print(n, flush=True)
time.sleep(1e9)
"""
"""A child that opens ``argv[1]`` loopback connections (up to its file limit), prints how
many, and holds them until killed."""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=int, default=17)
    ap.add_argument("--kvpressure", type=Path, default=Path(sys.executable).parent / "kvpressure")
    ap.add_argument("--connections", type=int, default=0, help="held from the second minute")
    args = ap.parse_args()
    holder: subprocess.Popen[str] | None = None
    capture = next(p for p in nc.CAPTURES if p.exists())
    ports = [nc.free_port() for _ in range(8)]
    servers = nc.start_engines(capture, ports)
    try:
        with nc.node_exporter() as peer, tempfile.TemporaryDirectory() as work:
            cfg = Path(work) / "node.yaml"
            cfg.write_text(yaml.safe_dump(nc.scenario_config("node", nc.free_port(), ports)))
            agent = subprocess.Popen(
                [str(args.kvpressure), "run", "--config", str(cfg)],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            stop = threading.Event()

            def scrape_peer(url: str) -> None:  # once a second, as a Prometheus would
                while not stop.wait(1.0):
                    nc.get(url)

            if peer is not None:
                threading.Thread(target=scrape_peer, args=(peer[1],), daemon=True).start()
            print(f"capture: {capture.name}; agent: {args.kvpressure}")
            print(f"{'after':>6} {'agent RSS':>10} {'anon':>8} {'file':>8} {'node_exp':>9}")
            try:
                start = time.monotonic()
                for minute in range(1, args.minutes + 1):
                    time.sleep(max(0.0, start + 60 * minute - time.monotonic()))
                    if agent.poll() is not None:
                        print(f"the agent exited ({agent.returncode})")
                        return 1
                    rss, anon, file = (
                        kib / 1024
                        for kib in nc.status_kib(agent.pid, "VmRSS", "RssAnon", "RssFile")
                    )
                    ne = (
                        f"{nc.status_kib(peer[0].pid, 'VmRSS')[0] / 1024:>5.1f} MiB"
                        if peer
                        else "-"
                    )
                    print(
                        f"{minute:>4} m {rss:>6.1f} MiB {anon:>4.1f} MiB {file:>4.1f} MiB {ne:>9}",
                        flush=True,
                    )
                    if minute == 1 and args.connections > 0:
                        holder = subprocess.Popen(
                            [sys.executable, "-c", HOLD_CONNECTIONS, str(args.connections)],
                            stdout=subprocess.PIPE,
                            text=True,
                        )
                        assert holder.stdout is not None
                        print(f"  {holder.stdout.readline().strip()} connections open", flush=True)
            finally:
                stop.set()
                agent.terminate()
                agent.wait(10)
                if holder is not None:
                    holder.kill()
                    holder.wait()
    finally:
        nc.stop_engines(servers)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
