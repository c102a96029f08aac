import asyncio
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from agent.config import parse
from agent.daemon import Daemon, SamplerRunner
from agent.samplers.base import Sampler
from agent.samples import Batch
from agent.state import AgentState
from agent.timeline import Timeline

QUIET = (
    "samplers: {host: {enabled: false}, engines: {enabled: false}}\ndiscovery: {enabled: false}\n"
    "attribution: {enabled: false}\n"
)


class Counting(Sampler):
    """A sampler that counts its calls; optionally sleeps or raises."""

    def __init__(self, name, interval_s=0.05, timeout_s=None, sleep_s=0.0, fail=False):
        super().__init__(interval_s, timeout_s)
        self.name = name
        self.sleep_s = sleep_s
        self.fail = fail
        self.calls = 0

    def collect(self, batch: Batch) -> None:
        self.calls += 1
        if self.sleep_s:
            time.sleep(self.sleep_s)
        if self.fail:
            raise RuntimeError("boom")
        batch.add("kvpressure_host_memory_total_bytes", 1.0)
        batch.source_ok("fake")


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_slow_sampler_times_out_without_delaying_others():
    state = AgentState(Timeline())
    slow = SamplerRunner(Counting("slow", interval_s=0.1, timeout_s=0.2, sleep_s=1.0), state, 1)
    fast = SamplerRunner(Counting("fast", interval_s=0.05), state, 2)
    slow.start()
    fast.start()
    t_end = time.monotonic() + 0.8
    while time.monotonic() < t_end:
        now = time.monotonic()
        slow.check_timeout(now)
        fast.check_timeout(now)
        time.sleep(0.02)
    reports = {r.sampler: r for r in state.reports()}
    assert reports["slow"].ok is False and reports["slow"].reason == "timeout"
    assert reports["fast"].ok is True
    assert fast.sampler.calls >= 10  # ~16 expected at 20 Hz
    assert slow.sampler.calls == 1  # never piled up behind the stuck call
    slow.stop()
    fast.stop()


def test_failing_sampler_is_down_and_counted_others_unaffected():
    state = AgentState(Timeline())
    bad = SamplerRunner(Counting("bad", fail=True), state, 1)
    good = SamplerRunner(Counting("good"), state, 2)
    state.publish(bad.collect_once())
    state.publish(bad.collect_once())
    state.publish(good.collect_once())
    values = {(s.name, s.labels): s.value for s in state.samples()}
    assert values[("kvpressure_sampler_up", (("sampler", "bad"),))] == 0.0
    assert values[("kvpressure_sampler_up", (("sampler", "good"),))] == 1.0
    assert (
        values[
            ("kvpressure_sampler_failures_total", (("reason", "RuntimeError"), ("sampler", "bad")))
        ]
        == 2.0
    )
    assert values[("kvpressure_source_up", (("sampler", "good"), ("source", "fake")))] == 1.0


def _run_daemon(daemon):
    """Run daemon.run() on a background loop; return (loop, thread)."""
    loop = asyncio.new_event_loop()
    ready = threading.Event()

    def main():
        asyncio.set_event_loop(loop)
        loop.run_until_complete(daemon.run(ready=ready.set))

    t = threading.Thread(target=main, daemon=True)
    t.start()
    assert ready.wait(5)
    return loop, t


def test_http_endpoints_and_format_negotiation():
    cfg = parse(f"listen: '127.0.0.1:0'\n{QUIET}")
    d = Daemon(cfg, extra_samplers=[Counting("fake", interval_s=0.05)])
    loop, t = _run_daemon(d)
    try:
        base = f"http://127.0.0.1:{d.bound_port}"
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            body = httpx.get(base + "/metrics").text
            if "kvpressure_host_memory_total_bytes" in body:
                break
            time.sleep(0.05)
        r = httpx.get(base + "/metrics")
        assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
        fams = {f.name: f for f in text_string_to_metric_families(r.text)}
        up = {x.labels["sampler"]: x.value for x in fams["kvpressure_sampler_up"].samples}
        assert up["fake"] == 1.0
        assert fams["kvpressure_host_memory_total_bytes"].samples[0].value == 1.0
        om = httpx.get(base + "/metrics", headers={"Accept": "application/openmetrics-text"})
        assert om.headers["content-type"].startswith("application/openmetrics-text")
        assert om.text.rstrip().endswith("# EOF")
        assert httpx.get(base + "/healthz").json()["status"] == "ok"
        snap = httpx.get(base + "/api/v1/snapshot").json()
        assert "fake" in {x["sampler"] for x in snap["samplers"]}
        assert any(s["name"] == "kvpressure_host_memory_total_bytes" for s in snap["samples"])
    finally:
        loop.call_soon_threadsafe(d.request_stop)
        t.join(5)
    assert not t.is_alive()


