"""Windowed quantiles from cumulative histograms: interpolation, windows, resets, sparse windows."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpressure.agent.histograms import (
    HistogramSnapshot,
    WindowedHistogram,
    histogram_quantile,
    sum_windows,
    window_quantile,
)

INF = math.inf
BOUNDS = (0.1, 0.5, 1.0, 5.0, INF)


def snap(*cumulative: float, bounds: tuple[float, ...] = BOUNDS) -> HistogramSnapshot:
    return HistogramSnapshot(bounds, tuple(float(c) for c in cumulative))


# --- histogram_quantile: Prometheus semantics ------------------------------------------------


def test_linear_interpolation_inside_the_bucket() -> None:
    # 10 observations: 2 in (0, 0.1], 6 in (0.1, 0.5], 2 in (0.5, 1]
    cum = (2, 8, 10, 10, 10)
    # rank 5 is the 3rd of 6 in (0.1, 0.5]: 0.1 + 0.4 * 3/6
    assert histogram_quantile(0.5, BOUNDS, cum) == pytest.approx(0.3)
    # rank 9.5 is 1.5 of 2 in (0.5, 1]
    assert histogram_quantile(0.95, BOUNDS, cum) == pytest.approx(0.875)
    # the lowest bucket starts at 0
    assert histogram_quantile(0.1, BOUNDS, cum) == pytest.approx(0.05)


def test_rank_in_the_inf_bucket_returns_the_highest_finite_bound() -> None:
    assert histogram_quantile(0.99, BOUNDS, (0, 0, 0, 1, 10)) == 5.0


def test_lowest_bucket_with_non_positive_bound_returns_the_bound() -> None:
    assert histogram_quantile(0.5, (0.0, 1.0, INF), (4, 4, 4)) == 0.0


@pytest.mark.parametrize(
    ("q", "bounds", "cum"),
    [
        (0.5, BOUNDS, (0, 0, 0, 0, 0)),  # empty
        (0.5, (0.1, 0.5, 1.0), (1, 2, 3)),  # no +Inf bucket
        (1.5, BOUNDS, (1, 2, 3, 4, 5)),  # q out of range
        (-0.1, BOUNDS, (1, 2, 3, 4, 5)),
        (0.5, (INF,), (3,)),  # a single bucket
    ],
)
def test_no_answer(q: float, bounds: tuple[float, ...], cum: tuple[float, ...]) -> None:
    assert histogram_quantile(q, bounds, cum) is None


def test_from_buckets_sorts_and_enforces_monotonic_counts() -> None:
    s = HistogramSnapshot.from_buckets([(INF, 10), (0.5, 4), (0.1, 5), (1.0, 9), (5.0, 10)])
    assert s is not None
    assert s.bounds == (0.1, 0.5, 1.0, 5.0, INF)
    assert s.cumulative == (5, 5, 9, 10, 10)  # 4 after 5 raised to 5, as Prometheus does
    assert HistogramSnapshot.from_buckets([(0.5, 1)]) is None  # no +Inf
    assert HistogramSnapshot.from_buckets([(INF, -1)]) is None
    assert HistogramSnapshot.from_buckets([(math.nan, 1), (INF, 1)]) is None


# --- windows -------------------------------------------------------------------------------


def test_first_snapshot_only_opens_the_window() -> None:
    w = WindowedHistogram(60)
    w.update(0, snap(100, 200, 300, 300, 300))
    assert w.window() is None
    assert w.quantile(0.5) is None


def test_window_is_the_delta_over_the_last_60s() -> None:
    w = WindowedHistogram(60)
    w.update(0, snap(100, 100, 100, 100, 100))  # old, fast observations
    w.update(30, snap(100, 100, 100, 110, 110))  # 10 slow ones in (1, 5]
    delta = w.window()
    assert delta is not None and delta.count == 10
    assert w.quantile(0.5) == pytest.approx(3.0)
    # 61 s after the slow ones, with nothing new: the window holds nothing
    w.update(91, snap(100, 100, 100, 110, 110))
    w.update(92, snap(100, 100, 100, 110, 110))
    delta = w.window()
    assert delta is not None and delta.count == 0
    assert w.quantile(0.5) is None


def test_a_quiet_series_holds_one_snapshot_not_equal_copies() -> None:
    # every scrape parses new, equal floats; the ring keeps the first snapshot each time
    # (issue 15: 8 quiet engines' 60 s windows were ~3 MiB of equal copies)
    w = WindowedHistogram(60)
    first = snap(1, 2, 3, 3, 3)
    for t in range(0, 61):
        w.update(t, snap(1, 2, 3, 3, 3))
    w.update(0, first)  # older than the newest: ignored
    held = {id(p.snap) for p in w._ring}
    assert len(w._ring) == 61 and len(held) == 1
    w.update(61, snap(1, 2, 4, 4, 4))  # one observation: a snapshot of its own
    delta = w.window()
    assert delta is not None and delta.cumulative == (0, 0, 1, 1, 1)
    assert len({id(p.snap) for p in w._ring}) == 2


def test_window_baseline_is_the_last_snapshot_at_or_before_the_cutoff() -> None:
    w = WindowedHistogram(60)
    for t, n in [(0, 0), (20, 10), (40, 20), (70, 30)]:
        w.update(t, snap(n, n, n, n, n))
    # at t=70 the cutoff is 10: the baseline is t=0 (the last at or before it)
    delta = w.window(now=70)
    assert delta is not None and delta.count == 30
    delta = w.window(now=100)
    assert delta is not None and delta.count == 10  # baseline t=40


def test_sparse_window_gives_no_quantile() -> None:
    w = WindowedHistogram(60)
    w.update(0, snap(0, 0, 0, 0, 0))
    w.update(10, snap(0, 4, 4, 4, 4))
    assert w.quantile(0.5, min_count=5) is None
    assert w.quantile(0.5, min_count=4) == pytest.approx(0.3)
    w.update(20, snap(0, 5, 5, 5, 5))
    assert w.quantile(0.5, min_count=5) == pytest.approx(0.3)


def test_reset_restarts_the_window_from_post_reset_values_never_negative() -> None:
    w = WindowedHistogram(60)
    w.update(0, snap(1000, 2000, 3000, 3000, 3000))
    w.update(10, snap(1000, 2000, 3000, 3100, 3100))
    # engine restart: every bucket fell; 6 observations since, all in (0.5, 1]
    assert w.update(20, snap(0, 0, 6, 6, 6)) is True
    assert w.resets == 1
    delta = w.window()
    assert delta is not None
    assert delta.cumulative == (0, 0, 6, 6, 6)
    assert all(c >= 0 for c in delta.cumulative)
    assert w.quantile(0.5) == pytest.approx(0.75)
    # later scrapes keep counting from the post-reset values
    w.update(30, snap(0, 0, 8, 8, 8))
    delta = w.window()
    assert delta is not None and delta.count == 8


def test_one_bucket_decreasing_is_a_reset() -> None:
    w = WindowedHistogram(60)
    w.update(0, snap(5, 5, 5, 5, 5))
    assert w.update(1, snap(4, 6, 6, 6, 6)) is True


def test_bucket_layout_change_is_a_reset() -> None:
    w = WindowedHistogram(60)
    w.update(0, snap(5, 5, 5, 5, 5))
    assert w.update(1, snap(1, 2, 2, bounds=(1.0, 2.0, INF))) is True
    delta = w.window()
    assert delta is not None and delta.bounds == (1.0, 2.0, INF) and delta.count == 2


def test_time_going_backwards_is_ignored() -> None:
    w = WindowedHistogram(60)
    w.update(10, snap(0, 0, 0, 0, 0))
    w.update(20, snap(0, 10, 10, 10, 10))
    assert w.update(5, snap(0, 0, 0, 0, 0)) is False
    delta = w.window()
    assert delta is not None and delta.count == 10


def test_ring_is_bounded() -> None:
    w = WindowedHistogram(1e9, max_snapshots=4)
    for t in range(100):
        w.update(float(t), snap(t, t, t, t, t))
    delta = w.window()
    assert delta is not None and delta.count == 3  # 99 - 96


def test_sum_windows_adds_ranks_and_skips_other_layouts() -> None:
    a = snap(1, 2, 3, 3, 3)
    b = snap(0, 1, 1, 1, 2)
    other = snap(1, 1, 1, bounds=(1.0, 2.0, INF))
    total = sum_windows([a, None, b, other])
    assert total is not None and total.cumulative == (1, 3, 4, 4, 5)
    assert sum_windows([None]) is None
    assert window_quantile(None, 0.5) is None


# --- properties -------------------------------------------------------------------------------


counts = st.lists(st.integers(0, 1000), min_size=5, max_size=5)


@settings(max_examples=300, deadline=None, database=None)
@given(
    steps=st.lists(st.tuples(st.floats(0, 100), counts), min_size=1, max_size=30),
    q=st.sampled_from([0.5, 0.95, 0.99]),
)
def test_windows_are_never_negative_and_quantiles_stay_in_range(
    steps: list[tuple[float, list[int]]], q: float
) -> None:
    w = WindowedHistogram(60)
    t = 0.0
    for dt, per_bucket in steps:
        t += dt
        cum: list[float] = []
        running = 0.0
        for c in per_bucket:
            running += c
            cum.append(running)
        w.update(t, HistogramSnapshot(BOUNDS, tuple(cum)))
        delta = w.window()
        if delta is not None:
            assert all(c >= 0 for c in delta.cumulative)
        value = w.quantile(q, min_count=1)
        if value is not None:
            assert 0.0 <= value <= 5.0


# --- the fast constructions equal the plain ones ----------------------------------------------

_COUNTS = st.sampled_from([0.0, -0.0, 1.0, 2.0, 5.0, 7.5, -1.0, INF, math.nan])
_BOUNDS = st.sampled_from([0.001, 0.1, 0.5, 1.0, 2.5, 10.0, -1.0, INF, -INF, math.nan])


def _same(a: HistogramSnapshot | None, b: HistogramSnapshot | None) -> bool:
    """Equal bounds, counts and sum, zero signs included (repr tells -0.0 from 0.0)."""
    if a is None or b is None:
        return a is b
    return (repr(a.bounds), repr(a.cumulative), repr(a.sum)) == (
        repr(b.bounds),
        repr(b.cumulative),
        repr(b.sum),
    )


@settings(max_examples=500, database=None, deadline=None)
@given(
    pairs=st.lists(st.tuples(_BOUNDS, _COUNTS), max_size=8)
    | st.lists(_COUNTS, max_size=6).map(
        lambda c: list(
            zip((0.1, 0.5, 1.0, 2.5, 10.0, INF)[-len(c) :] if c else (), c, strict=False)
        )
    ),
    sorted_counts=st.booleans(),
    sum_=st.none() | st.floats(allow_nan=False),
)
def test_from_columns_is_from_buckets(
    pairs: list[tuple[float, float]], sorted_counts: bool, sum_: float | None
) -> None:
    if sorted_counts:  # the shape engines write: counts non-decreasing along the bounds
        counts = sorted(c for _, c in pairs if not math.isnan(c))
        pairs = list(zip([b for b, _ in pairs][: len(counts)], counts, strict=True))
    bounds = [b for b, _ in pairs]
    counts = [c for _, c in pairs]
    got = HistogramSnapshot.from_columns(bounds, counts, sum_)
    assert _same(got, HistogramSnapshot.from_buckets(pairs, sum_))


def _rebucket_reference(snap: HistogramSnapshot, bounds: tuple[float, ...]) -> HistogramSnapshot:
    """The re-bucketing rule written out bound by bound (the plan must give the same)."""
    out: list[float] = []
    i = -1
    for t in bounds:
        while i + 1 < len(snap.bounds) and snap.bounds[i + 1] <= t * (1.0 + 1e-9):
            i += 1
        out.append(snap.cumulative[i] if i >= 0 else 0.0)
    out.append(snap.count)
    return HistogramSnapshot((*bounds, INF), tuple(out), snap.sum)


@settings(max_examples=300, database=None, deadline=None)
@given(
    source=st.lists(st.sampled_from([0.001, 0.005, 0.1, 0.25, 0.5, 1.0, 5.0, 100.0]), max_size=6),
    target=st.sampled_from([(0.01, 0.1, 1.0), (0.1 * 1.0000000001, 2.5), (0.0005,), ()]),
    data=st.data(),
)
def test_rebucket_plan_equals_the_rule(
    source: list[float], target: tuple[float, ...], data: st.DataObject
) -> None:
    from kvpressure.agent.histograms import rebucket

    bounds = (*sorted(set(source)), INF)
    counts = sorted(
        data.draw(st.lists(st.floats(0, 1e6), min_size=len(bounds), max_size=len(bounds)))
    )
    snap = HistogramSnapshot(bounds, tuple(counts), data.draw(st.none() | st.floats(0, 10)))
    assert _same(rebucket(snap, target), _rebucket_reference(snap, target))


@settings(max_examples=300, database=None, deadline=None)
@given(
    a=st.lists(st.floats(-5, 5), min_size=3, max_size=3),
    b=st.lists(st.floats(-5, 5), min_size=3, max_size=3),
)
def test_minus_and_plus_bucket_by_bucket(a: list[float], b: list[float]) -> None:
    three = (0.1, 1.0, INF)
    x, y = snap(*a, bounds=three), snap(*b, bounds=three)
    diff = tuple(p - q for p, q in zip(a, b, strict=True))
    got = x.minus(y)
    assert got is None if any(d < 0 for d in diff) else got == snap(*diff, bounds=three)
    assert x.plus(y) == snap(*(p + q for p, q in zip(a, b, strict=True)), bounds=three)
    assert x.minus(snap(1, 2, bounds=(1.0, INF))) is None  # another layout


_COUNTS = st.sampled_from([0.0, -0.0, 1.0, 2.0, 5.5, 1e308, math.inf])


@settings(max_examples=400, deadline=None)
@given(
    st.lists(st.tuples(_COUNTS, _COUNTS), min_size=1, max_size=5),
    st.booleans(),
)
def test_below_is_minus_giving_none(counts: list[tuple[float, float]], other_layout: bool) -> None:
    # the window's reset check answers as the delta would, without building it
    bounds = (*[0.5 * (i + 1) for i in range(len(counts) - 1)], math.inf)
    new = HistogramSnapshot(bounds, tuple(c for c, _ in counts), 1.0)
    base_bounds = (*bounds[:-1], 99.0, math.inf) if other_layout else bounds
    base = HistogramSnapshot(base_bounds, tuple(b for _, b in counts) + (0.0,) * other_layout)
    assert new.below(base) == (new.minus(base) is None)
