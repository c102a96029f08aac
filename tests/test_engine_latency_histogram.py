"""Aggregatable engine latency (issue 16, point 4): one bucket layout per phase.

Every engine's latency histogram is re-exported as
``kvpressure_engine_request_latency_seconds{phase}`` in the OpenTelemetry GenAI advisory
buckets, re-bucketed conservatively (an engine bound that is not a target bound counts in
the next target bound above it) and reset-aware, so Prometheus can sum it across engines,
instances and pods.
"""

from __future__ import annotations

import bisect
import math
import shutil
import subprocess

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from kvpressure.agent.histograms import (
    GENAI_REQUEST_DURATION_BOUNDS_S,
    GENAI_TPOT_BOUNDS_S,
    GENAI_TTFT_BOUNDS_S,
    CumulativeHistogram,
    HistogramSnapshot,
    rebucket,
)
from kvpressure.agent.samplers.engines import ENGINE_TYPES
from kvpressure.agent.samplers.engines.exposition import parse_exposition
from kvpressure.agent.samplers.engines.normalize import (
    ENGINE_LATENCY_HISTOGRAM,
    PHASE_BUCKETS,
    Normalizer,
)
from kvpressure.agent.samples import Batch, Sample
from kvpressure.agent.state import AgentState, SamplerReport
from kvpressure.agent.timeline import Timeline
from kvpressure.exporters.prometheus import make_registry, render

INF = math.inf
H = ENGINE_LATENCY_HISTOGRAM


def test_layouts_are_the_otel_genai_advisory_buckets() -> None:
    # semconv "Semantic conventions for generative AI metrics", model server metrics
    assert GENAI_TTFT_BOUNDS_S[:4] == (0.001, 0.005, 0.01, 0.02) and GENAI_TTFT_BOUNDS_S[-1] == 10
    assert GENAI_TPOT_BOUNDS_S == (
        0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5
    )  # fmt: skip
    assert GENAI_REQUEST_DURATION_BOUNDS_S == tuple(0.01 * 2**i for i in range(14))
    assert PHASE_BUCKETS["ttft"] == GENAI_TTFT_BOUNDS_S
    assert PHASE_BUCKETS["itl"] == GENAI_TPOT_BOUNDS_S
    assert PHASE_BUCKETS["e2e"] == GENAI_REQUEST_DURATION_BOUNDS_S
    # every phase the mappings use has a layout
    phases = {
        dict(r.out_labels)["phase"]
        for m in ENGINE_TYPES.values()
        for r in m.rules
        if r.kind == "histogram" and r.canonical == "kvpressure_engine_latency_seconds"
    }
    assert phases <= PHASE_BUCKETS.keys()
    assert {"ttft", "itl", "e2e", "queue"} <= phases


def test_rebucket_moves_an_off_layout_bound_up_and_keeps_shared_bounds() -> None:
    # engine buckets 0.1, 0.2, 0.4, 3.0, 20, +Inf (cumulative 2, 7, 10, 11, 12, 13)
    engine = HistogramSnapshot((0.1, 0.2, 0.4, 3.0, 20.0, INF), (2, 7, 10, 11, 12, 13), 9.5)
    out = rebucket(engine, (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0))
    assert out.bounds == (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, INF)
    # 0.1 shared: exact; 0.25 <- engine 0.2; 0.5 and 1.0 <- 0.4; 2.5 <- 0.4 (3.0 is above);
    # 5 and 10 <- 3.0; engine 20 is above the last target bound: +Inf
    assert out.cumulative == (2, 7, 10, 10, 10, 11, 11, 13)
    assert out.count == 13 and out.sum == 9.5


def test_rebucket_matches_scaled_milliseconds_and_zero_below_the_first_engine_bound() -> None:
    # Triton's microsecond/millisecond buckets scaled to seconds are not exact binary floats
    engine = HistogramSnapshot((100 * 1e-3, 300 * 1e-3, INF), (4, 6, 8))
    out = rebucket(engine, (0.05, 0.1, 0.3))
    assert out.cumulative == (0, 4, 6, 8)


