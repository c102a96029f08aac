"""Generate kvpressure's Grafana dashboards as importable JSON, with Grafana's own SDK.

The dashboards are built with ``grafana-foundation-sdk`` (PyPI; typed builders generated
from Grafana's schema, pinned in the ``dashboards`` and ``test`` extras to the release for
Grafana 11.2, whose dashboard schema version is :data:`SCHEMA_VERSION`). The committed
``dashboards/*.json`` files are this module's output; ``tests/test_dashboards.py`` fails
when they drift from it, and ``tests/test_rules.py`` checks every query against the metric
catalogue (``agent/catalogue.py``) and the recording rules in
``deploy/prometheus/kvpressure-rules.yml``. Regenerate after editing::

    .venv/bin/python -m kvpressure.dashboards.build          # rewrite dashboards/*.json
    .venv/bin/python -m kvpressure.dashboards.build --check  # exit 1 when a file is stale

The output is Grafana's dashboard JSON model (``schemaVersion`` 39, Grafana 10.4 and later;
11.x and 12.x migrate it on load). Each file imports through *Dashboards > New > Import*
(it declares a ``DS_PROMETHEUS`` input; ``__inputs``/``__requires`` are export fields the
SDK's model does not carry, added here) and provisions from disk (panels use the
``$datasource`` variable, never a data source UID).

Label conventions (see ``deploy/prometheus/kvpressure-rules.yml``): ``instance`` is the
agent's scrape target, ``exported_instance`` an engine's own host:port.

Adding a panel: write a function returning ``timeseries(...)``/``stat(...)``/... with
``q(...)`` targets and put it in its dashboard's list. Panels whose metrics do not exist yet
live in :data:`PENDING`; move one into its dashboard once its metrics are in the catalogue.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from grafana_foundation_sdk.builders import common as cb
from grafana_foundation_sdk.builders import dashboard as db
from grafana_foundation_sdk.builders import prometheus, statetimeline
from grafana_foundation_sdk.builders import stat as stat_panel
from grafana_foundation_sdk.builders import table as table_panel
from grafana_foundation_sdk.builders import timeseries as timeseries_panel
from grafana_foundation_sdk.cog.builder import Builder
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common as cm
from grafana_foundation_sdk.models import dashboard as dm
from grafana_foundation_sdk.models import prometheus as pm

SCHEMA_VERSION = 39
"""Grafana dashboard JSON schema version written (the SDK release for Grafana 11.2 writes
39, as Grafana 10.3 to 11.2 do)."""

GRAFANA_MIN_VERSION = "10.4.0"
"""Oldest Grafana the dashboards are written for (``__requires``)."""

OUT_DIR = Path(__file__).resolve().parent
TAG = "kvpressure"
DS = dm.DataSourceRef(type_val="prometheus", uid="${datasource}")

Json = dict[str, Any]

# Matchers shared by every query: the dashboard variables.
JOB = 'job=~"$job"'
AGENT = f'{JOB}, instance=~"$instance"'
ENGINE = f'{AGENT}, engine=~"$engine"'
GPU = f'{AGENT}, gpu=~"$gpu"'

# Legends: node (agent instance) first, then the engine or GPU on it.
ENGINE_LEGEND = "{{instance}} {{engine}} {{exported_instance}}"
GPU_LEGEND = "{{instance}} GPU {{gpu}}"


def sel(metric: str, matchers: str, *extra: str) -> str:
    """Return a PromQL selector, e.g. ``sel("m", ENGINE, 'state="used"')``."""
    return f"{metric}{{{', '.join((matchers, *extra))}}}"


def rate(metric: str, matchers: str, *extra: str) -> str:
    """Return ``rate(<selector>[$__rate_interval])``."""
    return f"rate({sel(metric, matchers, *extra)}[$__rate_interval])"


def increase(metric: str, matchers: str, *extra: str) -> str:
    """Return ``increase(<selector>[$__rate_interval])`` (events per interval, for bars)."""
    return f"increase({sel(metric, matchers, *extra)}[$__rate_interval])"


def q(
    expr: str, legend: str = "", *, instant: bool = False, table: bool = False
) -> prometheus.Dataquery:
    """Return one Prometheus query target (``refId`` is assigned by the panel)."""
    t = prometheus.Dataquery().datasource(DS).expr(expr).legend_format(legend)
    t = t.instant() if instant else t.range()
    if table:
        t = t.format(pm.PromQueryFormat.TABLE)
    return t


def to_json(obj: object) -> Json:
    """The JSON model of an SDK object or builder (what Grafana reads)."""
    if isinstance(obj, Builder):
        obj = obj.build()
    data: Json = json.loads(JSONEncoder().encode(obj))
    return data


@dataclass
class Panel:
    """A panel before layout: its SDK builder, its kind and its size."""

    builder: Any
    kind: str
    w: int = 12
    h: int = 8

    @property
    def body(self) -> Json:
        """The panel's JSON without layout (for checks of its queries)."""
        return to_json(self.builder)


Threshold = tuple[float | None, str]


def _common(
    builder: Any,
    title: str,
    description: str,
    targets: Sequence[prometheus.Dataquery],
    *,
    unit: str,
    color: dm.FieldColorModeId,
    thresholds: Sequence[Threshold],
    mappings: Sequence[dm.ValueMap] = (),
    minmax: tuple[float | None, float | None] = (None, None),
) -> Any:
    refs = "ABCDEFGHIJ"
    b = (
        builder.title(title)
        .description(description)
        .datasource(DS)
        .unit(unit)
        .color_scheme(db.FieldColor().mode(color))
        .thresholds(
            db.ThresholdsConfig()
            .mode(dm.ThresholdsMode.ABSOLUTE)
            .steps([dm.Threshold(value=v, color=c) for v, c in thresholds])
        )
        .mappings(list(mappings))
    )
    for i, t in enumerate(targets):
        b = b.with_target(t.ref_id(refs[i]))
    if minmax[0] is not None:
        b = b.min(minmax[0])
    if minmax[1] is not None:
        b = b.max(minmax[1])
    return b


