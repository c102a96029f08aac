"""Host sampler: cgroup-aware memory, swap, page faults, PSI, disks, network and NUMA tiers.

Every value is read straight from files under two injected roots, so tests (and an agent
running in a container with the host's ``/proc`` mounted elsewhere) can point the sampler
at any tree. Nothing here uses psutil: its functions do not take a root.

Sources (the ``source`` label of ``kvpressure_source_up``) and the files they read:

=================  ==========================================================================
``meminfo``        ``<procfs>/meminfo``
``cgroup``         ``<procfs>/self/cgroup``, then ``memory.max``/``memory.current`` (v2) or
                   ``memory.limit_in_bytes``/``memory.usage_in_bytes``/``memory.stat`` (v1)
                   of the agent's cgroup and its ancestors under ``<sysfs>/fs/cgroup``
``vmstat``         ``<procfs>/vmstat``
``cpu``            ``<procfs>/stat`` (its ``cpu`` line: every CPU's time by mode)
``psi``            ``<procfs>/pressure/{cpu,memory,io}``
``psi_cgroup``     ``<engine cgroup dir>/{cpu,memory,io}.pressure`` (only when engines are set)
``cgroup_memory``  ``<engine cgroup dir>/memory.{current,max,high,events}`` (cgroup v2; only
                   when engines are set): how close each engine is to its own memory limit
``engine_cpu``     each engine's CPU time (only when engines are set): ``usage_usec`` of
                   ``<engine cgroup dir>/cpu.stat`` when a cgroup is configured and has it,
                   else ``<procfs>/<pid>/stat`` of the PIDs listening on a local engine's
                   port and their descendants (:mod:`agent.samplers.proctree`)
``diskstats``      ``<procfs>/diskstats``, filtered with ``<sysfs>/block``
``netdev``         ``<procfs>/net/dev``
``snmp``           ``<procfs>/net/snmp``
``numa``           ``<sysfs>/devices/system/node/node*/{meminfo,cpulist}``
=================  ==========================================================================

Each source records exactly one status per cycle (``ok``, ``error`` or ``unsupported``;
when a source has several parts, such as three PSI files or several engine cgroups, the
worst part wins and the others' samples are still exported). A source that fails never
stops the others, and bad file contents never make :meth:`HostSampler.collect` raise.

At an interval under :data:`SLOW_INTERVAL_S` (10 Hz), ``cpu``, ``engine_cpu``,
``diskstats``, ``netdev``, ``snmp``, ``numa`` and the cgroup memory limits (the agent's and
the engines') are read once a second (the slower sources' samples held in between, the
limits repeated); at one second or more every source is read every cycle.

Slow-changing decisions are cached and re-evaluated every :data:`REFRESH_S` seconds: which
block devices are whole physical disks, the NUMA node list and their CPU lists, the
agent's cgroup directories, and where each engine's cgroup lives. PSI found unsupported
is re-probed every :data:`PSI_REPROBE_S` seconds, not every cycle.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Container, Iterable
from dataclasses import dataclass
from typing import Final, TypeVar

from kvpressure.agent.discovery import LOOPBACK_HOSTS
from kvpressure.agent.pipeline import Context, Plan, Stage, register
from kvpressure.agent.samplers.base import LogOnce, Sampler
from kvpressure.agent.samplers.proctree import ProcessTreeCpu
from kvpressure.agent.samples import Batch, Sample, SourceStatus

log = logging.getLogger(__name__)

T = TypeVar("T")

SECTOR_BYTES = 512
"""Bytes per sector in ``/proc/diskstats``, whatever the device's logical block size."""

UNLIMITED_BYTES = 1 << 62
"""cgroup memory limits at or above this (v1 prints ``9223372036854771712``) mean none."""

REFRESH_S = 60.0
"""Seconds between re-evaluations of cached directory listings and classifications."""

SLOW_INTERVAL_S: Final = 1.0
"""Seconds between reads of the slower sources when the sampler runs more often: CPU time
(``cpu``, and ``engine_cpu``: each engine's process tree, the largest part of a node's host
cycle), disks (``diskstats``), network (``netdev``, ``snmp``), NUMA tiers (``numa``) and the
cgroup memory limits. Memory, swap, paging, PSI and cgroup charges are the pressure signals
and are read every cycle. Of the slower sources, the counters are read by the attribution
rules only as rates over whole request phases (the host's and the engine's CPU time
together, so their rates cover the same intervals; the default ``attribution.settle_s``
waits for the read after a request's end), and the gauges (NUMA tiers, limits) change when
memory is onlined or an operator sets a limit. Between reads their last samples are held
(:meth:`agent.samples.Batch.hold`): exported, but not recorded in the timeline again, so
rates span their real reads."""

PSI_REPROBE_S = 600.0
"""Seconds between probes of a PSI found unsupported (missing or disabled at boot)."""

MAX_INTERFACES = 64
"""Most network interfaces exported per cycle (physical ones first, then file order)."""

PSI_RESOURCES = ("cpu", "memory", "io")

_MEMINFO_KEYS = frozenset({"MemTotal", "MemFree", "MemAvailable", "SwapTotal", "SwapFree"})
_ALLOCSTALL_KEYS = frozenset(
    {
        "allocstall",  # kernels before 4.8
        "allocstall_dma",
        "allocstall_dma32",
        "allocstall_normal",
        "allocstall_movable",
        "allocstall_device",
    }
)
_VMSTAT_KEYS = frozenset({"pgmajfault", "pswpin", "pswpout"}) | _ALLOCSTALL_KEYS
_NODE_KEYS = frozenset({"MemTotal", "MemFree", "MemUsed"})
_HIER = frozenset({"hierarchical_memory_limit"})
CGROUP_MEMORY_EVENTS = ("high", "max", "oom", "oom_kill")
"""``memory.events`` keys exported (cgroup v2): reclaim above ``memory.high``, usage hitting
``memory.max``, OOM situations and OOM kills."""

CPU_MODES = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")
"""``/proc/stat`` ``cpu`` line columns exported, in the kernel's order (``guest`` and
``guest_nice`` are already in ``user`` and ``nice``)."""

EngineProcesses = Callable[[str, bool], tuple[int, ...]]
"""``(engine, gone) -> PIDs`` listening on the engine's port
(:meth:`agent.kube.EnginePods.pids`)."""

_UNIT_SUFFIXES = (".service", ".scope", ".slice")
_NON_PHYSICAL_DISK = re.compile(r"(loop|ram|zram|dm-|md|sr|nbd)\d+")
_PARTITION = re.compile(r"((sd|vd|hd|xvd)[a-z]+\d+|.*\dp\d+)")
_NODE_DIR = re.compile(r"node(\d+)")

_open = open
"""The opener :func:`_read_text` uses; tests replace it to simulate ``read()`` errors."""


KEPT_FILES: Final = 256
"""Files kept open between cycles at most (all are closed and reopened beyond)."""
_kept: dict[str, int] = {}
_kept_lock = threading.Lock()


def _read_text(path: str) -> str:
    """Return the whole file at ``path``; undecodable bytes become U+FFFD.

    The file stays open and is read again from offset 0 with ``pread`` (a ``/proc``,
    sysfs or cgroup file is generated anew on every read): at 10 Hz the open and close of
    ~20 files was about a third of a host cycle. A kept file that lost its last link
    (deleted or replaced) or fails to read is closed and opened again, so a file that
    went away still raises ``FileNotFoundError`` as a fresh open would. While ``_open`` is
    replaced (tests simulating ``read()`` errors), every read opens the file through it.

    Raises:
        OSError: as ``open``/``read`` would (``FileNotFoundError``,
            ``PermissionError``, ``EOPNOTSUPP`` from a PSI file on a kernel booted
            without PSI).
    """
    if _open is not open:
        with _open(path, "rb") as f:
            data = f.read()
        return data.decode("utf-8", "replace")
    with _kept_lock:
        fd = _kept.pop(path, None)
    if fd is not None:
        try:
            if os.fstat(fd).st_nlink > 0:
                data = _pread_all(fd)
                _keep(path, fd)
                return data.decode("utf-8", "replace")
        except OSError:
            pass  # reopened below: a fresh open says what is wrong now
        _close(fd)
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        data = _pread_all(fd)
    except BaseException:
        _close(fd)
        raise
    _keep(path, fd)
    return data.decode("utf-8", "replace")


