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
e.g. llama.cpp's ``/props`` alias). Every other engine label (vLLM's data-parallel
``engine`` index, ``mode``, ...) is combined away. At most ``max_models`` (32) distinct
models are kept per engine; samples of further models are dropped with a log-once.
"""

from __future__ import annotations

import abc
import logging
import math
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Final, Literal

from agent.samplers.base import LogOnce
from agent.samplers.engines.exposition import ParsedFamily, ParseResult
from agent.samplers.engines.http import Fetch
from agent.samples import Batch, Sample, make_labels

log = logging.getLogger(__name__)

Combine = Literal["sum", "max", "pick"]
RuleKind = Literal["gauge", "counter"]

MAX_MODELS: Final = 32
"""Distinct ``model`` label values kept per engine."""

NONNEGATIVE: Final = (0.0, math.inf)
RATIO: Final = (0.0, 1.0)
PROCESS_START_TIME: Final = "process_start_time_seconds"

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
            the first one with a matching sample wins, the others are ignored.
        combine: how the samples of one model are combined: ``sum`` (e.g. across vLLM
            data-parallel ``engine`` ranks), ``max``, or ``pick`` (the first sample in
            label order, for values that should exist once).
        scale: factor applied to the combined value to reach the base unit
            (e.g. ``1e-3`` for milliseconds).
        kind: ``gauge`` or ``counter`` (re-exported reset-aware).
        labels: ``(name, value)`` pairs a sample must carry to be used, compared on the
            parsed, unescaped value (e.g. ``(("source", "local_compute"),)``).
        valid: inclusive ``(low, high)`` range of a valid raw value; values outside are
            dropped and logged once. ``None`` accepts any finite value.
    """

    canonical: str
    sources: tuple[str, ...]
    combine: Combine = "sum"
    scale: float = 1.0
    kind: RuleKind = "gauge"
    labels: tuple[tuple[str, str], ...] = ()
    valid: tuple[float, float] | None = NONNEGATIVE


@dataclass(frozen=True, slots=True)
class Derived:
    """A value an engine module computes from the whole scrape (not a plain rename).

    Attributes:
        canonical: catalogue metric name.
        value: value in base units.
        model: the model it belongs to; ``None`` means "the scrape's only model, if
            there is exactly one, else the default model".
    """

    canonical: str
    value: float
    model: str | None = None


@dataclass(frozen=True, slots=True)
class Series:
    """One sample of the scrape, with its family.

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


def looks_like_gauge(name: str, help_text: str) -> bool:
    """Return True when a family typed ``counter`` is really an average or a rate.

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


class MetricIndex:
    """The scrape's samples, looked up by sample name or by family name.

    Args:
        families: parsed families (see :mod:`agent.samplers.engines.exposition`).
    """

    def __init__(self, families: Iterable[ParsedFamily]) -> None:
        self._by_sample: dict[str, list[Series]] = {}
        self._by_family: dict[str, list[Series]] = {}
        self.family_names: list[str] = []
        for fam in families:
            self.family_names.append(fam.name)
            alias = fam.type in ("counter", "gauge", "untyped", "unknown")
            for s in fam.samples:
                series = Series(s.name, s.labels, s.value, fam)
                self._by_sample.setdefault(s.name, []).append(series)
                if alias and s.name == fam.name + "_total":
                    self._by_family.setdefault(fam.name, []).append(series)

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