def _legend(show: bool = True) -> cb.VizLegendOptions:
    return (
        cb.VizLegendOptions()
        .display_mode(cm.LegendDisplayMode.LIST)
        .placement(cm.LegendPlacement.BOTTOM)
        .show_legend(show)
    )


def timeseries(
    title: str,
    description: str,
    targets: Sequence[prometheus.Dataquery],
    *,
    unit: str = "short",
    stack: bool = False,
    bars: bool = False,
    thresholds: Sequence[Threshold] = ((None, "green"),),
    minmax: tuple[float | None, float | None] = (None, None),
    w: int = 12,
    h: int = 8,
) -> Panel:
    """Return a time-series panel.

    Args:
        title: panel title, phrased as what it shows.
        description: the question it answers and where the numbers come from.
        targets: :func:`q` results.
        unit: Grafana unit id (``bytes``, ``percentunit``, ``s``, ``short``, ...).
        stack: stack series (parts of a whole).
        bars: draw bars (counts per interval).
        thresholds: ``(value, color)`` steps, the first with value ``None``; drawn as a
            dashed line when there is more than one step.
        minmax: fixed axis min and max.
        w: width in grid columns (of 24).
        h: height in grid rows.
    """
    b = _common(
        timeseries_panel.Panel(),
        title,
        description,
        targets,
        unit=unit,
        color=dm.FieldColorModeId.PALETTE_CLASSIC,
        thresholds=thresholds,
        minmax=minmax,
    )
    b = (
        b.draw_style(cm.GraphDrawStyle.BARS if bars else cm.GraphDrawStyle.LINE)
        .line_width(1)
        .fill_opacity(60 if bars else (25 if stack else 10))
        .show_points(cm.VisibilityMode.NEVER)
        .span_nulls(False)
        .stacking(
            cb.StackingConfig()
            .mode(cm.StackingMode.NORMAL if stack else cm.StackingMode.NONE)
            .group("A")
        )
        .thresholds_style(
            cb.GraphThresholdsStyleConfig().mode(
                cm.GraphThresholdsStyleMode.DASHED
                if len(thresholds) > 1
                else cm.GraphThresholdsStyleMode.OFF
            )
        )
        .legend(_legend())
        .tooltip(
            cb.VizTooltipOptions().mode(cm.TooltipDisplayMode.MULTI).sort(cm.SortOrder.DESCENDING)
        )
    )
    return Panel(b, "timeseries", w, h)


def stat(
    title: str,
    description: str,
    targets: Sequence[prometheus.Dataquery],
    *,
    unit: str = "short",
    thresholds: Sequence[Threshold] = ((None, "green"),),
    mappings: Sequence[dm.ValueMap] = (),
    w: int = 6,
    h: int = 4,
) -> Panel:
    """Return a stat panel showing each series' last value."""
    b = _common(
        stat_panel.Panel(),
        title,
        description,
        targets,
        unit=unit,
        color=dm.FieldColorModeId.THRESHOLDS,
        thresholds=thresholds,
        mappings=mappings,
    )
    b = (
        b.reduce_options(cb.ReduceDataOptions().calcs(["lastNotNull"]).fields("").values(False))
        .color_mode(cm.BigValueColorMode.BACKGROUND)
        .graph_mode(cm.BigValueGraphMode.NONE)
        .justify_mode(cm.BigValueJustifyMode.AUTO)
        .orientation(cm.VizOrientation.AUTO)
        .text_mode(cm.BigValueTextMode.AUTO)
    )
    return Panel(b, "stat", w, h)


def value_map(texts: dict[str, tuple[str, str]]) -> dm.ValueMap:
    """A value-to-text mapping: ``{"0": ("down", "red"), ...}`` (text, colour per value)."""
    return dm.ValueMap(
        options={
            value: dm.ValueMappingResult(text=text, color=color, index=i)
            for i, (value, (text, color)) in enumerate(texts.items())
        }
    )


UP_DOWN = (value_map({"0": ("down", "red"), "1": ("up", "green")}),)
ACTIVE = (value_map({"0": ("-", "transparent"), "1": ("active", "orange")}),)


def state_timeline(
    title: str,
    description: str,
    targets: Sequence[prometheus.Dataquery],
    *,
    mappings: Sequence[dm.ValueMap] = UP_DOWN,
    w: int = 12,
    h: int = 8,
) -> Panel:
    """Return a state-timeline panel (0/1 gauges as coloured bands)."""
    b = _common(
        statetimeline.Panel(),
        title,
        description,
        targets,
        unit="short",
        color=dm.FieldColorModeId.THRESHOLDS,
        thresholds=((None, "red"), (1, "green")),
        mappings=mappings,
    )
    b = (
        b.merge_values(True)
        .show_value(cm.VisibilityMode.NEVER)
        .align_value(cm.TimelineValueAlignment.LEFT)
        .row_height(0.9)
        .legend(_legend(show=False))
        .tooltip(cb.VizTooltipOptions().mode(cm.TooltipDisplayMode.SINGLE).sort(cm.SortOrder.NONE))
        .fill_opacity(80)
        .line_width(0)
    )
    return Panel(b, "state-timeline", w, h)


def table(
    title: str,
    description: str,
    targets: Sequence[prometheus.Dataquery],
    *,
    hide: Sequence[str] = (),
    w: int = 12,
) -> Panel:
    """Return a table of instant-query label sets (``Time`` and ``Value`` hidden)."""
    b = _common(
        table_panel.Panel(),
        title,
        description,
        targets,
        unit="short",
        color=dm.FieldColorModeId.THRESHOLDS,
        thresholds=((None, "green"),),
    )
    excluded = {name: True for name in ("Time", "Value", "__name__", *hide)}
    b = (
        b.show_header(True)
        .cell_height(cm.TableCellHeight.SM)
        .footer(cb.TableFooterOptions().show(False).reducer([]))
        .with_transformation(
            dm.DataTransformerConfig(
                id_val="organize", options={"excludeByName": excluded, "renameByName": {}}
            )
        )
    )
    return Panel(b, "table", w)


