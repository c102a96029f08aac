"""Real-GPU check of the GPU sampler against nvidia-smi (under 5 minutes, one NVIDIA GPU).

Runs :class:`agent.samplers.gpu.GpuSampler` on the real NVML binding while PyTorch loads GPU 0
in phases, and at the same moments reads::

    nvidia-smi -i 0 --query-gpu=memory.used,memory.total,utilization.gpu,utilization.memory \\
        --format=csv,noheader,nounits

Phases: idle; 10 GiB allocated; 40 GiB more (50 GiB); a bandwidth-heavy device-to-device copy
loop; a host-to-device copy loop (PCIe counters); a compute-heavy bf16 matmul loop. It prints
the agent's readings beside nvidia-smi's and exits non-zero when

* memory used disagrees with nvidia-smi by more than 1 % of the total at any reading,
* the allocations do not show up as +10 GiB and +40 GiB (±5 %),
* the copy loop does not raise memory-bandwidth utilization (≥ 0.5 and ≥ idle + 0.3),
* the matmul loop does not drive GPU utilization to ≥ 0.9, or shows more bandwidth than the copy,
* the PCIe byte counters (when NVML supports them) do not grow by half the bytes copied.

Exit codes: 0 all checks passed; 1 a check failed; 2 no usable GPU here (no NVIDIA driver, no
``nvidia-smi``, no PyTorch with CUDA) — the message says which.

It imports only ``agent.samplers.{gpu,nvml_*,base}``, ``agent.samples`` and
``agent.catalogue`` from the project (no pydantic, httpx or aiohttp), plus torch. Run from the
repository root: ``python3 benchmarks/gpu_check.py``.
"""

from __future__ import annotations

import math
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvpressure.agent.catalogue import CATALOGUE
from kvpressure.agent.samplers.gpu import GpuSampler
from kvpressure.agent.samples import Batch

GIB = 1 << 30
MIB = 1 << 20
SMI_QUERY = "memory.used,memory.total,utilization.gpu,utilization.memory"
MISSING_TOKENS = frozenset(
    {"[not supported]", "not supported", "[n/a]", "n/a", "[unknown error]", "unknown error", "err!"}
)
"""nvidia-smi's "no value" spellings (case 04), compared case-insensitively."""
TIME_LIMIT_S = 280


def parse_smi_csv_row(line: str, columns: int) -> list[float | None]:
    """Parse one ``--format=csv,noheader,nounits`` row into numbers.

    A missing-value token (``[N/A]``, ``[Not Supported]``, ``ERR!``... any case, with or without
    brackets) or any other non-number makes that cell ``None``; the other cells are kept.

    Args:
        line: the row, e.g. ``"2004, 2004, 0, 44, [N/A], 0, 0"``.
        columns: how many cells the query asked for.

    Returns:
        ``columns`` values; cells beyond the row are ``None``.
    """
    cells = [c.strip() for c in line.split(",")]
    out: list[float | None] = []
    for i in range(columns):
        cell = cells[i] if i < len(cells) else ""
        if cell.lower() in MISSING_TOKENS:
            out.append(None)
            continue
        cell = cell.removesuffix("%").removesuffix("MiB").removesuffix("W").strip()
        try:
            v = float(cell)
        except ValueError:
            out.append(None)
            continue
        out.append(v if math.isfinite(v) else None)
    return out


@dataclass
class Reading:
    """The agent's and nvidia-smi's values at one moment."""

    phase: str
    t: float
    ours: dict[str, float | None]
    smi: list[float | None]


@dataclass
class Check:
    failures: list[str] = field(default_factory=list)

    def expect(self, ok: bool, what: str) -> None:
        print(f"  [{'ok' if ok else 'FAIL'}] {what}")
        if not ok:
            self.failures.append(what)


def die(msg: str) -> None:
    print(f"gpu_check: {msg}", file=sys.stderr)
    sys.exit(2)


def gpu0(batch: Batch) -> dict[str, float | None]:
    """The agent's GPU 0 (not MIG) values from one batch."""
    want = {
        "kvpressure_gpu_memory_used_bytes": "used",
        "kvpressure_gpu_memory_total_bytes": "total",
        "kvpressure_gpu_memory_reserved_bytes": "reserved",
        "kvpressure_gpu_utilization_ratio": "util",
        "kvpressure_gpu_memory_bandwidth_utilization_ratio": "bw",
        "kvpressure_gpu_sm_occupancy_ratio": "sm",
        "kvpressure_gpu_power_watts": "power",
        "kvpressure_gpu_up": "up",
    }
    out: dict[str, float | None] = dict.fromkeys(want.values())
    out["pcie"] = None
    for s in batch.samples:
        lab = dict(s.labels)
        if lab.get("gpu") != "0" or "mig" in lab:
            continue
        if s.name in want:
            out[want[s.name]] = s.value
            if s.name.endswith("bandwidth_utilization_ratio"):
                out["bw_source"] = 1.0 if lab.get("source") == "gpm" else 0.0
        elif s.name == "kvpressure_gpu_pcie_bytes_total":
            out["pcie"] = (out["pcie"] or 0.0) + s.value
    return out


