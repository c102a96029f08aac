"""The NVML chokepoint: error classification, lazy locked init, versioned probes, the fake."""

import ast
import ctypes
import logging
import subprocess
import sys
import threading
from pathlib import Path

import pynvml
import pytest

from kvpressure.agent.samplers import nvml_binding as nb
from kvpressure.agent.samplers import nvml_codes as nc
from kvpressure.agent.samplers.fake_nvml import MIB, FakeNvml, list_profiles, load_profile
from kvpressure.agent.samplers.nvml_factory import bind

ROOT = Path(__file__).resolve().parent.parent
PROFILES = ROOT / "agent" / "samplers" / "fake_nvml" / "profiles"


# ---- classification ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("code", "kind"),
    [
        (3, nb.UNSUPPORTED),
        (4, nb.NO_PERMISSION),
        (15, nb.GPU_LOST),
        (9, nb.DRIVER_NOT_LOADED),
        (18, nb.LIBRARY_VERSION_MISMATCH),
        (12, nb.LIBRARY_NOT_FOUND),
        (13, nb.FUNCTION_NOT_FOUND),
        (10, nb.TIMEOUT),
        (1, nb.UNINITIALIZED),
        (999, nb.OTHER),
        (16, nb.OTHER),
    ],
)
def test_every_pynvml_error_class_maps_to_one_kind(code, kind):
    exc = pynvml.NVMLError(code)
    assert type(exc).__name__.startswith("NVMLError_")  # pynvml's per-code subclass
    err = nb.classify(exc, "nvmlDeviceGetMemoryInfo")
    assert err is not None
    assert (err.kind, err.code, err.function) == (kind, code, "nvmlDeviceGetMemoryInfo")


def test_pynvml_class_names_match_the_codes_we_rely_on():
    assert pynvml.NVMLError_NotSupported().value == nb.NVML_ERROR_NOT_SUPPORTED
    assert pynvml.NVMLError_NoPermission().value == nb.NVML_ERROR_NO_PERMISSION
    assert pynvml.NVMLError_GpuIsLost().value == nb.NVML_ERROR_GPU_IS_LOST
    assert pynvml.NVMLError_DriverNotLoaded().value == nb.NVML_ERROR_DRIVER_NOT_LOADED
    assert pynvml.NVMLError_LibRmVersionMismatch().value == nb.NVML_ERROR_LIB_RM_VERSION_MISMATCH
    assert pynvml.NVMLError_FunctionNotFound().value == nb.NVML_ERROR_FUNCTION_NOT_FOUND
    assert pynvml.NVMLError_LibraryNotFound().value == nb.NVML_ERROR_LIBRARY_NOT_FOUND
    assert pynvml.NVMLError_Unknown().value == nb.NVML_ERROR_UNKNOWN


