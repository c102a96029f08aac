"""Closed-loop streaming load against llama.cpp's ``/completion`` (through the proxy).

``concurrency`` workers each send one streaming request at a time until ``n`` requests are
done. For each request the client records its wall-clock start and end, the time to the
first SSE event with content (client TTFT) and the HTTP status. Runnable as a script so the
network scenario can run it inside a network namespace::

    python benchmarks/attribution/load.py --url http://10.77.0.1:PORT --n 30 \
        --concurrency 2 --words 40 --n-predict 16 --seed 7

which prints one JSON list of results on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from typing import Any

import httpx

WORDS = [
    "memory",
    "cache",
    "token",
    "river",
    "mountain",
    "engine",
    "cluster",
    "stream",
    "window",
    "kernel",
    "latency",
    "tail",
    "queue",
    "signal",
    "thread",
    "garden",
    "winter",
    "summer",
    "planet",
    "ocean",
    "violet",
    "copper",
    "silver",
    "market",
    "harbor",
    "lantern",
    "meadow",
    "orchard",
    "pepper",
    "quartz",
    "rocket",
    "saddle",
    "timber",
    "velvet",
    "walnut",
]


@dataclass
class Result:
    """One request as the client saw it (times: Unix seconds and seconds)."""

    start: float
    end: float
    ttft_s: float | None
    status: int
    error: str = ""


def prompt(words: int, rng: random.Random) -> str:
    """A prompt of ``words`` pseudo-random words (about 1.3 tokens each for Gemma 3)."""
    return "Summarize: " + " ".join(rng.choice(WORDS) for _ in range(words))


async def _one(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> Result:
    start = time.time()
    t0 = time.monotonic()
    first: float | None = None
    status = 0
    try:
        async with client.stream("POST", f"{url}/completion", json=body) as resp:
            status = resp.status_code
            async for line in resp.aiter_lines():
                has_content = '"content":"' in line and '"content":""' not in line
                if first is None and line.startswith("data:") and has_content:
                    first = time.monotonic() - t0
        end = time.time()
        return Result(start, end, first, status)
    except httpx.HTTPError as exc:
        return Result(start, time.time(), first, status, type(exc).__name__)


async def run_load(
    url: str,
    n: int,
    concurrency: int,
    words: int,
    n_predict: int,
    seed: int = 1,
    timeout_s: float = 300.0,
    pad_bytes: int = 0,
    long_every: int = 0,
    long_words: int = 0,
) -> list[Result]:
    """Send ``n`` streaming completions with ``concurrency`` workers; return the results.

    ``pad_bytes`` adds a field the server ignores (``client_metadata``) so the request body
    is that much larger without more prompt tokens (a client that sends history or
    attachments); the network scenario uses it so the shaped link delays the upload.
    With ``long_every`` > 0, one request in ``long_every`` (at a random place in each run
    of that many) has a prompt of ``long_words`` words instead (a mixed-length workload).
    """
    rng = random.Random(seed)
    long_at: set[int] = set()
    if long_every > 0:
        for k in range(0, n, long_every):
            long_at.add(k + rng.randrange(long_every))
    bodies: list[dict[str, Any]] = [
        {
            "prompt": prompt(long_words if i in long_at else words, rng),
            "n_predict": n_predict,
            "stream": True,
            "cache_prompt": False,
            "ignore_eos": True,
            "temperature": 0.8,
            "seed": seed + i,
            **({"client_metadata": "x" * pad_bytes} if pad_bytes else {}),
        }
        for i in range(n)
    ]
    return await closed_loop(url, bodies, concurrency, _one, timeout_s)


async def closed_loop(
    url: str,
    bodies: list[dict[str, Any]],
    concurrency: int,
    one: Callable[[httpx.AsyncClient, str, dict[str, Any]], Awaitable[Result]],
    timeout_s: float = 300.0,
) -> list[Result]:
    """Send every body with ``concurrency`` closed-loop workers (each sends its next request
    when its previous one finished) through ``one(client, url, body)``; return the results
    in completion order."""
    queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    for b in bodies:
        queue.put_nowait(b)
    out: list[Result] = []
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits, trust_env=False) as client:

        async def worker() -> None:
            while True:
                try:
                    body = queue.get_nowait()
                except asyncio.QueueEmpty:
                    return
                out.append(await one(client, url, body))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--url", required=True)
    p.add_argument("--n", type=int, default=30)
    p.add_argument("--concurrency", type=int, default=2)
    p.add_argument("--words", type=int, default=40)
    p.add_argument("--n-predict", type=int, default=16)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--pad-bytes", type=int, default=0)
    a = p.parse_args(argv)
    res = asyncio.run(
        run_load(a.url, a.n, a.concurrency, a.words, a.n_predict, a.seed, pad_bytes=a.pad_bytes)
    )
    json.dump([asdict(r) for r in res], sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
