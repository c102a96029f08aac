"""The one normalizer: engine metric families in, catalogue samples out.

Every engine is a declarative :class:`EngineMapping` (a tuple of :class:`Rule` rows plus
optional hooks), and this module is the only code that applies them. A rule says: the
catalogue metric ``canonical`` comes from the first of ``sources`` present in the scrape,
its label sets are combined per model with ``combine``, multiplied by ``scale``, and it is
a ``gauge`` or a reset-aware ``counter``.

Matching (cases 09, 13, 14):

* Sources are tried in priority order and the **first present wins**; older names are
  listed after newer ones, and two names are never summed (case 09: vLLM emitting both
  ``kv_cache_usage_perc`` and ``gpu_cache_usage_perc`` gives the new one's value).
* A name matches a sample name (``vllm:prompt_tokens_total``) or a family name
  (``llamacpp:n_busy_slots_per_decode``, whose sample ``prometheus_client`` renames to
  ``..._total`` because the engine declares it a counter).
* Write source names in their ``prefix:`` form; the ``prefix_`` spelling is tried right
  after it (case 14). When a scrape has both spellings the colon form is used and a
  duplicate-family warning is logged once. A renamed metric is a one-line change: put the
  new name first in ``sources``.

One fact once (issue 17, kind 1): :class:`MetricIndex` keeps a repeated series (same
name and labels, e.g. a family written twice) once, the last copy winning, and collapses
series that differ only by a per-process label (``pid``, ``prometheus_client``'s
multiprocess mode) by what the sample is: counters and histogram buckets are summed,
gauges take the live value (:func:`collapse_per_process`). Copies are never summed; both
are counted (``NormalizedScrape.merged``, exported as
``kvpressure_engine_series_merged_total{reason}``).

Values:

* Non-finite values are skipped; values outside ``Rule.valid`` are invalid: dropped (not
  clipped) and logged once (case 09: a KV ratio > 1).
* Counters are re-exported reset-aware, per raw series (:class:`CounterTracker`): the
  delta is ``cur`` when ``cur < prev`` (a reset) else ``cur - prev``, and the exported
  value is the first value seen plus the sum of deltas, so it equals the engine's value
  until the engine restarts and then keeps counting up, never down. A reset, or a change
  of ``process_start_time_seconds``, counts one restart (case 22).
* A rule declared ``counter`` whose source's name or HELP says average / mean / ratio /
  per-second / throughput is treated as a gauge: no reset logic, a drop is not a restart
  (case 12: llama.cpp's ``n_busy_slots_per_decode`` is an average typed ``counter``).
  Gauges never get reset logic.

Labels: output samples carry ``engine`` (the configured engine name), ``instance``
(``host:port``) and ``model`` when the engine says which (the first of
``EngineMapping.model_labels`` present on the sample, else the sampler's default model,
e.g. llama.cpp's ``/props`` alias), plus the rule's constant ``out_labels`` (``tier``,
``phase``, ...) and the source labels it keeps (``keep_labels``, renamed, e.g. vLLM's
``reason``). Every other engine label (vLLM's data-parallel ``engine`` index, ``mode``,
...) is combined away. At most ``max_models`` (32) distinct models are kept per engine: the
ones under the most pressure (KV usage, then running, then waiting requests); samples of
further models are dropped, counted (``NormalizedScrape.models_dropped``) and logged once
per change of the dropped set. A rule with ``per_model=False``
combines all models into one series without a ``model`` label.

Histograms (``kind="histogram"``): the rule's source is a histogram family; per raw
series the normalizer keeps a :class:`~agent.histograms.WindowedHistogram` of
its buckets (``le`` scaled by ``scale``, e.g. milliseconds to seconds), sums the window
deltas of the series that combine into one output group, and emits the windowed
quantiles ``Rule.quantiles`` as gauge samples with a ``percentile`` label (``p50``,
``p95``, ``p99``; not ``quantile``, which Prometheus reserves for summaries). Resets and
sparse windows are handled there (no quantile with fewer than ``min_count`` observations
in the window). Beside the quantiles, the number of observations in the window is emitted
(:func:`window_observations_name`, e.g. ``kvpressure_engine_latency_window_observations``),
also when it is below ``min_count``: an absent quantile then says why.

Aggregatable latency (issue 16, point 4): a rule with ``export`` (every :func:`latency`
rule) also re-exports its source as a cumulative Prometheus histogram,
``kvpressure_engine_request_latency_seconds{phase}``, in one bucket layout per phase whatever
the engine (:data:`PHASE_BUCKETS`, the OpenTelemetry GenAI advisory buckets). Each raw
series is re-bucketed conservatively (:func:`~agent.histograms.rebucket`: an
engine bucket whose bound is not a target bound counts in the next target bound above it,
beyond the last one in ``+Inf``), re-exported reset-aware
(:class:`~agent.histograms.CumulativeHistogram`) and summed per output group like
the windows, so ``histogram_quantile(q, sum by (le) (rate(..._bucket[5m])))`` combines
instances, engines and pods.

Counters the engine never increments for a model (:data:`TRAFFIC_COUNTERS` still 0 while
another of them moved for that model) are withheld, never exported as zero traffic (issue
17, kind 6).

Window ratios (:class:`WindowRatio`): a ratio of two of the mapping's own re-exported
counters over the last window (vLLM's prefix-cache hit ratio), emitted only where the
engine's own gauge for it is absent.

Cost (issue 15): what depends only on a scrape's structure is worked out once and kept,
per result shape (:attr:`~.exposition.ParseResult.shape`, from
:class:`~.exposition.Reparse`) and, for a body parsed whole, per rule while its samples
come with the very same read-only :class:`~.exposition.LabelSet` objects as last time
(histogram layouts and models, gauge and counter statics). :class:`MetricIndex` files a
family's samples at C speed and finds repeated series with one dict of keys; a sample is
handled one by one only when a per-process label is present.
"""

from __future__ import annotations

import abc
import bisect
import functools
import logging
import math
import operator
import re
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from itertools import groupby, repeat
from typing import Final, Literal, NamedTuple, cast

from kvpressure.agent.catalogue import HistogramName, SampleName, histogram_names
from kvpressure.agent.histograms import (
    DEFAULT_MIN_COUNT,
    DEFAULT_WINDOW_S,
    GENAI_REQUEST_DURATION_BOUNDS_S,
    GENAI_TPOT_BOUNDS_S,
    GENAI_TTFT_BOUNDS_S,
    CumulativeHistogram,
    HistogramSnapshot,
    WindowedHistogram,
    rebucket,
    sum_windows,
    window_quantile,
)
from kvpressure.agent.logs import RateLimitedLog
from kvpressure.agent.samplers.base import LogOnce
from kvpressure.agent.samplers.engines.exposition import (
    LabelSet,
    ParsedFamily,
    ParseResult,
    bucket_key,
    label_pairs,
    wanted_families,
)
from kvpressure.agent.samplers.engines.http import Fetch
from kvpressure.agent.samples import Batch, Sample, make_labels

log = logging.getLogger(__name__)

Combine = Literal["sum", "max", "pick"]
RuleKind = Literal["gauge", "counter", "histogram"]
LabelPairs = tuple[tuple[str, str], ...]

MAX_MODELS: Final = 32
"""Distinct ``model`` label values kept per engine in one scrape."""
MAX_LABEL_VALUES: Final = 64
"""Distinct values of ``model`` (and of each label kept from the engine, such as vLLM's
``reason`` or Triton's ``uuid``) admitted per engine within :data:`LABEL_WINDOW_S`."""
LABEL_WINDOW_S: Final = 900.0
"""Seconds a label value stays admitted after it was last seen: the timeline's own horizon
for forgetting a series (15 min), so a churning label holds at most
:data:`MAX_LABEL_VALUES` values' series per engine."""

NONNEGATIVE: Final = (0.0, math.inf)
RATIO: Final = (0.0, 1.0)
PROCESS_START_TIME: Final = "process_start_time_seconds"
QUANTILES: Final = (0.5, 0.95, 0.99)
"""Quantiles emitted for histogram rules."""
MAX_HISTOGRAM_SERIES: Final = 2048
"""Raw histogram series windowed per engine; further ones are ignored (logged once)."""

_GAUGE_HELP = re.compile(
    r"\b(average|avg|mean|ratio|percent(age)?|throughput|per[ -]second)\b|tokens/s\b",
    re.IGNORECASE,
)
_GAUGE_NAME_SUFFIXES: Final = (
    "_per_decode",
    "_per_second",
    "_tokens_seconds",
    "_ratio",
    "_perc",
    "_average",
    "_avg",
    "_mean",
)


