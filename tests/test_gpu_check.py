"""benchmarks/gpu_check.py without a GPU: its nvidia-smi reader (case 04), its clean exit when
there is no GPU, and a dry run of its whole logic against the fake NVML and a stub torch."""

import importlib.util
import subprocess
import sys
import types
from pathlib import Path

import pytest

from kvpressure.agent.samplers import nvml_binding as nb
from kvpressure.agent.samplers.fake_nvml import MIB, FakeNvml
from kvpressure.agent.samplers.gpu import GpuSampler

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"
FIXTURES = Path(__file__).resolve().parent / "fixtures" / "gpu"


def load():
    spec = importlib.util.spec_from_file_location("gpu_check_under_test", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up while the class is built
    spec.loader.exec_module(mod)
    return mod


def test_case04_both_driver_spellings_parse_to_the_same_row():
    gc = load()
    rows = (FIXTURES / "04-nvsmi-na-token-variants.input.txt").read_text().splitlines()
    parsed = [gc.parse_smi_csv_row(r, 7) for r in rows]
    assert parsed[0] == parsed[1] == [2004, 2004, 0, 44, None, 0, 0]


@pytest.mark.parametrize(
    "cell",
    [
        "[Not Supported]",
        "Not Supported",
        "[N/A]",
        "N/A",
        "[n/a]",
        "[Unknown Error]",
        "Unknown Error",
        "ERR!",
        "garbage",
        "nan",
        "inf",
        "",
    ],
)
def test_every_missing_token_is_missing_for_that_cell_only(cell):
    gc = load()
    assert gc.parse_smi_csv_row(f"1, {cell}, 3 %", 4) == [1.0, None, 3.0, None]


def test_case01_rows_keep_the_other_columns():
    gc = load()
    row = (FIXTURES / "01-gb10-uma-memory-na.input.txt").read_text().splitlines()[1]
    assert gc.parse_smi_csv_row(row, 6) == [None, None, None, 0.0, 11.17, 35.0]


def test_without_a_gpu_it_exits_2_with_one_clear_line():
    if Path("/proc/driver/nvidia/version").exists():
        pytest.skip("an NVIDIA driver is present here")
    proc = subprocess.run(
        [sys.executable, str(SCRIPT)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=ROOT,
    )
    assert proc.returncode == 2
    assert "gpu_check: no usable NVIDIA GPU here" in proc.stderr
    assert "Traceback" not in proc.stderr


# ---- a dry run against the fake ----------------------------------------------------------------
class World:
    """Virtual time, a fake H200 and a stub torch whose work changes what the fake reports."""

    PHASES = {
        "idle": {
            "utilization_gpu": 0,
            "utilization_memory": 0,
            "dram_bw_util": 2,
            "sm_occupancy": 1,
        },
        "copy": {
            "utilization_gpu": 100,
            "utilization_memory": 90,
            "dram_bw_util": 88,
            "sm_occupancy": 20,
        },
        "h2d": {
            "utilization_gpu": 12,
            "utilization_memory": 5,
            "dram_bw_util": 6,
            "sm_occupancy": 2,
        },
        "matmul": {
            "utilization_gpu": 100,
            "utilization_memory": 35,
            "dram_bw_util": 30,
            "sm_occupancy": 75,
        },
    }

    def __init__(self, smi_skew: float = 0.0) -> None:
        self.t = 0.0
        self.fake = FakeNvml.from_profile("h200", clock=self.clock)
        self.used = 1 * MIB
        self.smi_skew = smi_skew
        self.phase("idle")

    def clock(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.t += s

    def set_used(self, delta: int) -> None:
        self.used += delta
        self.fake.set(0, memory_used=self.used)

    def phase(self, name: str) -> None:
        self.fake.set(0, memory_used=self.used, clocks_event_reasons=[], **self.PHASES[name])
        self.fake.set(0, pcie_rx_bytes_per_s=20e9 if name == "h2d" else 0, pcie_tx_bytes_per_s=0)

    def smi(self):
        dev = self.fake.devices[0]
        return [
            self.used / MIB + self.smi_skew * dev.memory_total / MIB,
            dev.memory_total / MIB,
            float(dev.util_gpu),
            float(dev.util_memory),
        ]

    def torch(self):
        world = self

        class Tensor:
            def __init__(self, nbytes, cuda):
                self.nbytes, self.cuda = nbytes, cuda
                if cuda:
                    world.set_used(nbytes)

            def fill_(self, _v):
                return self

            def copy_(self, other, non_blocking=False):
                world.phase("copy" if other.cuda else "h2d")
                return self

            def __del__(self):
                if self.cuda:
                    world.set_used(-self.nbytes)

        def empty(n, dtype=None, device=None, pin_memory=False):
            return Tensor(int(n), device == "cuda")

        cuda = types.SimpleNamespace(
            is_available=lambda: True,
            init=lambda: None,
            get_device_name=lambda _i: "NVIDIA H200",
            synchronize=lambda: None,
            empty_cache=lambda: None,
        )
        return types.SimpleNamespace(
            uint8="uint8",
            bfloat16="bfloat16",
            cuda=cuda,
            empty=empty,
            empty_like=lambda t: Tensor(t.nbytes, t.cuda),
            zeros=lambda n, device=None: Tensor(4, device == "cuda"),
            randn=lambda a, b, dtype=None, device=None: Tensor(a * b * 2, device == "cuda"),
            matmul=lambda x, y: world.phase("matmul"),
        )


def dry_run(monkeypatch, capsys, world):
    gc = load()
    clock = world.clock

    def sampler(_binding, interval_s, timeout_s):
        return GpuSampler(
            nb.NvmlBinding(world.fake, "fake:h200"),
            interval_s=interval_s,
            timeout_s=timeout_s,
            clock=clock,
        )

    class Done:
        def join(self):
            world.phase("idle")

    def loop_in_thread(body, _seconds):
        body()
        return Done()

    monkeypatch.setattr(gc, "GpuSampler", sampler)
    monkeypatch.setattr(gc, "smi_now", world.smi)
    monkeypatch.setattr(gc, "loop_in_thread", loop_in_thread)
    monkeypatch.setattr(gc, "time", types.SimpleNamespace(monotonic=clock, sleep=world.sleep))
    monkeypatch.setattr(
        gc,
        "signal",
        types.SimpleNamespace(signal=lambda *a: None, alarm=lambda s: None, SIGALRM=14),
    )
    monkeypatch.setattr(gc.shutil, "which", lambda name: f"/usr/bin/{name}")
    monkeypatch.setitem(sys.modules, "torch", world.torch())
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    rc = gc.main()
    return rc, capsys.readouterr().out


def test_dry_run_passes_when_the_agent_agrees_with_nvidia_smi(monkeypatch, capsys):
    rc, out = dry_run(monkeypatch, capsys, World())
    assert "all checks passed" in out, out
    assert rc == 0
    assert "[ok] 10 GiB allocation seen as +10.00 GiB" in out
    assert "[ok] 40 GiB allocation seen as +40.00 GiB" in out
    assert "copy loop: bandwidth 0.88" in out
    assert "matmul loop: utilization peak 1.0" in out
    assert "PCIe counters grew" in out


def test_dry_run_fails_when_memory_disagrees_by_more_than_one_percent(monkeypatch, capsys):
    rc, out = dry_run(monkeypatch, capsys, World(smi_skew=0.02))
    assert rc == 1
    assert "memory differs by" in out
