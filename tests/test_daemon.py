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

from kvpressure.agent import scheduler
from kvpressure.agent.config import parse
from kvpressure.agent.daemon import Daemon, SamplerRunner
from kvpressure.agent.pipeline import SHARED_THREAD
from kvpressure.agent.samplers.base import Sampler
from kvpressure.agent.samples import Batch
from kvpressure.agent.scheduler import Runners
from kvpressure.agent.state import AgentState
from kvpressure.agent.timeline import Timeline

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


class Grouped(Counting):
    """A :class:`Counting` sampler in a thread group; records its threads and its close."""

    thread_group = "test-group"

    def __init__(self, name, interval_s=0.05, sleep_s=0.0, slow_after=None):
        super().__init__(name, interval_s=interval_s, sleep_s=0.0)
        self.threads = set()
        self.closed = False
        self.slow_sleep = sleep_s
        self.slow_after = slow_after

    def collect(self, batch: Batch) -> None:
        self.threads.add(threading.current_thread().name)
        super().collect(batch)
        if self.slow_after is not None and self.calls > self.slow_after:
            time.sleep(self.slow_sleep)

    def close(self) -> None:
        self.closed = True


def test_thread_group_shares_one_thread_and_publishes_each_report():
    state = AgentState(Timeline())
    runners = Runners(state)
    a, b = Grouped("g-a"), Grouped("g-b")
    other = Grouped("g-other", interval_s=0.07)  # another interval: another thread
    runners.apply({}, {"g-a": a, "g-b": b, "g-other": other})
    before = {t.name for t in threading.enumerate()}
    time.sleep(0.5)
    assert a.threads == b.threads == {"sampler-test-group"}
    assert other.threads == {"sampler-test-group"}
    assert "sampler-g-a" not in before and "sampler-g-b" not in before
    assert sum(t.name == "sampler-test-group" for t in threading.enumerate()) == 2
    assert a.calls >= 6 and b.calls >= 6  # ~10 each at 20 Hz
    reports = {r.sampler: r for r in state.reports()}
    assert reports["g-a"].ok and reports["g-b"].ok and reports["g-other"].ok
    for r in runners.stop():
        assert r.join(2.0)
    assert a.closed and b.closed and other.closed
    time.sleep(0.1)
    assert not any(t.name == "sampler-test-group" for t in threading.enumerate())


def test_thread_group_member_that_overruns_leaves_without_delaying_the_rest():
    state = AgentState(Timeline())
    runners = Runners(state)
    slow = Grouped("g-slow", sleep_s=0.3, slow_after=2)
    fast = Grouped("g-fast")
    runners.apply({}, {"g-slow": slow, "g-fast": fast})
    time.sleep(0.3)
    calls = fast.calls
    time.sleep(1.0)
    assert "sampler-g-slow" in slow.threads  # left the group for a thread of its own
    assert fast.threads == {"sampler-test-group"}
    assert fast.calls - calls >= 12  # ~20 at 20 Hz; one late tick at most
    # a stopped member is closed; the group's thread ends with its last member
    for r in runners.stop():
        assert r.join(2.0)
    assert slow.closed and fast.closed


class Stuck(Grouped):
    """A grouped sampler whose calls ``slow_from`` to ``slow_to`` take ``sleep_s`` each."""

    def __init__(self, name, sleep_s, slow_from, slow_to=10**9):
        super().__init__(name)
        self.slow = (slow_from, slow_to)
        self.stuck_sleep = sleep_s

    def collect(self, batch: Batch) -> None:
        super().collect(batch)
        if self.slow[0] <= self.calls <= self.slow[1]:
            time.sleep(self.stuck_sleep)


def _watch(runners, seconds):
    """Run the daemon's watchdog (every 0.02 s here) for ``seconds``."""
    t_end = time.monotonic() + seconds
    while time.monotonic() < t_end:
        runners.check_timeouts(time.monotonic())
        time.sleep(0.02)


