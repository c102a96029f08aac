"""``kvpressure explain``: the ``/api/v1/attributions`` document as text for an incident.

Sections, each skipped when empty: latency per phase (p50/p95/p99), slow requests by cause,
what to change for each cause that scored (one line each),
the strongest evidence per cause, when each cause dominated (merged 10 s windows), what
could not be assessed (engine metrics unavailable), and the slowest requests with their
top evidence. Times are local wall-clock ``HH:MM:SS``.
"""

from __future__ import annotations

import re
import time
from typing import Any

from kvpressure.agent.attribution.model import REMEDIES
from kvpressure.agent.attribution.rules import RULES_BY_NAME

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


_RATE_NOUN = {
    "allocstalls": "stalls/s",
    "cgroup_memory_limit_hits": "hits/s",
    "major_faults": "faults/s",
    "tcp_retransmits": "segments/s",
    "net_errors": "errors/s",
}
"""What a ``1/s`` rule counts, so ``5.05 1/s`` reads ``5.05 segments/s``."""

_HOST_FAMILIES = ("kvpressure_host_", "kvpressure_disk_", "kvpressure_net_", "kvpressure_psi_")


def is_host_wide(evidence: dict[str, Any]) -> bool:
    """True when an evidence item measured the whole host, not the engine.

    Host memory, swap, faults, disks and network counters are host-wide (other tenants'
    traffic or I/O shows in them too); PSI is host-wide at ``scope=system`` and the
    engine's own at ``scope=<engine>`` (its cgroup).

    Args:
        evidence: an evidence dict of the ``/api/v1/attributions`` document (``metric``,
            ``labels``).
    """
    metric = str(evidence.get("metric", ""))
    if not metric.startswith(_HOST_FAMILIES):
        return False
    scope = (evidence.get("labels") or {}).get("scope")
    return scope in (None, "", "system")


def fmt_value(v: float, unit: str, signal: str = "") -> str:
    """An evidence value in its unit, e.g. ``0.65`` ratio -> ``65%``.

    ``5.05`` ``1/s`` of ``tcp_retransmits`` reads ``5.05 segments/s``; a whole count reads
    ``16``.
    """
    if unit == "1/s":
        return f"{v:.2f} {_RATE_NOUN.get(signal, 'events/s')}"
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


def header(doc: dict[str, Any]) -> str:
    """The first line: the window observed, and why it is shorter than asked if it is."""
    now, since = float(doc["time"]), float(doc["since"])
    line = f"kvpressure explain: last {_duration(now - since)} ({_hms(since)} - {_hms(now)})"
    requested = doc.get("requested_since")
    if isinstance(requested, int | float) and requested < since - 0.5:
        line += (
            f", since the agent started (--since asked for {_duration(now - requested)};"
            " nothing was observed before the start)"
        )
    return line


def causes_of(a: dict[str, Any], min_score: float) -> str:
    """``memory 0.71, network 0.30``: every cause at or above ``min_score``, strongest first."""
    scores = {k: float(v) for k, v in a.get("scores", {}).items() if float(v) >= min_score}
    if not scores:
        return str(a.get("cause", "unknown"))
    return ", ".join(f"{k} {v:.2f}" for k, v in sorted(scores.items(), key=lambda kv: -kv[1]))