def _pread_all(fd: int) -> bytes:
    chunks: list[bytes] = []
    offset = 0
    while True:
        data = os.pread(fd, 65536, offset)
        if not data:
            return b"".join(chunks)
        chunks.append(data)
        offset += len(data)


def _keep(path: str, fd: int) -> None:
    with _kept_lock:
        if len(_kept) >= KEPT_FILES:
            for old in _kept.values():
                _close(old)
            _kept.clear()
        other = _kept.get(path)
        _kept[path] = fd
    if other is not None:  # another thread kept the same path meanwhile
        _close(other)


def _close(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)


def _reason(exc: BaseException) -> str:
    """Map an exception to a short, bounded ``reason`` for a source status."""
    if isinstance(exc, FileNotFoundError):
        return "not_found"
    if isinstance(exc, PermissionError):
        return "permission_denied"
    if isinstance(exc, OSError):
        return "read_error"
    if isinstance(exc, ValueError):
        return "parse_error"
    return "internal_error"


def _int(token: str) -> int | None:
    try:
        return int(token)
    except ValueError:
        return None


# --- parsers ---------------------------------------------------------------------------


def parse_meminfo(text: str, keys: Container[str] | None = None) -> dict[str, int]:
    """Parse ``/proc/meminfo`` (or one NUMA node's meminfo with the prefix removed).

    Args:
        text: the file's contents, ``Key:   value [kB]`` per line.
        keys: parse only these keys (faster); None parses every line.

    Returns:
        Key to value, in bytes for ``kB`` lines and as-is for unitless lines
        (``HugePages_Total``). Values are not validated: lxcfs can show ``0`` or negative
        numbers, and callers decide what is usable. Malformed lines are skipped.
    """
    out: dict[str, int] = {}
    for line in text.splitlines():
        key, sep, rest = line.partition(":")
        key = key.strip()
        if not sep or (keys is not None and key not in keys):
            continue
        parts = rest.split()
        if not parts:
            continue
        value = _int(parts[0])
        if value is None:
            continue
        if len(parts) > 1 and parts[1] == "kB":
            value *= 1024
        out[key] = value
    return out


def parse_node_meminfo(text: str, keys: Container[str] | None = None) -> dict[str, int]:
    """Parse ``/sys/devices/system/node/nodeN/meminfo`` (``Node 0 MemTotal: 6514904 kB``).

    Args:
        text: the file's contents.
        keys: parse only these keys; None parses every line.

    Returns:
        Key to value in bytes, as :func:`parse_meminfo`.
    """
    lines = []
    for line in text.splitlines():
        parts = line.split(None, 2)
        if len(parts) == 3 and parts[0] == "Node":
            lines.append(parts[2])
    return parse_meminfo("\n".join(lines), keys)


def parse_kv(text: str, keys: Container[str] | None = None) -> dict[str, int]:
    """Parse ``key value`` lines, as in ``/proc/vmstat`` or a cgroup's ``memory.stat``.

    Args:
        text: the file's contents.
        keys: parse only these keys (faster); None parses every line.

    Returns:
        Key to integer value; lines that are not two fields with an integer are skipped.
    """
    out: dict[str, int] = {}
    if keys is not None and isinstance(keys, frozenset | tuple) and not _ODD_BREAK.search(text):
        # the lines that start with a key then a space (or end there), found by one regex
        # scan: every other line is skipped in C, not in a Python loop (/proc/vmstat has
        # ~180 lines for 6 keys). With no line break but "\n" in the text, these are
        # exactly the lines the loop below would look at, in order.
        lines: Iterable[str] = _key_lines(keys).findall(text)
    else:
        lines = text.splitlines()
    for line in lines:
        if keys is not None and line.partition(" ")[0] not in keys:
            continue
        parts = line.split()
        if len(parts) == 2:
            value = _int(parts[1])
            if value is not None:
                out[parts[0]] = value
    return out


_ODD_BREAK: Final = re.compile("[\r\v\f\x1c-\x1e\x85\u2028\u2029]")
"""Characters other than ``\n`` at which ``str.splitlines`` breaks a line."""


@functools.lru_cache(maxsize=64)
def _key_lines(keys: frozenset[str] | tuple[str, ...]) -> re.Pattern[str]:
    """A pattern whose ``findall`` gives the lines whose first space-separated token is a key."""
    alternatives = "|".join(re.escape(k) for k in sorted(keys))
    return re.compile(f"^(?:{alternatives})(?: [^\n]*)?$", re.MULTILINE)


@dataclass(frozen=True, slots=True)
class PsiLine:
    """One line of a PSI file (``some avg10=0.92 avg60=0.91 avg300=0.73 total=933490489``).

    Attributes:
        avg10: percent (0-100) of the last 10 s with stalled tasks, or None if unreadable.
        total_us: cumulative stall time in microseconds, or None if unreadable.
    """

    avg10: float | None
    total_us: int | None


def parse_psi(text: str) -> dict[str, PsiLine]:
    """Parse a PSI file (``/proc/pressure/<resource>`` or ``<cgroup>/<resource>.pressure``).

    Args:
        text: the file's contents.

    Returns:
        ``"some"``/``"full"`` to the parsed line. A kind the file does not have is absent
        (cpu often has only ``some``); lines with neither avg10 nor total are skipped.
        Dropping the meaningless system-level cpu ``full`` is the caller's job.
    """
    out: dict[str, PsiLine] = {}
    for line in text.splitlines():
        parts = line.split()
        if not parts or parts[0] not in ("some", "full"):
            continue
        avg10: float | None = None
        total: int | None = None
        for token in parts[1:]:
            key, _, value = token.partition("=")
            if key == "avg10":
                try:
                    avg10 = float(value)
                except ValueError:
                    avg10 = None
            elif key == "total":
                total = _int(value)
        if avg10 is not None or total is not None:
            out[parts[0]] = PsiLine(avg10, total)
    return out


@dataclass(frozen=True, slots=True)
class DiskStats:
    """One ``/proc/diskstats`` line (kernel ``Documentation/ABI/testing/procfs-diskstats``).

    Counts are I/Os, ``*_ms`` are milliseconds, sectors are 512 bytes. The discard group
    (kernel 4.18+) and flush group (5.5+) are None when the line does not have them.
    """

    name: str
    reads_completed: int
    reads_merged: int
    sectors_read: int
    read_ms: int
    writes_completed: int
    writes_merged: int
    sectors_written: int
    write_ms: int
    in_flight: int
    io_ms: int
    weighted_ms: int
    discards_completed: int | None = None
    discards_merged: int | None = None
    sectors_discarded: int | None = None
    discard_ms: int | None = None
    flushes_completed: int | None = None
    flush_ms: int | None = None

    @property
    def read_bytes(self) -> int:
        """Bytes read (sectors read x 512)."""
        return self.sectors_read * SECTOR_BYTES

    @property
    def written_bytes(self) -> int:
        """Bytes written (sectors written x 512)."""
        return self.sectors_written * SECTOR_BYTES


def parse_diskstats(
    text: str, memo: dict[str, DiskStats | bool] | None = None
) -> tuple[list[DiskStats], int]:
    """Parse ``/proc/diskstats`` of any kernel since 2.6.25.

    Args:
        text: the file's contents.
        memo: the last call's lines and what each parsed to, kept by the caller and
            replaced here by this call's: a line equal to one of the last call's (an idle
            disk's, a loop device's) is not parsed again. ``None``: every line is parsed.
            The result is the same either way (a line's parse depends on the line alone).

    Returns:
        The parsed lines and the number of malformed lines skipped. A line needs at least
        14 fields (major, minor, name and 11 counters); the discard (4) and flush (2)
        groups are read when present and fields beyond them are ignored. Never raises.
    """
    out: list[DiskStats] = []
    bad = 0
    last = memo if memo is not None else {}
    seen: dict[str, DiskStats | bool] = {}
    for line in text.splitlines():
        got = last.get(line)
        if got is None:
            got = _parse_diskstats_line(line)
        seen[line] = got
        if got is True:  # blank
            continue
        if got is False:
            bad += 1
            continue
        out.append(got)
    if memo is not None:
        memo.clear()
        memo.update(seen)
    return out, bad


