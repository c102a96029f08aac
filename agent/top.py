"""``kvpressure top``: a full-screen live view of a running agent, drawn with ``rich``.

Every ``--interval`` seconds it reads the agent's ``GET /api/v1/snapshot`` and
``GET /api/v1/attributions?since=60s`` and draws:

- ENGINES: KV used/capacity, running, waiting, TTFT and TPOT (inter-token latency) p50/p99
  now: the engine's own windowed percentiles (``kvpressure_engine_latency_seconds``, last
  60 s) or, where the engine exports none, the agent's per-request records of the last
  minute (proxy or OTLP), marked ``*``.
- GPUS: memory used/reserved/total, utilization, memory bandwidth, the share of the time
  since the previous refresh spent stalled by reason (``kvpressure_accelerator_stall_
  seconds_total`` deltas), and the processes on each GPU with the engine they serve.
- HOST: memory available, swap, PSI 10 s averages.
- SLOW REQUESTS, LAST MINUTE: counts by cause per engine and the newest few.

``q`` (or Ctrl-C) quits. ``--once`` prints one frame to stdout and exits (for pipes and
scripts). A missing value is ``-``; an agent that stops answering is shown as such on the
screen, which keeps retrying.
"""

from __future__ import annotations

import contextlib
import select
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from kvpressure.agent import view
from kvpressure.agent.attribution.explain import fmt_seconds
from kvpressure.agent.view import STALL_REASONS, fmt_bytes, fmt_num, fmt_pct

SLOW_WINDOW_S = 60.0
"""How far back the SLOW REQUESTS panel and the request-based latency fallback look."""


WIDTH_WHEN_PIPED = 140
"""Columns of ``--once`` output when stdout is not a terminal (a terminal's own width wins)."""


@dataclass(slots=True)
class Frame:
    """What one refresh read from the agent.

    Attributes:
        at: Unix seconds of the read.
        snapshot: ``/api/v1/snapshot`` document, ``None`` when the agent did not answer.
        attributions: ``/api/v1/attributions?since=60s`` document, ``None`` when unavailable
            (an agent with attribution disabled answers 404).
        error: why the snapshot could not be read; empty when it was.
    """

    at: float
    snapshot: dict[str, Any] | None
    attributions: dict[str, Any] | None
    error: str = ""


def read_frame(client: httpx.Client, url: str) -> Frame:
    """Read one :class:`Frame` from the agent at ``url`` (never raises on HTTP errors)."""
    base = url.rstrip("/")
    now = time.time()
    try:
        r = client.get(base + "/api/v1/snapshot")
        r.raise_for_status()
        snap = r.json()
        if not isinstance(snap, dict):
            raise ValueError("the snapshot is not a JSON object")
    except (httpx.HTTPError, ValueError) as exc:
        return Frame(now, None, None, f"no agent answering at {url} ({exc})")
    atts: dict[str, Any] | None = None
    try:
        r = client.get(
            base + "/api/v1/attributions", params={"since": f"{SLOW_WINDOW_S:g}", "limit": "20"}
        )
        if r.status_code == 200:
            body = r.json()
            atts = body if isinstance(body, dict) else None
    except (httpx.HTTPError, ValueError):
        atts = None
    return Frame(now, snap, atts)


@dataclass(slots=True)
class StallRates:
    """Turns the cumulative stall counters of successive frames into shares of time.

    ``update`` returns, per GPU and reason, stalled seconds / elapsed seconds between this
    frame and the previous one (0-1); a GPU or reason seen for the first time, or whose
    counter went backwards (agent restart), has no share yet.
    """

    _prev: dict[tuple[str, str], tuple[float, float]] = field(default_factory=dict)

    def update(self, at: float, gpus: list[view.GpuRow]) -> dict[tuple[str, str], float]:
        """Shares of time stalled since the previous call, keyed by ``(gpu, reason)``."""
        out: dict[tuple[str, str], float] = {}
        cur: dict[tuple[str, str], tuple[float, float]] = {}
        for g in gpus:
            for reason, total in g.stall_s.items():
                key = (g.gpu, reason)
                cur[key] = (at, total)
                prev = self._prev.get(key)
                if prev is not None and at > prev[0] and total >= prev[1]:
                    out[key] = min(1.0, (total - prev[1]) / (at - prev[0]))
        self._prev = cur
        return out


