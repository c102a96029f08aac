"""The PodMonitor's metricRelabelings, run by a real Prometheus (issue 16, gap b).

The Prometheus Operator gives every PodMonitor target ``namespace``, ``pod`` and
``container`` (its promcfg.go relabelings: the agent's own pod). An engine series carrying
its own pod's labels then arrives with them as ``exported_*``; the PodMonitor's
``metricRelabelings`` put them back. Here Prometheus scrapes a static exposition with the
target labels the operator would set and the PodMonitor's metricRelabelings translated to
``metric_relabel_configs`` field by field.
"""

from __future__ import annotations

import http.server
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from e2e_support import free_port
from test_prometheus_e2e import QUERY_TIMEOUT_S, Prometheus

pytestmark = pytest.mark.e2e

PODMONITOR = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes" / "podmonitor.yaml"
EXPOSITION = b"""\
# TYPE kvpressure_engine_requests_waiting gauge
kvpressure_engine_requests_waiting{container="vllm",engine="vllm",instance="127.0.0.1:8000",\
model="m",namespace="llm",pod="vllm-0",pod_uid="6f1c2b3a-4d5e-4f60-8a9b-0c1d2e3f4a5b"} 3
kvpressure_engine_requests_waiting{engine="llama",instance="127.0.0.1:8080",model="g"} 1
# TYPE kvpressure_sampler_up gauge
kvpressure_sampler_up{sampler="gpu"} 1
"""
TARGET_LABELS = {"namespace": "kvpressure", "pod": "kvpressure-x7k2p", "container": "kvpressure"}
FIELDS = {
    "sourceLabels": "source_labels",
    "separator": "separator",
    "targetLabel": "target_label",
    "regex": "regex",
    "modulus": "modulus",
    "replacement": "replacement",
    "action": "action",
}


def metric_relabel_configs() -> list[dict[str, Any]]:
    pm = yaml.safe_load(PODMONITOR.read_text(encoding="utf-8"))
    (ep,) = pm["spec"]["podMetricsEndpoints"]
    return [{FIELDS[k]: v for k, v in r.items()} for r in ep["metricRelabelings"]]


@pytest.fixture
def exposition() -> Iterator[str]:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(EXPOSITION)))
            self.end_headers()
            self.wfile.write(EXPOSITION)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_engine_pod_labels_replace_the_agent_pods(
    prometheus_bin: str, exposition: str, tmp_path: Path
) -> None:
    prom = Prometheus(prometheus_bin, tmp_path, exposition)
    prom.config.write_text(
        yaml.safe_dump(
            {
                "global": {"scrape_interval": "1s"},
                "scrape_configs": [
                    {
                        "job_name": "kvpressure",
                        "scrape_interval": "1s",
                        "scrape_timeout": "1s",
                        "static_configs": [{"targets": [exposition], "labels": TARGET_LABELS}],
                        "metric_relabel_configs": metric_relabel_configs(),
                    }
                ],
            }
        )
    )
    prom.start()
    try:
        deadline = time.monotonic() + QUERY_TIMEOUT_S
        got: list[dict[str, Any]] = []
        while len(got) < 3 and time.monotonic() < deadline:
            got = prom.query(
                '{__name__=~"kvpressure_engine_requests_waiting|kvpressure_sampler_up"}'
            )
            time.sleep(0.5)
    finally:
        prom.stop()
    by_engine = {r["metric"].get("engine", r["metric"]["__name__"]): r["metric"] for r in got}
    assert set(by_engine) == {"vllm", "llama", "kvpressure_sampler_up"}, got
    # the engine's pod, not the agent's; no exported_* left
    vllm = by_engine["vllm"]
    assert (vllm["namespace"], vllm["pod"], vllm["container"]) == ("llm", "vllm-0", "vllm")
    assert vllm["pod_uid"] == "6f1c2b3a-4d5e-4f60-8a9b-0c1d2e3f4a5b"
    assert not any(
        k.startswith("exported_") and k != "exported_instance" for r in got for k in r["metric"]
    )
    # series without pod labels keep the agent pod's
    for key in ("llama", "kvpressure_sampler_up"):
        m = by_engine[key]
        assert (m["namespace"], m["pod"], m["container"]) == tuple(TARGET_LABELS.values()), m
