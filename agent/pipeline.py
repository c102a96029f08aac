"""The pipeline: every stage the agent runs, registered by name. Read this file for the map.

Data flows one way::

    sources (Stage.SOURCE)          core                       derived (Stage.DERIVED)
    host, gpu, engines  ──► Batch ─► AgentState (latest)  ──►  accelerator  (after gpu)
                                     + Timeline                requests, capacity,
    OTLP receiver, proxies ─► RequestRecord ─► RequestStream ─► attribution
                                                            exporters render the state

Each stage module registers itself at import with :func:`register` (name, stage, default
switch, factory); :data:`MODULES` lists those modules, in the order the agent shows them.
The daemon (:mod:`agent.daemon`) is a loop over :func:`plan`: every registration gets the
same ``samplers.<name>.enabled`` / ``interval_s`` switch in the config
(:class:`agent.config.SamplersConfig`), and one :class:`Context` to build from.

Rules of the house, checked by ``tests/test_pipeline.py``:

* a source reads the outside world only, never another source or the state. What several
  stages need is a lookup in the :class:`Context`: ``engine_pids`` (the PIDs listening on
  the engines' ports: :func:`agent.discovery.listening_pids`, read by the GPU source to
  join processes to engines and by ``engine_pods``), ``engine_pods`` (an engine's pod labels: its
  listening PID's ``/proc/PID/cgroup``, plus names that only the GPU source's process rows
  give, joined on the derived side by :class:`agent.kube.PodNameJoin` from each published
  ``gpu`` report, never read from the state or the GPU sampler by the engine source) and
  ``engine_processes`` (the PIDs listening on an engine's port from the same bounded lookup,
  :meth:`agent.kube.EnginePods.pids`: the host source reads their CPU time);
* a derived stage reads the state and timeline; one with ``after`` runs right after each
  report of those sources (the same tick), the others on their own interval. A stage that
  reads the timeline declares the metric names it reads (its sampler's
  :attr:`Sampler.timeline_reads`, passed as ``reads`` to :func:`register`): the timeline
  keeps only the names the enabled stages declared (:func:`timeline_reads`), and reading
  any other raises :class:`agent.timeline.NotKept`;
* exporters are not stages: they render the state and report their own health with
  :meth:`agent.state.AgentState.add_health`.
"""

from __future__ import annotations

import abc
import enum
import importlib
import logging
import threading
from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final

from kvpressure.agent.samples import Batch

if TYPE_CHECKING:
    from kvpressure.agent.attribution.sampler import SpanSink
    from kvpressure.agent.attribution.store import AttributionStore
    from kvpressure.agent.config import Config, EngineConfig
    from kvpressure.agent.requests.record import RequestStream
    from kvpressure.agent.state import AgentState

log = logging.getLogger(__name__)

MODULES: Final = (
    "kvpressure.agent.samplers.host",
    "kvpressure.agent.samplers.gpu",
    "kvpressure.agent.samplers.engines",
    "kvpressure.agent.samplers.accelerator",
    "kvpressure.agent.requests.metrics",
    "kvpressure.agent.capacity.live",
    "kvpressure.agent.attribution",
)
"""The stage modules, each registering itself (sources first, then derived stages)."""


class Stage(enum.StrEnum):
    """Where a stage sits in the one-way flow."""

    SOURCE = "source"
    """Reads the outside world (procfs, NVML, an engine's ``/metrics``)."""
    DERIVED = "derived"
    """Reads the state and timeline the sources filled."""


SHARED_THREAD: Final = "shared"
"""The default :attr:`Sampler.thread_group`: every sampler of one interval on one thread."""

ENGINE_SAMPLER: Final = "engine:"
"""Name prefix of an engine's full-scrape sampler and plan (``engine:<name>``)."""
ENGINE_GAUGE_SAMPLER: Final = "engine-gauges:"
"""Name prefix of an engine's gauge-read sampler and plan (``engine-gauges:<name>``)."""
ENGINE_SAMPLERS: Final[tuple[str, ...]] = (ENGINE_SAMPLER, ENGINE_GAUGE_SAMPLER)
"""Name prefixes of the samplers that publish engine metrics (``kvpressure_engine_*``): a
stage reading those from the state asks only their reports
(:meth:`agent.state.AgentState.latest_many`)."""


