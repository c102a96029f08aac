"""Helpers for the end-to-end tests: real llama.cpp server, agent subprocess, scraping.

Imported by ``conftest.py`` and the test modules as ``e2e_support`` (pytest's default
import mode puts this directory on ``sys.path``; the name is unique so it cannot clash).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT / "scripts"))
from llamacpp_check import exit_reason  # noqa: E402  (scripts/: the build check's own wording)

E2E_REQUIRED = os.environ.get("KVPRESSURE_E2E_REQUIRED") == "1"
CACHE = Path(os.environ.get("KVPRESSURE_CACHE", Path.home() / ".cache" / "kvpressure"))
DEFAULT_MODEL = CACHE / "models" / "gemma-3-270m-q4_k_m.gguf"
DEFAULT_SERVER = CACHE / "bin" / "llama-server"

# The llama.cpp server shape the issue specifies: 4 slots sharing a 2048-token context.
LLAMA_CTX = 2048
LLAMA_SLOTS = 4
AGENT_INTERVAL_S = 0.5

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def unavailable(msg: str) -> None:
    """Skip, or fail when the e2e run is required (CI)."""
    if E2E_REQUIRED:
        pytest.fail(f"{msg} (KVPRESSURE_E2E_REQUIRED=1)", pytrace=False)
    pytest.skip(msg)


def free_port() -> int:
    """A currently free TCP port on 127.0.0.1."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def tail(path: Path, n: int = 40) -> str:
    """The last ``n`` lines of a log file, for failure messages."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return "<no log>"
    return "\n".join(lines[-n:])


def log_tail_line(path: Path, n: int = 4) -> str:
    """The last ``n`` non-empty lines of a log joined by `` | ``: a one-line failure reason."""
    lines = [ln.strip() for ln in tail(path, 200).splitlines() if ln.strip()]
    return " | ".join(lines[-n:]) or "<empty log>"


class EngineStartError(RuntimeError):
    """An engine the tests need could not start; the message says why in one line.

    Reported once per session (tests/conftest.py): later tests that need the same engine are
    skipped with a pointer to the first report instead of repeating it.
    """

    reported_once = True

    def __init__(self, message: str, key: str) -> None:
        super().__init__(message)
        self.key = key  # the same cause twice has the same key (no port, no run-specific text)


def wait_http_ok(
    url: str, timeout_s: float, proc: subprocess.Popen[bytes] | None = None, every_s: float = 0.1
) -> float:
    """Poll ``url`` until it answers 200; returns seconds waited.

    Raises:
        RuntimeError: ``proc`` exited first.
        TimeoutError: no 200 within ``timeout_s``.
    """
    t0 = time.monotonic()
    deadline = t0 + timeout_s
    last: str = ""
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process {exit_reason(proc.returncode)} before {url} answered")
        try:
            r = httpx.get(url, timeout=1.0)
            if r.status_code == 200:
                return time.monotonic() - t0
            last = f"HTTP {r.status_code}"
        except httpx.HTTPError as e:
            last = type(e).__name__
        time.sleep(every_s)
    raise TimeoutError(f"{url} not ready after {timeout_s} s (last: {last})")


SETPRIV = shutil.which("setpriv")
"""util-linux's ``setpriv`` (essential on Debian), or ``None``."""


def die_with_parent(argv: list[str]) -> list[str]:
    """``argv`` run so that it gets SIGKILL when the process that starts it exits.

    Prefixes ``setpriv --pdeathsig KILL --`` (``prctl(PR_SET_PDEATHSIG)``, which survives the
    ``exec`` of anything but a set-user-ID program; the PID stays the server's). Without it
    a run killed by ``timeout`` or SIGKILL, whose cleanup never ran, left its llama-server,
    vLLM or agent (each in its own session) idle for hours, holding ports, memory and a
    share of the CPU that later runs measured. ``argv`` unchanged where there is no
    ``setpriv``. Linux sends the signal when the starting *thread* exits: start servers from
    the main thread. (Not a ``preexec_fn``: that is unsafe in a process with threads.)
    """
    return [SETPRIV, "--pdeathsig", "KILL", "--", *argv] if SETPRIV else list(argv)


