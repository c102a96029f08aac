"""Each cause's scoring rules, table-driven over synthetic timelines.

Scope of every case: engine ``llamacpp``, request [T+10, T+14] with a 2 s lead-in, so the
rules read [T+8, T+14]. Signals are sampled every second. Values are chosen so that most
rules land at the middle of their ramp (score = weight x 0.5).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvpressure.agent.attribution.engine import primary_cause
from kvpressure.agent.attribution.model import ENGINE_METRICS
from kvpressure.agent.attribution.rules import (
    RULES,
    RULES_BY_NAME,
    Params,
    Scope,
    SlowDecode,
    evaluate,
    ramp,
)
from kvpressure.agent.attribution.signals import Series, Signals
from kvpressure.agent.requests.record import RequestRecord
from kvpressure.agent.samples import make_labels

T = 1_800_000_000.0
ENG = "llamacpp"
Points = dict[str, dict[tuple[tuple[str, str], ...], list[tuple[float, float]]]]


class Synth:
    """A synthetic timeline: series sampled once a second over [T-300, T+20]."""

    def __init__(self, engine_up: bool = True) -> None:
        self.points: Points = {}
        if engine_up:
            self.gauge("kvpressure_engine_up", 1.0, engine=ENG, instance="h:1")

    def add(self, name: str, fn: Callable[[float], float], lo: float = -300, hi: float = 20,
            **labels: str) -> Synth:  # fmt: skip
        pts = [(T + k, fn(float(k))) for k in range(int(lo), int(hi) + 1)]
        self.points.setdefault(name, {})[make_labels(dict(labels))] = pts
        return self

    def gauge(self, name: str, value: float, **labels: str) -> Synth:
        return self.add(name, lambda _k: value, **labels)

    def counter(self, name: str, per_s: float, **labels: str) -> Synth:
        """A counter rising ``per_s`` a second (from 1000 so resets would show)."""
        return self.add(name, lambda k: 1000.0 + per_s * (k + 300), **labels)

    def signals(self) -> Signals:
        return Signals.from_points(self.points)


def scope(record: RequestRecord | tuple | None = None,
          neighbours: tuple[RequestRecord, ...] = ()) -> Scope:  # fmt: skip
    """The case scope; ``record`` may be ``(record, neighbours)`` or ``(record, neighbours,
    slow decodes)``."""
    decodes: tuple[SlowDecode, ...] = ()
    if isinstance(record, tuple):
        record, neighbours, *rest = record
        decodes = tuple(rest[0]) if rest else ()
    return Scope(ENG, T + 10, T + 14, 2.0, record, neighbours, decodes)


def rec(**kw: object) -> RequestRecord:
    base: dict[str, object] = {"engine": ENG, "start": T + 10, "end": T + 14}
    base.update(kw)
    return RequestRecord(**base)  # type: ignore[arg-type]


def run(s: Synth, record: RequestRecord | tuple | None = None, params: Params | None = None):
    """Evaluate; ``record`` may be ``(record, neighbours)``."""
    return evaluate(s.signals(), scope(record), params or Params())


def ev(evidence, signal):
    got = [e for e in evidence if e.signal == signal]
    return got[0] if got else None


def slots(s: Synth, busy: Callable[[float], float], waiting: Callable[[float], float]) -> Synth:
    s.gauge("kvpressure_engine_slots", 4, engine=ENG, state="total")
    s.add("kvpressure_engine_slots", busy, engine=ENG, state="processing")
    return s.add("kvpressure_engine_requests_waiting", waiting, engine=ENG)


def kv(s: Synth, usage: float) -> Synth:
    return s.gauge("kvpressure_engine_kv_cache_usage_ratio", usage, engine=ENG)


PSI = "kvpressure_psi_stall_seconds_total"
CG_USED = "kvpressure_cgroup_memory_used_bytes"
CG_LIMIT = "kvpressure_cgroup_memory_limit_bytes"
CG_EVENTS = "kvpressure_cgroup_memory_events_total"
HOST_CPU = "kvpressure_host_cpu_seconds_total"
ENGINE_CPU = "kvpressure_engine_process_cpu_seconds_total"


def cpu(s: Synth, stall: float, busy: float, engine: float | None, cores: int = 2) -> Synth:
    """Host CPU PSI some at ``stall`` s/s, ``busy`` of ``cores`` CPUs busy (3/4 user, 1/4
    system), ``engine`` of them the engine's own processes (``None``: not known)."""
    s.counter(PSI, stall, resource="cpu", kind="some", scope="system")
    s.counter(HOST_CPU, 0.75 * busy, mode="user").counter(HOST_CPU, 0.25 * busy, mode="system")
    s.counter(HOST_CPU, cores - busy, mode="idle").counter(HOST_CPU, 0.0, mode="iowait")
    if engine is not None:
        s.counter(ENGINE_CPU, engine, engine=ENG, instance="h:1")
    return s


