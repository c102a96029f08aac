"""CPU stall time is contention only in the share of busy CPU that is not the engine's own.

Issue 13: on 2 cores the real vLLM CPU engine's own worker keeps host CPU PSI at ~0.99
whenever it is busy, so a KV-starved request whose scope held one preemption (memory 0.5)
was named compute (1.0). The rule now reads the stall rate at most as the share of the host's
busy CPU (``kvpressure_host_cpu_seconds_total``) that the engine's processes
(``kvpressure_engine_process_cpu_seconds_total``) did not use.

Here: the attribution through a real timeline for an engine saturating the CPU by itself
versus other processes hogging it; the process-tree reader on a fixture procfs; and the host
sampler's readings of a real process tree burning CPU, found through the real PID lookup
(the PID listening on a loopback port).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest

from kvpressure.agent.attribution.detector import PhaseVerdict, Verdict
from kvpressure.agent.attribution.engine import Attributor
from kvpressure.agent.attribution.model import Attribution
from kvpressure.agent.attribution.rules import LONG_LOOKBACK, METRICS_READ, Params
from kvpressure.agent.attribution.signals import Signals
from kvpressure.agent.config import EngineConfig
from kvpressure.agent.discovery import engine_pids
from kvpressure.agent.kube import EnginePods
from kvpressure.agent.requests.record import RequestRecord
from kvpressure.agent.samplers import proctree
from kvpressure.agent.samplers.host import HostSampler
from kvpressure.agent.samplers.proctree import MAX_TREE, ProcessTreeCpu, parse_stat
from kvpressure.agent.samples import Batch, Sample, make_labels
from kvpressure.agent.timeline import Timeline

T = 1_800_000_000.0
ENG = "vllm"
PSI = "kvpressure_psi_stall_seconds_total"
HOST_CPU = "kvpressure_host_cpu_seconds_total"
ENGINE_CPU = "kvpressure_engine_process_cpu_seconds_total"
DISK_QUEUE = "kvpressure_disk_io_time_weighted_seconds_total"


# --- attribution through a real timeline ------------------------------------------------------


def timeline(
    engine_cores: float | None,
    *,
    stall: float = 0.99,
    preempt_at: int | None = 12,
    user_cores: float = 1.6,
    disk_queue: float | None = None,
) -> Timeline:
    """A 2-core host sampled every 0.5 s over [T-60, T+30]: both cores busy from T
    (``user_cores`` of them in user mode, the rest in the kernel), CPU PSI some at ``stall``
    s/s, ``engine_cores`` of the busy CPU the engine's own (``None``: the engine's CPU time
    unknown), KV at 96 % with requests waiting and one preemption at ``T + preempt_at``, a
    disk's average queue at ``disk_queue`` from T when set."""
    tl = Timeline(4096, 1000)
    psi = busy = idle = eng = preempted = queued = 0.0
    user = system = 0.0
    for i in range(-120, 61):
        t = T + i / 2
        if i > 0:
            psi += stall / 2
            busy += 2.0 / 2
            user += user_cores / 2
            system += (2.0 - user_cores) / 2
            eng += (engine_cores or 0.0) / 2
            queued += (disk_queue or 0.0) / 2
        else:
            busy += 0.1 / 2
            user += 0.08 / 2
            system += 0.02 / 2
            idle += 1.9 / 2
        if preempt_at is not None and t >= T + preempt_at:
            preempted = 1.0
        samples = [
            Sample(PSI, psi, make_labels({"resource": "cpu", "kind": "some", "scope": "system"})),
            Sample(HOST_CPU, user, make_labels({"mode": "user"})),
            Sample(HOST_CPU, system, make_labels({"mode": "system"})),
            Sample(HOST_CPU, idle, make_labels({"mode": "idle"})),
            Sample(HOST_CPU, 0.0, make_labels({"mode": "iowait"})),
            Sample("kvpressure_engine_up", 1.0, make_labels({"engine": ENG, "instance": "h:1"})),
            Sample("kvpressure_engine_kv_cache_usage_ratio", 0.96, make_labels({"engine": ENG})),
            Sample("kvpressure_engine_requests_running", 8.0, make_labels({"engine": ENG})),
            Sample("kvpressure_engine_requests_waiting", 0.0, make_labels({"engine": ENG})),
            Sample("kvpressure_engine_preemptions_total", preempted, make_labels({"engine": ENG})),
        ]
        if engine_cores is not None:
            samples.append(Sample(ENGINE_CPU, eng, make_labels({"engine": ENG, "instance": "h:1"})))
        if disk_queue is not None:
            samples.append(Sample(DISK_QUEUE, queued, make_labels({"device": "vda"})))
        tl.append(t, samples)
    return tl


