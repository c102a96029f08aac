"""Tests for agent/samplers/host.py against fake /proc and /sys trees built in tmp_path.

Case inputs (23 PSI, 24 diskstats, 25 container memory) are copied verbatim under
tests/fixtures/host/ and laid out in the places the sampler reads them from.
"""

from __future__ import annotations

import errno
import io
import logging
import os
import timeit
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpressure.agent import catalogue
from kvpressure.agent.samplers import host
from kvpressure.agent.samplers.host import (
    HostSampler,
    is_physical_disk_name,
    parse_diskstats,
    parse_psi,
    parse_snmp,
)
from kvpressure.agent.samples import Batch, make_labels

FIXTURES = Path(__file__).parent / "fixtures" / "host"
KB = 1024
GIB = 1 << 30


def fixture(name: str) -> str:
    return (FIXTURES / name).read_text()


# --- batch helpers ----------------------------------------------------------------------


def value(batch: Batch, name: str, **labels: str) -> float | None:
    """The value of the one sample with exactly these labels, or None when absent."""
    want = make_labels(dict(labels))
    found = [s.value for s in batch if s.name == name and s.labels == want]
    assert len(found) <= 1, f"duplicate series {name}{labels}"
    return found[0] if found else None


def series(batch: Batch, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    return {s.labels: s.value for s in batch if s.name == name}


def status(batch: Batch, source: str) -> tuple[str, str] | None:
    found = [(s.state, s.reason) for s in batch.sources if s.source == source]
    assert len(found) <= 1, f"source {source} recorded {len(found)} times: {found}"
    return found[0] if found else None


# --- fake trees ---------------------------------------------------------------------------

MEMINFO = """\
MemTotal:       16000000 kB
MemFree:         4000000 kB
MemAvailable:   10000000 kB
Buffers:          100000 kB
Cached:          5000000 kB
SwapTotal:       2000000 kB
SwapFree:        1500000 kB
HugePages_Total:       0
"""

VMSTAT = "nr_free_pages 1000\npgmajfault 4242\npswpin 17\npswpout 23\nallocstall_normal 3\n"

NETDEV = (
    "Inter-|   Receive                                                |  Transmit\n"
    " face |bytes    packets errs drop fifo frame compressed multicast"
    "|bytes    packets errs drop fifo colls carrier compressed\n"
    "    lo:    3193      29    0    0    0     0          0         0"
    "     3193      29    0    0    0     0       0          0\n"
    "  eth0: 161901943    3826    5    6    0     0          0         0"
    "   203294    2119    7    8    0     0       0          0\n"
)

# Columns deliberately not in the kernel's order: parsing must go by name.
SNMP = """\
Ip: Forwarding DefaultTTL InReceives
Ip: 1 64 12345
Tcp: RtoAlgorithm RetransSegs RtoMin MaxConn
Tcp: 1 314 200 -1
Udp: InDatagrams NoPorts
Udp: 10 0
"""

# /proc/stat of a 2-CPU host: the aggregate line, per-CPU lines and the rest (not read).
PROC_STAT = """\
cpu  26025 10 4705 20170 438 0 78 339 0 0
cpu0 10454 0 1692 13495 41 0 8 173 0 0
cpu1 15571 10 3013 6675 397 0 69 165 0 0
intr 1234567 0 9 0 0
ctxt 987654
btime 1700000000
processes 4321
procs_running 3
procs_blocked 0
"""

NODE0 = """\
Node 0 MemTotal:       8000000 kB
Node 0 MemFree:        3000000 kB
Node 0 MemUsed:        5000000 kB
Node 0 Active:          100000 kB
"""
NODE1_CXL = "Node 1 MemTotal:       4000000 kB\nNode 1 MemFree:        3500000 kB\n"


class Tree:
    """A fake procfs + sysfs under tmp_path."""

    def __init__(self, root: Path) -> None:
        self.proc = root / "proc"
        self.sys = root / "sys"
        self.proc.mkdir()
        self.sys.mkdir()

    def proc_file(self, rel: str, content: str) -> Path:
        return self._write(self.proc / rel, content)

    def sys_file(self, rel: str, content: str) -> Path:
        return self._write(self.sys / rel, content)

    def cgroup_file(self, rel: str, content: str) -> Path:
        return self.sys_file(f"fs/cgroup/{rel}", content)

    @staticmethod
    def _write(path: Path, content: str) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content)
        return path

    def block(self, name: str, *, virtual: bool = False) -> None:
        parent = "devices/virtual/block" if virtual else "devices/pci0000:00/0000:00:1d.0/block"
        (self.sys / parent / name).mkdir(parents=True, exist_ok=True)
        (self.sys / "block").mkdir(exist_ok=True)
        (self.sys / "block" / name).symlink_to(Path("..") / parent / name)

    def node(self, node_id: int, meminfo: str, cpulist: str) -> None:
        self.sys_file(f"devices/system/node/node{node_id}/meminfo", meminfo)
        self.sys_file(f"devices/system/node/node{node_id}/cpulist", cpulist)

    def sampler(self, **kw: object) -> HostSampler:
        return HostSampler(str(self.proc), str(self.sys), **kw)  # type: ignore[arg-type]


def collect(sampler: HostSampler) -> Batch:
    batch = Batch()
    sampler.collect(batch)
    return batch


@pytest.fixture
def tree(tmp_path: Path) -> Tree:
    """A healthy host: cgroup v2 without limits, PSI, disks, network, two NUMA nodes."""
    t = Tree(tmp_path)
    t.proc_file("meminfo", MEMINFO)
    t.proc_file("self/cgroup", "0::/system.slice/kvpressure.service\n")
    t.cgroup_file("cgroup.controllers", "cpu io memory pids\n")
    t.cgroup_file("system.slice/memory.max", "max\n")
    t.cgroup_file("system.slice/memory.current", "5000000000\n")
    t.cgroup_file("system.slice/kvpressure.service/memory.max", "max\n")
    t.cgroup_file("system.slice/kvpressure.service/memory.current", "100000000\n")
    t.proc_file("vmstat", VMSTAT)
    t.proc_file("stat", PROC_STAT)
    t.proc_file("pressure/cpu", fixture("23-psi-unavailable.cpu-full-bogus.input.txt"))
    t.proc_file("pressure/memory", fixture("23-psi-unavailable.memory.input.txt"))
    t.proc_file(
        "pressure/io",
        "some avg10=1.50 avg60=1.00 avg300=0.50 total=2500000\n"
        "full avg10=0.75 avg60=0.50 avg300=0.25 total=1250000\n",
    )
    t.proc_file("diskstats", fixture("24-diskstats-nvme-20-fields.input.txt"))
    t.block("nvme0n1")
    t.block("sda")
    t.block("loop0", virtual=True)
    t.proc_file("net/dev", NETDEV)
    t.proc_file("net/snmp", SNMP)
    t.node(0, NODE0, "0-7\n")
    t.node(1, NODE1_CXL, "\n")
    t.sys_file("devices/system/node/online", "0-1\n")
    return t


SOURCES = ("meminfo", "cgroup", "vmstat", "psi", "cpu", "diskstats", "netdev", "snmp", "numa")


def test_healthy_host_uses_catalogue_names_and_reports_every_source(tree: Tree) -> None:
    batch = collect(tree.sampler())
    for s in batch:
        metric = catalogue.get(s.name)
        assert metric.area == "host" or s.name == "kvpressure_memory_tier_bytes"
        assert {k for k, _ in s.labels} <= set(metric.labels), s
    for source in SOURCES:
        assert status(batch, source) == ("ok", ""), source
    assert status(batch, "psi_cgroup") is None  # no engines configured, no status
    assert len({(s.name, s.labels) for s in batch}) == len(batch)  # no duplicate series


# --- memory (case 25) -------------------------------------------------------------------


def container_tree(tmp_path: Path, meminfo: str) -> Tree:
    """Case 25: a cgroup v2 container with its own cgroup namespace (``0::/``)."""
    t = Tree(tmp_path)
    t.proc_file("meminfo", meminfo)
    t.proc_file("self/cgroup", "0::/\n")
    t.cgroup_file("cgroup.controllers", "cpu io memory pids\n")
    t.cgroup_file("memory.max", fixture("25-container-memory-host-view.memory.max.input.txt"))
    t.cgroup_file(
        "memory.current", fixture("25-container-memory-host-view.memory.current.input.txt")
    )
    return t