def smi_now() -> list[float | None]:
    proc = subprocess.run(
        ["nvidia-smi", "-i", "0", f"--query-gpu={SMI_QUERY}", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        timeout=20,
        check=False,
    )
    if proc.returncode != 0:
        return [None] * 4
    return parse_smi_csv_row(proc.stdout.strip().splitlines()[0], 4)


def fmt(v: float | None, scale: float = 1.0, digits: int = 0) -> str:
    return "-" if v is None else f"{v / scale:.{digits}f}"


class Sampler:
    """The agent's sampler plus nvidia-smi, read together."""

    def __init__(self) -> None:
        self.gpu = GpuSampler("nvml", interval_s=0.5, timeout_s=10.0)
        self.readings: list[Reading] = []
        self.unknown: set[str] = set()
        self.t0 = time.monotonic()

    def read(self, phase: str) -> Reading:
        b = Batch()
        self.gpu.collect(b)
        for s in b.samples:
            if s.name not in CATALOGUE or not math.isfinite(s.value):
                self.unknown.add(s.name)
        r = Reading(phase, time.monotonic() - self.t0, gpu0(b), smi_now())
        self.readings.append(r)
        o, m = r.ours, r.smi
        print(
            f"{r.t:6.1f}s {phase:<10} used MiB {fmt(o['used'], MIB):>7} | smi {fmt(m[0]):>7}"
            f"   util {fmt(o['util'], 0.01):>3}% | smi {fmt(m[2]):>3}%"
            f"   bw {fmt(o['bw'], 0.01):>3}% ({'gpm' if o.get('bw_source') else 'nvml'})"
            f" | smi mem-util {fmt(m[3]):>3}%   sm-occ {fmt(o['sm'], 0.01):>3}%"
            f"   pcie {fmt(o['pcie'], GIB, 2)} GiB   power {fmt(o['power'], 1, 0)} W",
            flush=True,
        )
        return r

    def during(self, phase: str, seconds: float, every: float = 0.5) -> list[Reading]:
        out = []
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            out.append(self.read(phase))
            time.sleep(every)
        return out


def loop_in_thread(body: Callable[[], None], seconds: float) -> threading.Thread:
    """Run ``body`` repeatedly for ``seconds`` on a thread (kernels release the GIL)."""

    def run() -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            body()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def copy_phase(s: Sampler, torch: Any) -> list[Reading]:
    """Device-to-device copies of a 4 GiB buffer: bandwidth-bound, little compute."""
    src = torch.empty(4 * GIB, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)

    def copy() -> None:
        for _ in range(20):
            dst.copy_(src)
        torch.cuda.synchronize()

    worker = loop_in_thread(copy, 12.0)
    time.sleep(1.0)
    readings = s.during("copy", 10.0)
    worker.join()
    return readings


def h2d_phase(s: Sampler, torch: Any) -> tuple[Reading, Reading, int]:
    """Host-to-device copies from pinned memory: PCIe traffic. Returns before, after, bytes."""
    host = torch.empty(2 * GIB, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(2 * GIB, dtype=torch.uint8, device="cuda")
    copied = [0]

    def h2d() -> None:
        for _ in range(4):
            dev.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
        copied[0] += 4 * 2 * GIB

    s.read("h2d-start")
    time.sleep(1.1)  # the PCIe counters are read at most once a second
    before = s.read("h2d-start")
    worker = loop_in_thread(h2d, 5.0)
    s.during("h2d", 4.0)
    worker.join()
    time.sleep(1.1)
    after = s.read("h2d-end")
    return before, after, copied[0]


def matmul_phase(s: Sampler, torch: Any) -> list[Reading]:
    """bf16 8192x8192 matmuls: compute-bound."""
    n = 8192
    x = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    y = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")

    def matmul() -> None:
        for _ in range(50):
            torch.matmul(x, y)
        torch.cuda.synchronize()

    worker = loop_in_thread(matmul, 12.0)
    time.sleep(1.0)
    readings = s.during("matmul", 10.0)
    worker.join()
    return readings


def main() -> int:
    signal.signal(signal.SIGALRM, lambda *_: die(f"timed out after {TIME_LIMIT_S} s"))
    signal.alarm(TIME_LIMIT_S)
    os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")  # CUDA device 0 == NVML index 0

    s = Sampler()
    first = Batch()
    s.gpu.collect(first)
    nvml = {st.source: st for st in first.sources}.get("nvml")
    if nvml is None or nvml.state != "ok":
        reason = nvml.reason if nvml else "no status"
        die(f"no usable NVIDIA GPU here: NVML {nvml.state if nvml else '?'} ({reason})")
    if gpu0(first)["up"] != 1.0:
        die("NVML works but reports no GPU 0")
    if shutil.which("nvidia-smi") is None:
        die("nvidia-smi not found on PATH; it is needed for the comparison")
    try:
        import torch
    except ImportError:
        die("PyTorch is not installed; it is needed to load the GPU")
    if not torch.cuda.is_available():
        die("PyTorch sees no CUDA device")
    torch.cuda.init()
    print(f"GPU 0: {torch.cuda.get_device_name(0)}; sampler reads NVML every call")
    print(f"nvidia-smi query: {SMI_QUERY}")
    check = Check()
    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    time.sleep(1.0)

    idle = s.during("idle", 3.0)
    bufs: list[Any] = [torch.empty(10 * GIB, dtype=torch.uint8, device="cuda").fill_(1)]
    torch.cuda.synchronize()
    time.sleep(1.0)
    a10 = s.during("alloc10", 2.0)
    bufs.append(torch.empty(40 * GIB, dtype=torch.uint8, device="cuda").fill_(1))
    torch.cuda.synchronize()
    time.sleep(1.0)
    a50 = s.during("alloc50", 2.0)
    del bufs
    torch.cuda.empty_cache()
    time.sleep(0.5)

    cp = copy_phase(s, torch)
    before, after, h2d_bytes = h2d_phase(s, torch)
    mm = matmul_phase(s, torch)
    s.gpu.close()

    print("\nchecks")
    for r in s.readings:
        used, total, smi_used = r.ours["used"], r.ours["total"], r.smi[0]
        if used is None or total is None or smi_used is None:
            check.expect(False, f"{r.phase}@{r.t:.1f}s: memory reading missing")
            continue
        diff = abs(used / MIB - smi_used)
        if diff > 0.01 * total / MIB:
            check.expect(False, f"{r.phase}@{r.t:.1f}s: memory differs by {diff:.0f} MiB (>1 %)")
    check.expect(
        not any("memory differs" in f or "memory reading" in f for f in check.failures),
        f"memory used within 1 % of nvidia-smi at all {len(s.readings)} readings",
    )

    def mean(rs: list[Reading], key: str) -> float | None:
        vals = [r.ours[key] for r in rs if r.ours[key] is not None]
        return sum(vals) / len(vals) if vals else None  # type: ignore[arg-type]

    def peak(rs: list[Reading], key: str) -> float | None:
        vals = [r.ours[key] for r in rs if r.ours[key] is not None]
        return max(vals) if vals else None  # type: ignore[type-var]

    u_idle, u10, u50 = mean(idle, "used"), mean(a10, "used"), mean(a50, "used")
    if u_idle is not None and u10 is not None and u50 is not None:
        d10, d40 = (u10 - u_idle) / GIB, (u50 - u10) / GIB
        check.expect(9.5 <= d10 <= 10.5, f"10 GiB allocation seen as +{d10:.2f} GiB")
        check.expect(38.0 <= d40 <= 42.0, f"40 GiB allocation seen as +{d40:.2f} GiB")
    else:
        check.expect(False, "memory used missing in the allocation phases")

    bw_idle, bw_copy, bw_mm = peak(idle, "bw"), peak(cp, "bw"), peak(mm, "bw")
    if bw_idle is not None and bw_copy is not None:
        check.expect(
            bw_copy >= 0.5 and bw_copy >= bw_idle + 0.3,
            f"copy loop: bandwidth {bw_copy:.2f} (idle {bw_idle:.2f}); want >= 0.5 and idle+0.3",
        )
    else:
        check.expect(False, "bandwidth utilization missing")
    smi_copy = [r.smi[3] for r in cp if r.smi[3] is not None]
    check.expect(
        bool(smi_copy) and max(smi_copy) >= 40,
        f"copy loop: nvidia-smi utilization.memory peak {max(smi_copy) if smi_copy else '-'} %",
    )
    u_mm = peak(mm, "util")
    check.expect(u_mm is not None and u_mm >= 0.9, f"matmul loop: utilization peak {u_mm}")
    if bw_mm is not None and bw_copy is not None:
        check.expect(
            mean(mm, "bw") is not None and (mean(mm, "bw") or 0) < bw_copy,
            f"matmul mean bandwidth {mean(mm, 'bw'):.2f} < copy peak {bw_copy:.2f}",
        )
    sm_mm, sm_idle = peak(mm, "sm"), peak(idle, "sm")
    if sm_mm is None:
        print("  [info] SM occupancy absent (no GPM on this GPU)")
    else:
        check.expect(
            sm_mm > (sm_idle or 0.0), f"matmul SM occupancy {sm_mm:.2f} > idle {sm_idle or 0:.2f}"
        )
    p0, p1 = before.ours["pcie"], after.ours["pcie"]
    if p0 is None or p1 is None:
        print("  [info] PCIe byte counters unsupported here: absent, as designed")
    else:
        moved = p1 - p0
        check.expect(
            moved >= 0.5 * h2d_bytes,
            f"PCIe counters grew {moved / GIB:.1f} GiB for {h2d_bytes / GIB:.0f} GiB copied",
        )
    check.expect(not s.unknown, f"every sample is in the catalogue and finite {sorted(s.unknown)}")
    print(f"\n{len(check.failures)} check(s) failed" if check.failures else "\nall checks passed")
    return 1 if check.failures else 0


if __name__ == "__main__":
    sys.exit(main())
