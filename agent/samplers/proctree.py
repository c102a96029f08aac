"""CPU time of a process tree (an engine's listening process and its descendants), from procfs.

Not a sampler: the host sampler (:mod:`agent.samplers.host`) calls
:meth:`ProcessTreeCpu.read` for each local engine without a readable cgroup, to tell the
engine's own CPU use from other processes' (the ``psi_cpu_some`` rule reads CPU stall time
as contention only in the share of busy CPU that is not the engine's own).

Sources, under an injected procfs root (no psutil: its functions do not take a root):

* ``<procfs>/<pid>/stat``: ``ppid`` (field 4), ``utime`` + ``stime`` (fields 14, 15, clock
  ticks, every thread of the process) and ``starttime`` (field 22, which tells a reused PID
  from the process it knew);
* every ``<procfs>/<pid>/stat`` once per :data:`TREE_REFRESH_S` (shared by every tree), to
  find the roots' descendants by their ``ppid`` (vLLM's API server listens and its
  ``EngineCore`` child computes; a multi-process server has several).

A member's ``stat`` stays open between cycles and is read with one ``pread`` at offset 0
(procfs writes it anew on every read): opening, reading and closing it each cycle was about
30 µs per process here, 0.55 ms a cycle for 8 engines of two processes at 10 Hz. The
descriptor is bound to the process it was opened on, not to the PID: once that process is
gone (reaped, or its PID given to another) the read fails with ``ESRCH``, the descriptor is
closed and the PID is opened afresh, so a reused PID is never read as the process it was.
Descriptors of processes no tree holds any more are closed when a tree's members change.

The tree's CPU time is kept as a counter per engine that never goes down: each cycle adds
every known member's CPU time since the last cycle, and the whole CPU time of a member seen
for the first time (it started since the last tree refresh, or this is the first reading;
a member is a ``(pid, starttime)``, so a reused PID is a new member). A member that exits
keeps what it had been counted; the CPU it used between its last reading and its exit is
lost, and so is the whole CPU of a child that lived less than :data:`TREE_REFRESH_S` between
two refreshes (it reaches its parent's ``cutime``, not read: it would count a known child
twice). New roots (an engine restarted, a worker that shared the socket exited) rescan the
tree at once and add to the same counter: a counter that dropped would read, to a rate, as
a reset whose increase is the whole new value.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Final

TREE_REFRESH_S: Final = 10.0
"""Seconds between scans of every process's ``ppid`` for the roots' descendants."""

MAX_TREE: Final = 256
"""Most processes counted in one tree (roots first, then breadth-first descendants)."""

MAX_TREES: Final = 1024
"""Most trees (engines) tracked at once; beyond it :meth:`ProcessTreeCpu.read` answers None."""

KEPT_STATS: Final = 256
"""Members' ``stat`` files kept open at most; the members beyond are opened on each read."""

_STAT_BYTES: Final = 4096
"""Read size of one ``/proc/<pid>/stat`` (a line of ~52 numbers and a 16-byte name)."""


@dataclass(frozen=True, slots=True)
class ProcStat:
    """The fields of ``/proc/<pid>/stat`` used here.

    Attributes:
        ppid: parent PID.
        ticks: ``utime + stime``, clock ticks (``os.sysconf("SC_CLK_TCK")`` per second).
        start: ``starttime``, clock ticks after boot (identifies the process behind a PID).
    """

    ppid: int
    ticks: int
    start: int


def parse_stat(text: str | bytes) -> ProcStat | None:
    """Parse one ``/proc/<pid>/stat`` line, as read (bytes) or decoded.

    The command name (field 2) is in parentheses and may itself hold spaces and
    parentheses (and any byte), so fields are counted from the last ``)``; only the fields
    up to ``starttime`` are split off (the line has about 50).

    Returns:
        The :class:`ProcStat`, or ``None`` for a line that does not parse (never raises).
    """
    _, sep, rest = text.rpartition(b")") if isinstance(text, bytes) else text.rpartition(")")
    if not sep:
        return None
    f = rest.split(None, 20)
    if len(f) < 20:
        return None
    try:
        # f[0] is field 3 (state): field n is f[n - 3]
        utime, stime = int(f[11]), int(f[12])
        return ProcStat(ppid=int(f[1]), ticks=utime + stime, start=int(f[19]))
    except ValueError:
        return None


@dataclass(slots=True)
class _Tree:
    roots: frozenset[tuple[int, int]]
    members: dict[int, tuple[int, int]] = field(default_factory=dict)  # pid -> (start, ticks)
    total: int = 0
    scanned: float = -1e18