def _parse_diskstats_line(line: str) -> DiskStats | bool:
    """Parse one ``/proc/diskstats`` line (see :func:`parse_diskstats`).

    Returns:
        Its :class:`DiskStats`; ``True`` when the line is blank, ``False`` when malformed.
    """
    parts = line.split()
    if not parts:
        return True
    n: list[int] = []
    for token in parts[3:20]:
        value = _int(token)
        if value is None or value < 0:
            break
        n.append(value)
    if len(parts) < 14 or len(n) < 11:
        return False
    discard = len(n) >= 15
    flush = len(n) >= 17
    return DiskStats(
        name=parts[2],
        reads_completed=n[0],
        reads_merged=n[1],
        sectors_read=n[2],
        read_ms=n[3],
        writes_completed=n[4],
        writes_merged=n[5],
        sectors_written=n[6],
        write_ms=n[7],
        in_flight=n[8],
        io_ms=n[9],
        weighted_ms=n[10],
        discards_completed=n[11] if discard else None,
        discards_merged=n[12] if discard else None,
        sectors_discarded=n[13] if discard else None,
        discard_ms=n[14] if discard else None,
        flushes_completed=n[15] if flush else None,
        flush_ms=n[16] if flush else None,
    )


@dataclass(frozen=True, slots=True)
class NetDevStats:
    """Counters of one interface in ``/proc/net/dev`` (bytes and packet counts)."""

    interface: str
    rx_bytes: int
    rx_errs: int
    rx_drop: int
    tx_bytes: int
    tx_errs: int
    tx_drop: int


def parse_netdev(text: str) -> list[NetDevStats]:
    """Parse ``/proc/net/dev``.

    Args:
        text: the file's contents: two header lines, then ``iface: 16 counters``.

    Returns:
        One entry per interface, in file order; lines with fewer than 12 integer counters
        after the name are skipped.
    """
    out: list[NetDevStats] = []
    for line in text.splitlines():
        name, sep, rest = line.partition(":")
        if not sep or "|" in line:
            continue
        values = [_int(p) for p in rest.split()]
        if len(values) < 12 or any(v is None for v in values[:12]):
            continue
        c = [v or 0 for v in values]
        out.append(NetDevStats(name.strip(), c[0], c[2], c[3], c[8], c[10], c[11]))
    return out


def parse_snmp(text: str) -> dict[str, dict[str, int]]:
    """Parse ``/proc/net/snmp``: pairs of ``Proto: names...`` and ``Proto: values...`` lines.

    Args:
        text: the file's contents.

    Returns:
        Protocol (``Tcp``) to counter name (``RetransSegs``) to value. Values are matched to
        names by position within each pair, so the order of columns does not matter.
        A pair whose lengths differ is skipped.
    """
    headers: dict[str, list[str]] = {}
    out: dict[str, dict[str, int]] = {}
    for line in text.splitlines():
        proto, sep, rest = line.partition(":")
        if not sep:
            continue
        proto = proto.strip()
        fields = rest.split()
        if proto not in headers:
            headers[proto] = fields
            continue
        names = headers.pop(proto)
        if len(names) != len(fields):
            continue
        parsed = {n: v for n, f in zip(names, fields, strict=True) if (v := _int(f)) is not None}
        out.setdefault(proto, {}).update(parsed)
    return out


def parse_proc_stat_cpu(text: str) -> dict[str, int]:
    """Parse the aggregate ``cpu`` line of ``/proc/stat`` into :data:`CPU_MODES` ticks.

    Args:
        text: the file (only its line starting with ``cpu`` and a space is read).

    Returns:
        Mode to clock ticks (``USER_HZ``) summed over every CPU, for the columns the line
        has (kernels before 2.6.11 lack ``steal``); ``{}`` when there is no such line or
        a column is not a non-negative integer.
    """
    for line in text.splitlines():
        if not line.startswith("cpu "):
            continue
        out: dict[str, int] = {}
        for mode, token in zip(CPU_MODES, line.split()[1:], strict=False):
            n = _int(token)
            if n is None or n < 0:
                return {}
            out[mode] = n
        return out
    return {}


def parse_cpu_stat_usage(text: str) -> int | None:
    """``usage_usec`` of a cgroup v2 ``cpu.stat`` (microseconds); ``None`` when absent."""
    got = parse_kv(text, ("usage_usec",)).get("usage_usec")
    return got if got is not None and got >= 0 else None


def _on_loopback(instance: str) -> bool:
    """True when ``engine_pids`` can resolve an ``instance`` label's (``host:port``) host.

    The hosts are :data:`agent.discovery.LOOPBACK_HOSTS`, the ones
    :func:`agent.discovery.engine_pids` resolves.
    """
    host = instance.rsplit(":", 1)[0].strip("[]")
    return host in LOOPBACK_HOSTS


def parse_proc_cgroup(text: str) -> list[tuple[tuple[str, ...], str]]:
    """Parse ``/proc/<pid>/cgroup`` (``hierarchy-id:controllers:path`` per line).

    Args:
        text: the file's contents.

    Returns:
        ``(controllers, path)`` per line; the v2 line has no controllers (``0::/x``).
    """
    out: list[tuple[tuple[str, ...], str]] = []
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3 or not parts[2].startswith("/"):
            continue
        controllers = tuple(c for c in parts[1].split(",") if c)
        out.append((controllers, parts[2].strip()))
    return out


def is_physical_disk_name(name: str) -> bool:
    """Guess from its name alone whether a block device is a whole physical disk.

    Used only when ``/sys/block`` cannot be read: excludes ``loop``/``ram``/``zram``/
    ``dm-``/``md``/``sr``/``nbd`` devices and partitions (``sda1``, ``nvme0n1p1``,
    ``mmcblk0p1``).

    Args:
        name: the device name as ``/proc/diskstats`` shows it.

    Returns:
        True for a name that looks like a whole physical disk.
    """
    return not (_NON_PHYSICAL_DISK.fullmatch(name) or _PARTITION.fullmatch(name))


def _ancestors(mount: str, path: str) -> list[str]:
    """``mount/a/b/c`` to ``[mount/a/b/c, mount/a/b, mount/a, mount]``."""
    parts = [p for p in path.split("/") if p and p not in (".", "..")]
    return [os.path.join(mount, *parts[:i]) for i in range(len(parts), -1, -1)]


def _limit(value: int | None) -> int | None:
    return value if value is not None and 0 <= value < UNLIMITED_BYTES else None


# --- the sampler -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CgroupMemory:
    """Memory accounting of the agent's cgroup, from ``<sysfs>/fs/cgroup``.

    Attributes:
        limit: the lowest memory limit of the agent's cgroup and its ancestors, bytes;
            None when unlimited.
        limit_usage: bytes charged to the cgroup that holds ``limit``; None if unknown.
        usage: bytes charged to the agent's own cgroup (the deepest one found).
    """

    limit: int | None
    limit_usage: int | None
    usage: int | None


@dataclass(frozen=True, slots=True)
class _CgroupLimits:
    """What a full read of the agent's cgroup found, for the usage reads between.

    Attributes:
        limit: as :attr:`CgroupMemory.limit`.
        own_usage_file: the usage file of the agent's own (deepest) cgroup that read.
        limit_usage_file: the usage file of the cgroup that holds ``limit``; None when
            unlimited or when that cgroup's usage did not read.
    """

    limit: int | None
    own_usage_file: str
    limit_usage_file: str | None


class _Status:
    """The worst status of a source's parts: error over unsupported over ok."""

    _RANK = {"ok": 0, "unsupported": 1, "error": 2}

    def __init__(self) -> None:
        self.state = "ok"
        self.reason = ""
        self.detail = ""

    def set(self, state: str, reason: str, detail: str = "") -> None:
        if self._RANK[state] > self._RANK[self.state]:
            self.state, self.reason, self.detail = state, reason, detail

    def read(self, path: str, missing: tuple[str, str] | None = None) -> str | None:
        """Return the stripped contents of an optional file, or None.

        A missing file is not an error (``missing``, when given, is the ``(reason,
        detail)`` of an ``unsupported`` status to record); any other read error is
        recorded as an ``error``.
        """
        try:
            return _read_text(path).strip()
        except FileNotFoundError:
            if missing is not None:
                self.set("unsupported", *missing)
            return None
        except OSError as exc:
            self.set("error", _reason(exc), f"{path}: {exc}")
            return None


