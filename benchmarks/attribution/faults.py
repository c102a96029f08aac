"""Fault injectors for the attribution benchmark. Root only; everything stays on this machine.

Each injector checks that the kernel and the sandbox allow it and raises
:class:`Unavailable` with the exact reason when not, so a scenario that cannot run says why
instead of producing a meaningless number.

* :class:`EngineCgroup`: the engine in its own cgroup v2 directory (on the v2 root, or the
  ``unified`` hierarchy of a hybrid host), so the agent reports its PSI as
  ``scope=<engine>``.
* :class:`MemoryCgroup` / :class:`MemoryLimit`: a memory cgroup the engine joins when it
  starts (so the weights it maps are charged to it), and a limit below its working set:
  cgroup v2 ``memory.max`` where the v2 hierarchy has the memory controller, else cgroup v1
  ``memory.limit_in_bytes``, with a zram swap device for the duration (:class:`ZramSwap`:
  without swap the kernel OOM-kills the engine instead of slowing it).
* :class:`CpuBurners`: busy-looping processes competing with the engine for the CPUs.
* :class:`StoragePressure`: heavy background writes (``dd ... conv=fsync`` loops) while the
  model's pages are dropped from the page cache every ``period_s``: ``echo 1 >
  /proc/sys/vm/drop_caches`` plus ``process_madvise(MADV_PAGEOUT)`` on the engine's
  mapping of the model, because drop_caches never drops pages a process has mapped, and
  llama.cpp maps its weights.
* :class:`NetworkPath`: a network namespace joined to the host by a veth pair; the client
  runs inside it, and ``impair()`` puts a token-bucket filter (``tc qdisc ... tbf``: low
  rate, small queue, so packets queue and drop and TCP retransmits) on both ends. ``netem``
  is used instead when the kernel has it (delay and loss).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

CGROUP = Path("/sys/fs/cgroup")
SYS_PROCESS_MADVISE = 440  # same number on x86_64 and aarch64 (generic syscall table)
MADV_PAGEOUT = 21


class Unavailable(Exception):
    """This fault cannot be injected here; the message says why."""


def _write(path: Path, text: str) -> None:
    path.write_text(text)


def v2_root() -> Path | None:
    """The cgroup v2 hierarchy: ``/sys/fs/cgroup``, or ``/sys/fs/cgroup/unified`` (hybrid)."""
    for p in (CGROUP, CGROUP / "unified"):
        if (p / "cgroup.controllers").exists():
            return p
    return None


class EngineCgroup:
    """A cgroup v2 directory holding the engine (per-engine PSI: ``cgroup:`` in the config).

    Args:
        name: directory name under the v2 root.
    """

    def __init__(self, name: str) -> None:
        root = v2_root()
        if root is None:
            raise Unavailable("no cgroup v2 hierarchy (neither /sys/fs/cgroup nor .../unified)")
        if os.geteuid() != 0:
            raise Unavailable("not root: cannot create cgroups")
        self.root = root
        self.path = root / name
        self.rel = name

    def add(self, pid: int) -> None:
        """Create the directory and move ``pid`` into it."""
        self.path.mkdir(exist_ok=True)
        _write(self.path / "cgroup.procs", str(pid))

    def close(self) -> None:
        """Move every process back to the root and remove the directory."""
        with contextlib.suppress(OSError):
            for pid in (self.path / "cgroup.procs").read_text().split():
                with contextlib.suppress(OSError):
                    _write(self.root / "cgroup.procs", pid)
            self.path.rmdir()


def rss_bytes(pid: int) -> int:
    """Resident set size of ``pid`` (anonymous + file-mapped pages), bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise Unavailable(f"no VmRSS for pid {pid}")


