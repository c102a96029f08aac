"""NVML reading of the GPU sampler: discovery (identity, MIG layout, links), one GPU's reads.

Every call goes through :mod:`agent.samplers.nvml_binding`; a field NVML does not support is
absent and re-probed every :data:`~agent.samplers.gpu_devices.REPROBE_S`; impossible values are
dropped and counted. Runs on the sampler's worker threads. Moved verbatim out of ``gpu.py``
(see its module docstring for the table of NVML sources).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable
from typing import Any

from kvpressure.agent.kube import pod_of_pid
from kvpressure.agent.samplers import nvml_binding as nb
from kvpressure.agent.samplers.gpu_devices import (
    PID_MAX_LIMIT,
    REFRESH_S,
    REPROBE_S,
    UNIFIED_MEMORY_PARTS,
    _Gpu,
    _GpuReading,
    _Leaf,
    _LeafReading,
    _ratio,
    _skips,
    is_unified_total,
)
from kvpressure.agent.samplers.gpu_procs import _meminfo
from kvpressure.agent.samplers.gpu_xid import _XidMixin

log = logging.getLogger("kvpressure.agent.samplers.gpu")


class _NvmlMixin(_XidMixin):
    """NVML reads of :class:`~agent.samplers.gpu.GpuSampler`."""

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