class HostSampler(Sampler):
    """Reads host memory, swap, paging, PSI, disk, network and NUMA-tier figures.

    All values are exported in base units (bytes, seconds, ratios 0-1, counts) under the
    ``kvpressure_host_*``, ``kvpressure_psi_*``, ``kvpressure_disk_*``, ``kvpressure_net_*``
    and ``kvpressure_memory_tier_bytes`` catalogue names. See the module docstring for the
    file behind each source.

    Memory is cgroup-aware: ``kvpressure_host_memory_total_bytes`` is
    ``min(MemTotal, lowest limit of the agent's cgroup and its ancestors)``, and
    ``kvpressure_host_memory_available_bytes`` is ``MemAvailable`` unless that limit is the
    binding one, when it is ``min(limit - usage of the limiting cgroup, MemAvailable)``,
    never negative. The raw ``/proc/meminfo`` figures are exported beside them.

    NUMA: a node with CPUs is ``tier="dram"``, a CPU-less node ``tier="cxl"`` (each with
    its ``node``); swap is ``tier="swap"`` without a node. Without
    ``/sys/devices/system/node`` the ``numa`` source is unsupported (``no_numa_sysfs``)
    and one ``tier="dram"`` series set without ``node`` is derived from ``/proc/meminfo``
    (``MemTotal``, ``MemFree``), so the dram tier exists on every host.

    Args:
        procfs_root: where procfs is mounted (``/proc``; ``/host/proc`` in a container).
        sysfs_root: where sysfs is mounted; cgroups are under ``<sysfs_root>/fs/cgroup``.
        engine_cgroups: engine name to its cgroup, for per-engine PSI
            (``scope=<engine>``). Either a path relative to the cgroup v2 mount
            (``system.slice/llama.service``, a leading ``/`` is allowed) or a systemd
            unit name (``llama.service``), looked up in ``system.slice`` and then in the
            other top-level slices. On a hybrid host the v2 mount is
            ``<sysfs_root>/fs/cgroup/unified``.
        interval_s: seconds between collections.
        timeout_s: seconds after which a collection counts as failed.
        memory_cgroup: ``"self"`` caps the effective memory at the agent's own cgroup and
            its ancestors (the agent runs inside the engine's container); ``"none"`` uses
            ``/proc/meminfo`` alone (the agent runs in its own unit or pod, whose small
            limit says nothing about the engine's memory).
        engines: every engine's name to its ``instance`` label, for
            ``kvpressure_engine_process_cpu_seconds_total`` (source ``engine_cpu``).
        engine_processes: the PIDs listening on an engine's port (see
            :data:`EngineProcesses`), for engines whose CPU time no cgroup gives; ``None``
            reads only cgroups.

    Raises:
        ValueError: ``memory_cgroup`` is neither ``"self"`` nor ``"none"``.
    """

    name = "host"

    def __init__(
        self,
        procfs_root: str = "/proc",
        sysfs_root: str = "/sys",
        engine_cgroups: dict[str, str] | None = None,
        interval_s: float = 1.0,
        timeout_s: float | None = None,
        memory_cgroup: str = "self",
        engines: dict[str, str] | None = None,
        engine_processes: EngineProcesses | None = None,
    ) -> None:
        super().__init__(interval_s, timeout_s)
        if memory_cgroup not in ("self", "none"):
            raise ValueError(f"memory_cgroup must be 'self' or 'none', not {memory_cgroup!r}")
        self.memory_cgroup = memory_cgroup
        self.procfs_root = procfs_root
        self.sysfs_root = sysfs_root
        self.engine_cgroups = dict(engine_cgroups or {})
        self.engines = dict(engines or {})
        self.engine_processes = engine_processes
        self._now: Callable[[], float] = time.monotonic
        self._trees = ProcessTreeCpu(procfs_root, clock=lambda: self._now())  # noqa: PLW0108 - tests swap _now
        self._log_once = LogOnce(log)
        self._logged: dict[str, set[str]] = {}

        proc, sys_ = procfs_root, sysfs_root
        self._p_meminfo = os.path.join(proc, "meminfo")
        self._p_self_cgroup = os.path.join(proc, "self", "cgroup")
        self._p_vmstat = os.path.join(proc, "vmstat")
        self._p_stat = os.path.join(proc, "stat")
        self._p_pressure = os.path.join(proc, "pressure")
        self._p_diskstats = os.path.join(proc, "diskstats")
        self._p_netdev = os.path.join(proc, "net", "dev")
        self._p_snmp = os.path.join(proc, "net", "snmp")
        self._p_cgroup_fs = os.path.join(sys_, "fs", "cgroup")
        self._p_block = os.path.join(sys_, "block")
        self._p_class_net = os.path.join(sys_, "class", "net")
        self._p_nodes = os.path.join(sys_, "devices", "system", "node")

        # Cached decisions: (value, expires at monotonic time).
        self._disks: tuple[frozenset[str] | None, float] = (None, 0.0)
        # the last /proc/diskstats lines and their parse (parse_diskstats: unchanged lines
        # are not parsed again)
        self._diskstats_lines: dict[str, DiskStats | bool] = {}
        self._nodes: tuple[list[tuple[str, str, str]] | None, float] = (None, 0.0)
        self._cg_dirs: tuple[str, list[tuple[int, str]], float] = ("", [], 0.0)
        self._v2_root: tuple[str, float] = ("", 0.0)
        self._engine_dirs: dict[str, tuple[str | None, float]] = {}
        self._ifaces: tuple[tuple[str, ...], list[str], float] = ((), [], 0.0)
        self._psi_off: tuple[str, float] | None = None  # (reason, re-probe at)
        # the slower sources (SLOW_INTERVAL_S): read at _slow_at, held in between
        self._slow_every = interval_s < SLOW_INTERVAL_S
        self._slow_at = 0.0
        self._slow_held: tuple[tuple[Sample, ...], tuple[SourceStatus, ...]] | None = None
        # the agent's cgroup limits, read with the slower sources (see _collect_cgroup)
        self._cg_limits: _CgroupLimits | None = None
        # each engine cgroup's (dir, limits, status of their reads), read with the slower ones
        self._engine_limits: dict[
            str, tuple[str, tuple[tuple[str, int], ...], tuple[str, str, str]]
        ] = {}
        self._psi_hint = ""

    # --- framework ---------------------------------------------------------------------

    def close(self) -> None:
        """Close the engines' process ``stat`` files kept open (:mod:`.proctree`)."""
        self._trees.close()

    def collect(self, batch: Batch) -> None:
        """Read every source and add its samples and one status per source to ``batch``.

        Never raises for missing, unreadable or malformed files: each source records
        ``error`` (e.g. ``not_found``, ``permission_denied``, ``parse_error``,
        ``invalid_memtotal``, ``cgroup_not_found``) or ``unsupported`` (e.g.
        ``kernel_without_psi``, ``psi_disabled_boot_param``, ``empty``, ``no_numa_sysfs``),
        logged once per reason until the source recovers, and the other sources still run.
        ``psi_cgroup`` is recorded only when ``engine_cgroups`` is set, ``engine_cpu``
        only when ``engines`` is.

        Args:
            batch: the batch to fill.
        """
        held = self._slow_held
        slow = self._slow_due() or held is None
        info = self._run("meminfo", batch, self._collect_meminfo)
        cgroup = (
            self._run("cgroup", batch, lambda b: self._collect_cgroup(b, slow))
            if self.memory_cgroup == "self"
            else None
        )
        self._add_effective_memory(batch, info, cgroup)
        self._run("vmstat", batch, self._collect_vmstat)
        self._run("psi", batch, self._collect_psi)
        if self.engine_cgroups:
            self._run("psi_cgroup", batch, self._collect_psi_cgroup)
            self._run("cgroup_memory", batch, lambda b: self._collect_engine_memory(b, slow))
        if not slow and held is not None:
            batch.hold(*held)
            return
        n, m = len(batch.samples), len(batch.sources)
        self._run("cpu", batch, self._collect_cpu)
        if self.engines:
            self._run("engine_cpu", batch, self._collect_engine_cpu)
        self._run("diskstats", batch, self._collect_diskstats)
        self._run("netdev", batch, self._collect_netdev)
        self._run("snmp", batch, self._collect_snmp)
        self._run("numa", batch, lambda b: self._collect_numa(b, info))
        self._slow_held = (tuple(batch.samples[n:]), tuple(batch.sources[m:]))

    def _slow_due(self) -> bool:
        """Whether this cycle reads the slower sources (see :data:`SLOW_INTERVAL_S`).

        Always at an interval of :data:`SLOW_INTERVAL_S` or more; otherwise when about a
        second has passed since they were last read (half an interval early, so 10
        cycles at 0.1 s make one read however their start times jitter).
        """
        if not self._slow_every:
            return True
        now = self._now()
        if now < self._slow_at:
            return False
        self._slow_at = now + SLOW_INTERVAL_S - self.interval_s / 2
        return True

    def _run(self, source: str, batch: Batch, fn: Callable[[Batch], T]) -> T | None:
        """Run one source; an exception becomes a source error, never a sampler failure."""
        try:
            return fn(batch)
        except Exception as exc:  # noqa: BLE001 - one source never stops the others
            self._error(batch, source, _reason(exc), f"{type(exc).__name__}: {exc}")
            return None

    def _ok(self, batch: Batch, source: str) -> None:
        batch.source_ok(source)
        for key in self._logged.pop(source, ()):
            self._log_once.reset(key)

    def _error(self, batch: Batch, source: str, reason: str, detail: str = "") -> None:
        batch.source_error(source, reason)
        key = f"{source}:error:{reason}"
        self._logged.setdefault(source, set()).add(key)
        self._log_once(
            key,
            logging.WARNING,
            "host source %s failed (%s): %s; further "
            "failures with this reason are not logged until it recovers",
            source,
            reason,
            detail,
        )

    def _unsupported(self, batch: Batch, source: str, reason: str, hint: str = "") -> None:
        batch.source_unsupported(source, reason)
        key = f"{source}:unsupported:{reason}"
        self._logged.setdefault(source, set()).add(key)
        self._log_once(
            key, logging.INFO, "host source %s unsupported (%s). %s", source, reason, hint
        )

    def _finish(self, batch: Batch, source: str, status: _Status) -> None:
        if status.state == "ok":
            self._ok(batch, source)
        elif status.state == "error":
            self._error(batch, source, status.reason, status.detail)
        else:
            self._unsupported(batch, source, status.reason, status.detail)

    # --- memory ------------------------------------------------------------------------

    def _collect_meminfo(self, batch: Batch) -> dict[str, int]:
        info = parse_meminfo(_read_text(self._p_meminfo), _MEMINFO_KEYS)
        total = info.get("MemTotal")
        available = info.get("MemAvailable")
        valid = total is not None and total > 0
        if valid:
            batch.add("kvpressure_host_meminfo_total_bytes", total)
            if available is not None and available >= 0:
                batch.add("kvpressure_host_meminfo_available_bytes", available)

        swap_total, swap_free = info.get("SwapTotal"), info.get("SwapFree")
        if swap_total is not None and swap_free is not None and min(swap_total, swap_free) >= 0:
            used = max(0, swap_total - swap_free)
            free = min(swap_free, swap_total)
            batch.add("kvpressure_host_swap_total_bytes", swap_total)
            batch.add("kvpressure_host_swap_used_bytes", used)
            for state, value in (("total", swap_total), ("used", used), ("free", free)):
                batch.add("kvpressure_memory_tier_bytes", value, tier="swap", state=state)

        if not info:
            self._error(batch, "meminfo", "parse_error", "no 'Key: value' lines")
        elif not valid:
            # lxcfs on cgroup2 can show MemTotal 0 and negative free: unavailable this tick.
            self._error(batch, "meminfo", "invalid_memtotal", f"MemTotal={total}")
        else:
            self._ok(batch, "meminfo")
        return info

    def _memory_cgroup_dirs(self, text: str) -> list[tuple[int, str]]:
        """Return the agent's memory cgroup dirs and existing ancestors, deepest first.

        Entries are ``(cgroup version, dir)``, cached per ``/proc/self/cgroup`` content for
        REFRESH_S.
        """
        now = self._now()
        cached_text, cached, expires = self._cg_dirs
        if cached_text == text and now < expires:
            return cached
        dirs: list[tuple[int, str]] = []
        for controllers, path in parse_proc_cgroup(text):
            if not controllers:
                mount = self._cgroup_v2_root()
                dirs += [(2, d) for d in _ancestors(mount, path) if os.path.isdir(d)]
            elif "memory" in controllers:
                for name in ("memory", ",".join(controllers)):
                    mount = os.path.join(self._p_cgroup_fs, name)
                    if os.path.isdir(mount):
                        dirs += [(1, d) for d in _ancestors(mount, path) if os.path.isdir(d)]
                        break
        self._cg_dirs = (text, dirs, now + REFRESH_S)
        return dirs

    def _collect_cgroup(self, batch: Batch, slow: bool) -> CgroupMemory | None:
        """The agent's cgroup memory: the lowest limit up its tree, and usages.

        The limit is the lowest of the agent's cgroup and its ancestors; the usages are
        those charged to its own cgroup and to the one whose limit binds. A full read
        (``/proc/self/cgroup``, then every level's limit and usage) comes with the slower
        sources (:data:`SLOW_INTERVAL_S`); in between, only the one or two usage files that
        read found are read again (the limits change when an operator changes them, the
        usage any time). A full read runs every cycle while the last one was not
        clean, and in place of a usage read that fails.
        """
        lim = self._cg_limits
        if not slow and lim is not None:
            got = self._cgroup_usage(batch, lim)
            if got is not None:
                return got
        return self._cgroup_full(batch)

    def _cgroup_usage(self, batch: Batch, lim: _CgroupLimits) -> CgroupMemory | None:
        """The usage half of :meth:`_collect_cgroup`; ``None`` when a file did not read."""

        def usage(path: str) -> int | None:
            try:
                value = _int(_read_text(path).strip())
            except OSError:
                return None
            return value if value is not None and value >= 0 else None

        own = usage(lim.own_usage_file)
        if own is None:
            return None
        if lim.limit_usage_file is None or lim.limit_usage_file == lim.own_usage_file:
            limit_usage: int | None = own if lim.limit_usage_file else None
        elif (limit_usage := usage(lim.limit_usage_file)) is None:
            return None
        result = CgroupMemory(lim.limit, limit_usage, own)
        batch.add("kvpressure_host_cgroup_memory_limit_bytes", result.limit)
        batch.add("kvpressure_host_cgroup_memory_used_bytes", result.usage)
        self._ok(batch, "cgroup")
        return result

    def _cgroup_full(self, batch: Batch) -> CgroupMemory | None:
        """The full read of :meth:`_collect_cgroup`; keeps what the usage reads need."""
        self._cg_limits = None
        try:
            text = _read_text(self._p_self_cgroup)
        except FileNotFoundError:
            self._unsupported(
                batch,
                "cgroup",
                "no_proc_self_cgroup",
                f"{self._p_self_cgroup} does not exist; cgroup limits ignored.",
            )
            return None
        status = _Status()
        found = False
        limits: list[tuple[int, str]] = []  # (limit, dir)
        usages: dict[str, tuple[int, str]] = {}  # dir -> (usage, its file)
        own_usage: tuple[int, str] | None = None

        def as_int(path: str, raw: str) -> int | None:
            value = _int(raw)
            if value is None:
                status.set("error", "parse_error", f"{path}: {raw[:40]!r}")
            return value

        dirs = self._memory_cgroup_dirs(text)
        for i, (version, d) in enumerate(dirs):
            limit_file, usage_file = (
                ("memory.max", "memory.current")
                if version == 2
                else ("memory.limit_in_bytes", "memory.usage_in_bytes")
            )
            path = os.path.join(d, limit_file)
            raw = status.read(path)
            if raw is not None:
                found = True
                value = None if raw == "max" else _limit(as_int(path, raw))
                if value is not None:
                    limits.append((value, d))
            path = os.path.join(d, usage_file)
            raw = status.read(path)
            if raw is not None:
                found = True
                usage = as_int(path, raw)
                if usage is not None and usage >= 0:
                    usages[d] = (usage, path)
                    if own_usage is None:
                        own_usage = usages[d]
            if version == 1 and (i == 0 or dirs[i - 1][0] != 1):
                # v1 leaf: hierarchical_memory_limit covers ancestors we cannot see.
                raw = status.read(os.path.join(d, "memory.stat"))
                hier = (
                    _limit(parse_kv(raw, _HIER).get("hierarchical_memory_limit")) if raw else None
                )
                if hier is not None:
                    found = True
                    limits.append((hier, d))

        if not found and status.state == "ok":
            self._unsupported(
                batch,
                "cgroup",
                "no_memory_controller",
                "no cgroup memory files found; memory is not cgroup-aware.",
            )
            return None
        limit, limit_dir = min(limits) if limits else (None, "")
        at_limit = usages.get(limit_dir)
        result = CgroupMemory(
            limit,
            None if at_limit is None else at_limit[0],
            None if own_usage is None else own_usage[0],
        )
        batch.add("kvpressure_host_cgroup_memory_limit_bytes", result.limit)
        batch.add("kvpressure_host_cgroup_memory_used_bytes", result.usage)
        self._finish(batch, "cgroup", status)
        if status.state == "ok" and own_usage is not None:
            self._cg_limits = _CgroupLimits(
                limit, own_usage[1], None if at_limit is None else at_limit[1]
            )
        return result

    def _add_effective_memory(
        self, batch: Batch, info: dict[str, int] | None, cgroup: CgroupMemory | None
    ) -> None:
        """Export the effective (cgroup-aware) total and available memory."""
        info = info or {}
        mem_total = info.get("MemTotal")
        mem_avail = info.get("MemAvailable")
        if mem_total is None or mem_total <= 0:
            mem_total = mem_avail = None  # lxcfs zero file: the whole file is untrustworthy
        elif mem_avail is not None and mem_avail < 0:
            mem_avail = None
        limit = cgroup.limit if cgroup else None
        if limit is not None and (mem_total is None or limit < mem_total):
            total: int | None = limit
            candidates: list[int] = []
            if cgroup and cgroup.limit_usage is not None:
                candidates.append(max(0, limit - cgroup.limit_usage))
            if mem_avail is not None:
                candidates.append(min(mem_avail, limit))  # the host itself may be shorter
            available = min(candidates) if candidates else None
        else:
            total, available = mem_total, mem_avail
        batch.add("kvpressure_host_memory_total_bytes", total)
        batch.add("kvpressure_host_memory_available_bytes", available)

    def _collect_vmstat(self, batch: Batch) -> None:
        stats = parse_kv(_read_text(self._p_vmstat), _VMSTAT_KEYS)
        batch.add("kvpressure_host_major_page_faults_total", stats.get("pgmajfault"))
        batch.add("kvpressure_host_swap_in_pages_total", stats.get("pswpin"))
        batch.add("kvpressure_host_swap_out_pages_total", stats.get("pswpout"))
        stalls = [v for k, v in stats.items() if k in _ALLOCSTALL_KEYS]
        batch.add("kvpressure_host_allocstalls_total", sum(stalls) if stalls else None)
        if stats:
            self._ok(batch, "vmstat")
        else:
            self._error(batch, "vmstat", "parse_error", "no 'key value' lines")

    # --- PSI ---------------------------------------------------------------------------

    def _psi_disable(self, reason: str, hint: str) -> None:
        self._psi_off = (reason, self._now() + PSI_REPROBE_S)
        self._psi_hint = hint

    def _collect_psi(self, batch: Batch) -> None:
        if self._psi_off is not None and self._now() < self._psi_off[1]:
            batch.source_unsupported("psi", self._psi_off[0])
            return
        if not os.path.isdir(self._p_pressure):
            self._psi_disable(
                "kernel_without_psi",
                (
                    f"{self._p_pressure} does not exist: the kernel was built without "
                    "CONFIG_PSI (needs 4.20+). Memory pressure falls back to /proc/vmstat "
                    f"and MemAvailable; re-probing every {PSI_REPROBE_S:.0f} s."
                ),
            )
            self._unsupported(batch, "psi", "kernel_without_psi", self._psi_hint)
            return
        texts: dict[str, str] = {}
        status = _Status()
        for resource in PSI_RESOURCES:
            path = os.path.join(self._p_pressure, resource)
            try:
                texts[resource] = _read_text(path)
            except OSError as exc:
                if exc.errno == errno.EOPNOTSUPP:
                    self._psi_disable(
                        "psi_disabled_boot_param",
                        (
                            f"reading {path} fails with EOPNOTSUPP: the kernel has "
                            "CONFIG_PSI_DEFAULT_DISABLED; boot with psi=1 to enable PSI. "
                            "Memory pressure falls back to /proc/vmstat and MemAvailable; "
                            f"re-probing every {PSI_REPROBE_S:.0f} s."
                        ),
                    )
                    self._unsupported(batch, "psi", "psi_disabled_boot_param", self._psi_hint)
                    return
                if isinstance(exc, FileNotFoundError):
                    status.set("unsupported", "not_found", f"{path} does not exist")
                else:
                    status.set("error", _reason(exc), f"{path}: {exc}")
        self._psi_off = None
        for resource, text in texts.items():
            self._add_psi(
                batch, resource, text, scope="system", status=status, where=f"{self._p_pressure}/"
            )
        self._finish(batch, "psi", status)

    def _add_psi(
        self, batch: Batch, resource: str, text: str, *, scope: str, status: _Status, where: str
    ) -> None:
        if not text.strip():
            status.set("unsupported", "empty", f"{where}{resource} is empty; not exported")
            return
        lines = parse_psi(text)
        if not lines:
            status.set("error", "parse_error", f"{where}{resource}: {text[:60]!r}")
            return
        for kind, line in lines.items():
            if scope == "system" and resource == "cpu" and kind == "full":
                continue  # undefined at system level (forced to 0 since 5.13 stable fixes)
            total = None if line.total_us is None else line.total_us / 1e6
            avg10 = None if line.avg10 is None else line.avg10 / 100.0
            labels = {"resource": resource, "kind": kind, "scope": scope}
            batch.add("kvpressure_psi_stall_seconds_total", total, **labels)
            batch.add("kvpressure_psi_avg10_ratio", avg10, **labels)

    def _cgroup_v2_root(self) -> str:
        """The cgroup v2 mount: ``<sysfs>/fs/cgroup``, or ``.../unified`` on hybrid hosts."""
        now = self._now()
        root, expires = self._v2_root
        if now < expires:
            return root
        root = self._p_cgroup_fs
        unified = os.path.join(root, "unified")
        if not os.path.exists(os.path.join(root, "cgroup.controllers")) and os.path.exists(
            os.path.join(unified, "cgroup.controllers")
        ):
            root = unified
        self._v2_root = (root, now + REFRESH_S)
        return root

    def _engine_dir(self, engine: str, spec: str) -> str | None:
        """Resolve an engine's cgroup directory; the slice search runs once per REFRESH_S."""
        now = self._now()
        cached, expires = self._engine_dirs.get(engine, (None, 0.0))
        if cached is not None and os.path.isdir(cached):
            return cached
        root = os.path.normpath(self._cgroup_v2_root())
        rel = spec.strip("/")
        is_unit = "/" not in rel and rel.endswith(_UNIT_SUFFIXES)
        candidates = (
            [os.path.join(root, "system.slice", rel), os.path.join(root, rel)]
            if is_unit
            else [os.path.normpath(os.path.join(root, rel))]
        )
        if is_unit and now >= expires:
            try:
                slices = sorted(e for e in os.listdir(root) if e.endswith(".slice"))
            except OSError:
                slices = []
            candidates += [os.path.join(root, s, rel) for s in slices]
        found = None
        for c in candidates:
            inside = c == root or c.startswith(os.path.join(root, ""))  # no ../ escapes
            if inside and os.path.isdir(c):
                found = c
                break
        if found is not None or now >= expires:
            self._engine_dirs[engine] = (found, now + REFRESH_S)
        return found

    def _collect_psi_cgroup(self, batch: Batch) -> None:
        if self._psi_off is not None and self._psi_off[0] == "psi_disabled_boot_param":
            batch.source_unsupported("psi_cgroup", self._psi_off[0])
            return
        status = _Status()
        for engine, spec in self.engine_cgroups.items():
            d = self._engine_dir(engine, spec)
            if d is None:
                status.set("error", "cgroup_not_found", f"engine {engine}: cgroup {spec!r}")
                self._log_once(
                    f"psi_cgroup:missing:{engine}",
                    logging.WARNING,
                    "cgroup %r of engine %s not found under %s",
                    spec,
                    engine,
                    self._cgroup_v2_root(),
                )
                continue
            self._log_once.reset(f"psi_cgroup:missing:{engine}")
            for resource in PSI_RESOURCES:
                path = os.path.join(d, f"{resource}.pressure")
                try:
                    text = _read_text(path)
                except OSError as exc:
                    if exc.errno == errno.EOPNOTSUPP:
                        status.set(
                            "unsupported",
                            "psi_disabled_boot_param",
                            "boot with psi=1 to enable PSI",
                        )
                    elif isinstance(exc, FileNotFoundError):
                        status.set(
                            "unsupported",
                            "no_pressure_files",
                            f"{path} does not exist (cgroup v1 or PSI off)",
                        )
                    else:
                        status.set("error", _reason(exc), f"{path}: {exc}")
                    continue
                self._add_psi(batch, resource, text, scope=engine, status=status, where=f"{d}/")
        self._finish(batch, "psi_cgroup", status)

    def _engine_memory_limits(
        self, d: str
    ) -> tuple[tuple[tuple[str, int], ...], tuple[str, str, str]]:
        """An engine cgroup's ``memory.max`` and ``memory.high``, and how their reads went.

        Returns:
            ``((limit, bytes), ...)`` (an unlimited one absent) and the worst status of the
            two reads as ``(state, reason, detail)``.
        """
        status = _Status()
        limits: list[tuple[str, int]] = []
        for limit in ("max", "high"):
            path = os.path.join(d, f"memory.{limit}")
            raw = status.read(path)
            if raw is None or raw == "max":
                continue
            n = _int(raw)
            if n is None:
                status.set("error", "parse_error", f"{path}: {raw[:40]!r}")
            elif (value := _limit(n)) is not None:
                limits.append((limit, value))
        return tuple(limits), (status.state, status.reason, status.detail)

    def _collect_engine_memory(self, batch: Batch, slow: bool) -> None:
        """Each engine's cgroup v2 memory: charge, limits and limit events.

        ``memory.current`` → ``kvpressure_cgroup_memory_used_bytes{scope}``; ``memory.max``
        and ``memory.high`` → ``kvpressure_cgroup_memory_limit_bytes{scope,limit}`` (absent
        when ``max``: unlimited); ``memory.events`` → ``kvpressure_cgroup_memory_events_total
        {scope,event}`` for :data:`CGROUP_MEMORY_EVENTS`. A cgroup without these files (the
        memory controller not enabled for it) is ``unsupported``; one not found is an error.
        The limits are read with the slower sources (``slow``, :data:`SLOW_INTERVAL_S`) and
        when the engine's cgroup moved; the charge and the events every cycle.
        """
        status = _Status()
        for engine, spec in self.engine_cgroups.items():
            d = self._engine_dir(engine, spec)
            if d is None:
                status.set("error", "cgroup_not_found", f"engine {engine}: cgroup {spec!r}")
                continue
            path = os.path.join(d, "memory.current")
            raw = status.read(
                path,
                missing=(
                    "no_memory_controller",
                    f"{path} does not exist (memory controller not enabled there)",
                ),
            )
            if raw is None:
                continue
            current = _int(raw)
            if current is None or current < 0:
                status.set("error", "parse_error", f"{path}: {raw[:40]!r}")
            else:
                batch.add("kvpressure_cgroup_memory_used_bytes", current, scope=engine)
            known = self._engine_limits.get(engine)
            if slow or known is None or known[0] != d:
                known = self._engine_limits[engine] = (d, *self._engine_memory_limits(d))
            _, limits, (state, reason, detail) = known
            if state != "ok":
                status.set(state, reason, detail)
            for limit, value in limits:
                batch.add("kvpressure_cgroup_memory_limit_bytes", value, scope=engine, limit=limit)
            raw = status.read(os.path.join(d, "memory.events"))
            events = parse_kv(raw, CGROUP_MEMORY_EVENTS) if raw is not None else {}
            for event in CGROUP_MEMORY_EVENTS:
                if event in events and events[event] >= 0:
                    batch.add(
                        "kvpressure_cgroup_memory_events_total",
                        events[event],
                        scope=engine,
                        event=event,
                    )
        self._finish(batch, "cgroup_memory", status)

    # --- CPU time ------------------------------------------------------------------------

    def _collect_cpu(self, batch: Batch) -> None:
        """``/proc/stat``'s ``cpu`` line → ``kvpressure_host_cpu_seconds_total{mode}``."""
        modes = parse_proc_stat_cpu(_read_text(self._p_stat))
        if not modes:
            self._error(batch, "cpu", "parse_error", f"{self._p_stat}: no valid 'cpu' line")
            return
        hz = self._trees.hz
        for mode, ticks in modes.items():
            batch.add("kvpressure_host_cpu_seconds_total", ticks / hz, mode=mode)
        self._ok(batch, "cpu")

    def _engine_cgroup_cpu(self, engine: str, status: _Status) -> float | None:
        """Seconds of CPU charged to the engine's configured cgroup (``cpu.stat``), or None."""
        spec = self.engine_cgroups.get(engine)
        d = self._engine_dir(engine, spec) if spec else None
        if d is None:
            return None
        path = os.path.join(d, "cpu.stat")
        raw = status.read(path, missing=("no_cpu_stat", f"{path} does not exist"))
        if raw is None:
            return None
        usage = parse_cpu_stat_usage(raw)
        if usage is None:
            status.set("error", "parse_error", f"{path}: no usage_usec")
        return None if usage is None else usage / 1e6

    def _collect_engine_cpu(self, batch: Batch) -> None:
        """Each engine's own CPU time → ``kvpressure_engine_process_cpu_seconds_total``.

        From the engine's cgroup ``cpu.stat`` when one is configured and has it, else from
        the process tree of the PIDs listening on its port. An engine with neither (not on
        loopback, another PID namespace, no permission) has no sample: absent, never 0.
        The status is ``unsupported`` (``no_local_engine``) when no engine had one.
        """
        status = _Status()
        seen = 0
        for engine, instance in self.engines.items():
            cg = _Status()
            seconds = self._engine_cgroup_cpu(engine, cg)
            if seconds is None and self.engine_processes is not None:
                pids = self.engine_processes(engine, False)
                if not pids and _on_loopback(instance):
                    pids = self.engine_processes(engine, True)  # not listening yet: ask early
                seconds = self._trees.read(engine, pids) if pids else None
                if seconds is None and pids:
                    # the PIDs exited (a restart): ask again early, read the new ones if any
                    again = self.engine_processes(engine, True)
                    if again and again != pids:
                        seconds = self._trees.read(engine, again)
            if seconds is None:
                if cg.state != "ok":  # its cgroup failed and no process stood in
                    status.set(cg.state, cg.reason, cg.detail)
                continue
            seen += 1
            batch.add(
                "kvpressure_engine_process_cpu_seconds_total",
                seconds,
                engine=engine,
                instance=instance,
            )
        self._trees.forget(self.engines)
        if seen == 0 and status.state == "ok":
            status.set(
                "unsupported",
                "no_local_engine",
                "no engine has a cgroup with cpu.stat or a process this agent can read "
                "listening on loopback; CPU PSI is read whole as contention",
            )
        self._finish(batch, "engine_cpu", status)

    # --- disks, network ----------------------------------------------------------------

    def _physical_disks(self) -> frozenset[str] | None:
        """Return the names in ``<sysfs>/block`` that do not resolve under ``/virtual/``.

        None when ``/sys/block`` cannot be listed (name heuristics apply then). Cached for
        REFRESH_S.
        """
        now = self._now()
        disks, expires = self._disks
        if now < expires:
            return disks
        try:
            names = os.listdir(self._p_block)
        except OSError:
            disks = None
        else:
            disks = frozenset(
                n
                for n in names
                if "/virtual/" not in os.path.realpath(os.path.join(self._p_block, n))
            )
        self._disks = (disks, now + REFRESH_S)
        return disks

    def _collect_diskstats(self, batch: Batch) -> None:
        stats, bad = parse_diskstats(_read_text(self._p_diskstats), self._diskstats_lines)
        physical = self._physical_disks()
        for d in stats:
            sysfs_name = d.name.replace("/", "!")  # cciss/c0d0 is cciss!c0d0 in sysfs
            if not (
                sysfs_name in physical if physical is not None else is_physical_disk_name(d.name)
            ):
                continue
            batch.add("kvpressure_disk_read_bytes_total", d.read_bytes, device=d.name)
            batch.add("kvpressure_disk_written_bytes_total", d.written_bytes, device=d.name)
            batch.add("kvpressure_disk_reads_completed_total", d.reads_completed, device=d.name)
            batch.add("kvpressure_disk_writes_completed_total", d.writes_completed, device=d.name)
            batch.add("kvpressure_disk_io_time_seconds_total", d.io_ms / 1000.0, device=d.name)
            batch.add(
                "kvpressure_disk_io_time_weighted_seconds_total",
                d.weighted_ms / 1000.0,
                device=d.name,
            )
        if bad:
            self._log_once(
                "diskstats:malformed",
                logging.WARNING,
                "%s: skipped %d malformed line(s) (fewer than 14 fields or non-numeric counters)",
                self._p_diskstats,
                bad,
            )
        self._ok(batch, "diskstats")

    def _pick_interfaces(self, names: list[str]) -> list[str]:
        """At most MAX_INTERFACES names: physical (not ``/virtual/`` in sysfs) first."""
        if len(names) <= MAX_INTERFACES:
            return names
        key = tuple(names)
        cached_key, picked, expires = self._ifaces
        now = self._now()
        if cached_key == key and now < expires:
            return picked

        def virtual(n: str) -> bool:
            path = os.path.join(self._p_class_net, n)
            return not os.path.exists(path) or "/virtual/" in os.path.realpath(path)

        ranked = sorted(range(len(names)), key=lambda i: (virtual(names[i]), i))
        picked = [names[i] for i in ranked[:MAX_INTERFACES]]
        self._log_once(
            "netdev:cap",
            logging.WARNING,
            "%d network interfaces; exporting only %d (physical first)",
            len(names),
            MAX_INTERFACES,
        )
        self._ifaces = (key, picked, now + REFRESH_S)
        return picked

    def _collect_netdev(self, batch: Batch) -> None:
        stats = parse_netdev(_read_text(self._p_netdev))
        keep = set(self._pick_interfaces([s.interface for s in stats]))
        for s in stats:
            if s.interface not in keep:
                continue
            i = s.interface
            batch.add("kvpressure_net_receive_bytes_total", s.rx_bytes, interface=i)
            batch.add("kvpressure_net_transmit_bytes_total", s.tx_bytes, interface=i)
            batch.add("kvpressure_net_receive_errors_total", s.rx_errs, interface=i)
            batch.add("kvpressure_net_transmit_errors_total", s.tx_errs, interface=i)
            batch.add("kvpressure_net_receive_drops_total", s.rx_drop, interface=i)
            batch.add("kvpressure_net_transmit_drops_total", s.tx_drop, interface=i)
        self._ok(batch, "netdev")

    def _collect_snmp(self, batch: Batch) -> None:
        retrans = parse_snmp(_read_text(self._p_snmp)).get("Tcp", {}).get("RetransSegs")
        if retrans is None:
            self._error(batch, "snmp", "missing_field", "no Tcp RetransSegs")
            return
        batch.add("kvpressure_net_tcp_retransmitted_segments_total", retrans)
        self._ok(batch, "snmp")

    # --- NUMA tiers --------------------------------------------------------------------

    def _numa_nodes(self) -> list[tuple[str, str, str]] | None:
        """``(node id, tier, meminfo path)`` per node, or None without NUMA sysfs.

        A node whose ``cpulist`` is empty is ``cxl``; one whose ``cpulist`` cannot be
        read is assumed ``dram``. Cached for REFRESH_S.
        """
        now = self._now()
        nodes, expires = self._nodes
        if now < expires:
            return nodes
        try:
            entries = os.listdir(self._p_nodes)
        except (FileNotFoundError, NotADirectoryError):
            nodes = None
        else:
            nodes = []
            ids = sorted(int(m.group(1)) for e in entries if (m := _NODE_DIR.fullmatch(e)))
            for node_id in ids:
                d = os.path.join(self._p_nodes, f"node{node_id}")
                try:
                    tier = "dram" if _read_text(os.path.join(d, "cpulist")).strip() else "cxl"
                except OSError:
                    tier = "dram"
                nodes.append((str(node_id), tier, os.path.join(d, "meminfo")))
        self._nodes = (nodes, now + REFRESH_S)
        return nodes

    def _collect_numa(self, batch: Batch, info: dict[str, int] | None) -> None:
        nodes = self._numa_nodes()
        if nodes is None:
            total = (info or {}).get("MemTotal")
            free = (info or {}).get("MemFree")
            if total is not None and total > 0 and free is not None and free >= 0:
                free = min(free, total)
                for state, value in (("total", total), ("used", total - free), ("free", free)):
                    batch.add("kvpressure_memory_tier_bytes", value, tier="dram", state=state)
            self._unsupported(
                batch,
                "numa",
                "no_numa_sysfs",
                f"{self._p_nodes} does not exist; the dram tier comes from "
                "/proc/meminfo without a node label.",
            )
            return
        status = _Status()
        for node, tier, path in nodes:
            try:
                m = parse_node_meminfo(_read_text(path), _NODE_KEYS)
            except OSError as exc:
                status.set("error", _reason(exc), f"{path}: {exc}")
                continue
            total, free = m.get("MemTotal"), m.get("MemFree")
            if total is None or free is None or total < 0 or free < 0:
                status.set("error", "parse_error", f"{path}: no MemTotal/MemFree")
                continue
            if total == 0:
                continue  # a memoryless (CPU-only) node is not a memory tier
            used = m.get("MemUsed", total - free)
            for state, value in (("total", total), ("used", used), ("free", free)):
                batch.add("kvpressure_memory_tier_bytes", value, tier=tier, node=node, state=state)
        self._finish(batch, "numa", status)


@register("host", Stage.SOURCE, "memory, PSI, disks, network, NUMA tiers from /proc and /sys")
def _plan(ctx: Context) -> list[Plan]:
    cfg = ctx.config
    interval = ctx.interval_s("host")
    cgroups: dict[str, str] = {}
    for e in cfg.engines:
        if e.cgroup or e.unit:
            cgroups[e.label] = e.cgroup or e.unit or ""
    memory_cgroup = cfg.samplers.host.memory_cgroup
    engines = {e.label: e.instance for e in ctx.engines}
    spec = ("host", cfg.procfs_root, cfg.sysfs_root, tuple(sorted(cgroups.items())), interval,
            memory_cgroup, tuple(sorted(engines.items())))  # fmt: skip
    return [
        Plan(
            "host",
            spec,
            lambda: HostSampler(
                procfs_root=cfg.procfs_root,
                sysfs_root=cfg.sysfs_root,
                engine_cgroups=cgroups,
                interval_s=interval,
                memory_cgroup=memory_cgroup,
                engines=engines,
                engine_processes=ctx.engine_processes,
            ),
        )
    ]
