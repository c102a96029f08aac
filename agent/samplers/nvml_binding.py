"""The one chokepoint to NVML: the only module that imports ``pynvml`` (from ``nvidia-ml-py``).

Everything the GPU sampler asks of the driver goes through an :class:`NvmlBinding`:

* **Lazy, locked init.** ``nvmlInit`` runs on the first :meth:`NvmlBinding.init`, under a lock;
  :meth:`NvmlBinding.reinit` shuts down and initialises again (driver reload, case 06).
* **One error type.** Every ``pynvml.NVMLError`` (and pynvml's own
  ``NVMLLibraryMismatchError``) becomes an :class:`NvmlError` whose :attr:`NvmlError.kind` is
  one of :data:`KINDS`; callers branch on the kind, never on pynvml classes.
* **Versioned calls probed once.** ``nvmlDeviceGetMemoryInfo`` is tried with ``nvmlMemory_v2``
  (which adds ``reserved``) and falls back to v1 for good when the driver lacks
  ``nvmlDeviceGetMemoryInfo_v2`` or rejects the struct version; likewise
  ``nvmlDeviceGetCurrentClocksEventReasons`` → ``...ThrottleReasons`` (pre-R535 drivers),
  ``nvmlDeviceGetTemperature`` → ``nvmlDeviceGetTemperatureV`` (CUDA 14 removes the former) and
  ``nvmlDeviceGet{Compute,Graphics}RunningProcesses`` (v3) → ``_v2``.
* **A missing driver function is logged once** and never called again until re-init.

:func:`bind` returns a binding over the real library (``"nvml"``) or over the recorded-behaviour
fake (``"fake:<profile>"``, :mod:`agent.samplers.fake_nvml`), which has the same function names,
return shapes and error classes, so all classification code is shared. The NVML constants the
sampler needs are re-exported here as plain integers (values from ``nvml.h`` / nvidia-ml-py
13.615), so neither the sampler nor the fake imports ``pynvml``.

This module imports nothing beyond the standard library, ``pynvml`` and
:mod:`agent.samplers.base` (no pydantic, httpx or aiohttp), so ``benchmarks/gpu_check.py`` can
run it on a bare GPU machine.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Callable
from typing import Any, Final

from kvpressure.agent.samplers.base import LogOnce

try:  # nvidia-ml-py is a declared dependency, but a missing package must not break the agent
    import pynvml as _pynvml
except ImportError:  # pragma: no cover - exercised only where nvidia-ml-py is not installed
    _pynvml = None

log = logging.getLogger(__name__)

# --- return codes (nvmlReturn_t) ------------------------------------------------------------
NVML_SUCCESS: Final = 0
NVML_ERROR_UNINITIALIZED: Final = 1
NVML_ERROR_INVALID_ARGUMENT: Final = 2
NVML_ERROR_NOT_SUPPORTED: Final = 3
NVML_ERROR_NO_PERMISSION: Final = 4
NVML_ERROR_NOT_FOUND: Final = 6
NVML_ERROR_INSUFFICIENT_SIZE: Final = 7
NVML_ERROR_DRIVER_NOT_LOADED: Final = 9
NVML_ERROR_TIMEOUT: Final = 10
NVML_ERROR_LIBRARY_NOT_FOUND: Final = 12
NVML_ERROR_FUNCTION_NOT_FOUND: Final = 13
NVML_ERROR_GPU_IS_LOST: Final = 15
NVML_ERROR_RESET_REQUIRED: Final = 16
NVML_ERROR_LIB_RM_VERSION_MISMATCH: Final = 18
NVML_ERROR_ARGUMENT_VERSION_MISMATCH: Final = 25
NVML_ERROR_UNKNOWN: Final = 999

# --- struct versions, sensors, fields, events, GPM -----------------------------------------
nvmlMemory_v2: Final = 0x02000028
"""``nvmlMemory_v2`` struct version for ``nvmlDeviceGetMemoryInfo_v2`` (adds ``reserved``)."""
NVML_TEMPERATURE_GPU: Final = 0
NVML_DEVICE_MIG_ENABLE: Final = 1

NVML_FI_DEV_NVLINK_LINK_COUNT: Final = 91
NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX: Final = 138
"""Per-link cumulative NVLink TX payload in KiB (``scopeId`` = link)."""
NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX: Final = 139
NVML_FI_DEV_PCIE_COUNT_TX_BYTES: Final = 197
"""Cumulative PCIe TX bytes (may wrap); R535+ drivers."""
NVML_FI_DEV_PCIE_COUNT_RX_BYTES: Final = 198

NVML_VALUE_TYPE_DOUBLE: Final = 0
NVML_VALUE_TYPE_UNSIGNED_INT: Final = 1
NVML_VALUE_TYPE_UNSIGNED_LONG: Final = 2
NVML_VALUE_TYPE_UNSIGNED_LONG_LONG: Final = 3
NVML_VALUE_TYPE_SIGNED_LONG_LONG: Final = 4
NVML_VALUE_TYPE_SIGNED_INT: Final = 5
NVML_VALUE_TYPE_UNSIGNED_SHORT: Final = 6

nvmlEventTypeXidCriticalError: Final = 0x0000000000000008

NVML_GPM_METRIC_SM_OCCUPANCY: Final = 3
"""GPM: percentage of warps active vs the theoretical maximum, 0.0-100.0."""
NVML_GPM_METRIC_DRAM_BW_UTIL: Final = 10
"""GPM: percentage of DRAM bandwidth used vs the theoretical maximum, 0.0-100.0."""
NVML_GPM_METRICS_GET_VERSION: Final = 1

# --- clocks event reasons (nvmlClocksEventReason*, same bits as the deprecated *Throttle*) --
CLOCK_EVENT_REASONS: Final[tuple[tuple[str, int], ...]] = (
    ("idle", 0x0000000000000001),
    ("applications_clocks_setting", 0x0000000000000002),
    ("sw_power_cap", 0x0000000000000004),
    ("hw_slowdown", 0x0000000000000008),
    ("sync_boost", 0x0000000000000010),
    ("sw_thermal_slowdown", 0x0000000000000020),
    ("hw_thermal_slowdown", 0x0000000000000040),
    ("hw_power_brake_slowdown", 0x0000000000000080),
    ("display_clock_setting", 0x0000000000000100),
)
"""``reason`` label value and NVML bit of every clocks event reason we export."""

# --- error kinds ------------------------------------------------------------------------------
UNSUPPORTED: Final = "unsupported"
NO_PERMISSION: Final = "no_permission"
GPU_LOST: Final = "gpu_lost"
DRIVER_NOT_LOADED: Final = "driver_not_loaded"
LIBRARY_VERSION_MISMATCH: Final = "library_version_mismatch"
LIBRARY_NOT_FOUND: Final = "library_not_found"
FUNCTION_NOT_FOUND: Final = "function_not_found"
TIMEOUT: Final = "timeout"
UNINITIALIZED: Final = "uninitialized"
OTHER: Final = "other"

KINDS: Final = (
    UNSUPPORTED,
    NO_PERMISSION,
    GPU_LOST,
    DRIVER_NOT_LOADED,
    LIBRARY_VERSION_MISMATCH,
    LIBRARY_NOT_FOUND,
    FUNCTION_NOT_FOUND,
    TIMEOUT,
    UNINITIALIZED,
    OTHER,
)
"""Every :attr:`NvmlError.kind`."""

FIELD_KINDS: Final = frozenset({UNSUPPORTED, NO_PERMISSION, FUNCTION_NOT_FOUND})
"""Kinds that only make one field absent; the device and the library are still usable."""

LIBRARY_KINDS: Final = frozenset(
    {DRIVER_NOT_LOADED, LIBRARY_VERSION_MISMATCH, LIBRARY_NOT_FOUND, UNINITIALIZED}
)
"""Kinds that mean the whole library must be initialised again (driver reload, case 06)."""

_CODE_KIND: Final[dict[int, str]] = {
    NVML_ERROR_NOT_SUPPORTED: UNSUPPORTED,
    NVML_ERROR_NO_PERMISSION: NO_PERMISSION,
    NVML_ERROR_GPU_IS_LOST: GPU_LOST,
    NVML_ERROR_DRIVER_NOT_LOADED: DRIVER_NOT_LOADED,
    NVML_ERROR_LIB_RM_VERSION_MISMATCH: LIBRARY_VERSION_MISMATCH,
    NVML_ERROR_LIBRARY_NOT_FOUND: LIBRARY_NOT_FOUND,
    NVML_ERROR_FUNCTION_NOT_FOUND: FUNCTION_NOT_FOUND,
    NVML_ERROR_TIMEOUT: TIMEOUT,
    NVML_ERROR_UNINITIALIZED: UNINITIALIZED,
}


def kind_of(code: int) -> str:
    """Return the :data:`KINDS` entry for an NVML return code.

    Args:
        code: an ``nvmlReturn_t`` value, e.g. ``15`` (``NVML_ERROR_GPU_IS_LOST``).

    Returns:
        The kind; codes without a kind of their own (``NVML_ERROR_UNKNOWN``,
        ``NVML_ERROR_RESET_REQUIRED``, ...) are ``"other"``.
    """
    return _CODE_KIND.get(code, OTHER)


class NvmlError(Exception):
    """An NVML call failed; the only exception type :class:`NvmlBinding` raises.

    Attributes:
        kind: one of :data:`KINDS`.
        code: the NVML return code (``nvmlReturn_t``), e.g. ``3`` for NOT_SUPPORTED.
        function: the NVML function name that failed, e.g. ``"nvmlDeviceGetMemoryInfo"``.
    """

    def __init__(self, kind: str, code: int, function: str = "", message: str = "") -> None:
        super().__init__(message or f"{function or 'NVML'}: {kind} (code {code})")
        self.kind = kind
        self.code = code
        self.function = function

    @property
    def reason(self) -> str:
        """A short machine-readable reason: the kind, or ``nvml_error_<code>`` for ``other``."""
        return self.kind if self.kind != OTHER else f"nvml_error_{self.code}"


NVML_EXCEPTIONS: tuple[type[Exception], ...] = (
    (NvmlError,) if _pynvml is None else (_pynvml.NVMLError, NvmlError)
)
"""Exception classes an NVML call (real or fake) raises for an NVML return code."""


def make_error(code: int) -> Exception:
    """Return the exception real pynvml raises for ``code``, e.g. ``NVMLError_GpuIsLost``.

    The fake binding raises these so that classification is the same code path as with the
    real library.

    Args:
        code: an NVML return code.

    Returns:
        ``pynvml.NVMLError(code)`` (which pynvml maps to its per-code subclass), or an
        :class:`NvmlError` when nvidia-ml-py is not installed.
    """
    if _pynvml is None:  # pragma: no cover
        return NvmlError(kind_of(code), code)
    err: Exception = _pynvml.NVMLError(code)
    return err


def classify(exc: BaseException, function: str = "") -> NvmlError | None:
    """Turn an exception raised by a pynvml (or fake) call into an :class:`NvmlError`.

    Args:
        exc: the exception.
        function: the NVML function that raised it.

    Returns:
        The classified error, or ``None`` when ``exc`` does not come from NVML (a bug that
        should propagate).
    """
    if isinstance(exc, NvmlError):
        return exc
    if _pynvml is not None:
        if isinstance(exc, _pynvml.NVMLError):
            code = int(getattr(exc, "value", NVML_ERROR_UNKNOWN))
            return NvmlError(kind_of(code), code, function, f"{function}: {_error_text(code)}")
        if isinstance(exc, _pynvml.NVMLLibraryMismatchError):
            # pynvml raises this when an unversioned wrapper's versioned symbol is missing.
            return NvmlError(FUNCTION_NOT_FOUND, NVML_ERROR_FUNCTION_NOT_FOUND, function, str(exc))
    return None


def _error_text(code: int) -> str:
    """Return pynvml's text for ``code`` without calling into the library."""
    if _pynvml is None:  # pragma: no cover
        return f"NVML error {code}"
    text = _pynvml.NVMLError._errcode_to_string.get(code)
    return f"{text} (code {code})" if text else f"NVML error {code}"