@settings(max_examples=200, deadline=None)
@given(
    obs=st.lists(st.floats(0.0005, 200.0, allow_nan=False), min_size=1, max_size=200),
    engine_bounds=st.lists(st.floats(0.001, 100.0), min_size=1, max_size=20, unique=True),
)
def test_rebucketed_counts_never_exceed_the_truth(
    obs: list[float], engine_bounds: list[float]
) -> None:
    # each target bucket counts only observations surely <= its bound (so quantiles err only
    # upwards), and exactly those where the engine has the same bound
    ebounds = (*sorted(engine_bounds), INF)
    engine = HistogramSnapshot(ebounds, tuple(float(sum(o <= b for o in obs)) for b in ebounds))
    target = GENAI_REQUEST_DURATION_BOUNDS_S
    out = rebucket(engine, target)
    s = sorted(obs)
    for t, c in zip(target, out.cumulative, strict=False):
        truth = bisect.bisect_right(s, t)
        assert c <= truth
        if t in ebounds:
            assert c == truth
    assert out.count == len(obs)
    assert list(out.cumulative) == sorted(out.cumulative)


def test_cumulative_export_keeps_counting_through_an_engine_restart() -> None:
    bounds = (0.1, 1.0, INF)
    c = CumulativeHistogram()
    assert c.update(HistogramSnapshot(bounds, (1, 3, 4), 2.0)) is False
    assert c.update(HistogramSnapshot(bounds, (2, 5, 6), 3.0)) is False
    # restart: the engine starts again from zero and saw 1 observation
    assert c.update(HistogramSnapshot(bounds, (0, 1, 1), 0.5)) is True
    total = c.total
    assert total is not None
    assert total.cumulative == (2, 6, 7) and total.sum == 3.5
    assert c.resets == 1


# --- through the normalizer -----------------------------------------------------------------


def _hist(name: str, model: str, buckets: dict[str, float], total: float) -> str:
    lines = [f"# TYPE {name} histogram"]
    for le, v in buckets.items():
        lines.append(f'{name}_bucket{{le="{le}",model_name="{model}"}} {v}')
    lines.append(f'{name}_count{{model_name="{model}"}} {buckets["+Inf"]}')
    lines.append(f'{name}_sum{{model_name="{model}"}} {total}')
    return "\n".join(lines) + "\n"


def _series(samples: list[Sample], name: str, **labels: str) -> dict[str, float]:
    """``le`` -> value of the ``name`` samples carrying ``labels``."""
    return {
        dict(s.labels).get("le", ""): s.value
        for s in samples
        if s.name == name and all(dict(s.labels).get(k) == v for k, v in labels.items())
    }


def test_two_engines_with_different_buckets_share_one_layout_and_sum() -> None:
    vllm = Normalizer(ENGINE_TYPES["vllm"], "vllm", "a:8000")
    sglang = Normalizer(ENGINE_TYPES["sglang"], "sglang", "b:30000")
    v_body = _hist(
        "vllm:time_to_first_token_seconds",
        "m",
        {"0.02": 1, "0.04": 3, "0.1": 6, "0.5": 9, "+Inf": 10},
        2.0,
    )
    s_body = _hist(
        "sglang:time_to_first_token_seconds",
        "m",
        {"0.1": 2, "0.2": 7, "0.4": 10, "+Inf": 10},
        1.5,
    )
    v = vllm.normalize(parse_exposition(v_body, None), now=0.0).samples
    s = sglang.normalize(parse_exposition(s_body, None), now=0.0).samples
    vb = _series(v, H + "_bucket", phase="ttft", model="m", engine="vllm")
    sb = _series(s, H + "_bucket", phase="ttft", model="m", engine="sglang")
    layout = [repr(b) for b in GENAI_TTFT_BOUNDS_S] + ["+Inf"]
    assert sorted(vb) == sorted(layout) and sorted(sb) == sorted(layout)
    # sum by (le): what Prometheus does across instances, now exact because le sets agree
    summed = {le: vb[le] + sb[le] for le in layout}
    assert summed["0.1"] == 6 + 2
    assert summed["0.25"] == 6 + 7  # vLLM's 0.1 and SGLang's 0.2 are the last bounds <= 0.25
    assert summed["0.5"] == 9 + 10
    assert summed["+Inf"] == 20
    assert _series(v, H + "_count", phase="ttft")[""] == 10
    assert _series(s, H + "_sum", phase="ttft")[""] == 1.5
    # beside the windowed percentile gauges (one scrape: no window yet, no gauge)
    assert not any(x.name == "kvpressure_engine_latency_seconds" for x in v)


