"""Parse + normalize cost of one ~1 MB vLLM-like scrape.

Builds an exposition from the real vLLM 0.32.0 capture
(``tests/fixtures/engines/vllm/0.32.0-cpu-kv-metrics-load.txt``): every ``vllm:`` family
(histograms with all their buckets, ``_created`` gauges included) repeated for as many
``model_name`` label sets (LoRA adapters served next to the base model) as needed to reach
the target size, then times ``parse_exposition`` and ``Normalizer.normalize`` on it, the
work an engine sampler does every cycle. Two consecutive scrapes are normalized per round
so the windowed-quantile path (histogram deltas) runs too.

Usage::

    .venv/bin/python benchmarks/parse_bench.py [--mb 1.0,3.4] [--rounds 20] [--profile]

For each size (1 MB, and a LoRA-heavy 3.4 MB with about 80 adapters) prints the median
process CPU time of parse, normalize and both, per scrape and per MB, twice: with
``prometheus_client`` alone and every family kept (the agent before the fast path,
``--library-rounds`` rounds), and with the fast path and the families the vLLM mapping never
reads skipped (the agent now, ``--rounds`` rounds); the target is 50 ms per MB.

On a shared, noisy machine the same code moves by a third between runs, so ms/MB of two
runs compare badly. Each scrape of the agent-now rounds is therefore timed right after
``prometheus_client``'s own parser (``text_string_to_metric_families``, no agent code) read
the same body: a yardstick that no change to the agent moves, and that the machine's mood of
the moment slows alike. The ``ratio`` column is the median over scrapes of the agent's time
divided by the yardstick's (parse, normalize and total); compare ratios across runs and
checkouts. ``--profile`` adds a cProfile of two scrapes.

The garbage collector runs as inside ``kvpressure run`` (start-up objects frozen, young
passes every 10,000 allocations: :data:`agent.cli.GC_THRESHOLDS`); ``--python-gc`` keeps
Python's default thresholds (700, 10, 10), under which a scrape's ~100,000 short-lived
objects trigger a young pass every 700 allocations.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import logging
import pstats
import re
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from kvpressure.agent.cli import GC_THRESHOLDS  # noqa: E402
from kvpressure.agent.samplers.engines import ENGINE_TYPES  # noqa: E402
from kvpressure.agent.samplers.engines.exposition import parse_exposition  # noqa: E402
from kvpressure.agent.samplers.engines.normalize import Normalizer  # noqa: E402

CAPTURE = ROOT / "tests" / "fixtures" / "engines" / "vllm" / "0.32.0-cpu-kv-metrics-load.txt"
TARGET_MS_PER_MB = 50.0


def build(target_bytes: int) -> tuple[str, int]:
    """A vLLM-like exposition of about ``target_bytes``; returns (body, model label sets)."""
    families: list[tuple[list[str], list[str]]] = []  # (header lines, sample lines)
    for line in CAPTURE.read_text().splitlines():
        if line.startswith("# HELP vllm:"):
            families.append(([line], []))
        elif line.startswith("# TYPE vllm:") and families:
            families[-1][0].append(line)
        elif line.startswith("vllm:") and families:
            families[-1][1].append(line)
    per_model = sum(len(s) + 1 for _, samples in families for s in samples)
    models = max(1, target_bytes // per_model)
    out: list[str] = []
    for header, samples in families:
        out.extend(header)
        for i in range(models):
            name = "tiny" if i == 0 else f"tiny-lora-{i:03d}"
            out.extend(ln.replace('model_name="tiny"', f'model_name="{name}"') for ln in samples)
    return "\n".join(out) + "\n", models


def bump(body: str) -> str:
    """The same scrape a moment later: every histogram count and bucket +1 in +Inf only."""
    return re.sub(
        r'^(vllm:\S+_(?:count|bucket\{[^}]*le="\+Inf"[^}]*\}))(\{[^}]*\})? (\S+)$',
        lambda m: f"{m.group(1)}{m.group(2) or ''} {float(m.group(3)) + 1}",
        body,
        flags=re.MULTILINE,
    )


def run(
    body: str, later: str, models: int, rounds: int, fast: bool, yardstick: bool = False
) -> dict[str, list[float]]:
    """Time parse and normalize of ``rounds`` pairs of scrapes; milliseconds (CPU time).

    With ``yardstick``, each scrape is preceded by ``prometheus_client``'s own parse of the
    same text, timed too (``ref``), and ``*_ratio`` lists hold each scrape's time divided by
    the yardstick's just before it.
    """
    mapping = ENGINE_TYPES["vllm"]
    wanted = mapping.reads() if fast else None
    out: dict[str, list[float]] = {"parse": [], "normalize": [], "total": [], "ref": []}
    for r in range(rounds):
        n = Normalizer(mapping, "bench", "h:1", max_models=models + 1)
        for i, text in enumerate((body, later)):
            if yardstick:
                c0 = time.process_time()
                for _ in text_string_to_metric_families(text):
                    pass
                out["ref"].append((time.process_time() - c0) * 1e3)
            c0 = time.process_time()
            result = parse_exposition(text, "text/plain; version=0.0.4", wanted, fast_path=fast)
            c1 = time.process_time()
            n.normalize(result, now=float(r * 10 + i * 5))
            c2 = time.process_time()
            assert result.error_count == 0
            out["parse"].append((c1 - c0) * 1e3)
            out["normalize"].append((c2 - c1) * 1e3)
            out["total"].append((c2 - c0) * 1e3)
    if yardstick:
        for k in ("parse", "normalize", "total"):
            out[k + "_ratio"] = [v / ref for v, ref in zip(out[k], out["ref"], strict=True)]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", default="1.0,3.4", help="exposition sizes in MB, comma-separated")
    ap.add_argument("--rounds", type=int, default=20, help="rounds of the agent now")
    ap.add_argument(
        "--library-rounds", type=int, default=2, help="rounds of the agent before the fast path"
    )
    ap.add_argument("--profile", action="store_true", help="cProfile two scrapes")
    ap.add_argument(
        "--python-gc", action="store_true", help="Python's GC thresholds, not the agent's"
    )
    args = ap.parse_args()
    logging.disable(logging.WARNING)  # the synthetic body repeats series on purpose
    if not args.python_gc:
        gc.collect()
        gc.freeze()
        gc.set_threshold(*GC_THRESHOLDS)
    print(f"garbage collector thresholds: {gc.get_threshold()}")

    for mb in (float(x) for x in args.mb.split(",")):
        body, models = build(int(mb * 1_000_000))
        later = bump(body)
        size = len(body.encode()) / 1e6
        print(f"exposition: {size:.2f} MB, {body.count(chr(10))} lines, {models} model label sets")
        for label, fast, rounds in (
            ("prometheus_client only", False, args.library_rounds),
            ("fast path + skipping", True, args.rounds),
        ):
            if rounds <= 0:
                continue
            got = run(body, later, models, rounds, fast, yardstick=fast)
            med = {k: statistics.median(v) for k, v in got.items() if v}
            print(
                f"  {label:<23} parse {med['parse']:7.1f} ms  normalize {med['normalize']:6.1f} ms"
                f"  total {med['total']:7.1f} ms = {med['total'] / size:6.1f} ms/MB CPU"
                f"  (target <= {TARGET_MS_PER_MB:.0f} ms/MB; {2 * rounds} scrapes, medians)"
            )
            if fast:
                print(
                    f"  {'':<23} ratio to prometheus_client's parse of the same body just before"
                    f" ({med['ref']:.1f} ms = {med['ref'] / size:.1f} ms/MB):"
                    f" parse {med['parse_ratio']:.4f}  normalize {med['normalize_ratio']:.4f}"
                    f"  total {med['total_ratio']:.4f}"
                )

    if args.profile:
        body, models = build(1_000_000)
        prof = cProfile.Profile()
        n = Normalizer(ENGINE_TYPES["vllm"], "bench", "h:1", max_models=models + 1)
        wanted = ENGINE_TYPES["vllm"].reads()
        prof.enable()
        n.normalize(parse_exposition(body, None, wanted), now=0.0)
        n.normalize(parse_exposition(bump(body), None, wanted), now=5.0)
        prof.disable()
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(18)
        print(buf.getvalue())


if __name__ == "__main__":
    main()
