"""CPU cost of the GPU sampler on the fake NVML binding: 8 GPUs at 10 Hz for ~20 s.

Runs :class:`agent.samplers.gpu.GpuSampler` on ``fake:h100-sxm`` (8x H100, every field
supported, GPM, 18 NVLink links each, one engine process per GPU) and, after each cycle, the
``accelerator`` stage it triggers (:class:`agent.samplers.accelerator.AcceleratorSampler`) with
a synthetic engine feeding request gauges and token counters, so every code path (stall time,
data movement, the process join) runs each cycle. It prints the process CPU seconds per cycle
(all threads, ``time.process_time``) and the CPU % of one core, and the same without the fake's
own call time (measured per call with ``time.thread_time``), which stands in for NVML's own time
that the issue's target excludes. Beside it, in the same window, Debian's
``prometheus-node-exporter`` (started on a free port, scraped once a second by a process of
its own) is the peer: its CPU % and the ratio are printed too (skipped when not installed).

Usage::

    .venv/bin/python benchmarks/gpu_sampler_bench.py [--seconds 20] [--hz 10] [--gpus 8]
        [--profile h100-sxm] [--inline]

Exit status 0; the figures are for the report (target: <= 1 % of one core, excluding NVML).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))

import node_cost

from kvpressure.agent.samplers import nvml_binding as nb
from kvpressure.agent.samplers.accelerator import AcceleratorSampler
from kvpressure.agent.samplers.fake_nvml import FakeNvml
from kvpressure.agent.samplers.gpu import GpuSampler
from kvpressure.agent.samples import Batch, Labels, make_labels


class TimedLib:
    """Wraps the fake so the CPU time spent inside its calls can be subtracted."""

    def __init__(self, lib: FakeNvml) -> None:
        self._lib = lib
        self.cpu_s = 0.0
        self.calls = 0
        self._cache: dict[str, Callable[..., Any]] = {}

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._lib, name)
        if not callable(attr) or not name.startswith("nvml"):
            return attr
        cached = self._cache.get(name)
        if cached is not None:
            return cached

        @functools.wraps(attr)
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.thread_time()
            try:
                return attr(*args, **kwargs)
            finally:
                self.cpu_s += time.thread_time() - t0
                self.calls += 1

        self._cache[name] = timed
        return timed


class Engines:
    """A synthetic vLLM: a queue that comes and goes and token counters that grow."""

    def __init__(self) -> None:
        self.t0 = time.monotonic()
        self.lab = make_labels({"engine": "vllm", "instance": "127.0.0.1:8000", "model": "m"})

    def views(self, names: Iterable[str]) -> dict[str, dict[Labels, float]]:
        """``AgentState.latest_many``: each name's synthetic series."""
        return {n: self.view(n) for n in names}

    def view(self, name: str) -> dict[Labels, float]:
        t = time.monotonic() - self.t0
        if name.endswith("requests_running"):
            return {self.lab: 32.0}
        if name.endswith("requests_waiting"):
            return {self.lab: float(int(t) % 3)}
        if name.endswith("prompt_tokens_total"):
            return {self.lab: 20000.0 * t}
        if name.endswith("generation_tokens_total"):
            return {self.lab: 3000.0 * t}
        return {}


def wrapper_overhead_s() -> float:
    """CPU seconds the timing wrapper itself adds per call (charged to "sampler" otherwise)."""

    class Noop:
        def nvmlNoop(self) -> None:
            return None

    lib = TimedLib(Noop())  # type: ignore[arg-type]
    fn = lib.nvmlNoop
    n = 200_000
    t0 = time.process_time()
    for _ in range(n):
        fn()
    wrapped = time.process_time() - t0
    bare = Noop().nvmlNoop
    t0 = time.process_time()
    for _ in range(n):
        bare()
    return max(0.0, (wrapped - (time.process_time() - t0)) / n)


SCRAPER = """
import sys, time, urllib.request
while True:
    try:
        urllib.request.urlopen(sys.argv[1], timeout=5).read()
    except OSError:
        pass
    time.sleep(1.0)
"""


@contextlib.contextmanager
def node_exporter() -> Iterator[psutil.Process | None]:
    """The peer (:func:`node_cost.node_exporter`) and a process of its own scraping it at 1 Hz."""
    with node_cost.node_exporter() as peer:
        if peer is None:
            yield None
            return
        proc, url = peer
        scraper = subprocess.Popen([sys.executable, "-c", SCRAPER, url])
        try:
            time.sleep(2)  # its first scrapes (start-up) are not in the window
            yield proc
        finally:
            scraper.terminate()
            scraper.wait(10)


