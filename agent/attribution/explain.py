"""``kvpressure explain``: the ``/api/v1/attributions`` document as text for an incident.

Sections, each skipped when empty: latency per phase (p50/p95/p99), slow requests by cause,
the strongest evidence per cause, when each cause dominated (merged 10 s windows), what
could not be assessed (engine metrics unavailable), and the slowest requests with their
top evidence. Times are local wall-clock ``HH:MM:SS``.
"""

from __future__ import annotations

import re
import time
from typing import Any

from agent.attribution.rules import RULES_BY_NAME

_DURATION = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(ms|s|m|h|d)?\s*$")
_UNIT_S = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, None: 1.0}


def parse_since(text: str) -> float:
    """Parse ``10m``, ``90s``, ``1h``, ``2d`` or a number of seconds into seconds.

    Raises:
        ValueError: not a positive duration.
    """
    m = _DURATION.match(text)
    if not m:
        raise ValueError(f"expected a duration such as 10m, 90s or 1h, got {text!r}")
    v = float(m.group(1)) * _UNIT_S[m.group(2)]
    if v <= 0:
        raise ValueError("the duration must be positive")
    return v


def _hms(t: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t))


def fmt_seconds(v: float | None) -> str:
    """``0.0123`` -> ``12.3ms``, ``2.5`` -> ``2.50s``; ``-`` for ``None``."""
    if v is None:
        return "-"
    if v < 1.0:
        return f"{v * 1000:.1f}ms"
    if v < 100:
        return f"{v:.2f}s"
    return f"{v:.0f}s"


def _fmt_value(v: float, unit: str) -> str:
    if unit == "seconds":
        return fmt_seconds(v)
    if unit == "ratio":
        return f"{v * 100:.0f}%"
    if unit == "bytes/s":
        return f"{v / 1e6:.1f} MB/s"
    suffix = "" if unit == "1" else f" {unit}"  # a count: "16", not "16.00 1"
    if unit == "1" and float(v).is_integer():
        return f"{v:.0f}"
    if abs(v) >= 100:
        return f"{v:.0f}{suffix}"
    return f"{v:.2f}{suffix}"


def _duration(s: float) -> str:
    if s >= 3600:
        return f"{s / 3600:.1f}h"
    if s >= 60:
        return f"{int(s // 60)}m{int(s % 60):02d}s"
    return f"{s:.0f}s"


def render(doc: dict[str, Any]) -> str:
    """Render an ``/api/v1/attributions`` document (see ``AttributionStore.query``)."""
    now, since = float(doc["time"]), float(doc["since"])
    out: list[str] = [
        f"kvpressure explain: last {_duration(now - since)} ({_hms(since)} - {_hms(now)})",
        "",
    ]
    reqs: dict[str, Any] = doc.get("requests", {})
    if not reqs:
        out.append("No requests in this period. Point clients at a proxy (proxies:) or send")
        out.append("OTLP traces to /v1/traces so the agent sees per-request latency.")
    else:
        out.append(f"{'ENGINE':<14} {'PHASE':<8} {'N':>7} {'P50':>9} {'P95':>9} {'P99':>9}")
        for eng, st in reqs.items():
            first = True
            for phase, q in st["phases"].items():
                out.append(
                    f"{eng if first else '':<14} {phase:<8} {q['n']:>7} "
                    f"{fmt_seconds(q['p50']):>9} {fmt_seconds(q['p95']):>9} "
                    f"{fmt_seconds(q['p99']):>9}"
                )
                first = False
            n, slow = st["requests"], st["slow"]
            outcomes = ", ".join(f"{k} {v}" for k, v in sorted(st["outcomes"].items()))
            pct = 100.0 * slow / n if n else 0.0
            out.append(f"{'':<14} {n} requests, {slow} slow ({pct:.1f} %); {outcomes}")
    by_cause: dict[str, dict[str, int]] = doc.get("slow_by_cause", {})
    if by_cause:
        out += ["", "SLOW REQUESTS BY CAUSE"]
        for eng, causes in by_cause.items():
            total = sum(causes.values())
            first = True
            for cause, n in sorted(causes.items(), key=lambda kv: -kv[1]):
                bar = "#" * max(1, round(20 * n / total))
                out.append(
                    f"{eng if first else '':<14} {cause:<15} {n:>6} {100 * n / total:5.1f} %  {bar}"
                )
                first = False
    ev: list[dict[str, Any]] = doc.get("evidence", [])
    if ev:
        out += ["", "STRONGEST EVIDENCE (median over the slow requests given that cause)"]
        last = ""
        for e in ev:
            rule = RULES_BY_NAME.get(e["signal"])
            what = rule.doc if rule else e["metric"]
            lab = ",".join(f"{k}={v}" for k, v in e.get("labels", {}).items() if v)
            out.append(
                f"{e['cause'] if e['cause'] != last else '':<15} {e['signal']:<22} "
                f"{_fmt_value(e['median'], e['unit']):>11} (threshold "
                f"{_fmt_value(e['threshold'], e['unit'])}) in {e['requests']}/{e['of']}: {what}"
                + (f" [{lab}]" if lab else "")
            )
            last = e["cause"]
    dom: list[dict[str, Any]] = doc.get("dominant", [])
    if dom:
        out += ["", "WHEN EACH CAUSE DOMINATED"]
        for d in dom:
            out.append(
                f"{_hms(d['start'])}-{_hms(d['end'])}  {d['engine']:<14} {d['cause']:<15} "
                f"{d['windows']} window(s), {d['slow']} slow"
            )
    una: list[dict[str, Any]] = doc.get("unassessed", [])
    if una:
        out += ["", "NOT ASSESSED"]
        for u in una:
            why = (
                "engine metrics unavailable (kvpressure_engine_up 0 or not scraped): KV, "
                "queue and preemption signals could not be read, so memory is not ruled out"
                if u["what"] == "engine_metrics"
                else u["what"]
            )
            out.append(f"{_hms(u['start'])}-{_hms(u['end'])}  {u['engine']:<14} {why}")
    atts: list[dict[str, Any]] = doc.get("attributions", [])
    if atts:
        out += ["", "SLOWEST REQUESTS"]
        for a in sorted(atts, key=lambda a: -a["latency_s"] / max(a["threshold_s"], 1e-9))[:10]:
            top = " ".join(
                f"{e['signal']}={_fmt_value(e['value'], e['unit'])}" for e in a["evidence"][:3]
            )
            flag = " (engine metrics unavailable)" if "engine_metrics" in a["unassessed"] else ""
            out.append(
                f"{_hms(a['end'])}  {a['engine']:<14} {a['phase']} {fmt_seconds(a['latency_s'])}"
                f" > {fmt_seconds(a['threshold_s'])} ({a['basis']})  {a['cause']}{flag}  {top}"
            )
    return "\n".join(out)