def test_normalizer_export_is_reset_aware_and_never_decreases() -> None:
    n = Normalizer(ENGINE_TYPES["vllm"], "vllm", "a:8000")
    name = "vllm:e2e_request_latency_seconds"
    before = _hist(name, "m", {"0.5": 3, "5.0": 8, "+Inf": 9}, 20.0)
    after_restart = _hist(name, "m", {"0.5": 1, "5.0": 1, "+Inf": 1}, 0.3)
    first = n.normalize(parse_exposition(before, None), now=0.0).samples
    second = n.normalize(parse_exposition(after_restart, None), now=15.0)
    assert second.restarted
    b1 = _series(first, H + "_bucket", phase="e2e")
    b2 = _series(second.samples, H + "_bucket", phase="e2e")
    assert b2["+Inf"] == 10 and b2["0.64"] == 4  # 0.5 -> 0.64 (next target bound up)
    assert all(b2[le] >= b1[le] for le in b1)
    assert _series(second.samples, H + "_sum", phase="e2e")[""] == pytest.approx(20.3)


def test_an_impossible_sum_is_left_out_and_the_buckets_kept() -> None:
    # hypothesis found a Triton-style exposition whose _sum is -1: the re-export carried it
    n = Normalizer(ENGINE_TYPES["vllm"], "vllm", "a:8000")
    name = "vllm:time_to_first_token_seconds"
    for sum_s in (-1.0, math.inf):
        body = _hist(name, "m", {"0.1": 2, "1.0": 5, "+Inf": 6}, sum_s)
        out = n.normalize(parse_exposition(body, None), now=0.0).samples
        assert _series(out, H + "_count", phase="ttft")[""] == 6
        assert _series(out, H + "_bucket", phase="ttft")["0.1"] == 2
        assert _series(out, H + "_sum", phase="ttft") == {}


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed")
def test_exported_family_is_a_histogram_that_promtool_accepts() -> None:
    n = Normalizer(ENGINE_TYPES["vllm"], "vllm", "a:8000")
    body = _hist(
        "vllm:inter_token_latency_seconds",
        "m",
        {"0.01": 5, "0.025": 9, "80.0": 10, "+Inf": 10},
        0.4,
    )
    batch = Batch(samples=n.normalize(parse_exposition(body, None), now=0.0).samples)
    state = AgentState(Timeline())
    state.publish(SamplerReport("engines", 1.0, 0.001, True, "", batch))
    text = render(make_registry(state), None)[0]
    fams = {f.name: f for f in text_string_to_metric_families(text.decode())}
    fam = fams[H]
    assert fam.type == "histogram"
    les = [s.labels["le"] for s in fam.samples if s.name == H + "_bucket"]
    assert les == [repr(b) for b in GENAI_TPOT_BOUNDS_S] + ["+Inf"]
    # vLLM's 80 s bucket is beyond the TPOT layout's 2.5 s: it lands in +Inf only
    inf = [s.value for s in fam.samples if s.name == H + "_bucket" and s.labels["le"] == "+Inf"]
    top = [s.value for s in fam.samples if s.name == H + "_bucket" and s.labels["le"] == "2.5"]
    assert inf == [10] and top == [9]
    r = subprocess.run(
        ["promtool", "check", "metrics"], input=text, capture_output=True, check=False
    )
    assert r.returncode == 0, r.stdout.decode() + r.stderr.decode()
