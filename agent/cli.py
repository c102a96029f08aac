"""The ``kvpressure`` command.

Subcommands: ``run``, ``check-config``, ``status``, ``top``, ``default-config``,
``metrics``, ``plan``, ``explain``, ``gpu record``, ``export``.

Exit codes: 0 success; 1 invalid config, or no agent answering (``status``); 2 usage error.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any, Final

from kvpressure.agent import __version__, logs
from kvpressure.agent.config import (
    Config,
    ConfigError,
    default_text,
    load,
    load_default,
    read_token,
    with_overrides,
)

log = logging.getLogger("kvpressure.agent")

GIL_SWITCH_INTERVAL_S: Final = 0.001
"""``sys.setswitchinterval`` of ``kvpressure run``: how long a thread may keep the GIL while
the event loop waits for it, in seconds (Python's default is 0.005)."""
GC_THRESHOLDS: Final = (10_000, 10, 10)
"""``gc.set_threshold`` of ``kvpressure run`` (Python's default: 700, 10, 10)."""
MALLOC_ARENAS: Final = 1
"""glibc malloc arenas of ``kvpressure run`` (``mallopt(M_ARENA_MAX)``), unless the environment
sets ``MALLOC_ARENA_MAX``. glibc gives each thread that allocates an arena of its own, up to
8 per core; the agent's threads hold the GIL while they allocate, so a second arena buys no
concurrency, only memory it keeps for itself. On the standard 8-GPU node
(``benchmarks/node_rss.py``, three runs side by side) one arena held 1.1-1.6 MiB less than
two for the first 10 minutes and 0.7 MiB less at 14 (2 arenas instead of glibc's default had
cut ~4 MiB before)."""
_M_ARENA_MAX: Final = -8  # glibc's <malloc.h>


def limit_malloc_arenas(arenas: int = MALLOC_ARENAS) -> bool:
    """Cap glibc's malloc arenas at ``arenas`` for this process, before threads start.

    Leaves the cap alone when the environment sets ``MALLOC_ARENA_MAX`` (glibc read it at
    start) and does nothing on a C library without ``mallopt`` (musl).

    Returns:
        True when the cap was set here.
    """
    if os.environ.get("MALLOC_ARENA_MAX"):
        return False
    import ctypes

    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(mallopt(_M_ARENA_MAX, arenas))


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
    # logfmt from the first line: loading the config may already warn (a deprecated key);
    # the config's own level applies once it is read
    logs.setup(args.log_level or "info")
    limit_malloc_arenas()  # before any thread: each would take an arena of its own
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
    from kvpressure.agent.daemon import Daemon
    from kvpressure.agent.httpd import raise_fd_limit

    soft, hard = raise_fd_limit()
    # Threads decoding OTLP exports or building API answers hold the GIL for up to the
    # switch interval each time the event loop wants it back; 1 ms instead of Python's 5 ms
    # keeps /healthz and proxied streams answering under that load
    # (benchmarks/healthz_under_load.py: p99 beside three 4 MB exporters 274 -> 85 ms).
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    log.debug("open files limit", extra={"kv": {"soft": soft, "hard": hard}})

    try:
        daemon = Daemon(cfg, args.config, overrides=overrides)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 1
    # The cyclic collector's full passes walk every tracked object: what start-up built
    # (modules, catalogue, config) lives as long as the process, so it is frozen out of
    # them; young passes run every 10,000 allocations instead of 700 (a 1 MB scrape
    # allocates ~100,000 objects, nearly all freed by reference counting). On the 8-GPU
    # node (benchmarks/node_cost.py) the collector took ~7 % of the agent's CPU.
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)
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
            from kvpressure.agent.webconfig import load_web_config

            load_web_config(cfg.web_config_file)
        if cfg.otlp_receiver.bearer_token_file:
            read_token(cfg.otlp_receiver.bearer_token_file)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 1
    from kvpressure.agent import pipeline

    for msg in pipeline.starved(cfg):
        print(f"{args.file}: warning: {msg}", file=sys.stderr)
    print(
        f"{args.file}: ok ({len(cfg.engines)} engine(s), {len(cfg.proxies)} prox"
        f"{'y' if len(cfg.proxies) == 1 else 'ies'}, listen {cfg.listen})"
    )
    return 0