def handle_key(handle: object) -> int:
    """Return a stable integer identity for a device handle.

    Real handles are ctypes pointers (two pointer objects to the same device compare unequal),
    so the pointed-to address is used; fake handles are plain objects and use ``id``.
    """
    if isinstance(handle, ctypes._Pointer):
        addr = ctypes.cast(handle, ctypes.c_void_p).value
        return int(addr or 0)
    return id(handle)


class NvmlBinding:
    """A wrapper over the ``pynvml`` module (or the fake) with classified errors.

    Args:
        lib: the module-like object with pynvml's function names (``pynvml`` itself, or a
            :class:`agent.samplers.fake_nvml.FakeNvml`); ``None`` means nvidia-ml-py is not
            installed, and :meth:`init` raises ``library_not_found``.
        name: ``"nvml"`` or ``"fake:<profile>"``.

    Thread-safety: :meth:`init`, :meth:`shutdown` and :meth:`reinit` take a lock; :meth:`call`
    may run concurrently from several threads (NVML is thread-safe).
    """

    def __init__(self, lib: Any, name: str) -> None:
        self.lib = lib
        self.name = name
        self._lock = threading.Lock()
        self._initialized = False
        self._missing: set[str] = set()
        self._fns: dict[str, Callable[..., Any]] = {}
        self._mem_v2: bool | None = None
        self._log_once = LogOnce(log)

    # ---- lifecycle -----------------------------------------------------------------------
    @property
    def initialized(self) -> bool:
        """True after a successful :meth:`init` and before :meth:`shutdown`."""
        return self._initialized

    def init(self) -> None:
        """Initialise NVML once (``nvmlInit``); later calls return at once.

        Raises:
            NvmlError: ``library_not_found`` (no ``libnvidia-ml.so.1`` or no nvidia-ml-py),
                ``driver_not_loaded``, ``library_version_mismatch``, ``no_permission``, ...
        """
        with self._lock:
            if self._initialized:
                return
            if self.lib is None:
                raise NvmlError(
                    LIBRARY_NOT_FOUND,
                    NVML_ERROR_LIBRARY_NOT_FOUND,
                    "nvmlInit",
                    "nvidia-ml-py (pynvml) is not installed",
                )
            self._invoke("nvmlInit", "nvmlInit")
            self._initialized = True

    def shutdown(self) -> None:
        """Call ``nvmlShutdown`` if initialised; errors are ignored (the driver may be gone)."""
        with self._lock:
            if not self._initialized:
                return
            self._initialized = False
            try:
                self._invoke("nvmlShutdown", "nvmlShutdown")
            except NvmlError as exc:
                log.debug("nvmlShutdown failed: %s", exc)

    def reinit(self, reload_library: bool = False) -> None:
        """Shut down and initialise again, forgetting probed versions and missing functions.

        Used after a driver reload or a driver/library version mismatch (case 06): a new driver
        may have functions the old one lacked.

        Args:
            reload_library: also unload ``libnvidia-ml.so.1`` so ``nvmlInit`` maps the file now
                on disk. An agent started before a driver package upgrade still has the old
                library mapped; after the kernel module is reloaded, only a fresh library
                matches it. Only safe while no other thread is inside an NVML call.

        Raises:
            NvmlError: as :meth:`init`.
        """
        self.shutdown()
        with self._lock:
            self._missing.clear()
            self._fns.clear()
            self._mem_v2 = None
            self._log_once = LogOnce(log)
            if reload_library:
                self._unload_library()
        self.init()

    def _unload_library(self) -> bool:
        """Forget pynvml's loaded library (``dlclose``) so the next init loads it again.

        Returns:
            True when a library was unloaded; False for the fake, when nothing is loaded, or
            when this nvidia-ml-py keeps its loader state elsewhere (then nothing is touched).
        """
        mod = _pynvml
        if mod is None or self.lib is not mod:
            return False
        loaded = getattr(mod, "nvmlLib", None)
        cache = getattr(mod, "_nvmlGetFunctionPointer_cache", None)
        lock = getattr(mod, "libLoadLock", None)
        if loaded is None or not isinstance(cache, dict) or lock is None:
            return False
        import _ctypes

        with lock:
            cache.clear()
            mod.nvmlLib = None
            try:
                _ctypes.dlclose(loaded._handle)
            except (OSError, AttributeError) as exc:
                log.debug("could not unload libnvidia-ml: %s", exc)
        log.info("unloaded libnvidia-ml.so.1; the next nvmlInit loads the installed one")
        return True

    # ---- calls ---------------------------------------------------------------------------
    def has(self, function: str) -> bool:
        """True when ``function`` exists in the binding and has not been found missing."""
        return function not in self._missing and getattr(self.lib, function, None) is not None

    def call(self, function: str, *args: Any, **kwargs: Any) -> Any:
        """Call the NVML function ``function`` with classified errors.

        Args:
            function: a pynvml function name, e.g. ``"nvmlDeviceGetPowerUsage"``.
            *args: positional arguments (device handles, ids).
            **kwargs: keyword arguments.

        Returns:
            What pynvml returns (ints, strings, struct-like objects).

        Raises:
            NvmlError: the call failed; a ``function_not_found`` is logged once and the
                function is not called again until :meth:`reinit`.
        """
        fn = self._fns.get(function)
        if fn is None:
            return self._invoke(function, function, *args, **kwargs)
        try:
            return fn(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - re-raised, classified when from NVML
            raise self._classified(exc, function) from None

    def _invoke(self, key: str, function: str, *args: Any, **kwargs: Any) -> Any:
        """Call ``function``, tracking a missing C symbol under ``key``."""
        if key in self._missing:
            raise NvmlError(FUNCTION_NOT_FOUND, NVML_ERROR_FUNCTION_NOT_FOUND, key)
        fn: Callable[..., Any] | None = getattr(self.lib, function, None)
        if fn is None:
            self._mark_missing(key, "not in this nvidia-ml-py")
            raise NvmlError(FUNCTION_NOT_FOUND, NVML_ERROR_FUNCTION_NOT_FOUND, key)
        if key == function:
            self._fns[key] = fn
        try:
            return fn(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - re-raised, classified when from NVML
            raise self._classified(exc, key) from None

    def _classified(self, exc: Exception, key: str) -> Exception:
        """The :class:`NvmlError` for ``exc`` (or ``exc`` itself when not from NVML)."""
        err = classify(exc, key)
        if err is None:
            return exc
        if err.kind == FUNCTION_NOT_FOUND:
            self._fns.pop(key, None)
            self._mark_missing(key, "not in the installed driver")
        return err

    def _mark_missing(self, key: str, where: str) -> None:
        self._missing.add(key)
        self._log_once(
            f"missing:{key}",
            logging.INFO,
            "NVML function %s is %s; the values it gives are left out",
            key,
            where,
        )

    # ---- versioned calls -----------------------------------------------------------------
    def memory_info(self, handle: Any) -> Any:
        """Return device memory, preferring ``nvmlMemory_v2``.

        Calls ``nvmlDeviceGetMemoryInfo(handle, version=nvmlMemory_v2)`` (C symbol
        ``nvmlDeviceGetMemoryInfo_v2``); when the driver lacks it or answers
        ``NVML_ERROR_ARGUMENT_VERSION_MISMATCH``, falls back to v1 for good (logged once).

        Args:
            handle: a device or MIG device handle.

        Returns:
            An object with ``total``, ``free``, ``used`` (bytes) and, with v2, ``version`` and
            ``reserved``.

        Raises:
            NvmlError: e.g. ``unsupported`` on unified-memory parts such as GB10 (case 01).
        """
        if self._mem_v2 is not False:
            try:
                info = self._invoke(
                    "nvmlDeviceGetMemoryInfo_v2",
                    "nvmlDeviceGetMemoryInfo",
                    handle,
                    version=nvmlMemory_v2,
                )
            except NvmlError as exc:
                if exc.kind != FUNCTION_NOT_FOUND and exc.code != (
                    NVML_ERROR_ARGUMENT_VERSION_MISMATCH
                ):
                    raise
                self._mem_v2 = False
                self._log_once(
                    "memory_v1",
                    logging.INFO,
                    "nvmlDeviceGetMemoryInfo_v2 unavailable (%s); using v1, without reserved",
                    exc.reason,
                )
            except TypeError:  # an nvidia-ml-py without the version argument
                self._mem_v2 = False
            else:
                self._mem_v2 = True
                return info
        return self._invoke("nvmlDeviceGetMemoryInfo", "nvmlDeviceGetMemoryInfo", handle)

    def clocks_event_reasons(self, handle: Any) -> int:
        """Return the active clocks event reasons bitmask (see :data:`CLOCK_EVENT_REASONS`).

        ``nvmlDeviceGetCurrentClocksEventReasons`` (R535+), else the deprecated
        ``nvmlDeviceGetCurrentClocksThrottleReasons`` (same bits).

        Raises:
            NvmlError: both are missing or the call failed.
        """
        if self.has("nvmlDeviceGetCurrentClocksEventReasons"):
            try:
                return int(self.call("nvmlDeviceGetCurrentClocksEventReasons", handle))
            except NvmlError as exc:
                if exc.kind != FUNCTION_NOT_FOUND:
                    raise
        return int(self.call("nvmlDeviceGetCurrentClocksThrottleReasons", handle))

    def temperature(self, handle: Any) -> int:
        """Return the GPU die temperature in °C (``nvmlDeviceGetTemperature``, sensor GPU).

        Falls back to ``nvmlDeviceGetTemperatureV`` when the unversioned function is gone.

        Raises:
            NvmlError: the call failed.
        """
        if self.has("nvmlDeviceGetTemperature"):
            try:
                return int(self.call("nvmlDeviceGetTemperature", handle, NVML_TEMPERATURE_GPU))
            except NvmlError as exc:
                if exc.kind != FUNCTION_NOT_FOUND:
                    raise
        return int(self.call("nvmlDeviceGetTemperatureV", handle, NVML_TEMPERATURE_GPU))

    def compute_processes(self, handle: Any) -> list[Any]:
        """Return compute processes on a device (``nvmlDeviceGetComputeRunningProcesses``).

        pynvml maps the unversioned name to ``_v3``; older drivers fall back to ``_v2``.

        Returns:
            Objects with ``pid`` and ``usedGpuMemory`` (bytes, or ``None`` where the driver
            cannot tell, e.g. WDDM), plus ``gpuInstanceId``/``computeInstanceId``.

        Raises:
            NvmlError: the call failed.
        """
        if self.has("nvmlDeviceGetComputeRunningProcesses"):
            try:
                return list(self.call("nvmlDeviceGetComputeRunningProcesses", handle))
            except NvmlError as exc:
                if exc.kind != FUNCTION_NOT_FOUND:
                    raise
        return list(self.call("nvmlDeviceGetComputeRunningProcesses_v2", handle))

    def graphics_processes(self, handle: Any) -> list[Any]:
        """Return graphics processes on a device (``nvmlDeviceGetGraphicsRunningProcesses``).

        Same shape and fallback (v3, then ``_v2``) as :meth:`compute_processes`; a process
        with both a compute and a graphics context is listed by both calls
        (``nvidia-smi --query-compute-apps`` lists only the compute ones).

        Raises:
            NvmlError: the call failed.
        """
        if self.has("nvmlDeviceGetGraphicsRunningProcesses"):
            try:
                return list(self.call("nvmlDeviceGetGraphicsRunningProcesses", handle))
            except NvmlError as exc:
                if exc.kind != FUNCTION_NOT_FOUND:
                    raise
        return list(self.call("nvmlDeviceGetGraphicsRunningProcesses_v2", handle))

    def new_gpm_metrics_get(self) -> Any:
        """Return an empty ``c_nvmlGpmMetricsGet_t`` (or the fake's equivalent).

        Raises:
            NvmlError: ``function_not_found`` when the binding has no GPM support.
        """
        cls = getattr(self.lib, "c_nvmlGpmMetricsGet_t", None)
        if cls is None:
            raise NvmlError(
                FUNCTION_NOT_FOUND, NVML_ERROR_FUNCTION_NOT_FOUND, "c_nvmlGpmMetricsGet_t"
            )
        return cls()


def field_value(fv: Any) -> float | None:
    """Decode one ``c_nvmlFieldValue_t`` into a float, or ``None`` when it failed.

    Args:
        fv: a field value with ``nvmlReturn``, ``valueType`` and the ``value`` union.

    Returns:
        The value by its ``valueType`` (``dVal``, ``uiVal``, ``ulVal``, ``ullVal``, ``sllVal``,
        ``siVal``, ``usVal``); ``None`` when ``nvmlReturn`` is not ``NVML_SUCCESS`` or the type
        is unknown.
    """
    if int(fv.nvmlReturn) != NVML_SUCCESS:
        return None
    attr = _VALUE_ATTR.get(int(fv.valueType))
    if attr is None:
        return None
    return float(getattr(fv.value, attr))


def field_value_bits(fv: Any) -> int:
    """Return the width in bits of a field value's integer type (for counter wrap-around)."""
    return _VALUE_BITS.get(int(fv.valueType), 64)


_VALUE_ATTR: Final[dict[int, str]] = {
    NVML_VALUE_TYPE_DOUBLE: "dVal",
    NVML_VALUE_TYPE_UNSIGNED_INT: "uiVal",
    NVML_VALUE_TYPE_UNSIGNED_LONG: "ulVal",
    NVML_VALUE_TYPE_UNSIGNED_LONG_LONG: "ullVal",
    NVML_VALUE_TYPE_SIGNED_LONG_LONG: "sllVal",
    NVML_VALUE_TYPE_SIGNED_INT: "siVal",
    NVML_VALUE_TYPE_UNSIGNED_SHORT: "usVal",
}
_VALUE_BITS: Final[dict[int, int]] = {
    NVML_VALUE_TYPE_UNSIGNED_INT: 32,
    NVML_VALUE_TYPE_UNSIGNED_LONG: 64,
    NVML_VALUE_TYPE_UNSIGNED_LONG_LONG: 64,
    NVML_VALUE_TYPE_UNSIGNED_SHORT: 16,
}


def bind(spec: str = "nvml", **fake_options: Any) -> NvmlBinding:
    """Return the binding ``spec`` names.

    Args:
        spec: ``"nvml"`` for the real library, or ``"fake:<profile>"`` for a fake loaded from
            ``agent/samplers/fake_nvml/profiles/<profile>.yaml`` (e.g. ``fake:h200``) or
            from a profile file (``fake:/path/profile.yaml``).
        **fake_options: passed to :class:`agent.samplers.fake_nvml.FakeNvml` (``clock``,
            ``gpus``, fault overrides); rejected for ``"nvml"``.

    Returns:
        A binding; nothing is initialised yet.

    Raises:
        ValueError: an unknown spec, or options given for the real library.
        FileNotFoundError: no such fake profile.
    """
    if spec == "nvml":
        if fake_options:
            raise ValueError("options are only accepted by fake bindings")
        return NvmlBinding(_pynvml, "nvml")
    if spec.startswith("fake:"):
        from kvpressure.agent.samplers.fake_nvml import FakeNvml

        profile = spec.removeprefix("fake:")
        return NvmlBinding(FakeNvml.from_profile(profile, **fake_options), spec)
    raise ValueError(f"unknown NVML binding {spec!r}; expected 'nvml' or 'fake:<profile>'")
