"""XID events of the GPU sampler: registration, the zero-timeout drain, per-GPU counts.

XIDs are drained once per cycle with zero-timeout ``nvmlEventSetWait_v2`` polls on the
control worker (so sampling never blocks on events) and counted per GPU and XID code. Moved
verbatim out of ``gpu.py``.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from typing import Any, Final

from kvpressure.agent.samplers import nvml_binding as nb
from kvpressure.agent.samplers.gpu_devices import _Gpu
from kvpressure.agent.samplers.gpu_procs import _ProcsMixin
from kvpressure.agent.samplers.gpu_workers import _Job
from kvpressure.agent.samples import Batch

XID_DRAIN_MAX: Final = 256
"""Most XID events read per cycle."""


class _XidMixin(_ProcsMixin):
    """XID handling of :class:`~agent.samplers.gpu.GpuSampler`."""

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
