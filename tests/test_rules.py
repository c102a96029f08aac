"""Prometheus rules and every PromQL query we ship, checked against the metric catalogue.

* ``promtool check rules`` and ``promtool test rules tests/promtool/*.yml`` (every alert
  firing and not firing). Skipped only when promtool is missing outside CI.
* Every PromQL expression in the dashboards (panel targets, variable queries, pending panels)
  and in the rules file is parsed with ``promql_parser``; a metric name missing from
  ``agent/catalogue.py`` (recording rules defined in the rules file and Prometheus's own
  ``up`` allowed), a label the metric does not carry, and a syntax error all fail.

Labels a catalogue metric may carry at query time: its catalogue labels, the target labels
``job`` and ``instance`` that Prometheus adds, ``exported_instance`` where the catalogue
declares ``instance`` (Prometheus renames the agent's engine ``instance`` so with the
recommended ``honor_labels: false``), and ``le`` on a histogram's ``_bucket`` series.
"""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import promql_parser as pp
import pytest
import yaml

from kvpressure.agent.catalogue import CATALOGUE

ROOT = Path(__file__).resolve().parents[1]
RULES = ROOT / "deploy" / "prometheus" / "kvpressure-rules.yml"
PROMTOOL_TESTS = sorted((ROOT / "tests" / "promtool").glob("*.yml"))
DASHBOARD_FILES = sorted((ROOT / "dashboards").glob("*.json"))

TARGET_LABELS = frozenset({"job", "instance"})
PROMETHEUS_SERIES = {"up": TARGET_LABELS}  # written by Prometheus for every target
GRAFANA_MACROS = {"$__rate_interval": "5m", "$__interval": "1m", "$__range": "1h"}
SCALAR_FUNCS = {"scalar", "time", "pi", "minute", "hour", "day_of_month", "month", "year"}
Labels = frozenset[str] | None  # None: unknown (an earlier error), checks skipped


def catalogue_labels() -> dict[str, frozenset[str]]:
    """Metric name -> labels it may carry in Prometheus (see the module docstring)."""
    known: dict[str, frozenset[str]] = dict(PROMETHEUS_SERIES)
    for m in CATALOGUE.values():
        labels = set(m.labels) | TARGET_LABELS
        if "instance" in m.labels:
            labels.add("exported_instance")
        if m.kind == "histogram":
            known[f"{m.name}_bucket"] = frozenset(labels | {"le"})
            known[f"{m.name}_sum"] = frozenset(labels)
            known[f"{m.name}_count"] = frozenset(labels)
        else:
            known[m.name] = frozenset(labels)
    return known


