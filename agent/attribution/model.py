"""What an attribution says: causes, evidence, and the attribution of a request or a window.

A cause is one of :data:`CAUSES` (the resources that slow inference down) or one of the
event causes :data:`EVENT_CAUSES` (an engine restart or a GPU fault explains everything that
follows it, so it is reported as its own cause instead of as the memory pressure it looks
like), or ``unknown`` when no cause scored at least ``min_score``.

Every score is in [0, 1] and comes with the evidence that produced it: the rule
(``signal``), the observed ``value``, the ``threshold`` where the rule starts to score and
the ``saturation`` where it reaches its full weight.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

CAUSES: tuple[str, ...] = (
    "memory",
    "storage",
    "network",
    "concurrency",
    "prefill_interference",
    "compute",
)
"""Causes an operator acts on, in tie-break order (the first wins a tie): a resource that
is short (``memory``, ``storage``, ``network``, ``compute``), the engine's concurrency cap
(``concurrency``: requests queue while every slot or ``max_num_seqs`` place is taken and KV
has room), or other requests' prefill (``prefill_interference``: a long one ahead in the
queue or in the same steps, or short ones batched into a decode's steps)."""

SYMPTOM_CAUSES: tuple[str, ...] = ("concurrency",)
"""Causes named only when no other cause scored ``min_score``: requests queue at the cap
whenever the ones running take longer, so a shortage that slows them comes first."""

REMEDIES: dict[str, str] = {
    "memory": "KV or host memory is short: lower max concurrent sequences or context "
    "length, give the engine more GPU/host memory (vLLM --gpu-memory-utilization, the "
    "cgroup limit), enable KV offload, or add replicas",
    "storage": "the engine waits on disk: keep weights and KV tiers resident (more page "
    "cache, mlock), move them to a faster disk, or stop competing I/O",
    "network": "time is lost between client and engine: check the path (retransmits, "
    "errors, proxy), and keep clients close to the engine",
    "concurrency": "requests wait for a slot while KV has room: raise the slot count "
    "(llama.cpp -np, vLLM --max-num-seqs) or add replicas",
    "prefill_interference": "long prompts' prefill holds up other requests, or prompts "
    "prefilled in the same steps slow a decode: enable or shrink chunked prefill (vLLM "
    "--max-num-batched-tokens, llama.cpp -b/-ub), or route long prompts to their own "
    "replica",
    "compute": "the engine is short of CPU/GPU time: stop competing work, check throttling "
    "and clocks, or add capacity",
    "gpu_fault": "a GPU fault (XID or lost GPU): check the GPU and its driver, move the "
    "engine off it",
    "engine_restart": "the engine restarted: find why (OOM kill, crash, deploy) and warm "
    "it before it takes traffic",
}
"""One line per cause: what an operator changes (``kvpressure explain`` prints it)."""

EVENT_CAUSES: tuple[str, ...] = ("gpu_fault", "engine_restart")
"""Event causes, in precedence order; either one outranks every resource cause."""

ALL_CAUSES: tuple[str, ...] = CAUSES + EVENT_CAUSES
"""Every cause that has a score."""

Cause = Literal[
    "memory",
    "storage",
    "network",
    "concurrency",
    "prefill_interference",
    "compute",
    "gpu_fault",
    "engine_restart",
]
"""A scored cause, as a type (a rule's ``cause``); ``tests/test_pipeline.py`` keeps it equal
to :data:`ALL_CAUSES`."""

UNKNOWN = "unknown"
"""The primary cause when no cause scored at least ``min_score``."""

ENGINE_METRICS = "engine_metrics"
"""``unassessed`` entry: the engine's metrics were unavailable (``kvpressure_engine_up`` 0 or
never scraped), so KV, queue, preemption and prefix-cache signals could not be read. The
attribution then never means "no memory pressure"."""

ENGINE_METRICS_STALE = "engine_metrics_stale"
"""``unassessed`` entry: the engine's statistics were stale in the scope (token counters
frozen while its gauges claimed running requests or a full KV cache,
``kvpressure_engine_stats_stale`` 1), so its KV, queue and preemption gauges were not used
as evidence."""


