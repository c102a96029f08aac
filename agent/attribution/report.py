"""``kvpressure explain --html FILE``: one self-contained HTML page of an incident.

The page holds everything inline (CSS, and SVG charts drawn with ``pygal`` with its
JavaScript turned off): it opens from a file, a mail attachment or a ticket, offline, with
no external asset. It shows:

- latency per phase over the window (the ``explain`` table: requests that succeeded;
  failures counted beside them);
- the latency knee: TTFT and inter-token latency p50/p99 per KV-occupancy band
  (``kvpressure_kv_occupancy_latency_seconds`` from the agent's snapshot, cumulative since
  the agent started);
- causes over time: slow requests per window by primary cause, stacked;
- when each cause dominated, what could not be assessed;
- the slowest requests with every cause that scored and their evidence (host-wide evidence
  marked).

Data sources: the ``/api/v1/attributions`` document (see
:meth:`agent.attribution.store.AttributionStore.query`) and, for the knee, the
``/api/v1/snapshot`` document (see :mod:`agent.api`). A missing part is said to be missing,
never drawn as zeros.
"""

from __future__ import annotations

import html
import re
import time
from collections import Counter
from typing import Any

from kvpressure.agent.attribution.explain import (
    causes_of,
    fmt_seconds,
    fmt_value,
    header,
    is_host_wide,
)
from kvpressure.agent.attribution.model import ALL_CAUSES, UNKNOWN
from kvpressure.agent.capacity import knee

_CAUSE_ORDER = (*ALL_CAUSES, UNKNOWN)
_COLORS = {
    "memory": "#d62728",
    "storage": "#8c564b",
    "network": "#1f77b4",
    "compute": "#ff7f0e",
    "concurrency": "#2ca02c",
    "prefill_interference": "#17becf",
    "gpu_fault": "#9467bd",
    "engine_restart": "#7f7f7f",
    "unknown": "#bcbd22",
}

