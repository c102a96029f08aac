"""Grafana dashboards: committed JSON equals the generator's output, and it is importable.

Regenerate after changing ``dashboards/build.py``::

    .venv/bin/python -m kvpressure.dashboards.build

Queries are checked against the metric catalogue in ``tests/test_rules.py``.
"""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvpressure.dashboards import build  # noqa: E402

FILES = sorted((ROOT / "dashboards").glob("*.json"))
DASHBOARDS = {p.name: json.loads(p.read_text(encoding="utf-8")) for p in FILES}
REGENERATE = "stale: run `.venv/bin/python -m kvpressure.dashboards.build` and commit the result"
UNITS = {"short", "bytes", "percentunit", "s", "ops", "reqps", "Bps", "watt", "celsius"}


def panels(d):
    return [p for p in d["panels"] if p["type"] != "row"]


def exprs(d):
    return " ".join(t["expr"] for p in panels(d) for t in p["targets"])


def test_committed_json_matches_the_generator():
    rendered = build.render_all()
    assert sorted(rendered) == sorted(DASHBOARDS), f"dashboards/*.json {REGENERATE}"
    for name, text in rendered.items():
        committed = (ROOT / "dashboards" / name).read_text(encoding="utf-8")
        assert committed == text, f"dashboards/{name} {REGENERATE}"


def test_build_check_mode(tmp_path, capsys):
    out = ["--out", str(tmp_path)]
    assert build.main([*out, "--check"]) == 1
    assert "stale" in capsys.readouterr().err
    assert build.main(out) == 0
    (tmp_path / "hand-made.json").write_text("{}")
    assert build.main([*out, "--check"]) == 1
    assert "not generated" in capsys.readouterr().err
    (tmp_path / "hand-made.json").unlink()
    assert build.main([*out, "--check"]) == 0


def test_module_runs_as_documented():
    res = subprocess.run(
        [sys.executable, "-m", "kvpressure.dashboards.build", "--check"],
        cwd=ROOT,
        check=False,
        capture_output=True,
        text=True,
    )
    assert res.returncode == 0, f"{res.stderr}\ndashboards/*.json {REGENERATE}"


@pytest.mark.parametrize("name", sorted(DASHBOARDS))
def test_dashboard_is_importable(name):
    d = DASHBOARDS[name]
    assert d["schemaVersion"] == build.SCHEMA_VERSION >= 39
    assert d["id"] is None and d["uid"] == name.removesuffix(".json") and len(d["uid"]) <= 40
    assert d["title"].startswith("kvpressure / ") and d["description"]
    assert build.TAG in d["tags"]
    (inp,) = d["__inputs"]
    assert inp["name"] == "DS_PROMETHEUS"
    assert inp["type"] == "datasource" and inp["pluginId"] == "prometheus"
    requires = {(r["type"], r["id"]) for r in d["__requires"]}
    assert ("grafana", "grafana") in requires and ("datasource", "prometheus") in requires
    assert {p["type"] for p in panels(d)} == {i for t, i in requires if t == "panel"}

    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert {"datasource", "job", "instance", "engine", "gpu"} <= set(variables)
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for v in variables.values():
        if v["type"] == "query":
            assert v["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, v["name"]

    # ${DS_PROMETHEUS} only as the datasource variable's initial value: panels and queries
    # must go through $datasource so the file also works when provisioned from disk.
    body = json.dumps({k: v for k, v in d.items() if k not in ("__inputs", "templating")})
    assert "DS_PROMETHEUS" not in body
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids))
    for p in panels(d):
        where = f"{name}: {p['title']}"
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, where
        assert p["description"], f"{where}: say what question the panel answers"
        assert p["targets"], where
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)), where
        for t in p["targets"]:
            assert t["datasource"]["uid"] == "${datasource}", where
            assert t["expr"].strip(), where
        assert p["fieldConfig"]["defaults"]["unit"] in UNITS, where


@pytest.mark.parametrize("name", sorted(DASHBOARDS))
def test_layout_fits_the_grid_without_overlap(name):
    cells: dict[tuple[int, int], str] = {}
    for p in DASHBOARDS[name]["panels"]:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24 and g["h"] > 0, p["title"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{p['title']} overlaps {cells[(x, y)]}"
                cells[(x, y)] = p["title"]


# What the issue asks each dashboard to show, as the metrics that must appear in it.
COVERAGE = {
    "kvpressure-memory-pressure.json": [
        "kvpressure_gpu_memory_used_bytes",
        "kvpressure_gpu_memory_reserved_bytes",
        "kvpressure:gpu_memory_headroom:ratio",
        "kvpressure_engine_kv_cache_usage_ratio",
        "kvpressure_engine_requests_waiting",
        "kvpressure_engine_requests_running",
        "kvpressure_engine_preemptions_total",
        'kvpressure_psi_stall_seconds_total{job=~"$job", instance=~"$instance", '
        'resource=~"memory|io"}',
        "kvpressure_memory_tier_bytes",
    ],
    "kvpressure-accelerator.json": [
        "kvpressure_gpu_utilization_ratio",
        "kvpressure_gpu_sm_occupancy_ratio",
        "kvpressure_gpu_memory_bandwidth_utilization_ratio",
        "kvpressure_accelerator_stall_seconds_total",
        "kvpressure_data_movement_bytes_per_token",
        "kvpressure_gpu_clock_event_active",
    ],
    "kvpressure-capacity.json": [
        "kvpressure:engine_kv_headroom_tokens",
        "kvpressure_engine_prefix_cache_hit_tokens_total",
        "kvpressure:engine_prefix_cache_hit:ratio_rate5m",
    ],
    "kvpressure-agent-health.json": [
        "kvpressure_sampler_up",
        "kvpressure_sampler_duration_seconds",
        "kvpressure_engine_up",
        "kvpressure_engine_parse_errors_total",
        "up{",
    ],
}


@pytest.mark.parametrize("name", sorted(COVERAGE))
def test_dashboard_shows_what_the_issue_asks(name):
    text = exprs(DASHBOARDS[name])
    missing = [m for m in COVERAGE[name] if m not in text]
    assert missing == []


def test_alerts_and_dashboards_point_at_each_other():
    rules = (ROOT / "deploy" / "prometheus" / "kvpressure-rules.yml").read_text()
    alerts = set(re.findall(r"alert: (\w+)", rules))
    descriptions = " ".join(p["description"] for d in DASHBOARDS.values() for p in panels(d))
    named = set(re.findall(r"Kvpressure[A-Za-z]+", descriptions))
    assert named <= alerts, f"panel descriptions name unknown alerts: {named - alerts}"


@pytest.mark.parametrize("name", sorted(DASHBOARDS))
def test_dashboard_round_trips_through_grafanas_typed_model(name):
    """Built with grafana-foundation-sdk: the committed JSON decodes into the SDK's typed
    dashboard model (generated from Grafana's schema) and encodes back to itself, so it
    holds nothing outside that schema but the export fields (__inputs, __requires, id)."""
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.models import dashboard as dm

    d = DASHBOARDS[name]
    model = dm.Dashboard.from_json(d)
    assert model.schema_version == build.SCHEMA_VERSION
    assert {type(p).__name__ for p in model.panels or []} <= {"Panel", "RowPanel"}
    again = json.loads(JSONEncoder().encode(model))
    assert again == {k: v for k, v in d.items() if k not in ("__inputs", "__requires", "id")}
    assert {"__inputs", "__requires", "id"} <= d.keys()
