"""``/healthz`` latency while clients load the agent (issue 18, point 6).

One real agent (``python -m kvpressure.agent.cli run``, interval 0.1 s, host sampler on, attribution
on) on 127.0.0.1. First about 2,000 slow vLLM ``llm_request`` spans are posted to its OTLP
receiver so the attribution store holds at least 1,000 attributions. Then, for each phase,
a probe client GETs ``/healthz`` every 20 ms for ``--seconds`` and the script prints the
p50, p99 and max latency (milliseconds, wall clock at the client, new connection each time
as a kubelet or load balancer probe does):

- **idle**: no other client;
- **attributions**: one client looping on ``/api/v1/attributions?since=1h&limit=1000``;
- **otlp**: three clients each looping on OTLP protobuf exports just under the default
  4 MiB ``max_body_bytes`` (about 9,500 spans each).

Usage::

    .venv/bin/python benchmarks/healthz_under_load.py [--seconds 20]
"""

from __future__ import annotations

import argparse
import multiprocessing
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from multiprocessing.sharedctypes import Synchronized
from multiprocessing.synchronize import Event
from pathlib import Path

import httpx
import yaml
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span

REPO = Path(__file__).resolve().parents[1]
PB = {"Content-Type": "application/x-protobuf"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _kv(key: str, value: float | int | str) -> KeyValue:
    v = AnyValue()
    if isinstance(value, float):
        v.double_value = value
    elif isinstance(value, int):
        v.int_value = value
    else:
        v.string_value = value
    return KeyValue(key=key, value=v)


def export(n: int, end: float, ttft: float = 5.0, pad: int = 0) -> bytes:
    """A protobuf export of ``n`` vLLM ``llm_request`` spans ending around ``end``."""
    spans = []
    for i in range(n):
        e2e = ttft + 1.0
        t1 = end - (i % 60) * 0.5
        span = Span(
            trace_id=i.to_bytes(16, "big") or b"\1" * 16,
            span_id=(i + 1).to_bytes(8, "big"),
            name="llm_request",
            start_time_unix_nano=int((t1 - e2e) * 1e9),
            end_time_unix_nano=int(t1 * 1e9),
        )
        span.attributes.extend(
            [
                _kv("gen_ai.latency.time_to_first_token", ttft),
                _kv("gen_ai.latency.e2e", e2e),
                _kv("gen_ai.latency.time_in_queue", ttft - 0.5),
                _kv("gen_ai.latency.time_in_model_prefill", 0.3),
                _kv("gen_ai.latency.time_in_model_decode", 0.7),
                _kv("gen_ai.usage.prompt_tokens", 512),
                _kv("gen_ai.usage.completion_tokens", 128),
                _kv("gen_ai.response.model", "tiny"),
                _kv("gen_ai.request.id", f"cmpl-{i:08d}-" + "x" * pad),
            ]
        )
        spans.append(span)
    rs = ResourceSpans(scope_spans=[ScopeSpans(spans=spans)])
    rs.resource.attributes.append(_kv("service.name", "vllm"))
    return ExportTraceServiceRequest(resource_spans=[rs]).SerializeToString()


def probe(base: str, seconds: float) -> list[float]:
    """``/healthz`` latencies in ms, one request every 20 ms on a new connection.

    A plain socket with a hand-written request (as a kubelet probe sends it), so the figure
    is the agent's connect-to-answer time, not an HTTP client library's set-up cost.
    """
    port = int(base.rsplit(":", 1)[1])
    request = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
    out: list[float] = []
    stop = time.monotonic() + seconds
    while time.monotonic() < stop:
        t0 = time.perf_counter()
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(request)
            answer = b""
            while chunk := s.recv(4096):
                answer += chunk
        out.append((time.perf_counter() - t0) * 1000)
        if not answer.startswith(b"HTTP/1.1 200"):
            raise RuntimeError(f"/healthz answered {answer[:40]!r}")
        time.sleep(0.02)
    return out


def attributions_worker(url: str, stop: Event, done: Synchronized) -> None:
    """Loop on the attributions API until ``stop`` (its own process)."""
    with httpx.Client(timeout=60) as c:
        while not stop.is_set():
            c.get(url).raise_for_status()
            with done.get_lock():
                done.value += 1


def otlp_worker(base: str, body: bytes, stop: Event, done: Synchronized) -> None:
    """Loop on OTLP exports of ``body`` until ``stop`` (its own process); a 503 is retried
    after its ``Retry-After``, as the OTLP exporters do."""
    with httpx.Client(timeout=60) as c:
        while not stop.is_set():
            r = c.post(f"{base}/v1/traces", content=body, headers=PB)
            if r.status_code == 503:
                time.sleep(float(r.headers.get("Retry-After", "1")))
                continue
            if r.status_code != 200:
                raise RuntimeError(f"OTLP export answered {r.status_code}")
            with done.get_lock():
                done.value += 1


def phase(base: str, seconds: float, workers: list[tuple[Callable[..., None], tuple]]) -> str:
    """Probe ``/healthz`` while each worker loops in its own process (so the probe never
    waits for the load clients' GIL); a row of probes, p50, p99, max and load requests."""
    ctx = multiprocessing.get_context("fork")
    stop = ctx.Event()
    done = ctx.Value("i", 0)
    procs = [ctx.Process(target=w, args=(*a, stop, done), daemon=True) for w, a in workers]
    for pr in procs:
        pr.start()
    lat = probe(base, seconds)
    stop.set()
    for pr in procs:
        pr.join(60)
    q = statistics.quantiles(lat, n=100, method="inclusive")
    load = done.value
    return (
        f"{len(lat):6d}  {q[49]:7.1f}  {q[98]:7.1f}  {max(lat):7.1f}  "
        f"{load:6d} ({load / seconds:.1f}/s)"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=20.0, help="length of each phase")
    args = ap.parse_args()
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as tmp:
        cfg = Path(tmp) / "kvpressure.agent.yaml"
        cfg.write_text(
            yaml.safe_dump(
                {
                    "listen": f"127.0.0.1:{port}",
                    "interval_s": 0.1,
                    "discovery": {"enabled": False},
                    "log_level": "warning",
                    "samplers": {"gpu": {"enabled": False}},
                }
            )
        )
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvpressure.agent.cli", "run", "--config", str(cfg)],
            cwd=REPO,
            stdout=subprocess.DEVNULL,
            stderr=(Path(tmp) / "kvpressure.agent.err").open("wb"),
        )
        try:
            deadline = time.monotonic() + 30
            while True:
                try:
                    httpx.get(f"{base}/healthz", timeout=2).raise_for_status()
                    break
                except httpx.HTTPError:
                    if proc.poll() is not None or time.monotonic() > deadline:
                        print("agent did not start", file=sys.stderr)
                        return 1
                    time.sleep(0.2)
            # fill the attribution store: slow spans (TTFT 5 s, above the 2 s SLO)
            for _ in range(4):
                body = export(500, time.time() - 1)
                httpx.post(f"{base}/v1/traces", content=body, headers=PB, timeout=30)
                time.sleep(0.5)
            url = f"{base}/api/v1/attributions?since=1h&limit=1000"
            have = 0
            for _ in range(60):
                doc = httpx.get(url, timeout=30).json()
                have = len(doc.get("attributions", []))
                if have >= 1000:
                    break
                time.sleep(0.5)
            n = 10_000
            big = export(n, time.time() - 3600)
            while len(big) > 4 * 2**20 - 4096:  # just under the default max_body_bytes
                n -= 250
                big = export(n, time.time() - 3600)
            print(
                f"agent interval_s 0.1; attributions listed per answer: {have}; "
                f"OTLP export: {len(big) / 1e6:.2f} MB, {n:,} spans; {args.seconds:.0f} s "
                "per phase; latency in ms"
            )
            print(
                f"{'phase':<13}  {'probes':>6}  {'p50':>7}  {'p99':>7}  {'max':>7}  load requests"
            )
            print(f"{'idle':<13}  {phase(base, args.seconds, [])}")

            row = phase(base, args.seconds, [(attributions_worker, (url,))])
            print(f"{'attributions':<13}  {row}")
            row = phase(base, args.seconds, [(otlp_worker, (base, big))] * 3)
            print(f"{'otlp 3x4MB':<13}  {row}")
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                print("agent did not stop within 30 s of SIGTERM; killed", file=sys.stderr)
                proc.kill()
                proc.wait(10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
