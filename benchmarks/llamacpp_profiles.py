"""What the portable llama-server build costs against a native one, in tokens/s.

Usage:
    KVPRESSURE_LLAMA_PROFILE=native scripts/ensure-llamacpp     # once: the native build
    .venv/bin/python benchmarks/llamacpp_profiles.py [--rounds 5] [--tokens 64]
                                                     [--prompt-words 400] [BUILD ...]

BUILD is a llama-server path; by default every build under ~/.cache/kvpressure/llama.cpp
(`<version>-<profile>/llama-server`, failed ones excluded). The builds take turns, round by
round (each round starts each server once and runs ``--runs`` completions on it with
scripts/llamacpp_check.py), so a noisy neighbour hits them alike. Printed per build: the
median generation and prompt (prefill) rates from llama-server's own ``timings``, and each
rate as a ratio of the first build's. Same model, same threads, loopback only.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
from llamacpp_check import CheckFailed, check  # noqa: E402

CACHE = Path(os.environ.get("KVPRESSURE_CACHE", Path.home() / ".cache" / "kvpressure"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("builds", nargs="*", type=Path)
    p.add_argument("--model", type=Path, default=CACHE / "models" / "gemma-3-270m-q4_k_m.gguf")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--runs", type=int, default=3, help="completions per server start")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--prompt-words", type=int, default=400)
    p.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    p.add_argument("--json", type=Path, help="write the figures here")
    args = p.parse_args(argv)
    builds = args.builds or sorted(
        b for b in (CACHE / "llama.cpp").glob("*/llama-server") if ".failed-" not in str(b)
    )
    if not builds:
        print("no builds found; run scripts/ensure-llamacpp first", file=sys.stderr)
        return 2
    gen: dict[Path, list[float]] = {b: [] for b in builds}
    prompt: dict[Path, list[float]] = {b: [] for b in builds}
    for r in range(args.rounds):
        for b in builds if r % 2 == 0 else list(reversed(builds)):
            try:
                res = check(b, args.model, args.tokens, args.runs, args.threads, args.prompt_words)
            except CheckFailed as e:
                print(f"{b}: {e}", file=sys.stderr)
                return 1
            gen[b] += res["gen_tok_s_all"]  # type: ignore[operator]
            prompt[b] += res["prompt_tok_s_all"]  # type: ignore[operator]
            print(f"round {r + 1}/{args.rounds} {b.parent.name}: {res['gen_tok_s']:.1f} tok/s")
    base = builds[0]
    rows = []
    print(
        f"\n{args.rounds} rounds x {args.runs} completions, {args.tokens} tokens after "
        f"~{args.prompt_words}-word prompts, {args.threads} threads, model {args.model.name}"
    )
    print(f"{'build':<34} {'gen tok/s':>10} {'ratio':>6} {'prompt tok/s':>13} {'ratio':>6}")
    for b in builds:
        g, pr = statistics.median(gen[b]), statistics.median(prompt[b])
        g0, p0 = statistics.median(gen[base]), statistics.median(prompt[base])
        rows.append({"build": str(b), "gen_tok_s": g, "prompt_tok_s": pr})
        print(f"{b.parent.name:<34} {g:>10.1f} {g / g0:>6.2f} {pr:>13.1f} {pr / p0:>6.2f}")
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args), "rows": rows}, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