def _table(title: str, *cols: tuple[str, str]) -> Table:
    t = Table(
        title=title,
        title_justify="left",
        title_style="bold",
        box=None,
        pad_edge=False,
        expand=False,
        header_style="bold cyan",
    )
    for name, justify in cols:
        t.add_column(name, justify=justify, no_wrap=True)  # type: ignore[arg-type]
    return t


def _request_latency(atts: dict[str, Any] | None, engine: str, phase: str) -> dict[str, Any]:
    if not atts:
        return {}
    st = atts.get("requests", {}).get(engine, {})
    q = st.get("phases", {}).get(phase)
    return q if isinstance(q, dict) else {}


def _lat(gauge: float | None, fallback: dict[str, Any], key: str) -> str:
    if gauge is not None:
        return fmt_seconds(gauge)
    v = fallback.get(key)
    return fmt_seconds(float(v)) + "*" if isinstance(v, int | float) else "-"


COMPACT_BELOW = 120
"""Terminal columns under which ``top`` drops the engine's instance and merges the stall
columns, so an 80-column terminal shows every value without ellipses."""


def engines_table(
    snap: view.Snap, atts: dict[str, Any] | None, compact: bool = False
) -> tuple[Table, bool]:
    """The ENGINES panel (see the module docstring).

    Args:
        snap: the snapshot.
        atts: the last minute's attributions document, if any.
        compact: leave out the ``instance`` column (narrow terminals).

    Returns:
        The table, and whether a latency cell came from the request records (``*``).
    """
    lat_heads = ("TTFT50", "TTFT99", "TPOT50", "TPOT99") if compact else (
        "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99"
    )  # fmt: skip
    t = _table(
        "ENGINES",
        ("ENGINE", "left"),
        *((("INSTANCE", "left"),) if not compact else ()),
        ("UP", "right"),
        ("KV USED", "right"),
        ("KV TOKENS", "right"),
        ("RUN", "right"),
        ("WAIT", "right"),
        *((h, "right") for h in lat_heads),
    )
    rows = view.engines(snap)
    starred = False
    for e in rows:
        ttft = _request_latency(atts, e.engine, "ttft")
        tpot = _request_latency(atts, e.engine, "itl")
        lats = [
            _lat(e.ttft_p50, ttft, "p50"),
            _lat(e.ttft_p99, ttft, "p99"),
            _lat(e.tpot_p50, tpot, "p50"),
            _lat(e.tpot_p99, tpot, "p99"),
        ]
        starred = starred or any(x.endswith("*") for x in lats)
        tokens = (
            f"{fmt_num(e.kv_used)}/{fmt_num(e.kv_capacity)}"
            if e.kv_used is not None or e.kv_capacity is not None
            else "-"
        )
        up = Text(fmt_num(e.up), style="red" if e.up == 0 else "")
        t.add_row(
            e.engine,
            *((e.instance,) if not compact else ()),
            up,
            fmt_pct(e.kv_ratio),
            tokens,
            fmt_num(e.running),
            fmt_num(e.waiting),
            *lats,
        )
    if not rows:
        t.caption = "(no engines configured or discovered)"
        t.caption_justify = "left"
    return t, starred


_STALL_HEAD = {"idle_with_queue": "IDLE+QUEUE", "memory_bound": "MEM-BOUND",
               "throttled": "THROTTLED"}  # fmt: skip


