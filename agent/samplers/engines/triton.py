"""Triton Inference Server with the TensorRT-LLM backend (metrics port 8002, ``/metrics``).

Sources: the ``tensorrtllm_backend`` README's "Triton Metrics" section and its CI checks
(``nv_trt_llm_*`` batch-manager gauges, label ``model`` = the Triton model, usually
``tensorrt_llm``, and ``version``), and Triton's metrics documentation (``nv_inference_*``
per-model counters, cumulative durations in **microseconds**, converted to seconds here;
the TTFT histogram ``nv_inference_first_response_histogram_ms`` in **milliseconds**,
exported only with ``--metrics-config histogram_latencies=true``).

Every ``nv_inference_*`` series exists once per model of the ensemble (``ensemble``,
``preprocessing``, ``tensorrt_llm``, ``postprocessing``); each keeps its own ``model``
label, never summed across models.

=============================================  =================================================
catalogue metric                               Triton metric
=============================================  =================================================
``kvpressure_engine_kv_cache_usage_ratio``     ``nv_trt_llm_kv_cache_block_metrics
                                               {kv_cache_block_type=fraction}``
``kvpressure_engine_kv_cache_blocks{state}``   ``...{kv_cache_block_type=max|used|free}``
                                               (total, used, free)
``kvpressure_engine_kv_cache_block_size_...``  ``...{kv_cache_block_type=tokens_per}``
``kvpressure_engine_kv_cache_capacity_tokens`` max x tokens_per (derived)
``kvpressure_engine_kv_cache_used_tokens``     used x tokens_per (derived, block-granular)
``kvpressure_engine_kv_cache_free_tokens``     free x tokens_per (derived)
``kvpressure_engine_requests_running``         ``nv_trt_llm_request_metrics
                                               {request_type=active}``
``kvpressure_engine_requests_waiting``         ``...{request_type=waiting}`` (newer backends),
                                               else ``nv_inference_pending_request_count``
``kvpressure_engine_requests_paused``          ``nv_trt_llm_inflight_batcher_metrics
                                               {inflight_batcher_specific_metric=
                                               paused_requests}``
``kvpressure_engine_requests_completed_total`` ``nv_inference_request_success``
``kvpressure_engine_request_duration_seconds`` ``nv_inference_request_duration_us`` (request),
``_total{phase}``                              ``nv_inference_queue_duration_us`` (queue),
                                               ``nv_inference_compute_infer_duration_us``
                                               (compute), x 1e-6
``kvpressure_engine_latency_seconds{phase}``   ``nv_inference_first_response_histogram_ms``
                                               (ttft, ``le`` x 1e-3)
``kvpressure_engine_gpu_memory_{used,total}``  ``nv_gpu_memory_{used,total}_bytes{gpu_uuid}``
``_bytes{uuid}``                               (Triton's own GPU view: the GPU sampler's NVML
                                               reading wins, a disagreement is flagged in
                                               ``kvpressure_gpu_engine_disagreement``)
=============================================  =================================================

Cannot provide: prompt/generation token counters (Triton counts inferences, not tokens),
preemptions, prefix-cache reuse (the backend reports it only in its JSON stats), KV bytes,
ITL/e2e quantiles (only cumulative microsecond counters; summaries are opt-in and not
mapped).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Final

from kvpressure.agent.catalogue import SampleName
from kvpressure.agent.samplers.engines.normalize import (
    RATIO,
    Derived,
    EngineMapping,
    MetricIndex,
    Rule,
    latency,
)

KV_BLOCKS = "nv_trt_llm_kv_cache_block_metrics"
REQUESTS = "nv_trt_llm_request_metrics"

_BLOCK_TOKENS: Final[tuple[tuple[str, SampleName], ...]] = (
    ("max", "kvpressure_engine_kv_cache_capacity_tokens"),
    ("used", "kvpressure_engine_kv_cache_used_tokens"),
    ("free", "kvpressure_engine_kv_cache_free_tokens"),
)
"""``kv_cache_block_type`` of a block count, and the token gauge it gives (x tokens per block)."""


def derive(index: MetricIndex) -> Iterable[Derived]:
    """KV capacity, used and free tokens from the block gauges (see module doc)."""
    per_model: dict[str | None, dict[str, float]] = {}
    for s in index.find(KV_BLOCKS)[1]:
        kind = s.labels.get("kv_cache_block_type")
        if kind is None or not math.isfinite(s.value) or s.value < 0:
            continue
        model = s.labels.get("model") or None
        facts = per_model.setdefault(model, {})
        facts[kind] = facts.get(kind, 0.0) + s.value
    out: list[Derived] = []
    for model, facts in per_model.items():
        size = facts.get("tokens_per")
        if not size:
            continue
        for kind, canonical in _BLOCK_TOKENS:
            if kind in facts:
                out.append(Derived(canonical, facts[kind] * size, model))
    return out


def _blocks(state: str, kind: str) -> Rule:
    return Rule(
        "kvpressure_engine_kv_cache_blocks",
        (f"{KV_BLOCKS}{{kv_cache_block_type={kind}}}",),
        out_labels=(("state", state),),
    )


def _duration(phase: str, source: str) -> Rule:
    return Rule(
        "kvpressure_engine_request_duration_seconds_total",
        (source,),
        kind="counter",
        scale=1e-6,
        out_labels=(("phase", phase),),
    )


def _gpu(canonical: SampleName, source: str) -> Rule:
    return Rule(
        canonical,
        (source,),
        combine="max",
        keep_labels=(("gpu_uuid", "uuid"),),
        per_model=False,
    )


MAPPING = EngineMapping(
    engine_type="triton",
    prefixes=("nv_trt_llm_", "nv_inference_"),
    model_labels=("model",),
    rules=(
        Rule(
            "kvpressure_engine_kv_cache_usage_ratio",
            (f"{KV_BLOCKS}{{kv_cache_block_type=fraction}}",),
            combine="max",
            valid=RATIO,
        ),
        _blocks("total", "max"),
        _blocks("used", "used"),
        _blocks("free", "free"),
        Rule(
            "kvpressure_engine_kv_cache_block_size_tokens",
            (f"{KV_BLOCKS}{{kv_cache_block_type=tokens_per}}",),
            combine="max",
        ),
        Rule("kvpressure_engine_requests_running", (f"{REQUESTS}{{request_type=active}}",)),
        Rule(
            "kvpressure_engine_requests_waiting",
            (f"{REQUESTS}{{request_type=waiting}}", "nv_inference_pending_request_count"),
        ),
        Rule(
            "kvpressure_engine_requests_paused",
            (
                "nv_trt_llm_inflight_batcher_metrics"
                "{inflight_batcher_specific_metric=paused_requests}",
            ),
        ),
        Rule(
            "kvpressure_engine_requests_completed_total",
            ("nv_inference_request_success",),
            kind="counter",
        ),
        _duration("request", "nv_inference_request_duration_us"),
        _duration("queue", "nv_inference_queue_duration_us"),
        _duration("compute", "nv_inference_compute_infer_duration_us"),
        latency("ttft", "nv_inference_first_response_histogram_ms", scale=1e-3),
        _gpu("kvpressure_engine_gpu_memory_used_bytes", "nv_gpu_memory_used_bytes"),
        _gpu("kvpressure_engine_gpu_memory_total_bytes", "nv_gpu_memory_total_bytes"),
    ),
    derive=derive,
    derive_sources=(KV_BLOCKS,),
)
"""The Triton (TensorRT-LLM backend) :class:`~agent.samplers.engines.normalize.EngineMapping`."""