def render_status(snap: dict[str, Any]) -> str:
    """Render an ``/api/v1/snapshot`` document as the compact ``status`` table.

    Args:
        snap: the decoded JSON snapshot (see :mod:`agent.api`).

    Returns:
        Multi-line text: host memory and PSI, one row per engine, one row per GPU (memory
        used/reserved/total, utilization, memory bandwidth) followed by its processes, and
        one row per sampler with its state (``up``, ``down``, ``unsupported``). Values the
        agent does not have are shown as ``-``.
    """
    from kvpressure.agent import view
    from kvpressure.agent.view import fmt_bytes, fmt_num, fmt_pct

    sn = view.Snap(snap)
    uptime = snap.get("uptime_s")
    lines = [
        f"kvpressure {snap.get('version', '?')}  uptime "
        f"{fmt_num(uptime if isinstance(uptime, int | float) else None)} s",
        "",
    ]
    h = view.host(sn)
    lines.append(
        f"host memory  total {fmt_bytes(h.total)}  available {fmt_bytes(h.available)}  "
        f"swap used {fmt_bytes(h.swap_used)}"
    )
    psi = [f"{k} {v * 100:.1f}%" for k, v in h.psi.items()]
    lines.append("psi avg10    " + ("  ".join(psi) if psi else "unavailable"))
    lines.append("")
    lines.append(
        f"{'ENGINE':<16} {'INSTANCE':<22} {'UP':<3} {'KV USED':>8} {'KV TOKENS':>17} "
        f"{'RUNNING':>7} {'WAITING':>7}"
    )
    engines = view.engines(sn)
    if not engines:
        lines.append("(no engines configured or discovered)")
    for e in engines:
        tokens = (
            f"{fmt_num(e.kv_used)}/{fmt_num(e.kv_capacity)}"
            if e.kv_used is not None or e.kv_capacity is not None
            else "-"
        )
        lines.append(
            f"{e.engine:<16} {e.instance:<22} {fmt_num(e.up):<3} {fmt_pct(e.kv_ratio):>8} "
            f"{tokens:>17} {fmt_num(e.running):>7} {fmt_num(e.waiting):>7}"
        )
    lines.append("")
    lines += _gpu_lines(sn, snap.get("samplers", []))
    lines.append("")
    lines.append(f"{'SAMPLER':<28} {'STATE':<11} {'DURATION':>9}  NOTES")
    for s in snap.get("samplers", []):
        notes = [
            f"{x['source']}:{x['state']}" + (f"({x['reason']})" if x.get("reason") else "")
            for x in s.get("sources", [])
            if x.get("state") != "ok"
        ]
        if s.get("reason"):
            notes.insert(0, s["reason"])
        dur = s.get("duration_s")
        lines.append(
            f"{s.get('sampler', '?'):<28} {view.sampler_state(s):<11} "
            f"{fmt_num(dur * 1000 if isinstance(dur, int | float) else None, '.1f'):>7}ms  "
            f"{' '.join(notes)}".rstrip()
        )
    return "\n".join(lines)


def _gpu_lines(sn: Any, samplers: list[dict[str, Any]]) -> list[str]:
    """The GPU section of ``status``: one row per GPU, then its processes indented."""
    from kvpressure.agent import view
    from kvpressure.agent.view import fmt_bytes, fmt_pct

    rows = view.gpus(sn)
    if not rows:
        gpu = next((s for s in samplers if s.get("sampler") == "gpu"), None)
        if gpu is None:
            return ["GPU  (gpu sampler not running)"]
        why = [
            f"{x['source']}: {x.get('reason') or x.get('state')}"
            for x in gpu.get("sources", [])
            if x.get("state") != "ok"
        ]
        return [f"GPU  {view.sampler_state(gpu)}" + (f" ({'; '.join(why)})" if why else "")]
    out = [
        f"{'GPU':<6} {'NAME':<20} {'MEM USED':>10} {'RESERVED':>10} {'TOTAL':>10} "
        f"{'USED%':>6} {'UTIL':>5} {'MEM BW':>6}"
    ]
    for g in rows:
        used_pct = g.used / g.total if g.used is not None and g.total else None
        name = (g.name or "-") if g.up != 0 else "(lost)"
        out.append(
            f"{g.gpu:<6} {name[:20]:<20} {fmt_bytes(g.used):>10} {fmt_bytes(g.reserved):>10} "
            f"{fmt_bytes(g.total):>10} {fmt_pct(used_pct, '.0f'):>6} "
            f"{fmt_pct(g.utilization, '.0f'):>5} {fmt_pct(g.bandwidth, '.0f'):>6}"
        )
        for p in g.processes:
            out.append(
                f"  pid {p.pid:<8} {p.process[:16]:<16} {fmt_bytes(p.memory):>10}"
                + (f"  engine {p.engine}" if p.engine else "")
            )
    return out


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


