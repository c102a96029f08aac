"""The four symptoms of issue 13, each against the real detector, rules and sampler:

1. a decode stall after a calm first token is slow (judged on its time per output token);
2. a long prompt prefilled at the usual per-token rate is not slow;
3. queueing at the concurrency cap with KV headroom is ``concurrency``, not ``memory``;
4. stale engine statistics (token counters frozen while gauges claim work) are never
   evidence, and the engine sampler marks them stale.

The module imports only what the code before issue 13 already had, and the new names
inside the tests, so run against that code each symptom test fails on its assertion.
"""

from __future__ import annotations

import httpx

from kvpressure.agent.attribution.detector import SlowDetector, Verdict
from kvpressure.agent.attribution.engine import Attributor, primary_cause
from kvpressure.agent.attribution.rules import Params, Scope, evaluate
from kvpressure.agent.attribution.sampler import AttributionSampler
from kvpressure.agent.attribution.signals import Signals
from kvpressure.agent.attribution.store import AttributionStore
from kvpressure.agent.requests.record import RequestRecord, RequestStream
from kvpressure.agent.samplers.engines.base import EngineSampler
from kvpressure.agent.samples import Batch, Sample, make_labels
from kvpressure.agent.timeline import Timeline

T = 1_800_000_000.0
ENG = "vllm"


def span(start: float, ttft: float, decode: float, out: int = 64, prompt: int = 100,
         **kw: object) -> RequestRecord:  # fmt: skip
    """A vLLM ``llm_request`` span as the OTLP receiver records it."""
    return RequestRecord(
        engine=ENG, start=T + start, end=T + start + ttft + decode, source="otlp",
        ttft_s=ttft, e2e_s=ttft + decode, queue_s=0.001, prefill_s=ttft - 0.001,
        decode_s=decode, input_tokens=prompt, output_tokens=out, **kw,  # type: ignore[arg-type]
    )  # fmt: skip


# --- 1. decode stalls --------------------------------------------------------------------


def test_a_decode_stall_after_a_calm_first_token_is_slow():
    d = SlowDetector()
    for i in range(60):
        v = d.judge(span(i, 0.06, 63 * (0.02 + 0.0002 * (i % 5))))
        assert v is not None and not v.slow
    for i in range(5):  # 64 tokens at 0.9 s each (45x), TTFT as calm as ever
        v = d.judge(span(100 + i, 0.06, 63 * 0.9))
        assert v is not None and v.slow
        assert v.phase == "tpot" and "ttft" not in v.phases and "prefill" not in v.phases
        assert v.latency_s == 0.9 and v.basis == "baseline"
        # the decode is the span attributed, not the whole request
        assert v.start == T + 100 + i + 0.06


def test_the_noise_of_short_decodes_does_not_hide_a_long_decode_slowed_several_times():
    # calm: 16-token decodes at 3 ms per token, one in five with a 90 ms hiccup (3x per token)
    d = SlowDetector()
    for i in range(60):
        v = d.judge(span(i, 0.01, 15 * 0.003 + (0.09 if i % 5 == 0 else 0.0), out=16))
        assert v is not None and not v.slow
    # 1,800 tokens at the usual rate with three such hiccups: not slow
    v = d.judge(span(70, 0.01, 1799 * 0.003 + 0.27, out=1800))
    assert v is not None and not v.slow
    # 1,800 tokens at 11 ms per token (3.7x; a request preempted and waiting for KV blocks
    # in waves): slow on its time per output token, though under the 16-token decodes' spread
    v = d.judge(span(80, 0.01, 1799 * 0.011, out=1800))
    assert v is not None and v.slow and v.phase == "tpot"
    assert v.threshold_s < 0.006
    # a 16-token decode at that rate is within the short decodes' usual spread
    v = d.judge(span(90, 0.01, 15 * 0.011 - 0.03, out=16))
    assert v is not None and not v.slow


def test_long_decodes_keep_their_own_spread():
    # long decodes whose time per token varies by +-30 % (context length, batch mix) teach
    # that spread: a long one at 1.45x is not slow, one at 3x is
    d = SlowDetector()
    for i in range(60):
        v = d.judge(span(i, 0.01, 999 * 0.003 * (0.7 + 0.6 * (i % 7) / 6), out=1000))
        assert v is not None and not v.slow
    v = d.judge(span(70, 0.01, 999 * 0.003 * 1.45, out=1000))
    assert v is not None and not v.slow
    v = d.judge(span(80, 0.01, 999 * 0.009, out=1000))
    assert v is not None and v.slow and v.phase == "tpot"


