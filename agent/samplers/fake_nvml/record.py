"""Record a GPU's NVML answers, errors included, into a fake NVML profile.

``kvpressure gpu record FILE`` runs :func:`record` on the real library and writes the result
as YAML; ``gpu.binding: fake:FILE`` then replays it through
:class:`~agent.samplers.fake_nvml.FakeNvml`, so a user's bug report becomes a test fixture.

What is recorded, per GPU (and per MIG instance), in the profile format of ``profiles/*.yaml``:

* the answers of ``nvmlDeviceGetName``, ``...GetUUID``, ``...GetArchitecture``,
  ``...GetMemoryInfo`` (v2, else v1; MiB), ``...GetUtilizationRates``, ``...GetPowerUsage``,
  ``...GetTemperature``, ``...GetCurrentClocksEventReasons`` (the bit mask),
  ``...GetComputeRunningProcesses`` and ``...GetGraphicsRunningProcesses`` (PIDs as NVML gave
  them, ``raw_pid: true``, names from ``nvmlSystemGetProcessName``), the NVLink link count
  (field ``NVML_FI_DEV_NVLINK_LINK_COUNT``) and the MIG layout;
* rates, measured by the GPU sampler itself over ``seconds`` on the same binding: GPM DRAM
  bandwidth and SM occupancy (percent), PCIe bytes/s and NVLink KiB/s per link;
* errors: ``NOT_SUPPORTED`` is ``null`` for the value (the profile convention); any other
  error code is kept under ``errors: {function: code}`` and raised again by the fake.

Nothing else is read: no environment, no command lines, no files.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

from kvpressure.agent.samplers import nvml_codes as nc
from kvpressure.agent.samplers.fake_nvml import ARCHITECTURES, MIB

if TYPE_CHECKING:
    from kvpressure.agent.samplers.nvml_binding import NvmlBinding

_ARCH_NAMES = {v: k for k, v in ARCHITECTURES.items()}


class _Recorder:
    def __init__(self, nv: NvmlBinding) -> None:
        self.nv = nv

    def ask(self, errors: dict[str, int], fn: str, call: Callable[[], Any]) -> Any:
        """``call()``; ``None`` on an NVML error (non-NOT_SUPPORTED codes go to ``errors``)."""
        try:
            return call()
        except nc.NvmlError as exc:
            if exc.kind in nc.LIBRARY_KINDS:
                raise
            if exc.kind != nc.UNSUPPORTED:
                errors[fn] = exc.code
            return None

    def device(self, h: Any, mig: bool = False) -> dict[str, Any]:
        nv = self.nv
        errors: dict[str, int] = {}
        spec: dict[str, Any] = {
            "name": str(nv.call("nvmlDeviceGetName", h)),
            "uuid": str(nv.call("nvmlDeviceGetUUID", h)),
        }
        arch = self.ask(
            errors, "nvmlDeviceGetArchitecture", lambda: nv.call("nvmlDeviceGetArchitecture", h)
        )
        spec["architecture"] = _ARCH_NAMES.get(int(arch), "unknown") if arch is not None else None
        mem = self.ask(errors, "nvmlDeviceGetMemoryInfo_v2", lambda: nv.memory_info(h))
        if mem is None:
            spec["memory_mib"] = None
        else:
            reserved = getattr(mem, "reserved", None)
            used = float(mem.used)  # v1 (no reserved): used includes reserved, kept as is
            spec["memory_mib"] = {
                "total": float(mem.total) / MIB,
                "reserved": 0.0 if reserved is None else float(reserved) / MIB,
                "used": used / MIB,
            }
        util = self.ask(
            errors,
            "nvmlDeviceGetUtilizationRates",
            lambda: nv.call("nvmlDeviceGetUtilizationRates", h),
        )
        spec["utilization"] = (
            None if util is None else {"gpu": int(util.gpu), "memory": int(util.memory)}
        )
        if not mig:
            power = self.ask(
                errors, "nvmlDeviceGetPowerUsage", lambda: nv.call("nvmlDeviceGetPowerUsage", h)
            )
            spec["power_w"] = None if power is None else float(power) / 1000.0
            temp = self.ask(errors, "nvmlDeviceGetTemperature", lambda: nv.temperature(h))
            spec["temperature_c"] = None if temp is None else int(temp)
            clocks = self.ask(
                errors, "nvmlDeviceGetCurrentClocksEventReasons", lambda: nv.clocks_event_reasons(h)
            )
            spec["clocks_event_reasons"] = None if clocks is None else int(clocks)
        spec["processes"] = self.processes(h, errors)
        spec["errors"] = errors
        return spec

    def processes(self, h: Any, errors: dict[str, int]) -> list[dict[str, Any]]:
        """Compute and graphics rows as NVML listed them (duplicates and odd PIDs kept)."""
        nv = self.nv
        rows: list[dict[str, Any]] = []
        compute = self.ask(
            errors, "nvmlDeviceGetComputeRunningProcesses", lambda: nv.compute_processes(h)
        )
        graphics = self.ask(
            errors, "nvmlDeviceGetGraphicsRunningProcesses", lambda: nv.graphics_processes(h)
        )
        for kind, listing in (("compute", compute), ("graphics", graphics)):
            for p in listing or ():
                pid = int(p.pid)
                raw = getattr(p, "usedGpuMemory", None)
                used = None if raw is None else float(raw) / MIB
                twin = next(
                    (
                        r
                        for r in rows
                        if kind == "graphics"
                        and r["type"] == "compute"
                        and (r["pid"], r["used_mib"]) == (pid, used)
                    ),
                    None,
                )
                if twin is not None:  # one process with compute and graphics contexts
                    twin["type"] = "both"
                    continue
                name = self.ask({}, "nvmlSystemGetProcessName", partial(self._name, pid))
                rows.append(
                    {
                        "pid": pid,
                        "raw_pid": True,
                        "used_mib": used,
                        "name": str(name or "").rsplit("/", 1)[-1] or "unknown",
                        "type": kind,
                    }
                )
        return rows

    def _name(self, pid: int) -> Any:
        return self.nv.call("nvmlSystemGetProcessName", pid)

    def migs(self, h: Any, spec: dict[str, Any]) -> None:
        """Add ``mig_capable`` and, on a MIG-enabled GPU, ``mig.instances`` to ``spec``."""
        nv = self.nv
        errors = spec["errors"]
        mode = self.ask(errors, "nvmlDeviceGetMigMode", lambda: nv.call("nvmlDeviceGetMigMode", h))
        spec["mig_capable"] = mode is not None
        if mode is None or int(mode[0]) != nc.NVML_DEVICE_MIG_ENABLE:
            return
        out: list[dict[str, Any]] = []
        for i in range(int(nv.call("nvmlDeviceGetMaxMigDeviceCount", h))):
            try:
                mh = nv.call("nvmlDeviceGetMigDeviceHandleByIndex", h, i)
            except nc.NvmlError as exc:
                if exc.kind in nc.LIBRARY_KINDS:
                    raise
                continue
            inst = self.device(mh, mig=True)
            inst["gi"] = int(nv.call("nvmlDeviceGetGpuInstanceId", mh))
            inst["ci"] = int(nv.call("nvmlDeviceGetComputeInstanceId", mh))
            for key in ("architecture", "utilization"):
                inst.pop(key, None)
            out.append(inst)
        spec["mig"] = {"instances": out}

    def links(self, h: Any) -> int | None:
        """NVLink link count (``NVML_FI_DEV_NVLINK_LINK_COUNT``), ``None`` when unknown."""
        try:
            fv = self.nv.call("nvmlDeviceGetFieldValues", h, [nc.NVML_FI_DEV_NVLINK_LINK_COUNT])
        except nc.NvmlError as exc:
            if exc.kind in nc.LIBRARY_KINDS:
                raise
            return None
        count = nc.field_value(fv[0])
        return None if count is None else int(count)


def _rates(
    binding: NvmlBinding, seconds: float, sleep: Callable[[float], None]
) -> dict[str, dict[str, Any]]:
    """GPM, PCIe and NVLink rates per GPU uuid, measured by the GPU sampler over ``seconds``."""
    from kvpressure.agent.samplers.gpu import SLOW_INTERVAL_S, GpuSampler
    from kvpressure.agent.samples import Batch

    sampler = GpuSampler(binding, interval_s=seconds, gpu_timeout_s=0)
    first, second = Batch(), Batch()
    try:
        sampler.collect(first)
        t0 = time.monotonic()
        sleep(max(seconds, SLOW_INTERVAL_S) + 0.05)
        sampler.collect(second)
        dt = time.monotonic() - t0
    finally:
        sampler.close()  # shuts NVML down; record() initialises it again
    before = {(s.name, s.labels): s.value for s in first.samples}
    out: dict[str, dict[str, Any]] = {}
    for s in second.samples:
        labels = dict(s.labels)
        uuid = labels.get("uuid")
        if uuid is None or labels.get("mig"):
            continue
        rates = out.setdefault(uuid, {})
        if s.name == "kvpressure_gpu_memory_bandwidth_utilization_ratio":
            if labels.get("source") == "gpm":
                rates["dram_bw_util"] = s.value * 100
        elif s.name == "kvpressure_gpu_sm_occupancy_ratio":
            rates["sm_occupancy"] = s.value * 100
        elif s.name in ("kvpressure_gpu_pcie_bytes_total", "kvpressure_gpu_nvlink_bytes_total"):
            grp = "pcie" if "pcie" in s.name else "nvlink"
            delta = s.value - before.get((s.name, s.labels), 0.0)
            rates.setdefault(grp, {})[labels.get("direction", "")] = max(delta, 0.0) / dt
    return out


def record(
    binding: NvmlBinding,
    seconds: float = 1.0,
    sleep: Callable[[float], None] = time.sleep,
) -> dict[str, Any]:
    """Ask NVML everything the GPU sampler uses and return it as a fake NVML profile.

    Args:
        binding: the NVML binding to record (``nvml_factory.bind("nvml")`` for the real GPU; a fake
            binding records what the fake answers, for tests).
        seconds: how long the rates (GPM, PCIe, NVLink) are measured.
        sleep: waits ``seconds`` (tests pass a fake).

    Returns:
        A profile mapping (``gpus``, ``device`` for GPU 0, ``overrides`` for the others;
        units and ``null`` = NOT_SUPPORTED as in ``profiles/*.yaml``), loadable with
        :func:`agent.samplers.fake_nvml.load_profile` once written as YAML.

    Raises:
        nc.NvmlError: the library could not be initialised or answered with a library
            error (driver not loaded, version mismatch).
    """
    rates = _rates(binding, seconds, sleep)
    binding.init()
    rec = _Recorder(binding)
    versions = {
        key: rec.ask({}, fn, partial(binding.call, fn))
        for key, fn in (
            ("driver_version", "nvmlSystemGetDriverVersion"),
            ("nvml_version", "nvmlSystemGetNVMLVersion"),
        )
    }
    count = int(binding.call("nvmlDeviceGetCount"))
    devices: list[dict[str, Any]] = []
    for i in range(count):
        h = binding.call("nvmlDeviceGetHandleByIndex", i)
        spec = rec.device(h)
        r = rates.get(spec["uuid"], {})
        gpm = {k: r[k] for k in ("dram_bw_util", "sm_occupancy") if k in r}
        spec["gpm"] = gpm or None
        pcie = r.get("pcie")
        spec["pcie"] = (
            None if not pcie else {f"{d}_bytes_per_s": pcie.get(d, 0.0) for d in ("tx", "rx")}
        )
        links = rec.links(h)
        nvl = r.get("nvlink") or {}
        spec["nvlink"] = (
            None
            if links is None
            else {
                "links": links,
                **{
                    f"{d}_kib_per_s_per_link": nvl.get(d, 0.0) / 1024 / links if links else 0.0
                    for d in ("tx", "rx")
                },
            }
        )
        rec.migs(h, spec)
        mem = spec.get("memory_mib")
        if spec.get("mig") and mem:
            # the fake adds its instances' used memory to the parent's, as NVML reports it
            inst = sum(
                (m.get("memory_mib") or {}).get("used", 0.0) for m in spec["mig"]["instances"]
            )
            mem["used"] = max(mem["used"] - inst, 0.0)
        devices.append(spec)
    binding.shutdown()
    return {
        "profile": "recorded",
        **{k: str(v) for k, v in versions.items() if v is not None},
        "gpus": count,
        "device": devices[0] if devices else {},
        "overrides": {i: d for i, d in enumerate(devices) if i},
    }
