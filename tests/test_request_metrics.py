"""Request-latency metrics: histograms and counters from records, and the daemon wiring
(proxy + OTLP receiver → RequestStream → ``requests`` sampler → /metrics) over real HTTP."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from kvpressure.agent.config import parse
from kvpressure.agent.daemon import Daemon
from kvpressure.agent.requests.metrics import LATENCY_BUCKETS_S, Histogram, RequestMetrics
from kvpressure.agent.requests.record import RequestRecord, RequestStream
from kvpressure.agent.samples import Batch
from kvpressure.agent.state import AgentState, SamplerReport
from kvpressure.agent.timeline import Timeline
from kvpressure.exporters.prometheus import make_registry, render


def rec(engine: str = "llamacpp", **kw: Any) -> RequestRecord:
    return RequestRecord(engine=engine, start=100.0, end=101.0, **kw)


def samples(b: Batch) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return {(s.name, frozenset(s.labels)): s.value for s in b}


def key(name: str, **labels: str) -> tuple[str, frozenset[tuple[str, str]]]:
    return (name, frozenset(labels.items()))


def test_histogram_buckets_are_cumulative_with_le_semantics() -> None:
    h = Histogram((0.1, 1.0))
    for v in (0.05, 0.1, 0.5, 1.0, 3.0, -1.0, float("nan"), float("inf")):
        h.observe(v)
    b = Batch()
    h.emit(b, "kvpressure_request_latency_seconds", phase="ttft")
    s = samples(b)
    with pytest.raises(KeyError):  # only catalogued histograms: a typo is not exported
        h.emit(Batch(), "x", phase="ttft")
    assert (
        s[key("kvpressure_request_latency_seconds_bucket", le="0.1", phase="ttft")] == 2
    )  # 0.05 and 0.1 (le is inclusive)
    assert s[key("kvpressure_request_latency_seconds_bucket", le="1.0", phase="ttft")] == 4
    assert s[key("kvpressure_request_latency_seconds_bucket", le="+Inf", phase="ttft")] == 5
    assert s[key("kvpressure_request_latency_seconds_count", phase="ttft")] == 5
    assert s[key("kvpressure_request_latency_seconds_sum", phase="ttft")] == pytest.approx(4.65)


def test_records_become_histograms_and_counters() -> None:
    stream = RequestStream()
    m = RequestMetrics(stream)
    stream.submit(
        rec(
            ttft_s=0.3,
            e2e_s=2.0,
            itl_s=(0.01, 0.02, 0.03),
            input_tokens=10,
            output_tokens=3,
            cached_tokens=4,
            upstream_connect_s=0.0004,
            prefill_s=0.2,
            decode_s=1.5,
        )
    )
    stream.submit(rec(outcome="kv_exhausted", e2e_s=5.0))
    stream.submit(rec(engine="vllm", source="otlp", queue_s=51.06, ttft_s=51.33, e2e_s=71.24))
    stream.submit(rec(outcome="weird"))
    b = Batch()
    m.collect(b)
    s = samples(b)
    L = "kvpressure_request_latency_seconds"
    assert s[key(L + "_count", engine="llamacpp", phase="itl")] == 3
    assert s[key(L + "_sum", engine="llamacpp", phase="itl")] == pytest.approx(0.06)
    assert s[key(L + "_bucket", engine="llamacpp", phase="itl", le="0.01")] == 1
    assert s[key(L + "_count", engine="llamacpp", phase="e2e")] == 2
    assert s[key(L + "_count", engine="llamacpp", phase="ttft")] == 1
    assert s[key(L + "_count", engine="llamacpp", phase="prefill")] == 1
    assert key(L + "_count", engine="llamacpp", phase="queue") not in s  # never observed
    assert s[key(L + "_bucket", engine="vllm", phase="queue", le="60.0")] == 1
    assert s[key(L + "_bucket", engine="vllm", phase="queue", le="30.0")] == 0
    assert s[key(L + "_count", engine="vllm", phase="e2e")] == 1
    R = "kvpressure_requests_total"
    assert s[key(R, engine="llamacpp", outcome="ok")] == 1
    assert s[key(R, engine="llamacpp", outcome="kv_exhausted")] == 1
    assert s[key(R, engine="llamacpp", outcome="other")] == 1
    assert s[key(R, engine="vllm", outcome="ok")] == 1
    T = "kvpressure_request_tokens_total"
    assert s[key(T, engine="llamacpp", direction="input")] == 10
    assert s[key(T, engine="llamacpp", direction="cached")] == 4
    C = "kvpressure_proxy_upstream_connect_seconds"
    assert s[key(C + "_count", engine="llamacpp")] == 1
    assert s[key("kvpressure_request_records_dropped_total", consumer="metrics")] == 0
    # Cumulative: a second cycle with no new records emits the same values.
    b2 = Batch()
    m.collect(b2)
    assert samples(b2) == s


def test_engine_label_set_is_capped_and_queue_overflow_counted() -> None:
    stream = RequestStream(capacity=5)
    m = RequestMetrics(stream, max_engines=2)
    for i in range(8):
        stream.submit(rec(engine=f"e{i}", e2e_s=1.0))
    b = Batch()
    m.collect(b)
    s = samples(b)
    engines = {dict(k[1])["engine"] for k in s if k[0] == "kvpressure_requests_total"}
    assert engines <= {"e3", "e4", "other"} and "other" in engines  # oldest 3 dropped
    assert s[key("kvpressure_request_records_dropped_total", consumer="metrics")] == 3


def test_exposition_is_a_valid_histogram_family() -> None:
    stream = RequestStream()
    m = RequestMetrics(stream)
    stream.submit(rec(ttft_s=0.3, e2e_s=2.0, itl_s=(0.01,), upstream_connect_s=0.001))
    b = Batch()
    m.collect(b)
    state = AgentState(Timeline(16, 1000))
    state.publish(SamplerReport("requests", time.time(), 0.0, True, "", b))
    text = render(make_registry(state), None)[0]
    fams = {f.name: f for f in text_string_to_metric_families(text.decode())}
    h = fams["kvpressure_request_latency_seconds"]
    assert h.type == "histogram"
    ttft = [x for x in h.samples if x.labels.get("phase") == "ttft"]
    assert len(ttft) == len(LATENCY_BUCKETS_S) + 1 + 2
    assert fams["kvpressure_requests"].type == "counter"
    if shutil.which("promtool"):
        r = subprocess.run(
            ["promtool", "check", "metrics"], input=text, capture_output=True, check=False
        )
        assert r.returncode == 0, r.stderr.decode()


# --- the daemon, end to end over HTTP -------------------------------------------------------


class _Upstream:
    """A tiny SSE engine on its own loop thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.port = 0
        ready = threading.Event()

        async def chat(request: web.Request) -> web.StreamResponse:
            await request.read()
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for i in range(3):
                await asyncio.sleep(0.03)
                ev = {"model": "m", "choices": [{"index": 0, "delta": {"content": f"t{i}"}}]}
                await resp.write(b"data: " + json.dumps(ev).encode() + b"\n\n")
            usage = {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 3}}
            await resp.write(b"data: " + json.dumps(usage).encode() + b"\n\ndata: [DONE]\n\n")
            await resp.write_eof()
            return resp

        def main() -> None:
            asyncio.set_event_loop(self.loop)
            app = web.Application()
            app.router.add_post("/v1/chat/completions", chat)
            runner = web.AppRunner(app, access_log=None)
            self.loop.run_until_complete(runner.setup())
            site = web.TCPSite(runner, "127.0.0.1", 0)
            self.loop.run_until_complete(site.start())
            self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
            ready.set()
            self.loop.run_forever()

        self.thread = threading.Thread(target=main, daemon=True)
        self.thread.start()
        assert ready.wait(5)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@pytest.fixture
