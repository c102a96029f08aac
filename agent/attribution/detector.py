"""Slow-request detection: each phase of a request against what a request of its size costs.

A request is judged phase by phase. For each phase the detector keeps, per engine, an
online robust fit of the phase's cost against the request's size, over recent requests
whose phase was not slow (the idea of LatencyPrism, arXiv 2601.09258: flag the residual,
not the raw latency):

========= ======================================= =========================================
phase     value (seconds)                          size ``x`` the cost is fitted against
========= ======================================= =========================================
queue     ``queue_s`` (engine-reported wait)       none (a rolling tail)
prefill   ``prefill_s`` (engine-reported)        uncached prompt tokens: ``input_tokens``
                                                   minus ``cached_tokens`` where known
ttft      TTFT (queue, prefill and transport:      the same uncached prompt tokens
          every streaming source has it)
tpot      decode seconds per output token after    the engine's batch size over the decode
          the first: ``decode_s`` or               (mean ``kvpressure_engine_requests_
          ``e2e_s - ttft_s``, / (output - 1)       running``), given by the caller
itl_max   the longest inter-token gap (streams)    the same batch size
e2e       ``e2e_s`` of requests without a TTFT     output tokens where known
========= ======================================= =========================================

The fit (:class:`CostModel`) of a token-sized phase is Theil-Sen: the slope is the median
of the pairwise slopes between points whose sizes differ by at least a factor 2, between 0
and the median cost per unit of size; the intercept is the median residual. A workload of
one size says nothing about the slope: the cost then scales with the tokens (the per-token
rate of the requests seen, so a 3,000-token prompt after 100-token ones is expected to cost
30 times theirs). A batch-sized phase's cost is the curve of binned medians
(:func:`binned_medians`): the median cost of each batch-size bin (powers of 2, 3 points at
least), non-decreasing, linear between bins and never extrapolated: a batch larger than
any seen is expected to cost what the largest seen did (a decode that slows as the batch
grows is then slow until larger batches have been seen not to be). Decode cost is not
linear in the batch (flat while memory-bound, rising once compute-bound), and a line
through batches of 1 and 2 extrapolated to 8 expected four times the cost there on a CPU
vLLM whose unslowed batch-8 decodes cost what its batch-2 ones did. For a request of size
``x``::

    expected(x)  = intercept + slope x, or the binned curve  (at least 1 microsecond)
    ratio_i      = value_i / expected(x_i)                    over the fitted points
    threshold(x) = max(factor x quantile_q'(ratio) x expected(x), expected(x) + floor_s)
    q'           = min(q, 1 - 3 / n)                         (n fitted points)
    slow         = value > threshold(x)                       once >= min_requests are known

so a 3,000-token prompt prefilled at the usual per-token rate is not slow, and a decode at
45x the usual time per token is, whatever its TTFT.

TPOT is a mean over the decode's ``m = output - 1`` tokens, and a mean's spread shrinks
with what it averages: one 90 ms hiccup triples the TPOT of a 16-token decode and moves a
1,800-token one by 2 %. So for TPOT each fitted ratio from a mean over ``n < m`` tokens
enters the quantile as ``1 + (ratio_i - 1) sqrt(n / m)`` (the slower of the two shrink
rates, independent per-token noise, against ``n / m`` for one hiccup); ratios of means over
at least ``m`` tokens enter as they are (the spread of long decodes may be systematic:
context length, batch mix). The noise of short decodes then does not hide a long decode
slowed several times (preempted, waiting for KV blocks), and long decodes keep the spread
they showed.

The SLOs (TTFT above ``slo_ttft_s``, TPOT above ``slo_tpot_s``, end-to-end above
``slo_e2e_s`` for requests without a TTFT) judge a phase while its fit is warming up (fewer
than ``min_requests`` points); after that a request that misses an SLO only because it is
large is not slow (a long prompt on a slow engine misses the TTFT SLO at the engine's usual
per-token rate: the remedy is capacity, not an incident), and the miss is reported in
:attr:`Verdict.slo_missed` (``kvpressure explain`` counts such requests).

Defaults: ``q = 0.99``, ``factor = 1.5``, ``N = 500`` points per engine and phase (the line
is fitted through the latest 96, the ratio quantile is over all), ``min_requests = 30``,
``floor_s = 0.05`` (for TPOT the floor is on the whole decode, ``floor_s / (output - 1)``
per token; 0.02 for the longest gap), ``slo_ttft_s = 2.0``, ``slo_tpot_s = 0.5``,
``slo_e2e_s = 30.0``, ``coscheduled_tolerance = 2.0`` (below).

**A decode beside a preemption.** A decode phase (``tpot``, ``itl_max``) that ran while
its engine preempted requests (the caller's ``preempted`` intervals overlap its span, or the
engine says it preempted this request: ``own_preemptions`` >= 1, or ``shared_preemptions``
>= 1 when its own count is unknown) is judged without ``factor``: ``threshold =
max(quantile_q'(ratio) x expected, expected + floor_s)``. The factor is a margin against
calling the fit's own error slow; a preempted request's KV was dropped and recomputed, and
it waited for blocks in its decode, and the engine recomputes the preempted requests in the
same steps as every running request's next token, so each decode beside a preemption waits
too. A decode above the noise the unslowed ones show is that wait, not the fit's error. On
the KV-starved CPU vLLM the first requests to be readmitted lost 45 % of their decode to the
wait and still read only 1.1-1.5 times the fitted cost (the fit of short calm decodes puts
it above their real unslowed cost), and one the engine never preempted decoded in 2.07
times its stall-free time at 1.29 times the fitted cost. A decode that did not run beside
a preemption is still slow only above the fit's tail (``quantile_q'`` of the unslowed
ratio), which an unslowed decode rarely reaches. Requests that finished together between
two engine samples decoded together: when every one of them is known to the caller and the
engine counted preemptions for them, each is judged as preempted (``shared_preemptions``),
which covers a preemption the engine's counter samples missed.

``q`` is higher than the single-latency baseline's usual p95: up to six phases of every
request are judged, and a request is slow when any one is, so each phase's tail must be
rarer for the requests' false-slow rate to stay at a few per cent.

**Co-scheduled work.** An engine is shared: a request's phase also costs the work the
engine did for other requests meanwhile. The part that varies most is other requests'
prefill: on llama.cpp a short request that arrives during another's 1,650-token prefill
waits for all of it (2.5 s on 2 cores), and one that is decoding gets a 2.5 s gap. In a
mixed-length workload that happens to one short request in ten: the engine's normal, yet
too rare for the fit's tail (and a fit that learnt it would excuse any 2.5 s stall). So the
expected cost of each phase is its own cost (the fit above) plus the co-scheduled work in
its span, at the share that is usual for this engine::

    work(a, b)   = sum over the engine's other requests o (the caller's ``neighbours``) of
                   prefill(o) x |o's prefill span in [a, b]| / |o's span|
    prefill(o)   = min(o's own prefill time, tail_cost(uncached(o))); tail_cost(uncached(o))
                   when the engine did not say how long o's prefill took
    share        = min(1, tolerance x usual / recent)
    usual        = mean work over the whole life of the requests before the latest 32
                   (up to N; those slow even with all their co-scheduled work excused are
                   left out: another incident does not teach the engine's normal)
    recent       = mean work of the latest 32 requests and this one (slow or not)
    threshold'   = threshold(x) + share x work(phase span)
    slow         = value > threshold'

``tail_cost`` is the engine's prefill fit (else its TTFT fit) at its tail,
``quantile_q(ratio) x expected`` without the factor: the most a prefill of that size costs
when it is not slow. So a blocker slowed by a fault excuses no more than a normal prefill
could, and one a little slower than the fit's median (it shared the engine too: 3.29 s for
a 1,650-token prompt fitted at 3.05 s on llama.cpp) is excused whole; counted at the median,
the difference made the short request it held up slow (2 of 60 in a calm mixed run). For
``tpot`` the work is spread over the decode's tokens; for ``itl_max`` only the largest one
neighbour's part counts (one prefill falls into one gap). ``tolerance`` (2) is how much
more co-scheduled work than usual the engine may carry before the excess stops being
excused: with one long prompt in ten, 32 requests hold 3 or 4 of them, rarely 7 (twice the
usual). So a calm mixed workload, where interference is the engine's normal, is not slow;
a stream of long prompts back to back beside short requests (several times the usual
co-scheduled work) leaves most of each held-up request's delay unexcused, and it is slow
(the ``prefill_interference`` rule names it). An engine whose normal is such a stream is
judged against that normal once it has lasted N requests, as every baseline here. No work
is counted before the prefill (or TTFT) fit has 30 points, nor when the caller gives no
neighbours; all of it is excused for the next 30 requests (no normal known yet), and
until 30 requests have left the latest 32 the older half of the known requests is the
usual, the newer half the recent.

Only requests that completed (``outcome == "ok"``) with no slow phase feed the fits, and a
phase only when it did not miss its SLO, so a long incident does not become the new normal
(a request queued for 10 s behind a full KV cache was in the incident for its whole life:
its decode, preempted too, must not teach the decode's normal even when that phase alone
stayed under its threshold), and an incident the fit misses cannot teach it values past the
SLO. Nor does a phase that ran while its engine preempted requests (the preemption counter
rose between two engine samples around its span): the engine says which requests it preempts
only in aggregate, and a decode slowed 2x by waits for KV blocks that stays under its
threshold would otherwise teach the fit, at the batch sizes of the shortage, a slope that
excuses the next preempted decode. An engine that preempts all the time keeps the normal
it last had without preemptions (or its SLOs, if it never had one). The fit learns the
request's own cost: a value above the fitted cost is learnt less
the excused co-scheduled work, never below the fitted cost (the work is an upper bound of
the delay it caused).
"""