def test_thread_group_watchdog_moves_the_rest_on_while_a_member_is_stuck():
    # The stuck call lasts 1.5 s: without the watchdog's move the others would wait for it.
    state = AgentState(Timeline())
    runners = Runners(state)
    stuck = Stuck("g-stuck", sleep_s=1.5, slow_from=3, slow_to=3)
    fast = Grouped("g-fast")
    runners.apply({}, {"g-stuck": stuck, "g-fast": fast})
    _watch(runners, 0.3)
    calls = fast.calls
    _watch(runners, 1.0)
    assert stuck.calls == 3  # still inside its stuck call
    assert fast.calls - calls >= 12  # ~20 at 20 Hz: not held up behind it
    assert fast.threads == {"sampler-test-group"}  # a new thread of the same group
    assert sum(t.name == "sampler-test-group" for t in threading.enumerate()) == 2
    _watch(runners, 0.8)
    assert stuck.calls >= 5 and "sampler-g-stuck" in stuck.threads  # on its own thread now
    for r in runners.stop():
        assert r.join(3.0)
    assert stuck.closed and fast.closed


def test_member_that_left_rejoins_its_group_once_quick_again(monkeypatch):
    monkeypatch.setattr(scheduler, "REJOIN_AFTER", 5)
    state = AgentState(Timeline())
    runners = Runners(state)
    slow = Stuck("g-slow", sleep_s=0.12, slow_from=2, slow_to=3)  # a busy spell, then quick
    fast = Grouped("g-fast")
    runners.apply({}, {"g-slow": slow, "g-fast": fast})
    _watch(runners, 1.2)
    assert "sampler-g-slow" in slow.threads  # left during its slow spell
    slow.threads.clear()
    _watch(runners, 0.5)
    assert slow.threads == {"sampler-test-group"}  # back on the group's thread
    assert not any(t.name == "sampler-g-slow" for t in threading.enumerate())
    for r in runners.stop():
        assert r.join(2.0)
    assert slow.closed and fast.closed


def test_thread_group_whose_tick_overruns_sheds_its_slowest_member():
    # each collection fits the 0.1 s interval, all three together do not
    state = AgentState(Timeline())
    runners = Runners(state)
    a, b = Stuck("g-a", 0.03, slow_from=1), Stuck("g-b", 0.03, slow_from=1)
    slowest = Stuck("g-slowest", 0.06, slow_from=1)
    for g in (a, b, slowest):
        g.interval_s = 0.1
    runners.apply({}, {"g-a": a, "g-b": b, "g-slowest": slowest})
    _watch(runners, 0.6)
    assert "sampler-g-slowest" in slowest.threads  # left for a thread of its own
    assert a.threads == b.threads == {"sampler-test-group"}
    calls = a.calls
    _watch(runners, 0.5)
    assert a.calls - calls >= 4  # ~5 at 10 Hz: the group keeps its interval
    for r in runners.stop():
        assert r.join(2.0)


class Prepared(Grouped):
    """A grouped sampler that logs its prepare and collect calls in one shared list."""

    def __init__(self, name, log):
        super().__init__(name)
        self.log = log

    def prepare(self) -> None:
        self.log.append(("prepare", self.name))

    def collect(self, batch: Batch) -> None:
        self.log.append(("collect", self.name))
        super().collect(batch)


def test_thread_group_prepares_every_member_before_the_tick_collects():
    events: list[tuple[str, str]] = []
    state = AgentState(Timeline())
    runners = Runners(state)
    a, b = Prepared("p-a", events), Prepared("p-b", events)
    # the group's thread starts with its first member and may tick before the next joins
    # (CI saw it): here it always does
    runners.apply({}, {"p-a": a})
    deadline = time.monotonic() + 5.0
    while len(events) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    runners.apply({}, {"p-a": a, "p-b": b})
    time.sleep(0.3)
    for r in runners.stop():
        assert r.join(2.0)
    ticks: list[list[tuple[str, str]]] = []  # a tick starts with a prepare after a collect
    for event in events:
        if not ticks or (event[0] == "prepare" and ticks[-1][-1][0] == "collect"):
            ticks.append([])
        ticks[-1].append(event)
    alone = [("prepare", "p-a"), ("collect", "p-a")]
    both = [("prepare", "p-a"), ("prepare", "p-b"), ("collect", "p-a"), ("collect", "p-b")]
    assert ticks[0] == alone
    while ticks and ticks[0] == alone:
        del ticks[0]
    assert len(ticks) >= 4, ticks
    for tick in ticks[:-1]:  # the last one may be cut short by the stop
        assert tick == both


