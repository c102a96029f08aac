"""The one chokepoint to NVML: every call the GPU sampler makes goes through a binding.

:class:`NvmlBinding` gives:

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

A binding wraps any module-like object with pynvml's function names: the real library
(:func:`agent.samplers.nvml_codes.library`) or the recorded-behaviour fake
(:class:`agent.samplers.fake_nvml.FakeNvml`), which has the same function names, return shapes
and error classes, so all classification code is shared. This module knows neither: the codes
and the classification live in :mod:`agent.samplers.nvml_codes` (re-exported here, so
``nb.NVML_ERROR_NOT_SUPPORTED`` and ``nb.NvmlError`` keep working), and
:func:`agent.samplers.nvml_factory.bind` picks the library or the fake for a ``gpu.binding``
spec.

This module imports nothing beyond the standard library, :mod:`agent.samplers.nvml_codes` and
:mod:`agent.samplers.base` (no pydantic, httpx or aiohttp), so ``benchmarks/gpu_check.py`` can
run it on a bare GPU machine.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Callable
from typing import Any

from kvpressure.agent.samplers import nvml_codes
from kvpressure.agent.samplers.base import LogOnce
from kvpressure.agent.samplers.nvml_codes import (
    CLOCK_EVENT_REASONS,
    DRIVER_NOT_LOADED,
    FIELD_KINDS,
    FUNCTION_NOT_FOUND,
    GPU_LOST,
    KINDS,
    LIBRARY_KINDS,
    LIBRARY_NOT_FOUND,
    LIBRARY_VERSION_MISMATCH,
    NO_PERMISSION,
    NVML_DEVICE_MIG_ENABLE,
    NVML_ERROR_ARGUMENT_VERSION_MISMATCH,
    NVML_ERROR_DRIVER_NOT_LOADED,
    NVML_ERROR_FUNCTION_NOT_FOUND,
    NVML_ERROR_GPU_IS_LOST,
    NVML_ERROR_INSUFFICIENT_SIZE,
    NVML_ERROR_INVALID_ARGUMENT,
    NVML_ERROR_LIB_RM_VERSION_MISMATCH,
    NVML_ERROR_LIBRARY_NOT_FOUND,
    NVML_ERROR_NO_PERMISSION,
    NVML_ERROR_NOT_FOUND,
    NVML_ERROR_NOT_SUPPORTED,
    NVML_ERROR_RESET_REQUIRED,
    NVML_ERROR_TIMEOUT,
    NVML_ERROR_UNINITIALIZED,
    NVML_ERROR_UNKNOWN,
    NVML_EXCEPTIONS,
    NVML_FI_DEV_NVLINK_LINK_COUNT,
    NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX,
    NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX,
    NVML_FI_DEV_PCIE_COUNT_RX_BYTES,
    NVML_FI_DEV_PCIE_COUNT_TX_BYTES,
    NVML_GPM_METRIC_DRAM_BW_UTIL,
    NVML_GPM_METRIC_SM_OCCUPANCY,
    NVML_GPM_METRICS_GET_VERSION,
    NVML_SUCCESS,
    NVML_TEMPERATURE_GPU,
    NVML_VALUE_TYPE_DOUBLE,
    NVML_VALUE_TYPE_SIGNED_INT,
    NVML_VALUE_TYPE_SIGNED_LONG_LONG,
    NVML_VALUE_TYPE_UNSIGNED_INT,
    NVML_VALUE_TYPE_UNSIGNED_LONG,
    NVML_VALUE_TYPE_UNSIGNED_LONG_LONG,
    NVML_VALUE_TYPE_UNSIGNED_SHORT,
    OTHER,
    TIMEOUT,
    UNINITIALIZED,
    UNSUPPORTED,
    NvmlError,
    classify,
    field_value,
    field_value_bits,
    kind_of,
    make_error,
    nvmlEventTypeXidCriticalError,
    nvmlMemory_v2,
)

__all__ = [
    "CLOCK_EVENT_REASONS",
    "DRIVER_NOT_LOADED",
    "FIELD_KINDS",
    "FUNCTION_NOT_FOUND",
    "GPU_LOST",
    "KINDS",
    "LIBRARY_KINDS",
    "LIBRARY_NOT_FOUND",
    "LIBRARY_VERSION_MISMATCH",
    "NO_PERMISSION",
    "NVML_DEVICE_MIG_ENABLE",
    "NVML_ERROR_ARGUMENT_VERSION_MISMATCH",
    "NVML_ERROR_DRIVER_NOT_LOADED",
    "NVML_ERROR_FUNCTION_NOT_FOUND",
    "NVML_ERROR_GPU_IS_LOST",
    "NVML_ERROR_INSUFFICIENT_SIZE",
    "NVML_ERROR_INVALID_ARGUMENT",
    "NVML_ERROR_LIBRARY_NOT_FOUND",
    "NVML_ERROR_LIB_RM_VERSION_MISMATCH",
    "NVML_ERROR_NOT_FOUND",
    "NVML_ERROR_NOT_SUPPORTED",
    "NVML_ERROR_NO_PERMISSION",
    "NVML_ERROR_RESET_REQUIRED",
    "NVML_ERROR_TIMEOUT",
    "NVML_ERROR_UNINITIALIZED",
    "NVML_ERROR_UNKNOWN",
    "NVML_EXCEPTIONS",
    "NVML_FI_DEV_NVLINK_LINK_COUNT",
    "NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX",
    "NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX",
    "NVML_FI_DEV_PCIE_COUNT_RX_BYTES",
    "NVML_FI_DEV_PCIE_COUNT_TX_BYTES",
    "NVML_GPM_METRICS_GET_VERSION",
    "NVML_GPM_METRIC_DRAM_BW_UTIL",
    "NVML_GPM_METRIC_SM_OCCUPANCY",
    "NVML_SUCCESS",
    "NVML_TEMPERATURE_GPU",
    "NVML_VALUE_TYPE_DOUBLE",
    "NVML_VALUE_TYPE_SIGNED_INT",
    "NVML_VALUE_TYPE_SIGNED_LONG_LONG",
    "NVML_VALUE_TYPE_UNSIGNED_INT",
    "NVML_VALUE_TYPE_UNSIGNED_LONG",
    "NVML_VALUE_TYPE_UNSIGNED_LONG_LONG",
    "NVML_VALUE_TYPE_UNSIGNED_SHORT",
    "OTHER",
    "TIMEOUT",
    "UNINITIALIZED",
    "UNSUPPORTED",
    "NvmlBinding",
    "NvmlError",
    "classify",
    "field_value",
    "field_value_bits",
    "handle_key",
    "kind_of",
    "make_error",
    "nvmlEventTypeXidCriticalError",
    "nvmlMemory_v2",
]

log = logging.getLogger(__name__)


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
        mod = nvml_codes.library()
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
