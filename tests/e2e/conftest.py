"""Fixtures for the end-to-end tests: a real llama.cpp server, the agent, a real Prometheus.

Nothing here is mocked. The llama.cpp server and the model come from
``scripts/ensure-llamacpp`` (which builds llama-server once for a portable CPU profile, proves
it by generating tokens, and assembles the Gemma-3-270M GGUF); the fixtures find them through
the environment (``KVPRESSURE_LLAMA_SERVER``, ``KVPRESSURE_MODEL``) or, failing that, in the
default cache. A server that cannot start fails the first test that needs it with one line
(the signal, the log's last lines); the others are skipped pointing at it (tests/conftest.py).
When they are missing the tests skip with a hint, unless
``KVPRESSURE_E2E_REQUIRED=1`` (set by ``.ci/run``), in which case they fail.

All traffic is loopback; every wait is bounded.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from e2e_support import (
    REPO_ROOT,
    Agent,
    LlamaAssets,
    LlamaServer,
    find_llama_assets,
    free_port,
    unavailable,
    write_agent_config,
)


@pytest.fixture(scope="session")
def llama_assets() -> LlamaAssets:
    """The llama-server binary and model, or skip/fail with a hint."""
    assets, why = find_llama_assets()
    if assets is None:
        unavailable(why)
    assert assets is not None
    return assets


@pytest.fixture(scope="session")
def llama_server(
    llama_assets: LlamaAssets, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LlamaServer]:
    """A running llama-server (`--metrics -c 2048 -np 4 -t 2`) for the whole session."""
    server = LlamaServer(llama_assets, free_port(), tmp_path_factory.mktemp("llama"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


# --- the agent ------------------------------------------------------------------------------


def _require_agent_cli() -> None:
    if not (REPO_ROOT / "agent" / "cli.py").is_file():
        unavailable("agent/cli.py does not exist yet: `kvpressure run` cannot be started")


@pytest.fixture(scope="session")
def make_agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., Agent]]:
    """Factory: start an agent watching the given llama-server; all are stopped at the end."""
    _require_agent_cli()
    started: list[Agent] = []

    def _make(server: LlamaServer, name: str = "agent") -> Agent:
        d = tmp_path_factory.mktemp(name)
        port = free_port()
        cfg = write_agent_config(
            d / "kvpressure.yaml",
            port,
            [{"name": "llamacpp", "type": "llamacpp", "url": server.url}],
        )
        agent = Agent(config=cfg, port=port, stderr=d / "kvpressure.agent.stderr")
        started.append(agent)
        agent.start()
        return agent

    yield _make
    for a in started:
        a.stop()


@pytest.fixture(scope="session")
def agent(make_agent: Callable[..., Agent], llama_server: LlamaServer) -> Agent:
    """One agent (interval 0.5 s) watching the session's llama-server."""
    return make_agent(llama_server)


# --- observed values ------------------------------------------------------------------------


_REPORT: dict[str, Any] = {}


@pytest.fixture(scope="session")
def e2e_report(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """Observed values; written to $KVPRESSURE_E2E_REPORT (or the session's tmp dir)."""
    yield _REPORT
    path = Path(
        os.environ.get("KVPRESSURE_E2E_REPORT")
        or tmp_path_factory.getbasetemp() / "e2e-report.json"
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_REPORT, indent=2, sort_keys=True, default=str) + "\n")
    _REPORT["_written_to"] = str(path)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """Show the observed e2e values (before pytest's closing line), even under -q."""
    if not _REPORT:
        return
    brief = {k: v for k, v in _REPORT.items() if k != "_written_to"}
    # Long per-poll series stay in the JSON file only.
    for section, key in (("burst", "timeline"), ("formula_check", "agent_vs_slots")):
        if section in brief:
            brief[section] = {k: v for k, v in brief[section].items() if not k.startswith(key)}
    terminalreporter.section("kvpressure e2e observed values")
    terminalreporter.write_line(json.dumps(brief, sort_keys=True, default=str))
    if "_written_to" in _REPORT:
        terminalreporter.write_line(f"(full report: {_REPORT['_written_to']})")


@pytest.fixture(scope="session")
def promtool() -> str:
    path = shutil.which("promtool") or (
        "/usr/bin/promtool" if Path("/usr/bin/promtool").exists() else None
    )
    if path is None:
        unavailable("promtool not found (Debian package `prometheus`)")
    assert path is not None
    return path


@pytest.fixture(scope="session")
def prometheus_bin() -> str:
    path = shutil.which("prometheus") or (
        "/usr/bin/prometheus" if Path("/usr/bin/prometheus").exists() else None
    )
    if path is None:
        unavailable("prometheus server not found (Debian package `prometheus`)")
    assert path is not None
    return path
