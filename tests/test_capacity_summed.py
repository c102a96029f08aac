"""The capacity stage's summing of a window's series (agent/capacity/live.py)."""

from __future__ import annotations

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
    assert _summed_series(series) == _by_dict(series)


@given(st.lists(st.floats(min_value=0, max_value=1e6, allow_nan=False), max_size=20))
def test_one_rising_series_is_returned_as_it_is(values: list) -> None:
    pts = [(1000.0 + 0.1 * i, v) for i, v in enumerate(values)]
    series = {make_labels({"engine": "e"}): pts}
    assert _summed_series(series) == _by_dict(series)
    if pts:
        assert _summed_series(series) is pts  # no copy, no re-sort: 600 points a second


def test_a_repeated_or_earlier_timestamp_is_summed_and_sorted() -> None:
    lab = make_labels({"engine": "e"})
    assert _summed_series({lab: [(1.0, 2.0), (1.0, 3.0), (2.0, 1.0)]}) == [(1.0, 5.0), (2.0, 1.0)]
    assert _summed_series({lab: [(2.0, 1.0), (1.0, 3.0)]}) == [(1.0, 3.0), (2.0, 1.0)]
    assert _summed_series({}) == []