@dataclass(frozen=True, slots=True)
class Evidence:
    """One rule's finding.

    Attributes:
        cause: the cause the rule scores.
        signal: the rule name (``queue_while_full``, ``psi_cpu_some``, ...).
        metric: the catalogue metric (or record field) the value came from.
        value: the observed value, in ``unit``.
        threshold: value at which the rule starts to score (score 0 at or before it).
        saturation: value at which the rule reaches its full weight.
        score: ``weight x ramp(value, threshold, saturation)`` in [0, 1].
        unit: unit of ``value`` (``ratio``, ``1/s``, ``seconds``, ...).
        labels: the series the value came from where it matters (``device``, ``xid``).
    """

    cause: str
    signal: str
    metric: str
    value: float
    threshold: float
    saturation: float
    score: float
    unit: str
    labels: Mapping[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """Return a JSON-ready dict."""
        return {
            "cause": self.cause,
            "signal": self.signal,
            "metric": self.metric,
            "value": self.value,
            "threshold": self.threshold,
            "saturation": self.saturation,
            "score": round(self.score, 4),
            "unit": self.unit,
            "labels": dict(self.labels),
        }


@dataclass(frozen=True, slots=True)
class Attribution:
    """The attribution of one slow request.

    Attributes:
        engine: the ``engine`` label.
        start: request start, Unix seconds.
        end: request end, Unix seconds.
        cause: primary cause (see the module docstring).
        scores: score per cause in :data:`ALL_CAUSES`.
        evidence: findings with a score > 0, strongest first.
        unassessed: what could not be assessed (e.g. :data:`ENGINE_METRICS`).
        phase: the slowest phase (``queue``, ``prefill``, ``ttft``, ``tpot``, ``itl_max``,
            ``e2e``; see :mod:`agent.attribution.detector`).
        latency_s: that phase's value (seconds; per output token for ``tpot``).
        threshold_s: the slow threshold it exceeded.
        basis: ``slo`` (an objective) or ``baseline`` (the fitted cost of a request of its
            size on this engine).
        outcome: the request's outcome.
        model: served model where known.
        input_tokens: prompt tokens where known.
        output_tokens: generated tokens where known.
        trace_id: source trace id (32 hex digits) where known.
        span_id: source span id (16 hex digits) where known.
        slow_phases: every slow phase as ``(phase, value_s, threshold_s, basis)``, slowest
            first.
        scope_start: start of the time span attributed (the slow phases' span).
        scope_end: end of that span.
    """

    engine: str
    start: float
    end: float
    cause: str
    scores: Mapping[str, float]
    evidence: tuple[Evidence, ...]
    unassessed: tuple[str, ...]
    phase: str
    latency_s: float
    threshold_s: float
    basis: str
    outcome: str = "ok"
    model: str | None = None
    input_tokens: int | None = None
    output_tokens: int | None = None
    trace_id: str | None = None
    span_id: str | None = None
    slow_phases: tuple[tuple[str, float, float, str], ...] = ()
    scope_start: float | None = None
    scope_end: float | None = None

    def to_dict(self) -> dict[str, Any]:
        """Return a JSON-ready dict (the ``/api/v1/attributions`` item shape)."""
        return {
            "engine": self.engine,
            "start": self.start,
            "end": self.end,
            "cause": self.cause,
            "scores": {k: round(v, 4) for k, v in self.scores.items()},
            "evidence": [e.to_dict() for e in self.evidence],
            "unassessed": list(self.unassessed),
            "phase": self.phase,
            "latency_s": self.latency_s,
            "threshold_s": self.threshold_s,
            "basis": self.basis,
            "outcome": self.outcome,
            "model": self.model,
            "input_tokens": self.input_tokens,
            "output_tokens": self.output_tokens,
            "trace_id": self.trace_id,
            "span_id": self.span_id,
            "slow_phases": [
                {"phase": p, "value_s": v, "threshold_s": t, "basis": b}
                for p, v, t, b in self.slow_phases
            ],
            "scope_start": self.scope_start,
            "scope_end": self.scope_end,
        }


@dataclass(frozen=True, slots=True)
class WindowAttribution:
    """The attribution of one fixed window (default 10 s) of one engine.

    Attributes:
        engine: the ``engine`` label.
        start: window start, Unix seconds (a multiple of the window length).
        end: window end.
        cause: primary cause when the window was slow (it had slow requests, or the
            engine's own latency quantile exceeded the SLO), else ``None``.
        scores: score per cause in :data:`ALL_CAUSES`, computed for every window.
        evidence: findings with a score > 0, strongest first.
        unassessed: what could not be assessed.
        requests: requests that ended in the window.
        slow: slow requests that ended in the window.
        p95_s: 95th percentile of the judged latency of those requests, or of the engine's
            own latency quantile gauge when no request records exist; ``None`` when neither.
    """

    engine: str
    start: float
    end: float
    cause: str | None
    scores: Mapping[str, float]
    evidence: tuple[Evidence, ...]
    unassessed: tuple[str, ...]
    requests: int
    slow: int
    p95_s: float | None

    def to_dict(self) -> dict[str, Any]:
        """Return a JSON-ready dict."""
        return {
            "engine": self.engine,
            "start": self.start,
            "end": self.end,
            "cause": self.cause,
            "scores": {k: round(v, 4) for k, v in self.scores.items()},
            "evidence": [e.to_dict() for e in self.evidence[:5]],
            "unassessed": list(self.unassessed),
            "requests": self.requests,
            "slow": self.slow,
            "p95_s": self.p95_s,
        }