class MemoryCgroup:
    """The engine's memory cgroup, joined when the engine starts so its page cache (the
    mapped weights) is charged to it; :meth:`limit` then puts it under pressure.

    cgroup v2 ``memory.max`` where the v2 hierarchy has the memory controller (then the
    directory is the engine's PSI cgroup too), else cgroup v1 ``memory.limit_in_bytes``.

    Args:
        name: cgroup directory name.
    """

    def __init__(self, name: str) -> None:
        if os.geteuid() != 0:
            raise Unavailable("not root: cannot set a memory cgroup limit")
        root = v2_root()
        if root is not None and "memory" in (root / "cgroup.controllers").read_text().split():
            with contextlib.suppress(OSError):
                _write(root / "cgroup.subtree_control", "+memory")
            self.mode, self.dir, self.procs, self.knob = (
                "v2",
                root / name,
                "cgroup.procs",
                "memory.max",
            )
        elif (CGROUP / "memory" / "memory.limit_in_bytes").exists():
            self.mode, self.dir = "v1", CGROUP / "memory" / name
            self.procs, self.knob = "tasks", "memory.limit_in_bytes"
        else:
            raise Unavailable("no memory controller in cgroup v2 and no cgroup v1 memory mount")
        try:
            self.dir.mkdir(exist_ok=True)
        except OSError as exc:
            raise Unavailable(f"cannot create {self.dir}: {exc}") from exc

    @property
    def procs_file(self) -> Path:
        """The file a process writes its pid to in order to join."""
        return self.dir / self.procs

    def set_limit(self, limit_bytes: int | None) -> None:
        """Set the limit (``None``: unlimited); the kernel reclaims down to it first."""
        value = (
            str(limit_bytes) if limit_bytes is not None else ("max" if self.mode == "v2" else "-1")
        )
        for _ in range(50):
            try:
                _write(self.dir / self.knob, value)
                return
            except OSError:
                time.sleep(0.1)  # v1 answers EBUSY while it cannot reclaim enough yet
        raise Unavailable(f"cannot set {self.dir / self.knob} to {value}")

    def usage(self) -> int | None:
        """Bytes charged to the cgroup."""
        name = "memory.current" if self.mode == "v2" else "memory.usage_in_bytes"
        try:
            return int((self.dir / name).read_text())
        except (OSError, ValueError):
            return None

    def close(self) -> None:
        """Lift the limit, move the processes to the parent, remove the directory."""
        with contextlib.suppress(Unavailable):
            self.set_limit(None)
        parent = self.dir.parent / self.procs
        with contextlib.suppress(OSError):
            for pid in self.procs_file.read_text().split():
                with contextlib.suppress(OSError):
                    _write(parent, pid)
        for _ in range(20):
            try:
                self.dir.rmdir()
                break
            except OSError:
                time.sleep(0.1)


class ZramSwap:
    """A compressed-RAM swap device for the duration of the context.

    Without swap, a memory cgroup limit below an engine's working set gets the engine
    OOM-killed rather than slowed: its mapped weights are all referenced every token, so
    reclaim keeps activating them instead of evicting them, and its anonymous memory (KV
    cache, batch buffers) has nowhere to go. With swap the kernel pushes cold anonymous pages
    out and faults them back in: the engine is slowed, not killed. Pages are swapped only
    under memory pressure, which only the limited cgroup has.

    Args:
        size_mb: device size.
    """

    def __init__(self, size_mb: int = 1024) -> None:
        if os.geteuid() != 0:
            raise Unavailable("not root: cannot set up swap")
        hot_add = Path("/sys/class/zram-control/hot_add")
        if not hot_add.exists() or not shutil.which("mkswap") or not shutil.which("swapon"):
            raise Unavailable("no zram (zram-control/hot_add) or no mkswap/swapon")
        self.size_mb = size_mb
        self.num = int(hot_add.read_text())
        self.dev = f"/dev/zram{self.num}"

    def __enter__(self) -> ZramSwap:
        try:
            _write(Path(f"/sys/block/zram{self.num}/disksize"), f"{self.size_mb}M")
            for cmd in (("mkswap", self.dev), ("swapon", "-p", "5", self.dev)):
                r = _run(*cmd)
                if r.returncode != 0:
                    raise Unavailable(f"{' '.join(cmd)}: {r.stderr.strip()}")
        except (OSError, Unavailable) as exc:
            self.__exit__()
            raise Unavailable(f"zram swap: {exc}") from exc
        return self

    def __exit__(self, *exc: object) -> None:
        _run("swapoff", self.dev)
        with contextlib.suppress(OSError):
            _write(Path(f"/sys/block/zram{self.num}/reset"), "1")
        with contextlib.suppress(OSError):
            _write(Path("/sys/class/zram-control/hot_remove"), str(self.num))


class MemoryLimit:
    """A limit on a :class:`MemoryCgroup` while the context is active.

    The limit is set ``after_s`` seconds into the context, once the load has grown the
    engine's anonymous memory (batch buffers) to its plateau, and is computed then by
    ``limit()``: a limit below the anonymous memory would only get the engine OOM-killed
    (there is no swap to push it to), while one between the anonymous memory and the whole
    working set makes the kernel evict and re-read the mapped weights.
    """

    def __init__(
        self, cgroup: MemoryCgroup, limit: Callable[[], int], after_s: float = 3.0
    ) -> None:
        self.cgroup, self.limit, self.after_s = cgroup, limit, after_s
        self.mode = cgroup.mode
        self.applied: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._apply, daemon=True)

    def _apply(self) -> None:
        if not self._stop.wait(self.after_s):
            self.applied = self.limit()
            self.cgroup.set_limit(self.applied)

    def __enter__(self) -> MemoryLimit:
        self.swap = ZramSwap().__enter__()
        if self.cgroup.mode == "v1":
            with contextlib.suppress(OSError):
                _write(self.cgroup.dir / "memory.swappiness", "100")
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)
        self.cgroup.set_limit(None)
        self.swap.__exit__()