def test_a_request_slow_in_one_phase_teaches_no_phase():
    # queued 10 s behind a full KV cache, then preempted in its decode (1.4x, under the
    # decode's threshold on its own): the incident's decode must not become the normal
    d = SlowDetector()
    for i in range(60):
        d.judge(span(i, 0.06, 63 * 0.02))
    learnt = d.baseline_size(ENG, "tpot")
    for i in range(40):
        r = RequestRecord(
            engine=ENG, start=T + 100 + i, end=T + 110.06 + i + 63 * 0.028, source="otlp",
            ttft_s=10.06, e2e_s=10.06 + 63 * 0.028, queue_s=10.0, prefill_s=0.06,
            decode_s=63 * 0.028, input_tokens=100, output_tokens=64,
        )  # fmt: skip
        v = d.judge(r)
        assert v is not None and v.slow and "tpot" not in v.phases
    assert d.baseline_size(ENG, "tpot") == learnt


def _batch_slope_after_preemption(preempted: bool) -> tuple[SlowDetector, Verdict | None]:
    """Calm 16-token decodes at batch 2; then, at batch 20 while the engine preempts, five
    1,200-token decodes at 1.4x (under the threshold with the safety factor, over it
    beside the preemptions); then one at 2.1x."""
    d = SlowDetector()
    for i in range(60):
        v = d.judge(span(i, 0.01, 15 * 0.003 * (1 + 0.02 * (i % 3)), out=16), batch=2)
        assert v is not None and not v.slow
    storm = [(T + 99.0, T + 140.0)] if preempted else []
    for i in range(5):
        v = d.judge(span(100 + i, 0.01, 1199 * 0.0042, out=1200), batch=20, preempted=storm)
        assert v is not None and v.slow == preempted
    # later, still at batch 20: preemptions were counted during its decode (a fresh wave)
    later = [(T + 149.0, T + 150.0)] if preempted else []
    return d, d.judge(span(148, 0.01, 1199 * 0.0063, out=1200), batch=20, preempted=later)


def test_a_phase_that_ran_while_the_engine_preempted_teaches_nothing():
    # decodes slowed by waits for KV blocks, each under the threshold, teach the fit a batch
    # slope that excuses the next preempted decode; with the engine's preemptions known
    # (kvpressure_engine_preemptions_total rose during their decode) they teach nothing
    d, v = _batch_slope_after_preemption(preempted=True)
    assert d.baseline_size(ENG, "tpot") == 60
    assert v is not None and v.slow and v.phase == "tpot"
    d, v = _batch_slope_after_preemption(preempted=False)  # what the old fit did
    assert d.baseline_size(ENG, "tpot") == 66  # the five, and the 2.1x one learnt as normal
    assert v is not None and not v.slow


def test_only_the_phases_that_overlap_a_preemption_are_left_unlearnt():
    d = SlowDetector()
    # queue and prefill before the preemption interval, decode across it
    r = span(0, 0.06, 63 * 0.02)
    d.judge(r, batch=2, preempted=[(T + 0.5, T + 1.0)])
    assert d.baseline_size(ENG, "prefill") == 1 and d.baseline_size(ENG, "ttft") == 1
    assert d.baseline_size(ENG, "tpot") == 0
    # intervals that end before the request, or start after it: everything is learnt
    d.judge(span(10, 0.06, 63 * 0.02), batch=2, preempted=[(T + 1.0, T + 9.9), (T + 12, T + 13)])
    assert d.baseline_size(ENG, "tpot") == 1


def test_the_sampler_tells_the_detector_when_the_engine_preempted():
    # the engine's preemption counter (two instances of one engine) rose between the
    # samples at T+5 and T+6, and reset on the other instance between T+30 and T+31
    timeline = Timeline(4096, 1000)
    for k in range(41):
        b = Batch()
        b.add("kvpressure_engine_preemptions_total", 7.0 + (3.0 if k >= 6 else 0.0),
              engine=ENG, instance="a:1")  # fmt: skip
        b.add("kvpressure_engine_preemptions_total", 9.0 if k <= 30 else 1.0,
              engine=ENG, instance="b:1")  # fmt: skip
        # one request running in each record's life, none after (an engine still running
        # one after a record's end holds the record for that request's own record)
        busy = any(a <= k < a + 4 for a in (3, 10, 28))
        b.add("kvpressure_engine_requests_running", 1 if busy else 0, engine=ENG, instance="a:1")
        timeline.append(T + k, b.samples)
    stream, detector = RequestStream(), SlowDetector()
    sampler = AttributionSampler(
        stream, timeline, AttributionStore(), detector, Attributor(Params()),
        settle_s=1.0, clock=lambda: T + 45,
    )  # fmt: skip
    stream.submit(span(3.0, 0.06, 63 * 0.05))  # decode T+3.06 - T+6.2: over the rise
    stream.submit(span(10.0, 0.06, 63 * 0.05))  # T+10 - T+13.2: nothing preempted
    stream.submit(span(28.0, 0.06, 63 * 0.05))  # decode T+28.06 - T+31.2: over the reset
    sampler.collect(Batch())
    assert detector.baseline_size(ENG, "ttft") == 3
    assert detector.baseline_size(ENG, "tpot") == 1