def test_case25_container_limit_is_the_effective_total(tmp_path: Path) -> None:
    t = container_tree(tmp_path, fixture("25-container-memory-host-view.meminfo.input.txt"))
    batch = collect(t.sampler())
    assert value(batch, "kvpressure_host_memory_total_bytes") == 96636764160
    assert value(batch, "kvpressure_host_memory_available_bytes") == 64961380352
    assert value(batch, "kvpressure_host_cgroup_memory_limit_bytes") == 96636764160
    assert value(batch, "kvpressure_host_cgroup_memory_used_bytes") == 31675383808
    # The host's view stays visible beside the effective one.
    assert value(batch, "kvpressure_host_meminfo_total_bytes") == 791166868 * KB
    assert value(batch, "kvpressure_host_meminfo_available_bytes") == 650112340 * KB
    assert status(batch, "meminfo") == ("ok", "")
    assert status(batch, "cgroup") == ("ok", "")


def test_case25_lxcfs_zero_meminfo_is_unavailable_and_cgroup_files_still_used(
    tmp_path: Path,
) -> None:
    t = container_tree(tmp_path, fixture("25-container-memory-host-view.lxcfs-zero.input.txt"))
    batch = collect(t.sampler())
    assert value(batch, "kvpressure_host_meminfo_total_bytes") is None
    assert value(batch, "kvpressure_host_meminfo_available_bytes") is None
    assert status(batch, "meminfo") == ("error", "invalid_memtotal")
    assert value(batch, "kvpressure_host_memory_total_bytes") == 96636764160
    assert value(batch, "kvpressure_host_memory_available_bytes") == 64961380352
    # Swap lines of the same file are fine and still exported.
    assert value(batch, "kvpressure_host_swap_total_bytes") == 8273916 * KB
    assert value(batch, "kvpressure_host_swap_used_bytes") == (8273916 - 8266492) * KB
    assert all(s.value >= 0 for s in batch)


def test_lxcfs_zero_meminfo_without_cgroup_limit_has_no_memory_total(tmp_path: Path) -> None:
    t = container_tree(tmp_path, fixture("25-container-memory-host-view.lxcfs-zero.input.txt"))
    t.cgroup_file("memory.max", "max\n")
    batch = collect(t.sampler())
    assert value(batch, "kvpressure_host_memory_total_bytes") is None
    assert value(batch, "kvpressure_host_memory_available_bytes") is None
    assert value(batch, "kvpressure_host_cgroup_memory_limit_bytes") is None
    assert value(batch, "kvpressure_host_cgroup_memory_used_bytes") == 31675383808
    tiers = series(batch, "kvpressure_memory_tier_bytes")
    assert all(dict(labels)["tier"] == "swap" for labels in tiers)  # no dram from meminfo


@pytest.mark.parametrize(
    ("limits", "currents", "want_limit", "want_total", "want_available"),
    [
        pytest.param(  # the parent's limit binds; available uses the parent's usage
            {"": None, "kubepods": 8 * GIB, "kubepods/pod": "max", "kubepods/pod/ctr": 12 * GIB},
            {"kubepods": 6 * GIB, "kubepods/pod": 5 * GIB, "kubepods/pod/ctr": 1 * GIB},
            8 * GIB,
            8 * GIB,
            2 * GIB,
            id="ancestor-limit-binds",
        ),
        pytest.param(  # own limit lower than the ancestors'
            {"kubepods": 8 * GIB, "kubepods/pod": "max", "kubepods/pod/ctr": 4 * GIB},
            {"kubepods": 6 * GIB, "kubepods/pod/ctr": 1 * GIB},
            4 * GIB,
            4 * GIB,
            3 * GIB,
            id="own-limit-binds",
        ),
        pytest.param(  # usage above the limit (kernel memory, races): available clamps at 0
            {"kubepods/pod/ctr": 4 * GIB},
            {"kubepods/pod/ctr": 5 * GIB},
            4 * GIB,
            4 * GIB,
            0,
            id="usage-over-limit-clamps",
        ),
        pytest.param(  # a limit above MemTotal does not bind: meminfo figures
            {"kubepods": 64 * GIB},
            {"kubepods/pod/ctr": 1 * GIB},
            64 * GIB,
            16000000 * KB,
            10000000 * KB,
            id="limit-above-memtotal",
        ),
        pytest.param(  # binding limit with more headroom than MemAvailable: host is shorter
            {"kubepods": 15 * GIB},
            {"kubepods": 1 * GIB},
            15 * GIB,
            15 * GIB,
            10000000 * KB,
            id="memavailable-lower-than-headroom",
        ),
        pytest.param(  # "max" everywhere: no limit series at all
            {"kubepods": "max", "kubepods/pod/ctr": "max"},
            {"kubepods/pod/ctr": 1 * GIB},
            None,
            16000000 * KB,
            10000000 * KB,
            id="unlimited",
        ),
    ],
)
def test_cgroup_v2_lowest_limit_of_self_and_ancestors(
    tmp_path: Path,
    limits: dict[str, object],
    currents: dict[str, int],
    want_limit: int | None,
    want_total: int,
    want_available: int,
) -> None:
    t = Tree(tmp_path)
    t.proc_file("meminfo", MEMINFO)
    t.proc_file("self/cgroup", "0::/kubepods/pod/ctr\n")
    t.cgroup_file("cgroup.controllers", "memory\n")
    (t.sys / "fs/cgroup/kubepods/pod/ctr").mkdir(parents=True)
    for rel, limit in limits.items():
        if limit is not None:
            t.cgroup_file(f"{rel}/memory.max".lstrip("/"), f"{limit}\n")
    for rel, current in currents.items():
        t.cgroup_file(f"{rel}/memory.current", f"{current}\n")
    batch = collect(t.sampler())
    assert value(batch, "kvpressure_host_cgroup_memory_limit_bytes") == want_limit
    assert value(batch, "kvpressure_host_memory_total_bytes") == want_total
    assert value(batch, "kvpressure_host_memory_available_bytes") == want_available
    # Memory is charged to the deepest cgroup that has accounting files.
    deepest = next(
        currents[r] for r in ("kubepods/pod/ctr", "kubepods/pod", "kubepods") if r in currents
    )
    assert value(batch, "kvpressure_host_cgroup_memory_used_bytes") == deepest
    assert status(batch, "cgroup") == ("ok", "")


V1_UNLIMITED = "9223372036854771712\n"


def test_cgroup_v1_limit_in_bytes_of_an_ancestor(tmp_path: Path) -> None:
    t = Tree(tmp_path)
    t.proc_file("meminfo", MEMINFO)
    t.proc_file("self/cgroup", "12:pids:/docker/abc\n4:memory:/docker/abc\n0::/\n")
    t.cgroup_file("memory/memory.limit_in_bytes", V1_UNLIMITED)
    t.cgroup_file("memory/memory.usage_in_bytes", "9000000000\n")
    t.cgroup_file("memory/docker/memory.limit_in_bytes", f"{4 * GIB}\n")
    t.cgroup_file("memory/docker/memory.usage_in_bytes", f"{3 * GIB}\n")
    t.cgroup_file("memory/docker/abc/memory.limit_in_bytes", V1_UNLIMITED)
    t.cgroup_file("memory/docker/abc/memory.usage_in_bytes", f"{2 * GIB}\n")
    t.cgroup_file(
        "memory/docker/abc/memory.stat", f"cache 0\nhierarchical_memory_limit {4 * GIB}\n"
    )
    batch = collect(t.sampler())
    assert value(batch, "kvpressure_host_cgroup_memory_limit_bytes") == 4 * GIB
    assert value(batch, "kvpressure_host_cgroup_memory_used_bytes") == 2 * GIB
    assert value(batch, "kvpressure_host_memory_total_bytes") == 4 * GIB
    assert value(batch, "kvpressure_host_memory_available_bytes") == 1 * GIB
    assert status(batch, "cgroup") == ("ok", "")


