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

CAUSES: tuple[str, ...] = ("memory", "storage", "network", "compute")
"""Resource causes, in tie-break order (the first wins a tie)."""

EVENT_CAUSES: tuple[str, ...] = ("gpu_fault", "engine_restart")
"""Event causes, in precedence order; either one outranks every resource cause."""

ALL_CAUSES: tuple[str, ...] = CAUSES + EVENT_CAUSES
"""Every cause that has a score."""

Cause = Literal["memory", "storage", "network", "compute", "gpu_fault", "engine_restart"]
"""A scored cause, as a type (a rule's ``cause``); ``tests/test_pipeline.py`` keeps it equal
to :data:`ALL_CAUSES`."""

UNKNOWN = "unknown"
"""The primary cause when no cause scored at least ``min_score``."""

ENGINE_METRICS = "engine_metrics"
"""``unassessed`` entry: the engine's metrics were unavailable (``kvpressure_engine_up`` 0 or
never scraped), so KV, queue, preemption and prefix-cache signals could not be read. The
attribution then never means "no memory pressure"."""


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
        phase: ``ttft`` or ``e2e``: the latency the request was judged on.
        latency_s: that latency.
        threshold_s: the slow threshold it exceeded.
        basis: ``slo`` or ``baseline``: which of the two thresholds was lower.
        outcome: the request's outcome.
        model: served model where known.
        input_tokens: prompt tokens where known.
        output_tokens: generated tokens where known.
        trace_id: source trace id (32 hex digits) where known.
        span_id: source span id (16 hex digits) where known.
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