class Sampler(abc.ABC):
    """A periodic stage: a reader of one kind of source, or a derived computation.

    Subclasses implement :meth:`collect`. The daemon calls it every ``interval_s`` seconds
    (or, for a derived stage with ``after``, right after each report of those sources) on
    the thread it shares with the other samplers of that interval, or on one of its own
    while its collections overrun the interval (:mod:`agent.scheduler`); a call that runs
    longer than ``timeout_s`` marks the sampler down (``kvpressure_sampler_up 0``) without
    blocking any other sampler.

    Attributes:
        name: the value of the ``sampler`` label, e.g. ``"host"`` or ``"engine:vllm"``.
        interval_s: seconds between the starts of two collections.
        timeout_s: seconds after which a running collection counts as failed.
        thread_group: samplers of one ``thread_group`` and interval share one thread,
            collected in turn (:class:`agent.scheduler.ThreadGroup`); every sampler is in
            :data:`SHARED_THREAD` unless it names another group, or ``None`` for a thread
            of its own.
        timeline_reads: the metric names this stage reads back from the timeline
            (:meth:`agent.timeline.Timeline.window`); empty for a source and for a stage
            that reads only the latest state. The timeline keeps only the names that the
            stages it serves declared (:func:`timeline_reads`; an ``extra_samplers`` entry
            of the daemon is asked its own), so a name read and not declared raises
            :class:`agent.timeline.NotKept`.
    """

    name: str = "sampler"
    thread_group: str | None = SHARED_THREAD
    timeline_reads: frozenset[str] = frozenset()

    def __init__(self, interval_s: float = 1.0, timeout_s: float | None = None) -> None:
        self.interval_s = interval_s
        self.timeout_s = timeout_s if timeout_s is not None else max(interval_s, 2.0)

    @abc.abstractmethod
    def collect(self, batch: Batch) -> None:
        """Read the sources and add samples to ``batch``.

        Args:
            batch: the batch to fill. A source that fails is recorded with
                :meth:`Batch.source_error`; what was read stays in the batch.

        Raises:
            Exception: anything raised means the whole sampler failed this cycle; the
                daemon logs it, sets ``kvpressure_sampler_up 0`` and drops the batch.
        """

    def prepare(self) -> None:  # noqa: B027 - optional hook, empty by default
        """Start this tick's wait early: called by its thread group before any member collects.

        A sampler that waits on the network sends its request here, so the waits of the
        members of one thread group overlap (the engines' gauge readers send their GETs);
        :meth:`collect` then reads the answer. Must not block or raise. Not called for a
        sampler on a thread of its own.
        """

    def close(self) -> None:  # noqa: B027 - optional hook, empty by default
        """Release resources (HTTP clients, NVML handles). Called once at shutdown."""


@dataclass(frozen=True, slots=True)
class Plan:
    """One sampler to run.

    Attributes:
        name: its ``sampler`` label value (``host``, ``engine:vllm``).
        spec: a hashable description of what it was built from; the daemon keeps the
            running sampler across reloads while the spec is unchanged (counters survive).
        build: makes the sampler (called once per spec).
    """

    name: str
    spec: Hashable
    build: Callable[[], Sampler]


@dataclass(frozen=True, slots=True)
class Context:
    """Everything a stage factory may use; one per :func:`plan` call.

    Attributes:
        config: the validated configuration.
        state: the agent's state (derived stages read it; sources must not).
        requests: the one request stream (derived stages subscribe to it).
        attributions: the attribution store (outlives reloads).
        engines: configured and discovered engines.
        engine_pids: PID -> engine label of local engine processes (the GPU join); reads
            the OS (``psutil``), not a stage.
        engine_pods: engine label -> its pod's labels (:meth:`agent.kube.EnginePods.labels`);
            its names come from :class:`agent.kube.PodNameJoin`, a derived join of the
            published ``gpu`` reports (see the module doc), so the engine source reading it
            reads neither the state nor another source.
        engine_processes: ``(engine label, gone) -> PIDs`` listening on the engine's port
            (:meth:`agent.kube.EnginePods.pids`, one bounded ``engine_pids`` lookup shared
            with ``engine_pods``; ``gone=True`` asks again early); reads the OS, not a stage.
        span_sink: the OTLP exporter's span sink, or ``None`` when export is off.
    """

    config: Config
    state: AgentState
    requests: RequestStream
    attributions: AttributionStore
    engines: tuple[EngineConfig, ...] = ()
    engine_pids: Callable[[], dict[int, str]] | None = None
    engine_pods: Callable[[str], Mapping[str, str]] | None = None
    engine_processes: Callable[[str, bool], tuple[int, ...]] | None = None
    span_sink: SpanSink | None = None

    def interval_s(self, name: str) -> float:
        """``samplers.<name>.interval_s``, else the global ``interval_s`` (seconds)."""
        toggle = getattr(self.config.samplers, name, None)
        own = getattr(toggle, "interval_s", None)
        return float(own) if own else float(self.config.interval_s)


ConfigCheck = Callable[["Config"], Iterable[tuple[str, str]]]
"""Validates what only the stage knows (rule names, dtypes): yields ``(field path, message)``."""


@dataclass(frozen=True, slots=True)
class Registration:
    """One named stage.

    Attributes:
        name: the registry name; also its ``samplers.<name>`` config key.
        stage: :class:`Stage`.
        plan: ``plan(ctx) -> [Plan, ...]``: the samplers to run (several for ``engines``).
        doc: one line for the docs.
        default_enabled: the ``samplers.<name>.enabled`` default.
        label: the ``sampler`` label (prefix before ``:`` for per-instance samplers).
        after: for a derived stage, the sources whose reports trigger it.
        check: extra config validation the stage owns.
        reads: the metric names the stage reads back from the timeline (its sampler's
            :attr:`Sampler.timeline_reads`).
    """

    name: str
    stage: Stage
    plan: Callable[[Context], list[Plan]]
    doc: str
    default_enabled: bool = True
    label: str = ""
    after: tuple[str, ...] = ()
    check: ConfigCheck | None = None
    reads: frozenset[str] = frozenset()


