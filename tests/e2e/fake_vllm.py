"""A stand-in vLLM server for the operator-view tests: real HTTP, recorded metrics.

``python fake_vllm.py PORT METRICS_FILE`` serves ``GET /metrics`` from a recorded vLLM
exposition (``tests/fixtures/engines/vllm/``) and ``POST /v1/completions`` as an SSE
stream: it waits ``delay_s`` (a field of the JSON body, default 0.05 s), then sends
``n`` (default 4) content chunks 20 ms apart and ``[DONE]``; ``status`` in the body makes it
answer that HTTP status instead. Used where what matters is the agent's view of requests
and engines, not what a model computes (the llama.cpp tests cover that).
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

from aiohttp import web


def make_app(metrics: str) -> web.Application:
    """The fake server's routes."""

    async def get_metrics(_: web.Request) -> web.Response:
        return web.Response(text=metrics, content_type="text/plain")

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        status = int(body.get("status", 200))
        if status != 200:
            return web.json_response({"error": {"message": "fake failure"}}, status=status)
        await asyncio.sleep(float(body.get("delay_s", 0.05)))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        n = int(body.get("n", 4))
        for i in range(n):
            chunk = {"choices": [{"index": 0, "text": f" t{i}", "finish_reason": None}]}
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
            await asyncio.sleep(0.02)
        usage = {"prompt_tokens": 8, "completion_tokens": n, "total_tokens": 8 + n}
        last = {"choices": [{"index": 0, "text": "", "finish_reason": "length"}], "usage": usage}
        await resp.write(f"data: {json.dumps(last)}\n\ndata: [DONE]\n\n".encode())
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_get("/metrics", get_metrics)
    app.router.add_post("/v1/completions", completions)
    return app


if __name__ == "__main__":
    web.run_app(
        make_app(Path(sys.argv[2]).read_text()),
        host="127.0.0.1",
        port=int(sys.argv[1]),
        print=None,
    )
