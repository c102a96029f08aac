"""Accelerator stall time, data movement per token and engine/NVML disagreement (derived).

A derived stage (:mod:`agent.pipeline`, ``accelerator``): it runs right after each report of
the ``gpu`` source and reads that report plus the engines' latest request gauges and token
counters from the state. The GPU sampler itself reads only NVML and procfs.

**Accelerator stall time** (``kvpressure_accelerator_stall_seconds_total{gpu,uuid,mig,reason}``)
is accumulated per GPU report. Let ``dt`` be the seconds since the GPU's previous report in
which it was up (no accrual across a report where it was down, or when ``dt`` exceeds
``max(5 x gpu interval, 5 s)``). For each leaf device (a GPU without MIG, or each MIG instance
of a MIG-enabled GPU), with ``R``/``W`` = the sum of ``kvpressure_engine_requests_running``/
``_waiting`` over the engines on that device, ``U`` = ``kvpressure_gpu_utilization_ratio``,
``B`` = ``kvpressure_gpu_memory_bandwidth_utilization_ratio{source="gpm"}`` (the NVML
memory-activity fallback is not used here: it measures time, not bandwidth), ``S`` =
``kvpressure_gpu_sm_occupancy_ratio`` and ``T`` = whether a power/thermal
``kvpressure_gpu_clock_event_active`` reason is 1 (``sw_power_cap``, ``hw_slowdown``,
``sw_thermal_slowdown``, ``hw_thermal_slowdown``, ``hw_power_brake_slowdown``; the parent's for
a MIG instance), ``dt`` is added to the first reason that holds, in this order::

    if R + W > 0:
        throttled        if T
        memory_bound     elif B > memory_bound_bandwidth_above (0.60) and
                              S < memory_bound_sm_below (0.30)
        idle_with_queue  elif W > 0 and U < idle_utilization_below (0.10)

Throttling comes first because it is the cause when it coincides with the others (a capped
clock lowers utilization and occupancy); memory-bound before idle-with-queue because a GPU
streaming memory is busy, not idle. **A reason whose signals are missing never accrues** (no
GPM → no ``memory_bound``; no utilization, as under MIG → no ``idle_with_queue``; no clocks
reasons → no ``throttled``; no engine request gauges → nothing); each reason's counter is
exported once its GPU-side signals have been seen on that device and then stays. Thresholds
come from ``gpu.*`` in the config.

**Engine → GPU mapping.** An engine holds a device when one of its processes does
(``kvpressure_gpu_process_memory_bytes{engine}``, joined by the GPU sampler through the PID
ancestry). An engine with no process seen on any GPU counts for every GPU.

**Data movement** (per physical GPU, absent for MIG instances) over the last
``data_movement_window_s`` of contiguous reports: ``kvpressure_data_movement_bytes_per_token =
(ΔPCIe rx+tx + ΔNVLink rx+tx bytes) / Δtokens`` and ``kvpressure_tokens_per_byte = Δtokens /
mean(memory used)`` (time-weighted), where bytes are the increase of
``kvpressure_gpu_{pcie,nvlink}_bytes_total`` and tokens the increase of
``kvpressure_engine_prompt_tokens_total + _generation_tokens_total`` of the engines on that GPU.
Absent when either side is unknown: no token counters, PCIe counters unsupported, NVLink present
but unreadable (``gpu<i>.nvlink`` unsupported), memory unsupported or unified, or (bytes per
token) no tokens in the window.

**Disagreement.** ``kvpressure_gpu_engine_disagreement{engine,signal}`` compares an engine's
own GPU memory reading (Triton's ``nv_gpu_*``) with NVML's (see :meth:`_disagreement`).

Like the GPU sampler, the module imports only the standard library and the core, so
``benchmarks/gpu_check.py`` runs it on a bare GPU machine.
"""

from __future__ import annotations

import functools
import logging
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Final

from kvpressure.agent import catalogue as m
from kvpressure.agent.catalogue import SampleName
from kvpressure.agent.logs import LogOnce
from kvpressure.agent.pipeline import ENGINE_SAMPLERS, Context, Plan, Sampler, Stage, register
from kvpressure.agent.samples import Batch, Labels, Sample, SourceStatus, make_labels
from kvpressure.agent.state import SamplerReport

