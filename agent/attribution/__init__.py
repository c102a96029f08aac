"""Tail-latency attribution: why the slow requests were slow (memory, storage, network, compute).

* :mod:`agent.attribution.detector`: which requests are slow (SLO or rolling baseline).
* :mod:`agent.attribution.signals`: the timeline read once per pass; counter/gauge math.
* :mod:`agent.attribution.rules`: the scoring rules, thresholds and weights.
* :mod:`agent.attribution.engine`: scores to a primary cause, per request and per window.
* :mod:`agent.attribution.store`: bounded history for ``kvpressure explain``.
* :mod:`agent.attribution.sampler`: the ``attribution`` sampler tying them together.
* :mod:`agent.attribution.explain`: the ``explain`` text.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from agent.attribution.detector import SlowDetector
from agent.attribution.engine import Attributor
from agent.attribution.rules import Params
from agent.attribution.sampler import AttributionSampler, SpanSink
from agent.attribution.store import AttributionStore

if TYPE_CHECKING:
    from agent.config import AttributionConfig
    from agent.requests.record import RequestStream
    from agent.timeline import Timeline

__all__ = ["AttributionSampler", "AttributionStore", "Attributor", "SlowDetector", "make_sampler"]


def make_sampler(
    cfg: AttributionConfig,
    stream: RequestStream,
    timeline: Timeline,
    store: AttributionStore,
    *,
    interval_s: float,
    settle_s: float,
    span_sink: SpanSink | None = None,
) -> AttributionSampler:
    """Build the ``attribution`` sampler from the ``attribution:`` config section.

    Args:
        cfg: the section.
        stream: the daemon's request stream.
        timeline: the agent's timeline.
        store: the attribution store (kept across reloads).
        interval_s: the sampler's interval.
        settle_s: how long after its end a record is attributed.
        span_sink: the OTLP exporter, when on.
    """
    detector = SlowDetector(
        cfg.slo_ttft_s,
        cfg.slo_e2e_s,
        cfg.baseline_quantile,
        cfg.baseline_factor,
        cfg.baseline_requests,
        cfg.baseline_min_requests,
        cfg.baseline_floor_s,
        cfg.slo_tpot_s,
    )
    params = Params(dict(cfg.thresholds), cfg.cold_start_s, cfg.min_score)
    attributor = Attributor(params, cfg.lead_in_s, cfg.min_score)
    return AttributionSampler(
        stream,
        timeline,
        store,
        detector,
        attributor,
        interval_s=interval_s,
        settle_s=settle_s,
        window_s=cfg.window_s,
        span_sink=span_sink,
    )