# (case id, rule, cause, build timeline, record, expected value, expected score)
CASES: list[tuple[str, str, str, Callable[[], Synth], RequestRecord | None, float, float]] = [
    ("queue_full_all_samples", "queue_while_full", "memory",
     lambda: slots(kv(Synth(), 0.95), lambda k: 4, lambda k: 3), None, 1.0, 1.0),
    ("queue_full_2_of_7_samples", "queue_while_full", "memory",
     lambda: slots(kv(Synth(), 0.95), lambda k: 4, lambda k: 2 if k in (9, 10) else 0), None,
     2 / 7, 4 / 7),
    ("queue_at_slot_cap", "queue_at_cap", "concurrency",
     lambda: slots(kv(Synth(), 0.06), lambda k: 4, lambda k: 3), None, 1.0, 0.8),
    ("queue_at_running_cap", "queue_at_cap", "concurrency",
     lambda: kv(Synth(), 0.3).gauge("kvpressure_engine_requests_running", 8, engine=ENG)
     .add("kvpressure_engine_requests_waiting", lambda k: 2 if k in (9, 10) else 0, engine=ENG),
     None, 2 / 7, 0.8 * 4 / 7),
    # a 3,000-token prompt prefilled over [T+8, T+11.6] covers 1.6 s of the 4 s scope; a
    # 150-token one (not 2x this request's 100) and one after the scope do not count
    ("prefill_interference", "prefill_interference", "prefill_interference",
     Synth, (rec(input_tokens=100, ttft_s=4.0),
             (rec(start=T + 8, end=T + 20, input_tokens=3000, ttft_s=3.6),
              rec(start=T + 10, end=T + 12, input_tokens=150, ttft_s=1.0),
              rec(start=T + 15, end=T + 20, input_tokens=5000, ttft_s=3.0))), 0.4, 0.5),
    # a 1,400-token prompt's decode at 73 ms a token against 33 ms for its batch size: 40 ms
    # over, 30 ms of it other requests' (short) prefills batched into its steps
    ("decode_interference", "decode_interference", "prefill_interference",
     Synth, (rec(input_tokens=1400, ttft_s=3.5, output_tokens=8), (),
             (SlowDecode("tpot", 0.073, 0.033, 0.03),)), 0.75, 0.5),
    ("queue_while_kv_full", "queue_while_full", "memory",
     lambda: Synth().gauge("kvpressure_engine_kv_cache_usage_ratio", 0.95, engine=ENG)
     .gauge("kvpressure_engine_requests_waiting", 5, engine=ENG), None, 1.0, 1.0),
    ("kv_usage_high", "kv_cache_usage", "memory",
     lambda: Synth().gauge("kvpressure_engine_kv_cache_usage_ratio", 0.94, engine=ENG),
     None, 0.94, 0.3),
    ("preemptions_2", "preemptions", "memory",
     lambda: Synth().add("kvpressure_engine_preemptions_total", lambda k: 10 + max(0, k - 10),
                         engine=ENG, hi=12), None, 2.0, 1.0),
    ("preemptions_1", "preemptions", "memory",
     lambda: Synth().add("kvpressure_engine_preemptions_total", lambda k: 10 + (k >= 12),
                         engine=ENG), None, 1.0, 0.5),
    ("prefix_cache_collapse", "prefix_cache_collapse", "memory",
     lambda: Synth().counter("kvpressure_engine_prefix_cache_queried_tokens_total", 100, engine=ENG)
     .add("kvpressure_engine_prefix_cache_hit_tokens_total",
          lambda k: 60 * (k + 300) if k <= 8 else 60 * 308 + 10 * (k - 8), engine=ENG),
     None, 5 / 6, 0.5),
    ("gpu_headroom_3pct", "gpu_memory_headroom", "memory",
     lambda: Synth().gauge("kvpressure_gpu_memory_total_bytes", 100, gpu="0", uuid="u")
     .gauge("kvpressure_gpu_memory_used_bytes", 97, gpu="0", uuid="u"), None, 0.03, 0.25),
    ("psi_memory_some_system", "psi_memory_some", "memory",
     lambda: Synth().counter(PSI, 0.2, resource="memory", kind="some", scope="system"),
     None, 0.2, 0.6),
    ("psi_memory_some_engine_scope_preferred", "psi_memory_some", "memory",
     lambda: Synth().counter(PSI, 0.0, resource="memory", kind="some", scope="system")
     .counter(PSI, 0.3, resource="memory", kind="some", scope=ENG), None, 0.3, 1.0),
    ("psi_memory_some_avg10_fallback", "psi_memory_some", "memory",
     lambda: Synth().gauge("kvpressure_psi_avg10_ratio", 0.175, resource="memory", kind="some",
                           scope="system"), None, 0.175, 0.5),
    ("psi_memory_full", "psi_memory_full", "memory",
     lambda: Synth().counter(PSI, 0.085, resource="memory", kind="full", scope="system"),
     None, 0.085, 0.5),
    ("swap_in", "swap_in", "memory",
     lambda: Synth().counter("kvpressure_host_swap_in_pages_total", 505), None, 505, 0.45),
    ("swap_out", "swap_out", "memory",
     lambda: Synth().counter("kvpressure_host_swap_out_pages_total", 505), None, 505, 0.3),
    ("allocstalls", "allocstalls", "memory",
     lambda: Synth().counter("kvpressure_host_allocstalls_total", 25.5), None, 25.5, 0.4),
    ("memory_available_6pct", "memory_available", "memory",
     lambda: Synth().gauge("kvpressure_host_memory_total_bytes", 100)
     .gauge("kvpressure_host_memory_available_bytes", 6), None, 0.06, 0.3),
    ("kv_exhausted_outcome", "kv_exhausted", "memory",
     Synth, rec(outcome="kv_exhausted", e2e_s=4.0), 1.0, 1.0),
    ("major_faults_without_shortage_is_storage", "major_faults", "storage",
     lambda: Synth().counter("kvpressure_host_major_page_faults_total", 1050), None, 1050, 0.35),
    ("major_faults_with_swap_is_memory", "major_faults", "memory",
     lambda: Synth().counter("kvpressure_host_major_page_faults_total", 1050)
     .counter("kvpressure_host_swap_in_pages_total", 50), None, 1050, 0.35),
    ("major_faults_with_cgroup_limit_hits_is_memory", "major_faults", "memory",
     lambda: Synth().counter("kvpressure_host_major_page_faults_total", 1050)
     .counter(CG_EVENTS, 5, scope=ENG, event="max"), None, 1050, 0.35),
    ("major_faults_with_memory_psi_only_is_storage", "major_faults", "storage",
     lambda: Synth().counter("kvpressure_host_major_page_faults_total", 1050)
     .counter(PSI, 0.1, resource="memory", kind="some", scope="system"), None, 1050, 0.35),
    ("psi_memory_without_shortage_beside_disk_is_storage", "psi_memory_some", "storage",
     lambda: Synth().counter(PSI, 0.2, resource="memory", kind="some", scope=ENG)
     .counter("kvpressure_disk_io_time_weighted_seconds_total", 9, device="vda"),
     None, 0.2, 0.6),
    ("psi_memory_with_shortage_beside_disk_is_memory", "psi_memory_full", "memory",
     lambda: Synth().counter(PSI, 0.085, resource="memory", kind="full", scope=ENG)
     .counter("kvpressure_disk_io_time_weighted_seconds_total", 9, device="vda")
     .gauge("kvpressure_host_memory_total_bytes", 100)
     .gauge("kvpressure_host_memory_available_bytes", 6), None, 0.085, 0.5),
    ("cgroup_memory_headroom_6pct", "cgroup_memory_headroom", "memory",
     lambda: Synth().gauge(CG_USED, 94, scope=ENG).gauge(CG_LIMIT, 100, scope=ENG, limit="max")
     .gauge(CG_LIMIT, 200, scope=ENG, limit="high")
     .gauge(CG_USED, 1, scope="other").gauge(CG_LIMIT, 100, scope="other", limit="max"),
     None, 0.06, 0.3),
    ("cgroup_memory_headroom_high_is_lower", "cgroup_memory_headroom", "memory",
     lambda: Synth().gauge(CG_USED, 47, scope=ENG).gauge(CG_LIMIT, 100, scope=ENG, limit="max")
     .gauge(CG_LIMIT, 50, scope=ENG, limit="high"), None, 0.06, 0.3),
    ("cgroup_memory_limit_hits", "cgroup_memory_limit_hits", "memory",
     lambda: Synth().counter(CG_EVENTS, 6, scope=ENG, event="max")
     .counter(CG_EVENTS, 4.25, scope=ENG, event="high")
     .counter(CG_EVENTS, 100, scope=ENG, event="oom"), None, 10.25, 0.4),
    ("psi_io_some_net_of_memory_when_short", "psi_io_some", "storage",
     lambda: Synth().counter(PSI, 0.4, resource="io", kind="some", scope="system")
     .counter(PSI, 0.1, resource="memory", kind="some", scope="system")
     .counter("kvpressure_host_swap_out_pages_total", 50), None, 0.3, 0.5),
    ("psi_io_some_whole_when_memory_not_short", "psi_io_some", "storage",
     lambda: Synth().counter(PSI, 0.3, resource="io", kind="some", scope="system")
     .counter(PSI, 0.1, resource="memory", kind="some", scope="system"), None, 0.3, 0.5),
    ("psi_io_full", "psi_io_full", "storage",
     lambda: Synth().counter(PSI, 0.175, resource="io", kind="full", scope="system"),
     None, 0.175, 0.4),
    ("disk_busy", "disk_busy", "storage",
     lambda: Synth().counter("kvpressure_disk_io_time_seconds_total", 0.725, device="vda")
     .counter("kvpressure_disk_io_time_seconds_total", 0.1, device="vdb"), None, 0.725, 0.3),
    ("disk_queue", "disk_queue", "storage",
     lambda: Synth().counter("kvpressure_disk_io_time_weighted_seconds_total", 9, device="vda"),
     None, 9.0, 0.35),
    ("disk_read", "disk_read", "storage",
     lambda: Synth().counter("kvpressure_disk_read_bytes_total", 2.75e8, device="vda"),
     None, 2.75e8, 0.25),
    ("tcp_retransmits", "tcp_retransmits", "network",
     lambda: Synth().counter("kvpressure_net_tcp_retransmitted_segments_total", 10.5),
     None, 10.5, 0.45),
    ("net_errors", "net_errors", "network",
     lambda: Synth().counter("kvpressure_net_receive_drops_total", 20, interface="eth0")
     .counter("kvpressure_net_transmit_errors_total", 5.5, interface="eth0"), None, 25.5, 0.3),
    ("upstream_connect", "upstream_connect", "network",
     Synth, rec(ttft_s=1.0, upstream_connect_s=0.275), 0.275, 0.5),
    ("transport_gap_no_queue", "transport_gap", "network",
     lambda: Synth().gauge("kvpressure_engine_requests_waiting", 0, engine=ENG),
     rec(ttft_s=1.0, prefill_s=0.375), 0.625, 0.4),
    ("transport_gap_known_queue", "transport_gap", "network",
     Synth, rec(ttft_s=2.0, prefill_s=0.375, queue_s=1.0), 0.625, 0.4),
    ("psi_cpu_some", "psi_cpu_some", "compute",
     lambda: Synth().counter(PSI, 0.5, resource="cpu", kind="some", scope="system"),
     None, 0.5, 0.5),
    # 2 cores busy, 0.8 of them the engine's: 0.9 s/s of stalls, at most the 0.6 not its own
    ("psi_cpu_some_others_share", "psi_cpu_some", "compute",
     lambda: cpu(Synth(), 0.9, 2.0, 0.8), None, 0.6, 0.7),
    # others took 1.5 of 2 cores but the engine's processes waited 0.3 s/s: the stall bounds
    ("psi_cpu_some_stall_bounds", "psi_cpu_some", "compute",
     lambda: cpu(Synth(), 0.3, 2.0, 0.5), None, 0.3, 0.1),
    ("gpu_utilization", "gpu_utilization", "compute",
     lambda: Synth().gauge("kvpressure_gpu_utilization_ratio", 0.975, gpu="0"), None, 0.975, 0.25),
    ("gpu_throttle_2_of_7", "gpu_throttle", "compute",
     lambda: Synth().add("kvpressure_gpu_clock_event_active", lambda k: 1 if k in (9, 13) else 0,
                         gpu="0", reason="hw_slowdown")
     .gauge("kvpressure_gpu_clock_event_active", 1, gpu="0", reason="idle"), None, 2 / 7,
     0.8 * (2 / 7) / 0.5),
    ("accelerator_stall", "accelerator_stall", "compute",
     lambda: Synth().counter("kvpressure_accelerator_stall_seconds_total", 0.2, gpu="0",
                             reason="throttled")
     .counter("kvpressure_accelerator_stall_seconds_total", 0.1, gpu="0", reason="memory_bound")
     .counter("kvpressure_accelerator_stall_seconds_total", 0.9, gpu="0",
              reason="idle_with_queue"), None, 0.3, 0.4),
    ("engine_restart_5s_before", "engine_restart", "engine_restart",
     lambda: Synth().add("kvpressure_engine_restarts_total", lambda k: 0 if k < 5 else 1,
                         engine=ENG), None, 5.0, 55 / 60),
    ("engine_restart_during_request", "engine_restart", "engine_restart",
     lambda: Synth().add("kvpressure_engine_restarts_total", lambda k: 3 if k < 12 else 4,
                         engine=ENG), None, 0.0, 1.0),
    ("gpu_fault_xid", "gpu_fault", "gpu_fault",
     lambda: Synth().add("kvpressure_gpu_xid_errors_total", lambda k: 0 if k < 12 else 1,
                         gpu="0", xid="79"), None, 1.0, 1.0),
    ("gpu_lost", "gpu_fault", "gpu_fault",
     lambda: Synth().add("kvpressure_gpu_up", lambda k: 1 if k < 11 else 0, gpu="0"),
     None, 1.0, 1.0),
]  # fmt: skip