@dataclass
class Row:
    """A row header; the panels after it belong to it."""

    title: str


Item = Panel | Row


def _variable(name: str, label: str, query: str, *, multi: bool = True) -> db.QueryVariable:
    return (
        db.QueryVariable(name)
        .label(label)
        .datasource(DS)
        .query({"query": query, "refId": f"{name}-var"})
        .refresh(dm.VariableRefresh.ON_TIME_RANGE_CHANGED)  # agents, engines, GPUs come and go
        .sort(dm.VariableSort.ALPHABETICAL_ASC)
        .multi(multi)
        .include_all(True)
        .all_value(".*")
        .current(dm.VariableOption(selected=True, text=["All"], value=["$__all"]))
        .options([])
        .hide(dm.VariableHide.DONT_HIDE)
        .regex("")
    )


def variables() -> list[Any]:
    """Return the template variables every dashboard has: datasource, job, instance, engine, gpu."""
    datasource = (
        db.DatasourceVariable("datasource")
        .label("Data source")
        .type("prometheus")
        .current(dm.VariableOption(selected=False, text="Prometheus", value="${DS_PROMETHEUS}"))
        .hide(dm.VariableHide.DONT_HIDE)
        .regex("")
        .include_all(False)
        .multi(False)
    )
    return [
        datasource,
        _variable("job", "Job", "label_values(kvpressure_build_info, job)"),
        _variable("instance", "Agent", f"label_values(kvpressure_build_info{{{JOB}}}, instance)"),
        _variable("engine", "Engine", f"label_values(kvpressure_engine_up{{{AGENT}}}, engine)"),
        _variable("gpu", "GPU", f"label_values(kvpressure_gpu_up{{{AGENT}}}, gpu)"),
    ]


def _layout(board: db.Dashboard, items: Sequence[Item]) -> db.Dashboard:
    """Add ``items`` with ids and grid positions (rows span the width, panels fill rows)."""
    x = y = row_h = 0
    for pid, item in enumerate(items, start=1):
        if isinstance(item, Row):
            if x:
                y += row_h
            board = board.with_row(
                db.Row(item.title)
                .id(pid)
                .collapsed(False)
                .grid_pos(dm.GridPos(h=1, w=24, x=0, y=y))
            )
            x, y, row_h = 0, y + 1, 0
            continue
        if x + item.w > 24:
            x, y, row_h = 0, y + row_h, 0
        board = board.with_panel(
            item.builder.id(pid).grid_pos(dm.GridPos(h=item.h, w=item.w, x=x, y=y))
        )
        x += item.w
        row_h = max(row_h, item.h)
    return board


def _requires(items: Sequence[Item]) -> list[Json]:
    kinds = sorted({i.kind for i in items if isinstance(i, Panel)})
    names = {
        "timeseries": "Time series",
        "stat": "Stat",
        "state-timeline": "State timeline",
        "table": "Table",
    }
    return [
        {"type": "grafana", "id": "grafana", "name": "Grafana", "version": GRAFANA_MIN_VERSION},
        {"type": "datasource", "id": "prometheus", "name": "Prometheus", "version": "1.0.0"},
        *({"type": "panel", "id": k, "name": names[k], "version": ""} for k in kinds),
    ]


INPUTS: list[Json] = [
    {
        "name": "DS_PROMETHEUS",
        "label": "Prometheus",
        "description": "Prometheus that scrapes the kvpressure agents",
        "type": "datasource",
        "pluginId": "prometheus",
        "pluginName": "Prometheus",
    }
]
"""The export's data source input (Grafana asks for it on import)."""


@dataclass
class Dashboard:
    """One dashboard: its identity, the question it answers and its panels."""

    uid: str
    title: str
    description: str
    items: Sequence[Item] = field(default_factory=list)

    @property
    def filename(self) -> str:
        """The committed file name, ``<uid>.json``."""
        return f"{self.uid}.json"

    def builder(self) -> db.Dashboard:
        """The SDK dashboard builder with every panel, variable, link and annotation."""
        board = (
            db.Dashboard(self.title)
            .uid(self.uid)
            .description(self.description)
            .tags([TAG])
            .editable()
            .fiscal_year_start_month(0)
            .tooltip(dm.DashboardCursorSync.CROSSHAIR)
            .refresh("30s")
            .time("now-3h", "now")
            .timezone("browser")
            .version(1)
            .week_start("")
            .annotation(
                db.AnnotationQuery()
                .built_in(1)
                .datasource(dm.DataSourceRef(type_val="grafana", uid="-- Grafana --"))
                .enable(True)
                .hide(True)
                .icon_color("rgba(0, 211, 255, 1)")
                .name("Annotations & Alerts")
                .type("dashboard")
            )
            .link(
                db.DashboardLink("kvpressure")
                .type(dm.DashboardLinkType.DASHBOARDS)
                .tags([TAG])
                .as_dropdown(True)
                .include_vars(True)
                .keep_time(True)
                .icon("external link")
                .target_blank(False)
                .tooltip("")
                .url("")
            )
        )
        for v in variables():
            board = board.with_variable(v)
        return _layout(board, self.items)

    def to_json(self) -> Json:
        """Return the importable dashboard JSON model (the SDK's, plus the export fields)."""
        model = to_json(self.builder())
        if model.get("schemaVersion") != SCHEMA_VERSION:
            raise RuntimeError(
                f"grafana-foundation-sdk writes schemaVersion {model.get('schemaVersion')}, "
                f"not {SCHEMA_VERSION}: install the pinned release"
            )
        return {
            "__inputs": INPUTS,
            "__requires": _requires(self.items),
            "id": None,
            **model,
        }