class ProcessTreeCpu:
    """Cumulative CPU seconds of process trees, one per key (an engine's name).

    Args:
        procfs_root: where procfs is mounted (the PIDs are in its PID namespace).
        clock: monotonic seconds, for the tree refresh (tests).
        clk_tck: clock ticks per second; default ``os.sysconf("SC_CLK_TCK")``.

    Thread-safety: one caller at a time (the host sampler's thread).
    """

    def __init__(
        self,
        procfs_root: str,
        clock: Callable[[], float],
        clk_tck: int | None = None,
    ) -> None:
        self._proc = procfs_root
        self._clock = clock
        self.hz: int = clk_tck or os.sysconf("SC_CLK_TCK") or 100
        """Clock ticks per second (``USER_HZ``: also the unit of ``/proc/stat``)."""
        self._trees: dict[str, _Tree] = {}
        self._map: tuple[float, dict[int, list[int]]] | None = None
        self._fds: dict[int, int] = {}  # member pid -> its stat file, open

    def _open_stat(self, pid: int | str) -> tuple[int, bytes] | None:
        """Open ``<procfs>/<pid>/stat`` and read it.

        Returns ``(descriptor, bytes)``, the descriptor still open; ``None`` when the
        process is gone or unreadable (nothing is left open then).
        """
        try:
            fd = os.open(os.path.join(self._proc, str(pid), "stat"), os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            data = os.pread(fd, _STAT_BYTES, 0)
        except OSError:
            data = b""
        if not data:
            os.close(fd)
            return None
        return fd, data

    def _stat(self, pid: int | str) -> ProcStat | None:
        """Read ``<procfs>/<pid>/stat``; ``None`` when gone, unreadable or unparsable.

        Opened afresh and closed (the scan of every process): kept descriptors are for tree
        members only (:meth:`_member_stat`).
        """
        got = self._open_stat(pid)
        if got is None:
            return None
        os.close(got[0])
        return parse_stat(got[1])

    def _member_stat(self, pid: int) -> ProcStat | None:
        """Read a tree member's ``stat`` through its kept descriptor (see the module doc).

        ``None`` when the process is gone, unreadable or its line does not parse.
        """
        fd = self._fds.get(pid)
        if fd is not None:
            try:
                data = os.pread(fd, _STAT_BYTES, 0)
            except OSError:  # ESRCH: the process this descriptor was opened on is gone
                data = b""
            if data:
                return parse_stat(data)
            self._close(pid)
        got = self._open_stat(pid)
        if got is None:
            return None
        fd, data = got
        if len(self._fds) < KEPT_STATS:
            self._fds[pid] = fd
        else:
            os.close(fd)
        return parse_stat(data)

    def _close(self, pid: int) -> None:
        fd = self._fds.pop(pid, None)
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)

    def _sweep(self) -> None:
        """Close the kept descriptors of processes no tree holds."""
        held = {pid for tree in self._trees.values() for pid in tree.members}
        for pid in [p for p in self._fds if p not in held]:
            self._close(pid)

    def close(self) -> None:
        """Close every kept descriptor (the trees' counters stay)."""
        for pid in list(self._fds):
            self._close(pid)

    def _children(self, fresh: bool) -> dict[int, list[int]]:
        """PID to its children's PIDs, from every ``<procfs>/<pid>/stat``.

        One scan serves every tree refreshed within :data:`TREE_REFRESH_S` of it (engines'
        trees are refreshed together, so one scan per refresh period, not one per engine);
        ``fresh`` scans anyway (new roots: an engine just found or restarted).
        """
        now = self._clock()
        if not fresh and self._map is not None and now - self._map[0] < TREE_REFRESH_S:
            return self._map[1]
        children: dict[int, list[int]] = {}
        try:
            names = os.listdir(self._proc)
        except OSError:
            names = []
        for name in names:
            if not name.isdigit():
                continue
            st = self._stat(name)  # None: gone since the listing
            if st is not None:
                children.setdefault(st.ppid, []).append(int(name))
        self._map = (now, children)
        return children

    def _descendants(self, roots: Iterable[int], fresh: bool) -> list[int]:
        """The roots and their descendants, breadth first, at most :data:`MAX_TREE`."""
        children = self._children(fresh)
        out = list(dict.fromkeys(roots))
        seen = set(out)
        i = 0
        while i < len(out) and len(out) < MAX_TREE:
            for c in children.get(out[i], ()):
                if c not in seen and len(out) < MAX_TREE:
                    seen.add(c)
                    out.append(c)
            i += 1
        return out

    def read(self, key: str, pids: Iterable[int]) -> float | None:
        """Cumulative CPU seconds (user + system) of the trees rooted at ``pids``.

        Args:
            key: whose tree (an engine's name); each key keeps its own counter.
            pids: the roots (the PIDs listening on the engine's port).

        Returns:
            Seconds, a counter that never goes down for ``key`` (new roots, an engine that
            restarted, add their processes' CPU time to it); ``None`` when no root can be
            read (gone, no permission, another PID namespace). Never raises.
        """
        found = {p: st for p in dict.fromkeys(pids) if (st := self._member_stat(p)) is not None}
        if not found:
            return None
        roots = frozenset((p, st.start) for p, st in found.items())
        tree = self._trees.get(key)
        if tree is None:
            if len(self._trees) >= MAX_TREES:
                return None
            tree = self._trees[key] = _Tree(roots)
        now = self._clock()
        new_roots = tree.roots != roots or not tree.members
        if new_roots or now - tree.scanned >= TREE_REFRESH_S:
            tree.roots = roots
            tree.scanned = now
            pids_now = self._descendants(sorted(found), fresh=new_roots)
        else:
            pids_now = [*found, *(p for p in tree.members if p not in found)]
        members: dict[int, tuple[int, int]] = {}
        for pid in pids_now:
            st = found.get(pid) or self._member_stat(pid)
            if st is None:
                continue  # exited: what it used until its last reading stays counted
            known = tree.members.get(pid)
            if known is not None and known[0] == st.start:
                tree.total += max(0, st.ticks - known[1])
            else:
                tree.total += st.ticks  # new since the last refresh (or the first reading)
            members[pid] = (st.start, st.ticks)
        changed = members.keys() != tree.members.keys()
        tree.members = members
        if changed:
            self._sweep()
        return tree.total / self.hz

    def forget(self, keep: Iterable[str]) -> None:
        """Drop the trees of keys not in ``keep`` (engines no longer configured)."""
        wanted = set(keep)
        gone = [k for k in self._trees if k not in wanted]
        for key in gone:
            del self._trees[key]
        if gone:
            self._sweep()
