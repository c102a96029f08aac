"""The scoring rules: one row per piece of evidence, each mapping an observed value to a score.

Every rule reads one signal over the scope being attributed (a slow request's lifetime
plus a lead-in, or a window) and scores it with a linear ramp::

    ramp(v, threshold, saturation) = clamp((v - threshold) / (saturation - threshold), 0, 1)
    score = weight x ramp(value, threshold, saturation)

so a value at or below ``threshold`` scores 0 and one at or beyond ``saturation`` scores
``weight``. A rule whose ``saturation`` is below its ``threshold`` scores falling values
(headroom, seconds since a restart). A cause's score is the largest score of its rules: the
strongest single piece of evidence, which a person can check by reading one number.

Thresholds are configuration (``attribution.thresholds.<rule>: [threshold, saturation]``);
weights are fixed here and say how directly the signal implies that the cause slowed
requests (a full KV cache alone slows nothing; requests queued while it is full do).

Rules and their defaults (``rate`` means per second over the scope, from counters; ``max``,
``min``, ``mean`` are over the gauge samples in the scope; engine signals match the
request's ``engine`` label; PSI prefers the engine's own cgroup, ``scope=<engine>``, over
``scope=system``):

========================== ======== ====== ============= =========================================
rule                       cause    weight default       value
========================== ======== ====== ============= =========================================
queue_while_full           memory   1.0    [0.0, 0.5]    share of engine samples with requests
                                                         waiting while KV usage >=
                                                         kv_cache_usage threshold (a shortage;
                                                         busy slots alone are queue_at_cap)
queue_at_cap               concur-  0.8    [0.0, 0.5]    share of engine samples with requests
                           rency                         waiting while the engine runs at its
                                                         concurrency cap (every llama.cpp slot
                                                         processing; else running at the most
                                                         seen in the scope) with KV below the
                                                         kv_cache_usage threshold; the cap is
                                                         the evidence's ``cap`` label
prefill_interference       prefill_ 1.0    [0.2, 0.6]    share of the slow phase's time span in
                           interf.                       which another request with at least
                                                         twice this one's uncached prompt was in
                                                         prefill (records seen by the agent);
                                                         the largest blocker's prompt tokens are
                                                         the ``blocker_tokens`` label
decode_interference        prefill_ 1.0    [0.5, 1.0]    for a slow decode phase (``tpot``,
                           interf.                       ``itl_max``): the share of its excess
                                                         over the fitted cost of a decode of
                                                         its batch size that other requests'
                                                         prefill work in its span accounts for,
                                                         at most 1 (any prompt size: prefills
                                                         batched into its decode steps; see
                                                         below); the phase is the ``phase``
                                                         label. Dropped when a memory,
                                                         storage or compute rule scored
                                                         >= min_score
kv_cache_usage             memory   0.6    [0.90, 0.98]  max KV-cache usage ratio
preemptions                memory   1.0    [0, 2]        preemptions in the scope (increase)
prefix_cache_collapse      memory   0.6    [0.5, 0.9]    relative drop of the prefix-cache hit
                                                         rate vs the 5 minutes before the scope
gpu_memory_headroom        memory   0.5    [0.05, 0.01]  min free/total GPU memory (engine GPUs)
psi_memory_some            memory   1.0    [0.05, 0.30]  memory PSI some stall rate (s/s); counted
                           /storage                      as storage when no memory-shortage rule
                                                         fired and a storage rule did (see below)
psi_memory_full            memory   1.0    [0.02, 0.15]  memory PSI full stall rate (s/s); as above
swap_in                    memory   0.9    [10, 1000]    swap-in pages/s
swap_out                   memory   0.6    [10, 1000]    swap-out pages/s
allocstalls                memory   0.8    [1, 50]       direct-reclaim stalls/s
memory_available           memory   0.6    [0.10, 0.02]  min available/total host memory
cgroup_memory_headroom     memory   0.6    [0.10, 0.02]  min (limit - charge)/limit of the
                                                         engine's own cgroup (memory.max or
                                                         memory.high, whichever is lower)
cgroup_memory_limit_hits   memory   0.8    [0.5, 20]     rate of the engine cgroup's memory.events
                                                         max + high (reclaim forced by its limit)
kv_exhausted               memory   1.0    [0, 1]        1 when the request failed because the
                                                         engine's KV pool filled (record outcome)
major_faults               memory   0.7    [100, 2000]   major page faults/s; counted as memory
                           /storage                      when another host memory rule fired
                                                         (thrashing), else as storage (weights or
                                                         KV read back from disk)
psi_io_some                storage  1.0    [0.10, 0.50]  io PSI some stall rate; minus the memory
                                                         PSI some rate when memory is short (the
                                                         I/O that thrashing does not explain)
psi_io_full                storage  0.8    [0.05, 0.30]  io PSI full rate; minus memory full rate
                                                         when memory is short
disk_busy                  storage  0.6    [0.5, 0.95]   max per-disk utilisation (io_time rate)
disk_queue                 storage  0.7    [2, 16]       max per-disk average queue depth
                                                         (weighted io_time rate)
disk_read                  storage  0.5    [5e7, 5e8]    disk read bytes/s, all disks
tcp_retransmits            network  0.9    [1, 20]       TCP segments retransmitted/s
net_errors                 network  0.6    [1, 50]       interface errors + drops/s
upstream_connect           network  1.0    [0.05, 0.5]   proxy-measured connect time to the
                                                         engine (record), seconds
transport_gap              network  0.8    [0.25, 1.0]   TTFT not spent in the engine: TTFT -
                                                         prefill - queue (record; only when the
                                                         queue time is known or no request waited).
                                                         Residual: dropped when a memory, storage,
                                                         compute, concurrency or prefill
                                                         interference rule scored >= min_score
                                                         (waiting for a slot or behind a prefill
                                                         is not transport), and since
                                                         a stalled engine is also slow to start
                                                         prefill (CPU-starved HTTP thread, weights
                                                         and vocabulary paged in before prefill)
psi_cpu_some               compute  1.0    [0.25, 0.75]  CPU PSI some stall rate (s/s), bounded
                                                         by the share of the host's busy CPU
                                                         that is not the engine's own (host
                                                         ``kvpressure_host_cpu_seconds_total``
                                                         busy modes minus
                                                         ``kvpressure_engine_process_cpu_``
                                                         ``seconds_total``, rates over the
                                                         scope): stalls among the engine's own
                                                         threads are its work, not contention.
                                                         The plain rate when the engine's CPU
                                                         time is unknown (remote engine, no
                                                         permission); CPU engines. Bounded
                                                         by the others' user-space share
                                                         instead when a host memory, storage
                                                         or network rule scored (see below)
gpu_utilization            compute  0.5    [0.95, 1.0]   mean GPU utilisation (engine GPUs)
gpu_throttle               compute  0.8    [0.0, 0.5]    share of samples with a slowdown clock
                                                         event active (power cap, thermal, HW)
accelerator_stall          compute  0.8    [0.1, 0.5]    throttled + memory-bound accelerator
                                                         stall seconds per second
engine_restart             engine_  1.0    [60, 0]       seconds from the engine's last restart
                           restart                       (kvpressure_engine_restarts_total rose) to
                                                         the start of the scope; within the cold
                                                         start (weights load, empty prefix cache).
                                                         ``engine_up`` 0 -> 1 is not a restart
gpu_fault                  gpu_     1.0    [0, 1]        XID errors or a lost GPU (gpu_up 0) in
                           fault                         the scope
========================== ======== ====== ============= =========================================

**Stalls versus shortage.** Memory PSI counts every stall on a page that has to be brought
back, including file pages refaulted from disk. Those stalls mean *memory* only when memory
is short: a shortage rule (``swap_in``, ``swap_out``, ``allocstalls``, ``memory_available``,
``cgroup_memory_headroom``, ``cgroup_memory_limit_hits``) fired. Without one, pages were
evicted for another reason (weights dropped from the page cache, a KV tier on disk) and
come back at the disk's pace, so when a storage rule fired too, memory PSI and major faults
are *storage* evidence, and io PSI is read whole. With a shortage, io PSI is read net of
memory PSI (the thrashing's own I/O is the memory's). A limit the agent cannot see (a
cgroup v1 limit, an engine without a configured ``cgroup``) leaves thrashing without swap
looking like storage; configure the engine's cgroup so its ``memory.max`` is read.

**Contention versus the engine's own load.** CPU PSI ``some`` is the share of time some
task waited for a CPU. A CPU engine with more busy threads than cores (vLLM's worker on 2
cores) keeps it near 1 by itself, busy or not slowed by anyone: the cost of its own work,
which the detector's expected cost already holds. Only the share of the busy CPU that other
processes took (``others_cpu_share`` in the evidence labels, with ``busy_cores`` and
``engine_cores``) can be contention, so ``psi_cpu_some`` reads the smaller of the stall rate
and that share: time the engine's processes waited while others held a CPU is at most both.
The engine's CPU time comes from its cgroup's ``cpu.stat`` when ``engines[].cgroup`` is set,
else from the processes listening on its loopback port and their descendants; without it
(a remote engine, another PID namespace) the stall rate is read whole, as before.

**Kernel CPU of I/O.** The others' busy CPU includes what the kernel spent on their
behalf (``system``, ``irq``, ``softirq``): copying writes into the page cache, writeback,
reclaim, swap, the network stack. When a host memory, storage or network rule
(:data:`KERNEL_WORK_RULES`) scored at least ``min_score``, that kernel time is the work of
the I/O, swap or traffic the rule names, and the CPU it took from the engine is part of
that cause: ``psi_cpu_some`` is then bounded by the share the others spent in user space
(and ``steal``) instead (``others_user_share``; the evidence carries ``kernel_cpu_of``), or,
when the engine's CPU time is unknown, by the user-space share of all the busy CPU
(``user_cpu_share``). Two
``dd conv=fsync`` writers plus page-cache drops on 2 cores take ~0.75 cores, all of it in
the kernel (user 0.01): compute scored 0.4-0.8 beside storage's 0.7 and won about one slow
request in ten. A CPU hog is user time and keeps its score; kernel-heavy work with no
memory, storage or network rule firing is still read whole as contention.

**Scope of a request.** A slow request is read over the time span of its slow phase(s)
(the detector's verdict: the wait and prefill up to the first token, or the decode after
it), plus the lead-in, not over its whole life: a decode stall is attributed to what
happened during the decode.

**Prefill beside a decode.** An engine that batches prefill with decode (llama.cpp puts
every waiting prompt into the next step; vLLM and SGLang chunked prefill) makes each
running request's next token wait for the prompts prefilled in the same step, whatever
their size: a long prompt's 8-token decode beside a stream of 60-token prompts doubles its
time per token. ``prefill_interference`` cannot name that (a blocker must have at least
twice the request's prompt: a short prompt does not hold a long one up in the queue or its
prefill), so a decode phase has its own rule: the detector's verdict gives the phase's
value, its own fitted cost (``expected`` less the co-scheduled allowance) and the other
requests' prefill work in its span (each prefill at most what a normal one of its size
costs, :func:`agent.attribution.detector.coscheduled_work`), and ``decode_interference``
reads ``min(1, work / (value - own cost))``. The excess is what slowed the decode, and the
prefill work can explain it only up to its own cost: a decode slowed 3x by a CPU hog, a
swap storm or a slow disk has an excess far above the prefill work that ran beside it
(which the hog does not inflate: it is capped at the normal cost), and scores below the
threshold; a decode with no prefill beside it scores 0. ``value - own cost`` is per token
for ``tpot``; for ``itl_max`` the work is the prefill inside the longest gap (llama.cpp
prefills every prompt that arrived during a step in the next one). A prompt prefilled in
the same step as others is reported with the whole step's time, so the work can read
above the engine time it took: a decode slowed 2x by contention with several prompts
batched into it can reach a score above ``min_score`` here, and the compute rule, which
also fires then. So ``decode_interference`` yields to a resource shortage: it is dropped
when a memory, storage or compute rule scored at least ``min_score`` in the scope. A
shortage slows every step, the prefills batched into the decode included, and the records
cannot split the decode's excess between the two (on the faults suite's memory scenario,
8 requests for 4 slots under a cgroup limit that makes the engine swap, each decode's
2.4 s gap held three newly admitted 400-token prompts whose normal cost alone is about the
gap): the shortage is the cause to act on first, as a queue at the slot cap yields to it.

**Stale engine statistics.** The engine sampler marks an engine's statistics stale
(``kvpressure_engine_stats_stale`` 1, source ``stats`` in error) when its token counters
have not moved while its gauges claimed running requests or a full KV cache
(vLLM keeps its last gauges after every request aborted). While they are stale in the
scope, the rules that read the engine's own metrics (:data:`ENGINE_RULES`) are not
evaluated and the attribution lists :data:`~agent.attribution.model.ENGINE_METRICS_STALE`
as unassessed.

**Weights of the operator causes.** ``queue_at_cap`` weighs 0.8, and ``concurrency`` is
named only when no other cause reached ``min_score``
(:func:`agent.attribution.engine.primary_cause`): requests queue at the cap whenever the
engine is slower to finish the ones it runs, so a shortage that slows it is named before
the cap it makes visible.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

from kvpressure.agent.attribution.model import ENGINE_METRICS, ENGINE_METRICS_STALE, Cause, Evidence
from kvpressure.agent.attribution.signals import Signals
from kvpressure.agent.catalogue import SampleName
from kvpressure.agent.requests.record import RequestRecord

THROTTLE_REASONS = frozenset(
    {
        "sw_power_cap",
        "hw_slowdown",
        "sw_thermal_slowdown",
        "hw_thermal_slowdown",
        "hw_power_brake_slowdown",
    }
)
"""``kvpressure_gpu_clock_event_active`` reasons that mean the GPU runs slower than asked."""

PREFIX_BASELINE_S = 300.0
"""Look-back of the prefix-cache hit-rate baseline, seconds."""

PREFIX_MIN_TOKENS = 256.0
"""Fewest queried prompt tokens (baseline and scope each) for the hit-rate collapse rule."""

PREFIX_MIN_BASELINE_RATE = 0.2
"""Lowest baseline hit rate that can "collapse"; below it there was little reuse to lose."""


@dataclass(frozen=True, slots=True)
class SlowDecode:
    """A slow decode phase of the request attributed, as the detector judged it.

    Built by :meth:`agent.attribution.engine.Attributor.attribute_request` from the
    verdict's slow phases (:class:`agent.attribution.detector.PhaseVerdict`) that were
    judged against the phase's fit with the co-scheduled work known.

    Attributes:
        phase: ``tpot`` or ``itl_max``.
        value_s: the phase's value, seconds (per output token for ``tpot``).
        own_s: the fitted cost of a decode of its batch size, without any co-scheduled
            work, seconds (same unit).
        work_s: other requests' prefill work in the phase's span, each prefill at most
            a normal one's cost, seconds (per output token for ``tpot``; inside the longest
            gap for ``itl_max``).
    """

    phase: str
    value_s: float
    own_s: float
    work_s: float


@dataclass(frozen=True, slots=True)
class Scope:
    """What is being attributed.

    Attributes:
        engine: the ``engine`` label.
        start: start of the request or window, Unix seconds.
        end: end of the request or window.
        lead_in_s: seconds before ``start`` that are read too (causes precede effects).
        record: the request, for record-level rules; ``None`` for windows.
        neighbours: other recent requests of the same engine (``prefill_interference``
            looks for a long prefill among them); empty for windows.
        decodes: the request's slow decode phases with their fitted cost and the
            co-scheduled prefill work in their span (``decode_interference``); empty for
            windows and for requests whose decode was not judged against a fit.
    """

    engine: str
    start: float
    end: float
    lead_in_s: float = 0.0
    record: RequestRecord | None = None
    neighbours: tuple[RequestRecord, ...] = ()
    decodes: tuple[SlowDecode, ...] = ()

    @property
    def a(self) -> float:
        """Start of the interval read: ``start - lead_in_s``."""
        return self.start - self.lead_in_s

    @property
    def b(self) -> float:
        """End of the interval read."""
        return self.end


@dataclass(frozen=True, slots=True)
class Measurement:
    """A rule's observed value and where it came from.

    Attributes:
        value: the observed value, in the rule's unit.
        metric: the metric (or record field) it was read from.
        labels: what the evidence shows beside the value.
        without_kernel: ``psi_cpu_some`` only: the value with other processes' kernel-mode
            CPU left out; :func:`evaluate` reads it instead of ``value`` when a rule of
            :data:`KERNEL_WORK_RULES` scored >= ``min_score`` (see "Kernel CPU of I/O" in
            the module docstring). ``None``: not applicable or unknown.
    """

    value: float
    metric: SampleName | str
    labels: Mapping[str, str] = field(default_factory=dict)
    without_kernel: float | None = None


@dataclass(frozen=True, slots=True)
class Params:
    """Thresholds and horizons the rules use.

    Attributes:
        thresholds: rule name to ``(threshold, saturation)``; rules not named use their
            defaults.
        cold_start_s: seconds after an engine restart during which slow requests are the
            restart's (weights load, empty prefix cache); sets the ``engine_restart`` ramp.
        min_score: a residual rule (``transport_gap``) is dropped when a memory, storage or
            compute rule scored at least this much.
    """

    thresholds: Mapping[str, tuple[float, float]] = field(default_factory=dict)
    cold_start_s: float = 60.0
    min_score: float = 0.3

    def limits(self, rule: RuleSpec) -> tuple[float, float]:
        """Return ``(threshold, saturation)`` of ``rule``."""
        if rule.name == "engine_restart" and rule.name not in self.thresholds:
            return self.cold_start_s, 0.0
        return self.thresholds.get(rule.name, (rule.threshold, rule.saturation))


Measure = Callable[[Signals, Scope, Params], Measurement | None]

_READS: dict[Measure, tuple[str, ...]] = {}


def reads(*metrics: SampleName) -> Callable[[Measure], Measure]:
    """Declare the timeline metrics a rule's measure reads (decorator).

    :data:`METRICS_READ`, the metrics the attribution sampler loads from the timeline, is
    built from these declarations, so a rule cannot read a metric that is never loaded (it
    would silently never fire in production). ``tests/test_attribution_rules.py`` checks
    each rule reads nothing else and fires through :meth:`Signals.from_timeline`.

    Args:
        *metrics: catalogue metric names; none for a rule that reads only the request.
    """

    def mark(fn: Measure) -> Measure:
        _READS[fn] = metrics
        return fn

    return mark


@dataclass(frozen=True, slots=True)
class RuleSpec:
    """One scoring rule (see the module docstring's table).

    Attributes:
        name: rule name; also the ``signal`` of its evidence and its config key.
        cause: the cause it scores.
        weight: the score at saturation.
        threshold: default value where the score starts.
        saturation: default value where the score reaches ``weight``.
        unit: unit of the value.
        doc: what the value is.
        measure: reads the value; ``None`` when the signal is not available.
    """

    name: str
    cause: Cause
    weight: float
    threshold: float
    saturation: float
    unit: str
    doc: str
    measure: Measure

    @property
    def reads(self) -> tuple[str, ...]:
        """The metrics the rule reads (declared with :func:`reads` on its measure).

        Raises:
            TypeError: the measure declares nothing.
        """
        got = _READS.get(self.measure)
        if got is None:
            raise TypeError(f"rule {self.name!r}: declare its metrics with @reads(...)")
        return got


def ramp(value: float, threshold: float, saturation: float) -> float:
    """Linear ramp from 0 at ``threshold`` to 1 at ``saturation``, clamped to [0, 1].

    Works in both directions: with ``saturation < threshold`` falling values score.

    >>> ramp(0.5, 0.0, 1.0), ramp(2.0, 0.0, 1.0), ramp(0.02, 0.05, 0.01)
    (0.5, 1.0, 0.75)
    """
    if math.isnan(value):
        return 0.0
    if saturation == threshold:
        return 1.0 if value >= threshold else 0.0
    return min(1.0, max(0.0, (value - threshold) / (saturation - threshold)))


# --- helpers ---------------------------------------------------------------------------------

ENGINE_UP: SampleName = "kvpressure_engine_up"
PSI: SampleName = "kvpressure_psi_stall_seconds_total"
PSI_AVG10: SampleName = "kvpressure_psi_avg10_ratio"
CGROUP_USED: SampleName = "kvpressure_cgroup_memory_used_bytes"
CGROUP_LIMIT: SampleName = "kvpressure_cgroup_memory_limit_bytes"
CGROUP_EVENTS: SampleName = "kvpressure_cgroup_memory_events_total"
GPU_PROCESSES: SampleName = "kvpressure_gpu_process_memory_bytes"
"""Read by :func:`gpu_filter` (the engine's GPUs): every GPU rule declares it."""
NET_ERRORS: tuple[SampleName, ...] = (
    "kvpressure_net_receive_errors_total",
    "kvpressure_net_transmit_errors_total",
    "kvpressure_net_receive_drops_total",
    "kvpressure_net_transmit_drops_total",
)


def engine_match(sc: Scope) -> dict[str, str]:
    """Label match for the scope's engine."""
    return {"engine": sc.engine}


def engine_unavailable(sig: Signals, sc: Scope) -> bool:
    """True when the engine's metrics were not usable for much of the scope.

    ``kvpressure_engine_up`` was 0 in at least :data:`ENGINE_DOWN_SHARE` of the scope's
    samples, or the engine has no ``kvpressure_engine_up`` series at all (not scraped).
    Case 20: then memory cannot be ruled out, and the attribution lists
    :data:`ENGINE_METRICS` as unassessed. One failed scrape in a minute-long request (a
    busy engine answering late once) leaves the rest of its samples as evidence.
    """
    vals = sig.gauge_values(ENGINE_UP, sc.a, sc.b, engine_match(sc))
    return not vals or sum(v < 1.0 for v in vals) >= ENGINE_DOWN_SHARE * len(vals)


ENGINE_DOWN_SHARE = 0.25
"""Share of a scope's ``kvpressure_engine_up`` samples at 0 from which the engine's metrics
count as unavailable for it."""


STATS_STALE: SampleName = "kvpressure_engine_stats_stale"


def engine_stale(sig: Signals, sc: Scope) -> bool:
    """True when the engine sampler marked the engine's statistics stale in the scope.

    ``kvpressure_engine_stats_stale`` is 1 when the engine's token counters did not move
    while its gauges claimed running requests or a full KV cache (see
    :mod:`agent.samplers.engines.staleness`): its KV, queue and preemption gauges then
    describe the past, not the scope.
    """
    vals = sig.gauge_values(STATS_STALE, sc.a, sc.b, engine_match(sc))
    return bool(vals) and max(vals) >= 1.0


def psi_rate(
    sig: Signals, sc: Scope, resource: str, kind: str
) -> tuple[float, dict[str, str]] | None:
    """Stall seconds per second of ``resource``/``kind`` PSI over the scope.

    Prefers the engine's cgroup (``scope=<engine>``), else ``scope=system``. Falls back to
    the mean ``avg10`` gauge when the counter has too few points.
    """
    for scope in (sc.engine, "system"):
        labels = {"resource": resource, "kind": kind, "scope": scope}
        if not sig.has(PSI, labels) and not sig.has(PSI_AVG10, labels):
            continue
        r = sig.counter_rate(PSI, sc.a, sc.b, labels)
        if r is not None:
            return r, labels
        vals = sig.gauge_values(PSI_AVG10, sc.a, sc.b, labels)
        if vals:
            return sum(vals) / len(vals), labels
    return None


def gpu_filter(sig: Signals, sc: Scope) -> Callable[[Mapping[str, str]], bool]:
    """Predicate over GPU series labels: the engine's GPUs where known, else every GPU."""
    gpus = {s.labels.get("gpu") for s in sig.series(GPU_PROCESSES, engine_match(sc))}
    gpus.discard(None)
    if not gpus:
        return lambda _labels: True
    return lambda labels: labels.get("gpu") in gpus


# --- memory -------------------------------------------------------------------------------


QUEUE_GAUGES: tuple[SampleName, ...] = (
    "kvpressure_engine_requests_waiting",
    "kvpressure_engine_slots",
    "kvpressure_engine_requests_running",
    "kvpressure_engine_kv_cache_usage_ratio",
)
"""The engine gauges the queue rules join on sample time."""


def _queue_samples(
    sig: Signals, sc: Scope, p: Params
) -> tuple[
    dict[float, float],
    dict[float, float],
    dict[float, float],
    dict[float, float],
    dict[float, float],
    float,
]:
    """Engine gauges joined on sample time: waiting, slots total, slots busy, running, KV."""
    m = engine_match(sc)
    waiting = sig.gauge_by_time("kvpressure_engine_requests_waiting", sc.a, sc.b, m)
    total = sig.gauge_by_time("kvpressure_engine_slots", sc.a, sc.b, {**m, "state": "total"})
    busy = sig.gauge_by_time("kvpressure_engine_slots", sc.a, sc.b, {**m, "state": "processing"})
    running = sig.gauge_by_time("kvpressure_engine_requests_running", sc.a, sc.b, m)
    kv = sig.gauge_by_time("kvpressure_engine_kv_cache_usage_ratio", sc.a, sc.b, m)
    kv_full = p.limits(RULES_BY_NAME["kv_cache_usage"])[0]
    return waiting, total, busy, running, kv, kv_full


@reads(*QUEUE_GAUGES)
def _queue_while_full(sig: Signals, sc: Scope, p: Params) -> Measurement | None:
    waiting, _, _, _, kv, kv_full = _queue_samples(sig, sc, p)
    if not waiting:
        return None
    hits = sum(1 for t, w in waiting.items() if w > 0 and t in kv and kv[t] >= kv_full)
    return Measurement(hits / len(waiting), "kvpressure_engine_requests_waiting")


@reads(*QUEUE_GAUGES)
def _queue_at_cap(sig: Signals, sc: Scope, p: Params) -> Measurement | None:
    waiting, total, busy, running, kv, kv_full = _queue_samples(sig, sc, p)
    if not waiting:
        return None
    # without slot counts, the cap is the most the engine ran while requests waited
    top = max((running[t] for t, w in waiting.items() if w > 0 and t in running), default=0.0)
    hits = 0
    cap = 0.0
    for t, w in waiting.items():
        if w <= 0 or (t in kv and kv[t] >= kv_full):
            continue
        if t in total and t in busy and total[t] > 0:
            at_cap, c = busy[t] >= total[t], total[t]
        else:
            at_cap, c = t in running and top > 0 and running[t] >= top, top
        if at_cap:
            hits += 1
            cap = max(cap, c)
    labels = {"cap": f"{cap:.0f}"} if hits else {}
    return Measurement(hits / len(waiting), "kvpressure_engine_requests_waiting", labels)


def prefill_span(r: RequestRecord) -> tuple[float, float] | None:
    """``(start, end)`` of ``r``'s prefill, Unix seconds; ``None`` without a TTFT.

    From ``prefill_s`` before the first token where known, else from arrival (the wait
    included) to the first token.
    """
    if r.ttft_s is None:
        return None
    first = r.start + r.ttft_s
    if r.prefill_s is not None and r.prefill_s >= 0:
        return first - r.prefill_s, first
    return r.start, first


def uncached_tokens(r: RequestRecord) -> int | None:
    """Prompt tokens ``r`` had to prefill: input minus prefix-cache hits where known."""
    if r.input_tokens is None:
        return None
    return max(0, r.input_tokens - (r.cached_tokens or 0))


@reads()
def _prefill_interference(sig: Signals, sc: Scope, p: Params) -> Measurement | None:
    r = sc.record
    if r is None or sc.end <= sc.start:
        return None
    own = uncached_tokens(r)
    if own is None:
        return None
    spans: list[tuple[float, float]] = []
    biggest = 0
    for b in sc.neighbours:
        if b is r or b.engine != r.engine:
            continue
        size = uncached_tokens(b)
        span = prefill_span(b)
        if size is None or span is None or size < 2 * max(own, 1):
            continue
        lo, hi = max(span[0], sc.start), min(span[1], sc.end)
        if hi > lo:
            spans.append((lo, hi))
            biggest = max(biggest, size)
    covered = 0.0
    last = -math.inf
    for a, hi in sorted(spans):
        lo = max(a, last)
        if hi > lo:
            covered += hi - lo
            last = hi
    labels = {"blocker_tokens": str(biggest), "blockers": str(len(spans))} if spans else {}
    return Measurement(covered / (sc.end - sc.start), "record.prefill_overlap", labels)


@reads()
def _decode_interference(sig: Signals, sc: Scope, p: Params) -> Measurement | None:
    """Share of a slow decode's excess over its own cost that co-scheduled prefill explains.

    Over the scope's slow decode phases (:attr:`Scope.decodes`), the largest
    ``min(1, work / (value - own cost))``; ``None`` when no decode phase was judged
    against its fit with the co-scheduled work known (the rule is then not assessed, as
    for a window).
    """
    best: Measurement | None = None
    for d in sc.decodes:
        excess = d.value_s - d.own_s
        if excess <= 0.0:
            continue  # not over its own cost: nothing for the prefill work to explain
        share = min(1.0, max(0.0, d.work_s) / excess)
        if best is None or share > best.value:
            labels = {"phase": d.phase, "work_s": f"{d.work_s:.4g}", "excess_s": f"{excess:.4g}"}
            best = Measurement(share, "record.decode_coscheduled_prefill", labels)
    return best


@reads("kvpressure_engine_kv_cache_usage_ratio")
def _kv_cache_usage(sig: Signals, sc: Scope, p: Params) -> Measurement | None:
    v = sig.gauge_max("kvpressure_engine_kv_cache_usage_ratio", sc.a, sc.b, engine_match(sc))
    return None if v is None else Measurement(v, "kvpressure_engine_kv_cache_usage_ratio")


@reads("kvpressure_engine_preemptions_total")
def _preemptions(sig: Signals, sc: Scope, p: Params) -> Measurement | None:
    name: SampleName = "kvpressure_engine_preemptions_total"
    v = sig.counter_increase(name, sc.a, sc.b, engine_match(sc))
    return None if v is None else Measurement(v, name)


@reads(
    "kvpressure_engine_prefix_cache_queried_tokens_total",
    "kvpressure_engine_prefix_cache_hit_tokens_total",
)
def _prefix_cache_collapse(sig: Signals, sc: Scope, p: Params) -> Measurement | None:
    m = engine_match(sc)
    q_name: SampleName = "kvpressure_engine_prefix_cache_queried_tokens_total"
    h_name: SampleName = "kvpressure_engine_prefix_cache_hit_tokens_total"
    q_now = sig.counter_increase(q_name, sc.a, sc.b, m)
    h_now = sig.counter_increase(h_name, sc.a, sc.b, m)
    q_base = sig.counter_increase(q_name, sc.a - PREFIX_BASELINE_S, sc.a, m)
    h_base = sig.counter_increase(h_name, sc.a - PREFIX_BASELINE_S, sc.a, m)
    if None in (q_now, h_now, q_base, h_base):
        return None
    assert q_now is not None and h_now is not None and q_base is not None and h_base is not None
    if q_now < PREFIX_MIN_TOKENS or q_base < PREFIX_MIN_TOKENS:
        return None
    base = h_base / q_base
    if base < PREFIX_MIN_BASELINE_RATE:
        return None
    now = h_now / q_now
    return Measurement(max(0.0, (base - now) / base), h_name)


@reads(GPU_PROCESSES, "kvpressure_gpu_memory_total_bytes", "kvpressure_gpu_memory_used_bytes")
def _gpu_memory_headroom(sig: Signals, sc: Scope, p: Params) -> Measurement | None:
    keep = gpu_filter(sig, sc)
    worst: Measurement | None = None
    for tot in sig.series("kvpressure_gpu_memory_total_bytes"):
        if not keep(tot.labels) or not tot.vs or tot.vs[-1] <= 0:
            continue
        match = {k: v for k, v in tot.labels.items() if k in ("gpu", "uuid", "mig")}
        used = sig.gauge_max("kvpressure_gpu_memory_used_bytes", sc.a, sc.b, match)
        if used is None:
            continue
        free = max(0.0, 1.0 - used / tot.vs[-1])
        if worst is None or free < worst.value:
            worst = Measurement(free, "kvpressure_gpu_memory_used_bytes", {"gpu": match["gpu"]})
    return worst


def _psi(resource: str, kind: str) -> Measure:
    @reads(PSI, PSI_AVG10)
    def measure(sig: Signals, sc: Scope, p: Params) -> Measurement | None:
        got = psi_rate(sig, sc, resource, kind)
        return None if got is None else Measurement(got[0], PSI, got[1])

    return measure


HOST_CPU: SampleName = "kvpressure_host_cpu_seconds_total"
ENGINE_CPU: SampleName = "kvpressure_engine_process_cpu_seconds_total"
CPU_IDLE_MODES = frozenset({"idle", "iowait"})
"""``kvpressure_host_cpu_seconds_total`` modes in which a CPU did no work."""
CPU_USER_MODES = frozenset({"user", "nice", "steal"})
"""Busy modes outside this kernel: user space (``guest`` is inside ``user``) and ``steal``
(the hypervisor ran another guest). The rest (``system``, ``irq``, ``softirq``) is the
kernel working, much of it for I/O: page-cache copies, writeback, reclaim, the network
stack."""


class CpuShare(NamedTuple):
    """How the host's busy CPU split between the engine and other processes over a scope.

    Attributes:
        others: share of the busy CPU that was not the engine's own, [0, 1].
        others_user: share of the busy CPU that other processes spent outside the kernel
            (``user``, ``nice`` and ``steal`` less the engine's CPU), [0, 1]: a lower bound,
            since the engine's own CPU time is not split by mode.
        busy: busy CPUs, in cores.
        engine: the engine's CPU, in cores.
    """

    others: float
    others_user: float
    busy: float
    engine: float


def host_busy_cpu(sig: Signals, sc: Scope) -> tuple[float, float] | None:
    """The host's busy CPUs over the scope, in cores, and the part of it in user space.

    Rates of ``kvpressure_host_cpu_seconds_total``: busy is every mode but
    :data:`CPU_IDLE_MODES`, user space the :data:`CPU_USER_MODES`.

    Returns:
        ``(busy, user)``; ``None`` when the series are absent or the host was not busy.
    """
    busy: float | None = None
    user = 0.0
    for s in sig.series(HOST_CPU):
        mode = s.labels.get("mode")
        if mode in CPU_IDLE_MODES:
            continue
        r = s.rate(sc.a, sc.b)
        if r is not None:
            busy = r if busy is None else busy + r
            if mode in CPU_USER_MODES:
                user += r
    if busy is None or busy <= 0.0:
        return None
    return busy, user


def others_cpu_share(sig: Signals, sc: Scope, busy: float, user: float) -> CpuShare | None:
    """Share of the host's busy CPU over the scope that was not the engine's own.

    ``busy`` and ``user`` are :func:`host_busy_cpu`'s (cores); the engine's own is the rate
    of ``kvpressure_engine_process_cpu_seconds_total`` (its cgroup or its process tree).
    Both come from the host sampler's cycles, so their rates cover the same sample
    intervals.

    Returns:
        The split, shares clamped to [0, 1] (the engine's per-process time and the host's
        per-CPU ticks are accounted apart); ``None`` when the engine's CPU time is unknown
        (a remote engine, no permission, an agent without the series).
    """
    engine = sig.counter_rate(ENGINE_CPU, sc.a, sc.b, engine_match(sc))
    if engine is None:
        return None

    def share(cores: float) -> float:
        return min(1.0, max(0.0, cores / busy))

    return CpuShare(share(busy - engine), share(user - engine), busy, engine)


@reads(PSI, PSI_AVG10, HOST_CPU, ENGINE_CPU)
def _psi_cpu_contention(sig: Signals, sc: Scope, p: Params) -> Measurement | None:
    """CPU PSI some, counted as contention only in the share of busy CPU not the engine's.

    A CPU engine's own threads outnumbering the cores stall one another (vLLM's worker
    keeps host CPU PSI at 0.99 on 2 cores by itself): that is the engine's work, not
    contention, and is already in the engine's cost of a request. Other processes taking
    the CPUs are: the stall they cause is at most the stall rate and at most the share of
    the busy CPU they took (:func:`others_cpu_share`), so the value is the smaller of the
    two. (Their product would count a stall twice over: an engine held to 1.2 of 2 busy
    cores by others, PSI 0.7 and others' share 0.4, would score 0.28 -> 0.06, not compute.)
    ``without_kernel`` bounds the stall by the others' user-space share instead, for
    :func:`evaluate` to read when their kernel CPU was I/O or reclaim. The plain stall
    rate is read when the engine's CPU time is unknown (no ``others_cpu_share`` label then);
    its ``without_kernel`` is then bounded by the user-space share of all the busy CPU (the
    engine's own included: an upper bound on the others').
    """
    got = psi_rate(sig, sc, "cpu", "some")
    if got is None:
        return None
    rate, labels = got
    host = host_busy_cpu(sig, sc)
    if host is None:
        return Measurement(rate, PSI, labels)
    share = others_cpu_share(sig, sc, *host)
    if share is None:
        user = min(1.0, host[1] / host[0])
        return Measurement(rate, PSI, {**labels, "user_cpu_share": f"{user:.2f}"},
                           without_kernel=min(rate, user))  # fmt: skip
    return Measurement(
        min(rate, share.others),
        PSI,
        {
            **labels,
            "others_cpu_share": f"{share.others:.2f}",
            "others_user_share": f"{share.others_user:.2f}",
            "busy_cores": f"{share.busy:.2f}",
            "engine_cores": f"{share.engine:.2f}",
        },
        without_kernel=min(rate, share.others_user),
    )


def _host_rate(name: SampleName) -> Measure:
    @reads(name)
    def measure(sig: Signals, sc: Scope, p: Params) -> Measurement | None:
        v = sig.counter_rate(name, sc.a, sc.b)
        return None if v is None else Measurement(v, name)

    return measure


@reads("kvpressure_host_memory_total_bytes", "kvpressure_host_memory_available_bytes")
def _memory_available(sig: Signals, sc: Scope, p: Params) -> Measurement | None:
    total = sig.gauge_min("kvpressure_host_memory_total_bytes", sc.a, sc.b)
    avail = sig.gauge_min("kvpressure_host_memory_available_bytes", sc.a, sc.b)
    if total is None or avail is None or total <= 0:
        return None
    return Measurement(avail / total, "kvpressure_host_memory_available_bytes")


@reads(CGROUP_USED, CGROUP_LIMIT)
def _cgroup_memory_headroom(sig: Signals, sc: Scope, p: Params) -> Measurement | None:
    scope = {"scope": sc.engine}
    used = sig.gauge_by_time(CGROUP_USED, sc.a, sc.b, scope)
    limits: dict[float, float] = {}
    for s in sig.series(CGROUP_LIMIT, scope):
        for t, v in s.between(sc.a, sc.b, hold=True):
            limits[t] = min(v, limits.get(t, math.inf))
    ratios = [(lim - used[t]) / lim for t, lim in limits.items() if t in used and lim > 0]
    if not ratios:
        return None
    return Measurement(max(0.0, min(ratios)), CGROUP_USED, scope)


@reads(CGROUP_EVENTS)
def _cgroup_memory_limit_hits(sig: Signals, sc: Scope, p: Params) -> Measurement | None:
    rates = [
        r
        for event in ("max", "high")
        if (r := sig.counter_rate(CGROUP_EVENTS, sc.a, sc.b, {"scope": sc.engine, "event": event}))
        is not None
    ]
    if not rates:
        return None
    return Measurement(sum(rates), CGROUP_EVENTS, {"scope": sc.engine})


@reads()
def _kv_exhausted(sig: Signals, sc: Scope, p: Params) -> Measurement | None:
    if sc.record is None:
        return None
    return Measurement(1.0 if sc.record.outcome == "kv_exhausted" else 0.0, "record.outcome")


# --- storage ------------------------------------------------------------------------------


def _disk_rate_max(name: SampleName) -> Measure:
    @reads(name)
    def measure(sig: Signals, sc: Scope, p: Params) -> Measurement | None:
        got = sig.counter_rate_max(name, sc.a, sc.b)
        if got is None:
            return None
        return Measurement(got[0], name, {"device": got[1].get("device", "")})

    return measure


# --- network ------------------------------------------------------------------------------


@reads(*NET_ERRORS)
def _net_errors(sig: Signals, sc: Scope, p: Params) -> Measurement | None:
    total: float | None = None
    for name in NET_ERRORS:
        r = sig.counter_rate(name, sc.a, sc.b)
        if r is not None:
            total = r if total is None else total + r
    return None if total is None else Measurement(total, "kvpressure_net_*_errors|drops_total")


@reads()
def _upstream_connect(sig: Signals, sc: Scope, p: Params) -> Measurement | None:
    r = sc.record
    if r is None or r.upstream_connect_s is None:
        return None
    return Measurement(r.upstream_connect_s, "record.upstream_connect_s")


@reads("kvpressure_engine_requests_waiting")
def _transport_gap(sig: Signals, sc: Scope, p: Params) -> Measurement | None:
    r = sc.record
    if r is None or r.ttft_s is None or r.prefill_s is None:
        return None
    queue = r.queue_s
    if queue is None:
        waiting = sig.gauge_max("kvpressure_engine_requests_waiting", sc.a, sc.b, engine_match(sc))
        if waiting is None or waiting > 0:
            return None  # the gap could be queueing: not evidence of the network
        queue = 0.0
    return Measurement(max(0.0, r.ttft_s - r.prefill_s - queue), "record.ttft_s-prefill_s-queue_s")


# --- compute ------------------------------------------------------------------------------


@reads(GPU_PROCESSES, "kvpressure_gpu_utilization_ratio")
def _gpu_utilization(sig: Signals, sc: Scope, p: Params) -> Measurement | None:
    keep = gpu_filter(sig, sc)
    best: Measurement | None = None
    for s in sig.series("kvpressure_gpu_utilization_ratio"):
        if not keep(s.labels):
            continue
        vals = [v for _, v in s.between(sc.a, sc.b, hold=True)]
        if vals:
            mean = sum(vals) / len(vals)
            if best is None or mean > best.value:
                best = Measurement(
                    mean, "kvpressure_gpu_utilization_ratio", {"gpu": s.labels.get("gpu", "")}
                )
    return best


@reads(GPU_PROCESSES, "kvpressure_gpu_clock_event_active")
def _gpu_throttle(sig: Signals, sc: Scope, p: Params) -> Measurement | None:
    keep = gpu_filter(sig, sc)
    times: dict[float, bool] = {}
    reasons: set[str] = set()
    for s in sig.series("kvpressure_gpu_clock_event_active"):
        reason = s.labels.get("reason", "")
        if not keep(s.labels) or reason not in THROTTLE_REASONS:
            continue
        for t, v in s.between(sc.a, sc.b, hold=True):
            active = v >= 1.0
            times[t] = times.get(t, False) or active
            if active:
                reasons.add(reason)
    if not times:
        return None
    share = sum(1 for a in times.values() if a) / len(times)
    return Measurement(
        share, "kvpressure_gpu_clock_event_active", {"reason": ",".join(sorted(reasons))}
    )


@reads(GPU_PROCESSES, "kvpressure_accelerator_stall_seconds_total")
def _accelerator_stall(sig: Signals, sc: Scope, p: Params) -> Measurement | None:
    keep = gpu_filter(sig, sc)
    name: SampleName = "kvpressure_accelerator_stall_seconds_total"
    best: Measurement | None = None
    rates: dict[str, float] = {}
    for s in sig.series(name):
        if not keep(s.labels) or s.labels.get("reason") not in ("throttled", "memory_bound"):
            continue
        r = s.rate(sc.a, sc.b)
        if r is not None:
            g = s.labels.get("gpu", "")
            rates[g] = rates.get(g, 0.0) + r
    for g, r in rates.items():
        if best is None or r > best.value:
            best = Measurement(r, name, {"gpu": g})
    return best


# --- events -------------------------------------------------------------------------------


def last_restart(sig: Signals, engine: str, a: float, b: float) -> float | None:
    """Time of the engine's last restart in ``(a, b]``; ``None`` when there was none.

    A restart is a rise of ``kvpressure_engine_restarts_total`` (the engine sampler counts
    counter resets and a new ``process_start_time_seconds``). ``kvpressure_engine_up`` going
    from 0 back to 1 is not one: a metrics endpoint can fail while inference goes on (case
    20).
    """
    times: list[float] = []
    for s in sig.series("kvpressure_engine_restarts_total", {"engine": engine}):
        times.extend(t for t, _ in s.increase_events(a, b))
    return max(times) if times else None


@reads("kvpressure_engine_restarts_total")
def _engine_restart(sig: Signals, sc: Scope, p: Params) -> Measurement | None:
    if not sig.has("kvpressure_engine_restarts_total", engine_match(sc)):
        return None
    t = last_restart(sig, sc.engine, sc.start - p.cold_start_s, sc.b)
    if t is None:
        return Measurement(math.inf, "kvpressure_engine_restarts_total")
    return Measurement(max(0.0, sc.start - t), "kvpressure_engine_restarts_total")


@reads(GPU_PROCESSES, "kvpressure_gpu_xid_errors_total", "kvpressure_gpu_up")
def _gpu_fault(sig: Signals, sc: Scope, p: Params) -> Measurement | None:
    keep = gpu_filter(sig, sc)
    seen = False
    for s in sig.series("kvpressure_gpu_xid_errors_total"):
        if not keep(s.labels):
            continue
        seen = True
        if s.increase_events(sc.a, sc.b):
            labels = {"gpu": s.labels.get("gpu", ""), "xid": s.labels.get("xid", "")}
            return Measurement(1.0, "kvpressure_gpu_xid_errors_total", labels)
    for s in sig.series("kvpressure_gpu_up"):
        if not keep(s.labels):
            continue
        seen = True
        if any(v < 1 for _, v in s.between(sc.a, sc.b, hold=True)):
            return Measurement(1.0, "kvpressure_gpu_up", {"gpu": s.labels.get("gpu", "")})
    return Measurement(0.0, "kvpressure_gpu_xid_errors_total") if seen else None


# --- the table ----------------------------------------------------------------------------

RULES: tuple[RuleSpec, ...] = (
    RuleSpec("queue_while_full", "memory", 1.0, 0.0, 0.5, "ratio",
             "share of engine samples with requests waiting while slots or KV are full",
             _queue_while_full),
    RuleSpec("queue_at_cap", "concurrency", 0.8, 0.0, 0.5, "ratio",
             "share of engine samples with requests waiting at the concurrency cap, KV free",
             _queue_at_cap),
    RuleSpec("prefill_interference", "prefill_interference", 1.0, 0.2, 0.6, "ratio",
             "share of the slow phase spent while a longer prompt was in prefill",
             _prefill_interference),
    RuleSpec("decode_interference", "prefill_interference", 1.0, 0.5, 1.0, "ratio",
             "share of a slow decode's excess over its own cost that prefill beside it explains",
             _decode_interference),
    RuleSpec("kv_cache_usage", "memory", 0.6, 0.90, 0.98, "ratio",
             "max KV-cache usage ratio", _kv_cache_usage),
    RuleSpec("preemptions", "memory", 1.0, 0.0, 2.0, "1",
             "preemptions in the scope", _preemptions),
    RuleSpec("prefix_cache_collapse", "memory", 0.6, 0.5, 0.9, "ratio",
             "relative drop of the prefix-cache hit rate vs the 5 minutes before",
             _prefix_cache_collapse),
    RuleSpec("gpu_memory_headroom", "memory", 0.5, 0.05, 0.01, "ratio",
             "min free/total memory of the engine's GPUs", _gpu_memory_headroom),
    RuleSpec("psi_memory_some", "memory", 1.0, 0.05, 0.30, "s/s",
             "memory PSI some stall rate", _psi("memory", "some")),
    RuleSpec("psi_memory_full", "memory", 1.0, 0.02, 0.15, "s/s",
             "memory PSI full stall rate", _psi("memory", "full")),
    RuleSpec("swap_in", "memory", 0.9, 10.0, 1000.0, "pages/s",
             "swap-in rate", _host_rate("kvpressure_host_swap_in_pages_total")),
    RuleSpec("swap_out", "memory", 0.6, 10.0, 1000.0, "pages/s",
             "swap-out rate", _host_rate("kvpressure_host_swap_out_pages_total")),
    RuleSpec("allocstalls", "memory", 0.8, 1.0, 50.0, "1/s",
             "direct-reclaim stall rate", _host_rate("kvpressure_host_allocstalls_total")),
    RuleSpec("memory_available", "memory", 0.6, 0.10, 0.02, "ratio",
             "min available/total host memory", _memory_available),
    RuleSpec("cgroup_memory_headroom", "memory", 0.6, 0.10, 0.02, "ratio",
             "min headroom below the engine cgroup's memory limit", _cgroup_memory_headroom),
    RuleSpec("cgroup_memory_limit_hits", "memory", 0.8, 0.5, 20.0, "1/s",
             "rate the engine cgroup hit memory.max or memory.high", _cgroup_memory_limit_hits),
    RuleSpec("kv_exhausted", "memory", 1.0, 0.0, 1.0, "1",
             "the request failed because the KV pool filled", _kv_exhausted),
    RuleSpec("major_faults", "memory", 0.7, 100.0, 2000.0, "1/s",
             "major page fault rate (memory when thrashing, else storage)",
             _host_rate("kvpressure_host_major_page_faults_total")),
    RuleSpec("psi_io_some", "storage", 1.0, 0.10, 0.50, "s/s",
             "io PSI some stall rate (net of memory stalls when memory is short)",
             _psi("io", "some")),
    RuleSpec("psi_io_full", "storage", 0.8, 0.05, 0.30, "s/s",
             "io PSI full stall rate (net of memory stalls when memory is short)",
             _psi("io", "full")),
    RuleSpec("disk_busy", "storage", 0.6, 0.5, 0.95, "ratio",
             "max per-disk utilisation", _disk_rate_max("kvpressure_disk_io_time_seconds_total")),
    RuleSpec("disk_queue", "storage", 0.7, 2.0, 16.0, "requests",
             "max per-disk average queue depth",
             _disk_rate_max("kvpressure_disk_io_time_weighted_seconds_total")),
    RuleSpec("disk_read", "storage", 0.5, 5e7, 5e8, "bytes/s",
             "disk read rate, all disks", _host_rate("kvpressure_disk_read_bytes_total")),
    RuleSpec("tcp_retransmits", "network", 0.9, 1.0, 20.0, "1/s",
             "TCP retransmitted segments rate",
             _host_rate("kvpressure_net_tcp_retransmitted_segments_total")),
    RuleSpec("net_errors", "network", 0.6, 1.0, 50.0, "1/s",
             "interface errors and drops rate", _net_errors),
    RuleSpec("upstream_connect", "network", 1.0, 0.05, 0.5, "seconds",
             "proxy connect time to the engine", _upstream_connect),
    RuleSpec("transport_gap", "network", 0.8, 0.25, 1.0, "seconds",
             "TTFT not spent queued or in prefill", _transport_gap),
    RuleSpec("psi_cpu_some", "compute", 1.0, 0.25, 0.75, "s/s",
             "CPU PSI some stall rate, at most the share of busy CPU not the engine's own",
             _psi_cpu_contention),
    RuleSpec("gpu_utilization", "compute", 0.5, 0.95, 1.0, "ratio",
             "mean utilisation of the engine's GPUs", _gpu_utilization),
    RuleSpec("gpu_throttle", "compute", 0.8, 0.0, 0.5, "ratio",
             "share of samples with a slowdown clock event", _gpu_throttle),
    RuleSpec("accelerator_stall", "compute", 0.8, 0.1, 0.5, "s/s",
             "throttled and memory-bound accelerator stall rate", _accelerator_stall),
    RuleSpec("engine_restart", "engine_restart", 1.0, 60.0, 0.0, "seconds",
             "seconds since the engine's last restart", _engine_restart),
    RuleSpec("gpu_fault", "gpu_fault", 1.0, 0.0, 1.0, "1",
             "XID error or lost GPU in the scope", _gpu_fault),
)  # fmt: skip
"""Every rule, in the order evidence is listed on ties."""

RULES_BY_NAME: dict[str, RuleSpec] = {r.name: r for r in RULES}
"""Rules by name (the keys ``attribution.thresholds`` accepts)."""

ENGINE_RULES = frozenset(
    {"queue_while_full", "queue_at_cap", "kv_cache_usage", "preemptions",
     "prefix_cache_collapse"}
)  # fmt: skip
"""Rules that read the engine's own metrics: not assessed while those are unavailable."""

MEMORY_SHORTAGE = frozenset(
    {"swap_in", "swap_out", "allocstalls", "memory_available", "cgroup_memory_headroom",
     "cgroup_memory_limit_hits"}
)  # fmt: skip
"""Rules that show memory is short, not merely stalled: with one of them firing, memory PSI
and major faults are memory (thrashing); without, they follow the storage evidence."""

STALLS_OF_SHORTAGE = frozenset({"psi_memory_some", "psi_memory_full", "major_faults"})
"""Memory-stall rules that are storage evidence when memory is not short and a storage rule
fired (pages evicted for another reason, read back from disk)."""

IO_NET_OF_MEMORY = {"psi_io_some": "psi_memory_some", "psi_io_full": "psi_memory_full"}
"""io PSI rules and the memory PSI rule subtracted from them when memory is short."""

RESIDUAL = frozenset({"transport_gap"})
"""Rules that only count when no rule of :data:`RESIDUAL_EXPLAINED_BY` explains the delay."""

RESIDUAL_EXPLAINED_BY = frozenset(
    {"memory", "storage", "compute", "concurrency", "prefill_interference"}
)
"""Causes that explain a TTFT not spent in prefill: a stalled engine is slow to start
prefill, and a request waiting for a slot or behind another prefill is waiting."""

KERNEL_WORK_RULES = frozenset(
    {"psi_memory_some", "psi_memory_full", "swap_in", "swap_out", "allocstalls",
     "major_faults", "cgroup_memory_limit_hits", "psi_io_some", "psi_io_full", "disk_busy",
     "disk_queue", "disk_read", "tcp_retransmits", "net_errors"}
)  # fmt: skip
"""Host rules of memory, storage and network whose cause makes the kernel work (reclaim,
swap, page-cache copies and writeback, the network stack): when one scored >= min_score,
``psi_cpu_some`` reads its ``without_kernel`` value (see "Kernel CPU of I/O" in the module
docstring)."""

YIELDS_TO_SHORTAGE = frozenset({"decode_interference"})
"""Rules dropped when a rule of a cause in :data:`SHORTAGES` scored >= min_score (see
"Prefill beside a decode" in the module docstring)."""

SHORTAGES = frozenset({"memory", "storage", "compute"})
"""Causes that slow every step of the engine: a decode's excess in their presence is not
split between them and the prefill batched into it."""

EVALUATE_READS: tuple[SampleName, ...] = (ENGINE_UP, STATS_STALE)
"""Read by :func:`evaluate` itself (:func:`engine_unavailable`, :func:`engine_stale`),
besides the rules."""

METRICS_READ: tuple[str, ...] = tuple(
    dict.fromkeys(name for names in (EVALUATE_READS, *(r.reads for r in RULES)) for name in names)
)
"""Every metric the rules read (one timeline read each per attribution pass)."""

LONG_LOOKBACK: dict[str, float] = {
    "kvpressure_engine_prefix_cache_queried_tokens_total": PREFIX_BASELINE_S,
    "kvpressure_engine_prefix_cache_hit_tokens_total": PREFIX_BASELINE_S,
    "kvpressure_engine_restarts_total": 0.0,  # widened by cold_start_s at read time
    "kvpressure_engine_up": 0.0,
}
"""Metrics read further back than the lead-in (seconds before the earliest scope)."""


def _without_kernel_cpu(
    found: list[Evidence],
    measured: list[tuple[RuleSpec, Measurement]],
    causes: list[str],
    score: Callable[[RuleSpec, float], float],
) -> list[Evidence]:
    """Re-read the evidence of rules with a ``without_kernel`` value at that value.

    Returns ``found`` with those rules' evidence re-scored (dropped when it no longer
    scores) and labelled ``kernel_cpu_of`` with the ``causes`` whose kernel work the
    left-out CPU was.
    """
    alt = {rule.name: (rule, m.without_kernel) for rule, m in measured
           if m.without_kernel is not None}  # fmt: skip
    if not alt:
        return found
    named = ",".join(sorted(set(causes)))
    out: list[Evidence] = []
    for e in found:
        if e.signal not in alt:
            out.append(e)
            continue
        rule, value = alt[e.signal]
        s = score(rule, value)
        if s > 0.0:
            out.append(Evidence(e.cause, e.signal, e.metric, value, e.threshold, e.saturation,
                                s, e.unit, {**e.labels, "kernel_cpu_of": named}))  # fmt: skip
    return out


def evaluate(
    sig: Signals, sc: Scope, params: Params
) -> tuple[dict[str, float], list[Evidence], tuple[str, ...]]:
    """Score every cause for ``sc``.

    Returns:
        ``(scores, evidence, unassessed)``: the score of every cause in
        :data:`agent.attribution.model.ALL_CAUSES` (max of its rules' scores, 0 when none
        fired), the evidence with a score > 0 strongest first, and what could not be
        assessed (:data:`ENGINE_METRICS` when the engine's metrics were unavailable).
    """
    from kvpressure.agent.attribution.model import ALL_CAUSES

    unassessed: list[str] = []
    if engine_unavailable(sig, sc):
        unassessed.append(ENGINE_METRICS)
    skip: frozenset[str] = frozenset()
    if engine_stale(sig, sc):
        unassessed.append(ENGINE_METRICS_STALE)
        skip = ENGINE_RULES
    measured = [
        (rule, m)
        for rule in RULES
        if rule.name not in skip and (m := rule.measure(sig, sc, params)) is not None
    ]
    values = {rule.name: m.value for rule, m in measured}

    def score(rule: RuleSpec, value: float) -> float:
        thr, sat = params.limits(rule)
        return round(rule.weight * ramp(value, thr, sat), 6)  # no float-noise evidence

    scored = {rule.name: score(rule, m.value) for rule, m in measured}
    shortage = any(scored.get(name, 0.0) > 0.0 for name in MEMORY_SHORTAGE)
    found: list[Evidence] = []
    for rule, m in measured:
        value, s = m.value, scored[rule.name]
        if shortage and rule.name in IO_NET_OF_MEMORY:
            value = max(0.0, value - values.get(IO_NET_OF_MEMORY[rule.name], 0.0))
            s = score(rule, value)
        if s <= 0.0:
            continue
        thr, sat = params.limits(rule)
        found.append(Evidence(rule.cause, rule.name, m.metric, value, thr, sat, s, rule.unit,
                              m.labels))  # fmt: skip
    if not shortage and any(e.cause == "storage" or e.signal == "major_faults" for e in found):
        found = [
            Evidence("storage", e.signal, e.metric, e.value, e.threshold, e.saturation,
                     e.score, e.unit, e.labels)
            if e.signal in STALLS_OF_SHORTAGE
            else e
            for e in found
        ]  # fmt: skip
    kernel = [e.cause for e in found
              if e.signal in KERNEL_WORK_RULES and e.score >= params.min_score]  # fmt: skip
    if kernel:
        found = _without_kernel_cpu(found, measured, kernel, score)
    if any(e.cause in SHORTAGES and e.score >= params.min_score for e in found):
        found = [e for e in found if e.signal not in YIELDS_TO_SHORTAGE]
    engine_stalled = any(
        e.cause in RESIDUAL_EXPLAINED_BY and e.score >= params.min_score for e in found
    )
    evidence = [e for e in found if e.signal not in RESIDUAL] if engine_stalled else found
    scores = dict.fromkeys(ALL_CAUSES, 0.0)
    for e in evidence:
        scores[e.cause] = max(scores.get(e.cause, 0.0), e.score)
    order = {r.name: i for i, r in enumerate(RULES)}
    evidence.sort(key=lambda e: (-e.score, order.get(e.signal, 0)))
    return scores, evidence, tuple(unassessed)