def render(doc: dict[str, Any]) -> str:
    """Render an ``/api/v1/attributions`` document (see ``AttributionStore.query``).

    Args:
        doc: the decoded document; ``requested_since`` and ``min_score`` are optional (older
            agents send neither; ``min_score`` then reads as 0.3, the default).

    Returns:
        The text ``kvpressure explain`` prints: latency over the requests that succeeded
        (failures counted beside them), slow requests by primary cause and by every cause
        that scored at least ``min_score``, the strongest evidence (host-wide evidence
        marked ``[host-wide]``), when each cause dominated, what was not assessed, and the
        slowest requests with every cause that scored.
    """
    min_score = float(doc.get("min_score", 0.3))
    out: list[str] = [header(doc), ""]
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
            pct = 100.0 * slow / n if n else 0.0
            failed = {k: v for k, v in sorted(st["outcomes"].items()) if k != "ok"}
            line = f"{'':<14} {n} requests, {slow} slow ({pct:.1f} %)"
            if "failed" in st:  # an agent that leaves failures out of the percentiles
                line += f"; percentiles over the {st['ok']} ok"
                if failed:
                    line += ", failed left out: " + ", ".join(f"{k} {v}" for k, v in failed.items())
            else:
                line += "; " + ", ".join(f"{k} {v}" for k, v in sorted(st["outcomes"].items()))
            out.append(line)
            if st.get("slo_missed_not_slow"):
                out.append(
                    f"{'':<14} {st['slo_missed_not_slow']} more missed an SLO but cost what "
                    "a request of their size costs on this engine (not slow: capacity, not an "
                    "incident)"
                )
    by_cause: dict[str, dict[str, int]] = doc.get("slow_by_cause", {})
    scored: dict[str, dict[str, int]] = doc.get("scored_by_cause", {})
    if by_cause:
        out += [
            "",
            "SLOW REQUESTS BY CAUSE (PRIMARY: the cause named; SCORED: requests where the "
            f"cause scored >= {min_score:g})",
            f"{'':<14} {'CAUSE':<15} {'PRIMARY':>7} {'':>7}  {'':<20} {'SCORED':>6}",
        ]
        for eng, causes in by_cause.items():
            total = sum(causes.values())
            also = scored.get(eng, {})
            first = True
            names = sorted(
                set(causes) | set(also), key=lambda c: (-causes.get(c, 0), -also.get(c, 0))
            )
            for cause in names:
                n = causes.get(cause, 0)
                bar = "#" * round(20 * n / total) if n else ""
                share = f"{100 * n / total:5.1f} %" if n else ""
                sc = str(also[cause]) if cause in also else ("-" if cause == "unknown" else "0")
                out.append(
                    f"{eng if first else '':<14} {cause:<15} {n:>7} {share:>7}  {bar:<20} {sc:>6}"
                )
                first = False
    acted = [
        c
        for c in dict.fromkeys(
            [c for causes in by_cause.values() for c in causes]
            + [c for causes in scored.values() for c in causes]
        )
        if c in REMEDIES
    ]
    if acted:
        out += ["", "WHAT TO CHANGE (every cause that scored >= "
                f"{min_score:g} in a slow request)"]  # fmt: skip
        out += [f"{c:<21} {REMEDIES[c]}" for c in acted]
    ev: list[dict[str, Any]] = doc.get("evidence", [])
    if ev:
        out += ["", "STRONGEST EVIDENCE (median over the slow requests where that cause scored)"]
        last = ""
        for e in ev:
            rule = RULES_BY_NAME.get(e["signal"])
            what = rule.doc if rule else e["metric"]
            lab = ",".join(f"{k}={v}" for k, v in e.get("labels", {}).items() if v)
            tags = [x for x in (lab, "host-wide" if is_host_wide(e) else "") if x]
            unit, sig = e["unit"], e["signal"]
            out.append(
                f"{e['cause'] if e['cause'] != last else '':<15} {sig:<22} "
                f"{fmt_value(e['median'], unit, sig):>11} (threshold "
                f"{fmt_value(e['threshold'], unit, sig)}) in {e['requests']}/{e['of']}: {what}"
                + "".join(f" [{t}]" for t in tags)
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
            why = {
                "engine_metrics": "engine metrics unavailable (kvpressure_engine_up 0 or not "
                "scraped): KV, queue and preemption signals could not be read, so memory is "
                "not ruled out",
                "engine_metrics_stale": "engine statistics stale (token counters frozen while "
                "its gauges claimed running requests or a full KV cache): KV, queue and "
                "preemption gauges were not used as evidence",
            }.get(u["what"], u["what"])
            out.append(f"{_hms(u['start'])}-{_hms(u['end'])}  {u['engine']:<14} {why}")
    atts: list[dict[str, Any]] = doc.get("attributions", [])
    if atts:
        out += ["", "SLOWEST REQUESTS"]
        for a in sorted(atts, key=lambda a: -a["latency_s"] / max(a["threshold_s"], 1e-9))[:10]:
            top = " ".join(
                f"{e['signal']}={fmt_value(e['value'], e['unit'], e['signal'])}"
                + (" (host-wide)" if is_host_wide(e) else "")
                for e in a["evidence"][:3]
            )
            flag = " (engine metrics unavailable)" if "engine_metrics" in a["unassessed"] else ""
            if "engine_metrics_stale" in a["unassessed"]:
                flag += " (engine statistics stale)"
            slow_ph = [p["phase"] for p in a.get("slow_phases", [])]
            extra = f" [slow: {', '.join(slow_ph)}]" if len(slow_ph) > 1 else ""
            out.append(
                f"{_hms(a['end'])}  {a['engine']:<14} {a['phase']} {fmt_seconds(a['latency_s'])}"
                f" > {fmt_seconds(a['threshold_s'])} ({a['basis']}){extra}  "
                f"{causes_of(a, min_score)}{flag}  {top}"
            )
    return "\n".join(out)
