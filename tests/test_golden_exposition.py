"""Whole-agent golden exposition (node_exporter's ``e2e-output.txt`` habit).

The agent is built from a config exactly as ``kvpressure run`` builds it (every registered
stage) with the fake H200 (``gpu.binding: fake:h200``), a fixture procfs/sysfs, two captured
engine expositions served by a real HTTP server on loopback, and three finished requests.
Three ticks run (sources, then derived stages, as the daemon schedules them), ``/metrics``
is rendered once, linted with ``promtool check metrics`` and compared, normalised, with
``tests/fixtures/golden/e2e-output.txt``.

Regenerate with
``KVPRESSURE_UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/test_golden_exposition.py``
and review the diff (see ``tests/fixtures/golden/README.md``).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from test_timeline_reads import Spy  # the timeline that records every name read from it

from kvpressure.agent import daemon as daemon_module
from kvpressure.agent import pipeline
from kvpressure.agent.config import parse
from kvpressure.agent.daemon import Daemon
from kvpressure.agent.pipeline import ENGINE_SAMPLERS
from kvpressure.agent.requests.record import RequestRecord
from kvpressure.agent.samplers import accelerator
from kvpressure.agent.scheduler import Once

FIXTURES = Path(__file__).parent / "fixtures"
GOLDEN_DIR = FIXTURES / "golden"
GOLDEN = GOLDEN_DIR / "e2e-output.txt"
UPDATE = os.environ.get("KVPRESSURE_UPDATE_GOLDEN") == "1"

ROUTES: dict[str, dict[str, tuple[Path, str]]] = {
    "vllm": {
        "/metrics": (FIXTURES / "engines/vllm/0.32.0-cpu-kv-metrics-load.txt", "text/plain"),
    },
    "llamacpp": {
        "/metrics": (FIXTURES / "engines/llamacpp/metrics_load.txt", "text/plain"),
        "/props": (FIXTURES / "engines/llamacpp/props.json", "application/json"),
        "/slots": (FIXTURES / "engines/llamacpp/slots_load.json", "application/json"),
    },
}

VOLATILE = frozenset(
    {
        # wall-clock durations of this run
        "kvpressure_sampler_duration_seconds",
        # integrated over the real seconds between ticks (fake NVML counters grow with time)
        "kvpressure_accelerator_stall_seconds_total",
        "kvpressure_gpu_pcie_bytes_total",
        "kvpressure_gpu_nvlink_bytes_total",
        "kvpressure_data_movement_bytes_per_token",
        "kvpressure_tokens_per_byte",
    }
)
"""Families whose values depend on the wall clock: compared as ``0`` or ``<positive>``."""

_LINE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?P<labels>\{.*\})? (?P<value>\S+)$")


def _serve(kind: str) -> ThreadingHTTPServer:
    routes = ROUTES[kind]

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            got = routes.get(self.path.split("?")[0])
            if got is None:
                self.send_error(404)
                return
            body = got[0].read_bytes()
            self.send_response(200)
            self.send_header("Content-Type", got[1])
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.fixture
def engines() -> Iterator[dict[str, int]]:
    servers = {kind: _serve(kind) for kind in ROUTES}
    yield {kind: s.server_address[1] for kind, s in servers.items()}
    for s in servers.values():
        s.shutdown()
        s.server_close()


def _config(ports: dict[str, int]) -> str:
    return f"""
listen: "127.0.0.1:0"
interval_s: 1.0
procfs_root: {GOLDEN_DIR / "proc"}
sysfs_root: {GOLDEN_DIR / "sys"}
discovery: {{enabled: false}}
gpu: {{binding: "fake:h200"}}
engines:
  - {{name: vllm, type: vllm, url: "http://127.0.0.1:{ports["vllm"]}"}}
  - {{name: llamacpp, type: llamacpp, url: "http://127.0.0.1:{ports["llamacpp"]}"}}