@dataclass(frozen=True, slots=True)
class Rule:
    """One row of an engine mapping: where one catalogue metric comes from.

    Attributes:
        canonical: the catalogue metric name, e.g. ``kvpressure_engine_kv_cache_usage_ratio``.
        sources: engine metric names in priority order (newest first, ``prefix:`` form);
            the first one with a matching sample wins, the others are ignored. A source
            may carry its own label filter, ``name{label=value}`` (see
            :func:`parse_source`), e.g. ``vllm:prompt_tokens_cached_by_source{source=host}``.
        combine: how the samples of one model are combined: ``sum`` (e.g. across vLLM
            data-parallel ``engine`` ranks), ``max``, or ``pick`` (the first sample in
            label order, for values that should exist once).
        scale: factor applied to the combined value to reach the base unit
            (e.g. ``1e-3`` for milliseconds).
        kind: ``gauge`` or ``counter`` (re-exported reset-aware).
        labels: ``(name, value)`` pairs a sample must carry to be used, compared on the
            parsed, unescaped value (e.g. ``(("source", "local_compute"),)``). A value may
            list alternatives separated by ``|`` and may end in ``*`` (prefix match).
        valid: inclusive ``(low, high)`` range of a valid raw value; values outside are
            dropped and logged once. ``None`` accepts any finite value.
        out_labels: constant labels added to the output (``(("tier", "kv_host"),)``).
        keep_labels: ``(source label, output label)`` pairs copied from the source sample
            (e.g. vLLM's ``reason``); samples are grouped by them. A sample without the
            source label is skipped.
        per_model: False to combine every model into one series without ``model``.
        quantiles: for ``histogram`` rules, the quantiles emitted (label ``percentile``).
        min_count: for ``histogram`` rules, fewest observations in the window for a
            quantile.
        export: for ``histogram`` rules, the catalogue histogram the source is also
            re-exported as (cumulative, reset-aware, re-bucketed into ``buckets`` by
            :func:`~agent.histograms.rebucket`); empty for none.
        buckets: the finite upper bounds (seconds) of ``export``'s bucket layout.
    """

    canonical: SampleName
    sources: tuple[str, ...]
    combine: Combine = "sum"
    scale: float = 1.0
    kind: RuleKind = "gauge"
    labels: LabelPairs = ()
    valid: tuple[float, float] | None = NONNEGATIVE
    out_labels: LabelPairs = ()
    keep_labels: LabelPairs = ()
    per_model: bool = True
    quantiles: tuple[float, ...] = QUANTILES
    min_count: float = DEFAULT_MIN_COUNT
    export: HistogramName | Literal[""] = ""
    buckets: tuple[float, ...] = ()


ENGINE_LATENCY_HISTOGRAM: Final = "kvpressure_engine_request_latency_seconds"
"""The catalogue histogram every engine's latency is re-exported as, in one layout per
phase (:data:`PHASE_BUCKETS`)."""

PHASE_BUCKETS: Final[Mapping[str, tuple[float, ...]]] = {
    "ttft": GENAI_TTFT_BOUNDS_S,
    "itl": GENAI_TPOT_BOUNDS_S,
    "e2e": GENAI_REQUEST_DURATION_BOUNDS_S,
    "queue": GENAI_REQUEST_DURATION_BOUNDS_S,
    "prefill": GENAI_REQUEST_DURATION_BOUNDS_S,
    "decode": GENAI_REQUEST_DURATION_BOUNDS_S,
    "inference": GENAI_REQUEST_DURATION_BOUNDS_S,
    "batch_prefill": GENAI_REQUEST_DURATION_BOUNDS_S,
    "batch_decode": GENAI_REQUEST_DURATION_BOUNDS_S,
}
"""Bucket layout of :data:`ENGINE_LATENCY_HISTOGRAM` per ``phase``: the OpenTelemetry GenAI
advisory bounds of ``gen_ai.server.time_to_first_token`` (ttft),
``gen_ai.server.time_per_output_token`` (itl) and ``gen_ai.server.request.duration`` (every
other phase, whole-request stages and TGI's batch forward passes). The same for every
engine and instance, so ``sum by (le)`` across them is exact."""


def latency(phase: str, *sources: str, scale: float = 1.0, **labels: str) -> Rule:
    """A ``kvpressure_engine_latency_seconds`` histogram rule for one phase.

    Args:
        phase: ``ttft``, ``itl``, ``e2e``, ``queue``, ``prefill``, ``decode``,
            ``inference``, ``batch_prefill`` or ``batch_decode``.
        *sources: histogram family names, first present wins.
        scale: factor from the engine's ``le`` unit to seconds (``1e-3`` for ms).
        **labels: source label filter (see :attr:`Rule.labels`).

    Returns:
        The rule: windowed percentile gauges, and the source re-exported as
        :data:`ENGINE_LATENCY_HISTOGRAM` in the phase's :data:`PHASE_BUCKETS` layout.

    Raises:
        KeyError: ``phase`` has no bucket layout.
    """
    return Rule(
        "kvpressure_engine_latency_seconds",
        tuple(sources),
        scale=scale,
        kind="histogram",
        labels=tuple(labels.items()),
        out_labels=(("phase", phase),),
        export=ENGINE_LATENCY_HISTOGRAM,
        buckets=PHASE_BUCKETS[phase],
    )


@dataclass(frozen=True, slots=True)
class WindowRatio:
    """A ratio of two of the mapping's counters over the last window.

    Attributes:
        canonical: the catalogue gauge to emit (e.g. ``kvpressure_engine_prefix_cache_hit_ratio``).
        numerator: the catalogue counter on top (e.g. hit tokens).
        denominator: the catalogue counter below (e.g. queried tokens); no value when it
            did not increase in the window.
        window_s: window length in seconds.
    """

    canonical: SampleName
    numerator: SampleName
    denominator: SampleName
    window_s: float = DEFAULT_WINDOW_S


@dataclass(frozen=True, slots=True)
class Derived:
    """A value an engine module computes from the whole scrape (not a plain rename).

    Attributes:
        canonical: catalogue metric name.
        value: value in base units.
        model: the model it belongs to; ``None`` means "the scrape's only model, if
            there is exactly one, else the default model".
        labels: extra output labels (e.g. ``(("state", "total"),)``).
    """

    canonical: SampleName
    value: float
    model: str | None = None
    labels: LabelPairs = ()


class Series(NamedTuple):
    """One sample of the scrape, with its family (a named tuple: one is built per sample).

    Attributes:
        name: the sample name.
        labels: its labels.
        value: its value (never NaN).
        family: the family it belongs to (type and HELP as the engine declared them).
    """

    name: str
    labels: Mapping[str, str]
    value: float
    family: ParsedFamily


def name_variants(name: str) -> tuple[str, ...]:
    """Return the spellings tried for a source name, preferred first (case 14).

    Args:
        name: a source name such as ``sglang:num_requests_running``.

    Returns:
        ``(name, name with its first ":" replaced by "_")`` for a prefixed name, else
        ``(name,)``.
    """
    if ":" in name:
        return (name, name.replace(":", "_", 1))
    return (name,)


@functools.lru_cache(maxsize=4096)
def looks_like_gauge(name: str, help_text: str) -> bool:
    """Return True when a family typed ``counter`` is really an average or a rate.

    Answered once per name and HELP text (a bounded cache): the normalizer asks for every
    counter rule on every scrape.

    Args:
        name: the family or sample name (a ``_total`` suffix is ignored).
        help_text: the family's HELP text.

    Returns:
        True for names ending in ``_per_decode``, ``_per_second``, ``_tokens_seconds``,
        ``_ratio``, ``_perc``, ``_average``/``_avg``/``_mean``, or HELP mentioning
        average, mean, ratio, percent, throughput, per second or tokens/s (case 12).
    """
    base = name.removesuffix("_total").lower()
    if base.endswith(_GAUGE_NAME_SUFFIXES):
        return True
    return bool(_GAUGE_HELP.search(help_text))


PER_PROCESS_LABELS: Final = frozenset({"pid"})
"""Labels that only say which process wrote a sample (``prometheus_client``'s multiprocess
mode adds ``pid`` to gauges in ``all``/``liveall`` mode); series differing only by them are
one fact, collapsed by :func:`collapse_per_process`."""
_PER_PROCESS_ORDERED: Final = tuple(sorted(PER_PROCESS_LABELS))

_new_tuple: Final = tuple.__new__
_REPEAT_SERIES: Final = repeat(Series)
"""``map(tuple.__new__, _REPEAT_SERIES, rows)``: :class:`Series` built without the named
tuple's Python-level ``__new__``."""
_NAME: Final = operator.itemgetter(0)
_LABELS: Final = operator.itemgetter(1)
_VALUE: Final = operator.itemgetter(2)
_REPEAT_SAMPLE: Final = repeat(Sample)
_NAME_FAMILY: Final = operator.itemgetter(0, 3)
_PAIRS: Final = operator.attrgetter("pairs")
_BUCKET: Final = operator.attrgetter("bucket")
_LE: Final = operator.itemgetter(1)


def _same_objects(a: list[Mapping[str, str]], b: list[Mapping[str, str]]) -> bool:
    """True when ``a`` and ``b`` hold the very same objects in the same order."""
    return len(a) == len(b) and all(map(operator.is_, a, b))


def _read_only(labels: list[Mapping[str, str]]) -> bool:
    """True when every label set is the fast parser's shared, read-only :class:`LabelSet`."""
    return not labels or set(map(type, labels)) == {LabelSet}


def _per_process(families: list[ParsedFamily]) -> bool:
    """True when a sample carries a per-process label (:data:`PER_PROCESS_LABELS`).

    Asked of every label set at C speed: only then does :class:`MetricIndex` take its
    sample-by-sample path.
    """
    for fam in families:
        labels = list(map(_LABELS, fam.samples))
        for k in _PER_PROCESS_ORDERED:
            if any(map(operator.contains, labels, repeat(k))):
                return True
    return False


MERGE_DUPLICATE: Final = "duplicate"
MERGE_PER_PROCESS: Final = "per_process"


def is_additive(name: str, family: ParsedFamily) -> bool:
    """Return True when copies of sample ``name`` from several processes add up.

    Counters (not averages, see :func:`looks_like_gauge`) and the ``_bucket``/``_count``/
    ``_sum`` samples of histograms and summaries are additive; gauges, info and
    ``_created`` samples are not. An ``unknown``/``untyped`` family is judged by the
    sample's suffix (``_total``, ``_bucket``, ``_count``, ``_sum``).

    Args:
        name: the sample name.
        family: the family the sample came in (type and HELP as the engine declared them).
    """
    if name.endswith("_created") or family.type in ("gauge", "info", "stateset"):
        return False
    if family.type in ("histogram", "summary", "gaugehistogram"):
        return True
    if family.type == "counter" or name.endswith("_total"):
        return not looks_like_gauge(name, family.help)
    return family.type in ("untyped", "unknown") and name.endswith(("_bucket", "_count", "_sum"))


