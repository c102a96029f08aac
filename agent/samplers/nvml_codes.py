"""NVML's vocabulary, shared by the real binding and the fake: codes, error kinds, classification.

The return codes, struct versions, field ids, value types, event types, GPM metric ids and
clocks event reasons the GPU sampler needs, as plain integers (values from ``nvml.h`` /
nvidia-ml-py 13.615); the error :data:`KINDS` every NVML failure is classified into
(:class:`NvmlError`, :func:`classify`); and :func:`field_value`, the decoding of a
``c_nvmlFieldValue_t``.

This is the only module that imports ``pynvml`` (from ``nvidia-ml-py``): for its exception
classes (:func:`classify`, :func:`make_error`) and, through :func:`library`, as the real library
:class:`agent.samplers.nvml_binding.NvmlBinding` wraps. Both
:mod:`agent.samplers.nvml_binding` and the fake (:mod:`agent.samplers.fake_nvml`) import it;
neither imports the other (:mod:`agent.samplers.nvml_factory` picks one). It imports nothing
else beyond the standard library, so ``benchmarks/gpu_check.py`` can run it on a bare GPU
machine.
"""

from __future__ import annotations

from typing import Any, Final

try:  # nvidia-ml-py is a declared dependency, but a missing package must not break the agent
    import pynvml as _pynvml
except ImportError:  # pragma: no cover - exercised only where nvidia-ml-py is not installed
    _pynvml = None


def library() -> Any:
    """The ``pynvml`` module, or ``None`` when nvidia-ml-py is not installed."""
    return _pynvml


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
