"""Request-latency metrics: cumulative histograms and counters from the RequestRecord stream.

:class:`RequestMetrics` is a :class:`~agent.samplers.base.Sampler` named ``requests``. Each
cycle it drains its own queue of the :class:`~agent.requests.record.RequestStream` and
folds every record into cumulative histograms per ``(engine, phase)`` and counters per
``(engine, outcome)``, then emits them all as samples (histograms as ``<name>_bucket{le}``,
``_count`` and ``_sum``). Other request sources (the OTLP receiver) add their own counters
through :class:`SampleSource`.

Bounds: the ``engine`` label takes at most :data:`MAX_ENGINES` values (later ones are
counted under ``other``); outcomes, phases and directions are closed sets.
"""

from __future__ import annotations

import bisect
import math
import re
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Final, Protocol

from kvpressure.agent import catalogue
from kvpressure.agent.pipeline import Context, Plan, Sampler, Stage, register
from kvpressure.agent.requests.record import OUTCOMES, RequestRecord, RequestStream
from kvpressure.agent.samples import Batch

LATENCY_METRIC: Final = catalogue.REQUEST_LATENCY_SECONDS
REQUESTS_METRIC: Final = catalogue.REQUESTS_TOTAL
TOKENS_METRIC: Final = catalogue.REQUEST_TOKENS_TOTAL
CONNECT_METRIC: Final = catalogue.PROXY_UPSTREAM_CONNECT_SECONDS
DROPPED_METRIC: Final = catalogue.REQUEST_RECORDS_DROPPED_TOTAL

CONSUMER = "metrics"
"""Name of this collector's queue on the RequestStream."""

LATENCY_BUCKETS_S: tuple[float, ...] = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.02,
    0.05,
    0.1,
    0.2,
    0.5,
    1.0,
    2.0,
    5.0,
    10.0,
    20.0,
    30.0,
    60.0,
    120.0,
)
"""Upper bounds (seconds) of the latency histogram: 1 ms (inter-token gaps) to 120 s (long
end-to-end generations and queueing under KV pressure)."""

CONNECT_BUCKETS_S: tuple[float, ...] = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
)
"""Upper bounds (seconds) of the proxy's upstream TCP connect-time histogram."""

PHASES = ("ttft", "e2e", "itl", "queue", "prefill", "decode")
MAX_ENGINES = 64
OTHER = "other"
_LABEL_OK = re.compile(r"^[A-Za-z0-9_.:/-]{1,64}$")


class LabelCap:
    """A bounded set of label values; overflow and odd values become ``other``.

    The first ``limit`` distinct values pass; later ones, and values that are not short
    plain names (``[A-Za-z0-9_.:/-]{1,64}``), become ``other``. Thread-safe.

    Args:
        limit: most distinct values kept.
    """

    def __init__(self, limit: int = MAX_ENGINES) -> None:
        self._limit = limit
        self._seen: set[str] = set()
        self._lock = threading.Lock()

    def __call__(self, value: str) -> str:
        """Return ``value`` if it is (or can become) one of the kept values, else ``other``."""
        if value in self._seen:
            return value
        if not _LABEL_OK.match(value):
            return OTHER
        with self._lock:
            if value in self._seen:
                return value
            if len(self._seen) >= self._limit:
                return OTHER
            self._seen.add(value)
            return value


@dataclass
class Histogram:
    """A cumulative histogram with fixed upper bounds.

    Attributes:
        bounds: bucket upper bounds in increasing order (``+Inf`` is implied).
        counts: observations per bucket (not cumulative); the last entry is the
            ``+Inf`` overflow bucket.
        total: number of observations.
        sum: sum of the observed values.
    """

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: int = 0
    sum: float = 0.0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        """Add one observation; negative, NaN and infinite values are ignored."""
        if not (value >= 0.0 and math.isfinite(value)):
            return
        # le semantics: a value equal to a bound falls in that bound's bucket.
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += 1
        self.sum += value

    def emit(self, batch: Batch, name: catalogue.HistogramName, **labels: str) -> None:
        """Add ``<name>_bucket`` (cumulative, with ``le``), ``_count`` and ``_sum`` samples."""
        bucket, count, total = catalogue.histogram_names(name)
        running = 0
        for bound, n in zip(self.bounds, self.counts, strict=False):
            running += n
            batch.add(bucket, running, le=_fmt_le(bound), **labels)
        batch.add(bucket, self.total, le="+Inf", **labels)
        batch.add(count, self.total, **labels)
        batch.add(total, self.sum, **labels)


def _fmt_le(bound: float) -> str:
    """Format a bucket bound the way Prometheus client libraries do (``0.5``, ``1.0``)."""
    return repr(float(bound))


class SampleSource(Protocol):
    """Anything that adds its own counters to the ``requests`` sampler's batch."""

    def add_samples(self, batch: Batch) -> None:
        """Add samples (counters of the source) to ``batch``."""


