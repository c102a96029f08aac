"""Every attribution rule declares what it reads, and fires through the real timeline path.

The trap this closes: a rule reading a metric the attribution sampler never loads from the
timeline (``METRICS_READ``) passes its unit tests (built with ``Signals.from_points``) and
never fires in production. Here every case of ``tests/test_attribution_rules.py`` is written
into a real :class:`~agent.timeline.Timeline`, read back with ``Signals.from_timeline`` the
way :class:`~agent.attribution.sampler.AttributionSampler` reads it (``METRICS_READ`` and
``LONG_LOOKBACK``), and must give the same evidence; and each rule's measure may touch only
the metrics it declares.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import pytest
from test_attribution_rules import CASES, ENG, Synth, T, ev, scope

from kvpressure.agent.attribution.rules import (
    LONG_LOOKBACK,
    METRICS_READ,
    RULES,
    RULES_BY_NAME,
    Params,
    RuleSpec,
    evaluate,
    reads,
)
from kvpressure.agent.attribution.signals import Series, Signals
from kvpressure.agent.catalogue import CATALOGUE
from kvpressure.agent.samples import Sample
from kvpressure.agent.timeline import Timeline


def _timeline(s: Synth) -> Timeline:
    tl = Timeline(points_per_series=1024, max_series=10_000)
    by_time: dict[float, list[Sample]] = {}
    for name, series in s.points.items():
        for labels, pts in series.items():
            for t, v in pts:
                by_time.setdefault(t, []).append(Sample(name, v, labels))
    for t in sorted(by_time):
        tl.append(t, by_time[t])
    return tl


def _from_timeline(s: Synth) -> Signals:
    sc = scope()
    lo = sc.start - sc.lead_in_s
    extended = {k: lo - v - Params().cold_start_s for k, v in LONG_LOOKBACK.items()}
    return Signals.from_timeline(_timeline(s), METRICS_READ, lo - 2.0, T + 30, extended)


@pytest.mark.parametrize(
    ("rule", "build", "record", "value"),
    [(c[1], c[3], c[4], c[5]) for c in CASES],
    ids=[c[0] for c in CASES],
)
def test_every_case_fires_the_same_through_signals_from_timeline(rule, build, record, value):
    _, evidence, _ = evaluate(_from_timeline(build()), scope(record), Params())
    e = ev(evidence, rule)
    assert e is not None, f"{rule} did not fire through the timeline: {evidence}"
    assert e.value == pytest.approx(value, rel=1e-6)


def test_every_rule_fires_through_signals_from_timeline():
    fired = set()
    for _id, rule, _cause, build, record, _v, _s in CASES:
        _, evidence, _ = evaluate(_from_timeline(build()), scope(record), Params())
        if ev(evidence, rule) is not None:
            fired.add(rule)
    assert fired == {r.name for r in RULES}


class _Recording(Signals):
    """Signals that remember every metric name asked for."""

    def __init__(self, data: Mapping[str, list[Series]]) -> None:
        super().__init__(data)
        self.asked: set[str] = set()

    def series(self, name: str, match: Mapping[str, str] | None = None) -> Iterator[Series]:
        self.asked.add(name)
        return super().series(name, match)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_each_rule_reads_only_what_it_declares(case):
    _id, rule, _cause, build, record, _v, _s = case
    spec = RULES_BY_NAME[rule]
    sig = _Recording(build().signals()._data)
    spec.measure(sig, scope(record), Params())
    assert sig.asked <= set(spec.reads), sorted(sig.asked - set(spec.reads))


def test_metrics_read_is_built_from_the_rules_and_names_catalogue_metrics():
    declared = {name for r in RULES for name in r.reads}
    assert declared <= set(METRICS_READ)
    # evaluate() reads them (engine_unavailable, engine_stale)
    assert set(METRICS_READ) - declared == {"kvpressure_engine_up", "kvpressure_engine_stats_stale"}
    assert set(METRICS_READ) <= set(CATALOGUE)


def test_a_rule_without_a_declaration_is_refused():
    def undeclared(sig, sc, p):
        return None

    with pytest.raises(TypeError, match="declare its metrics"):
        _ = RuleSpec("x", "memory", 1.0, 0.0, 1.0, "1", "doc", undeclared).reads
    declared = reads("kvpressure_engine_up")(undeclared)
    assert RuleSpec("x", "memory", 1.0, 0.0, 1.0, "1", "doc", declared).reads == (
        "kvpressure_engine_up",
    )


def test_an_undeclared_read_never_reaches_the_rule_through_the_timeline():
    """The trap itself: a metric outside METRICS_READ is not in Signals.from_timeline."""
    s = Synth().gauge("kvpressure_engine_kv_cache_used_tokens", 100, engine=ENG)
    assert "kvpressure_engine_kv_cache_used_tokens" not in METRICS_READ
    assert not _from_timeline(s).has("kvpressure_engine_kv_cache_used_tokens")