def collapse_per_process(name: str, family: ParsedFamily, values: list[float]) -> float:
    """Collapse the per-process copies of one series into its one value.

    Rule: additive samples (:func:`is_additive`: counters, histogram buckets, counts and
    sums) are the **sum** of the processes' values, since each process counted its own
    events. Anything else (a gauge) is one fact that several processes hold a copy of, so
    never a sum: its **live value** is the largest non-zero copy, and 0 only when every
    copy is 0. Why non-zero: ``prometheus_client``'s multiprocess files hold 0 for every
    process that declared the gauge but never set it (the API servers beside the one
    engine core that does), so the non-zero row is the one that is being written. Why the
    largest when several are non-zero: the exposition carries no timestamps, so the most
    recent copy cannot be told apart, and for a pressure signal the conservative reading
    is the highest (a dead process's stale copy lasts only until the client marks it dead).
    ``_created`` samples take the earliest.

    Args:
        name: the sample name.
        family: its family.
        values: the copies' values (at least one).

    Returns:
        The one value; non-finite copies are ignored unless all are.
    """
    finite = [v for v in values if math.isfinite(v)] or values[:1]
    if name.endswith("_created"):
        return min(finite)
    if is_additive(name, family):
        return math.fsum(finite)
    nonzero = [v for v in finite if v != 0]
    return max(nonzero) if nonzero else finite[0]


class MetricIndex:
    """The scrape's samples, looked up by sample name or by family name.

    Every series is one fact, kept once (kind 1 of issue 17):

    * a **repeated series** (same sample name and labels, e.g. a family written twice with
      its ``# TYPE`` repeated) is kept once, the last copy winning; the dropped copies are
      counted in :attr:`duplicates`;
    * series that differ only by a per-process label (:data:`PER_PROCESS_LABELS`) are
      collapsed into one series without that label by :func:`collapse_per_process`
      (counters summed, gauges take the live value); the rows folded away are counted in
      :attr:`collapsed`.

    Args:
        families: parsed families (see :mod:`agent.samplers.engines.exposition`).
        plain: the caller knows the families repeat no series and carry no per-process
            label (:attr:`plain` of an index of the same structure): neither is looked for.

    Attributes:
        duplicates: repeated samples dropped (copies beyond the one kept).
        collapsed: per-process rows folded into another row.
        family_names: family names in body order.
    """

    def __init__(self, families: Iterable[ParsedFamily], plain: bool = False) -> None:
        self._by_sample: dict[str, list[Series]] = {}
        self._by_family: dict[str, list[Series]] = {}
        self.family_names: list[str] = []
        self.duplicates = 0
        self.collapsed = 0
        self.plain = True
        """No repeated series and no per-process label: each sample filed as it came."""
        if not isinstance(families, list):
            families = list(families)
        if plain or not _per_process(families):
            self._file(families, check=not plain)
            return
        latest: dict[tuple[str, LabelPairs], Series] = {}
        per_process = False
        size = 0
        for fam in families:  # a per-process label: the general path, sample by sample
            self.family_names.append(fam.name)
            # each sample is filed under its names as it comes (one list per name and
            # family, looked up once); a repeated or per-process series files all again
            routes: dict[str, tuple[list[Series], list[Series] | None]] = {}
            for s in fam.samples:
                name, labels, value, _ = s
                # a LabelSet from the fast parser carries its sorted pairs (one per text)
                pairs = label_pairs(labels)
                key = (name, pairs)
                series = latest[key] = Series(name, labels, value, fam)
                if len(latest) == size:
                    # a repeated series: the last copy wins, in the last copy's place
                    self.duplicates += 1
                    del latest[key]
                    latest[key] = series
                else:
                    size += 1
                route = routes.get(name)
                if route is None:
                    route = routes[name] = self._route(name, fam)
                route[0].append(series)
                if route[1] is not None:
                    route[1].append(series)
                if not per_process:
                    for k in _PER_PROCESS_ORDERED:  # a key lookup per label: no generator
                        if k in labels:
                            per_process = True
        if not per_process and not self.duplicates:  # the common case: filed already
            return
        self.plain = False
        self._by_sample.clear()
        self._by_family.clear()
        if not per_process:
            for series in latest.values():
                self._add(series)
            return
        groups: dict[tuple[str, LabelPairs], list[Series]] = {}
        for (name, pairs), series in latest.items():
            kept = tuple([p for p in pairs if p[0] not in PER_PROCESS_LABELS])
            groups.setdefault((name, kept), []).append(series)
        for (name, pairs), copies in groups.items():
            one = copies[-1]
            if len(copies) > 1 or len(pairs) != len(one.labels):
                self.collapsed += len(copies) - 1
                value = collapse_per_process(name, one.family, [c.value for c in copies])
                one = Series(name, dict(pairs), value, one.family)
            self._add(one)

    def _file(self, families: list[ParsedFamily], check: bool) -> None:
        """File the samples of families that carry no per-process label.

        Each family's samples are built into :class:`Series` at C speed; with ``check``, a
        repeated series (same name and sorted label pairs) keeps only its last copy, in
        that copy's place (:attr:`duplicates`), as the sample-by-sample path does. The kept
        series are filed a run of one name (and family) at a time.
        """
        built: list[Series] = []
        keys: list[tuple[str, LabelPairs]] = []
        for fam in families:
            self.family_names.append(fam.name)
            samples = fam.samples
            if not samples:
                continue
            names = list(map(_NAME, samples))
            labels = list(map(_LABELS, samples))
            rows = zip(names, labels, map(_VALUE, samples), repeat(fam))
            built.extend(map(_new_tuple, _REPEAT_SERIES, rows))
            if check:
                pairs = map(_PAIRS, labels) if _read_only(labels) else map(label_pairs, labels)
                keys.extend(zip(names, pairs, strict=True))
        kept: Iterable[Series] = built
        if check:
            last = dict(zip(keys, range(len(keys)), strict=True))  # a key's last position
            if len(last) != len(keys):
                self.duplicates = len(keys) - len(last)
                self.plain = False
                kept = map(built.__getitem__, sorted(last.values()))
        for (name, fam), run in groupby(kept, _NAME_FAMILY):
            by_sample, by_family = self._route(name, fam)
            if by_family is None:
                by_sample.extend(run)
            else:
                got = list(run)
                by_sample.extend(got)
                by_family.extend(got)

    def _add(self, series: Series) -> None:
        by_sample, by_family = self._route(series.name, series.family)
        by_sample.append(series)
        if by_family is not None:
            by_family.append(series)

    def _route(self, name: str, fam: ParsedFamily) -> tuple[list[Series], list[Series] | None]:
        """The lists a sample ``name`` of ``fam`` is filed in: by name, and by family."""
        by_family = None
        if fam.type in ("counter", "gauge", "untyped", "unknown") and name.endswith("_total"):
            # a counter's samples are found under the name without ``_total`` too,
            # whether the family was declared with it (text format) or without
            # (OpenMetrics, or a text body that split it into an unknown family)
            by_family = self._by_family.setdefault(name[: -len("_total")], [])
        return self._by_sample.setdefault(name, []), by_family

    def exact(self, name: str) -> list[Series]:
        """Samples named ``name``, else samples of the family ``name``; exact spelling only."""
        return self._by_sample.get(name) or self._by_family.get(name) or []

    def find(self, name: str) -> tuple[str, list[Series], bool]:
        """Look ``name`` up in each of its :func:`name_variants`.

        Returns:
            ``(spelling used, samples, duplicate)``: the first spelling with samples,
            its samples (empty when none matched) and whether a later spelling was
            present too (both ``sglang:`` and ``sglang_`` in one scrape).
        """
        found: tuple[str, list[Series]] | None = None
        duplicate = False
        for variant in name_variants(name):
            got = self.exact(variant)
            if not got:
                continue
            if found is None:
                found = (variant, got)
            else:
                duplicate = True
        if found is None:
            return name, [], False
        return found[0], found[1], duplicate

    def value(self, name: str) -> float | None:
        """The largest finite value of ``name`` (any spelling), or ``None`` when absent."""
        values = [s.value for s in self.find(name)[1] if math.isfinite(s.value)]
        return max(values) if values else None

    def histogram(self, name: str) -> tuple[str, list[Series], list[Series], bool]:
        """Look up the histogram family ``name`` (any spelling) by its sample names.

        Matching on ``<name>_bucket``/``<name>_sum`` sample names works whatever the
        family was typed as (a missing ``# TYPE`` line included).

        Returns:
            ``(spelling used, bucket samples, sum samples, duplicate)``; empty lists when
            there is no bucket sample.
        """
        used, buckets, duplicate = self.find(name + "_bucket")
        if not buckets:
            return name, [], [], False
        base = used.removesuffix("_bucket")
        return base, buckets, self.exact(base + "_sum"), duplicate


@dataclass(slots=True)
class CounterUpdate:
    """What :meth:`CounterTracker.update` saw.

    Attributes:
        value: the reset-aware value to export (first value seen + sum of deltas).
        delta: the increase since the previous scrape; ``None`` on the first sighting.
        reset: True when the raw value went down (or a restart was forced).
    """

    value: float
    delta: float | None
    reset: bool


@dataclass(slots=True)
class _CounterState:
    prev: float
    total: float
    seen: int