def _calm_then_first_wave(
    own: int | None, shared: int = 0, preempted: tuple[tuple[float, float], ...] = ()
) -> Verdict | None:
    """Calm 16-token decodes at 10 ms per token, +-15 %; then a 1,800-token decode at 11.2
    ms per token (on the KV-starved vLLM, a first-wave request that lost 45 % of its decode
    to the wait for blocks, whose unslowed cost, 6 ms, the short decodes overstate)."""
    d = SlowDetector()
    for i in range(60):
        v = d.judge(span(i, 0.01, 15 * 0.010 * (0.85 + 0.01 * (i % 31)), out=16), batch=2)
        assert v is not None and not v.slow
    return d.judge(
        span(100, 0.01, 1799 * 0.0112, out=1800),
        batch=6,
        preempted=preempted,
        own_preemptions=own,
        shared_preemptions=shared,
    )


def test_a_request_the_engine_preempted_is_judged_without_the_safety_factor():
    v = _calm_then_first_wave(own=2)
    assert v is not None and v.slow and v.phase == "tpot"
    assert v.threshold_s < 0.0112
    # the same decode, known not preempted or unknown: within 1.5x the fit, not slow
    for own in (0, None):
        v = _calm_then_first_wave(own=own)
        assert v is not None and not v.slow


def test_a_decode_beside_the_engines_preemptions_is_judged_without_the_safety_factor():
    # the engine never preempted this request, but preempted others (and recomputed them
    # in the steps that made its tokens) while it decoded: on the KV-starved vLLM such a
    # decode took 2.07x its stall-free time at 1.29x the fitted cost
    beside = ((T + 110.0, T + 111.0),)
    v = _calm_then_first_wave(own=0, preempted=beside)
    assert v is not None and v.slow and v.phase == "tpot"
    # a preemption outside its decode (before its first token) changes nothing
    v = _calm_then_first_wave(own=0, preempted=((T + 99.0, T + 100.005),))
    assert v is not None and not v.slow


def test_a_request_that_finished_with_preempted_ones_is_judged_as_preempted():
    # its own count unknown, but the engine preempted the requests that finished with it
    v = _calm_then_first_wave(own=None, shared=3)
    assert v is not None and v.slow and v.phase == "tpot"
    # a count of its own wins over the shared one
    v = _calm_then_first_wave(own=0, shared=3)
    assert v is not None and not v.slow


def test_a_preempted_request_still_needs_a_decode_above_the_noise():
    d = SlowDetector()
    for i in range(60):
        d.judge(span(i, 0.01, 15 * 0.010 * (0.85 + 0.01 * (i % 31)), out=16), batch=2)
    # preempted once, but its decode at the usual cost: the preemption cost it nothing
    v = d.judge(span(100, 0.01, 1799 * 0.0100, out=1800), batch=2, own_preemptions=1)
    assert v is not None and not v.slow
    # its TTFT is judged as any other's: the factor is dropped for the decode phases only
    v = d.judge(span(110, 0.012, 15 * 0.010, out=16), batch=2, own_preemptions=3)
    assert v is not None and not v.slow


def _finished_timeline(
    finished: list[float], preemptions: list[float], instances: int = 1
) -> Timeline:
    """The engine's finished-request counters sampled at T+0, T+1, ... (vLLM's
    ``request_num_preemptions`` count and sum, normalized), on ``instances`` instances
    that each see the same values."""
    timeline = Timeline(4096, 1000)
    for k, (c, p) in enumerate(zip(finished, preemptions, strict=True)):
        b = Batch()
        for n in range(instances):
            inst = f"i{n}:1"
            b.add("kvpressure_engine_finished_requests_total", c, engine=ENG, instance=inst)
            b.add("kvpressure_engine_finished_requests_preemptions_total", p, engine=ENG,
                  instance=inst)  # fmt: skip
        b.add("kvpressure_engine_requests_running", 1, engine=ENG, instance="i0:1")
        timeline.append(T + k, b.samples)
    return timeline


def _own_preemptions(
    timeline: Timeline, records: list[RequestRecord]
) -> list[tuple[int | None, int]]:
    sampler = AttributionSampler(
        RequestStream(), timeline, AttributionStore(), SlowDetector(), Attributor(Params()),
        settle_s=1.0, clock=lambda: T + 45,
    )  # fmt: skip
    pool = sorted(records, key=lambda r: r.end)
    return [tuple(o) for o in sampler._own_preemptions(pool, pool, T + 45)]