log = logging.getLogger(__name__)

STALL_REASONS: Final = ("idle_with_queue", "memory_bound", "throttled")
THROTTLE_REASONS: Final = frozenset(
    {
        "sw_power_cap",
        "hw_slowdown",
        "sw_thermal_slowdown",
        "hw_thermal_slowdown",
        "hw_power_brake_slowdown",
    }
)

RUNNING: Final = m.ENGINE_REQUESTS_RUNNING
WAITING: Final = m.ENGINE_REQUESTS_WAITING
PROMPT_TOKENS: Final = m.ENGINE_PROMPT_TOKENS_TOTAL
GENERATION_TOKENS: Final = m.ENGINE_GENERATION_TOKENS_TOTAL
TOKEN_COUNTERS: Final[tuple[SampleName, ...]] = (PROMPT_TOKENS, GENERATION_TOKENS)
ENGINE_GPU_VIEWS: Final[dict[str, SampleName]] = {
    "memory_total": m.ENGINE_GPU_MEMORY_TOTAL_BYTES,
    "memory_used": m.ENGINE_GPU_MEMORY_USED_BYTES,
}
"""Engine metrics that restate an NVML reading (Triton's nv_gpu_*), by signal."""
_VIEWED: Final[tuple[SampleName, ...]] = (
    *ENGINE_GPU_VIEWS.values(),
    RUNNING,
    WAITING,
    *TOKEN_COUNTERS,
)
"""Every engine metric the stage reads from the state, asked in one call per tick."""
DISAGREE_TOTAL_SHARE: Final = 0.01
DISAGREE_USED_SHARE: Final = 0.05
DISAGREE_USED_MIN_BYTES: Final = float(2**30)
MAX_DEVICES: Final = 4096
"""Devices (GPUs and MIG instances) whose counters are remembered; the least recently seen
is forgotten first (a MIG layout that churns cannot grow memory without bound)."""

StateView = Callable[[Iterable[SampleName]], Mapping[SampleName, Mapping[Labels, float]]]
"""``AgentState.latest_many``: metric names → each name's {labels: current value}."""

_DEVICE_KEYS: Final = frozenset({"gpu", "uuid", "mig"})


# ---- thresholds and the stall rule ------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class StallThresholds:
    """Accelerator-stall thresholds (ratios 0-1) and the data-movement window (seconds).

    Attributes:
        idle_utilization_below: ``idle_with_queue`` when utilization is below this.
        memory_bound_bandwidth_above: ``memory_bound`` needs bandwidth utilization above this...
        memory_bound_sm_below: ...and SM occupancy below this.
        data_movement_window_s: window of bytes-per-token and tokens-per-byte, seconds.
    """

    idle_utilization_below: float = 0.10
    memory_bound_bandwidth_above: float = 0.60
    memory_bound_sm_below: float = 0.30
    data_movement_window_s: float = 30.0

    @classmethod
    def of(cls, obj: object | None = None, **overrides: float) -> StallThresholds:
        """Build from any object with these attributes (e.g. ``config.GpuConfig``) and overrides."""
        values: dict[str, float] = {}
        for name in cls.__dataclass_fields__:
            if obj is not None and hasattr(obj, name):
                values[name] = float(getattr(obj, name))
        values.update({k: float(v) for k, v in overrides.items()})
        return cls(**values)


