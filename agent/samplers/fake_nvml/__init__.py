"""A recorded-behaviour fake of ``pynvml`` for tests, demos and benchmarks without a GPU.

:class:`FakeNvml` has the same function names, argument order, return shapes (objects with the
same attributes as pynvml's structs) and error classes as nvidia-ml-py: a failing call raises
``pynvml.NVMLError(code)``, i.e. the real ``NVMLError_NotSupported``, ``NVMLError_GpuIsLost``,
... subclasses, so :mod:`agent.samplers.nvml_binding` classifies fake and real errors with the
same code. It shares only :mod:`agent.samplers.nvml_codes` with the real binding (neither imports
the other; :func:`agent.samplers.nvml_factory.bind` wraps it in a binding for ``fake:`` specs).
It implements only the functions the GPU sampler uses.

Profiles are YAML files in ``profiles/`` (package data), one per simulated machine, each with
provenance notes saying where its values come from. Select one with ``gpu.binding:
fake:<profile>``, or a profile file with ``fake:/path/profile.yaml`` (``kvpressure gpu
record FILE`` writes one from a real GPU's NVML answers, errors included). Available:
``h100-sxm`` (8 GPUs), ``h200``, ``a100-80gb-mig`` (two MIG 3g.40gb
instances, case 07), ``gb10`` (memory unsupported, case 01), ``lost-after-n`` (case 05) and
``driver-mismatch-heals`` (case 06).

Tests script the fake between collections with :meth:`FakeNvml.set` (utilization, bandwidth,
SM occupancy, clock event reasons, memory, link rates, processes, a hang, loss),
:meth:`FakeNvml.inject_xid` and :meth:`FakeNvml.break_driver`. Cumulative PCIe/NVLink counters
integrate the configured rates over the fake's ``clock``, which tests share with the sampler.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from kvpressure.agent.samplers import nvml_codes as nc

MIB = 1024 * 1024
"""Bytes per MiB (nvidia-smi and the profiles count memory in MiB)."""

NO_ID = 0xFFFFFFFF
"""``gpuInstanceId``/``computeInstanceId`` NVML reports for a whole (non-MIG) GPU."""

ARCHITECTURES = {"ampere": 7, "ada": 8, "hopper": 9, "blackwell": 10}
"""``nvmlDeviceGetArchitecture`` values (``NVML_DEVICE_ARCH_*``)."""

_REASON_BITS = dict(nc.CLOCK_EVENT_REASONS)


def _err(code: int) -> Exception:
    return nc.make_error(code)


def list_profiles() -> list[str]:
    """Return the names of the bundled profiles (``fake:<name>``)."""
    root = resources.files(__name__).joinpath("profiles")
    return sorted(p.name.removesuffix(".yaml") for p in root.iterdir() if p.name.endswith(".yaml"))


def is_profile_path(name: str) -> bool:
    """True when ``name`` names a profile file rather than a bundled profile.

    A name with a ``/`` or ending in ``.yaml``/``.yml`` is a path (``fake:/tmp/gpu.yaml``,
    ``fake:./gpu.yaml``); anything else is a bundled profile's name.
    """
    return "/" in name or name.endswith((".yaml", ".yml"))


def load_profile(name: str) -> dict[str, Any]:
    """Load a profile: bundled ``profiles/<name>.yaml``, or the file at path ``name``.

    Args:
        name: a bundled profile's name (``h200``) or a profile file's path
            (:func:`is_profile_path`), e.g. one ``kvpressure gpu record`` wrote.

    Raises:
        FileNotFoundError: no such profile (the message lists the bundled ones) or file.
        ValueError: the file is not a YAML mapping.
        yaml.YAMLError: the file is not YAML.
    """
    if is_profile_path(name):
        text = Path(name).expanduser().read_text(encoding="utf-8")
    else:
        path = resources.files(__name__).joinpath("profiles", f"{name}.yaml")
        if not path.is_file():
            raise FileNotFoundError(
                f"no fake NVML profile {name!r}; available: {', '.join(list_profiles())} "
                "(or a profile file's path)"
            )
        text = path.read_text(encoding="utf-8")
    data = yaml.safe_load(text)
    if not isinstance(data, dict):
        raise ValueError(f"fake NVML profile {name!r} is not a mapping")
    return data


# ---- struct-like return values --------------------------------------------------------------
class Struct:
    """A plain object with the attributes of a pynvml struct (``c_nvmlMemory_v2_t`` ...)."""

    def __init__(self, **attrs: Any) -> None:
        self.__dict__.update(attrs)

    def __repr__(self) -> str:
        return f"Struct({self.__dict__!r})"


class FakeValue:
    """The ``c_nvmlValue_t`` union: every member holds the same number."""

    def __init__(self, v: float) -> None:
        self.dVal = float(v)
        iv = int(v)
        self.uiVal = iv & 0xFFFFFFFF
        self.ulVal = iv & 0xFFFFFFFFFFFFFFFF
        self.ullVal = iv & 0xFFFFFFFFFFFFFFFF
        self.sllVal = iv
        self.siVal = iv
        self.usVal = iv & 0xFFFF


class FakeGpmMetric:
    """``c_nvmlGpmMetric_t``: ``metricId``, ``nvmlReturn``, ``value`` (percent for ours)."""

    def __init__(self) -> None:
        self.metricId = 0
        self.nvmlReturn = nc.NVML_SUCCESS
        self.value = 0.0
        self.metricInfo = Struct(shortName=None, longName=None, unit=None)


class FakeGpmMetricsGet:
    """pynvml's ``c_nvmlGpmMetricsGet_t``: version, numMetrics, sample1, sample2, metrics.

    pynvml sizes ``metrics`` to ``NVML_GPM_METRIC_MAX``; the fake keeps 16 slots, more than the
    sampler asks for.
    """

    def __init__(self) -> None:
        self.version = 0
        self.numMetrics = 0
        self.sample1: FakeGpmSample | None = None
        self.sample2: FakeGpmSample | None = None
        self.metrics = [FakeGpmMetric() for _ in range(16)]


@dataclass
class FakeGpmSample:
    """An opaque GPM sample (``nvmlGpmSampleAlloc``); holds what the device showed when taken."""

    taken: bool = False
    values: dict[int, float] = field(default_factory=dict)


class _EventSet:
    def __init__(self) -> None:
        self.devices: set[int] = set()
        self.queue: deque[Struct] = deque()
        self.cond = threading.Condition()


# ---- devices --------------------------------------------------------------------------------
class _Rate:
    """A cumulative counter that grows at ``rate`` per second of the fake clock."""

    def __init__(self, rate: float, now: float) -> None:
        self.value = 0.0
        self.rate = rate
        self.t = now

    def read(self, now: float) -> float:
        self.value += self.rate * max(0.0, now - self.t)
        self.t = now
        return self.value

    def set_rate(self, rate: float, now: float) -> None:
        self.read(now)
        self.rate = rate


@dataclass
class FakeDevice:
    """One simulated GPU or MIG instance; returned as the opaque device handle.

    Values are in NVML's units: bytes, percent (0-100), milliwatts, °C. ``None`` for a value
    means the matching NVML call answers ``NVML_ERROR_NOT_SUPPORTED``.
    """

    index: int
    name: str
    uuid: str
    architecture: int = 9
    memory_total: int | None = None
    memory_reserved: int = 0
    memory_used: int = 0
    util_gpu: int | None = 0
    util_memory: int | None = 0
    power_mw: int | None = None
    temperature_c: int | None = None
    clock_reasons: int | None = 0
    gpm: dict[int, float] | None = None
    pcie: dict[str, _Rate] | None = None
    nvlink_links: int | None = 0
    nvlink: dict[str, list[_Rate]] = field(default_factory=dict)
    xid_events: bool = True
    processes: list[tuple[int, int | None, str]] = field(default_factory=list)
    graphics_processes: list[tuple[int, int | None, str]] = field(default_factory=list)
    not_supported: set[str] = field(default_factory=set)
    errors: dict[str, int] = field(default_factory=dict)
    mig_capable: bool = False
    mig_max: int = 7
    migs: list[FakeDevice] = field(default_factory=list)
    parent: FakeDevice | None = None
    gi: int = NO_ID
    ci: int = NO_ID
    # faults
    lost: bool = False
    lost_after_calls: int | None = None
    recover_after_calls: int | None = None
    failing_calls: int = 0
    calls: int = 0
    hang_s: float = 0.0

    def __hash__(self) -> int:
        return id(self)

    def __eq__(self, other: object) -> bool:
        return self is other

    @property
    def mig_enabled(self) -> bool:
        """True when the device is a MIG-enabled parent."""
        return bool(self.migs)


def _mib(value: Any) -> int | None:
    return None if value is None else round(float(value) * MIB)


def _reason_mask(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, int):
        return value
    mask = 0
    for name in value:
        mask |= _REASON_BITS[str(name)]
    return mask


def _merge(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), Mapping):
            out[k] = _merge(out[k], v)
        else:
            out[k] = v
    return out


class FakeNvml:
    """The fake ``pynvml`` module for one simulated machine.

    Args:
        profile: a parsed profile (see ``profiles/*.yaml``).
        clock: seconds, monotonic; drives the cumulative PCIe/NVLink counters. Tests pass the
            same clock to the sampler.
        gpus: override the profile's GPU count (replicating its device template).
        lost_gpu, lost_after_calls, recover_after_calls: override ``faults.lost``.
        init_failures, init_failure_code: override ``faults.init_failures``.

    Attributes:
        calls: how many times each NVML function was called (tests check batching with it).
        init_attempts: ``nvmlInit`` calls so far.
    """

    c_nvmlGpmMetricsGet_t = FakeGpmMetricsGet

    def __init__(
        self,
        profile: Mapping[str, Any],
        *,
        clock: Callable[[], float] = time.monotonic,
        gpus: int | None = None,
        lost_gpu: int | None = None,
        lost_after_calls: int | None = None,
        recover_after_calls: int | None = None,
        init_failures: int | None = None,
        init_failure_code: int | None = None,
    ) -> None:
        self.profile_name = str(profile.get("profile", "custom"))
        self.clock = clock
        self.calls: Counter[str] = Counter()
        self.init_attempts = 0
        self._lock = threading.RLock()
        self._initialized = 0
        self._driver_version = str(profile.get("driver_version", "550.90.12"))
        self._nvml_version = str(profile.get("nvml_version", f"12.{self._driver_version}"))
        self._names: dict[int, str] = {}
        self._event_sets: list[_EventSet] = []
        faults = dict(profile.get("faults") or {})
        init = dict(faults.get("init_failures") or {})
        self._init_failures = int(
            init_failures if init_failures is not None else init.get("attempts", 0)
        )
        self._init_code = int(
            init_failure_code
            if init_failure_code is not None
            else init.get("code", nc.NVML_ERROR_LIB_RM_VERSION_MISMATCH)
        )
        self._broken_code: int | None = None
        count = int(gpus if gpus is not None else profile.get("gpus", 1))
        template = dict(profile.get("device") or {})
        overrides = {int(k): v for k, v in dict(profile.get("overrides") or {}).items()}
        now = clock()
        self.devices: list[FakeDevice] = [
            self._build(i, _merge(template, overrides.get(i, {})), now) for i in range(count)
        ]
        lost = dict(faults.get("lost") or {})
        gpu = lost_gpu if lost_gpu is not None else lost.get("gpu")
        if gpu is not None:
            dev = self.devices[int(gpu)]
            dev.lost_after_calls = int(
                lost_after_calls if lost_after_calls is not None else lost.get("after_calls", 10)
            )
            dev.recover_after_calls = (
                int(recover_after_calls)
                if recover_after_calls is not None
                else (
                    None
                    if lost.get("recover_after_calls") is None
                    else int(lost["recover_after_calls"])
                )
            )

    @classmethod
    def from_profile(cls, name: str, **options: Any) -> FakeNvml:
        """Build the fake from the bundled profile ``name`` (see :func:`load_profile`)."""
        return cls(load_profile(name), **options)

    # ---- building ------------------------------------------------------------------------
    def _build(self, index: int, spec: Mapping[str, Any], now: float) -> FakeDevice:
        def fmt(v: Any) -> str:
            return str(v).format(index=index)

        mem = spec.get("memory_mib")
        util = spec.get("utilization")
        gpm = spec.get("gpm")
        pcie = spec.get("pcie")
        nvl = spec.get("nvlink")
        dev = FakeDevice(
            index=index,
            name=fmt(spec.get("name", "NVIDIA Fake GPU")),
            uuid=fmt(spec.get("uuid", "GPU-fa4e0000-0000-4000-8000-{index:012d}")),
            architecture=ARCHITECTURES.get(str(spec.get("architecture", "hopper")), 0xFFFFFFFF),
            memory_total=_mib(mem.get("total")) if mem else None,
            memory_reserved=(_mib(mem.get("reserved", 0)) or 0) if mem else 0,
            memory_used=(_mib(mem.get("used", 0)) or 0) if mem else 0,
            util_gpu=None if util is None else util.get("gpu"),
            util_memory=None if util is None else util.get("memory"),
            power_mw=None if spec.get("power_w") is None else round(float(spec["power_w"]) * 1000),
            temperature_c=spec.get("temperature_c"),
            clock_reasons=_reason_mask(spec.get("clocks_event_reasons", [])),
            gpm=None
            if gpm is None
            else {
                nc.NVML_GPM_METRIC_DRAM_BW_UTIL: float(gpm.get("dram_bw_util", 0.0)),
                nc.NVML_GPM_METRIC_SM_OCCUPANCY: float(gpm.get("sm_occupancy", 0.0)),
            },
            pcie=None
            if pcie is None
            else {
                "tx": _Rate(float(pcie.get("tx_bytes_per_s", 0)), now),
                "rx": _Rate(float(pcie.get("rx_bytes_per_s", 0)), now),
            },
            nvlink_links=None if nvl is None else int(nvl.get("links", 0)),
            xid_events=bool(spec.get("xid_events", True)),
            not_supported=set(spec.get("not_supported") or ()),
            errors={str(k): int(v) for k, v in dict(spec.get("errors") or {}).items()},
            mig_capable=bool(spec.get("mig_capable", False)),
        )
        if nvl and dev.nvlink_links:
            dev.nvlink = {
                d: [
                    _Rate(float(nvl.get(f"{d}_kib_per_s_per_link", 0)), now)
                    for _ in range(dev.nvlink_links)
                ]
                for d in ("tx", "rx")
            }
        dev.processes, dev.graphics_processes = self._processes(spec, index)
        mig = spec.get("mig")
        if mig:
            dev.mig_capable = True
            for j, inst in enumerate(mig.get("instances") or ()):
                imem = inst.get("memory_mib") or {}
                child = FakeDevice(
                    index=index,
                    name=fmt(inst.get("name", f"{dev.name} MIG")),
                    uuid=fmt(inst.get("uuid", f"MIG-fa4e0000-0000-4000-8000-{index:06d}{j:06d}")),
                    architecture=dev.architecture,
                    memory_total=_mib(imem.get("total")),
                    memory_reserved=_mib(imem.get("reserved", 0)) or 0,
                    memory_used=_mib(imem.get("used", 0)) or 0,
                    util_gpu=None,
                    util_memory=None,
                    clock_reasons=None,
                    gpm=None
                    if dev.gpm is None
                    else {
                        k: float((inst.get("gpm") or {}).get(n, 0.0))
                        for k, n in (
                            (nc.NVML_GPM_METRIC_DRAM_BW_UTIL, "dram_bw_util"),
                            (nc.NVML_GPM_METRIC_SM_OCCUPANCY, "sm_occupancy"),
                        )
                    },
                    pcie=None,
                    nvlink_links=None,
                    xid_events=False,
                    parent=dev,
                    gi=int(inst["gi"]),
                    ci=int(inst.get("ci", 0)),
                )
                child.processes, child.graphics_processes = self._processes(inst, index)
                dev.migs.append(child)
        return dev

    def _processes(
        self, spec: Mapping[str, Any], index: int
    ) -> tuple[list[tuple[int, int | None, str]], list[tuple[int, int | None, str]]]:
        """The compute and graphics process rows of a device spec.

        A row's ``type`` is ``compute`` (default), ``graphics`` or ``both`` (listed by both
        NVML calls, as a process with both contexts is). ``pid`` is offset by the GPU index
        unless ``raw_pid: true`` (for recorded values such as PID 4294967295).
        """
        compute: list[tuple[int, int | None, str]] = []
        graphics: list[tuple[int, int | None, str]] = []
        for p in spec.get("processes") or ():
            pid = int(p["pid"]) + (0 if p.get("raw_pid") else index)
            row = (pid, _mib(p.get("used_mib")), str(p.get("name", "python3")))
            kind = str(p.get("type", "compute"))
            if kind in ("compute", "both"):
                compute.append(row)
            if kind in ("graphics", "both"):
                graphics.append(row)
            self._names[pid] = row[2]
        return compute, graphics

    # ---- scripting (tests) ---------------------------------------------------------------
    def set(self, index: int, mig: int | None = None, **values: Any) -> None:
        """Change what GPU ``index`` (or its MIG instance with GPU instance id ``mig``) reports.

        Args:
            index: GPU index.
            mig: GPU instance id of a MIG instance of that GPU, or ``None`` for the GPU.
            **values: any of ``utilization_gpu``/``utilization_memory`` (percent, ``None`` =
                unsupported), ``dram_bw_util``/``sm_occupancy`` (GPM percent),
                ``clocks_event_reasons`` (bitmask or reason names), ``memory_used`` (bytes),
                ``power_w``, ``temperature_c``, ``pcie_tx_bytes_per_s``,
                ``pcie_rx_bytes_per_s``, ``nvlink_tx_kib_per_s_per_link``,
                ``nvlink_rx_kib_per_s_per_link``, ``processes`` (``(pid, bytes[, name])``
                tuples, compute), ``graphics_processes`` (the same, graphics),
                ``memory_total`` (bytes), ``hang_s`` (each call sleeps this long), ``lost`` (bool).

        Raises:
            KeyError: an unknown value name.
        """
        with self._lock:
            dev = self.devices[index]
            if mig is not None:
                dev = next(m for m in dev.migs if m.gi == mig)
            now = self.clock()
            for key, v in values.items():
                self._set_one(dev, key, v, now)

    def _set_one(self, dev: FakeDevice, key: str, v: Any, now: float) -> None:
        if key == "utilization_gpu":
            dev.util_gpu = v
        elif key == "utilization_memory":
            dev.util_memory = v
        elif key in ("dram_bw_util", "sm_occupancy"):
            if dev.gpm is None:
                raise KeyError(f"{dev.name} has no GPM in this profile")
            metric = (
                nc.NVML_GPM_METRIC_DRAM_BW_UTIL
                if key == "dram_bw_util"
                else nc.NVML_GPM_METRIC_SM_OCCUPANCY
            )
            dev.gpm[metric] = float(v)
        elif key == "clocks_event_reasons":
            dev.clock_reasons = _reason_mask(v)
        elif key == "memory_used":
            dev.memory_used = int(v)
        elif key == "power_w":
            dev.power_mw = None if v is None else round(float(v) * 1000)
        elif key == "temperature_c":
            dev.temperature_c = v
        elif key.startswith("pcie_") and dev.pcie is not None:
            dev.pcie[key.split("_")[1]].set_rate(float(v), now)
        elif key.startswith("nvlink_") and dev.nvlink:
            for r in dev.nvlink[key.split("_")[1]]:
                r.set_rate(float(v), now)
        elif key in ("processes", "graphics_processes"):
            rows: list[tuple[int, int | None, str]] = []
            for p in v:
                pid, used = int(p[0]), (None if p[1] is None else int(p[1]))
                name = str(p[2]) if len(p) > 2 else "python3"
                rows.append((pid, used, name))
                self._names[pid] = name
            setattr(dev, key, rows)
        elif key == "memory_total":
            dev.memory_total = None if v is None else int(v)
        elif key == "hang_s":
            dev.hang_s = float(v)
        elif key == "lost":
            dev.lost = bool(v)
            dev.failing_calls = 0
        else:
            raise KeyError(key)

    def inject_xid(self, index: int, xid: int) -> None:
        """Deliver an XID event (``nvmlEventTypeXidCriticalError``) for GPU ``index``."""
        dev = self.devices[index]
        data = Struct(
            device=dev,
            eventType=nc.nvmlEventTypeXidCriticalError,
            eventData=int(xid),
            gpuInstanceId=NO_ID,
            computeInstanceId=NO_ID,
        )
        for es in list(self._event_sets):
            if id(dev) in es.devices:
                with es.cond:
                    es.queue.append(data)
                    es.cond.notify_all()

    def break_driver(
        self, code: int = nc.NVML_ERROR_LIB_RM_VERSION_MISMATCH, init_failures: int = 2
    ) -> None:
        """Simulate a driver upgrade or reload under a running agent (case 06).

        Every later call raises ``code`` until the library is initialised again, and the next
        ``init_failures`` ``nvmlInit`` attempts raise ``code`` too; then it heals.
        """
        with self._lock:
            self._broken_code = code
            self._init_failures = self.init_attempts + init_failures

    # ---- plumbing ------------------------------------------------------------------------
    def _enter(self, fn: str) -> None:
        self.calls[fn] += 1
        if self._broken_code is not None:
            raise _err(self._broken_code)
        if not self._initialized:
            raise _err(nc.NVML_ERROR_UNINITIALIZED)

    def _dev(self, fn: str, handle: Any) -> FakeDevice:
        """Account a device call and apply faults; returns the device or raises."""
        self._enter(fn)
        if not isinstance(handle, FakeDevice):
            raise _err(nc.NVML_ERROR_INVALID_ARGUMENT)
        root = handle.parent or handle
        with self._lock:
            root.calls += 1
            if (
                root.lost_after_calls is not None
                and root.calls > root.lost_after_calls
                and not root.lost
            ):
                root.lost = True
                root.lost_after_calls = None
                root.failing_calls = 0
                self.inject_xid(root.index, 79)  # "GPU has fallen off the bus"
            if root.lost:
                root.failing_calls += 1
                if (
                    root.recover_after_calls is not None
                    and root.failing_calls > root.recover_after_calls
                ):
                    root.lost = False
                    root.recover_after_calls = None
                else:
                    raise _err(nc.NVML_ERROR_GPU_IS_LOST)
            hang = root.hang_s
        if hang:
            time.sleep(hang)
        if fn in handle.not_supported:
            raise _err(nc.NVML_ERROR_NOT_SUPPORTED)
        code = handle.errors.get(fn)
        if code is not None:
            raise _err(code)  # a recorded answer such as NO_PERMISSION
        return handle

    def _lookup(self, fn: str, dev: FakeDevice) -> FakeDevice:
        """A handle lookup: a lost GPU answers ``Unknown Error``; the attempt counts."""
        if dev.lost:
            try:
                self._dev(fn, dev)
            except nc.NVML_EXCEPTIONS:
                raise _err(nc.NVML_ERROR_UNKNOWN) from None
        return dev

    # ---- library -------------------------------------------------------------------------
    def nvmlInit(self) -> None:
        """``nvmlInit``; fails with the configured code for the first attempts."""
        with self._lock:
            self.calls["nvmlInit"] += 1
            self.init_attempts += 1
            if self.init_attempts <= self._init_failures:
                raise _err(self._init_code)
            self._broken_code = None
            self._initialized += 1

    def nvmlShutdown(self) -> None:
        """``nvmlShutdown``."""
        with self._lock:
            self.calls["nvmlShutdown"] += 1
            if not self._initialized:
                raise _err(nc.NVML_ERROR_UNINITIALIZED)
            self._initialized -= 1

    def nvmlSystemGetDriverVersion(self) -> str:
        """``nvmlSystemGetDriverVersion``, e.g. ``"550.90.12"``."""
        self._enter("nvmlSystemGetDriverVersion")
        return self._driver_version

    def nvmlSystemGetNVMLVersion(self) -> str:
        """``nvmlSystemGetNVMLVersion``, e.g. ``"12.550.90.12"``."""
        self._enter("nvmlSystemGetNVMLVersion")
        return self._nvml_version

    def nvmlSystemGetProcessName(self, pid: int) -> str:
        """``nvmlSystemGetProcessName``; NOT_FOUND for unknown PIDs."""
        self._enter("nvmlSystemGetProcessName")
        name = self._names.get(int(pid))
        if name is None:
            raise _err(nc.NVML_ERROR_NOT_FOUND)
        return name

    # ---- device discovery ----------------------------------------------------------------
    def nvmlDeviceGetCount(self) -> int:
        """``nvmlDeviceGetCount`` (``_v2``)."""
        self._enter("nvmlDeviceGetCount")
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeDevice:
        """``nvmlDeviceGetHandleByIndex``; a lost GPU answers ``Unknown Error`` (case 05)."""
        self._enter("nvmlDeviceGetHandleByIndex")
        if not 0 <= index < len(self.devices):
            raise _err(nc.NVML_ERROR_INVALID_ARGUMENT)
        return self._lookup("nvmlDeviceGetHandleByIndex", self.devices[index])

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> FakeDevice:
        """``nvmlDeviceGetHandleByUUID``; NOT_FOUND for unknown UUIDs."""
        self._enter("nvmlDeviceGetHandleByUUID")
        for dev in self.devices:
            if dev.uuid == uuid:
                return self._lookup("nvmlDeviceGetHandleByUUID", dev)
            for m in dev.migs:
                if m.uuid == uuid:
                    return m
        raise _err(nc.NVML_ERROR_NOT_FOUND)

    def nvmlDeviceGetIndex(self, handle: Any) -> int:
        """``nvmlDeviceGetIndex``."""
        return self._dev("nvmlDeviceGetIndex", handle).index

    def nvmlDeviceGetName(self, handle: Any) -> str:
        """``nvmlDeviceGetName``, e.g. ``"NVIDIA H200"``."""
        return self._dev("nvmlDeviceGetName", handle).name

    def nvmlDeviceGetUUID(self, handle: Any) -> str:
        """``nvmlDeviceGetUUID`` (``GPU-...`` or ``MIG-...``)."""
        return self._dev("nvmlDeviceGetUUID", handle).uuid

    def nvmlDeviceGetArchitecture(self, handle: Any) -> int:
        """``nvmlDeviceGetArchitecture`` (``NVML_DEVICE_ARCH_*``)."""
        return self._dev("nvmlDeviceGetArchitecture", handle).architecture

    # ---- readings ------------------------------------------------------------------------
    def nvmlDeviceGetMemoryInfo(self, handle: Any, version: int | None = None) -> Struct:
        """``nvmlDeviceGetMemoryInfo``; with ``version=nvmlMemory_v2`` the v2 struct.

        v2: ``used`` excludes ``reserved`` and ``free = total - reserved - used``; v1: ``used``
        includes reserved (NVML API reference, ``nvmlMemory_t``).
        """
        fn = "nvmlDeviceGetMemoryInfo_v2" if version else "nvmlDeviceGetMemoryInfo"
        dev = self._dev(fn, handle)
        if dev.memory_total is None:
            raise _err(nc.NVML_ERROR_NOT_SUPPORTED)
        if dev.mig_enabled:
            used = sum(m.memory_used for m in dev.migs) + dev.memory_used
        else:
            used = dev.memory_used
        free = max(0, dev.memory_total - dev.memory_reserved - used)
        if version:
            if version != nc.nvmlMemory_v2:
                raise _err(nc.NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
            return Struct(
                version=version,
                total=dev.memory_total,
                reserved=dev.memory_reserved,
                free=free,
                used=used,
            )
        return Struct(total=dev.memory_total, free=free, used=used + dev.memory_reserved)

    def nvmlDeviceGetUtilizationRates(self, handle: Any) -> Struct:
        """``nvmlDeviceGetUtilizationRates``: ``gpu`` and ``memory`` in percent.

        NOT_SUPPORTED on MIG instances and on MIG-enabled GPUs (case 07).
        """
        dev = self._dev("nvmlDeviceGetUtilizationRates", handle)
        if dev.parent is not None or dev.mig_enabled or dev.util_gpu is None:
            raise _err(nc.NVML_ERROR_NOT_SUPPORTED)
        return Struct(gpu=int(dev.util_gpu), memory=int(dev.util_memory or 0))

    def nvmlDeviceGetPowerUsage(self, handle: Any) -> int:
        """``nvmlDeviceGetPowerUsage`` in milliwatts."""
        dev = self._dev("nvmlDeviceGetPowerUsage", handle)
        if dev.parent is not None or dev.power_mw is None:
            raise _err(nc.NVML_ERROR_NOT_SUPPORTED)
        return dev.power_mw

    def nvmlDeviceGetTemperature(self, handle: Any, sensor: int) -> int:
        """``nvmlDeviceGetTemperature(handle, NVML_TEMPERATURE_GPU)`` in °C."""
        dev = self._dev("nvmlDeviceGetTemperature", handle)
        if sensor != nc.NVML_TEMPERATURE_GPU:
            raise _err(nc.NVML_ERROR_INVALID_ARGUMENT)
        if dev.parent is not None or dev.temperature_c is None:
            raise _err(nc.NVML_ERROR_NOT_SUPPORTED)
        return int(dev.temperature_c)

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: Any) -> int:
        """``nvmlDeviceGetCurrentClocksEventReasons`` bitmask."""
        return self._clocks("nvmlDeviceGetCurrentClocksEventReasons", handle)

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle: Any) -> int:
        """Deprecated ``nvmlDeviceGetCurrentClocksThrottleReasons`` (same bits)."""
        return self._clocks("nvmlDeviceGetCurrentClocksThrottleReasons", handle)

    def _clocks(self, fn: str, handle: Any) -> int:
        dev = self._dev(fn, handle)
        if dev.parent is not None or dev.clock_reasons is None:
            raise _err(nc.NVML_ERROR_NOT_SUPPORTED)
        return dev.clock_reasons

    def nvmlDeviceGetComputeRunningProcesses(self, handle: Any) -> list[Struct]:
        """``nvmlDeviceGetComputeRunningProcesses`` (v3): ``pid``, ``usedGpuMemory`` (bytes)."""
        dev = self._dev("nvmlDeviceGetComputeRunningProcesses", handle)
        procs: list[Struct] = []
        children = dev.migs if dev.mig_enabled else [dev]
        for d in children:
            for pid, used, _name in d.processes:
                procs.append(
                    Struct(pid=pid, usedGpuMemory=used, gpuInstanceId=d.gi, computeInstanceId=d.ci)
                )
        return procs

    def nvmlDeviceGetGraphicsRunningProcesses(self, handle: Any) -> list[Struct]:
        """``nvmlDeviceGetGraphicsRunningProcesses`` (v3): same shape as the compute list."""
        dev = self._dev("nvmlDeviceGetGraphicsRunningProcesses", handle)
        procs: list[Struct] = []
        children = dev.migs if dev.mig_enabled else [dev]
        for d in children:
            for pid, used, _name in d.graphics_processes:
                procs.append(
                    Struct(pid=pid, usedGpuMemory=used, gpuInstanceId=d.gi, computeInstanceId=d.ci)
                )
        return procs

    def nvmlDeviceGetFieldValues(self, handle: Any, fieldIds: Iterable[Any]) -> list[Struct]:
        """``nvmlDeviceGetFieldValues``: ``fieldIds`` are ids or ``(id, scopeId)`` pairs.

        Supports ``NVML_FI_DEV_PCIE_COUNT_{TX,RX}_BYTES`` (bytes),
        ``NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_{TX,RX}`` per link (KiB) and
        ``NVML_FI_DEV_NVLINK_LINK_COUNT``; others answer NOT_SUPPORTED in ``nvmlReturn``.
        """
        dev = self._dev("nvmlDeviceGetFieldValues", handle)
        now = self.clock()
        out: list[Struct] = []
        for fid in fieldIds:
            fid_, scope = fid if isinstance(fid, tuple) else (fid, 0)
            ret, vtype, value = (
                nc.NVML_ERROR_NOT_SUPPORTED,
                nc.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG,
                0.0,
            )
            with self._lock:
                if fid_ in (nc.NVML_FI_DEV_PCIE_COUNT_TX_BYTES, nc.NVML_FI_DEV_PCIE_COUNT_RX_BYTES):
                    if dev.pcie is not None and dev.parent is None:
                        d = "tx" if fid_ == nc.NVML_FI_DEV_PCIE_COUNT_TX_BYTES else "rx"
                        ret, value = nc.NVML_SUCCESS, dev.pcie[d].read(now)
                elif fid_ == nc.NVML_FI_DEV_NVLINK_LINK_COUNT:
                    if dev.nvlink_links is not None and dev.parent is None:
                        ret, vtype, value = (
                            nc.NVML_SUCCESS,
                            nc.NVML_VALUE_TYPE_UNSIGNED_INT,
                            float(dev.nvlink_links),
                        )
                elif fid_ in (
                    nc.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX,
                    nc.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX,
                ):
                    d = "tx" if fid_ == nc.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX else "rx"
                    links = dev.nvlink.get(d) or []
                    if 0 <= scope < len(links):
                        ret, value = nc.NVML_SUCCESS, links[scope].read(now)
            out.append(
                Struct(
                    fieldId=fid_,
                    scopeId=scope,
                    timestamp=int(now * 1e6),
                    latencyUsec=0,
                    valueType=vtype,
                    nvmlReturn=ret,
                    value=FakeValue(int(value)),
                )
            )
        return out

    # ---- MIG -----------------------------------------------------------------------------
    def nvmlDeviceGetMigMode(self, handle: Any) -> list[int]:
        """``nvmlDeviceGetMigMode`` → ``[current, pending]``; NOT_SUPPORTED without MIG."""
        dev = self._dev("nvmlDeviceGetMigMode", handle)
        if dev.parent is not None or not dev.mig_capable:
            raise _err(nc.NVML_ERROR_NOT_SUPPORTED)
        mode = nc.NVML_DEVICE_MIG_ENABLE if dev.migs else 0
        return [mode, mode]

    def nvmlDeviceGetMaxMigDeviceCount(self, handle: Any) -> int:
        """``nvmlDeviceGetMaxMigDeviceCount``."""
        dev = self._dev("nvmlDeviceGetMaxMigDeviceCount", handle)
        if not dev.mig_capable:
            raise _err(nc.NVML_ERROR_NOT_SUPPORTED)
        return dev.mig_max

    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle: Any, index: int) -> FakeDevice:
        """``nvmlDeviceGetMigDeviceHandleByIndex``; NOT_FOUND for empty slots."""
        dev = self._dev("nvmlDeviceGetMigDeviceHandleByIndex", handle)
        if not 0 <= index < len(dev.migs):
            raise _err(nc.NVML_ERROR_NOT_FOUND)
        return dev.migs[index]

    def nvmlDeviceIsMigDeviceHandle(self, handle: Any) -> int:
        """``nvmlDeviceIsMigDeviceHandle``."""
        return int(self._dev("nvmlDeviceIsMigDeviceHandle", handle).parent is not None)

    def nvmlDeviceGetGpuInstanceId(self, handle: Any) -> int:
        """``nvmlDeviceGetGpuInstanceId`` of a MIG device handle."""
        dev = self._dev("nvmlDeviceGetGpuInstanceId", handle)
        if dev.parent is None:
            raise _err(nc.NVML_ERROR_INVALID_ARGUMENT)
        return dev.gi

    def nvmlDeviceGetComputeInstanceId(self, handle: Any) -> int:
        """``nvmlDeviceGetComputeInstanceId`` of a MIG device handle."""
        dev = self._dev("nvmlDeviceGetComputeInstanceId", handle)
        if dev.parent is None:
            raise _err(nc.NVML_ERROR_INVALID_ARGUMENT)
        return dev.ci

    def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(self, handle: Any) -> FakeDevice:
        """``nvmlDeviceGetDeviceHandleFromMigDeviceHandle``."""
        dev = self._dev("nvmlDeviceGetDeviceHandleFromMigDeviceHandle", handle)
        if dev.parent is None:
            raise _err(nc.NVML_ERROR_INVALID_ARGUMENT)
        return dev.parent

    # ---- GPM -----------------------------------------------------------------------------
    def nvmlGpmQueryDeviceSupport(self, handle: Any) -> Struct:
        """``nvmlGpmQueryDeviceSupport`` → ``isSupportedDevice`` (Hopper and newer)."""
        dev = self._dev("nvmlGpmQueryDeviceSupport", handle)
        return Struct(version=1, isSupportedDevice=int(dev.gpm is not None))

    def nvmlGpmSampleAlloc(self) -> FakeGpmSample:
        """``nvmlGpmSampleAlloc``."""
        self._enter("nvmlGpmSampleAlloc")
        return FakeGpmSample()

    def nvmlGpmSampleFree(self, sample: FakeGpmSample) -> None:
        """``nvmlGpmSampleFree``."""
        self._enter("nvmlGpmSampleFree")
        sample.taken = False

    def nvmlGpmSampleGet(self, handle: Any, sample: FakeGpmSample) -> FakeGpmSample:
        """``nvmlGpmSampleGet``: records what the device shows now."""
        dev = self._dev("nvmlGpmSampleGet", handle)
        if dev.gpm is None:
            raise _err(nc.NVML_ERROR_NOT_SUPPORTED)
        sample.values = dict(dev.gpm)
        sample.taken = True
        return sample

    def nvmlGpmMigSampleGet(
        self, handle: Any, gpuInstanceId: int, sample: FakeGpmSample
    ) -> FakeGpmSample:
        """``nvmlGpmMigSampleGet`` for the MIG instance ``gpuInstanceId`` of ``handle``."""
        dev = self._dev("nvmlGpmMigSampleGet", handle)
        inst = next((m for m in dev.migs if m.gi == gpuInstanceId), None)
        if inst is None:
            raise _err(nc.NVML_ERROR_NOT_FOUND)
        if inst.gpm is None:
            raise _err(nc.NVML_ERROR_NOT_SUPPORTED)
        sample.values = dict(inst.gpm)
        sample.taken = True
        return sample

    def nvmlGpmMetricsGet(self, metricsGet: FakeGpmMetricsGet) -> FakeGpmMetricsGet:
        """``nvmlGpmMetricsGet``: each metric's value over ``sample1``..``sample2``.

        The fake reports the values ``sample2`` recorded (what the device showed at its end).
        """
        self._enter("nvmlGpmMetricsGet")
        s1, s2 = metricsGet.sample1, metricsGet.sample2
        if metricsGet.version != nc.NVML_GPM_METRICS_GET_VERSION:
            raise _err(nc.NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
        if s1 is None or s2 is None or not s1.taken or not s2.taken:
            raise _err(nc.NVML_ERROR_INVALID_ARGUMENT)
        for m in metricsGet.metrics[: metricsGet.numMetrics]:
            if m.metricId in s2.values:
                m.nvmlReturn, m.value = nc.NVML_SUCCESS, s2.values[m.metricId]
            else:
                m.nvmlReturn, m.value = nc.NVML_ERROR_NOT_SUPPORTED, 0.0
        return metricsGet

    # ---- events --------------------------------------------------------------------------
    def nvmlEventSetCreate(self) -> _EventSet:
        """``nvmlEventSetCreate``."""
        self._enter("nvmlEventSetCreate")
        es = _EventSet()
        self._event_sets.append(es)
        return es

    def nvmlDeviceGetSupportedEventTypes(self, handle: Any) -> int:
        """``nvmlDeviceGetSupportedEventTypes``."""
        dev = self._dev("nvmlDeviceGetSupportedEventTypes", handle)
        return nc.nvmlEventTypeXidCriticalError if dev.xid_events else 0

    def nvmlDeviceRegisterEvents(self, handle: Any, eventTypes: int, eventSet: _EventSet) -> None:
        """``nvmlDeviceRegisterEvents``; NOT_SUPPORTED where the device has no such events."""
        dev = self._dev("nvmlDeviceRegisterEvents", handle)
        if not dev.xid_events or not eventTypes & nc.nvmlEventTypeXidCriticalError:
            raise _err(nc.NVML_ERROR_NOT_SUPPORTED)
        eventSet.devices.add(id(dev))

    def nvmlEventSetWait_v2(self, eventSet: _EventSet, timeoutms: int) -> Struct:
        """``nvmlEventSetWait_v2``: the next event, or ``NVMLError_Timeout`` after ``timeoutms``."""
        self._enter("nvmlEventSetWait_v2")
        with eventSet.cond:
            if not eventSet.queue and timeoutms > 0:
                eventSet.cond.wait(timeoutms / 1000.0)
            if not eventSet.queue:
                raise _err(nc.NVML_ERROR_TIMEOUT)
            return eventSet.queue.popleft()

    def nvmlEventSetWait(self, eventSet: _EventSet, timeoutms: int) -> Struct:
        """``nvmlEventSetWait`` (same as ``_v2``)."""
        return self.nvmlEventSetWait_v2(eventSet, timeoutms)

    def nvmlEventSetFree(self, eventSet: _EventSet) -> None:
        """``nvmlEventSetFree``."""
        self.calls["nvmlEventSetFree"] += 1
        if eventSet in self._event_sets:
            self._event_sets.remove(eventSet)
