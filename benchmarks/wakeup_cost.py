"""CPU cost of waking a thread on this machine: what a 10 Hz agent pays per hand-off.

The agent's 0.1 s stages are cheap enough that waking the thread that runs them is a visible
part of their cost, and the price of a wake-up differs from machine to machine (a VM pays
for an idle vCPU's wake-up in exits and interrupts). This prints, after idle gaps of 0,
1, 10 and 100 ms (100 ms: the agent's 0.1 s cycle), the process CPU time of:

- ``sleep``: one ``time.sleep(gap)`` (one timer wake-up of the one thread);
- ``thread hand-off``: a round trip to a second Python thread as the GPU sampler hands an
  NVML pass to its worker (``agent/samplers/gpu_workers.py``: a ``queue.SimpleQueue`` put,
  then a ``threading.Lock`` released by the worker), less the sleep's cost;
- ``pipe hand-off``: the same round trip through two pipes (``os.write``/``os.read``, which
  drop the GIL around the system call), less the sleep's cost: the peer, the kernel's
  wake-ups without the GIL's hand-over on top.

The two hand-offs move one job each way; the difference between them is what handing the GIL
over adds (the woken thread waits for the GIL, and is woken again when the other blocks).

Usage::

    flock /tmp/kvpressure-cpu.lock .venv/bin/python benchmarks/wakeup_cost.py [--rounds 100]

Takes about 2 minutes with the default rounds (three runs of each kind at each gap; the
100 ms gap alone is 3 x 3 x 100 rounds). The ``ratio`` column is thread over pipe.

Exit status 0; the figures are for the report (README "What it costs").
"""

from __future__ import annotations

import argparse
import os
import queue
import threading
import time
from collections.abc import Callable

GAPS_S = (0.0, 0.001, 0.01, 0.1)


def per_round_us(fn: Callable[[], None], gap: float, rounds: int) -> float:
    """Process CPU microseconds per ``fn(); time.sleep(gap)`` round."""
    c0 = time.process_time()
    for _ in range(rounds):
        fn()
        time.sleep(gap)
    return (time.process_time() - c0) / rounds * 1e6


def thread_handoff() -> tuple[Callable[[], None], Callable[[], None]]:
    """A worker taking jobs from a SimpleQueue and releasing each job's lock when done."""
    q: queue.SimpleQueue[threading.Lock | None] = queue.SimpleQueue()

    def worker() -> None:
        while (job := q.get()) is not None:
            job.release()

    t = threading.Thread(target=worker, daemon=True)
    t.start()

    def once() -> None:
        done = threading.Lock()
        done.acquire()
        q.put(done)
        done.acquire()

    def stop() -> None:
        q.put(None)
        t.join()

    return once, stop


def pipe_handoff() -> tuple[Callable[[], None], Callable[[], None]]:
    """The same round trip through two pipes: the GIL is dropped around each system call."""
    to_r, to_w = os.pipe()
    back_r, back_w = os.pipe()

    def worker() -> None:
        while os.read(to_r, 1) == b"j":
            os.write(back_w, b"d")

    t = threading.Thread(target=worker, daemon=True)
    t.start()

    def once() -> None:
        os.write(to_w, b"j")
        os.read(back_r, 1)

    def stop() -> None:
        os.write(to_w, b"q")
        t.join()
        for fd in (to_r, to_w, back_r, back_w):
            os.close(fd)

    return once, stop


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--rounds",
        type=int,
        default=100,
        help="rounds per kind and gap (the 100 ms gap: 30 s a run)",
    )
    args = ap.parse_args()
    print(f"{os.cpu_count()} CPUs; CPU microseconds per round, medians of 3 runs")
    print(f"{'gap':>8} {'sleep':>8} {'thread hand-off':>16} {'pipe hand-off':>14} {'ratio':>6}")
    for gap in GAPS_S:
        rounds = args.rounds if gap >= 0.01 else 5 * args.rounds
        rows: list[tuple[float, float, float]] = []
        for _ in range(3):
            sleep = per_round_us(lambda: None, gap, rounds)
            got = []
            for make in (thread_handoff, pipe_handoff):
                once, stop = make()
                once()  # the thread is started and has run once
                got.append(per_round_us(once, gap, rounds) - sleep)
                stop()
            rows.append((sleep, got[0], got[1]))
        sleep, thread, pipe = (sorted(col)[1] for col in zip(*rows, strict=True))
        ratio = f"{thread / pipe:6.2f}" if pipe > 0 else "     -"
        print(f"{gap * 1e3:6.0f}ms {sleep:8.1f} {thread:16.1f} {pipe:14.1f} {ratio}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
