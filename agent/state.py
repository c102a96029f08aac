"""What the agent knows right now: each sampler's latest report, and the timeline.

Samplers' worker threads :meth:`AgentState.publish` a :class:`SamplerReport` per cycle;
exporters read :meth:`AgentState.samples` (the latest batch of every healthy sampler plus
the agent's own metrics). A sampler that failed contributes no samples, so its stale values
never linger: vanished label sets disappear from the exposition by themselves.
"""

from __future__ import annotations

import logging
import platform
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from kvpressure.agent import __version__
from kvpressure.agent.catalogue import SampleName
from kvpressure.agent.samples import Batch, Labels, Sample, SourceStatus, make_labels
from kvpressure.agent.timeline import Timeline

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SamplerReport:
    """The outcome of one sampler cycle.

    Attributes:
        sampler: the sampler's name (``sampler`` label).
        ts: Unix time (seconds) when the collection started; the samples' timestamp.
        duration_s: wall time the collection took, in seconds.
        ok: False when the collection raised or timed out.
        reason: short failure reason (``timeout``, the exception type); empty when ok.
        batch: the samples and source statuses; ``None`` when the collection failed.
    """

    sampler: str
    ts: float
    duration_s: float
    ok: bool
    reason: str = ""
    batch: Batch | None = None


@dataclass(slots=True)
class _Counters:
    failures: Counter[tuple[str, str]] = field(default_factory=Counter)
    reloads: Counter[str] = field(default_factory=Counter)
    unknown_samples: int = 0


