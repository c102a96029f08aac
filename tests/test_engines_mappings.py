"""Every engine mapping against its fixture: golden normalized output and the key values.

Each engine is scraped twice: first its fixture with every histogram sample zeroed (at
t=0), then the fixture itself (at t=30), so the 60 s latency window holds the fixture's
whole histograms and the golden files show the windowed quantiles. Regenerate with
``KVPRESSURE_UPDATE_GOLDEN=1`` and review the diff.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from kvpressure.agent.catalogue import CATALOGUE, metric_of_sample
from kvpressure.agent.samplers.engines import ENGINE_TYPES, engine_type_from_families
from kvpressure.agent.samplers.engines.exposition import parse_exposition
from kvpressure.agent.samplers.engines.normalize import (
    EngineMapping,
    NormalizedScrape,
    Normalizer,
    Rule,
    parse_source,
)
from kvpressure.agent.samples import Sample

FIXTURES = Path(__file__).parent / "fixtures"
ENGINES = FIXTURES / "engines"
CASES = FIXTURES / "cases"
GOLDEN = ENGINES / "golden"
ZERO = re.compile(r"^(\S+_(?:bucket|count|sum)(?:\{.*\})?) \S+$", re.MULTILINE)

# Catalogue entries whose label list does not yet include what the KV-tier sources add:
# kvpressure_memory_tier_bytes (host area) gets engine/instance for tier=kv_* series.
PENDING_LABELS: dict[str, set[str]] = {}

FIXTURE_OF = {
    "vllm": "vllm/0.32.0-cpu-kv-metrics-load.txt",
    "sglang": "sglang/0.5.x.txt",
    "tgi": "tgi/3.x.txt",
    "trtllm": "trtllm/1.x.txt",
    "triton": "triton/25.x-trtllm.txt",
    "lmcache": "lmcache/0.3.x.txt",
    "kvbm": "kvbm/0.x.txt",
}


def zeroed(body: str) -> str:
    """The body with every histogram bucket, count and sum at 0 (an empty window start)."""
    return ZERO.sub(r"\1 0", body)


def two_scrapes(etype: str, body: str, first: str | None = None) -> NormalizedScrape:
    n = Normalizer(ENGINE_TYPES[etype], "e1", "h:1")
    n.normalize(parse_exposition(zeroed(body) if first is None else first, None), now=0.0)
    return n.normalize(parse_exposition(body, None), now=30.0)


def get(samples: list[Sample], name: str, **labels: str) -> float | None:
    found = [
        s.value
        for s in samples
        if s.name == name and all(dict(s.labels).get(k) == v for k, v in labels.items())
    ]
    assert len(found) <= 1, (name, labels, found)
    return found[0] if found else None


def render(samples: list[Sample]) -> str:
    lines = []
    for s in sorted(samples, key=lambda x: (x.name, x.labels)):
        labels = ",".join(f'{k}="{v}"' for k, v in s.labels)
        lines.append(f"{s.name}{{{labels}}} {s.value!r}")
    return "\n".join(lines) + "\n"


def check_golden(samples: list[Sample], name: str) -> None:
    got = render(samples)
    path = GOLDEN / name
    if os.environ.get("KVPRESSURE_UPDATE_GOLDEN"):
        path.write_text(got)
    assert got == path.read_text(), f"golden {name} differs; regenerate and review"


def assert_catalogued(samples: list[Sample]) -> None:
    for s in samples:
        metric = metric_of_sample(s.name)
        assert metric is not None, s
        allowed = set(metric.labels) | PENDING_LABELS.get(metric.name, set())
        if s.name == metric.name + "_bucket":
            allowed.add("le")
        assert {k for k, _ in s.labels} <= allowed, s


# --- golden per engine ----------------------------------------------------------------------


@pytest.mark.parametrize("etype", sorted(FIXTURE_OF))
def test_golden(etype: str) -> None:
    body = (ENGINES / FIXTURE_OF[etype]).read_text()
    result = parse_exposition(body, None)
    assert result.error_count == 0
    assert engine_type_from_families(result.family_names()) == etype
    scrape = two_scrapes(etype, body)
    assert scrape.samples
    assert not scrape.invalid
    assert_catalogued(scrape.samples)
    check_golden(scrape.samples, f"{etype}_{Path(FIXTURE_OF[etype]).stem}.txt")


def test_vllm_real_capture_windowed_latency_and_capacity() -> None:
    idle = (ENGINES / "vllm" / "0.32.0-cpu-kv-metrics-idle.txt").read_text()
    load = (ENGINES / "vllm" / "0.32.0-cpu-kv-metrics-load.txt").read_text()
    s = two_scrapes("vllm", load, first=idle).samples
    m = {"model": "tiny"}
    p50 = get(s, "kvpressure_engine_latency_seconds", phase="ttft", percentile="p50", **m)
    p99 = get(s, "kvpressure_engine_latency_seconds", phase="ttft", percentile="p99", **m)
    assert p50 is not None and p99 is not None and p99 > p50
    for phase in ("itl", "e2e", "queue", "prefill", "decode", "inference"):
        assert get(s, "kvpressure_engine_latency_seconds", phase=phase, percentile="p95", **m)
    assert get(
        s, "kvpressure_engine_kv_block_residency_seconds", event="lifetime", percentile="p50"
    )
    assert get(s, "kvpressure_engine_kv_cache_capacity_tokens", **m) == 6144
    assert get(s, "kvpressure_engine_kv_cache_block_size_tokens", **m) == 128
    assert get(s, "kvpressure_engine_kv_cache_blocks", state="total", **m) == 48
    assert get(s, "kvpressure_engine_kv_cache_capacity_bytes", **m) == 12 * 1024 * 1024
    assert get(s, "kvpressure_engine_kv_cache_max_concurrency", **m) == 3
    assert get(s, "kvpressure_engine_requests_waiting_by_reason", reason="capacity", **m) == 9
    assert get(s, "kvpressure_engine_requests_rejected_total", reason="max_num_queued_reqs") == 0
    # hit / queried tokens between the two scrapes
    ratio = get(s, "kvpressure_engine_prefix_cache_hit_ratio", **m)
    assert ratio is not None and 0 <= ratio <= 1


def test_vllm_single_scrape_has_no_quantiles() -> None:
    n = Normalizer(ENGINE_TYPES["vllm"], "e1", "h:1")
    body = (ENGINES / "vllm" / "0.32.0-cpu-kv-metrics-load.txt").read_text()
    scrape = n.normalize(parse_exposition(body, None), now=0.0)
    assert not scrape.has("kvpressure_engine_latency_seconds")
    assert not scrape.has("kvpressure_engine_prefix_cache_hit_ratio")


def test_vllm_latency_survives_an_engine_restart() -> None:
    body = (ENGINES / "vllm" / "0.32.0-cpu-kv-metrics-load.txt").read_text()
    n = Normalizer(ENGINE_TYPES["vllm"], "e1", "h:1")
    n.normalize(parse_exposition(zeroed(body), None), now=0.0)
    n.normalize(parse_exposition(body, None), now=10.0)
    # restart: every histogram back to zero, then a few observations
    after = n.normalize(parse_exposition(zeroed(body), None), now=20.0)
    assert after.restarted
    assert not after.has("kvpressure_engine_latency_seconds")  # empty window, no quantile
    for s in after.samples:
        assert s.value >= 0


def test_vllm_deprecated_offload_bytes_by_transfer_type() -> None:
    body = (
        "# TYPE vllm:kv_offload_total_bytes_total counter\n"
        'vllm:kv_offload_total_bytes_total{model_name="m",transfer_type="GPU_to_CPU"} 100\n'
        'vllm:kv_offload_total_bytes_total{model_name="m",transfer_type="CPU_to_GPU"} 40\n'
        "# TYPE vllm:kv_offload_cpu_cache_usage_perc gauge\n"
        'vllm:kv_offload_cpu_cache_usage_perc{model_name="m"} 0.25\n'
    )
    s = two_scrapes("vllm", body).samples
    name = "kvpressure_engine_kv_offload_bytes_total"
    assert get(s, name, tier="kv_host", direction="offload", model="m") == 100
    assert get(s, name, tier="kv_host", direction="onboard", model="m") == 40
    assert get(s, "kvpressure_engine_kv_tier_usage_ratio", tier="kv_host", model="m") == 0.25


def test_vllm_with_lmcache_counts_external_hits_once() -> None:
    vllm = (
        "# TYPE vllm:external_prefix_cache_hits_total counter\n"
        'vllm:external_prefix_cache_hits_total{engine="0",model_name="m"} 500\n'
    )
    lmcache = (
        "# TYPE lmcache:num_hit_tokens_total counter\n"
        'lmcache:num_hit_tokens_total{model_name="m",worker_id="0"} 480\n'
        "# TYPE lmcache:local_cache_usage gauge\n"
        'lmcache:local_cache_usage{model_name="m",worker_id="0"} 1024\n'
    )
    s = two_scrapes("vllm", vllm + lmcache).samples
    assert get(s, "kvpressure_engine_external_prefix_cache_hit_tokens_total", model="m") == 500
    assert get(s, "kvpressure_memory_tier_bytes", tier="kv_host", state="used") == 1024
    s = two_scrapes("vllm", lmcache).samples  # no vLLM counter: LMCache's
    assert get(s, "kvpressure_engine_external_prefix_cache_hit_tokens_total", model="m") == 480


# --- SGLang (case 14) -----------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["colon", "underscore"])
def test_case14_sglang_mapping_gives_the_same_values_for_both_spellings(variant: str) -> None:
    body = (CASES / f"14-sglang-prefix-churn.{variant}.input.txt").read_text()
    s = two_scrapes("sglang", body).samples
    m = {"model": "/models/example-model"}
    assert get(s, "kvpressure_engine_kv_cache_capacity_tokens", **m) == 570979
    assert get(s, "kvpressure_engine_requests_running", **m) == 0
    assert get(s, "kvpressure_engine_requests_waiting", **m) == 0
    assert get(s, "kvpressure_engine_kv_cache_usage_ratio", **m) == 0
    assert get(s, "kvpressure_engine_prompt_tokens_total", **m) == 230794


def test_sglang_fixture_values() -> None:
    s = two_scrapes("sglang", (ENGINES / "sglang" / "0.5.x.txt").read_text()).samples
    m = {"model": "meta-llama/Llama-3.1-8B-Instruct"}
    assert get(s, "kvpressure_engine_kv_cache_evictable_tokens", **m) == 120979
    assert get(s, "kvpressure_engine_kv_cache_free_tokens", **m) == 300000
    assert get(s, "kvpressure_engine_preemptions_total", **m) == 37
    tier = "kvpressure_engine_prefix_cache_tier_hit_tokens_total"
    assert get(s, tier, tier="kv_disk", **m) == 80000  # cache_source=storage_file
    assert get(s, "kvpressure_engine_prefix_cache_hit_ratio", **m) == 0.41
    offload = "kvpressure_engine_kv_offload_tokens_total"
    assert get(s, offload, tier="kv_host", direction="offload", **m) == 910000
    assert get(s, "kvpressure_engine_latency_seconds", phase="ttft", percentile="p99", **m)
    assert get(s, "kvpressure_engine_prefix_cache_queried_tokens_total") is None  # not exported


# --- TGI (case 15) ----------------------------------------------------------------------------


def test_tgi_has_no_kv_metric_and_queue_batch_values() -> None:
    s = two_scrapes("tgi", (ENGINES / "tgi" / "3.x.txt").read_text()).samples
    assert get(s, "kvpressure_engine_requests_waiting") == 14
    assert get(s, "kvpressure_engine_requests_running") == 32
    assert get(s, "kvpressure_engine_batch_max_tokens") == 61440
    assert not [x for x in s if x.name.startswith("kvpressure_engine_kv_")]  # absent, not 0
    assert get(s, "kvpressure_engine_latency_seconds", phase="ttft", percentile="p50") is None


def test_case15_tgi_method_label_with_braces_matches() -> None:
    body = (CASES / "15-label-values-with-braces.input.txt").read_text()
    body = body.replace("tgi_batch_inference_duration", "tgi_batch_forward_duration")
    s = two_scrapes("tgi", body).samples
    p50 = get(s, "kvpressure_engine_latency_seconds", phase="batch_prefill", percentile="p50")
    # 215 observations: rank 107.5 is in (0.02, 0.05] after 112 in (0.01, 0.02] -> in 2nd
    assert p50 is not None and 0.01 < p50 <= 0.02
    assert get(s, "kvpressure_engine_requests_waiting") == 0


# --- TensorRT-LLM and Triton --------------------------------------------------------------------


def test_trtllm_blocks_to_tokens_and_metrics_path() -> None:
    assert ENGINE_TYPES["trtllm"].metrics_path == "/prometheus/metrics"
    s = two_scrapes("trtllm", (ENGINES / "trtllm" / "1.x.txt").read_text()).samples
    m = {"model": "nvidia/Llama-3.1-8B-Instruct-FP8"}
    assert get(s, "kvpressure_engine_kv_cache_capacity_tokens", **m) == 4096 * 32
    assert get(s, "kvpressure_engine_kv_cache_used_tokens", **m) == 3584 * 32
    assert get(s, "kvpressure_engine_kv_cache_usage_ratio", **m) == 0.875
    assert get(s, "kvpressure_engine_requests_paused", **m) == 3
    assert get(s, "kvpressure_engine_requests_completed_total", **m) == 1500  # both reasons
    name = "kvpressure_engine_kv_offload_bytes_total"
    assert get(s, name, tier="kv_host", direction="offload", **m) == 8589934592


def test_trtllm_dynamo_colon_spelling() -> None:
    body = (ENGINES / "trtllm" / "1.x.txt").read_text().replace("trtllm_", "trtllm:")
    assert engine_type_from_families(parse_exposition(body, None).family_names()) == "trtllm"
    colon = render(two_scrapes("trtllm", body).samples)
    under = render(two_scrapes("trtllm", (ENGINES / "trtllm" / "1.x.txt").read_text()).samples)
    assert colon == under


def test_triton_microseconds_to_seconds_per_model_and_ms_histogram() -> None:
    s = two_scrapes("triton", (ENGINES / "triton" / "25.x-trtllm.txt").read_text()).samples
    name = "kvpressure_engine_request_duration_seconds_total"
    assert get(s, name, phase="queue", model="tensorrt_llm") == pytest.approx(1800.0)
    assert get(s, name, phase="request", model="ensemble") == pytest.approx(9600.0)
    assert get(s, "kvpressure_engine_kv_cache_capacity_tokens", model="tensorrt_llm") == 6240 * 64
    assert get(s, "kvpressure_engine_kv_cache_usage_ratio", model="tensorrt_llm") == 0.9375
    assert get(s, "kvpressure_engine_requests_waiting", model="tensorrt_llm") == 5
    assert get(s, "kvpressure_engine_requests_waiting", model="ensemble") is None  # 0 pending
    # 1200 first responses; rank 600 lies in (100, 500] ms -> seconds
    p50 = get(s, "kvpressure_engine_latency_seconds", phase="ttft", percentile="p50")
    assert p50 is not None and 0.1 < p50 <= 0.5


def test_triton_waiting_falls_back_to_pending_request_count() -> None:
    body = (
        "# TYPE nv_inference_pending_request_count gauge\n"
        'nv_inference_pending_request_count{model="tensorrt_llm",version="1"} 7\n'
        "# TYPE nv_trt_llm_request_metrics gauge\n"
        'nv_trt_llm_request_metrics{model="tensorrt_llm",request_type="active",version="1"} 3\n'
    )
    s = two_scrapes("triton", body).samples
    assert get(s, "kvpressure_engine_requests_waiting", model="tensorrt_llm") == 7


# --- KV tier sources ------------------------------------------------------------------------------


def test_lmcache_tiers_and_shared_remote_store() -> None:
    s = two_scrapes("lmcache", (ENGINES / "lmcache" / "0.3.x.txt").read_text()).samples
    tier = "kvpressure_memory_tier_bytes"
    assert get(s, tier, tier="kv_host", state="used") == pytest.approx(2.1474836e10 + 2.0e10)
    assert get(s, tier, tier="kv_remote", state="used") == 5.0e10  # max, not the sum
    for x in s:
        if x.name == tier:
            assert "model" not in dict(x.labels)
    evictions = "kvpressure_engine_kv_tier_evictions_total"
    assert get(s, evictions, tier="kv_host", model="meta-llama/Llama-3.1-8B-Instruct") == 2300


def test_kvbm_blocks_per_tier_and_direction() -> None:
    s = two_scrapes("kvbm", (ENGINES / "kvbm" / "0.x.txt").read_text()).samples
    name = "kvpressure_engine_kv_offload_blocks_total"
    assert get(s, name, tier="kv_host", direction="offload") == 96000
    assert get(s, name, tier="kv_disk", direction="offload") == 40000 + 2000  # h2d + d2d
    assert get(s, name, tier="kv_disk", direction="onboard") == 8400
    assert get(s, "kvpressure_engine_kv_tier_hit_ratio", tier="kv_disk") == 0.18


def test_counters_of_one_canonical_from_two_sources_reset_independently() -> None:
    body = (ENGINES / "kvbm" / "0.x.txt").read_text()
    n = Normalizer(ENGINE_TYPES["kvbm"], "e1", "h:1")
    n.normalize(parse_exposition(body, None), now=0.0)
    later = body.replace("kvbm_offload_blocks_h2d 40000", "kvbm_offload_blocks_h2d 40010")
    s = n.normalize(parse_exposition(later, None), now=1.0).samples
    assert (
        get(s, "kvpressure_engine_kv_offload_blocks_total", tier="kv_disk", direction="offload")
        == 42010
    )
    assert n.restarts == 0


# --- table mechanics ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("vllm:x", ("vllm:x", ())),
        ("vllm:x{source=host}", ("vllm:x", (("source", "host"),))),
        ('m{a="1",b=2|3}', ("m", (("a", "1"), ("b", "2|3")))),
        ("m{broken}", ("m", ())),
    ],
)
def test_parse_source(source: str, expected: tuple[str, tuple[tuple[str, str], ...]]) -> None:
    assert parse_source(source) == expected


def test_a_rename_is_a_one_line_change() -> None:
    base = ENGINE_TYPES["vllm"]
    renamed = EngineMapping(
        "vllm",
        base.prefixes,
        rules=(
            Rule(
                "kvpressure_engine_requests_waiting",
                ("vllm:queue_depth", *("vllm:num_requests_waiting",)),
            ),
        ),
    )
    new = 'vllm:queue_depth{model_name="m"} 3\nvllm:num_requests_waiting{model_name="m"} 9\n'
    old = 'vllm:num_requests_waiting{model_name="m"} 9\n'
    n = Normalizer(renamed, "e", "h:1")
    assert (
        get(n.normalize(parse_exposition(new, None)).samples, "kvpressure_engine_requests_waiting")
        == 3
    )
    assert (
        get(n.normalize(parse_exposition(old, None)).samples, "kvpressure_engine_requests_waiting")
        == 9
    )


def test_every_mapping_emits_only_catalogue_names() -> None:
    for etype, mapping in ENGINE_TYPES.items():
        for rule in mapping.rules:
            assert rule.canonical in CATALOGUE, (etype, rule.canonical)
            metric = CATALOGUE[rule.canonical]
            extra = {k for k, _ in rule.out_labels} | {d for _, d in rule.keep_labels}
            if rule.kind == "histogram":
                extra.add("percentile")
            allowed = set(metric.labels) | PENDING_LABELS.get(rule.canonical, set())
            assert extra <= allowed, (etype, rule.canonical, extra)


def test_one_malformed_line_costs_only_itself() -> None:
    body = (ENGINES / "sglang" / "0.5.x.txt").read_text()
    bad = body.replace(
        'sglang:num_queue_reqs{engine_type="unified"',
        'sglang:num_queue_reqs{engine_type="uni"fied"',
    ).replace(
        'sglang:time_to_first_token_seconds_bucket{le="0.4",',
        'sglang:time_to_first_token_seconds_bucket{le="0.4" ',
    )
    result = parse_exposition(bad, None)
    assert result.error_count == 2
    good = {(s.name, s.labels): s.value for s in two_scrapes("sglang", body).samples}
    got = {(s.name, s.labels): s.value for s in two_scrapes("sglang", bad).samples}
    lost = set(good) - set(got)
    # the waiting gauge is gone; the TTFT histogram lost one bucket, which Prometheus'
    # monotonic rule absorbs, so its quantiles survive
    assert {name for name, _ in lost} == {"kvpressure_engine_requests_waiting"}
    assert all(got[k] == v for k, v in good.items() if k in got and "latency" not in k[0])