from __future__ import annotations

import bisect
import logging
import math
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from kvpressure.agent.attribution.rules import prefill_span, uncached_tokens
from kvpressure.agent.requests.record import RequestRecord

log = logging.getLogger(__name__)

PHASES: tuple[str, ...] = ("queue", "prefill", "ttft", "tpot", "itl_max", "e2e")
"""Phases a verdict can name."""

FIT_POINTS = 96
"""Most recent points the line is fitted through (Theil-Sen is quadratic in them); the
ratios whose quantile sets the threshold are taken over every point kept."""

REFIT_EVERY = 32
"""A fit is recomputed after this many new points (after every one while it has fewer
than FIT_POINTS), so its cost stays bounded at any request rate."""

MIN_SIZE_RATIO = 2.0
"""Pairs whose sizes differ by less than this factor give no slope: prompts of 45 and 60
tokens differ mostly by noise, and a slope fitted on such pairs extrapolates wildly."""

TAIL_POINTS = 3
"""Points kept above the tail quantile: ``q`` falls to ``1 - 3/n`` while ``n`` is small."""

TOKEN_SIZED = frozenset({"prefill", "ttft", "e2e"})
"""Phases whose size is a token count (cost proportional to it when only one size is seen)."""
DECODE_PHASES = frozenset({"tpot", "itl_max"})
"""Phases judged without ``baseline_factor`` when they ran beside a preemption (module
docstring)."""