class CounterTracker:
    """Per-series state that turns raw engine counters into reset-aware ones (case 22).

    ``delta = cur if cur < prev else cur - prev`` (Prometheus reset semantics, never
    negative) and the exported value is ``first + sum(deltas)``. Series not seen for
    ``ttl_scrapes`` scrapes are forgotten; beyond ``max_series`` tracked series new ones
    are exported raw (not reset-aware) and logged once.

    Args:
        max_series: the most series tracked at once.
        ttl_scrapes: scrapes after which an unseen series is forgotten.
    """

    def __init__(self, max_series: int = 4096, ttl_scrapes: int = 600) -> None:
        self._state: dict[tuple[str, tuple[tuple[str, str], ...]], _CounterState] = {}
        self._max_series = max_series
        self._ttl = ttl_scrapes
        self._scrape = 0
        self._log = LogOnce(log)

    def begin(self) -> None:
        """Start a new scrape (advances the clock used for forgetting series)."""
        self._scrape += 1
        if self._scrape % 64 == 0:
            cutoff = self._scrape - self._ttl
            for key in [k for k, st in self._state.items() if st.seen < cutoff]:
                del self._state[key]

    def update(
        self,
        key: tuple[str, tuple[tuple[str, str], ...]],
        cur: float,
        force_reset: bool = False,
    ) -> CounterUpdate:
        """Feed the raw value ``cur`` of series ``key``.

        Args:
            key: ``(canonical name, sorted raw label pairs)``.
            cur: the engine's raw counter value (finite, >= 0).
            force_reset: treat this sample as the first after a restart (the engine's
                ``process_start_time_seconds`` changed): delta = ``cur``.

        Returns:
            The :class:`CounterUpdate`.
        """
        st = self._state.get(key)
        if st is None:
            if len(self._state) >= self._max_series:
                self._log(
                    "cap",
                    logging.WARNING,
                    "counter tracker full (%d series); exporting further counters raw",
                    self._max_series,
                )
                return CounterUpdate(cur, None, False)
            self._state[key] = _CounterState(cur, cur, self._scrape)
            return CounterUpdate(cur, None, False)
        reset = force_reset or cur < st.prev
        delta = cur if reset else cur - st.prev
        st.total += delta
        st.prev = cur
        st.seen = self._scrape
        return CounterUpdate(st.total, delta, reset)


class ValueWindowCap:
    """At most ``limit`` distinct values admitted within a sliding window; new ones refused.

    A value is admitted while fewer than ``limit`` values were seen in the last
    ``window_s`` seconds; an admitted value stays admitted for ``window_s`` after it was
    last seen. Unlike an LRU, a full cap refuses the *new* value instead of evicting an old
    one, so a label whose values churn every scrape cannot push out the steady ones (or
    make every scrape a new set of series). Memory: at most ``limit`` entries.

    Args:
        limit: distinct values admitted at once (at least 1).
        window_s: seconds an admitted value is remembered after it was last seen.
    """

    def __init__(self, limit: int, window_s: float) -> None:
        self.limit = max(1, limit)
        self.window_s = window_s
        self._seen: OrderedDict[str, float] = OrderedDict()  # value -> last seen, oldest first

    def admit(self, value: str, now: float) -> bool:
        """Admit ``value`` seen at ``now`` (monotonic seconds); False when the cap is full."""
        if value in self._seen:
            self._seen[value] = now
            self._seen.move_to_end(value)
            return True
        horizon = now - self.window_s
        while self._seen and next(iter(self._seen.values())) < horizon:
            self._seen.popitem(last=False)
        if len(self._seen) >= self.limit:
            return False
        self._seen[value] = now
        return True

    def __contains__(self, value: object) -> bool:
        return value in self._seen

    def __len__(self) -> int:
        return len(self._seen)


@dataclass(slots=True)
class NormalizedScrape:
    """The normalizer's output for one scrape.

    Attributes:
        samples: catalogue samples with ``engine``, ``instance`` and ``model`` labels.
        models: the models admitted in this scrape (sorted).
        emitted: ``(canonical, model)`` pairs present in ``samples``.
        emitted_labels: the same pairs, by the extra output labels they were emitted with.
        missing: canonical names none of whose sources were in the scrape.
        invalid: canonical names whose source had a value outside ``Rule.valid``.
        restarted: True when a counter reset or ``process_start_time_seconds`` changed.
        merged: exposition samples folded into another this scrape, by reason
            (``duplicate``: a repeated series; ``per_process``: a row differing only by
            ``pid``); see :class:`MetricIndex`.
        models_dropped: models over ``max_models`` whose samples were dropped this scrape.
        label_values_dropped: label name -> distinct values of it refused this scrape by
            the per-engine cap over a window (:data:`MAX_LABEL_VALUES` within
            :data:`LABEL_WINDOW_S`), their samples dropped.
        withheld: per-model traffic counters (:data:`TRAFFIC_COUNTERS`) not exported this
            scrape because they stay 0 for a model whose other traffic counters moved.
    """

    samples: list[Sample] = field(default_factory=list)
    models: list[str] = field(default_factory=list)
    emitted: set[tuple[str, str | None]] = field(default_factory=set)
    emitted_labels: dict[LabelPairs, set[tuple[str, str | None]]] = field(default_factory=dict)
    missing: list[str] = field(default_factory=list)
    invalid: list[str] = field(default_factory=list)
    restarted: bool = False
    merged: dict[str, int] = field(default_factory=dict)
    models_dropped: int = 0
    label_values_dropped: dict[str, int] = field(default_factory=dict)
    withheld: int = 0

    def has(self, canonical: str, model: str | None = None) -> bool:
        """True when ``canonical`` was emitted for ``model`` (any model when ``None``)."""
        if model is None:
            return any(c == canonical for c, _ in self.emitted)
        return (canonical, model) in self.emitted


@dataclass(slots=True)
class AddonContext:
    """What an :class:`EngineAddon` gets each cycle.

    Attributes:
        engine: the configured engine name (the ``engine`` label).
        instance: ``host:port`` (the ``instance`` label).
        batch: the batch being filled.
        fetch: GET a path on the engine's base URL (never raises; see
            :class:`agent.samplers.engines.http.HttpResult`).
    """

    engine: str
    instance: str
    batch: Batch
    fetch: Fetch
    admits: Callable[[str | None], bool] = lambda _model: True
    """Whether a model may get series (the normalizer's :meth:`Normalizer.admits`)."""

    def add(self, name: SampleName, value: float | None, model: str | None, **labels: str) -> None:
        """Add a catalogue sample with this engine's labels (none for a refused model)."""
        if not self.admits(model):
            return
        self.batch.add(
            name, value, engine=self.engine, instance=self.instance, model=model, **labels
        )


class EngineAddon(abc.ABC):
    """Engine-specific extra endpoints next to ``/metrics`` (llama.cpp ``/slots``, ``/props``).

    One instance per sampler; it may keep state between cycles. Both hooks run only when
    the metrics endpoint answered with a usable, non-empty exposition.
    """

    @abc.abstractmethod
    def before(self, ctx: AddonContext) -> str | None:
        """Run before normalization.

        Returns:
            The default ``model`` label for samples that carry no model label, or ``None``.
        """

    @abc.abstractmethod
    def after(self, ctx: AddonContext, scrape: NormalizedScrape) -> bool:
        """Run after normalization; add derived samples to ``ctx.batch``.

        Returns:
            True when the add-on's KV source failed this cycle (so missing KV usage is an
            error, not "not exported by the engine").
        """


@dataclass(frozen=True, slots=True)
class EngineMapping:
    """Everything engine-specific about one engine type, as data.

    Attributes:
        engine_type: one of ``vllm``, ``sglang``, ``llamacpp``, ``tgi``, ``trtllm``,
            ``triton`` (engines), or ``lmcache``, ``kvbm`` (KV tier sources).
        prefixes: metric-name prefixes that identify the engine in auto-detection.
        rules: the :class:`Rule` rows; empty for engines whose mapping has not landed.
        model_labels: raw label names that carry the model, in priority order.
        metrics_path: the exposition path on the engine's base URL.
        derive: optional function computing :class:`Derived` values from the whole scrape
            (e.g. vLLM's KV capacity from ``cache_config_info`` labels).
        addon: optional factory of an :class:`EngineAddon` for extra endpoints.
        implemented: False while only detection exists (the sampler then emits only
            ``kvpressure_engine_up`` and ``kvpressure_engine_info``).
        ratios: :class:`WindowRatio` rows computed from the rules' counters.
        reports_kv: False for KV-tier sources (LMCache, KVBM), which never report the
            device KV cache: no ``kv_cache`` source status is recorded for them.
        derive_sources: the families ``derive`` reads (``MetricIndex.find`` names), so a
            sampler can skip every family neither the rules nor ``derive`` read
            (:meth:`reads`).
    """

    engine_type: str
    prefixes: tuple[str, ...]
    rules: tuple[Rule, ...] = ()
    model_labels: tuple[str, ...] = ("model_name", "model", "name")
    metrics_path: str = "/metrics"
    derive: Callable[[MetricIndex], Iterable[Derived]] | None = None
    addon: Callable[[], EngineAddon] | None = None
    implemented: bool = True
    ratios: tuple[WindowRatio, ...] = ()
    reports_kv: bool = True
    derive_sources: tuple[str, ...] = ()

    def reads(self) -> frozenset[str]:
        """The family names a scrape must keep for this mapping (the rest can be skipped).

        Returns:
            :func:`~agent.samplers.engines.exposition.wanted_families` of every rule
            source (label filters cut), :attr:`derive_sources` and
            ``process_start_time_seconds`` (restart detection).
        """
        names = [parse_source(src)[0] for rule in self.rules for src in rule.sources]
        return wanted_families([*names, *self.derive_sources, PROCESS_START_TIME])


_BASE_LABELS: Final = frozenset({"engine", "instance", "model"})
_LABEL_SETS_KEPT: Final = 16384
"""Output label sets a normalizer keeps built (cleared when full)."""

GroupKey = tuple[SampleName, str | None, LabelPairs]
"""``(canonical, model, extra output labels)``: one output series."""


@dataclass(slots=True)
class _Pending:
    canonical: SampleName
    combine: Combine
    scale: float
    model: str | None
    extra: LabelPairs
    value: float
    order: LabelPairs


