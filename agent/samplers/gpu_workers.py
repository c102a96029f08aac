"""The GPU sampler's NVML worker threads, one cycle's read pass, and capped back-off.

NVML can hang (a wedged GSP, dcgm-exporter#84); these pieces let :class:`agent.samplers.gpu.
GpuSampler` bound every NVML call (see its module docstring, "Bounded NVML calls"). Moved
verbatim out of ``gpu.py``.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvpressure.agent.samplers.gpu_devices import _Gpu, _GpuReading


class _Job:
    """One unit of NVML work; :meth:`wait` blocks on a raw lock (cheaper than an Event)."""

    __slots__ = ("_lock", "error", "finished", "fn", "result")

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.fn = fn
        self.result: Any = None
        self.error: BaseException | None = None
        self.finished = False
        self._lock = threading.Lock()
        self._lock.acquire()

    def run(self) -> None:
        try:
            self.result = self.fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
            self.error = exc
        finally:
            self.finished = True
            self._lock.release()

    def wait(self, timeout: float | None) -> bool:
        """Wait up to ``timeout`` seconds (``None``: forever); True when the job finished."""
        if self.finished:
            return True
        if self._lock.acquire(timeout=-1 if timeout is None else max(0.0, timeout)):
            self._lock.release()
        return self.finished


class _Worker:
    """A daemon thread running one NVML job at a time (one per GPU, plus a control worker).

    Args:
        name: thread name.
        inline: run jobs in the caller's thread instead (``gpu_timeout_s=0``).
    """

    def __init__(self, name: str, inline: bool = False) -> None:
        self.name = name
        self.inline = inline
        self._q: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._current: _Job | None = None

    @property
    def busy(self) -> bool:
        """True while the last submitted job has not finished (e.g. a hung NVML call)."""
        job = self._current
        return job is not None and not job.finished

    def submit(self, fn: Callable[[], Any]) -> _Job:
        """Queue ``fn``; returns its job (already finished when inline)."""
        job = _Job(fn)
        self._current = job
        if self.inline:
            job.run()
            return job
        if self._thread is None:
            self._thread = threading.Thread(target=self._main, name=self.name, daemon=True)
            self._thread.start()
        self._q.put(job)
        return job

    def _main(self) -> None:
        while True:
            job = self._q.get()
            if job is None:
                return
            job.run()

    def stop(self) -> None:
        """Let the thread end after its current job."""
        if self._thread is not None:
            self._q.put(None)


class _Pass:
    """One cycle's NVML reads of several GPUs, in order, on one worker thread.

    The sampler watches :attr:`current`/:attr:`since` and may :meth:`cancel` the pass when a GPU
    overruns its budget; after cancellation the pass starts no further GPU and its remaining
    results are discarded, so a GPU is never read by two threads at once.
    """

    __slots__ = ("cancelled", "current", "gpus", "lock", "read", "results", "since")

    def __init__(self, gpus: list[_Gpu], read: Callable[[_Gpu], _GpuReading]) -> None:
        self.gpus = gpus
        self.read = read
        self.lock = threading.Lock()
        self.cancelled = False
        self.current: _Gpu | None = None
        self.since = 0.0
        self.results: dict[int, tuple[_GpuReading | None, BaseException | None]] = {}

    def run(self) -> None:
        for g in self.gpus:
            with self.lock:
                if self.cancelled:
                    return
                self.current = g
                self.since = time.monotonic()
            try:
                result: tuple[_GpuReading | None, BaseException | None] = (self.read(g), None)
            except BaseException as exc:  # noqa: BLE001 - reported per GPU
                result = (None, exc)
            with self.lock:
                self.current = None
                if self.cancelled:
                    return
                self.results[g.index] = result

    def cancel(
        self,
    ) -> tuple[_Gpu | None, dict[int, tuple[_GpuReading | None, BaseException | None]]]:
        """Stop the pass; returns the GPU it is stuck in (if any) and the results so far."""
        with self.lock:
            self.cancelled = True
            return self.current, dict(self.results)


class _Backoff:
    """Capped exponential back-off: after n failures wait ``min(cap, base * 2**(n-1))``."""

    def __init__(self, base_s: float, cap_s: float) -> None:
        self.base_s = base_s
        self.cap_s = cap_s
        self.failures = 0
        self.retry_at = 0.0

    def fail(self, now: float) -> None:
        self.failures += 1
        self.retry_at = now + min(self.cap_s, self.base_s * 2 ** (self.failures - 1))

    def ok(self) -> None:
        self.failures = 0
        self.retry_at = 0.0

    def ready(self, now: float) -> bool:
        return now >= self.retry_at