def test_cgroup_v1_hierarchical_limit_when_ancestors_are_not_visible(tmp_path: Path) -> None:
    # Inside a v1 container the memory mount is the container's own cgroup: /docker/abc
    # does not exist under it, and only memory.stat knows the ancestors' limit.
    t = Tree(tmp_path)
    t.proc_file("meminfo", MEMINFO)
    t.proc_file("self/cgroup", "4:memory:/docker/abc\n")
    t.cgroup_file("memory/memory.limit_in_bytes", V1_UNLIMITED)
    t.cgroup_file("memory/memory.usage_in_bytes", f"{1 * GIB}\n")
    t.cgroup_file(
        "memory/memory.stat",
        f"cache 0\nhierarchical_memory_limit {2 * GIB}\nhierarchical_memsw_limit 1\n",
    )
    batch = collect(t.sampler())
    assert value(batch, "kvpressure_host_cgroup_memory_limit_bytes") == 2 * GIB
    assert value(batch, "kvpressure_host_memory_total_bytes") == 2 * GIB
    assert value(batch, "kvpressure_host_memory_available_bytes") == 1 * GIB


def test_cgroup_v1_unlimited_everywhere(tmp_path: Path) -> None:
    t = Tree(tmp_path)
    t.proc_file("meminfo", MEMINFO)
    t.proc_file("self/cgroup", "4:memory:/\n")
    t.cgroup_file("memory/memory.limit_in_bytes", V1_UNLIMITED)
    t.cgroup_file("memory/memory.usage_in_bytes", "123\n")
    t.cgroup_file("memory/memory.stat", f"hierarchical_memory_limit {V1_UNLIMITED}")
    batch = collect(t.sampler())
    assert value(batch, "kvpressure_host_cgroup_memory_limit_bytes") is None
    assert value(batch, "kvpressure_host_memory_total_bytes") == 16000000 * KB
    assert value(batch, "kvpressure_host_cgroup_memory_used_bytes") == 123


@pytest.mark.parametrize(
    ("self_cgroup", "files", "want"),
    [
        pytest.param(None, {}, ("unsupported", "no_proc_self_cgroup"), id="no-proc-self-cgroup"),
        pytest.param("0::/\n", {}, ("unsupported", "no_memory_controller"), id="no-memory-files"),
        pytest.param(
            "0::/\n",
            {"memory.max": "lots\n", "memory.current": "12\n"},
            ("error", "parse_error"),
            id="garbage-limit",
        ),
    ],
)
def test_cgroup_source_states(
    tmp_path: Path, self_cgroup: str | None, files: dict[str, str], want: tuple[str, str]
) -> None:
    t = Tree(tmp_path)
    t.proc_file("meminfo", MEMINFO)
    if self_cgroup is not None:
        t.proc_file("self/cgroup", self_cgroup)
    t.cgroup_file("cgroup.controllers", "memory\n")
    for rel, content in files.items():
        t.cgroup_file(rel, content)
    batch = collect(t.sampler())
    assert status(batch, "cgroup") == want
    # meminfo figures are still the effective ones.
    assert value(batch, "kvpressure_host_memory_total_bytes") == 16000000 * KB
    assert value(batch, "kvpressure_host_memory_available_bytes") == 10000000 * KB


@pytest.mark.parametrize(
    ("swap_total_kb", "swap_free_kb", "want_used_kb"),
    [(2000000, 1500000, 500000), (0, 0, 0), (1000, 2000, 0), (None, 0, None), (-5, 0, None)],
)
def test_swap_from_meminfo(
    tmp_path: Path, swap_total_kb: int | None, swap_free_kb: int, want_used_kb: int | None
) -> None:
    t = Tree(tmp_path)
    meminfo = "MemTotal: 1000000 kB\nMemFree: 10 kB\nMemAvailable: 500 kB\n"
    if swap_total_kb is not None:
        meminfo += f"SwapTotal: {swap_total_kb} kB\n"
    t.proc_file("meminfo", meminfo + f"SwapFree: {swap_free_kb} kB\n")
    batch = collect(t.sampler())
    want_used = None if want_used_kb is None else want_used_kb * KB
    want_total = None if want_used is None else swap_total_kb * KB  # type: ignore[operator]
    assert value(batch, "kvpressure_host_swap_used_bytes") == want_used
    assert value(batch, "kvpressure_host_swap_total_bytes") == want_total
    assert value(batch, "kvpressure_memory_tier_bytes", tier="swap", state="used") == want_used
    assert value(batch, "kvpressure_memory_tier_bytes", tier="swap", state="total") == want_total


def test_vmstat_counters(tree: Tree) -> None:
    batch = collect(tree.sampler())
    assert value(batch, "kvpressure_host_major_page_faults_total") == 4242
    assert value(batch, "kvpressure_host_swap_in_pages_total") == 17
    assert value(batch, "kvpressure_host_swap_out_pages_total") == 23


# --- PSI (case 23) ----------------------------------------------------------------------

PSI = "kvpressure_psi_stall_seconds_total"
AVG10 = "kvpressure_psi_avg10_ratio"


def test_case23_parse_variants() -> None:
    assert set(parse_psi(fixture("23-psi-unavailable.cpu-some-only.input.txt"))) == {"some"}
    bogus = parse_psi(fixture("23-psi-unavailable.cpu-full-bogus.input.txt"))
    assert bogus["full"].total_us == 358783277  # parsed; dropping it is the sampler's job
    idle = parse_psi(fixture("23-psi-unavailable.memory.input.txt"))
    assert idle["some"] == idle["full"] == host.PsiLine(0.0, 0)
    assert parse_psi(fixture("23-psi-unavailable.empty.input.txt")) == {}
    assert parse_psi("some avg10=x total=7\nfull garbage\nnonsense\n") == {
        "some": host.PsiLine(None, 7)
    }


@pytest.mark.parametrize(
    ("resource", "case_file", "want"),
    [
        # want: kind -> (avg10 ratio, total seconds); kinds not listed must be absent.
        ("cpu", "23-psi-unavailable.cpu-some-only.input.txt", {"some": (0.0013, 1.195993)}),
        ("cpu", "23-psi-unavailable.cpu-full-bogus.input.txt", {"some": (0.0092, 933.490489)}),
        ("memory", "23-psi-unavailable.memory.input.txt", {"some": (0.0, 0.0), "full": (0.0, 0.0)}),
        ("memory", "23-psi-unavailable.empty.input.txt", {}),
        (
            "io",
            "23-psi-unavailable.cpu-full-bogus.input.txt",
            {"some": (0.0092, 933.490489), "full": (0.0022, 358.783277)},
        ),
    ],
)
def test_case23_system_psi(
    tree: Tree, resource: str, case_file: str, want: dict[str, tuple[float, float]]
) -> None:
    tree.proc_file(f"pressure/{resource}", fixture(case_file))
    batch = collect(tree.sampler())
    for kind in ("some", "full"):
        labels = {"resource": resource, "kind": kind, "scope": "system"}
        if kind in want:
            avg10, total = want[kind]
            assert value(batch, AVG10, **labels) == pytest.approx(avg10)
            assert value(batch, PSI, **labels) == pytest.approx(total)
        else:
            assert value(batch, AVG10, **labels) is None
            assert value(batch, PSI, **labels) is None


def test_case23_empty_file_is_unsupported_for_that_resource_only(tree: Tree) -> None:
    tree.proc_file("pressure/memory", fixture("23-psi-unavailable.empty.input.txt"))
    batch = collect(tree.sampler())
    assert status(batch, "psi") == ("unsupported", "empty")
    resources = {dict(labels)["resource"] for labels in series(batch, PSI)}
    assert resources == {"cpu", "io"}  # memory absent, not zeros


def test_case23_missing_pressure_dir_is_unsupported_and_logged_once(
    tree: Tree, caplog: pytest.LogCaptureFixture
) -> None:
    for f in (tree.proc / "pressure").iterdir():
        f.unlink()
    (tree.proc / "pressure").rmdir()
    sampler = tree.sampler()
    with caplog.at_level(logging.DEBUG, logger="kvpressure.agent.samplers.host"):
        batches = [collect(sampler) for _ in range(3)]
    for batch in batches:
        assert status(batch, "psi") == ("unsupported", "kernel_without_psi")
        assert not series(batch, PSI)
        # Fallback signals are still there.
        assert value(batch, "kvpressure_host_major_page_faults_total") == 4242
        assert value(batch, "kvpressure_host_memory_available_bytes") == 10000000 * KB
    logged = [r for r in caplog.records if "kernel_without_psi" in r.getMessage()]
    assert len(logged) == 1
    assert "CONFIG_PSI" in logged[0].getMessage()


