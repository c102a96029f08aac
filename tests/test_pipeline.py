"""The pipeline registry is the agent's map: names, config switches, flow direction.

* the registry's names, the config's ``samplers.<name>`` keys and the ``sampler`` label
  values of ``kvpressure_sampler_up`` (the whole agent, as the golden exposition runs it) are
  the same set;
* imports go one way (no samplers -> requests, exporters -> samplers, config ->
  attribution/capacity, requests -> samplers; sources never import the state);
* sources build and collect without touching the state; a derived stage with ``after`` runs
  right after each report of its source;
* the old ``attribution.enabled`` switch still works, with a deprecation warning.
"""

from __future__ import annotations

import ast
import logging
import threading
import time
from pathlib import Path
from typing import get_args

import pytest

from kvpressure.agent import catalogue, pipeline
from kvpressure.agent.attribution.sampler import AttributionSampler
from kvpressure.agent.attribution.store import AttributionStore
from kvpressure.agent.config import ENGINE_TYPES, ConfigError, SamplersConfig, parse
from kvpressure.agent.pipeline import Context, Plan, Planned, Registration, Sampler, Stage
from kvpressure.agent.requests.record import RequestStream
from kvpressure.agent.samplers.engines import ENGINE_TYPES as ENGINE_MAPPINGS
from kvpressure.agent.samples import Batch
from kvpressure.agent.scheduler import Runners, SamplerRunner
from kvpressure.agent.state import AgentState, SamplerReport
from kvpressure.agent.timeline import Timeline

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = Path(__file__).parent / "fixtures" / "golden" / "e2e-output.txt"


def test_registry_names_config_keys_and_sampler_labels_are_one_set():
    regs = pipeline.registry()
    names = set(regs)
    assert names == set(SamplersConfig.model_fields)
    # the golden exposition runs the whole agent with every stage on, two engines configured
    labels = {
        line.split('sampler="', 1)[1].split('"', 1)[0]
        for line in GOLDEN.read_text().splitlines()
        if line.startswith("kvpressure_sampler_up{")
    }
    by_label = {r.label: r.name for r in regs.values()}
    assert {by_label[v.split(":", 1)[0]] for v in labels} == names
    # per-instance samplers are "<label>:<instance>", the others their bare name
    for v in labels:
        reg = regs[by_label[v.split(":", 1)[0]]]
        assert (":" in v) == (reg.label != reg.name), v


def test_sources_come_before_derived_stages_and_after_names_a_source():
    regs = list(pipeline.registry().values())
    stages = [r.stage for r in regs]
    assert stages == sorted(stages, key=lambda s: s is Stage.DERIVED)
    sources = {r.name for r in regs if r.stage is Stage.SOURCE}
    for r in regs:
        assert set(r.after) <= sources, r.name
    assert pipeline.registry()["accelerator"].after == ("gpu",)


def test_every_stage_switch_turns_its_stage_off():
    for name in pipeline.registry():
        cfg = parse(f"samplers: {{{name}: {{enabled: false}}}}\nengines: "
                    "[{name: e, type: vllm, url: 'http://127.0.0.1:1'}]\n")  # fmt: skip
        ctx = Context(cfg, AgentState(Timeline(16, 100)), RequestStream(), AttributionStore(),
                      engines=tuple(cfg.engines))  # fmt: skip
        planned = {p.reg.name for p in pipeline.plan(ctx).values()}
        assert name not in planned
        assert planned == set(pipeline.registry()) - {name} - (
            {"accelerator"} if name == "gpu" else set()
        )


def _imports(path: Path) -> set[str]:
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return out


def _files(package: str) -> list[Path]:
    return sorted((ROOT / package.replace(".", "/")).rglob("*.py"))


@pytest.mark.parametrize(
    ("importer", "forbidden"),
    [
        ("kvpressure.agent.samplers", "kvpressure.agent.requests"),
        ("exporters", "kvpressure.agent.samplers"),
        ("kvpressure.agent.requests", "kvpressure.agent.samplers"),
        ("kvpressure.agent.config", "kvpressure.agent.attribution"),
        ("kvpressure.agent.config", "kvpressure.agent.capacity"),
    ],
)
def test_imports_go_one_way(importer, forbidden):
    path = ROOT / (importer.replace(".", "/") + ".py")
    files = [path] if path.exists() else _files(importer)
    bad = {
        f"{f.relative_to(ROOT)} imports {m}"
        for f in files
        for m in _imports(f)
        if m == forbidden or m.startswith(forbidden + ".")
    }
    assert not bad, sorted(bad)