_RawSeries = tuple[LabelPairs, list[int], list[float], tuple[LabelPairs, str | None] | None]
"""One raw histogram series of a scrape: its key (sorted pairs less ``le``), its buckets'
positions, their bounds (scaled), and its (extra output labels, model), None when a kept
label is missing."""
_Layout = tuple[list[_RawSeries], list[LabelPairs], set[str]]
"""A histogram rule's series in body order, its ``_sum`` samples' keys, its models."""

_Static = tuple[LabelPairs, LabelPairs, tuple[str, LabelPairs], str | None]
"""Per series of a gauge or counter rule: extra output labels, sorted raw pairs, counter
key, model."""


@dataclass(slots=True)
class _ShapeCache:
    """What :meth:`Normalizer.normalize` derived from the structure of one result shape.

    Everything here depends on the families' names, types, HELP and label sets, never on a
    value, so it holds for every result of :attr:`ParseResult.shape` ``shape`` (with the
    same default model); per-scrape values are read afresh. Entries are filled on the first
    scrape of a shape and read on the next ones, keyed by the rule's index in the mapping.
    """

    shape: object
    default_model: str | None
    plain: bool
    resolved: dict[int, tuple[str, str, tuple[int, ...] | None] | None] = field(
        default_factory=dict
    )
    """Gauge or counter rule -> (source used, index key, positions of the matching samples
    in that key's list, or None for all of them); None: no source present."""
    hist_resolved: dict[int, tuple[str, str, tuple[int, ...] | None, tuple[int, ...] | None]] = (
        field(default_factory=dict)
    )
    """Histogram rule -> (base name used, bucket index key, bucket positions, ``_sum``
    positions), absent from the dict when no source is present."""
    statics: dict[int, list[_Static | None]] = field(default_factory=dict)
    """Gauge or counter rule -> per resolved series, :data:`_Static` (None: a kept label
    missing, the series is skipped)."""
    layouts: dict[int, _Layout] = field(default_factory=dict)
    """Histogram rule -> (per raw series in body order: its key, its buckets' positions,
    bounds (scaled) and (extra labels, model) or None; the ``_sum`` samples' keys; the
    models of its buckets)."""


