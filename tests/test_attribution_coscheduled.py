"""Co-scheduled work in the expected cost (issue 13): interference is slow only when abnormal.

A small discrete-event model of a llama.cpp-like engine (each step prefills every waiting
prompt whole and decodes one token of every running request; a step costs a fixed part plus
a per-prompt-token and a per-decoder part) serves closed-loop streams; its records go
through the real :class:`AttributionSampler` and :class:`SlowDetector`:

* a calm mixed-length workload (two streams, one prompt in ten 1,650 tokens) is the
  engine's normal: the short requests that wait behind, or decode beside, a long prefill
  are not slow (the old detector flags most of them);
* a stream of long prompts back to back beside the short streams is interference beyond
  the engine's normal: the short requests it holds up are slow;
* an engine slowed for every request (a compute fault) is still slow, the co-scheduled
  allowance did not widen the fit;
* a burst for more requests than slots soon after the start (the co-scheduled work's
  usual level is still being learnt) is slow: the burst is not its own normal;
* the long prompts of a calm mixed workload generate 200 tokens, so their records end
  seconds after the short requests they held up: those are judged once the long one's
  record is known (the engine's ``requests_running`` said it was in flight), and are not
  slow (15 of 300 were on the code that judged them 1.5 s after their end); a record whose
  neighbours the agent never sees waits 30 s, not forever.

Run against the code before the co-scheduled model the first test fails on its assertion
(29 of 300 slow); the others pass there too (that code excused nothing): they guard
against the model excusing too much.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from kvpressure.agent.attribution.detector import SlowDetector
from kvpressure.agent.attribution.engine import Attributor
from kvpressure.agent.attribution.rules import Params
from kvpressure.agent.attribution.sampler import AttributionSampler
from kvpressure.agent.attribution.store import AttributionStore
from kvpressure.agent.requests.record import RequestRecord, RequestStream
from kvpressure.agent.samples import Batch
from kvpressure.agent.timeline import Timeline

T = 1_800_000_000.0
ENG = "llamacpp"
SHORT, LONG = 55, 1650
OUT = 16


@dataclass
class _Req:
    stream: int
    arrival: float
    prompt: int
    out: int
    prefilled: bool = False
    prefill_s: float = 0.0
    tokens: list[float] = field(default_factory=list)


@dataclass
class Engine:
    """One engine step: ``base + per_prompt_token x prompt tokens + per_decoder x decoders``
    seconds (2 CPU cores: a 1,650-token prompt costs about 2.5 s), times ``1 + jitter x u``
    with ``u`` uniform in [-1, 1] (a real engine's steps vary: the same 1,650-token prefill
    took 3.05-3.3 s on the real llama.cpp)."""

    base: float = 0.02
    per_prompt_token: float = 0.0015
    per_decoder: float = 0.008
    slowdown: float = 1.0
    jitter: float = 0.0
    rng: random.Random = field(default_factory=lambda: random.Random(7))

    def step_s(self, prompt_tokens: int, decoders: int) -> float:
        raw = self.base + self.per_prompt_token * prompt_tokens + self.per_decoder * decoders
        if self.jitter:
            raw *= 1.0 + self.jitter * self.rng.uniform(-1.0, 1.0)
        return raw * self.slowdown


def simulate(
    engine: Engine,
    streams: list[list[int]],
    t0: float,
    seed: int = 0,
    slots: int = 4,
    out: int = OUT,
    long_out: int | None = None,
    running_log: list[tuple[float, int]] | None = None,
) -> tuple[list[RequestRecord], float]:
    """Serve closed-loop ``streams`` (each a list of prompt sizes, sent one after another,
    0-100 ms apart: a client's own time between requests) on ``slots`` slots, ``out``
    tokens each (``long_out`` for the ``LONG`` prompts when given).

    Returns the records (in the order they ended) and the time the last one ended; appends
    ``(time, requests running)`` after every step to ``running_log`` when given.
    """

    def n_out(prompt: int) -> int:
        return long_out if long_out is not None and prompt == LONG else out

    rng = random.Random(seed)
    pos = [0] * len(streams)
    waiting: list[_Req] = []
    running: list[_Req] = []
    done: list[RequestRecord] = []
    now = t0
    for k, s in enumerate(streams):
        waiting.append(_Req(k, now + rng.uniform(0, 0.1), s[0], n_out(s[0])))
        pos[k] = 1
    while waiting or running:
        batch = [r for r in waiting if r.arrival <= now][: max(0, slots - len(running))]
        if not batch and not running:
            now = min(r.arrival for r in waiting)
            continue
        dur = engine.step_s(sum(r.prompt for r in batch), len(running))
        now += dur
        for r in running:
            r.tokens.append(now)
        for r in batch:
            waiting.remove(r)
            r.prefilled, r.prefill_s = True, dur
            r.tokens.append(now)
            running.append(r)
        if running_log is not None:
            running_log.append((now, len(running)))
        for r in [r for r in running if len(r.tokens) >= r.out]:
            running.remove(r)
            ttft = r.tokens[0] - r.arrival
            gaps = tuple(b - a for a, b in zip(r.tokens, r.tokens[1:], strict=False))
            done.append(RequestRecord(
                ENG, r.arrival, now, ttft_s=ttft, e2e_s=now - r.arrival, prefill_s=r.prefill_s,
                decode_s=now - r.tokens[0], itl_s=gaps, input_tokens=r.prompt,
                output_tokens=r.out,
            ))  # fmt: skip
            s = streams[r.stream]
            if pos[r.stream] < len(s):
                think = rng.uniform(0, 0.1)
                nxt = s[pos[r.stream]]
                waiting.append(_Req(r.stream, now + think, nxt, n_out(nxt)))
                pos[r.stream] += 1
    done.sort(key=lambda r: r.end)
    return done, now


def mixed(n: int, rng: random.Random) -> list[int]:
    """``n`` prompts, one in ten (at a random place in each ten) long."""
    out = [SHORT] * n
    for k in range(0, n, 10):
        out[min(n - 1, k + rng.randrange(10))] = LONG
    return out


class Harness:
    """The real sampler over a record stream, its clock following the simulated time."""

    def __init__(self) -> None:
        self.now = T
        self.stream = RequestStream()
        self.store = AttributionStore(recent_attributions=100000, recent_requests=100000)
        self.timeline = Timeline(4096, 1000)
        self.sampler = AttributionSampler(
            self.stream, self.timeline, self.store, SlowDetector(),
            Attributor(Params()), settle_s=1.0, clock=lambda: self.now,
        )  # fmt: skip

    def feed(
        self, records: list[RequestRecord], running: list[tuple[float, int]] | None = None
    ) -> None:
        """Submit ``records`` as they end, the sampler running after each; with
        ``running`` (the engine's ``(time, requests running)``), the engine sampler's
        ``kvpressure_engine_requests_running`` once a second up to each record's end."""
        pos, scraped = 0, float("-inf")
        for r in records:
            while running and pos < len(running) and running[pos][0] <= r.end:
                t, n = running[pos]
                pos += 1
                if t - scraped >= 1.0:
                    scraped = t
                    b = Batch()
                    b.add("kvpressure_engine_requests_running", n, engine=ENG, instance="e:1")
                    self.timeline.append(t, b.samples)
            self.now = r.end
            self.stream.submit(r)
            self.sampler.collect(Batch())
        end = self.now + 60.0
        while self.now < end:  # records held for a neighbour are judged within 30 s
            self.now += 1.0
            self.sampler.collect(Batch())

    def slow_in(self, records: list[RequestRecord]) -> list[RequestRecord]:
        slow = {(a.start, a.end) for a in self.store.attributions()}
        return [r for r in records if (r.start, r.end) in slow]


def calm_mixed(h: Harness, n: int, seed: int, t0: float, eng: Engine | None = None):
    rng = random.Random(seed)
    recs, end = simulate(eng or Engine(), [mixed(n, rng), mixed(n, rng)], t0, seed)
    h.feed(recs)
    return recs, end


def test_a_calm_mixed_workload_is_the_engines_normal():
    h = Harness()
    _, end = calm_mixed(h, 30, 1, T)  # warm-up: 60 requests of the workload itself
    recs, _ = calm_mixed(h, 150, 2, end + 1)
    short = [r for r in recs if r.input_tokens == SHORT]
    held = [r for r in short if (r.ttft_s or 0.0) > 0.5 or max(r.itl_s) > 0.5]
    assert len(held) >= 0.1 * len(short)  # the workload does hold short requests up...
    slow = h.slow_in(recs)  # ...but that is its normal
    assert len(slow) <= 0.02 * len(recs), [(r.input_tokens, r.ttft_s) for r in slow]


def test_a_blocker_a_little_slower_than_its_median_is_still_the_engines_normal():
    # steps +-20 %: a long prefill that holds a short request up often runs above the
    # fit's median cost for its size, and within its spread; counted at the median, the
    # difference made the short request slow (17 of 600 here; 2 of 60 on the real
    # llama.cpp). Counted up to the fit's tail, it is excused.
    slow = total = 0
    for seed in range(10):
        h = Harness()
        _, end = calm_mixed(h, 30, 100 + seed, T, Engine(jitter=0.2))
        recs, _ = calm_mixed(h, 30, 200 + seed, end + 1, Engine(jitter=0.2))
        slow += len(h.slow_in(recs))
        total += len(recs)
    assert slow <= 0.01 * total, slow


def test_back_to_back_long_prompts_beside_the_calm_streams_are_interference():
    h = Harness()
    _, end = calm_mixed(h, 150, 1, T)
    blockers = [1800] * 40
    recs, _ = simulate(Engine(), [[SHORT] * 40, [SHORT] * 40, blockers], end + 1, 3)
    h.feed(recs)
    short = [r for r in recs if r.input_tokens == SHORT]
    later = short[len(short) // 3 :]  # once the change shows in the recent requests
    slow = h.slow_in(later)
    assert len(slow) >= 0.9 * len(later)
    names = {a.cause for a in h.store.attributions() if (a.start, a.end) in
             {(r.start, r.end) for r in slow}}  # fmt: skip
    assert names == {"prefill_interference"}


def test_a_slower_engine_is_still_slow_after_a_mixed_workload():
    h = Harness()
    _, end = calm_mixed(h, 150, 1, T)
    recs, _ = calm_mixed(h, 40, 4, end + 1, Engine(slowdown=3.0))
    short = [r for r in recs if r.input_tokens == SHORT]
    assert len(h.slow_in(short)) >= 0.9 * len(short)


def test_a_burst_soon_after_the_start_is_not_its_own_normal():
    h = Harness()
    recs, end = simulate(Engine(), [[SHORT] * 35, [SHORT] * 35], T)  # 70 calm requests
    h.feed(recs)
    burst, _ = simulate(Engine(), [[400] * 3 for _ in range(8)], end + 1, 2, out=32)
    h.feed(burst)
    queued = [r for r in burst if (r.ttft_s or 0.0) > 2.0]  # 10x a calm one: waited
    assert len(queued) >= 15
    assert len(h.slow_in(queued)) == len(queued)


def test_a_long_prompt_whose_record_ends_long_after_the_request_it_held_up_is_counted():
    # the long prompts generate 200 tokens: their records end ~8 s after the short requests
    # they held up (in the queue or between two tokens) ended
    h = Harness()
    rng = random.Random(1)
    log: list[tuple[float, int]] = []
    recs, end = simulate(
        Engine(), [mixed(30, rng), mixed(30, rng)], T, 1, long_out=200, running_log=log
    )
    h.feed(recs, log)
    log = []
    recs, _ = simulate(
        Engine(), [mixed(150, rng), mixed(150, rng)], end + 1, 2, long_out=200, running_log=log
    )
    h.feed(recs, log)
    short = [r for r in recs if r.input_tokens == SHORT]
    held = [r for r in short if (r.ttft_s or 0.0) > 0.5 or max(r.itl_s) > 0.5]
    assert len(held) >= 10  # one in 20: the other stream's long decode runs many short ones
    slow = h.slow_in(recs)
    assert len(slow) <= 0.02 * len(recs), [(r.input_tokens, r.ttft_s) for r in slow]


def test_a_record_waits_for_unseen_neighbours_at_most_30_s():
    # the engine says 3 requests ran beside this one, and the agent never sees them (their
    # clients bypass the proxy): the record is judged 30 s after its end, not never
    h = Harness()
    r = RequestRecord(ENG, T, T + 2.0, ttft_s=0.1, e2e_s=2.0, input_tokens=50, output_tokens=16)
    b = Batch()
    b.add("kvpressure_engine_requests_running", 4, engine=ENG, instance="e:1")
    h.timeline.append(T + 1.0, b.samples)
    h.now = T + 2.0
    h.stream.submit(r)
    judged = []
    for k in range(40):
        h.now = T + 2.0 + k
        h.sampler.collect(Batch())
        if h.store.engines_with_requests():
            judged.append(k)
    assert judged and 29 <= judged[0] <= 31


def _long_decodes_beside_short_streams(
    slowdown: float, seed: int = 3
) -> tuple[list[RequestRecord], Harness]:
    """A calm mixed warm-up, then back-to-back long prompts of 8 output tokens beside
    three short streams (one more than the warm-up's): each long decode's steps take the
    short prompts arriving meanwhile, as llama.cpp batches them. The engine's
    ``requests_running`` is sampled once a second, so the sampler holds a record for the
    short requests still running after its end."""
    h = Harness()
    rng = random.Random(1)
    log: list[tuple[float, int]] = []
    recs, end = simulate(Engine(), [mixed(150, rng), mixed(150, rng)], T, 1, running_log=log)
    h.feed(recs, log)
    log = []
    streams = [[SHORT] * 40] * 3 + [[LONG] * 40]
    recs, _ = simulate(
        Engine(slowdown=slowdown), streams, end + 1, seed, long_out=8, running_log=log
    )
    h.feed(recs, log)
    return [r for r in recs if r.input_tokens == LONG], h


def test_a_long_prompts_decode_slowed_by_short_prefills_batched_into_it_is_interference():
    # the short prompts are far below twice the long one's: only the decode rule, with the
    # short records known when the long one is judged, can name them
    causes: list[str] = []
    for seed in (3, 4, 5):
        longs, h = _long_decodes_beside_short_streams(1.0, seed)
        keys = {(r.start, r.end) for r in longs}
        causes += [a.cause for a in h.store.attributions() if (a.start, a.end) in keys
                   and {p[0] for p in a.slow_phases} <= {"tpot", "itl_max"}]  # fmt: skip
    assert len(causes) >= 3
    assert set(causes) == {"prefill_interference"}, causes


def test_a_long_prompts_decode_on_a_slower_engine_is_not_interference():
    # the same workload on an engine 3x slower at everything (a compute fault): the
    # prefills beside each decode, at no more than their normal cost, explain a small part
    # of its excess; nothing names interference for it
    longs, h = _long_decodes_beside_short_streams(3.0)
    keys = {(r.start, r.end) for r in longs}
    slow = [a for a in h.store.attributions() if (a.start, a.end) in keys]
    assert len(slow) >= 0.5 * len(longs)
    assert all(a.scores["prefill_interference"] < 0.3 for a in slow), [
        (a.cause, a.scores["prefill_interference"]) for a in slow
    ]


def test_a_record_waits_for_a_neighbour_that_started_in_its_last_sampling_interval():
    # the engine sampled 1 running (this one) at T+1.5, and still 1 at T+2.5, after this
    # one's end at T+2.0: a request started between T+1.5 and T+2.0, beside its last decode
    # steps
    h = Harness()
    r = RequestRecord(ENG, T, T + 2.0, ttft_s=0.1, e2e_s=2.0, input_tokens=50, output_tokens=16)
    for t, n in ((T + 0.5, 1), (T + 1.5, 1), (T + 2.5, 1)):
        b = Batch()
        b.add("kvpressure_engine_requests_running", n, engine=ENG, instance="e:1")
        h.timeline.append(t, b.samples)
    h.now = T + 2.0
    h.stream.submit(r)
    for k in range(1, 6):
        h.now = T + 2.0 + k
        h.sampler.collect(Batch())
    assert not h.store.engines_with_requests()  # held: a neighbour is still running
    nb = RequestRecord(ENG, T + 1.8, T + 7.5, ttft_s=0.2, e2e_s=5.7, prefill_s=0.15,
                       input_tokens=60, output_tokens=16)  # fmt: skip
    h.stream.submit(nb)
    h.now = T + 8.0
    h.sampler.collect(Batch())
    assert h.store.engines_with_requests()  # judged once it is known
