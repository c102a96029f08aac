"""GPU sampler: NVML readings per GPU and MIG instance, accelerator stall time, data movement.

Memory, bandwidth, clocks, links, processes and XIDs come from NVML; the accelerator stall time
and the data movement per token are derived from them and from the engines' request gauges and
token counters.

Every NVML call goes through :mod:`agent.samplers.nvml_binding` (``gpu.binding: nvml``, or a
recorded-behaviour fake with ``fake:<profile>``). Per GPU and per MIG instance (labels ``gpu``,
``uuid``, ``mig``), one batch of NVML calls per cycle:

====================================================  =========================================
metric                                                NVML source (``nvidia-smi`` equivalent)
====================================================  =========================================
``kvpressure_gpu_memory_{total,used,free}_bytes``     ``nvmlDeviceGetMemoryInfo`` (v2, else v1)
                                                      (``--query-gpu=memory.total,memory.used``)
``kvpressure_gpu_memory_reserved_bytes``              ``nvmlMemory_v2.reserved`` (``-q``)
``kvpressure_gpu_utilization_ratio``                  ``nvmlDeviceGetUtilizationRates.gpu``/100
``kvpressure_gpu_memory_bandwidth_utilization_ratio`` GPM ``DRAM_BW_UTIL``/100 (``source="gpm"``,
                                                      Hopper+), else ``UtilizationRates.memory``
                                                      /100 (``source="nvml"``: the share of time
                                                      memory was read or written, weaker)
``kvpressure_gpu_sm_occupancy_ratio``                 GPM ``SM_OCCUPANCY``/100
``kvpressure_gpu_pcie_bytes_total``                   ``NVML_FI_DEV_PCIE_COUNT_{TX,RX}_BYTES``
``kvpressure_gpu_nvlink_bytes_total``                 ``NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_*``
                                                      per link, summed, KiB x 1024
``kvpressure_gpu_clock_event_active``                 ``nvmlDeviceGetCurrentClocksEventReasons``
                                                      (``-q`` Clocks Event Reasons)
``kvpressure_gpu_power_watts``                        ``nvmlDeviceGetPowerUsage`` mW / 1000
``kvpressure_gpu_temperature_celsius``                ``nvmlDeviceGetTemperature`` (GPU sensor)
``kvpressure_gpu_process_memory_bytes``               ``nvmlDeviceGetComputeRunningProcesses``
                                                      and ``...GraphicsRunningProcesses``
                                                      (``--query-compute-apps=pid,used_memory``)
``kvpressure_gpu_xid_errors_total``                   ``nvmlEventSetWait_v2`` XID events
====================================================  =========================================

PCIe/NVLink counters are accumulated from NVML's cumulative counters from the agent's start
(a counter reset, e.g. after a GPU reset, adds nothing rather than a spike). MIG instances get
memory, GPM (Hopper) and processes; power, temperature, clocks and links belong to the
physical GPU.

**Faults degrade only themselves** (habits 3-5):

* A field NVML answers ``NOT_SUPPORTED``/``NO_PERMISSION`` for is absent (never 0 or NaN)
  while the GPU stays listed; it is reported as ``kvpressure_source_unsupported{source=
  "gpu<i>.<field>", reason}`` (reasons ``not_supported``, ``unified_memory`` on GB10-class
  parts, case 01, ``mig_enabled`` for utilization under MIG, case 07, ``no_permission``,
  ``function_not_found``) and re-probed every :data:`REPROBE_S` seconds.
* A GPU whose calls fail (``GPU_IS_LOST``, ``Unknown``, a timeout) gets
  ``kvpressure_gpu_up 0`` and nothing else this cycle (case 05); the others carry on. It is
  retried with capped exponential back-off (``backoff_base_s`` doubling up to
  ``backoff_cap_s``), its handle looked up again by UUID.
* A driver/library problem (``DRIVER_NOT_LOADED``, ``LIB_RM_VERSION_MISMATCH``,
  ``UNINITIALIZED``) marks source ``nvml`` down with that reason (and every known GPU
  ``gpu_up 0``); ``nvmlInit`` is retried with the same back-off and sampling resumes without
  restarting the agent (case 06). Logged once per state change, with the kernel module
  version from ``/proc/driver/nvidia/version`` when readable.
* No NVML library at all (``libnvidia-ml.so.1`` or nvidia-ml-py missing) disables the sampler
  with one log line and ``kvpressure_source_unsupported{source="nvml",
  reason="library_not_found"}``; it is re-probed quietly every :data:`DISABLED_REPROBE_S`.

**Values that cannot be true are dropped and counted, the rest of the sample kept** (issue 17,
kind 2), in ``kvpressure_gpu_values_dropped_total{reason}``: a process PID outside
``1..PID_MAX_LIMIT`` (real drivers list PID 0 and 4294967295) is ``process_pid_invalid``; a
process holding more than the device's total (the host's MemTotal on unified memory) is
``process_memory_above_total``; a PID listed twice by one call is one process
(``process_duplicate``, one row kept, never summed); a memory reading whose used, free or
reserved exceeds its total is dropped whole (``memory_above_total``), a utilization outside
0-100 % too (``utilization_out_of_range``). Compute and graphics process lists are
both read and merged per PID (a process with both contexts is in both). A PID the agent's
procfs lacks (the engine in another PID namespace) is mapped through the ``NSpid:`` lines of
``<procfs>/*/status`` when exactly one process has it.

**Unified memory.** Where NVML answers memory with the system's own total (GB10 and other
integrated parts, a Grace superchip reporting the coherent memory, or any part whose total is
within 1 % of the host's MemTotal: :func:`is_unified_total`), the device is flagged
``unified_memory="true"``; NVML's total/used/free (host figures) are not exported as GPU
memory: ``kvpressure_gpu_memory_used_bytes`` is the sum of the device's processes and
``kvpressure_gpu_unified_memory_available_bytes`` the host's MemAvailable (shared-memory
pressure). The latter is also exported where memory is NOT_SUPPORTED on such a part (case 01).

**Bounded NVML calls.** NVML can hang (a wedged GSP, dcgm-exporter#84). Each cycle reads the
GPUs in one pass on a pooled worker thread while the sampler watches it: a GPU still inside its
NVML calls after ``gpu_budget_s`` (half of ``gpu_timeout_s``, which defaults to half the
sampler's ``timeout_s``) is reported ``gpu_up 0`` with source reason ``timeout`` and backs off,
and the GPUs after it continue at once on another worker, all within ``gpu_timeout_s``. The
stuck thread cannot be interrupted (Python cannot abort a blocked C call): it keeps that GPU
quarantined (skipped, reported ``timeout``) until the call returns, and its late answer is
discarded. At most ``GPUs + 2`` workers exist, so a wedged driver cannot leak threads without
bound. Init and the XID drain run on a separate control worker, bounded the same way. One
hand-off per cycle instead of one per GPU keeps the CPU cost low (``benchmarks/
gpu_sampler_bench.py``); the price is that GPUs are read one after another, not in parallel.
``gpu_timeout_s=0`` runs everything inline (no threads and no per-GPU bound; the daemon's
sampler timeout still applies).

**XIDs** are drained once per cycle with zero-timeout ``nvmlEventSetWait_v2`` polls on the
control worker (so sampling never blocks on events) and counted per GPU and XID code.

**Accelerator stall time** (``kvpressure_accelerator_stall_seconds_total{gpu,uuid,mig,reason}``)
is accumulated per cycle. Let ``dt`` be the seconds since the GPU's previous successful cycle
(no accrual across a failure, or when ``dt`` exceeds ``max(5 x interval_s, 5 s)``). For each
leaf device (a GPU without MIG, or each MIG instance of a MIG-enabled GPU), with
``R``/``W`` = the sum of ``kvpressure_engine_requests_running``/``_waiting`` over the engines on
that device, ``U`` = utilization ratio (``nvmlDeviceGetUtilizationRates.gpu``/100), ``B`` = GPM
DRAM bandwidth utilization ratio (the NVML memory-activity fallback is not used here: it
measures time, not bandwidth), ``S`` = GPM SM occupancy ratio, and ``T`` = whether a
power/thermal clocks event reason is active
(``sw_power_cap``, ``hw_slowdown``, ``sw_thermal_slowdown``, ``hw_thermal_slowdown``,
``hw_power_brake_slowdown``; the parent's for a MIG instance), ``dt`` is added to the first
reason that holds, in this order::

    if R + W > 0:
        throttled        if T
        memory_bound     elif B > memory_bound_bandwidth_above (0.60) and
                              S < memory_bound_sm_below (0.30)
        idle_with_queue  elif W > 0 and U < idle_utilization_below (0.10)

Throttling comes first because it is the cause when it coincides with the others (a capped
clock lowers utilization and occupancy); memory-bound before idle-with-queue because a GPU
streaming memory is busy, not idle. Values are those read at the end of the interval (NVML
utilization and GPM are averages over the period just ended). **A reason whose signals are
missing never accrues** (no GPM → no ``memory_bound``; no utilization, as under MIG → no
``idle_with_queue``; no clocks reasons → no ``throttled``; no engine request gauges → nothing);
each reason's counter is exported once its GPU-side signals have been seen on that device and
then stays. Thresholds come from ``gpu.*`` in the config.

**Engine → GPU mapping.** ``engine_pids()`` maps PIDs to engine names; a GPU process whose PID
(or one of up to :data:`ANCESTOR_DEPTH` ancestors, read from ``<procfs>/<pid>/stat``, so vLLM's
worker processes map to the server) is an engine's belongs to that engine. An engine that
holds memory on some GPUs counts for those GPUs only; an engine with no process seen on any GPU
(no PIDs given, PIDs from another PID namespace, no permission to list processes) counts for
every GPU.

**Data movement** (per physical GPU, absent for MIG instances) over the last
``data_movement_window_s`` of contiguous successful cycles: ``kvpressure_data_movement_bytes_
per_token = (ΔPCIe rx+tx + ΔNVLink rx+tx bytes) / Δtokens`` and ``kvpressure_tokens_per_byte =
Δtokens / mean(memory used)`` (time-weighted), where tokens are the increase of
``kvpressure_engine_prompt_tokens_total + _generation_tokens_total`` of the engines on that GPU
(or its MIG instances). Absent when either side is unknown: no token counters, PCIe counters
unsupported, NVLink present but unreadable, memory unsupported, or (bytes per token) no tokens
in the window.

The module imports only the standard library and ``agent.samplers.{base,nvml_binding}`` /
``agent.samples`` (no pydantic, httpx or aiohttp), so ``benchmarks/gpu_check.py`` runs it on a
bare GPU machine.
"""