class Normalizer:
    """Applies one :class:`EngineMapping` to successive scrapes of one endpoint.

    Stateful: it holds the counter tracker, the histogram windows, the last
    ``process_start_time_seconds``, the admitted models and the restart count, so use one
    instance per endpoint.

    Args:
        mapping: the engine's mapping.
        engine: the ``engine`` label value (the configured engine name).
        instance: the ``instance`` label value (``host:port``).
        max_models: distinct models kept in one scrape (the ones under the most pressure;
            further ones are dropped, counted and logged once per change).
        clock: monotonic clock in seconds (histogram and ratio windows).
        window_s: length of the histogram quantile windows in seconds.
        max_label_values: distinct values of ``model`` and of each label kept from the
            engine admitted within ``label_window_s`` (:class:`ValueWindowCap`); samples
            with a further value are dropped and counted in
            :attr:`NormalizedScrape.label_values_dropped`, so a label that churns (a new
            model name every scrape) keeps memory and series bounded.
        label_window_s: seconds a value stays admitted after it was last seen.
    """

    def __init__(
        self,
        mapping: EngineMapping,
        engine: str,
        instance: str,
        max_models: int = MAX_MODELS,
        clock: Callable[[], float] = time.monotonic,
        window_s: float = DEFAULT_WINDOW_S,
        max_label_values: int = MAX_LABEL_VALUES,
        label_window_s: float = LABEL_WINDOW_S,
    ) -> None:
        self.mapping = mapping
        self.engine = engine
        self.instance = instance
        self.max_models = max_models
        self.restarts = 0
        """Restarts seen so far (counter resets or a new process start time)."""
        self.tracker = CounterTracker()
        self.clock = clock
        self.window_s = window_s
        self._start_time: float | None = None
        self._models: dict[str, int] = {}
        self._dropped: frozenset[str] = frozenset()
        self._scrape = 0
        self._hist: dict[tuple[str, LabelPairs, LabelPairs], tuple[WindowedHistogram, int]] = {}
        self._cumulative: dict[tuple[str, LabelPairs, LabelPairs], CumulativeHistogram] = {}
        self._ratios: dict[tuple[str, str | None], deque[tuple[float, float, float]]] = {}
        self._log = LogOnce(log)
        self._warn = RateLimitedLog(log, 60.0)
        # Per-engine caps on distinct label values over a window: ``model`` and each label
        # kept from the engine's own series (the rules' keep_labels destinations).
        kept = {dst for rule in mapping.rules for _, dst in rule.keep_labels}
        self._label_caps = {
            name: ValueWindowCap(max_label_values, label_window_s)
            for name in sorted({"model", *kept})
        }
        self._refused: dict[str, set[str]] = {}
        self._now = 0.0
        self._label_sets: dict[tuple[str | None, LabelPairs], tuple[tuple[str, str], ...]] = {}
        self._bucket_sets: dict[
            tuple[str | None, LabelPairs, tuple[float, ...]],
            tuple[tuple[tuple[tuple[str, str], ...], ...], tuple[LabelPairs, ...]],
        ] = {}
        # what the last result's structure gave, for results of the same shape
        self._cache: _ShapeCache | None = None
        # per histogram rule: (default model, bucket and _sum label sets, layout) of the last
        # scrape whose label sets were all read-only (Normalizer._layout)
        self._layouts: dict[
            int, tuple[str | None, list[Mapping[str, str]], list[Mapping[str, str]], _Layout]
        ] = {}
        # the same for a gauge or counter rule's statics: (source used, default model, label
        # sets, statics) (Normalizer._values)
        self._statics: dict[
            int, tuple[str, str | None, list[Mapping[str, str]], list[_Static | None]]
        ] = {}

    @property
    def capped_labels(self) -> tuple[str, ...]:
        """The labels whose distinct values are capped per window (``model`` and kept ones)."""
        return tuple(self._label_caps)

    def admits(self, model: str | None) -> bool:
        """True for no model or a model admitted by the label cap (for add-on samples)."""
        return model is None or model in self._label_caps["model"]

    def normalize(
        self,
        result: ParseResult,
        default_model: str | None = None,
        now: float | None = None,
    ) -> NormalizedScrape:
        """Map one parsed scrape to catalogue samples.

        Args:
            result: the parsed exposition (only its families are read).
            default_model: the model for samples without a model label (llama.cpp's
                ``/props`` ``model_alias``), or ``None``.
            now: monotonic time of the scrape in seconds (default: the clock).

        Returns:
            The :class:`NormalizedScrape`. Never raises on engine data.
        """
        t = self.clock() if now is None else now
        self._now = t
        self._refused = {}
        self._scrape += 1
        self.tracker.begin()
        out = NormalizedScrape()
        shape, cache = result.shape, self._cache
        if cache is not None and (cache.shape is not shape or cache.default_model != default_model):
            cache = None  # another structure (or none known): derived afresh below
        index = MetricIndex(result.families, plain=cache is not None and cache.plain)
        if cache is None:
            cache = self._cache = (
                None if shape is None else _ShapeCache(shape, default_model, index.plain)
            )
        out.merged = {MERGE_DUPLICATE: index.duplicates, MERGE_PER_PROCESS: index.collapsed}
        self._log_merges(index)

        start = index.value(PROCESS_START_TIME)
        force_reset = (
            start is not None
            and self._start_time is not None
            and abs(start - self._start_time) > 1e-3
        )
        if start is not None:
            self._start_time = start
        restarted = force_reset

        pending: list[_Pending] = []
        histograms: list[tuple[Rule, str, list[Series], list[float], _Layout]] = []
        for i, rule in enumerate(self.mapping.rules):
            if rule.kind == "histogram":
                used, buckets, sums = self._resolve_histogram(index, rule, i, cache)
                if buckets:
                    values = list(map(_VALUE, buckets))
                    layout = self._layout(rule, i, buckets, sums, default_model, values, cache)
                    histograms.append((rule, used, sums, values, layout))
                else:
                    out.missing.append(rule.canonical)
                continue
            used, series = self._resolve(index, rule, i, cache)
            if not series:
                out.missing.append(rule.canonical)
                continue
            pending_rule, reset = self._values(
                rule, used, series, default_model, force_reset, out, i, cache
            )
            pending.extend(pending_rule)
            restarted = restarted or reset

        present = {p.model for p in pending if p.model is not None}
        for _, _, _, _, layout in histograms:
            present |= layout[2]  # empty for a rule that is not per model
        admitted = self._admit(present, pending, out)
        groups: dict[GroupKey, list[_Pending]] = {}
        for p in pending:
            if p.model is not None and p.model not in admitted:
                continue
            groups.setdefault((p.canonical, p.model, p.extra), []).append(p)
        combined = {key: _combine(items) for key, items in groups.items()}
        served = {m for (c, m, _), v in combined.items() if c in TRAFFIC_COUNTERS and v > 0}
        for (canonical, model, extra), value in combined.items():
            if canonical in TRAFFIC_COUNTERS and value == 0 and model in served:
                # the model served requests by its other counters, yet this one never moved:
                # the engine does not count it at this level; absent, not "zero traffic"
                out.withheld += 1
                self._log(
                    f"withheld:{canonical}:{model}",
                    logging.INFO,
                    "%s (%s): %s stays 0 for model %r while its other traffic counters move; "
                    "the engine does not count it per model: not exported",
                    self.engine,
                    self.instance,
                    canonical,
                    model,
                )
                continue
            self._emit(out, canonical, model, value, extra)

        for rule, used, sums, values, layout in histograms:
            restarted = self._histogram(out, rule, used, sums, values, layout, admitted, t) or (
                restarted
            )

        if self.mapping.derive is not None:
            self._derive(index, out, admitted, default_model)
        self._window_ratios(out, t)

        out.models = sorted(admitted)
        out.label_values_dropped = {k: len(v) for k, v in sorted(self._refused.items())}
        if self._refused:
            self._warn(
                f"label-cap:{','.join(sorted(self._refused))}",
                logging.WARNING,
                "%s (%s): more than %d distinct values of %s within %.0f s; samples with "
                "further values dropped (e.g. %s)",
                self.engine,
                self.instance,
                self._label_caps["model"].limit,
                "/".join(sorted(self._refused)),
                self._label_caps["model"].window_s,
                ", ".join(repr(v[:64]) for vs in self._refused.values() for v in sorted(vs)[:3]),
            )
        if restarted:
            self.restarts += 1
            out.restarted = True
        return out

    # -- gauges and counters -----------------------------------------------------------------

    def _values(
        self,
        rule: Rule,
        used: str,
        series: list[Series],
        default_model: str | None,
        force_reset: bool,
        out: NormalizedScrape,
        index: int = -1,
        cache: _ShapeCache | None = None,
    ) -> tuple[list[_Pending], bool]:
        statics = cache.statics.get(index) if cache is not None else None
        labels: list[Mapping[str, str]] | None = None
        if statics is None:
            # without a shape: kept per rule while the series come with the very same
            # read-only label sets as last time (and the same source and default model)
            labels = list(map(_LABELS, series))
            seen = self._statics.get(index)
            if (
                seen is not None
                and seen[0] == used
                and seen[1] == default_model
                and _same_objects(seen[2], labels)
            ):
                statics = seen[3]
                if cache is not None:
                    cache.statics[index] = statics
        if statics is None:
            # per series, what its labels alone give (the same for every scrape of a shape)
            statics = []
            for s in series:
                extra = _extra_labels(rule, s.labels)
                if extra is None:
                    statics.append(None)
                    continue
                order = label_pairs(s.labels)
                model = self._model_of(s.labels, default_model) if rule.per_model else None
                statics.append((extra, order, (rule.canonical + "|" + used, order), model))
            if cache is not None:
                cache.statics[index] = statics
            if labels is not None and _read_only(labels):
                self._statics[index] = (used, default_model, labels, statics)
            else:
                self._statics.pop(index, None)
        kind = rule.kind
        if kind == "counter" and looks_like_gauge(used, series[0].family.help):
            kind = "gauge"
            self._log(
                f"avg:{used}",
                logging.DEBUG,
                "%s: %s is typed counter but reads as an average/rate; treated as a gauge",
                self.engine,
                used,
            )
        pending: list[_Pending] = []
        restarted = False
        for s, static in zip(series, statics, strict=True):
            value = s.value
            if not math.isfinite(value):
                continue
            if rule.valid is not None and not rule.valid[0] <= value <= rule.valid[1]:
                if rule.canonical not in out.invalid:
                    out.invalid.append(rule.canonical)
                self._log(
                    f"invalid:{rule.canonical}",
                    logging.WARNING,
                    "%s (%s): %s=%r is outside %s; sample dropped, not clipped",
                    self.engine,
                    self.instance,
                    used,
                    value,
                    rule.valid,
                )
                continue
            if static is None:
                continue  # a kept label is missing
            extra, order, key, model = static
            if kind == "counter":
                upd = self.tracker.update(key, value, force_reset)
                value = upd.value
                restarted = restarted or upd.reset
            pending.append(
                _Pending(rule.canonical, rule.combine, rule.scale, model, extra, value, order)
            )
        return pending, restarted

    def _resolve(
        self, index: MetricIndex, rule: Rule, i: int = -1, cache: _ShapeCache | None = None
    ) -> tuple[str, list[Series]]:
        """The first source with a sample matching ``rule.labels``, and those samples.

        With ``cache`` (the result's shape), rule ``i``'s answer is worked out once per shape:
        which source and which of its samples, by position.
        """
        if cache is not None and i in cache.resolved:
            hit = cache.resolved[i]
            if hit is None:
                return rule.sources[0] if rule.sources else "", []
            used, key, positions = hit
            got = index.exact(key)
            return used, got if positions is None else [got[j] for j in positions]
        for source in rule.sources:
            name, wanted = parse_source(source)
            used, series, duplicate = index.find(name)
            wanted = rule.labels + wanted
            positions = None
            if wanted:
                positions = tuple(j for j, s in enumerate(series) if _matches(s.labels, wanted))
                series = [series[j] for j in positions]
            if not series:
                continue
            if duplicate:
                self._warn_duplicate(name, used)
            if cache is not None:
                cache.resolved[i] = (used, used, positions)
            return used, series
        if cache is not None:
            cache.resolved[i] = None
        return rule.sources[0] if rule.sources else "", []

    def _log_merges(self, index: MetricIndex) -> None:
        if index.duplicates:
            self._log(
                "merge:duplicate",
                logging.WARNING,
                "%s (%s): the exposition repeats %d series (same name and labels); "
                "each is kept once, the last copy wins, never summed",
                self.engine,
                self.instance,
                index.duplicates,
            )
        if index.collapsed:
            self._log(
                "merge:per_process",
                logging.INFO,
                "%s (%s): %d rows differ only by a per-process label (%s); collapsed "
                "(counters summed, gauges take the live value)",
                self.engine,
                self.instance,
                index.collapsed,
                ", ".join(sorted(PER_PROCESS_LABELS)),
            )

    def _warn_duplicate(self, source: str, used: str) -> None:
        self._log(
            f"dup:{source}",
            logging.WARNING,
            "%s (%s): both %s and its %s spelling are exported; using %s, never summing them",
            self.engine,
            self.instance,
            source,
            name_variants(source)[-1],
            used,
        )

    # -- histograms --------------------------------------------------------------------------

    def _resolve_histogram(
        self, index: MetricIndex, rule: Rule, i: int = -1, cache: _ShapeCache | None = None
    ) -> tuple[str, list[Series], list[Series]]:
        if cache is not None and i in cache.hist_resolved:
            used, key, bucket_at, sum_at = cache.hist_resolved[i]
            if not key:
                return "", [], []
            buckets, sums = index.exact(key), index.exact(used + "_sum")
            return (
                used,
                buckets if bucket_at is None else [buckets[j] for j in bucket_at],
                sums if sum_at is None else [sums[j] for j in sum_at],
            )
        for source in rule.sources:
            name, wanted = parse_source(source)
            used, buckets, sums, duplicate = index.histogram(name)
            wanted = rule.labels + wanted
            bucket_at = sum_at = None
            if wanted:
                bucket_at = tuple(j for j, s in enumerate(buckets) if _matches(s.labels, wanted))
                sum_at = tuple(j for j, s in enumerate(sums) if _matches(s.labels, wanted))
                buckets = [buckets[j] for j in bucket_at]
                sums = [sums[j] for j in sum_at]
            if not buckets:
                continue
            if duplicate:
                self._warn_duplicate(name, used)
            if cache is not None:
                cache.hist_resolved[i] = (used, used + "_bucket", bucket_at, sum_at)
            return used, buckets, sums
        if cache is not None:
            cache.hist_resolved[i] = ("", "", None, None)
        return "", [], []

    def _models_of(self, buckets: list[Series], default_model: str | None) -> set[str]:
        models = {self._model_of(s.labels, default_model) for s in buckets}
        return {m for m in models if m is not None}

    def _layout(
        self,
        rule: Rule,
        index: int,
        buckets: list[Series],
        sums: list[Series],
        default_model: str | None,
        values: list[float],
        cache: _ShapeCache | None,
    ) -> _Layout:
        """Rule ``index``'s :meth:`_histogram_layout` for this scrape, worked out rarely.

        Kept per result shape (``cache``) and, for results without one (a body parsed
        whole), per rule while its buckets and ``_sum`` samples come with the very same
        read-only label sets as last time (the fast parser gives every sample written with
        one label text the same :class:`~.exposition.LabelSet`): the layout depends on the
        labels and the default model only. A scrape with a non-finite bucket count is laid
        out afresh and kept nowhere (such a bucket is left out).
        """
        finite = all(map(math.isfinite, values))
        layout = cache.layouts.get(index) if cache is not None else None
        if layout is not None and finite:
            return layout
        labels = list(map(_LABELS, buckets))
        sum_labels = list(map(_LABELS, sums))
        seen = self._layouts.get(index)
        if (
            finite
            and seen is not None
            and seen[0] == default_model
            and _same_objects(seen[1], labels)
            and _same_objects(seen[2], sum_labels)
        ):
            layout = seen[3]
        else:
            layout = self._histogram_layout(rule, buckets, sums, default_model, values)
            if finite and _read_only(labels) and _read_only(sum_labels):
                self._layouts[index] = (default_model, labels, sum_labels, layout)
            else:
                self._layouts.pop(index, None)
        if cache is not None and finite:
            cache.layouts[index] = layout
        return layout

    def _histogram_layout(
        self,
        rule: Rule,
        buckets: list[Series],
        sums: list[Series],
        default_model: str | None,
        values: list[float],
    ) -> _Layout:
        """How a histogram rule's buckets group into series (:attr:`_ShapeCache.layouts`).

        Returns:
            Per raw series in body order: its key, the positions of its buckets (those with
            a bound and a finite count), its bounds (scaled) and its (extra labels, model),
            None when a kept label is missing; the ``_sum`` samples' keys; the buckets'
            models.
        """
        # the labels' bucket key is worked out once per label text by the parser's LabelSet
        labels = list(map(_LABELS, buckets))
        keyed = list(map(_BUCKET if _read_only(labels) else bucket_key, labels))
        keys = list(map(_NAME, keyed))
        bounds_of = list(map(_LE, keyed))
        raw: dict[LabelPairs, tuple[list[int], list[float]]] = {}
        scale = rule.scale
        isfinite = math.isfinite
        if None not in bounds_of and all(map(isfinite, values)):
            # every bucket counts: its series' buckets taken a run of one key at a time
            for key, run in groupby(zip(keys, range(len(keys)), strict=True), _NAME):
                positions = list(map(_LE, run))
                columns = raw.get(key)
                if columns is None:
                    columns = raw[key] = ([], [])
                columns[0].extend(positions)
                bounds = cast("list[float]", list(map(bounds_of.__getitem__, positions)))
                if scale != 1.0:
                    bounds = [le * scale if isfinite(le) else le for le in bounds]
                columns[1].extend(bounds)
        else:
            for j, (key, le) in enumerate(keyed):
                if le is None or not isfinite(values[j]):
                    continue
                columns = raw.get(key)
                if columns is None:
                    columns = raw[key] = ([], [])
                columns[0].append(j)
                columns[1].append(le * scale if scale != 1.0 and isfinite(le) else le)
        # a bucket's model is its series' (no mapping reads the model from ``le``)
        per_key = "le" not in self.mapping.model_labels
        model_of: dict[LabelPairs, str | None] = {}
        if rule.per_model and per_key:
            for key in dict.fromkeys(keys):
                model_of[key] = self._model_of(dict(key), default_model)
        series: list[_RawSeries] = []
        for key, (positions, bounds) in raw.items():
            labels_of = dict(key)
            extra = _extra_labels(rule, labels_of)
            if not rule.per_model:
                model = None
            elif per_key:
                model = model_of[key]
            else:
                model = self._model_of(labels_of, default_model)
            series.append((key, positions, bounds, None if extra is None else (extra, model)))
        models: set[str] = set()
        if rule.per_model:
            if per_key:
                models = {m for m in model_of.values() if m is not None}
            else:
                models = self._models_of(buckets, default_model)
        return series, [label_pairs(s.labels) for s in sums], models

    def _histogram(
        self,
        out: NormalizedScrape,
        rule: Rule,
        used: str,
        sums: list[Series],
        values: list[float],
        layout: _Layout,
        admitted: set[str],
        now: float,
    ) -> bool:
        """Window one histogram rule's series and emit its quantiles; True on a reset.

        ``values`` are the bucket samples' values in the order :meth:`_layout` laid out
        ``layout`` (the grouping of the buckets into series, their bounds and each series'
        labels); ``sums`` the rule's ``_sum`` samples.
        """
        series, sum_keys, _ = layout
        sum_of = dict(zip(sum_keys, [s.value for s in sums], strict=True))
        reset_seen = False
        group_deltas: dict[tuple[str | None, LabelPairs], list[HistogramSnapshot | None]] = {}
        group_totals: dict[tuple[str | None, LabelPairs], list[HistogramSnapshot | None]] = {}
        for key, positions, bounds, labelled in series:
            if labelled is None:
                continue
            extra, model = labelled
            if model is not None and model not in admitted:
                continue
            counts = list(map(values.__getitem__, positions))
            total = sum_of.get(key)
            if total is not None and not (math.isfinite(total) and total >= 0):
                total = None  # a latency sum cannot be negative or infinite: absent, not used
            snap = HistogramSnapshot.from_columns(
                bounds, counts, None if total is None else total * rule.scale
            )
            if snap is None:
                continue
            window = self._window_for(rule.canonical + "|" + used, extra, key)
            if window is None:
                continue
            if window.update(now, snap):
                reset_seen = True
            group_deltas.setdefault((model, extra), []).append(window.window(now))
            if rule.export:
                hkey = (rule.canonical + "|" + used, extra, key)
                cum = self._cumulative.setdefault(hkey, CumulativeHistogram())
                cum.update(rebucket(snap, rule.buckets))
                group_totals.setdefault((model, extra), []).append(cum.total)
        for (model, extra), deltas in group_deltas.items():
            delta = sum_windows(deltas)
            if delta is not None:
                # beside each quantile, how many observations its window holds: a missing
                # quantile is then "too few observations", not "no data"
                self._emit(out, window_observations_name(rule.canonical), model, delta.count, extra)
            for q in rule.quantiles:
                value = window_quantile(delta, q, rule.min_count)
                if value is not None:
                    self._emit(out, rule.canonical, model, value, (*extra, ("percentile", _pct(q))))
        for (model, extra), totals in group_totals.items():
            hist = sum_windows(totals)
            if hist is not None and rule.export:
                self._emit_histogram(out, rule.export, model, hist, extra)
        return reset_seen

    def _emit_histogram(
        self,
        out: NormalizedScrape,
        name: HistogramName,
        model: str | None,
        hist: HistogramSnapshot,
        extra: LabelPairs,
    ) -> None:
        """Emit ``name``'s ``_bucket`` (per bound), ``_count`` and, if known, ``_sum``.

        A ``_sum`` that cannot be true for latencies (negative, e.g. after an engine's sum
        went down between scrapes while its counts grew) is left out, never exported.
        """
        if not self._admit_extra(extra):
            return
        bucket, count, sum_ = histogram_names(name)
        emitted_labels = out.emitted_labels
        samples = out.samples
        key = (bucket, model)
        isfinite = math.isfinite
        emitted = False
        label_sets, extras = self._bucket_labels(model, extra, hist.bounds)
        cumulative = hist.cumulative
        if all(map(isfinite, cumulative)):  # as ever: every bucket, built at C speed
            rows = zip(repeat(bucket), map(float, cumulative), label_sets, strict=False)
            samples.extend(map(_new_tuple, _REPEAT_SAMPLE, rows))
            for extra_le in extras:
                seen = emitted_labels.get(extra_le)
                if seen is None:
                    seen = emitted_labels[extra_le] = set()
                seen.add(key)
            emitted = bool(extras)
        else:
            for labels, extra_le, cum in zip(label_sets, extras, cumulative, strict=True):
                if not isfinite(cum):
                    continue
                samples.append(Sample(bucket, float(cum), labels))
                seen = emitted_labels.get(extra_le)
                if seen is None:
                    seen = emitted_labels[extra_le] = set()
                seen.add(key)
                emitted = True
        if emitted:
            out.emitted.add(key)
        self._emit(out, count, model, hist.count, extra)
        if hist.sum is not None and math.isfinite(hist.sum) and hist.sum >= 0:
            self._emit(out, sum_, model, hist.sum, extra)

    def _window_for(
        self, name: str, extra: LabelPairs, key: LabelPairs
    ) -> WindowedHistogram | None:
        hkey = (name, extra, key)
        entry = self._hist.get(hkey)
        if entry is None:
            if len(self._hist) >= MAX_HISTOGRAM_SERIES:
                self._forget_histograms()
            if len(self._hist) >= MAX_HISTOGRAM_SERIES:
                self._log(
                    "hist-cap",
                    logging.WARNING,
                    "%s (%s): more than %d histogram series; further ones get no quantiles",
                    self.engine,
                    self.instance,
                    MAX_HISTOGRAM_SERIES,
                )
                return None
            entry = (WindowedHistogram(self.window_s), self._scrape)
        self._hist[hkey] = (entry[0], self._scrape)
        return entry[0]

    def _forget_histograms(self) -> None:
        cutoff = self._scrape - 600
        for k in [k for k, (_, seen) in self._hist.items() if seen < cutoff]:
            del self._hist[k]
            self._cumulative.pop(k, None)

    # -- window ratios ---------------------------------------------------------------------------

    def _window_ratios(self, out: NormalizedScrape, now: float) -> None:
        if not self.mapping.ratios:
            return
        values: dict[tuple[str, str | None], float] = {}
        plain = out.emitted_labels.get((), set())
        read = {n for r in self.mapping.ratios for n in (r.numerator, r.denominator)}
        for smp in out.samples:
            if smp.name not in read:
                continue  # only the ratios' own counters are read below
            labels = dict(smp.labels)
            if labels.keys() <= _BASE_LABELS and (smp.name, labels.get("model")) in plain:
                values[(smp.name, labels.get("model"))] = smp.value
        for ratio in self.mapping.ratios:
            for (name, model), num in list(values.items()):
                if name != ratio.numerator:
                    continue
                den = values.get((ratio.denominator, model))
                if den is None or out.has(ratio.canonical, model):
                    continue
                ring = self._ratios.setdefault((ratio.canonical, model), deque(maxlen=4096))
                ring.append((now, num, den))
                while len(ring) >= 2 and ring[1][0] <= now - ratio.window_s:
                    ring.popleft()
                t0, num0, den0 = ring[0]
                d_num, d_den = num - num0, den - den0
                if t0 < now and d_den > 0 and 0 <= d_num <= d_den:
                    self._emit(out, ratio.canonical, model, d_num / d_den)
        # A (ratio, model) not updated for a whole window (the model went away) is forgotten,
        # so a churning model label cannot grow this map.
        horizon = now - max(r.window_s for r in self.mapping.ratios)
        for key in [k for k, ring in self._ratios.items() if not ring or ring[-1][0] < horizon]:
            del self._ratios[key]

    # -- models and emission -----------------------------------------------------------------

    def _model_of(self, labels: Mapping[str, str], default: str | None) -> str | None:
        for name in self.mapping.model_labels:
            value = labels.get(name)
            if value:
                return value
        return default or None

    def _admit(self, present: set[str], pending: list[_Pending], out: NormalizedScrape) -> set[str]:
        """Keep at most ``max_models`` models: the ones under the most pressure.

        Models are ranked by KV-cache usage, then requests running, then requests waiting
        (the scrape's own values, :data:`PRESSURE_ORDER`); ties go to models admitted
        before, then to the name. Dropped models are counted in ``out.models_dropped`` and
        logged once per change of the dropped set, with counts (a warning when their number
        changes, info when only which models changes).
        """
        pressure = _pressure(pending)
        ordered = sorted(
            present,
            key=lambda m: (*(-v for v in pressure.get(m, _NO_PRESSURE)), m not in self._models, m),
        )
        admitted = set(ordered[: self.max_models])
        dropped = frozenset(ordered[self.max_models :])
        out.models_dropped = len(dropped)
        if dropped != self._dropped:
            # Logged when the dropped set changes: a new count warns, at most once a minute
            # per count; the same count with other models (pressure moving between models at
            # the boundary, churning model names) is info, at most once a minute in all, with
            # the number of changes since. Churn never floods the log.
            if dropped:
                shown = ", ".join(repr(m) for m in sorted(dropped)[:5])
                new_count = len(dropped) != len(self._dropped)
                self._warn(
                    f"model-cap:{len(dropped)}" if new_count else "model-cap:same",
                    logging.WARNING if new_count else logging.INFO,
                    "%s (%s): %d models, more than the cap of %d; kept the %d under the most "
                    "pressure (KV usage, running, waiting), dropped %d: %s%s",
                    self.engine,
                    self.instance,
                    len(present),
                    self.max_models,
                    len(admitted),
                    len(dropped),
                    shown,
                    ", ..." if len(dropped) > 5 else "",
                )
            else:
                log.info(
                    "%s (%s): %d models, within the cap of %d again",
                    self.engine,
                    self.instance,
                    len(present),
                    self.max_models,
                )
            self._dropped = dropped
        # Over a window too: at most max_label_values models (a model name that changes
        # every scrape would otherwise be a new set of series every scrape).
        models_cap = self._label_caps["model"]
        for model in [m for m in ordered[: self.max_models] if not models_cap.admit(m, self._now)]:
            admitted.discard(model)
            self._refused.setdefault("model", set()).add(model)
        for model in admitted:
            self._models[model] = self._scrape
        if len(self._models) > 4 * self.max_models:
            for model in sorted(self._models, key=self._models.__getitem__)[: self.max_models]:
                del self._models[model]
        return admitted

    def _derive(
        self,
        index: MetricIndex,
        out: NormalizedScrape,
        admitted: set[str],
        default_model: str | None,
    ) -> None:
        assert self.mapping.derive is not None
        sole = next(iter(admitted)) if len(admitted) == 1 else default_model
        try:
            derived = list(self.mapping.derive(index))
        except Exception:  # a mapping bug must not take the scrape down
            log.exception("%s: derive() of %s failed", self.engine, self.mapping.engine_type)
            return
        for d in derived:
            if d.model is not None and d.model not in admitted:
                continue  # a model the rules did not admit (or over the cap)
            model = d.model if d.model is not None else sole
            if not math.isfinite(d.value) or (d.canonical, model) in out.emitted_labels.get(
                d.labels, set()
            ):
                continue
            self._emit(out, d.canonical, model, d.value, d.labels)

    def _labels(self, model: str | None, extra: LabelPairs) -> tuple[tuple[str, str], ...]:
        """The output label set of ``model`` and ``extra`` (built once, then looked up)."""
        key = (model, extra)
        labels = self._label_sets.get(key)
        if labels is None:
            if len(self._label_sets) >= _LABEL_SETS_KEPT:
                self._label_sets.clear()  # bounded: a churning label rebuilds, never grows
            labels = make_labels(
                {"engine": self.engine, "instance": self.instance, "model": model, **dict(extra)}
            )
            self._label_sets[key] = labels
        return labels

    def _bucket_labels(
        self, model: str | None, extra: LabelPairs, bounds: tuple[float, ...]
    ) -> tuple[tuple[tuple[tuple[str, str], ...], ...], tuple[LabelPairs, ...]]:
        """Per bound: a bucket's output label set (the base set plus ``le``); ``extra`` + ``le``.

        Built once per model, extra labels and bucket layout; two tuples, one entry per bound.
        """
        key = (model, extra, bounds)
        got = self._bucket_sets.get(key)
        if got is None:
            if len(self._bucket_sets) >= _LABEL_SETS_KEPT:
                self._bucket_sets.clear()  # bounded: a churning label rebuilds, never grows
            base = self._labels(model, extra)
            sets = []
            extras = []
            for le in map(_le_label, bounds):
                pair = ("le", le)
                at = bisect.bisect_right(base, pair)  # where sorted() puts it: base is sorted
                sets.append((*base[:at], pair, *base[at:]))
                extras.append((*extra, pair))
            got = self._bucket_sets[key] = (tuple(sets), tuple(extras))
        return got

    def _admit_extra(self, extra: LabelPairs) -> bool:
        """False (and the value counted as refused) when a capped label's value is refused."""
        for name, label_value in extra:
            cap = self._label_caps.get(name)
            if cap is not None and not cap.admit(label_value, self._now):
                self._refused.setdefault(name, set()).add(label_value)
                return False
        return True

    def _emit(
        self,
        out: NormalizedScrape,
        canonical: SampleName,
        model: str | None,
        value: float,
        extra: LabelPairs = (),
    ) -> None:
        if not math.isfinite(value) or (extra and not self._admit_extra(extra)):
            return
        labels = self._label_sets.get((model, extra)) or self._labels(model, extra)
        out.samples.append(_new_tuple(Sample, (canonical, float(value), labels)))
        key = (canonical, model)
        out.emitted.add(key)
        seen = out.emitted_labels.get(extra)
        if seen is None:
            seen = out.emitted_labels[extra] = set()
        seen.add(key)


