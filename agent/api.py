"""The agent's HTTP surface (aiohttp): ``/metrics``, ``/healthz`` and ``/api/v1/snapshot``.

``/api/v1/snapshot`` returns JSON::

    {"time": 1796054431.2, "version": "0.1.0", "uptime_s": 12.5,
     "samplers": [{"sampler": "host", "up": true, "duration_s": 0.004, "reason": "",
                   "age_s": 0.3, "sources": [{"source": "psi", "state": "ok", "reason": ""}]}],
     "samples": [{"name": "kvpressure_host_memory_total_bytes", "labels": {}, "value": 1.6e10}]}

``kvpressure status`` reads it.
"""

from __future__ import annotations

import time
from typing import Any

from aiohttp import web
from prometheus_client.registry import CollectorRegistry

from agent import __version__
from agent.state import AgentState
from exporters.prometheus import render


def snapshot(state: AgentState) -> dict[str, Any]:
    """Return the JSON-ready snapshot of ``state`` (shape in the module docstring)."""
    now = time.time()
    samplers = []
    for r in state.reports():
        samplers.append(
            {
                "sampler": r.sampler,
                "up": r.ok,
                "duration_s": r.duration_s,
                "reason": r.reason,
                "age_s": max(0.0, now - r.ts),
                "sources": [
                    {"source": s.source, "state": s.state, "reason": s.reason}
                    for s in (r.batch.sources if r.batch else [])
                ],
            }
        )
    samples = [
        {"name": s.name, "labels": dict(s.labels), "value": s.value} for s in state.samples()
    ]
    return {
        "time": now,
        "version": __version__,
        "uptime_s": now - state.started,
        "samplers": samplers,
        "samples": samples,
    }


def make_app(state: AgentState, registry: CollectorRegistry) -> web.Application:
    """Build the aiohttp application serving ``state``.

    Args:
        state: the agent state to expose.
        registry: the registry holding the snapshot collector (see
            :func:`exporters.prometheus.make_registry`).
    """

    async def metrics(request: web.Request) -> web.Response:
        body, content_type = render(registry, request.headers.get("Accept"))
        resp = web.Response(body=body)
        resp.headers["Content-Type"] = content_type
        return resp

    async def healthz(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "uptime_s": time.time() - state.started})

    async def snap(_: web.Request) -> web.Response:
        return web.json_response(snapshot(state))

    app = web.Application(client_max_size=1 << 20)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/api/v1/snapshot", snap)
    return app
