"""Fixtures for the real-vLLM end-to-end test: a vLLM CPU server, the agent, a poller.

Helpers live in ``vllm_support.py`` (a unique module name, so pytest's default import mode
cannot confuse it with another directory's conftest). See that module for where the vLLM
virtualenv and the model come from, and when the test skips or fails.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from vllm_support import (
    AGENT_INTERVAL_S,
    REPO_ROOT,
    REPORT,
    SERVER_READY_S,
    Agent,
    Poller,
    VllmServer,
    find_assets,
    free_port,
    server_argv,
    server_env,
    stop_group,
    unavailable,
    wait_ok,
)


@pytest.fixture(scope="module")
def vllm_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    assets, why = find_assets()
    if assets is None:
        unavailable(why)
    assert assets is not None
    d = tmp_path_factory.mktemp("vllm")
    port = free_port()
    argv = server_argv(assets, port)
    log = d / "vllm.log"
    env = server_env()
    with log.open("wb") as out:
        proc = subprocess.Popen(
            argv, stdout=out, stderr=subprocess.STDOUT, cwd=d, env=env, start_new_session=True
        )
    url = f"http://127.0.0.1:{port}"
    try:
        start_s = wait_ok(url + "/health", SERVER_READY_S, proc, log)
        REPORT["vllm_server_start_s"] = round(start_s, 1)
        yield VllmServer(url, proc, log, start_s)
    finally:
        stop_group(proc)


@pytest.fixture(scope="module")
def agent(vllm_server: VllmServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Agent]:
    d = tmp_path_factory.mktemp("agent")
    port = free_port()
    cfg = {
        "listen": f"127.0.0.1:{port}",
        "interval_s": AGENT_INTERVAL_S,
        "samplers": {"host": {"enabled": False}, "gpu": {"enabled": False}},
        "discovery": {"enabled": False},
        "engines": [{"name": "vllm", "type": "vllm", "url": vllm_server.url}],
    }
    path = d / "kvpressure.yaml"
    path.write_text(yaml.safe_dump(cfg))
    log = d / "kvpressure.agent.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvpressure.agent.cli", "run", "--config", str(path)],
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=REPO_ROOT,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ok(url + "/healthz", 30.0, proc, log)
        yield Agent(url, proc, log)
    finally:
        stop_group(proc, grace_s=5.0)


@pytest.fixture
def poller(agent: Agent) -> Iterator[Poller]:
    p = Poller(agent.url)
    p.start()
    try:
        yield p
    finally:
        p.stop()


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """Show the real-vLLM observed values (before pytest's closing line), even under -q."""
    if not REPORT:
        return
    terminalreporter.section("kvpressure real vLLM observed values")
    terminalreporter.write_line(json.dumps(REPORT, sort_keys=True, default=str))
    path = os.environ.get("KVPRESSURE_VLLM_REPORT")
    if path:
        Path(path).write_text(json.dumps(REPORT, indent=2, sort_keys=True, default=str) + "\n")
        terminalreporter.write_line(f"(written to {path})")
