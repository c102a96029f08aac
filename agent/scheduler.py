"""Runs the pipeline's samplers: one daemon thread each, a watchdog, and the derived triggers.

Scheduling: every sampler runs on its own daemon thread (:class:`SamplerRunner`), starting
a collection every ``interval_s`` seconds (missed ticks are skipped, never queued), except
samplers that name a ``thread_group`` (:attr:`agent.pipeline.Sampler.thread_group`: the
engines' 10 Hz gauge readers): those of one group and interval share one thread
(:class:`ThreadGroup`), collected one after another each tick, each still publishing its own
report; one whose collection runs past the interval leaves the group for a thread of its
own, so a slow member delays the others by one tick at most. A derived
stage registered with ``after`` (the accelerator, after ``gpu``) instead runs right after each
report of those sources, so it reads the state of the same tick. :meth:`Runners.check_timeouts`
(called by the daemon's watchdog on the event loop) marks a sampler down (``kvpressure_sampler_up
0``, reason ``timeout``) as soon as a collection runs past its ``timeout_s``; the stuck thread
delays nothing else, and its late result is discarded.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Hashable, Mapping

from kvpressure.agent.pipeline import Planned, Sampler, Stage
from kvpressure.agent.samples import Batch
from kvpressure.agent.state import AgentState, SamplerReport

log = logging.getLogger(__name__)


class SamplerRunner:
    """Runs one sampler on its own daemon thread and publishes its reports.

    Args:
        sampler: the sampler to run.
        state: where reports go.
        spec: a hashable description of how the sampler was built; the daemon keeps the
            runner across reloads when the spec is unchanged (so counter state survives).
        triggered: run after each :meth:`trigger` (a derived stage with ``after``) instead of
            on the sampler's interval.
    """

    def __init__(
        self,
        sampler: Sampler,
        state: AgentState,
        spec: object,
        triggered: bool = False,
        group: ThreadGroup | None = None,
    ) -> None:
        self.sampler = sampler
        self.spec = spec
        self.triggered = triggered
        self._state = state
        self._group = group
        self._stop = threading.Event()
        self._done = threading.Event()
        self._wake = threading.Event()
        self._thread = threading.Thread(
            target=self._main, name=f"sampler-{sampler.name}", daemon=True
        )
        self._lock = threading.Lock()
        self._running_since: float | None = None
        self._timed_out = False

    def start(self) -> None:
        """Start the sampler thread (or join its thread group)."""
        group = self._group
        if group is None or not group.add(self):
            self._group = None
            self._thread.start()

    def stop(self) -> None:
        """Ask the thread to stop after its current collection; does not wait."""
        self._stop.set()
        self._wake.set()
        group = self._group
        if group is not None:
            group.wake()

    @property
    def stopped(self) -> bool:
        """True once :meth:`stop` was called."""
        return self._stop.is_set()

    def leave_group(self) -> None:
        """Run on a thread of its own from now on (called by its group, between ticks)."""
        self._group = None
        self._thread.start()

    def finish(self) -> None:
        """Close the sampler; :meth:`join` returns True from then on."""
        with contextlib.suppress(Exception):
            self.sampler.close()
        self._done.set()

    def trigger(self) -> None:
        """Wake a triggered runner: a source it runs after has published a report."""
        self._wake.set()

    def join(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the sampler to be closed; True when it was."""
        return self._done.wait(timeout)

    def check_timeout(self, now: float) -> None:
        """Mark the sampler down if its current collection has run past its timeout."""
        with self._lock:
            since = self._running_since
            if since is None or self._timed_out or now - since <= self.sampler.timeout_s:
                return
            self._timed_out = True
        log.warning(
            "sampler timed out; its result will be discarded",
            extra={"kv": {"sampler": self.sampler.name, "timeout_s": self.sampler.timeout_s}},
        )
        self._state.publish(
            SamplerReport(self.sampler.name, time.time(), now - since, False, "timeout")
        )

    def collect_once(self) -> SamplerReport:
        """Run one collection now and return its report (also used by tests)."""
        ts = time.time()
        t0 = time.monotonic()
        batch = Batch()
        try:
            self.sampler.collect(batch)
        except Exception as exc:  # noqa: BLE001 - a sampler failure must not kill its thread
            dur = time.monotonic() - t0
            log.warning(
                "sampler failed",
                extra={
                    "kv": {"sampler": self.sampler.name, "error": f"{type(exc).__name__}: {exc}"}
                },
            )
            return SamplerReport(self.sampler.name, ts, dur, False, type(exc).__name__)
        return SamplerReport(self.sampler.name, ts, time.monotonic() - t0, True, "", batch)

    def once(self) -> None:
        """Run one collection and publish it (unless it timed out or the runner stopped)."""
        with self._lock:
            self._running_since = time.monotonic()
            self._timed_out = False
        report = self.collect_once()
        with self._lock:
            self._running_since = None
            late = self._timed_out
        if not late and not self._stop.is_set():
            self._state.publish(report)

    def _main(self) -> None:
        interval = self.sampler.interval_s
        next_t = time.monotonic()
        while not self._stop.is_set():
            if self.triggered:
                self._wake.wait()
                self._wake.clear()
                if self._stop.is_set():
                    break
                self.once()
                continue
            self.once()
            next_t += interval
            now = time.monotonic()
            if next_t < now:  # skip missed ticks instead of bursting to catch up
                next_t = now + interval - ((now - next_t) % interval)
            self._stop.wait(next_t - now)
        self.finish()