def gpus_table(
    snap: view.Snap,
    stall: dict[tuple[str, str], float],
    samplers: list[dict[str, Any]],
    compact: bool = False,
) -> RenderableType:
    """The GPUS panel: one row per GPU, its processes below it (see the module docstring).

    ``compact`` (narrow terminals) merges the three stall shares into one ``i/m/t`` column
    (idle with queue / memory-bound / throttled).
    """
    rows = view.gpus(snap)
    if not rows:
        gpu = next((s for s in samplers if s.get("sampler") == "gpu"), None)
        state = view.sampler_state(gpu) if gpu else "not running"
        why = ", ".join(
            f"{x['source']}: {x.get('reason') or x.get('state')}"
            for x in (gpu or {}).get("sources", [])
            if x.get("state") != "ok"
        )
        return Text.assemble(("GPUS", "bold"), f"  {state}" + (f" ({why})" if why else ""))
    stall_cols = (("STALL i/m/t", "right"),) if compact else tuple(
        (_STALL_HEAD[r], "right") for r in STALL_REASONS
    )  # fmt: skip
    t = _table(
        "GPUS  (stalled: share of the time since the last refresh, by reason)",
        ("GPU", "left"),
        ("NAME / PROCESS", "left"),
        ("MEM USED", "right"),
        ("RESERVED", "right"),
        ("TOTAL", "right"),
        ("UTIL", "right"),
        ("BW" if compact else "MEM BW", "right"),
        *stall_cols,
    )
    if compact:
        t.columns[1].max_width = 14
        t.columns[1].overflow = "ellipsis"
    for g in rows:
        shares = [fmt_pct(stall.get((g.gpu, r)), ".0f") for r in STALL_REASONS]
        if compact:
            nums = [x.removesuffix("%") for x in shares]
            shares = ["-" if all(x == "-" for x in nums) else "/".join(nums) + "%"]
        t.add_row(
            g.gpu,
            Text(g.name or "-", style="bold") if g.up != 0 else Text("(lost)", style="red"),
            fmt_bytes(g.used),
            fmt_bytes(g.reserved),
            fmt_bytes(g.total),
            fmt_pct(g.utilization, ".0f"),
            fmt_pct(g.bandwidth, ".0f"),
            *shares,
        )
        for p in g.processes:
            who = f"  pid {p.pid} {p.process}" + (f" -> {p.engine}" if p.engine else "")
            t.add_row("", who, fmt_bytes(p.memory))
    return t


def host_text(snap: view.Snap) -> Text:
    """The HOST line: memory, swap, PSI avg10."""
    h = view.host(snap)
    swap = fmt_bytes(h.swap_used) + (
        f" of {fmt_bytes(h.swap_total)}" if h.swap_total is not None else ""
    )
    psi = "  ".join(f"{k} {v * 100:.1f}%" for k, v in h.psi.items()) or "unavailable"
    return Text.assemble(
        ("HOST", "bold"),
        f"  memory available {fmt_bytes(h.available)} of {fmt_bytes(h.total)}"
        f"  swap used {swap}\n      psi avg10  {psi}",
    )


def slow_panel(atts: dict[str, Any] | None) -> RenderableType:
    """SLOW REQUESTS, LAST MINUTE: counts by cause per engine, then the newest five."""
    title = Text("SLOW REQUESTS, LAST MINUTE", style="bold")
    if atts is None:
        return Text.assemble(title, "  unavailable (attribution disabled or not answering)")
    by_cause: dict[str, dict[str, int]] = atts.get("slow_by_cause", {})
    reqs: dict[str, Any] = atts.get("requests", {})
    if not by_cause:
        n = sum(int(st.get("requests", 0)) for st in reqs.values())
        return Text.assemble(title, f"  none ({n} request(s) seen)")
    t = _table("", ("ENGINE", "left"), ("CAUSE", "left"),
               ("SLOW", "right"), ("OF", "right"))  # fmt: skip
    for eng, causes in by_cause.items():
        total = reqs.get(eng, {}).get("requests")
        for i, (cause, n) in enumerate(sorted(causes.items(), key=lambda kv: -kv[1])):
            t.add_row(eng if i == 0 else "", cause, str(n), fmt_num(total) if i == 0 else "")
    newest = _table("", ("AT", "left"), ("ENGINE", "left"), ("PHASE", "left"),
                    ("LATENCY", "right"), ("LIMIT", "right"), ("CAUSE", "left"),
                    ("EVIDENCE", "left"))  # fmt: skip
    for a in list(atts.get("attributions", []))[-5:][::-1]:
        ev = " ".join(str(e.get("signal", "")) for e in a.get("evidence", [])[:2])
        newest.add_row(
            time.strftime("%H:%M:%S", time.localtime(float(a.get("end", 0)))),
            str(a.get("engine", "")),
            str(a.get("phase", "")),
            fmt_seconds(a.get("latency_s")),
            fmt_seconds(a.get("threshold_s")),
            str(a.get("cause", "")),
            ev,
        )
    return Group(title, t, newest)


