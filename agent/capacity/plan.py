"""``kvpressure plan``: what-if answers from a KV shape, a memory size and the live workload.

Questions answered (table, or JSON with ``--json``):

1. KV memory per request at the given context lengths (sliding windows applied).
2. How many such requests fit in the KV budget at once.
3. What doubling concurrent users does: KV demand (linear in users), the requests that no
   longer fit and queue, and the expected TTFT tail, read from the observed knee of a
   running agent (``kvpressure_kv_occupancy_latency_seconds``) at the occupancy band the
   new demand lands in.
4. What offload tiers (host DRAM, CXL, SSD) add in capacity and what reloading a token
   from them costs, next to recomputing it (measured prefill rate).

KV budget, in order of preference:

* the engine's own KV capacity in tokens (``--agent``: ``kvpressure_engine_kv_cache_capacity
  _tokens``) x bytes per token: what the engine actually allocated;
* else ``memory x gpus x memory_utilization - weights - overhead`` (vLLM's rule:
  ``gpu_memory_utilization`` 0.90, weights, then activation/runtime overhead; 2 GiB per
  accelerator assumed, vLLM profiles the real figure at start-up).

Weights when not given: the GGUF file size; for an HF config the ``*.safetensors`` next to
it, else an estimate from the config, dense or mixture-of-experts
(:func:`~agent.capacity.kvbytes.estimate_hf_weights_bytes`); hybrid models need ``--weights``,
and without it the budget line says the weights are unknown.

Queueing model for the tail: requests beyond what fits wait in waves; the last of
``queued`` waits ``ceil(queued / fit)`` service times, a service time being ``TTFT p50 +
output_tokens x ITL p50`` of the fullest observed band. Tail TTFT = the band's TTFT p99 +
that wait. It is a planning figure (closed batch, FIFO, equal lengths), not a simulation.

Tier bandwidth defaults (effective, host to accelerator; override with ``--tier``):
``dram`` 50 GB/s (PCIe 5.0 x16, 64 GB/s raw), ``cxl`` 25 GB/s (a CXL 2.0 x8 Type-3
expander, 32 GB/s raw, then PCIe to the accelerator), ``ssd`` 6 GB/s (one PCIe 4.0 x4 NVMe,
sequential read). Reload seconds per token = bytes per token / bandwidth.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvpressure.agent.capacity.knee import BandStats, band_bounds, band_of, stats_from_samples
from kvpressure.agent.capacity.kvbytes import KVShape, fmt_bytes
from kvpressure.agent.catalogue import SampleName

GIB = 1024**3

DEFAULT_MEMORY_UTILIZATION = 0.90
DEFAULT_OVERHEAD_BYTES = 2 * GIB
DEFAULT_OUTPUT_TOKENS = 256

TIER_BANDWIDTH: dict[str, float] = {"dram": 50e9, "cxl": 25e9, "ssd": 6e9}
"""Default effective reload bandwidth per tier, bytes per second (see the module doc)."""


_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgtp]?)(i?)(b?)\s*$", re.IGNORECASE)
_POW = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4, "p": 5}


def parse_size(text: str) -> float:
    """Parse a byte size: ``80GiB``, ``80GB``, ``1.5TiB``, ``512MiB`` or plain bytes.

    ``GiB`` and friends are powers of 1024; ``GB`` powers of 1000; a bare ``80G`` is GiB.

    Raises:
        ValueError: not a size.
    """
    m = _SIZE.match(text)
    if not m:
        raise ValueError(f"expected a size such as 80GiB, 80GB or 1.5TiB, got {text!r}")
    num, prefix, i, b = m.groups()
    p = _POW[prefix.lower()]
    binary = bool(i) or (prefix != "" and not b)
    return float(num) * float((1024 if binary else 1000) ** p)


def parse_tokens(text: str) -> int:
    """Parse a token count: ``2k`` = 2048, ``32K`` = 32768, ``1M`` = 1048576, ``8192``.

    Raises:
        ValueError: not a positive count.
    """
    m = re.match(r"^\s*([0-9]*\.?[0-9]+)\s*([kKmM]?)\s*$", text)
    if not m:
        raise ValueError(f"expected a token count such as 2k, 8k or 8192, got {text!r}")
    n = float(m.group(1)) * {"": 1, "k": 1024, "m": 1024**2}[m.group(2).lower()]
    if n < 1:
        raise ValueError(f"token count must be >= 1, got {text!r}")
    return int(n)


def parse_bandwidth(text: str) -> float:
    """Parse a bandwidth such as ``50GB/s`` or ``25GiB/s`` into bytes per second.

    Raises:
        ValueError: not a bandwidth.
    """
    return parse_size(text.strip().removesuffix("/s").removesuffix("ps"))


@dataclass(frozen=True, slots=True)
class Tier:
    """An offload tier.

    Attributes:
        name: ``dram``, ``cxl``, ``ssd`` or any name given.
        capacity_bytes: bytes available for KV.
        bandwidth: effective reload bandwidth to the accelerator, bytes per second.
        capacity_from: ``agent``, ``this host`` or ``--tier``.
    """

    name: str
    capacity_bytes: float
    bandwidth: float
    capacity_from: str


def parse_tier(text: str) -> tuple[str, float | None, float | None]:
    """Parse ``NAME=CAPACITY[@BANDWIDTH]`` or ``NAME@BANDWIDTH`` (``dram=512GiB@50GB/s``).

    Returns:
        ``(name, capacity bytes or None, bandwidth bytes/s or None)``.

    Raises:
        ValueError: malformed.
    """
    m = re.match(r"^\s*([a-z0-9_-]+)\s*(?:=\s*([^@]+?))?\s*(?:@\s*(.+))?\s*$", text, re.I)
    if not m or (m.group(2) is None and m.group(3) is None):
        raise ValueError(f"expected NAME=CAPACITY[@BANDWIDTH], e.g. dram=512GiB@50GB/s: {text!r}")
    cap = parse_size(m.group(2)) if m.group(2) else None
    bw = parse_bandwidth(m.group(3)) if m.group(3) else None
    return m.group(1).lower(), cap, bw


@dataclass(slots=True)
class LiveFacts:
    """What a running agent reports about one engine and its host.

    Attributes:
        engine: the ``engine`` label.
        engine_type: ``llamacpp``, ``vllm``, ...
        model: the ``model`` label.
        capacity_tokens: KV capacity the engine reports.
        used_tokens: KV tokens in use (or ratio x capacity).
        running: requests running.
        waiting: requests waiting.
        slots: llama.cpp slots.
        tokens_per_request: observed KV tokens per running request.
        bytes_per_token: ``kvpressure_kv_bytes_per_token`` for the engine.
        prefill_seconds_per_token: lifetime prefill seconds per computed prompt token.
        knee: per-band latency quantiles of the engine.
        gpu_memory_bytes: the largest accelerator's memory total.
        host_available_bytes: host memory available.
        cxl_free_bytes: free bytes on CPU-less (CXL) NUMA nodes.
        instance: the engine's ``instance`` label (``host:port``) when it has one.
    """

    engine: str
    engine_type: str | None = None
    model: str | None = None
    capacity_tokens: float | None = None
    used_tokens: float | None = None
    running: float | None = None
    waiting: float | None = None
    slots: float | None = None
    tokens_per_request: float | None = None
    bytes_per_token: float | None = None
    prefill_seconds_per_token: float | None = None
    knee: list[BandStats] = field(default_factory=list)
    gpu_memory_bytes: float | None = None
    host_available_bytes: float | None = None
    cxl_free_bytes: float | None = None
    instance: str | None = None


def live_from_snapshot(snap: Mapping[str, Any], engine: str | None = None) -> LiveFacts:
    """Extract :class:`LiveFacts` from an agent's ``/api/v1/snapshot`` JSON.

    Args:
        snap: the decoded snapshot.
        engine: the ``engine`` label; may be omitted when the agent sees one engine.

    Raises:
        ValueError: no engine, or several and ``engine`` not given (the message lists them).
    """
    samples = [
        (
            str(s["name"]),
            {str(k): str(v) for k, v in s.get("labels", {}).items()},
            float(s["value"]),
        )
        for s in snap.get("samples", [])
    ]
    engines = sorted(
        {lab["engine"] for n, lab, _ in samples if n == "kvpressure_engine_up" and "engine" in lab}
        | {
            lab["engine"]
            for n, lab, _ in samples
            if n == "kvpressure_engine_kv_cache_capacity_tokens" and "engine" in lab
        }
    )
    if engine is None:
        if len(engines) != 1:
            raise ValueError(
                "the agent sees "
                + (f"engines {', '.join(engines)}: pass --engine" if engines else "no engine")
            )
        engine = engines[0]
    elif engine not in engines:
        raise ValueError(
            f"the agent has no engine {engine!r} (it has: {', '.join(engines) or 'none'})"
        )

    def total(name: SampleName, **want: str) -> float | None:
        vals = [
            v
            for n, lab, v in samples
            if n == name
            and lab.get("engine", engine) == engine
            and all(lab.get(k) == x for k, x in want.items())
        ]
        return sum(vals) if vals else None

    def host(name: SampleName, agg: str = "sum", **want: str) -> float | None:
        vals = [
            v
            for n, lab, v in samples
            if n == name and all(lab.get(k) == x for k, x in want.items())
        ]
        if not vals:
            return None
        return max(vals) if agg == "max" else sum(vals)

    info = [
        lab
        for n, lab, _ in samples
        if n == "kvpressure_engine_info" and lab.get("engine") == engine
    ]
    etype = info[0].get("type") if info else None
    model = info[0].get("model") if info else None
    instance = next(
        (
            lab["instance"]
            for n, lab, _ in samples
            if n == "kvpressure_engine_up" and lab.get("engine") == engine and lab.get("instance")
        ),
        None,
    )
    cap = total("kvpressure_engine_kv_cache_capacity_tokens")
    used = total("kvpressure_engine_kv_cache_used_tokens")
    ratio = total("kvpressure_engine_kv_cache_usage_ratio")
    if used is None and ratio is not None and cap is not None:
        used = ratio * cap
    p_sec = total("kvpressure_engine_prompt_seconds_total")
    p_tok = total("kvpressure_engine_prompt_tokens_total")
    hits = total("kvpressure_engine_prefix_cache_hit_tokens_total") or 0.0
    rate = None
    if p_sec and p_tok:
        from kvpressure.agent.capacity.live import PROMPT_INCLUDES_HITS

        computed = p_tok - (hits if (etype or "") in PROMPT_INCLUDES_HITS else 0.0)
        rate = p_sec / computed if computed > 0 else None
    return LiveFacts(
        engine=engine,
        engine_type=etype,
        model=model,
        capacity_tokens=cap,
        used_tokens=used,
        running=total("kvpressure_engine_requests_running"),
        waiting=total("kvpressure_engine_requests_waiting"),
        slots=total("kvpressure_engine_slots", state="total"),
        tokens_per_request=total("kvpressure_kv_request_tokens"),
        bytes_per_token=total("kvpressure_kv_bytes_per_token"),
        prefill_seconds_per_token=rate,
        knee=stats_from_samples(((n, lab, v) for n, lab, v in samples), engine),
        gpu_memory_bytes=host("kvpressure_gpu_memory_total_bytes", "max"),
        host_available_bytes=host("kvpressure_host_memory_available_bytes", "max"),
        cxl_free_bytes=host("kvpressure_memory_tier_bytes", tier="cxl", state="free"),
        instance=instance,
    )


def llamacpp_gguf(live: LiveFacts, timeout_s: float = 3.0) -> str | None:
    """The GGUF file a llama.cpp engine serves, when it is readable on this host.

    The same rule the agent's capacity sampler follows
    (:func:`agent.capacity.live.llamacpp_gguf_path`); ``None`` for other engines.
    """
    if live.engine_type != "llamacpp":
        return None
    from kvpressure.agent.capacity.live import llamacpp_gguf_path

    return llamacpp_gguf_path(live.model, live.instance, timeout_s)


def fetch_live(url: str, engine: str | None = None, timeout_s: float = 5.0) -> LiveFacts:
    """GET ``<url>/api/v1/snapshot`` and extract :class:`LiveFacts`.

    Raises:
        httpx.HTTPError: the agent did not answer.
        ValueError: bad JSON, or the engine cannot be chosen.
    """
    import httpx

    r = httpx.get(url.rstrip("/") + "/api/v1/snapshot", timeout=timeout_s)
    r.raise_for_status()
    return live_from_snapshot(r.json(), engine)


def local_cxl_free(sysfs_root: str = "/sys", procfs_root: str = "/proc") -> float | None:
    """Free bytes on this host's CPU-less NUMA nodes (CXL memory), as the agent reads them.

    Runs the host sampler's NUMA reading once (``/sys/devices/system/node/node*/cpulist``
    empty: a CXL node; its ``meminfo`` ``MemFree``) and sums
    ``kvpressure_memory_tier_bytes{tier="cxl",state="free"}``; ``None`` when the host has no
    such node or no NUMA sysfs.
    """
    import logging

    from kvpressure.agent.samplers.host import HostSampler
    from kvpressure.agent.samples import Batch

    host_log = logging.getLogger("kvpressure.agent.samplers.host")
    level = host_log.level
    host_log.setLevel(logging.CRITICAL)  # one-shot read: the sampler's hints are for the agent
    try:
        batch = Batch()
        HostSampler(procfs_root, sysfs_root, memory_cgroup="none").collect(batch)
    except Exception:  # noqa: BLE001 - a planning aid: an unreadable host means "not found"
        return None
    finally:
        host_log.setLevel(level)
    vals = [
        s.value
        for s in batch.samples
        if s.name == "kvpressure_memory_tier_bytes"
        and dict(s.labels).get("tier") == "cxl"
        and dict(s.labels).get("state") == "free"
    ]
    return sum(vals) if vals else None


def local_mem_available(meminfo: str | Path = "/proc/meminfo") -> float | None:
    """This host's ``MemAvailable`` in bytes, or ``None`` when unreadable."""
    try:
        for line in Path(meminfo).read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return float(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def default_tiers(
    live: LiveFacts | None,
    overrides: Iterable[tuple[str, float | None, float | None]] = (),
    local_available: float | None = None,
    local_cxl_free: float | None = None,
) -> list[Tier]:
    """Return the offload tiers to evaluate: the ones detected, then those given.

    A tier is shown only when it exists (host DRAM; CXL memory the agent found on CPU-less
    NUMA nodes) or was given with ``--tier``: a capacity is never assumed.

    Args:
        live: agent facts (host available memory, CXL free bytes), if any.
        overrides: parsed ``--tier`` values.
        local_available: this host's available memory, used without an agent.
        local_cxl_free: this host's free CXL memory, used without an agent.
    """
    caps: dict[str, tuple[float, str]] = {}
    if live is not None and live.host_available_bytes:
        caps["dram"] = (live.host_available_bytes, "agent")
    elif local_available:
        caps["dram"] = (local_available, "this host")
    if live is not None and live.cxl_free_bytes:
        caps["cxl"] = (live.cxl_free_bytes, "agent")
    elif live is None and local_cxl_free:
        caps["cxl"] = (local_cxl_free, "this host")
    bws = dict(TIER_BANDWIDTH)
    for name, cap, bw in overrides:
        if cap is not None:
            caps[name] = (cap, "--tier")
        if bw is not None:
            bws[name] = bw
    names = list(dict.fromkeys([*TIER_BANDWIDTH, *bws, *caps]))
    out = []
    for name in names:
        cap_from = caps.get(name)
        if cap_from is None:
            continue  # neither detected nor given: not assumed
        bw = bws.get(name)
        if bw is None:
            raise ValueError(f"tier {name!r} needs a bandwidth: --tier {name}=SIZE@BANDWIDTH")
        out.append(Tier(name, cap_from[0], bw, cap_from[1]))
    return out


@dataclass(slots=True)
class PlanInputs:
    """Everything :func:`make_plan` needs.

    Attributes:
        shape: the model's KV shape (required; a flat shape from the agent's bytes per token
            when no model file is given).
        contexts: context lengths in tokens (prompt + output per request).
        concurrency: concurrent users now (doubled in the what-if).
        memory_bytes: memory of one accelerator; ``None`` with an engine-reported budget.
        gpus: accelerators the model is spread over.
        memory_utilization: share of memory the engine may use.
        weights_bytes: model weights (all accelerators together).
        weights_how: where the weight figure comes from.
        overhead_bytes: activations/runtime per accelerator.
        output_tokens: output tokens per request, for the service time.
        live: agent facts, if any.
        tiers: offload tiers.
        prefill_seconds_per_token: recompute cost per token (live, or ``--prefill-rate``).
        windowed: apply sliding windows (``False``: llama.cpp ``--swa-full``).
    """

    shape: KVShape
    contexts: Sequence[int]
    concurrency: int
    memory_bytes: float | None = None
    gpus: int = 1
    memory_utilization: float = DEFAULT_MEMORY_UTILIZATION
    weights_bytes: float | None = None
    weights_how: str = ""
    overhead_bytes: float = DEFAULT_OVERHEAD_BYTES
    output_tokens: int = DEFAULT_OUTPUT_TOKENS
    live: LiveFacts | None = None
    tiers: Sequence[Tier] = ()
    prefill_seconds_per_token: float | None = None
    windowed: bool = True


def _knee_at(knee: Sequence[BandStats], occupancy: float, phase: str) -> BandStats | None:
    """Return the stats of the band ``occupancy`` falls in.

    Else the nearest lower band with data, else the nearest higher one.
    """
    have = {s.band: s for s in knee if s.phase == phase and s.count > 0}
    if not have:
        return None
    target = band_of(occupancy)
    lo_t = band_bounds(target)[0]
    if target in have:
        return have[target]
    lower = [s for b, s in have.items() if band_bounds(b)[0] < lo_t]
    if lower:
        return max(lower, key=lambda s: band_bounds(s.band)[0])
    return min(have.values(), key=lambda s: band_bounds(s.band)[0])


def _tail(inp: PlanInputs, occupancy: float, queued: int, fit: int) -> dict[str, Any]:
    """Expected TTFT at an occupancy, with queueing waves (see the module doc)."""
    knee = inp.live.knee if inp.live is not None else []
    ttft = _knee_at(knee, occupancy, "ttft")
    itl = _knee_at(knee, occupancy, "itl")
    out: dict[str, Any] = {
        "band": band_of(occupancy),
        "knee_band_used": ttft.band if ttft else (itl.band if itl else None),
        "ttft_p50_s": ttft.p50 if ttft else None,
        "ttft_p99_s": ttft.p99 if ttft else None,
        "itl_p50_s": itl.p50 if itl else None,
        "queue_wait_s": None,
        "tail_ttft_s": None,
    }
    service = None
    if itl is not None and itl.p50 is not None:
        service = (ttft.p50 if ttft and ttft.p50 else 0.0) + inp.output_tokens * itl.p50
    waves = math.ceil(queued / fit) if queued > 0 and fit > 0 else 0
    if service is not None:
        out["queue_wait_s"] = waves * service
        base = ttft.p99 if ttft and ttft.p99 is not None else 0.0
        out["tail_ttft_s"] = base + waves * service
    elif waves == 0 and ttft is not None:
        out["queue_wait_s"] = 0.0
        out["tail_ttft_s"] = ttft.p99
    out["queue_waves"] = waves
    return out


def make_plan(inp: PlanInputs) -> dict[str, Any]:
    """Compute the plan (JSON-ready dict; :func:`render_plan` prints it as tables).

    Raises:
        ValueError: no KV budget can be derived (no memory size and no engine capacity).
    """
    shape = inp.shape
    bpt = shape.bytes_per_token
    notes: list[str] = list(shape.notes)
    budget: dict[str, Any] = {}
    live = inp.live
    if live is not None and live.capacity_tokens:
        b = live.capacity_tokens * bpt
        budget = {
            "bytes": b,
            "tokens": live.capacity_tokens,
            "how": f"engine-reported capacity {live.capacity_tokens:,.0f} tokens x "
            f"{fmt_bytes(bpt)} per token",
        }
        if live.engine_type == "llamacpp" and live.slots:
            notes.append(
                f"llama.cpp: {live.slots:.0f} slots of {live.capacity_tokens / live.slots:,.0f} "
                "tokens each (default per-slot KV): at most that many requests run, each must "
                "fit its slot; a request beyond the slots waits, one longer than a slot is refused"
            )
    elif inp.memory_bytes:
        mem = inp.memory_bytes * inp.gpus
        usable = mem * inp.memory_utilization
        weights = inp.weights_bytes or 0.0
        w_text = (
            f"weights {fmt_bytes(weights)}{f' ({inp.weights_how})' if inp.weights_how else ''}"
            if inp.weights_bytes is not None
            else "weights UNKNOWN (not subtracted: pass --weights)"
        )
        b = usable - weights - inp.overhead_bytes * inp.gpus
        if b <= 0:
            raise ValueError(
                f"no room for KV: {fmt_bytes(usable)} usable - weights {fmt_bytes(weights)} - "
                f"overhead {fmt_bytes(inp.overhead_bytes * inp.gpus)} <= 0"
            )
        budget = {
            "bytes": b,
            "tokens": b / bpt,
            "how": f"{inp.gpus} x {fmt_bytes(inp.memory_bytes)} x {inp.memory_utilization:.2f} - "
            f"{w_text} - overhead {fmt_bytes(inp.overhead_bytes * inp.gpus)}",
        }
        if inp.weights_bytes is None:
            notes.append(
                "weights unknown and NOT subtracted, so the KV budget is too high: pass "
                "--weights SIZE (or point --hf-config at a directory with the safetensors)"
            )
    else:
        raise ValueError(
            "no KV budget: pass --gpu-memory (or --live-gpu), or --agent with an engine"
        )
    kv_bytes = float(budget["bytes"])
    n1, n2 = inp.concurrency, inp.concurrency * 2
    rows = []
    for ctx in inp.contexts:
        per_req = shape.sequence_bytes(ctx, inp.windowed)
        fit = int(kv_bytes // per_req) if per_req > 0 else 0
        if (
            live is not None
            and live.engine_type == "llamacpp"
            and live.slots
            and live.capacity_tokens
        ):
            slot_ctx = live.capacity_tokens / live.slots
            fit = int(live.slots) if ctx <= slot_ctx else 0
        row: dict[str, Any] = {"context_tokens": ctx, "kv_bytes_per_request": per_req, "fit": fit}
        for label, n in (("now", n1), ("doubled", n2)):
            demand = n * per_req
            occ = min(1.0, demand / kv_bytes)
            queued = max(0, n - fit)
            tail = _tail(inp, occ, queued, fit)
            if fit == 0:  # a request of this length never fits: refused, not queued
                tail.update(queue_wait_s=None, tail_ttft_s=None)
            row[label] = {
                "concurrency": n,
                "kv_demand_bytes": demand,
                "demand_ratio": demand / kv_bytes,
                "occupancy": occ,
                "queued": queued if fit else None,
                **tail,
            }
        if fit == 0:
            notes.append(f"a {ctx}-token request does not fit at all: the engine refuses it")
        rows.append(row)
    rate = inp.prefill_seconds_per_token
    if rate is None and live is not None:
        rate = live.prefill_seconds_per_token
    tiers = []
    for t in inp.tiers:
        reload_s_tok = bpt / t.bandwidth
        tiers.append(
            {
                "tier": t.name,
                "capacity_bytes": t.capacity_bytes,
                "capacity_from": t.capacity_from,
                "bandwidth_bytes_per_s": t.bandwidth,
                "extra_tokens": t.capacity_bytes / bpt,
                "extra_requests": {
                    str(ctx): int(t.capacity_bytes // shape.sequence_bytes(ctx, inp.windowed))
                    for ctx in inp.contexts
                },
                "reload_seconds_per_token": reload_s_tok,
                "recompute_seconds_per_token": rate,
                "reload_vs_recompute": (rate / reload_s_tok) if rate else None,
            }
        )
    if rate is None and tiers:
        notes.append("no prefill rate to compare reloads with: pass --prefill-rate or --agent")
    absent = [n for n in TIER_BANDWIDTH if n not in {t.name for t in inp.tiers}]
    if absent:
        notes.append(
            f"tiers not shown: {', '.join(absent)} (neither found on this host nor given; "
            "add one with --tier NAME=SIZE[@BANDWIDTH])"
        )
    return {
        "model": shape.as_dict(),
        "kv_budget": budget,
        "concurrency": n1,
        "output_tokens": inp.output_tokens,
        "contexts": rows,
        "tiers": tiers,
        "live": None
        if live is None
        else {
            "engine": live.engine,
            "type": live.engine_type,
            "capacity_tokens": live.capacity_tokens,
            "used_tokens": live.used_tokens,
            "running": live.running,
            "waiting": live.waiting,
            "slots": live.slots,
            "tokens_per_request": live.tokens_per_request,
            "prefill_seconds_per_token": live.prefill_seconds_per_token,
            "knee": [
                {"phase": s.phase, "band": s.band, "count": s.count, "p50_s": s.p50, "p99_s": s.p99}
                for s in live.knee
            ],
        },
        "notes": notes,
    }


def _s(v: float | None) -> str:
    """Seconds with a unit and three significant digits (``1.23 ms``, ``370 ns``)."""
    if v is None:
        return "-"
    for scale, unit in ((1.0, "s"), (1e-3, "ms"), (1e-6, "us"), (1e-9, "ns")):
        if v >= scale or unit == "ns":
            return f"{v / scale:.3g} {unit}"
    return "-"  # pragma: no cover


def _q(n: int | None) -> str:
    return "no fit" if n is None else str(n)


def _tok(n: float) -> str:
    if n >= 1024 and n % 1024 == 0:
        return f"{n / 1024:.0f}k"
    return f"{n:,.0f}"


def render_plan(plan: Mapping[str, Any]) -> str:
    """Render :func:`make_plan`'s result as the text tables ``kvpressure plan`` prints."""
    m = plan["model"]
    b = plan["kv_budget"]
    if m["source"] == "agent" and m["kv_dtype"] == "unknown":
        head = (
            f"model        {m['model'] or '?'} (bytes per token as the agent measured them; "
            "pass --gguf or --hf-config for its layout and KV dtype)"
        )
    else:
        head = (
            f"model        {m['model'] or '?'} ({m['source']}, {m['architecture'] or '?'}), "
            f"KV dtype {m['kv_dtype']}"
        )
    lines = [head]
    if m["latent_dim"]:
        how = (
            f"{m['full_attention_layers']} layers x latent {m['latent_dim']} x "
            f"{m['element_bytes']:g} B"
        )
    elif m["layers"]:
        how = (
            f"2 x {m['full_attention_layers'] + m['window_layers']} attention layers x "
            f"{m['kv_heads']} KV heads x {m['key_dim']} dim x {m['element_bytes']:g} B"
        )
    else:
        how = "as reported"
    lines.append(
        f"KV per token {fmt_bytes(m['bytes_per_token'])} ({m['bytes_per_token']:,.0f} B = {how})"
    )
    if m["window_tokens"]:
        lines.append(
            f"             beyond the {m['window_tokens']}-token window: "
            f"{fmt_bytes(m['marginal_bytes_per_token'])} per token "
            f"({m['full_attention_layers']} full-attention layers)"
        )
    lines.append(f"KV budget    {fmt_bytes(b['bytes'])} = {b['tokens']:,.0f} tokens ({b['how']})")
    lines.append("")
    n1 = plan["concurrency"]
    hdr = (
        f"{'CONTEXT':>8} {'KV/REQUEST':>11} {'FIT':>6} | {'USERS':>5} {'KV DEMAND':>10} "
        f"{'OF KV':>5} {'QUEUED':>6} {'TAIL TTFT':>9} | {'USERS':>5} {'KV DEMAND':>10} "
        f"{'OF KV':>5} {'QUEUED':>6} {'TAIL TTFT':>9}"
    )
    lines.append(f"{'':>28}| now ({n1} users){'':>30}| doubled ({2 * n1} users)")
    lines.append(hdr)
    for r in plan["contexts"]:
        cells = [
            f"{_tok(r['context_tokens']):>8} {fmt_bytes(r['kv_bytes_per_request']):>11} "
            f"{r['fit']:>6}"
        ]
        for k in ("now", "doubled"):
            x = r[k]
            cells.append(
                f"{x['concurrency']:>5} {fmt_bytes(x['kv_demand_bytes']):>10} "
                f"{x['demand_ratio'] * 100:>4.0f}% {_q(x['queued']):>6} {_s(x['tail_ttft_s']):>9}"
            )
        lines.append(" | ".join(cells))
    lines.append("")
    lines.append(
        "doubling users doubles KV demand; TAIL TTFT = observed TTFT p99 in the band the "
        "demand lands in + queueing waves"
        + (
            "; a what-if for this demand from the knee since the agent started, so it differs "
            "from `kvpressure explain`'s p99, which is over the requests actually seen in its "
            "window, at whatever occupancy they met; and the knee's quantiles are read from "
            "histogram buckets (interpolated within a bucket, as histogram_quantile does) "
            "where explain's are exact per-request latencies, so with few requests they can "
            "differ by up to a bucket's width"
            if plan["live"] and plan["live"]["knee"]
            else " (needs --agent with an observed knee)"
        )
    )
    if plan["tiers"]:
        lines.append("")
        ctx_names = [_tok(r["context_tokens"]) for r in plan["contexts"]]
        lines.append(
            f"{'TIER':<6} {'CAPACITY':>11} {'FROM':<10} {'BANDWIDTH':>10} {'+TOKENS':>14} "
            f"{'+REQUESTS @' + '/'.join(ctx_names):>22} {'RELOAD/TOKEN':>12} "
            f"{'RECOMPUTE/TOKEN':>15}"
        )
        for t in plan["tiers"]:
            reqs = "/".join(f"{v:,}" for v in t["extra_requests"].values())
            lines.append(
                f"{t['tier']:<6} {fmt_bytes(t['capacity_bytes']):>11} {t['capacity_from']:<10} "
                f"{t['bandwidth_bytes_per_s'] / 1e9:>6.1f} GB/s {t['extra_tokens']:>14,.0f} "
                f"{reqs:>22} {_s(t['reload_seconds_per_token']):>12} "
                f"{_s(t['recompute_seconds_per_token']):>15}"
            )
    live = plan["live"]
    if live:
        lines.append("")
        lines.append(
            f"live ({live['engine']}, {live['type'] or '?'}): capacity "
            f"{_fmt_opt(live['capacity_tokens'])} tokens, used {_fmt_opt(live['used_tokens'])}, "
            f"running {_fmt_opt(live['running'])}, waiting {_fmt_opt(live['waiting'])}, "
            f"tokens/request {_fmt_opt(live['tokens_per_request'])}, prefill "
            f"{_s(live['prefill_seconds_per_token'])}/token"
        )
        for k in live["knee"]:
            lines.append(
                f"  knee {k['phase']:<4} band {k['band']:>6}%: n={k['count']:.0f} "
                f"p50 {_s(k['p50_s'])} p99 {_s(k['p99_s'])}"
            )
    for n in plan["notes"]:
        lines.append(f"note: {n}")
    return "\n".join(lines)


def _fmt_opt(v: float | None) -> str:
    return "-" if v is None else f"{v:,.0f}"


def weights_for(path: str | Path) -> tuple[float, str] | None:
    """Infer weight bytes for a model file: GGUF file size, or safetensors beside a config.

    Returns:
        ``(bytes, how)``, or ``None`` when nothing can be inferred.
    """
    p = Path(path)
    if p.suffix.lower() == ".gguf" and p.is_file():
        return float(p.stat().st_size), "GGUF file size"
    d = p if p.is_dir() else p.parent
    files = sorted(d.glob("*.safetensors"))
    if files:
        return float(sum(f.stat().st_size for f in files)), f"{len(files)} safetensors file(s)"
    cfg = d / "config.json" if p.is_dir() else p
    try:
        import json

        data = json.loads(cfg.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    from kvpressure.agent.capacity.kvbytes import estimate_hf_weights_bytes

    return estimate_hf_weights_bytes(data) if isinstance(data, Mapping) else None


def run_plan(args: Any) -> int:
    """Run ``kvpressure plan`` for parsed CLI arguments; print the table or JSON.

    Args:
        args: the ``argparse`` namespace built by ``agent.cli`` (``hf_config``, ``gguf``,
            ``agent``, ``engine``, ``kv_dtype``, ``gpu_memory``, ``live_gpu``, ``gpus``,
            ``memory_utilization``, ``weights``, ``overhead``, ``context``, ``concurrency``,
            ``output_tokens``, ``tier``, ``prefill_rate``, ``swa_full``, ``json``).

    Returns:
        0 on success, 1 when the inputs cannot produce a plan (message on stderr), 2 for an
        unusable value.
    """
    import json
    import sys

    from kvpressure.agent.capacity.kvbytes import ModelShapeError, flat_shape, load_shape

    def fail(msg: str, code: int = 1) -> int:
        print(f"kvpressure plan: {msg}", file=sys.stderr)
        return code

    try:
        contexts = [parse_tokens(x) for x in args.context.split(",") if x.strip()]
        memory = parse_size(args.gpu_memory) if args.gpu_memory else None
        weights = parse_size(args.weights) if args.weights else None
        overhead = parse_size(args.overhead) if args.overhead else DEFAULT_OVERHEAD_BYTES
        tier_over = [parse_tier(t) for t in args.tier or []]
    except ValueError as exc:
        return fail(str(exc), 2)
    live: LiveFacts | None = None
    if args.agent:
        try:
            live = fetch_live(args.agent, args.engine)
        except ValueError as exc:
            return fail(str(exc))
        except Exception as exc:  # noqa: BLE001 - httpx errors: say which agent did not answer
            return fail(f"no agent answering at {args.agent} ({type(exc).__name__}: {exc})")
    model_path = args.hf_config or args.gguf
    served = None
    if model_path is None and live is not None:
        served = model_path = llamacpp_gguf(live)  # llama.cpp: its GGUF gives name and dtype
    weights_how = "--weights" if weights is not None else ""
    if model_path:
        try:
            shape = load_shape(model_path, args.kv_dtype)
        except (OSError, ValueError, ModelShapeError) as exc:
            return fail(f"{model_path}: {exc}")
        if served and live is not None:
            shape = dataclasses.replace(
                shape,
                notes=(*shape.notes, f"layout read from {served}, the GGUF {live.engine} serves"),
            )
        if weights is None:
            w = weights_for(model_path)
            if w is not None:
                weights, weights_how = w
    elif live is not None and live.bytes_per_token:
        shape = flat_shape(live.bytes_per_token, live.model, "agent")
    else:
        return fail(
            "no model shape: pass --hf-config PATH or --gguf PATH"
            + (
                " (the agent exports no kvpressure_kv_bytes_per_token for this engine)"
                if live
                else ""
            )
        )
    if args.live_gpu:
        if live is None or not live.gpu_memory_bytes:
            return fail("--live-gpu needs --agent URL of an agent that reports GPU memory")
        memory = live.gpu_memory_bytes
    try:
        tiers = default_tiers(
            live,
            tier_over,
            local_mem_available() if live is None else None,
            local_cxl_free() if live is None else None,
        )
        plan = make_plan(
            PlanInputs(
                shape=shape,
                contexts=contexts,
                concurrency=args.concurrency,
                memory_bytes=memory,
                gpus=args.gpus,
                memory_utilization=args.memory_utilization,
                weights_bytes=weights,
                weights_how=weights_how,
                overhead_bytes=overhead,
                output_tokens=args.output_tokens,
                live=live,
                tiers=tiers,
                prefill_seconds_per_token=args.prefill_rate,
                windowed=not args.swa_full,
            )
        )
    except ValueError as exc:
        return fail(str(exc))
    print(json.dumps(plan, indent=2) if args.json else render_plan(plan))
    return 0