def test_constants_match_the_installed_nvidia_ml_py():
    assert nb.nvmlMemory_v2 == pynvml.nvmlMemory_v2
    assert nb.NVML_FI_DEV_PCIE_COUNT_TX_BYTES == pynvml.NVML_FI_DEV_PCIE_COUNT_TX_BYTES
    assert nb.NVML_FI_DEV_PCIE_COUNT_RX_BYTES == pynvml.NVML_FI_DEV_PCIE_COUNT_RX_BYTES
    assert nb.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX == pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX
    assert nb.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX == pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX
    assert nb.NVML_FI_DEV_NVLINK_LINK_COUNT == pynvml.NVML_FI_DEV_NVLINK_LINK_COUNT
    assert nb.NVML_GPM_METRIC_DRAM_BW_UTIL == pynvml.NVML_GPM_METRIC_DRAM_BW_UTIL
    assert nb.NVML_GPM_METRIC_SM_OCCUPANCY == pynvml.NVML_GPM_METRIC_SM_OCCUPANCY
    assert nb.NVML_GPM_METRICS_GET_VERSION == pynvml.NVML_GPM_METRICS_GET_VERSION
    assert nb.nvmlEventTypeXidCriticalError == pynvml.nvmlEventTypeXidCriticalError
    assert nb.NVML_DEVICE_MIG_ENABLE == pynvml.NVML_DEVICE_MIG_ENABLE
    bits = dict(nb.CLOCK_EVENT_REASONS)
    assert bits["sw_power_cap"] == pynvml.nvmlClocksEventReasonSwPowerCap
    assert bits["hw_slowdown"] == pynvml.nvmlClocksEventReasonHwSlowdown
    assert bits["sw_thermal_slowdown"] == pynvml.nvmlClocksEventReasonSwThermalSlowdown
    assert bits["hw_thermal_slowdown"] == pynvml.nvmlClocksEventReasonHwThermalSlowdown
    assert bits["hw_power_brake_slowdown"] == pynvml.nvmlClocksEventReasonHwPowerBrakeSlowdown
    assert bits["idle"] == pynvml.nvmlClocksEventReasonGpuIdle
    assert bits["sync_boost"] == pynvml.nvmlClocksEventReasonSyncBoost
    assert bits["display_clock_setting"] == pynvml.nvmlClocksEventReasonDisplayClockSetting
    assert bits["applications_clocks_setting"] == (
        pynvml.nvmlClocksEventReasonApplicationsClocksSetting
    )
    for code in (3, 4, 9, 10, 12, 13, 15, 18, 25, 999):
        name = next(
            k for k in dir(pynvml) if k.startswith("NVML_ERROR_") and getattr(pynvml, k) == code
        )
        assert getattr(nb, name) == code


def test_library_mismatch_error_and_foreign_exceptions():
    err = nb.classify(
        pynvml.NVMLLibraryMismatchError("no _v3"), "nvmlDeviceGetComputeRunningProcesses"
    )
    assert err is not None and err.kind == nb.FUNCTION_NOT_FOUND
    assert nb.classify(ValueError("bug")) is None
    assert nb.NvmlError(nb.OTHER, 999).reason == "nvml_error_999"
    assert nb.NvmlError(nb.GPU_LOST, 15).reason == "gpu_lost"


def test_field_value_decoding_by_value_type():
    values = pynvml.c_nvmlFieldValue_t * 3
    fv = values()
    fv[0].nvmlReturn, fv[0].valueType = 0, nb.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG
    fv[0].value.ullVal = 1 << 40
    fv[1].nvmlReturn, fv[1].valueType = 0, nb.NVML_VALUE_TYPE_DOUBLE
    fv[1].value.dVal = 2.5
    fv[2].nvmlReturn = nb.NVML_ERROR_NOT_SUPPORTED
    assert nb.field_value(fv[0]) == float(1 << 40)
    assert nb.field_value_bits(fv[0]) == 64
    assert nb.field_value(fv[1]) == 2.5
    assert nb.field_value(fv[2]) is None


def test_handle_key_identifies_ctypes_pointers_by_address():
    buf = ctypes.c_int(7)
    p1 = ctypes.pointer(buf)
    p2 = ctypes.pointer(buf)
    assert p1 is not p2
    assert nb.handle_key(p1) == nb.handle_key(p2)
    obj = object()
    assert nb.handle_key(obj) == id(obj)


