import subprocess
import sys

import pytest

from kvpressure.agent import config as c


def test_embedded_default_is_valid_and_matches_model_defaults():
    cfg = c.load_default()
    assert cfg.listen == "127.0.0.1:9470"
    assert cfg.interval_s == 1.0
    assert cfg.discovery.enabled and cfg.discovery.ports == [8000, 8080, 30000, 3000, 8002]
    assert cfg.discovery.interval_s == 60
    assert cfg == c.Config()  # the YAML and the model agree


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("engines: [{url: foo}]", "f.yaml: engines[0].url: expected an http(s) URL"),
        ("engines: [{url: 'http://a:1', type: x}]", "f.yaml: engines[0].type: expected 'auto'"),
        ("interval_s: 0.01", "f.yaml: interval_s: expected greater than or equal to 0.1"),
        ("listen: nope", "f.yaml: listen: expected host:port"),
        ("samplers: {host: {enabld: true}}", "f.yaml: samplers.host.enabld: unknown setting"),
        ("interval_s: soon", "f.yaml: interval_s: expected a duration"),
        ("- a\n- b", "f.yaml: (top level): expected a mapping"),
        ("a: [", "f.yaml: line 1, column 5: invalid YAML"),
        (
            "engines: [{url: 'http://a:1'}, {url: 'http://b:2'}]",
            "engine name 'engine' is used twice",
        ),
        (
            "engines: [{url: 'http://a:1', cgroup: x, unit: y.service}]",
            "engines[0]: set cgroup or unit, not both",
        ),
    ],
)
def test_errors_name_file_field_and_expectation(text, expected):
    with pytest.raises(c.ConfigError) as ei:
        c.parse(text, "f.yaml")
    assert expected in str(ei.value)


def test_durations_and_engine_labels():
    cfg = c.parse(
        "interval_s: 250ms\n"
        "engines:\n"
        "  - {url: 'http://127.0.0.1:8000/', type: vllm}\n"
        "  - {url: 'http://10.0.0.5', name: big, unit: llama.service}\n"
    )
    assert cfg.interval_s == 0.25
    assert cfg.engines[0].label == "vllm"
    assert cfg.engines[0].instance == "127.0.0.1:8000"
    assert cfg.engines[0].url == "http://127.0.0.1:8000"
    assert cfg.engines[1].instance == "10.0.0.5:80"
    assert cfg.engines[1].label == "big"


def test_empty_file_means_defaults(tmp_path):
    p = tmp_path / "empty.yaml"
    p.write_text("")
    assert c.load(p) == c.Config()


def test_unreadable_file(tmp_path):
    with pytest.raises(c.ConfigError, match="cannot read"):
        c.load(tmp_path / "missing.yaml")


def _cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "kvpressure.agent.cli", *args],
        capture_output=True,
        text=True,
        check=False,
    )


def test_check_config_cli_exit_codes(tmp_path):
    good = tmp_path / "good.yaml"
    good.write_text("engines: [{url: 'http://127.0.0.1:8080', type: llamacpp}]\n")
    bad = tmp_path / "bad.yaml"
    bad.write_text("interval_s: -1\n")
    r = _cli("check-config", str(good))
    assert r.returncode == 0, r.stderr
    assert "ok" in r.stdout
    r = _cli("check-config", str(bad))
    assert r.returncode == 1
    assert f"{bad}: interval_s: expected greater than or equal to 0.1" in r.stderr


def test_default_config_cli_round_trips(tmp_path):
    r = _cli("default-config")
    assert r.returncode == 0
    p = tmp_path / "d.yaml"
    p.write_text(r.stdout)
    assert c.load(p) == c.Config()


# --- issue 17: a proxy cannot listen on the agent's own address ------------------------------


@pytest.mark.parametrize(
    "proxy_listen",
    ["127.0.0.1:9470", "localhost:9470", "0.0.0.0:9470", "[::]:9470"],
)
def test_check_config_rejects_a_proxy_on_the_agents_own_address(tmp_path, proxy_listen):
    cfg = tmp_path / "proxy.yaml"
    cfg.write_text(
        "listen: 127.0.0.1:9470\n"
        f"proxies: [{{listen: '{proxy_listen}', upstream: 'http://127.0.0.1:8080', "
        "engine: llamacpp}]\n"
    )
    r = _cli("check-config", str(cfg))
    assert r.returncode == 1, r.stdout
    assert "agent's own address" in r.stderr


def test_check_config_accepts_a_proxy_on_another_port(tmp_path):
    cfg = tmp_path / "proxy.yaml"
    cfg.write_text(
        "listen: 127.0.0.1:9470\n"
        "proxies: [{listen: '127.0.0.1:9471', upstream: 'http://127.0.0.1:8080', "
        "engine: llamacpp}, {listen: '0.0.0.0:9472', upstream: 'http://127.0.0.1:8081', "
        "engine: vllm}]\n"
    )
    r = _cli("check-config", str(cfg))
    assert r.returncode == 0, r.stderr


def test_a_deprecation_warning_at_start_is_a_logfmt_line(tmp_path):
    """The config is read before the daemon starts; what it warns about is logged as every
    other line is (README: logs are single logfmt lines on stderr), not as a bare message."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = tmp_path / "old.yaml"
    cfg.write_text(
        f"listen: 127.0.0.1:{port}\ndiscovery: {{enabled: false}}\nattribution: {{enabled: true}}\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvpressure.agent.cli", "run", "--config", str(cfg)],
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: list[str] = []
    try:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.append(line)
            if "kvpressure starting" in line:
                break
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    (warning,) = [line for line in lines if "deprecated" in line]
    assert warning.startswith("ts=") and " level=warning " in warning, warning
    assert 'msg="attribution.enabled is deprecated; use samplers.attribution.enabled"' in warning