class Checker:
    """Walks a PromQL AST, infers each node's output labels and records problems."""

    def __init__(self, known: dict[str, frozenset[str]]) -> None:
        self.known = known
        self.errors: list[str] = []

    def check(self, expr: str, where: str, legend: str = "") -> Labels:
        """Parse ``expr``; return its output labels, or None after a syntax error."""
        text = expr
        for macro, value in GRAFANA_MACROS.items():
            text = text.replace(macro, value)
        try:
            node = pp.parse(text)
        except (ValueError, RuntimeError) as exc:
            self.errors.append(f"{where}: syntax error: {exc}\n    {expr}")
            return None
        self._where = f"{where}: {' '.join(expr.split())}"
        labels = self.labels(node)
        if labels is not None:
            for name in re.findall(r"\{\{\s*([A-Za-z_][A-Za-z0-9_]*)\s*\}\}", legend):
                if name not in labels:
                    self._err(f"legend uses label {name!r} the query result does not carry")
        return labels

    def _err(self, msg: str) -> None:
        self.errors.append(f"{self._where}\n    {msg}")

    def _need(self, label: str, have: Labels, what: str) -> None:
        if have is not None and label not in have:
            self._err(f"{what}: label {label!r} not carried (has {sorted(have)})")

    @staticmethod
    def is_scalar(node: object) -> bool:
        if isinstance(node, pp.NumberLiteral):
            return True
        if isinstance(node, (pp.ParenExpr, pp.UnaryExpr)):
            return Checker.is_scalar(node.expr)
        if isinstance(node, pp.Call):
            return node.func.name in SCALAR_FUNCS
        if isinstance(node, pp.BinaryExpr):
            return Checker.is_scalar(node.lhs) and Checker.is_scalar(node.rhs)
        return False

    def labels(self, node: object) -> Labels:
        if isinstance(node, pp.VectorSelector):
            return self._selector(node)
        if isinstance(node, pp.MatrixSelector):
            return self._selector(node.vector_selector)
        if isinstance(node, (pp.ParenExpr, pp.UnaryExpr, pp.SubqueryExpr)):
            return self.labels(node.expr)
        if isinstance(node, (pp.NumberLiteral, pp.StringLiteral)):
            return frozenset()
        if isinstance(node, pp.Call):
            return self._call(node)
        if isinstance(node, pp.AggregateExpr):
            return self._aggregate(node)
        if isinstance(node, pp.BinaryExpr):
            return self._binary(node)
        self._err(f"unhandled node {type(node).__name__}")
        return None

    def _selector(self, vs: pp.VectorSelector) -> Labels:
        matchers = list(vs.matchers.matchers) + [m for ms in vs.matchers.or_matchers for m in ms]
        name = vs.name or next(
            (m.value for m in matchers if m.name == "__name__" and m.op == pp.MatchOp.Equal), None
        )
        if name is None:
            self._err("selector without a fixed metric name")
            return None
        have = self.known.get(name)
        if have is None:
            self._err(f"metric {name!r} is not in agent/catalogue.py or the recording rules")
            return None
        for m in matchers:
            if m.name != "__name__":
                self._need(m.name, have, f"matcher on {name}")
        return have

    def _call(self, node: pp.Call) -> Labels:
        fn = node.func.name
        args = list(node.args)
        vectors = [a for a in args if not isinstance(a, (pp.StringLiteral, pp.NumberLiteral))]
        arg_labels = [self.labels(a) for a in vectors]
        if fn in SCALAR_FUNCS or fn in {"vector", "absent", "absent_over_time"}:
            return frozenset()
        if fn == "histogram_quantile":
            base = arg_labels[-1]
            self._need("le", base, "histogram_quantile input")
            return None if base is None else base - {"le"}
        if fn in {"label_replace", "label_join"}:
            base = arg_labels[0]
            strings = [a.val for a in args if isinstance(a, pp.StringLiteral)]
            sources = strings[3:] if fn == "label_join" else strings[2:3]
            for src in sources:
                if src:
                    self._need(src, base, f"{fn} source")
            return None if base is None else base | {strings[0]}
        return next(
            (lab for a, lab in zip(vectors, arg_labels, strict=True) if not self.is_scalar(a)),
            frozenset(),
        )

    def _aggregate(self, node: pp.AggregateExpr) -> Labels:
        inner = self.labels(node.expr)
        if node.param is not None and not isinstance(node.param, pp.StringLiteral):
            self.labels(node.param)
        mod = node.modifier
        grouping = list(mod.labels) if mod is not None else []
        for label in grouping:
            self._need(label, inner, f"{node.op} by/without")
        if inner is None:
            return None
        op = str(node.op)
        if op in {"topk", "bottomk", "limitk", "limit_ratio"}:
            return inner
        if mod is None:
            out: frozenset[str] = frozenset()
        elif mod.type == pp.AggModifierType.By:
            out = frozenset(grouping)
        else:
            out = inner - set(grouping)
        if op == "count_values" and isinstance(node.param, pp.StringLiteral):
            out |= {node.param.val}
        return out

    def _binary(self, node: pp.BinaryExpr) -> Labels:
        lhs, rhs = self.labels(node.lhs), self.labels(node.rhs)
        if self.is_scalar(node.lhs):
            return rhs
        if self.is_scalar(node.rhs):
            return lhs
        mod = node.modifier
        matching = mod.matching if mod is not None else None
        card = mod.card if mod is not None else None
        on = ignoring = None
        if matching is not None and matching.type == pp.LabelModifierType.Include:
            on = list(matching.labels)
            for label in on:
                self._need(label, lhs, "on() left side")
                self._need(label, rhs, "on() right side")
        elif matching is not None:
            ignoring = list(matching.labels)
            both = None if lhs is None or rhs is None else lhs | rhs
            for label in ignoring:
                self._need(label, both, "ignoring()")
        include = list(mod.group_labels or []) if mod is not None else []
        if card == pp.VectorMatchCardinality.ManyToOne:
            for label in include:
                self._need(label, rhs, "group_left() right side")
        if card == pp.VectorMatchCardinality.OneToMany:
            for label in include:
                self._need(label, lhs, "group_right() left side")
        if lhs is None or rhs is None:
            return None
        op = str(node.op)
        if op == "or":
            return lhs | rhs
        if op in {"and", "unless"}:
            return lhs
        if card == pp.VectorMatchCardinality.ManyToOne:
            return lhs | set(include)
        if card == pp.VectorMatchCardinality.OneToMany:
            return rhs | set(include)
        if on is not None:
            return frozenset(on)
        if ignoring is not None:
            return lhs - set(ignoring)
        return lhs


