"""The agent's HTTP routes: ``/metrics``, ``/healthz``, ``/api/v1/snapshot`` and attributions.

They are served by :class:`agent.httpd.HttpServer`.

``/api/v1/snapshot`` returns JSON::

    {"time": 1796054431.2, "version": "0.1.0", "uptime_s": 12.5,
     "samplers": [{"sampler": "host", "state": "up", "up": true, "duration_s": 0.004, "reason": "",
                   "age_s": 0.3, "sources": [{"source": "psi", "state": "ok", "reason": ""}]}],
     "samples": [{"name": "kvpressure_host_memory_total_bytes", "labels": {}, "value": 1.6e10}]}

A sampler's ``state`` is ``up``, ``down`` (its last cycle failed: ``reason`` says why) or
``unsupported`` (it ran, but every source it has is missing on this host, e.g. the GPU
sampler without an NVML library: ``sources`` says which and why); ``up`` is true only for
``state == "up"``. ``kvpressure status`` and ``kvpressure top`` read it.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Final

from prometheus_client.registry import CollectorRegistry

from kvpressure.agent import __version__
from kvpressure.agent.attribution.store import AttributionStore
from kvpressure.agent.httpd import Request, Response, Route, get, json_response
from kvpressure.agent.state import AgentState, SamplerReport
from kvpressure.exporters.prometheus import ExpositionCache


def sampler_state(r: SamplerReport) -> str:
    """``up``, ``down`` or ``unsupported`` for one sampler report (see the module docstring).

    ``unsupported``: the cycle succeeded, produced no samples, and every source it reported
    is unsupported (a host with no device for this sampler).
    """
    if not r.ok:
        return "down"
    b = r.batch
    if (
        b is not None
        and not b.samples
        and b.sources
        and all(s.state == "unsupported" for s in b.sources)
    ):
        return "unsupported"
    return "up"


def snapshot(state: AgentState) -> dict[str, Any]:
    """Return the JSON-ready snapshot of ``state`` (shape in the module docstring)."""
    now = time.time()
    samplers = []
    for r in state.reports():
        st = sampler_state(r)
        samplers.append(
            {
                "sampler": r.sampler,
                "state": st,
                "up": st == "up",
                "duration_s": r.duration_s,
                "reason": r.reason,
                "age_s": max(0.0, now - r.ts),
                "sources": [
                    {"source": s.source, "state": s.state, "reason": s.reason}
                    for s in (r.batch.sources if r.batch is not None else [])
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


def api_routes(
    state: AgentState, registry: CollectorRegistry, routes: Sequence[Route] = ()
) -> list[Route]:
    """The routes serving ``state`` (serve them with :class:`agent.httpd.HttpServer`).

    ``/metrics`` is rendered once per state change, in the format and encoding asked
    (:class:`exporters.prometheus.ExpositionCache`), not once per scrape.

    Args:
        state: the agent state to expose.
        registry: the registry holding the snapshot collector (see
            :func:`exporters.prometheus.make_registry`).
        routes: extra routes served on the same listener (e.g. the OTLP trace receiver's
            ``POST /v1/traces``).
    """
    cache = ExpositionCache(registry, state)
    # one header set per (format, gzip): at most a few, built on first use
    response_headers: dict[tuple[str, bool], dict[str, str]] = {}

    def metrics(request: Request) -> Response:
        asked = request.headers
        body, content_type, zipped = cache.get(asked.get("Accept"), asked.get("Accept-Encoding"))
        out = response_headers.get((content_type, zipped))
        if out is None:
            out = {"Content-Type": content_type, "Vary": "Accept, Accept-Encoding"}
            if zipped:
                out["Content-Encoding"] = "gzip"
            if len(response_headers) < 64:  # content types are the library's few
                response_headers[(content_type, zipped)] = out
        return Response(body, headers=out)

    def healthz(_: Request) -> Response:
        return json_response({"status": "ok", "uptime_s": time.time() - state.started})

    def snap(_: Request) -> Response:
        return json_response(snapshot(state))

    return [
        get("/metrics", metrics),
        get("/healthz", healthz),
        get("/api/v1/snapshot", snap),
        *routes,
    ]


MAX_ATTRIBUTIONS_LIMIT: Final = 1000
"""Most attributions (and windows) one ``/api/v1/attributions`` answer lists."""


def attribution_routes(
    store: AttributionStore,
    window_s: float,
    started: float | None = None,
    min_score: float = 0.3,
    known_engines: Callable[[], Iterable[str]] | None = None,
) -> list[Route]:
    """``GET /api/v1/attributions?since=10m[&engine=E][&limit=N]`` for ``kvpressure explain``.

    ``since`` is a duration (``600``, ``90s``, ``10m``, ``1h``; default ``10m``); ``limit``
    (default 100) is at most :data:`MAX_ATTRIBUTIONS_LIMIT`; the answer is
    :meth:`agent.attribution.store.AttributionStore.query`'s document, built and encoded on a
    worker thread so a large answer never holds up the event loop (``/healthz``, proxied
    streams), plus ``agent_started`` (Unix seconds) and ``requested_since`` (``now - since``):
    the document's ``since`` never lies before the agent started (nothing was observed then),
    unless a kept request ended earlier (a late OTLP span), and then not before it.
    ``engines`` also lists the engines ``known_engines`` returns (those scraped, with or
    without requests). A bad parameter is answered 400 with ``{"error": ...}``.

    Args:
        store: the attribution store.
        window_s: window length (``attribution.window_s``), seconds.
        started: the agent's start, Unix seconds (``AgentState.started``).
        min_score: ``attribution.min_score``.
        known_engines: engine labels known beyond the store's (e.g. from
            ``kvpressure_engine_up``); called on the event loop.
    """
    from kvpressure.agent.attribution.explain import parse_since

    async def attributions(request: Request) -> Response:
        q = request.query
        try:
            since_s = parse_since(q.get("since", "10m"))
        except ValueError as exc:
            return json_response({"error": str(exc)}, status=400)
        raw_limit = q.get("limit", "100")
        ascii_digits = raw_limit.isascii() and raw_limit.isdigit() and len(raw_limit) <= 9
        limit = int(raw_limit) if ascii_digits else -1
        if not 0 <= limit <= MAX_ATTRIBUTIONS_LIMIT:
            error = f"limit must be a whole number between 0 and {MAX_ATTRIBUTIONS_LIMIT}"
            return json_response({"error": error}, status=400)
        now = time.time()
        requested = now - since_s
        engine = q.get("engine") or None
        known = set(known_engines()) if known_engines is not None else None

        def build() -> str:
            floor = started
            if started is not None and (oldest := store.oldest()) is not None:
                floor = min(started, oldest)
            doc = store.query(
                requested if floor is None else max(requested, floor),
                now,
                engine=engine,
                limit=limit,
                window_s=window_s,
                min_score=min_score,
            )
            doc["requested_since"] = requested
            doc["agent_started"] = started
            if known is not None:
                doc["engines"] = sorted(set(doc["engines"]) | known)
            return json.dumps(doc)

        return Response(text=await asyncio.to_thread(build), content_type="application/json")

    return [get("/api/v1/attributions", attributions)]