def attribute(tl: Timeline) -> Attribution:
    """Attribute a request slow in decode over [T+5, T+20], as the attribution sampler does
    (the metrics it loads, read once from the timeline)."""
    record = RequestRecord(engine=ENG, start=T + 4, end=T + 20, ttft_s=0.1, output_tokens=400)
    phase = PhaseVerdict("tpot", 0.04, 0.01, "baseline", 0.01, None, T + 5, T + 20)
    verdict = Verdict(True, "tpot", 0.04, 0.01, "baseline", (phase,), T + 5, T + 20)
    extended = {k: T - 30 - v for k, v in LONG_LOOKBACK.items()}
    sig = Signals.from_timeline(tl, METRICS_READ, T - 30, T + 30, extended)
    return Attributor(Params()).attribute_request(sig, record, verdict)


def evidence(a: Attribution, signal: str):
    got = [e for e in a.evidence if e.signal == signal]
    return got[0] if got else None


def test_an_engine_saturating_the_cpu_by_itself_is_not_compute() -> None:
    """The engine's own processes use 1.95 of the 2 busy cores: its threads stall one
    another (PSI 0.99), which is its work, not contention; the preemption names memory."""
    a = attribute(timeline(engine_cores=1.95))
    assert a.scores["compute"] == 0.0
    assert evidence(a, "psi_cpu_some") is None
    assert a.cause == "memory"
    assert evidence(a, "preemptions") is not None


def test_other_processes_hogging_the_cpu_are_compute() -> None:
    """The engine gets 0.5 of the 2 busy cores, other processes the rest: the same stall
    rate is contention, and it outweighs one preemption."""
    a = attribute(timeline(engine_cores=0.5))
    e = evidence(a, "psi_cpu_some")
    assert e is not None
    assert e.value == pytest.approx(0.75, rel=0.02)  # bounded by the others' share
    assert e.labels["others_cpu_share"] == "0.75"
    assert e.labels["engine_cores"] == "0.50" and e.labels["busy_cores"] == "2.00"
    assert a.scores["compute"] > a.scores["memory"] > 0.0
    assert a.cause == "compute"


def test_unknown_engine_cpu_reads_the_stall_rate_whole() -> None:
    """A remote engine (no process or cgroup to read): the plain PSI rate, as before."""
    a = attribute(timeline(engine_cores=None))
    e = evidence(a, "psi_cpu_some")
    assert e is not None and e.value == pytest.approx(0.99, rel=0.02)
    assert "others_cpu_share" not in e.labels
    assert a.scores["compute"] == 1.0


def test_contention_scales_with_the_others_share() -> None:
    """Between the two: the score follows the share the engine did not use."""
    scores = [attribute(timeline(engine_cores=c)).scores["compute"] for c in (1.9, 1.4, 1.0)]
    assert scores[0] == 0.0 < scores[1] < scores[2]
    # others held 0.8 of the 2 busy cores and the engine waited 0.7 s/s: a real slowdown
    # (the product of stall rate and share, 0.28, would score 0.06: not compute)
    a = attribute(timeline(engine_cores=1.2, stall=0.7))
    assert a.scores["compute"] == pytest.approx((0.4 - 0.25) / 0.5, abs=0.02)


def test_kernel_cpu_of_the_io_a_storage_rule_names_is_not_compute() -> None:
    """Two ``dd conv=fsync`` writers and page-cache drops on 2 cores: the others' 1.5 busy
    cores are all kernel time (page-cache copies, writeback, reclaim) and a disk queues 20
    deep. The stall the engine saw waiting for a CPU is the I/O's, so storage is named and
    ``psi_cpu_some`` (0.7 s/s against an others' share of 0.75: 0.9 before) does not score:
    the others' user-space share is 0."""
    a = attribute(timeline(0.5, stall=0.7, preempt_at=None, user_cores=0.5, disk_queue=20.0))
    assert a.cause == "storage"
    assert evidence(a, "disk_queue") is not None
    assert evidence(a, "psi_cpu_some") is None
    assert a.scores["compute"] == 0.0


