"""The operator's views tried as a user would: ``status``, ``top`` in a real terminal (tmux),
``explain`` and ``explain --html`` opened in headless Chromium.

One agent subprocess for the module: ``gpu.binding: fake:h200`` (recorded NVML behaviour),
a stand-in vLLM (``fake_vllm.py``: recorded vLLM ``/metrics``, SSE completions with a delay
the test chooses) scraped as engine ``vllm``, and the agent's proxy in front of it. The test
sends fast, slow and failing requests through the proxy, so the agent has real request
records, slow-request attributions and failures to show.

tmux and Chromium come from Debian (``scripts/test`` installs them); without them the
tests skip, or fail under ``KVPRESSURE_E2E_REQUIRED=1``. The captured screen and the
screenshot are kept under ``$KVPRESSURE_VIEWS_DIR`` (default: the test's tmp dir).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from e2e_support import REPO_ROOT, Agent, free_port, stop_process, unavailable, wait_http_ok

FIXTURE = REPO_ROOT / "tests/fixtures/engines/vllm/0.32.0-cpu-kv-metrics-load.txt"
SLO_TTFT_S = 0.5


def _kvpressure() -> list[str]:
    script = Path(sys.executable).parent / "kvpressure"
    if script.is_file():
        return [str(script)]
    return [sys.executable, "-c", "import sys; from agent.cli import main; sys.exit(main())"]


def _out_dir(tmp: Path) -> Path:
    d = Path(os.environ.get("KVPRESSURE_VIEWS_DIR", tmp))
    d.mkdir(parents=True, exist_ok=True)
    return d


class World:
    """The running agent, its stand-in engine and proxy."""

    def __init__(self, agent: Agent, proxy_url: str, engine_url: str, out: Path) -> None:
        self.agent = agent
        self.proxy_url = proxy_url
        self.engine_url = engine_url
        self.out = out

    def complete(self, **body: Any) -> int:
        r = httpx.post(
            f"{self.proxy_url}/v1/completions",
            json={"model": "tiny", "prompt": "hi", "stream": True, **body},
            timeout=30,
        )
        return r.status_code

    def attributions(self, since: str = "10m") -> Any:
        r = httpx.get(f"{self.agent.url}/api/v1/attributions", params={"since": since})
        r.raise_for_status()
        return r.json()


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    tmp = tmp_path_factory.mktemp("views")
    engine_port, proxy_port, agent_port = free_port(), free_port(), free_port()
    engine = subprocess.Popen(
        [sys.executable, str(Path(__file__).with_name("fake_vllm.py")), str(engine_port),
         str(FIXTURE)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=(tmp / "engine.log").open("wb"),
        start_new_session=True,
    )  # fmt: skip
    engine_url = f"http://127.0.0.1:{engine_port}"
    config = {
        "listen": f"127.0.0.1:{agent_port}",
        "interval_s": 0.5,
        "discovery": {"enabled": False},
        "gpu": {"binding": "fake:h200"},
        "engines": [{"name": "vllm", "type": "vllm", "url": engine_url}],
        "proxies": [
            {"listen": f"127.0.0.1:{proxy_port}", "upstream": engine_url, "engine": "vllm"}
        ],
        "attribution": {"slo_ttft_s": SLO_TTFT_S},
    }
    cfg = tmp / "agent.yaml"
    cfg.write_text(yaml.safe_dump(config, sort_keys=False))
    agent = Agent(cfg, agent_port, tmp / "agent.log")
    try:
        wait_http_ok(f"{engine_url}/metrics", 20, engine)
        agent.start()
        w = World(agent, f"http://127.0.0.1:{proxy_port}", engine_url, _out_dir(tmp))
        for i in range(12):
            assert w.complete(delay_s=0.02) == 200
            if i % 4 == 3:
                assert w.complete(delay_s=SLO_TTFT_S + 0.4) == 200  # slow: TTFT over the SLO
        for _ in range(3):
            assert w.complete(status=500) == 500  # failures: counted, not in the percentiles
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            doc = w.attributions()
            if doc.get("slow_by_cause", {}).get("vllm"):
                break
            time.sleep(0.5)
        else:
            pytest.fail(f"no slow request attributed within 30 s: {doc}")
        yield w
    finally:
        agent.stop()
        stop_process(engine)


def test_status_shows_the_fake_h200(world: World) -> None:
    r = subprocess.run(
        [*_kvpressure(), "status", "--url", world.agent.url],
        capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    (world.out / "status.txt").write_text(r.stdout)
    lines = r.stdout.splitlines()
    gpu = next(line for line in lines if line.startswith("0 ") and "NVIDIA H200" in line)
    assert "GiB" in gpu and "%" in gpu
    assert any(line.strip().startswith("pid 4242") for line in lines)
    assert next(line for line in lines if line.startswith("gpu ")).split()[1] == "up"
    assert next(line for line in lines if line.startswith("vllm ")).split()[2] == "1"


def _tmux(*args: str) -> str:
    r = subprocess.run(["tmux", *args], capture_output=True, text=True, timeout=10, check=False)
    if r.returncode != 0:
        raise RuntimeError(f"tmux {' '.join(args)}: {r.stderr.strip()}")
    return r.stdout


def _gpu_row(lines: list[str]) -> str | None:
    return next((x for x in lines if x.startswith("0 ") and "NVIDIA H200" in x), None)


def _ready(screen: str) -> bool:
    """Two refreshes done (stall shares need a previous frame) and slow requests shown."""
    lines = screen.splitlines()
    gpu = _gpu_row(lines)
    if gpu is None or not all(c.endswith("%") for c in gpu.split()[-3:]):
        return False
    at = next((i for i, x in enumerate(lines) if "SLOW REQUESTS, LAST MINUTE" in x), None)
    return at is not None and any(x.startswith("vllm ") for x in lines[at:])


def test_top_in_tmux_shows_engines_gpus_host_and_slow_requests_and_q_quits(
    world: World, tmp_path: Path
) -> None:
    if shutil.which("tmux") is None:
        unavailable("tmux not installed (Debian: apt-get install -y tmux)")
    session = f"kvp-top-{os.getpid()}"
    sock = str(tmp_path / "tmux.sock")
    cmd = " ".join([*_kvpressure(), "top", "--url", world.agent.url, "--interval", "0.5"])
    env = dict(os.environ, TERM="xterm-256color")
    subprocess.run(
        ["tmux", "-S", sock, "-f", "/dev/null", "new-session", "-d", "-s", session,
         "-x", "150", "-y", "45", cmd],
        env=env, check=True, timeout=10,
    )  # fmt: skip
    try:
        _tmux("-S", sock, "set-option", "-t", session, "remain-on-exit", "on")
        screen = ""
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            screen = _tmux("-S", sock, "capture-pane", "-p", "-t", session)
            if _ready(screen):
                break
            time.sleep(0.3)
        (world.out / "top-screen.txt").write_text(screen)
        lines = screen.splitlines()
        assert lines[0].startswith("kvpressure") and "top" in lines[0] and "(q quits)" in lines[0]
        eng = next(line for line in lines if line.startswith("vllm "))
        cells = eng.split()
        # vllm  127.0.0.1:PORT  UP  KV USED  KV TOKENS  RUN  WAIT  TTFT p50/p99  TPOT p50/p99
        assert cells[2] == "1" and cells[3] == "93.6%" and cells[5] == "6" and cells[6] == "9"
        assert cells[8].endswith("*")  # TTFT p99 from the request records of the last minute
        assert float(cells[8].rstrip("s*").removesuffix("m")) > 0
        gpu = _gpu_row(lines)
        assert gpu is not None and "GiB" in gpu
        assert all(c.endswith("%") for c in gpu.split()[-3:])  # stall shares, 2nd refresh on
        assert any("pid 4242 python3" in line for line in lines)
        assert any(line.startswith("HOST") and "memory available" in line for line in lines)
        assert any("psi avg10" in line for line in lines)
        slow_at = next(i for i, line in enumerate(lines) if "SLOW REQUESTS, LAST MINUTE" in line)
        slow_rows = [line for line in lines[slow_at:] if line.startswith("vllm ")]
        assert slow_rows, screen
        assert int(slow_rows[0].split()[2]) >= 1  # ENGINE CAUSE SLOW OF
        # q quits: the pane's process exits with 0 and the terminal is restored
        _tmux("-S", sock, "send-keys", "-t", session, "q")
        deadline = time.monotonic() + 10
        dead = ""
        while time.monotonic() < deadline:
            dead = _tmux("-S", sock, "display-message", "-p", "-t", session,
                         "#{pane_dead} #{pane_dead_status}").strip()  # fmt: skip
            if len(dead.split()) == 2:  # dead, with its exit status (set a moment later)
                break
            time.sleep(0.2)
        assert dead == "1 0", f"top did not exit on q: {dead!r}"
    finally:
        subprocess.run(["tmux", "-S", sock, "kill-server"], capture_output=True, check=False)