_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:24px;
color:#222;background:#fff;max-width:1100px}
h1{font-size:22px;margin:0 0 4px} h2{font-size:17px;margin:28px 0 8px;border-bottom:1px solid #ddd}
.sub{color:#555;margin:0 0 16px} .note{color:#666;font-size:13px}
table{border-collapse:collapse;font-size:13px;margin:6px 0}
th,td{border-bottom:1px solid #eee;padding:3px 8px;text-align:left;vertical-align:top}
th{background:#f5f5f5} td.n{text-align:right;font-variant-numeric:tabular-nums}
.tag{background:#eef;border-radius:3px;padding:0 4px;font-size:11px;color:#335}
.chart{margin:6px 0 0}
"""


def _e(x: object) -> str:
    return html.escape(str(x), quote=True)


def _hms(t: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t))


_SCRIPT = re.compile(r"<script\b[^>]*>.*?</script>", re.S)


def _svg(chart: Any) -> str:
    """Render a pygal chart as inline SVG (no XML declaration, no script).

    With ``js=[]`` pygal loads no script, but still writes its config as an inline
    ``<script>`` for the tooltips it would load; inert without them, it is dropped.
    """
    return _SCRIPT.sub("", str(chart.render(is_unicode=True)))


def _style(colors: tuple[str, ...] = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e")) -> Any:
    import pygal.style

    return pygal.style.Style(
        background="white",
        plot_background="white",
        font_family="system-ui, Helvetica, Arial, sans-serif",
        colors=colors,
        opacity="1",
        opacity_hover="1",
        label_font_size=12,
        major_label_font_size=12,
        legend_font_size=12,
        title_font_size=14,
    )


def knee_charts(snapshot: dict[str, Any] | None, engine: str | None) -> str:
    """The knee: TTFT and ITL p50/p99 per KV-occupancy band, as two inline SVG bar charts.

    Args:
        snapshot: the ``/api/v1/snapshot`` document, or ``None`` when it was not read.
        engine: one engine's bands, or ``None`` for every engine's buckets summed.

    Returns:
        HTML: the charts, or a sentence saying why there are none.
    """
    if snapshot is None:
        return '<p class="note">No snapshot was read, so no knee.</p>'
    samples = [
        (str(s.get("name", "")), dict(s.get("labels", {})), float(s.get("value", 0.0)))
        for s in snapshot.get("samples", [])
        if str(s.get("name", "")).startswith(knee.METRIC)
    ]
    stats = knee.stats_from_samples(samples, engine)
    if not stats:
        return (
            '<p class="note">No latency per KV-occupancy band yet: the agent needs requests '
            "(a proxy or OTLP traces) while it reads the engine's KV occupancy.</p>"
        )
    import pygal

    out = []
    bands = [b[0] for b in knee.BANDS]
    for phase, title in (("ttft", "TTFT"), ("itl", "Inter-token latency")):
        by_band = {s.band: s for s in stats if s.phase == phase}
        if not by_band:
            continue
        chart = pygal.Bar(
            js=[],
            disable_xml_declaration=True,
            width=520,
            height=300,
            style=_style(),
            title=f"{title} per KV-occupancy band (%)",
            x_title="KV occupancy band (%)",
            y_title="seconds",
            value_formatter=lambda v: fmt_seconds(v) if v is not None else "-",
            print_values=False,
            truncate_label=-1,
            legend_at_bottom=True,
            margin=8,
        )
        chart.x_labels = [f"{b} ({by_band[b].count:.0f})" if b in by_band else b for b in bands]
        for q in ("p50", "p99"):
            chart.add(
                f"{title.split()[0]} {q}",
                [getattr(by_band[b], q) if b in by_band else None for b in bands],
            )
        out.append(
            f'<div class="chart" style="display:inline-block;width:520px">{_svg(chart)}</div>'
        )
    out.append(
        '<p class="note">Per band: observations in it (in brackets: requests for TTFT, '
        "token gaps or decode cycles for inter-token latency), since the agent started. "
        "Latency that bends upward in the high bands is the knee: where filling the KV cache "
        "starts to cost time.</p>"
    )
    return "\n".join(out)


def causes_chart(doc: dict[str, Any]) -> str:
    """Slow requests per window by primary cause, stacked (inline SVG), or a sentence."""
    atts: list[dict[str, Any]] = doc.get("attributions", [])
    if not atts:
        return '<p class="note">No slow requests in this window.</p>'
    import pygal

    spans = [w["end"] - w["start"] for w in doc.get("windows", []) if w["end"] > w["start"]]
    step = spans[0] if spans else 10.0
    since, now = float(doc["since"]), float(doc["time"])
    first = since - since % step
    n = max(1, min(360, int((now - first) // step) + 1))
    if (now - first) // step + 1 > n:  # very long windows: coarser bins
        step = (now - first) / n
    counts: dict[str, Counter[int]] = {}
    for a in atts:
        i = min(n - 1, max(0, int((float(a["end"]) - first) // step)))
        counts.setdefault(str(a["cause"]), Counter())[i] += 1
    causes = sorted(counts, key=lambda c: _CAUSE_ORDER.index(c) if c in _CAUSE_ORDER else 99)
    chart = pygal.StackedBar(
        js=[],
        disable_xml_declaration=True,
        width=1000,
        height=320,
        style=_style(tuple(_COLORS.get(c, "#333") for c in causes)),
        title=f"Slow requests per {step:.0f} s window, by primary cause",
        y_title="slow requests",
        x_label_rotation=30,
        show_minor_x_labels=False,
        legend_at_bottom=True,
        margin=8,
    )
    chart.x_labels = [_hms(first + i * step) for i in range(n)]
    chart.x_labels_major = chart.x_labels[:: max(1, n // 12)]
    for c in causes:
        chart.add(c, [counts[c][i] or None for i in range(n)])
    return f'<div class="chart">{_svg(chart)}</div>'


def _latency_table(doc: dict[str, Any]) -> str:
    reqs: dict[str, Any] = doc.get("requests", {})
    if not reqs:
        return (
            '<p class="note">No requests in this period. Point clients at a proxy (proxies:) '
            "or send OTLP traces to /v1/traces so the agent sees per-request latency.</p>"
        )
    rows = []
    for eng, st in reqs.items():
        for phase, q in st.get("phases", {}).items():
            rows.append(
                f"<tr><td>{_e(eng)}</td><td>{_e(phase)}</td><td class=n>{q['n']}</td>"
                + "".join(
                    f"<td class=n>{_e(fmt_seconds(q[k]))}</td>" for k in ("p50", "p95", "p99")
                )
                + "</tr>"
            )
        failed = {k: v for k, v in sorted(st.get("outcomes", {}).items()) if k != "ok"}
        fail = ", ".join(f"{k} {v}" for k, v in failed.items()) or "none"
        rows.append(
            f'<tr><td></td><td colspan=5 class="note">{st["requests"]} requests, '
            f"{st['slow']} slow; percentiles over the {st.get('ok', st['requests'])} ok; "
            f"failed (left out): {_e(fail)}</td></tr>"
        )
    return (
        "<table><tr><th>engine</th><th>phase</th><th>n</th><th>p50</th><th>p95</th>"
        "<th>p99</th></tr>" + "".join(rows) + "</table>"
    )


def _by_cause_table(doc: dict[str, Any]) -> str:
    prim: dict[str, dict[str, int]] = doc.get("slow_by_cause", {})
    if not prim:
        return ""
    scored: dict[str, dict[str, int]] = doc.get("scored_by_cause", {})
    rows = []
    for eng, causes in prim.items():
        also = scored.get(eng, {})
        for c in sorted(set(causes) | set(also), key=lambda c: -causes.get(c, 0)):
            rows.append(
                f'<tr><td>{_e(eng)}</td><td><span style="color:{_COLORS.get(c, "#333")}">'
                f"&#9632;</span> {_e(c)}</td><td class=n>{causes.get(c, 0)}</td>"
                f"<td class=n>{also.get(c, '-')}</td></tr>"
            )
    return (
        "<table><tr><th>engine</th><th>cause</th><th>primary</th>"
        f"<th>scored &ge; {_e(doc.get('min_score', 0.3))}</th></tr>" + "".join(rows) + "</table>"
    )


def _ranges_table(doc: dict[str, Any]) -> str:
    parts = []
    dom = doc.get("dominant", [])
    if dom:
        parts.append(
            "<h2>When each cause dominated</h2><table><tr><th>from</th><th>to</th>"
            "<th>engine</th><th>cause</th><th>windows</th><th>slow</th></tr>"
            + "".join(
                f"<tr><td>{_hms(d['start'])}</td><td>{_hms(d['end'])}</td><td>{_e(d['engine'])}"
                f"</td><td>{_e(d['cause'])}</td><td class=n>{d['windows']}</td>"
                f"<td class=n>{d['slow']}</td></tr>"
                for d in dom
            )
            + "</table>"
        )
    una = doc.get("unassessed", [])
    if una:
        parts.append(
            "<h2>Not assessed</h2><table><tr><th>from</th><th>to</th><th>engine</th>"
            "<th>what</th></tr>"
            + "".join(
                f"<tr><td>{_hms(u['start'])}</td><td>{_hms(u['end'])}</td>"
                f"<td>{_e(u['engine'])}</td><td>{_e(u['what'])}: could not be read, so "
                "memory is not ruled out</td></tr>"
                for u in una
            )
            + "</table>"
        )
    return "\n".join(parts)


def _slowest_table(doc: dict[str, Any], n: int = 20) -> str:
    atts: list[dict[str, Any]] = doc.get("attributions", [])
    if not atts:
        return ""
    min_score = float(doc.get("min_score", 0.3))
    rows = []
    for a in sorted(atts, key=lambda a: -a["latency_s"] / max(a["threshold_s"], 1e-9))[:n]:
        ev = "<br>".join(
            f"{_e(e['signal'])} = {_e(fmt_value(e['value'], e['unit'], e['signal']))} "
            f"(threshold {_e(fmt_value(e['threshold'], e['unit'], e['signal']))}, "
            f"{_e(e['cause'])} {float(e['score']):.2f})"
            + (' <span class="tag">host-wide</span>' if is_host_wide(e) else "")
            for e in a.get("evidence", [])[:5]
        )
        if "engine_metrics" in a.get("unassessed", []):
            ev += '<br><span class="tag">engine metrics unavailable</span>'
        rows.append(
            f"<tr><td>{_hms(a['end'])}</td><td>{_e(a['engine'])}</td><td>{_e(a['phase'])}</td>"
            f"<td class=n>{_e(fmt_seconds(a['latency_s']))}</td>"
            f"<td class=n>{_e(fmt_seconds(a['threshold_s']))} ({_e(a['basis'])})</td>"
            f"<td>{_e(causes_of(a, min_score))}</td><td>{ev or '-'}</td></tr>"
        )
    return (
        "<h2>Slowest requests</h2><table><tr><th>ended</th><th>engine</th><th>phase</th>"
        "<th>latency</th><th>limit</th><th>causes (score)</th><th>evidence</th></tr>"
        + "".join(rows)
        + "</table>"
    )


def render_html(
    doc: dict[str, Any], snapshot: dict[str, Any] | None = None, engine: str | None = None
) -> str:
    """The whole page for an ``/api/v1/attributions`` document.

    Args:
        doc: the attributions document (what ``kvpressure explain --json`` prints).
        snapshot: the agent's ``/api/v1/snapshot`` document, for the knee; ``None`` to skip.
        engine: the ``--engine`` the document was asked for, or ``None``.

    Returns:
        A complete HTML5 document (UTF-8 text) with no external reference.
    """
    title = header(doc).removeprefix("kvpressure explain: ")
    return "\n".join(
        [
            "<!DOCTYPE html>",
            '<html lang="en"><head><meta charset="utf-8">',
            f"<title>kvpressure explain: {_e(title)}</title>",
            f"<style>{_CSS}</style></head><body>",
            "<h1>Why were requests slow?</h1>",
            f'<p class="sub">kvpressure explain: {_e(title)}'
            + (f" &middot; engine {_e(engine)}" if engine else "")
            + f" &middot; generated {_e(time.strftime('%Y-%m-%d %H:%M:%S %Z'))}</p>",
            "<h2>Latency per phase</h2>",
            _latency_table(doc),
            "<h2>Latency per KV-occupancy band (the knee)</h2>",
            knee_charts(snapshot, engine),
            "<h2>Causes over time</h2>",
            causes_chart(doc),
            _by_cause_table(doc),
            _ranges_table(doc),
            _slowest_table(doc),
            "</body></html>",
        ]
    )