def load_rules() -> dict:
    return yaml.safe_load(RULES.read_text(encoding="utf-8"))


def rule_checker() -> tuple[Checker, dict[str, frozenset[str]]]:
    """Check the rules file in order; return the checker and the recording rules' labels."""
    checker = Checker(catalogue_labels())
    recorded: dict[str, frozenset[str]] = {}
    for group in load_rules()["groups"]:
        for rule in group["rules"]:
            name = rule.get("record") or rule["alert"]
            labels = checker.check(rule["expr"], f"{RULES.name}: {name}")
            if "record" in rule:
                if labels is None:
                    continue
                recorded[name] = labels
                checker.known[name] = labels
                continue
            # annotation templates may only use labels the alert carries
            texts = " ".join(rule.get("annotations", {}).values())
            for label in re.findall(r"\$labels\.([A-Za-z_][A-Za-z0-9_]*)", texts):
                checker._where = f"{RULES.name}: {name} annotations"
                checker._need(label, labels, "annotation $labels")
    return checker, recorded


def dashboard_queries(dashboard: dict) -> list[tuple[str, str, str]]:
    """Return ``(where, expr, legend)`` for every panel target and ``label_values`` query."""
    out = []
    title = dashboard["title"]
    for panel in dashboard["panels"]:
        for t in panel.get("targets", []):
            out.append((f"{title} / {panel['title']}", t["expr"], t.get("legendFormat", "")))
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            out.append((f"{title} / variable {var['name']}", query, ""))
    return out


def check_label_values(checker: Checker, where: str, query: str) -> None:
    m = re.fullmatch(r"\s*label_values\((.*),\s*([A-Za-z_][A-Za-z0-9_]*)\s*\)\s*", query)
    assert m, f"{where}: variable query must be label_values(<selector>, <label>): {query}"
    labels = checker.check(m.group(1), where)
    if labels is not None and m.group(2) not in labels:
        checker.errors.append(f"{where}: label_values label {m.group(2)!r} not on {m.group(1)}")


# --- promtool -----------------------------------------------------------------------------


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        if os.environ.get("CI"):
            pytest.fail("promtool is required in CI (Debian package `prometheus`)")
        pytest.skip("promtool not installed (apt-get install prometheus)")
    return path