def test_sources_do_not_import_the_state_or_other_sources():
    regs = pipeline.registry().values()
    source_modules = {r.plan.__module__ for r in regs if r.stage is Stage.SOURCE}
    assert source_modules == {
        "kvpressure.agent.samplers.host",
        "kvpressure.agent.samplers.gpu",
        "kvpressure.agent.samplers.engines",
    }
    files = [
        f
        for f in _files("kvpressure.agent.samplers")
        if f.name != "accelerator.py"  # the one derived stage under samplers/
    ]
    for f in files:
        for m in _imports(f):
            assert m not in ("kvpressure.agent.state", "kvpressure.agent.timeline"), (
                f"{f.relative_to(ROOT)}: {m}"
            )
            assert not m.startswith("kvpressure.agent.requests"), f"{f.relative_to(ROOT)}: {m}"
    host = _imports(ROOT / "agent/samplers/host.py")
    assert not any(
        m.startswith(("kvpressure.agent.samplers.gpu", "kvpressure.agent.samplers.engines"))
        for m in host
    )


class _NoState:
    """A state that fails on any use: sources must never read it."""

    def __getattr__(self, name: str) -> object:
        raise AssertionError(f"a source used the state ({name})")


def test_sources_build_and_collect_without_the_state(tmp_path):
    cfg = parse(
        f"procfs_root: {tmp_path}\nsysfs_root: {tmp_path}\ngpu: {{binding: 'fake:h200'}}\n"
        "engines: [{name: e, type: vllm, url: 'http://127.0.0.1:9'}]\n"
    )
    ctx = Context(cfg, _NoState(), RequestStream(), AttributionStore(), engines=tuple(cfg.engines))
    regs = pipeline.registry()
    for reg in regs.values():
        if reg.stage is not Stage.SOURCE:
            continue
        for p in reg.plan(ctx):
            s = p.build()
            try:
                s.collect(Batch())
            finally:
                s.close()


class _Counting(Sampler):
    def __init__(self, name: str, interval_s: float) -> None:
        super().__init__(interval_s)
        self.name = name
        self.runs = 0
        self.threads: set[int] = set()
        self.closed = False

    def collect(self, batch: Batch) -> None:
        self.runs += 1
        self.threads.add(threading.get_ident())

    def close(self) -> None:
        self.closed = True


def test_a_derived_stage_with_after_runs_after_each_report_of_its_source():
    state = AgentState(Timeline(16, 100))
    src = _Counting("src", 0.1)
    derived = _Counting("der", 3600.0)  # its own interval would never come round

    def reg(name: str, stage: Stage, after: tuple[str, ...] = ()) -> Registration:
        return Registration(name, stage, lambda _ctx: [], "test", after=after)

    desired = {
        "src": Planned(Plan("src", 1, lambda: src), reg("src", Stage.SOURCE)),
        "der": Planned(Plan("der", 1, lambda: derived), reg("der", Stage.DERIVED, ("src",))),
    }
    runners = Runners(state)
    runners.apply(desired, {})
    try:
        deadline = time.monotonic() + 5
        while derived.runs < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        for r in runners.stop():
            r.join(2)
    assert derived.runs >= 3
    assert abs(derived.runs - src.runs) <= 1  # once per source report
    # on the thread that published the source's report: no thread was woken for it
    assert derived.threads <= src.threads
    assert not [t for t in threading.enumerate() if t.name == "sampler-der"]
    assert derived.closed  # stop() closed it


