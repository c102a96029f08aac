"""TensorRT-LLM ``trtllm-serve`` mapping (Prometheus text on ``/prometheus/metrics``).

Source: TensorRT-LLM's ``tensorrt_llm/metrics/collector.py`` (``MetricsCollector``, metric
prefix ``trtllm_``; labels ``model_name``, ``engine_type``). Iteration-level metrics need
``enable_iter_perf_stats: true`` and per-request ones ``return_perf_metrics: true`` in the
LLM API options; without them those families are absent here too. ``trtllm-serve``'s
``/metrics`` is a JSON list of iteration stats, not exposition, hence ``metrics_path``.
Dynamo's wrapper has exported the same families as ``trtllm:``; both spellings match.

=============================================  =================================================
catalogue metric                               TensorRT-LLM metric (``trtllm_`` prefix)
=============================================  =================================================
``kvpressure_engine_kv_cache_usage_ratio``     ``kv_cache_utilization`` (used / max blocks)
``kvpressure_engine_kv_cache_blocks{state}``   ``kv_cache_max_blocks`` (total),
                                               ``kv_cache_used_blocks`` (used),
                                               ``kv_cache_free_blocks`` (free)
``kvpressure_engine_kv_cache_block_size_...``  ``kv_cache_tokens_per_block``
``kvpressure_engine_kv_cache_capacity_tokens`` max blocks x tokens per block (derived)
``kvpressure_engine_kv_cache_used_tokens``     used blocks x tokens per block (derived,
                                               block-granular: an upper bound)
``kvpressure_engine_kv_cache_free_tokens``     free blocks x tokens per block (derived)
``kvpressure_engine_kv_tier_usage_ratio``      ``kv_cache_host_utilization`` (kv_host:
                                               secondary pool)
``kvpressure_engine_kv_offload_bytes_total``   ``kv_cache_offload_bytes_total`` (kv_host,
                                               offload), ``kv_cache_onboard_bytes_total``
                                               (kv_host, onboard)
``kvpressure_engine_prefix_cache_hit_ratio``   ``kv_cache_hit_rate``
``kvpressure_engine_prefix_cache_hit_tokens``  ``prompt_cached_tokens_total``
``kvpressure_engine_prefix_cache_tier_hit...`` ``prompt_cache_hit_tokens_total{cache_tier}``
                                               (gpu → device, host → kv_host, disk → kv_disk)
``kvpressure_engine_requests_running``         ``num_requests_running``
``kvpressure_engine_requests_waiting``         ``num_requests_waiting``
``kvpressure_engine_requests_paused``          ``num_paused_requests``
``kvpressure_engine_requests_completed_total`` ``request_success_total``
``kvpressure_engine_prompt_tokens_total``      ``prompt_tokens_total``
``kvpressure_engine_generation_tokens_total``  ``generation_tokens_total``
``kvpressure_engine_batch_max_tokens``         ``max_num_tokens_runtime``
``kvpressure_engine_latency_seconds{phase}``   ``time_to_first_token_seconds`` (ttft),
                                               ``time_per_output_token_seconds`` (itl: per
                                               request TPOT), ``e2e_request_latency_seconds``
                                               (e2e), ``request_queue_time_seconds`` (queue),
                                               ``request_prefill_time_seconds`` (prefill),
                                               ``request_decode_time_seconds`` (decode),
                                               ``request_inference_time_seconds`` (inference)
=============================================  =================================================

Cannot provide: preemptions (TensorRT-LLM pauses instead: ``requests_paused``), queried
prefix tokens (blocks reused/missed are counted, not tokens looked up), KV bytes,
admission rejections. KVBM and LMCache tier rules (:mod:`.kvtiers`) are appended.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from kvpressure.agent.catalogue import SampleName
from kvpressure.agent.samplers.engines import kvtiers
from kvpressure.agent.samplers.engines.normalize import (
    RATIO,
    Derived,
    EngineMapping,
    MetricIndex,
    Rule,
    latency,
)


def _per_model(index: MetricIndex, name: str, labels: tuple[str, ...]) -> dict[str | None, float]:
    """Sum of ``name``'s finite values per model label (``None`` without one)."""
    out: dict[str | None, float] = {}
    for s in index.find(name)[1]:
        if not math.isfinite(s.value) or s.value < 0:
            continue
        model = next((s.labels[k] for k in labels if s.labels.get(k)), None)
        out[model] = out.get(model, 0.0) + s.value
    return out