def test_the_sampler_reads_each_finished_requests_own_preemptions():
    # one request finished between T+4 and T+5 (preempted 3 times), one between T+7 and
    # T+8 (never), two between T+10 and T+11 (3 preemptions between them: whose?), one
    # between T+13 and T+14 that the agent has no record of beside the known one
    c = [0, 0, 0, 0, 0, 1, 1, 1, 2, 2, 2, 4, 4, 4, 6, 6, 6, 6, 6, 6]
    p = [0, 0, 0, 0, 0, 3, 3, 3, 3, 3, 3, 6, 6, 6, 7, 7, 7, 7, 7, 7]
    recs = [
        span(1.0, 0.05, 3.45 - 0.05),  # ends T+4.45
        span(2.0, 0.05, 5.5 - 0.05),  # ends T+7.5
        span(6.0, 0.05, 4.3 - 0.05),  # ends T+10.3
        span(6.5, 0.05, 4.2 - 0.05),  # ends T+10.7
        span(9.0, 0.05, 4.5 - 0.05),  # ends T+13.5 (the other request that finished is unseen)
        span(12.0, 0.05, 3.02 - 0.05),  # ends T+15.02: too close to the sample at T+15
        span(16.0, 0.05, 3.5 - 0.05),  # ends T+19.5: no sample after it yet
    ]
    # the two that ended between T+10 and T+11 are every request the engine finished
    # there: each shares the 3 preemptions; the one beside an unseen request shares none
    assert _own_preemptions(_finished_timeline(c, p), recs) == [
        (3, 0), (0, 0), (None, 3), (None, 3), (None, 0), (None, 0), (None, 0)
    ]  # fmt: skip
    # two instances of the engine: their counters are summed, 2 finished beside one known
    # record: unknown, nothing shared
    assert _own_preemptions(_finished_timeline(c, p, 2), recs[:2]) == [(None, 0), (0, 0)]


def test_a_record_waits_for_the_scrape_that_counts_it():
    # the engine's counters sampled at T+0..T+4; a request ends at T+4.5 and its span is
    # settled at T+6, before the next full scrape: it is held, then read when it comes
    c, p = [0.0] * 5, [0.0] * 5
    timeline = _finished_timeline(c, p)
    now = [T + 6.0]
    stream, detector = RequestStream(), SlowDetector()
    sampler = AttributionSampler(
        stream, timeline, AttributionStore(), detector, Attributor(Params()),
        settle_s=1.0, clock=lambda: now[0],
    )  # fmt: skip
    stream.submit(span(1.0, 0.05, 3.45))  # ends T+4.5
    sampler.collect(Batch())
    assert detector.baseline_size(ENG, "ttft") == 0  # held
    b = Batch()
    b.add("kvpressure_engine_finished_requests_total", 1.0, engine=ENG, instance="i0:1")
    b.add("kvpressure_engine_finished_requests_preemptions_total", 0.0, engine=ENG,
          instance="i0:1")  # fmt: skip
    timeline.append(T + 5.0, b.samples)
    sampler.collect(Batch())
    assert detector.baseline_size(ENG, "ttft") == 1  # judged
    # an engine whose scrapes stopped does not hold its records past the wait
    stream.submit(span(3.0, 0.05, 3.0))  # ends T+6.05
    now[0] = T + 8.0
    sampler.collect(Batch())
    assert detector.baseline_size(ENG, "ttft") == 1
    now[0] = T + 11.5
    sampler.collect(Batch())
    assert detector.baseline_size(ENG, "ttft") == 2


def test_an_engine_without_per_request_preemptions_leaves_them_unknown():
    timeline = Timeline(4096, 1000)
    for k in range(10):
        b = Batch()
        b.add("kvpressure_engine_preemptions_total", float(k), engine=ENG, instance="a:1")
        timeline.append(T + k, b.samples)
    assert _own_preemptions(timeline, [span(1.0, 0.05, 3.4)]) == [(None, 0)]


def test_a_batch_slope_is_not_extrapolated_past_the_batches_seen():
    # calm on a CPU engine: 3 ms per token alone, 7 ms beside another request (a slope as
    # steep as the cost itself); at batch 8 its unslowed decodes cost 7.5 ms, not 4x that
    d = SlowDetector()
    for i in range(60):
        batch = 1 if i % 2 else 2
        v = d.judge(span(i, 0.01, 15 * (0.003 if batch == 1 else 0.007), out=16), batch=batch)
        assert v is not None and not v.slow
    v = d.judge(span(100, 0.01, 1199 * 0.0075, out=1200), batch=8)
    assert v is not None and not v.slow
    assert d.threshold(ENG, "tpot", 8)[0] == d.threshold(ENG, "tpot", 2)[0]
    # decodes at 2.8x the largest batch's cost (waiting for KV blocks) are slow
    v = d.judge(span(110, 0.01, 1199 * 0.02, out=1200), batch=8)
    assert v is not None and v.slow and v.phase == "tpot"
    # below the batches seen, the cost of the smallest one: batch 0.5 is not held to 1.5 ms
    v = d.judge(span(120, 0.01, 15 * 0.003, out=16), batch=0.5)
    assert v is not None and not v.slow


def test_a_decode_stall_is_judged_on_the_longest_gap_of_a_stream():
    d = SlowDetector()
    gaps = (0.02,) * 15
    for i in range(40):
        d.judge(RequestRecord(ENG, T + i, T + i + 0.4, ttft_s=0.1, e2e_s=0.4, itl_s=gaps,
                              output_tokens=16))  # fmt: skip
    stalled = (0.02,) * 7 + (1.2,) + (0.02,) * 7  # one 1.2 s stall; TPOT 0.1 s, under SLO
    v = d.judge(RequestRecord(ENG, T + 50, T + 51.6, ttft_s=0.1, e2e_s=1.6, itl_s=stalled,
                              output_tokens=16))  # fmt: skip
    assert v is not None and v.slow and v.phase == "itl_max"