def _cmd_top(args: argparse.Namespace) -> int:
    """``kvpressure top``: exit 0 on ``q``; 1 with ``--once`` when no agent answers."""
    from kvpressure.agent.top import run_top

    if args.interval <= 0:
        print("kvpressure top: --interval must be positive", file=sys.stderr)
        return 2
    return run_top(args.url, args.interval, args.timeout, once=args.once)


def _cmd_default_config(_: argparse.Namespace) -> int:
    sys.stdout.write(default_text())
    return 0


def _cmd_metrics(args: argparse.Namespace) -> int:
    from kvpressure.agent.catalogue import markdown_table

    print(markdown_table())
    return 0


def _cmd_gpu_record(args: argparse.Namespace) -> int:
    import datetime

    import yaml

    from kvpressure.agent.samplers import nvml_codes as nc
    from kvpressure.agent.samplers.fake_nvml.record import record
    from kvpressure.agent.samplers.nvml_factory import bind

    try:
        binding = bind(args.binding)
        profile = record(binding, seconds=args.seconds)
    except (nc.NvmlError, OSError, ValueError) as exc:
        print(f"kvpressure gpu record: {exc}", file=sys.stderr)
        return 1
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    header = (
        f"# Fake NVML profile recorded by `kvpressure gpu record` ({args.binding}) at {when}.\n"
        "# null = NVML_ERROR_NOT_SUPPORTED; errors: {function: NVML return code}.\n"
        f"# Replay with gpu.binding: fake:{args.file}\n"
    )
    text = header + yaml.safe_dump(profile, sort_keys=False)
    try:
        with open(args.file, "w", encoding="utf-8") as f:
            f.write(text)
    except OSError as exc:
        print(f"kvpressure gpu record: {exc}", file=sys.stderr)
        return 1
    print(f"{args.file}: {profile['gpus']} GPU(s) recorded")
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    from pathlib import Path

    from kvpressure.agent.export import export

    try:
        done = export(args.what, Path(args.dir), force=args.force)
    except (OSError, KeyError) as exc:
        print(f"kvpressure export: {exc}", file=sys.stderr)
        return 1
    for path, action in done:
        print(f"{action:9}  {path}")
    if any(a == "kept" for _, a in done):
        print(
            "kvpressure export: files that differ were kept; --force replaces them", file=sys.stderr
        )
    return 0


def _cmd_plan(args: argparse.Namespace) -> int:
    from kvpressure.agent.capacity.plan import run_plan

    return run_plan(args)


def _cmd_explain(args: argparse.Namespace) -> int:
    """``kvpressure explain``: exit 0; 1 no agent answers; 2 bad ``--since`` or unknown engine.

    An ``--engine`` the agent does not know is named with the engines it knows.
    """
    import httpx

    from kvpressure.agent.attribution.explain import parse_since, render

    try:
        since_s = parse_since(args.since)
    except ValueError as exc:
        print(f"kvpressure explain: --since: {exc}", file=sys.stderr)
        return 2
    from kvpressure.agent.api import MAX_ATTRIBUTIONS_LIMIT

    limit = MAX_ATTRIBUTIONS_LIMIT if args.html else 200
    params = {"since": f"{since_s:g}", "limit": str(limit)}
    if args.engine:
        params["engine"] = args.engine
    url = args.url.rstrip("/") + "/api/v1/attributions"
    try:
        resp = httpx.get(url, params=params, timeout=args.timeout)
    except httpx.HTTPError as exc:
        print(f"kvpressure explain: no agent answering at {args.url} ({exc})", file=sys.stderr)
        return 1
    try:
        doc = resp.json()
    except ValueError:
        doc = None
    if resp.status_code != 200 or not isinstance(doc, dict):
        why = doc.get("error") if isinstance(doc, dict) else None
        print(
            f"kvpressure explain: the agent at {args.url} answered HTTP {resp.status_code}"
            + (f": {why}" if why else " without a JSON document"),
            file=sys.stderr,
        )
        return 1
    known = doc.get("engines") if isinstance(doc, dict) else None
    if args.engine and isinstance(known, list) and args.engine not in known:
        print(
            f"kvpressure explain: the agent at {args.url} knows no engine {args.engine!r}; "
            + (f"it knows: {', '.join(known)}" if known else "it knows none yet"),
            file=sys.stderr,
        )
        return 2
    if args.html:
        return _write_html(args, doc)
    print(json.dumps(doc, indent=2) if args.json else render(doc))
    return 0


