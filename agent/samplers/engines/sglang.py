"""SGLang mapping (``python -m sglang.launch_server --enable-metrics``, ``/metrics``).

Sources: SGLang's ``python/sglang/srt/metrics/collector.py`` (scheduler, tokenizer,
storage and radix-cache collectors) and its production-metrics document; the early names
(``num_requests_running``/``num_requests_waiting``, label ``name``) from the samples of
case 14. Every name is written in its ``sglang:`` form and also matched as ``sglang_``
(case 14: the separator flipped between releases and wrappers; when both spellings are in
one scrape the colon form wins and a duplicate-family warning is logged once). The model
comes from ``model_name`` (current) or ``name`` (early releases). Other labels
(``engine_type``, ``tp_rank``, ``pp_rank``, ``moe_ep_rank``, ``dp_rank``) are combined
away: summed for counts, max for ratios.

=============================================  =================================================
catalogue metric                               SGLang metric (first present wins)
=============================================  =================================================
``kvpressure_engine_kv_cache_usage_ratio``     ``token_usage`` (KV held by running requests /
                                               pool size; radix-cached evictable tokens are
                                               not counted as used)
``kvpressure_engine_kv_cache_used_tokens``     ``kv_used_tokens`` → ``num_used_tokens``
``kvpressure_engine_kv_cache_capacity_tokens`` ``max_total_num_tokens``
``kvpressure_engine_kv_cache_free_tokens``     ``kv_available_tokens``
``kvpressure_engine_kv_cache_evictable_...``   ``kv_evictable_tokens``
``kvpressure_engine_requests_running``         ``num_running_reqs`` → ``num_requests_running``
``kvpressure_engine_requests_waiting``         ``num_queue_reqs`` → ``num_requests_waiting``
``kvpressure_engine_preemptions_total``        ``num_retracted_requests_total`` (retractions
                                               free KV for other requests: SGLang's
                                               preemption)
``kvpressure_engine_prompt_tokens_total``      ``prompt_tokens_total``
``kvpressure_engine_generation_tokens_total``  ``generation_tokens_total``
``kvpressure_engine_prefix_cache_hit_...``     ``cached_tokens_total`` (all sources)
``kvpressure_engine_prefix_cache_tier_hit...`` ``cached_tokens_total{cache_source}``: device,
                                               host → kv_host, storage_* → kv_disk
``kvpressure_engine_prefix_cache_hit_ratio``   ``cache_hit_rate``
``kvpressure_engine_requests_completed_total`` ``num_requests_total``
``kvpressure_engine_kv_offload_tokens_total``  HiCache ``evicted_tokens_total`` (kv_host,
                                               offload: GPU to CPU) and
                                               ``load_back_tokens_total`` (kv_host, onboard)
``kvpressure_memory_tier_bytes``               not exported (HiCache reports host tokens:
                                               ``hicache_host_used_tokens``)
``kvpressure_engine_latency_seconds{phase}``   ``time_to_first_token_seconds`` (ttft),
                                               ``inter_token_latency_seconds`` (itl),
                                               ``e2e_request_latency_seconds`` (e2e),
                                               ``queue_time_seconds`` (queue)
=============================================  =================================================

Cannot provide: queried prefix tokens (SGLang counts hits, not lookups), prefill and
decode durations per request, KV block size and bytes, admission rejections.
LMCache and KVBM tier rules (:mod:`.kvtiers`) are appended.
"""

from __future__ import annotations

from kvpressure.agent.samplers.engines import kvtiers
from kvpressure.agent.samplers.engines.normalize import RATIO, EngineMapping, Rule, latency

MAPPING = EngineMapping(
    engine_type="sglang",
    prefixes=("sglang:", "sglang_"),
    model_labels=("model_name", "name", "model"),
    rules=(
        Rule(
            "kvpressure_engine_kv_cache_usage_ratio",
            ("sglang:token_usage",),
            combine="max",
            valid=RATIO,
        ),
        Rule(
            "kvpressure_engine_kv_cache_used_tokens",
            ("sglang:kv_used_tokens", "sglang:num_used_tokens"),
        ),
        Rule("kvpressure_engine_kv_cache_capacity_tokens", ("sglang:max_total_num_tokens",)),
        Rule("kvpressure_engine_kv_cache_free_tokens", ("sglang:kv_available_tokens",)),
        Rule("kvpressure_engine_kv_cache_evictable_tokens", ("sglang:kv_evictable_tokens",)),
        Rule(
            "kvpressure_engine_requests_running",
            ("sglang:num_running_reqs", "sglang:num_requests_running"),
        ),
        Rule(
            "kvpressure_engine_requests_waiting",
            ("sglang:num_queue_reqs", "sglang:num_requests_waiting"),
        ),
        Rule(
            "kvpressure_engine_preemptions_total",
            ("sglang:num_retracted_requests",),
            kind="counter",
        ),
        Rule("kvpressure_engine_prompt_tokens_total", ("sglang:prompt_tokens",), kind="counter"),
        Rule(
            "kvpressure_engine_generation_tokens_total",
            ("sglang:generation_tokens",),
            kind="counter",
        ),
        Rule(
            "kvpressure_engine_prefix_cache_hit_tokens_total",
            ("sglang:cached_tokens",),
            kind="counter",
        ),
        kvtiers.tier_hits("device", "sglang:cached_tokens{cache_source=device}"),
        kvtiers.tier_hits("kv_host", "sglang:cached_tokens{cache_source=host}"),
        kvtiers.tier_hits("kv_disk", "sglang:cached_tokens{cache_source=storage*}"),
        Rule(
            "kvpressure_engine_prefix_cache_hit_ratio",
            ("sglang:cache_hit_rate",),
            combine="max",
            valid=RATIO,
        ),
        Rule(
            "kvpressure_engine_requests_completed_total",
            ("sglang:num_requests",),
            kind="counter",
        ),
        kvtiers.moved(kvtiers.OFFLOAD_TOKENS, "kv_host", "offload", "sglang:evicted_tokens"),
        kvtiers.moved(kvtiers.OFFLOAD_TOKENS, "kv_host", "onboard", "sglang:load_back_tokens"),
        latency("ttft", "sglang:time_to_first_token_seconds"),
        latency("itl", "sglang:inter_token_latency_seconds"),
        latency("e2e", "sglang:e2e_request_latency_seconds"),
        latency("queue", "sglang:queue_time_seconds"),
        *kvtiers.TIER_RULES,
    ),
)
"""The SGLang :class:`~agent.samplers.engines.normalize.EngineMapping`."""
