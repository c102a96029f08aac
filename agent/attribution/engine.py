"""Turns rule scores into an attribution: the primary cause of a slow request or window.

Primary cause::

    gpu_fault        if score(gpu_fault) >= min_score
    engine_restart   elif score(engine_restart) >= min_score
    argmax over {memory, storage, network, prefill_interference, compute}
                     elif that score >= min_score (ties: that order)
    concurrency      elif score(concurrency) >= min_score
    unknown          otherwise

Queueing at the concurrency cap is named only when nothing slowed the engine itself:
requests wait at the cap whenever the ones in the slots take longer, so with memory,
storage or compute short the queue is their symptom (and still scored, with its remedy).

Event causes outrank resource causes because they explain them: after a restart the prefix
cache is empty and requests queue while weights load, which reads as memory pressure (case
22); a GPU that fell off the bus stalls everything (case 5). ``unknown`` with
``engine_metrics`` in ``unassessed`` means "the engine's metrics were unavailable", never
"no memory pressure" (case 20).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kvpressure.agent.attribution.detector import DECODE_PHASES, Verdict, quantile
from kvpressure.agent.attribution.model import (
    CAUSES,
    EVENT_CAUSES,
    SYMPTOM_CAUSES,
    UNKNOWN,
    Attribution,
    WindowAttribution,
)
from kvpressure.agent.attribution.rules import Params, Scope, SlowDecode, evaluate
from kvpressure.agent.attribution.signals import Signals
from kvpressure.agent.requests.record import RequestRecord


def primary_cause(scores: Mapping[str, float], min_score: float) -> str:
    """Return the primary cause for ``scores`` (rules in the module docstring)."""
    for ev in EVENT_CAUSES:
        if scores.get(ev, 0.0) >= min_score:
            return ev
    for causes in (
        tuple(c for c in CAUSES if c not in SYMPTOM_CAUSES),
        SYMPTOM_CAUSES,
    ):
        best, best_score = UNKNOWN, 0.0
        for cause in causes:
            s = scores.get(cause, 0.0)
            if s > best_score:
                best, best_score = cause, s
        if best_score >= min_score:
            return best
    return UNKNOWN


def slow_decodes(verdict: Verdict) -> tuple[SlowDecode, ...]:
    """The verdict's slow decode phases (``tpot``, ``itl_max``) for ``decode_interference``.

    Only phases judged against their fit with the co-scheduled work known (``expected_s``
    and ``work_s`` set): their own cost is ``expected_s`` less the co-scheduled allowance.
    """
    out: list[SlowDecode] = []
    for p in verdict.slow_phases:
        if p.phase not in DECODE_PHASES or p.expected_s is None or p.work_s is None:
            continue
        own = p.expected_s - (p.coscheduled_s or 0.0)
        out.append(SlowDecode(p.phase, p.value_s, own, p.work_s))
    return tuple(out)


MIN_SCOPE_S = 5.0
"""Shortest span a slow request's evidence is read over, seconds (before the lead-in): five
engine scrapes at the default 1 s interval."""


class Attributor:
    """Scores slow requests and windows against the timeline.

    Args:
        params: rule thresholds and the cold-start horizon.
        lead_in_s: seconds before a request's start that are read too.
        min_score: the lowest score that can name a primary cause.
    """

    def __init__(self, params: Params, lead_in_s: float = 2.0, min_score: float = 0.3) -> None:
        self.params = params
        self.lead_in_s = lead_in_s
        self.min_score = min_score

    def attribute_request(
        self,
        sig: Signals,
        record: RequestRecord,
        verdict: Verdict,
        neighbours: Sequence[RequestRecord] = (),
    ) -> Attribution:
        """Attribute one slow request over the time span of its slow phase(s).

        The scope read is ``[verdict.start - lead_in_s, verdict.end]`` (the request's
        ``[start - lead_in_s, end]`` when the verdict has no span), its start moved back so
        that it spans at least :data:`MIN_SCOPE_S` before the lead-in.

        Args:
            sig: timeline signals covering the scope.
            record: the slow request.
            verdict: the detector's verdict on it.
            neighbours: other recent requests of the engine (prefill interference).
        """
        a = record.start if verdict.start is None else verdict.start
        b = record.end if verdict.end is None else verdict.end
        # a phase shorter than a few engine samples holds too few of them to show its
        # cause (a request that queued 0.8 s during a preemption storm): read at least
        # MIN_SCOPE_S, ending where the phase ends
        a = min(a, b - MIN_SCOPE_S)
        scope = Scope(
            record.engine, a, b, self.lead_in_s, record, tuple(neighbours), slow_decodes(verdict)
        )
        scores, evidence, unassessed = evaluate(sig, scope, self.params)
        return Attribution(
            engine=record.engine,
            start=record.start,
            end=record.end,
            cause=primary_cause(scores, self.min_score),
            scores=scores,
            evidence=tuple(evidence),
            unassessed=unassessed,
            phase=verdict.phase,
            latency_s=verdict.latency_s,
            threshold_s=verdict.threshold_s,
            basis=verdict.basis,
            outcome=record.outcome,
            model=record.model,
            input_tokens=record.input_tokens,
            output_tokens=record.output_tokens,
            trace_id=record.trace_id,
            span_id=record.span_id,
            slow_phases=tuple(
                (p.phase, p.value_s, p.threshold_s, p.basis) for p in verdict.slow_phases
            ),
            scope_start=a,
            scope_end=b,
        )

    def attribute_window(
        self,
        sig: Signals,
        engine: str,
        start: float,
        end: float,
        latencies: Sequence[float],
        slow: int,
        engine_p95_s: float | None = None,
        slo_s: float | None = None,
    ) -> WindowAttribution:
        """Attribute the window ``[start, end)`` of ``engine``.

        Args:
            sig: timeline signals covering the window.
            engine: the ``engine`` label.
            start: window start, Unix seconds.
            end: window end.
            latencies: judged latencies of the requests that ended in the window.
            slow: how many of them were slow.
            engine_p95_s: the engine's own tail-latency quantile over the window (from
                ``kvpressure_engine_latency_seconds``) when no request records exist.
            slo_s: the SLO ``engine_p95_s`` is compared to.

        Returns:
            Scores for every window; a primary cause only when the window was slow (slow
            requests, or ``engine_p95_s > slo_s`` when there were no records).
        """
        scores, evidence, unassessed = evaluate(sig, Scope(engine, start, end), self.params)
        p95: float | None = None
        if latencies:
            p95 = quantile(sorted(latencies), 0.95)
        elif engine_p95_s is not None:
            p95 = engine_p95_s
        is_slow = slow > 0 or (
            not latencies
            and engine_p95_s is not None
            and slo_s is not None
            and engine_p95_s > slo_s
        )
        return WindowAttribution(
            engine=engine,
            start=start,
            end=end,
            cause=primary_cause(scores, self.min_score) if is_slow else None,
            scores=scores,
            evidence=tuple(evidence),
            unassessed=unassessed,
            requests=len(latencies),
            slow=slow,
            p95_s=p95,
        )