@pytest.mark.parametrize(
    ("rule", "cause", "build", "record", "value", "score"),
    [c[1:] for c in CASES],
    ids=[c[0] for c in CASES],
)
def test_rule_scores(rule, cause, build, record, value, score):
    scores, evidence, _ = run(build(), record)
    e = ev(evidence, rule)
    assert e is not None, f"{rule} did not fire: {evidence}"
    assert e.cause == cause
    assert e.value == pytest.approx(value, rel=1e-6)
    assert e.score == pytest.approx(score, rel=1e-6)
    assert (e.threshold, e.saturation) == Params().limits(RULES_BY_NAME[rule])
    assert scores[cause] >= e.score


def test_every_rule_has_a_case():
    assert {c[1] for c in CASES} == {r.name for r in RULES}


@pytest.mark.parametrize(
    ("build", "rule"),
    [
        (lambda: slots(Synth(), lambda k: 2, lambda k: 3), "queue_while_full"),  # slots free
        (lambda: slots(Synth(), lambda k: 4, lambda k: 0), "queue_while_full"),  # no queue
        (lambda: Synth().gauge("kvpressure_engine_kv_cache_usage_ratio", 0.9, engine=ENG),
         "kv_cache_usage"),
        (lambda: Synth().counter(PSI, 0.05, resource="memory", kind="some", scope="system"),
         "psi_memory_some"),
        (lambda: Synth().counter(PSI, 0.2, resource="cpu", kind="some", scope="system"),
         "psi_cpu_some"),
        (lambda: cpu(Synth(), 0.99, 2.0, 1.9), "psi_cpu_some"),  # the engine's own stalls
        (lambda: Synth().counter(PSI, 0.3, resource="io", kind="some", scope="system")
         .counter(PSI, 0.3, resource="memory", kind="some", scope="system")
         .counter("kvpressure_host_allocstalls_total", 5), "psi_io_some"),
        (lambda: Synth().gauge(CG_USED, 80, scope=ENG).gauge(CG_LIMIT, 100, scope=ENG,
                                                              limit="max"),
         "cgroup_memory_headroom"),
        (lambda: Synth().counter("kvpressure_net_tcp_retransmitted_segments_total", 0.5),
         "tcp_retransmits"),
        (lambda: Synth().add("kvpressure_engine_restarts_total", lambda k: 0 if k < -70 else 1,
                             engine=ENG), "engine_restart"),  # 80 s before: past the cold start
        (lambda: Synth().gauge("kvpressure_gpu_xid_errors_total", 3, gpu="0", xid="79"),
         "gpu_fault"),  # old XIDs, no new ones
    ],
    ids=["slots_free", "no_queue", "kv_at_threshold", "psi_mem_at_threshold", "cpu_below",
         "cpu_engines_own",
         "io_explained_by_thrashing", "cgroup_headroom_20pct", "few_retransmits", "old_restart",
         "old_xids"],
)  # fmt: skip
def test_rules_stay_quiet_at_or_below_threshold(build, rule):
    _, evidence, _ = run(build())
    assert ev(evidence, rule) is None