def join_argv(procs_files: list[Path], argv: list[str]) -> list[str]:
    """``argv`` run by a shell that first joins the cgroups (writes its pid to each file)."""
    joins = " && ".join(f"echo $$ > {f}" for f in procs_files)
    return ["sh", "-c", f'{joins} && exec "$@"', "sh", *argv] if joins else argv


def evict_file(path: Path) -> None:
    """Drop ``path``'s unmapped pages from the page cache (``POSIX_FADV_DONTNEED``)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


BURN = """
import os
while True:
    for _ in range(1_000_000):
        pass
    try:
        os.kill({parent}, 0)
    except OSError:  # the benchmark is gone (killed before its cleanup ran): stop
        break
"""
"""A CPU burner that ends when the benchmark process does: a fault injector must not outlive
the run that injected it (a killed test run once left two fsync writers running for half an
hour, and every later run on the machine saw a storage fault)."""


class CpuBurners:
    """``n`` busy-looping processes (context manager)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.procs: list[subprocess.Popen[bytes]] = []

    def __enter__(self) -> CpuBurners:
        for _ in range(self.n):
            self.procs.append(
                subprocess.Popen(
                    [sys.executable, "-c", BURN.format(parent=os.getpid())], start_new_session=True
                )
            )
        return self

    def __exit__(self, *exc: object) -> None:
        for p in self.procs:
            p.kill()
        for p in self.procs:
            p.wait(timeout=10)


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def page_out(pid: int, path_part: str) -> int:
    """``process_madvise(MADV_PAGEOUT)`` every mapping of ``pid`` whose file contains
    ``path_part``; returns the bytes advised.

    Raises:
        Unavailable: the syscall is not there or not permitted.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    total = 0
    fd = os.pidfd_open(pid)
    try:
        for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
            parts = line.split()
            if len(parts) < 6 or path_part not in parts[5]:
                continue
            a, b = (int(x, 16) for x in parts[0].split("-"))
            iov = _IoVec(a, b - a)
            r = libc.syscall(SYS_PROCESS_MADVISE, fd, ctypes.byref(iov), 1, MADV_PAGEOUT, 0)
            if r < 0:
                err = ctypes.get_errno()
                raise Unavailable(f"process_madvise(MADV_PAGEOUT) failed: {os.strerror(err)}")
            total += r
    finally:
        os.close(fd)
    return total


def file_resident_bytes(pid: int, path_part: str) -> int:
    """Resident bytes of ``pid``'s mappings of files containing ``path_part`` (smaps Rss)."""
    total, inside = 0, False
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        if line[:1].isdigit() or line[:1] in "abcdef":
            inside = path_part in line
        elif inside and line.startswith("Rss:"):
            total += int(line.split()[1]) * 1024
    return total


class StoragePressure:
    """Heavy background writes while the model keeps being dropped from the page cache.

    Args:
        pid: the engine's process id.
        model_part: a substring of the model file's path (to find its mappings).
        workdir: where the writers write (same disk as the model).
        writers: parallel ``dd`` loops.
        write_mb: size of each ``dd`` file, MiB.
        period_s: seconds between page drops.
    """

    def __init__(
        self,
        pid: int,
        model_part: str,
        workdir: Path,
        writers: int = 2,
        write_mb: int = 512,
        period_s: float = 1.0,
    ) -> None:
        if os.geteuid() != 0:
            raise Unavailable("not root: cannot write /proc/sys/vm/drop_caches")
        try:
            _write(Path("/proc/sys/vm/drop_caches"), "1")
        except OSError as exc:
            raise Unavailable(f"echo 1 > /proc/sys/vm/drop_caches failed: {exc}") from exc
        page_out(pid, model_part)  # raises Unavailable when not permitted
        if not shutil.which("dd"):
            raise Unavailable("dd not found")
        self.pid, self.part, self.dir = pid, model_part, workdir
        self.writers, self.write_mb, self.period_s = writers, write_mb, period_s
        self.procs: list[subprocess.Popen[bytes]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._evict, daemon=True)
        self.drops = 0

    def _evict(self) -> None:
        while not self._stop.wait(self.period_s):
            with contextlib.suppress(OSError, Unavailable):
                _write(Path("/proc/sys/vm/drop_caches"), "1")
                page_out(self.pid, self.part)
                self.drops += 1

    def __enter__(self) -> StoragePressure:
        for i in range(self.writers):
            f = self.dir / f"fill-{i}.bin"
            cmd = (
                f"while kill -0 {os.getpid()} 2>/dev/null; do dd if=/dev/zero of={f} "
                f"bs=1M count={self.write_mb} conv=fsync status=none; done; rm -f {f}"
            )
            self.procs.append(subprocess.Popen(["bash", "-c", cmd], start_new_session=True))
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)
        for p in self.procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, 9)
            p.wait(timeout=10)
        for i in range(self.writers):
            with contextlib.suppress(OSError):
                (self.dir / f"fill-{i}.bin").unlink()