def test_kernel_cpu_of_io_with_the_engine_cpu_unknown_is_bounded_by_the_user_share() -> None:
    """A remote engine (its CPU time unknown) beside the same writers: the stall is bounded
    by the user-space share of all the busy CPU (0.25: below the threshold), not read
    whole."""
    a = attribute(timeline(None, stall=0.7, preempt_at=None, user_cores=0.5, disk_queue=20.0))
    assert a.cause == "storage"
    assert evidence(a, "psi_cpu_some") is None
    plain = attribute(timeline(None, stall=0.7, preempt_at=None, user_cores=0.5))
    e = evidence(plain, "psi_cpu_some")
    assert e is not None and e.value == pytest.approx(0.7, rel=0.02)
    assert e.labels["user_cpu_share"] == "0.25"
    assert plain.cause == "compute"


def test_kernel_cpu_without_an_io_rule_is_still_contention() -> None:
    """The same kernel-heavy others with no memory, storage or network rule firing: their
    CPU is read whole as contention (a syscall-heavy process is still a CPU hog)."""
    a = attribute(timeline(0.5, stall=0.7, preempt_at=None, user_cores=0.5))
    e = evidence(a, "psi_cpu_some")
    assert e is not None and e.value == pytest.approx(0.7, rel=0.02)
    assert e.labels["others_user_share"] == "0.00" and "kernel_cpu_of" not in e.labels
    assert a.cause == "compute"


def test_a_user_space_hog_beside_io_keeps_its_contention() -> None:
    """Busy loops (user time) take 1.5 cores while a disk queues: the stall is bounded by
    the others' user-space share (0.75), so compute keeps 0.9 and outweighs storage's
    0.7."""
    a = attribute(timeline(0.5, stall=0.7, preempt_at=None, user_cores=2.0, disk_queue=20.0))
    e = evidence(a, "psi_cpu_some")
    assert e is not None and e.value == pytest.approx(0.7, rel=0.02)
    assert e.labels["kernel_cpu_of"] == "storage"
    assert e.labels["others_user_share"] == "0.75"
    assert a.scores["storage"] == pytest.approx(0.7)
    assert a.cause == "compute"


# --- the process-tree reader on a fixture procfs ----------------------------------------------


def stat_line(pid: int, ppid: int, ticks: int, start: int, comm: str = "python3") -> str:
    """A ``/proc/<pid>/stat`` line: utime = ticks - 1, stime = 1."""
    rest = ["S", str(ppid)] + ["0"] * 9 + [str(ticks - 1), "1"] + ["0"] * 6 + [str(start)]
    return f"{pid} ({comm}) " + " ".join(rest + ["0"] * 30) + "\n"


class FakeProc:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.t = 0.0

    def set(self, pid: int, ppid: int, ticks: int, start: int = 100) -> None:
        (self.root / str(pid)).mkdir(parents=True, exist_ok=True)
        (self.root / str(pid) / "stat").write_text(stat_line(pid, ppid, ticks, start))

    def kill(self, pid: int) -> None:
        # procfs fails a read through a descriptor kept open on a reaped process (ESRCH);
        # a regular file kept open would still read: emptied first, it reads nothing
        (self.root / str(pid) / "stat").write_text("")
        (self.root / str(pid) / "stat").unlink()
        (self.root / str(pid)).rmdir()

    def reader(self) -> ProcessTreeCpu:
        return ProcessTreeCpu(str(self.root), clock=lambda: self.t, clk_tck=100)


def test_parse_stat_counts_fields_after_the_last_parenthesis() -> None:
    st = parse_stat(stat_line(42, 7, 250, 9000, comm="a) (b c"))
    assert st is not None and (st.ppid, st.ticks, st.start) == (7, 250, 9000)
    assert parse_stat("42 (x) S 1 2") is None
    assert parse_stat("garbage") is None
    assert parse_stat(stat_line(42, 7, 250, 9000).replace(" 249 ", " x ")) is None


