"""GPU sampler: NVML readings per GPU and MIG instance (a source: it reads NVML and procfs only).

Memory, bandwidth, clocks, links, processes and XIDs come from NVML.

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

**XIDs** (:mod:`.gpu_xid`) are drained once per cycle on the control worker and counted per GPU
and XID code.

**Processes → engines** (:mod:`.gpu_procs`): ``engine_pids()`` maps PIDs to engine names; a GPU
process whose PID or one of its ancestors is an engine's gets that ``engine`` label. Accelerator
stall time and data movement per token are derived from these samples by the ``accelerator``
stage (:mod:`agent.samplers.accelerator`), which runs after each GPU report.

The sampler is split by concern: :mod:`.gpu_workers` (worker pool, back-off),
:mod:`.gpu_devices` (per-device state), :mod:`.gpu_nvml` (discovery, MIG, reads),
:mod:`.gpu_xid`, :mod:`.gpu_procs`; this module runs the cycle and emits the samples.

NVML comes through :mod:`.nvml_binding`, picked by :func:`.nvml_factory.bind` (the real
library, or the fake for ``fake:<profile>``; neither imports the other, they share
:mod:`.nvml_codes`). The module imports no pydantic, httpx or aiohttp, so
``benchmarks/gpu_check.py`` runs it on a bare GPU machine.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, Final, Literal

from kvpressure.agent import catalogue
from kvpressure.agent.catalogue import SampleName
from kvpressure.agent.kube import PodRef
from kvpressure.agent.logs import LogOnce
from kvpressure.agent.pipeline import Context, Plan, Stage, register
from kvpressure.agent.samplers import nvml_binding as nb
from kvpressure.agent.samplers.base import Sampler
from kvpressure.agent.samplers.gpu_devices import (
    COHERENT_MEMORY_PARTS,
    COHERENT_TOTAL_SHARE,
    DROP_REASONS,
    PID_MAX_LIMIT,
    REFRESH_S,
    REPROBE_S,
    UNIFIED_MEMORY_PARTS,
    UNIFIED_TOTAL_TOLERANCE,
    _Gpu,
    _GpuReading,
    _Leaf,
    _skips,
    is_unified_total,
)
from kvpressure.agent.samplers.gpu_nvml import _NvmlMixin
from kvpressure.agent.samplers.gpu_procs import (
    ANCESTOR_DEPTH,
    NSPID_RESCAN_S,
    _kernel_module_version,
    _meminfo,
    nspid_index,
)
from kvpressure.agent.samplers.gpu_workers import _Backoff, _Job, _Pass, _Worker
from kvpressure.agent.samplers.gpu_xid import XID_DRAIN_MAX
from kvpressure.agent.samplers.nvml_factory import bind
from kvpressure.agent.samples import Batch, Sample, make_labels

__all__ = [
    "ANCESTOR_DEPTH",
    "COHERENT_MEMORY_PARTS",
    "COHERENT_TOTAL_SHARE",
    "DISABLED_REPROBE_S",
    "DROP_REASONS",
    "ENGINE_PIDS_MAX_AGE_S",
    "NSPID_RESCAN_S",
    "PID_MAX_LIMIT",
    "REFRESH_S",
    "REPROBE_S",
    "SLOW_INTERVAL_S",
    "UNIFIED_MEMORY_PARTS",
    "UNIFIED_TOTAL_TOLERANCE",
    "XID_DRAIN_MAX",
    "GpuSampler",
    "is_unified_total",
    "nspid_index",
]

log = logging.getLogger(__name__)

DISABLED_REPROBE_S: Final = 300.0
"""Seconds between quiet re-probes when the NVML library is missing."""
SLOW_INTERVAL_S: Final = 1.0
"""The process list, the PCIe/NVLink field values and the XID event queue are read at most
this often (seconds): the counters are cumulative, processes change slowly and NVML queues
events, so reading them at 10 Hz would only add NVML cost. Between reads the last values are
exported."""
ENGINE_PIDS_MAX_AGE_S: Final = 30.0
"""The engines' listening PIDs (``engine_pids``) are asked for again when a GPU process
appears, and at least this often (seconds) otherwise."""

NvmlState = Literal["uninit", "ok", "down", "disabled"]
"""The NVML library's state as the sampler sees it."""
EnginePids = Callable[[], dict[int, str]]
"""PID → engine name (the ``engine`` label) of the engine processes the agent knows."""
PodNames = Callable[[], dict[str, tuple[str, str, str]]]
"""Returns GPU UUID (or MIG UUID) -> ``(namespace, pod, container)`` of the one container
the kubelet assigned that device to (:func:`agent.podresources.gpu_assignments`)."""