_REGISTRY: dict[str, Registration] = {}
_LOCK = threading.Lock()
_LOADED = False


def register(
    name: str,
    stage: Stage,
    doc: str,
    *,
    default_enabled: bool = True,
    label: str = "",
    after: tuple[str, ...] = (),
    check: ConfigCheck | None = None,
    reads: frozenset[str] = frozenset(),
) -> Callable[[Callable[[Context], list[Plan]]], Callable[[Context], list[Plan]]]:
    """Register the decorated ``plan(ctx)`` function as stage ``name`` (see the module doc).

    Raises:
        ValueError: ``name`` is registered twice, ``after`` names a stage on a source, or a
            source declares timeline reads.
    """

    def deco(fn: Callable[[Context], list[Plan]]) -> Callable[[Context], list[Plan]]:
        if name in _REGISTRY and _REGISTRY[name].plan is not fn:
            raise ValueError(f"stage {name!r} registered twice")
        if after and stage is not Stage.DERIVED:
            raise ValueError(f"stage {name!r}: only a derived stage runs after others")
        if reads and stage is not Stage.DERIVED:
            raise ValueError(f"stage {name!r}: only a derived stage reads the timeline")
        _REGISTRY[name] = Registration(name, stage, fn, doc, default_enabled, label or name,
                                       after, check, frozenset(reads))  # fmt: skip
        return fn

    return deco


def registry() -> Mapping[str, Registration]:
    """Import every stage module of :data:`MODULES` once and return the registrations."""
    global _LOADED  # noqa: PLW0603 - one import pass per process
    with _LOCK:
        if not _LOADED:
            for module in MODULES:
                importlib.import_module(module)
            _LOADED = True
    order = {m: i for i, m in enumerate(MODULES)}
    regs = sorted(_REGISTRY.values(), key=lambda r: (order.get(r.plan.__module__, 99), r.name))
    return {r.name: r for r in regs}


def enabled(config: Config, name: str) -> bool:
    """``samplers.<name>.enabled`` (the registration's default when the key is absent)."""
    toggle = getattr(config.samplers, name, None)
    if toggle is None:
        return registry()[name].default_enabled
    return bool(toggle.enabled)


def timeline_reads(config: Config) -> frozenset[str]:
    """The metric names the timeline keeps for ``config``: what its enabled stages read.

    The union of the ``reads`` every enabled registration declared (a disabled stage's
    names are not kept; a source declares none). The daemon passes it to
    :meth:`agent.timeline.Timeline.set_kept`.
    """
    return frozenset().union(
        *(reg.reads for reg in registry().values() if enabled(config, reg.name))
    )


def starved(config: Config) -> list[str]:
    """Derived stages ``config`` enables whose every input source it disables.

    Such a stage never runs (no source reports to it): a config that turns the
    ``gpu`` source off also silences ``accelerator``. The daemon logs these at every config
    it adopts and ``check-config`` prints them, so the silence is never a surprise.

    Returns:
        One message per starved stage, naming the keys to change; empty when none.
    """
    out = []
    for reg in registry().values():
        if not reg.after or not enabled(config, reg.name):
            continue
        if not any(enabled(config, src) for src in reg.after):
            srcs = " and ".join(f"samplers.{s}" for s in reg.after)
            out.append(
                f"samplers.{reg.name} is enabled but will not run: its input {srcs} "
                f"{'is' if len(reg.after) == 1 else 'are'} disabled"
            )
    return out


def warn_starved(config: Config) -> None:
    """Log one warning per :func:`starved` stage of ``config``."""
    for msg in starved(config):
        log.warning(msg)


@dataclass(frozen=True, slots=True)
class Planned:
    """A :class:`Plan` with the registration it came from."""

    plan: Plan
    reg: Registration = field(compare=False)


def plan(ctx: Context) -> dict[str, Planned]:
    """Every sampler the config asks for, by ``sampler`` label, sources first.

    Raises:
        Exception: whatever a stage's ``plan`` raises (a bug; the daemon logs it).
    """
    out: dict[str, Planned] = {}
    for reg in registry().values():
        if enabled(ctx.config, reg.name):
            for p in reg.plan(ctx):
                out[p.name] = Planned(p, reg)
    return out


def check_config(config: Config) -> list[tuple[str, str]]:
    """Run every stage's own config check; ``[(field path, message), ...]`` (empty: ok)."""
    problems: list[tuple[str, str]] = []
    for reg in registry().values():
        if reg.check is not None:
            problems.extend(reg.check(config))
    return problems
