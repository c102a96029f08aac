"""End to end against a real llama.cpp server under real load.

A real ``llama-server`` (Gemma-3-270M Q4_K_M, ``--metrics -c 2048 -np 4 -t 2``) and a real
``kvpressure run`` (interval 0.5 s) on loopback. The tests drive requests at the server and
read only the agent's ``/metrics`` for their assertions; the server's own answers
(``/slots``, the completion's ``timings``) are the yardstick for the KV formula.

The tests run in file order and share the session's server and agent: idle baseline, one
request (formula check), an 8-request burst on 4 slots, then kill and restart of the server.
"""

from __future__ import annotations

import random
import signal
import threading
import time
from typing import Any

import httpx
import pytest
from e2e_support import (
    AGENT_INTERVAL_S,
    LLAMA_CTX,
    LLAMA_SLOTS,
    Agent,
    LlamaServer,
    Samples,
    find,
    tail,
    value,
)

pytestmark = pytest.mark.e2e

ENGINE = {"engine": "llamacpp"}
BURST_REQUESTS = 8
BURST_PREDICT = 48
SINGLE_PREDICT = 128
POLL_S = 0.25

_WORDS = (
    "memory cache token slot queue server model request batch decode prefill context "
    "window pressure latency throughput kernel page swap disk network socket thread core "
    "river mountain forest ocean desert valley island harbor bridge tower garden market "
    "library museum station airport village castle temple meadow canyon glacier volcano "
    "apple bread cheese honey lemon olive pepper rice salt sugar tomato butter coffee tea "
    "red green blue yellow purple orange silver golden bright dark quiet loud slow fast "
    "walks reads writes builds opens closes moves lifts carries watches finds keeps sends "
    "morning evening winter summer spring autumn storm cloud rain snow wind sun moon star "
    "teacher doctor farmer sailor painter writer singer driver baker pilot engineer nurse"
).split()


def make_prompt(tag: str, n_words: int = 320) -> str:
    """A deterministic prompt of roughly ``n_words`` tokens that starts with ``tag``.

    Different tags differ from the first tokens on, so llama.cpp's prompt cache cannot
    reuse another request's prefix.
    """
    rng = random.Random(tag)
    words = [rng.choice(_WORDS) for _ in range(n_words)]
    sentences = [" ".join(words[i : i + 11]).capitalize() + "." for i in range(0, n_words, 11)]
    return f"{tag}: continue this story. " + " ".join(sentences)


def engine_view(samples: Samples, instance: str) -> dict[str, float | None]:
    """The agent's engine series for one llama.cpp instance."""
    lab = {**ENGINE, "instance": instance}
    return {
        "up": value(samples, "kvpressure_engine_up", **lab),
        "running": value(samples, "kvpressure_engine_requests_running", **lab),
        "waiting": value(samples, "kvpressure_engine_requests_waiting", **lab),
        "used": value(samples, "kvpressure_engine_kv_cache_used_tokens", **lab),
        "capacity": value(samples, "kvpressure_engine_kv_cache_capacity_tokens", **lab),
        "ratio": value(samples, "kvpressure_engine_kv_cache_usage_ratio", **lab),
    }


def wait_for(
    agent: Agent, instance: str, pred: Any, timeout_s: float, every_s: float = 0.05
) -> tuple[float, dict[str, float | None]]:
    """Scrape the agent until ``pred(view)``; returns (seconds waited, view)."""
    t0 = time.monotonic()
    view: dict[str, float | None] = {}
    while time.monotonic() - t0 < timeout_s:
        view = engine_view(agent.scrape(), instance)
        if pred(view):
            return time.monotonic() - t0, view
        time.sleep(every_s)
    raise AssertionError(f"condition not met within {timeout_s} s; last view {view}")


def n_decoded(slot: dict[str, Any]) -> int:
    """``next_token[0].n_decoded`` of a /slots entry."""
    return sum(int(nt.get("n_decoded", 0)) for nt in slot.get("next_token", []) or [])