def exit_on_sigterm() -> None:
    """Make SIGTERM (``timeout``'s default, systemd's stop) raise ``SystemExit(143)``.

    Python's default action for SIGTERM ends the process without running ``finally`` or
    ``atexit``, so a benchmark stopped that way never stopped its servers or its fault
    injectors. Call it once, from the main thread.
    """

    def _raise(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _raise)


def stop_process(
    proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM, grace_s: float = 5.0
) -> float:
    """Send ``sig`` and wait; SIGKILL after ``grace_s``. Returns seconds until it exited."""
    if proc.poll() is not None:
        return 0.0
    t0 = time.monotonic()
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(sig)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        proc.wait(timeout=5)
    return time.monotonic() - t0


# --- llama.cpp ------------------------------------------------------------------------------


@dataclass(frozen=True)
class LlamaAssets:
    """Where the llama-server binary and the GGUF model are."""

    server: Path
    model: Path


def find_llama_assets() -> tuple[LlamaAssets | None, str]:
    """The llama-server and model from the environment, else from the default cache.

    ``scripts/ensure-llamacpp`` prints ``KVPRESSURE_LLAMA_SERVER`` / ``KVPRESSURE_MODEL`` and
    links the build it proved by a real inference as ``$CACHE/bin/llama-server``.

    Returns:
        ``(assets, "")``, or ``(None, why)`` with a hint when either file is missing.
    """
    server_env = os.environ.get("KVPRESSURE_LLAMA_SERVER")
    model_env = os.environ.get("KVPRESSURE_MODEL")
    server = Path(server_env) if server_env else DEFAULT_SERVER
    model = Path(model_env) if model_env else DEFAULT_MODEL
    hint = "run `scripts/ensure-llamacpp .venv` (builds llama-server once, ~8 min on 2 cores)"
    if not server.is_file():
        return None, f"llama-server not found at {server}; {hint}"
    if not model.is_file():
        return None, f"model not found at {model}; {hint}"
    return LlamaAssets(server, model), ""


class LlamaServer:
    """A real llama-server on a fixed loopback port, restartable on the same port."""

    def __init__(self, assets: LlamaAssets, port: int, workdir: Path) -> None:
        self.assets = assets
        self.port = port
        self.log = workdir / "llama-server.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def instance(self) -> str:
        return f"127.0.0.1:{self.port}"

    def argv(self) -> list[str]:
        return [
            str(self.assets.server),
            "-m",
            str(self.assets.model),
            "--metrics",
            "-c",
            str(LLAMA_CTX),
            "-np",
            str(LLAMA_SLOTS),
            "-t",
            "2",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
        ]

    def start(self, timeout_s: float = 90.0) -> float:
        """Start and wait for /health; returns seconds to ready.

        Raises:
            EngineStartError: the server died or never answered; one line with the signal
                (a build for instructions this CPU cannot run dies with SIGILL) and the log's
                last lines. A crash is not retried; a start that fails otherwise (the port
                briefly unavailable right after a kill) is tried three times.
        """
        assert self.proc is None or self.proc.poll() is not None, "already running"
        why = ""
        for _attempt in range(3):
            self.starts += 1
            with self.log.open("ab") as f:
                f.write(f"\n=== start #{self.starts}: {' '.join(self.argv())}\n".encode())
                f.flush()
                self.proc = subprocess.Popen(
                    die_with_parent(self.argv()),
                    stdin=subprocess.DEVNULL,
                    stdout=f,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            try:
                return wait_http_ok(f"{self.url}/health", timeout_s, self.proc)
            except (RuntimeError, TimeoutError) as e:
                rc = self.proc.poll()
                why = f"{exit_reason(rc)} before /health answered" if rc is not None else str(e)
                stop_process(self.proc, signal.SIGKILL)
                if rc is not None and rc < 0:  # a crash: starting again would crash again
                    break
                time.sleep(1.0)
        raise EngineStartError(
            f"llama-server ({self.assets.server}) did not start: {why}; "
            f"last log lines: {log_tail_line(self.log)}",
            key=f"{self.assets.server}: {why}",
        )

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        if self.proc is not None:
            stop_process(self.proc, signal.SIGKILL)

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc, signal.SIGTERM)

    def restart(self) -> float:
        """Stop if running, start again on the same port; returns seconds to ready."""
        self.stop()
        return self.start()

    def ensure_running(self) -> None:
        if not self.running():
            self.start()

    def get_json(self, path: str, timeout_s: float = 10.0) -> Any:
        r = httpx.get(f"{self.url}{path}", timeout=timeout_s)
        r.raise_for_status()
        return r.json()

    def complete(self, prompt: str, n_predict: int, timeout_s: float = 120.0) -> dict[str, Any]:
        """POST /completion (non-streaming); returns the JSON answer."""
        r = httpx.post(
            f"{self.url}/completion",
            json={
                "prompt": prompt,
                "n_predict": n_predict,
                "ignore_eos": True,
                "cache_prompt": False,
                "temperature": 0.8,
                "seed": 1,
            },
            timeout=timeout_s,
        )
        r.raise_for_status()
        return dict(r.json())

    def n_tokens(self, text: str) -> int:
        r = httpx.post(f"{self.url}/tokenize", json={"content": text}, timeout=30)
        r.raise_for_status()
        return len(r.json()["tokens"])