class _EopnotsuppFile(io.RawIOBase):
    """A file whose open() succeeded but whose read() fails like a psi=0 kernel's."""

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: object) -> int:
        raise OSError(errno.EOPNOTSUPP, "Operation not supported")


def test_case23_eopnotsupp_is_unsupported_logged_once_and_reprobed_slowly(
    tree: Tree, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    real_open = host._open
    pressure_opens: list[str] = []
    psi_disabled = True

    def fake_open(path: str, mode: str = "r", *args: object, **kwargs: object) -> object:
        if psi_disabled and f"{os.sep}pressure{os.sep}" in str(path):
            pressure_opens.append(str(path))
            return _EopnotsuppFile()
        return real_open(path, mode, *args, **kwargs)  # type: ignore[call-overload]

    monkeypatch.setattr(host, "_open", fake_open)
    now = 1000.0
    sampler = tree.sampler()
    sampler._now = lambda: now
    with caplog.at_level(logging.DEBUG, logger="kvpressure.agent.samplers.host"):
        for _ in range(5):
            batch = collect(sampler)
            assert status(batch, "psi") == ("unsupported", "psi_disabled_boot_param")
            assert not series(batch, PSI)
            assert status(batch, "vmstat") == ("ok", "")
            now += 1.0
    assert len(pressure_opens) == 1  # probed once, not every cycle
    logged = [r for r in caplog.records if "psi_disabled_boot_param" in r.getMessage()]
    assert len(logged) == 1
    assert "psi=1" in logged[0].getMessage()

    now += host.PSI_REPROBE_S  # slow re-probe: still disabled, read once more, no new log
    assert status(collect(sampler), "psi") == ("unsupported", "psi_disabled_boot_param")
    assert len(pressure_opens) == 2
    assert len([r for r in caplog.records if "psi_disabled_boot_param" in r.getMessage()]) == 1

    psi_disabled = False  # e.g. the host was rebooted with psi=1 under a long-lived mount
    now += host.PSI_REPROBE_S
    batch = collect(sampler)
    assert status(batch, "psi") == ("ok", "")
    assert value(batch, PSI, resource="io", kind="full", scope="system") == 1.25


def test_eopnotsupp_from_psi_also_marks_engine_cgroup_psi_unsupported(
    tree: Tree, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_open = host._open

    def fake_open(path: str, mode: str = "r", *args: object, **kwargs: object) -> object:
        if f"{os.sep}pressure{os.sep}" in str(path) or str(path).endswith(".pressure"):
            return _EopnotsuppFile()
        return real_open(path, mode, *args, **kwargs)  # type: ignore[call-overload]

    tree.cgroup_file("system.slice/llama.service/cpu.pressure", "some avg10=1 total=1\n")
    monkeypatch.setattr(host, "_open", fake_open)
    batch = collect(tree.sampler(engine_cgroups={"llamacpp": "llama.service"}))
    assert status(batch, "psi") == ("unsupported", "psi_disabled_boot_param")
    assert status(batch, "psi_cgroup") == ("unsupported", "psi_disabled_boot_param")


def engine_pressure(tree: Tree, rel: str, cpu: str) -> None:
    tree.cgroup_file(f"{rel}/cpu.pressure", cpu)
    tree.cgroup_file(
        f"{rel}/memory.pressure",
        "some avg10=12.50 avg60=0 avg300=0 total=4000000\n"
        "full avg10=2.50 avg60=0 avg300=0 total=1000000\n",
    )
    tree.cgroup_file(f"{rel}/io.pressure", fixture("23-psi-unavailable.memory.input.txt"))


def test_engine_cgroup_psi_by_path_and_unit_and_missing(tree: Tree) -> None:
    bogus_cpu = fixture("23-psi-unavailable.cpu-full-bogus.input.txt")
    engine_pressure(tree, "system.slice/llama.service", bogus_cpu)
    engine_pressure(tree, "workload.slice/vllm.service", bogus_cpu)
    engine_pressure(tree, "machine.slice/sglang-1.scope", bogus_cpu)
    sampler = tree.sampler(
        engine_cgroups={
            "llamacpp": "llama.service",  # unit in system.slice
            "vllm": "vllm.service",  # unit in another top-level slice
            "sglang": "/machine.slice/sglang-1.scope",  # path with a leading slash
            "tgi": "system.slice/tgi.service",  # not there
            "escape": "../../../etc",  # outside the cgroup mount
        }
    )
    batch = collect(sampler)
    assert status(batch, "psi_cgroup") == ("error", "cgroup_not_found")
    for scope in ("llamacpp", "vllm", "sglang"):
        # cgroup-level cpu full is meaningful, unlike the system-level one.
        assert value(batch, PSI, resource="cpu", kind="full", scope=scope) == 358.783277
        assert value(batch, AVG10, resource="memory", kind="some", scope=scope) == 0.125
        assert value(batch, PSI, resource="memory", kind="full", scope=scope) == 1.0
        assert value(batch, PSI, resource="io", kind="some", scope=scope) == 0.0
    scopes = {dict(labels)["scope"] for labels in series(batch, PSI)}
    assert scopes == {"system", "llamacpp", "vllm", "sglang"}
    assert value(batch, PSI, resource="cpu", kind="full", scope="system") is None
    assert status(batch, "psi") == ("ok", "")


def test_engine_cgroup_with_relative_sysfs_root(
    tree: Tree, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine_pressure(tree, "system.slice/llama.service", "some avg10=0 total=5\n")
    monkeypatch.chdir(tree.sys.parent)
    sampler = HostSampler(
        "./proc",
        "./sys",
        engine_cgroups={"a": "llama.service", "b": "./system.slice/llama.service"},
    )
    batch = collect(sampler)
    assert status(batch, "psi_cgroup") == ("ok", "")
    assert value(batch, PSI, resource="cpu", kind="some", scope="a") == 5e-6
    assert value(batch, PSI, resource="cpu", kind="some", scope="b") == 5e-6


def test_engine_cgroup_found_later_and_all_found_is_ok(tree: Tree) -> None:
    sampler = tree.sampler(engine_cgroups={"vllm": "vllm.service"})
    now = 0.0
    sampler._now = lambda: now
    assert status(collect(sampler), "psi_cgroup") == ("error", "cgroup_not_found")
    engine_pressure(tree, "system.slice/vllm.service", "some avg10=0 total=5\n")
    # The direct system.slice location is checked every cycle.
    batch = collect(sampler)
    assert status(batch, "psi_cgroup") == ("ok", "")
    assert value(batch, PSI, resource="cpu", kind="some", scope="vllm") == 5e-6


def test_engine_cgroup_without_pressure_files_is_unsupported(tree: Tree) -> None:
    (tree.sys / "fs/cgroup/system.slice/llama.service").mkdir(parents=True)
    batch = collect(tree.sampler(engine_cgroups={"llamacpp": "system.slice/llama.service"}))
    assert status(batch, "psi_cgroup") == ("unsupported", "no_pressure_files")


def test_hybrid_host_finds_engine_cgroups_under_unified(tmp_path: Path) -> None:
    t = Tree(tmp_path)
    t.proc_file("meminfo", MEMINFO)
    t.proc_file("self/cgroup", "4:memory:/\n0::/\n")
    t.cgroup_file("memory/memory.limit_in_bytes", V1_UNLIMITED)
    t.cgroup_file("memory/memory.usage_in_bytes", "77\n")
    t.cgroup_file("unified/cgroup.controllers", "")
    engine_pressure(t, "unified/system.slice/llama.service", "some avg10=0 total=5\n")
    batch = collect(t.sampler(engine_cgroups={"llamacpp": "llama.service"}))
    assert status(batch, "psi_cgroup") == ("ok", "")
    assert value(batch, PSI, resource="cpu", kind="some", scope="llamacpp") == 5e-6
    assert value(batch, "kvpressure_host_cgroup_memory_used_bytes") == 77


CG_USED = "kvpressure_cgroup_memory_used_bytes"
CG_LIMIT = "kvpressure_cgroup_memory_limit_bytes"
CG_EVENTS = "kvpressure_cgroup_memory_events_total"


def test_engine_cgroup_memory_charge_limits_and_events(tree: Tree) -> None:
    d = "system.slice/vllm.service"
    tree.cgroup_file(f"{d}/memory.current", "3221225472\n")
    tree.cgroup_file(f"{d}/memory.max", "4294967296\n")
    tree.cgroup_file(f"{d}/memory.high", "max\n")
    tree.cgroup_file(
        f"{d}/memory.events", "low 0\nhigh 12\nmax 7\noom 1\noom_kill 1\noom_group_kill 0\n"
    )
    tree.cgroup_file("system.slice/llama.service/memory.current", "1000\n")  # no limits
    tree.cgroup_file("system.slice/llama.service/memory.max", "max\n")
    batch = collect(
        tree.sampler(engine_cgroups={"vllm": "vllm.service", "llamacpp": "llama.service"})
    )
    assert status(batch, "cgroup_memory") == ("ok", "")
    assert value(batch, CG_USED, scope="vllm") == 3221225472
    assert value(batch, CG_LIMIT, scope="vllm", limit="max") == 4294967296
    assert value(batch, CG_LIMIT, scope="vllm", limit="high") is None  # "max": unlimited, absent
    assert value(batch, CG_EVENTS, scope="vllm", event="max") == 7
    assert value(batch, CG_EVENTS, scope="vllm", event="oom_kill") == 1
    assert value(batch, CG_EVENTS, scope="vllm", event="low") is None  # not exported
    assert value(batch, CG_USED, scope="llamacpp") == 1000
    assert not [k for k in series(batch, CG_LIMIT) if ("scope", "llamacpp") in k]


def test_engine_cgroup_memory_without_controller_or_cgroup_or_with_garbage(tree: Tree) -> None:
    (tree.sys / "fs/cgroup/system.slice/a.service").mkdir(parents=True)  # no memory controller
    batch = collect(tree.sampler(engine_cgroups={"a": "a.service"}))
    assert status(batch, "cgroup_memory") == ("unsupported", "no_memory_controller")
    assert not series(batch, CG_USED)

    tree.cgroup_file("system.slice/b.service/memory.current", "lots\n")
    tree.cgroup_file("system.slice/b.service/memory.max", "-\n")
    tree.cgroup_file("system.slice/b.service/memory.events", "max many\nhigh 3\n")
    batch = collect(
        tree.sampler(engine_cgroups={"a": "a.service", "b": "b.service", "c": "c.service"})
    )
    got = status(batch, "cgroup_memory")  # an error outranks the unsupported part
    assert got is not None and got[0] == "error", got
    assert value(batch, CG_USED, scope="b") is None
    assert value(batch, CG_EVENTS, scope="b", event="high") == 3  # the good line still counts
    assert value(batch, CG_EVENTS, scope="b", event="max") is None
    assert status(collect(tree.sampler(engine_cgroups={"b": "b.service"})), "cgroup_memory") == (
        "error",
        "parse_error",
    )


# --- diskstats (case 24) ----------------------------------------------------------------

EXTRA_DISKSTATS = """\
   8      16 sdb 1 2 3 4 5 6 7 8 9 10 11
   8      32 sdc 10 0 20 0 30 0 40 0 0 500 600 1 2 3 4
   8       1 sda1 100 0 200 0 300 0 400 0 0 5 6 0 0 0 0 0 0
   7       0 loop0 1 0 2 0 3 0 4 0 0 5 6 0 0 0 0 0 0
 253       0 dm-0 1 0 2 0 3 0 4 0 0 5 6 0 0 0 0 0 0
   8      48 sdd 1 2 x 4 5 6 7 8 9 10 11
   8      64 sde 1 2 3
"""
DISK_METRICS = {
    "read_bytes": "kvpressure_disk_read_bytes_total",
    "written_bytes": "kvpressure_disk_written_bytes_total",
    "reads": "kvpressure_disk_reads_completed_total",
    "writes": "kvpressure_disk_writes_completed_total",
    "io_s": "kvpressure_disk_io_time_seconds_total",
    "weighted_s": "kvpressure_disk_io_time_weighted_seconds_total",
}


def test_case24_twenty_field_lines_parse_with_flush_and_discard_groups() -> None:
    stats, bad = parse_diskstats(fixture("24-diskstats-nvme-20-fields.input.txt"))
    assert bad == 0
    nvme, sda = stats
    assert nvme.name == "nvme0n1"
    assert (nvme.reads_completed, nvme.read_bytes, nvme.read_ms) == (109916, 3647526912, 550966)
    assert (nvme.writes_completed, nvme.written_bytes, nvme.write_ms) == (
        115172,
        4759757824,
        219723,
    )
    assert (nvme.in_flight, nvme.io_ms, nvme.weighted_ms) == (0, 51641, 694795)
    assert (nvme.discards_completed, nvme.flushes_completed, nvme.flush_ms) == (0, 4958, 2319)
    assert (sda.reads_completed, sda.writes_completed, sda.io_ms) == (104019, 33788, 35594)
    assert (sda.flushes_completed, sda.flush_ms) == (2303, 1625)


@pytest.mark.parametrize(
    ("line", "ok", "discards", "flushes"),
    [
        ("8 0 sda 1 2 3 4 5 6 7 8 9 10 11", True, None, None),  # 14 fields (pre-4.18)
        ("8 0 sda 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15", True, 12, None),  # 18 (4.18+)
        ("8 0 sda 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17", True, 12, 16),  # 20 (5.5+)
        ("8 0 sda 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20", True, 12, 16),  # future
        ("8 0 sda 1 2 3 4 5 6 7 8 9 10", False, None, None),  # 13 fields
        ("8 0 sda 1 2 3 4 5 6 7 8 9 10 x", False, None, None),  # non-numeric counter
        ("8 0 sda 1 2 3 4 5 6 7 8 9 10 -1", False, None, None),  # negative counter
        ("8 1 sda1 1 2 3 4", False, None, None),  # 2.6 partition format
    ],
)
def test_diskstats_field_counts(
    line: str, ok: bool, discards: int | None, flushes: int | None
) -> None:
    stats, bad = parse_diskstats(line + "\n\n")
    assert (len(stats), bad) == ((1, 0) if ok else (0, 1))
    if ok:
        assert stats[0].weighted_ms == 11
        assert stats[0].discards_completed == discards
        assert stats[0].flushes_completed == flushes


def test_case24_sampler_exports_whole_physical_disks_only(
    tree: Tree, caplog: pytest.LogCaptureFixture
) -> None:
    tree.proc_file("diskstats", fixture("24-diskstats-nvme-20-fields.input.txt") + EXTRA_DISKSTATS)
    for name in ("sdb", "sdc", "sdd", "sde"):
        tree.block(name)
    tree.block("dm-0", virtual=True)
    with caplog.at_level(logging.WARNING, logger="kvpressure.agent.samplers.host"):
        batch = collect(tree.sampler())
    want = {
        "nvme0n1": {
            "read_bytes": 3647526912,
            "written_bytes": 4759757824,
            "reads": 109916,
            "writes": 115172,
            "io_s": 51.641,
            "weighted_s": 694.795,
        },
        "sda": {
            "read_bytes": 4430926 * 512,
            "written_bytes": 2499633 * 512,
            "reads": 104019,
            "writes": 33788,
            "io_s": 35.594,
            "weighted_s": 12.302,
        },
        "sdb": {
            "read_bytes": 3 * 512,
            "written_bytes": 7 * 512,
            "reads": 1,
            "writes": 5,
            "io_s": 0.010,
            "weighted_s": 0.011,
        },
        "sdc": {
            "read_bytes": 20 * 512,
            "written_bytes": 40 * 512,
            "reads": 10,
            "writes": 30,
            "io_s": 0.5,
            "weighted_s": 0.6,
        },
    }
    for key, metric in DISK_METRICS.items():
        got = {dict(labels)["device"]: v for labels, v in series(batch, metric).items()}
        assert got == pytest.approx({dev: w[key] for dev, w in want.items()}), metric
    assert status(batch, "diskstats") == ("ok", "")
    assert len([r for r in caplog.records if "malformed" in r.getMessage()]) == 1


@pytest.mark.parametrize(
    ("name", "physical"),
    [
        ("sda", True),
        ("vda", True),
        ("xvdb", True),
        ("nvme0n1", True),
        ("mmcblk0", True),
        ("sda1", False),
        ("vda15", False),
        ("xvdb2", False),
        ("nvme0n1p1", False),
        ("mmcblk0p1", False),
        ("loop0", False),
        ("ram15", False),
        ("zram0", False),
        ("dm-3", False),
        ("md127", False),
        ("sr0", False),
        ("nbd0", False),
    ],
)
def test_physical_disk_name_fallback(name: str, physical: bool) -> None:
    assert is_physical_disk_name(name) is physical


def test_diskstats_without_sys_block_uses_name_rules(tree: Tree) -> None:
    tree.proc_file("diskstats", fixture("24-diskstats-nvme-20-fields.input.txt") + EXTRA_DISKSTATS)
    for link in (tree.sys / "block").iterdir():
        link.unlink()
    (tree.sys / "block").rmdir()
    batch = collect(tree.sampler())
    devices = {dict(labels)["device"] for labels in series(batch, DISK_METRICS["reads"])}
    assert devices == {"nvme0n1", "sda", "sdb", "sdc"}


def test_physical_disk_set_is_cached_and_refreshed(tree: Tree) -> None:
    tree.proc_file("diskstats", fixture("24-diskstats-nvme-20-fields.input.txt") + EXTRA_DISKSTATS)
    sampler = tree.sampler()
    now = 0.0
    sampler._now = lambda: now
    reads = DISK_METRICS["reads"]
    assert value(collect(sampler), reads, device="sdb") is None
    tree.block("sdb")  # hot-plugged
    now = host.REFRESH_S - 1
    assert value(collect(sampler), reads, device="sdb") is None
    now = host.REFRESH_S + 1
    assert value(collect(sampler), reads, device="sdb") == 1


# --- network ----------------------------------------------------------------------------


def test_netdev_counters(tree: Tree) -> None:
    tree.proc_file("net/dev", NETDEV + "  eth1:123 4 1 2 0 0 0 0 456 7 3 4 0 0 0 0\n bad: 1 2\n")
    batch = collect(tree.sampler())
    assert value(batch, "kvpressure_net_receive_bytes_total", interface="eth0") == 161901943
    assert value(batch, "kvpressure_net_transmit_bytes_total", interface="eth0") == 203294
    assert value(batch, "kvpressure_net_receive_errors_total", interface="eth0") == 5
    assert value(batch, "kvpressure_net_receive_drops_total", interface="eth0") == 6
    assert value(batch, "kvpressure_net_transmit_errors_total", interface="eth0") == 7
    assert value(batch, "kvpressure_net_transmit_drops_total", interface="eth0") == 8
    assert value(batch, "kvpressure_net_receive_bytes_total", interface="eth1") == 123
    assert value(batch, "kvpressure_net_transmit_drops_total", interface="eth1") == 4
    interfaces = {dict(k)["interface"] for k in series(batch, "kvpressure_net_receive_bytes_total")}
    assert interfaces == {"lo", "eth0", "eth1"}


def test_netdev_caps_interfaces_physical_first_and_logs_once(
    tree: Tree, caplog: pytest.LogCaptureFixture
) -> None:
    lines = [f"veth{i}: {i} 0 0 0 0 0 0 0 {i} 0 0 0 0 0 0 0" for i in range(80)]
    lines += ["ens5: 999 0 0 0 0 0 0 0 1 0 0 0 0 0 0 0"]
    tree.proc_file("net/dev", "\n".join(NETDEV.splitlines()[:2] + lines) + "\n")
    (tree.sys / "devices/pci0000:00/net/ens5").mkdir(parents=True)
    (tree.sys / "class/net").mkdir(parents=True)
    (tree.sys / "class/net/ens5").symlink_to(tree.sys / "devices/pci0000:00/net/ens5")
    sampler = tree.sampler()
    with caplog.at_level(logging.WARNING, logger="kvpressure.agent.samplers.host"):
        batches = [collect(sampler) for _ in range(3)]
    for batch in batches:
        got = series(batch, "kvpressure_net_receive_bytes_total")
        assert len(got) == host.MAX_INTERFACES
        assert got[make_labels({"interface": "ens5"})] == 999
        assert make_labels({"interface": "veth62"}) in got
        assert make_labels({"interface": "veth63"}) not in got
    assert len([r for r in caplog.records if "network interfaces" in r.getMessage()]) == 1


def test_snmp_by_name_not_position(tree: Tree) -> None:
    batch = collect(tree.sampler())
    assert value(batch, "kvpressure_net_tcp_retransmitted_segments_total") == 314
    assert parse_snmp(SNMP)["Ip"]["InReceives"] == 12345
    assert parse_snmp("Tcp: A B\nTcp: 1\n") == {}  # mismatched pair skipped


def test_snmp_without_tcp_is_an_error(tree: Tree) -> None:
    tree.proc_file("net/snmp", "Ip: Forwarding\nIp: 1\n")
    batch = collect(tree.sampler())
    assert status(batch, "snmp") == ("error", "missing_field")
    assert value(batch, "kvpressure_net_tcp_retransmitted_segments_total") is None


# --- NUMA tiers -------------------------------------------------------------------------

TIER = "kvpressure_memory_tier_bytes"


def test_numa_tiers_dram_and_cxl(tree: Tree) -> None:
    batch = collect(tree.sampler())
    assert value(batch, TIER, tier="dram", node="0", state="total") == 8000000 * KB
    assert value(batch, TIER, tier="dram", node="0", state="free") == 3000000 * KB
    assert value(batch, TIER, tier="dram", node="0", state="used") == 5000000 * KB
    assert value(batch, TIER, tier="cxl", node="1", state="total") == 4000000 * KB
    assert value(batch, TIER, tier="cxl", node="1", state="free") == 3500000 * KB
    assert value(batch, TIER, tier="cxl", node="1", state="used") == 500000 * KB  # no MemUsed
    assert value(batch, TIER, tier="swap", state="total") == 2000000 * KB
    assert value(batch, TIER, tier="swap", state="used") == 500000 * KB
    assert value(batch, TIER, tier="swap", state="free") == 1500000 * KB
    assert value(batch, TIER, tier="dram", state="total") is None  # no node-less dram here
    assert status(batch, "numa") == ("ok", "")


def test_without_numa_sysfs_dram_comes_from_meminfo(tree: Tree, tmp_path: Path) -> None:
    nodes = tree.sys / "devices/system/node"
    nodes.rename(tmp_path / "gone")
    batch = collect(tree.sampler())
    assert status(batch, "numa") == ("unsupported", "no_numa_sysfs")
    assert value(batch, TIER, tier="dram", state="total") == 16000000 * KB
    assert value(batch, TIER, tier="dram", state="free") == 4000000 * KB
    assert value(batch, TIER, tier="dram", state="used") == 12000000 * KB
    assert value(batch, TIER, tier="swap", state="total") == 2000000 * KB


def test_numa_node_meminfo_unreadable_is_an_error_for_that_node_only(tree: Tree) -> None:
    (tree.sys / "devices/system/node/node1/meminfo").unlink()
    batch = collect(tree.sampler())
    assert status(batch, "numa") == ("error", "not_found")
    assert value(batch, TIER, tier="dram", node="0", state="total") == 8000000 * KB
    assert value(batch, TIER, tier="cxl", node="1", state="total") is None


# --- failures stay local ----------------------------------------------------------------


def test_failing_sources_do_not_stop_the_others(tree: Tree) -> None:
    (tree.proc / "diskstats").unlink()
    (tree.proc / "diskstats").mkdir()  # read() -> IsADirectoryError
    (tree.proc / "net/snmp").unlink()
    tree.proc_file("vmstat", "\x00\xff garbage without pairs\n")
    batch = collect(tree.sampler())
    assert status(batch, "diskstats") == ("error", "read_error")
    assert status(batch, "snmp") == ("error", "not_found")
    assert status(batch, "vmstat") == ("error", "parse_error")
    assert not series(batch, DISK_METRICS["reads"])
    for source in ("meminfo", "cgroup", "psi", "netdev", "numa"):
        assert status(batch, source) == ("ok", ""), source
    assert value(batch, "kvpressure_host_memory_total_bytes") == 16000000 * KB
    assert value(batch, "kvpressure_net_receive_bytes_total", interface="eth0") == 161901943
    assert value(batch, PSI, resource="io", kind="some", scope="system") == 2.5


def test_empty_roots_never_raise(tmp_path: Path) -> None:
    sampler = HostSampler(
        str(tmp_path / "proc"), str(tmp_path / "sys"), engine_cgroups={"vllm": "vllm.service"}
    )
    batch = collect(sampler)
    assert len(batch) == 0
    assert {s.source for s in batch.sources} == {*SOURCES, "psi_cgroup", "cgroup_memory"}
    assert status(batch, "psi") == ("unsupported", "kernel_without_psi")
    assert status(batch, "meminfo") == ("error", "not_found")


def test_error_logged_once_until_recovery(tree: Tree, caplog: pytest.LogCaptureFixture) -> None:
    sampler = tree.sampler()
    snmp = tree.proc / "net/snmp"
    with caplog.at_level(logging.WARNING, logger="kvpressure.agent.samplers.host"):
        snmp.rename(tree.proc / "snmp.bak")
        collect(sampler)
        collect(sampler)
        (tree.proc / "snmp.bak").rename(snmp)
        assert status(collect(sampler), "snmp") == ("ok", "")
        snmp.unlink()
        collect(sampler)
    assert len([r for r in caplog.records if "source snmp failed" in r.getMessage()]) == 2


FILES = ("meminfo", "self/cgroup", "vmstat", "pressure/cpu", "diskstats", "net/dev", "net/snmp")


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    target=st.sampled_from(FILES),
    content=st.one_of(
        st.text(max_size=300),
        st.lists(
            st.one_of(
                st.integers(-(2**70), 2**70).map(str),
                st.sampled_from(
                    ["some", "full", "avg10=", "total=", "kB", ":", "Tcp:", "|", "max", "nan", "-"]
                ),
            ),
            max_size=40,
        ).map(" ".join),
    ),
)
def test_arbitrary_file_contents_never_raise(tree: Tree, target: str, content: str) -> None:
    tree.proc_file(target, content)
    tree.cgroup_file("system.slice/memory.max", content[:40])
    tree.cgroup_file("system.slice/memory.current", content[:20])
    tree.cgroup_file("system.slice/memory.events", content)
    batch = collect(tree.sampler(engine_cgroups={"x": "system.slice"}))
    assert {s.source for s in batch.sources} == {*SOURCES, "psi_cgroup", "cgroup_memory"}
    assert all(s.name in catalogue.CATALOGUE for s in batch)


# --- the real machine -------------------------------------------------------------------


@pytest.mark.skipif(not Path("/proc/meminfo").exists(), reason="needs Linux procfs")
def test_real_proc_and_sys() -> None:
    sampler = HostSampler()
    batch = collect(sampler)
    batch = collect(sampler)  # second cycle uses the caches
    total = value(batch, "kvpressure_host_memory_total_bytes")
    available = value(batch, "kvpressure_host_memory_available_bytes")
    assert total is not None and total > 0
    assert available is not None and 0 <= available <= total
    assert value(batch, "kvpressure_host_meminfo_total_bytes") >= total  # type: ignore[operator]
    assert series(batch, DISK_METRICS["reads"]) or series(
        batch, "kvpressure_net_receive_bytes_total"
    )
    assert status(batch, "meminfo") == ("ok", "")
    assert status(batch, "vmstat") == ("ok", "")
    assert status(batch, "netdev") == ("ok", "")
    for s in batch:
        assert s.name in catalogue.CATALOGUE
        assert s.value >= 0, s
    per_call = timeit.timeit(lambda: sampler.collect(Batch()), number=50) / 50
    assert per_call < 0.05, f"collect() took {per_call * 1e3:.1f} ms"


def test_memory_cgroup_none_uses_meminfo_alone(tmp_path):
    """A systemd unit's MemoryMax (the agent's own cgroup) must not cap the host view."""
    root = tmp_path / "root"
    proc = root / "proc"
    cg = root / "sys" / "fs" / "cgroup" / "system.slice" / "kvpressure.service"
    cg.mkdir(parents=True)
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text(
        "MemTotal: 1000 kB\nMemFree: 500 kB\nMemAvailable: 800 kB\n"
        "SwapTotal: 0 kB\nSwapFree: 0 kB\n"
    )
    (proc / "self" / "cgroup").write_text("0::/system.slice/kvpressure.service\n")
    (cg / "memory.max").write_text("102400\n")
    (cg / "memory.current").write_text("51200\n")
    capped = Batch()
    HostSampler(str(proc), str(root / "sys")).collect(capped)
    host_view = Batch()
    HostSampler(str(proc), str(root / "sys"), memory_cgroup="none").collect(host_view)
    assert value(capped, "kvpressure_host_memory_total_bytes") == 102400
    assert value(host_view, "kvpressure_host_memory_total_bytes") == 1000 * 1024
    assert value(host_view, "kvpressure_host_memory_available_bytes") == 800 * 1024
    assert "cgroup" not in {s.source for s in host_view.sources}


def test_read_text_keeps_files_open_yet_sees_new_content_and_deleted_files(
    tmp_path: Path,
) -> None:
    f = tmp_path / "meminfo"
    f.write_text("MemTotal: 1 kB\n")
    assert host._read_text(str(f)) == "MemTotal: 1 kB\n"
    assert str(f) in host._kept  # kept open for the next cycle
    f.write_text("MemTotal: 22 kB\n")  # rewritten in place, as /proc regenerates it
    assert host._read_text(str(f)) == "MemTotal: 22 kB\n"
    f.unlink()
    with pytest.raises(FileNotFoundError):
        host._read_text(str(f))
    f.write_text("MemTotal: 3 kB\n")  # a new file under the same name
    assert host._read_text(str(f)) == "MemTotal: 3 kB\n"


# --- 10 Hz: the slower sources once a second ----------------------------------------------

SLOW_SOURCES = ("diskstats", "netdev", "snmp", "numa")
RETRANS = "kvpressure_net_tcp_retransmitted_segments_total"


def test_at_10hz_disks_network_and_numa_are_read_once_a_second_and_held(tree: Tree) -> None:
    now = 100.0
    sampler = tree.sampler(interval_s=0.1)
    sampler._now = lambda: now
    first = collect(sampler)
    assert first.held == 0
    slow_first = [
        s
        for s in first
        if s.name.startswith(("kvpressure_disk_", "kvpressure_net_", "kvpressure_host_cpu_"))
    ]
    assert slow_first and series(first, "kvpressure_memory_tier_bytes")
    tree.proc_file("net/snmp", SNMP.replace("Tcp: 1 314", "Tcp: 1 400"))
    tree.proc_file("stat", PROC_STAT.replace("cpu  26025", "cpu  27025"))
    tree.proc_file("meminfo", MEMINFO.replace("10000000 kB", "9000000 kB"))
    user = "kvpressure_host_cpu_seconds_total"
    for k in range(1, 10):  # 0.1 s apart, jittered: none reaches the next read
        now = 100.0 + k / 10 + (0.04 if k % 2 else -0.04)
        batch = collect(sampler)
        assert value(batch, RETRANS) == 314  # held
        assert value(batch, user, mode="user") == value(first, user, mode="user")
        assert value(batch, "kvpressure_host_meminfo_available_bytes") == 9000000 * KB  # read
        for source in SOURCES:
            assert status(batch, source) == ("ok", "")
        recorded = batch.recorded()
        assert batch.samples[len(recorded) :] == [
            s for s in first if s in batch.samples[len(recorded) :]
        ]
        assert not [s for s in recorded if s in slow_first or s.name == RETRANS]
        assert value(batch, "kvpressure_disk_read_bytes_total", device="nvme0n1") == value(
            first, "kvpressure_disk_read_bytes_total", device="nvme0n1"
        )
    now = 101.0
    batch = collect(sampler)
    assert batch.held == 0
    assert value(batch, RETRANS) == 400
    assert value(batch, user, mode="user") == 27025 / os.sysconf("SC_CLK_TCK")


def test_at_one_second_or_more_every_source_is_read_every_cycle(tree: Tree) -> None:
    now = 100.0
    sampler = tree.sampler(interval_s=1.0)
    sampler._now = lambda: now
    collect(sampler)
    tree.proc_file("net/snmp", SNMP.replace("Tcp: 1 314", "Tcp: 1 400"))
    now += 0.9  # a cycle that came a little early
    batch = collect(sampler)
    assert batch.held == 0
    assert value(batch, RETRANS) == 400


def test_a_failing_slow_source_keeps_its_status_between_reads(tree: Tree) -> None:
    tree.proc_file("net/snmp", "Ip: Forwarding\nIp: 1\n")
    now = 100.0
    sampler = tree.sampler(interval_s=0.1)
    sampler._now = lambda: now
    assert status(collect(sampler), "snmp") == ("error", "missing_field")
    tree.proc_file("net/snmp", SNMP)
    now += 0.1
    batch = collect(sampler)
    assert status(batch, "snmp") == ("error", "missing_field")
    assert value(batch, RETRANS) is None
    now += 1.0
    assert status(collect(sampler), "snmp") == ("ok", "")


CGROUP_FIGURES = (
    "kvpressure_host_cgroup_memory_limit_bytes",
    "kvpressure_host_cgroup_memory_used_bytes",
    "kvpressure_host_memory_total_bytes",
    "kvpressure_host_memory_available_bytes",
)


def usage_cycle_matches_a_full_read(t: Tree) -> None:
    """At 10 Hz a cycle between two full cgroup reads reads only the usage files the last
    full read found; it must export what a full read of the same files would, once every
    usage has changed."""
    now = 100.0
    fast = t.sampler(interval_s=0.1)
    fast._now = lambda: now
    collect(fast)
    for f in (t.sys / "fs" / "cgroup").rglob("memory.*"):
        if f.name in ("memory.current", "memory.usage_in_bytes"):
            f.write_text(f"{int(f.read_text()) + GIB}\n")
    now += 0.1
    read: list[str] = []
    real = host._read_text

    def spy(path: str) -> str:
        read.append(path)
        return real(path)

    host._read_text = spy  # type: ignore[assignment]
    try:
        got = collect(fast)
    finally:
        host._read_text = real  # type: ignore[assignment]
    want = collect(t.sampler())
    for name in CGROUP_FIGURES:
        assert series(got, name) == series(want, name), name
    assert status(got, "cgroup") == status(want, "cgroup")
    full = [p for p in read if p.endswith(("/cgroup", ".max", "limit_in_bytes", "memory.stat"))]
    # a clean full read is followed by usage reads alone; one that was not, by full reads
    assert bool(full) is (status(want, "cgroup") != ("ok", ""))


def test_cgroup_usage_cycles_match_full_reads(tmp_path: Path) -> None:
    cases = {
        "v2-ancestor-binds": (
            "0::/kubepods/pod/ctr\n",
            {
                "kubepods/memory.max": 8 * GIB,
                "kubepods/memory.current": 6 * GIB,
                "kubepods/pod/memory.max": "max",
                "kubepods/pod/memory.current": 5 * GIB,
                "kubepods/pod/ctr/memory.max": 12 * GIB,
                "kubepods/pod/ctr/memory.current": 1 * GIB,
            },
        ),
        "v2-own-binds": (
            "0::/kubepods/pod/ctr\n",
            {"kubepods/memory.max": 8 * GIB, "kubepods/pod/ctr/memory.max": 4 * GIB,
             "kubepods/pod/ctr/memory.current": 1 * GIB, "kubepods/memory.current": 6 * GIB},
        ),
        "v2-unlimited": ("0::/a\n", {"a/memory.max": "max", "a/memory.current": 7}),
        "v2-garbage-limit": ("0::/\n", {"memory.max": "lots", "memory.current": 12}),
        "v1-ancestor": (
            "4:memory:/docker/abc\n0::/\n",
            {
                "memory/memory.limit_in_bytes": V1_UNLIMITED.strip(),
                "memory/memory.usage_in_bytes": 9000000000,
                "memory/docker/memory.limit_in_bytes": 4 * GIB,
                "memory/docker/memory.usage_in_bytes": 3 * GIB,
                "memory/docker/abc/memory.limit_in_bytes": V1_UNLIMITED.strip(),
                "memory/docker/abc/memory.usage_in_bytes": 2 * GIB,
                "memory/docker/abc/memory.stat": f"cache 0\nhierarchical_memory_limit {4 * GIB}",
            },
        ),
    }  # fmt: skip
    for name, (self_cgroup, files) in cases.items():
        (tmp_path / name).mkdir()
        t = Tree(tmp_path / name)
        t.proc_file("meminfo", MEMINFO)
        t.proc_file("self/cgroup", self_cgroup)
        t.cgroup_file("cgroup.controllers", "memory\n")
        for rel, content in files.items():
            t.cgroup_file(rel, f"{content}\n")
        usage_cycle_matches_a_full_read(t)


def test_cgroup_limits_are_read_once_a_second_and_a_vanished_usage_file_reads_all(
    tmp_path: Path,
) -> None:
    t = Tree(tmp_path)
    t.proc_file("meminfo", MEMINFO)
    t.proc_file("self/cgroup", "0::/kubepods/ctr\n")
    t.cgroup_file("cgroup.controllers", "memory\n")
    t.cgroup_file("kubepods/memory.max", f"{8 * GIB}\n")
    t.cgroup_file("kubepods/memory.current", f"{6 * GIB}\n")
    t.cgroup_file("kubepods/ctr/memory.max", "max\n")
    t.cgroup_file("kubepods/ctr/memory.current", f"{1 * GIB}\n")
    now = 100.0
    sampler = t.sampler(interval_s=0.1)
    sampler._now = lambda: now
    limit, used = CGROUP_FIGURES[:2]
    assert value(collect(sampler), limit) == 8 * GIB
    t.cgroup_file("kubepods/memory.max", f"{7 * GIB}\n")  # an operator lowers the limit
    t.cgroup_file("kubepods/ctr/memory.current", f"{2 * GIB}\n")
    now += 0.1
    batch = collect(sampler)
    assert (value(batch, limit), value(batch, used)) == (8 * GIB, 2 * GIB)
    now += 1.0
    assert value(collect(sampler), limit) == 7 * GIB
    # the agent moved to another cgroup (its own one removed): read in full that cycle
    t.proc_file("self/cgroup", "0::/kubepods/new\n")
    (t.sys / "fs/cgroup/kubepods/ctr/memory.current").unlink()
    t.cgroup_file("kubepods/new/memory.current", f"{3 * GIB}\n")
    now += 0.1
    batch = collect(sampler)
    assert (value(batch, limit), value(batch, used)) == (7 * GIB, 3 * GIB)
    assert status(batch, "cgroup") == ("ok", "")


def test_engine_cgroup_limits_at_10hz_are_read_once_a_second_and_their_errors_kept(
    tree: Tree,
) -> None:
    d = "system.slice/vllm.service"
    tree.cgroup_file(f"{d}/memory.current", "1000\n")
    tree.cgroup_file(f"{d}/memory.max", "4096\n")
    tree.cgroup_file(f"{d}/memory.high", "lots\n")
    now = 100.0
    sampler = tree.sampler(interval_s=0.1, engine_cgroups={"vllm": "vllm.service"})
    sampler._now = lambda: now
    batch = collect(sampler)
    assert value(batch, CG_LIMIT, scope="vllm", limit="max") == 4096
    assert status(batch, "cgroup_memory") == ("error", "parse_error")
    tree.cgroup_file(f"{d}/memory.current", "2000\n")
    tree.cgroup_file(f"{d}/memory.max", "8192\n")
    tree.cgroup_file(f"{d}/memory.high", "max\n")
    now += 0.1
    batch = collect(sampler)  # the charge read again, the limits repeated with their error
    assert value(batch, CG_USED, scope="vllm") == 2000
    assert value(batch, CG_LIMIT, scope="vllm", limit="max") == 4096
    assert status(batch, "cgroup_memory") == ("error", "parse_error")
    now += 1.0
    batch = collect(sampler)
    assert value(batch, CG_LIMIT, scope="vllm", limit="max") == 8192
    assert status(batch, "cgroup_memory") == ("ok", "")