def test_idle_baseline(agent: Agent, llama_server: LlamaServer, e2e_report: dict[str, Any]) -> None:
    """Engine up, idle, capacity = the server's context, host series present."""
    _, view = wait_for(
        agent, llama_server.instance, lambda v: v["up"] == 1 and v["capacity"] is not None, 10
    )
    # the host sampler publishes on its own thread: its first cycle may land after the
    # engine's first (seen once in CI, 2026-12-02); wait for it, bounded
    samples = agent.scrape()
    deadline = time.monotonic() + 10.0
    while value(samples, "kvpressure_host_memory_total_bytes") is None:
        assert time.monotonic() < deadline, "no host memory series 10 s after the engine was up"
        time.sleep(0.2)
        samples = agent.scrape()
    slots = llama_server.get_json("/slots")
    n_ctx_sum = sum(int(s["n_ctx"]) for s in slots)
    print(f"\n[e2e] idle view {view}; /slots n_ctx {[s['n_ctx'] for s in slots]}")
    e2e_report["idle"] = {"view": view, "slots_n_ctx": [s["n_ctx"] for s in slots]}
    assert len(slots) == LLAMA_SLOTS
    assert view["capacity"] == n_ctx_sum == LLAMA_CTX
    assert view["running"] == 0
    assert view["waiting"] == 0
    assert view["used"] == 0
    assert view["ratio"] == 0
    assert (value(samples, "kvpressure_host_memory_total_bytes") or 0) > 0
    # Every engine series carries engine and instance; model where the engine names it.
    for labels, _v in find(samples, "kvpressure_engine_requests_running", **ENGINE):
        assert labels["instance"] == llama_server.instance
    e2e_report["idle"]["model_label"] = sorted(
        {lab.get("model", "") for lab, _ in find(samples, "kvpressure_engine_kv_cache_used_tokens")}
    )


def test_kv_used_matches_server_numbers(
    agent: Agent, llama_server: LlamaServer, e2e_report: dict[str, Any]
) -> None:
    """One request: the agent's KV used tokens against llama.cpp's own counts.

    llama-server's own numbers: the completion answer's ``timings`` (``prompt_n`` computed,
    ``cache_n`` reused, ``predicted_n`` generated) and ``tokens_cached`` (tokens the slot
    holds at the end), and ``/slots``, whose ``n_prompt_tokens`` is the size of the slot's
    token list, i.e. the KV cells it holds: in this build it grows by one per decoded token
    (``server_slot::to_json`` reports ``prompt.tokens.size()``, and each sampled token is
    appended to it).
    """
    prompt = make_prompt("single-request")
    n_prompt = llama_server.n_tokens(prompt)
    assert n_prompt >= 300, n_prompt
    result: dict[str, Any] = {}

    def run() -> None:
        result.update(llama_server.complete(prompt, SINGLE_PREDICT))

    th = threading.Thread(target=run, daemon=True)
    t0 = time.monotonic()
    th.start()
    # (t, n_prompt_tokens, n_prompt_tokens_processed, n_prompt_tokens_cache, n_decoded)
    slot_obs: list[tuple[float, int, int, int, int]] = []
    agent_obs: list[tuple[float, float]] = []  # (t, used)
    ratio_pairs: list[tuple[float, float, float]] = []
    t_end = t0 + 120
    while th.is_alive() and time.monotonic() < t_end:
        for s in llama_server.get_json("/slots", timeout_s=30):
            if s.get("is_processing"):
                slot_obs.append(
                    (
                        round(time.monotonic() - t0, 3),
                        int(s.get("n_prompt_tokens", 0)),
                        int(s.get("n_prompt_tokens_processed", 0)),
                        int(s.get("n_prompt_tokens_cache", 0)),
                        n_decoded(s),
                    )
                )
        v = engine_view(agent.scrape(), llama_server.instance)
        if v["used"] is not None:
            agent_obs.append((round(time.monotonic() - t0, 3), v["used"]))
            if v["ratio"] is not None and v["capacity"]:
                ratio_pairs.append((v["used"], v["capacity"], v["ratio"]))
        time.sleep(0.1)
    th.join(timeout=5)
    assert result, "the completion request did not finish"

    timings = result["timings"]
    prompt_n = int(timings["prompt_n"])
    cache_n = int(timings.get("cache_n", 0))
    predicted_n = int(timings["predicted_n"])
    server_total = prompt_n + cache_n + predicted_n
    decoding = [o for o in slot_obs if o[4] >= 1]
    agent_used = [u for _, u in agent_obs]
    nonzero = [u for u in agent_used if u > 0]
    # The slot's KV tokens at each agent scrape, by the nearest /slots poll (for the report).
    paired = []
    for t, used in agent_obs:
        if used > 0 and slot_obs:
            near = min(slot_obs, key=lambda o: abs(o[0] - t))
            paired.append((t, used, near[1], near[4], round(near[0] - t, 3)))
    check = {
        "tokenize_n": n_prompt,
        "timings.prompt_n": prompt_n,
        "timings.cache_n": cache_n,
        "timings.predicted_n": predicted_n,
        "tokens_evaluated": result.get("tokens_evaluated"),
        "tokens_cached": result.get("tokens_cached"),
        "server_total(prompt_n+cache_n+predicted_n)": server_total,
        "slots_observations": len(slot_obs),
        "slots_max_n_prompt_tokens": max((o[1] for o in slot_obs), default=None),
        "slots_last(n_prompt_tokens,processed,cache,n_decoded)": slot_obs[-1][1:]
        if slot_obs
        else None,
        "agent_scrapes": len(agent_obs),
        "agent_max_used": max(agent_used, default=None),
        "agent_nonzero_scrapes": len(nonzero),
        "agent_vs_slots(t,agent_used,slots_n_prompt_tokens,slots_n_decoded,dt)": paired,
    }
    print(f"\n[e2e] KV formula check: {check}")
    e2e_report["formula_check"] = check

    assert predicted_n == SINGLE_PREDICT
    # The server counts the prompt as its tokenizer does (+ BOS at most).
    assert prompt_n + cache_n in (n_prompt, n_prompt + 1)
    assert result.get("tokens_evaluated") in (None, prompt_n + cache_n)
    # The slot ends holding prompt + generated tokens (the last sampled one is not decoded).
    assert result.get("tokens_cached") in (None, server_total - 1, server_total)
    # /slots: during decode, n_prompt_tokens = processed + cached + decoded, within one token
    # (the newest sampled token enters the KV cache with the next decode step).
    assert decoding, f"never saw the slot decoding: {slot_obs}"
    for _t, held, processed, cached, dec in decoding:
        assert abs(held - (processed + cached + dec)) <= 1, (held, processed, cached, dec)
    assert max(o[1] for o in slot_obs) <= server_total
    # The agent: KV used > 0 while the request runs, at least the prompt once decoding
    # started (scrapes every interval over ~3 s of decode), never more than the slot can hold.
    assert nonzero, f"agent never reported KV used > 0 during the request: {agent_obs}"
    assert max(nonzero) >= prompt_n + cache_n, (max(nonzero), prompt_n + cache_n)
    assert max(nonzero) <= server_total, (
        f"agent KV used {max(nonzero)} exceeds what the slot can hold ({server_total} = "
        f"prompt {prompt_n + cache_n} + generated {predicted_n}); decoded tokens counted twice?"
    )
    for used, cap, ratio in ratio_pairs:
        assert ratio == pytest.approx(used / cap, abs=1e-9)