def stall_reason(
    *,
    running: float | None,
    waiting: float | None,
    utilization: float | None,
    bandwidth: float | None,
    sm_occupancy: float | None,
    throttled: bool | None,
    thresholds: StallThresholds,
) -> str | None:
    """Return the stall reason for one interval, or ``None`` (see the module docstring).

    Args:
        running: requests running on the engines of the device; ``None`` when unknown.
        waiting: requests waiting; ``None`` when unknown.
        utilization: GPU utilization ratio 0-1; ``None`` when unknown.
        bandwidth: memory-bandwidth utilization ratio 0-1; ``None`` when unknown.
        sm_occupancy: SM occupancy ratio 0-1; ``None`` when unknown.
        throttled: a power/thermal clocks event reason is active; ``None`` when unknown.
        thresholds: the configured thresholds.

    Returns:
        ``"throttled"``, ``"memory_bound"``, ``"idle_with_queue"`` or ``None``. A reason whose
        inputs are unknown is never returned.
    """
    if running is None and waiting is None:
        return None
    if (running or 0.0) + (waiting or 0.0) <= 0:
        return None
    if throttled:
        return "throttled"
    if (
        bandwidth is not None
        and sm_occupancy is not None
        and bandwidth > thresholds.memory_bound_bandwidth_above
        and sm_occupancy < thresholds.memory_bound_sm_below
    ):
        return "memory_bound"
    if (
        utilization is not None
        and waiting is not None
        and waiting > 0
        and utilization < thresholds.idle_utilization_below
    ):
        return "idle_with_queue"
    return None


class _Run:
    """Running sums ``a``, ``b`` over a trailing time window of contiguous known points.

    Each point covers ``(t - dt, t]``; a point with an unknown value restarts the run, so the
    sums only ever cover an unbroken stretch of known values. O(1) amortized per point.

    The points are packed four doubles each (``t, dt, a, b``) in one ``array('d')``, the
    oldest at ``_head``, whose dropped prefix is cut once it is the larger half: 32-80 bytes
    a point instead of a tuple of four floats' ~170 (a 30 s window of 8 GPUs at 0.1 s holds
    4,800 points; issue 15). The sums see the same values in the same order as before.
    """

    __slots__ = ("_buf", "_head", "a", "b", "span")

    def __init__(self) -> None:
        self._buf = array("d")
        self._head = 0
        self.a = 0.0
        self.b = 0.0
        self.span = 0.0

    def __len__(self) -> int:
        """The points in the window."""
        return (len(self._buf) - self._head) // 4

    def add(self, t: float, dt: float, a: float | None, b: float | None, horizon: float) -> None:
        if a is None or b is None:
            self.clear()
            return
        buf = self._buf
        buf.extend((t, dt, a, b))
        self.a += a
        self.b += b
        self.span += dt
        i, n = self._head, len(buf)
        while i < n and buf[i] - buf[i + 1] < horizon:
            self.a -= buf[i + 2]
            self.b -= buf[i + 3]
            self.span -= buf[i + 1]
            i += 4
        if i == n:
            self.clear()
            return
        if i > n - i:
            del buf[:i]
            i = 0
        self._head = i

    def clear(self) -> None:
        del self._buf[:]
        self._head = 0
        self.a = self.b = self.span = 0.0


@dataclass(slots=True)
class _Engines:
    gpu_views: dict[tuple[str, str], dict[str, float]] = field(default_factory=dict)
    """(uuid, signal) -> engine -> the engine's own GPU reading (bytes)."""
    running: dict[str, float] = field(default_factory=dict)
    waiting: dict[str, float] = field(default_factory=dict)
    tokens: dict[str, float | None] = field(default_factory=dict)
    names: set[str] = field(default_factory=set)


@dataclass(slots=True)
class _Leaf:
    """One device's signals in one GPU report (what the GPU sampler exported)."""

    labels: Labels
    mig: str | None
    utilization: float | None = None
    bandwidth: float | None = None
    sm_occupancy: float | None = None
    memory: dict[str, float] = field(default_factory=dict)
    engines: set[str] = field(default_factory=set)


@dataclass(slots=True)
class _Gpu:
    """One physical GPU in one report."""

    leaves: list[_Leaf] = field(default_factory=list)
    up: bool = True
    clocks: dict[str, float] = field(default_factory=dict)
    totals: dict[tuple[str, str], float] = field(default_factory=dict)
    nvlink_unsupported: bool = False
    mig_enabled: bool = False


@dataclass(slots=True)
class _History:
    """What the stage remembers of one physical GPU between reports."""

    last_ok_t: float | None = None
    last_bytes: float | None = None
    bytes_per_token: _Run = field(default_factory=_Run)
    tokens_per_mem: _Run = field(default_factory=_Run)

    def reset(self) -> None:
        self.last_ok_t = None
        self.last_bytes = None
        self.bytes_per_token.clear()
        self.tokens_per_mem.clear()


