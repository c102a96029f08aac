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
import re
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
    code = "import sys; from kvpressure.agent.cli import main; sys.exit(main())"
    return [sys.executable, "-c", code]


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
    cfg = tmp / "kvpressure.agent.yaml"
    cfg.write_text(yaml.safe_dump(config, sort_keys=False))
    agent = Agent(cfg, agent_port, tmp / "kvpressure.agent.log")
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
    # the shell tmux runs the command with writes top's own exit status to a file: tmux's
    # #{pane_dead_status} is read from its SIGCHLD handling and was seen empty for 10 s
    # after the pane died (CI), which says nothing about top
    exit_file = tmp_path / "top-exit"
    top = " ".join([*_kvpressure(), "top", "--url", world.agent.url, "--interval", "0.5"])
    cmd = f"{top}; echo $? > {exit_file}"
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
        # q quits: top exits with 0 and the terminal is restored
        _tmux("-S", sock, "send-keys", "-t", session, "q")
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not exit_file.exists():
            time.sleep(0.2)
        time.sleep(0.2)  # the shell's echo may still be writing
        status = exit_file.read_text().strip() if exit_file.exists() else None
        assert status == "0", f"top did not exit with 0 on q: exit status {status!r}"
    finally:
        subprocess.run(["tmux", "-S", sock, "kill-server"], capture_output=True, check=False)


def test_explain_text_leaves_failures_out_and_names_unknown_engines(world: World) -> None:
    r = subprocess.run(
        [*_kvpressure(), "explain", "--url", world.agent.url, "--since", "1h"],
        capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    (world.out / "explain.txt").write_text(r.stdout)
    assert "since the agent started (--since asked for 1.0h" in r.stdout.splitlines()[0]
    assert "failed left out: server_error 3" in r.stdout
    assert "1/s" not in r.stdout
    r = subprocess.run(
        [*_kvpressure(), "explain", "--url", world.agent.url, "--engine", "nosuch"],
        capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
    assert r.returncode == 2
    assert "knows no engine 'nosuch'; it knows: vllm" in r.stderr
    assert "Traceback" not in r.stderr


def _count_near(img: Any, rgb: tuple[int, int, int], tol: int = 12) -> int:
    return sum(
        n
        for n, px in img.getcolors(1 << 24)
        if all(abs(a - b) <= tol for a, b in zip(px, rgb, strict=True))
    )


def test_explain_html_is_self_contained_and_renders_in_headless_chromium(
    world: World, tmp_path: Path
) -> None:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        unavailable("chromium not installed (Debian: apt-get install -y chromium)")
    page = world.out / "explain.html"
    r = subprocess.run(
        [*_kvpressure(), "explain", "--url", world.agent.url, "--html", str(page)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert f"wrote {page}" in r.stdout
    text = page.read_text()
    assert text.startswith("<!DOCTYPE html>")
    assert "<script" not in text and "<link" not in text and "<img" not in text
    assert not re.search(r"""(?:src|href)\s*=\s*["']?(?:https?:|//)""", text)
    assert not re.search(r"url\(\s*['\"]?(?:https?:|//)", text)
    assert text.count("<svg") >= 3  # knee: TTFT and ITL; causes over time
    for part in ("Latency per KV-occupancy band", "Causes over time", "Slowest requests"):
        assert part in text
    assert "server_error 3" in text and "memory" in text

    png = world.out / "explain.png"
    png.unlink(missing_ok=True)
    cmd = [
        chromium, "--headless", "--no-sandbox", "--disable-gpu",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        "--no-first-run", f"--user-data-dir={tmp_path / 'profile'}", "--hide-scrollbars",
        "--window-size=1200,1800", f"--screenshot={png}", page.resolve().as_uri(),
    ]  # fmt: skip
    shot = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    assert png.is_file(), f"no screenshot (rc {shot.returncode}): {shot.stderr[-2000:]}"
    from PIL import Image

    with Image.open(png) as im:
        img = im.convert("RGB")
    assert img.size == (1200, 1800)
    colors = img.getcolors(1 << 24)
    assert colors is not None
    white = sum(n for n, px in colors if min(px) >= 250)
    assert white < 0.97 * img.size[0] * img.size[1], "the page rendered (almost) blank"
    assert len(colors) > 50  # text antialiasing and charts, not a flat fill
    # the charts were drawn: bars in the memory cause's red and the knee's TTFT p50 blue
    assert _count_near(img, (0xD6, 0x27, 0x28)) > 200
    assert _count_near(img, (0x1F, 0x77, 0xB4)) > 200