LONG_DECODE = rec(input_tokens=1400, ttft_s=3.5, output_tokens=8)


def test_a_long_prompts_decode_slowed_by_short_prefills_is_interference():
    # the blockers are 60-token prompts, far from twice this one's 1,400: the queue and
    # prefill rule has nothing to say about them, the decode rule does
    shorts = tuple(rec(start=T + 13.6, end=T + 15, input_tokens=60, ttft_s=0.3, prefill_s=0.28)
                   for _ in range(2))  # fmt: skip
    decode = SlowDecode("tpot", 0.072, 0.033, 0.040)  # all of the 39 ms excess explained
    scores, evidence, _ = run(Synth(), (LONG_DECODE, shorts, (decode,)))
    assert primary_cause(scores, 0.3) == "prefill_interference"
    assert ev(evidence, "prefill_interference") is None
    e = ev(evidence, "decode_interference")
    assert e.value == 1.0 and e.labels["phase"] == "tpot"


@pytest.mark.parametrize(
    "decode",
    [
        SlowDecode("tpot", 0.072, 0.033, 0.0),  # no prefill beside it
        SlowDecode("itl_max", 0.5, 0.05, 0.09),  # one 60-token prefill, a 450 ms stall
        SlowDecode("tpot", 0.030, 0.033, 0.02),  # not over its own cost (slow on its SLO)
    ],
    ids=["no_coscheduled_prefill", "prefill_explains_a_fifth", "under_own_cost"],
)
def test_a_decode_the_prefill_beside_it_does_not_explain_is_not_interference(decode):
    _, evidence, _ = run(Synth(), (LONG_DECODE, (), (decode,)))
    assert ev(evidence, "decode_interference") is None