@functools.lru_cache(maxsize=1024)
def _le_label(bound: float) -> str:
    """The ``le`` label value of an exported bucket bound (``+Inf`` for infinity)."""
    return "+Inf" if math.isinf(bound) else repr(float(bound))


@functools.lru_cache(maxsize=1024)
def window_observations_name(canonical: SampleName) -> SampleName:
    """The catalogue gauge counting the observations behind a windowed-quantile gauge.

    Args:
        canonical: a histogram rule's canonical name, e.g.
            ``kvpressure_engine_latency_seconds``.

    Returns:
        ``canonical`` without its ``_seconds`` unit, plus ``_window_observations``, e.g.
        ``kvpressure_engine_latency_window_observations``: a catalogued gauge for every
        histogram rule of the mappings (``tests/test_typing.py`` checks each).
    """
    return cast("SampleName", canonical.removesuffix("_seconds") + "_window_observations")


def parse_source(source: str) -> tuple[str, LabelPairs]:
    """Split a rule source into its metric name and label filter.

    Args:
        source: ``name`` or ``name{label=value,label=a|b,label=prefix*}`` (no quotes;
            values may not contain ``,`` or ``}``).

    Returns:
        ``(name, ((label, value), ...))``; a malformed filter is ignored (no filter).
    """
    if not source.endswith("}") or "{" not in source:
        return source, ()
    name, _, body = source[:-1].partition("{")
    pairs: list[tuple[str, str]] = []
    for item in body.split(","):
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            return name, ()
        pairs.append((key.strip(), value.strip().strip('"')))
    return name, tuple(pairs)


