"""The decode scenario's ground truth (``benchmarks/attribution/vllm_memory.py``): how the
clients' token streams say which requests stalled, and how the agent's verdicts are matched
to them by trace id. No server: the stream lines are in the shape vLLM 0.32's
``/v1/completions`` sends with ``stream`` and ``stream_options.include_usage``."""

from __future__ import annotations

import json
from types import ModuleType

import pytest
from vllm_support import load_bench


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_bench()


def _chunk(text: str, usage: dict[str, int] | None = None) -> str:
    choices = [{"index": 0, "text": text, "logprobs": None, "finish_reason": None}]
    doc = {"id": "cmpl-1", "object": "text_completion", "model": "tiny", "choices": choices}
    if usage is not None:
        doc = {**doc, "choices": [], "usage": usage}
    return "data: " + json.dumps(doc)


def test_the_stream_gives_each_token_chunks_time_and_the_usage_count(bench: ModuleType) -> None:
    lines = [
        (1.00, _chunk(" a")),
        (1.01, ""),
        (1.02, _chunk("")),  # no text: not a token
        (1.03, _chunk(" b")),
        (1.04, "data: {not json"),
        (2.50, _chunk(" c")),
        (2.51, _chunk("", usage={"prompt_tokens": 32, "completion_tokens": 3})),
        (2.52, "data: [DONE]"),
    ]
    times, tokens = bench._stream_times(lines)
    assert times == [1.00, 1.03, 2.50]
    assert tokens == 3


def test_a_stall_is_ten_median_gaps_and_at_least_a_quarter_second(bench: ModuleType) -> None:
    assert bench.stall_gap_s([0.01] * 50) == pytest.approx(0.25)
    assert bench.stall_gap_s([0.05] * 50 + [3.0]) == pytest.approx(0.5)
    assert bench.stall_gap_s([]) == pytest.approx(0.25)


def test_only_requests_the_stalls_slowed_count_and_verdicts_match_by_trace_id(
    bench: ModuleType,
) -> None:
    r = bench.VllmResult
    results = [
        r(0.0, 10.0, 0.02, 200, "", "a" * 32, 10.0, 0.0),  # never stalled
        r(0.0, 10.0, 0.02, 200, "", "b" * 32, 10.0, 1.0),  # stalled, 1.11x: not slowed
        r(0.0, 10.0, 0.02, 200, "", "c" * 32, 10.0, 6.0),  # 2.5x, flagged memory
        r(0.0, 10.0, 0.02, 200, "", "d" * 32, 10.0, 5.0),  # 2.0x, flagged compute
        r(0.0, 10.0, 0.02, 200, "", "e" * 32, 10.0, 4.0),  # 1.67x, not flagged
        r(0.0, 10.0, None, 0, "ConnectError", "f" * 32),  # failed: not counted
    ]
    attributions = [
        {"trace_id": "c" * 32, "cause": "memory"},
        {"trace_id": "d" * 32, "cause": "compute"},
        {"trace_id": "b" * 32, "cause": "memory"},
        {"trace_id": "0" * 32, "cause": "memory"},  # another request's
    ]
    t = bench.stall_truth(results, attributions)
    assert (t.requests, t.stalled, t.slowed) == (5, 4, 3)
    assert (t.flagged_slowed, t.memory_slowed, t.flagged_other) == (2, 1, 1)
    assert t.ratios == pytest.approx([1.0, 10 / 9, 10 / 6, 2.0, 2.5])
    assert "3 slowed >= 1.5x" in t.line()