def test_a_decode_slowed_by_a_cpu_hog_stays_compute():
    # 3x its own cost with one short prefill beside it: others took 60 % of the busy CPU
    s = cpu(Synth(), 0.9, 2.0, 0.8)
    decode = SlowDecode("tpot", 0.11, 0.033, 0.012)
    scores, _, _ = run(s, (LONG_DECODE, (), (decode,)))
    assert primary_cause(scores, 0.3) == "compute"
    assert scores["prefill_interference"] == 0.0


def test_a_decode_with_prompts_batched_in_while_the_engine_swaps_is_memory():
    # the faults suite's memory scenario: 8 requests for 4 slots, the engine swapping; a
    # 2.4 s gap held three newly admitted 400-token prompts whose normal cost alone is the
    # gap. The shortage slowed every step and is named; the decode rule yields to it
    s = Synth().counter("kvpressure_host_swap_out_pages_total", 1900)
    decode = SlowDecode("itl_max", 2.48, 0.08, 2.6)
    scores, evidence, _ = run(s, (LONG_DECODE, (), (decode,)))
    assert primary_cause(scores, 0.3) == "memory"
    assert ev(evidence, "decode_interference") is None
    # without the shortage the same decode is interference
    scores, _, _ = run(Synth(), (LONG_DECODE, (), (decode,)))
    assert primary_cause(scores, 0.3) == "prefill_interference"


