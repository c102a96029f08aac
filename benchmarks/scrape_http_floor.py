"""Server CPU of one ``/metrics`` scrape at 20 Hz: the agent's listener against the floors under it.

Each server runs in its own process, serving a body from cache (no rendering: the state
does not change), and is polled at 20 Hz with Prometheus' headers (OpenMetrics, gzip) for
``--seconds``, over one kept-alive connection and then with a new connection per scrape.
Printed: the CPU time of the server's event-loop thread (``/proc/<pid>/task/<pid>/schedstat``,
nanoseconds) per scrape. A scrape 50 ms after the last one runs with cold caches, so these
are several times what a burst of back-to-back requests measures. Servers:

* ``asyncio``: a bare ``asyncio.Protocol`` writing one prepared response (no HTTP parsing;
  the floor of the event loop and the kernel's socket work);
* ``h11``: an ``asyncio.Protocol`` around an ``h11.Connection`` (the pure-Python HTTP/1.1
  state machine httpx's transport uses, already installed with it) answering each request
  with the prepared body: what an HTTP server built on that library would cost;
* ``aiohttp-lowlevel``: ``aiohttp.web.Server`` with a handler returning a prepared body and
  headers (aiohttp at its leanest);
* ``agent``: the agent's listener (:class:`agent.httpd.HttpServer`: the connection cap,
  timeouts and routing; a scrape that arrives whole is read and answered by its fast path,
  anything else by h11) serving :func:`agent.api.api_routes` with the default exposition.
  Until issue 15's RSS cut it was an aiohttp application; ``aiohttp-lowlevel`` is the floor
  of that library.

Usage::

    flock /tmp/kvpressure-cpu.lock .venv/bin/python benchmarks/scrape_http_floor.py [--seconds 10]
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import http.client
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from node_cost import PROM_ACCEPT  # noqa: E402  (Prometheus' own Accept header)

HEADERS = {"Accept": PROM_ACCEPT, "Accept-Encoding": "gzip"}
SERVERS = ("asyncio", "h11", "aiohttp-lowlevel", "agent")
OM = "application/openmetrics-text; version=1.0.0; charset=utf-8"


def serve(kind: str) -> None:
    """Serve ``kind`` on a free loopback port; print the port; run until killed."""
    from aiohttp import web

    from kvpressure.agent.api import api_routes
    from kvpressure.agent.httpd import HttpServer
    from kvpressure.agent.samplers.host import HostSampler
    from kvpressure.agent.samples import Batch
    from kvpressure.agent.state import AgentState, SamplerReport
    from kvpressure.agent.timeline import Timeline
    from kvpressure.exporters.prometheus import Encoder, make_registry

    state = AgentState(Timeline())
    batch = Batch()
    HostSampler().collect(batch)
    state.publish(SamplerReport("host", time.time(), 0.001, True, "", batch))
    body = gzip.compress(Encoder().encode(state.samples(), True) or b"", 1, mtime=0)
    headers = {"Content-Type": OM, "Content-Encoding": "gzip", "Vary": "Accept, Accept-Encoding"}

    async def main() -> None:
        if kind == "asyncio":
            head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
            response = f"HTTP/1.1 200 OK\r\n{head}Content-Length: {len(body)}\r\n\r\n".encode()
            response += body

            class Reply(asyncio.Protocol):
                def connection_made(self, transport: asyncio.BaseTransport) -> None:
                    assert isinstance(transport, asyncio.Transport)
                    self.transport = transport

                def data_received(self, data: bytes) -> None:
                    if b"\r\n\r\n" in data:  # one whole request head per read, as polled here
                        self.transport.write(response)

            server = await asyncio.get_running_loop().create_server(Reply, "127.0.0.1", 0)
            port = server.sockets[0].getsockname()[1]
        elif kind == "h11":
            import h11

            fields = [*headers.items(), ("Content-Length", str(len(body)))]

            class H11Reply(asyncio.Protocol):
                def connection_made(self, transport: asyncio.BaseTransport) -> None:
                    assert isinstance(transport, asyncio.Transport)
                    self.transport = transport
                    self.conn = h11.Connection(h11.SERVER)

                def data_received(self, data: bytes) -> None:
                    conn = self.conn
                    conn.receive_data(data)
                    while True:
                        event = conn.next_event()
                        if event is h11.NEED_DATA or event is h11.PAUSED:
                            break
                        if isinstance(event, h11.Request):
                            out = conn.send(h11.Response(status_code=200, headers=fields))
                            out += conn.send(h11.Data(data=body)) + conn.send(h11.EndOfMessage())
                            self.transport.write(out)
                        elif isinstance(event, h11.EndOfMessage):
                            conn.start_next_cycle()
                        elif isinstance(event, h11.ConnectionClosed):
                            self.transport.close()
                            break

            server = await asyncio.get_running_loop().create_server(H11Reply, "127.0.0.1", 0)
            port = server.sockets[0].getsockname()[1]
        elif kind == "aiohttp-lowlevel":

            async def handler(_: web.BaseRequest) -> web.Response:
                return web.Response(body=body, headers=headers)

            runner = web.ServerRunner(web.Server(handler, access_log=None), handle_signals=False)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        else:
            server = HttpServer("api", api_routes(state, make_registry(state)))
            port = await server.start("127.0.0.1", 0)
        print(port, flush=True)
        await asyncio.Event().wait()

    asyncio.run(main())


def measure(kind: str, kept_alive: bool, seconds: float) -> float:
    """Milliseconds of the server's loop-thread CPU per scrape."""
    proc = subprocess.Popen([sys.executable, __file__, "--serve", kind], stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        stop = threading.Event()
        done = [0]

        def poll() -> None:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            while not stop.wait(0.05):
                if not kept_alive:
                    conn.close()
                    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
                conn.request("GET", "/metrics", headers=HEADERS)
                conn.getresponse().read()
                done[0] += 1
            conn.close()

        def loop_ns() -> int:
            return int(Path(f"/proc/{proc.pid}/task/{proc.pid}/schedstat").read_text().split()[0])

        poller = threading.Thread(target=poll, daemon=True)
        poller.start()
        time.sleep(1.0)  # warm-up
        ns0, n0 = loop_ns(), done[0]
        time.sleep(seconds)
        ns1, n1 = loop_ns(), done[0]
        stop.set()
        poller.join(5)
        return (ns1 - ns0) / 1e6 / max(1, n1 - n0)
    finally:
        proc.kill()
        proc.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--serve", choices=SERVERS, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        serve(args.serve)
        return
    print(f"server CPU per /metrics scrape at 20 Hz, {args.seconds:.0f} s each")
    for kind in SERVERS:
        kept = measure(kind, True, args.seconds)
        fresh = measure(kind, False, args.seconds)
        print(f"  {kind:<17} kept alive {kept:6.3f} ms   new connection {fresh:6.3f} ms")


if __name__ == "__main__":
    main()
