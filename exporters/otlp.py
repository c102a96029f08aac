"""OTLP/HTTP export: ``kvpressure.attribution`` spans and the whole metric catalogue.

Spans: one ``kvpressure.attribution`` span per slow request (start and end are the
request's), through the OpenTelemetry SDK's ``TracerProvider`` + ``BatchSpanProcessor`` +
OTLP/HTTP span exporter. When the request's source trace is known (OTLP-ingested requests,
or a proxy that saw ``traceparent``), the span is a child of the source span
(``span_parent: child``, the default) or starts its own trace with a link to it
(``span_parent: link``). Attributes:

=================================== =========================================================
``kvpressure.cause``                primary cause (memory, storage, network, concurrency,
                                    prefill_interference, compute, gpu_fault,
                                    engine_restart, unknown)
``kvpressure.score.<cause>``        score of every cause, 0-1
``kvpressure.evidence``             JSON list of the evidence: signal, metric, value,
                                    threshold, saturation, score, unit, labels
``kvpressure.evidence.<signal>``    the observed value of each piece of evidence
``kvpressure.unassessed``           what could not be assessed (``engine_metrics``,
                                    ``engine_metrics_stale``)
``kvpressure.gpu.xid``              the XID code of a GPU fault
``kvpressure.latency.phase``        the slowest phase (``queue``, ``prefill``, ``ttft``,
                                    ``tpot``, ``itl_max``, ``e2e``), and
                                    ``kvpressure.latency_s``, ``kvpressure.threshold_s``,
                                    ``kvpressure.threshold.basis``
``kvpressure.slow_phases``          every slow phase, slowest first
``kvpressure.engine``, ``kvpressure.outcome``
``gen_ai.request.model``, ``gen_ai.usage.input_tokens``, ``gen_ai.usage.output_tokens``,
``gen_ai.latency.time_to_first_token`` (phase ``ttft``), ``gen_ai.latency.e2e`` (``e2e``)
=================================== =========================================================

Metrics: every ``otlp_export.interval_s`` the current :class:`~agent.state.AgentState`
snapshot is converted to OTLP metrics (catalogue OTel names and UCUM units; counters as
cumulative monotonic sums, gauges and info metrics as gauges, Prometheus-style histograms as
explicit-bucket histograms) and sent with the OTLP/HTTP metric exporter. Observable
instruments cannot carry the pre-aggregated histogram families, so the snapshot is converted
directly; only the newest snapshot is ever pending (a queue of one).

An exporter that is down never slows sampling: spans wait in the batch processor's bounded
queue (``otlp_export.queue_size``) and the oldest are dropped when it is full; a failed
export drops its batch. Both are counted in ``kvpressure_otlp_export_dropped_total{signal}``
(``traces`` in spans, ``metrics`` in data points); what was delivered is counted in
``kvpressure_otlp_exported_total{signal}``.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.metrics.export import (
    AggregationTemporality,
    Gauge,
    Histogram,
    HistogramDataPoint,
    Metric,
    MetricExporter,
    MetricExportResult,
    MetricsData,
    NumberDataPoint,
    ResourceMetrics,
    ScopeMetrics,
    Sum,
)
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import Link, NonRecordingSpan, SpanContext, SpanKind, TraceFlags
from opentelemetry.util.types import AttributeValue

from kvpressure.agent import __version__
from kvpressure.agent.attribution.model import Attribution
from kvpressure.agent.catalogue import CATALOGUE
from kvpressure.agent.samples import Batch, Sample
from kvpressure.agent.state import AgentState

log = logging.getLogger(__name__)

SPAN_NAME = "kvpressure.attribution"
"""Name of the span emitted per slow request."""

SCOPE_NAME = "kvpressure.attribution"
"""Instrumentation scope of the spans and metrics."""

MAX_EVIDENCE_ATTRIBUTES = 12
"""Most pieces of evidence carried per span."""

UCUM = {
    "bytes": "By",
    "seconds": "s",
    "ratio": "1",
    "tokens": "{token}",
    "pages": "{page}",
    "requests": "{request}",
    "watts": "W",
    "celsius": "Cel",
    "1": "1",
}
"""Catalogue unit to UCUM unit (OpenTelemetry's unit syntax)."""


class ExportStats:
    """Thread-safe counts of exported and dropped items per signal (``traces``, ``metrics``).

    Also logs once when a signal's exports start failing and once when they recover, instead
    of once per batch.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.exported: dict[str, int] = {"traces": 0, "metrics": 0}
        self.dropped: dict[str, int] = {"traces": 0, "metrics": 0}
        self._failing: set[str] = set()

    def add_exported(self, signal: str, n: int) -> None:
        """Count ``n`` items delivered."""
        with self._lock:
            self.exported[signal] = self.exported.get(signal, 0) + n
            recovered = signal in self._failing
            self._failing.discard(signal)
        if recovered:
            log.info("OTLP export recovered", extra={"kv": {"signal": signal}})

    def add_dropped(self, signal: str, n: int, failed_export: bool = False) -> None:
        """Count ``n`` items lost (queue full, or a failed export when ``failed_export``)."""
        with self._lock:
            self.dropped[signal] = self.dropped.get(signal, 0) + n
            first = failed_export and signal not in self._failing
            if failed_export:
                self._failing.add(signal)
        if first:
            log.warning(
                "OTLP export failing; items are dropped and counted in "
                "kvpressure_otlp_export_dropped_total",
                extra={"kv": {"signal": signal}},
            )

    def snapshot(self) -> tuple[dict[str, int], dict[str, int]]:
        """Return copies of ``(exported, dropped)``."""
        with self._lock:
            return dict(self.exported), dict(self.dropped)


# --- spans ----------------------------------------------------------------------------------


def _hex_id(value: str | None, digits: int) -> int | None:
    if not value or len(value) != digits:
        return None
    try:
        n = int(value, 16)
    except ValueError:
        return None
    return n or None


def source_context(a: Attribution) -> SpanContext | None:
    """The source span's context of ``a``, or ``None`` when its ids are unknown or invalid."""
    tid = _hex_id(a.trace_id, 32)
    sid = _hex_id(a.span_id, 16)
    if tid is None or sid is None:
        return None
    return SpanContext(tid, sid, is_remote=True, trace_flags=TraceFlags(TraceFlags.SAMPLED))


def span_attributes(a: Attribution) -> dict[str, AttributeValue]:
    """The attributes of ``a``'s span (table in the module docstring)."""
    attrs: dict[str, AttributeValue] = {
        "kvpressure.cause": a.cause,
        "kvpressure.engine": a.engine,
        "kvpressure.outcome": a.outcome,
        "kvpressure.latency.phase": a.phase,
        "kvpressure.latency_s": a.latency_s,
        "kvpressure.threshold_s": a.threshold_s,
        "kvpressure.threshold.basis": a.basis,
    }
    for cause, score in a.scores.items():
        attrs[f"kvpressure.score.{cause}"] = round(score, 4)
    ev = a.evidence[:MAX_EVIDENCE_ATTRIBUTES]
    attrs["kvpressure.evidence"] = json.dumps([e.to_dict() for e in ev], separators=(",", ":"))
    for e in ev:
        attrs.setdefault(f"kvpressure.evidence.{e.signal}", e.value)
        if e.signal == "gpu_fault" and e.labels.get("xid"):
            attrs["kvpressure.gpu.xid"] = e.labels["xid"]
    if a.unassessed:
        attrs["kvpressure.unassessed"] = list(a.unassessed)
    if a.model:
        attrs["gen_ai.request.model"] = a.model
    if a.input_tokens is not None:
        attrs["gen_ai.usage.input_tokens"] = a.input_tokens
    if a.output_tokens is not None:
        attrs["gen_ai.usage.output_tokens"] = a.output_tokens
    if a.slow_phases:
        attrs["kvpressure.slow_phases"] = [p[0] for p in a.slow_phases]
    key = {"ttft": "gen_ai.latency.time_to_first_token", "e2e": "gen_ai.latency.e2e"}
    if a.phase in key:
        attrs[key[a.phase]] = a.latency_s
    return attrs


class AttributionSpans:
    """Turns attributions into ``kvpressure.attribution`` spans (a ``SpanSink``).

    Args:
        provider: the tracer provider whose processors export the spans.
        parenting: ``child`` (the span is a child of the source span when it is known) or
            ``link`` (a new trace, linked to the source span).
    """

    def __init__(self, provider: TracerProvider, parenting: str = "child") -> None:
        self._tracer = provider.get_tracer(SCOPE_NAME, __version__)
        self.parenting = parenting

    def emit(self, attribution: Attribution) -> None:
        """Start and end one span for ``attribution``; never blocks on the exporter."""
        src = source_context(attribution)
        ctx = None
        links: list[Link] = []
        if src is not None:
            if self.parenting == "child":
                ctx = trace.set_span_in_context(NonRecordingSpan(src))
            else:
                links.append(Link(src, {"kvpressure.link": "source_request"}))
        span = self._tracer.start_span(
            SPAN_NAME,
            context=ctx,
            kind=SpanKind.INTERNAL,
            attributes=span_attributes(attribution),
            links=links,
            start_time=int(attribution.start * 1e9),
        )
        span.end(end_time=int(attribution.end * 1e9))


class CountingSpanExporter(SpanExporter):
    """Wraps a span exporter and counts delivered and failed spans into ``stats``."""

    def __init__(self, inner: SpanExporter, stats: ExportStats) -> None:
        self._inner = inner
        self._stats = stats

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        """Export ``spans``; a failure (or exception) counts them as dropped."""
        try:
            result = self._inner.export(spans)
        except Exception:
            log.debug("span export raised", exc_info=True)
            result = SpanExportResult.FAILURE
        if result == SpanExportResult.SUCCESS:
            self._stats.add_exported("traces", len(spans))
        else:
            self._stats.add_dropped("traces", len(spans), failed_export=True)
        return result

    def shutdown(self) -> None:
        """Shut the wrapped exporter down."""
        self._inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        """Flush the wrapped exporter."""
        return self._inner.force_flush(timeout_millis)


class CountingBatchSpanProcessor(BatchSpanProcessor):
    """``BatchSpanProcessor`` that counts the spans its full queue drops.

    The SDK drops the oldest queued span when the queue is full and only logs it; this
    subclass counts it in ``stats`` first. It reads the queue length through the SDK's
    private batch processor when available (checked against SDK 1.45); without it the
    overflow goes uncounted but nothing else changes. The check races the export worker: a
    span taken for export just as the queue was full may be counted once too often.
    """

    def __init__(self, exporter: SpanExporter, stats: ExportStats, max_queue_size: int,
                 **kwargs: Any) -> None:  # fmt: skip
        super().__init__(exporter, max_queue_size=max_queue_size, **kwargs)
        self._stats = stats
        self._max = max_queue_size
        self._queue = getattr(getattr(self, "_batch_processor", None), "_queue", None)

    def queued(self) -> int | None:
        """Spans waiting in the queue, or ``None`` when the SDK does not expose it."""
        return None if self._queue is None else len(self._queue)

    def on_end(self, span: ReadableSpan) -> None:
        """Queue ``span`` for export, counting the span that a full queue drops."""
        if (
            self._queue is not None
            and span.context is not None
            and span.context.trace_flags.sampled
            and len(self._queue) >= self._max
        ):
            self._stats.add_dropped("traces", 1)
        super().on_end(span)


# --- metrics --------------------------------------------------------------------------------

_HIST_SUFFIXES = ("_bucket", "_count", "_sum")


def _family(name: str) -> tuple[str, str]:
    """``(catalogue name, sample suffix)``; suffix is ``""`` for plain samples."""
    if name in CATALOGUE:
        return name, ""
    for suf in _HIST_SUFFIXES:
        base = name.removesuffix(suf)
        if base != name and base in CATALOGUE and CATALOGUE[base].kind == "histogram":
            return base, suf
    return "", ""


def snapshot_metrics(
    samples: Iterable[Sample], start_ns: int, now_ns: int
) -> tuple[list[Metric], int]:
    """Convert snapshot samples to OTLP metrics using the catalogue.

    Args:
        samples: the agent's current samples (names not in the catalogue are skipped).
        start_ns: start time of cumulative series (the agent's start), Unix nanoseconds.
        now_ns: the data points' time.

    Returns:
        ``(metrics, data points)``.
    """
    plain: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    hist: dict[str, dict[tuple[tuple[str, str], ...], dict[str, Any]]] = {}
    for s in samples:
        fam, suf = _family(s.name)
        if not fam:
            continue
        if not suf:
            plain.setdefault(fam, {}).setdefault(s.labels, s.value)
            continue
        labels = tuple([kv for kv in s.labels if kv[0] != "le"])
        h = hist.setdefault(fam, {}).setdefault(labels, {"buckets": {}, "count": 0.0, "sum": 0.0})
        if suf == "_bucket":
            le = dict(s.labels).get("le", "+Inf")
            h["buckets"][float(le)] = s.value
        else:
            h[suf[1:]] = s.value
    out: list[Metric] = []
    points = 0
    for name, m in CATALOGUE.items():
        unit = UCUM.get(m.unit, m.unit)
        otel = m.otel or name
        if name in plain:
            series = plain[name]
            dps = [
                NumberDataPoint(dict(labels), start_ns, now_ns, value)
                for labels, value in series.items()
            ]
            points += len(dps)
            if m.kind == "counter":
                data: Sum | Gauge | Histogram = Sum(
                    dps, AggregationTemporality.CUMULATIVE, is_monotonic=True
                )
            else:
                data = Gauge(dps)
            out.append(Metric(otel, m.help, unit, data))
        elif name in hist:
            hdps: list[HistogramDataPoint] = []
            for labels, h in hist[name].items():
                bounds = sorted(b for b in h["buckets"] if b != float("inf"))
                cum = [h["buckets"][b] for b in bounds] + [h["count"]]
                counts = [int(c - p) for c, p in zip(cum, [0.0, *cum[:-1]], strict=True)]
                hdps.append(
                    HistogramDataPoint(
                        dict(labels), start_ns, now_ns, int(h["count"]), h["sum"], counts,
                        bounds, min=None, max=None,  # type: ignore[arg-type]
                    )
                )  # fmt: skip
            points += len(hdps)
            out.append(
                Metric(otel, m.help, unit, Histogram(hdps, AggregationTemporality.CUMULATIVE))
            )
    return out, points


class SnapshotMetricExport:
    """Periodically exports the agent's snapshot as OTLP metrics on its own thread.

    Args:
        state: the agent state to read.
        exporter: the OTLP metric exporter (or a test double).
        resource: the OTel resource of the agent.
        stats: export counters.
        interval_s: seconds between exports.
        timeout_s: per-export timeout passed to the exporter.
    """

    def __init__(
        self,
        state: AgentState,
        exporter: MetricExporter,
        resource: Resource,
        stats: ExportStats,
        interval_s: float = 15.0,
        timeout_s: float = 5.0,
    ) -> None:
        self._state = state
        self._exporter = exporter
        self._resource = resource
        self._stats = stats
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._main, name="otlp-metrics", daemon=True)

    def start(self) -> None:
        """Start the export thread."""
        self._thread.start()

    def export_once(self) -> bool:
        """Take a snapshot and export it now; True when it was delivered."""
        now_ns = time.time_ns()
        metrics, points = snapshot_metrics(
            self._state.samples(), int(self._state.started * 1e9), now_ns
        )
        data = MetricsData(
            [
                ResourceMetrics(
                    self._resource,
                    [ScopeMetrics(InstrumentationScope(SCOPE_NAME, __version__), metrics, "")],
                    "",
                )
            ]
        )
        try:
            result = self._exporter.export(data, timeout_millis=self.timeout_s * 1000)
        except Exception:
            log.debug("metric export raised", exc_info=True)
            result = MetricExportResult.FAILURE
        if result == MetricExportResult.SUCCESS:
            self._stats.add_exported("metrics", points)
            return True
        self._stats.add_dropped("metrics", points, failed_export=True)
        return False

    def _main(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.export_once()

    def stop(self, timeout_s: float = 1.0) -> None:
        """Stop the thread (waits up to ``timeout_s``) and shut the exporter down."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        try:
            self._exporter.shutdown(timeout_millis=timeout_s * 1000)
        except Exception:
            log.debug("metric exporter shutdown raised", exc_info=True)


# --- the whole thing ------------------------------------------------------------------------


def default_resource() -> Resource:
    """The agent's OTel resource: service name and version, host name."""
    return Resource.create(
        {
            "service.name": "kvpressure",
            "service.version": __version__,
            "host.name": socket.gethostname(),
        }
    )


class OtlpExport:
    """OTLP export of attribution spans and the metric snapshot (see the module docstring).

    Args:
        state: the agent state (metrics snapshot).
        endpoint: OTLP/HTTP base URL, e.g. ``http://127.0.0.1:4318``; ``/v1/traces`` and
            ``/v1/metrics`` are appended.
        headers: extra HTTP headers (e.g. an authorization header).
        interval_s: metric export interval.
        queue_size: span queue bound.
        timeout_s: per-export timeout.
        span_parent: ``child`` or ``link`` (see :class:`AttributionSpans`).
        span_exporter: exporter to use instead of OTLP/HTTP (tests).
        metric_exporter: exporter to use instead of OTLP/HTTP (tests); metrics are not
            exported when ``endpoint`` is empty and this is ``None``.
        schedule_delay_s: batch processor delay between exports.
        export_metrics: export the metric snapshot (spans are always exported).
    """

    def __init__(
        self,
        state: AgentState,
        endpoint: str = "",
        headers: Mapping[str, str] | None = None,
        interval_s: float = 15.0,
        queue_size: int = 2048,
        timeout_s: float = 5.0,
        span_parent: str = "child",
        span_exporter: SpanExporter | None = None,
        metric_exporter: MetricExporter | None = None,
        schedule_delay_s: float = 1.0,
        export_metrics: bool = True,
    ) -> None:
        self.stats = ExportStats()
        self.resource = default_resource()
        # The SDK logs every span a full queue drops and every failed batch; the counters
        # and ExportStats' one-line state changes say the same without flooding the log.
        logging.getLogger("opentelemetry.sdk._shared_internal").setLevel(logging.ERROR)
        logging.getLogger("opentelemetry.exporter.otlp.proto.http").setLevel(logging.CRITICAL)
        base = endpoint.rstrip("/")
        if span_exporter is None:
            from opentelemetry.exporter.otlp.proto.http import Compression
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            span_exporter = OTLPSpanExporter(
                endpoint=f"{base}/v1/traces",
                headers=dict(headers or {}),
                timeout=timeout_s,
                compression=Compression.Gzip,
            )
        if metric_exporter is None and base and export_metrics:
            from opentelemetry.exporter.otlp.proto.http import Compression
            from opentelemetry.exporter.otlp.proto.http.metric_exporter import (
                OTLPMetricExporter,
            )

            metric_exporter = OTLPMetricExporter(
                endpoint=f"{base}/v1/metrics",
                headers=dict(headers or {}),
                timeout=timeout_s,
                compression=Compression.Gzip,
            )
        self.processor = CountingBatchSpanProcessor(
            CountingSpanExporter(span_exporter, self.stats),
            self.stats,
            max_queue_size=queue_size,
            max_export_batch_size=min(512, queue_size),
            schedule_delay_millis=schedule_delay_s * 1000,
        )
        self.provider = TracerProvider(resource=self.resource)
        self.provider.add_span_processor(self.processor)
        self.spans = AttributionSpans(self.provider, span_parent)
        self.metrics: SnapshotMetricExport | None = None
        if metric_exporter is not None and export_metrics:
            self.metrics = SnapshotMetricExport(
                state, metric_exporter, self.resource, self.stats, interval_s, timeout_s
            )

    def start(self) -> None:
        """Start the metric export thread (spans need no start)."""
        if self.metrics is not None:
            self.metrics.start()

    def emit(self, attribution: Attribution) -> None:
        """Emit ``attribution``'s span (the ``SpanSink`` interface)."""
        self.spans.emit(attribution)

    def health_samples(self) -> list[Sample]:
        """The exporter's own metrics (its health), rendered with the agent's.

        The daemon registers this with :meth:`agent.state.AgentState.add_health`: the
        exporter is not a sampler. ``kvpressure_otlp_exported_total{signal}``,
        ``kvpressure_otlp_export_dropped_total{signal}``, ``kvpressure_otlp_export_queue_spans``.
        """
        batch = Batch()
        exported, dropped = self.stats.snapshot()
        for signal in ("traces", "metrics"):
            if signal == "metrics" and self.metrics is None:
                continue
            batch.add("kvpressure_otlp_exported_total", exported.get(signal, 0), signal=signal)
            batch.add("kvpressure_otlp_export_dropped_total", dropped.get(signal, 0), signal=signal)
        batch.add("kvpressure_otlp_export_queue_spans", self.processor.queued())
        return batch.samples

    def shutdown(self, timeout_s: float = 1.0) -> None:
        """Stop exporting; pending spans get one last flush attempt within ``timeout_s``.

        Spans still queued when the time is up (the exporter is down or hanging) will
        never be sent: they are counted in ``kvpressure_otlp_export_dropped_total`` and
        logged in one line. A batch being exported at that moment is counted by the
        exporter when its attempt ends, if the process lives that long.
        """
        if self.metrics is not None:
            self.metrics.stop(timeout_s)
        done = threading.Event()

        def _close() -> None:
            try:
                self.provider.shutdown()
            finally:
                done.set()

        threading.Thread(target=_close, name="otlp-shutdown", daemon=True).start()
        if done.wait(timeout_s):
            return
        left = self.processor.queued()
        if left:
            self.stats.add_dropped("traces", left)
            log.warning(
                "OTLP export did not finish at stop; queued spans dropped",
                extra={"kv": {"spans": left, "timeout_s": timeout_s}},
            )