# ---- the binding and the fake do not import each other -------------------------------------
def _loaded_after(module: str) -> set[str]:
    """The ``kvpressure.agent.samplers`` modules a fresh interpreter holds after ``module``."""
    code = (
        f"import sys, importlib; importlib.import_module({module!r}); "
        "print(' '.join(m for m in sys.modules if m.startswith('kvpressure.agent.samplers')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    return set(out.stdout.split())


def test_the_real_binding_and_the_fake_share_only_the_codes():
    binding = _loaded_after("kvpressure.agent.samplers.nvml_binding")
    assert "kvpressure.agent.samplers.nvml_codes" in binding
    assert not any(m.startswith("kvpressure.agent.samplers.fake_nvml") for m in binding)
    assert "kvpressure.agent.samplers.nvml_factory" not in binding
    for fake in ("fake_nvml", "fake_nvml.record"):
        loaded = _loaded_after(f"kvpressure.agent.samplers.{fake}")
        assert "kvpressure.agent.samplers.nvml_codes" in loaded
        assert "kvpressure.agent.samplers.nvml_binding" not in loaded, fake
    # not even lazily (an import inside a function): the binding imports neither
    tree = ast.parse((ROOT / "agent" / "samplers" / "nvml_binding.py").read_text("utf-8"))
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)} | {
        a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names
    }
    assert not {m for m in imported if m and ("fake_nvml" in m or "nvml_factory" in m)}
    # the factory picks the fake only when asked, and both speak the same error classes
    assert "kvpressure.agent.samplers.fake_nvml" not in _loaded_after(
        "kvpressure.agent.samplers.nvml_factory"
    )
    assert nb.NvmlError is nc.NvmlError and nb.classify is nc.classify


# ---- bind ---------------------------------------------------------------------------------
def test_bind_rejects_unknown_specs_and_profiles():
    with pytest.raises(ValueError, match="unknown NVML binding"):
        bind("cuda")
    with pytest.raises(ValueError, match="only accepted by fake"):
        bind("nvml", gpus=2)
    with pytest.raises(FileNotFoundError, match=r"available: .*h200"):
        bind("fake:h300")


def test_real_binding_without_a_driver_is_library_not_found():
    if Path("/proc/driver/nvidia/version").exists():
        pytest.skip("an NVIDIA driver is present here")
    b = bind("nvml")
    with pytest.raises(nb.NvmlError) as ei:
        b.init()
    assert ei.value.kind in (nb.LIBRARY_NOT_FOUND, nb.DRIVER_NOT_LOADED)
    assert not b.initialized


def test_missing_package_is_library_not_found():
    b = nb.NvmlBinding(None, "nvml")
    with pytest.raises(nb.NvmlError) as ei:
        b.init()
    assert ei.value.kind == nb.LIBRARY_NOT_FOUND