def render_frame(
    frame: Frame, stall: dict[tuple[str, str], float], url: str, width: int | None = None
) -> RenderableType:
    """The whole screen for one frame.

    ``width`` (terminal columns) picks the compact layout below :data:`COMPACT_BELOW`.
    """
    compact = width is not None and width < COMPACT_BELOW
    clock = time.strftime("%H:%M:%S", time.localtime(frame.at))
    if frame.snapshot is None:
        return Group(
            Text(f"kvpressure top  {url}  {clock}  (q quits)", style="bold"),
            Text(""),
            Text(frame.error, style="red"),
            Text("retrying..."),
        )
    snap = view.Snap(frame.snapshot)
    samplers: list[dict[str, Any]] = frame.snapshot.get("samplers", [])
    uptime = frame.snapshot.get("uptime_s")
    head = Text(
        f"kvpressure {frame.snapshot.get('version', '?')} top  {url}  {clock}  uptime "
        f"{fmt_num(uptime if isinstance(uptime, int | float) else None)} s  (q quits)",
        style="bold",
    )
    notes = [
        f"{s.get('sampler')}: {view.sampler_state(s)}"
        + (f" ({s['reason']})" if s.get("reason") else "")
        for s in samplers
        if view.sampler_state(s) != "up"
    ]
    engines, starred = engines_table(snap, frame.attributions, compact)
    parts: list[RenderableType] = [
        head,
        Text(""),
        engines,
        Text("* from the agent's request records of the last minute" if starred else ""),
        gpus_table(snap, stall, samplers, compact),
        Text(""),
        host_text(snap),
        Text(""),
        slow_panel(frame.attributions),
    ]
    if notes:
        parts += [Text(""), Text("samplers not up: " + "; ".join(notes), style="yellow")]
    return Group(*parts)


@contextlib.contextmanager
def _keys() -> Iterator[bool]:
    """Put a terminal stdin in cbreak mode; yields whether key presses can be read."""
    if not sys.stdin.isatty():
        yield False
        return
    import termios
    import tty

    fd = sys.stdin.fileno()
    old = termios.tcgetattr(fd)
    try:
        tty.setcbreak(fd)
        yield True
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, old)


def _wait_for_quit(seconds: float, keys: bool) -> bool:
    """Wait up to ``seconds``; True when ``q`` was pressed."""
    if not keys:
        time.sleep(seconds)
        return False
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        ready, _, _ = select.select([sys.stdin], [], [], left)
        if ready:
            ch = sys.stdin.read(1)
            if ch in ("q", "Q", ""):
                return True
    return False


def run_top(url: str, interval_s: float, timeout_s: float, once: bool = False) -> int:
    """Run the live view until ``q``; returns the exit code.

    Args:
        url: agent base URL.
        interval_s: seconds between refreshes.
        timeout_s: HTTP timeout per request, seconds.
        once: print a single frame to stdout and exit (1 when no agent answers).
    """
    stall = StallRates()
    with httpx.Client(timeout=timeout_s) as client:
        if once:
            frame = read_frame(client, url)
            if frame.snapshot is not None:
                gpus = view.gpus(view.Snap(frame.snapshot))
                stall.update(frame.at, gpus)
                time.sleep(min(interval_s, 1.0))
                frame = read_frame(client, url)
            rates = (
                stall.update(frame.at, view.gpus(view.Snap(frame.snapshot)))
                if frame.snapshot is not None
                else {}
            )
            if frame.snapshot is None:  # as ``status``: one line on stderr, exit 1
                print(f"kvpressure top: {frame.error}",
                      file=sys.stderr)  # fmt: skip
                return 1
            out = Console()
            if not out.is_terminal:
                out = Console(width=WIDTH_WHEN_PIPED)
            out.print(render_frame(frame, rates, url, out.width))
            return 0
        console = Console()
        try:
            with (
                _keys() as keys,
                Live(console=console, screen=True, auto_refresh=False) as live,
            ):
                while True:
                    frame = read_frame(client, url)
                    rates = (
                        stall.update(frame.at, view.gpus(view.Snap(frame.snapshot)))
                        if frame.snapshot is not None
                        else {}
                    )
                    live.update(render_frame(frame, rates, url, console.width), refresh=True)
                    if _wait_for_quit(interval_s, keys):
                        return 0
        except KeyboardInterrupt:
            return 0