def run(
    seconds: float,
    hz: float,
    gpus: int,
    profile: str,
    inline: bool,
    peer: psutil.Process | None = None,
) -> dict[str, float | None]:
    fake = FakeNvml.from_profile(profile, gpus=gpus)
    timed = TimedLib(fake)
    binding = nb.NvmlBinding(timed, f"fake:{profile}")
    engines = Engines()
    pids = {5100 + i: "vllm" for i in range(gpus)}
    sampler = GpuSampler(
        binding,
        interval_s=1.0 / hz,
        engine_pids=lambda: pids,
        gpu_timeout_s=0 if inline else None,
    )
    accelerator = AcceleratorSampler(lambda: None, engines.views, gpu_interval_s=1.0 / hz)

    def cycle() -> Batch:
        b = Batch()
        sampler.collect(b)
        b.samples.extend(accelerator.derive(time.monotonic(), b.samples, b.sources))
        return b

    cycle()  # init and discovery are not part of the steady state
    cycle()
    timed.cpu_s = 0.0
    timed.calls = 0
    period = 1.0 / hz
    cycles = 0
    samples = 0
    wall0 = time.monotonic()
    cpu0 = time.process_time()
    peer0 = node_cost.cpu_s(peer) if peer else 0.0
    next_t = wall0
    while time.monotonic() - wall0 < seconds:
        b = cycle()
        samples += len(b.samples)
        cycles += 1
        next_t += period
        delay = next_t - time.monotonic()
        if delay > 0:
            time.sleep(delay)
    cpu = time.process_time() - cpu0
    wall = time.monotonic() - wall0
    peer_pct = 100 * (node_cost.cpu_s(peer) - peer0) / wall if peer else None
    sampler.close()
    own = cpu - timed.cpu_s - timed.calls * wrapper_overhead_s()
    return {
        "cycles": cycles,
        "wall_s": wall,
        "samples_per_cycle": samples / cycles,
        "nvml_calls_per_cycle": timed.calls / cycles,
        "cpu_per_cycle_ms": 1000 * cpu / cycles,
        "cpu_pct": 100 * cpu / wall,
        "fake_per_cycle_ms": 1000 * timed.cpu_s / cycles,
        "own_per_cycle_ms": 1000 * own / cycles,
        "own_pct": 100 * own / wall,
        "peer_pct": peer_pct,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--hz", type=float, default=10.0)
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--profile", default="h100-sxm")
    ap.add_argument("--inline", action="store_true", help="gpu_timeout_s=0: no worker threads")
    args = ap.parse_args()
    with node_exporter() as peer:
        r = run(args.seconds, args.hz, args.gpus, args.profile, args.inline, peer)
    mode = "inline (no threads)" if args.inline else "one pass per cycle on a pooled worker thread"
    print(
        f"GPU sampler and the accelerator stage it triggers, fake:{args.profile}, "
        f"{args.gpus} GPUs at {args.hz:g} Hz, {mode}"
    )
    print(
        f"  {r['cycles']:.0f} cycles in {r['wall_s']:.1f} s, "
        f"{r['samples_per_cycle']:.0f} samples and {r['nvml_calls_per_cycle']:.0f} NVML calls "
        f"per cycle"
    )
    print(
        f"  all CPU (sampler + fake NVML): {r['cpu_per_cycle_ms']:.3f} ms per cycle, "
        f"{r['cpu_pct']:.2f} % of one core"
    )
    print(
        f"  fake NVML calls alone:         {r['fake_per_cycle_ms']:.3f} ms per cycle "
        "(plus the timing wrapper's own cost, also subtracted below)"
    )
    print(
        f"  sampler + accelerator, no NVML: {r['own_per_cycle_ms']:.3f} ms per cycle, "
        f"{r['own_pct']:.2f} % of one core (target <= 1 %)"
    )
    own, peer = r["own_pct"], r["peer_pct"]
    assert own is not None
    if peer is None:
        print("  node_exporter: not installed (apt-get install prometheus-node-exporter)")
    else:
        ratio = own / peer if peer > 0 else float("inf")
        print(
            f"  node_exporter, same window:    {peer:.2f} % of one core (scraped at "
            f"1 Hz); sampler + accelerator, no NVML / node_exporter: {ratio:.2f}x"
        )


if __name__ == "__main__":
    main()