def _label(labels: Labels, key: str) -> str | None:
    for k, v in labels:
        if k == key:
            return v
    return None


def _sum(values: dict[str, float], keys: Iterable[str]) -> float | None:
    total = None
    for k in keys:
        v = values.get(k)
        if v is not None:
            total = (total or 0.0) + v
    return total


def _read_report(samples: Iterable[Sample], sources: Iterable[SourceStatus]) -> dict[str, _Gpu]:
    """Group one GPU report's samples by physical GPU (``gpu`` label) and device."""
    gpus: dict[str, _Gpu] = {}
    leaves: dict[Labels, _Leaf] = {}
    cache = _DEVICE_OF
    if len(cache) > MAX_DEVICES * 16:
        cache.clear()
    # one pass sorts out the samples read here (most of a report is not)
    ups: list[Sample] = []
    typed: list[tuple[str, Sample]] = []
    kind_of = _KIND.get
    for s in samples:
        kind = kind_of(s.name)
        if kind is not None:
            typed.append((kind, s))
        elif s.name == m.GPU_UP:
            ups.append(s)
    for s in ups:
        g = gpus.setdefault(_label(s.labels, "gpu") or "", _Gpu())
        if s.value < 1:
            g.up = False
        elif _label(s.labels, "uuid") is not None:
            leaf = _Leaf(s.labels, _label(s.labels, "mig"))
            leaves[s.labels] = leaf
            g.leaves.append(leaf)
            g.mig_enabled = g.mig_enabled or leaf.mig is not None
    for kind, s in typed:
        labels = s.labels
        known = cache.get(labels)
        if known is None:
            # a label set's device part and its values by name, worked out once (the GPU
            # sampler keeps its label tuples from cycle to cycle)
            known = cache[labels] = (
                tuple((k, v) for k, v in labels if k in _DEVICE_KEYS),
                dict(reversed(labels)),  # the first of a repeated name, as _label reads
            )
        device, named = known
        if kind == "links":
            owner = gpus.get(named.get("gpu") or "")
            if owner is not None:
                owner.totals[(_LINKS[s.name], named.get("direction") or "")] = s.value
            continue
        dev = leaves.get(device)
        if dev is None:
            continue
        if kind == "utilization":
            dev.utilization = s.value
        elif kind == "bandwidth":
            if named.get("source") == "gpm":
                dev.bandwidth = s.value
        elif kind == "sm":
            dev.sm_occupancy = s.value
        elif kind == "clock":
            owner = gpus.get(named.get("gpu") or "")
            if owner is not None and dev.mig is None:
                owner.clocks[named.get("reason") or ""] = s.value
        elif kind == "process":
            engine = named.get("engine")
            if engine is not None:
                dev.engines.add(engine)
        elif kind == "memory":
            dev.memory[_MEMORY[s.name]] = s.value
    for st in sources:
        index, _, what = st.source.removeprefix("gpu").partition(".")
        found = gpus.get(index)
        if found is None or st.state != "unsupported":
            continue
        if what == "nvlink":
            found.nvlink_unsupported = True
        elif what == "utilization" and st.reason == "mig_enabled":
            found.mig_enabled = True
    return gpus


_DEVICE_OF: dict[Labels, tuple[Labels, dict[str, str]]] = {}
"""Labels -> their ``gpu``/``uuid``/``mig`` part and their values by name (the GPU sampler
reuses label tuples)."""
_MEMORY: Final = {
    m.GPU_MEMORY_TOTAL_BYTES: "total",
    m.GPU_MEMORY_USED_BYTES: "used",
    m.GPU_MEMORY_RESERVED_BYTES: "reserved",
}
_LINKS: Final = {m.GPU_PCIE_BYTES_TOTAL: "pcie", m.GPU_NVLINK_BYTES_TOTAL: "nvlink"}
_KIND: Final = {
    m.GPU_UTILIZATION_RATIO: "utilization",
    m.GPU_MEMORY_BANDWIDTH_UTILIZATION_RATIO: "bandwidth",
    m.GPU_SM_OCCUPANCY_RATIO: "sm",
    m.GPU_CLOCK_EVENT_ACTIVE: "clock",
    m.GPU_PROCESS_MEMORY_BYTES: "process",
    **dict.fromkeys(_MEMORY, "memory"),
    **dict.fromkeys(_LINKS, "links"),
}
"""The GPU report's samples the stage reads, by what they are."""