def agent_argv(config: Path) -> list[str]:
    """`kvpressure run --config FILE`, via the venv's console script when it exists."""
    script = Path(sys.executable).parent / "kvpressure"
    if script.is_file():
        return [str(script), "run", "--config", str(config)]
    return [
        sys.executable,
        "-c",
        "import sys; from kvpressure.agent.cli import main; sys.exit(main())",
        "run",
        "--config",
        str(config),
    ]


def parse_exposition(text: str) -> Samples:
    """Prometheus text exposition -> {(sample name, frozenset(labels)): value}."""
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = float(s.value)
    return out


def find(samples: Samples, name: str, **labels: str) -> list[tuple[dict[str, str], float]]:
    """All samples named ``name`` whose labels include ``labels``."""
    want = set(labels.items())
    return [(dict(ls), v) for (n, ls), v in samples.items() if n == name and want <= ls]


def value(samples: Samples, name: str, **labels: str) -> float | None:
    """The single value of ``name`` matching ``labels``; None when absent.

    Raises:
        AssertionError: more than one sample matches.
    """
    hits = find(samples, name, **labels)
    assert len(hits) <= 1, f"{name}{labels} is ambiguous: {hits}"
    return hits[0][1] if hits else None


@dataclass
class Agent:
    """A `kvpressure run` subprocess with its config, logs and /metrics scraper."""

    config: Path
    port: int
    stderr: Path
    proc: subprocess.Popen[bytes] | None = None
    client: httpx.Client = field(default_factory=lambda: httpx.Client(timeout=5.0))

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 30.0) -> float:
        with self.stderr.open("ab") as err, (self.stderr.with_suffix(".stdout")).open("ab") as out:
            self.proc = subprocess.Popen(
                agent_argv(self.config),
                cwd=REPO_ROOT,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                start_new_session=True,
            )
        try:
            return wait_http_ok(f"{self.url}/healthz", timeout_s, self.proc)
        except (RuntimeError, TimeoutError) as e:
            self.stop()
            raise RuntimeError(f"agent did not start: {e}\nstderr:\n{tail(self.stderr)}") from e

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, sig: int = signal.SIGTERM) -> float:
        """Signal the agent and wait; returns seconds until it exited."""
        self.client.close()
        if self.proc is None:
            return 0.0
        return stop_process(self.proc, sig)

    def metrics_text(self, accept: str | None = None) -> str:
        headers = {"Accept": accept} if accept else {}
        r = self.client.get(f"{self.url}/metrics", headers=headers)
        r.raise_for_status()
        return r.text

    def scrape(self) -> Samples:
        """GET /metrics (text format) and parse it."""
        return parse_exposition(self.metrics_text())

    def snapshot(self) -> Any:
        r = self.client.get(f"{self.url}/api/v1/snapshot")
        r.raise_for_status()
        return r.json()


def write_agent_config(path: Path, listen_port: int, engines: list[dict[str, str]]) -> Path:
    config = {
        "listen": f"127.0.0.1:{listen_port}",
        "interval_s": AGENT_INTERVAL_S,
        "samplers": {"host": {"enabled": True}, "gpu": {"enabled": False}},
        "discovery": {"enabled": False},
        "engines": engines,
    }
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path