def test_tree_cpu_counts_descendants_and_never_goes_down(tmp_path: Path) -> None:
    p = FakeProc(tmp_path)
    p.set(1, 0, 5)
    p.set(10, 1, 100)  # the listening process
    p.set(11, 10, 300)  # its engine core
    p.set(12, 11, 50)  # a grandchild
    p.set(20, 1, 9999)  # not the engine's
    r = p.reader()
    assert r.read("e", (10,)) == pytest.approx(4.5)
    p.set(10, 1, 110)
    p.set(11, 10, 400)
    p.t = 1.0
    assert r.read("e", (10,)) == pytest.approx(4.5 + 1.1)
    p.kill(12)  # the grandchild exits: what it used stays counted
    p.t = 2.0
    assert r.read("e", (10,)) == pytest.approx(5.6)
    p.set(13, 10, 30, start=500)  # a new child, found at the next tree refresh
    p.t = 3.0
    assert r.read("e", (10,)) == pytest.approx(5.6)
    p.t = 20.0
    assert r.read("e", (10,)) == pytest.approx(5.9)  # its whole CPU time, once
    p.t = 21.0
    assert r.read("e", (10,)) == pytest.approx(5.9)


def test_a_reused_pid_is_a_new_process_and_a_restart_adds_to_the_counter(tmp_path: Path) -> None:
    p = FakeProc(tmp_path)
    p.set(10, 1, 100)
    p.set(11, 10, 300)
    r = p.reader()
    assert r.read("e", (10,)) == pytest.approx(4.0)
    p.kill(11)
    p.set(11, 10, 20, start=777)  # another process got PID 11
    p.t = 20.0
    assert r.read("e", (10,)) == pytest.approx(4.2)
    p.kill(10)
    p.kill(11)
    assert r.read("e", (10,)) is None  # the engine is gone: absent
    p.set(30, 1, 40, start=900)  # restarted under another PID, with a child at once
    p.set(31, 30, 10, start=901)
    p.t = 21.0
    assert r.read("e", (30,)) == pytest.approx(4.7)  # never down: no false reset
    assert r.read("other", (30,)) == pytest.approx(0.5)  # each key its own counter


def test_the_tree_is_bounded(tmp_path: Path) -> None:
    p = FakeProc(tmp_path)
    p.set(10, 1, 1)
    for pid in range(100, 100 + 2 * MAX_TREE):
        p.set(pid, 10, 1)
    assert p.reader().read("e", (10,)) == pytest.approx(MAX_TREE / 100)


def open_stats(under: str) -> set[str]:
    """The ``stat`` files under ``under`` this process holds open."""
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.startswith(under) and target.endswith("/stat"):
                out.add(target)
    return out


