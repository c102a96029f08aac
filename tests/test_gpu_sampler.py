"""GpuSampler on the fake NVML binding: every profile, cases 01, 04, 05, 06, 07, stall time,
data movement, the engine join and the Prometheus exposition."""

import logging
import math
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import CollectorRegistry

from kvpressure.agent.catalogue import CATALOGUE
from kvpressure.agent.samplers import nvml_binding as nb
from kvpressure.agent.samplers.accelerator import AcceleratorSampler, StallThresholds, stall_reason
from kvpressure.agent.samplers.fake_nvml import MIB, FakeNvml, list_profiles, load_profile
from kvpressure.agent.samplers.gpu import ENGINE_PIDS_MAX_AGE_S, GpuSampler
from kvpressure.agent.samples import Batch, make_labels
from kvpressure.agent.state import AgentState, SamplerReport
from kvpressure.agent.timeline import Timeline
from kvpressure.exporters.prometheus import families

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "gpu"

DESIGN_GPU_METRICS = {
    "kvpressure_gpu_memory_total_bytes",
    "kvpressure_gpu_memory_used_bytes",
    "kvpressure_gpu_memory_reserved_bytes",
    "kvpressure_gpu_utilization_ratio",
    "kvpressure_gpu_memory_bandwidth_utilization_ratio",
    "kvpressure_gpu_sm_occupancy_ratio",
    "kvpressure_gpu_pcie_bytes_total",
    "kvpressure_gpu_nvlink_bytes_total",
    "kvpressure_gpu_clock_event_active",
    "kvpressure_gpu_process_memory_bytes",
    "kvpressure_accelerator_stall_seconds_total",
}


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def tick(self, dt: float = 1.0) -> None:
        self.t += dt


class Engines:
    """What AgentState.latest would return for the engine metrics."""

    def __init__(self) -> None:
        self.series: dict[str, dict] = {}

    def set(self, engine, running=None, waiting=None, prompt=None, generation=None):
        lab = make_labels({"engine": engine, "instance": f"{engine}:8000", "model": "m"})
        for name, v in (
            ("kvpressure_engine_requests_running", running),
            ("kvpressure_engine_requests_waiting", waiting),
            ("kvpressure_engine_prompt_tokens_total", prompt),
            ("kvpressure_engine_generation_tokens_total", generation),
        ):
            if v is None:
                self.series.setdefault(name, {}).pop(lab, None)
            else:
                self.series.setdefault(name, {})[lab] = float(v)

    def view(self, name):
        return dict(self.series.get(name, {}))

    def views(self, names):
        """``AgentState.latest_many`` of the fake engine."""
        return {n: self.view(n) for n in names}


class WithAccelerator:
    """The GPU source and the accelerator stage it triggers, as one daemon tick runs them.

    ``collect`` reads the GPUs, then derives stall time and data movement from that report
    (taken at the fake clock's time) and the engines' view; attribute access goes to the GPU
    sampler.
    """

    def __init__(self, gpu, accelerator, clock):
        self.gpu = gpu
        self.accelerator = accelerator
        self.clock = clock

    def collect(self, batch):
        now = self.clock()
        self.gpu.collect(batch)
        batch.samples.extend(self.accelerator.derive(now, list(batch.samples), batch.sources))

    def __getattr__(self, name):
        return getattr(self.gpu, name)


def make(profile, clock=None, fake_opts=None, state_view=None, thresholds=None, **kw):
    clock = clock or Clock()
    spec = profile if isinstance(profile, dict) else load_profile(profile)
    fake = FakeNvml(spec, clock=clock, **(fake_opts or {}))
    binding = nb.NvmlBinding(fake, f"fake:{spec.get('profile', 'custom')}")
    kw.setdefault("timeout_s", 10.0)
    sampler = GpuSampler(binding, interval_s=1.0, clock=clock, **kw)
    accelerator = AcceleratorSampler(lambda: None, state_view, thresholds, gpu_interval_s=1.0)
    return WithAccelerator(sampler, accelerator, clock), fake, clock


def collect(sampler) -> Batch:
    b = Batch()
    sampler.collect(b)
    return b


def get(batch, name, **labels):
    """Value of the one sample of ``name`` whose labels include ``labels`` (None if absent)."""
    found = [
        s.value
        for s in batch.samples
        if s.name == name and labels.items() <= dict(s.labels).items()
    ]
    assert len(found) <= 1, (name, labels, found)
    return found[0] if found else None


def names(batch, **labels):
    return {s.name for s in batch.samples if labels.items() <= dict(s.labels).items()}


def sources(batch):
    return {s.source: (s.state, s.reason) for s in batch.sources}


def stall(batch, reason, **labels):
    return get(batch, "kvpressure_accelerator_stall_seconds_total", reason=reason, **labels)


# ---- every profile ------------------------------------------------------------------------------
@pytest.mark.parametrize("profile", sorted(set(list_profiles()) - {"driver-mismatch-heals"}))
def test_every_profile_samples_cleanly(profile):
    s, fake, clock = make(profile)
    for _ in range(3):
        b = collect(s)
        clock.tick()
    gpus = len(fake.devices)
    ups = [x for x in b.samples if x.name == "kvpressure_gpu_up" and "mig" not in dict(x.labels)]
    assert len(ups) == gpus
    for x in b.samples:
        assert x.name in CATALOGUE, x.name
        assert set(dict(x.labels)) <= set(CATALOGUE[x.name].labels), x
        assert math.isfinite(x.value)
    assert sources(b)["nvml"] == ("ok", "")
    s.close()


def test_h200_serves_every_design_gpu_metric_with_real_values():
    eng = Engines()
    eng.set("vllm", running=8, waiting=2, prompt=0, generation=0)
    s, _fake, clock = make("h200", state_view=eng.views, engine_pids=lambda: {4242: "vllm"})
    for i in range(4):
        eng.set("vllm", running=8, waiting=2, prompt=1000 * i, generation=200 * i)
        b = collect(s)
        clock.tick()
    assert DESIGN_GPU_METRICS <= names(b)
    assert {"kvpressure_data_movement_bytes_per_token", "kvpressure_tokens_per_byte"} <= names(b)
    assert get(b, "kvpressure_gpu_memory_total_bytes", gpu="0") == 143771 * MIB
    assert get(b, "kvpressure_gpu_memory_reserved_bytes", gpu="0") == 700 * MIB
    assert get(b, "kvpressure_gpu_memory_used_bytes", gpu="0") == 87321 * MIB
    assert get(b, "kvpressure_gpu_utilization_ratio", gpu="0") == pytest.approx(0.68)
    assert get(b, "kvpressure_gpu_memory_bandwidth_utilization_ratio", source="gpm") == 0.44
    assert get(b, "kvpressure_gpu_power_watts") == 434.0
    assert get(b, "kvpressure_gpu_temperature_celsius") == 62.0
    assert (
        get(b, "kvpressure_gpu_process_memory_bytes", pid="4242", engine="vllm", process="python3")
        == 86016 * MIB
    )
    info = next(x for x in b.samples if x.name == "kvpressure_gpu_info")
    assert dict(info.labels)["driver_version"] == "550.90.12"
    assert dict(info.labels)["name"] == "NVIDIA H200"


