"""Per-device state of the GPU sampler: a GPU, its MIG instances, one cycle's readings.

Moved verbatim out of ``gpu.py`` (see its module docstring for what the fields mean), with the
memory-kind helpers (:func:`is_unified_total`).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from kvpressure.agent.kube import PodRef
from kvpressure.agent.logs import LogOnce
from kvpressure.agent.samplers import nvml_binding as nb
from kvpressure.agent.samplers.gpu_workers import _Backoff, _Job
from kvpressure.agent.samples import Labels, Sample, make_labels

log = logging.getLogger("kvpressure.agent.samplers.gpu")

REPROBE_S: Final = 60.0
"""Seconds before a field found unsupported is asked for again."""
REFRESH_S: Final = 60.0
"""Seconds between re-discoveries of a GPU's identity and MIG layout."""

UNIFIED_MEMORY_PARTS: Final = ("GB10", "DGX Spark", "Jetson", "Orin", "Thor", "Xavier")
"""Name fragments of integrated/unified-memory parts: memory NOT_SUPPORTED there is expected
(``unified_memory``); on any other part it stays ``not_supported`` (gpustat PR #179's rule).
When NVML does answer on these parts, its total is the system's memory (see
:func:`is_unified_total`)."""
COHERENT_MEMORY_PARTS: Final = ("GH200", "GB200", "GB300")
"""Name fragments of Grace superchips: their own HBM is a GPU memory, but some drivers report
the coherent system memory as the total; a total of at least :data:`COHERENT_TOTAL_SHARE` of
the host's MemTotal is then unified memory."""
COHERENT_TOTAL_SHARE: Final = 0.9
UNIFIED_TOTAL_TOLERANCE: Final = 0.01
"""Any other part whose NVML total is within this fraction of the host's MemTotal is answering
with the system's memory (a discrete card matching the host's RAM to 1 % is not expected)."""
PID_MAX_LIMIT: Final = 4_194_304
"""Linux's largest possible ``pid_max`` (2^22): an NVML process PID outside ``1..PID_MAX_LIMIT``
(0 and 4294967295 are seen on real drivers) is impossible and dropped."""
DROP_REASONS: Final = (
    "process_pid_invalid",
    "process_duplicate",
    "process_memory_above_total",
    "memory_above_total",
    "utilization_out_of_range",
)
"""``reason`` values of ``kvpressure_gpu_values_dropped_total``."""


@dataclass(eq=False)
class _Leaf:
    """A physical GPU or one MIG instance: what labels and per-device signals belong to."""

    gpu: int
    uuid: str
    name: str
    handle: Any
    mig: str | None = None
    gi: int | None = None
    labels: Labels = ()
    skip: dict[str, tuple[float, str]] = field(default_factory=dict)
    stall: dict[str, float] = field(default_factory=dict)
    gpm_samples: list[Any] | None = None
    gpm_get: Any = None
    gpm_ready: bool = False
    processes: list[tuple[int, float]] | None = None
    unified: str = "false"
    host_memory: bool = False
    """NVML answered memory with the system's total (unified memory): not exported as GPU
    memory; used is derived from the processes."""
    dropped: Counter[str] = field(default_factory=Counter)
    """Impossible NVML values dropped on this device, by ``DROP_REASONS`` reason."""
    static: tuple[Sample, ...] = ()
    static_key: tuple[str, str, str] | None = None
    _lab: dict[tuple[str, str], Labels] = field(default_factory=dict)
    _clocks: tuple[int, tuple[Sample, ...]] | None = None
    _plab: dict[tuple[Any, ...], Labels] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.labels = make_labels({"gpu": str(self.gpu), "uuid": self.uuid, "mig": self.mig})

    def lab(self, key: str, value: str) -> Labels:
        """The device labels plus ``key=value`` (cached)."""
        k = (key, value)
        out = self._lab.get(k)
        if out is None:
            out = tuple(sorted((*self.labels, k)))
            self._lab[k] = out
        return out

    def clock_samples(self, mask: int) -> tuple[Sample, ...]:
        """The 9 ``kvpressure_gpu_clock_event_active`` samples for ``mask`` (cached)."""
        cached = self._clocks
        if cached is not None and cached[0] == mask:
            return cached[1]
        samples = tuple(
            Sample(
                "kvpressure_gpu_clock_event_active",
                1.0 if mask & bit else 0.0,
                self.lab("reason", reason),
            )
            for reason, bit in nb.CLOCK_EVENT_REASONS
        )
        self._clocks = (mask, samples)
        return samples

    def process_labels(
        self,
        pid: int,
        process: str,
        engine: str | None,
        pod: PodRef | None = None,
        names: tuple[str, str, str] | None = None,
    ) -> Labels:
        """Labels of a per-process memory sample (cached; the cache follows live PIDs).

        ``pod_uid`` comes from the process's cgroup path; ``namespace``, ``pod`` and
        ``container`` from ``names`` (the kubelet's assignment of this device), each absent
        when unknown, never empty.
        """
        key = (pid, process, engine, pod, names)
        out = self._plab.get(key)
        if out is None:
            if len(self._plab) > 4096:
                self._plab.clear()
            namespace, pod_name, container = names or (None, None, None)
            out = make_labels(
                {
                    "gpu": str(self.gpu),
                    "uuid": self.uuid,
                    "mig": self.mig,
                    "pid": str(pid),
                    "process": process or None,
                    "engine": engine,
                    "pod_uid": pod.pod_uid if pod is not None else None,
                    "namespace": namespace,
                    "pod": pod_name,
                    "container": container,
                }
            )
            self._plab[key] = out
        return out

    @property
    def source(self) -> str:
        return f"gpu{self.gpu}" if self.mig is None else f"gpu{self.gpu}.mig{self.mig}"