class Default(Counting):
    """A sampler with the default ``thread_group``; records the threads it ran on."""

    def __init__(self, name, interval_s=0.05):
        super().__init__(name, interval_s=interval_s)
        self.threads = set()

    def collect(self, batch: Batch) -> None:
        self.threads.add(threading.current_thread().name)
        super().collect(batch)


class Alone(Default):
    thread_group = None


def test_samplers_of_one_interval_share_a_thread_by_default():
    state = AgentState(Timeline())
    runners = Runners(state)
    a, b, slower, alone = Default("d-a"), Default("d-b"), Default("d-c", 0.1), Alone("d-own")
    runners.apply({}, {"d-a": a, "d-b": b, "d-c": slower, "d-own": alone})
    time.sleep(0.4)
    assert a.threads == b.threads == slower.threads == {f"sampler-{SHARED_THREAD}"}
    assert sum(t.name == f"sampler-{SHARED_THREAD}" for t in threading.enumerate()) == 2
    assert alone.threads == {"sampler-d-own"}
    assert min(a.calls, b.calls) >= 5 and slower.calls >= 3
    for r in runners.stop():
        assert r.join(2.0)


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


def test_metrics_gzip_follows_accept_encoding_weights():
    """``/metrics`` on the wire: gzip when asked, plain for ``gzip;q=0`` (RFC 9110 12.5.3)."""
    import gzip
    import http.client

    cfg = parse(f"listen: '127.0.0.1:0'\n{QUIET}")
    d = Daemon(cfg)
    loop, t = _run_daemon(d)
    prom = "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5"
    try:
        conn = http.client.HTTPConnection("127.0.0.1", d.bound_port, timeout=5)
        seen = {}
        for encoding in ("gzip", "gzip;q=0", "identity", "gzip;q=0, *", "x-gzip"):
            conn.request("GET", "/metrics", headers={"Accept": prom, "Accept-Encoding": encoding})
            r = conn.getresponse()  # one kept-alive connection, as Prometheus scrapes
            body = r.read()
            assert r.status == 200 and r.getheader("Vary") == "Accept, Accept-Encoding"
            assert r.getheader("Content-Type").startswith("application/openmetrics-text")
            seen[encoding] = r.getheader("Content-Encoding")
            if seen[encoding] == "gzip":
                body = gzip.decompress(body)
            assert body.endswith(b"# EOF\n") and b"kvpressure_build_info" in body
        assert seen == {
            "gzip": "gzip",
            "gzip;q=0": None,
            "identity": None,
            "gzip;q=0, *": None,
            "x-gzip": "gzip",
        }
        conn.close()
    finally:
        loop.call_soon_threadsafe(d.request_stop)
        t.join(5)


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
        [sys.executable, "-m", "kvpressure.agent.cli", "run", "--config", str(cfg)],
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
        [sys.executable, "-m", "kvpressure.agent.cli", "run", "--config", str(cfg)],
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


def _slow_sse_upstream(n_events=10):
    """An aiohttp engine on its own loop thread streaming ``n_events`` SSE events 0.1 s apart.

    Returns (url, the whole stream's bytes, stop).
    """
    from aiohttp import web

    loop = asyncio.new_event_loop()
    events = [b'data: {"choices":[{"delta":{"content":"t%d"}}]}\n\n' % i for i in range(n_events)]

    async def chat(request):
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for e in events:
            await resp.write(e)
            await asyncio.sleep(0.1)
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    port = _free_port()
    loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
    t = threading.Thread(target=loop.run_forever, daemon=True)
    t.start()

    def stop():
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(5)
        loop.call_soon_threadsafe(loop.stop)
        t.join(5)

    return f"http://127.0.0.1:{port}", b"".join(events), stop


