"""The ``kvpressure`` command.

Subcommands: ``run``, ``check-config``, ``status``, ``default-config``, ``metrics``,
``plan``, ``explain``.

Exit codes: 0 success; 1 invalid config, or no agent answering (``status``); 2 usage error.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from collections.abc import Sequence
from typing import Any

from agent import __version__, logs
from agent.config import (
    Config,
    ConfigError,
    default_text,
    load,
    load_default,
    with_overrides,
)

log = logging.getLogger("agent")


def _cmd_run(args: argparse.Namespace) -> int:
    # Command-line settings win over the file's, at start and at every reload (SIGHUP).
    overrides = {
        k: v
        for k, v in (
            ("listen", args.listen),
            ("log_level", args.log_level),
            ("web_config_file", args.web_config_file),
        )
        if v
    }
    try:
        cfg: Config = (
            load(args.config, overrides)
            if args.config
            else with_overrides(load_default(), overrides, "<command line>")
        )
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 1
    logs.setup(cfg.log_level)
    from agent.daemon import Daemon
    from agent.listener import raise_fd_limit

    soft, hard = raise_fd_limit()
    log.debug("open files limit", extra={"kv": {"soft": soft, "hard": hard}})

    try:
        daemon = Daemon(cfg, args.config, overrides=overrides)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 1
    log.info(
        "kvpressure starting",
        extra={"kv": {"version": __version__, "config": args.config or "<embedded default>"}},
    )
    try:
        asyncio.run(daemon.run())
    except OSError as exc:
        log.error("cannot start", extra={"kv": {"error": str(exc)}})
        return 1
    except KeyboardInterrupt:  # pragma: no cover - SIGINT is handled by the loop
        pass
    return 0


def _cmd_check_config(args: argparse.Namespace) -> int:
    try:
        cfg = load(args.file)
        if cfg.web_config_file:
            from agent.webconfig import load_web_config

            load_web_config(cfg.web_config_file)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 1
    print(
        f"{args.file}: ok ({len(cfg.engines)} engine(s), {len(cfg.proxies)} prox"
        f"{'y' if len(cfg.proxies) == 1 else 'ies'}, listen {cfg.listen})"
    )
    return 0


def _fmt_bytes(v: float | None) -> str:
    if v is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(v) < 1024 or unit == "TiB":
            return f"{v:.1f} {unit}" if unit != "B" else f"{v:.0f} B"
        v /= 1024
    return "-"  # pragma: no cover


def _fmt(v: float | None, spec: str = ".0f") -> str:
    return "-" if v is None else format(v, spec)


def render_status(snap: dict[str, Any]) -> str:
    """Render an ``/api/v1/snapshot`` document as the compact ``status`` table.

    Args:
        snap: the decoded JSON snapshot (see :mod:`agent.api`).

    Returns:
        Multi-line text: host memory and PSI, one row per engine, one row per sampler.
        Values the agent does not have are shown as ``-``.
    """

    def one(name: str, **labels: str) -> float | None:
        for s in snap.get("samples", []):
            if s["name"] == name and all(s["labels"].get(k) == v for k, v in labels.items()):
                return float(s["value"])
        return None

    lines = [f"kvpressure {snap.get('version', '?')}  uptime {snap.get('uptime_s', 0):.0f} s", ""]
    total = one("kvpressure_host_memory_total_bytes")
    avail = one("kvpressure_host_memory_available_bytes")
    swap = one("kvpressure_host_swap_used_bytes")
    lines.append(
        f"host memory  total {_fmt_bytes(total)}  available {_fmt_bytes(avail)}  "
        f"swap used {_fmt_bytes(swap)}"
    )
    psi = []
    for res in ("cpu", "memory", "io"):
        for kind in ("some", "full"):
            v = one("kvpressure_psi_avg10_ratio", resource=res, kind=kind, scope="system")
            if v is not None:
                psi.append(f"{res}.{kind} {v * 100:.1f}%")
    lines.append("psi avg10    " + ("  ".join(psi) if psi else "unavailable"))
    lines.append("")
    engines = sorted(
        {
            (s["labels"].get("engine", ""), s["labels"].get("instance", ""))
            for s in snap.get("samples", [])
            if s["name"] == "kvpressure_engine_up"
        }
    )
    lines.append(
        f"{'ENGINE':<16} {'INSTANCE':<22} {'UP':<3} {'KV USED':>8} {'KV TOKENS':>17} "
        f"{'RUNNING':>7} {'WAITING':>7}"
    )
    if not engines:
        lines.append("(no engines configured or discovered)")
    for eng, inst in engines:
        lab = {"engine": eng, "instance": inst}
        up = one("kvpressure_engine_up", **lab)
        ratio = one("kvpressure_engine_kv_cache_usage_ratio", **lab)
        used = one("kvpressure_engine_kv_cache_used_tokens", **lab)
        cap = one("kvpressure_engine_kv_cache_capacity_tokens", **lab)
        tokens = f"{_fmt(used)}/{_fmt(cap)}" if used is not None or cap is not None else "-"
        lines.append(
            f"{eng:<16} {inst:<22} {_fmt(up):<3} "
            f"{('-' if ratio is None else f'{ratio * 100:.1f}%'):>8} {tokens:>17} "
            f"{_fmt(one('kvpressure_engine_requests_running', **lab)):>7} "
            f"{_fmt(one('kvpressure_engine_requests_waiting', **lab)):>7}"
        )
    lines.append("")
    lines.append(f"{'SAMPLER':<28} {'UP':<4} {'DURATION':>9}  NOTES")
    for s in snap.get("samplers", []):
        notes = [
            f"{x['source']}:{x['state']}" + (f"({x['reason']})" if x["reason"] else "")
            for x in s.get("sources", [])
            if x["state"] != "ok"
        ]
        if s.get("reason"):
            notes.insert(0, s["reason"])
        lines.append(
            f"{s['sampler']:<28} {('yes' if s['up'] else 'NO'):<4} "
            f"{s['duration_s'] * 1000:>7.1f}ms  {' '.join(notes)}"
        )
    return "\n".join(lines)


def _cmd_status(args: argparse.Namespace) -> int:
    import httpx

    url = args.url.rstrip("/") + "/api/v1/snapshot"
    try:
        resp = httpx.get(url, timeout=args.timeout)
        resp.raise_for_status()
        snap = resp.json()
    except (httpx.HTTPError, ValueError) as exc:
        print(f"kvpressure status: no agent answering at {args.url} ({exc})", file=sys.stderr)
        return 1
    print(json.dumps(snap, indent=2) if args.json else render_status(snap))
    return 0


def _cmd_default_config(_: argparse.Namespace) -> int:
    sys.stdout.write(default_text())
    return 0


def _cmd_metrics(args: argparse.Namespace) -> int:
    from agent.catalogue import markdown_table

    print(markdown_table())
    return 0


def _cmd_plan(args: argparse.Namespace) -> int:
    from agent.capacity.plan import run_plan

    return run_plan(args)


def _cmd_explain(args: argparse.Namespace) -> int:
    """``kvpressure explain``: exit 0, 1 when no agent answers, 2 for a bad ``--since``."""
    import httpx

    from agent.attribution.explain import parse_since, render

    try:
        since_s = parse_since(args.since)
    except ValueError as exc:
        print(f"kvpressure explain: --since: {exc}", file=sys.stderr)
        return 2
    params = {"since": f"{since_s:g}", "limit": "200"}
    if args.engine:
        params["engine"] = args.engine
    url = args.url.rstrip("/") + "/api/v1/attributions"
    try:
        resp = httpx.get(url, params=params, timeout=args.timeout)
        resp.raise_for_status()
        doc = resp.json()
    except (httpx.HTTPError, ValueError) as exc:
        print(f"kvpressure explain: no agent answering at {args.url} ({exc})", file=sys.stderr)
        return 1
    print(json.dumps(doc, indent=2) if args.json else render(doc))
    return 0


def build_parser() -> argparse.ArgumentParser:
    """Return the argument parser of the ``kvpressure`` command."""
    p = argparse.ArgumentParser(prog="kvpressure", description=__doc__)
    p.add_argument("--version", action="version", version=f"kvpressure {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run the agent (embedded default config unless --config)")
    run.add_argument("--config", "-c", help="YAML config file")
    run.add_argument("--listen", help="override the listen address (host:port)")
    run.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    run.add_argument(
        "--web.config.file",
        dest="web_config_file",
        help="Prometheus exporter web-config file: TLS and basic auth of the listener",
    )
    run.set_defaults(func=_cmd_run)

    chk = sub.add_parser("check-config", help="validate a config file (exit 1 when invalid)")
    chk.add_argument("file")
    chk.set_defaults(func=_cmd_check_config)

    st = sub.add_parser("status", help="show a running agent's snapshot")
    st.add_argument("--url", default="http://127.0.0.1:9470", help="agent base URL")
    st.add_argument("--json", action="store_true", help="print the raw snapshot JSON")
    st.add_argument("--timeout", type=float, default=3.0, help="seconds")
    st.set_defaults(func=_cmd_status)

    dc = sub.add_parser("default-config", help="print the embedded default config")
    dc.set_defaults(func=_cmd_default_config)

    mt = sub.add_parser("metrics", help="print the metric catalogue as a Markdown table")
    mt.set_defaults(func=_cmd_metrics)

    # --- capacity: kvpressure plan ----------------------------------------------------
    pl = sub.add_parser(
        "plan",
        help="KV capacity what-if: per-request KV, requests that fit, doubling users, tiers",
    )
    src = pl.add_mutually_exclusive_group()
    src.add_argument("--hf-config", metavar="PATH", help="Hugging Face config.json (or its dir)")
    src.add_argument("--gguf", metavar="PATH", help="GGUF model file")
    pl.add_argument("--agent", metavar="URL", help="running agent (live capacity, knee, GPU)")
    pl.add_argument("--engine", help="engine label at the agent (when it sees several)")
    pl.add_argument("--kv-dtype", default="auto", help="KV dtype (auto, f16, bf16, fp8, q8_0..)")
    pl.add_argument("--gpu-memory", metavar="SIZE", help="memory of one accelerator, e.g. 80GiB")
    pl.add_argument("--live-gpu", action="store_true", help="use the agent's GPU memory total")
    pl.add_argument("--gpus", type=int, default=1, help="accelerators the model spans")
    pl.add_argument("--memory-utilization", type=float, default=0.90, help="usable share")
    pl.add_argument(
        "--weights", "--weights-bytes", metavar="SIZE", help="weight bytes (default: inferred)"
    )
    pl.add_argument("--overhead", metavar="SIZE", help="activations per accelerator (2GiB)")
    pl.add_argument("--context", default="2k,8k,32k", help="context lengths, e.g. 2k,8k,32k")
    pl.add_argument("--concurrency", type=int, default=16, help="concurrent users now")
    pl.add_argument("--output-tokens", type=int, default=256, help="output tokens per request")
    pl.add_argument(
        "--tier", action="append", metavar="NAME=SIZE@BW", help="offload tier, e.g. dram=512GiB"
    )
    pl.add_argument("--prefill-rate", type=float, metavar="S", help="prefill seconds per token")
    pl.add_argument("--swa-full", action="store_true", help="no sliding-window savings")
    pl.add_argument("--json", action="store_true", help="print JSON")
    pl.set_defaults(func=_cmd_plan)

    # --- attribution: kvpressure explain ----------------------------------------------
    ex = sub.add_parser(
        "explain", help="why requests were slow: latency per phase, causes, evidence, when"
    )
    ex.add_argument("--since", default="10m", help="look back this long (10m, 90s, 1h)")
    ex.add_argument("--url", default="http://127.0.0.1:9470", help="agent base URL")
    ex.add_argument("--engine", help="only this engine label")
    ex.add_argument("--json", action="store_true", help="print the raw JSON document")
    ex.add_argument("--timeout", type=float, default=5.0, help="seconds")
    ex.set_defaults(func=_cmd_explain)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``kvpressure`` console script; returns the exit code."""
    args = build_parser().parse_args(argv)
    rc: int = args.func(args)
    return rc


if __name__ == "__main__":
    sys.exit(main())