# --- Memory pressure overview ----------------------------------------------------------


def memory_pressure() -> Dashboard:
    """GPU memory, KV occupancy, queues, preemptions, PSI and memory tiers side by side."""
    items: list[Item] = [
        Row("GPU memory"),
        timeseries(
            "GPU memory used, reserved and total",
            "Device memory per GPU from NVML: used by processes, reserved by the driver (not "
            "usable), and the total. Engines that pre-allocate (vLLM) hold most of it from "
            "start-up, so watch the free share next to it.",
            [
                q(sel("kvpressure_gpu_memory_used_bytes", GPU), f"{GPU_LEGEND} used"),
                q(sel("kvpressure_gpu_memory_reserved_bytes", GPU), f"{GPU_LEGEND} reserved"),
                q(sel("kvpressure_gpu_memory_total_bytes", GPU), f"{GPU_LEGEND} total"),
            ],
            unit="bytes",
            minmax=(0, None),
            w=8,
        ),
        timeseries(
            "GPU memory headroom (free share)",
            "Free device memory as a share of the total (recording rule "
            "kvpressure:gpu_memory_headroom:ratio). Below 3 % for 10 minutes fires "
            "KvpressureGPUMemoryHeadroomLow: a new process or a larger batch may hit OOM.",
            [q(sel("kvpressure:gpu_memory_headroom:ratio", GPU), GPU_LEGEND)],
            unit="percentunit",
            thresholds=((None, "red"), (0.03, "green")),
            minmax=(0, 1),
            w=8,
        ),
        timeseries(
            "GPU memory by process",
            "Who holds the memory: NVML's compute processes per GPU, joined to the engine the "
            "agent knows at that PID.",
            [
                q(
                    sel("kvpressure_gpu_process_memory_bytes", GPU),
                    f"{GPU_LEGEND} {{{{process}}}} ({{{{pid}}}}) {{{{engine}}}}",
                )
            ],
            unit="bytes",
            stack=True,
            w=8,
        ),
        Row("KV cache and queues"),
        timeseries(
            "KV-cache occupancy",
            "Share of each engine's KV-cache capacity in use. Near 100 % with requests "
            "waiting (next panel) is KV saturation: KvpressureKVCacheSaturated fires at 95 % "
            "for 5 minutes.",
            [q(sel("kvpressure_engine_kv_cache_usage_ratio", ENGINE), ENGINE_LEGEND)],
            unit="percentunit",
            thresholds=((None, "green"), (0.95, "red")),
            minmax=(0, 1),
            w=8,
        ),
        timeseries(
            "Requests running and waiting",
            "Requests being processed and requests queued for a slot or for KV space. A "
            "waiting queue that grows while occupancy is pinned means requests wait for "
            "memory, not compute.",
            [
                q(sel("kvpressure_engine_requests_running", ENGINE), f"{ENGINE_LEGEND} running"),
                q(sel("kvpressure_engine_requests_waiting", ENGINE), f"{ENGINE_LEGEND} waiting"),
            ],
            unit="short",
            minmax=(0, None),
            w=8,
        ),
        timeseries(
            "Preemptions per second",
            "Requests the engine evicted to free KV space; each is recomputed or swapped back. "
            "KvpressurePreemptionStorm fires above 0.1/s for 10 minutes.",
            [q(rate("kvpressure_engine_preemptions_total", ENGINE), ENGINE_LEGEND)],
            unit="ops",
            thresholds=((None, "green"), (0.1, "red")),
            minmax=(0, None),
            w=8,
        ),
        timeseries(
            "KV-cache headroom (tokens)",
            "KV-cache tokens still free (recording rule kvpressure:engine_kv_headroom_tokens: "
            "capacity minus used), for engines that expose token counts.",
            [q(sel("kvpressure:engine_kv_headroom_tokens", ENGINE), ENGINE_LEGEND)],
            unit="short",
            minmax=(0, None),
            w=12,
        ),
        timeseries(
            "GPU memory held by each engine",
            "GPU memory of the processes the agent attributes to each engine, summed over "
            "its GPUs: how much device memory backs the KV cache on the left.",
            [
                q(
                    f"sum by (job, instance, engine) "
                    f"({sel('kvpressure_gpu_process_memory_bytes', ENGINE)})",
                    "{{instance}} {{engine}}",
                )
            ],
            unit="bytes",
            minmax=(0, None),
            w=12,
        ),
        Row("Host memory"),
        timeseries(
            "PSI: share of time stalled on memory and I/O",
            "Pressure stall information: 'some' is the share of time at least one task "
            "stalled, 'full' the share all tasks did (scope=system for the host, or an "
            "engine's cgroup). Memory full above 10 % for 5 minutes fires "
            "KvpressureHostMemoryPressure.",
            [
                q(
                    rate("kvpressure_psi_stall_seconds_total", AGENT, 'resource=~"memory|io"'),
                    "{{instance}} {{scope}} {{resource}} {{kind}}",
                )
            ],
            unit="percentunit",
            thresholds=((None, "green"), (0.1, "red")),
            minmax=(0, None),
            w=8,
        ),
        timeseries(
            "Host memory available",
            "Available and total memory as the host sees it (/proc/meminfo MemAvailable and "
            "MemTotal). The cgroup-aware kvpressure_host_memory_* series are left out here: "
            "they are bounded by the agent's own limit (the unit's MemoryMax, the pod's limit).",
            [
                q(sel("kvpressure_host_meminfo_available_bytes", AGENT), "{{instance}} available"),
                q(sel("kvpressure_host_meminfo_total_bytes", AGENT), "{{instance}} total"),
            ],
            unit="bytes",
            minmax=(0, None),
            w=8,
        ),
        timeseries(
            "Memory tiers (used)",
            "Used memory per tier: DRAM NUMA nodes, CPU-less (CXL) nodes and swap. KV offload "
            "to host memory shows here first.",
            [
                q(
                    sel("kvpressure_memory_tier_bytes", AGENT, 'state="used"'),
                    "{{instance}} {{tier}} {{node}}",
                )
            ],
            unit="bytes",
            stack=True,
            w=8,
        ),
        timeseries(
            "Swap used",
            "Swap in use. Any growth on an inference host means the working set no longer "
            "fits in RAM.",
            [q(sel("kvpressure_host_swap_used_bytes", AGENT), "{{instance}}")],
            unit="bytes",
            minmax=(0, None),
            w=12,
        ),
        timeseries(
            "Swap activity and major page faults",
            "Pages swapped in and out, and major faults (page reads from disk), per second: "
            "reclaim that stalls tokenizers, schedulers and host-side KV.",
            [
                q(rate("kvpressure_host_swap_in_pages_total", AGENT), "{{instance}} swap in"),
                q(rate("kvpressure_host_swap_out_pages_total", AGENT), "{{instance}} swap out"),
                q(
                    rate("kvpressure_host_major_page_faults_total", AGENT),
                    "{{instance}} major faults",
                ),
            ],
            unit="ops",
            minmax=(0, None),
            w=12,
        ),
    ]
    return Dashboard(
        "kvpressure-memory-pressure",
        "kvpressure / Memory pressure overview",
        "Is memory what limits this inference node right now? GPU memory, KV-cache "
        "occupancy, queues and preemptions per engine, and host memory pressure (PSI, swap, "
        "tiers) side by side.",
        items,
    )


