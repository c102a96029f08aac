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

from collections.abc import Iterator
from typing import TYPE_CHECKING

from kvpressure.agent.attribution.detector import SlowDetector
from kvpressure.agent.attribution.engine import Attributor
from kvpressure.agent.attribution.rules import Params
from kvpressure.agent.attribution.sampler import AttributionSampler, SpanSink
from kvpressure.agent.attribution.store import AttributionStore
from kvpressure.agent.pipeline import Context, Plan, Stage, register
from kvpressure.agent.samplers.host import SLOW_INTERVAL_S

if TYPE_CHECKING:
    from kvpressure.agent.config import AttributionConfig, Config
    from kvpressure.agent.requests.record import RequestStream
    from kvpressure.agent.timeline import Timeline

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


def _check(config: Config) -> Iterator[tuple[str, str]]:
    """``attribution.thresholds`` names known rules, each with threshold != saturation."""
    from kvpressure.agent.attribution.rules import RULES_BY_NAME

    for name, (thr, sat) in config.attribution.thresholds.items():
        if name not in RULES_BY_NAME:
            known = ", ".join(sorted(RULES_BY_NAME))
            yield "attribution.thresholds", f"unknown rule {name!r}; expected one of {known}"
        elif thr == sat:
            yield "attribution.thresholds", f"{name}: threshold and saturation must differ"


@register(
    "attribution",
    Stage.DERIVED,
    "names the cause of each slow request and window from the timeline",
    check=_check,
    reads=AttributionSampler.timeline_reads,
)
def _plan(ctx: Context) -> list[Plan]:
    cfg = ctx.config
    acfg = cfg.attribution
    interval = ctx.interval_s("attribution")
    # the sources that run, each at its own interval; under 1 s the host reads its CPU,
    # disk and network counters once a second: a record is judged once the read after its
    # end has been recorded
    sources = [
        max(ctx.interval_s(name), SLOW_INTERVAL_S) if name == "host" else ctx.interval_s(name)
        for name in ("host", "gpu", "engines")
        if getattr(cfg.samplers, name).enabled
    ]
    longest = max(sources, default=float(cfg.interval_s))
    settle = acfg.settle_s if acfg.settle_s is not None else 2 * longest
    if not cfg.samplers.attribution.interval_s:
        # A record is judged settle_s after its end, when its evidence has been sampled:
        # judging more often than half of that (or once a second) gives no verdict much
        # sooner, and each cycle costs as much with nothing new (10 Hz sources: 2 s settle).
        interval = max(interval, min(settle / 2, 1.0))

    def build() -> AttributionSampler:
        return make_sampler(
            acfg, ctx.requests, ctx.state.timeline, ctx.attributions,
            interval_s=interval, settle_s=settle, span_sink=ctx.span_sink,
        )  # fmt: skip

    return [Plan("attribution", ("attribution", acfg, settle, interval, id(ctx.span_sink)), build)]