def test_reload_moving_a_proxy_serves_the_new_port_at_once(tmp_path):
    """A proxy whose listen changes stops listening at once, the new address serves at once,
    and the old one's stream in flight finishes; quick successive reloads leave exactly the
    configured listener."""
    upstream, whole, stop_upstream = _slow_sse_upstream()
    ports = [_free_port() for _ in range(3)]

    def config(port):
        return (
            f"listen: '127.0.0.1:0'\n{QUIET}"
            f"proxies: [{{listen: '127.0.0.1:{port}', upstream: '{upstream}', engine: e}}]\n"
        )

    p = tmp_path / "k.yaml"
    p.write_text(config(ports[0]))
    d = Daemon(parse(p.read_text(), str(p)), p)
    loop, t = _run_daemon(d)
    got = {}

    def stream_through_old():
        r = httpx.post(f"http://127.0.0.1:{ports[0]}/v1/chat/completions", json={}, timeout=10)
        got["old"] = (r.status_code, r.content)

    try:
        s = threading.Thread(target=stream_through_old)
        s.start()
        time.sleep(0.2)  # the stream is running (1 s long)
        p.write_text(config(ports[1]))
        loop.call_soon_threadsafe(d._on_hup)
        t0 = time.monotonic()
        while True:
            try:
                with httpx.stream(
                    "POST", f"http://127.0.0.1:{ports[1]}/v1/chat/completions", json={}
                ) as r:
                    answered = time.monotonic() - t0
                    body = r.read()
                break
            except httpx.ConnectError:
                assert time.monotonic() - t0 < 0.6, "the new address did not serve in time"
                time.sleep(0.02)
        assert r.status_code == 200 and body == whole
        assert answered < 0.6  # long before the old stream ends
        with pytest.raises(httpx.ConnectError):
            httpx.post(f"http://127.0.0.1:{ports[0]}/v1/chat/completions", json={})
        s.join(10)
        assert got["old"] == (200, whole)

        # Two reloads in quick succession while a stream runs on the current port.
        s = threading.Thread(
            target=lambda: httpx.post(
                f"http://127.0.0.1:{ports[1]}/v1/chat/completions", json={}, timeout=10
            )
        )
        s.start()
        time.sleep(0.2)
        p.write_text(config(ports[2]))
        loop.call_soon_threadsafe(d._on_hup)
        time.sleep(0.05)
        p.write_text(config(ports[0]))
        loop.call_soon_threadsafe(d._on_hup)
        s.join(10)
        time.sleep(0.3)
        assert list(d.proxies) == [f"127.0.0.1:{ports[0]}"]
        assert (
            httpx.post(f"http://127.0.0.1:{ports[0]}/v1/chat/completions", json={}).content == whole
        )
        for gone in ports[1:]:
            with pytest.raises(httpx.ConnectError):
                httpx.post(f"http://127.0.0.1:{gone}/v1/chat/completions", json={})
    finally:
        loop.call_soon_threadsafe(d.request_stop)
        t.join(10)
        stop_upstream()
    assert not t.is_alive()


def test_stop_does_not_wait_for_long_streams(tmp_path):
    """SIGTERM with a 10 s stream in flight through a proxy: the agent stops within 2 s,
    cutting the stream (its client sees it end early) instead of waiting for it."""
    upstream, _, stop_upstream = _slow_sse_upstream(n_events=100)
    port = _free_port()
    cfg = parse(
        f"listen: '127.0.0.1:0'\n{QUIET}"
        f"proxies: [{{listen: '127.0.0.1:{port}', upstream: '{upstream}', engine: e}}]\n"
    )
    d = Daemon(cfg)
    loop, t = _run_daemon(d)
    got = {}

    def stream():
        try:
            httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json={}, timeout=30)
            got["error"] = None
        except httpx.HTTPError as exc:
            got["error"] = type(exc).__name__

    try:
        s = threading.Thread(target=stream)
        s.start()
        time.sleep(0.5)
        t0 = time.monotonic()
        loop.call_soon_threadsafe(d.request_stop)
        t.join(10)
        took = time.monotonic() - t0
        s.join(10)
    finally:
        stop_upstream()
    assert not t.is_alive() and took < 2.0, took
    assert got["error"] is not None  # the stream was cut, not completed