def test_init_is_lazy_locked_and_once():
    fake = FakeNvml.from_profile("h200")
    b = nb.NvmlBinding(fake, "fake:h200")
    assert fake.init_attempts == 0  # nothing happens at bind time
    barrier = threading.Barrier(8)

    def go():
        barrier.wait()
        b.init()

    threads = [threading.Thread(target=go) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert fake.init_attempts == 1 and b.initialized
    b.shutdown()
    assert not b.initialized and fake.calls["nvmlShutdown"] == 1


def test_calls_before_init_are_uninitialized():
    b = bind("fake:h200")
    with pytest.raises(nb.NvmlError) as ei:
        b.call("nvmlDeviceGetCount")
    assert ei.value.kind == nb.UNINITIALIZED


# ---- versioned probes and missing functions -------------------------------------------------
class NoV2(FakeNvml):
    """A driver without nvmlDeviceGetMemoryInfo_v2."""

    def nvmlDeviceGetMemoryInfo(self, handle, version=None):
        if version:
            self.calls["v2-attempt"] += 1
            raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
        return super().nvmlDeviceGetMemoryInfo(handle)


def test_memory_v2_falls_back_to_v1_once_and_logs_once(caplog):
    fake = NoV2(load_profile("h200"))
    b = nb.NvmlBinding(fake, "fake")
    b.init()
    h = b.call("nvmlDeviceGetHandleByIndex", 0)
    with caplog.at_level(logging.INFO, logger="kvpressure.agent.samplers.nvml_binding"):
        m1 = b.memory_info(h)
        m2 = b.memory_info(h)
    assert fake.calls["v2-attempt"] == 1  # probed once
    assert not hasattr(m1, "reserved") and m1.total == m2.total == 143771 * MIB
    assert m1.used == (87321 + 700) * MIB  # v1 "used" includes the reserved memory
    assert sum("_v2 unavailable" in r.getMessage() for r in caplog.records) == 1


def test_memory_v2_argument_version_mismatch_also_falls_back():
    class OldStruct(FakeNvml):
        def nvmlDeviceGetMemoryInfo(self, handle, version=None):
            if version:
                raise pynvml.NVMLError(pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
            return super().nvmlDeviceGetMemoryInfo(handle)

    b = nb.NvmlBinding(OldStruct(load_profile("h200")), "fake")
    b.init()
    m = b.memory_info(b.call("nvmlDeviceGetHandleByIndex", 0))
    assert m.used == (87321 + 700) * MIB


def test_memory_v2_reports_reserved_separately():
    b = bind("fake:h200")
    b.init()
    m = b.memory_info(b.call("nvmlDeviceGetHandleByIndex", 0))
    assert (m.version, m.total, m.reserved, m.used) == (
        pynvml.nvmlMemory_v2,
        143771 * MIB,
        700 * MIB,
        87321 * MIB,
    )
    assert m.free == m.total - m.reserved - m.used


def test_driver_without_a_function_is_logged_once_and_not_called_again(caplog):
    class OldDriver(FakeNvml):
        def nvmlDeviceGetCurrentClocksEventReasons(self, handle):
            self.calls["new-name"] += 1
            raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)

    fake = OldDriver(load_profile("gb10"))
    b = nb.NvmlBinding(fake, "fake")
    b.init()
    h = b.call("nvmlDeviceGetHandleByIndex", 0)
    with caplog.at_level(logging.INFO, logger="kvpressure.agent.samplers.nvml_binding"):
        for _ in range(5):
            assert b.clocks_event_reasons(h) == 1  # GB10 profile: idle, via ThrottleReasons
    assert fake.calls["new-name"] == 1
    msgs = [
        r.getMessage()
        for r in caplog.records
        if "nvmlDeviceGetCurrentClocksEventReasons" in r.getMessage()
    ]
    assert len(msgs) == 1 and "not in the installed driver" in msgs[0]
    b.reinit()  # a new driver may have it
    b.clocks_event_reasons(h)
    assert fake.calls["new-name"] == 2


def test_function_absent_from_the_python_package():
    class Lib:
        def nvmlInit(self):
            return None

    b = nb.NvmlBinding(Lib(), "fake")
    b.init()
    assert not b.has("nvmlDeviceGetCount")
    with pytest.raises(nb.NvmlError) as ei:
        b.call("nvmlDeviceGetCount")
    assert ei.value.kind == nb.FUNCTION_NOT_FOUND


def test_non_nvml_exceptions_propagate_unchanged():
    class Buggy(FakeNvml):
        def nvmlDeviceGetPowerUsage(self, handle):
            raise KeyError("bug")

    b = nb.NvmlBinding(Buggy(load_profile("h200")), "fake")
    b.init()
    with pytest.raises(KeyError):
        b.call("nvmlDeviceGetPowerUsage", b.call("nvmlDeviceGetHandleByIndex", 0))


# ---- the fake itself ---------------------------------------------------------------------------
def test_every_profile_loads_and_carries_provenance():
    names = list_profiles()
    assert set(names) >= {
        "h100-sxm",
        "h200",
        "a100-80gb-mig",
        "gb10",
        "lost-after-n",
        "driver-mismatch-heals",
    }
    for name in names:
        text = (PROFILES / f"{name}.yaml").read_text()
        assert "Provenance" in text or "as h100-sxm.yaml" in text, name
        assert load_profile(name)["profile"] == name


@pytest.mark.parametrize(
    ("profile", "gpus", "name", "total_mib"),
    [
        ("h100-sxm", 8, "NVIDIA H100 80GB HBM3", 81559),
        ("h200", 1, "NVIDIA H200", 143771),
        ("a100-80gb-mig", 1, "NVIDIA A100-SXM4-80GB", 81920),
        ("lost-after-n", 2, "NVIDIA H100 80GB HBM3", 81559),
    ],
)
def test_profile_identity_and_memory(profile, gpus, name, total_mib):
    b = bind(f"fake:{profile}")
    b.init()
    assert b.call("nvmlDeviceGetCount") == gpus
    h = b.call("nvmlDeviceGetHandleByIndex", 0)
    assert b.call("nvmlDeviceGetName", h) == name
    assert b.memory_info(h).total == total_mib * MIB


def test_gb10_memory_is_not_supported_in_both_versions():
    fake = FakeNvml.from_profile("gb10")
    fake.nvmlInit()
    h = fake.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        fake.nvmlDeviceGetMemoryInfo(h)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        fake.nvmlDeviceGetMemoryInfo(h, version=pynvml.nvmlMemory_v2)
    assert fake.nvmlDeviceGetUtilizationRates(h).gpu == 0
    assert fake.nvmlDeviceGetPowerUsage(h) == 11170
    assert fake.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU) == 35
    assert [p.pid for p in fake.nvmlDeviceGetComputeRunningProcesses(h)] == [7100]