# --- Accelerator ------------------------------------------------------------------------


def accelerator() -> Dashboard:
    """GPU utilization, SM occupancy, bandwidth, stall time, data movement and clocks."""
    items: list[Item] = [
        Row("Utilization"),
        timeseries(
            "GPU utilization",
            "Share of the sample period a kernel was running (NVML). High utilization says "
            "nothing about useful work: compare SM occupancy and stall time.",
            [q(sel("kvpressure_gpu_utilization_ratio", GPU), GPU_LEGEND)],
            unit="percentunit",
            minmax=(0, 1),
            w=8,
        ),
        timeseries(
            "SM occupancy",
            "SM occupancy from GPM (Hopper and newer). Low occupancy with high bandwidth "
            "means the GPU is memory-bound, typical of decode with a large KV cache.",
            [q(sel("kvpressure_gpu_sm_occupancy_ratio", GPU), GPU_LEGEND)],
            unit="percentunit",
            minmax=(0, 1),
            w=8,
        ),
        timeseries(
            "Memory bandwidth utilization",
            "DRAM bandwidth in use (GPM on Hopper and newer, else NVML's memory utilization; "
            "the source label says which).",
            [
                q(
                    sel("kvpressure_gpu_memory_bandwidth_utilization_ratio", GPU),
                    f"{GPU_LEGEND} ({{{{source}}}})",
                )
            ],
            unit="percentunit",
            minmax=(0, 1),
            w=8,
        ),
        timeseries(
            "Accelerator stall time by reason",
            "Share of wall time the GPU had requests running or waiting but did no useful "
            "compute: idle with a queue, memory-bound, or clock-throttled.",
            [
                q(
                    rate("kvpressure_accelerator_stall_seconds_total", GPU),
                    f"{GPU_LEGEND} {{{{reason}}}}",
                )
            ],
            unit="percentunit",
            stack=True,
            minmax=(0, 1),
            w=24,
        ),
        Row("Data movement"),
        timeseries(
            "Bytes moved per token",
            "PCIe plus NVLink bytes per token processed by the engines on the GPU, over the "
            "agent's data-movement window. Rising values mean KV offload or swapping.",
            [q(sel("kvpressure_data_movement_bytes_per_token", GPU), GPU_LEGEND)],
            unit="bytes",
            minmax=(0, None),
            w=12,
        ),
        timeseries(
            "Tokens per byte of GPU memory",
            "Tokens processed over the window divided by the mean GPU memory in use: how "
            "much work each byte of device memory buys.",
            [q(sel("kvpressure_tokens_per_byte", GPU), GPU_LEGEND)],
            unit="short",
            minmax=(0, None),
            w=12,
        ),
        timeseries(
            "PCIe throughput",
            "PCIe bytes per second by direction (rx into the GPU, tx out of it).",
            [q(rate("kvpressure_gpu_pcie_bytes_total", GPU), f"{GPU_LEGEND} {{{{direction}}}}")],
            unit="Bps",
            minmax=(0, None),
            w=12,
        ),
        timeseries(
            "NVLink throughput",
            "NVLink bytes per second by direction.",
            [q(rate("kvpressure_gpu_nvlink_bytes_total", GPU), f"{GPU_LEGEND} {{{{direction}}}}")],
            unit="Bps",
            minmax=(0, None),
            w=12,
        ),
        Row("Clocks, power and errors"),
        state_timeline(
            "Clock event reasons active",
            "NVML clocks event reasons while active (power cap, thermal and hardware "
            "slowdowns, sync boost, ...); 'idle' is left out. Throttling here shows up as "
            "'throttled' stall time above.",
            [
                q(
                    sel("kvpressure_gpu_clock_event_active", GPU, 'reason!="idle"'),
                    f"{GPU_LEGEND} {{{{reason}}}}",
                )
            ],
            mappings=ACTIVE,
            w=24,
        ),
        timeseries(
            "Power draw",
            "Board power per GPU (NVML).",
            [q(sel("kvpressure_gpu_power_watts", GPU), GPU_LEGEND)],
            unit="watt",
            minmax=(0, None),
            w=8,
        ),
        timeseries(
            "Temperature",
            "GPU die temperature (NVML).",
            [q(sel("kvpressure_gpu_temperature_celsius", GPU), GPU_LEGEND)],
            unit="celsius",
            w=8,
        ),
        timeseries(
            "XID errors",
            "Driver XID errors per interval, by code: 79 (fallen off the bus) and 48/94/95 "
            "(ECC) explain a GPU that vanished or an engine that crashed.",
            [
                q(
                    increase("kvpressure_gpu_xid_errors_total", GPU),
                    f"{GPU_LEGEND} xid {{{{xid}}}}",
                )
            ],
            unit="short",
            bars=True,
            minmax=(0, None),
            w=8,
        ),
    ]
    return Dashboard(
        "kvpressure-accelerator",
        "kvpressure / Accelerator",
        "Is the GPU doing useful work, or stalled on memory, a queue or its clocks? "
        "Utilization, SM occupancy, bandwidth, stall time by reason, bytes moved per token "
        "and clock events per GPU.",
        items,
    )