@dataclass(slots=True)
class _LeafReading:
    leaf: _Leaf
    memory: tuple[float, float, float, float | None] | None = None
    utilization: float | None = None
    memory_activity: float | None = None
    power_w: float | None = None
    temperature_c: float | None = None
    clocks: int | None = None
    bandwidth: float | None = None
    sm_occupancy: float | None = None
    processes: list[tuple[int, float]] | None = None
    unsupported: list[tuple[str, str]] = field(default_factory=list)


@dataclass(slots=True)
class _GpuReading:
    slow: bool
    leaves: list[_LeafReading]
    counters: list[tuple[str, str, tuple[int, int], float, int, float]]
    """(group, direction, field key, raw value, bit width, scale to bytes)."""
    pcie_ok: bool
    nvlink_ok: bool


@dataclass(eq=False)
class _Gpu:
    index: int
    backoff: _Backoff
    handle: Any = None
    uuid: str = ""
    leaf: _Leaf | None = None
    migs: list[_Leaf] = field(default_factory=list)
    mig_enabled: bool = False
    refresh_at: float = 0.0
    links: list[int] | None = None
    links_probed: bool = False
    gpm_supported: bool | None = None
    xid_registered: bool = False
    down_reason: str = ""
    last_raw: dict[tuple[int, int], float] = field(default_factory=dict)
    totals: dict[tuple[str, str], float] = field(default_factory=dict)
    last_ok_t: float | None = None
    slow_at: float = 0.0
    pcie_ok: bool = False
    nvlink_ok: bool = False
    bytes_known: bool = False
    stuck: _Job | None = None
    counter_samples: tuple[Sample, ...] | None = None

    def leaves(self) -> list[_Leaf]:
        return ([self.leaf] if self.leaf else []) + self.migs

    def reset_deltas(self) -> None:
        """Forget everything relative to the previous cycle (after a failure)."""
        self.last_raw.clear()
        self.last_ok_t = None
        self.slow_at = 0.0
        self.bytes_known = False
        self.counter_samples = None
        for leaf in self.leaves():
            leaf.gpm_ready = False


class _GpuState:
    """What the GPU sampler's parts share (set by :class:`~agent.samplers.gpu.GpuSampler`)."""

    _nv: nb.NvmlBinding
    _procfs: Path
    _log_once: LogOnce
    _gpus: list[_Gpu]
    _slow_interval: float
    _event_set: Any
    _events_reason: str
    _handle_index: dict[int, int]
    _xid: dict[int, Counter[int]]
    _proc_names: dict[int, str]
    _pods: dict[int, PodRef | None]
    _ancestors: dict[int, tuple[int, ...]]
    _nspid: dict[int, int]
    _nspid_at: float
    _host_total: tuple[float, float | None]

    @staticmethod
    def _quiet(fn: Callable[..., Any], *args: Any) -> None:
        try:
            fn(*args)
        except nb.NvmlError as exc:
            log.debug("ignored while closing: %s", exc)


def _ratio(percent: Any) -> float:
    """Percent (0-100) to a ratio clamped to 0-1."""
    return min(1.0, max(0.0, float(percent) / 100.0))


def _skips(leaf: _Leaf, names: Iterable[str]) -> list[tuple[str, str]]:
    return [(n, leaf.skip[n][1]) for n in names if n in leaf.skip]


def is_unified_total(name: str, total: float, host_total: float | None) -> bool:
    """Return True when an NVML memory total is the system's memory (unified memory).

    Args:
        name: ``nvmlDeviceGetName``, e.g. ``"NVIDIA GB10"``.
        total: ``nvmlDeviceGetMemoryInfo`` total, bytes.
        host_total: the host's ``/proc/meminfo`` MemTotal in bytes, or ``None``.

    Returns:
        True for integrated parts (:data:`UNIFIED_MEMORY_PARTS`) whatever the total; for
        Grace superchips (:data:`COHERENT_MEMORY_PARTS`) when the total is at least
        :data:`COHERENT_TOTAL_SHARE` of MemTotal; for any other part when the total is within
        :data:`UNIFIED_TOTAL_TOLERANCE` of MemTotal. False when MemTotal is unknown (except
        integrated parts).
    """
    low = name.lower()
    if any(p.lower() in low for p in UNIFIED_MEMORY_PARTS):
        return True
    if host_total is None or host_total <= 0 or total <= 0:
        return False
    if any(p.lower() in low for p in COHERENT_MEMORY_PARTS):
        return total >= COHERENT_TOTAL_SHARE * host_total
    return abs(total / host_total - 1.0) <= UNIFIED_TOTAL_TOLERANCE