def test_one_batch_of_calls_per_gpu_per_cycle():
    s, fake, clock = make("h100-sxm")
    collect(s)
    clock.tick()
    before = dict(fake.calls)
    collect(s)
    delta = {k: v - before.get(k, 0) for k, v in fake.calls.items() if v != before.get(k, 0)}
    assert delta == {
        "nvmlDeviceGetMemoryInfo_v2": 8,
        "nvmlDeviceGetUtilizationRates": 8,
        "nvmlDeviceGetPowerUsage": 8,
        "nvmlDeviceGetTemperature": 8,
        "nvmlDeviceGetCurrentClocksEventReasons": 8,
        "nvmlGpmSampleGet": 8,
        "nvmlGpmMetricsGet": 8,
        "nvmlDeviceGetComputeRunningProcesses": 8,
        "nvmlDeviceGetGraphicsRunningProcesses": 8,
        "nvmlDeviceGetFieldValues": 8,
        "nvmlEventSetWait_v2": 1,
    }
    clock.tick(0.5)  # faster than SLOW_INTERVAL_S: no processes, field values or XID drain
    before = dict(fake.calls)
    collect(s)
    for fn in (
        "nvmlDeviceGetComputeRunningProcesses",
        "nvmlDeviceGetGraphicsRunningProcesses",
        "nvmlDeviceGetFieldValues",
        "nvmlEventSetWait_v2",
    ):
        assert fake.calls[fn] == before[fn]


# ---- case 01: GB10, memory unsupported ------------------------------------------------------
def test_case01_gb10_memory_absent_rest_kept():
    row = (FIXTURES / "01-gb10-uma-memory-na.input.txt").read_text().splitlines()[1]
    cells = [c.strip() for c in row.split(",")]
    assert cells[:3] == ["[N/A]"] * 3
    s, _fake, clock = make("gb10")
    collect(s)
    clock.tick()
    b = collect(s)
    assert get(b, "kvpressure_gpu_up", gpu="0") == 1.0
    assert not {
        n for n in names(b) if n.startswith("kvpressure_gpu_memory_") and n.endswith("_bytes")
    }
    assert get(b, "kvpressure_gpu_utilization_ratio") == float(cells[3].rstrip(" %")) / 100
    assert get(b, "kvpressure_gpu_power_watts") == float(cells[4].rstrip(" W"))
    assert get(b, "kvpressure_gpu_temperature_celsius") == float(cells[5])
    assert get(b, "kvpressure_gpu_process_memory_bytes", pid="7100") == 20480 * MIB
    assert sources(b)["gpu0.memory"] == ("unsupported", "unified_memory")
    info = next(x for x in b.samples if x.name == "kvpressure_gpu_info")
    assert dict(info.labels)["unified_memory"] == "true"
    assert "kvpressure_tokens_per_byte" not in names(b)  # no memory: nothing to divide by


def test_case01_same_error_on_a_discrete_card_stays_unknown():
    spec = load_profile("h100-sxm")
    spec["gpus"] = 1
    spec["device"] = {**spec["device"], "memory_mib": None}
    s, _fake, _clock = make(spec)
    b = collect(s)
    assert sources(b)["gpu0.memory"] == ("unsupported", "not_supported")
    info = next(x for x in b.samples if x.name == "kvpressure_gpu_info")
    assert dict(info.labels)["unified_memory"] == "unknown"
    assert get(b, "kvpressure_gpu_utilization_ratio") is not None


def test_unsupported_fields_are_reprobed_not_retried_every_cycle():
    s, fake, clock = make("gb10")
    for _ in range(30):
        b = collect(s)
        clock.tick()
    assert fake.calls["nvmlDeviceGetMemoryInfo_v2"] == 1
    assert sources(b)["gpu0.memory"] == ("unsupported", "unified_memory")
    clock.tick(60)
    collect(s)
    assert fake.calls["nvmlDeviceGetMemoryInfo_v2"] == 2


# ---- case 04: never a non-numeric value --------------------------------------------------------
def _exposition(batches) -> str:
    registry = CollectorRegistry(auto_describe=False)
    samples = [x for b in batches for x in b.samples]

    class Snapshot:
        def collect(self):
            return families(samples)

    registry.register(Snapshot())
    return generate_latest(registry).decode()


def test_case04_unsupported_fields_are_absent_and_the_exposition_is_numeric():
    batches = []
    for profile in ("gb10", "a100-80gb-mig", "h200"):
        s, _fake, clock = make(profile)
        collect(s)
        clock.tick()
        batches.append(collect(s))
    text = _exposition(batches)
    values = [line for line in text.splitlines() if not line.startswith("#")]
    bad = re.compile(r"N/A|Not Supported|Unknown Error|ERR!|\bNaN\b|\bInf\b", re.IGNORECASE)
    assert values and not [line for line in values if bad.search(line)]
    for fam in text_string_to_metric_families(text):
        for smp in fam.samples:
            assert math.isfinite(smp.value), smp
    gb10, a100, _ = batches
    assert get(gb10, "kvpressure_gpu_memory_used_bytes") is None  # unknown -> absent, not 0
    assert get(a100, "kvpressure_gpu_utilization_ratio", gpu="0") is None


