"""A benchmark or test run that is killed takes its servers with it (tests/e2e/e2e_support.py).

Real processes, no engine: a parent Python process starts a long ``sleep`` the way the
attribution benchmarks start llama-server, vLLM and the agent (its own session, argv wrapped
by ``die_with_parent``), then the parent is killed; the sleep must be gone. And SIGTERM, the
way ``timeout`` stops a run, must run the parent's ``finally`` (its cleanup).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from e2e_support import SETPRIV, die_with_parent

HERE = Path(__file__).resolve().parent

STARTER = """
import subprocess, sys, time
sys.path.insert(0, {here!r})
from e2e_support import die_with_parent, exit_on_sigterm
exit_on_sigterm()
p = subprocess.Popen(die_with_parent(["sleep", "300"]), start_new_session=True)
print(p.pid, flush=True)
try:
    time.sleep(300)
finally:
    print("cleanup", flush=True)
"""


def _alive(pid: int) -> bool:
    """``pid`` exists and is not a zombie (an orphan is reaped by init, or lingers as one)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state != "Z"


def _start() -> tuple[subprocess.Popen[str], int]:
    parent = subprocess.Popen(
        [sys.executable, "-c", STARTER.format(here=str(HERE))],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    assert _alive(child)
    return parent, child


def _gone_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.05)
    return False


@pytest.mark.skipif(SETPRIV is None, reason="no setpriv (util-linux) on this machine")
def test_a_server_dies_when_its_killed_starter_does() -> None:
    parent, child = _start()
    try:
        parent.kill()  # SIGKILL: no cleanup of the starter's runs
        parent.wait(timeout=10)
        assert _gone_within(child, 10), f"the server {child} outlived its killed starter"
    finally:
        if _alive(child):
            os.kill(child, signal.SIGKILL)


def test_sigterm_runs_the_starters_cleanup() -> None:
    parent, child = _start()
    try:
        parent.terminate()
        out, _ = parent.communicate(timeout=10)
        assert "cleanup" in out
        assert parent.returncode == 128 + signal.SIGTERM
    finally:
        if _alive(child):
            os.kill(child, signal.SIGKILL)


def test_without_setpriv_the_argv_is_unchanged(monkeypatch: pytest.MonkeyPatch) -> None:
    import e2e_support

    monkeypatch.setattr(e2e_support, "SETPRIV", None)
    assert e2e_support.die_with_parent(["a", "b"]) == ["a", "b"]
    assert die_with_parent is e2e_support.die_with_parent