def test_promtool_check_rules():
    res = subprocess.run(
        [promtool(), "check", "rules", str(RULES)],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert "SUCCESS" in res.stdout


def test_promtool_unit_tests_pass():
    assert PROMTOOL_TESTS, "no promtool test files in tests/promtool/"
    res = subprocess.run(
        [promtool(), "test", "rules", *map(str, PROMTOOL_TESTS)],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    print(res.stdout, res.stderr, file=sys.stderr)
    assert res.returncode == 0, res.stdout + res.stderr


def test_every_alert_is_unit_tested_firing_and_not_firing():
    alerts = {r["alert"] for g in load_rules()["groups"] for r in g["rules"] if "alert" in r}
    fires, silent = set(), set()
    for path in PROMTOOL_TESTS:
        for case in yaml.safe_load(path.read_text(encoding="utf-8"))["tests"]:
            for t in case.get("alert_rule_test", []):
                (fires if t.get("exp_alerts") else silent).add(t["alertname"])
    assert alerts - fires == set(), "alerts without a firing case"
    assert alerts - silent == set(), "alerts without a not-firing case"
    assert fires | silent <= alerts, "tests name alerts that do not exist"


def test_alerts_have_severity_for_and_runbook():
    uids = {p.stem for p in DASHBOARD_FILES}
    for group in load_rules()["groups"]:
        for rule in group["rules"]:
            if "alert" not in rule:
                assert re.fullmatch(r"[a-z_]+:[a-z0-9_]+(:[a-z0-9_]+)?", rule["record"]), rule
                continue
            name = rule["alert"]
            assert name.startswith("Kvpressure"), name
            assert rule["labels"]["severity"] in {"info", "warning", "critical"}, name
            assert rule.get("for"), f"{name}: alerts need a for: duration"
            ann = rule["annotations"]
            assert {"summary", "description", "runbook", "dashboard"} <= set(ann), name
            assert ann["dashboard"] in uids, f"{name}: unknown dashboard {ann['dashboard']}"
            assert len(ann["runbook"]) > 80, f"{name}: runbook should say what to look at next"


# --- PromQL against the catalogue ---------------------------------------------------------


def test_rules_use_only_catalogue_metrics_and_labels():
    checker, recorded = rule_checker()
    assert checker.errors == [], "\n".join(checker.errors)
    assert "kvpressure:engine_kv_headroom_tokens" in recorded
    assert recorded["kvpressure:psi_memory_full:rate1m"] >= {"scope", "instance"}


def test_dashboards_use_only_catalogue_metrics_and_labels():
    import json

    assert DASHBOARD_FILES
    checker, _ = rule_checker()
    count = 0
    for path in DASHBOARD_FILES:
        dashboard = json.loads(path.read_text(encoding="utf-8"))
        for where, expr, legend in dashboard_queries(dashboard):
            count += 1
            if expr.startswith("label_values("):
                check_label_values(checker, f"{path.name}: {where}", expr)
            else:
                checker.check(expr, f"{path.name}: {where}", legend)
    assert count > 50
    assert checker.errors == [], "\n".join(checker.errors)


def test_pending_panels_parse_and_use_only_declared_names():
    """Panels waiting for later metrics are valid PromQL over the catalogue + their needs."""
    sys.path.insert(0, str(ROOT))
    from kvpressure.dashboards import build

    for pending in build.PENDING:
        checker, _ = rule_checker()
        assert not set(pending.needs) & set(CATALOGUE), (
            f"{pending.needs} are in the catalogue now: move these panels into "
            f"{pending.dashboard} and regenerate (python -m kvpressure.dashboards.build)"
        )
        for name in pending.needs:  # labels as DESIGN.md announces them, unchecked
            checker.known[name] = checker.known[f"{name}_bucket"] = frozenset()
        for item in pending.build():
            if isinstance(item, build.Row):
                continue
            for t in item.body["targets"]:
                checker.check(t["expr"], f"pending {pending.dashboard}")
        problems = [e for e in checker.errors if "not carried" not in e]
        assert problems == [], "\n".join(problems)


def test_promtool_input_series_use_catalogue_metrics_and_labels():
    checker, _ = rule_checker()
    for path in PROMTOOL_TESTS:
        for case in yaml.safe_load(path.read_text(encoding="utf-8"))["tests"]:
            for s in case["input_series"]:
                checker.check(s["series"], f"{path.name}: {case.get('name', '')}")
    assert checker.errors == [], "\n".join(checker.errors)


@pytest.mark.parametrize(
    ("expr", "legend", "problem"),
    [
        ("kvpressure_engine_kv_cache_usage_perc", "", "not in agent/catalogue.py"),
        ('kvpressure_engine_up{model="x"}', "", "label 'model' not carried"),
        ("sum by (gpu) (kvpressure_engine_requests_waiting)", "", "label 'gpu' not carried"),
        ("kvpressure_engine_requests_waiting", "{{gpu}}", "legend uses label 'gpu'"),
        ("sum by (engine) (kvpressure_engine_up)", "{{instance}}", "legend uses label"),
        ("rate(kvpressure_engine_preemptions_total[5m]", "", "syntax error"),
        ("kvpressure_engine_up and on (gpu) up", "", "label 'gpu' not carried"),
        ("histogram_quantile(0.9, sum by (engine) (kvpressure_engine_up))", "", "'le'"),
        ("kvpressure_sampler_up * on (instance) group_left (version) up", "", "'version'"),
        ('{__name__=~"kvpressure_.+"}', "", "without a fixed metric name"),
    ],
)
def test_checker_catches(expr, legend, problem):
    checker = Checker(catalogue_labels())
    checker.check(expr, "case", legend)
    assert any(problem in e for e in checker.errors), checker.errors


@pytest.mark.parametrize(
    "expr",
    [
        'up{job="kvpressure"} == 0',
        'kvpressure_engine_up{exported_instance="127.0.0.1:8000"}',
        "kvpressure_sampler_up * on (job, instance) group_left (version) kvpressure_build_info",
        'label_replace(kvpressure_engine_up, "endpoint", "$1", "exported_instance", "(.*)")',
        "count(kvpressure_sampler_up) or vector(0)",
        "topk(3, rate(kvpressure_disk_read_bytes_total[$__rate_interval]))",
    ],
)
def test_checker_accepts(expr):
    checker = Checker(catalogue_labels())
    checker.check(expr, "case")
    assert checker.errors == []