def test_members_stat_files_stay_open_and_close_when_their_process_is_gone() -> None:
    """On the real procfs: each member's stat is kept open between reads (one pread a
    cycle); once a member is reaped its descriptor reads ESRCH and is closed, what it used
    stays counted, and close() closes the rest."""
    parent = subprocess.Popen(
        [sys.executable, "-c", "import subprocess, sys, time;"
         " c = subprocess.Popen(['sleep', '60']); print(c.pid, flush=True); c.wait();"
         " time.sleep(60)"],
        stdout=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        r = ProcessTreeCpu("/proc", clock=time.monotonic)
        first = r.read("e", (parent.pid,))
        assert first is not None
        want = {f"/proc/{parent.pid}/stat", f"/proc/{child}/stat"}
        assert open_stats("/proc/") >= want
        again = r.read("e", (parent.pid,))
        assert again is not None and again >= first
        assert open_stats("/proc/") >= want  # the same files, not opened anew and leaked
        os.kill(child, 9)  # the parent reaps it
        deadline = time.monotonic() + 5
        while psutil.pid_exists(child) and time.monotonic() < deadline:
            time.sleep(0.02)
        after = r.read("e", (parent.pid,))
        assert after is not None and after >= again  # never down
        assert f"/proc/{child}/stat" not in open_stats("/proc/")
        assert f"/proc/{parent.pid}/stat" in open_stats("/proc/")
        r.close()
        assert not open_stats(f"/proc/{parent.pid}/")
    finally:
        os.killpg(parent.pid, 9)
        parent.wait()


def test_kept_stat_files_are_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Beyond KEPT_STATS members the rest are opened on each read; the counts hold."""
    monkeypatch.setattr(proctree, "KEPT_STATS", 2)
    p = FakeProc(tmp_path)
    p.set(10, 1, 100)
    for pid in range(11, 15):
        p.set(pid, 10, 100)
    r = p.reader()
    assert r.read("e", (10,)) == pytest.approx(5.0)
    for pid in range(10, 15):
        p.set(pid, 10 if pid > 10 else 1, 150)
    p.t = 1.0
    assert r.read("e", (10,)) == pytest.approx(7.5)
    assert len(open_stats(str(tmp_path))) == 2
    r.close()
    assert not open_stats(str(tmp_path))


# --- the host sampler against a real process tree burning CPU --------------------------------

# A stand-in engine: listens on loopback (the port the agent finds it by) and starts a child
# that starts a grandchild busy-looping, like vLLM's API server and its EngineCore; it prints
# the port and the grandchild's PID once everything runs.
ENGINE = """
import os, socket, subprocess, sys, time
s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen()
burn = "import time\\nt = time.time()\\nwhile time.time() - t < 60: pass\\n"
mid = subprocess.Popen([sys.executable, "-c",
    "import subprocess, sys; p = subprocess.Popen([sys.executable, '-c', sys.argv[1]]);"
    " print(p.pid, flush=True); p.wait()", burn], stdout=subprocess.PIPE, text=True)
print(s.getsockname()[1], mid.stdout.readline().strip(), flush=True)
time.sleep(60)
"""


@pytest.fixture
def engine() -> Iterator[tuple[int, int, int]]:
    """``(port, listening PID, busy grandchild PID)``."""
    p = subprocess.Popen(
        [sys.executable, "-c", ENGINE], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        assert p.stdout is not None
        port, burner = (int(x) for x in p.stdout.readline().split())
        yield port, p.pid, burner
    finally:
        for c in psutil.Process(p.pid).children(recursive=True):
            c.kill()
        p.kill()
        p.wait()


def tree_cpu(pid: int) -> float:
    """user + system seconds of ``pid`` and its descendants, as psutil reads them."""
    procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    return sum(t.user + t.system for t in (q.cpu_times() for q in procs))


def value(batch: Batch, name: str, **labels: str) -> float | None:
    want = make_labels(dict(labels))
    got = [s.value for s in batch if s.name == name and s.labels == want]
    return got[0] if got else None


def busy(batch: Batch) -> float:
    return sum(
        s.value
        for s in batch
        if s.name == HOST_CPU and dict(s.labels)["mode"] not in ("idle", "iowait")
    )


def collect(sampler: HostSampler) -> Batch:
    batch = Batch()
    sampler.collect(batch)
    return batch


def test_host_sampler_reads_a_real_engine_tree_burning_cpu(engine: tuple[int, int, int]) -> None:
    port, listener, burner = engine
    cfg = EngineConfig(url=f"http://127.0.0.1:{port}", type="vllm", name=ENG)
    pods = EnginePods(lambda: engine_pids([cfg]))
    sampler = HostSampler(engines={ENG: cfg.instance}, engine_processes=pods.pids)
    assert pods.pids(ENG) == (listener,)  # the real lookup: the PID listening on the port

    first = collect(sampler)
    before = tree_cpu(listener)
    e0 = value(first, ENGINE_CPU, engine=ENG, instance=cfg.instance)
    assert e0 is not None and e0 == pytest.approx(before, abs=0.1)
    time.sleep(1.5)
    second = collect(sampler)
    after = tree_cpu(listener)
    e1 = value(second, ENGINE_CPU, engine=ENG, instance=cfg.instance)
    assert e1 is not None
    assert e1 - e0 == pytest.approx(after - before, abs=0.1)  # the grandchild's burn
    assert e1 - e0 >= 0.3  # it did burn, even on a shared 2-core machine
    assert psutil.Process(burner).ppid() != listener  # counted through the tree, not as root
    # the host's busy CPU holds the engine's (ticks and per-task time differ by a few ticks)
    assert busy(second) - busy(first) >= (e1 - e0) - 0.05
    states = {s.source: s.state for s in second.sources}
    assert states["engine_cpu"] == "ok" and states["cpu"] == "ok"


def test_host_sampler_without_a_local_engine_has_no_engine_cpu() -> None:
    """A remote engine (no PID to read): absent, never 0, and the source says why."""
    sampler = HostSampler(
        engines={"remote": "10.0.0.5:8000"}, engine_processes=lambda engine, gone: ()
    )
    batch = collect(sampler)
    assert not [s for s in batch if s.name == ENGINE_CPU]
    got = [(s.state, s.reason) for s in batch.sources if s.source == "engine_cpu"]
    assert got == [("unsupported", "no_local_engine")]
    assert busy(batch) > 0


def test_engine_cgroup_cpu_stat_is_preferred(tmp_path: Path) -> None:
    """With a cgroup configured, its cpu.stat usage_usec is the engine's CPU time."""
    cg = tmp_path / "sys" / "fs" / "cgroup"
    (cg / "llm.slice").mkdir(parents=True)
    (cg / "cgroup.controllers").write_text("cpu memory\n")
    (cg / "llm.slice" / "cpu.stat").write_text(
        "usage_usec 12500000\nuser_usec 10000000\nsystem_usec 2500000\n"
    )
    asked: list[str] = []

    def processes(engine: str, gone: bool) -> tuple[int, ...]:
        asked.append(engine)
        return (os.getpid(),)

    sampler = HostSampler(
        "/proc",
        str(tmp_path / "sys"),
        engine_cgroups={"a": "llm.slice"},
        engines={"a": "127.0.0.1:1", "b": "127.0.0.1:2"},
        engine_processes=processes,
    )
    batch = collect(sampler)
    assert value(batch, ENGINE_CPU, engine="a", instance="127.0.0.1:1") == 12.5
    assert asked == ["b"]  # a's cgroup answered; b has none: its process tree
    assert value(batch, ENGINE_CPU, engine="b", instance="127.0.0.1:2") is not None


# --- the PID lookup is shared and bounded -------------------------------------------------------


def test_engine_pods_pids_share_the_bounded_lookup() -> None:
    calls: list[float] = []
    now = {"t": 1000.0}
    answer: dict[int, str] = {101: "a", 102: "a", 201: "b"}

    def lookup() -> dict[int, str]:
        calls.append(now["t"])
        return dict(answer)

    clock: Callable[[], float] = lambda: now["t"]  # noqa: E731
    pods = EnginePods(lookup, refresh_s=30.0, retry_s=5.0, clock=clock)
    assert pods.pids("a") == (101, 102)  # every process sharing the listening socket
    assert pods.labels("b") == {} and pods.pids("b") == (201,)
    assert len(calls) == 1
    now["t"] += 2.0
    answer = {301: "a", 201: "b"}  # a restarted
    assert pods.pids("a", gone=True) == (101, 102)  # too soon after the last lookup
    now["t"] += 4.0
    assert pods.pids("a", gone=True) == (301,)
    assert len(calls) == 2
    now["t"] += 1.0
    assert pods.pids("a") == (301,) and len(calls) == 2  # not due


def test_an_engine_never_found_backs_the_early_lookups_off_to_the_refresh() -> None:
    """Each cycle the host sampler asks early (``gone``) for an engine whose PIDs it does not
    know. One that is never found (its PID serves another engine's port too, or lives in
    another PID namespace) must not cost a psutil scan every ``retry_s`` forever: the floor
    doubles up to ``refresh_s``, and an answer that changes (the engine came up) resets it."""
    calls: list[float] = []
    now = {"t": 1000.0}
    answer: dict[int, str] = {101: "a"}

    def lookup() -> dict[int, str]:
        calls.append(now["t"])
        return dict(answer)

    pods = EnginePods(lookup, refresh_s=30.0, retry_s=5.0, clock=lambda: now["t"])
    assert pods.pids("a") == (101,)
    for _ in range(1200):  # 120 s of 0.1 s cycles
        now["t"] += 0.1
        assert pods.pids("b") == ()
        pods.pids("b", gone=True)
    gaps = [round(b - a) for a, b in itertools.pairwise(calls)]
    assert gaps[:4] == [5, 10, 20, 30] and set(gaps[4:]) == {30}  # was: every 5 s
    answer[201] = "b"  # b comes up: found within a backed-off floor, then the floor resets
    start = len(calls)
    while pods.pids("b", gone=True) == ():
        now["t"] += 0.1
    assert now["t"] - calls[start - 1] <= 30.1 and pods.pids("b") == (201,)
    answer[102] = "a"  # a restart of a: the next gone-asked lookup comes retry_s later
    last = calls[-1]
    while pods.pids("a", gone=True) == (101,):
        now["t"] += 0.1
    assert calls[-1] - last == pytest.approx(5.0, abs=0.15)