def test_reload_rejects_invalid_file_and_keeps_running(tmp_path):
    p = tmp_path / "k.yaml"
    p.write_text(f"listen: '127.0.0.1:0'\n{QUIET}log_level: info\n")
    d = Daemon(parse(p.read_text(), str(p)), p)
    p.write_text("interval_s: [\n")
    assert d.reload() is False
    assert d.config.log_level == "info"
    p.write_text(f"listen: '127.0.0.1:0'\n{QUIET}log_level: debug\n")
    assert d.reload() is True
    assert d.config.log_level == "debug"
    values = {(s.name, s.labels): s.value for s in d.state.samples()}
    assert values[("kvpressure_config_reloads_total", (("result", "invalid"),))] == 1
    assert values[("kvpressure_config_reloads_total", (("result", "ok"),))] == 1


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_stops_the_process_within_two_seconds(tmp_path, sig):
    port = _free_port()
    cfg = tmp_path / "k.yaml"
    cfg.write_text(f"listen: '127.0.0.1:{port}'\ndiscovery: {{enabled: false}}\n")
    proc = subprocess.Popen(
        [sys.executable, "-m", "agent.cli", "run", "--config", str(cfg)],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=0.5).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.05)
        else:
            pytest.fail("agent did not come up")
        # SIGHUP with an invalid file: rejected, still serving
        cfg.write_text("listen: [\n")
        os.kill(proc.pid, signal.SIGHUP)
        time.sleep(0.3)
        assert httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200
        t0 = time.monotonic()
        proc.send_signal(sig)
        rc = proc.wait(timeout=5)
        elapsed = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    err = proc.stderr.read()
    assert rc == 0, err
    assert elapsed < 2.0, f"shutdown took {elapsed:.2f}s"
    assert "config reload rejected" in err
    assert all(line.startswith("ts=") for line in err.strip().splitlines()), err


def test_systemd_notify_ready_and_watchdog(tmp_path):
    sock_path = str(tmp_path / "notify.sock")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    srv.bind(sock_path)
    srv.settimeout(5)
    port = _free_port()
    cfg = tmp_path / "k.yaml"
    cfg.write_text(f"listen: '127.0.0.1:{port}'\n{QUIET}")
    env = dict(os.environ, NOTIFY_SOCKET=sock_path, WATCHDOG_USEC="400000")
    proc = subprocess.Popen(
        [sys.executable, "-m", "agent.cli", "run", "--config", str(cfg)],
        env=env,
        stderr=subprocess.DEVNULL,
    )
    got = []
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and sum("WATCHDOG=1" in m for m in got) < 3:
            got.append(srv.recv(4096).decode())
        proc.send_signal(signal.SIGHUP)
        while time.monotonic() < deadline and not any("RELOADING=1" in m for m in got):
            got.append(srv.recv(4096).decode())
        proc.terminate()
        while time.monotonic() < deadline and not any("STOPPING=1" in m for m in got):
            got.append(srv.recv(4096).decode())
        proc.wait(5)
    finally:
        if proc.poll() is None:
            proc.kill()
        srv.close()
    ready = [m for m in got if "READY=1" in m]
    assert ready, got
    assert f"listening on 127.0.0.1:{port}" in ready[0]
    assert sum("WATCHDOG=1" in m for m in got) >= 3
    assert got.index(ready[0]) < next(i for i, m in enumerate(got) if "WATCHDOG=1" in m)
    assert any(m.startswith("RELOADING=1\nMONOTONIC_USEC=") for m in got)
    assert any("STOPPING=1" in m for m in got)


def test_fake_h200_binding_serves_every_design_gpu_metric():
    """`kvpressure run` with gpu.binding: fake:h200 serves the GPU names DESIGN.md lists."""
    cfg = parse(
        "listen: '127.0.0.1:0'\ninterval_s: 0.2\n"
        "samplers: {host: {enabled: false}, engines: {enabled: false}}\n"
        "discovery: {enabled: false}\ngpu: {binding: 'fake:h200'}\n"
    )
    d = Daemon(cfg)
    loop, t = _run_daemon(d)
    design = {
        "kvpressure_gpu_memory_total_bytes",
        "kvpressure_gpu_memory_used_bytes",
        "kvpressure_gpu_memory_reserved_bytes",
        "kvpressure_gpu_utilization_ratio",
        "kvpressure_gpu_memory_bandwidth_utilization_ratio",
        "kvpressure_gpu_sm_occupancy_ratio",
        "kvpressure_gpu_pcie_bytes",
        "kvpressure_gpu_nvlink_bytes",
        "kvpressure_gpu_clock_event_active",
        "kvpressure_gpu_process_memory_bytes",
        "kvpressure_accelerator_stall_seconds",
    }
    try:
        base = f"http://127.0.0.1:{d.bound_port}"
        deadline = time.monotonic() + 10
        names: set[str] = set()
        while time.monotonic() < deadline and not design <= names:
            text = httpx.get(base + "/metrics").text
            names = {f.name for f in text_string_to_metric_families(text) if f.samples}
            time.sleep(0.2)
    finally:
        loop.call_soon_threadsafe(d.request_stop)
        t.join(5)
    assert design <= names, sorted(design - names)
    total = next(
        f
        for f in text_string_to_metric_families(text)
        if f.name == "kvpressure_gpu_memory_total_bytes"
    )
    assert total.samples[0].value == 143771 * 2**20  # H200 as NVML reports it


def test_stop_requested_during_start_up_starts_no_sampler(monkeypatch):
    """A SIGTERM handled while the listener is being bound ends the start-up there."""
    cfg = parse(f"listen: '127.0.0.1:0'\n{QUIET}")
    d = Daemon(cfg, extra_samplers=[Counting("fake", interval_s=0.05)])
    serve = d._serve

    async def serve_then_term(host, port):
        await serve(host, port)
        os.kill(os.getpid(), signal.SIGTERM)  # handled by the loop at the next await
        await asyncio.sleep(0.05)

    monkeypatch.setattr(d, "_serve", serve_then_term)
    started = []

    def record_start(runner):
        started.append(runner)

    monkeypatch.setattr(SamplerRunner, "start", record_start)
    t0 = time.monotonic()
    asyncio.run(d.run())
    assert time.monotonic() - t0 < 2.0
    assert started == [] and d.proxies == {}
