"""GPU process → engine: PID namespaces and the parent-PID walk, from procfs.

A GPU process whose PID (or one of up to :data:`ANCESTOR_DEPTH` ancestors, read from
``<procfs>/<pid>/stat``, so vLLM's worker processes map to the server) is an engine's belongs to
that engine. Moved verbatim out of ``gpu.py``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Final

from kvpressure.agent.samplers.gpu_devices import _GpuState

ANCESTOR_DEPTH: Final = 8
"""Parent PIDs walked when joining a GPU process to an engine."""
NSPID_RESCAN_S: Final = 10.0
"""Seconds between scans of ``<procfs>/*/status`` ``NSpid:`` lines, done only when NVML lists
a PID that the agent's procfs does not have."""


class _ProcsMixin(_GpuState):
    """Process joins of :class:`~agent.samplers.gpu.GpuSampler`."""

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