def test_case04_exposition_passes_promtool(tmp_path):
    promtool = shutil.which("promtool") or (
        "/usr/bin/promtool" if Path("/usr/bin/promtool").exists() else None
    )
    if promtool is None:
        pytest.skip("promtool not installed")
    eng = Engines()
    s, _fake, clock = make("h200", state_view=eng.views)
    m, _f, mclock = make("a100-80gb-mig")
    batches = []
    for i in range(3):
        eng.set("vllm", running=4, waiting=1, prompt=100 * i, generation=10 * i)
        batches.append(collect(s))
        batches.append(collect(m))
        clock.tick()
        mclock.tick()
    text = _exposition(batches[-2:])
    proc = subprocess.run(
        [promtool, "check", "metrics"], input=text, capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_through_agent_state_and_the_prometheus_exporter():
    from kvpressure.exporters.prometheus import make_registry

    eng = Engines()
    state = AgentState(Timeline())
    s, _fake, clock = make("h200", state_view=state.latest_many)
    for _ in range(3):
        b = collect(s)
        state.publish(SamplerReport("gpu", time.time(), 0.01, True, "", b))
        clock.tick()
    text = generate_latest(make_registry(state)).decode()
    assert 'kvpressure_gpu_up{gpu="0",uuid="GPU-5eed0200-0000-4000-8000-000000000000"} 1.0' in text
    assert "kvpressure_exporter_unknown_samples_total 0.0" in text
    assert 'kvpressure_source_up{sampler="gpu",source="nvml"} 1.0' in text
    del eng


# ---- case 05: a GPU lost mid-run --------------------------------------------------------------
def test_case05_lost_gpu_is_isolated_backs_off_and_recovers():
    dmesg = (FIXTURES / "05-gpu-lost-mid-sampling.dmesg.txt").read_text()
    assert "79, pid=<unknown>, name=<unknown>, GPU has fallen off the bus" in dmesg
    s, fake, clock = make(
        "lost-after-n", fake_opts={"lost_after_calls": 25, "recover_after_calls": 3}
    )
    gpu1 = fake.devices[1]
    history = []
    for _ in range(30):
        b = collect(s)
        history.append((clock.t, b, gpu1.calls))
        clock.tick()
    ups = [get(b, "kvpressure_gpu_up", gpu="1") for _t, b, _c in history]
    first_down = ups.index(0.0)
    assert 0 < first_down < 5
    down = history[first_down][1]
    assert names(down, gpu="1") == {"kvpressure_gpu_up"}  # nothing else for the lost GPU
    assert sources(down)["gpu1"] == ("error", "gpu_lost")
    assert get(down, "kvpressure_gpu_up", gpu="0") == 1.0  # the other GPU keeps sampling
    assert DESIGN_GPU_METRICS - {"kvpressure_gpu_process_memory_bytes"} <= names(down, gpu="0")
    # back-off: retries 1, 2, 4 s after the failure; no NVML calls on GPU 1 in between
    attempts = [
        i for i in range(first_down + 1, len(history)) if history[i][2] != history[i - 1][2]
    ]
    assert [i - first_down for i in attempts[:3]] == [1, 3, 7]
    back = next(i for i in range(first_down, len(ups)) if ups[i] == 1.0)
    assert back == first_down + 7
    recovered = history[back][1]
    assert "kvpressure_gpu_memory_used_bytes" in names(recovered, gpu="1")
    assert sources(recovered)["gpu1"] == ("ok", "")
    assert get(recovered, "kvpressure_gpu_xid_errors_total", gpu="1", xid="79") == 1.0
    before = get(
        history[first_down - 1][1], "kvpressure_gpu_pcie_bytes_total", gpu="1", direction="tx"
    )
    assert get(history[-1][1], "kvpressure_gpu_pcie_bytes_total", gpu="1", direction="tx") >= before


def test_case05_hung_nvml_call_is_bounded_and_isolated():
    s, fake, clock = make("h100-sxm", fake_opts={"gpus": 3}, gpu_timeout_s=0.6)
    collect(s)
    clock.tick()
    fake.set(1, hang_s=3.0)
    t0 = time.monotonic()
    b = collect(s)
    took = time.monotonic() - t0
    assert took < 2.0  # bounded by gpu_timeout_s (0.6 s), not by the 3 s hang
    assert get(b, "kvpressure_gpu_up", gpu="1") == 0.0
    assert sources(b)["gpu1"] == ("error", "timeout")
    assert (
        get(b, "kvpressure_gpu_up", gpu="0") == 1.0 and get(b, "kvpressure_gpu_up", gpu="2") == 1.0
    )
    assert "kvpressure_gpu_memory_used_bytes" in names(b, gpu="2")  # read after the hung GPU
    clock.tick()
    t0 = time.monotonic()
    b = collect(s)  # GPU 1's call is still stuck: skipped at once, nothing piles up
    assert time.monotonic() - t0 < 1.0
    assert sources(b)["gpu1"] == ("error", "timeout")
    assert get(b, "kvpressure_gpu_up", gpu="2") == 1.0
    fake.set(1, hang_s=0)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        clock.tick(10)
        b = collect(s)
        if get(b, "kvpressure_gpu_up", gpu="1") == 1.0:
            break
        time.sleep(0.1)
    assert get(b, "kvpressure_gpu_up", gpu="1") == 1.0
    s.close()


# ---- case 06: driver/library mismatch -------------------------------------------------------
def test_case06_mismatch_at_start_backs_off_and_heals_without_restart(caplog):
    version_file = FIXTURES / "06-nvml-driver-mismatch.input.txt"
    s, fake, clock = make("driver-mismatch-heals", driver_version_file=str(version_file))
    seen = []
    with caplog.at_level(logging.WARNING, logger="kvpressure.agent.samplers.gpu"):
        for _ in range(10):
            b = collect(s)  # never raises
            seen.append((sources(b)["nvml"], get(b, "kvpressure_gpu_up", gpu="0")))
            clock.tick()
    assert seen[0] == (("error", "library_version_mismatch"), None)
    assert fake.init_attempts == 4  # t=0, 1, 3, 7: capped exponential back-off, not every cycle
    ok_at = [i for i, (src, _) in enumerate(seen) if src == ("ok", "")]
    assert ok_at[0] == 7 and seen[-1] == (("ok", ""), 1.0)
    down_logs = [r.getMessage() for r in caplog.records if "NVML unavailable" in r.getMessage()]
    assert len(down_logs) == 1  # once per state change
    assert "kernel module 550.90.07" in down_logs[0]
    assert sum("available again" in r.getMessage() for r in caplog.records) == 1


def test_case06_driver_reload_under_a_running_agent():
    eng = Engines()
    eng.set("vllm", running=1, waiting=3)
    s, fake, clock = make(
        "driver-mismatch-heals", state_view=eng.views, fake_opts={"init_failures": 0}
    )
    for _ in range(3):
        b = collect(s)
        clock.tick()
    total_before = get(b, "kvpressure_gpu_pcie_bytes_total", direction="tx")
    stall_before = stall(b, "idle_with_queue")
    assert stall_before == 2.0
    fake.break_driver(init_failures=2)
    b = collect(s)
    assert sources(b)["nvml"] == ("error", "library_version_mismatch")
    assert names(b, gpu="0") == {"kvpressure_gpu_up"} and get(b, "kvpressure_gpu_up") == 0.0
    for _ in range(8):
        clock.tick()
        b = collect(s)
    assert sources(b)["nvml"] == ("ok", "")
    assert get(b, "kvpressure_gpu_up", gpu="0") == 1.0
    assert get(b, "kvpressure_gpu_pcie_bytes_total", direction="tx") >= total_before
    assert stall(b, "idle_with_queue") >= stall_before  # counters survive the re-init


def test_no_nvml_library_disables_once_with_a_hint(caplog):
    s = GpuSampler(nb.NvmlBinding(None, "nvml"), interval_s=1.0)
    with caplog.at_level(logging.WARNING, logger="kvpressure.agent.samplers.gpu"):
        for _ in range(5):
            b = collect(s)
            assert sources(b) == {"nvml": ("unsupported", "library_not_found")}
            assert b.samples == []
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 1 and "libnvidia-ml.so.1" in msgs[0] and "\n" not in msgs[0]


# ---- case 07: MIG -------------------------------------------------------------------------------
def test_case07_mig_parent_and_instances():
    row = (FIXTURES / "07-mig-util-na.input.txt").read_text().splitlines()[8]
    assert "36537MiB / 81920MiB" in row and "N/A" in row
    s, _fake, clock = make("a100-80gb-mig", engine_pids=lambda: {6100: "vllm"})
    collect(s)
    clock.tick()
    b = collect(s)
    parent = {"gpu": "0"}
    assert (
        get(
            b,
            "kvpressure_gpu_memory_used_bytes",
            **parent,
            uuid="GPU-5eeda100-0000-4000-8000-000000000000",
        )
        == 36537 * MIB
    )
    assert (
        get(b, "kvpressure_gpu_memory_total_bytes", uuid="GPU-5eeda100-0000-4000-8000-000000000000")
        == 81920 * MIB
    )
    assert get(b, "kvpressure_gpu_power_watts") == 87.0
    assert get(b, "kvpressure_gpu_temperature_celsius") == 33.0
    assert not [x for x in b.samples if x.name == "kvpressure_gpu_utilization_ratio"]  # never 0
    src = sources(b)
    assert src["gpu0.utilization"] == ("unsupported", "mig_enabled")
    assert src["gpu0.mig1.utilization"] == ("unsupported", "mig_enabled")
    assert src["gpu0.mig2.utilization"] == ("unsupported", "mig_enabled")
    for mig in ("1", "2"):
        assert get(b, "kvpressure_gpu_up", mig=mig) == 1.0
        assert get(b, "kvpressure_gpu_memory_total_bytes", mig=mig) == 40192 * MIB
    assert get(b, "kvpressure_gpu_memory_used_bytes", mig="2") == 19 * MIB
    assert (
        get(b, "kvpressure_gpu_process_memory_bytes", mig="1", pid="6100", engine="vllm")
        == 36480 * MIB
    )
    # stall time lives on the instances; idle_with_queue needs utilization, which MIG lacks
    assert stall(b, "idle_with_queue", mig="1") is None
    assert stall(b, "throttled", mig="1") == 0.0
    assert stall(b, "throttled", gpu="0", uuid="GPU-5eeda100-0000-4000-8000-000000000000") is None


def test_mig_instances_inherit_the_parents_throttling():
    eng = Engines()
    eng.set("vllm", running=2, waiting=1)
    s, fake, clock = make("a100-80gb-mig", state_view=eng.views, engine_pids=lambda: {6100: "vllm"})
    collect(s)
    fake.set(0, clocks_event_reasons=["hw_power_brake_slowdown"])
    for _ in range(3):
        clock.tick()
        b = collect(s)
    assert stall(b, "throttled", mig="1") == 3.0
    assert stall(b, "throttled", mig="2") == 0.0  # no engine there, and vllm is mapped to mig 1


# ---- stall time ------------------------------------------------------------------------------
def test_stall_phases_move_only_the_matching_reason():
    eng = Engines()
    s, fake, clock = make("h200", state_view=eng.views)
    eng.set("vllm", running=1, waiting=4)
    collect(s)  # first cycle: no dt yet

    def phase(cycles, **gpu):
        fake.set(0, **gpu)
        for _ in range(cycles):
            clock.tick()
            b = collect(s)
        return tuple(stall(b, r) for r in ("idle_with_queue", "memory_bound", "throttled"))

    quiet = {"clocks_event_reasons": []}
    assert phase(3, utilization_gpu=3, dram_bw_util=10, sm_occupancy=5, **quiet) == (3, 0, 0)
    assert phase(2, utilization_gpu=95, dram_bw_util=85, sm_occupancy=15, **quiet) == (3, 2, 0)
    # throttled wins even where idle_with_queue and memory_bound would also hold
    thermal = {"clocks_event_reasons": ["sw_thermal_slowdown"]}
    assert phase(4, utilization_gpu=3, dram_bw_util=85, sm_occupancy=15, **thermal) == (3, 2, 4)
    assert phase(1, utilization_gpu=50, dram_bw_util=40, sm_occupancy=40, **quiet) == (3, 2, 4)
    eng.set("vllm", running=2, waiting=0)  # running only: not idle-with-queue
    assert phase(2, utilization_gpu=3, dram_bw_util=10, sm_occupancy=5, **quiet) == (3, 2, 4)
    eng.set("vllm", running=0, waiting=0)  # nothing to do: no stall at all
    assert phase(2, utilization_gpu=3, dram_bw_util=85, sm_occupancy=15, **thermal) == (3, 2, 4)


def test_stall_reason_without_its_signals_never_accrues():
    eng = Engines()
    eng.set("llamacpp", running=1, waiting=2)
    s, fake, clock = make("gb10", state_view=eng.views)  # no GPM
    fake.set(0, utilization_gpu=95, clocks_event_reasons=[])
    for _ in range(3):
        b = collect(s)
        clock.tick()
    assert stall(b, "memory_bound") is None  # no bandwidth/occupancy signal: not exported
    assert stall(b, "idle_with_queue") == 0.0 and stall(b, "throttled") == 0.0
    s2, _f, clock2 = make("h200")  # no engine data at all: nothing accrues
    for _ in range(3):
        b = collect(s2)
        clock2.tick()
    assert (stall(b, "idle_with_queue"), stall(b, "memory_bound"), stall(b, "throttled")) == (
        0,
        0,
        0,
    )


def test_stall_does_not_accrue_across_a_gap():
    eng = Engines()
    eng.set("vllm", running=1, waiting=1)
    s, fake, clock = make("h200", state_view=eng.views)
    fake.set(0, utilization_gpu=1)
    collect(s)
    clock.tick(1)
    collect(s)
    clock.tick(600)  # the agent was stopped/suspended
    b = collect(s)
    assert stall(b, "idle_with_queue") == 1.0


TH = StallThresholds()
maybe = st.one_of(st.none(), st.floats(0, 1))


@given(
    running=st.one_of(st.none(), st.floats(0, 100)),
    waiting=st.one_of(st.none(), st.floats(0, 100)),
    util=maybe,
    bw=maybe,
    sm=maybe,
    throttled=st.one_of(st.none(), st.booleans()),
)
def test_stall_reason_never_uses_a_missing_signal(running, waiting, util, bw, sm, throttled):
    r = stall_reason(
        running=running,
        waiting=waiting,
        utilization=util,
        bandwidth=bw,
        sm_occupancy=sm,
        throttled=throttled,
        thresholds=TH,
    )
    if (running or 0) + (waiting or 0) <= 0:
        assert r is None
    if r == "throttled":
        assert throttled is True
    if r == "memory_bound":
        assert bw is not None and sm is not None and bw > 0.6 and sm < 0.3 and not throttled
    if r == "idle_with_queue":
        assert util is not None and util < 0.1 and waiting and waiting > 0
        assert not throttled and not (bw is not None and sm is not None and bw > 0.6 and sm < 0.3)


def test_thresholds_from_a_config_like_object():
    class Cfg:
        idle_utilization_below = 0.05
        memory_bound_bandwidth_above = 0.7
        memory_bound_sm_below = 0.2
        data_movement_window_s = 10.0
        binding = "fake:h200"

    th = StallThresholds.of(Cfg(), memory_bound_sm_below=0.25)
    assert th == StallThresholds(0.05, 0.7, 0.25, 10.0)
    s = AcceleratorSampler(lambda: None, None, thresholds=Cfg())
    assert s.thresholds.idle_utilization_below == 0.05


# ---- data movement -----------------------------------------------------------------------------
def test_bytes_per_token_and_tokens_per_byte():
    eng = Engines()
    pids = {5100: "vllm", 5101: "vllm"}
    s, _fake, clock = make(
        "h100-sxm", fake_opts={"gpus": 2}, state_view=eng.views, engine_pids=lambda: pids
    )
    for i in range(10):
        eng.set("vllm", running=8, waiting=0, prompt=20000 * i, generation=3000 * i)
        b = collect(s)
        clock.tick()
    nvlink = 18 * 1_953_125 * 1024 * 2  # 18 links x KiB/s x 2 directions
    bytes_per_s = 52_000_000 + 48_000_000 + nvlink
    for gpu in ("0", "1"):
        assert get(b, "kvpressure_data_movement_bytes_per_token", gpu=gpu) == pytest.approx(
            bytes_per_s / 23000
        )
        # tokens over the 9 s with known token deltas / mean memory in use
        assert get(b, "kvpressure_tokens_per_byte", gpu=gpu) == pytest.approx(
            23000 * 9 / (74624 * MIB)
        )
    assert get(b, "kvpressure_gpu_nvlink_bytes_total", gpu="0", direction="tx") == pytest.approx(
        9 * nvlink / 2
    )


def test_per_token_figures_are_absent_when_tokens_are_unknown():
    s, _f, clock = make("h100-sxm", fake_opts={"gpus": 1})  # no state view
    eng = Engines()
    eng.set("vllm", running=3, waiting=1)  # request gauges but no token counters
    s2, _f2, clock2 = make("h100-sxm", fake_opts={"gpus": 1}, state_view=eng.views)
    for _ in range(5):
        b, b2 = collect(s), collect(s2)
        clock.tick()
        clock2.tick()
    for batch in (b, b2):
        assert "kvpressure_data_movement_bytes_per_token" not in names(batch)
        assert "kvpressure_tokens_per_byte" not in names(batch)
    assert stall(b2, "idle_with_queue") == 0.0  # the gauges still feed stall time


def test_bytes_per_token_absent_without_pcie_counters_and_zero_tokens_is_not_a_division():
    eng = Engines()
    s, _f, clock = make("a100-80gb-mig", state_view=eng.views)  # PCIe counters unsupported
    for i in range(5):
        eng.set("vllm", running=1, waiting=0, prompt=100 * i, generation=0)
        b = collect(s)
        clock.tick()
    assert "kvpressure_data_movement_bytes_per_token" not in names(b)
    assert sources(b)["gpu0.pcie"] == ("unsupported", "not_supported")
    assert get(b, "kvpressure_tokens_per_byte", gpu="0") > 0
    eng2 = Engines()
    s2, _f2, clock2 = make("h200", state_view=eng2.views)
    for _ in range(5):
        eng2.set("vllm", running=0, waiting=0, prompt=5, generation=5)  # idle: no tokens
        b = collect(s2)
        clock2.tick()
    assert "kvpressure_data_movement_bytes_per_token" not in names(b)
    assert get(b, "kvpressure_tokens_per_byte") == 0.0


# ---- engine -> GPU mapping and the process join ------------------------------------------------
def test_engines_map_to_their_gpus_and_unknown_ones_count_everywhere():
    eng = Engines()
    s, fake, clock = make(
        "h100-sxm", fake_opts={"gpus": 2}, state_view=eng.views, engine_pids=lambda: {5100: "a"}
    )
    for i in (0, 1):
        fake.set(i, utilization_gpu=2)
    eng.set("a", running=1, waiting=5)
    eng.set("b", running=0, waiting=0)
    collect(s)
    clock.tick()
    b = collect(s)
    assert stall(b, "idle_with_queue", gpu="0") == 1.0  # engine a holds GPU 0
    assert stall(b, "idle_with_queue", gpu="1") == 0.0  # a is not on GPU 1; b is idle
    eng.set("b", running=0, waiting=2)  # b's PIDs are unknown: it counts for every GPU
    clock.tick()
    b = collect(s)
    assert stall(b, "idle_with_queue", gpu="0") == 2.0
    assert stall(b, "idle_with_queue", gpu="1") == 1.0


def test_process_join_walks_parent_pids(tmp_path):
    proc = tmp_path / "proc"
    (proc / "4242").mkdir(parents=True)
    (proc / "4242" / "stat").write_text("4242 (python3 (worker)) S 4000 4242 4242 0 -1 4194560\n")
    (proc / "4000").mkdir()
    (proc / "4000" / "stat").write_text("4000 (vllm) S 1 4000 4000 0 -1 4194560\n")
    s, _f, _c = make("h200", engine_pids=lambda: {4000: "vllm"}, procfs_root=str(proc))
    b = collect(s)
    assert get(b, "kvpressure_gpu_process_memory_bytes", pid="4242", engine="vllm") == 86016 * MIB
    s2, _f2, _c2 = make("h200", engine_pids=lambda: {}, procfs_root=str(proc))
    b2 = collect(s2)
    x = next(x for x in b2.samples if x.name == "kvpressure_gpu_process_memory_bytes")
    assert "engine" not in dict(x.labels) and dict(x.labels)["process"] == "python3"


def test_broken_engine_pids_provider_does_not_stop_sampling(caplog):
    def boom():
        raise RuntimeError("psutil went away")

    s, _f, _c = make("h200", engine_pids=boom)
    with caplog.at_level(logging.WARNING, logger="kvpressure.agent.samplers.gpu"):
        b = collect(s)
        b = collect(s)
    assert get(b, "kvpressure_gpu_up") == 1.0
    assert sum("engine_pids" in r.getMessage() for r in caplog.records) == 1


def test_xids_are_counted_per_gpu_and_code():
    s, fake, clock = make("h100-sxm", fake_opts={"gpus": 2})
    collect(s)
    fake.inject_xid(1, 45)
    fake.inject_xid(1, 45)
    fake.inject_xid(0, 119)
    clock.tick()
    b = collect(s)
    assert get(b, "kvpressure_gpu_xid_errors_total", gpu="1", xid="45") == 2.0
    assert get(b, "kvpressure_gpu_xid_errors_total", gpu="0", xid="119") == 1.0
    assert sources(b)["xid"] == ("ok", "")


def test_close_releases_nvml():
    s, fake, _c = make("h200")
    collect(s)
    collect(s)
    s.close()
    assert fake.calls["nvmlShutdown"] == 1
    assert fake.calls["nvmlEventSetFree"] == 1
    assert fake.calls["nvmlGpmSampleFree"] == 2


def test_inline_mode_gives_the_same_samples():
    a, _fa, ca = make("h200")
    b, _fb, cb = make("h200", gpu_timeout_s=0)
    for _ in range(3):
        ba, bb = collect(a), collect(b)
        ca.tick()
        cb.tick()
    assert sorted((x.name, x.labels, x.value) for x in ba.samples) == sorted(
        (x.name, x.labels, x.value) for x in bb.samples
    )


def test_hopper_mig_instances_get_gpm_through_the_mig_sample():
    spec = load_profile("h100-sxm")
    spec["gpus"] = 1
    spec["device"] = {
        **spec["device"],
        "mig": {
            "instances": [
                {
                    "gi": 1,
                    "name": "NVIDIA H100 80GB HBM3 MIG 3g.40gb",
                    "memory_mib": {"total": 40448, "used": 30000},
                    "gpm": {"dram_bw_util": 72.0, "sm_occupancy": 18.0},
                }
            ]
        },
    }
    eng = Engines()
    eng.set("vllm", running=1, waiting=1)
    s, fake, clock = make(spec, state_view=eng.views)
    for _ in range(3):
        b = collect(s)
        clock.tick()
    assert fake.calls["nvmlGpmMigSampleGet"] == 3
    assert (
        get(b, "kvpressure_gpu_memory_bandwidth_utilization_ratio", mig="1", source="gpm") == 0.72
    )
    assert get(b, "kvpressure_gpu_sm_occupancy_ratio", mig="1") == 0.18
    assert stall(b, "memory_bound", mig="1") == 2.0  # cycles 2 and 3 (GPM needs two samples)


# ---- issue 17, kind 2: values that cannot be true are dropped and counted ------------------
GIB = 1024**3


def _procfs(tmp_path, mem_total_kib=2 * 1024**3, mem_available_kib=1536 * 1024**2, nspid=()):
    """A procfs root with meminfo and ``(outer, inner)`` processes in a nested PID namespace."""
    (tmp_path / "meminfo").write_text(
        f"MemTotal:       {mem_total_kib} kB\nMemFree:        1000 kB\n"
        f"MemAvailable:   {mem_available_kib} kB\n"
    )
    for outer, inner in nspid:
        d = tmp_path / str(outer)
        d.mkdir()
        (d / "status").write_text(f"Name:\tpython3\nPid:\t{outer}\nNSpid:\t{outer}\t{inner}\n")
        (d / "stat").write_text(f"{outer} (python3) S 1 {outer} {outer} 0\n")
    return str(tmp_path)


def _dropped(batch, reason):
    return get(batch, "kvpressure_gpu_values_dropped_total", reason=reason)


def _process_rows(batch):
    return {
        dict(x.labels)["pid"]: x.value
        for x in batch.samples
        if x.name == "kvpressure_gpu_process_memory_bytes"
    }


def test_issue17_impossible_process_rows_are_dropped_and_counted_rest_kept(tmp_path):
    s, fake, clock = make("h200", procfs_root=_procfs(tmp_path))
    fake.set(
        0,
        processes=[
            (0, 1 * GIB, "ghost"),  # seen on real drivers
            (4294967295, 4294967295, "ghost"),  # -1 as unsigned, with -1 bytes
            (5000, 10 * GIB, "vllm"),
            (5000, 10 * GIB, "vllm"),  # the same row twice
            (5001, 500 * GIB, "big"),  # more than the 140 GiB GPU
        ],
        graphics_processes=[
            (5000, 10 * GIB, "vllm"),  # compute + graphics contexts: one process
            (6000, 2 * GIB, "Xorg"),  # graphics only: was never read
        ],
    )
    b = collect(s)
    assert _process_rows(b) == {"5000": 10 * GIB, "6000": 2 * GIB}  # not 20 GiB, no ghosts
    assert _dropped(b, "process_pid_invalid") == 2
    assert _dropped(b, "process_duplicate") == 1
    assert _dropped(b, "process_memory_above_total") == 1
    # the rest of the sample is kept
    assert get(b, "kvpressure_gpu_memory_used_bytes") == 87321 * MIB
    assert get(b, "kvpressure_gpu_utilization_ratio") == 0.68
    assert get(b, "kvpressure_gpu_up") == 1.0
    clock.tick()
    b = collect(s)
    assert _dropped(b, "process_pid_invalid") == 4  # cumulative
    assert_catalogued_gpu(b)


def assert_catalogued_gpu(batch):
    for x in batch.samples:
        assert {k for k, _ in x.labels} <= set(CATALOGUE[x.name].labels), x


def test_issue17_pids_from_another_pid_namespace_are_mapped_through_nspid(tmp_path):
    # the engine runs in a container: NVML lists its namespace's PID 7, which is 48213 here
    procfs = _procfs(tmp_path, nspid=[(48213, 7), (48300, 9), (48301, 9)])
    s, fake, _clock = make("h200", procfs_root=procfs, engine_pids=lambda: {48213: "vllm-a"})
    fake.set(0, processes=[(7, 30 * GIB, "python3"), (9, 1 * GIB, "python3")])
    b = collect(s)
    rows = {
        dict(x.labels)["pid"]: dict(x.labels).get("engine")
        for x in b.samples
        if x.name == "kvpressure_gpu_process_memory_bytes"
    }
    assert rows == {"48213": "vllm-a", "9": None}  # 9 is two containers' PID: left as is


def _unified_profile(name, total_gib, used_gib):
    spec = load_profile("gb10")
    spec["device"] = {
        **spec["device"],
        "name": name,
        "memory_mib": {"total": total_gib * 1024, "used": used_gib * 1024},
    }
    return spec


@pytest.mark.parametrize(
    ("name", "total_gib"),
    [
        ("NVIDIA GB10", 119),  # NVML answers with the system's memory (other drivers than case 01)
        ("NVIDIA GH200 480GB", 470),  # a Grace superchip reporting the coherent system memory
        ("NVIDIA Future SoC", 119),  # unknown name, total = host MemTotal
    ],
)
def test_issue17_unified_memory_with_a_system_sized_total(tmp_path, name, total_gib):
    procfs = _procfs(tmp_path, mem_total_kib=total_gib * 1024**2, mem_available_kib=80 * 1024**2)
    s, _fake, clock = make(_unified_profile(name, total_gib, 34), procfs_root=procfs)
    collect(s)
    clock.tick()
    b = collect(s)
    info = next(x for x in b.samples if x.name == "kvpressure_gpu_info")
    assert dict(info.labels)["unified_memory"] == "true"  # was "false"
    # used is the processes' memory (20 GiB), not the host's 34 GiB
    assert get(b, "kvpressure_gpu_memory_used_bytes") == 20480 * MIB
    assert get(b, "kvpressure_gpu_memory_total_bytes") is None  # the system's, not the GPU's
    assert get(b, "kvpressure_gpu_memory_free_bytes") is None
    assert get(b, "kvpressure_gpu_unified_memory_available_bytes") == 80 * GIB
    assert sources(b)["gpu0.memory"] == ("unsupported", "unified_memory")
    assert get(b, "kvpressure_gpu_power_watts") == 11.17  # the rest is kept


def test_issue17_a_discrete_gpu_on_a_big_host_is_not_unified(tmp_path):
    s, _fake, _clock = make("h200", procfs_root=_procfs(tmp_path, mem_total_kib=2 * 1024**3))
    b = collect(s)
    info = next(x for x in b.samples if x.name == "kvpressure_gpu_info")
    assert dict(info.labels)["unified_memory"] == "false"
    assert get(b, "kvpressure_gpu_memory_used_bytes") == 87321 * MIB
    assert get(b, "kvpressure_gpu_unified_memory_available_bytes") is None


# ---- issue 17, kind 6: an engine that disagrees with NVML is flagged, NVML wins ------------
def test_issue17_engine_gpu_view_disagreeing_with_nvml_is_flagged():
    eng = Engines()
    s, _fake, _clock = make("h200", state_view=eng.views)
    uuid = "GPU-5eed0200-0000-4000-8000-000000000000"
    nvml_v1_used = (87321 + 700) * MIB  # what the engine's own NVML v1 call calls used

    def engine_view(engine, used, total):
        lab = make_labels({"engine": engine, "instance": f"{engine}:8002", "uuid": uuid})
        eng.series.setdefault("kvpressure_engine_gpu_memory_used_bytes", {})[lab] = used
        eng.series.setdefault("kvpressure_engine_gpu_memory_total_bytes", {})[lab] = total

    engine_view("triton-a", nvml_v1_used + 100 * MIB, 143771 * MIB)  # agrees (read later)
    engine_view("triton-b", 20 * GIB, 80 * GIB)  # another GPU's figures: disagrees
    b = collect(s)
    flag = "kvpressure_gpu_engine_disagreement"
    assert get(b, flag, engine="triton-a", signal="memory_used") == 0
    assert get(b, flag, engine="triton-a", signal="memory_total") == 0
    assert get(b, flag, engine="triton-b", signal="memory_used") == 1
    assert get(b, flag, engine="triton-b", signal="memory_total") == 1
    assert get(b, "kvpressure_gpu_memory_used_bytes") == 87321 * MIB  # NVML's, unchanged
    assert_catalogued_gpu(b)


# ---- fake NVML from a file, and `kvpressure gpu record` --------------------------------------
def _static(batch):
    """The samples a recording must reproduce exactly (rates are measured, so left out)."""
    keep = (
        "kvpressure_gpu_up",
        "kvpressure_gpu_info",
        "kvpressure_gpu_memory_",
        "kvpressure_gpu_utilization_ratio",
        "kvpressure_gpu_power_watts",
        "kvpressure_gpu_temperature_celsius",
        "kvpressure_gpu_clock_event_active",
        "kvpressure_gpu_process_memory_bytes",
        "kvpressure_gpu_values_dropped_total",
    )
    return sorted((x.name, x.labels, x.value) for x in batch.samples if x.name.startswith(keep))


@pytest.mark.parametrize("profile", ["h200", "a100-80gb-mig", "gb10", "h100-sxm"])
def test_gpu_record_round_trip_through_a_profile_file(tmp_path, profile):
    from kvpressure.agent.cli import main

    path = tmp_path / f"{profile}.yaml"
    assert main(["gpu", "record", str(path), "--binding", f"fake:{profile}", "--seconds", "0"]) == 0
    outputs = []
    for binding in (f"fake:{profile}", f"fake:{path}"):
        s = GpuSampler(binding, interval_s=1.0, timeout_s=10.0, gpu_timeout_s=0)
        try:
            collect(s)
            time.sleep(0.01)
            outputs.append((collect(s), sources(collect(s))))
        finally:
            s.close()
    (orig, orig_src), (replay, replay_src) = outputs
    assert _static(replay) == _static(orig)
    assert replay_src == orig_src  # unsupported fields and their reasons too


def test_gpu_record_keeps_nvml_errors_and_odd_rows(tmp_path):
    from kvpressure.agent.samplers.fake_nvml.record import record

    spec = load_profile("h200")
    spec["device"] = {**spec["device"], "errors": {"nvmlDeviceGetPowerUsage": 4}}  # NO_PERMISSION
    fake = FakeNvml(spec)
    fake.set(0, processes=[(4294967295, 1 * GIB), (4242, 2 * GIB), (4242, 2 * GIB)])
    profile = record(nb.NvmlBinding(fake, "fake:h200"), seconds=0, sleep=lambda _s: None)
    dev = profile["device"]
    assert dev["errors"] == {"nvmlDeviceGetPowerUsage": 4}
    assert dev["power_w"] is None
    assert [p["pid"] for p in dev["processes"]] == [4294967295, 4242, 4242]  # as NVML said
    replay = GpuSampler(nb.NvmlBinding(FakeNvml(profile), "fake:file"), timeout_s=10.0)
    b = collect(replay)
    assert sources(b)["gpu0.power"] == ("unsupported", "no_permission")
    assert _dropped(b, "process_pid_invalid") == 1 and _dropped(b, "process_duplicate") == 1


def test_config_accepts_a_fake_profile_file_and_rejects_a_missing_one(tmp_path):
    from kvpressure.agent.config import ConfigError, load

    path = tmp_path / "gpu.yaml"
    path.write_text(
        (Path(__file__).parents[1] / "agent/samplers/fake_nvml/profiles/gb10.yaml").read_text()
    )
    good = tmp_path / "good.yaml"
    good.write_text(f"gpu: {{binding: 'fake:{path}'}}\n")
    assert load(str(good)).gpu.binding == f"fake:{path}"
    bad = tmp_path / "bad.yaml"
    bad.write_text(f"gpu: {{binding: 'fake:{tmp_path}/missing.yaml'}}\n")
    with pytest.raises(ConfigError):
        load(str(bad))


def test_issue17_impossible_memory_and_utilization_readings_are_dropped_rest_kept(tmp_path):
    s, fake, clock = make("h200", procfs_root=_procfs(tmp_path))
    fake.set(0, memory_used=200 * GIB, utilization_gpu=255)  # used > the 140 GiB total
    b = collect(s)
    assert get(b, "kvpressure_gpu_memory_used_bytes") is None
    assert get(b, "kvpressure_gpu_memory_total_bytes") is None
    assert get(b, "kvpressure_gpu_utilization_ratio") is None
    assert _dropped(b, "memory_above_total") == 1
    assert _dropped(b, "utilization_out_of_range") == 1
    assert get(b, "kvpressure_gpu_power_watts") == 434.0  # the rest is kept
    assert _process_rows(b) == {"4242": 86016 * MIB}
    fake.set(0, memory_used=80 * GIB, utilization_gpu=50)
    clock.tick()
    b = collect(s)
    assert get(b, "kvpressure_gpu_memory_used_bytes") == 80 * GIB
    assert get(b, "kvpressure_gpu_utilization_ratio") == 0.5
    assert _dropped(b, "memory_above_total") == 1  # cumulative, nothing new


def test_process_in_a_pod_gets_pod_uid_from_cgroup_and_names_from_pod_resources(tmp_path):
    """Issue 16 point 5: pod_uid from /proc/PID/cgroup; namespace, pod, container only from
    the kubelet's device assignment, and only for a process the cgroup puts in a pod."""
    uid = "6f1c2b3a-4d5e-4f60-8a9b-0c1d2e3f4a5b"
    cid = "ab" * 32
    proc = tmp_path / "proc"
    (proc / "4242").mkdir(parents=True)
    (proc / "4242" / "stat").write_text("4242 (python3) S 1 4242 4242 0 -1 4194560\n")
    (proc / "4242" / "cgroup").write_text(
        "0::/kubepods.slice/kubepods-burstable.slice/"
        f"kubepods-burstable-pod{uid.replace('-', '_')}.slice/cri-containerd-{cid}.scope\n"
    )
    s, _f, _c = make("h200", procfs_root=str(proc))
    b = collect(s)
    rows = [dict(x.labels) for x in b.samples if x.name == "kvpressure_gpu_process_memory_bytes"]
    mine = next(r for r in rows if r["pid"] == "4242")
    assert mine["pod_uid"] == uid
    assert not {"pod", "namespace", "container"} & mine.keys()  # no name source: absent

    assignments = {mine["uuid"]: ("llm", "vllm-0", "vllm")}
    s2, _f2, _c2 = make("h200", procfs_root=str(proc), pod_names=lambda: assignments)
    b2 = collect(s2)
    rows2 = [dict(x.labels) for x in b2.samples if x.name == "kvpressure_gpu_process_memory_bytes"]
    mine2 = next(r for r in rows2 if r["pid"] == "4242")
    assert (mine2["namespace"], mine2["pod"], mine2["container"]) == ("llm", "vllm-0", "vllm")
    # the same process on the same assigned GPU, but a host cgroup: no pod, so no names
    (proc / "4242" / "cgroup").write_text("0::/system.slice/vllm.service\n")
    s3, _f3, _c3 = make("h200", procfs_root=str(proc), pod_names=lambda: assignments)
    rows3 = [dict(x.labels) for x in collect(s3).samples if x.name.endswith("process_memory_bytes")]
    mine3 = next(r for r in rows3 if r["pid"] == "4242")
    assert not {"pod_uid", "pod", "namespace", "container"} & mine3.keys()


def test_engine_pod_info_joins_an_engine_to_its_pod(tmp_path):
    uid = "6f1c2b3a-4d5e-4f60-8a9b-0c1d2e3f4a5b"
    proc = tmp_path / "proc"
    (proc / "4242").mkdir(parents=True)
    (proc / "4242" / "stat").write_text("4242 (python3) S 1 4242 4242 0 -1 4194560\n")
    (proc / "4242" / "cgroup").write_text(f"0::/kubepods/besteffort/pod{uid}/{'cd' * 32}\n")
    s, _f, _c = make("h200", procfs_root=str(proc), engine_pids=lambda: {4242: "vllm"})
    b = collect(s)
    info = [dict(x.labels) for x in b.samples if x.name == "kvpressure_engine_pod_info"]
    assert info == [{"engine": "vllm", "pod_uid": uid}]
    # without the engine join, or outside a pod, there is no info series
    s2, _f2, _c2 = make("h200", procfs_root=str(proc))
    assert not [x for x in collect(s2).samples if x.name == "kvpressure_engine_pod_info"]


def test_engine_pids_are_asked_for_when_a_gpu_process_appears_or_the_answer_is_old():
    """``engine_pids`` walks every process's fds: not on every slow cycle, only on change."""
    calls = []

    def engine_pids():
        calls.append(1)
        return {5100: "a"}

    s, fake, clock = make("h100-sxm", fake_opts={"gpus": 1}, engine_pids=engine_pids)
    fake.set(0, processes=[(5100, 1 << 30)])
    for _ in range(10):  # ten slow cycles, the same GPU processes
        collect(s)
        clock.tick()
    assert len(calls) == 1
    fake.set(0, processes=[(5100, 1 << 30), (5200, 1 << 30)])  # an engine (re)started
    collect(s)
    clock.tick()
    assert len(calls) == 2
    fake.set(0, processes=[(5200, 1 << 30)])  # one left: nothing new to resolve
    collect(s)
    assert len(calls) == 2
    clock.tick(ENGINE_PIDS_MAX_AGE_S)  # an old answer is asked for again
    collect(s)
    assert len(calls) == 3


def _read_report_before(samples, sources):
    """``accelerator._read_report`` as it was before its one-pass rewrite (the reference)."""
    from kvpressure.agent import catalogue as m
    from kvpressure.agent.samplers import accelerator as acc

    gpus, leaves = {}, {}
    samples = list(samples)
    for s in samples:
        if s.name == m.GPU_UP:
            g = gpus.setdefault(acc._label(s.labels, "gpu") or "", acc._Gpu())
            if s.value < 1:
                g.up = False
            elif acc._label(s.labels, "uuid") is not None:
                leaf = acc._Leaf(s.labels, acc._label(s.labels, "mig"))
                leaves[s.labels] = leaf
                g.leaves.append(leaf)
                g.mig_enabled = g.mig_enabled or leaf.mig is not None
    for s in samples:
        kind = acc._KIND.get(s.name)
        if kind is None:
            continue
        labels = s.labels
        device = tuple((k, v) for k, v in labels if k in acc._DEVICE_KEYS)
        if kind == "links":
            owner = gpus.get(acc._label(labels, "gpu") or "")
            if owner is not None:
                owner.totals[(acc._LINKS[s.name], acc._label(labels, "direction") or "")] = s.value
            continue
        dev = leaves.get(device)
        if dev is None:
            continue
        if kind == "utilization":
            dev.utilization = s.value
        elif kind == "bandwidth":
            if acc._label(labels, "source") == "gpm":
                dev.bandwidth = s.value
        elif kind == "sm":
            dev.sm_occupancy = s.value
        elif kind == "clock":
            owner = gpus.get(acc._label(labels, "gpu") or "")
            if owner is not None and dev.mig is None:
                owner.clocks[acc._label(labels, "reason") or ""] = s.value
        elif kind == "process":
            engine = acc._label(labels, "engine")
            if engine is not None:
                dev.engines.add(engine)
        elif kind == "memory":
            dev.memory[acc._MEMORY[s.name]] = s.value
    for status in sources:
        index, _, what = status.source.removeprefix("gpu").partition(".")
        found = gpus.get(index)
        if found is None or status.state != "unsupported":
            continue
        if what == "nvlink":
            found.nvlink_unsupported = True
        elif what == "utilization" and status.reason == "mig_enabled":
            found.mig_enabled = True
    return gpus


@pytest.mark.parametrize("profile", list_profiles())
def test_one_pass_read_of_a_gpu_report_equals_the_two_pass_one(profile):
    from kvpressure.agent.samplers.accelerator import _read_report

    engines = Engines()
    engines.set("vllm", running=4, waiting=1, prompt=100, generation=50)
    sampler, _fake, clock = make(profile, state_view=engines.views)
    for _ in range(6):
        b = Batch()
        sampler.gpu.collect(b)
        assert _read_report(b.samples, b.sources) == _read_report_before(b.samples, b.sources)
        # a report whose samples come in another order reads the same too
        back = list(reversed(b.samples))
        assert _read_report(back, b.sources) == _read_report_before(back, b.sources)
        clock.tick(1.0)