from __future__ import annotations

import logging
import math
import os
import queue
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Final

from agent.kube import PodRef, pod_of_pid
from agent.samplers import nvml_binding as nb
from agent.samplers.base import LogOnce, Sampler
from agent.samples import Batch, Labels, Sample, make_labels

log = logging.getLogger(__name__)

REPROBE_S: Final = 60.0
"""Seconds before a field found unsupported is asked for again."""
REFRESH_S: Final = 60.0
"""Seconds between re-discoveries of a GPU's identity and MIG layout."""
DISABLED_REPROBE_S: Final = 300.0
"""Seconds between quiet re-probes when the NVML library is missing."""
XID_DRAIN_MAX: Final = 256
"""Most XID events read per cycle."""
ANCESTOR_DEPTH: Final = 8
"""Parent PIDs walked when joining a GPU process to an engine."""
SLOW_INTERVAL_S: Final = 1.0
"""The process list, the PCIe/NVLink field values and the XID event queue are read at most
this often (seconds): the counters are cumulative, processes change slowly and NVML queues
events, so reading them at 10 Hz would only add NVML cost. Between reads the last values are
exported."""

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
NSPID_RESCAN_S: Final = 10.0
"""Seconds between scans of ``<procfs>/*/status`` ``NSpid:`` lines, done only when NVML lists
a PID that the agent's procfs does not have."""
DROP_REASONS: Final = (
    "process_pid_invalid",
    "process_duplicate",
    "process_memory_above_total",
    "memory_above_total",
    "utilization_out_of_range",
)
"""``reason`` values of ``kvpressure_gpu_values_dropped_total``."""

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
THROTTLE_MASK: Final = sum(bit for name, bit in nb.CLOCK_EVENT_REASONS if name in THROTTLE_REASONS)

RUNNING: Final = "kvpressure_engine_requests_running"
WAITING: Final = "kvpressure_engine_requests_waiting"
PROMPT_TOKENS: Final = "kvpressure_engine_prompt_tokens_total"
GENERATION_TOKENS: Final = "kvpressure_engine_generation_tokens_total"
ENGINE_GPU_VIEWS: Final = {
    "memory_total": "kvpressure_engine_gpu_memory_total_bytes",
    "memory_used": "kvpressure_engine_gpu_memory_used_bytes",
}
"""Engine metrics that restate an NVML reading (Triton's nv_gpu_*), by signal."""
DISAGREE_TOTAL_SHARE: Final = 0.01
DISAGREE_USED_SHARE: Final = 0.05
DISAGREE_USED_MIN_BYTES: Final = float(2**30)

StateView = Callable[[str], dict[Labels, float]]
"""``AgentState.latest``: metric name → {labels: current value}."""
EnginePids = Callable[[], dict[int, str]]

PodNames = Callable[[], dict[str, tuple[str, str, str]]]
"""Returns GPU UUID (or MIG UUID) -> ``(namespace, pod, container)`` of the one container
the kubelet assigned that device to (:func:`agent.podresources.gpu_assignments`)."""
"""PID → engine name (the ``engine`` label) of the engine processes the agent knows."""


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


# ---- workers --------------------------------------------------------------------------------
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


# ---- per-device state -----------------------------------------------------------------------
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


class _Run:
    """Running sums ``a``, ``b`` over a trailing time window of contiguous known points.

    Each point covers ``(t - dt, t]``; a point with an unknown value restarts the run, so the
    sums only ever cover an unbroken stretch of known values. O(1) amortized per point.
    """

    __slots__ = ("a", "b", "points", "span")

    def __init__(self) -> None:
        self.points: deque[tuple[float, float, float, float]] = deque()
        self.a = 0.0
        self.b = 0.0
        self.span = 0.0

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
    bytes_per_token: _Run = field(default_factory=_Run)
    tokens_per_mem: _Run = field(default_factory=_Run)

    def leaves(self) -> list[_Leaf]:
        return ([self.leaf] if self.leaf else []) + self.migs

    def reset_deltas(self) -> None:
        """Forget everything relative to the previous cycle (after a failure)."""
        self.last_raw.clear()
        self.last_ok_t = None
        self.slow_at = 0.0
        self.bytes_known = False
        self.counter_samples = None
        self.bytes_per_token.clear()
        self.tokens_per_mem.clear()
        for leaf in self.leaves():
            leaf.gpm_ready = False


@dataclass(slots=True)
class _Engines:
    gpu_views: dict[tuple[str, str], dict[str, float]] = field(default_factory=dict)
    """(uuid, signal) -> engine -> the engine's own GPU reading (bytes)."""
    running: dict[str, float] = field(default_factory=dict)
    waiting: dict[str, float] = field(default_factory=dict)
    tokens: dict[str, float | None] = field(default_factory=dict)
    names: set[str] = field(default_factory=set)