def test_tpot_slo():
    d = SlowDetector(slo_tpot_s=0.1)
    v = d.judge(span(0, 0.05, 63 * 0.2))  # warm-up: only the SLOs judge
    assert v is not None and v.slow and v.phase == "tpot" and v.basis == "slo"


# --- 2. long prompts ---------------------------------------------------------------------


def test_a_long_prompt_at_the_usual_per_token_rate_is_not_slow():
    d = SlowDetector(slo_ttft_s=2.0)
    for i in range(60):  # 100-token prompts at 0.5 ms per token, +-4 %
        ttft = 0.05 * (1 + 0.04 * ((i % 5) - 2))
        d.judge(RequestRecord(ENG, T + i, T + i + 1, ttft_s=ttft, e2e_s=1.0, input_tokens=100))
    for i in range(3):  # 3,000 tokens at exactly that rate: TTFT 1.5 s
        v = d.judge(
            RequestRecord(ENG, T + 70 + i, T + 72 + i, ttft_s=1.5, e2e_s=2.0, input_tokens=3000)
        )
        assert v is not None and not v.slow, v
    # 6,000 tokens at that rate miss the 2 s TTFT SLO only because they are long: not slow,
    # the miss reported
    v = d.judge(RequestRecord(ENG, T + 75, T + 79, ttft_s=3.0, e2e_s=3.5, input_tokens=6000))
    assert v is not None and not v.slow and v.slo_missed == ("ttft",)
    # a short prompt that took as long is slow, and so is a long one 3x its expected cost
    v = d.judge(RequestRecord(ENG, T + 80, T + 82, ttft_s=1.5, e2e_s=2.0, input_tokens=100))
    assert v is not None and v.slow and v.phase == "ttft"
    v = d.judge(RequestRecord(ENG, T + 90, T + 96, ttft_s=4.5, e2e_s=5.0, input_tokens=3000))
    assert v is not None and v.slow


def test_the_fit_learns_the_per_token_cost_from_a_mixed_workload():
    from kvpressure.agent.attribution.detector import CostModel, theil_sen

    pts = [(100.0 + (i % 7), 0.05 + 0.0005 * (i % 7)) for i in range(54)]
    pts += [(1650.0 + i, 0.05 + 0.0005 * (1550 + i)) for i in range(6)]
    a, b = theil_sen(pts)
    assert abs(b - 0.0005) < 1e-4 and abs(a) < 0.05
    m = CostModel(500)
    for x, y in pts:
        m.add(x, y)
    assert 0.8 < m.expected(1650) / 0.825 < 1.25


def test_prefix_cache_hits_are_not_prefill_work():
    d = SlowDetector()
    for i in range(40):
        d.judge(RequestRecord(ENG, T + i, T + i + 1, ttft_s=0.05, e2e_s=1.0, input_tokens=100))
    # 3,000 tokens of which 2,900 hit the prefix cache: costs what 100 do
    v = d.judge(RequestRecord(ENG, T + 50, T + 51, ttft_s=0.055, e2e_s=1.0, input_tokens=3000,
                              cached_tokens=2900))  # fmt: skip
    assert v is not None and not v.slow


# --- 3. concurrency cap ------------------------------------------------------------------


def _points(series: dict[tuple[str, tuple[tuple[str, str], ...]], float], lo: int = -30,
            hi: int = 30) -> Signals:  # fmt: skip
    pts: dict[str, dict[tuple[tuple[str, str], ...], list[tuple[float, float]]]] = {}
    for (name, labels), v in series.items():
        pts.setdefault(name, {})[labels] = [(T + k, v) for k in range(lo, hi + 1)]
    return Signals.from_points(pts)


def L(**kw: str) -> tuple[tuple[str, str], ...]:
    return make_labels(dict(kw))


def test_queueing_at_the_slot_cap_with_kv_headroom_is_concurrency_not_memory():
    e = "llamacpp"
    sig = _points({
        ("kvpressure_engine_up", L(engine=e)): 1.0,
        ("kvpressure_engine_slots", L(engine=e, state="total")): 4.0,
        ("kvpressure_engine_slots", L(engine=e, state="processing")): 4.0,
        ("kvpressure_engine_requests_waiting", L(engine=e)): 4.0,
        ("kvpressure_engine_kv_cache_usage_ratio", L(engine=e)): 0.06,
    })  # fmt: skip
    r = RequestRecord(e, T, T + 6, ttft_s=5.0, e2e_s=6.0, input_tokens=199, output_tokens=64)
    scores, evidence, _ = evaluate(sig, Scope(e, T, T + 5, 2.0, r), Params())
    assert primary_cause(scores, 0.3) == "concurrency"
    assert scores["memory"] == 0.0
    cap = next(x for x in evidence if x.signal == "queue_at_cap")
    assert cap.labels == {"cap": "4"}
    from kvpressure.agent.attribution.model import REMEDIES

    assert "--max-num-seqs" in REMEDIES["concurrency"]