# --- Capacity ---------------------------------------------------------------------------


def capacity() -> Dashboard:
    """KV headroom, prefix reuse and throughput per engine and for the fleet."""
    items: list[Item] = [
        Row("KV headroom"),
        timeseries(
            "KV-cache headroom (tokens)",
            "KV-cache tokens still free per engine (recording rule "
            "kvpressure:engine_kv_headroom_tokens). Divide by a typical request's prompt "
            "plus output tokens for the requests that still fit.",
            [q(sel("kvpressure:engine_kv_headroom_tokens", ENGINE), ENGINE_LEGEND)],
            unit="short",
            minmax=(0, None),
            w=12,
        ),
        timeseries(
            "KV-cache headroom (share)",
            "Free share of each engine's KV cache (recording rule "
            "kvpressure:engine_kv_headroom:ratio); works for engines that only report a "
            "usage ratio.",
            [q(sel("kvpressure:engine_kv_headroom:ratio", ENGINE), ENGINE_LEGEND)],
            unit="percentunit",
            thresholds=((None, "red"), (0.05, "green")),
            minmax=(0, 1),
            w=12,
        ),
        timeseries(
            "KV-cache capacity and used tokens",
            "Capacity (llama.cpp: the slots' n_ctx; vLLM: GPU blocks x block size) and tokens "
            "in use.",
            [
                q(
                    sel("kvpressure_engine_kv_cache_capacity_tokens", ENGINE),
                    f"{ENGINE_LEGEND} capacity",
                ),
                q(sel("kvpressure_engine_kv_cache_used_tokens", ENGINE), f"{ENGINE_LEGEND} used"),
            ],
            unit="short",
            minmax=(0, None),
            w=12,
        ),
        timeseries(
            "Fleet KV headroom by engine and model",
            "Free KV-cache tokens summed over every node (recording rule "
            "engine_model:kvpressure_engine_kv_headroom_tokens:sum); not filtered by agent.",
            [
                q(
                    'engine_model:kvpressure_engine_kv_headroom_tokens:sum{engine=~"$engine"}',
                    "{{engine}} {{model}}",
                )
            ],
            unit="short",
            minmax=(0, None),
            w=12,
        ),
        Row("Prefix reuse and throughput"),
        timeseries(
            "Prefix-cache hit ratio",
            "Share of looked-up prompt tokens served from the prefix cache (recording rule "
            "kvpressure:engine_prefix_cache_hit:ratio_rate5m). Every hit is prefill not "
            "computed and KV not allocated twice.",
            [q(sel("kvpressure:engine_prefix_cache_hit:ratio_rate5m", ENGINE), ENGINE_LEGEND)],
            unit="percentunit",
            minmax=(0, 1),
            w=12,
        ),
        timeseries(
            "Prefill tokens saved by prefix reuse",
            "Prompt tokens per second served from the prefix cache instead of recomputed.",
            [q(rate("kvpressure_engine_prefix_cache_hit_tokens_total", ENGINE), ENGINE_LEGEND)],
            unit="short",
            minmax=(0, None),
            w=12,
        ),
        timeseries(
            "Token throughput",
            "Prompt (prefill) and generated (decode) tokens per second.",
            [
                q(rate("kvpressure_engine_prompt_tokens_total", ENGINE), f"{ENGINE_LEGEND} prompt"),
                q(
                    rate("kvpressure_engine_generation_tokens_total", ENGINE),
                    f"{ENGINE_LEGEND} generation",
                ),
            ],
            unit="short",
            minmax=(0, None),
            w=12,
        ),
        timeseries(
            "Fleet requests running and waiting by engine and model",
            "Requests summed over every node (recording rules "
            "engine_model:kvpressure_engine_requests_{running,waiting}:sum); not filtered "
            "by agent.",
            [
                q(
                    'engine_model:kvpressure_engine_requests_running:sum{engine=~"$engine"}',
                    "{{engine}} {{model}} running",
                ),
                q(
                    'engine_model:kvpressure_engine_requests_waiting:sum{engine=~"$engine"}',
                    "{{engine}} {{model}} waiting",
                ),
            ],
            unit="short",
            minmax=(0, None),
            w=12,
        ),
        Row("Saturation"),
        timeseries(
            "Saturation concurrency",
            "Concurrent requests at which the KV cache fills, per engine (capacity divided "
            "by the tokens one request needs at its peak; llama.cpp: capped at its slots).",
            [q(sel("kvpressure_kv_saturation_concurrency", REQUEST), "{{engine}}")],
            w=8,
        ),
        timeseries(
            "Time to KV saturation",
            "Headroom divided by the growth rate of used KV tokens; absent unless growing.",
            [q(sel("kvpressure_kv_time_to_saturation_seconds", REQUEST), "{{engine}}")],
            unit="s",
            w=8,
        ),
        timeseries(
            "KV bytes per token",
            "KV-cache bytes one token occupies, per engine and model.",
            [q(sel("kvpressure_kv_bytes_per_token", REQUEST), "{{engine}} {{model}}")],
            unit="bytes",
            w=8,
        ),
        timeseries(
            "Prefill time saved by prefix reuse",
            "Seconds of prefill per second that prefix-cache hits saved, at the measured "
            "prefill rate.",
            [
                q(
                    f"sum by (engine) "
                    f"({rate('kvpressure_prefix_cache_saved_seconds_total', REQUEST)})",
                    "{{engine}}",
                )
            ],
            unit="s",
            w=24,
        ),
    ]
    return Dashboard(
        "kvpressure-capacity",
        "kvpressure / Capacity",
        "How much more load fits? KV-cache headroom per engine and for the fleet, prefix "
        "reuse savings and token throughput.",
        items,
    )