def test_a100_mig_layout_and_not_supported_utilization():
    fake = FakeNvml.from_profile("a100-80gb-mig")
    fake.nvmlInit()
    h = fake.nvmlDeviceGetHandleByIndex(0)
    assert fake.nvmlDeviceGetMigMode(h) == [1, 1]
    assert fake.nvmlDeviceGetMaxMigDeviceCount(h) == 7
    migs = [fake.nvmlDeviceGetMigDeviceHandleByIndex(h, i) for i in range(2)]
    with pytest.raises(pynvml.NVMLError_NotFound):
        fake.nvmlDeviceGetMigDeviceHandleByIndex(h, 2)
    assert [fake.nvmlDeviceGetGpuInstanceId(m) for m in migs] == [1, 2]
    assert [fake.nvmlDeviceGetComputeInstanceId(m) for m in migs] == [0, 0]
    assert fake.nvmlDeviceGetName(migs[0]) == "NVIDIA A100-SXM4-80GB MIG 3g.40gb"
    assert fake.nvmlDeviceGetMemoryInfo(migs[1]).total == 40192 * MIB
    for dev in (h, *migs):
        with pytest.raises(pynvml.NVMLError_NotSupported):
            fake.nvmlDeviceGetUtilizationRates(dev)
    assert fake.nvmlDeviceGetMemoryInfo(h, version=pynvml.nvmlMemory_v2).used == 36537 * MIB
    assert fake.nvmlGpmQueryDeviceSupport(h).isSupportedDevice == 0


def test_lost_after_n_then_recovers_after_m():
    fake = FakeNvml.from_profile("lost-after-n", lost_after_calls=3, recover_after_calls=2)
    fake.nvmlInit()
    es = fake.nvmlEventSetCreate()
    h1 = fake.nvmlDeviceGetHandleByIndex(1)
    fake.nvmlDeviceRegisterEvents(h1, pynvml.nvmlEventTypeXidCriticalError, es)  # call 1
    for _ in range(2):
        fake.nvmlDeviceGetPowerUsage(h1)  # calls 2, 3
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        fake.nvmlDeviceGetPowerUsage(h1)  # lost from call 4
    assert fake.nvmlEventSetWait_v2(es, 0).eventData == 79  # "fallen off the bus"
    with pytest.raises(pynvml.NVMLError_Unknown):  # handle lookups: "Unknown Error" (case 05)
        fake.nvmlDeviceGetHandleByIndex(1)
    h0 = fake.nvmlDeviceGetHandleByIndex(0)
    assert fake.nvmlDeviceGetPowerUsage(h0) == 512000  # the other GPU is fine
    assert fake.nvmlDeviceGetPowerUsage(h1) == 512000  # recovered after 2 failing calls
    with pytest.raises(pynvml.NVMLError_Timeout):
        fake.nvmlEventSetWait_v2(es, 0)


