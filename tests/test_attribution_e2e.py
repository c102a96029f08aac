"""Reduced attribution benchmark (``benchmarks/attribution/run.py``) on the real llama.cpp
server: the same scenarios and assertions as the full run, fewer requests (about 3 minutes
on 2 cores): 12 per fault scenario, 30 calm ones (quick; with fewer, the calm target of at
most 5 % slow would allow no slow request at all).

Root only (cgroups, drop_caches, a zram swap device, network namespaces): it changes host
state for its duration and undoes it in ``finally``. A fault this machine cannot inject
(reported with the reason) fails the test when ``KVPRESSURE_E2E_REQUIRED=1`` (the README's
test command sets it) and skips otherwise, like every other e2e prerequisite.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "attribution" / "run.py"
REQUIRED = os.environ.get("KVPRESSURE_E2E_REQUIRED") == "1"


def _unavailable(msg: str) -> None:
    if REQUIRED:
        pytest.fail(f"{msg} (KVPRESSURE_E2E_REQUIRED=1)", pytrace=False)
    pytest.skip(msg)


def _load():
    spec = importlib.util.spec_from_file_location("attribution_bench", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["attribution_bench"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_reduced_attribution_benchmark(tmp_path):
    if os.geteuid() != 0:
        _unavailable("the attribution benchmark injects faults as root (cgroups, netns)")
    bench = _load()
    assets, why = bench.es.find_llama_assets()
    if assets is None:
        _unavailable(why)
    out = tmp_path / "attribution.json"
    rc = bench.main(
        ["--requests", "12", "--calm-requests", "30", "--warmup", "32", "--gap-s", "4",
         "--json", str(out), "--workdir", str(tmp_path)]
    )  # fmt: skip
    doc = json.loads(out.read_text())
    results = {r["name"]: r for r in doc["results"]}
    missing = {k: r["unavailable"] for k, r in results.items() if r["unavailable"]}
    if missing:
        _unavailable(f"faults that cannot be injected here: {missing}")
    calm = results["calm"]
    # false alarms: flagged requests the client's own clock did not see decode slowly
    # (run.CLIENT_SLOW_FACTOR: the engine's out-of-step decode mode is really slower)
    assert calm["false_slow"] <= bench.TARGET_CALM_SLOW * calm["requests"] + 1e-9, calm
    assert calm["by_cause"].get("memory", 0) == 0, calm
    for name in bench.SCENARIOS[1:]:  # the fault scenarios this suite runs
        cause, r = bench.EXPECTED[name], results[name]
        assert r["slow"] > 0, f"{name}: the fault made no request slow: {r}"
        assert r["accuracy"] >= bench.TARGET_ACCURACY, f"{name} -> {cause}: {r}"
    assert rc == 0
