"""Capacity benchmark on the real llama.cpp server (Gemma-3-270M, CPU).

Run: ``.venv/bin/python benchmarks/capacity/bench_capacity.py [--json OUT]``

Needs what the e2e tests need (``scripts/ensure-llamacpp .venv``): the llama-server binary
and the Gemma-3-270M GGUF; it starts its servers with ``tests/e2e/e2e_support.py``'s
``LlamaServer`` (another argv for part b), on loopback only, and stops them.

(a) Saturation. Server ``-c 2048 -np 4`` (the e2e shape: 4 slots of 512 tokens). For two
    context-length mixes, the agent's own samplers run in-process (engine sampler +
    capacity sampler, 0.25 s) while 2 requests run, twice; the prediction is the last
    ``kvpressure_kv_saturation_concurrency`` the agent published while they ran (capacity /
    the window's peak tokens per running request, capped at the slots). The measurement ramps the
    offered concurrency c = 1..7 (c requests sent at once) and records whether any request
    waited: the server's own ``llamacpp:requests_deferred`` > 0 in a 50 ms poll (a deferred
    request waits for a whole request to finish, far longer than the poll). The extra time
    per request beyond its prompt + decode time (server ``timings``) is reported too; it
    includes HTTP and batching overhead, so it is not the criterion. Measured saturation =
    the largest c at which no request waited.

(a') Pool-bound saturation. Server ``-c 2048 -np 8 --kv-unified``, the long mix: eight slots
    share one pool of 2,048 cells, so tokens bind before slots. llama.cpp admits by slot and
    does not queue on KV; when the pool runs out mid-decode it fails the batch's requests
    (HTTP 500). Measured = the largest c at which every request completed; predicted = pool
    / the capacity sampler's per-request footprint (see ``unified``).

(b) Reuse. Server ``-c 4096 -np 1 --swa-full`` (one slot; ``--swa-full`` keeps every layer's
    cells for the whole context, so the cached prefix is plain KV reuse; without it Gemma-3's
    sliding-window layers keep only window + ubatch cells and this build restores the prefix
    from SWA checkpoints instead: one run, 2,049-token prompt, warm TTFT 0.335 s against
    0.08 s with ``--swa-full``). For each prompt length: TTFT of the prompt cold, then of the
    same prompt + a short suffix with ``cache_prompt: true``; TTFT is the time to the first
    streamed token. The agent's ``kvpressure_prefix_cache_saved_seconds_total`` is read
    before and after, as a check of item 4.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "e2e"))
sys.path.insert(0, str(ROOT))

from e2e_support import LlamaAssets, LlamaServer, find_llama_assets, free_port  # noqa: E402

from kvpressure.agent.capacity.live import CapacitySampler  # noqa: E402
from kvpressure.agent.samplers.engines import make_engine_sampler  # noqa: E402
from kvpressure.agent.samples import Batch  # noqa: E402
from kvpressure.agent.state import AgentState, SamplerReport  # noqa: E402
from kvpressure.agent.timeline import Timeline  # noqa: E402

WORDS = [
    *("river", "stone", "lantern", "orchard", "velvet", "harbor", "meadow", "copper"),
    *("signal", "window", "thunder", "garden", "pepper", "silver", "canyon", "mirror"),
    *("basket", "candle", "feather", "island"),
]


class Server(LlamaServer):
    """LlamaServer with a chosen context, slot count and extra flags (e2e files untouched)."""

    def __init__(
        self, assets: LlamaAssets, port: int, workdir: Path, ctx: int, slots: int, extra: list[str]
    ) -> None:
        super().__init__(assets, port, workdir)
        self.ctx, self.slots, self.extra = ctx, slots, extra

    def argv(self) -> list[str]:
        argv = super().argv()
        argv[argv.index("-c") + 1] = str(self.ctx)
        argv[argv.index("-np") + 1] = str(self.slots)
        return argv + self.extra


class InProcessAgent:
    """The agent's engine sampler and capacity sampler on one thread, every ``interval_s``."""

    def __init__(self, url: str, interval_s: float = 0.25) -> None:
        self.state = AgentState(Timeline())
        self.engine = make_engine_sampler("llamacpp", url, "llamacpp", interval_s=interval_s)
        self.capacity = CapacitySampler(self.state, interval_s=interval_s, window_s=30.0)
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self.capacity_series: list[tuple[float, dict[str, float]]] = []

    def _run(self) -> None:
        while not self._stop.is_set():
            for smp in (self.engine, self.capacity):
                ts = time.time()
                b = Batch()
                try:
                    smp.collect(b)
                    self.state.publish(SamplerReport(smp.name, ts, 0.0, True, "", b))
                except Exception as exc:  # noqa: BLE001 - keep sampling; report below
                    print(f"sampler {smp.name} failed: {exc}", file=sys.stderr)
                if smp is self.capacity:
                    self.capacity_series.append(
                        (ts, {s.name: s.value for s in b.samples if "_bucket" not in s.name})
                    )
            self._stop.wait(self.interval_s)

    def latest(self, name: str) -> float | None:
        vals = list(self.state.latest(name).values())
        return sum(vals) if vals else None

    def __enter__(self) -> InProcessAgent:
        self._t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join(5)
        self.engine.close()