def test_queueing_while_kv_is_full_stays_memory():
    e = "vllm"
    sig = _points({
        ("kvpressure_engine_up", L(engine=e)): 1.0,
        ("kvpressure_engine_requests_running", L(engine=e)): 12.0,
        ("kvpressure_engine_requests_waiting", L(engine=e)): 4.0,
        ("kvpressure_engine_kv_cache_usage_ratio", L(engine=e)): 0.99,
    })  # fmt: skip
    scores, _, _ = evaluate(sig, Scope(e, T, T + 5, 2.0), Params())
    assert primary_cause(scores, 0.3) == "memory" and scores["concurrency"] == 0.0


def test_waiting_behind_a_long_prefill_is_named_with_the_blocker_size():
    e = "llamacpp"
    sig = _points({("kvpressure_engine_up", L(engine=e)): 1.0})
    blocker = RequestRecord(e, T - 0.5, T + 3.5, ttft_s=3.0, e2e_s=4.0, input_tokens=1650)
    r = RequestRecord(e, T, T + 3.2, ttft_s=3.0, e2e_s=3.2, input_tokens=55)
    sc = Scope(e, T, T + 3.0, 2.0, r, (blocker,))  # type: ignore[call-arg]
    scores, evidence, _ = evaluate(sig, sc, Params())
    assert primary_cause(scores, 0.3) == "prefill_interference"
    (x,) = [x for x in evidence if x.signal == "prefill_interference"]
    assert x.labels["blocker_tokens"] == "1650" and x.value > 0.8


# --- 4. stale engine statistics ----------------------------------------------------------


def stale_timeline(stale: bool) -> Timeline:
    """vLLM after every request aborted: KV 99 %, 57 running, no token for 35 s."""
    tl = Timeline(4096, 1000)
    for k in range(-40, 30):
        lab = L(engine=ENG, instance="h:1")
        tl.append(T + k, [
            Sample("kvpressure_engine_up", 1.0, lab),
            Sample("kvpressure_engine_kv_cache_usage_ratio", 0.99, L(engine=ENG)),
            Sample("kvpressure_engine_requests_running", 57.0, L(engine=ENG)),
            Sample("kvpressure_engine_requests_waiting", 3.0, L(engine=ENG)),
            Sample("kvpressure_engine_generation_tokens_total", 5000.0, L(engine=ENG)),
            Sample("kvpressure_engine_stats_stale", 1.0 if stale else 0.0, lab),
        ])  # fmt: skip
    return tl


def attribute_one_slow_request(stale: bool):
    """Attribute one slow request (TTFT 4 s) over :func:`stale_timeline`."""
    store = AttributionStore()
    stream = RequestStream()
    s = AttributionSampler(
        stream, stale_timeline(stale=stale), store, SlowDetector(slo_ttft_s=2.0),
        Attributor(Params()), settle_s=1.0, clock=lambda: T + 41,
    )  # fmt: skip
    # judged 31 s after its end: the engine claims 57 running, the agent knows this one
    stream.submit(RequestRecord(ENG, T + 5, T + 10, ttft_s=4.0, e2e_s=5.0))
    s.collect(Batch())
    (a,) = store.attributions()
    return a


def test_stale_engine_statistics_are_never_evidence():
    a = attribute_one_slow_request(stale=True)
    assert a.cause != "memory" and a.scores["memory"] == 0.0
    from kvpressure.agent.attribution.model import ENGINE_METRICS_STALE

    assert ENGINE_METRICS_STALE in a.unassessed
    assert not any(e.metric.startswith("kvpressure_engine_") for e in a.evidence)


def test_fresh_statistics_still_count():
    a = attribute_one_slow_request(stale=False)
    assert a.cause == "memory"


def test_stale_tracker():
    from kvpressure.agent.samplers.engines.staleness import StaleTracker

    t = StaleTracker(stale_after_s=30.0)

    def scrape(tokens: float, running: float, kv: float) -> list[Sample]:
        return [
            Sample("kvpressure_engine_generation_tokens_total", tokens, L(model="m")),
            Sample("kvpressure_engine_requests_running", running, L(model="m")),
            Sample("kvpressure_engine_kv_cache_usage_ratio", kv, L(model="m")),
        ]

    assert t.update(0.0, []) is None  # no token counter: cannot tell
    assert t.update(0.0, scrape(100, 0, 0.1)) is False  # idle: frozen counters are normal
    assert t.update(100.0, scrape(100, 0, 0.1)) is False
    assert t.update(101.0, scrape(100, 5, 0.5)) is False  # work claimed from now on
    assert t.update(130.0, scrape(100, 5, 0.5)) is False
    assert t.update(131.5, scrape(100, 5, 0.5)) is True  # 30.5 s of claimed work, no token
    assert t.update(132.0, scrape(101, 5, 0.5)) is False  # a token: fresh again
    assert t.update(140.0, scrape(101, 0, 0.99)) is False  # a full KV claims work too
    assert t.update(171.0, scrape(101, 0, 0.99)) is True


