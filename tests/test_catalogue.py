import re
from pathlib import Path

from kvpressure.agent.catalogue import CATALOGUE, markdown_table

ROOT = Path(__file__).resolve().parents[1]
NAME = re.compile(r"^kvpressure_[a-z0-9_]+$")
UNIT_SUFFIX = {
    "bytes": "_bytes",
    "seconds": "_seconds",
    "ratio": "_ratio",
    "watts": "_watts",
    "celsius": "_celsius",
    "tokens": "_tokens",
    "pages": "_pages",
}


def test_names_follow_prometheus_conventions():
    for name, m in CATALOGUE.items():
        assert NAME.match(name), name
        base = name.removesuffix("_total")
        if m.kind == "counter":
            assert name.endswith("_total"), f"counter {name} must end in _total"
        else:
            assert not name.endswith("_total"), f"{m.kind} {name} must not end in _total"
        if m.kind == "info":
            assert name.endswith("_info"), name
        suffix = UNIT_SUFFIX.get(m.unit)
        if suffix and m.kind != "counter":
            assert base.endswith(suffix) or name.endswith("_per_token"), (name, m.unit)
        if m.unit == "seconds":
            assert base.endswith("_seconds"), name
        assert m.help and m.help[-1] in ".)", f"help of {name} should be a sentence"
        assert len(set(m.labels)) == len(m.labels), name


def test_design_names_are_all_declared():
    design = ROOT.parent / "shared" / "DESIGN.md"
    if not design.exists():
        return
    names = set(re.findall(r"`(kvpressure_[a-z0-9_]+)", design.read_text()))
    missing = sorted(n for n in names if n not in CATALOGUE)
    # request and capacity metrics land with their issues (attribution, capacity planner)
    later = {
        n
        for n in missing
        if n.startswith(
            ("kvpressure_request", "kvpressure_slow", "kvpressure_attribution", "kvpressure_kv_")
        )
    }
    assert sorted(set(missing) - later) == []


def test_readme_metric_table_is_generated_from_the_catalogue():
    readme = (ROOT / "README.md").read_text()
    begin, end = "<!-- metrics:begin -->", "<!-- metrics:end -->"
    assert begin in readme and end in readme
    current = readme.split(begin, 1)[1].split(end, 1)[0].strip()
    assert current == markdown_table(), "README metric table is stale: run `kvpressure metrics`"