TPOT_FLOOR_S = 0.02
"""Absolute floor of the longest inter-token gap's threshold above the expected value."""

RECENT_REQUESTS = 32
"""Requests whose co-scheduled work is what an engine carries "now" (:class:`CoScheduledLoad`):
enough that an occasional long prompt among them is not read as a change of the workload."""


@dataclass(frozen=True, slots=True)
class PhaseVerdict:
    """The judgement of one phase of a request.

    Attributes:
        phase: one of :data:`PHASES`.
        value_s: the phase's value, seconds (per token for ``tpot``).
        threshold_s: the value above which the phase is slow.
        basis: ``slo`` (an absolute objective) or ``baseline`` (the fitted cost of a request
            of this size on this engine).
        expected_s: the fitted cost, ``None`` for an SLO.
        size: the size the cost was fitted against (tokens or batch size), ``None`` when
            unknown.
        start: start of the phase's time span, Unix seconds.
        end: end of the phase's time span.
        coscheduled_s: the part of ``expected_s`` and ``threshold_s`` that is other
            requests' prefill work in the phase's span, at the share usual for the engine
            (seconds, per token for ``tpot``; see :class:`CoScheduledLoad`); ``None`` when
            it could not be estimated (no neighbours given, no prefill fit yet).
        work_s: the co-scheduled prefill work in the phase's span (:func:`coscheduled_work`,
            each prefill at most a normal one's cost, before the share; per token for
            ``tpot``; for ``itl_max`` all of it inside the longest gap, the gap's interval
            taken from the first token and the gaps before it), seconds; ``None`` as for
            ``coscheduled_s``. The ``decode_interference`` rule compares it to the phase's
            excess over its own cost, ``expected_s - coscheduled_s``.
    """

    phase: str
    value_s: float
    threshold_s: float
    basis: str
    expected_s: float | None
    size: float | None
    start: float
    end: float
    coscheduled_s: float | None = None
    work_s: float | None = None

    @property
    def excess(self) -> float:
        """``value / threshold``: how far over (> 1) or under its threshold the phase is."""
        return self.value_s / self.threshold_s if self.threshold_s > 0 else math.inf


@dataclass(frozen=True, slots=True)
class Verdict:
    """Whether one request was slow, and why that was decided.

    Attributes:
        slow: at least one phase exceeded its threshold.
        phase: the slowest phase (largest value/threshold) when slow; else ``ttft`` or
            ``e2e``, the latency the request is summarised by.
        latency_s: that phase's value.
        threshold_s: the threshold it was compared to.
        basis: ``slo`` or ``baseline`` (see :class:`PhaseVerdict`); ``slo`` before warm-up.
        slow_phases: every slow phase, slowest first.
        start: start of the time span of the slow phases (the request's start when none).
        end: end of that span (the request's end when none).
        slo_missed: phases (``ttft``, ``tpot``, ``e2e``) above their SLO, slow or not: once
            a phase's fit is known a request that misses the SLO only because it is long
            (its phase within the fitted cost of its size) is not slow, but the miss is
            still reported.
    """

    slow: bool
    phase: str
    latency_s: float
    threshold_s: float
    basis: str
    slow_phases: tuple[PhaseVerdict, ...] = ()
    start: float | None = None
    end: float | None = None
    slo_missed: tuple[str, ...] = ()

    @property
    def phases(self) -> tuple[str, ...]:
        """Names of the slow phases, slowest first."""
        return tuple(p.phase for p in self.slow_phases)