def _pct(q: float) -> str:
    """The ``percentile`` label value of quantile ``q``: ``p50``, ``p95``, ``p99``, ``p99.9``.

    Not a ``quantile`` label: ``promtool check metrics`` reserves that for summaries, and
    these are gauges computed from histogram windows.
    """
    return f"p{q * 100:.10g}"


def _value_matches(actual: str | None, wanted: str) -> bool:
    if actual is None:
        return False
    for alt in wanted.split("|"):
        if alt.endswith("*"):
            if actual.startswith(alt[:-1]):
                return True
        elif actual == alt:
            return True
    return False


def _matches(labels: Mapping[str, str], required: LabelPairs) -> bool:
    return all(_value_matches(labels.get(k), v) for k, v in required)


def _extra_labels(rule: Rule, labels: Mapping[str, str]) -> LabelPairs | None:
    """The rule's constant labels plus the kept source labels; None when one is missing."""
    if not rule.keep_labels:
        return rule.out_labels
    kept: list[tuple[str, str]] = list(rule.out_labels)
    for src, dst in rule.keep_labels:
        value = labels.get(src)
        if not value:
            return None
        kept.append((dst, value))
    return tuple(kept)


TRAFFIC_COUNTERS: Final = frozenset(
    {
        "kvpressure_engine_requests_completed_total",
        "kvpressure_engine_prompt_tokens_total",
        "kvpressure_engine_generation_tokens_total",
        "kvpressure_engine_request_duration_seconds_total",
    }
)
"""Counters every served request moves. One that is still 0 for a model while another of
these is above 0 for the same model is not counted by the engine at that level (Triton's
``ensemble`` model has request counts but no compute time): it is withheld, never exported
as "zero traffic". When none moved, the zeros are real (an idle model) and exported."""

PRESSURE_ORDER: Final = (
    "kvpressure_engine_kv_cache_usage_ratio",
    "kvpressure_engine_requests_running",
    "kvpressure_engine_requests_waiting",
)
"""The catalogue gauges that rank models for the model cap, most important first."""
_NO_PRESSURE: Final = (0.0,) * len(PRESSURE_ORDER)


def _pressure(pending: list[_Pending]) -> dict[str, tuple[float, ...]]:
    """Per model, the :data:`PRESSURE_ORDER` values of one scrape (0 where absent)."""
    groups: dict[tuple[str, str, LabelPairs], list[_Pending]] = {}
    for p in pending:
        if p.model is not None and p.canonical in PRESSURE_ORDER:
            groups.setdefault((p.model, p.canonical, p.extra), []).append(p)
    values: dict[str, list[float]] = {}
    for (model, canonical, _), items in groups.items():
        row = values.setdefault(model, list(_NO_PRESSURE))
        i = PRESSURE_ORDER.index(canonical)
        row[i] = max(row[i], _combine(items))
    return {m: tuple(v) for m, v in values.items()}


def _combine(items: list[_Pending]) -> float:
    how = items[0].combine
    scale = items[0].scale
    if how == "max":
        value = max(p.value for p in items)
    elif how == "pick":
        value = min(items, key=lambda p: p.order).value
    else:
        value = math.fsum(p.value for p in items)
    return value * scale