def test_a_derived_stage_that_raises_on_publish_does_not_stop_its_source(caplog):
    state = AgentState(Timeline(16, 100))
    src = _Counting("src", 0.1)
    derived = _Counting("der", 3600.0)

    def reg(name: str, stage: Stage, after: tuple[str, ...] = ()) -> Registration:
        return Registration(name, stage, lambda _ctx: [], "test", after=after)

    def broken_listener(report: SamplerReport) -> None:
        if report.sampler == "der":
            raise RuntimeError("a listener failed")

    state.on_publish(broken_listener)
    desired = {
        "src": Planned(Plan("src", 1, lambda: src), reg("src", Stage.SOURCE)),
        "der": Planned(Plan("der", 1, lambda: derived), reg("der", Stage.DERIVED, ("src",))),
    }
    runners = Runners(state)
    with caplog.at_level(logging.ERROR):
        runners.apply(desired, {})
        try:
            deadline = time.monotonic() + 5
            while src.runs < 4 and time.monotonic() < deadline:
                time.sleep(0.05)
        finally:
            for r in runners.stop():
                r.join(2)
    assert src.runs >= 4 and derived.runs >= 3  # the source kept going, the stage with it
    assert "derived stage failed" in caplog.text


def test_the_old_attribution_switch_still_works_with_a_deprecation_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="kvpressure.agent.config"):
        cfg = parse("attribution: {enabled: false, slo_ttft_s: 3}\n")
    assert cfg.samplers.attribution.enabled is False
    assert cfg.attribution.slo_ttft_s == 3
    assert any("attribution.enabled is deprecated" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvpressure.agent.config"):
        cfg = parse("attribution: {enabled: false}\nsamplers: {attribution: {enabled: true}}\n")
    assert cfg.samplers.attribution.enabled is True  # the new key wins
    assert any("ignored" in r.getMessage() for r in caplog.records)
    ctx = Context(parse("attribution: {enabled: false}\n"), AgentState(Timeline(16, 100)),
                  RequestStream(), AttributionStore())  # fmt: skip
    assert "attribution" not in pipeline.plan(ctx)


def test_every_stage_has_an_interval_switch():
    cfg = parse(
        "interval_s: 2\nsamplers: {requests: {interval_s: 5}, capacity: {interval_s: 7},"
        " attribution: {interval_s: 3}}\n"
    )
    ctx = Context(cfg, AgentState(Timeline(16, 100)), RequestStream(), AttributionStore())
    plans = pipeline.plan(ctx)
    got = {n: plans[n].plan.build().interval_s for n in ("requests", "capacity", "attribution")}
    assert got == {"requests": 5.0, "capacity": 7.0, "attribution": 3.0}
    assert ctx.interval_s("host") == 2.0


def test_capacity_runs_no_faster_than_the_engines_it_reads_unless_told():
    def capacity_interval(text: str) -> float:
        ctx = Context(
            parse(text), AgentState(Timeline(16, 100)), RequestStream(), AttributionStore()
        )
        return pipeline.plan(ctx)["capacity"].plan.build().interval_s

    assert capacity_interval("interval_s: 0.1\nsamplers: {engines: {interval_s: 1}}\n") == 1.0
    assert capacity_interval("interval_s: 2\nsamplers: {engines: {interval_s: 1}}\n") == 2.0
    assert capacity_interval("interval_s: 0.5\n") == 0.5  # engines at the global interval
    assert (
        capacity_interval(
            "interval_s: 0.1\nsamplers: {engines: {interval_s: 1}, capacity: {interval_s: 0.2}}\n"
        )
        == 0.2
    )


def test_attribution_judges_no_faster_than_half_its_settle_time_unless_told():
    def attribution(text: str) -> tuple[float, float]:
        ctx = Context(
            parse(text), AgentState(Timeline(16, 100)), RequestStream(), AttributionStore()
        )
        s = pipeline.plan(ctx)["attribution"].plan.build()
        assert isinstance(s, AttributionSampler)
        return s.interval_s, s.settle_s

    # the 8-GPU node: sources at 0.1 s, engines scraped at 1 s -> settle 2 s, judged at 1 s
    assert attribution("interval_s: 0.1\nsamplers: {engines: {interval_s: 1}}\n") == (1.0, 2.0)
    # the host reads its CPU, disk and network counters once a second under 1 s: a record
    # is judged after the read that follows its end (2 x 1 s), not 2 x 0.1 s
    assert attribution("interval_s: 0.1\n") == (1.0, 2.0)
    no_host = "interval_s: 0.1\nsamplers: {host: {enabled: false}}\n"
    assert attribution(no_host) == (pytest.approx(0.1), pytest.approx(0.2))
    # a disabled source's own interval does not count; a running source's does
    off = "interval_s: 0.1\nsamplers: {host: {enabled: false, interval_s: 5}}\n"
    assert attribution(off) == (pytest.approx(0.1), pytest.approx(0.2))
    slow_gpu = "interval_s: 0.1\nsamplers: {host: {enabled: false}, gpu: {interval_s: 3}}\n"
    assert attribution(slow_gpu) == (1.0, 6.0)
    nothing = "interval_s: 0.5\nsamplers: {host: {enabled: false}, gpu: {enabled: false},"
    assert attribution(nothing + " engines: {enabled: false}}\n") == (0.5, 1.0)
    assert attribution("interval_s: 5\n") == (5.0, 10.0)  # never faster than asked
    assert attribution("interval_s: 0.1\nattribution: {settle_s: 0}\n")[0] == 0.1
    told = "interval_s: 0.1\nsamplers: {engines: {interval_s: 1}, attribution: {interval_s: 0.1}}\n"
    assert attribution(told) == (0.1, 2.0)


def test_stage_owned_config_checks_still_reject_at_parse():
    with pytest.raises(ConfigError, match=r"f\.yaml: attribution\.thresholds: unknown rule"):
        parse("attribution: {thresholds: {nope: [1, 2]}}\n", "f.yaml")
    with pytest.raises(ConfigError, match=r"threshold and saturation must differ"):
        parse("attribution: {thresholds: {kv_cache_usage: [1, 1]}}\n", "f.yaml")


def test_config_engine_types_are_the_engine_registry():
    assert set(ENGINE_TYPES) == {"auto", *ENGINE_MAPPINGS}


def test_catalogue_constants_and_sample_names_match_the_catalogue():
    consts = {
        k: v
        for k, v in vars(catalogue).items()
        if k.isupper() and isinstance(v, str) and v.startswith("kvpressure_")
    }
    assert set(consts.values()) == set(catalogue.CATALOGUE)
    for k, v in consts.items():
        assert k == v.removeprefix("kvpressure_").upper()
    want = []
    for name, m in catalogue.CATALOGUE.items():
        want += (
            [name + s for s in ("_bucket", "_count", "_sum")] if m.kind == "histogram" else [name]
        )
    assert list(get_args(catalogue.SampleName)) == want


def test_runners_survive_a_factory_that_raises():
    state = AgentState(Timeline(16, 100))
    reg = Registration("bad", Stage.SOURCE, lambda _c: [], "test")

    def boom() -> Sampler:
        raise RuntimeError("no")

    runners = Runners(state)
    runners.apply({"bad": Planned(Plan("bad", 1, boom), reg)}, {})
    report = state.report("bad")
    assert report is not None and not report.ok and report.reason == "init"
    assert threading.active_count() >= 1


def test_closed_sets_are_types_that_match_their_runtime_sets():
    from kvpressure.agent.attribution.model import ALL_CAUSES, Cause
    from kvpressure.agent.attribution.rules import RULES
    from kvpressure.agent.requests.record import OUTCOMES, Outcome
    from kvpressure.agent.samples import SourceState

    assert set(get_args(Cause)) == set(ALL_CAUSES)
    assert {r.cause for r in RULES} <= set(ALL_CAUSES)
    assert set(get_args(Outcome)) == OUTCOMES
    assert set(get_args(SourceState)) == {"ok", "error", "unsupported"}


def test_the_accelerator_is_unsupported_where_the_gpu_sampler_is():
    from kvpressure.agent.samplers.accelerator import AcceleratorSampler
    from kvpressure.agent.state import SamplerReport

    gpu = Batch()
    gpu.source_unsupported("nvml", "library_not_found")
    report = SamplerReport("gpu", 1.0, 0.01, True, "", gpu)
    acc = AcceleratorSampler(lambda: report, None)
    b = Batch()
    acc.collect(b)
    assert [(s.source, s.state, s.reason) for s in b.sources] == [
        ("gpu", "unsupported", "library_not_found")
    ]
    assert b.samples == []


def test_a_derived_stage_whose_sources_are_all_off_is_reported_not_silent(tmp_path, caplog):
    assert pipeline.starved(parse("{}\n")) == []
    cfg = parse("samplers: {gpu: {enabled: false}}\n")
    msgs = pipeline.starved(cfg)
    assert msgs == [
        "samplers.accelerator is enabled but will not run: its input samplers.gpu is disabled"
    ]
    # turning the derived stage off too is a consistent config: nothing to say
    assert (
        pipeline.starved(
            parse("samplers: {gpu: {enabled: false}, accelerator: {enabled: false}}\n")
        )
        == []
    )
    with caplog.at_level(logging.WARNING, logger="kvpressure.agent.pipeline"):
        pipeline.warn_starved(cfg)
    assert [r.getMessage() for r in caplog.records] == msgs
    # check-config says it too, and still accepts the file
    import subprocess
    import sys

    f = tmp_path / "c.yaml"
    f.write_text("samplers:\n  gpu:\n    enabled: false\n")
    r = subprocess.run([sys.executable, "-m", "kvpressure", "check-config", str(f)],
                       capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "warning: samplers.accelerator is enabled but will not run" in r.stderr


def test_latest_many_answers_each_name_as_latest_does() -> None:
    """One pass over the reports gives, per name, what one ``latest`` call per name gives:
    healthy reports only, the first sampler by name winning a series both report."""
    state = AgentState(Timeline())
    running, waiting = "kvpressure_engine_requests_running", "kvpressure_engine_requests_waiting"

    def batch(*samples: tuple[str, float, str]) -> Batch:
        b = Batch()
        for name, value, engine in samples:
            b.add(name, value, engine=engine)
        return b

    state.publish(
        SamplerReport("b", 1.0, 0.0, True, "", batch((running, 2, "x"), (waiting, 5, "y")))
    )
    state.publish(SamplerReport("a", 1.0, 0.0, True, "", batch((running, 1, "x"))))
    state.publish(SamplerReport("c", 1.0, 0.0, False, "timeout", None))
    names = (running, waiting, "kvpressure_engine_kv_cache_usage_ratio")
    many = state.latest_many(names)
    assert many == {n: state.latest(n) for n in names}
    assert {dict(k)["engine"]: v for k, v in many[running].items()} == {"x": 1.0}
    assert many["kvpressure_engine_kv_cache_usage_ratio"] == {}
    # only the samplers asked for: "b" alone, then "a" or "c" (c is down: nothing)
    assert {dict(k)["engine"]: v for k, v in state.latest_many(names, ("b",))[running].items()} == {
        "x": 2.0
    }
    assert state.latest_many(names, ("a", "c")) == state.latest_many(names, ("a",))
    assert state.latest_many(names, ("z",)) == {n: {} for n in names}


def test_held_samples_are_current_values_but_not_new_timeline_points() -> None:
    """A sample a sampler holds from an earlier read (:meth:`Batch.hold`) is exported and
    read as the latest value, but the timeline keeps only the times it was read: a counter's
    rate over a short window then spans the reads around it instead of a step to zero."""
    state = AgentState(Timeline())
    retrans, avail = (
        "kvpressure_net_tcp_retransmitted_segments_total",
        "kvpressure_host_memory_available_bytes",
    )
    first = Batch()
    first.add(avail, 100)
    first.add(retrans, 10)
    state.publish(SamplerReport("host", 1.0, 0.0, True, "", first))
    held = tuple(s for s in first.samples if s.name == retrans)
    for k, value in enumerate((90, 80, 70), start=1):
        b = Batch()
        b.add(avail, value)
        b.hold(held)
        assert b.held == 1 and b.recorded() == [s for s in b.samples if s.name == avail]
        state.publish(SamplerReport("host", 1.0 + k / 10, 0.0, True, "", b))
        assert state.latest(retrans) == {(): 10.0}  # still exported, still the latest
    last = Batch()
    last.add(avail, 60)
    last.add(retrans, 30)
    state.publish(SamplerReport("host", 2.0, 0.0, True, "", last))
    assert state.timeline.window(retrans) == {(): [(1.0, 10.0), (2.0, 30.0)]}
    assert [v for _, v in state.timeline.window(avail)[()]] == [100, 90, 80, 70, 60]


class _Blocking(Sampler):
    """A derived stage whose collection waits for ``release`` (a hung stage)."""

    def __init__(self, name: str) -> None:
        super().__init__(3600.0, timeout_s=0.3)
        self.name = name
        self.entered = threading.Event()
        self.release = threading.Event()
        self.closed = False

    def collect(self, batch: Batch) -> None:
        self.entered.set()
        self.release.wait(10)

    def close(self) -> None:
        self.closed = True


def test_a_hung_derived_stage_marks_its_source_down_and_stop_does_not_wait_for_it():
    state = AgentState(Timeline(16, 100))
    src = _Counting("src", 0.1)
    stage = _Blocking("der")

    def reg(name: str, kind: Stage, after: tuple[str, ...] = ()) -> Registration:
        return Registration(name, kind, lambda _ctx: [], "test", after=after)

    desired = {
        "src": Planned(Plan("src", 1, lambda: src), reg("src", Stage.SOURCE)),
        "der": Planned(Plan("der", 1, lambda: stage), reg("der", Stage.DERIVED, ("src",))),
    }
    runners = Runners(state)
    runners.apply(desired, {})
    try:
        assert stage.entered.wait(5)
        deadline = time.monotonic() + 5
        # the watchdog: the source's collection (its publication, the stage inside) overran
        while time.monotonic() < deadline:
            runners.check_timeouts(time.monotonic())  # its own trigger of "der" does not wait
            got = state.report("src")
            if got is not None and not got.ok:
                break
            time.sleep(0.05)
        got = state.report("src")
        assert got is not None and got.reason == "timeout"
        t0 = time.monotonic()
        stopped = runners.stop()
        assert time.monotonic() - t0 < 0.5  # stop() returns while the stage still hangs
        assert not stage.closed
        stage.release.set()
        for r in stopped:
            assert r.join(5)
        assert stage.closed  # closed by the thread that ran it, once it returned
    finally:
        stage.release.set()


def test_a_failed_source_report_gives_its_stage_an_empty_report_without_running_it():
    state = AgentState(Timeline(16, 100))
    stage = _Counting("der", 3600.0)

    def reg(name: str, kind: Stage, after: tuple[str, ...] = ()) -> Registration:
        return Registration(name, kind, lambda _ctx: [], "test", after=after)

    src = _Counting("src", 3600.0)
    desired = {
        "src": Planned(Plan("src", 1, lambda: src), reg("src", Stage.SOURCE)),
        "der": Planned(Plan("der", 1, lambda: stage), reg("der", Stage.DERIVED, ("src",))),
    }
    runners = Runners(state)
    runners.apply(desired, {})
    try:
        runs = stage.runs
        state.publish(SamplerReport("src", 5.0, 0.0, False, "timeout", None))  # the watchdog's
        got = state.report("der")
        assert stage.runs == runs  # not run on the publishing thread
        assert got is not None and got.ok and got.batch is not None and not got.batch.samples
    finally:
        for r in runners.stop():
            r.join(2)


def test_stop_and_the_end_of_a_trigger_race_without_leaving_the_stage_open():
    """stop() from another thread while a trigger's collection still holds its lock, after
    the collection (the interleaving a review found left the stage open: stop() found the
    lock taken, the trigger had checked the stop flag already), closes the stage, once."""
    state = AgentState(Timeline(16, 100))
    stage = _Counting("der", 3600.0)
    runner = SamplerRunner(stage, state, 1, triggered=True)
    lock = runner._inline

    class StopAfterRelease:
        def acquire(self, blocking: bool = True) -> bool:
            return lock.acquire(blocking)

        def release(self) -> None:
            if not runner.stopped:
                runner.stop()  # another thread's stop(), just before the release
            lock.release()

    runner._inline = StopAfterRelease()  # type: ignore[assignment]
    runner.trigger()
    assert stage.runs == 1
    assert runner.join(1) and stage.closed
