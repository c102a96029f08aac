"""A bearer token for the OTLP receiver (issue 18, point 5): ``otlp_receiver.bearer_token_file``.

The real agent (:class:`agent.daemon.Daemon`) on 127.0.0.1 and httpx as the exporter: no
token or a wrong one is a 401 before the body is read, the right one is a 200 with the span
recorded, a reload changes the token, and with web-config basic auth on the listener the
receiver still takes the bearer token (an exporter cannot send both) while ``/metrics``
keeps asking for the password.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import bcrypt
import httpx
import pytest

from kvpressure.agent.config import ConfigError, load, read_token
from kvpressure.agent.daemon import Daemon
from tests.test_otlp_receiver import PB, capture_span, counters, export

QUIET = (
    "samplers: {host: {enabled: false}, engines: {enabled: false}, gpu: {enabled: false}, "
    "capacity: {enabled: false}}\ndiscovery: {enabled: false}\nattribution: {enabled: false}\n"
)
TOKEN = "0123456789abcdef-otlp-token"


@pytest.fixture
def start_agent(
    run_daemon: Callable[[Daemon], asyncio.AbstractEventLoop],
) -> Callable[[Path], tuple[Daemon, asyncio.AbstractEventLoop]]:
    def start(config: Path) -> tuple[Daemon, asyncio.AbstractEventLoop]:
        d = Daemon(load(config), config_path=config)
        return d, run_daemon(d)

    return start


def _post(port: int, token: str | None, **kw: object) -> httpx.Response:
    headers = {"Content-Type": PB}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    body = export(capture_span()).SerializeToString()
    return httpx.post(
        f"http://127.0.0.1:{port}/v1/traces", content=body, headers=headers, timeout=5, **kw
    )


def test_bearer_token_is_required_by_the_agents_receiver(tmp_path: Path, start_agent) -> None:
    (tmp_path / "token").write_text(f"{TOKEN}\n")  # a trailing newline, as editors write
    config = tmp_path / "kvpressure.yaml"
    config.write_text(
        f"listen: '127.0.0.1:0'\notlp_receiver: {{bearer_token_file: '{tmp_path}/token'}}\n" + QUIET
    )
    d, loop = start_agent(config)
    port = d.bound_port
    assert port is not None

    missing = _post(port, None)
    assert missing.status_code == 401
    assert missing.headers["WWW-Authenticate"].startswith("Bearer")
    assert _post(port, "wrong").status_code == 401
    assert _post(port, TOKEN[:-1]).status_code == 401  # a prefix is not the token
    basic = httpx.post(
        f"http://127.0.0.1:{port}/v1/traces",
        content=b"x",
        headers={"Content-Type": PB},
        auth=("user", TOKEN),
        timeout=5,
    )
    assert basic.status_code == 401
    assert _post(port, TOKEN).status_code == 200
    c = counters(d.otlp_receiver)
    assert c[("kvpressure_otlp_requests_total", "unauthorized")] == 4
    assert c[("kvpressure_otlp_requests_total", "ok")] == 1
    assert c[("kvpressure_otlp_spans_received_total", "record")] == 1  # only the good export

    # A reload reads the token file again: the old token stops working.
    (tmp_path / "token").write_text("a-new-token")
    assert asyncio.run_coroutine_threadsafe(d.reload_async(), loop).result(10)
    assert _post(port, TOKEN).status_code == 401
    assert _post(port, "a-new-token").status_code == 200
    # An empty token file is an invalid reload: the last token stays in force.
    (tmp_path / "token").write_text("\n")
    assert not asyncio.run_coroutine_threadsafe(d.reload_async(), loop).result(10)
    assert _post(port, "a-new-token").status_code == 200


def test_bearer_token_with_basic_auth_on_the_listener(tmp_path: Path, start_agent) -> None:
    password = "scrape-password"
    hashed = bcrypt.hashpw(password.encode(), bcrypt.gensalt(rounds=4)).decode()
    (tmp_path / "web.yml").write_text(f"basic_auth_users:\n  prometheus: '{hashed}'\n")
    (tmp_path / "token").write_text(TOKEN)
    config = tmp_path / "kvpressure.yaml"
    config.write_text(
        f"listen: '127.0.0.1:0'\nweb_config_file: '{tmp_path}/web.yml'\n"
        f"otlp_receiver: {{bearer_token_file: '{tmp_path}/token'}}\n" + QUIET
    )
    d, loop = start_agent(config)
    port = d.bound_port
    assert port is not None
    assert _post(port, TOKEN).status_code == 200
    assert _post(port, None).status_code == 401
    metrics = f"http://127.0.0.1:{port}/metrics"
    assert httpx.get(metrics, timeout=5).status_code == 401
    assert httpx.get(metrics, headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 401
    assert httpx.get(metrics, auth=("prometheus", password), timeout=5).status_code == 200

    # Without a token the receiver is behind basic auth like every other path.
    config.write_text(f"listen: '127.0.0.1:0'\nweb_config_file: '{tmp_path}/web.yml'\n" + QUIET)
    assert asyncio.run_coroutine_threadsafe(d.reload_async(), loop).result(10)
    assert _post(port, TOKEN).status_code == 401
    assert _post(port, None, auth=("prometheus", password)).status_code == 200


@pytest.mark.parametrize(
    ("content", "error"),
    [("", "empty"), ("  \n", "empty"), ("two words", "whitespace"), ("x" * 5000, "larger")],
)
def test_bad_token_files_are_config_errors(tmp_path: Path, content: str, error: str) -> None:
    path = tmp_path / "token"
    path.write_text(content)
    with pytest.raises(ConfigError, match=error):
        read_token(path)
    with pytest.raises(ConfigError, match="a directory"):
        read_token(tmp_path)


def test_check_config_and_run_refuse_an_unreadable_token_file(tmp_path: Path) -> None:
    import subprocess
    import sys

    config = tmp_path / "kvpressure.yaml"
    config.write_text(
        f"listen: '127.0.0.1:0'\notlp_receiver: {{bearer_token_file: '{tmp_path}/absent'}}\n"
        + QUIET
    )
    for command in (["check-config", str(config)], ["run", "--config", str(config)]):
        res = subprocess.run(
            [sys.executable, "-m", "kvpressure.agent.cli", *command],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert res.returncode == 1, (command, res.stderr)
        assert "absent" in res.stderr and "Traceback" not in res.stderr, res.stderr