# ---- the sampler ------------------------------------------------------------------------------
class GpuSampler(Sampler):
    """Sample every NVIDIA GPU and MIG instance through NVML (see the module docstring).

    Args:
        binding: ``"nvml"``, ``"fake:<profile>"``, or an already built
            :class:`~agent.samplers.nvml_binding.NvmlBinding` (tests).
        interval_s: seconds between collections.
        timeout_s: the daemon's timeout for a whole collection (default ``max(interval, 2)``).
        thresholds: stall thresholds: a :class:`StallThresholds`, or any object with the same
            attributes (``config.GpuConfig``); ``None`` for the defaults.
        state_view: ``AgentState.latest``; gives the engines' request gauges and token
            counters. ``None``: no stall time and no per-token figures.
        engine_pids: PID → engine name of known engine processes, for the per-process join
            and the engine → GPU mapping.
        gpu_timeout_s: the per-cycle bound on all GPUs' NVML calls; default
            ``timeout_s / 2``; ``0`` runs them inline without a bound.
        backoff_base_s: first retry delay after a GPU or NVML failure, seconds.
        backoff_cap_s: longest retry delay, seconds.
        clock: monotonic seconds (tests pass the fake's clock).
        procfs_root: where ``<pid>/stat`` is read for the parent-PID walk, and
            ``<pid>/cgroup`` for the process's Kubernetes pod (:mod:`agent.kube`).
        pod_names: device UUID -> ``(namespace, pod, container)`` from the kubelet's
            pod-resources socket, or ``None``; names a process's pod only when its cgroup
            puts it in a pod.
        driver_version_file: read for the kernel module version in driver-mismatch logs.
        **threshold_overrides: individual thresholds, e.g. ``idle_utilization_below=0.05``.
    """

    name = "gpu"

    def __init__(
        self,
        binding: str | nb.NvmlBinding = "nvml",
        interval_s: float = 1.0,
        timeout_s: float | None = None,
        thresholds: object | None = None,
        state_view: StateView | None = None,
        engine_pids: EnginePids | None = None,
        *,
        gpu_timeout_s: float | None = None,
        backoff_base_s: float = 1.0,
        backoff_cap_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
        procfs_root: str = "/proc",
        driver_version_file: str = "/proc/driver/nvidia/version",
        pod_names: PodNames | None = None,
        **threshold_overrides: float,
    ) -> None:
        super().__init__(interval_s, timeout_s)
        self._nv = nb.bind(binding) if isinstance(binding, str) else binding
        self.binding = self._nv
        self.thresholds = StallThresholds.of(thresholds, **threshold_overrides)
        self._state_view = state_view
        self._engine_pids = engine_pids
        self.gpu_timeout_s = self.timeout_s / 2 if gpu_timeout_s is None else gpu_timeout_s
        self.gpu_budget_s = self.gpu_timeout_s / 2
        self._inline = self.gpu_timeout_s <= 0
        self._backoff_base = backoff_base_s
        self._backoff_cap = backoff_cap_s
        self._clock = clock
        self._procfs = Path(procfs_root)
        self._driver_version_file = Path(driver_version_file)
        self._log_once = LogOnce(log)
        self._control = _Worker("gpu-nvml-control", inline=self._inline)
        self._pool: list[_Worker] = []
        self._gpus: list[_Gpu] = []
        self._state = "uninit"  # uninit | ok | down | disabled
        self._init_pending: _Job | None = None
        self._need_reinit = False
        self._reason = ""
        self._nvml_backoff = _Backoff(backoff_base_s, backoff_cap_s)
        self._driver_version = ""
        self._event_set: Any = None
        self._events_reason = ""
        self._handle_index: dict[int, int] = {}
        self._xid: dict[int, Counter[int]] = {}
        self._proc_names: dict[int, str] = {}
        self._pods: dict[int, PodRef | None] = {}
        self._pod_names = pod_names
        self._pod_names_now: dict[str, tuple[str, str, str]] = {}
        self._ancestors: dict[int, tuple[int, ...]] = {}
        self._token_last: dict[str, tuple[frozenset[Labels], float]] = {}
        self._max_dt = max(5.0 * interval_s, 5.0)
        self._slow_interval = max(interval_s, SLOW_INTERVAL_S)
        self._xid_at = 0.0
        self._pids_cache: dict[int, str] | None = None
        self._nspid: dict[int, int] = {}
        self._nspid_at = -math.inf
        self._host_total: tuple[float, float | None] = (-math.inf, None)

    # ---- lifecycle -------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the workers; free the event set and GPM samples and shut NVML down.

        NVML is left alone when a worker is stuck in a call (the call could hang again).
        """
        stuck = self._control.busy or any(w.busy for w in self._pool)
        for w in [self._control, *self._pool]:
            w.stop()
        if stuck or self._state != "ok":
            return
        nv = self._nv
        for g in self._gpus:
            for leaf in g.leaves():
                for s in leaf.gpm_samples or ():
                    self._quiet(nv.call, "nvmlGpmSampleFree", s)
                leaf.gpm_samples = None
        if self._event_set is not None:
            self._quiet(nv.call, "nvmlEventSetFree", self._event_set)
            self._event_set = None
        nv.shutdown()
        self._state = "uninit"

    @staticmethod
    def _quiet(fn: Callable[..., Any], *args: Any) -> None:
        try:
            fn(*args)
        except nb.NvmlError as exc:
            log.debug("ignored while closing: %s", exc)

    # ---- collect ---------------------------------------------------------------------------
    def collect(self, batch: Batch) -> None:
        """Read every GPU once and add the samples to ``batch`` (never raises for NVML faults)."""
        now = self._clock()
        if not self._ensure_nvml(batch, now):
            return
        batch.source_ok("nvml")
        deadline = time.monotonic() + self.gpu_timeout_s
        todo: list[_Gpu] = []
        for g in self._gpus:
            if g.stuck is not None and not g.stuck.finished:
                self._gpu_down(batch, g, nb.TIMEOUT, now, count=False)
            elif not g.backoff.ready(now):
                self._gpu_down(batch, g, g.down_reason or "backoff", now, count=False)
            else:
                g.stuck = None
                todo.append(g)
        xid_job = None
        drain = now >= self._xid_at
        if drain and self._event_set is not None and not self._control.busy:
            self._xid_at = now + self._slow_interval
            xid_job = self._control.submit(self._drain_events)
        engines = self._engines()
        results = self._run_passes(batch, todo, now, deadline)
        readings: dict[int, _GpuReading] = {}
        library_error: nb.NvmlError | None = None
        for g in todo:
            got = results.get(g.index)
            if got is None:
                continue  # timed out, already reported
            reading, err = got
            if reading is not None:
                readings[g.index] = reading
            elif isinstance(err, nb.NvmlError):
                if err.kind in nb.LIBRARY_KINDS:
                    library_error = library_error or err
                else:
                    self._gpu_down(batch, g, err.reason, now)
            else:
                self._log_once(
                    f"bug:{type(err).__name__}",
                    logging.ERROR,
                    "GPU sampler error on GPU %d: %r",
                    g.index,
                    err,
                )
                self._gpu_down(batch, g, "internal_error", now)
        self._collect_xids(batch, xid_job, deadline, drain)
        if library_error is not None:
            self._library_failed(batch, library_error, now)
            return
        self._emit_all(batch, readings, engines, now)

    def _run_passes(
        self, batch: Batch, todo: list[_Gpu], now: float, deadline: float
    ) -> dict[int, tuple[_GpuReading | None, BaseException | None]]:
        """Read ``todo`` in one pass on a free worker, moving on past a GPU that hangs.

        A GPU still in its NVML calls after :attr:`gpu_budget_s` is declared timed out and
        left to the stuck worker (skipped until that call returns); the GPUs after it continue
        at once on another worker. The whole cycle ends by ``deadline``.
        """
        results: dict[int, tuple[_GpuReading | None, BaseException | None]] = {}
        read = partial(self._read_gpu, now=now)
        while todo:
            if self._inline:
                p = _Pass(todo, read)
                p.run()
                results.update(p.results)
                return results
            worker = next((w for w in self._pool if not w.busy), None)
            if worker is None:
                if len(self._pool) >= len(self._gpus) + 2:  # every spare is stuck in NVML
                    for g in todo:
                        self._gpu_down(batch, g, nb.TIMEOUT, now)
                    return results
                worker = _Worker(f"gpu-nvml-{len(self._pool)}")
                self._pool.append(worker)
            p = _Pass(todo, read)
            job = worker.submit(p.run)
            while not job.finished:
                t = time.monotonic()
                if t >= deadline:
                    break
                cur, since = p.current, p.since
                if cur is not None and t - since >= self.gpu_budget_s:
                    break
                limit = deadline if cur is None else min(deadline, since + self.gpu_budget_s)
                job.wait(min(limit - t, self.gpu_budget_s / 2))
            if job.finished:
                results.update(p.results)
                return results
            hung, done = p.cancel()
            results.update(done)
            rest = [g for g in todo if g.index not in done and g is not hung]
            if hung is not None:
                hung.stuck = job
                self._gpu_down(batch, hung, nb.TIMEOUT, now)
            if time.monotonic() >= deadline:
                for g in rest:
                    self._gpu_down(batch, g, nb.TIMEOUT, now)
                return results
            todo = rest
        return results

    # ---- NVML lifecycle ----------------------------------------------------------------------
    def _ensure_nvml(self, batch: Batch, now: float) -> bool:
        """Initialise NVML when needed; False (with the source status recorded) when unusable."""
        if self._state == "ok":
            return True
        job = self._init_pending
        if job is None:
            if self._state == "disabled" and now < self._nvml_backoff.retry_at:
                batch.source_unsupported("nvml", self._reason)
                return False
            if self._state == "down" and not self._nvml_backoff.ready(now):
                batch.source_error("nvml", self._reason)
                self._all_down(batch)
                return False
            if self._control.busy:  # an XID drain is stuck in NVML
                batch.source_error("nvml", nb.TIMEOUT)
                self._all_down(batch)
                return False
            # After a driver/library failure, start from a freshly loaded library, unless a
            # worker is still inside NVML (unloading under it would crash the process).
            fresh = self._state == "down" and not any(w.busy for w in self._pool)
            job = self._init_pending = self._control.submit(
                partial(self._init_job, self._need_reinit or fresh, fresh)
            )
            self._need_reinit = False
        if not job.wait(None if self._inline else self.gpu_timeout_s):
            # nvmlInit can take seconds without persistence mode; keep waiting for this job
            # (never start a second init behind it) and report the wait.
            batch.source_error("nvml", nb.TIMEOUT)
            self._all_down(batch)
            return False
        self._init_pending = None
        if job.error is not None:
            if not isinstance(job.error, nb.NvmlError):
                raise job.error
            err = job.error
            if err.kind == nb.LIBRARY_NOT_FOUND:
                self._state = "disabled"
                self._reason = err.reason
                self._nvml_backoff.retry_at = now + DISABLED_REPROBE_S
                self._log_once(
                    "nvml:disabled",
                    logging.WARNING,
                    "GPU sampler disabled: NVML library not found (%s); install the NVIDIA "
                    "driver, or run the container with the NVIDIA runtime (--gpus all) so "
                    "libnvidia-ml.so.1 is mounted",
                    err,
                )
                batch.source_unsupported("nvml", self._reason)
                return False
            self._nvml_down(batch, err, now)
            return False
        self._apply_init(job.result)
        recovered = self._state == "down"
        self._state = "ok"
        self._reason = ""
        self._nvml_backoff.ok()
        self._log_once.reset("nvml:down")
        if recovered:
            log.warning(
                "NVML available again (driver %s); GPU sampling resumed",
                self._driver_version or "unknown",
            )
        return True

    def _init_job(self, reinit: bool, reload_library: bool) -> tuple[str, int, Any, str]:
        """Initialise NVML on the control worker.

        Args:
            reinit: shut down first (the driver went away under a running agent).
            reload_library: also reload ``libnvidia-ml.so.1`` from disk (see
                :meth:`~agent.samplers.nvml_binding.NvmlBinding.reinit`).

        Returns:
            (driver version, GPU count, XID event set or ``None``, why there is no event set).
        """
        nv = self._nv
        if reinit:
            nv.reinit(reload_library=reload_library)
        else:
            nv.init()
        try:
            driver = str(nv.call("nvmlSystemGetDriverVersion"))
        except nb.NvmlError as exc:
            if exc.kind in nb.LIBRARY_KINDS:
                raise
            driver = ""
        count = int(nv.call("nvmlDeviceGetCount"))
        event_set: Any = None
        events_reason = ""
        try:
            event_set = nv.call("nvmlEventSetCreate")
        except nb.NvmlError as exc:
            if exc.kind in nb.LIBRARY_KINDS:
                raise
            events_reason = "not_supported" if exc.kind == nb.UNSUPPORTED else exc.reason
        return driver, count, event_set, events_reason

    def _apply_init(self, result: tuple[str, int, Any, str]) -> None:
        """Size the GPU list after init, keeping counters of GPUs that were already known."""
        self._driver_version, count, self._event_set, self._events_reason = result
        old = {g.index: g for g in self._gpus}
        gpus: list[_Gpu] = []
        for i in range(count):
            g = old.get(i)
            if g is None:
                g = _Gpu(i, _Backoff(self._backoff_base, self._backoff_cap))
            g.handle = None
            g.uuid = ""  # enumerate by index again: a reload may renumber
            g.refresh_at = 0.0
            g.xid_registered = False
            g.links_probed = False
            g.gpm_supported = None
            g.down_reason = ""
            g.backoff.ok()
            for leaf in g.leaves():
                leaf.gpm_samples = None
                leaf.gpm_get = None
            g.reset_deltas()
            gpus.append(g)
        self._gpus = gpus
        self._handle_index = {}

    def _nvml_down(self, batch: Batch, err: nb.NvmlError, now: float) -> None:
        self._state = "down"
        self._reason = err.reason
        self._nvml_backoff.fail(now)
        self._event_set = None
        self._log_once("nvml:down", logging.WARNING, "%s", self._down_message(err))
        batch.source_error("nvml", self._reason)
        self._all_down(batch)

    def _library_failed(self, batch: Batch, err: nb.NvmlError, now: float) -> None:
        """A device call showed the driver went away (reload, mismatch): re-init from now on."""
        for g in self._gpus:
            g.reset_deltas()
            g.refresh_at = 0.0
        self._nvml_backoff.ok()
        self._need_reinit = True
        self._nvml_down(batch, err, now)
        self._nvml_backoff.retry_at = now  # first re-init attempt at the next cycle

    def _down_message(self, err: nb.NvmlError) -> str:
        kernel = _kernel_module_version(self._driver_version_file)
        extra = f"; kernel module {kernel}" if kernel else ""
        lib = f"; library/driver {self._driver_version}" if self._driver_version else ""
        return (
            f"NVML unavailable ({err.reason}: {err}){extra}{lib}; GPU metrics are missing, "
            f"retrying with back-off up to {self._backoff_cap:g} s"
        )

    def _all_down(self, batch: Batch) -> None:
        """``gpu_up 0`` for every known GPU and MIG instance not already reported this cycle."""
        done = {s.labels for s in batch.samples if s.name == "kvpressure_gpu_up"}
        for g in self._gpus:
            labels = [leaf.labels for leaf in g.leaves()] or [make_labels({"gpu": str(g.index)})]
            for lab in labels:
                if lab not in done:
                    batch.samples.append(Sample("kvpressure_gpu_up", 0.0, lab))

    def _gpu_down(self, batch: Batch, g: _Gpu, reason: str, now: float, count: bool = True) -> None:
        if count:
            g.down_reason = g.down_reason or reason  # the reason that took it down stays
            g.backoff.fail(now)
            g.reset_deltas()
            g.handle = None
            g.refresh_at = 0.0
            self._log_once(
                f"gpu{g.index}:down",
                logging.WARNING,
                "GPU %d (%s) not answering NVML: %s; other GPUs keep sampling, retry with back-off",
                g.index,
                g.uuid or "uuid unknown",
                reason,
            )
        batch.source_error(f"gpu{g.index}", g.down_reason or reason)
        labels = [leaf.labels for leaf in g.leaves()] or [make_labels({"gpu": str(g.index)})]
        for lab in labels:
            batch.samples.append(Sample("kvpressure_gpu_up", 0.0, lab))

    # ---- reading one GPU (worker thread) -----------------------------------------------------
    def _read_gpu(self, g: _Gpu, *, now: float) -> _GpuReading:
        if g.handle is None or now >= g.refresh_at:
            self._discover(g, now)
        assert g.leaf is not None
        slow = now >= g.slow_at
        if slow:
            g.slow_at = now + self._slow_interval
        leaves = [self._read_leaf(g, g.leaf, now, True, slow)]
        leaves.extend(self._read_leaf(g, m, now, False, slow) for m in g.migs)
        if slow:
            counters, pcie_ok, nvlink_ok = self._read_counters(g, now)
        else:
            counters, pcie_ok, nvlink_ok = [], g.pcie_ok, g.nvlink_ok
        return _GpuReading(slow, leaves, counters, pcie_ok, nvlink_ok)

    def _discover(self, g: _Gpu, now: float) -> None:
        nv = self._nv
        if g.handle is None:
            if g.uuid:
                g.handle = nv.call("nvmlDeviceGetHandleByUUID", g.uuid)
            else:
                g.handle = nv.call("nvmlDeviceGetHandleByIndex", g.index)
        h = g.handle
        uuid = str(nv.call("nvmlDeviceGetUUID", h))
        name = str(nv.call("nvmlDeviceGetName", h))
        if g.leaf is None or g.leaf.uuid != uuid:
            g.leaf = _Leaf(g.index, uuid, name, h)
            g.migs = []
            g.last_raw.clear()
        g.uuid = uuid
        g.leaf.handle = h
        g.leaf.name = name
        self._handle_index[nb.handle_key(h)] = g.index
        g.mig_enabled = False
        try:
            g.mig_enabled = int(nv.call("nvmlDeviceGetMigMode", h)[0]) == nb.NVML_DEVICE_MIG_ENABLE
        except nb.NvmlError as exc:
            if exc.kind not in nb.FIELD_KINDS:
                raise
        g.migs = self._discover_migs(g, h) if g.mig_enabled else []
        if not g.links_probed:
            g.links = self._probe_links(h)
            g.links_probed = True
        if g.gpm_supported is None:
            try:
                g.gpm_supported = bool(nv.call("nvmlGpmQueryDeviceSupport", h).isSupportedDevice)
            except nb.NvmlError as exc:
                if exc.kind not in nb.FIELD_KINDS:
                    raise
                g.gpm_supported = False
        if self._event_set is not None and not g.xid_registered:
            self._register_xid(g, h)
        g.refresh_at = now + REFRESH_S

    def _discover_migs(self, g: _Gpu, h: Any) -> list[_Leaf]:
        nv = self._nv
        old = {m.uuid: m for m in g.migs}
        out: list[_Leaf] = []
        for i in range(int(nv.call("nvmlDeviceGetMaxMigDeviceCount", h))):
            try:
                mh = nv.call("nvmlDeviceGetMigDeviceHandleByIndex", h, i)
            except nb.NvmlError as exc:
                if exc.code == nb.NVML_ERROR_NOT_FOUND or exc.kind in nb.FIELD_KINDS:
                    continue
                raise
            uuid = str(nv.call("nvmlDeviceGetUUID", mh))
            gi = int(nv.call("nvmlDeviceGetGpuInstanceId", mh))
            ci = int(nv.call("nvmlDeviceGetComputeInstanceId", mh))
            leaf = old.get(uuid)
            if leaf is None:
                label = str(gi) if ci == 0 else f"{gi}.{ci}"
                leaf = _Leaf(g.index, uuid, str(nv.call("nvmlDeviceGetName", mh)), mh, label, gi)
            leaf.handle = mh
            out.append(leaf)
        kept = {id(m) for m in out}
        for gone in g.migs:  # a MIG instance destroyed since the last discovery
            if id(gone) not in kept:
                for sample in gone.gpm_samples or ():
                    self._quiet(nv.call, "nvmlGpmSampleFree", sample)
                gone.gpm_samples = None
        return out

    def _probe_links(self, h: Any) -> list[int] | None:
        """NVLink links to read: ``[]`` when the GPU has none, ``None`` when unknown."""
        try:
            fv = self._nv.call("nvmlDeviceGetFieldValues", h, [nb.NVML_FI_DEV_NVLINK_LINK_COUNT])
        except nb.NvmlError as exc:
            if exc.kind not in nb.FIELD_KINDS:
                raise
            return None
        count = nb.field_value(fv[0])
        if count is None:
            return None
        return list(range(int(count)))

    def _register_xid(self, g: _Gpu, h: Any) -> None:
        nv = self._nv
        try:
            types = int(nv.call("nvmlDeviceGetSupportedEventTypes", h))
            if types & nb.nvmlEventTypeXidCriticalError:
                nv.call(
                    "nvmlDeviceRegisterEvents", h, nb.nvmlEventTypeXidCriticalError, self._event_set
                )
                g.xid_registered = True
        except nb.NvmlError as exc:
            if exc.kind not in nb.FIELD_KINDS:
                raise

    def _opt(
        self, leaf: _Leaf, out: _LeafReading, name: str, now: float, fn: Callable[..., Any], *a: Any
    ) -> Any:
        """Call ``fn(*a)`` for field ``name``; ``None`` when unsupported (then re-probed later)."""
        skipped = leaf.skip.get(name)
        if skipped is not None:
            if now < skipped[0]:
                out.unsupported.append((name, skipped[1]))
                return None
            del leaf.skip[name]
        try:
            return fn(*a)
        except nb.NvmlError as exc:
            if exc.kind not in nb.FIELD_KINDS:
                raise
            reason = "not_supported" if exc.kind == nb.UNSUPPORTED else exc.reason
            if name == "utilization" and (leaf.mig is not None or leaf.gpu in self._mig_gpus()):
                reason = "mig_enabled"
            elif name == "memory" and exc.kind == nb.UNSUPPORTED:
                reason = (
                    "unified_memory"
                    if any(p.lower() in leaf.name.lower() for p in UNIFIED_MEMORY_PARTS)
                    else "not_supported"
                )
                leaf.unified = "true" if reason == "unified_memory" else "unknown"
            leaf.skip[name] = (now + REPROBE_S, reason)
            out.unsupported.append((name, reason))
            return None

    def _mig_gpus(self) -> set[int]:
        return {g.index for g in self._gpus if g.mig_enabled}

    def _read_leaf(
        self, g: _Gpu, leaf: _Leaf, now: float, physical: bool, slow: bool
    ) -> _LeafReading:
        nv = self._nv
        h = leaf.handle
        r = _LeafReading(leaf)
        mem = self._opt(leaf, r, "memory", now, nv.memory_info, h)
        host_total = self._host_memory_total(now)
        if (
            mem is not None
            and leaf.mig is None  # a MIG slice is a share of the GPU's own memory
            and is_unified_total(leaf.name, float(mem.total), host_total)
        ):
            if not leaf.host_memory:
                log.warning(
                    "GPU %s (%s): NVML reports %.1f GiB of memory, the system's (MemTotal "
                    "%.1f GiB): unified memory; GPU used is derived from the processes",
                    leaf.source,
                    leaf.name,
                    float(mem.total) / 2**30,
                    (host_total or 0.0) / 2**30,
                )
            leaf.host_memory = True
            leaf.unified = "true"
            r.unsupported.append(("memory", "unified_memory"))
        elif mem is not None:
            leaf.host_memory = False
            reserved = getattr(mem, "reserved", None)
            memory = (
                float(mem.total),
                float(mem.used),
                float(mem.free),
                None if reserved is None else float(reserved),
            )
            total = memory[0]
            if not all(v is None or 0 <= v <= total for v in memory[1:]):
                # used, free or reserved above the total cannot be true: the whole reading
                # is suspect (the four come from one struct), the rest of the GPU is kept
                self._drop(leaf, "memory_above_total", f"{memory}")
            else:
                r.memory = memory
            if leaf.unified != "true":
                leaf.unified = "false"
        util = self._opt(leaf, r, "utilization", now, nv.call, "nvmlDeviceGetUtilizationRates", h)
        if util is not None:
            if 0 <= util.gpu <= 100 and 0 <= util.memory <= 100:
                r.utilization = _ratio(util.gpu)
                r.memory_activity = _ratio(util.memory)
            else:
                self._drop(leaf, "utilization_out_of_range", f"gpu={util.gpu} memory={util.memory}")
        if physical:
            power = self._opt(leaf, r, "power", now, nv.call, "nvmlDeviceGetPowerUsage", h)
            r.power_w = None if power is None else float(power) / 1000.0
            temp = self._opt(leaf, r, "temperature", now, nv.temperature, h)
            r.temperature_c = None if temp is None else float(temp)
            r.clocks = self._opt(leaf, r, "clocks", now, nv.clocks_event_reasons, h)
        if g.gpm_supported:
            got = self._opt(leaf, r, "gpm", now, self._read_gpm, g, leaf)
            if got is not None:
                r.bandwidth, r.sm_occupancy = got
        if physical and g.mig_enabled:
            return r
        if not slow:
            r.processes = leaf.processes
            r.unsupported.extend(_skips(leaf, ("processes", "graphics_processes")))
            return r
        leaf.processes = None
        compute = self._opt(leaf, r, "processes", now, nv.compute_processes, h)
        graphics = self._opt(leaf, r, "graphics_processes", now, nv.graphics_processes, h)
        if compute is not None or graphics is not None:
            if r.memory is not None:
                limit: float | None = r.memory[0]
            else:
                limit = host_total if leaf.unified == "true" else None
            found: list[tuple[int, float]] = []
            for nvml_pid, used in self._clean_processes(leaf, compute or (), graphics or (), limit):
                pid = self._local_pid(nvml_pid, now)
                found.append((pid, used))
                if pid not in self._proc_names:
                    self._proc_names[pid] = self._process_name(nvml_pid)
                    self._pods[pid] = pod_of_pid(pid, self._procfs)
            leaf.processes = r.processes = found
        return r

    def _clean_processes(
        self, leaf: _Leaf, compute: Iterable[Any], graphics: Iterable[Any], limit: float | None
    ) -> list[tuple[int, float]]:
        """Merge NVML's compute and graphics process rows, dropping impossible ones.

        Args:
            leaf: the device (its ``dropped`` counter is updated).
            compute: ``nvmlDeviceGetComputeRunningProcesses`` rows (``pid``,
                ``usedGpuMemory`` bytes or ``None``).
            graphics: ``nvmlDeviceGetGraphicsRunningProcesses`` rows, same shape.
            limit: the most memory one process can hold, bytes (the device's total, or the
                host's MemTotal on unified memory); ``None`` when unknown.

        Returns:
            ``(NVML pid, used bytes)`` once per PID. A PID outside ``1..PID_MAX_LIMIT``
            (``process_pid_invalid``) and a row holding more than ``limit``
            (``process_memory_above_total``) are dropped; a PID listed twice by one call is
            one process (``process_duplicate``; the rows are copies, so the larger is kept,
            never the sum), as is a PID in both lists (a process with compute and graphics
            contexts, not counted). Rows without a memory figure are left out.
        """
        rows: dict[int, float | None] = {}
        for listing in (compute, graphics):
            seen: set[int] = set()
            for p in listing:
                try:
                    pid = int(getattr(p, "pid", 0))
                except (TypeError, ValueError):
                    pid = 0
                if not 0 < pid <= PID_MAX_LIMIT:
                    self._drop(leaf, "process_pid_invalid", f"pid {pid}")
                    continue
                raw = getattr(p, "usedGpuMemory", None)
                used = None if raw is None else float(raw)
                if used is not None and (
                    not math.isfinite(used) or used < 0 or (limit is not None and used > limit)
                ):
                    self._drop(leaf, "process_memory_above_total", f"pid {pid}, {used:.0f} B")
                    continue
                if pid in seen:
                    self._drop(leaf, "process_duplicate", f"pid {pid}")
                seen.add(pid)
                prev = rows.get(pid)
                rows[pid] = used if prev is None else (prev if used is None else max(prev, used))
        return [(pid, used) for pid, used in rows.items() if used is not None]

    def _drop(self, leaf: _Leaf, reason: str, detail: str) -> None:
        """Count an impossible NVML value dropped on ``leaf`` (one of :data:`DROP_REASONS`)."""
        leaf.dropped[reason] += 1
        self._log_once(
            f"{leaf.source}:{reason}",
            logging.WARNING,
            "GPU %s: impossible NVML value dropped (%s): %s; the rest of the sample is kept",
            leaf.source,
            reason,
            detail,
        )

    def _local_pid(self, pid: int, now: float) -> int:
        """The PID in the agent's PID namespace of an NVML process PID.

        A PID the agent's procfs has is taken as it is. Otherwise it is looked up among the
        inner-namespace PIDs of ``<procfs>/*/status`` ``NSpid:`` lines (a process in a
        container: ``NSpid: 48213 7`` is PID 7 inside, 48213 here); a PID found in exactly
        one process is mapped, any other is kept unmapped. The scan runs at most every
        :data:`NSPID_RESCAN_S` seconds.
        """
        if (self._procfs / str(pid)).exists():
            return pid
        if now >= self._nspid_at:
            self._nspid_at = now + NSPID_RESCAN_S
            self._nspid = nspid_index(self._procfs)
        return self._nspid.get(pid, pid)

    def _host_memory_total(self, now: float) -> float | None:
        """``MemTotal`` of ``<procfs>/meminfo`` in bytes (re-read every :data:`REFRESH_S`)."""
        if now >= self._host_total[0]:
            self._host_total = (now + REFRESH_S, _meminfo(self._procfs).get("MemTotal"))
        return self._host_total[1]

    def _process_name(self, pid: int) -> str:
        try:
            name = str(self._nv.call("nvmlSystemGetProcessName", pid))
        except nb.NvmlError as exc:
            if exc.kind in nb.LIBRARY_KINDS:
                raise
            return ""
        return name.rsplit("/", 1)[-1]

    def _read_gpm(self, g: _Gpu, leaf: _Leaf) -> tuple[float | None, float | None] | None:
        """Take a GPM sample and return (DRAM bandwidth, SM occupancy) since the previous one."""
        nv = self._nv
        if leaf.gpm_samples is None:
            leaf.gpm_samples = [nv.call("nvmlGpmSampleAlloc"), nv.call("nvmlGpmSampleAlloc")]
            leaf.gpm_ready = False
        s = leaf.gpm_samples
        if leaf.gi is None:
            nv.call("nvmlGpmSampleGet", g.handle, s[1])
        else:
            nv.call("nvmlGpmMigSampleGet", g.handle, leaf.gi, s[1])
        if not leaf.gpm_ready:
            s[0], s[1] = s[1], s[0]
            leaf.gpm_ready = True
            return None
        mg = leaf.gpm_get
        if mg is None:
            mg = leaf.gpm_get = nv.new_gpm_metrics_get()
        mg.version = nb.NVML_GPM_METRICS_GET_VERSION
        mg.numMetrics = 2
        mg.sample1 = s[0]
        mg.sample2 = s[1]
        mg.metrics[0].metricId = nb.NVML_GPM_METRIC_DRAM_BW_UTIL
        mg.metrics[1].metricId = nb.NVML_GPM_METRIC_SM_OCCUPANCY
        nv.call("nvmlGpmMetricsGet", mg)
        s[0], s[1] = s[1], s[0]
        m0, m1 = mg.metrics[0], mg.metrics[1]
        bw = _ratio(m0.value) if int(m0.nvmlReturn) == nb.NVML_SUCCESS else None
        sm = _ratio(m1.value) if int(m1.nvmlReturn) == nb.NVML_SUCCESS else None
        return bw, sm

    def _read_counters(
        self, g: _Gpu, now: float
    ) -> tuple[list[tuple[str, str, tuple[int, int], float, int, float]], bool, bool]:
        """One ``nvmlDeviceGetFieldValues`` call for PCIe bytes and per-link NVLink KiB."""
        assert g.leaf is not None
        leaf = g.leaf
        ids: list[tuple[str, str, tuple[int, int], float]] = []
        want_pcie = not self._skipped(leaf, "pcie", now)
        want_nvl = bool(g.links) and not self._skipped(leaf, "nvlink", now)
        if want_pcie:
            ids.append(("pcie", "tx", (nb.NVML_FI_DEV_PCIE_COUNT_TX_BYTES, 0), 1.0))
            ids.append(("pcie", "rx", (nb.NVML_FI_DEV_PCIE_COUNT_RX_BYTES, 0), 1.0))
        if want_nvl:
            for link in g.links or ():
                ids.append(
                    ("nvlink", "tx", (nb.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, link), 1024.0)
                )
                ids.append(
                    ("nvlink", "rx", (nb.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX, link), 1024.0)
                )
        if not ids:
            return [], False, g.links == []
        try:
            values = self._nv.call("nvmlDeviceGetFieldValues", g.handle, [i[2] for i in ids])
        except nb.NvmlError as exc:
            if exc.kind not in nb.FIELD_KINDS:
                raise
            reason = "not_supported" if exc.kind == nb.UNSUPPORTED else exc.reason
            for grp in {i[0] for i in ids}:
                leaf.skip[grp] = (now + REPROBE_S, reason)
            return [], False, g.links == []
        out: list[tuple[str, str, tuple[int, int], float, int, float]] = []
        failed: set[str] = set()
        for (grp, direction, key, scale), fv in zip(ids, values, strict=False):
            v = nb.field_value(fv)
            if v is None:
                failed.add(grp)
                continue
            out.append((grp, direction, key, v, nb.field_value_bits(fv), scale))
        for grp in failed:
            leaf.skip[grp] = (now + REPROBE_S, "not_supported")
        out = [c for c in out if c[0] not in failed]
        pcie_ok = want_pcie and "pcie" not in failed
        nvlink_ok = g.links == [] or (want_nvl and "nvlink" not in failed)
        return out, pcie_ok, nvlink_ok

    @staticmethod
    def _skipped(leaf: _Leaf, name: str, now: float) -> bool:
        s = leaf.skip.get(name)
        if s is None:
            return False
        if now < s[0]:
            return True
        del leaf.skip[name]
        return False

    # ---- XIDs --------------------------------------------------------------------------------
    def _drain_events(self) -> list[tuple[int, int]]:
        """Read pending XID events without waiting; returns (GPU index, XID) pairs."""
        nv = self._nv
        fn = "nvmlEventSetWait_v2" if nv.has("nvmlEventSetWait_v2") else "nvmlEventSetWait"
        out: list[tuple[int, int]] = []
        for _ in range(XID_DRAIN_MAX):
            try:
                data = nv.call(fn, self._event_set, 0)
            except nb.NvmlError as exc:
                if exc.kind == nb.TIMEOUT:
                    break
                raise
            if not int(data.eventType) & nb.nvmlEventTypeXidCriticalError:
                continue
            index = self._handle_index.get(nb.handle_key(data.device))
            if index is None:
                try:
                    index = int(nv.call("nvmlDeviceGetIndex", data.device))
                except nb.NvmlError:
                    continue
            out.append((index, int(data.eventData)))
        return out

    def _collect_xids(self, batch: Batch, job: _Job | None, deadline: float, drain: bool) -> None:
        if self._event_set is None:
            batch.source_unsupported("xid", self._events_reason or "not_supported")
            return
        if not drain:  # drained every SLOW_INTERVAL_S; NVML queues events meanwhile
            batch.source_ok("xid")
            return
        if job is None:
            batch.source_error("xid", "timeout")
            return
        if not job.wait(deadline - time.monotonic()):
            batch.source_error("xid", "timeout")
            return
        if job.error is not None:
            reason = job.error.reason if isinstance(job.error, nb.NvmlError) else "internal_error"
            batch.source_error("xid", reason)
            return
        for index, xid in job.result:
            self._xid.setdefault(index, Counter())[xid] += 1
            self._log_once(f"xid:{index}:{xid}", logging.WARNING, "XID %d on GPU %d", xid, index)
        batch.source_ok("xid")

    # ---- engines -----------------------------------------------------------------------------
    def _engines(self) -> _Engines:
        """Sum the engines' request gauges and token-counter increases (main thread)."""
        out = _Engines()
        view = self._state_view
        if view is None:
            return out
        for signal, metric in ENGINE_GPU_VIEWS.items():
            for labels, value in view(metric).items():
                engine, uuid = _label(labels, "engine"), _label(labels, "uuid")
                if engine is not None and uuid is not None:
                    out.gpu_views.setdefault((uuid, signal), {})[engine] = value
        for metric, target in ((RUNNING, out.running), (WAITING, out.waiting)):
            for labels, value in view(metric).items():
                engine = _label(labels, "engine")
                if engine is not None:
                    target[engine] = target.get(engine, 0.0) + value
                    out.names.add(engine)
        cum: dict[str, float] = {}
        series: dict[str, set[Labels]] = {}
        for metric in (PROMPT_TOKENS, GENERATION_TOKENS):
            for labels, value in view(metric).items():
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

    def _engine_of(self, pid: int, pids: dict[int, str]) -> str | None:
        engine = pids.get(pid)
        if engine is not None:
            return engine
        for parent in self._ancestry(pid):
            engine = pids.get(parent)
            if engine is not None:
                return engine
        return None

    def _ancestry(self, pid: int) -> tuple[int, ...]:
        cached = self._ancestors.get(pid)
        if cached is not None:
            return cached
        chain: list[int] = []
        cur = pid
        for _ in range(ANCESTOR_DEPTH):
            ppid = _ppid(self._procfs, cur)
            if ppid is None or ppid <= 1 or ppid in chain:
                break
            chain.append(ppid)
            cur = ppid
        out = tuple(chain)
        self._ancestors[pid] = out
        return out

    # ---- emitting (main thread) --------------------------------------------------------------
    def _emit_all(
        self, batch: Batch, readings: dict[int, _GpuReading], engines: _Engines, now: float
    ) -> None:
        if self._engine_pids is not None and (
            self._pids_cache is None or any(r.slow for r in readings.values())
        ):
            # the process lists change at most every SLOW_INTERVAL_S: ask for PIDs as rarely
            try:
                self._pids_cache = dict(self._engine_pids())
            except Exception as exc:  # noqa: BLE001 - a broken provider must not stop sampling
                self._log_once("engine_pids", logging.WARNING, "engine_pids() failed: %r", exc)
                self._pids_cache = {}
        pids = self._pids_cache or {}
        if self._pod_names is not None and any(r.slow for r in readings.values()):
            # pod assignments change with the process lists: on the slow cadence too
            try:
                self._pod_names_now = dict(self._pod_names())
            except Exception as exc:  # noqa: BLE001 - a broken provider must not stop sampling
                self._log_once("pod_names", logging.WARNING, "pod_names() failed: %r", exc)
                self._pod_names_now = {}
        seen_pids: set[int] = set()
        leaf_engines: dict[int, set[str]] = {}
        mapped: set[str] = set()
        proc_engine: dict[int, str | None] = {}
        for reading in readings.values():
            for lr in reading.leaves:
                found: set[str] = set()
                for pid, _used in lr.processes or ():
                    seen_pids.add(pid)
                    engine = proc_engine.get(pid)
                    if pid not in proc_engine:
                        engine = proc_engine[pid] = self._engine_of(pid, pids) if pids else None
                    if engine is not None:
                        found.add(engine)
                leaf_engines[id(lr.leaf)] = found
                mapped |= found
        unmapped = engines.names - mapped
        for pid in [p for p in list(self._proc_names) if p not in seen_pids]:
            self._proc_names.pop(pid, None)
            self._pods.pop(pid, None)
        for pid in [p for p in self._ancestors if p not in seen_pids]:
            del self._ancestors[pid]
        engine_pods: set[tuple[str, str, tuple[str, str, str] | None]] = set()
        for g in self._gpus:
            got = readings.get(g.index)
            if got is None:
                continue
            if g.down_reason:
                log.warning("GPU %d (%s) answering NVML again", g.index, g.uuid)
                self._log_once.reset(f"gpu{g.index}:down")
                g.down_reason = ""
            g.backoff.ok()
            self._emit_gpu(
                batch, g, got, engines, leaf_engines, unmapped, proc_engine, now, engine_pods
            )
            g.last_ok_t = now
        for engine, pod_uid, names in sorted(engine_pods, key=lambda e: (e[0], e[1], e[2] or ())):
            namespace, pod, container = names or (None, None, None)
            batch.add(
                "kvpressure_engine_pod_info",
                1,
                engine=engine,
                pod_uid=pod_uid,
                namespace=namespace,
                pod=pod,
                container=container,
            )

    def _emit_gpu(
        self,
        batch: Batch,
        g: _Gpu,
        reading: _GpuReading,
        engines: _Engines,
        leaf_engines: dict[int, set[str]],
        unmapped: set[str],
        proc_engine: dict[int, str | None],
        now: float,
        engine_pods: set[tuple[str, str, tuple[str, str, str] | None]],
    ) -> None:
        out = batch.samples
        phys = reading.leaves[0]
        th = self.thresholds
        dt = 0.0 if g.last_ok_t is None else now - g.last_ok_t
        if dt > self._max_dt or dt < 0:
            dt = 0.0
        throttled = None if phys.clocks is None else bool(phys.clocks & THROTTLE_MASK)
        gpu_engines: set[str] = set(unmapped)
        for lr in reading.leaves:
            leaf = lr.leaf
            lab = leaf.labels
            on_leaf = leaf_engines.get(id(leaf), set())
            gpu_engines |= on_leaf
            out.extend(self._static_samples(leaf))
            if lr.memory is not None:
                total, used, free, reserved = lr.memory
                if engines.gpu_views and leaf.mig is None:
                    self._disagreement(out, leaf, lr.memory, engines)
                out.append(Sample("kvpressure_gpu_memory_total_bytes", total, lab))
                out.append(Sample("kvpressure_gpu_memory_used_bytes", used, lab))
                out.append(Sample("kvpressure_gpu_memory_free_bytes", free, lab))
                if reserved is not None:
                    out.append(Sample("kvpressure_gpu_memory_reserved_bytes", reserved, lab))
            if lr.utilization is not None:
                out.append(Sample("kvpressure_gpu_utilization_ratio", lr.utilization, lab))
            if lr.bandwidth is not None:
                _put(
                    out,
                    "kvpressure_gpu_memory_bandwidth_utilization_ratio",
                    lr.bandwidth,
                    leaf.lab("source", "gpm"),
                )
            elif lr.memory_activity is not None:
                _put(
                    out,
                    "kvpressure_gpu_memory_bandwidth_utilization_ratio",
                    lr.memory_activity,
                    leaf.lab("source", "nvml"),
                )
            if lr.sm_occupancy is not None:
                out.append(Sample("kvpressure_gpu_sm_occupancy_ratio", lr.sm_occupancy, lab))
            _put(out, "kvpressure_gpu_power_watts", lr.power_w, lab)
            _put(out, "kvpressure_gpu_temperature_celsius", lr.temperature_c, lab)
            if lr.clocks is not None:
                out.extend(leaf.clock_samples(lr.clocks))
            for pid, used in lr.processes or ():
                pod = self._pods.get(pid)
                names = self._pod_names_now.get(leaf.uuid) if pod is not None else None
                plab = leaf.process_labels(
                    pid, self._proc_names.get(pid, ""), proc_engine.get(pid), pod, names
                )
                engine = proc_engine.get(pid)
                if pod is not None and engine is not None:
                    engine_pods.add((engine, pod.pod_uid, names))
                out.append(Sample("kvpressure_gpu_process_memory_bytes", used, plab))
            if leaf.host_memory and lr.processes is not None:
                used_sum = math.fsum(u for _, u in lr.processes)
                out.append(Sample("kvpressure_gpu_memory_used_bytes", used_sum, lab))
            if leaf.unified == "true":
                _put(
                    out,
                    "kvpressure_gpu_unified_memory_available_bytes",
                    _meminfo(self._procfs).get("MemAvailable"),
                    lab,
                )
            # every device read carries its counters, 0 until something is dropped
            for reason in DROP_REASONS:
                out.append(
                    Sample(
                        "kvpressure_gpu_values_dropped_total",
                        float(leaf.dropped[reason]),
                        leaf.lab("reason", reason),
                    )
                )
            for name, reason in lr.unsupported:
                batch.source_unsupported(f"{leaf.source}.{name}", reason)
            stall_leaf = not (leaf.mig is None and g.mig_enabled)
            if stall_leaf:
                self._stall(out, lr, on_leaf | unmapped, engines, throttled, dt, th)
        for name, reason in _skips(g.leaf, ("pcie", "nvlink")) if g.leaf else ():
            batch.source_unsupported(f"gpu{g.index}.{name}", reason)
        if g.links is None:
            batch.source_unsupported(f"gpu{g.index}.nvlink", "not_supported")
        d_bytes = self._counters(out, g, reading)
        self._movement(out, g, phys, d_bytes, gpu_engines, engines, dt, now)
        xids = self._xid.get(g.index)
        if xids and g.leaf is not None:
            for xid, n in sorted(xids.items()):
                out.append(
                    Sample("kvpressure_gpu_xid_errors_total", float(n), g.leaf.lab("xid", str(xid)))
                )
        batch.source_ok(f"gpu{g.index}")

    def _disagreement(
        self,
        out: list[Sample],
        leaf: _Leaf,
        memory: tuple[float, float, float, float | None],
        engines: _Engines,
    ) -> None:
        """Flag engines whose own GPU memory reading disagrees with NVML's (NVML wins).

        ``kvpressure_gpu_engine_disagreement{engine,signal}`` is 1 when the engine's total
        differs from NVML's by more than :data:`DISAGREE_TOTAL_SHARE` of it, or its used
        from NVML's used + reserved (what v1 ``nvmlDeviceGetMemoryInfo``, and so the engine,
        calls used) by more than :data:`DISAGREE_USED_SHARE` of the total and
        :data:`DISAGREE_USED_MIN_BYTES` (the two are read at different moments); else 0.
        """
        total, used, _free, reserved = memory
        nvml = {"memory_total": total, "memory_used": used + (reserved or 0.0)}
        for signal, reference in nvml.items():
            for engine, value in sorted(engines.gpu_views.get((leaf.uuid, signal), {}).items()):
                if signal == "memory_total":
                    off = abs(value - reference) > DISAGREE_TOTAL_SHARE * total
                else:
                    limit = max(DISAGREE_USED_SHARE * total, DISAGREE_USED_MIN_BYTES)
                    off = abs(value - reference) > limit
                if off:
                    self._log_once(
                        f"disagree:{leaf.uuid}:{engine}:{signal}",
                        logging.WARNING,
                        "GPU %s: engine %s reports %s %.0f bytes, NVML %.0f; NVML's is exported",
                        leaf.source,
                        engine,
                        signal,
                        value,
                        reference,
                    )
                labels = make_labels({**dict(leaf.labels), "engine": engine, "signal": signal})
                out.append(Sample("kvpressure_gpu_engine_disagreement", float(off), labels))

    def _static_samples(self, leaf: _Leaf) -> tuple[Sample, ...]:
        """``gpu_up 1`` and ``gpu_info``, rebuilt only when the identity changes."""
        key = (leaf.name, self._driver_version, leaf.unified)
        if leaf.static_key != key:
            info = make_labels(
                {
                    "gpu": str(leaf.gpu),
                    "uuid": leaf.uuid,
                    "mig": leaf.mig,
                    "name": leaf.name,
                    "driver_version": self._driver_version,
                    "unified_memory": leaf.unified,
                }
            )
            leaf.static = (
                Sample("kvpressure_gpu_up", 1.0, leaf.labels),
                Sample("kvpressure_gpu_info", 1.0, info),
            )
            leaf.static_key = key
        return leaf.static

    def _stall(
        self,
        out: list[Sample],
        lr: _LeafReading,
        on: set[str],
        engines: _Engines,
        throttled: bool | None,
        dt: float,
        th: StallThresholds,
    ) -> None:
        leaf = lr.leaf
        have = {
            "throttled": throttled is not None,
            "memory_bound": lr.bandwidth is not None and lr.sm_occupancy is not None,
            "idle_with_queue": lr.utilization is not None,
        }
        for reason, ok in have.items():
            if ok and reason not in leaf.stall:
                leaf.stall[reason] = 0.0
        running = _sum(engines.running, on)
        waiting = _sum(engines.waiting, on)
        reason_now = stall_reason(
            running=running,
            waiting=waiting,
            utilization=lr.utilization,
            bandwidth=lr.bandwidth,
            sm_occupancy=lr.sm_occupancy,
            throttled=throttled,
            thresholds=th,
        )
        if reason_now is not None and dt > 0:
            leaf.stall[reason_now] = leaf.stall.get(reason_now, 0.0) + dt
        for reason in STALL_REASONS:
            value = leaf.stall.get(reason)
            if value is not None:
                out.append(
                    Sample(
                        "kvpressure_accelerator_stall_seconds_total",
                        value,
                        leaf.lab("reason", reason),
                    )
                )

    def _counters(self, out: list[Sample], g: _Gpu, reading: _GpuReading) -> float | None:
        """Accumulate PCIe/NVLink totals; returns this cycle's bytes moved, or ``None``.

        Field values are read every :data:`SLOW_INTERVAL_S`; a cycle without a read moved 0
        bytes as far as the window is concerned (the next read carries them).
        """
        assert g.leaf is not None
        moved: float | None = 0.0 if g.bytes_known else None
        if reading.slow:
            total_moved = 0.0
            baseline = True
            for grp, direction, key, value, bits, scale in reading.counters:
                last = g.last_raw.get(key)
                g.last_raw[key] = value
                tkey = (grp, direction)
                g.totals.setdefault(tkey, 0.0)
                if last is None:
                    baseline = False
                    continue
                delta = value - last
                if delta < 0:  # a 32-bit wrap, else a reset (GPU reset): add nothing
                    wrap = float(1 << bits)
                    delta = value + wrap - last if bits <= 32 and last > wrap / 2 else 0.0
                g.totals[tkey] += delta * scale
                total_moved += delta * scale
            g.pcie_ok, g.nvlink_ok = reading.pcie_ok, reading.nvlink_ok
            known = g.pcie_ok and g.nvlink_ok and baseline
            moved = total_moved if known and g.bytes_known else None
            g.bytes_known = known
        if reading.slow or g.counter_samples is None:
            g.counter_samples = tuple(
                Sample(f"kvpressure_gpu_{grp}_bytes_total", total, g.leaf.lab("direction", d))
                for (grp, d), total in sorted(g.totals.items())
                if (g.pcie_ok if grp == "pcie" else g.nvlink_ok)
            )
        out.extend(g.counter_samples)
        return moved

    def _movement(
        self,
        out: list[Sample],
        g: _Gpu,
        phys: _LeafReading,
        d_bytes: float | None,
        on: set[str],
        engines: _Engines,
        dt: float,
        now: float,
    ) -> None:
        assert g.leaf is not None
        d_tokens: float | None = None
        if on and all(engines.tokens.get(e) is not None for e in on):
            d_tokens = sum(engines.tokens[e] or 0.0 for e in on)
        mem_used = phys.memory[1] if phys.memory is not None else None
        if dt <= 0:
            return
        horizon = now - self.thresholds.data_movement_window_s
        bpt = g.bytes_per_token
        bpt.add(now, dt, d_bytes, d_tokens, horizon)
        if bpt.points and bpt.b >= 1.0:  # at least one token in the window
            out.append(
                Sample("kvpressure_data_movement_bytes_per_token", bpt.a / bpt.b, g.leaf.labels)
            )
        tpm = g.tokens_per_mem
        tpm.add(now, dt, d_tokens, None if mem_used is None else mem_used * dt, horizon)
        if tpm.points and tpm.span > 0 and tpm.b / tpm.span >= 1.0:
            out.append(
                Sample("kvpressure_tokens_per_byte", tpm.a / (tpm.b / tpm.span), g.leaf.labels)
            )


# ---- helpers ------------------------------------------------------------------------------------
def _put(out: list[Sample], name: str, value: float | None, labels: Labels) -> None:
    """Append a sample unless the value is missing (``None``)."""
    if value is not None and math.isfinite(value):
        out.append(Sample(name, float(value), labels))


def _ratio(percent: Any) -> float:
    """Percent (0-100) to a ratio clamped to 0-1."""
    return min(1.0, max(0.0, float(percent) / 100.0))


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


def nspid_index(procfs: Path) -> dict[int, int]:
    """Map inner-namespace PIDs to PIDs in ``procfs``'s namespace, from ``NSpid:`` lines.

    Args:
        procfs: the procfs root (``/proc``); reads ``<procfs>/<pid>/status``.

    Returns:
        ``{inner pid: pid here}`` for every PID of a nested namespace that belongs to exactly
        one process (a PID two containers both use is ambiguous and left out). Empty when
        nothing is nested or procfs cannot be read.
    """
    found: dict[int, int] = {}
    ambiguous: set[int] = set()
    try:
        entries = [e.name for e in os.scandir(procfs) if e.name.isdigit()]
    except OSError:
        return {}
    for name in entries:
        try:
            text = (procfs / name / "status").read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        for line in text.splitlines():
            if line.startswith("NSpid:"):
                ids = [int(x) for x in line.split()[1:] if x.isdigit()]
                for inner in ids[1:]:
                    if found.get(inner, ids[0]) != ids[0]:
                        ambiguous.add(inner)
                    found[inner] = ids[0]
                break
    for pid in ambiguous:
        found.pop(pid, None)
    return found


def _meminfo(procfs: Path) -> dict[str, float]:
    """``MemTotal`` and ``MemAvailable`` of ``<procfs>/meminfo`` in bytes ({} if unreadable)."""
    out: dict[str, float] = {}
    try:
        text = (procfs / "meminfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return out
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        if key in ("MemTotal", "MemAvailable"):
            parts = rest.split()
            if parts and parts[0].isdigit():
                out[key] = float(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    return out


def _ppid(procfs: Path, pid: int) -> int | None:
    """Parent PID from ``<procfs>/<pid>/stat`` (the field after the ``(comm)``), or ``None``."""
    try:
        text = (procfs / str(pid) / "stat").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    tail = text.rpartition(")")[2].split()
    if len(tail) < 2 or not tail[1].isdigit():
        return None
    return int(tail[1])


def _kernel_module_version(path: Path) -> str:
    """The kernel module version from ``/proc/driver/nvidia/version`` (case 06), or ``""``."""
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return ""
    for line in lines:  # "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.90.07  <date>"
        parts = line.split()
        for i, word in enumerate(parts[:-1]):
            if word == "Module" and parts[i - 1] == "Kernel":
                return parts[i + 1]
    return ""