def probe(agent: InProcessAgent, t0: float) -> dict[str, float | None]:
    """The agent's view at the end of a probe that started at ``t0``.

    ``predicted``: the last ``kvpressure_kv_saturation_concurrency`` published while requests
    ran; ``footprint``: the capacity sampler's per-request footprint (window peak of used /
    running); ``mean_tokens``: median of ``kvpressure_kv_request_tokens`` over the probe.
    """
    from kvpressure.agent.capacity.live import engine_views

    sat = [
        v["kvpressure_kv_saturation_concurrency"]
        for ts, v in agent.capacity_series
        if ts >= t0 and "kvpressure_kv_saturation_concurrency" in v
    ]
    mean = [
        v["kvpressure_kv_request_tokens"]
        for ts, v in agent.capacity_series
        if ts >= t0 and "kvpressure_kv_request_tokens" in v
    ]
    views = engine_views(agent.state.latest)
    view = views.get("llamacpp")
    foot = agent.capacity.request_footprint(view, time.time()) if view else None
    return {
        "predicted": sat[-1] if sat else None,
        "footprint": foot,
        "mean_tokens": statistics.median(mean) if mean else None,
    }


def make_prompt(server: LlamaServer, tokens: int, tag: str) -> str:
    """A prompt of about ``tokens`` tokens (checked with /tokenize), unique per ``tag``."""
    words = [f"[{tag}]"] + [WORDS[(i * 7 + len(tag)) % len(WORDS)] for i in range(tokens)]
    text = " ".join(words)
    n = server.n_tokens(text)
    while n > tokens:
        words = words[: max(2, len(words) - (n - tokens))]
        text = " ".join(words)
        n = server.n_tokens(text)
    return text


def complete(url: str, prompt: str, n_predict: int, cache: bool = False) -> dict[str, Any]:
    t0 = time.monotonic()
    r = httpx.post(
        f"{url}/completion",
        json={
            "prompt": prompt,
            "n_predict": n_predict,
            "ignore_eos": True,
            "cache_prompt": cache,
            "temperature": 0.0,
        },
        timeout=600,
    )
    r.raise_for_status()
    out = dict(r.json())
    out["_e2e_s"] = time.monotonic() - t0
    return out