def test_stale_tracker_counts_moving_work_gauges_as_progress():
    """llama-server adds generated tokens to its counter when a request ends: a long decode
    freezes the counter while its KV usage grows every token; that is work, not staleness."""
    from kvpressure.agent.samplers.engines.staleness import StaleTracker

    t = StaleTracker(stale_after_s=30.0)

    def scrape(tokens: float, running: float, kv: float, used: float) -> list[Sample]:
        return [
            Sample("kvpressure_engine_generation_tokens_total", tokens, L(model="m")),
            Sample("kvpressure_engine_requests_running", running, L(model="m")),
            Sample("kvpressure_engine_kv_cache_usage_ratio", kv, L(model="m")),
            Sample("kvpressure_engine_kv_cache_used_tokens", used, L(model="m")),
        ]

    # 4 slots decoding for 60 s: counter frozen at 500, KV used growing ~10 tokens/s
    for i in range(61):
        assert t.update(float(i), scrape(500, 4, 0.05 + i * 0.001, 400 + 10 * i)) is False
    # the same numbers scrape after scrape under claimed work: stale after 30 s
    for i in range(61, 92):
        assert t.update(float(i), scrape(500, 4, 0.12, 1010)) is (i - 61 >= 30)


VLLM_FROZEN = """# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m"} 57
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="m"} 0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{model_name="m"} 0.99
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{model_name="m"} 5000
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{model_name="m"} 9000
"""


def test_engine_sampler_marks_frozen_statistics_stale(monkeypatch):
    now = {"t": 1000.0}
    monkeypatch.setattr("kvpressure.agent.samplers.engines.base.time.monotonic", lambda: now["t"])
    transport = httpx.MockTransport(
        lambda req: httpx.Response(200, text=VLLM_FROZEN,
                                   headers={"content-type": "text/plain; version=0.0.4"})
    )  # fmt: skip
    s = EngineSampler("v", "http://127.0.0.1:9", engine_type="vllm", transport=transport)

    def cycle() -> tuple[float | None, dict[str, tuple[str, str]]]:
        b = Batch()
        s.collect(b)
        vals = [x.value for x in b.samples if x.name == "kvpressure_engine_stats_stale"]
        return (vals[0] if vals else None), {x.source: (x.state, x.reason) for x in b.sources}

    try:
        assert cycle() == (0.0, {"metrics": ("ok", ""), "stats": ("ok", "")})
        now["t"] += 35.0
        assert cycle() == (1.0, {"metrics": ("ok", ""), "stats": ("error", "stale")})
    finally:
        s.close()


# --- explain -----------------------------------------------------------------------------


def test_explain_tells_what_to_change_for_every_cause_that_scored():
    from kvpressure.agent.attribution.explain import render
    from kvpressure.agent.attribution.model import REMEDIES, Attribution

    store = AttributionStore()
    scores = {"memory": 0.0, "concurrency": 0.8, "compute": 0.45, "storage": 0.1}
    store.add_attribution(
        Attribution(
            engine="llamacpp", start=T, end=T + 6, cause="concurrency", scores=scores,
            evidence=(), unassessed=(), phase="ttft", latency_s=5.0, threshold_s=0.3,
            basis="baseline", slow_phases=(("ttft", 5.0, 0.3, "baseline"),
                                           ("queue", 4.8, 0.05, "baseline")),
        )
    )  # fmt: skip
    text = render(store.query(T - 10, T + 20))
    assert "WHAT TO CHANGE" in text
    assert REMEDIES["concurrency"] in text and REMEDIES["compute"] in text
    assert REMEDIES["storage"] not in text and REMEDIES["memory"] not in text
    assert "[slow: ttft, queue]" in text


def test_noise_in_similar_sizes_does_not_excuse_a_slow_larger_request():
    """Calm prompts of 40-60 tokens with noisy TTFT must not fit a steep slope that makes a
    300-token request waiting 5.8 s look expected (the llama.cpp memory scenario)."""
    d = SlowDetector()
    for i in range(70):
        tokens = 40 + (i * 7) % 21
        ttft = 0.19 * (1 + 0.3 * ((i * 5) % 7 - 3) / 3) * (1 + (tokens - 40) / 40)
        d.judge(RequestRecord(ENG, T + i, T + i + 1, ttft_s=ttft, e2e_s=1.0, input_tokens=tokens))
    for i in range(20):
        v = d.judge(
            RequestRecord(ENG, T + 100 + i, T + 107 + i, ttft_s=5.8, e2e_s=7.0, input_tokens=320)
        )
        assert v is not None and v.slow, v
    # a TTFT past the SLO is never learnt, so the same requests stay slow
    assert d.baseline_size(ENG, "ttft") == 70


