"""Slow-request detection: SLO, rolling baseline tail, warm-up, floor, phase choice."""

from __future__ import annotations

import pytest

from kvpressure.agent.attribution.detector import SlowDetector, quantile
from kvpressure.agent.requests.record import RequestRecord


def rec(ttft=None, e2e=None, engine="e", outcome="ok"):
    return RequestRecord(engine=engine, start=0.0, end=1.0, ttft_s=ttft, e2e_s=e2e,
                         outcome=outcome)  # fmt: skip


def test_quantile_matches_linear_interpolation():
    assert quantile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.5
    assert quantile([5.0], 0.99) == 5.0
    assert quantile(sorted(float(i) for i in range(101)), 0.95) == pytest.approx(95.0)
    with pytest.raises(ValueError):
        quantile([], 0.5)


def test_warm_up_uses_the_slo_only():
    d = SlowDetector(slo_ttft_s=2.0, baseline_min_requests=30)
    for _ in range(29):
        v = d.judge(rec(ttft=0.1))
        assert v is not None and not v.slow and v.basis == "slo" and v.threshold_s == 2.0
    v = d.judge(rec(ttft=1.0))  # 30th request: still judged against the SLO...
    assert v is not None and not v.slow and v.basis == "slo"
    v = d.judge(rec(ttft=1.0))  # ...31st: the 30 known requests make the baseline
    assert v is not None and v.slow and v.basis == "baseline"


def test_baseline_is_factor_times_the_tail_quantile():
    d = SlowDetector(slo_ttft_s=10.0, baseline_factor=1.5, baseline_quantile=0.95,
                     baseline_min_requests=30)  # fmt: skip
    for i in range(100):
        d.judge(rec(ttft=0.1 + 0.001 * i))  # 0.100 .. 0.199
    thr, basis = d.threshold("e", "ttft")
    p95 = quantile(sorted(0.1 + 0.001 * i for i in range(100)), 0.95)
    assert basis == "baseline"
    assert thr == pytest.approx(1.5 * p95, rel=0.02)
    assert not d.judge(rec(ttft=0.25)).slow
    assert d.judge(rec(ttft=0.35)).slow


def test_the_lower_threshold_wins():
    d = SlowDetector(slo_ttft_s=0.2, baseline_min_requests=5)
    for _ in range(10):
        d.judge(rec(ttft=0.15))  # baseline 1.5 x 0.15 = 0.225 > SLO 0.2
    assert d.threshold("e", "ttft") == (0.2, "slo")


def test_floor_keeps_jitter_on_a_fast_engine_from_counting():
    d = SlowDetector(baseline_min_requests=5, baseline_floor_s=0.05)
    for _ in range(10):
        d.judge(rec(ttft=0.002))
    assert d.threshold("e", "ttft") == (pytest.approx(0.052), "baseline")  # expected + floor
    assert not d.judge(rec(ttft=0.01)).slow


def test_slow_and_failed_requests_do_not_feed_the_baseline():
    d = SlowDetector(slo_ttft_s=1.0, baseline_min_requests=5)
    for _ in range(10):
        d.judge(rec(ttft=0.1))
    n = d.baseline_size("e", "ttft")
    assert d.judge(rec(ttft=5.0)).slow
    d.judge(rec(ttft=0.1, outcome="server_error"))
    assert d.baseline_size("e", "ttft") == n
    # a long incident does not move the threshold
    for _ in range(200):
        assert d.judge(rec(ttft=0.9)).slow


def test_e2e_when_ttft_unknown_and_separate_baselines_per_engine_and_phase():
    d = SlowDetector(slo_ttft_s=2.0, slo_e2e_s=30.0, baseline_min_requests=3)
    v = d.judge(rec(e2e=12.0))
    assert v.phase == "e2e" and v.threshold_s == 30.0 and not v.slow
    assert d.judge(rec()) is None
    for _ in range(5):
        d.judge(rec(ttft=0.1, engine="a"))
    assert d.threshold("a", "ttft")[1] == "baseline"
    assert d.threshold("b", "ttft") == (2.0, "slo")
    assert d.threshold("a", "e2e") == (30.0, "slo")