def _write_html(args: argparse.Namespace, doc: dict[str, Any]) -> int:
    """Write ``explain --html FILE`` (the knee comes from the agent's snapshot); exit 0 or 1."""
    import httpx

    from kvpressure.agent.attribution.report import render_html

    snap: dict[str, Any] | None = None
    try:
        resp = httpx.get(args.url.rstrip("/") + "/api/v1/snapshot", timeout=args.timeout)
        resp.raise_for_status()
        got = resp.json()
        snap = got if isinstance(got, dict) else None
    except (httpx.HTTPError, ValueError):
        snap = None  # the page says there is no knee
    page = render_html(doc, snap, args.engine)
    try:
        with open(args.html, "w", encoding="utf-8") as f:
            f.write(page)
    except OSError as exc:
        print(f"kvpressure explain: cannot write {args.html}: {exc}", file=sys.stderr)
        return 1
    n = len(doc.get("attributions", []))
    print(f"kvpressure explain: wrote {args.html} ({n} slow request(s), {len(page):,} bytes)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """Return the argument parser of the ``kvpressure`` command."""
    p = argparse.ArgumentParser(
        prog="kvpressure",
        description="Memory-pressure observability for LLM inference: samples GPU, host and "
        "engine memory, KV occupancy and request latency, and explains slow requests.",
        epilog="Exit codes: 0 success; 1 invalid config, or no agent answering; 2 usage error. "
        "Start with: kvpressure run (embedded default config), then kvpressure status.",
    )
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

    tp = sub.add_parser("top", help="full-screen live view of a running agent (q quits)")
    tp.add_argument("--url", default="http://127.0.0.1:9470", help="agent base URL")
    tp.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes")
    tp.add_argument("--timeout", type=float, default=3.0, help="seconds")
    tp.add_argument("--once", action="store_true", help="print one frame to stdout and exit")
    tp.set_defaults(func=_cmd_top)

    dc = sub.add_parser("default-config", help="print the embedded default config")
    dc.set_defaults(func=_cmd_default_config)

    mt = sub.add_parser("metrics", help="print the metric catalogue as a Markdown table")
    mt.set_defaults(func=_cmd_metrics)

    gpu = sub.add_parser("gpu", help="GPU tools").add_subparsers(dest="gpu_command", required=True)
    rec = gpu.add_parser(
        "record",
        help="record this machine's NVML answers (errors included) into a fake NVML profile",
    )
    rec.add_argument("file", help="profile file to write (replay: gpu.binding: fake:FILE)")
    rec.add_argument("--binding", default="nvml", help="NVML binding to record (default nvml)")
    rec.add_argument("--seconds", type=float, default=1.0, help="rate measurement time")
    rec.set_defaults(func=_cmd_gpu_record)

    from kvpressure.agent.export import BUNDLES

    xp = sub.add_parser(
        "export", help="write the shipped dashboards, rules, systemd unit or manifests to DIR"
    )
    xp.add_argument(
        "what",
        choices=sorted(BUNDLES),
        help="; ".join(f"{k}: {b.what}" for k, b in sorted(BUNDLES.items())),
    )
    xp.add_argument("dir", help="folder to write into (created when missing)")
    xp.add_argument("--force", action="store_true", help="replace files that differ")
    xp.set_defaults(func=_cmd_export)

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
    out = ex.add_mutually_exclusive_group()
    out.add_argument("--json", action="store_true", help="print the raw JSON document")
    out.add_argument(
        "--html", metavar="FILE", help="write a self-contained HTML page with charts to FILE"
    )
    ex.add_argument("--timeout", type=float, default=5.0, help="seconds")
    ex.set_defaults(func=_cmd_explain)
    return p


EXIT_BROKEN_PIPE = 141
"""Exit code when the reader of stdout went away (128 + SIGPIPE, as ``cat | head`` gives)."""


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``kvpressure`` console script; returns the exit code.

    A reader that closes stdout early (``kvpressure metrics | head``) ends the command
    quietly with :data:`EXIT_BROKEN_PIPE`, without a ``BrokenPipeError`` traceback.
    """
    args = build_parser().parse_args(argv)
    try:
        rc: int = args.func(args)
        sys.stdout.flush()  # a closed pipe surfaces here, not at interpreter exit
    except BrokenPipeError:
        # Python's documented recipe: point stdout at devnull so the exit-time flush of
        # the rest of the buffer cannot raise again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return EXIT_BROKEN_PIPE
    return rc


if __name__ == "__main__":
    sys.exit(main())