class ThreadGroup:
    """Samplers of one ``thread_group`` and interval, collected in turn on one daemon thread.

    Each tick (every ``interval_s`` seconds, missed ticks skipped as in
    :class:`SamplerRunner`) runs every member's :meth:`SamplerRunner.once` in the order they
    joined; each publishes its own report, so the state, ``/metrics`` and the watchdog see
    them as separate samplers. Eight 10 Hz readers on one thread cost a quarter less CPU
    than on eight (fewer wake-ups and GIL hand-offs). A member whose collection takes longer
    than ``interval_s`` leaves the group for its own thread (:meth:`SamplerRunner.leave_group`),
    so a slow engine delays the others by at most that one collection. A stopped member is
    closed by the group's thread between ticks; the thread ends when the last member left.

    Args:
        name: the group's name; its thread is ``sampler-<name>``.
        interval_s: seconds between ticks.
    """

    def __init__(self, name: str, interval_s: float) -> None:
        self.name = name
        self.interval_s = interval_s
        self._members: list[SamplerRunner] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._started = False
        self._closed = False
        self._thread = threading.Thread(target=self._main, name=f"sampler-{name}", daemon=True)

    def add(self, runner: SamplerRunner) -> bool:
        """Add ``runner`` (starting the thread on the first); False once the group has ended."""
        with self._lock:
            if self._closed:
                return False
            self._members.append(runner)
            if not self._started:
                self._started = True
                self._thread.start()
        return True

    @property
    def closed(self) -> bool:
        """True once the group's thread has ended (its last member left)."""
        with self._lock:
            return self._closed

    def wake(self) -> None:
        """Wake the thread now (a member was stopped: it is closed without waiting a tick)."""
        self._wake.set()

    def _main(self) -> None:
        interval = self.interval_s
        next_t = time.monotonic()
        while True:
            if time.monotonic() >= next_t:
                self._tick(interval)
                next_t += interval
                now = time.monotonic()
                if next_t < now:  # skip missed ticks instead of bursting to catch up
                    next_t = now + interval - ((now - next_t) % interval)
            if self._reap():
                return
            self._wake.wait(max(0.0, next_t - time.monotonic()))
            self._wake.clear()

    def _tick(self, interval: float) -> None:
        with self._lock:
            members = list(self._members)
        for runner in members:
            if runner.stopped:
                continue
            t0 = time.monotonic()
            runner.once()
            if time.monotonic() - t0 > interval and not runner.stopped:
                with self._lock:
                    self._members.remove(runner)
                log.info(
                    "sampler left its thread group: a collection ran past the interval",
                    extra={"kv": {"sampler": runner.sampler.name, "group": self.name}},
                )
                runner.leave_group()

    def _reap(self) -> bool:
        """Close the stopped members; True when none is left (the thread then ends)."""
        with self._lock:
            gone = [r for r in self._members if r.stopped]
            self._members = [r for r in self._members if not r.stopped]
            if not self._members:
                self._closed = True
        for runner in gone:
            runner.finish()
        return self._closed


