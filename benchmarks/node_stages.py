"""Where the 8-GPU node's CPU goes, by stage: node_cost's ``node`` scenario, in-process.

Builds every stage of ``benchmarks/node_cost.py``'s ``node`` scenario (host and 8 fake GPUs
at 0.1 s, 8 vLLM engines serving the real 51 KB exposition, fully scraped at 1 s, their KV
usage, running and waiting read at 0.1 s) as the daemon builds them, and runs them with the
daemon's scheduler (:class:`agent.scheduler.Runners`: one thread per interval, the
accelerator right after each GPU report on the GPU's thread, the watchdog every 0.1 s) for
``--seconds``. Each collection's CPU (``time.thread_time``, on the thread that runs it,
publication included, less the stages its publication ran: the accelerator's is its own, not
the GPU sampler's) is added to its stage, and each thread group's
:meth:`~agent.pipeline.Sampler.prepare` calls (the engines' GETs sent ahead) to
``prepare``. Prints the process's CPU, each stage's share of a core and its CPU per
collection, and the rest (NVML worker threads, thread wake-ups and hand-offs,
the garbage collector), the breakdown ``node_cost.py`` cannot give (it sees one process).

The fake NVML is Python and runs inside the GPU stage's worker threads (``the rest``); a real
NVML is C. ``benchmarks/gpu_sampler_bench.py`` prints the fake's own time apart. No HTTP
server, no ``/metrics`` scrapes, no event loop: a little less than ``kvpressure run``.

Usage::

    flock /tmp/kvpressure-cpu.lock .venv/bin/python benchmarks/node_stages.py [--seconds 20]
"""

from __future__ import annotations

import argparse
import collections
import gc
import sys
import threading
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))

import node_cost

from kvpressure.agent import config, scheduler
from kvpressure.agent.cli import GC_THRESHOLDS
from kvpressure.agent.daemon import Daemon


def stage_of(sampler: str) -> str:
    """The stage a sampler name counts under (the 8 engines' samplers add up)."""
    if sampler.startswith("engine:"):
        return "engine full scrapes"
    if sampler.startswith("engine-gauges:"):
        return "engine gauge reads"
    return sampler


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument(
        "--warmup",
        type=float,
        default=5.0,
        help="seconds the node runs before it is measured (110: the 0.1 s rings full)",
    )
    args = ap.parse_args()
    cpu: collections.defaultdict[str, float] = collections.defaultdict(float)
    calls: collections.Counter[str] = collections.Counter()
    lock = threading.Lock()
    once, prepare = scheduler.SamplerRunner.once, scheduler.SamplerRunner.prepare

    nested = threading.local()  # CPU of stages run inside this one (the accelerator's)

    def timed_once(runner: scheduler.SamplerRunner) -> None:
        outer = getattr(nested, "spent", None)
        nested.spent = 0.0
        t0 = time.thread_time()
        once(runner)
        spent = time.thread_time() - t0
        inner, nested.spent = nested.spent, outer
        if outer is not None:
            nested.spent = outer + spent
        with lock:
            cpu[stage_of(runner.sampler.name)] += spent - inner
            calls[stage_of(runner.sampler.name)] += 1

    def timed_prepare(runner: scheduler.SamplerRunner) -> None:
        t0 = time.thread_time()
        prepare(runner)
        spent = time.thread_time() - t0
        with lock:
            cpu["prepare (GETs sent ahead)"] += spent

    scheduler.SamplerRunner.once = timed_once  # type: ignore[method-assign,assignment]
    scheduler.SamplerRunner.prepare = timed_prepare  # type: ignore[method-assign,assignment]
    capture = next(p for p in node_cost.CAPTURES if p.exists())
    ports = [node_cost.free_port() for _ in range(8)]
    servers = node_cost.start_engines(capture, ports)
    daemon: Daemon | None = None
    stop = threading.Event()
    try:
        scenario = node_cost.scenario_config("node", node_cost.free_port(), ports)
        cfg = config.parse(yaml.safe_dump(scenario))
        daemon = Daemon(cfg)
        gc.collect()
        gc.freeze()  # as kvpressure run does
        gc.set_threshold(*GC_THRESHOLDS)
        daemon._apply(cfg)
        runners = daemon._runners

        def watchdog() -> None:
            while not stop.wait(0.1):
                runners.check_timeouts(time.monotonic())

        threading.Thread(target=watchdog, daemon=True).start()
        time.sleep(args.warmup)  # warm-up: types known, windows open (rings filling)
        with lock:
            cpu.clear()
            calls.clear()
        c0, w0 = time.process_time(), time.monotonic()
        time.sleep(args.seconds)
        total, wall = time.process_time() - c0, time.monotonic() - w0
        with lock:
            spent, counted = dict(cpu), dict(calls)
    finally:
        stop.set()
        if daemon is not None:
            for r in daemon._runners.stop():
                r.join(2.0)
        node_cost.stop_engines(servers)
    timed = sum(spent.values())
    print(f"node stages, {wall:.0f} s: process {100 * total / wall:.2f} % of a core")
    for stage, s in sorted(spent.items(), key=lambda kv: -kv[1]):
        n = counted.get(stage, 0)
        per = f"{1e3 * s / n:7.3f} ms per collection ({n})" if n else ""
        print(f"  {stage:<26} {100 * s / wall:5.2f} %  {per}")
    print(
        f"  {'the rest':<26} {100 * (total - timed) / wall:5.2f} %  (NVML workers and the "
        "fake NVML, wake-ups and hand-offs, GC)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