def test_transport_gap_needs_a_known_or_empty_queue():
    s = Synth().gauge("kvpressure_engine_requests_waiting", 2, engine=ENG)
    _, evidence, _ = run(s, rec(ttft_s=1.0, prefill_s=0.1))
    assert ev(evidence, "transport_gap") is None  # the gap may be queueing


def test_transport_gap_is_residual_to_an_engine_stall():
    s = Synth().gauge("kvpressure_engine_requests_waiting", 0, engine=ENG)
    s.counter(PSI, 0.6, resource="cpu", kind="some", scope=ENG)  # CPU-starved engine
    scores, evidence, _ = run(s, rec(ttft_s=1.0, prefill_s=0.1))
    assert ev(evidence, "transport_gap") is None
    assert scores["network"] == 0.0 and primary_cause(scores, 0.3) == "compute"


def test_thresholds_from_config_override_defaults():
    s = Synth().counter(PSI, 0.5, resource="cpu", kind="some", scope="system")
    _, evidence, _ = run(s, params=Params({"psi_cpu_some": (0.1, 0.3)}))
    e = ev(evidence, "psi_cpu_some")
    assert (e.threshold, e.saturation, e.score) == (0.1, 0.3, 1.0)


def test_engine_metrics_down_is_unassessed_not_no_memory():
    s = Synth(engine_up=False).add(
        "kvpressure_engine_up", lambda k: 0.0 if 9 <= k <= 13 else 1.0, engine=ENG
    )
    s.gauge("kvpressure_engine_restarts_total", 0, engine=ENG)
    scores, evidence, unassessed = run(s)
    assert unassessed == (ENGINE_METRICS,)
    assert evidence == []  # a metrics outage is neither a restart nor "no memory pressure"
    assert primary_cause(scores, 0.3) == "unknown"


