"""Reduced vLLM memory scenario of the attribution benchmark
(``benchmarks/attribution/vllm_memory.py``): the same run and assertions as the full one,
30 memory and 30 calm requests (about 100 s on 2 cores).

A real vLLM CPU server sends its ``llm_request`` spans over OTLP/HTTP to a real agent, which
also scrapes its ``/metrics``; no proxy. After a calm warm-up, 30 calm requests must not be
slow (at most 5 %, none attributed to memory) and at least 90 % of the slow requests of a
KV-cache-starved load (30 x 512-token prompts asking for 1,200 tokens, 48 KV blocks) must be
attributed to memory; the records must come from the spans (queue, prefill and decode times)
and the load must really fill the KV cache and preempt. Skips like the other vLLM tests when
the vLLM virtualenv or the model is missing (fails under ``KVPRESSURE_E2E_REQUIRED=1``).

The benchmark's ``decode`` scenario (decode-phase preemption) is not run here: on 2 cores
it does not yet preempt reliably (vLLM preemptions +16 in one run, +1 in the next), so it
is a benchmark, not a gate (``benchmarks/attribution/README.md``).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from vllm_support import REPORT, find_assets, load_bench, unavailable

pytestmark = pytest.mark.e2e

REQUESTS = 30
"""As many as the full benchmark: before psi_cpu_some discounted the engine's own CPU use, in
about half the runs two requests of the first wave went to compute (their scope held one
preemption and KV at 96 %, while vLLM's worker kept CPU PSI saturated on 2 cores), a fixed
count that failed the 90 % target with 12 requests (9 of 11) and with 20 (17 of 19); with 30
it was 27 of 29 at worst seen."""
CALM_REQUESTS = 30
"""Calm requests are quick (about 2 s for 30); with fewer than 20 the calm target (at most
5 % slow) would allow no slow request at all."""
CI_ACCURACY = 0.80
"""Share of the memory scenario's slow requests that must be named memory (see the test)."""


def test_reduced_vllm_memory_attribution(tmp_path: Path) -> None:
    assets, why = find_assets()
    if assets is None:
        unavailable(why)
    bench = load_bench()
    out = tmp_path / "vllm-memory.json"
    t0 = time.monotonic()
    rc = bench.main(
        [
            "--requests",
            str(REQUESTS),
            "--calm-requests",
            str(CALM_REQUESTS),
            "--scenarios",
            "calm,memory",
            "--json",
            str(out),
            "--workdir",
            str(tmp_path),
            "--check",
        ]
    )
    doc = json.loads(out.read_text())
    results = {r["name"]: r for r in doc["results"]}
    calm, memory = results["calm"], results["memory"]
    REPORT["attribution_memory"] = {
        "wall_s": round(time.monotonic() - t0, 1),
        "calm": {"requests": calm["requests"], "slow": calm["slow"], "by_cause": calm["by_cause"]},
        "memory": {
            "requests": memory["requests"],
            "slow": memory["slow"],
            "by_cause": memory["by_cause"],
            "preemptions": memory["preemptions"],
            "queue_p95_s": memory["agent_phases"].get("queue", {}).get("p95"),
        },
        "problems": doc["problems"],
    }

    assert calm["requests"] == CALM_REQUESTS and memory["requests"] == REQUESTS
    assert calm["slow"] <= bench.TARGET_CALM_SLOW * calm["requests"] + 1e-9, calm
    assert calm["by_cause"].get("memory", 0) == 0, calm
    assert memory["slow"] > 0, f"the KV-starved load made no request slow: {memory}"
    # The benchmark's target is bench.TARGET_ACCURACY (90 %). On a 2-core CI machine the
    # vLLM CPU engine saturates both cores and host-wide CPU PSI reads ~0.99; while
    # psi_cpu_some read that whole it tied or beat the memory evidence of requests whose
    # scope held one or two preemptions: over seven runs 84-100 % (21/25, 21/24, 26/26,
    # 27/27, 28/28, 29/29, 26/26). It now counts stalls only up to the share of busy CPU
    # that is not vLLM's own (issue 13): compute scored at most 0.05 in every slow request
    # of the next eight runs (26/26, 29/29, 26/26, 30/30 memory with the final rule). CI
    # still gates at CI_ACCURACY until more CI runs confirm; the 90 % target is measured by
    # benchmarks/attribution/vllm_memory.py.
    assert memory["accuracy"] >= CI_ACCURACY, memory
    assert doc["problems"] == [], doc["problems"]
    assert rc == 0