class AgentState:
    """The latest report of every sampler, the timeline, and the agent's own counters.

    Thread-safe. Args:
        timeline: where every successful batch is appended.
    """

    def __init__(self, timeline: Timeline) -> None:
        self.timeline = timeline
        self.started = time.time()
        self._reports: dict[str, SamplerReport] = {}
        self._lock = threading.Lock()
        self._c = _Counters()
        self._version = 0
        self._health: dict[str, Callable[[], Iterable[Sample]]] = {}
        self._listeners: list[Callable[[SamplerReport], None]] = []
        # each report's samples of the names one latest_many() asks, built on its first
        # call after the publish; keyed by (sampler, names): code asks a few fixed sets
        self._by_name: dict[
            tuple[str, tuple[SampleName, ...]], tuple[SamplerReport, dict[str, list[Sample]]]
        ] = {}

    def add_health(self, name: str, samples: Callable[[], Iterable[Sample]]) -> None:
        """Render ``samples()`` with the agent's own metrics (an exporter's health).

        Exporters are not samplers: they report their counters through this, read on every
        render. A provider that raises is skipped for that render.
        """
        with self._lock:
            self._health[name] = samples

    def remove_health(self, name: str) -> None:
        """Stop rendering the health samples registered as ``name``."""
        with self._lock:
            self._health.pop(name, None)

    def on_publish(self, listener: Callable[[SamplerReport], None]) -> None:
        """Call ``listener(report)`` after each :meth:`publish` (the scheduler's trigger)."""
        with self._lock:
            self._listeners.append(listener)

    def report(self, sampler: str) -> SamplerReport | None:
        """The latest report of ``sampler``, or ``None``."""
        with self._lock:
            return self._reports.get(sampler)

    @property
    def version(self) -> object:
        """Changes whenever :meth:`samples` may yield something else; exporters cache on it.

        Returns:
            A value compared with ``==``: the count of publishes, removals and reloads, and
            the exporters' health samples as they are now (read here: they change without
            a publish); never equal to an earlier one when a health provider fails.
        """
        with self._lock:
            health = list(self._health.values())
            version = self._version
        try:
            return (version, tuple([s for provider in health for s in provider()]))
        except Exception:  # noqa: BLE001 - the rendering logs it; this one is not cached
            return object()

    def publish(self, report: SamplerReport) -> None:
        """Store ``report`` as its sampler's latest and append its samples to the timeline."""
        with self._lock:
            self._reports[report.sampler] = report
            self._version += 1
            if not report.ok:
                self._c.failures[(report.sampler, report.reason or "error")] += 1
        if report.ok and report.batch is not None:
            self.timeline.append(report.ts, report.batch.recorded(), clock=report.sampler)
        with self._lock:
            listeners = list(self._listeners)
        for listener in listeners:
            listener(report)

    def remove(self, sampler: str) -> None:
        """Forget a sampler that was stopped (removed engine, reload)."""
        with self._lock:
            self._reports.pop(sampler, None)
            for key in [k for k in self._by_name if k[0] == sampler]:
                del self._by_name[key]
            self._version += 1

    def count_reload(self, result: str) -> None:
        """Count a SIGHUP reload with ``result`` ``ok`` or ``invalid``."""
        with self._lock:
            self._c.reloads[result] += 1
            self._version += 1

    def count_unknown_sample(self) -> None:
        """Count a sample the exporter dropped because its name is not in the catalogue."""
        with self._lock:
            self._c.unknown_samples += 1

    def reports(self) -> list[SamplerReport]:
        """Return the latest report of every sampler, sorted by sampler name."""
        with self._lock:
            return [self._reports[k] for k in sorted(self._reports)]

    def latest(self, name: SampleName) -> dict[Labels, float]:
        """Return the current value of every series of ``name`` from the latest batches.

        Used by derived computations (accelerator stall time, capacity) that combine what
        several samplers saw; only healthy samplers' latest batches are read. A stage that
        asks for several names each tick asks :meth:`latest_many` once instead.
        """
        return self.latest_many((name,))[name]

    def latest_many(
        self, names: Iterable[SampleName], samplers: tuple[str, ...] = ("",)
    ) -> dict[SampleName, dict[Labels, float]]:
        """:meth:`latest` of each of ``names``, read in one pass over the samplers' reports.

        Args:
            names: the sample names to read.
            samplers: read only the reports of samplers whose name starts with one of these
                (default: every sampler). A stage that reads engine metrics at 10 Hz passes
                the engine samplers' prefixes (:data:`agent.pipeline.ENGINE_SAMPLERS`): the
                GPU and host reports, new every cycle, are then not searched for names they
                never carry.

        Returns:
            Each name to ``{labels: value}`` (empty when no healthy sampler has it); where
            two samplers report one series, the first by sampler name wins, as in
            :meth:`latest`. One walk of the ~25 reports of a node answers every name (the
            accelerator asks 6 names at 10 Hz), not one walk per name.
        """
        wanted = tuple(names)
        out: dict[SampleName, dict[Labels, float]] = {n: {} for n in wanted}
        for r in self.reports():
            if r.ok and r.batch is not None and r.sampler.startswith(samplers):
                index = self._named(r, wanted)
                for name, got in out.items():
                    for s in index.get(name, ()):
                        got.setdefault(s.labels, s.value)
        return out

    def _named(
        self, report: SamplerReport, wanted: tuple[SampleName, ...]
    ) -> dict[str, list[Sample]]:
        # A derived stage asks for a few names on every tick; a batch changes once per
        # publish: its samples of those names are picked out once, not per question (and
        # only those: most of a 10 Hz batch is of names nobody asks for).
        key = (report.sampler, wanted)
        got = self._by_name.get(key)
        if got is not None and got[0] is report:
            return got[1]
        index: dict[str, list[Sample]] = {}
        assert report.batch is not None
        names = frozenset(wanted)
        for s in report.batch.samples:
            if s.name in names:
                index.setdefault(s.name, []).append(s)
        self._by_name[key] = (report, index)
        return index

    def samples(self) -> Iterator[Sample]:
        """Yield the latest samples of every healthy sampler, then the agent's own metrics."""
        reports = self.reports()
        for r in reports:
            if r.ok and r.batch is not None:
                yield from r.batch.samples
        yield from self._self_samples(reports)

    def _self_samples(self, reports: list[SamplerReport]) -> Iterator[Sample]:
        yield Sample(
            "kvpressure_build_info",
            1.0,
            make_labels({"version": __version__, "python": platform.python_version()}),
        )
        for r in reports:
            lab = make_labels({"sampler": r.sampler})
            yield Sample("kvpressure_sampler_up", 1.0 if r.ok else 0.0, lab)
            yield Sample("kvpressure_sampler_duration_seconds", r.duration_s, lab)
            if r.batch is not None:
                yield from _source_samples(r.sampler, r.batch.sources)
        with self._lock:
            failures = dict(self._c.failures)
            reloads = dict(self._c.reloads)
            unknown = self._c.unknown_samples
        for (sampler, reason), n in sorted(failures.items()):
            yield Sample(
                "kvpressure_sampler_failures_total",
                float(n),
                make_labels({"sampler": sampler, "reason": reason}),
            )
        for result, n in sorted(reloads.items()):
            yield Sample(
                "kvpressure_config_reloads_total", float(n), make_labels({"result": result})
            )
        yield Sample("kvpressure_timeline_series", float(len(self.timeline)))
        yield Sample(
            "kvpressure_timeline_dropped_samples_total", float(self.timeline.dropped_samples)
        )
        for reason, n in (
            ("cap", self.timeline.evicted_series),
            ("stale", self.timeline.forgotten_series),
        ):
            yield Sample(
                "kvpressure_timeline_evicted_series_total",
                float(n),
                make_labels({"reason": reason}),
            )
        yield Sample("kvpressure_exporter_unknown_samples_total", float(unknown))
        with self._lock:
            health = list(self._health.values())
        for provider in health:
            try:
                got = list(provider())
            except Exception:  # an exporter's bug must not break rendering
                log.exception("health samples failed")
                continue
            yield from got


_RANK = {"ok": 0, "unsupported": 1, "error": 2}


def _source_samples(sampler: str, sources: list[SourceStatus]) -> Iterator[Sample]:
    worst: dict[str, SourceStatus] = {}
    for s in sources:
        prev = worst.get(s.source)
        if prev is None or _RANK.get(s.state, 2) > _RANK.get(prev.state, 2):
            worst[s.source] = s
    for s in worst.values():
        if s.state == "unsupported":
            yield Sample(
                "kvpressure_source_unsupported",
                1.0,
                make_labels({"sampler": sampler, "source": s.source, "reason": s.reason}),
            )
        else:
            yield Sample(
                "kvpressure_source_up",
                1.0 if s.state == "ok" else 0.0,
                make_labels({"sampler": sampler, "source": s.source}),
            )
