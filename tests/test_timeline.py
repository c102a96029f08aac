from kvpressure.agent.samples import Batch, Sample
from kvpressure.agent.timeline import Ring, Timeline


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


def test_churning_label_keeps_memory_bounded_and_new_series_admitted():
    """Issue 18, point 2: an engine whose ``model`` label changes every 0.1 s scrape. The
    timeline stays under its cap, stable series keep their history, the newest churned
    series (a new model, engine or PID) is still admitted, and a series written once costs
    a few hundred bytes instead of a preallocated 16 KiB ring."""
    import tracemalloc

    stable = [Sample("kvpressure_host_memory_available_bytes", 1.0)] + [
        Sample("kvpressure_engine_up", 1.0, (("engine", f"e{i}"),)) for i in range(20)
    ]
    tracemalloc.start()
    try:
        t = Timeline(points_per_series=1024, max_series=2000)
        base = tracemalloc.get_traced_memory()[0]
        for k in range(12_000):  # 20 minutes of scrapes at 0.1 s
            ts = 1000.0 + k * 0.1
            churn = Sample("kvpressure_engine_requests_running", 1.0, (("model", f"m{k}"),))
            t.append(ts, [*stable, churn])
        used = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    assert len(t) <= 2000
    newest = t.window("kvpressure_engine_requests_running", match={"model": "m11999"})
    assert list(newest.values()) == [[(ts, 1.0)]]
    assert (
        len(t.window("kvpressure_engine_up", match={"engine": "e0"})[(("engine", "e0"),)]) == 1024
    )
    assert t.evicted_series > 0 and t.dropped_samples == 0
    # 21 full rings (16 KiB each) and < 2,000 one-point series of < 1 KB each (measured
    # 1.66 MB in all; preallocated rings made it 2,000 x 16 KiB = 33 MB)
    assert used < 21 * 17_000 + 2000 * 1_000, used


def _reference_points(appended, capacity, start, end):
    kept = appended[-capacity:]
    return [(t, v) for t, v in kept if start <= t <= end]


def test_ring_points_bisect_equals_a_scan_wrapped_or_not():
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from kvpressure.agent.timeline import Ring

    @settings(max_examples=300, deadline=None, database=None)
    @given(
        capacity=st.integers(1, 12),
        steps=st.lists(st.floats(-3, 10, allow_nan=False), max_size=40),
        start=st.floats(-5, 200, allow_nan=False),
        span=st.floats(0, 200, allow_nan=False),
    )
    def check(capacity, steps, start, span):
        ring = Ring(capacity)
        appended = []
        t = 0.0
        for i, step in enumerate(steps):
            t += step  # mostly forward, sometimes back (a clock step)
            ring.append(t, float(i))
            appended.append((t, float(i)))
        end = start + span
        assert ring.points(start, end) == _reference_points(appended, capacity, start, end)
        assert ring.points() == appended[-capacity:]
        ts, vs = ring.columns(start, end)  # the same points as two array('d') columns
        assert (ts.typecode, vs.typecode) == ("d", "d")
        assert list(zip(ts, vs, strict=True)) == _reference_points(appended, capacity, start, end)

    check()


def test_window_reads_only_the_series_of_its_name_and_forgets_with_them():
    from kvpressure.agent.samples import Sample
    from kvpressure.agent.timeline import Timeline

    tl = Timeline(points_per_series=4, max_series=3, evict_after_s=1.0)
    tl.append(1.0, [Sample("a", 1.0, (("x", "1"),)), Sample("b", 2.0, (("x", "1"),))])
    tl.append(2.0, [Sample("a", 3.0, (("x", "2"),))])
    assert tl.window("a") == {(("x", "1"),): [(1.0, 1.0)], (("x", "2"),): [(2.0, 3.0)]}
    # at the cap, the least recently written series ("a", x=1 at t=1) gives its place
    tl.append(5.0, [Sample("c", 4.0), Sample("b", 5.0, (("x", "1"),))])
    assert tl.window("a") == {(("x", "2"),): [(2.0, 3.0)]}
    assert tl.window("c") == {(): [(5.0, 4.0)]}
    assert tl.forget(3.0) == 1  # "a" x=2, last written at 2
    assert tl.window("a") == {}
    assert tl.window("b", match={"x": "1"}) == {(("x", "1"),): [(1.0, 2.0), (5.0, 5.0)]}


def test_series_rewritten_after_others_is_neither_evicted_nor_forgotten_first():
    """The least recently *written* series goes first, not the first one filed: a write
    does not move its series in the timeline's order, so eviction and forgetting must
    find the series written since they were filed and pass over them."""
    t = Timeline(points_per_series=4, max_series=2, evict_after_s=5.0)
    t.append(0.0, [Sample("a", 1.0)])
    t.append(1.0, [Sample("b", 1.0)])
    t.append(20.0, [Sample("a", 2.0)])  # a: filed first, written last
    t.append(21.0, [Sample("c", 1.0)])  # at the cap: b (last written at 1) gives way
    assert t.evicted_series == 1 and t.dropped_samples == 0
    assert set(t.window("a")) == {()} and t.window("b") == {} and set(t.window("c")) == {()}
    t.append(22.0, [Sample("d", 1.0)])  # a (20) and c (21): both written within 5 s
    assert t.dropped_samples == 1 and t.window("d") == {}
    t.append(40.0, [Sample("c", 2.0)])
    assert t.forget(30.0) == 1  # a, last written at 20; c was written at 40
    assert t.window("a") == {} and [p for p, _ in t.window("c")[()]] == [21.0, 40.0]
    assert t.forget(41.0) == 1 and len(t) == 0


