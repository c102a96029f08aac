from agent.samples import Batch, Sample
from agent.timeline import Ring, Timeline


def test_ring_keeps_newest_points_in_order():
    r = Ring(3)
    for i in range(5):
        r.append(float(i), float(i * 10))
    assert r.points() == [(2.0, 20.0), (3.0, 30.0), (4.0, 40.0)]
    assert r.points(3.0, 3.5) == [(3.0, 30.0)]
    assert r.last() == (4.0, 40.0)
    assert Ring(2).last() is None


def test_series_cap_drops_and_counts_new_series_only():
    t = Timeline(points_per_series=4, max_series=2)
    for i in range(3):
        t.append(float(i), [Sample("a", 1.0), Sample("b", 2.0), Sample("c", 3.0)])
    assert len(t) == 2
    assert t.dropped_samples == 3
    assert len(t.window("a")[()]) == 3


def test_window_filters_by_labels_and_time():
    t = Timeline()
    b = Batch()
    b.add("m", 1, engine="x")
    b.add("m", 2, engine="y")
    t.append(10.0, b.samples)
    t.append(20.0, b.samples)
    w = t.window("m", 15, 25, {"engine": "x"})
    assert w == {(("engine", "x"),): [(20.0, 1.0)]}
    assert t.window("m", 30, 40) == {}


def test_forget_drops_stale_series():
    t = Timeline()
    t.append(1.0, [Sample("old", 1.0)])
    t.append(100.0, [Sample("new", 1.0)])
    assert t.forget(50.0) == 1
    assert list(t.window("new")) == [()]
    assert t.window("old") == {}


def test_batch_drops_missing_values():
    b = Batch()
    b.add("m", None)
    b.add("m", float("nan"))
    b.add("m", float("inf"))
    b.add("m", 0, engine=None, model="")
    assert [(s.name, s.value, s.labels) for s in b] == [("m", 0.0, ())]
