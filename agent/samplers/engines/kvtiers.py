"""KV-cache tier sources: LMCache and NVIDIA Dynamo's KV Block Manager (KVBM).

Neither is an engine: LMCache runs inside vLLM (or SGLang) and its ``lmcache:*`` families
appear in the engine's own ``/metrics`` (through the shared Prometheus multiprocess
directory); KVBM serves ``kvbm_*`` on a port of its own (``DYN_KVBM_METRICS_PORT``,
6880 in Dynamo's recipes). Their rules are therefore appended to the vLLM, SGLang and
TensorRT-LLM mappings, and also form two stand-alone mappings (``lmcache``, ``kvbm``) for
an endpoint that serves only them. Tiers are named as in ``kvpressure_memory_tier_bytes``:
``kv_host`` (CPU DRAM), ``kv_disk`` (local disk/NVMe), ``kv_remote`` (remote store).

Sources: LMCache's metrics reference (``docs/source/production/observability/metrics.rst``)
and Dynamo's KVBM metric names (``kvbm_offload_blocks_d2h`` ... in its runtime metric
constants and KVBM guides). Fixtures: ``tests/fixtures/engines/lmcache/`` and
``tests/fixtures/engines/kvbm/`` (constructed from those documents).

LMCache (``lmcache:`` prefix, counters exported with ``_total``; labels ``model_name``,
``worker_id``, combined away):

==================================================  ===========================================
catalogue metric                                    LMCache source
==================================================  ===========================================
``kvpressure_memory_tier_bytes{tier,state=used}``   ``local_cache_usage`` (kv_host),
                                                    ``local_storage_usage`` (kv_disk), summed
                                                    over workers; ``remote_cache_usage``
                                                    (kv_remote, max: a shared store), bytes;
                                                    labels ``engine``, ``instance`` (no model)
``kvpressure_engine_prefix_cache_tier_hit_...``     ``num_l2_hit_tokens`` (kv_host),
                                                    ``num_l3_hit_tokens`` (kv_disk),
                                                    ``num_remote_hit_tokens`` (kv_remote)
``kvpressure_engine_kv_offload_bytes_total``        ``num_remote_write_bytes`` (kv_remote,
                                                    offload), ``num_remote_read_bytes``
                                                    (kv_remote, onboard)
``kvpressure_engine_kv_tier_evictions_total``       ``local_cpu_evict_count`` (kv_host)
``kvpressure_engine_kv_tier_hit_ratio``             ``retrieve_hit_rate`` (tier=external)
``kvpressure_engine_external_prefix_cache_...``     ``num_requested_tokens`` (queried),
                                                    ``num_hit_tokens`` (hit); in the vLLM
                                                    mapping only when vLLM's own external
                                                    counters are absent
==================================================  ===========================================

KVBM (``kvbm_`` prefix, blocks; no model label):

==================================================  ===========================================
catalogue metric                                    KVBM source
==================================================  ===========================================
``kvpressure_engine_kv_offload_blocks_total``       ``offload_blocks_d2h`` (kv_host, offload),
                                                    ``offload_blocks_h2d`` + ``..._d2d``
                                                    (kv_disk, offload), ``onboard_blocks_h2d``
                                                    (kv_host, onboard), ``onboard_blocks_d2d``
                                                    (kv_disk, onboard: disk to device)
``kvpressure_engine_kv_tier_hit_ratio``             ``host_cache_hit_rate`` (kv_host),
                                                    ``disk_cache_hit_rate`` (kv_disk)
``kvpressure_engine_external_prefix_cache_hit...``  ``matched_tokens``
==================================================  ===========================================

Cannot provide: KVBM exports no tier sizes (``DYN_KVBM_CPU_CACHE_GB`` is configuration, not
a metric) and no bytes, so ``kvpressure_memory_tier_bytes`` and offload bytes stay absent
for it; LMCache exports no tier capacity (``state=total``).
"""

from __future__ import annotations

from typing import Final

from kvpressure.agent import catalogue as m
from kvpressure.agent.catalogue import SampleName
from kvpressure.agent.samplers.engines.normalize import RATIO, Combine, EngineMapping, Rule

TIER_BYTES: Final = m.MEMORY_TIER_BYTES
TIER_HITS: Final = m.ENGINE_PREFIX_CACHE_TIER_HIT_TOKENS_TOTAL
OFFLOAD_BYTES: Final = m.ENGINE_KV_OFFLOAD_BYTES_TOTAL
OFFLOAD_BLOCKS: Final = m.ENGINE_KV_OFFLOAD_BLOCKS_TOTAL
OFFLOAD_TOKENS: Final = m.ENGINE_KV_OFFLOAD_TOKENS_TOTAL
TIER_EVICTIONS: Final = m.ENGINE_KV_TIER_EVICTIONS_TOTAL
TIER_HIT_RATIO: Final = m.ENGINE_KV_TIER_HIT_RATIO
TIER_USAGE: Final = m.ENGINE_KV_TIER_USAGE_RATIO
EXT_QUERIED: Final = m.ENGINE_EXTERNAL_PREFIX_CACHE_QUERIED_TOKENS_TOTAL
EXT_HITS: Final = m.ENGINE_EXTERNAL_PREFIX_CACHE_HIT_TOKENS_TOTAL