def burst(url: str, prompts: list[str], n_predict: int) -> dict[str, Any]:
    """Send every prompt at once; poll deferred requests; return what waited."""
    results: list[dict[str, Any]] = [{} for _ in prompts]
    errors: list[str] = []

    def one(i: int) -> None:
        try:
            results[i] = complete(url, prompts[i], n_predict)
        except httpx.HTTPError as exc:
            errors.append(f"{type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    max_deferred = 0.0
    with httpx.Client(timeout=5) as c:
        while any(t.is_alive() for t in threads):
            try:
                for line in c.get(f"{url}/metrics").text.splitlines():
                    if line.startswith("llamacpp:requests_deferred"):
                        max_deferred = max(max_deferred, float(line.split()[-1]))
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
    for t in threads:
        t.join()
    queue = [
        r["_e2e_s"] - (r["timings"]["prompt_ms"] + r["timings"]["predicted_ms"]) / 1000
        for r in results
        if r
    ]
    return {
        "max_deferred": max_deferred,
        "max_queue_s": max(queue) if queue else None,
        "errors": errors,
        "waited": max_deferred > 0,
        "tokens_per_request": statistics.mean(
            r["timings"]["prompt_n"] + r["timings"]["predicted_n"] for r in results if r
        )
        if any(results)
        else None,
    }


def saturation(assets: LlamaAssets, work: Path) -> list[dict[str, Any]]:
    mixes = [("short", 100, 24), ("long", 400, 48)]
    rows = []
    srv = Server(assets, free_port(), work, ctx=2048, slots=4, extra=[])
    srv.start()
    try:
        with InProcessAgent(srv.url) as agent:
            time.sleep(1.0)
            for name, p_tokens, n_predict in mixes:
                # prediction: the agent's live gauge while 2 requests run
                t0 = time.time()
                for rnd in range(2):
                    prompts = [
                        make_prompt(srv, p_tokens, f"{name}-probe-{rnd}-{i}") for i in range(2)
                    ]
                    burst(srv.url, prompts, n_predict)
                seen = probe(agent, t0)
                cap = agent.latest("kvpressure_engine_kv_cache_capacity_tokens")
                predicted = seen["predicted"]
                foot = seen["footprint"]
                pooled = cap / foot if (cap and foot) else None
                # measurement: ramp the offered concurrency
                ramp = []
                measured = 0
                for c in range(1, 8):
                    prompts = [make_prompt(srv, p_tokens, f"{name}-c{c}-{i}") for i in range(c)]
                    res = burst(srv.url, prompts, n_predict)
                    ramp.append({"c": c, **res})
                    print(
                        f"  {name} c={c}: waited={res['waited']} "
                        f"deferred={res['max_deferred']:.0f} "
                        f"max_queue={res['max_queue_s']:.2f}s errors={len(res['errors'])}",
                        file=sys.stderr,
                    )
                    if res["waited"] or res["errors"]:
                        break
                    measured = c
                rows.append(
                    {
                        "mix": name,
                        "prompt_tokens": p_tokens,
                        "output_tokens": n_predict,
                        "capacity_tokens": cap,
                        "mean_tokens_per_request": seen["mean_tokens"],
                        "footprint_tokens": foot,
                        "pooled_estimate": pooled,
                        "predicted": predicted,
                        "measured": measured,
                        "error_pct": (predicted - measured) / measured * 100
                        if predicted and measured
                        else None,
                        "floor_error_pct": (math.floor(predicted) - measured) / measured * 100
                        if predicted and measured
                        else None,
                        "pooled_error_pct": (pooled - measured) / measured * 100
                        if pooled and measured
                        else None,
                        "ramp": ramp,
                    }
                )
    finally:
        srv.stop()
    return rows


def unified(assets: LlamaAssets, work: Path) -> dict[str, Any]:
    """Pool-bound saturation: ``-c 2048 -np 8 --kv-unified``, the long mix.

    Eight slots share one pool of 2,048 cells, so tokens, not slots, bind. llama.cpp admits
    by slot and does not queue on KV: when the pool runs out mid-decode the server fails
    the requests in the batch. Saturation is then the largest concurrency at which every
    request completes. Prediction: pool / the agent's observed tokens per running request
    (``kvpressure_kv_request_tokens``) during a 2-request probe. The pool is ``n_ctx`` from
    ``/props`` (with ``--kv-unified`` every slot reports the whole pool as its ``n_ctx``, so
    the engine sampler's sum over slots overcounts it 8x; see the report).
    """
    p_tokens, n_predict = 400, 48
    srv = Server(assets, free_port(), work, ctx=2048, slots=8, extra=["--kv-unified"])
    srv.start()
    try:
        pool = srv.get_json("/props")["default_generation_settings"]["n_ctx"]
        with InProcessAgent(srv.url) as agent:
            time.sleep(1.0)
            t0 = time.time()
            for rnd in range(2):
                prompts = [make_prompt(srv, p_tokens, f"u-probe-{rnd}-{i}") for i in range(2)]
                burst(srv.url, prompts, n_predict)
            seen = probe(agent, t0)
            cap_reported = agent.latest("kvpressure_engine_kv_cache_capacity_tokens")
        tokens = seen["footprint"]
        predicted = pool / tokens if tokens else None
        ramp = []
        measured = 0
        for c in range(2, 9):
            prompts = [make_prompt(srv, p_tokens, f"u-c{c}-{i}") for i in range(c)]
            res = burst(srv.url, prompts, n_predict)
            ramp.append({"c": c, **res})
            print(
                f"  unified c={c}: deferred={res['max_deferred']:.0f} errors={len(res['errors'])} "
                f"{res['errors'][:1]}",
                file=sys.stderr,
            )
            if res["errors"] or res["waited"]:
                break
            measured = c
            if not srv.running():
                break
    finally:
        srv.stop()
    return {
        "pool_tokens": pool,
        "engine_sampler_capacity_tokens": cap_reported,
        "agent_saturation_gauge": seen["predicted"],
        "mean_tokens_per_request": seen["mean_tokens"],
        "footprint_tokens": tokens,
        "predicted": predicted,
        "measured": measured,
        "error_pct": (predicted - measured) / measured * 100 if predicted and measured else None,
        "floor_error_pct": (math.floor(predicted) - measured) / measured * 100
        if predicted and measured
        else None,
        "ramp": ramp,
    }


def ttft_stream(url: str, prompt: str) -> tuple[float, dict[str, Any]]:
    """Time to the first streamed token, and the final chunk's timings."""
    t0 = time.monotonic()
    first: float | None = None
    last: dict[str, Any] = {}
    with httpx.stream(
        "POST",
        f"{url}/completion",
        json={
            "prompt": prompt,
            "n_predict": 2,
            "cache_prompt": True,
            "stream": True,
            "temperature": 0.0,
        },
        timeout=600,
    ) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            data = json.loads(line[6:])
            if first is None and data.get("content") is not None:
                first = time.monotonic() - t0
            last = data
    return (first if first is not None else time.monotonic() - t0), last.get("timings", {})


def reuse(assets: LlamaAssets, work: Path) -> list[dict[str, Any]]:
    rows = []
    srv = Server(assets, free_port(), work, ctx=4096, slots=1, extra=["--swa-full"])
    srv.start()
    try:
        with InProcessAgent(srv.url) as agent:
            time.sleep(1.0)
            warm_up = make_prompt(srv, 64, "warmup")
            ttft_stream(srv.url, warm_up)
            for n in (1024, 2048, 3584):
                prompt = make_prompt(srv, n, f"reuse-{n}")
                time.sleep(0.6)
                saved0 = agent.latest("kvpressure_prefix_cache_saved_seconds_total") or 0.0
                cold, t_cold = ttft_stream(srv.url, prompt)
                warm, t_warm = ttft_stream(srv.url, prompt + " And one more question about it?")
                time.sleep(1.2)  # two capacity cycles see the new counters
                saved1 = agent.latest("kvpressure_prefix_cache_saved_seconds_total") or 0.0
                rows.append(
                    {
                        "prompt_tokens": t_cold.get("prompt_n"),
                        "cold_ttft_s": cold,
                        "warm_ttft_s": warm,
                        "speedup": cold / warm if warm else None,
                        "warm_cached_tokens": t_warm.get("cache_n"),
                        "warm_computed_tokens": t_warm.get("prompt_n"),
                        "agent_saved_s": saved1 - saved0,
                        "measured_saved_s": cold - warm,
                    }
                )
                print(f"  reuse {n}: {rows[-1]}", file=sys.stderr)
    finally:
        srv.stop()
    return rows


def fmt(v: float | None, spec: str = ".2f") -> str:
    return "-" if v is None else format(v, spec)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the full results here")
    ap.add_argument("--only", choices=["saturation", "unified", "reuse"])
    args = ap.parse_args(argv)
    assets, why = find_llama_assets()
    if assets is None:
        print(f"cannot run: {why}", file=sys.stderr)
        return 2
    out: dict[str, Any] = {"model": str(assets.model)}
    with tempfile.TemporaryDirectory(prefix="kvp-capbench-") as d:
        work = Path(d)
        if args.only in (None, "saturation"):
            out["saturation"] = saturation(assets, work)
        if args.only in (None, "unified"):
            out["unified"] = unified(assets, work)
        if args.only in (None, "reuse"):
            out["reuse"] = reuse(assets, work)
    if "saturation" in out or "unified" in out:
        print(
            f"\n{'SERVER':<34} {'MIX':<6} {'MEAN TOK':>8} {'PEAK TOK':>8} {'POOL/PEAK':>9} "
            f"{'PREDICTED':>9} {'MEASURED':>8} {'ERROR':>6} {'FLOOR ERR':>9}"
        )
        rows = [("-c 2048 -np 4 (4 x 512-token slots)", r) for r in out.get("saturation", [])]
        if "unified" in out:
            rows.append(("-c 2048 -np 8 --kv-unified", {"mix": "long", **out["unified"]}))
        for server, r in rows:
            pooled = r.get("pooled_estimate", r.get("predicted"))
            print(
                f"{server:<34} {r['mix']:<6} {fmt(r['mean_tokens_per_request'], '.0f'):>8} "
                f"{fmt(r['footprint_tokens'], '.0f'):>8} {fmt(pooled):>9} "
                f"{fmt(r['predicted']):>9} {r['measured']:>8} {fmt(r['error_pct'], '+.0f'):>5}% "
                f"{fmt(r['floor_error_pct'], '+.0f'):>8}%"
            )
        if "unified" in out:
            u = out["unified"]
            print(
                f"(unified: pool = /props n_ctx {u['pool_tokens']}; the engine sampler reports "
                f"{fmt(u['engine_sampler_capacity_tokens'], '.0f')} (8 slots x 2048), so the "
                f"agent's own gauge read {fmt(u['agent_saturation_gauge'])} (the slot cap); "
                f"requests beyond the pool fail, they do not wait)"
            )
    if "reuse" in out:
        print(
            "\n(b) prefix reuse, llama-server -c 4096 -np 1 --swa-full, "
            "TTFT to the first streamed token"
        )
        print(
            f"{'PROMPT':>7} {'COLD TTFT':>10} {'WARM TTFT':>10} {'SPEEDUP':>8} {'CACHED':>7} "
            f"{'AGENT SAVED':>11} {'COLD-WARM':>10}"
        )
        for r in out["reuse"]:
            print(
                f"{fmt(r['prompt_tokens'], '.0f'):>7} {fmt(r['cold_ttft_s'], '.3f'):>9}s "
                f"{fmt(r['warm_ttft_s'], '.3f'):>9}s {fmt(r['speedup'], '.1f'):>7}x "
                f"{fmt(r['warm_cached_tokens'], '.0f'):>7} {fmt(r['agent_saved_s'], '.3f'):>10}s "
                f"{fmt(r['measured_saved_s'], '.3f'):>9}s"
            )
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