def test_burst_saturates_slots_and_falls_back(
    agent: Agent, llama_server: LlamaServer, e2e_report: dict[str, Any]
) -> None:
    """8 concurrent 300+-token requests on 4 slots: running 4, waiting >= 1, KV in bounds."""
    prompts = [make_prompt(f"burst-{i}") for i in range(BURST_REQUESTS)]
    n_tokens = [llama_server.n_tokens(p) for p in prompts]
    assert min(n_tokens) >= 300, n_tokens
    assert max(n_tokens) + BURST_PREDICT < LLAMA_CTX // LLAMA_SLOTS, n_tokens

    results: list[dict[str, Any] | Exception | None] = [None] * BURST_REQUESTS
    barrier = threading.Barrier(BURST_REQUESTS)

    def run(i: int) -> None:
        barrier.wait(timeout=10)
        try:
            results[i] = llama_server.complete(prompts[i], BURST_PREDICT, timeout_s=150)
        except (httpx.HTTPError, ValueError) as e:  # report, don't hang the poller
            results[i] = e

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(BURST_REQUESTS)]
    t0 = time.monotonic()
    for th in threads:
        th.start()
    polls: list[dict[str, Any]] = []
    scrape_errors: list[str] = []
    deadline = t0 + 180
    while any(th.is_alive() for th in threads) and time.monotonic() < deadline:
        try:
            v = engine_view(agent.scrape(), llama_server.instance)
            polls.append({"t": round(time.monotonic() - t0, 2), **v})
        except httpx.HTTPError as e:
            scrape_errors.append(f"{time.monotonic() - t0:.2f}s {type(e).__name__}")
        time.sleep(POLL_S)
    burst_s = time.monotonic() - t0
    for th in threads:
        th.join(timeout=5)

    # After the burst: everything falls back to idle within a few intervals.
    settle_s, after = wait_for(
        agent,
        llama_server.instance,
        lambda v: v["running"] == 0 and v["waiting"] == 0 and v["used"] == 0,
        15,
    )

    def mx(key: str) -> float | None:
        vals = [p[key] for p in polls if p[key] is not None]
        return max(vals) if vals else None

    used_over_cap = [
        p
        for p in polls
        if p["used"] is not None and p["capacity"] is not None and p["used"] > p["capacity"]
    ]
    summary = {
        "requests": BURST_REQUESTS,
        "prompt_tokens": n_tokens,
        "n_predict": BURST_PREDICT,
        "burst_s": round(burst_s, 2),
        "polls": len(polls),
        "max_running": mx("running"),
        "max_waiting": mx("waiting"),
        "max_used_tokens": mx("used"),
        "capacity_tokens": mx("capacity"),
        "max_ratio": mx("ratio"),
        "polls_running_4": sum(1 for p in polls if p["running"] == LLAMA_SLOTS),
        "polls_waiting_ge_1": sum(1 for p in polls if (p["waiting"] or 0) >= 1),
        "polls_engine_down": sum(1 for p in polls if p["up"] != 1),
        "scrape_errors": scrape_errors,
        "settle_s_after_burst": round(settle_s, 2),
        "after": after,
        "timeline": [
            f"{p['t']}s up={p['up']} run={p['running']} wait={p['waiting']} "
            f"used={p['used']}/{p['capacity']}"
            for p in polls
        ],
    }
    print("\n[e2e] burst: " + ", ".join(f"{k}={v}" for k, v in summary.items() if k != "timeline"))
    print("[e2e] burst timeline:\n  " + "\n  ".join(summary["timeline"]))
    e2e_report["burst"] = summary

    failed = [r for r in results if not isinstance(r, dict)]
    assert not failed, f"burst requests failed: {failed}\n{tail(llama_server.log)}"
    assert all(int(r["timings"]["predicted_n"]) == BURST_PREDICT for r in results)
    assert summary["max_running"] == LLAMA_SLOTS, summary
    assert (summary["max_waiting"] or 0) >= 1, summary
    assert (summary["max_used_tokens"] or 0) > 0, summary
    assert summary["capacity_tokens"] == LLAMA_CTX, summary
    assert not used_over_cap, used_over_cap
    assert summary["polls_engine_down"] == 0, "engine read as down while it was serving"
    assert not scrape_errors, scrape_errors