class AcceleratorSampler(Sampler):
    """The ``accelerator`` derived stage (see the module docstring).

    Args:
        gpu_report: returns the GPU sampler's latest report (``AgentState.report("gpu")``).
        state_view: ``AgentState.latest_many``: the engines' request gauges and token
            counters, all asked in one call per tick.
        thresholds: a :class:`StallThresholds`, or any object with the same attributes
            (``config.GpuConfig``); ``None`` for the defaults.
        gpu_interval_s: the GPU sampler's interval: a gap longer than ``max(5 x it, 5 s)``
            accrues nothing.
        interval_s: the stage's own interval (it runs after each GPU report anyway).
        **threshold_overrides: individual thresholds, e.g. ``idle_utilization_below=0.05``.
    """

    name = "accelerator"

    def __init__(
        self,
        gpu_report: Callable[[], SamplerReport | None],
        state_view: StateView | None,
        thresholds: object | None = None,
        gpu_interval_s: float = 1.0,
        interval_s: float = 1.0,
        **threshold_overrides: float,
    ) -> None:
        super().__init__(interval_s)
        self._gpu_report = gpu_report
        self._state_view = state_view
        self.thresholds = StallThresholds.of(thresholds, **threshold_overrides)
        self._max_dt = max(5.0 * gpu_interval_s, 5.0)
        self._history: dict[str, _History] = {}
        self._stall: OrderedDict[Labels, dict[str, float]] = OrderedDict()
        self._token_last: dict[str, tuple[frozenset[Labels], float]] = {}
        self._last: tuple[float, list[Sample]] | None = None
        self._log_once = LogOnce(log)

    def collect(self, batch: Batch) -> None:
        """Derive from the GPU report of this tick (a report seen already is re-emitted)."""
        report = self._gpu_report()
        if report is None or not report.ok or report.batch is None:
            return
        for st in report.batch.sources:
            if st.source == "nvml" and st.state == "unsupported":
                # no GPU to derive from (no driver): the stage is unsupported too, so
                # ``kvpressure status`` shows it as the GPU sampler, not as "up"
                batch.source_unsupported("gpu", st.reason)
                return
        if self._last is not None and self._last[0] == report.ts:
            batch.samples.extend(self._last[1])
            return
        out = self.derive(report.ts, report.batch.samples, report.batch.sources)
        self._last = (report.ts, out)
        batch.samples.extend(out)

    def derive(
        self, now: float, samples: Iterable[Sample], sources: Iterable[SourceStatus] = ()
    ) -> list[Sample]:
        """Process one GPU report taken at ``now`` (seconds); returns the derived samples."""
        engines = self._engines()
        gpus = _read_report(samples, sources)
        mapped = {e for g in gpus.values() for leaf in g.leaves for e in leaf.engines}
        unmapped = engines.names - mapped
        out: list[Sample] = []
        for index, g in gpus.items():
            hist = self._history.setdefault(index, _History())
            if not g.up or not g.leaves:
                hist.reset()
                continue
            dt = 0.0 if hist.last_ok_t is None else now - hist.last_ok_t
            if dt > self._max_dt or dt < 0:
                dt = 0.0
            throttled = (
                None if not g.clocks else any(g.clocks.get(r, 0.0) >= 1 for r in THROTTLE_REASONS)
            )
            gpu_engines: set[str] = set(unmapped)
            phys: _Leaf | None = None
            for leaf in g.leaves:
                gpu_engines |= leaf.engines
                if leaf.mig is None:
                    phys = leaf
                    if engines.gpu_views and "total" in leaf.memory:
                        self._disagreement(out, leaf, engines)
                if not (leaf.mig is None and g.mig_enabled):
                    self._accrue(out, leaf, leaf.engines | unmapped, engines, throttled, dt)
            if phys is not None:
                self._movement(out, g, hist, phys, gpu_engines, engines, dt, now)
            hist.last_ok_t = now
        while len(self._stall) > MAX_DEVICES:
            self._stall.popitem(last=False)
        return out

    def _engines(self) -> _Engines:
        """Sum the engines' request gauges and token-counter increases."""
        out = _Engines()
        view = self._state_view
        if view is None:
            return out
        views = view(_VIEWED)
        for signal, metric in ENGINE_GPU_VIEWS.items():
            for labels, value in views[metric].items():
                engine, uuid = _label(labels, "engine"), _label(labels, "uuid")
                if engine is not None and uuid is not None:
                    out.gpu_views.setdefault((uuid, signal), {})[engine] = value
        gauges: tuple[tuple[SampleName, dict[str, float]], ...] = (
            (RUNNING, out.running),
            (WAITING, out.waiting),
        )
        for metric, target in gauges:
            for labels, value in views[metric].items():
                engine = _label(labels, "engine")
                if engine is not None:
                    target[engine] = target.get(engine, 0.0) + value
                    out.names.add(engine)
        cum: dict[str, float] = {}
        series: dict[str, set[Labels]] = {}
        for metric in TOKEN_COUNTERS:
            for labels, value in views[metric].items():
                engine = _label(labels, "engine")
                if engine is not None:
                    cum[engine] = cum.get(engine, 0.0) + value
                    series.setdefault(engine, set()).add((("__name__", metric), *labels))
                    out.names.add(engine)
        for engine, total in cum.items():
            key = frozenset(series[engine])
            last = self._token_last.get(engine)
            self._token_last[engine] = (key, total)
            if last is None or last[0] != key:
                out.tokens[engine] = None  # new or changed series: baseline only
            else:
                delta = total - last[1]
                out.tokens[engine] = delta if delta >= 0 else None  # reset: skip a cycle
        for engine in list(self._token_last):
            if engine not in cum:
                del self._token_last[engine]
        return out

    def _disagreement(self, out: list[Sample], leaf: _Leaf, engines: _Engines) -> None:
        """Flag engines whose own GPU memory reading disagrees with NVML's (NVML wins).

        ``kvpressure_gpu_engine_disagreement{engine,signal}`` is 1 when the engine's total
        differs from NVML's by more than :data:`DISAGREE_TOTAL_SHARE` of it, or its used
        from NVML's used + reserved (what v1 ``nvmlDeviceGetMemoryInfo``, and so the engine,
        calls used) by more than :data:`DISAGREE_USED_SHARE` of the total and
        :data:`DISAGREE_USED_MIN_BYTES` (the two are read at different moments); else 0.
        """
        total = leaf.memory["total"]
        used = leaf.memory.get("used", 0.0)
        nvml = {"memory_total": total, "memory_used": used + leaf.memory.get("reserved", 0.0)}
        uuid = _label(leaf.labels, "uuid") or ""
        source = f"gpu{_label(leaf.labels, 'gpu')}"
        for signal, reference in nvml.items():
            for engine, value in sorted(engines.gpu_views.get((uuid, signal), {}).items()):
                if signal == "memory_total":
                    off = abs(value - reference) > DISAGREE_TOTAL_SHARE * total
                else:
                    limit = max(DISAGREE_USED_SHARE * total, DISAGREE_USED_MIN_BYTES)
                    off = abs(value - reference) > limit
                if off:
                    self._log_once(
                        f"disagree:{uuid}:{engine}:{signal}",
                        logging.WARNING,
                        "GPU %s: engine %s reports %s %.0f bytes, NVML %.0f; NVML's is exported",
                        source,
                        engine,
                        signal,
                        value,
                        reference,
                    )
                labels = make_labels({**dict(leaf.labels), "engine": engine, "signal": signal})
                out.append(Sample(m.GPU_ENGINE_DISAGREEMENT, float(off), labels))

    def _accrue(
        self,
        out: list[Sample],
        leaf: _Leaf,
        on: set[str],
        engines: _Engines,
        throttled: bool | None,
        dt: float,
    ) -> None:
        stall = self._stall.get(leaf.labels)
        if stall is None:
            stall = self._stall[leaf.labels] = {}
        self._stall.move_to_end(leaf.labels)
        have = {
            "throttled": throttled is not None,
            "memory_bound": leaf.bandwidth is not None and leaf.sm_occupancy is not None,
            "idle_with_queue": leaf.utilization is not None,
        }
        for reason, ok in have.items():
            if ok and reason not in stall:
                stall[reason] = 0.0
        reason_now = stall_reason(
            running=_sum(engines.running, on),
            waiting=_sum(engines.waiting, on),
            utilization=leaf.utilization,
            bandwidth=leaf.bandwidth,
            sm_occupancy=leaf.sm_occupancy,
            throttled=throttled,
            thresholds=self.thresholds,
        )
        if reason_now is not None and dt > 0:
            stall[reason_now] = stall.get(reason_now, 0.0) + dt
        for reason in STALL_REASONS:
            value = stall.get(reason)
            if value is not None:
                labels = tuple(sorted((*leaf.labels, ("reason", reason))))
                out.append(Sample(m.ACCELERATOR_STALL_SECONDS_TOTAL, value, labels))

    def _movement(
        self,
        out: list[Sample],
        g: _Gpu,
        hist: _History,
        phys: _Leaf,
        on: set[str],
        engines: _Engines,
        dt: float,
        now: float,
    ) -> None:
        pcie = [v for (grp, _d), v in g.totals.items() if grp == "pcie"]
        nvlink = [v for (grp, _d), v in g.totals.items() if grp == "nvlink"]
        known = bool(pcie) and (bool(nvlink) or not g.nvlink_unsupported)
        total = sum(pcie) + sum(nvlink) if known else None
        d_bytes = None
        if total is not None and hist.last_bytes is not None and total >= hist.last_bytes:
            d_bytes = total - hist.last_bytes
        hist.last_bytes = total
        d_tokens: float | None = None
        if on and all(engines.tokens.get(e) is not None for e in on):
            d_tokens = sum(engines.tokens[e] or 0.0 for e in on)
        # used without total: unified memory, derived from the processes (not a device reading)
        mem_used = phys.memory.get("used") if "total" in phys.memory else None
        if dt <= 0:
            return
        horizon = now - self.thresholds.data_movement_window_s
        bpt = hist.bytes_per_token
        bpt.add(now, dt, d_bytes, d_tokens, horizon)
        if bpt and bpt.b >= 1.0:  # at least one token in the window
            out.append(Sample(m.DATA_MOVEMENT_BYTES_PER_TOKEN, bpt.a / bpt.b, phys.labels))
        tpm = hist.tokens_per_mem
        tpm.add(now, dt, d_tokens, None if mem_used is None else mem_used * dt, horizon)
        if tpm and tpm.span > 0 and tpm.b / tpm.span >= 1.0:
            out.append(Sample(m.TOKENS_PER_BYTE, tpm.a / (tpm.b / tpm.span), phys.labels))


@register(
    "accelerator",
    Stage.DERIVED,
    "accelerator stall time, bytes per token, tokens per byte, engine/NVML disagreement",
    after=("gpu",),
)
def _plan(ctx: Context) -> list[Plan]:
    cfg = ctx.config
    if not cfg.samplers.gpu.enabled:
        return []
    gpu_interval = ctx.interval_s("gpu")
    spec = ("accelerator", cfg.gpu, gpu_interval, ctx.interval_s("accelerator"))
    state = ctx.state
    return [
        Plan(
            "accelerator",
            spec,
            lambda: AcceleratorSampler(
                lambda: state.report("gpu"),
                functools.partial(state.latest_many, samplers=ENGINE_SAMPLERS),
                thresholds=cfg.gpu,
                gpu_interval_s=gpu_interval,
                interval_s=ctx.interval_s("accelerator"),
            ),
        )
    ]