def upstream() -> Iterator[_Upstream]:
    u = _Upstream()
    yield u
    u.stop()


def _run(d: Daemon) -> tuple[asyncio.AbstractEventLoop, threading.Thread]:
    loop = asyncio.new_event_loop()
    ready = threading.Event()

    def main() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(d.run(ready.set))

    t = threading.Thread(target=main, daemon=True)
    t.start()
    assert ready.wait(5)
    return loop, t


def _metric(base: str, name: str, **labels: str) -> float | None:
    text = httpx.get(base + "/metrics").text
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return float(s.value)
    return None


def _wait_metric(base: str, name: str, want: float, **labels: str) -> None:
    deadline = time.monotonic() + 5
    got = None
    while time.monotonic() < deadline:
        got = _metric(base, name, **labels)
        if got == want:
            return
        time.sleep(0.05)
    raise AssertionError(f"{name}{labels} = {got}, want {want}")


def test_daemon_wires_proxy_and_otlp_into_metrics(upstream: _Upstream, tmp_path: Any) -> None:
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )
    from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
    from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span

    cfg_text = (
        "listen: '127.0.0.1:0'\ninterval_s: 0.1\n"
        "samplers: {host: {enabled: false}, engines: {enabled: false}, gpu: {enabled: false}}\n"
        "discovery: {enabled: false}\n"
        f"proxies: [{{listen: '127.0.0.1:0', upstream: 'http://127.0.0.1:{upstream.port}', "
        "engine: llamacpp}]\n"
        "otlp_receiver: {service_engines: {vllm-main: vllm}}\n"
    )
    path = tmp_path / "k.yaml"
    path.write_text(cfg_text)
    d = Daemon(parse(cfg_text, str(path)), path)
    loop, t = _run(d)
    try:
        base = f"http://127.0.0.1:{d.bound_port}"
        proxy = d.proxies["127.0.0.1:0"]
        r = httpx.post(
            f"http://127.0.0.1:{proxy.port}/v1/chat/completions",
            json={"stream": True, "messages": []},
        )
        assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
        span = Span(
            name="llm_request", start_time_unix_nano=10**18, end_time_unix_nano=10**18 + 2 * 10**9
        )
        for k, v in (("gen_ai.latency.e2e", 2.0), ("gen_ai.latency.time_in_queue", 0.5)):
            span.attributes.append(KeyValue(key=k, value=AnyValue(double_value=v)))
        rs = ResourceSpans(scope_spans=[ScopeSpans(spans=[span])])
        rs.resource.attributes.append(
            KeyValue(key="service.name", value=AnyValue(string_value="vllm-main"))
        )
        body = ExportTraceServiceRequest(resource_spans=[rs]).SerializeToString()
        r = httpx.post(
            base + "/v1/traces", content=body, headers={"Content-Type": "application/x-protobuf"}
        )
        assert r.status_code == 200
        L = "kvpressure_request_latency_seconds_count"
        _wait_metric(base, L, 1, engine="llamacpp", phase="ttft")
        _wait_metric(base, L, 2, engine="llamacpp", phase="itl")
        _wait_metric(base, L, 1, engine="vllm", phase="queue")
        _wait_metric(base, "kvpressure_requests_total", 1, engine="llamacpp", outcome="ok")
        _wait_metric(
            base, "kvpressure_request_tokens_total", 7, engine="llamacpp", direction="input"
        )
        _wait_metric(base, "kvpressure_otlp_spans_received_total", 1, result="record")
        _wait_metric(base, "kvpressure_sampler_up", 1, sampler="requests")

        # SIGHUP with a changed proxy setting: the proxy is reconfigured in place (same
        # listener), serves on, and the cumulative counts survive the reload.
        path.write_text(
            cfg_text.replace(
                "listen: '127.0.0.1:0', upstream",
                "listen: '127.0.0.1:0', connect_timeout_s: 2, upstream",
            )
        )
        port = proxy.port
        loop.call_soon_threadsafe(d._on_hup)
        deadline = time.monotonic() + 5
        while proxy.spec[3] != 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert d.proxies["127.0.0.1:0"] is proxy and proxy.spec[3] == 2 and proxy.port == port
        r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json={"stream": True})
        assert r.status_code == 200
        _wait_metric(base, "kvpressure_requests_total", 2, engine="llamacpp", outcome="ok")
    finally:
        loop.call_soon_threadsafe(d.request_stop)
        t.join(5)
    assert not t.is_alive()