@dataclass(slots=True)
class NormalizedScrape:
    """The normalizer's output for one scrape.

    Attributes:
        samples: catalogue samples with ``engine``, ``instance`` and ``model`` labels.
        models: the models admitted in this scrape (sorted).
        emitted: ``(canonical, model)`` pairs present in ``samples``.
        missing: canonical names none of whose sources were in the scrape.
        invalid: canonical names whose source had a value outside ``Rule.valid``.
        restarted: True when a counter reset or ``process_start_time_seconds`` changed.
    """

    samples: list[Sample] = field(default_factory=list)
    models: list[str] = field(default_factory=list)
    emitted: set[tuple[str, str | None]] = field(default_factory=set)
    missing: list[str] = field(default_factory=list)
    invalid: list[str] = field(default_factory=list)
    restarted: bool = False

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

    def add(self, name: str, value: float | None, model: str | None, **labels: str) -> None:
        """Add a catalogue sample with this engine's ``engine``/``instance``/``model``."""
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
            ``triton``.
        prefixes: metric-name prefixes that identify the engine in auto-detection.
        rules: the :class:`Rule` rows; empty for engines whose mapping has not landed.
        model_labels: raw label names that carry the model, in priority order.
        metrics_path: the exposition path on the engine's base URL.
        derive: optional function computing :class:`Derived` values from the whole scrape
            (e.g. vLLM's KV capacity from ``cache_config_info`` labels).
        addon: optional factory of an :class:`EngineAddon` for extra endpoints.
        implemented: False while only detection exists (the sampler then emits only
            ``kvpressure_engine_up`` and ``kvpressure_engine_info``).
    """

    engine_type: str
    prefixes: tuple[str, ...]
    rules: tuple[Rule, ...] = ()
    model_labels: tuple[str, ...] = ("model_name", "model", "name")
    metrics_path: str = "/metrics"
    derive: Callable[[MetricIndex], Iterable[Derived]] | None = None
    addon: Callable[[], EngineAddon] | None = None
    implemented: bool = True


@dataclass(slots=True)
class _Pending:
    canonical: str
    combine: Combine
    scale: float
    model: str | None
    value: float
    order: tuple[tuple[str, str], ...]


class Normalizer:
    """Applies one :class:`EngineMapping` to successive scrapes of one endpoint.

    Stateful: it holds the counter tracker, the last ``process_start_time_seconds``, the
    admitted models and the restart count, so use one instance per endpoint.

    Args:
        mapping: the engine's mapping.
        engine: the ``engine`` label value (the configured engine name).
        instance: the ``instance`` label value (``host:port``).
        max_models: distinct models kept (further ones are dropped and logged once).
    """

    def __init__(
        self,
        mapping: EngineMapping,
        engine: str,
        instance: str,
        max_models: int = MAX_MODELS,
    ) -> None:
        self.mapping = mapping
        self.engine = engine
        self.instance = instance
        self.max_models = max_models
        self.restarts = 0
        """Restarts seen so far (counter resets or a new process start time)."""
        self.tracker = CounterTracker()
        self._start_time: float | None = None
        self._models: dict[str, int] = {}
        self._scrape = 0
        self._log = LogOnce(log)

    def normalize(self, result: ParseResult, default_model: str | None = None) -> NormalizedScrape:
        """Map one parsed scrape to catalogue samples.

        Args:
            result: the parsed exposition (only its families are read).
            default_model: the model for samples without a model label (llama.cpp's
                ``/props`` ``model_alias``), or ``None``.

        Returns:
            The :class:`NormalizedScrape`. Never raises on engine data.
        """
        self._scrape += 1
        self.tracker.begin()
        out = NormalizedScrape()
        index = MetricIndex(result.families)

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
        for rule in self.mapping.rules:
            used, series = self._resolve(index, rule)
            if not series:
                out.missing.append(rule.canonical)
                continue
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
            for s in series:
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
                order = tuple(sorted(s.labels.items()))
                if kind == "counter":
                    upd = self.tracker.update((rule.canonical, order), value, force_reset)
                    value = upd.value
                    restarted = restarted or upd.reset
                pending.append(
                    _Pending(
                        rule.canonical,
                        rule.combine,
                        rule.scale,
                        self._model_of(s.labels, default_model),
                        value,
                        order,
                    )
                )

        admitted = self._admit({p.model for p in pending if p.model is not None})
        groups: dict[tuple[str, str | None], list[_Pending]] = {}
        for p in pending:
            if p.model is not None and p.model not in admitted:
                continue
            groups.setdefault((p.canonical, p.model), []).append(p)
        for (canonical, model), items in groups.items():
            self._emit(out, canonical, model, _combine(items))

        if self.mapping.derive is not None:
            self._derive(index, out, admitted, default_model)

        out.models = sorted(admitted)
        if restarted:
            self.restarts += 1
            out.restarted = True
        return out

    def _resolve(self, index: MetricIndex, rule: Rule) -> tuple[str, list[Series]]:
        """The first source with a sample matching ``rule.labels``, and those samples."""
        for source in rule.sources:
            used, series, duplicate = index.find(source)
            if rule.labels:
                series = [s for s in series if _matches(s.labels, rule.labels)]
            if not series:
                continue
            if duplicate:
                self._log(
                    f"dup:{source}",
                    logging.WARNING,
                    "%s (%s): both %s and its %s spelling are exported; using %s, "
                    "never summing them",
                    self.engine,
                    self.instance,
                    source,
                    name_variants(source)[-1],
                    used,
                )
            return used, series
        return rule.sources[0] if rule.sources else "", []

    def _model_of(self, labels: Mapping[str, str], default: str | None) -> str | None:
        for name in self.mapping.model_labels:
            value = labels.get(name)
            if value:
                return value
        return default or None

    def _admit(self, present: set[str]) -> set[str]:
        """Keep at most ``max_models`` models, preferring ones admitted before."""
        ordered = sorted(present, key=lambda m: (m not in self._models, m))
        admitted = set(ordered[: self.max_models])
        for model in ordered[self.max_models :]:
            self._log(
                f"model-cap:{model}",
                logging.WARNING,
                "%s (%s): more than %d models; dropping samples of model %r",
                self.engine,
                self.instance,
                self.max_models,
                model,
            )
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
            if not math.isfinite(d.value) or (d.canonical, model) in out.emitted:
                continue
            self._emit(out, d.canonical, model, d.value)

    def _emit(self, out: NormalizedScrape, canonical: str, model: str | None, value: float) -> None:
        if not math.isfinite(value):
            return
        labels = make_labels({"engine": self.engine, "instance": self.instance, "model": model})
        out.samples.append(Sample(canonical, float(value), labels))
        out.emitted.add((canonical, model))


def _matches(labels: Mapping[str, str], required: tuple[tuple[str, str], ...]) -> bool:
    return all(labels.get(k) == v for k, v in required)


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