def test_reload_to_an_address_in_use_keeps_the_old_proxy(tmp_path, caplog):
    """A reload moving a proxy to a port that cannot be bound (a typo, a busy port) keeps
    the old proxy serving; the next good reload moves it."""
    upstream, whole, stop_upstream = _slow_sse_upstream(n_events=2)
    old_port, good_port = _free_port(), _free_port()
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)

    def config(port):
        return (
            f"listen: '127.0.0.1:0'\n{QUIET}"
            f"proxies: [{{listen: '127.0.0.1:{port}', upstream: '{upstream}', engine: e}}]\n"
        )

    p = tmp_path / "k.yaml"
    p.write_text(config(old_port))
    d = Daemon(parse(p.read_text(), str(p)), p)
    loop, t = _run_daemon(d)

    def chat(port):
        return httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json={}).content

    try:
        p.write_text(config(busy.getsockname()[1]))
        loop.call_soon_threadsafe(d._on_hup)
        time.sleep(0.5)
        assert list(d.proxies) == [f"127.0.0.1:{old_port}"]
        assert chat(old_port) == whole
        assert "proxy could not listen" in caplog.text
        assert "proxies kept until a reload binds every new address" in caplog.text
        p.write_text(config(good_port))
        loop.call_soon_threadsafe(d._on_hup)
        time.sleep(0.5)
        assert list(d.proxies) == [f"127.0.0.1:{good_port}"]
        assert chat(good_port) == whole
        with pytest.raises(httpx.ConnectError):
            chat(old_port)
    finally:
        loop.call_soon_threadsafe(d.request_stop)
        t.join(10)
        stop_upstream()
        busy.close()
    assert not t.is_alive()


# --- reload hardening (issue 18, point 4) -------------------------------------------------------


def _reloads(d, result):
    values = {(s.name, s.labels): s.value for s in d.state.samples()}
    return values.get(("kvpressure_config_reloads_total", (("result", result),)), 0)


def _notice(sock):
    """The next sd_notify message that is not a periodic STATUS= or WATCHDOG= line."""
    while True:
        msg = sock.recv(4096).decode()
        if not msg.startswith(("STATUS=", "WATCHDOG=")):
            return msg


def _release_fifo(path):
    """Open a FIFO for writing and close it, so a reader blocked on it (old code) gets EOF."""
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:
        pass  # nobody is reading it


def _make_bad(kind, p):
    p.unlink()
    if kind == "fifo":
        os.mkfifo(p)
    elif kind == "dev_zero":
        p.symlink_to("/dev/zero")
    elif kind == "deep":
        p.write_text("listen: " + "[" * 100_000 + "\n")
    elif kind == "too_large":
        p.write_text("# " + "x" * (2 * 1024 * 1024) + "\n")


@pytest.mark.parametrize("kind", ["fifo", "dev_zero", "deep", "too_large"])
def test_reload_of_an_unreadable_file_is_a_counted_invalid_reload(tmp_path, caplog, kind):
    """A FIFO, /dev/zero, deep nesting or a huge file: HTTP keeps answering, the reload is
    counted invalid with one error line, systemd gets READY=1 again, and the next good
    reload applies."""
    sock_path = str(tmp_path / "notify.sock")
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(sock_path)
    notify.settimeout(5)
    p = tmp_path / "k.yaml"
    p.write_text(f"listen: '127.0.0.1:0'\n{QUIET}log_level: info\n")
    d = Daemon(parse(p.read_text(), str(p)), p)
    from kvpressure.agent.sdnotify import Notifier

    d.notifier = Notifier({"NOTIFY_SOCKET": sock_path})
    loop, t = _run_daemon(d)
    try:
        assert "READY=1" in _notice(notify)
        base = f"http://127.0.0.1:{d.bound_port}"
        _make_bad(kind, p)
        loop.call_soon_threadsafe(d._on_hup)
        assert _notice(notify).startswith("RELOADING=1")
        assert "READY=1" in _notice(notify)
        assert httpx.get(base + "/healthz", timeout=2).status_code == 200
        assert _reloads(d, "invalid") == 1
        rejected = [r for r in caplog.records if "config reload" in r.getMessage()]
        assert [r.levelname for r in rejected] == ["ERROR"]
        p.unlink()
        p.write_text(f"listen: '127.0.0.1:0'\n{QUIET}log_level: debug\n")
        loop.call_soon_threadsafe(d._on_hup)
        assert _notice(notify).startswith("RELOADING=1")
        assert "READY=1" in _notice(notify)
        assert d.config.log_level == "debug"
        assert _reloads(d, "ok") == 1
    finally:
        if kind == "fifo" and p.is_fifo():
            _release_fifo(p)
        loop.call_soon_threadsafe(d.request_stop)
        t.join(5)
        notify.close()
    assert not t.is_alive()


