#!/usr/bin/env python3
"""Prove that a llama-server binary can serve: load a model and generate tokens.

Usage: llamacpp_check.py SERVER MODEL [--tokens N] [--runs K] [--prompt-words W]
                         [--threads T] [--json]

Starts ``SERVER -m MODEL`` on a free loopback port (``-c 1024 -np 1``), waits for
``/health``, asks ``POST /completion`` for N tokens (``ignore_eos``, greedy, no prompt
cache) after a prompt of W words (default: one short sentence) K times and
checks that every answer holds N predicted tokens. ``--version`` proves nothing: a binary
built for instructions the CPU advertises but the kernel has not enabled (AMX on some
hypervisors) starts, loads the model and dies with SIGILL on its first matrix multiply.

Exit 0 and one line ``ok: ...`` with the generation and prompt rates (tokens/s, from the
server's own ``timings``; the median over the runs) on success, and with ``--json`` a JSON
object on the next line. Exit 1 and one line ``failed: <why>`` (the signal's name when the
server was killed by one, the last lines of its log) otherwise.

Standard library only: it runs before the project's virtualenv has anything installed.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

START_TIMEOUT_S = 120.0
# One token each in common tokenizers, so W words make a prompt of about W tokens.
_WORDS = [
    "the",
    "cat",
    "sat",
    "on",
    "a",
    "mat",
    "and",
    "the",
    "dog",
    "ran",
    "to",
    "the",
    "park",
    "while",
    "birds",
    "sang",
    "in",
    "green",
    "trees",
    "near",
    "an",
    "old",
    "house",
    "by",
    "the",
    "river",
    "where",
    "people",
    "walk",
    "every",
    "day",
]
REQUEST_TIMEOUT_S = 300.0


def exit_reason(returncode: int) -> str:
    """``exited with 3`` or ``killed by SIGILL (Illegal instruction)`` for a Popen returncode."""
    if returncode < 0:
        try:
            sig = signal.Signals(-returncode)
        except ValueError:
            return f"killed by signal {-returncode}"
        return f"killed by {sig.name} ({signal.strsignal(sig) or sig.name})"
    return f"exited with {returncode}"


def log_tail(path: Path, n: int = 5) -> str:
    """The last ``n`` non-empty lines of ``path`` joined with `` | `` (one line)."""
    try:
        lines = [ln.strip() for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return "<no log>"
    return " | ".join(lines[-n:]) or "<empty log>"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get(url: str, timeout_s: float) -> int:
    with urllib.request.urlopen(url, timeout=timeout_s) as r:
        return int(r.status)


def _post_json(url: str, body: dict[str, object], timeout_s: float) -> dict[str, object]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        return dict(json.loads(r.read()))


class CheckFailed(Exception):
    """The server could not load the model or generate; the message says why in one line."""


def check(
    server: Path, model: Path, tokens: int, runs: int, threads: int, prompt_words: int = 0
) -> dict[str, object]:
    """Start the server, generate ``tokens`` tokens ``runs`` times, stop it.

    ``prompt_words`` > 0 makes each prompt that many words (about as many tokens), so the
    prompt rate measures batched prefill rather than a handful of tokens.

    Returns:
        ``{"tokens": N, "runs": K, "gen_tok_s": median, "prompt_tok_s": median,
        "gen_tok_s_all": [...], "start_s": seconds to /health}``.

    Raises:
        CheckFailed: the server exited, never answered, or generated fewer tokens.
    """
    port = _free_port()
    with tempfile.TemporaryDirectory(prefix="llamacpp-check-") as tmp:
        log = Path(tmp) / "llama-server.log"
        argv = [str(server), "-m", str(model), "-c", "1024", "-np", "1", "-t", str(threads)]
        argv += ["--host", "127.0.0.1", "--port", str(port)]
        with log.open("wb") as f:
            try:
                proc = subprocess.Popen(
                    argv, stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT
                )
            except OSError as e:
                raise CheckFailed(f"cannot start {server}: {e}") from e
        base = f"http://127.0.0.1:{port}"
        try:
            t0 = time.monotonic()
            while True:
                if proc.poll() is not None:
                    raise CheckFailed(
                        f"llama-server {exit_reason(proc.returncode)} while loading the model; "
                        f"last log lines: {log_tail(log)}"
                    )
                try:
                    if _get(f"{base}/health", 1.0) == 200:
                        break
                except (urllib.error.URLError, OSError):
                    pass
                if time.monotonic() - t0 > START_TIMEOUT_S:
                    raise CheckFailed(
                        f"llama-server did not answer /health within {START_TIMEOUT_S:.0f} s; "
                        f"last log lines: {log_tail(log)}"
                    )
                time.sleep(0.1)
            start_s = time.monotonic() - t0
            gen: list[float] = []
            prompt: list[float] = []
            for i in range(runs):
                words = " ".join(_WORDS[(i * 7 + j) % len(_WORDS)] for j in range(prompt_words))
                body = {
                    "prompt": f"Run {i}. {words} The three primary colours are",
                    "n_predict": tokens,
                    "ignore_eos": True,
                    "temperature": 0.0,
                    "cache_prompt": False,
                }
                try:
                    answer = _post_json(f"{base}/completion", body, REQUEST_TIMEOUT_S)
                except (urllib.error.URLError, OSError, ValueError) as e:
                    proc.poll()
                    why = (
                        exit_reason(proc.returncode)
                        if proc.returncode is not None
                        else f"request failed ({e})"
                    )
                    raise CheckFailed(
                        f"llama-server {why} during generation; last log lines: {log_tail(log)}"
                    ) from e
                got = answer.get("tokens_predicted")
                if not isinstance(got, int) or got < tokens:
                    raise CheckFailed(f"asked for {tokens} tokens, got {got!r}")
                timings = answer.get("timings")
                if isinstance(timings, dict):
                    if isinstance(timings.get("predicted_per_second"), (int, float)):
                        gen.append(float(timings["predicted_per_second"]))
                    if isinstance(timings.get("prompt_per_second"), (int, float)):
                        prompt.append(float(timings["prompt_per_second"]))
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
    return {
        "tokens": tokens,
        "runs": runs,
        "gen_tok_s": statistics.median(gen) if gen else None,
        "prompt_tok_s": statistics.median(prompt) if prompt else None,
        "gen_tok_s_all": gen,
        "prompt_tok_s_all": prompt,
        "start_s": round(start_s, 2),
    }


def main(argv: list[str] | None = None) -> int:
    """Command line: see the module docstring; returns the exit status."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("server", type=Path)
    p.add_argument("model", type=Path)
    p.add_argument("--tokens", type=int, default=8, help="tokens to generate per run")
    p.add_argument("--runs", type=int, default=1)
    p.add_argument("--prompt-words", type=int, default=0, help="prompt length in words")
    p.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    p.add_argument("--json", action="store_true", help="also print the result as JSON")
    args = p.parse_args(argv)
    try:
        result = check(
            args.server, args.model, args.tokens, args.runs, args.threads, args.prompt_words
        )
    except CheckFailed as e:
        print(f"failed: {e}")
        return 1
    gen, prompt = result["gen_tok_s"], result["prompt_tok_s"]
    print(
        f"ok: generated {args.tokens} tokens x {args.runs} "
        f"(generation {gen if gen is None else f'{gen:.1f}'} tok/s, "
        f"prompt {prompt if prompt is None else f'{prompt:.1f}'} tok/s, "
        f"ready in {result['start_s']} s)"
    )
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