class Runners:
    """The running samplers, kept equal to a plan (:func:`agent.pipeline.plan`).

    Args:
        state: where reports go; its publications trigger the derived stages that run
            ``after`` a source.
    """

    def __init__(self, state: AgentState) -> None:
        self.state = state
        self.runners: dict[str, SamplerRunner] = {}
        self._after: dict[str, tuple[str, ...]] = {}  # runner name -> source labels it follows
        self._labels: dict[str, str] = {}  # runner name -> registration name
        self._groups: dict[tuple[str, float], ThreadGroup] = {}
        state.on_publish(self._published)

    def _published(self, report: SamplerReport) -> None:
        reg = self._labels.get(report.sampler)
        if reg is None:
            return
        for name, after in list(self._after.items()):
            if reg in after:
                runner = self.runners.get(name)
                if runner is not None:
                    runner.trigger()

    def apply(self, desired: Mapping[str, Planned], extra: Mapping[str, Sampler]) -> None:
        """Start, keep or stop runners so they match ``desired`` plus the ``extra`` samplers."""
        specs: dict[str, Hashable] = {n: p.plan.spec for n, p in desired.items()}
        specs.update({n: ("extra", id(s)) for n, s in extra.items()})
        for name in list(self.runners):
            if specs.get(name, ...) != self.runners[name].spec:
                runner = self.runners.pop(name)
                runner.stop()
                self._after.pop(name, None)
                self.state.remove(name)
                log.info("sampler stopped", extra={"kv": {"sampler": name}})
        for name, spec in specs.items():
            if name in self.runners:
                continue
            planned = desired.get(name)
            triggered = bool(planned and planned.reg.stage is Stage.DERIVED and planned.reg.after)
            try:
                sampler = extra[name] if planned is None else planned.plan.build()
            except Exception as exc:  # noqa: BLE001 - one bad sampler must not stop the rest
                log.error(
                    "sampler could not be created",
                    extra={"kv": {"sampler": name, "error": f"{type(exc).__name__}: {exc}"}},
                )
                self.state.publish(SamplerReport(name, time.time(), 0.0, False, "init"))
                continue
            runner = SamplerRunner(sampler, self.state, spec, triggered, self._group(sampler))
            self.runners[name] = runner
            if planned is not None:
                self._labels[name] = planned.reg.name
                if triggered:
                    self._after[name] = planned.reg.after
            runner.start()
            log.info(
                "sampler started",
                extra={"kv": {"sampler": name, "interval_s": sampler.interval_s}},
            )

    def _group(self, sampler: Sampler) -> ThreadGroup | None:
        """The live thread group of ``sampler`` (created on demand), or ``None``."""
        name = getattr(sampler, "thread_group", None)
        if not name:
            return None
        key = (name, float(sampler.interval_s))
        group = self._groups.get(key)
        if group is None or group.closed:
            group = self._groups[key] = ThreadGroup(name, sampler.interval_s)
        return group

    def check_timeouts(self, now: float) -> None:
        """Mark down every sampler whose collection overran (the daemon's watchdog)."""
        for r in list(self.runners.values()):
            r.check_timeout(now)

    def stop(self) -> list[SamplerRunner]:
        """Ask every runner to stop; returns them for joining."""
        runners = list(self.runners.values())
        for r in runners:
            r.stop()
        return runners


class Once:
    """Every planned sampler, run tick by tick on the caller's thread (tests, the golden file).

    A tick runs the sources in plan order, then the derived stages, as the daemon's threads
    would within one interval.
    """

    def __init__(self, desired: Mapping[str, Planned], state: AgentState) -> None:
        self.state = state
        order = sorted(desired.values(), key=lambda p: p.reg.stage is Stage.DERIVED)
        self.runners = [
            SamplerRunner(p.plan.build(), state, p.plan.spec) for p in order
        ]  # fmt: skip

    def tick(self) -> None:
        """One collection of every sampler, sources first; each report is published."""
        for r in self.runners:
            self.state.publish(r.collect_once())

    def close(self) -> None:
        """Close every sampler."""
        for r in self.runners:
            with contextlib.suppress(Exception):
                r.sampler.close()