def test_one_failed_scrape_in_a_long_request_leaves_the_engine_assessed():
    """A busy engine that answers one scrape late in a minute-long request (a new user's
    llama.cpp at 8 streams for 4 slots) keeps its other samples as evidence."""
    long = Scope(ENG, T - 50, T + 14, 2.0, rec(start=T - 50), ())
    s = Synth(engine_up=False).add(
        "kvpressure_engine_up", lambda k: 0.0 if k == -20 else 1.0, engine=ENG
    )
    _, _, unassessed = evaluate(s.signals(), long, Params())
    assert unassessed == ()
    # down for a third of the same span: not assessed
    s = Synth(engine_up=False).add(
        "kvpressure_engine_up", lambda k: 0.0 if -30 <= k <= -10 else 1.0, engine=ENG
    )
    _, _, unassessed = evaluate(s.signals(), long, Params())
    assert unassessed == (ENGINE_METRICS,)


def test_engine_never_scraped_is_unassessed():
    _, _, unassessed = run(Synth(engine_up=False))
    assert unassessed == (ENGINE_METRICS,)


def test_engine_up_is_assessed():
    _, _, unassessed = run(Synth())
    assert unassessed == ()


def test_evidence_sorted_strongest_first_and_cause_score_is_max():
    s = slots(Synth(), lambda k: 4, lambda k: 3).gauge(
        "kvpressure_engine_kv_cache_usage_ratio", 0.94, engine=ENG
    )
    scores, evidence, _ = run(s)
    assert [e.signal for e in evidence][:2] == ["queue_while_full", "kv_cache_usage"]
    assert scores["memory"] == 1.0
    assert scores["compute"] == 0.0


@pytest.mark.parametrize(
    ("scores", "expected"),
    [
        ({"memory": 1.0, "gpu_fault": 1.0}, "gpu_fault"),
        ({"memory": 1.0, "engine_restart": 0.5}, "engine_restart"),
        ({"memory": 1.0, "engine_restart": 0.2}, "memory"),
        ({"memory": 0.6, "compute": 0.6}, "memory"),  # ties: memory, storage, network, compute
        ({"network": 0.6, "compute": 0.7}, "compute"),
        ({"storage": 0.29}, "unknown"),
        ({}, "unknown"),
    ],
)
def test_primary_cause(scores, expected):
    assert primary_cause(scores, 0.3) == expected


