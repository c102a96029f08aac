"""Produce a live ``kvpressure plan --agent`` example against the real llama.cpp server.

Run: ``.venv/bin/python benchmarks/capacity/plan_live_example.py``

Starts llama-server (``-c 2048 -np 4``, the e2e shape) and ``kvpressure run`` with the
server as engine ``llamacpp`` and a request proxy in front of it (so the capacity sampler
gets per-request TTFT/ITL from the request stream), sends streaming load through the proxy
at rising concurrency (1, 2, 4, 6, 8 requests of ~300 prompt tokens, 64 output tokens),
then prints ``kvpressure plan --agent URL --gguf MODEL --context 256,512,1k --concurrency 4``.
Loopback only; everything it starts is stopped.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "e2e"))

from e2e_support import (  # noqa: E402
    AGENT_INTERVAL_S,
    Agent,
    LlamaServer,
    find_llama_assets,
    free_port,
)

WORDS = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india"]


def stream_one(url: str, prompt: str, n_predict: int) -> None:
    with httpx.stream(
        "POST",
        f"{url}/completion",
        json={"prompt": prompt, "n_predict": n_predict, "stream": True, "ignore_eos": True},
        timeout=600,
    ) as r:
        for _ in r.iter_lines():
            pass


def main() -> int:
    assets, why = find_llama_assets()
    if assets is None:
        print(f"cannot run: {why}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="kvp-plan-") as d:
        work = Path(d)
        srv = LlamaServer(assets, free_port(), work)
        srv.start()
        agent_port, proxy_port = free_port(), free_port()
        cfg = {
            "listen": f"127.0.0.1:{agent_port}",
            "interval_s": AGENT_INTERVAL_S,
            "samplers": {"host": {"enabled": True}, "gpu": {"enabled": False}},
            "discovery": {"enabled": False},
            "engines": [{"name": "llamacpp", "type": "llamacpp", "url": srv.url}],
            "proxies": [
                {"listen": f"127.0.0.1:{proxy_port}", "upstream": srv.url, "engine": "llamacpp"}
            ],
        }
        (work / "kvpressure.yaml").write_text(yaml.safe_dump(cfg))
        agent = Agent(config=work / "kvpressure.yaml", port=agent_port, stderr=work / "a.err")
        agent.start()
        proxy = f"http://127.0.0.1:{proxy_port}"
        try:
            time.sleep(2)
            for c in (1, 2, 4, 6, 8):
                prompts = [
                    f"[{c}-{i}] " + " ".join(WORDS[(j + i) % len(WORDS)] for j in range(280))
                    for i in range(c)
                ]
                ts = [threading.Thread(target=stream_one, args=(proxy, p, 64)) for p in prompts]
                for t in ts:
                    t.start()
                for t in ts:
                    t.join()
            time.sleep(2 * AGENT_INTERVAL_S + 0.5)
            cmd = [
                sys.executable, "-m", "kvpressure.agent.cli", "plan", "--agent", agent.url,
                "--gguf", str(assets.model), "--context", "256,512,1k", "--concurrency", "4",
                "--output-tokens", "64",
            ]  # fmt: skip
            print("$ kvpressure plan --agent " + agent.url + " " + " ".join(cmd[6:]))
            r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)
            print(r.stdout + r.stderr)
        finally:
            agent.stop()
            srv.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