class RequestMetrics(Sampler):
    """The ``requests`` sampler: latency histograms and outcome counters from records.

    Emits ``kvpressure_request_latency_seconds{engine,phase}`` (phase = ttft, e2e, itl (one
    observation per inter-token gap), queue, prefill, decode; a phase is observed only
    when the record has it), ``kvpressure_requests_total{engine,outcome}``,
    ``kvpressure_request_tokens_total{engine,direction}`` (direction = input, output,
    cached; cached tokens are part of input), ``kvpressure_proxy_upstream_connect_seconds
    {engine}`` (records with a measured connect) and
    ``kvpressure_request_records_dropped_total{consumer}`` (the stream's per-consumer
    overflow), plus whatever the ``sources`` add.

    Args:
        stream: the request stream; this sampler subscribes as ``metrics``.
        sources: other request sources whose counters ride along (the OTLP receiver).
        interval_s: seconds between collections.
        max_engines: most distinct ``engine`` label values (later ones count as ``other``).
        drain_limit: most records folded in per cycle (the rest wait for the next cycle,
            bounded by the stream's queue).
    """

    name = "requests"

    def __init__(
        self,
        stream: RequestStream,
        sources: Sequence[SampleSource] = (),
        interval_s: float = 1.0,
        max_engines: int = MAX_ENGINES,
        drain_limit: int = 100_000,
    ) -> None:
        super().__init__(interval_s=interval_s)
        self._stream = stream
        stream.subscribe(CONSUMER)
        self._sources = list(sources)
        self._engines = LabelCap(max_engines)
        self._drain_limit = drain_limit
        self._lock = threading.Lock()
        self._latency: dict[tuple[str, str], Histogram] = {}
        self._connect: dict[str, Histogram] = {}
        self._outcomes: dict[tuple[str, str], int] = {}
        self._tokens: dict[tuple[str, str], int] = {}

    def observe(self, records: Iterable[RequestRecord]) -> None:
        """Fold ``records`` into the histograms and counters (also used by tests)."""
        with self._lock:
            for r in records:
                self._observe_one(r)

    def _hist(self, engine: str, phase: str) -> Histogram:
        key = (engine, phase)
        h = self._latency.get(key)
        if h is None:
            h = self._latency[key] = Histogram(LATENCY_BUCKETS_S)
        return h

    def _observe_one(self, r: RequestRecord) -> None:
        engine = self._engines(r.engine)
        outcome = r.outcome if r.outcome in OUTCOMES else OTHER
        self._outcomes[(engine, outcome)] = self._outcomes.get((engine, outcome), 0) + 1
        for phase, value in (
            ("ttft", r.ttft_s),
            ("e2e", r.e2e_s),
            ("queue", r.queue_s),
            ("prefill", r.prefill_s),
            ("decode", r.decode_s),
        ):
            if value is not None:
                self._hist(engine, phase).observe(value)
        if r.itl_s:
            h = self._hist(engine, "itl")
            for gap in r.itl_s:
                h.observe(gap)
        for direction, n in (
            ("input", r.input_tokens),
            ("output", r.output_tokens),
            ("cached", r.cached_tokens),
        ):
            if n is not None and n >= 0:
                self._tokens[(engine, direction)] = self._tokens.get((engine, direction), 0) + n
        if r.upstream_connect_s is not None:
            c = self._connect.get(engine)
            if c is None:
                c = self._connect[engine] = Histogram(CONNECT_BUCKETS_S)
            c.observe(r.upstream_connect_s)

    def collect(self, batch: Batch) -> None:
        """Drain this sampler's queue, update the aggregates and emit them all."""
        self.observe(self._stream.drain(CONSUMER, self._drain_limit))
        with self._lock:
            for (engine, phase), h in sorted(self._latency.items()):
                h.emit(batch, LATENCY_METRIC, engine=engine, phase=phase)
            for engine, h in sorted(self._connect.items()):
                h.emit(batch, CONNECT_METRIC, engine=engine)
            for (engine, outcome), n in sorted(self._outcomes.items()):
                batch.add(REQUESTS_METRIC, n, engine=engine, outcome=outcome)
            for (engine, direction), n in sorted(self._tokens.items()):
                batch.add(TOKENS_METRIC, n, engine=engine, direction=direction)
        for consumer, n in sorted(self._stream.dropped().items()):
            batch.add(DROPPED_METRIC, n, consumer=consumer)
        for source in self._sources:
            source.add_samples(batch)


@register(
    "requests",
    Stage.DERIVED,
    "request latency histograms, outcomes and tokens from the request stream",
)
def _plan(ctx: Context) -> list[Plan]:
    interval = ctx.interval_s("requests")
    return [Plan("requests", ("requests", interval),
                 lambda: RequestMetrics(ctx.requests, interval_s=interval))]  # fmt: skip
