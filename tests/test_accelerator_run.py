"""The accelerator stage's running window sums (``_Run``): packed points, same sums (issue 15)."""

from __future__ import annotations

import random
import tracemalloc
from collections import deque

from kvpressure.agent.samplers.accelerator import _Run


class _TupleRun:
    """The window as it was kept before: a deque of ``(t, dt, a, b)`` tuples (the reference)."""

    def __init__(self) -> None:
        self.points: deque[tuple[float, float, float, float]] = deque()
        self.a = self.b = self.span = 0.0

    def add(self, t: float, dt: float, a: float | None, b: float | None, horizon: float) -> None:
        if a is None or b is None:
            self.clear()
            return
        self.points.append((t, dt, a, b))
        self.a += a
        self.b += b
        self.span += dt
        pts = self.points
        while pts and pts[0][0] - pts[0][1] < horizon:
            _t, pdt, pa, pb = pts.popleft()
            self.a -= pa
            self.b -= pb
            self.span -= pdt
        if not pts:
            self.clear()

    def clear(self) -> None:
        self.points.clear()
        self.a = self.b = self.span = 0.0


def test_the_packed_window_sums_exactly_as_the_tuple_window() -> None:
    rng = random.Random(15)
    new, old = _Run(), _TupleRun()
    t = 1.7e9
    for step in range(20_000):
        dt = rng.choice([0.1, 0.1, 0.1, 0.25, 1.0, 7.0, 40.0])  # gaps past the window too
        t += dt
        a = None if rng.random() < 0.01 else rng.random() * 1e9
        b = None if rng.random() < 0.01 else float(rng.randrange(0, 5000))
        window = rng.choice([30.0, 30.0, 5.0]) if step % 500 == 0 else 30.0
        new.add(t, dt, a, b, t - window)
        old.add(t, dt, a, b, t - window)
        assert (len(new), new.a, new.b, new.span) == (len(old.points), old.a, old.b, old.span)
        assert bool(new) == bool(old.points)


def test_a_full_window_costs_at_most_80_bytes_a_point() -> None:
    # 30 s at 0.1 s: 300 points (a tuple of four floats each cost ~170 bytes)
    tracemalloc.start()
    try:
        run = _Run()
        t = 1.7e9
        for i in range(3000):
            t += 0.1
            run.add(t, 0.1, float(i), float(i % 7), t - 30.0)
        size = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert 295 <= len(run) <= 301
    assert size <= 80 * 301  # live points, as many dropped ones at most, growth slack