def tier_bytes(tier: str, *sources: str, combine: Combine = "sum") -> Rule:
    """A ``kvpressure_memory_tier_bytes{tier, state="used"}`` rule (no model label).

    Args:
        tier: ``kv_host``, ``kv_disk`` or ``kv_remote``.
        *sources: source families, first present wins.
        combine: ``sum`` for per-worker pools, ``max`` for a store every worker sees.
    """
    return Rule(
        TIER_BYTES,
        sources,
        combine=combine,
        out_labels=(("tier", tier), ("state", "used")),
        per_model=False,
    )


def moved(canonical: SampleName, tier: str, direction: str, *sources: str) -> Rule:
    """A counter of KV moved to (``offload``) or from (``onboard``) ``tier``."""
    return Rule(
        canonical,
        sources,
        kind="counter",
        out_labels=(("tier", tier), ("direction", direction)),
    )


def tier_hits(tier: str, *sources: str) -> Rule:
    """A ``kvpressure_engine_prefix_cache_tier_hit_tokens_total{tier}`` counter rule."""
    return Rule(TIER_HITS, sources, kind="counter", out_labels=(("tier", tier),))


def tier_ratio(canonical: SampleName, tier: str, *sources: str) -> Rule:
    """A 0-1 gauge rule with a ``tier`` label (max across ranks)."""
    return Rule(canonical, sources, combine="max", valid=RATIO, out_labels=(("tier", tier),))


LMCACHE_TIER_RULES: tuple[Rule, ...] = (
    tier_bytes("kv_host", "lmcache:local_cache_usage"),
    tier_bytes("kv_disk", "lmcache:local_storage_usage"),
    # every worker reports the same shared remote store: max, not sum
    tier_bytes("kv_remote", "lmcache:remote_cache_usage", combine="max"),
    tier_hits("kv_host", "lmcache:num_l2_hit_tokens"),
    tier_hits("kv_disk", "lmcache:num_l3_hit_tokens"),
    tier_hits("kv_remote", "lmcache:num_remote_hit_tokens"),
    moved(OFFLOAD_BYTES, "kv_remote", "offload", "lmcache:num_remote_write_bytes"),
    moved(OFFLOAD_BYTES, "kv_remote", "onboard", "lmcache:num_remote_read_bytes"),
    Rule(
        TIER_EVICTIONS,
        ("lmcache:local_cpu_evict_count",),
        kind="counter",
        out_labels=(("tier", "kv_host"),),
    ),
    tier_ratio(TIER_HIT_RATIO, "external", "lmcache:retrieve_hit_rate"),
)
"""LMCache rules that no engine metric overlaps (safe to append to any mapping)."""

KVBM_TIER_RULES: tuple[Rule, ...] = (
    moved(OFFLOAD_BLOCKS, "kv_host", "offload", "kvbm_offload_blocks_d2h"),
    moved(OFFLOAD_BLOCKS, "kv_disk", "offload", "kvbm_offload_blocks_h2d"),
    moved(OFFLOAD_BLOCKS, "kv_disk", "offload", "kvbm_offload_blocks_d2d"),
    moved(OFFLOAD_BLOCKS, "kv_host", "onboard", "kvbm_onboard_blocks_h2d"),
    moved(OFFLOAD_BLOCKS, "kv_disk", "onboard", "kvbm_onboard_blocks_d2d"),
    tier_ratio(TIER_HIT_RATIO, "kv_host", "kvbm_host_cache_hit_rate"),
    tier_ratio(TIER_HIT_RATIO, "kv_disk", "kvbm_disk_cache_hit_rate"),
)
"""KVBM rules that no engine metric overlaps (safe to append to any mapping)."""

TIER_RULES: tuple[Rule, ...] = LMCACHE_TIER_RULES + KVBM_TIER_RULES
"""Every tier rule, appended to the vLLM, SGLang and TensorRT-LLM mappings."""

LMCACHE_EXTERNAL = (
    Rule(EXT_QUERIED, ("lmcache:num_requested_tokens",), kind="counter"),
    Rule(EXT_HITS, ("lmcache:num_hit_tokens",), kind="counter"),
)
KVBM_EXTERNAL = (Rule(EXT_HITS, ("kvbm_matched_tokens",), kind="counter"),)

LMCACHE = EngineMapping(
    engine_type="lmcache",
    prefixes=("lmcache:", "lmcache_"),
    model_labels=("model_name", "model"),
    rules=LMCACHE_TIER_RULES + LMCACHE_EXTERNAL,
    reports_kv=False,
)
"""An endpoint serving only LMCache's metrics (its internal API server)."""

KVBM = EngineMapping(
    engine_type="kvbm",
    prefixes=("kvbm_",),
    model_labels=("model_name", "model"),
    rules=KVBM_TIER_RULES + KVBM_EXTERNAL,
    reports_kv=False,
)
"""Dynamo KVBM's own metrics endpoint (``DYN_KVBM_METRICS=true``, port 6880)."""