def test_the_cap_yields_to_a_shortage_that_slows_the_engine():
    """8 requests for 4 slots while the engine swaps: the queue at the cap is the swap's
    symptom; memory is named, concurrency still scored (and its remedy shown)."""
    scores = {"memory": 0.6, "concurrency": 0.8, "compute": 0.1}
    assert primary_cause(scores, 0.3) == "memory"
    assert primary_cause({"memory": 0.2, "concurrency": 0.8}, 0.3) == "concurrency"
    assert primary_cause({"concurrency": 0.2}, 0.3) == "unknown"


def test_a_short_slow_phase_is_read_over_at_least_a_few_engine_samples():
    """A request that queued 0.8 s during a preemption storm: its own span holds one engine
    sample, too few to show the storm; the evidence is read over at least MIN_SCOPE_S."""
    from kvpressure.agent.attribution.detector import PhaseVerdict, Verdict
    from kvpressure.agent.attribution.engine import MIN_SCOPE_S

    eng = {"engine": "vllm", "instance": "h:1", "model": "m"}
    up = [(T + k, 1.0) for k in range(-30, 31)]
    # preemptions: +4 at T-2, none after
    pre = [(T + k, 100.0 + (4.0 if k >= -2 else 0.0)) for k in range(-30, 31)]
    sig = Signals.from_points(
        {
            "kvpressure_engine_up": {make_labels({"engine": "vllm", "instance": "h:1"}): up},
            "kvpressure_engine_preemptions_total": {make_labels(eng): pre},
        }
    )
    record = RequestRecord(source="otlp", engine="vllm", start=T - 0.5, end=T + 3.0,
                           ttft_s=0.9, e2e_s=3.5, queue_s=0.8)  # fmt: skip
    phase = PhaseVerdict("queue", 0.8, 0.2, "baseline", 0.01, None, T - 0.5, T + 0.3)
    verdict = Verdict(True, "queue", 0.8, 0.2, "baseline", (phase,), T - 0.5, T + 0.3)
    assert MIN_SCOPE_S >= 3.0
    att = Attributor(Params(), lead_in_s=0.0).attribute_request(sig, record, verdict)
    assert att.cause == "memory", att.scores


def test_a_slow_decode_reaches_the_rules_with_its_own_cost_and_the_prefill_beside_it():
    """The verdict's slow decode phases judged against their fit become the scope's
    ``decodes``: their own cost is the expected cost less the co-scheduled allowance; a
    phase judged on its SLO (no fit) or without the co-scheduled work known is left out."""
    from kvpressure.agent.attribution.detector import PhaseVerdict, Verdict
    from kvpressure.agent.attribution.engine import slow_decodes

    e = "llamacpp"
    sig = _points({("kvpressure_engine_up", L(engine=e)): 1.0})
    r = RequestRecord(e, T, T + 4.2, ttft_s=3.7, e2e_s=4.2, input_tokens=1404, output_tokens=8)
    short = RequestRecord(e, T + 3.8, T + 8, ttft_s=0.4, prefill_s=0.28, input_tokens=60)
    # tpot 0.072 s against 0.033 s of its own plus 0.004 s of the co-scheduled 0.045 s allowed
    tpot = PhaseVerdict("tpot", 0.072, 0.058, "baseline", 0.037, 3.0, T + 3.7, T + 4.2,
                        0.004, 0.045)  # fmt: skip
    itl = PhaseVerdict("itl_max", 0.24, 0.2, "slo", None, None, T + 3.7, T + 4.2)
    verdict = Verdict(True, "tpot", 0.072, 0.058, "baseline", (tpot, itl), T + 3.7, T + 4.2)
    (d,) = slow_decodes(verdict)
    assert (d.phase, d.value_s, d.work_s) == ("tpot", 0.072, 0.045)
    assert abs(d.own_s - 0.033) < 1e-12
    att = Attributor(Params()).attribute_request(sig, r, verdict, (short,))
    assert att.cause == "prefill_interference", att.scores
    assert att.evidence[0].signal == "decode_interference"
    # the same decode with nothing prefilled beside it is not interference
    alone = PhaseVerdict("tpot", 0.072, 0.058, "baseline", 0.033, 3.0, T + 3.7, T + 4.2, 0.0, 0.0)
    verdict = Verdict(True, "tpot", 0.072, 0.058, "baseline", (alone,), T + 3.7, T + 4.2)
    att = Attributor(Params()).attribute_request(sig, r, verdict, ())
    assert att.cause == "unknown", att.scores


def test_debug_logging_shows_every_phase_of_every_verdict(caplog):
    d = SlowDetector()
    with caplog.at_level("DEBUG", logger="kvpressure.agent.attribution.detector"):
        for i in range(31):
            d.judge(span(i, 0.06, 63 * 0.02), batch=2)
        line = caplog.records[-1].getMessage()
        assert "(in 100, out 64, preempted ?)" in line
        for phase in ("queue", "prefill", "ttft", "tpot"):
            assert f"{phase} " in line
        assert "tpot 0.02 <= " in line and "(baseline, expected 0.02" in line
        assert "size 2)" in line
        caplog.clear()
        d.judge(span(40, 0.06, 63 * 0.9), batch=2)
        assert "tpot 0.9 > " in caplog.records[-1].getMessage()