def test_engine_down_detected_and_recovers(
    agent: Agent, llama_server: LlamaServer, e2e_report: dict[str, Any]
) -> None:
    """Kill the server: engine_up 0 within 3 intervals; restart it: back to 1, same agent."""
    wait_for(agent, llama_server.instance, lambda v: v["up"] == 1, 10)
    agent_pid = agent.proc.pid if agent.proc else None

    t_kill = time.monotonic()
    llama_server.kill()
    down_s, down_view = wait_for(agent, llama_server.instance, lambda v: v["up"] == 0, 10, 0.02)
    # While it is down the agent keeps sampling the host, and the engine never reads as idle.
    samples = agent.scrape()
    host_total = value(samples, "kvpressure_host_memory_total_bytes")
    down_view = engine_view(samples, llama_server.instance)

    ready_s = llama_server.start()
    t_ready = time.monotonic()
    up_s, up_view = wait_for(agent, llama_server.instance, lambda v: v["up"] == 1, 15, 0.02)
    _, idle_view = wait_for(
        agent, llama_server.instance, lambda v: v["running"] == 0 and v["capacity"] == LLAMA_CTX, 10
    )

    result = {
        "interval_s": AGENT_INTERVAL_S,
        "down_detect_s": round(down_s, 3),
        "down_detect_intervals": round(down_s / AGENT_INTERVAL_S, 2),
        "view_while_down": down_view,
        "server_restart_ready_s": round(ready_s, 2),
        "up_detect_after_ready_s": round(up_s, 3),
        "agent_pid_unchanged": agent.proc is not None and agent.proc.pid == agent_pid,
        "view_after_restart": idle_view,
    }
    print(f"\n[e2e] engine down/up: {result} (kill at t={t_kill:.2f}, ready at t={t_ready:.2f})")
    e2e_report["down_up"] = result

    assert down_s <= 3 * AGENT_INTERVAL_S, f"engine_up fell to 0 only after {down_s:.2f} s"
    assert host_total is not None and host_total > 0, "host sampling stopped with the engine"
    for key in ("running", "waiting", "used", "ratio"):
        assert down_view[key] != 0, f"a dead engine reads as idle: {key}=0 in {down_view}"
    assert agent.running(), f"agent exited:\n{tail(agent.stderr)}"
    assert result["agent_pid_unchanged"]
    assert up_view["up"] == 1


def test_agent_sigterm_with_engine_attached(
    make_agent: Any, llama_server: LlamaServer, e2e_report: dict[str, Any]
) -> None:
    """A second agent on the same engine serves its metrics and stops within 2 s on SIGTERM."""
    llama_server.ensure_running()
    second = make_agent(llama_server, "agent-sigterm")
    wait_for(second, llama_server.instance, lambda v: v["up"] == 1, 10)
    took = second.stop(signal.SIGTERM)
    e2e_report["sigterm_shutdown_s"] = round(took, 3)
    print(f"\n[e2e] agent SIGTERM shutdown took {took:.3f} s (rc={second.proc.returncode})")
    assert took <= 2.0, f"shutdown took {took:.2f} s\n{tail(second.stderr)}"
    assert second.proc is not None and second.proc.returncode == 0, tail(second.stderr)