def test_series_sharing_a_sources_timestamps_read_back_as_if_each_held_its_own():
    """Issue 15 (the node's memory): the series a source writes at each report read their
    timestamps from one :class:`Clock`. Whatever the reports hold (a series missing from
    some, written twice in one, written by two sources, a clock stepping back, rings
    wrapping, eviction at the cap, forgetting and names no longer kept), every read equals
    that of a timeline where each series holds its own timestamps."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    names = ["a", "b", "c"]
    labels = [(), (("gpu", "0"),), (("gpu", "1"),)]
    report = st.tuples(
        st.sampled_from(["s1", "s2", None]),  # the source (None: no clock)
        st.floats(-2, 5, allow_nan=False),  # step of the clock (sometimes back)
        st.lists(st.tuples(st.integers(0, 2), st.integers(0, 2)), max_size=8),
    )

    @settings(max_examples=400, deadline=None, database=None)
    @given(
        capacity=st.integers(1, 6),
        max_series=st.integers(1, 9),
        reports=st.lists(report, max_size=40),
        forget_at=st.lists(st.integers(0, 39), max_size=3),
        kept_at=st.dictionaries(st.integers(0, 39), st.sets(st.sampled_from(names)), max_size=2),
    )
    def check(capacity, max_series, reports, forget_at, kept_at):
        kw = {"points_per_series": capacity, "max_series": max_series, "evict_after_s": 3.0}
        shared, plain = Timeline(**kw), Timeline(**kw)
        t = 100.0
        for k, (source, step, picks) in enumerate(reports):
            t += step
            samples = [
                Sample(names[n], float(k * 10 + i), labels[lab]) for i, (n, lab) in enumerate(picks)
            ]
            shared.append(t, samples, clock=source)
            plain.append(t, samples)
            if k in forget_at:
                assert shared.forget(t - 4.0) == plain.forget(t - 4.0)
            if k in kept_at:
                assert shared.set_kept(kept_at[k]) == plain.set_kept(kept_at[k])
            for name in names:
                if shared.kept is not None and name not in shared.kept:
                    continue
                assert shared.window(name) == plain.window(name)
                assert shared.window(name, t - 3.0, t - 0.5) == plain.window(name, t - 3.0, t - 0.5)
            assert len(shared) == len(plain)
            assert shared.dropped_samples == plain.dropped_samples
            assert shared.evicted_series == plain.evicted_series
            for key, ring in shared._series.items():
                assert ring.last() == plain._series[key].last()
                assert ring.last_ts == plain._series[key].last_ts
        # a clock is kept only while some series reads it
        assert all(c.members for c in shared._clocks.values())

    check()


def test_a_sources_steady_series_hold_no_timestamps_of_their_own():
    """The memory the clock saves: series written at every report keep values only; one
    that misses a report gets its own timestamps back, with its history intact."""
    t = Timeline(points_per_series=8)
    for k in range(20):
        batch = [
            Sample("kvpressure_gpu_memory_used_bytes", float(k), (("gpu", str(g)),))
            for g in range(4)
        ]
        if k % 5 == 0:  # read once a second by a sampler ticking at 0.2 s
            batch.append(Sample("kvpressure_host_cpu_seconds_total", float(k)))
        t.append(1000.0 + k * 0.2, batch, clock="gpu")
    rings = t._series
    gpu = [r for (n, _), r in rings.items() if n == "kvpressure_gpu_memory_used_bytes"]
    assert all(r.clocked for r in gpu) and len(t._clocks) == 1
    assert not rings[("kvpressure_host_cpu_seconds_total", ())].clocked
    assert [v for _, v in t.window("kvpressure_host_cpu_seconds_total")[()]] == [
        0.0,
        5.0,
        10.0,
        15.0,
    ]
    w = t.window("kvpressure_gpu_memory_used_bytes", match={"gpu": "3"})[(("gpu", "3"),)]
    assert w == [(1000.0 + k * 0.2, float(k)) for k in range(12, 20)]


def test_the_state_records_each_samplers_reports_on_its_own_clock():
    from kvpressure.agent.state import AgentState, SamplerReport

    state = AgentState(Timeline(points_per_series=4))
    for k in range(6):
        for sampler, name in (("gpu", "kvpressure_gpu_memory_used_bytes"), ("host", "h")):
            b = Batch()
            b.add(name, float(k), gpu="0")
            state.publish(SamplerReport(sampler, 10.0 + k, 0.001, True, batch=b))
    tl = state.timeline
    assert set(tl._clocks) == {"gpu", "host"}
    assert all(r.clocked for r in tl._series.values())
    assert tl.window("h") == {(("gpu", "0"),): [(10.0 + k, float(k)) for k in range(2, 6)]}
