"""A real Prometheus scrapes the agent; promtool lints the agent's exposition.

Prometheus (Debian package ``prometheus``) runs on a free loopback port with its own
temporary TSDB and scrapes the session's agent every second. The agent watches the
session's real llama.cpp server, so both host and engine series must arrive.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from e2e_support import Agent, LlamaServer, free_port, stop_process, tail, wait_http_ok

pytestmark = pytest.mark.e2e

QUERY_TIMEOUT_S = 30.0


class Prometheus:
    """A Prometheus server process with an HTTP API client."""

    def __init__(self, binary: str, workdir: Path, target: str) -> None:
        self.port = free_port()
        self.log = workdir / "prometheus.log"
        self.config = workdir / "prometheus.yml"
        self.config.write_text(
            yaml.safe_dump(
                {
                    "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                    "scrape_configs": [
                        {
                            "job_name": "kvpressure",
                            "scrape_interval": "1s",
                            "scrape_timeout": "1s",
                            "static_configs": [{"targets": [target]}],
                        }
                    ],
                },
                sort_keys=False,
            )
        )
        self.argv = [
            binary,
            f"--config.file={self.config}",
            f"--storage.tsdb.path={workdir / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{self.port}",
            "--storage.tsdb.retention.time=1h",
            "--log.level=warn",
        ]
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> float:
        with self.log.open("ab") as f:
            self.proc = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=f,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        try:
            return wait_http_ok(f"{self.url}/-/ready", 30, self.proc, 0.2)
        except (RuntimeError, TimeoutError) as e:
            self.stop()
            raise RuntimeError(f"prometheus did not start: {e}\n{tail(self.log)}") from e

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc)

    def api(self, path: str, **params: str) -> Any:
        r = httpx.get(f"{self.url}/api/v1/{path}", params=params, timeout=5)
        r.raise_for_status()
        body = r.json()
        assert body["status"] == "success", body
        return body["data"]

    def query(self, promql: str) -> list[dict[str, Any]]:
        return list(self.api("query", query=promql)["result"])


@pytest.fixture(scope="module")
def prometheus(
    prometheus_bin: str,
    agent: Agent,
    llama_server: LlamaServer,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Prometheus]:
    llama_server.ensure_running()  # an earlier test may have killed it
    prom = Prometheus(prometheus_bin, tmp_path_factory.mktemp("prometheus"), agent.url[7:])
    prom.start()
    try:
        yield prom
    finally:
        prom.stop()


def test_promtool_check_metrics_passes(
    promtool: str, agent: Agent, llama_server: LlamaServer, e2e_report: dict[str, Any]
) -> None:
    """`promtool check metrics` accepts the agent's text exposition, engine attached."""
    llama_server.ensure_running()
    deadline = time.monotonic() + 15
    text = agent.metrics_text()
    while 'kvpressure_engine_up{engine="llamacpp"' not in text and time.monotonic() < deadline:
        time.sleep(0.25)
        text = agent.metrics_text()
    r = subprocess.run(
        [promtool, "check", "metrics"],
        input=text,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    lint = (r.stdout + r.stderr).strip()
    families = sum(1 for line in text.splitlines() if line.startswith("# TYPE "))
    print(f"\n[e2e] promtool check metrics: rc={r.returncode}, {families} families, lint:\n{lint}")
    e2e_report["promtool"] = {"rc": r.returncode, "families": families, "output": lint}
    assert 'kvpressure_engine_up{engine="llamacpp"' in text
    assert r.returncode == 0, f"promtool check metrics failed:\n{lint}"


def test_prometheus_scrapes_host_and_engine_series(
    prometheus: Prometheus, agent: Agent, llama_server: LlamaServer, e2e_report: dict[str, Any]
) -> None:
    """Prometheus's HTTP API returns a host series and the llama.cpp engine series."""
    queries = {
        "host": "kvpressure_host_memory_total_bytes",
        "engine": 'kvpressure_engine_up{engine="llamacpp"}',
        "kv_capacity": 'kvpressure_engine_kv_cache_capacity_tokens{engine="llamacpp"}',
    }
    t0 = time.monotonic()
    found: dict[str, list[dict[str, Any]]] = {}
    while time.monotonic() - t0 < QUERY_TIMEOUT_S:
        for key, q in queries.items():
            if key not in found and (res := prometheus.query(q)):
                found[key] = res
        if len(found) == len(queries):
            break
        time.sleep(0.5)
    waited = time.monotonic() - t0
    targets = prometheus.api("targets")["activeTargets"]
    target_state = [
        {k: t.get(k) for k in ("scrapeUrl", "health", "lastError", "lastScrapeDuration")}
        for t in targets
    ]
    summary = {
        "waited_s": round(waited, 2),
        "targets": target_state,
        "results": {k: [(r["metric"], r["value"][1]) for r in v] for k, v in found.items()},
    }
    print(f"\n[e2e] prometheus: {summary}")
    e2e_report["prometheus"] = summary

    assert set(found) == set(queries), f"missing after {waited:.1f} s: {set(queries) - set(found)}"
    assert all(t["health"] == "up" for t in targets), target_state
    assert float(found["host"][0]["value"][1]) > 0
    engine = found["engine"]
    assert len(engine) == 1, engine
    # Prometheus's own target label `instance` wins by default (honor_labels: false), so the
    # agent's engine `instance` label arrives as `exported_instance`.
    labels = engine[0]["metric"]
    assert labels.get("exported_instance", labels["instance"]) == llama_server.instance
    assert engine[0]["value"][1] == "1"
    assert float(found["kv_capacity"][0]["value"][1]) == 2048