def test_driver_mismatch_heals_after_k_attempts():
    fake = FakeNvml.from_profile("driver-mismatch-heals")
    for _ in range(3):
        with pytest.raises(pynvml.NVMLError_LibRmVersionMismatch):
            fake.nvmlInit()
    fake.nvmlInit()
    assert fake.nvmlDeviceGetCount() == 1
    fake.break_driver(init_failures=1)
    with pytest.raises(pynvml.NVMLError_LibRmVersionMismatch):
        fake.nvmlDeviceGetCount()
    with pytest.raises(pynvml.NVMLError_LibRmVersionMismatch):
        fake.nvmlInit()
    fake.nvmlInit()
    assert fake.nvmlDeviceGetCount() == 1


def test_counters_integrate_rates_over_the_fake_clock():
    t = [100.0]
    fake = FakeNvml.from_profile("h100-sxm", clock=lambda: t[0], gpus=1)
    fake.nvmlInit()
    h = fake.nvmlDeviceGetHandleByIndex(0)
    ids = [
        pynvml.NVML_FI_DEV_PCIE_COUNT_TX_BYTES,
        (pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, 17),
        (pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, 18),  # H100 SXM has links 0-17
        pynvml.NVML_FI_DEV_NVLINK_LINK_COUNT,
    ]
    before = [nb.field_value(v) for v in fake.nvmlDeviceGetFieldValues(h, ids)]
    t[0] += 2.0
    after = [nb.field_value(v) for v in fake.nvmlDeviceGetFieldValues(h, ids)]
    assert after[0] - before[0] == 2 * 52_000_000
    assert after[1] - before[1] == 2 * 1_953_125  # KiB
    assert before[2] is None and after[3] == 18
    fake.set(0, pcie_tx_bytes_per_s=0)
    t[0] += 5
    assert nb.field_value(fake.nvmlDeviceGetFieldValues(h, ids[:1])[0]) == after[0]


def test_gpm_metrics_report_the_scripted_values():
    fake = FakeNvml.from_profile("h200")
    fake.nvmlInit()
    h = fake.nvmlDeviceGetHandleByIndex(0)
    assert fake.nvmlGpmQueryDeviceSupport(h).isSupportedDevice == 1
    s1, s2 = fake.nvmlGpmSampleAlloc(), fake.nvmlGpmSampleAlloc()
    fake.nvmlGpmSampleGet(h, s1)
    fake.set(0, dram_bw_util=91.5, sm_occupancy=12.0)
    fake.nvmlGpmSampleGet(h, s2)
    mg = fake.c_nvmlGpmMetricsGet_t()
    mg.version, mg.numMetrics, mg.sample1, mg.sample2 = 1, 2, s1, s2
    mg.metrics[0].metricId = pynvml.NVML_GPM_METRIC_DRAM_BW_UTIL
    mg.metrics[1].metricId = pynvml.NVML_GPM_METRIC_SM_OCCUPANCY
    fake.nvmlGpmMetricsGet(mg)
    assert (mg.metrics[0].value, mg.metrics[1].value) == (91.5, 12.0)
    assert mg.metrics[0].nvmlReturn == 0


def test_reinit_can_unload_the_real_library_for_a_fresh_load(monkeypatch):
    # Stand in for libnvidia-ml with libm, which this process keeps loaded anyway (so the
    # dlclose only drops our extra reference).
    libm = ctypes.CDLL("libm.so.6")
    monkeypatch.setattr(pynvml, "nvmlLib", libm)
    pynvml._nvmlGetFunctionPointer_cache["nvmlInit"] = object()
    b = nb.NvmlBinding(pynvml, "nvml")
    assert b._unload_library() is True
    assert pynvml.nvmlLib is None
    assert "nvmlInit" not in pynvml._nvmlGetFunctionPointer_cache
    assert nb.NvmlBinding(FakeNvml.from_profile("h200"), "fake")._unload_library() is False
    assert b._unload_library() is False  # nothing loaded any more