def blocks_to_tokens(
    index: MetricIndex,
    blocks: dict[SampleName, str],
    tokens_per_block: str,
    model_labels: tuple[str, ...] = ("model_name", "model"),
) -> Iterable[Derived]:
    """Turn block counts into token counts with the tokens-per-block gauge.

    Args:
        index: the scrape.
        blocks: catalogue name to the source family of a block count (summed per model).
        tokens_per_block: source family of tokens per block (max per model).
        model_labels: labels that carry the model.

    Returns:
        One :class:`Derived` per canonical and model where both values exist.
    """
    size: dict[str | None, float] = {}
    for s in index.find(tokens_per_block)[1]:
        model = next((s.labels[k] for k in model_labels if s.labels.get(k)), None)
        if math.isfinite(s.value) and s.value > 0:
            size[model] = max(size.get(model, 0.0), s.value)
    out: list[Derived] = []
    for canonical, source in blocks.items():
        for model, count in _per_model(index, source, model_labels).items():
            if model in size:
                out.append(Derived(canonical, count * size[model], model))
    return out


def derive(index: MetricIndex) -> Iterable[Derived]:
    """KV capacity, used and free tokens from ``trtllm_kv_cache_*_blocks`` (see module doc)."""
    return blocks_to_tokens(
        index,
        {
            "kvpressure_engine_kv_cache_capacity_tokens": "trtllm:kv_cache_max_blocks",
            "kvpressure_engine_kv_cache_used_tokens": "trtllm:kv_cache_used_blocks",
            "kvpressure_engine_kv_cache_free_tokens": "trtllm:kv_cache_free_blocks",
        },
        "trtllm:kv_cache_tokens_per_block",
    )


def _blocks(state: str, source: str) -> Rule:
    return Rule("kvpressure_engine_kv_cache_blocks", (source,), out_labels=(("state", state),))


MAPPING = EngineMapping(
    engine_type="trtllm",
    prefixes=("trtllm_", "trtllm:"),
    model_labels=("model_name", "model"),
    metrics_path="/prometheus/metrics",
    rules=(
        Rule(
            "kvpressure_engine_kv_cache_usage_ratio",
            ("trtllm:kv_cache_utilization",),
            combine="max",
            valid=RATIO,
        ),
        _blocks("total", "trtllm:kv_cache_max_blocks"),
        _blocks("used", "trtllm:kv_cache_used_blocks"),
        _blocks("free", "trtllm:kv_cache_free_blocks"),
        Rule(
            "kvpressure_engine_kv_cache_block_size_tokens",
            ("trtllm:kv_cache_tokens_per_block",),
            combine="max",
        ),
        kvtiers.tier_ratio(kvtiers.TIER_USAGE, "kv_host", "trtllm:kv_cache_host_utilization"),
        kvtiers.moved(kvtiers.OFFLOAD_BYTES, "kv_host", "offload", "trtllm:kv_cache_offload_bytes"),
        kvtiers.moved(kvtiers.OFFLOAD_BYTES, "kv_host", "onboard", "trtllm:kv_cache_onboard_bytes"),
        Rule(
            "kvpressure_engine_prefix_cache_hit_ratio",
            ("trtllm:kv_cache_hit_rate",),
            combine="max",
            valid=RATIO,
        ),
        Rule(
            "kvpressure_engine_prefix_cache_hit_tokens_total",
            ("trtllm:prompt_cached_tokens",),
            kind="counter",
        ),
        kvtiers.tier_hits("device", "trtllm:prompt_cache_hit_tokens{cache_tier=gpu}"),
        kvtiers.tier_hits("kv_host", "trtllm:prompt_cache_hit_tokens{cache_tier=host}"),
        kvtiers.tier_hits("kv_disk", "trtllm:prompt_cache_hit_tokens{cache_tier=disk}"),
        Rule("kvpressure_engine_requests_running", ("trtllm:num_requests_running",)),
        Rule("kvpressure_engine_requests_waiting", ("trtllm:num_requests_waiting",)),
        Rule("kvpressure_engine_requests_paused", ("trtllm:num_paused_requests",)),
        Rule(
            "kvpressure_engine_requests_completed_total",
            ("trtllm:request_success",),
            kind="counter",
        ),
        Rule("kvpressure_engine_prompt_tokens_total", ("trtllm:prompt_tokens",), kind="counter"),
        Rule(
            "kvpressure_engine_generation_tokens_total",
            ("trtllm:generation_tokens",),
            kind="counter",
        ),
        Rule("kvpressure_engine_batch_max_tokens", ("trtllm:max_num_tokens_runtime",)),
        latency("ttft", "trtllm:time_to_first_token_seconds"),
        latency("itl", "trtllm:time_per_output_token_seconds"),
        latency("e2e", "trtllm:e2e_request_latency_seconds"),
        latency("queue", "trtllm:request_queue_time_seconds"),
        latency("prefill", "trtllm:request_prefill_time_seconds"),
        latency("decode", "trtllm:request_decode_time_seconds"),
        latency("inference", "trtllm:request_inference_time_seconds"),
        *kvtiers.TIER_RULES,
    ),
    derive=derive,
    derive_sources=(
        "trtllm:kv_cache_max_blocks",
        "trtllm:kv_cache_used_blocks",
        "trtllm:kv_cache_free_blocks",
        "trtllm:kv_cache_tokens_per_block",
    ),
)
"""The ``trtllm-serve`` :class:`~agent.samplers.engines.normalize.EngineMapping`."""
