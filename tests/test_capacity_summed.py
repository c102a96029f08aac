"""The capacity stage's summing of a window's series (agent/capacity/live.py)."""

from __future__ import annotations

from array import array
from collections import defaultdict

from hypothesis import given
from hypothesis import strategies as st

from kvpressure.agent.capacity.live import _summed_series
from kvpressure.agent.samples import make_labels


def _by_dict(series: dict) -> list[tuple[float, float]]:
    """The plain sum at each timestamp, in time order: what the fast path must equal."""
    acc: dict[float, float] = defaultdict(float)
    for pts in series.values():
        for t, v in pts:
            acc[t] += v
    return sorted(acc.items())


def _columns(series: dict) -> dict:
    """``{labels: [(t, v), ...]}`` as the timeline's columns: ``{labels: (ts, vs)}`` arrays."""
    return {
        k: (array("d", [t for t, _ in pts]), array("d", [v for _, v in pts]))
        for k, pts in series.items()
    }


def _summed(series: dict) -> list[tuple[float, float]]:
    ts, vs = _summed_series(_columns(series))
    assert len(ts) == len(vs)
    return list(zip(ts, vs, strict=True))


POINTS = st.lists(
    st.tuples(
        st.sampled_from([0.0, 0.1, 0.2, 0.3, 1.0, 1.7, 2.5]),  # repeats and disorder happen
        st.floats(min_value=-1e12, max_value=1e12, allow_nan=False),
    ),
    max_size=12,
)


@given(st.lists(POINTS, min_size=1, max_size=3))
def test_summed_series_equals_the_sum_at_each_timestamp(lists: list) -> None:
    series = {make_labels({"engine": "e", "model": str(i)}): pts for i, pts in enumerate(lists)}
    assert _summed(series) == _by_dict(series)


@given(st.lists(st.floats(min_value=0, max_value=1e6, allow_nan=False), max_size=20))
def test_one_rising_series_is_returned_as_it_is(values: list) -> None:
    pts = [(1000.0 + 0.1 * i, v) for i, v in enumerate(values)]
    series = {make_labels({"engine": "e"}): pts}
    assert _summed(series) == _by_dict(series)
    if pts:
        cols = _columns(series)
        ts, vs = cols[make_labels({"engine": "e"})]
        got = _summed_series(cols)
        assert got[0] is ts and got[1] is vs  # no copy, no re-sort: 600 points a second


def test_a_repeated_or_earlier_timestamp_is_summed_and_sorted() -> None:
    lab = make_labels({"engine": "e"})
    assert _summed({lab: [(1.0, 2.0), (1.0, 3.0), (2.0, 1.0)]}) == [(1.0, 5.0), (2.0, 1.0)]
    assert _summed({lab: [(2.0, 1.0), (1.0, 3.0)]}) == [(1.0, 3.0), (2.0, 1.0)]
    assert _summed({}) == []


def test_growth_rate_is_the_least_squares_slope() -> None:
    from kvpressure.agent.capacity.live import growth_rate

    ts = array("d", [0.0, 1.0, 2.0, 3.0])
    assert growth_rate(ts, array("d", [1.0, 3.0, 5.0, 7.0])) == 2.0
    assert growth_rate(ts, [4.0, 4.0, 4.0, 4.0]) == 0.0
    assert growth_rate(ts[:2], [1.0, 2.0]) is None  # fewer than 3 points
    assert growth_rate([5.0, 5.0, 5.0], [1.0, 2.0, 3.0]) is None  # one timestamp
