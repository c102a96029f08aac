"""Runs the pipeline's samplers: shared threads per interval, a watchdog, the derived triggers.

Scheduling: the samplers of one interval (and ``thread_group``, :attr:`agent.pipeline.Sampler.
thread_group`, by default one shared group) run on one daemon thread (:class:`ThreadGroup`),
collected one after another every ``interval_s`` seconds (missed ticks are skipped, never
queued), each publishing its own report. One thread per interval, not per sampler: on the
virtual machine of the README's figures a thread that wakes an idle vCPU pays 80-150 µs of
CPU for it (more than a host or gauge cycle's own work) and runs with cold caches, and
threads that wake together contend for the GIL; on one thread the 8-GPU node's ~70 wake-ups
a second become ~12 (``benchmarks/node_cost.py``: 1.4-1.8 % of a core less, out of 8-10).

A member whose collection runs past the interval leaves the group for a thread of its own
(:class:`SamplerRunner`), at once: the watchdog (:meth:`Runners.check_timeouts`) moves the
group's other members to a new thread while the slow collection is still running, so a
stuck or slow sampler delays the others by one interval at most. A sampler on its own
thread rejoins its group after :data:`REJOIN_AFTER` collections in a row that each took at
most half the interval (a transient: the machine was busy). A sampler whose
``thread_group`` is ``None`` always has a thread of its own.

A derived stage registered with ``after`` (the accelerator, after ``gpu``) instead runs
right after each report of those sources, on the thread that published it (inside the
source's collection as the watchdog sees it), so it reads the state of the same tick with
the source's samples still in cache and no thread is woken for it (a thread of its own
woken ten times a second pays a wake-up each time: about 0.1 % of a core on the README's VM,
less than ``benchmarks/node_stages.py`` can tell from its noise). Such a stage must be
quick and never block: a stuck one holds its source's thread, and the watchdog then marks
the source down (``timeout``) and moves its thread group on, as for a stuck source. A failed
report of its source (a sampler error, the watchdog's timeout) has nothing to derive from:
the stage gets an empty report without running, so no stage code runs on the watchdog's
thread (the event loop).

:meth:`Runners.check_timeouts` (called by the daemon's watchdog on the event loop) marks a
sampler down (``kvpressure_sampler_up 0``, reason ``timeout``) as soon as a
collection runs past its ``timeout_s``; its late result is discarded.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from collections.abc import Callable, Hashable, Mapping

from kvpressure.agent.pipeline import Planned, Sampler, Stage
from kvpressure.agent.samples import Batch
from kvpressure.agent.state import AgentState, SamplerReport

log = logging.getLogger(__name__)

REJOIN_AFTER = 100
"""Collections in a row, each within a quarter of the interval, after which a sampler that
left its thread group (it overran the interval) rejoins it; doubled at each rejoin, up to 64
times, so a sampler that keeps overrunning does not come and go."""


class SamplerRunner:
    """Runs one sampler, in its thread group or on its own daemon thread, and publishes its reports.

    Args:
        sampler: the sampler to run.
        state: where reports go.
        spec: a hashable description of how the sampler was built; the daemon keeps the
            runner across reloads when the spec is unchanged (so counter state survives).
        triggered: run by each :meth:`trigger`, on the caller's thread (a derived stage with
            ``after``, called by the thread that published its source's report), instead of
            on the sampler's interval; no thread of its own.
        group: the thread group to run in; ``None``: a thread of its own.
        home: returns the live group to rejoin after a spell on its own thread (a group
            whose members all left has ended; :class:`Runners` then makes a new one);
            default: ``group`` while it lasts.
    """

    def __init__(
        self,
        sampler: Sampler,
        state: AgentState,
        spec: object,
        triggered: bool = False,
        group: ThreadGroup | None = None,
        home: Callable[[], ThreadGroup | None] | None = None,
    ) -> None:
        self.sampler = sampler
        self.spec = spec
        self.triggered = triggered
        self._state = state
        self._group = group  # the group running it now; None while on a thread of its own
        self._home = home or (lambda: group)  # the group it rejoins, if any
        self._rejoin_after = REJOIN_AFTER
        self._stop = threading.Event()
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._running_since: float | None = None
        self._timed_out = False
        self._inline = threading.Lock()  # a triggered runner: one trigger or stop at a time

    def start(self) -> None:
        """Start the sampler thread (or join its thread group); a triggered one has none."""
        if self.triggered:
            return
        group = self._group
        if group is None or not group.add(self):
            self._group = None
            self._own_thread()

    def _own_thread(self) -> None:
        threading.Thread(
            target=self._main, name=f"sampler-{self.sampler.name}", daemon=True
        ).start()

    def stop(self) -> None:
        """Ask the thread to stop after its current collection; does not wait.

        A triggered runner is closed here, or, while a trigger's collection runs on another
        thread, by that thread once it is done.
        """
        self._stop.set()
        if self.triggered:
            self._close_if_stopped()
            return
        group = self._group
        if group is not None:
            group.wake()

    @property
    def stopped(self) -> bool:
        """True once :meth:`stop` was called."""
        return self._stop.is_set()

    def leave_group(self) -> None:
        """Run on a thread of its own (called by its group's thread, after a collection).

        It rejoins the group after :data:`REJOIN_AFTER` quick collections in a row (more
        after each rejoin).
        """
        self._group = None
        self._own_thread()

    def prepare(self) -> None:
        """Let the sampler start its collection's wait (:meth:`Sampler.prepare`); never raises."""
        if self.stopped:
            return
        try:
            self.sampler.prepare()
        except Exception:  # an optimisation only: collect() does the whole read anyway
            log.debug("prepare failed", extra={"kv": {"sampler": self.sampler.name}}, exc_info=True)

    def finish(self) -> None:
        """Close the sampler; :meth:`join` returns True from then on."""
        with contextlib.suppress(Exception):
            self.sampler.close()
        self._done.set()

    def trigger(self) -> None:
        """Run a triggered runner's collection now, on this thread, and publish it.

        Called by :class:`Runners` when a source the stage runs after has published a
        report; nothing once :meth:`stop` was called, nor while a collection of this stage
        runs on another thread (a report published meanwhile, e.g. the watchdog's timeout
        report for the source, does not wait for it). Never raises (as :meth:`once`).
        """
        if not self._inline.acquire(blocking=False):
            return  # a trigger's collection is running (on another thread): it reads the state
        try:
            if not self._stop.is_set():
                self.once()
        except Exception:  # the source's thread must go on
            log.exception("derived stage failed", extra={"kv": {"sampler": self.sampler.name}})
        finally:
            self._inline.release()
        self._close_if_stopped()  # stop() may have come while this collection ran

    def _close_if_stopped(self) -> None:
        """Close a stopped triggered runner unless a collection runs (its thread closes it).

        Called after setting ``_stop`` (:meth:`stop`) and after releasing the lock
        (:meth:`trigger`): whichever of the two finds the lock taken, the other, holding it
        or about to check ``_stop`` again, closes it.
        """
        if not self._stop.is_set() or not self._inline.acquire(blocking=False):
            return
        try:
            if not self._done.is_set():
                self.finish()
        finally:
            self._inline.release()

    def skip(self, ts: float) -> None:
        """Publish an empty report for a triggered runner without running it.

        Called by :class:`Runners` for a failed report of the source it runs after: there is
        nothing to derive from it (the stage's output is absent, as its collection would have
        left it), and the thread that published the failure (the watchdog's, on the event
        loop) never runs stage code.
        """
        if not self._stop.is_set():
            self._state.publish(SamplerReport(self.sampler.name, ts, 0.0, True, "", Batch()))

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
        """Run one collection and publish it (unless it timed out or the runner stopped).

        The publication counts as part of the collection for the watchdog: the derived
        stages that run after this sampler run inside it (:meth:`trigger`), so one that
        hangs marks this sampler down (``timeout``) as a hung collection would.
        """
        with self._lock:
            self._running_since = time.monotonic()
            self._timed_out = False
        try:
            report = self.collect_once()
            with self._lock:
                late = self._timed_out
            if not late and not self._stop.is_set():
                self._state.publish(report)
        finally:
            with self._lock:
                self._running_since = None

    def _main(self) -> None:
        interval = self.sampler.interval_s
        next_t = time.monotonic()
        quick = 0  # collections in a row within a quarter of the interval (then it rejoins)
        while not self._stop.is_set():
            t0 = time.monotonic()
            self.once()
            now = time.monotonic()
            quick = quick + 1 if now - t0 <= interval / 4 else 0
            if quick >= self._rejoin_after and not self._stop.is_set():
                quick = 0
                home = self._home()
                if home is not None:
                    # it may leave again: each spell in the group doubles the wait for the next
                    self._rejoin_after = min(2 * self._rejoin_after, 64 * REJOIN_AFTER)
                    self._group = home
                    if home.add(self):
                        log.info(
                            "sampler rejoined its thread group",
                            extra={"kv": {"sampler": self.sampler.name, "group": home.name}},
                        )
                        return  # the group runs it (and closes it once stopped) from now on
                    self._group = None  # that group has just ended: try again later
            next_t += interval
            if next_t < now:  # skip missed ticks instead of bursting to catch up
                next_t = now + interval - ((now - next_t) % interval)
            self._stop.wait(next_t - now)
        self.finish()


class ThreadGroup:
    """Samplers of one ``thread_group`` and interval, collected in turn on one daemon thread.

    Each tick (every ``interval_s`` seconds, missed ticks skipped as in
    :class:`SamplerRunner`) calls every member's :meth:`~agent.pipeline.Sampler.prepare`
    (the gauge readers send their GETs), then runs every member's :meth:`SamplerRunner.once`
    in the order they joined; each publishes its own report, so the state, ``/metrics``
    and the watchdog see them as separate samplers. A member whose collection takes longer
    than ``interval_s`` leaves the group for its own thread
    (:meth:`SamplerRunner.leave_group`): after the collection, or, through :meth:`check`
    (the watchdog), while it still runs, the group's other members then going on on a new
    thread, so a slow or stuck member delays the others by about one interval at most. So
    does the slowest member of a tick whose collections together took longer than
    ``interval_s``. A stopped member is closed by the group's thread between ticks; the
    thread ends when the last member left.

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
        self._gen = 0  # which thread runs the group: a superseded one ends after its call
        self._current: tuple[SamplerRunner, float] | None = None  # collecting now, since

    def add(self, runner: SamplerRunner) -> bool:
        """Add ``runner`` (starting the thread on the first); False once the group has ended."""
        with self._lock:
            if self._closed:
                return False
            self._members.append(runner)
            if not self._started:
                self._started = True
                self._spawn()
        return True

    def _spawn(self) -> None:
        """Start a thread for generation ``self._gen`` (called with the lock held)."""
        threading.Thread(
            target=self._main, args=(self._gen,), name=f"sampler-{self.name}", daemon=True
        ).start()

    @property
    def closed(self) -> bool:
        """True once the group's thread has ended (its last member left)."""
        with self._lock:
            return self._closed

    def wake(self) -> None:
        """Wake the thread now (a member was stopped: it is closed without waiting a tick)."""
        self._wake.set()

    def check(self, now: float) -> None:
        """Move the other members to a new thread when the one collecting overran the interval.

        Called by the watchdog (:meth:`Runners.check_timeouts`). The overrunning member
        leaves the group when its collection returns (its thread then becomes its own).

        Args:
            now: ``time.monotonic()`` seconds.
        """
        with self._lock:
            current = self._current
            if current is None or self._closed or now - current[1] <= self.interval_s:
                return
            runner = current[0]
            self._current = None
            if runner in self._members:
                self._members.remove(runner)
            self._gen += 1
            if self._members:
                self._spawn()
            else:
                self._closed = True
        log.info(
            "sampler left its thread group: a collection is running past the interval",
            extra={"kv": {"sampler": runner.sampler.name, "group": self.name}},
        )

    def _main(self, gen: int) -> None:
        interval = self.interval_s
        next_t = time.monotonic()
        while True:
            if time.monotonic() >= next_t:
                if not self._tick(interval, gen):
                    return  # superseded (check): the rest of the group runs on a new thread
                next_t += interval
                now = time.monotonic()
                if next_t < now:  # skip missed ticks instead of bursting to catch up
                    next_t = now + interval - ((now - next_t) % interval)
            if self._reap(gen):
                return
            self._wake.wait(max(0.0, next_t - time.monotonic()))
            self._wake.clear()

    def _tick(self, interval: float, gen: int) -> bool:
        """One collection of every member; False when this thread was superseded meanwhile."""
        with self._lock:
            members = list(self._members)
        for runner in members:
            runner.prepare()
        spent = 0.0  # wall seconds of this tick's collections
        slowest: tuple[SamplerRunner | None, float] = (None, -1.0)
        for runner in members:
            with self._lock:
                if self._gen != gen:
                    return False
                if runner.stopped or runner not in self._members:
                    continue
                t0 = time.monotonic()
                self._current = (runner, t0)
            runner.once()
            took = time.monotonic() - t0
            with self._lock:
                detached = self._gen != gen
                if not detached:
                    self._current = None
                slow = not detached and took > interval and not runner.stopped
                if slow:
                    self._members.remove(runner)
            if detached:  # check() moved the others on: this thread becomes the runner's
                runner.leave_group()
                return False
            if slow:
                self._leave(runner, "a collection ran past the interval")
            else:
                spent += took
                if took > slowest[1]:
                    slowest = (runner, took)
        if spent > interval:
            # each collection fit, not all of them: the slowest one (an engine slow to
            # answer) leaves, so the rest keep their interval
            worst = slowest[0]
            if worst is not None:
                with self._lock:
                    leave = worst in self._members and len(self._members) > 1
                    if leave:
                        self._members.remove(worst)
                if leave:
                    self._leave(worst, "the group's collections ran past the interval")
        return True

    def _leave(self, runner: SamplerRunner, why: str) -> None:
        log.info(
            "sampler left its thread group: %s",
            why,
            extra={"kv": {"sampler": runner.sampler.name, "group": self.name}},
        )
        runner.leave_group()

    def _reap(self, gen: int) -> bool:
        """Close the stopped members; True when none is left (the thread then ends)."""
        with self._lock:
            if self._gen != gen:
                return True
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
        self._groups_lock = threading.Lock()
        state.on_publish(self._published)

    def _published(self, report: SamplerReport) -> None:
        reg = self._labels.get(report.sampler)
        if reg is None:
            return
        for name, after in list(self._after.items()):
            if reg in after:
                runner = self.runners.get(name)
                if runner is None:
                    continue
                if report.ok:
                    runner.trigger()
                else:
                    runner.skip(report.ts)

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
            group = None if triggered else self._group(sampler)
            home = None if group is None else functools.partial(self._group, sampler)
            runner = SamplerRunner(sampler, self.state, spec, triggered, group, home)
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
        with self._groups_lock:  # runner threads rejoining call this too
            group = self._groups.get(key)
            if group is None or group.closed:
                group = self._groups[key] = ThreadGroup(name, sampler.interval_s)
            return group

    def check_timeouts(self, now: float) -> None:
        """The daemon's watchdog: mark down every sampler whose collection overran.

        Also moves the other members of a thread group whose member is collecting past the
        interval to a new thread (:meth:`ThreadGroup.check`).
        """
        for r in list(self.runners.values()):
            r.check_timeout(now)
        with self._groups_lock:
            groups = list(self._groups.values())
        for group in groups:
            group.check(now)

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
