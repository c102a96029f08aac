"""TLS and basic auth from a Prometheus exporter web-config file (issue 18, point 5).

Real certificates made with the ``openssl`` command, the agent on 127.0.0.1, and httpx as
the TLS client: server verification against the test CA, basic auth with bcrypt hashes, and
client certificates.
"""

from __future__ import annotations

import shutil
import ssl
import subprocess
import sys
from pathlib import Path

import bcrypt
import httpx
import pytest

from kvpressure.agent.config import ConfigError, parse
from kvpressure.agent.daemon import Daemon
from kvpressure.agent.webconfig import load_web_config

QUIET = (
    "samplers: {host: {enabled: false}, engines: {enabled: false}, gpu: {enabled: false}, "
    "capacity: {enabled: false}}\ndiscovery: {enabled: false}\nattribution: {enabled: false}\n"
)
PASSWORD = "s3cret-scrape"

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl")


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, all signed by it."""
    d = tmp_path_factory.mktemp("pki")
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out",
             "ca.crt", "-days", "2", "-subj", "/CN=kvpressure test CA", cwd=d)  # fmt: skip
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    for name, ext in (("server", ["-extfile", "san.ext"]), ("client", [])):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out",
                 f"{name}.csr", "-subj", f"/CN={name}", cwd=d)  # fmt: skip
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
                 "-CAcreateserial", "-out", f"{name}.crt", "-days", "2", *ext, cwd=d)  # fmt: skip
    return d


def _web_config(pki: Path, client_auth: str = "NoClientCert", users: bool = True) -> Path:
    hashed = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(rounds=4)).decode()
    hashed = "$2y$" + hashed[4:]  # as htpasswd writes it
    lines = [
        "tls_server_config:",
        "  cert_file: server.crt",  # relative to the web-config file
        "  key_file: server.key",
        f"  client_auth_type: {client_auth}",
        "  client_ca_file: ca.crt",
    ]
    if users:
        lines += ["basic_auth_users:", f"  prometheus: '{hashed}'"]
    path = pki / f"web-{client_auth}-{users}.yml"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture
def agent_with(pki: Path, run_daemon):
    def start(web: Path) -> int:
        d = Daemon(parse(f"listen: '127.0.0.1:0'\nweb_config_file: '{web}'\n{QUIET}"))
        run_daemon(d)
        assert d.bound_port is not None
        return d.bound_port

    return start


def test_tls_and_basic_auth_with_a_real_client(pki: Path, agent_with) -> None:
    port = agent_with(_web_config(pki))
    url = f"https://127.0.0.1:{port}/metrics"
    ca = ssl.create_default_context(cafile=str(pki / "ca.crt"))
    with httpx.Client(verify=ca, timeout=5) as c:
        assert c.get(url).status_code == 401
        r = c.get(url, auth=("prometheus", "wrong"))
        assert r.status_code == 401 and r.headers["WWW-Authenticate"].startswith("Basic")
        assert c.get(url, auth=("nobody", PASSWORD)).status_code == 401
        ok = c.get(url, auth=("prometheus", PASSWORD))
        assert ok.status_code == 200 and "kvpressure_build_info" in ok.text
        assert c.get(url, auth=("prometheus", PASSWORD)).status_code == 200  # cached check
        healthz = c.get(f"https://127.0.0.1:{port}/healthz", auth=("prometheus", PASSWORD))
        assert healthz.status_code == 200
    # plain HTTP on the TLS port gets no answer; a client that does not trust the CA fails
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=2)
    with pytest.raises(httpx.ConnectError):
        httpx.get(url, timeout=2)


def test_client_certificate_required(pki: Path, agent_with) -> None:
    port = agent_with(_web_config(pki, "RequireAndVerifyClientCert", users=False))
    url = f"https://127.0.0.1:{port}/metrics"
    anonymous = ssl.create_default_context(cafile=str(pki / "ca.crt"))
    with pytest.raises(httpx.HTTPError):
        httpx.get(url, verify=anonymous, timeout=5)
    with_cert = ssl.create_default_context(cafile=str(pki / "ca.crt"))
    with_cert.load_cert_chain(str(pki / "client.crt"), str(pki / "client.key"))
    assert httpx.get(url, verify=with_cert, timeout=5).status_code == 200


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("tls_server_config: {cert_file: nope.crt, key_file: nope.key}\n", "cannot load cert"),
        ("basic_auth_users: {p: plaintext}\n", "expected a bcrypt hash"),
        ("tls_server_config: {cert_file: a, key_file: b, cipher_suites: [x]}\n", "not supported"),
        (
            "tls_server_config: {cert_file: a, key_file: b, client_auth_type: RequireAnyClientCert}"
            "\n",
            "client_auth_type",
        ),
    ],
)
def test_bad_web_config_is_one_clear_error(tmp_path: Path, text: str, error: str) -> None:
    web = tmp_path / "web.yml"
    web.write_text(text)
    with pytest.raises(ConfigError, match=error):
        load_web_config(web)
    cfg = tmp_path / "k.yaml"
    cfg.write_text(f"web_config_file: '{web}'\n")
    proc = subprocess.run(
        [sys.executable, "-m", "kvpressure.agent.cli", "check-config", str(cfg)],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert error in proc.stderr
