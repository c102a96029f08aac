"""The agent's parse + normalize of ``benchmarks/parse_bench.py``'s bodies equals the reference.

The benchmark's two vLLM-like bodies (about 1 MB with 25 ``model_name`` label sets, and a
LoRA-heavy 3.4 MB one with 86) are what the fast parser, the skipping of unread families and
the normalizer's shortcuts (work done once per shape or per label set, series filed at C
speed) are measured on. Here each pair of consecutive scrapes of them (the second with every
histogram count grown, so windows and re-exported histograms have a delta) is normalized
three ways, and all must give the same scrapes:

* the reference: ``prometheus_client``'s parse, every family kept, a fresh normalizer;
* the agent's fast path with the vLLM mapping's families only (``parse_exposition``);
* the sampler's path, :class:`~agent.samplers.engines.exposition.Reparse` (results of one
  shape, so the normalizer's per-shape cache is used).

The three share the normalizer's code, so a digest of the reference's scrapes (samples,
models, emitted sets, counts; sets and samples sorted) is also held against
``tests/fixtures/golden/bench-bodies-normalized.sha256``, written by the normalizer before
these shortcuts (main at 07bd06a) and regenerated with ``KVPRESSURE_UPDATE_GOLDEN=1``
(review why it changed).
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import sys
import types
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpressure.agent.samplers.engines import ENGINE_TYPES
from kvpressure.agent.samplers.engines.exposition import Reparse, parse_exposition
from kvpressure.agent.samplers.engines.normalize import Normalizer
from tests.test_engines_gauges import scrape_view

ROOT = Path(__file__).resolve().parents[1]
TEXT = "text/plain; version=0.0.4"
GOLDEN = ROOT / "tests" / "fixtures" / "golden" / "bench-bodies-normalized.sha256"
UPDATE = os.environ.get("KVPRESSURE_UPDATE_GOLDEN") == "1"


@pytest.fixture(scope="module")
def bench() -> Iterator[types.ModuleType]:
    spec = importlib.util.spec_from_file_location(
        "parse_bench_under_test", ROOT / "benchmarks" / "parse_bench.py"
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    yield mod
    del sys.modules[spec.name]


def _digest(view: tuple[object, ...]) -> str:
    """sha256 of a scrape view with its sets and samples in a stable order (hash seeds vary)."""
    samples, models, emitted, emitted_labels, *rest = view
    stable = (
        sorted(map(repr, samples)),
        models,
        sorted(map(repr, emitted)),
        sorted((repr(k), sorted(map(repr, v))) for k, v in emitted_labels.items()),
        rest,
    )
    return hashlib.sha256(repr(stable).encode()).hexdigest()


def _golden() -> dict[str, str]:
    if not GOLDEN.exists():
        return {}
    return dict(ln.split(" ", 1) for ln in GOLDEN.read_text().splitlines() if ln)


def _write_golden(key: str, digest: str) -> None:
    got = _golden()
    got[key] = digest
    GOLDEN.write_text("".join(f"{k} {v}\n" for k, v in sorted(got.items())))


@pytest.mark.parametrize(("mb", "min_models"), [(1.0, 20), (3.4, 80)])
def test_fast_normalize_of_the_benchmark_bodies_equals_the_reference(
    bench: types.ModuleType, mb: float, min_models: int, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR)  # the synthetic bodies repeat HELP lines on purpose
    body, models = bench.build(int(mb * 1_000_000))
    assert models >= min_models
    scrapes = [body, bench.bump(body), bench.bump(bench.bump(body))]
    mapping = ENGINE_TYPES["vllm"]
    wanted = mapping.reads()
    reparse = Reparse()
    parsed = []
    for text in scrapes:  # each parsed once, each result normalized by every normalizer
        shaped = reparse.parse(200, TEXT, text, wanted)
        assert shaped.shape is not None or not parsed
        parsed.append(
            (
                parse_exposition(text, TEXT, fast_path=False),
                parse_exposition(text, TEXT, wanted),
                shaped,
            )
        )
    for cap in (models + 1, 32):  # every model kept, and the default cap dropping some
        ref, fast, cached = (Normalizer(mapping, "e", "h:1", max_models=cap) for _ in range(3))
        for k, (library, quick, shaped) in enumerate(parsed):
            want = scrape_view(ref.normalize(library, now=k * 5.0))
            assert len(want[0]) > 1000
            key = f"{mb}MB-cap{'all' if cap > models else cap}-scrape{k}"
            if UPDATE:
                _write_golden(key, _digest(want))
            assert _golden().get(key) == _digest(want), (key, "differs from the golden digest")
            assert scrape_view(fast.normalize(quick, now=k * 5.0)) == want, (mb, cap, k, "fast")
            assert scrape_view(cached.normalize(shaped, now=k * 5.0)) == want, (mb, cap, k, "shape")
        assert fast.restarts == ref.restarts == cached.restarts