def test_reload_to_a_busy_listen_address_keeps_the_old_listener(tmp_path, caplog):
    """A reload whose ``listen`` cannot be bound: logged, the old listener keeps serving, no
    task dies with an unretrieved exception; the next reload with a free address moves."""
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    p = tmp_path / "k.yaml"
    p.write_text(f"listen: '127.0.0.1:0'\n{QUIET}")
    d = Daemon(parse(p.read_text(), str(p)), p)
    loop, t = _run_daemon(d)
    unhandled = []
    loop.call_soon_threadsafe(loop.set_exception_handler, lambda _l, ctx: unhandled.append(ctx))
    old = d.bound_port
    try:
        p.write_text(f"listen: '127.0.0.1:{busy.getsockname()[1]}'\n{QUIET}")
        future = asyncio.run_coroutine_threadsafe(d.reload_async(), loop)
        assert future.result(5) is True
        assert httpx.get(f"http://127.0.0.1:{old}/healthz", timeout=2).status_code == 200
        assert "cannot listen on the reloaded address" in caplog.text
        free = _free_port()
        p.write_text(f"listen: '127.0.0.1:{free}'\n{QUIET}")
        assert asyncio.run_coroutine_threadsafe(d.reload_async(), loop).result(5) is True
        assert httpx.get(f"http://127.0.0.1:{free}/healthz", timeout=2).status_code == 200
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"http://127.0.0.1:{old}/healthz", timeout=2)
    finally:
        loop.call_soon_threadsafe(d.request_stop)
        t.join(5)
        busy.close()
    assert not unhandled


def test_command_line_listen_is_kept_across_sighup(tmp_path):
    """``run --listen`` wins over the file's ``listen`` at start and after SIGHUP."""
    cli_port, file_port = _free_port(), _free_port()
    cfg = tmp_path / "k.yaml"
    cfg.write_text(f"listen: '127.0.0.1:{file_port}'\n{QUIET}")
    proc = subprocess.Popen(
        [
            *(sys.executable, "-m", "kvpressure.agent.cli", "run", "--config", str(cfg)),
            *("--listen", f"127.0.0.1:{cli_port}", "--log-level", "warning"),
        ],
        stderr=subprocess.PIPE,
        text=True,
    )

    def healthy(port):
        try:
            return httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=0.5).status_code == 200
        except httpx.HTTPError:
            return False

    def reloads_ok():
        text = httpx.get(f"http://127.0.0.1:{cli_port}/metrics", timeout=2).text
        return 'kvpressure_config_reloads_total{result="ok"} 1.0' in text

    try:
        deadline = time.monotonic() + 10
        while not healthy(cli_port):
            assert time.monotonic() < deadline, "agent did not come up"
            time.sleep(0.05)
        cfg.write_text(f"listen: '127.0.0.1:{file_port}'\n{QUIET}log_level: debug\n")
        proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 5
        while not reloads_ok():
            assert time.monotonic() < deadline, "the reload was not applied"
            time.sleep(0.05)
        assert healthy(cli_port)
        assert not healthy(file_port)
    finally:
        proc.terminate()
        proc.wait(5)
    # --log-level warning is kept too: the reload's "config reloaded" INFO line is not logged
    assert "config reloaded" not in proc.stderr.read()


@pytest.mark.parametrize("kind", ["fifo", "dev_zero", "deep", "too_large"])
def test_check_config_prints_one_line_for_an_unreadable_file(tmp_path, kind):
    p = tmp_path / "k.yaml"
    p.write_text("")
    _make_bad(kind, p)
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "kvpressure.agent.cli", "check-config", str(p)],
            capture_output=True,
            text=True,
            timeout=20,
            check=False,
        )
    finally:
        if kind == "fifo":
            _release_fifo(p)
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{p}: "), proc.stderr
    assert "Traceback" not in proc.stderr