def _run(*cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=30)


class NetworkPath:
    """A client network namespace joined to the host by a veth pair (context manager).

    The host end is ``10.201.<n>.1``, the namespace end ``10.201.<n>.2``. The client runs
    with :meth:`exec_argv`; :meth:`impair` shapes both ends.

    Args:
        name: namespace name (also the veth name prefix, at most 10 characters).
        subnet: the ``<n>`` of the /30.
    """

    def __init__(self, name: str, subnet: int = 77) -> None:
        if os.geteuid() != 0:
            raise Unavailable("not root: cannot create network namespaces")
        if not shutil.which("ip") or not shutil.which("tc"):
            raise Unavailable("ip or tc (iproute2) not found")
        self.ns = name
        self.host_if, self.ns_if = f"{name[:10]}h", f"{name[:10]}n"
        self.host_ip, self.ns_ip = f"10.201.{subnet}.1", f"10.201.{subnet}.2"
        self.impairment = ""

    def __enter__(self) -> NetworkPath:
        steps = [
            ("ip", "netns", "add", self.ns),
            ("ip", "link", "add", self.host_if, "type", "veth", "peer", "name", self.ns_if),
            ("ip", "link", "set", self.ns_if, "netns", self.ns),
            ("ip", "addr", "add", f"{self.host_ip}/30", "dev", self.host_if),
            ("ip", "link", "set", self.host_if, "up"),
            ("ip", "-n", self.ns, "addr", "add", f"{self.ns_ip}/30", "dev", self.ns_if),
            ("ip", "-n", self.ns, "link", "set", self.ns_if, "up"),
            ("ip", "-n", self.ns, "link", "set", "lo", "up"),
        ]
        for cmd in steps:
            r = _run(*cmd)
            if r.returncode != 0:
                self.__exit__()
                raise Unavailable(f"{' '.join(cmd)}: {r.stderr.strip()}")
        return self

    def impair(
        self,
        rate: str = "48kbit",
        burst: str = "2kb",
        limit: str = "4kb",
        delay_ms: int = 40,
        loss_pct: float = 3.0,
    ) -> str:
        """Shape both ends; returns a description of what was applied.

        ``netem`` (delay + loss) when the kernel has it; otherwise ``tbf`` (rate + a queue
        of ``limit`` bytes, so bursts queue and then drop).
        """
        netem = _run(
            "tc",
            "qdisc",
            "add",
            "dev",
            self.host_if,
            "root",
            "netem",
            "delay",
            f"{delay_ms}ms",
            "loss",
            f"{loss_pct}%",
        )
        if netem.returncode == 0:
            _run(
                "ip",
                "netns",
                "exec",
                self.ns,
                "tc",
                "qdisc",
                "add",
                "dev",
                self.ns_if,
                "root",
                "netem",
                "delay",
                f"{delay_ms}ms",
                "loss",
                f"{loss_pct}%",
            )
            self.impairment = f"netem delay {delay_ms}ms loss {loss_pct}% both ways"
            return self.impairment
        for dev, pre in ((self.host_if, ()), (self.ns_if, ("ip", "netns", "exec", self.ns))):
            r = _run(
                *pre,
                "tc",
                "qdisc",
                "add",
                "dev",
                dev,
                "root",
                "tbf",
                "rate",
                rate,
                "burst",
                burst,
                "limit",
                limit,
            )
            if r.returncode != 0:
                raise Unavailable(f"tc tbf on {dev}: {r.stderr.strip()}")
        self.impairment = (
            f"tbf rate {rate} burst {burst} limit {limit} both ways "
            f"(netem unavailable: {netem.stderr.strip()})"
        )
        return self.impairment

    def clear(self) -> None:
        """Remove the shaping."""
        _run("tc", "qdisc", "del", "dev", self.host_if, "root")
        _run("ip", "netns", "exec", self.ns, "tc", "qdisc", "del", "dev", self.ns_if, "root")

    def exec_argv(self, argv: list[str]) -> list[str]:
        """``argv`` run inside the namespace."""
        return ["ip", "netns", "exec", self.ns, *argv]

    def __exit__(self, *exc: object) -> None:
        _run("ip", "link", "del", self.host_if)
        _run("ip", "netns", "del", self.ns)