def quantile(sorted_values: list[float], q: float) -> float:
    """Linear-interpolated quantile of already sorted values (numpy's default method).

    Raises:
        ValueError: ``sorted_values`` is empty.
    """
    if not sorted_values:
        raise ValueError("quantile of no values")
    pos = q * (len(sorted_values) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def _median(values: list[float]) -> float:
    return quantile(sorted(values), 0.5)


def theil_sen(points: list[tuple[float, float]], proportional: bool = False) -> tuple[float, float]:
    """Robust line ``y = intercept + slope x`` through ``points`` (``(x, y)`` pairs).

    The slope is the median of the slopes of every pair whose ``x`` differ by at least a
    factor :data:`MIN_SIZE_RATIO`, never negative (a cost does not fall with size) and never
    above the median of ``y / x`` (a cost that is not negative at size 0 does not rise
    faster than that; this bounds the extrapolation to larger sizes); the intercept is the
    median of ``y - slope x``, at least 0. When no pair differs that much (every
    request of about one size) the slope cannot be told from the points: with
    ``proportional`` the cost is taken as proportional to the size (slope the median of
    ``y / x``, intercept 0: the per-token rate of the requests seen), else constant (slope
    0). Quadratic in ``len(points)``.

    Returns:
        ``(intercept, slope)``.

    Raises:
        ValueError: ``points`` is empty.
    """
    if not points:
        raise ValueError("fit of no points")
    slopes: list[float] = []
    n = len(points)
    for i in range(n):
        xi, yi = points[i]
        for j in range(i + 1, n):
            xj, yj = points[j]
            lo, hi = min(xi, xj), max(xi, xj)
            if hi > 0 and hi >= MIN_SIZE_RATIO * lo:
                slopes.append((yj - yi) / (xj - xi))
    rates = [y / x for x, y in points if x > 0]
    rate = max(0.0, _median(rates)) if rates else None
    if not slopes and proportional and rate is not None:
        return 0.0, rate
    slope = max(0.0, _median(slopes)) if slopes else 0.0
    if rate is not None:
        slope = min(slope, rate)  # a line with a cost >= 0 at size 0 rises no faster
    intercept = max(0.0, _median([y - slope * x for x, y in points]))
    return intercept, slope


def _g(value: float | None) -> str:
    """``value`` in 4 significant digits for the debug log, ``-`` when unknown (an SLO)."""
    return "-" if value is None else f"{value:.4g}"


def _work(value: float | None) -> str:
    """``, co-scheduled <seconds>`` for the debug log; empty when not estimated."""
    return "" if value is None else f", co-scheduled {value:.4g}"


def _overlaps(intervals: Sequence[tuple[float, float]], a: float, b: float) -> bool:
    """True when ``[a, b]`` overlaps one of ``intervals`` (sorted, disjoint): one bisection."""
    i = bisect.bisect_left(intervals, (b,)) - 1
    return i >= 0 and intervals[i][1] > a


MIN_BIN_POINTS = 3
"""Points a size bin needs before its median cost is a knot of a batch-sized cost curve."""


def binned_medians(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """A batch-sized cost curve through ``points`` (``(size, cost)`` pairs): its knots.

    Sizes are binned by powers of :data:`MIN_SIZE_RATIO` (sizes below 2 share the first
    bin); each bin of at least :data:`MIN_BIN_POINTS` points gives the knot (median size,
    median cost), and the knots' costs are made non-decreasing (a cost does not fall with
    the batch; a cheaper bin takes the cost of the one below it). With no bin that full,
    one knot: the medians of all points. The cost between knots is interpolated linearly
    and beyond them held at the end knots' (:func:`interpolate`): nothing is extrapolated.
    ``O(n log n)``.

    Returns:
        ``(size, cost)`` knots by ascending size.

    Raises:
        ValueError: ``points`` is empty.
    """
    if not points:
        raise ValueError("fit of no points")
    bins: dict[int, list[tuple[float, float]]] = {}
    for x, y in points:
        k = math.floor(math.log(x, MIN_SIZE_RATIO)) if x >= MIN_SIZE_RATIO else 0
        bins.setdefault(k, []).append((x, y))
    knots = [
        (_median([x for x, _ in b]), _median([y for _, y in b]))
        for _, b in sorted(bins.items())
        if len(b) >= MIN_BIN_POINTS
    ]
    if not knots:
        knots = [(_median([x for x, _ in points]), _median([y for _, y in points]))]
    top = -math.inf
    out: list[tuple[float, float]] = []
    for x, y in knots:
        top = max(top, y)
        out.append((x, top))
    return out


def interpolate(knots: Sequence[tuple[float, float]], x: float) -> float:
    """The cost at ``x`` on the curve of ``knots`` (:func:`binned_medians`), seconds.

    Linear between knots, the first or last knot's cost outside them.
    """
    if x <= knots[0][0]:
        return knots[0][1]
    if x >= knots[-1][0]:
        return knots[-1][1]
    i = bisect.bisect_right(knots, (x, math.inf))
    (x0, y0), (x1, y1) = knots[i - 1], knots[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0) if x1 > x0 else y1


@dataclass(frozen=True, slots=True)
class _Fit:
    """One refit of a :class:`CostModel`."""

    intercept: float
    slope: float
    knots: list[tuple[float, float]] | None  # a batch-sized curve; None: the line
    ratios: list[float]  # value / expected of every kept point, sorted
    weighted: list[tuple[float, float]]  # (ratio, tokens the value is a mean over)
    fewest: float  # the fewest tokens of any kept point

    def cost(self, x: float) -> float:
        """The fitted cost of size ``x``, seconds, at least 1 microsecond."""
        if self.knots is not None:
            return max(interpolate(self.knots, x), 1e-6)
        return max(self.intercept + self.slope * x, 1e-6)


class CostModel:
    """Online robust fit of one phase's cost against a request's size (one engine).

    Args:
        size: points kept (``N``); the line is fitted through the latest
            :data:`FIT_POINTS`, the ratios are over all of them.
        proportional: the size is a token count: the cost is the Theil-Sen line, which
            scales with the size when only one size was seen (see :func:`theil_sen`). Else
            the size is a batch size: the curve of binned medians, never extrapolated
            (:func:`binned_medians`; scaling would excuse any decode slowdown under load).
    """

    __slots__ = ("_fit", "_since_fit", "points", "proportional")

    def __init__(self, size: int, proportional: bool = False) -> None:
        self.proportional = proportional
        # (size, value, tokens averaged in the value: 1 unless the value is a mean)
        self.points: deque[tuple[float, float, float]] = deque(maxlen=size)
        self._fit: _Fit | None = None
        self._since_fit = 0

    def add(self, x: float, y: float, tokens: float = 1.0) -> None:
        """Learn one not-slow observation.

        Args:
            x: the request's size (tokens or batch size).
            y: the phase's value, seconds (per token for ``tpot``).
            tokens: how many tokens ``y`` is the mean over (the decode's ``output - 1``
                for ``tpot``; 1 for a phase that is one duration).
        """
        self.points.append((x, y, max(1.0, tokens)))
        self._since_fit += 1

    def _model(self) -> _Fit:
        due = self._since_fit >= REFIT_EVERY or (
            self._since_fit > 0 and len(self.points) <= FIT_POINTS
        )
        if self._fit is None or due:
            pts = list(self.points)
            latest = [(x, y) for x, y, _ in pts[-FIT_POINTS:]]
            if self.proportional:
                a, b = theil_sen(latest, True)
                knots = None
            else:
                a, b = 0.0, 0.0
                knots = binned_medians(latest)
            shape = _Fit(a, b, knots, [], [], 0.0)
            weighted = [(y / shape.cost(x), n) for x, y, n in pts]
            ratios = sorted(r for r, _ in weighted)
            self._fit = _Fit(a, b, knots, ratios, weighted, min(n for _, n in weighted))
            self._since_fit = 0
        return self._fit

    def expected(self, x: float) -> float:
        """Fitted cost of size ``x``, seconds (at least 1 microsecond).

        A token-sized cost (``proportional``) is the Theil-Sen line; a batch-sized one the
        curve of binned medians (:func:`binned_medians`), never extrapolated: a slope seen
        between batches of 1 and 2 says little about a batch of 8 (on a CPU engine it read
        4x the batch-2 cost where unslowed batch-8 decodes cost about as much), so a larger
        batch is expected to cost what the largest one seen did until it has been seen not
        to be slow.

        Raises:
            ValueError: no point learnt yet.
        """
        return self._model().cost(x)

    def threshold(
        self, x: float, q: float, factor: float, floor_s: float, tokens: float = 1.0
    ) -> tuple[float, float]:
        """Return ``(threshold, expected)`` for size ``x`` (formula in the module docstring).

        The quantile is ``min(q, 1 - TAIL_POINTS / n)`` of the ``n`` ratios: a tail quantile
        of few points is set by one outlier, so it keeps :data:`TAIL_POINTS` above it.

        A value that is a mean over ``tokens`` tokens (``tpot``) is judged against the
        ratios as a mean over that many would have shown them: a point learnt from a mean
        over ``n < tokens`` tokens enters as ``1 + (ratio - 1) x sqrt(n / tokens)`` (the
        spread of a mean shrinks at least as the square root of what it averages when the
        per-token noise is independent, and as ``n / tokens`` when it is one hiccup; the
        slower is assumed); points over at least ``tokens`` tokens enter as they are (a
        longer mean's deviation is not amplified: it may be systematic). So the noise of
        16-token decodes does not hide a 1,800-token decode at 4 times their usual time
        per token.

        Raises:
            ValueError: no point learnt yet.
        """
        f = self._model()
        ratios, weighted, fewest = f.ratios, f.weighted, f.fewest
        exp = self.expected(x)
        if tokens > fewest:
            ratios = sorted(
                r if n >= tokens else 1.0 + (r - 1.0) * math.sqrt(n / tokens) for r, n in weighted
            )
        qq = min(q, 1.0 - TAIL_POINTS / len(ratios))
        return max(factor * quantile(ratios, max(qq, 0.5)) * exp, exp + floor_s), exp


def coscheduled_work(
    record: RequestRecord,
    a: float,
    b: float,
    neighbours: Iterable[RequestRecord],
    cost: Callable[[float], float],
) -> tuple[float, float]:
    """Other requests' prefill work the engine did in ``[a, b]``, seconds, at most a normal cost.

    Each other record ``o`` of ``record``'s engine with a known uncached prompt and a
    prefill span (``prefill_s`` before its first token, else arrival to first token)
    contributes ``prefill x overlap / len(o's prefill span)``: its prefill, spread evenly
    over its span, for the part of the span inside ``[a, b]`` (all of it when the span has
    no length and lies inside). ``prefill`` is ``min(o.prefill_s, cost(uncached(o)))``, or
    ``cost(uncached(o))`` without a ``prefill_s``: never more than ``cost``, so a prefill
    slowed by a fault is not excused past what a normal one costs.

    Args:
        record: the request judged (never its own neighbour).
        a: start of the phase's span, Unix seconds.
        b: end of the span.
        neighbours: other requests (any engine; others are skipped).
        cost: the most seconds an uncached prompt of that many tokens costs to prefill
            when it is not slow (the prefill fit's tail).

    Returns:
        ``(total, largest)``: the sum over the neighbours and the largest single
        neighbour's part, seconds, >= 0 (one prefill can fall into one inter-token gap;
        several are spread over the decode).
    """
    total = largest = 0.0
    if b <= a:
        return total, largest
    for o in neighbours:
        if o is record or o.engine != record.engine:
            continue
        span = prefill_span(o)
        tokens = uncached_tokens(o)
        if span is None or tokens is None or tokens <= 0:
            continue
        lo, hi = max(span[0], a), min(span[1], b)
        length = span[1] - span[0]
        if length > 0:
            share = (hi - lo) / length if hi > lo else 0.0
        else:
            share = 1.0 if a <= span[0] <= b else 0.0
        if share > 0:
            normal = cost(float(tokens))
            if o.prefill_s is not None and o.prefill_s >= 0:
                normal = min(normal, o.prefill_s)
            part = share * normal
            total += part
            largest = max(largest, part)
    return total, largest


class CoScheduledLoad:
    """How much co-scheduled prefill work one engine usually carries, and carries now.

    Two bounded windows of per-request co-scheduled work (seconds over the request's life,
    from :func:`coscheduled_work`): ``recent``, the latest :data:`RECENT_REQUESTS` judged
    requests, slow or not (what the engine carries now), and ``usual``, up to ``size``
    requests before them (what it carries normally; a request enters it when it leaves
    ``recent``, unless it failed or was slow even with all its co-scheduled work excused).
    The share of a request's co-scheduled work that is excused::

        share = min(1, tolerance x mean(usual) / mean(recent and this request))

    1 while the engine carries up to ``tolerance`` times its usual co-scheduled work; less
    when it carries more (interference beyond the engine's normal is not excused). Warm-up:
    until ``min_requests`` requests are known the share is 1 (like a cost fit in warm-up,
    no baseline judges yet); until ``min_requests`` have left ``recent`` the older half of
    the known requests is the usual and the newer half the recent. Not thread-safe.

    Args:
        size: usual requests kept.
        min_requests: usual requests needed before any work is excused.
        tolerance: how many times its usual co-scheduled work the engine may carry before
            the excess is no longer excused.
    """

    __slots__ = ("min_requests", "recent", "tolerance", "usual")

    def __init__(self, size: int, min_requests: int, tolerance: float) -> None:
        self.usual: deque[float] = deque(maxlen=size)
        self.recent: deque[tuple[float, bool]] = deque(maxlen=RECENT_REQUESTS)
        self.min_requests = min_requests
        self.tolerance = tolerance

    def share(self, work_s: float) -> float:
        """Share (0..1) of ``work_s`` co-scheduled seconds excused now (see the class)."""
        n = len(self.usual) + len(self.recent)
        if n < self.min_requests:
            return 1.0  # warm-up: no normal known to tell an abnormal share from
        recent = list(self.recent)
        usual: list[float] = list(self.usual)
        if len(self.usual) < self.min_requests:
            # until enough have left ``recent``: the older half of the known requests is the
            # usual, the newer half the recent (never the same requests in both)
            k = min(len(recent), n // 2)
            usual += [w for w, ok in recent[: len(recent) - k] if ok]
            recent = recent[len(recent) - k :]
        if not usual:
            return 1.0
        now = (sum(w for w, _ in recent) + work_s) / (len(recent) + 1)
        if now <= 0:
            return 1.0
        return min(1.0, self.tolerance * (sum(usual) / len(usual)) / now)

    def add(self, work_s: float, usual: bool) -> None:
        """Record one judged request's co-scheduled seconds.

        Args:
            work_s: the request's co-scheduled work, seconds.
            usual: it may become part of ``usual`` once it leaves ``recent``: the request
                completed and no phase of it was slow with all its co-scheduled work
                excused.
        """
        if len(self.recent) == self.recent.maxlen:
            w, ok = self.recent[0]
            if ok:
                self.usual.append(w)
        self.recent.append((work_s, usual))


class SlowDetector:
    """Judges each phase of a request against its fitted cost and the SLOs.

    Not thread-safe: the attribution sampler owns it.

    Args:
        slo_ttft_s: TTFT objective, seconds.
        slo_e2e_s: end-to-end objective for requests without a TTFT, seconds.
        baseline_quantile: the tail quantile ``q`` of the fitted ratios.
        baseline_factor: multiplier on that quantile.
        baseline_requests: ``N``, points kept per engine and phase.
        baseline_min_requests: points needed before a phase's fit applies.
        baseline_floor_s: lowest margin of a threshold above the expected cost, seconds.
        slo_tpot_s: time-per-output-token objective, seconds.
        coscheduled_tolerance: times its usual co-scheduled prefill work an engine may
            carry before the excess stops being excused (:class:`CoScheduledLoad`).
    """

    def __init__(
        self,
        slo_ttft_s: float = 2.0,
        slo_e2e_s: float = 30.0,
        baseline_quantile: float = 0.99,
        baseline_factor: float = 1.5,
        baseline_requests: int = 500,
        baseline_min_requests: int = 30,
        baseline_floor_s: float = 0.05,
        slo_tpot_s: float = 0.5,
        coscheduled_tolerance: float = 2.0,
    ) -> None:
        self.slo = {"ttft": slo_ttft_s, "e2e": slo_e2e_s, "tpot": slo_tpot_s}
        self.q = baseline_quantile
        self.factor = baseline_factor
        self.size = baseline_requests
        self.min_requests = baseline_min_requests
        self.floor = baseline_floor_s
        self.coscheduled_tolerance = coscheduled_tolerance
        self._models: dict[tuple[str, str], CostModel] = {}
        self._load: dict[str, CoScheduledLoad] = {}

    def _floor(self, phase: str) -> float:
        return min(self.floor, TPOT_FLOOR_S) if phase == "itl_max" else self.floor

    def threshold(self, engine: str, phase: str, size: float = 0.0) -> tuple[float, str]:
        """Return ``(threshold_s, basis)`` of ``phase`` for a request of ``size`` now.

        ``basis`` is ``baseline`` once the phase's fit has ``baseline_min_requests``
        points, else ``slo`` (``ttft``, ``tpot``, ``e2e``) or ``inf`` with basis ``slo`` for
        phases without an SLO.
        """
        m = self._models.get((engine, phase))
        if m is not None and len(m.points) >= self.min_requests:
            thr, _ = m.threshold(size, self.q, self.factor, self._floor(phase))
            slo = self.slo.get(phase, math.inf)
            return (thr, "baseline") if thr < slo else (slo, "slo")
        return self.slo.get(phase, math.inf), "slo"

    def baseline_size(self, engine: str, phase: str) -> int:
        """Points currently in the fit of ``engine`` and ``phase``."""
        m = self._models.get((engine, phase))
        return 0 if m is None else len(m.points)

    def _prefill_cost(self, engine: str) -> Callable[[float], float] | None:
        """Most seconds a not-slow uncached prompt of ``x`` tokens costs, or ``None``.

        The prefill fit, else the TTFT fit, once it has ``baseline_min_requests`` points:
        its tail (``quantile_q(ratio) x expected``, no factor, no floor).
        """
        for phase in ("prefill", "ttft"):
            m = self._models.get((engine, phase))
            if m is not None and len(m.points) >= self.min_requests:
                model, q = m, self.q
                return lambda x: model.threshold(x, q, 1.0, 0.0)[0]
        return None

    def _coscheduled(self, engine: str) -> CoScheduledLoad:
        load = self._load.get(engine)
        if load is None:
            load = self._load[engine] = CoScheduledLoad(
                self.size, self.min_requests, self.coscheduled_tolerance
            )
        return load

    def judge(
        self,
        record: RequestRecord,
        batch: float | None = None,
        neighbours: Sequence[RequestRecord] | None = None,
        preempted: Sequence[tuple[float, float]] = (),
        own_preemptions: int | None = None,
        shared_preemptions: int = 0,
    ) -> Verdict | None:
        """Judge every phase of ``record``; learn from it when no phase was slow.

        Args:
            record: the finished request.
            batch: mean number of requests the engine was running during the record's
                decode (``kvpressure_engine_requests_running``), ``None`` when unknown.
            neighbours: the engine's other requests whose lifetime overlapped ``record``'s
                (settled or not), whose prefill is the co-scheduled work of its phases;
                ``None`` when unknown (no co-scheduled work is then excused or tracked).
            preempted: ``(a, b)`` intervals, Unix seconds, sorted and disjoint, in which
                the engine preempted requests (``kvpressure_engine_preemptions_total`` rose
                between two samples at ``a`` and ``b``); a phase whose span overlaps one is
                judged but not learnt (a memory shortage is not the engine's normal cost),
                and a decode phase is judged without ``baseline_factor`` (module
                docstring).
            own_preemptions: how many times the engine preempted this request (vLLM's
                ``request_num_preemptions``), ``None`` when unknown; at least 1 judges its
                decode phases without ``baseline_factor`` (module docstring).
            shared_preemptions: when ``own_preemptions`` is ``None``: the preemptions of the
                requests that finished with this one between two engine samples, every one
                of them known to the caller (0: none, or not known); at least 1 judges its
                decode phases as ``own_preemptions`` >= 1 does.

        Returns:
            ``None`` when the record has neither TTFT nor end-to-end latency.
        """
        r = record
        if r.ttft_s is None and r.e2e_s is None:
            return None
        if own_preemptions is not None:
            preempted_self = own_preemptions >= 1
        else:
            preempted_self = shared_preemptions >= 1
        judged: list[PhaseVerdict] = []
        learn: list[tuple[str, float, float, float]] = []

        fitted: set[str] = set()
        missed: list[str] = []
        cost = self._prefill_cost(r.engine) if neighbours is not None else None
        # co-scheduled seconds over the request's life, and the share of it excused now
        work: float | None = None
        share = 0.0
        # False once a phase is slow even with all its co-scheduled work excused (another
        # incident: its co-scheduled work does not teach the engine's usual)
        explained = True

        def coscheduled(a: float, b: float, largest: bool = False) -> float | None:
            if cost is None or neighbours is None or work is None:
                return None
            total, one = coscheduled_work(r, a, b, neighbours, cost)
            return one if largest else total

        def fit(
            phase: str,
            value: float,
            size: float,
            a: float,
            b: float,
            floor: float | None = None,
            work_s: float | None = None,
            tokens: float = 1.0,
            seen_s: float | None = None,
        ) -> None:
            nonlocal explained
            m = self._models.get((r.engine, phase))
            allow = None if work_s is None else share * work_s
            extra = allow or 0.0
            slow = False
            own = max(0.0, value - extra)
            if m is not None and len(m.points) >= self.min_requests:
                fl = self._floor(phase) if floor is None else floor
                beside = phase in DECODE_PHASES and (preempted_self or _overlaps(preempted, a, b))
                factor = 1.0 if beside else self.factor
                thr, exp = m.threshold(size, self.q, factor, fl, tokens)
                judged.append(
                    PhaseVerdict(
                        phase,
                        value,
                        thr + extra,
                        "baseline",
                        exp + extra,
                        size,
                        a,
                        b,
                        allow,
                        work_s if seen_s is None or work_s is None else seen_s,
                    )
                )
                slow = value > thr + extra
                if value > thr + (work_s or 0.0):
                    explained = False
                fitted.add(phase)
                # the allowance is an upper bound of the co-scheduled delay: it explains the
                # value's excess over the own cost, never more
                own = value if value <= exp else max(exp, own)
            # the fit learns the request's own cost, net of the excused work, and only from
            # a phase that ran while its engine preempted nothing
            if not slow and not _overlaps(preempted, a, b):
                learn.append((phase, size, own, tokens))

        def slo(phase: str, value: float, a: float, b: float) -> None:
            if value > self.slo[phase]:
                missed.append(phase)
                # never learnt: an undetected incident must not become the norm past the SLO
                learn[:] = [x for x in learn if x[0] != phase]
            if phase not in fitted:  # warm-up: the SLO is the only judgement
                judged.append(PhaseVerdict(phase, value, self.slo[phase], "slo", None, None, a, b))

        uncached: float = 0.0
        if r.input_tokens is not None:
            uncached = float(max(0, r.input_tokens - (r.cached_tokens or 0)))
        if r.ttft_s is not None and cost is not None and neighbours is not None:
            work = coscheduled_work(r, r.start, r.end, neighbours, cost)[0]
            share = self._coscheduled(r.engine).share(work)
        if r.queue_s is not None and r.queue_s >= 0:
            q_end = r.start + r.queue_s
            fit("queue", r.queue_s, 0.0, r.start, q_end, work_s=coscheduled(r.start, q_end))
        if r.ttft_s is not None:
            first = r.start + r.ttft_s
            if r.prefill_s is not None and r.prefill_s >= 0:
                p_start = first - r.prefill_s
                fit("prefill", r.prefill_s, uncached, p_start, first,
                    work_s=coscheduled(p_start, first))  # fmt: skip
            ttft_work = coscheduled(r.start, first)
            fit("ttft", r.ttft_s, uncached, r.start, first, work_s=ttft_work)
            slo("ttft", r.ttft_s, r.start, first)
            out = r.output_tokens
            decode = r.decode_s
            if decode is None and r.e2e_s is not None:
                decode = r.e2e_s - r.ttft_s
            size = batch if batch is not None and batch > 0 else 1.0
            dec_work = coscheduled(first, r.end)
            if out is not None and out >= 2 and decode is not None and decode >= 0:
                tpot = decode / (out - 1)
                per_token = None if dec_work is None else dec_work / (out - 1)
                # the floor is on the decode's seconds, spread over its tokens
                fit("tpot", tpot, size, first, r.end, self.floor / (out - 1), per_token,
                    tokens=out - 1)  # fmt: skip
                slo("tpot", tpot, first, r.end)
            if len(r.itl_s) >= 2:
                # one co-scheduled prefill can fall into one gap: the largest is allowed there;
                # the prefill work that did fall into the longest gap (several prompts
                # batched into one step) is what the rules compare the gap's excess to
                gap_work = coscheduled(first, r.end, largest=True)
                longest = max(range(len(r.itl_s)), key=r.itl_s.__getitem__)
                g0 = first + math.fsum(r.itl_s[:longest])
                in_gap = coscheduled(g0, g0 + r.itl_s[longest])
                fit("itl_max", r.itl_s[longest], size, first, r.end, work_s=gap_work,
                    seen_s=in_gap)  # fmt: skip
        elif r.e2e_s is not None:
            out_size = float(r.output_tokens) if r.output_tokens is not None else 0.0
            fit("e2e", r.e2e_s, out_size, r.start, r.end)
            slo("e2e", r.e2e_s, r.start, r.end)

        slow_phases = tuple(
            sorted((p for p in judged if p.value_s > p.threshold_s), key=lambda p: -p.excess)
        )
        if log.isEnabledFor(logging.DEBUG):  # every verdict, for whoever tunes a workload
            log.debug(
                "judged %s request %.3f-%.3f (in %s, out %s, preempted %s): %s",
                r.engine, r.start, r.end, r.input_tokens, r.output_tokens,
                own_preemptions if own_preemptions is not None
                else f"? ({shared_preemptions} shared)" if shared_preemptions else "?",
                "; ".join(
                    f"{p.phase} {p.value_s:.4g} {'>' if p.value_s > p.threshold_s else '<='}"
                    f" {p.threshold_s:.4g} ({p.basis}, expected {_g(p.expected_s)},"
                    f" size {_g(p.size)}{_work(p.work_s)})"
                    for p in judged
                ),
            )  # fmt: skip
        if r.outcome == "ok" and not slow_phases:
            for phase, size, value, tokens in learn:
                key = (r.engine, phase)
                m = self._models.get(key)
                if m is None:
                    m = self._models[key] = CostModel(self.size, phase in TOKEN_SIZED)
                m.add(size, value, tokens)
        if work is not None:
            self._coscheduled(r.engine).add(work, r.outcome == "ok" and explained)
        if slow_phases:
            top = slow_phases[0]
            return Verdict(
                True, top.phase, top.value_s, top.threshold_s, top.basis, slow_phases,
                min(p.start for p in slow_phases), max(p.end for p in slow_phases),
                tuple(missed),
            )  # fmt: skip
        # not slow: summarised by TTFT (else e2e) against its tightest threshold
        main = "ttft" if r.ttft_s is not None else "e2e"
        cands = [p for p in judged if p.phase == main]
        best = min(cands, key=lambda p: p.threshold_s) if cands else None
        latency = r.ttft_s if r.ttft_s is not None else r.e2e_s
        assert latency is not None
        thr = best.threshold_s if best is not None else self.slo[main]
        basis = best.basis if best is not None else "slo"
        return Verdict(False, main, latency, thr, basis, (), r.start, r.end, tuple(missed))