# --- Agent health -----------------------------------------------------------------------


def agent_health() -> Dashboard:
    """Is the agent itself healthy: scrapes, samplers, engines, sources, timeline."""
    items: list[Item] = [
        Row("Agent"),
        stat(
            "Agent scrape",
            "Prometheus's own up series for each agent: down fires KvpressureAgentDown "
            "after 5 minutes.",
            [q(sel("up", AGENT), "{{instance}}")],
            thresholds=((None, "red"), (1, "green")),
            mappings=UP_DOWN,
            w=8,
        ),
        stat(
            "Recording rules loaded",
            "Agents for which the kvpressure recording rules produce data. 0 means "
            "deploy/prometheus/kvpressure-rules.yml is not loaded in Prometheus and the "
            "panels built on kvpressure:* series stay empty.",
            [q(f"count({sel('kvpressure:samplers_up:ratio', AGENT)}) or vector(0)", "agents")],
            thresholds=((None, "red"), (1, "green")),
            w=4,
        ),
        table(
            "Agent versions",
            "kvpressure and Python version of each agent.",
            [q(sel("kvpressure_build_info", AGENT), instant=True, table=True)],
            w=12,
        ),
        Row("Samplers"),
        state_timeline(
            "Sampler up",
            "1 when a sampler's last collection succeeded within its timeout. Down for 5 "
            "minutes fires KvpressureSamplerFailing.",
            [q(sel("kvpressure_sampler_up", AGENT), "{{instance}} {{sampler}}")],
            w=12,
        ),
        timeseries(
            "Sampler duration",
            "Wall time of each sampler's last collection. A sampler close to its interval "
            "delays nothing else but its own data.",
            [q(sel("kvpressure_sampler_duration_seconds", AGENT), "{{instance}} {{sampler}}")],
            unit="s",
            minmax=(0, None),
            w=12,
        ),
        timeseries(
            "Sampler failures",
            "Collections that raised or timed out, per second, by reason.",
            [
                q(
                    rate("kvpressure_sampler_failures_total", AGENT),
                    "{{instance}} {{sampler}} {{reason}}",
                )
            ],
            unit="ops",
            minmax=(0, None),
            w=12,
        ),
        state_timeline(
            "Sources up",
            "Each source inside a sampler (a /proc file, an endpoint): 0 when it failed to "
            "read in the last cycle. Sources the system does not have are in the table "
            "instead.",
            [q(sel("kvpressure_source_up", AGENT), "{{instance}} {{sampler}} {{source}}")],
            w=12,
        ),
        table(
            "Sources this system does not provide",
            "Unsupported sources and why (e.g. kernel_without_psi): no data by design, not "
            "an error.",
            [q(f"{sel('kvpressure_source_unsupported', AGENT)} == 1", instant=True, table=True)],
            w=24,
        ),
        Row("Engines"),
        state_timeline(
            "Engine metrics endpoint up",
            "1 when the engine's metrics endpoint answered with usable exposition. 0 for 5 "
            "minutes while the agent is up fires KvpressureEngineMetricsUnavailable.",
            [q(sel("kvpressure_engine_up", ENGINE), ENGINE_LEGEND)],
            w=12,
        ),
        timeseries(
            "Engine parse errors",
            "Exposition lines or families per second the agent could not parse and skipped.",
            [q(rate("kvpressure_engine_parse_errors_total", ENGINE), ENGINE_LEGEND)],
            unit="ops",
            minmax=(0, None),
            w=12,
        ),
        timeseries(
            "Samples per engine scrape",
            "Samples parsed from each engine's last metrics response; a sudden drop after an "
            "engine upgrade is a metric rename.",
            [q(sel("kvpressure_engine_scrape_samples", ENGINE), ENGINE_LEGEND)],
            unit="short",
            minmax=(0, None),
            w=12,
        ),
        timeseries(
            "Engine restarts",
            "Engine restarts seen as counter resets or a new process start time.",
            [
                q(
                    increase("kvpressure_engine_restarts_total", ENGINE),
                    ENGINE_LEGEND,
                )
            ],
            unit="short",
            bars=True,
            minmax=(0, None),
            w=12,
        ),
        Row("Timeline, exporter and config"),
        timeseries(
            "Timeline series",
            "Series held in the agent's in-memory timeline (capped by timeline.max_series).",
            [q(sel("kvpressure_timeline_series", AGENT), "{{instance}}")],
            unit="short",
            minmax=(0, None),
            w=8,
        ),
        timeseries(
            "Dropped samples",
            "Samples per second dropped at the timeline's series cap, or by the exporter "
            "because their name is not in the catalogue (a bug).",
            [
                q(
                    rate("kvpressure_timeline_dropped_samples_total", AGENT),
                    "{{instance}} timeline cap",
                ),
                q(
                    rate("kvpressure_exporter_unknown_samples_total", AGENT),
                    "{{instance}} unknown name",
                ),
            ],
            unit="ops",
            minmax=(0, None),
            w=8,
        ),
        timeseries(
            "Config reloads",
            "SIGHUP reloads per interval by result; invalid ones keep the last good config.",
            [
                q(
                    increase("kvpressure_config_reloads_total", AGENT),
                    "{{instance}} {{result}}",
                )
            ],
            unit="short",
            bars=True,
            minmax=(0, None),
            w=8,
        ),
    ]
    return Dashboard(
        "kvpressure-agent-health",
        "kvpressure / Agent health",
        "Can the other dashboards be trusted? Scrapes, samplers, sources, engine endpoints, "
        "the timeline and the exporter of every agent.",
        items,
    )