capacity: {{auto_gguf: false}}
attribution: {{window_s: 3600}}
otlp_receiver: {{enabled: false}}
"""


def _records(now: float) -> list[RequestRecord]:
    return [
        RequestRecord("vllm", now - 6.0, now - 5.0, ttft_s=0.2, input_tokens=512,
                      output_tokens=64, itl_s=(0.01, 0.012, 0.011)),
        RequestRecord("vllm", now - 6.0, now - 4.0, ttft_s=3.5, input_tokens=1024,
                      output_tokens=32),
        RequestRecord("llamacpp", now - 5.5, now - 5.0, ttft_s=0.1, input_tokens=64,
                      output_tokens=16, outcome="server_error", status=500),
    ]  # fmt: skip


@contextlib.contextmanager
def run_agent(ports: dict[str, int]) -> Iterator[tuple[Daemon, Once]]:
    """Build the agent from the config and run three ticks; yields it and its stages."""
    daemon = Daemon(parse(_config(ports)))
    # Attribution windows (an hour here) end at multiples of their length: a run that
    # crossed one would add window scores, so start clear of the next boundary.
    while (time.time() - 2.0) % 3600 > 3600 - 10:
        time.sleep(0.5)
    stages = daemon.pipeline_once()
    try:
        for r in _records(time.time()):
            daemon.request_stream.submit(r)
        for i in range(3):
            if i:
                time.sleep(1.1)  # every tick is a "slow" NVML cycle (SLOW_INTERVAL_S = 1 s)
            stages.tick()
        yield daemon, stages
    finally:
        stages.close()


def render_agent(ports: dict[str, int]) -> str:
    """Build the agent from the config, run three ticks, render ``/metrics`` once."""
    with run_agent(ports) as (daemon, _):
        return generate_latest(daemon.registry).decode()


def normalise(text: str) -> str:
    """Replace what varies run to run by placeholders, per series (see the module docstring)."""
    out: list[str] = []
    for line in text.splitlines():
        if line.startswith("#"):
            out.append(line)
            continue
        m = _LINE.match(line)
        assert m, line
        name, labels, value = m["name"], m["labels"] or "", m["value"]
        labels = re.sub(r'(instance|url)="127\.0\.0\.1:\d+', r'\1="127.0.0.1:<port>', labels)
        labels = re.sub(r'python="[^"]*"', 'python="<python>"', labels)
        base = re.sub(r"_(bucket|count|sum|created)$", "", name)
        if name.endswith("_created") or base in VOLATILE or name in VOLATILE:
            value = "0" if float(value) == 0 else "<positive>"
        out.append(f"{name}{labels} {value}")
    return "\n".join(out) + "\n"


def test_whole_agent_exposition_matches_the_golden_file(engines: dict[str, int]) -> None:
    text = render_agent(engines)
    if shutil.which("promtool") is not None:
        lint = subprocess.run(
            ["promtool", "check", "metrics"], input=text, capture_output=True, text=True,
            check=False,
        )  # fmt: skip
        assert lint.returncode == 0, lint.stdout + lint.stderr
    got = normalise(text)
    if UPDATE:
        GOLDEN.write_text(got)
    assert GOLDEN.exists(), "no golden file: run with KVPRESSURE_UPDATE_GOLDEN=1"
    want = GOLDEN.read_text()
    assert got == want, "exposition differs from tests/fixtures/golden/e2e-output.txt"


def test_normalisation_keeps_what_does_not_vary() -> None:
    text = (
        'kvpressure_engine_up{engine="vllm",instance="127.0.0.1:41234"} 1.0\n'
        'kvpressure_sampler_duration_seconds{sampler="gpu"} 0.0123\n'
        'kvpressure_gpu_pcie_bytes_total{direction="tx",gpu="0"} 0.0\n'
        'kvpressure_build_info{python="3.11.9",version="0.1.0"} 1.0\n'
    )
    assert normalise(text).splitlines() == [
        'kvpressure_engine_up{engine="vllm",instance="127.0.0.1:<port>"} 1.0',
        'kvpressure_sampler_duration_seconds{sampler="gpu"} <positive>',
        'kvpressure_gpu_pcie_bytes_total{direction="tx",gpu="0"} 0',
        'kvpressure_build_info{python="<python>",version="0.1.0"} 1.0',
    ]


def test_the_agents_timeline_holds_only_what_its_stages_read(
    engines: dict[str, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 15: the engines' latency histograms (and every other series no stage reads
    back) are exported but not kept in the timeline; each stage reads only what it declared.
    """
    monkeypatch.setattr(daemon_module, "Timeline", Spy)
    with run_agent(engines) as (daemon, stages):
        tl = daemon.state.timeline
        assert isinstance(tl, Spy)
        exported = {s.name for m in daemon.registry.collect() for s in m.samples}
        held = tl.names()
        declared = pipeline.timeline_reads(daemon.config)
        assert held <= declared, sorted(held - declared)
        hist = "kvpressure_engine_request_latency_seconds_bucket"
        assert hist in exported and hist not in held
        for name in ("kvpressure_engine_kv_cache_usage_ratio", "kvpressure_engine_up",
                     "kvpressure_engine_requests_running", "kvpressure_psi_stall_seconds_total",
                     "kvpressure_gpu_memory_used_bytes"):  # fmt: skip
            assert name in held, name
        readers = [r for r in stages.runners if r.sampler.timeline_reads]
        assert {r.sampler.name for r in readers} == {"attribution", "capacity"}
        for r in readers:  # each stage alone, on the timeline the ticks filled
            tl.asked.clear()
            report = r.collect_once()
            assert report.ok, (r.sampler.name, report.reason)
            assert tl.asked, r.sampler.name
            assert tl.asked <= r.sampler.timeline_reads, (
                r.sampler.name, sorted(tl.asked - r.sampler.timeline_reads))  # fmt: skip


def test_engine_metrics_come_only_from_the_engine_samplers(engines: dict[str, int]) -> None:
    """The accelerator reads the engines' metrics from the engine samplers' reports alone
    (``ENGINE_SAMPLERS``): the whole agent's reports, engines and GPU included, give it the
    same answer as a read of every report, and no other sampler publishes those names."""
    with run_agent(engines) as (daemon, _):
        state = daemon.state
        names = accelerator._VIEWED
        assert state.latest_many(names, samplers=ENGINE_SAMPLERS) == state.latest_many(names)
        assert state.latest_many(names)["kvpressure_engine_requests_running"]
        others = {
            s.name
            for r in state.reports()
            if r.batch is not None and not r.sampler.startswith(ENGINE_SAMPLERS)
            for s in r.batch.samples
        }
        assert others, "the GPU, host and derived stages published"
        assert not others & set(names), sorted(others & set(names))