# ---- the sampler ------------------------------------------------------------------------------
class GpuSampler(_NvmlMixin, Sampler):
    """Sample every NVIDIA GPU and MIG instance through NVML (see the module docstring).

    Args:
        binding: ``"nvml"``, ``"fake:<profile>"``, or an already built
            :class:`~agent.samplers.nvml_binding.NvmlBinding` (tests).
        interval_s: seconds between collections.
        timeout_s: the daemon's timeout for a whole collection (default ``max(interval, 2)``).
        engine_pids: PID → engine name of known engine processes, for the per-process join
            (the ``engine`` label of ``kvpressure_gpu_process_memory_bytes``).
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
    """

    name = "gpu"

    def __init__(
        self,
        binding: str | nb.NvmlBinding = "nvml",
        interval_s: float = 1.0,
        timeout_s: float | None = None,
        engine_pids: EnginePids | None = None,
        *,
        gpu_timeout_s: float | None = None,
        backoff_base_s: float = 1.0,
        backoff_cap_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
        procfs_root: str = "/proc",
        driver_version_file: str = "/proc/driver/nvidia/version",
        pod_names: PodNames | None = None,
    ) -> None:
        super().__init__(interval_s, timeout_s)
        self._nv = bind(binding) if isinstance(binding, str) else binding
        self.binding = self._nv
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
        self._state: NvmlState = "uninit"
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
        self._slow_interval = max(interval_s, SLOW_INTERVAL_S)
        self._xid_at = 0.0
        self._pids_cache: dict[int, str] | None = None
        self._pids_asked_for: frozenset[int] = frozenset()  # GPU PIDs when last asked
        self._pids_asked_at = float("-inf")
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
        self._emit_all(batch, readings, now)

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
                    batch.add_labelled("kvpressure_gpu_up", 0, lab)

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
            batch.add_labelled("kvpressure_gpu_up", 0, lab)

    # ---- emitting (main thread) --------------------------------------------------------------
    def _emit_all(self, batch: Batch, readings: dict[int, _GpuReading], now: float) -> None:
        if self._engine_pids is not None and (
            self._pids_cache is None or any(r.slow for r in readings.values())
        ):
            # The process lists change at most every SLOW_INTERVAL_S. Asking for the engines'
            # listening PIDs walks every process's fds (discovery.listening_pids): ask only when
            # a GPU process appeared (an engine (re)started) or the answer is old (an engine
            # added by discovery or a reload whose process was already on a GPU).
            gpu_pids = frozenset(
                pid
                for r in readings.values()
                for lr in r.leaves
                for pid, _used in lr.processes or ()
            )
            if (
                self._pids_cache is None
                or not gpu_pids <= self._pids_asked_for
                or now - self._pids_asked_at >= ENGINE_PIDS_MAX_AGE_S
            ):
                self._pids_asked_for, self._pids_asked_at = gpu_pids, now
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
        proc_engine: dict[int, str | None] = {}
        for reading in readings.values():
            for lr in reading.leaves:
                for pid, _used in lr.processes or ():
                    seen_pids.add(pid)
                    if pid not in proc_engine:
                        proc_engine[pid] = self._engine_of(pid, pids) if pids else None
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
            self._emit_gpu(batch, g, got, proc_engine, engine_pods)
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
        proc_engine: dict[int, str | None],
        engine_pods: set[tuple[str, str, tuple[str, str, str] | None]],
    ) -> None:
        add = batch.add_labelled
        for lr in reading.leaves:
            leaf = lr.leaf
            lab = leaf.labels
            batch.extend(self._static_samples(leaf))
            if lr.memory is not None:
                total, used, free, reserved = lr.memory
                add("kvpressure_gpu_memory_total_bytes", total, lab)
                add("kvpressure_gpu_memory_used_bytes", used, lab)
                add("kvpressure_gpu_memory_free_bytes", free, lab)
                if reserved is not None:
                    add("kvpressure_gpu_memory_reserved_bytes", reserved, lab)
            if lr.utilization is not None:
                add("kvpressure_gpu_utilization_ratio", lr.utilization, lab)
            if lr.bandwidth is not None:
                add(
                    "kvpressure_gpu_memory_bandwidth_utilization_ratio",
                    lr.bandwidth,
                    leaf.lab("source", "gpm"),
                )
            elif lr.memory_activity is not None:
                add(
                    "kvpressure_gpu_memory_bandwidth_utilization_ratio",
                    lr.memory_activity,
                    leaf.lab("source", "nvml"),
                )
            if lr.sm_occupancy is not None:
                add("kvpressure_gpu_sm_occupancy_ratio", lr.sm_occupancy, lab)
            add("kvpressure_gpu_power_watts", lr.power_w, lab)
            add("kvpressure_gpu_temperature_celsius", lr.temperature_c, lab)
            if lr.clocks is not None:
                batch.extend(leaf.clock_samples(lr.clocks))
            for pid, used in lr.processes or ():
                pod = self._pods.get(pid)
                names = self._pod_names_now.get(leaf.uuid) if pod is not None else None
                plab = leaf.process_labels(
                    pid, self._proc_names.get(pid, ""), proc_engine.get(pid), pod, names
                )
                engine = proc_engine.get(pid)
                if pod is not None and engine is not None:
                    engine_pods.add((engine, pod.pod_uid, names))
                add("kvpressure_gpu_process_memory_bytes", used, plab)
            if leaf.host_memory and lr.processes is not None:
                used_sum = math.fsum(u for _, u in lr.processes)
                add("kvpressure_gpu_memory_used_bytes", used_sum, lab)
            if leaf.unified == "true":
                add(
                    "kvpressure_gpu_unified_memory_available_bytes",
                    _meminfo(self._procfs).get("MemAvailable"),
                    lab,
                )
            # every device read carries its counters, 0 until something is dropped
            for reason in DROP_REASONS:
                add(
                    "kvpressure_gpu_values_dropped_total",
                    leaf.dropped[reason],
                    leaf.lab("reason", reason),
                )
            for name, reason in lr.unsupported:
                batch.source_unsupported(f"{leaf.source}.{name}", reason)
        for name, reason in _skips(g.leaf, ("pcie", "nvlink")) if g.leaf else ():
            batch.source_unsupported(f"gpu{g.index}.{name}", reason)
        if g.links is None:
            batch.source_unsupported(f"gpu{g.index}.nvlink", "not_supported")
        self._counters(batch, g, reading)
        xids = self._xid.get(g.index)
        if xids and g.leaf is not None:
            for xid, n in sorted(xids.items()):
                add("kvpressure_gpu_xid_errors_total", n, g.leaf.lab("xid", str(xid)))
        batch.source_ok(f"gpu{g.index}")

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

    def _counters(self, batch: Batch, g: _Gpu, reading: _GpuReading) -> float | None:
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
                Sample(_LINK_METRICS[grp], total, g.leaf.lab("direction", d))
                for (grp, d), total in sorted(g.totals.items())
                if (g.pcie_ok if grp == "pcie" else g.nvlink_ok)
            )
        batch.extend(g.counter_samples)
        return moved


# ---- helpers ------------------------------------------------------------------------------------
_LINK_METRICS: Final[dict[str, SampleName]] = {
    "pcie": catalogue.GPU_PCIE_BYTES_TOTAL,
    "nvlink": catalogue.GPU_NVLINK_BYTES_TOTAL,
}


@register("gpu", Stage.SOURCE, "every NVIDIA GPU and MIG instance through NVML")
def _plan(ctx: Context) -> list[Plan]:
    cfg = ctx.config
    interval = ctx.interval_s("gpu")
    spec = ("gpu", cfg.gpu, interval)  # GpuConfig is frozen: hashable

    def build() -> GpuSampler:
        socket = cfg.gpu.pod_resources_socket
        pod_names = None
        if socket:
            # imported only here: protobuf adds ~2 MiB of resident memory to an agent that
            # has no pod-resources socket configured (benchmarks/agent_footprint.py)
            from kvpressure.agent.podresources import make_client

            pod_names = make_client(socket)
        return GpuSampler(
            binding=cfg.gpu.binding,
            interval_s=interval,
            engine_pids=ctx.engine_pids,
            pod_names=pod_names,
        )

    return [Plan("gpu", spec, build)]