# --- Tail latency and attribution --------------------------------------------------------

REQUEST = f'{JOB}, engine=~"$engine"'  # request metrics carry engine but no engine instance


def _quantile(phase: str, quantile: float) -> prometheus.Dataquery:
    bucket = sel("kvpressure_request_latency_seconds_bucket", REQUEST, f'phase="{phase}"')
    return q(
        f"histogram_quantile({quantile}, sum by (engine, le) (rate({bucket}[$__rate_interval])))",
        f"{{{{engine}}}} {phase} p{round(quantile * 100)}",
    )


def _engine_quantile(phase: str, quantile: float) -> prometheus.Dataquery:
    bucket = sel("kvpressure_engine_request_latency_seconds_bucket", ENGINE, f'phase="{phase}"')
    return q(
        f"histogram_quantile({quantile}, "
        f"sum by (engine, model, le) (rate({bucket}[$__rate_interval])))",
        f"{{{{engine}}}} {{{{model}}}} p{round(quantile * 100)}",
    )


def tail_latency() -> Dashboard:
    """Tail latency and attribution: request-latency quantiles, slow requests by cause."""
    items: list[Item] = [
        Row("Latency"),
        *(
            timeseries(
                f"{phase.upper()} p50 and p99",
                f"{phase.upper()} quantiles from the request latency histogram.",
                [_quantile(phase, 0.5), _quantile(phase, 0.99)],
                unit="s",
                w=8,
            )
            for phase in ("ttft", "itl", "e2e")
        ),
        Row("Engine latency (the engines' own histograms)"),
        *(
            timeseries(
                f"Engine {phase.upper()} p50 and p99 per model",
                f"{phase.upper()} quantiles per engine and model over every selected node and "
                "engine instance, from kvpressure_engine_request_latency_seconds (the engines' "
                "histograms re-bucketed into one OpenTelemetry GenAI layout per phase, so they "
                "sum across instances). Needs no request proxy.",
                [_engine_quantile(phase, 0.5), _engine_quantile(phase, 0.99)],
                unit="s",
                w=8,
            )
            for phase in ("ttft", "itl", "e2e")
        ),
        Row("Attribution"),
        timeseries(
            "Slow requests by cause",
            "Slow requests per second by primary cause (memory, storage, network, compute, "
            "unknown).",
            [
                q(
                    f"sum by (engine, cause) ({rate('kvpressure_slow_requests_total', REQUEST)})",
                    "{{engine}} {{cause}}",
                )
            ],
            unit="reqps",
            stack=True,
            w=12,
        ),
        timeseries(
            "Attribution score",
            "Score per cause over time.",
            [q(sel("kvpressure_attribution_score", REQUEST), "{{engine}} {{cause}}")],
            unit="short",
            minmax=(0, 1),
            w=12,
        ),
        timeseries(
            "TTFT p99 against KV occupancy",
            "Does tail latency follow KV occupancy?",
            [
                _quantile("ttft", 0.99),
                q(
                    f"max by (engine) ({sel('kvpressure_engine_kv_cache_usage_ratio', ENGINE)})",
                    "{{engine}} KV occupancy",
                ),
            ],
            unit="s",
            w=24,
        ),
    ]
    return Dashboard(
        "kvpressure-tail-latency",
        "kvpressure / Tail latency and attribution",
        "Why did p99 rise? TTFT, ITL and e2e quantiles, slow requests by cause, attribution "
        "scores and latency against KV occupancy.",
        items,
    )


DASHBOARDS: tuple[Callable[[], Dashboard], ...] = (
    memory_pressure,
    tail_latency,
    accelerator,
    capacity,
    agent_health,
)
"""Builders of the committed dashboards."""


@dataclass(frozen=True)
class Pending:
    """Panels or a dashboard waiting for metrics that are not in the catalogue yet."""

    dashboard: str
    needs: tuple[str, ...]
    build: Callable[[], Sequence[Item]]
    issue: str


PENDING: tuple[Pending, ...] = ()
"""Ready-made panels to add once their metrics exist (``tests/test_dashboards.py`` parses
them). The agent-health panel for dropped spans waits for the name the request issue
chooses."""


# --- Output -----------------------------------------------------------------------------


def render_all() -> dict[str, str]:
    """Return every committed dashboard as ``{file name: JSON text}``."""
    out: dict[str, str] = {}
    for build in DASHBOARDS:
        d = build()
        out[d.filename] = json.dumps(d.to_json(), indent=2, ensure_ascii=False) + "\n"
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Write ``dashboards/*.json``, or with ``--check`` report stale files and exit 1."""
    parser = argparse.ArgumentParser(
        prog="python -m kvpressure.dashboards.build", description=__doc__
    )
    parser.add_argument("--check", action="store_true", help="exit 1 when a file is stale")
    parser.add_argument("--out", type=Path, default=OUT_DIR, help="output directory")
    args = parser.parse_args(argv)
    rendered = render_all()
    stale = [
        name
        for name, text in rendered.items()
        if not (args.out / name).exists() or (args.out / name).read_text("utf-8") != text
    ]
    extra = sorted(p.name for p in args.out.glob("*.json") if p.name not in rendered)
    if args.check:
        for name in stale:
            print(
                f"{args.out / name}: stale; run python -m kvpressure.dashboards.build",
                file=sys.stderr,
            )
        for name in extra:
            print(f"{args.out / name}: not generated by dashboards/build.py", file=sys.stderr)
        return 1 if stale or extra else 0
    args.out.mkdir(parents=True, exist_ok=True)
    for name in stale:
        (args.out / name).write_text(rendered[name], encoding="utf-8")
        print(f"wrote {args.out / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