def test_ramp_both_directions():
    assert ramp(0.5, 0.0, 1.0) == 0.5
    assert ramp(-1.0, 0.0, 1.0) == 0.0
    assert ramp(5.0, 0.0, 1.0) == 1.0
    assert ramp(0.03, 0.05, 0.01) == pytest.approx(0.5)
    assert ramp(float("nan"), 0.0, 1.0) == 0.0
    assert ramp(float("inf"), 60.0, 0.0) == 0.0


def test_counter_increase_is_reset_aware():
    s = Series({}, (0.0, 1.0, 2.0, 3.0), (100.0, 110.0, 5.0, 15.0))
    assert s.increase(0.0, 3.0) == (25.0, 3.0)
    assert s.rate(0.5, 2.5) == pytest.approx(25.0 / 3.0)  # widened to sample boundaries
    assert s.increase_events(0.0, 3.0) == [(1.0, 10.0), (2.0, 5.0), (3.0, 10.0)]
    assert Series({}, (0.0,), (1.0,)).increase(0.0, 1.0) is None


def test_gauge_holds_its_last_value_into_a_scope_without_samples():
    s = Series({}, (0.0, 10.0), (3.0, 4.0))
    assert s.between(4.0, 6.0, hold=True) == [(0.0, 3.0)]
    assert s.between(4.0, 6.0) == []


def _weights_paged_back_from_a_busy_disk(available: float = 21e9) -> Synth:
    """What the storage benchmark scenario looks like (recorded on this project's sandbox):
    the engine's weights dropped from the page cache and read back under heavy writes; the
    refaults raise the engine's memory PSI as much as its io PSI, with no memory shortage."""
    return (
        Synth()
        .counter(PSI, 0.45, resource="memory", kind="some", scope=ENG)
        .counter(PSI, 0.2, resource="memory", kind="full", scope=ENG)
        .counter(PSI, 0.5, resource="io", kind="some", scope=ENG)
        .counter(PSI, 0.22, resource="io", kind="full", scope=ENG)
        .counter("kvpressure_disk_io_time_seconds_total", 0.78, device="vda")
        .counter("kvpressure_disk_io_time_weighted_seconds_total", 30, device="vda")
        .counter("kvpressure_disk_read_bytes_total", 2.2e8, device="vda")
        .counter("kvpressure_host_major_page_faults_total", 3000)
        .gauge("kvpressure_host_memory_total_bytes", 24e9)
        .gauge("kvpressure_host_memory_available_bytes", available)
    )


def test_refaults_without_a_memory_shortage_are_storage():
    scores, evidence, _ = run(_weights_paged_back_from_a_busy_disk())
    assert primary_cause(scores, 0.3) == "storage"
    assert scores["memory"] == 0.0
    assert {e.cause for e in evidence} == {"storage"}
    assert ev(evidence, "psi_memory_some").cause == "storage"
    assert ev(evidence, "psi_io_some").value == pytest.approx(0.5)  # whole, not net of memory


@pytest.mark.parametrize(
    "build",
    [
        lambda: _weights_paged_back_from_a_busy_disk().counter(
            "kvpressure_host_swap_in_pages_total", 400
        ),
        lambda: _weights_paged_back_from_a_busy_disk(available=0.5e9),
        lambda: _weights_paged_back_from_a_busy_disk().counter(
            CG_EVENTS, 25, scope=ENG, event="max"
        ),
        lambda: (
            _weights_paged_back_from_a_busy_disk()
            .gauge(CG_USED, 99, scope=ENG)
            .gauge(CG_LIMIT, 100, scope=ENG, limit="max")
        ),
    ],
    ids=["swap_in", "host_available_2pct", "cgroup_limit_hits", "cgroup_headroom_1pct"],
)
def test_the_same_stalls_under_a_memory_shortage_are_memory(build):
    """Thrashing: the engine's pages are evicted because memory is short (swap, a host
    without available memory, or its own cgroup at memory.max without swap) and refault
    from the same busy disk."""
    scores, evidence, _ = run(build())
    assert primary_cause(scores, 0.3) == "memory", evidence
    assert ev(evidence, "psi_memory_some").cause == "memory"
    assert ev(evidence, "major_faults").cause == "memory"
    assert ev(evidence, "psi_io_some") is None  # 0.5 - 0.45 s/s net of memory: below 0.10
