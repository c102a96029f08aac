"""The engine sampler: scrape an inference engine's metrics and normalize them.

One :class:`EngineSampler` per configured engine endpoint. Each cycle it GETs the metrics
path, classifies and parses the response (:mod:`~agent.samplers.engines.exposition`; a body
whose lines equal the last one's up to their values takes the last parse's shape with the
new values, :class:`~agent.samplers.engines.exposition.Reparse`),
resolves the engine type (``auto``: from metric-name prefixes, kept once known), applies
the type's mapping (:mod:`~agent.samplers.engines.normalize`) and runs the type's add-on
(llama.cpp ``/slots``). Every cycle emits, whatever happened:

* ``kvpressure_engine_up{engine,instance}``: 1 when the endpoint answered with usable
  exposition (an empty 2xx body included), 0 otherwise;
* ``kvpressure_engine_scrape_samples``, ``kvpressure_engine_parse_errors_total``
  (cumulative), ``kvpressure_engine_restarts_total``,
  ``kvpressure_engine_series_merged_total{reason}`` (cumulative: ``duplicate`` repeated
  series dropped, ``per_process`` rows collapsed), and, once normalized,
  ``kvpressure_engine_models_dropped`` (models over the cap in the last scrape),
  ``kvpressure_engine_label_values_dropped_total{label}`` (cumulative: values of ``model``
  or of a kept engine label refused by the per-engine cap over a window, counted once per
  scrape each) and ``kvpressure_engine_counters_withheld`` (per-model counters the engine
  does not count);
* ``kvpressure_engine_info{engine,instance,type,model}`` (``type="unknown"`` until known);
* once normalized, for an engine with token counters, ``kvpressure_engine_stats_stale``
  and the source ``stats`` (:mod:`~agent.samplers.engines.staleness`: token counters
  frozen while the gauges claim running requests or a full KV cache).

An engine that is down is data, not a sampler failure: :meth:`EngineSampler.collect` does
not raise for HTTP errors, refused connections, timeouts, JSON or garbage; it records
``batch.source_error("metrics", reason)`` with reason ``http_<code>``, ``connect``,
``timeout``, ``not_exposition``, ``empty``, ``too_large`` or ``transport``, logs the
reason (once per change) and the first 200 bytes of a bad body (once, at debug), and emits
no KV or queue samples, so a down engine never reads as an idle one.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Final

from kvpressure.agent.logs import RateLimitedLog
from kvpressure.agent.pipeline import ENGINE_GAUGE_SAMPLER, ENGINE_SAMPLER
from kvpressure.agent.samplers.base import LogOnce, Sampler
from kvpressure.agent.samplers.engines.exposition import (
    REASON_EMPTY,
    ParseResult,
    Reparse,
    classify_response,
    failed,
)
from kvpressure.agent.samplers.engines.http import (
    Fetch,
    HttpResult,
    KeptAlive,
    LazyClient,
    ascii_compatible,
    http_get,
    tls_context,
    url_parts,
)
from kvpressure.agent.samplers.engines.normalize import (
    MERGE_DUPLICATE,
    MERGE_PER_PROCESS,
    PROCESS_START_TIME,
    AddonContext,
    EngineAddon,
    EngineMapping,
    Normalizer,
)
from kvpressure.agent.samplers.engines.registry import DETECTION_FALLBACK, ENGINE_TYPES
from kvpressure.agent.samplers.engines.staleness import STALE, StaleTracker
from kvpressure.agent.samples import Batch, Sample, make_labels

if TYPE_CHECKING:
    import httpx

log = logging.getLogger(__name__)

AUTO: Final = "auto"
DEFAULT_METRICS_PATH: Final = "/metrics"
KV_RATIO: Final = "kvpressure_engine_kv_cache_usage_ratio"
GAUGES: Final = frozenset(
    {KV_RATIO, "kvpressure_engine_requests_running", "kvpressure_engine_requests_waiting"}
)
"""What :class:`EngineGaugeSampler` reads between full scrapes: KV usage, running, waiting."""
_ACCEPT: Final = "text/plain;version=0.0.4;q=1.0, application/openmetrics-text;q=0.5, */*;q=0.1"
_BODY_LOG_BYTES: Final = 200
MEMO_MAX_AGE_S: Final = 1.0
"""The gauge reader reuses a repeated response's samples for at most this long (seconds)."""
WARN_PERIOD_S: Final = 60.0
"""Warnings about an engine's malformed output: one line per reason per period, counted."""


def engine_type_from_families(names: Iterable[str]) -> str | None:
    """Detect the engine type from metric family names.

    Prefixes (see ``ENGINE_TYPES``): ``vllm:``/``vllm_``, ``llamacpp:``/``llamacpp_``,
    ``sglang:``/``sglang_``, ``tgi_``, ``trtllm_``/``trtllm:`` (``trtllm-serve``), and, only
    when no other type's prefix is present (``DETECTION_FALLBACK``): ``nv_trt_llm_``/
    ``nv_inference_`` (Triton; a Triton running the vLLM backend is a vLLM),
    ``lmcache:`` (LMCache's own server) and ``kvbm_`` (Dynamo KVBM's port).

    Args:
        names: family (or sample) names from one scrape.

    Returns:
        The type whose prefixes match the most names (ties go to the order of
        ``ENGINE_TYPES``), or ``None`` when no name matches.
    """
    order = list(ENGINE_TYPES)
    counts = dict.fromkeys(order, 0)
    for name in names:
        for etype, mapping in ENGINE_TYPES.items():
            if name.startswith(mapping.prefixes):
                counts[etype] += 1
                break
    primary = {t: c for t, c in counts.items() if c and t not in DETECTION_FALLBACK}
    candidates = primary or {t: c for t, c in counts.items() if c}
    if not candidates:
        return None
    return max(candidates, key=lambda t: (candidates[t], -order.index(t)))


def base_url(url: str) -> str:
    """Normalize an engine URL to its base: scheme added, trailing ``/`` and ``/metrics`` cut.

    Args:
        url: e.g. ``"127.0.0.1:8080"``, ``"http://h:8000/"`` or ``"http://h:8000/metrics"``.

    Returns:
        e.g. ``"http://h:8000"``.
    """
    url = url.strip()
    if "://" not in url:
        url = "http://" + url
    url = url.rstrip("/")
    url = url.removesuffix(DEFAULT_METRICS_PATH)
    return url.rstrip("/")


def instance_of(url: str) -> str:
    """Return the ``instance`` label (``host:port``) of an engine URL.

    Args:
        url: an absolute URL; a missing port is the scheme's default (80/443).

    Returns:
        ``host:port``, IPv6 hosts in brackets; the raw URL when it cannot be parsed.
    """
    try:
        scheme, host, port = url_parts(url)
    except (_invalid_url(), TypeError, ValueError):
        return url
    host = host or ""
    if ":" in host:
        host = f"[{host}]"
    port = port or (443 if scheme == "https" else 80)
    return f"{host}:{port}"


def _invalid_url() -> type[Exception]:
    """``httpx.InvalidURL`` (called only once :func:`url_parts` raised: httpx is loaded)."""
    import httpx

    return httpx.InvalidURL


def probe(url: str, timeout_s: float = 0.5) -> str | None:
    """Ask ``url`` for its metrics and say which engine it is, for auto-discovery.

    Args:
        url: the engine's base URL (``/metrics`` is appended unless present).
        timeout_s: seconds for each phase of the one GET.

    Returns:
        The detected engine type (see :func:`engine_type_from_families`), or ``None``
        when the endpoint does not answer with exposition or no prefix matches. Never
        raises.
    """
    import httpx

    try:
        with httpx.Client(headers={"Accept": _ACCEPT}, verify=tls_context()) as client:
            res = http_get(client, base_url(url) + DEFAULT_METRICS_PATH, timeout_s)
        if res.reason or res.status is None:
            return None
        result = classify_response(res.status, res.content_type, res.body)
        return engine_type_from_families(result.family_names()) if result.families else None
    except Exception:  # discovery must never fail loudly
        log.debug("probe of %s failed", url, exc_info=True)
        return None


class EngineSampler(Sampler):
    """Scrapes one inference engine endpoint and emits the ``kvpressure_engine_*`` metrics.

    Args:
        name: the configured engine name; the ``engine`` label, and the sampler is named
            ``engine:<name>``.
        url: the engine's base URL (``http://host:port``; a trailing ``/metrics`` is cut).
        engine_type: one of ``ENGINE_TYPES`` or ``"auto"`` (detected from metric prefixes
            on the first usable scrape, then kept).
        interval_s: seconds between collections.
        timeout_s: the whole collection's budget in seconds (HTTP requests of one cycle
            share 90% of it); default ``max(interval_s, 2.0)``.
        transport: an ``httpx`` transport (tests inject ``httpx.MockTransport``).
        pod_labels: ``engine name -> {label: value}``, the engine's pod labels
            (:meth:`agent.kube.EnginePods.labels`: ``pod_uid``, ``namespace``, ``pod``,
            ``container``), added to every series of the engine; ``None``: no pod labels.

    Raises:
        ValueError: ``engine_type`` is neither ``"auto"`` nor a known type.
    """

    def __init__(
        self,
        name: str,
        url: str,
        engine_type: str = AUTO,
        interval_s: float = 1.0,
        timeout_s: float | None = None,
        transport: httpx.BaseTransport | None = None,
        pod_labels: Callable[[str], Mapping[str, str]] | None = None,
    ) -> None:
        super().__init__(interval_s=interval_s, timeout_s=timeout_s)
        if engine_type != AUTO and engine_type not in ENGINE_TYPES:
            known = ", ".join([AUTO, *ENGINE_TYPES])
            raise ValueError(f"unknown engine type {engine_type!r}; expected one of {known}")
        self.name = f"{ENGINE_SAMPLER}{name}"
        self.engine = name
        self.url = base_url(url)
        self.instance = instance_of(self.url)
        self.engine_type = engine_type
        self._transport = transport
        self._client = LazyClient(transport, {"Accept": _ACCEPT})
        # plain http: one kept-alive connection read by hand (KeptAlive), httpx otherwise
        self._raw = KeptAlive(self.url, {"Accept": _ACCEPT}) if transport is None else None
        self._lock = threading.Lock()
        self._log = LogOnce(log)
        self._warn = RateLimitedLog(log, WARN_PERIOD_S)
        self._type: str | None = None
        self._normalizer: Normalizer | None = None
        self._addon: EngineAddon | None = None
        self._parse_errors = 0
        self._merged = dict.fromkeys((MERGE_DUPLICATE, MERGE_PER_PROCESS), 0)
        self._models_dropped: int | None = None
        self._label_values_dropped: dict[str, int] = {}
        self._withheld: int | None = None
        self._models: list[str] = []
        self._failing = ""
        self._stale = StaleTracker()
        self._wanted: frozenset[str] | None = None
        self._reparse = Reparse()  # a body with the last one's lines is not parsed again
        self._pod_labels = pod_labels
        # shared with the gauge sampler (EngineGaugeSampler), replaced whole, never mutated
        self.up = False
        self.present: frozenset[str] = frozenset()  # family names of the last usable scrape
        self.default_model: str | None = None
        # the series the gauge sampler published last, and when (monotonic seconds)
        self.gauge_keys: tuple[frozenset[tuple[str, object]], float] = (frozenset(), 0.0)
        if engine_type != AUTO:
            self._set_type(engine_type)

    @property
    def detected_type(self) -> str | None:
        """The engine type in use (configured, or detected), ``None`` while unknown."""
        return self._type

    @property
    def restarts(self) -> int:
        """Engine restarts seen so far."""
        return self._normalizer.restarts if self._normalizer else 0

    def collect(self, batch: Batch) -> None:
        """Scrape the engine once and fill ``batch``.

        Args:
            batch: the batch to fill (see the module docstring for what goes in).

        Never raises for engine-side failures; those are ``source_error("metrics", ...)``
        with ``kvpressure_engine_up 0``.
        """
        if not self._lock.acquire(timeout=self.timeout_s):
            batch.source_error("metrics", "busy")  # the previous cycle is still running
            return
        try:
            self._collect(batch)
            self._add_pod_labels(batch)
            keys, at = self.gauge_keys
            if keys and time.monotonic() - at <= self.interval_s:
                # the gauge sampler publishes these series, fresher: not twice (a gauge
                # sampler silent for a whole interval, stuck or stopped, is not relied on)
                batch.samples = [s for s in batch.samples if (s.name, s.labels) not in keys]
        finally:
            self._lock.release()

    def prepare(self) -> None:
        """Send this cycle's metrics GET ahead (:meth:`~.http.KeptAlive.send_ahead`).

        The thread group calls it for every engine before their scrapes, so the engines
        answer while the thread reads the others; :meth:`collect` reads the response.
        """
        if self._raw is not None:
            mapping = self._mapping()
            self._raw.send_ahead(mapping.metrics_path if mapping else DEFAULT_METRICS_PATH)

    def gauge_sampler(self, interval_s: float) -> EngineGaugeSampler:
        """A sampler of this engine's KV usage, running and waiting requests every ``interval_s``.

        See :class:`EngineGaugeSampler`; while it publishes a series, this sampler's own
        batches leave that series out.
        """
        return EngineGaugeSampler(self, interval_s)

    def _add_pod_labels(self, batch: Batch) -> None:
        """Put the engine's pod labels on every sample of ``batch`` (one set per engine)."""
        if self._pod_labels is None:
            return
        pod = self._pod_labels(self.engine)  # never raises (EnginePods.labels)
        if not pod:
            return
        batch.samples = [
            Sample(s.name, s.value, make_labels({**pod, **dict(s.labels)})) for s in batch.samples
        ]

    def close(self) -> None:
        """Close the HTTP client and the kept connection."""
        self._client.close()
        if self._raw is not None:
            self._raw.close()

    # -- one cycle -----------------------------------------------------------------------

    def _collect(self, batch: Batch) -> None:
        fetch = self._fetcher(time.monotonic() + 0.9 * self.timeout_s)
        mapping = self._mapping()
        res = fetch(mapping.metrics_path if mapping else DEFAULT_METRICS_PATH)
        if res.reason or res.status is None:
            result = failed(res.reason or "transport")
        else:
            result = self._reparse.parse(res.status, res.content_type, res.body, self._wanted)
        self._parse_errors += result.error_count
        self._log_parse_errors(result)

        if self._type is None and result.families:
            detected = engine_type_from_families(result.family_names())
            if detected is not None:
                log.info("engine %s (%s): detected type %s", self.engine, self.instance, detected)
                self._set_type(detected)
            else:
                self._log(
                    "undetected",
                    logging.WARNING,
                    "engine %s (%s): no known engine metric prefix; set its type",
                    self.engine,
                    self.instance,
                )

        up = result.usable
        self.up = up and result.reason != REASON_EMPTY
        if up and result.families:
            self.present = frozenset(f.name for f in result.families)
        if not up or result.reason == REASON_EMPTY:
            self._report_failure(batch, result, res)
        else:
            if self._failing:
                log.info("engine %s (%s): metrics available again", self.engine, self.instance)
                self._failing = ""
            batch.source_ok("metrics")
            self._normalize(batch, result, fetch)

        labels = {"engine": self.engine, "instance": self.instance}
        batch.add("kvpressure_engine_up", 1 if up else 0, **labels)
        batch.add("kvpressure_engine_scrape_samples", result.sample_count, **labels)
        batch.add("kvpressure_engine_parse_errors_total", self._parse_errors, **labels)
        batch.add("kvpressure_engine_restarts_total", self.restarts, **labels)
        for reason, count in self._merged.items():
            batch.add("kvpressure_engine_series_merged_total", count, reason=reason, **labels)
        batch.add("kvpressure_engine_models_dropped", self._models_dropped, **labels)
        for label, count in self._label_values_dropped.items():
            batch.add("kvpressure_engine_label_values_dropped_total", count, label=label, **labels)
        batch.add("kvpressure_engine_counters_withheld", self._withheld, **labels)
        models: list[str | None] = list(self._models) or [None]
        for model in models:
            batch.add(
                "kvpressure_engine_info", 1, type=self._type or "unknown", model=model, **labels
            )

    def _normalize(self, batch: Batch, result: ParseResult, fetch: Fetch) -> None:
        mapping = self._mapping()
        if mapping is None or self._normalizer is None or not mapping.implemented:
            if mapping is not None:
                self._log(
                    "not-implemented",
                    logging.INFO,
                    "engine %s (%s): type %s is recognised but has no mapping yet; "
                    "only up/info are exported",
                    self.engine,
                    self.instance,
                    mapping.engine_type,
                )
            return
        normalizer = self._normalizer
        ctx = AddonContext(self.engine, self.instance, batch, fetch, normalizer.admits)
        default_model = self._addon.before(ctx) if self._addon else None
        self.default_model = default_model
        scrape = normalizer.normalize(result, default_model)
        for label, count in scrape.label_values_dropped.items():
            self._label_values_dropped[label] = self._label_values_dropped.get(label, 0) + count
        for reason, count in scrape.merged.items():
            self._merged[reason] = self._merged.get(reason, 0) + count
        self._models_dropped = scrape.models_dropped
        self._withheld = scrape.withheld
        if scrape.restarted:
            log.info(
                "engine %s (%s): restart detected (counter reset or new process start time)",
                self.engine,
                self.instance,
            )
        mark = len(batch.samples)
        batch.samples.extend(scrape.samples)
        kv_failed = self._addon.after(ctx, scrape) if self._addon else False
        stale = self._stale.update(time.monotonic(), batch.samples[mark:])
        if stale is not None:
            batch.add(STALE, 1 if stale else 0, engine=self.engine, instance=self.instance)
            if stale:
                batch.source_error("stats", "stale")
            else:
                batch.source_ok("stats")
        self._models = scrape.models or (
            [default_model] if default_model and normalizer.admits(default_model) else []
        )
        if not mapping.reports_kv:
            pass  # a KV-tier source (LMCache, KVBM): no device KV cache to report
        elif KV_RATIO in scrape.invalid:
            batch.source_error("kv_cache", "invalid_value")
        elif not kv_failed and not any(s.name == KV_RATIO for s in batch.samples[mark:]):
            batch.source_unsupported("kv_cache", "not_exported_by_engine")
            self._log(
                "kv-missing",
                logging.INFO,
                "engine %s (%s): the engine exports no KV-cache usage; "
                "KV occupancy is unavailable (not 0)",
                self.engine,
                self.instance,
            )

    def _report_failure(self, batch: Batch, result: ParseResult, res: HttpResult) -> None:
        reason = result.reason
        batch.source_error("metrics", reason)
        if reason != self._failing:
            level = logging.INFO if reason == REASON_EMPTY else logging.WARNING
            log.log(
                level, "engine %s (%s): metrics unavailable: %s", self.engine, self.instance, reason
            )
            self._failing = reason
        if res.body:
            self._log(
                f"body:{reason}",
                logging.DEBUG,
                "engine %s (%s): first bytes of the %s body: %r",
                self.engine,
                self.instance,
                reason,
                res.body[:_BODY_LOG_BYTES],
            )

    def _log_parse_errors(self, result: ParseResult) -> None:
        # One line a minute for this reason, with a count, however the bad lines' names
        # churn (keyed by name, an engine with churning bad names logged every scrape).
        for err in result.errors:
            self._warn(
                "parse",
                logging.WARNING,
                "engine %s (%s): skipped unparsable line %d (%s): %r",
                self.engine,
                self.instance,
                err.line,
                err.message,
                err.text,
            )

    # -- helpers -------------------------------------------------------------------------

    def _mapping(self) -> EngineMapping | None:
        return ENGINE_TYPES.get(self._type) if self._type else None

    def _set_type(self, engine_type: str) -> None:
        self._type = engine_type
        mapping = ENGINE_TYPES[engine_type]
        self._normalizer = Normalizer(mapping, self.engine, self.instance)
        # 0 for every capped label from the start: a real zero, not an absent count
        self._label_values_dropped = dict.fromkeys(self._normalizer.capped_labels, 0)
        self._addon = mapping.addon() if mapping.addon else None
        # once the type is known, families its mapping never reads are skipped unparsed
        self._wanted = mapping.reads() if mapping.implemented else None

    def _fetcher(self, deadline: float) -> Fetch:
        def fetch(path: str) -> HttpResult:
            if deadline - time.monotonic() <= 0.01:
                return HttpResult(None, None, "", "timeout")
            if self._raw is not None:
                got = self._raw.get(path, deadline, ahead_max_age=self.interval_s / 2)
                if got is not None:
                    return got
            left = deadline - time.monotonic()
            if left <= 0.01:
                return HttpResult(None, None, "", "timeout")
            return http_get(self._client.get(), self.url + path, left)

        return fetch


class EngineGaugeSampler(Sampler):
    """One engine's KV-cache usage and running/waiting requests, between its full scrapes.

    The engine's :class:`EngineSampler` reads the whole exposition every ``interval_s``
    (parse and normalize: milliseconds per scrape); this sampler reads, every
    ``interval_s`` of its own (e.g. 0.1 s), only the :data:`GAUGES` series, so the
    timeline and ``/metrics`` see queue and KV swings the 1 s scrape misses (issue 15). Each
    cycle it GETs the metrics path (a kept-alive connection, :class:`~.http.KeptAlive`),
    cuts out the lines of the gauge families the last full scrape found (their ``# HELP``,
    ``# TYPE`` and sample lines, by a search of the undecoded bytes: no other line is
    decoded or parsed), and parses (:class:`~.exposition.Reparse`: the same lines as last
    time with new values are not parsed again) and normalizes them with the same mapping
    rows, so each series has the same name, labels and value the full scrape would give.
    Models the full scrape did not admit (the per-engine model cap) are left out.

    It emits nothing while the engine sampler has not yet seen the engine up, with its type
    known and the gauge families present (a down engine never reads as idle); a failed GET
    records ``source_error("metrics", reason)`` and emits no gauge. The engine sampler
    leaves out of its own batches the series this sampler published in its last cycle, while
    that cycle is at most one engine interval old.

    Like every sampler, it runs on the thread shared by the samplers of its interval
    (:class:`agent.scheduler.ThreadGroup`): 80 reads a second on eight threads cost a
    quarter more CPU than on one.

    Args:
        engine: the engine's sampler (its type, admitted models and pod labels are read).
        interval_s: seconds between collections.
    """

    def __init__(self, engine: EngineSampler, interval_s: float) -> None:
        super().__init__(interval_s=interval_s, timeout_s=max(interval_s, 1.0))
        self.name = f"{ENGINE_GAUGE_SAMPLER}{engine.engine}"
        self._engine = engine
        self._raw = (
            KeptAlive(engine.url, {"Accept": _ACCEPT}) if engine._transport is None else None
        )
        self._client = LazyClient(engine._transport, {"Accept": _ACCEPT})
        self._type: str | None = None
        self._normalizer: Normalizer | None = None
        self._wanted: tuple[str, ...] = ()
        self._reparse = Reparse()
        self.memo_max_age_s = MEMO_MAX_AGE_S  # negative: no repeat is reused (tests)
        self._forget()

    def _forget(self) -> None:
        """Drop the repeat memo of :meth:`_gauges` (a new type, a new normalizer)."""
        self._lines_key: tuple[object, ...] | None = None
        self._lines = ""
        self._memo_key: tuple[object, ...] | None = None
        self._memo: list[Sample] = []
        self._memo_at = float("-inf")

    def close(self) -> None:
        """Close the HTTP client and the kept connection; the engine sampler reads all again."""
        self._engine.gauge_keys = (frozenset(), 0.0)
        self._client.close()
        if self._raw is not None:
            self._raw.close()

    def prepare(self) -> None:
        """Send this tick's GET ahead (:meth:`~.http.KeptAlive.send_ahead`) when it will read.

        The thread group calls it for every engine before the reads, so the engines answer
        while the thread reads the others; :meth:`collect` reads the response (one sent
        more than half an interval before is not read: the GET is sent again).
        """
        eng = self._engine
        if (
            self._raw is not None
            and self._normalizer is not None
            and eng.detected_type == self._type
            and eng.up
            and any(n in eng.present for n in self._wanted)
        ):
            self._raw.send_ahead(ENGINE_TYPES[self._type or ""].metrics_path)

    def collect(self, batch: Batch) -> None:
        """Read the engine's gauges once and fill ``batch``; never raises for engine data."""
        eng = self._engine
        etype = eng.detected_type
        if etype != self._type:
            self._set_type(etype)
        names = [n for n in self._wanted if n in eng.present]
        if self._normalizer is None or not eng.up or not names:
            eng.gauge_keys = (frozenset(), 0.0)
            return
        mapping = ENGINE_TYPES[self._type or ""]
        deadline = time.monotonic() + 0.9 * self.timeout_s
        res = (
            self._raw.get(
                mapping.metrics_path, deadline, decode=False, ahead_max_age=self.interval_s / 2
            )
            if self._raw is not None
            else None
        )
        if res is None:
            left = deadline - time.monotonic()
            res = (
                http_get(self._client.get(), eng.url + mapping.metrics_path, left)
                if left > 0.01
                else HttpResult(None, None, "", "timeout")
            )
        if res.reason or res.status is None or not res.ok:
            batch.source_error("metrics", res.reason or f"http_{res.status}")
            eng.gauge_keys = (frozenset(), 0.0)
            return
        samples = self._gauges(res, names, eng.default_model)
        admitted = set(eng._models)
        for s in samples:
            model = dict(s.labels).get("model")
            if model is None or model in admitted:
                batch.samples.append(s)
        batch.source_ok("metrics")
        eng._add_pod_labels(batch)
        eng.gauge_keys = (frozenset((s.name, s.labels) for s in batch.samples), time.monotonic())

    def _gauges(self, res: HttpResult, names: list[str], default_model: str | None) -> list[Sample]:
        """The gauge series of one response: its gauge lines parsed and normalized.

        Equal to ``normalize(reparse(gauge_lines(body)))`` of every response; two steps are
        skipped when their input repeats the last response's, as an idle or steady engine's
        does between 0.1 s reads: a body byte-equal to the last one (with the same names
        and ``Content-Type``) has the same gauge lines (no search), and gauge lines equal to
        the last ones (with the same status, ``Content-Type`` and default model) the same
        samples (no parse, no normalize; the gauge rows have no counter, window or derived
        state that a repeat would move). At least every ``memo_max_age_s`` seconds (default
        :data:`MEMO_MAX_AGE_S`) the
        whole path runs again, so the normalizer's per-window label caps see every value.
        """
        assert self._normalizer is not None and res.status is not None
        now = time.monotonic()
        fresh = now - self._memo_at <= self.memo_max_age_s
        lines_key = (res.raw, res.body, tuple(names), res.content_type)
        if fresh and lines_key == self._lines_key:
            text = self._lines
        else:
            text = (
                gauge_lines(res.body, names)
                if res.raw is None
                else gauge_lines_raw(res.raw, names, res.content_type)
            )
            self._lines_key, self._lines = lines_key, text
        key = (text, res.status, res.content_type, default_model)
        if fresh and key == self._memo_key:
            return self._memo
        result = self._reparse.parse(res.status, res.content_type, text)
        samples = self._normalizer.normalize(result, default_model).samples
        self._memo_key, self._memo, self._memo_at = key, samples, now
        return samples

    def _set_type(self, etype: str | None) -> None:
        self._type = etype
        self._normalizer = None
        self._wanted = ()
        self._forget()
        mapping = ENGINE_TYPES.get(etype) if etype else None
        if mapping is None or not mapping.implemented:
            return
        rules = tuple(r for r in mapping.rules if r.canonical in GAUGES and r.kind == "gauge")
        if not rules:
            return
        gauges = dataclasses.replace(
            mapping, rules=rules, derive=None, addon=None, ratios=(), derive_sources=()
        )
        self._normalizer = Normalizer(gauges, self._engine.engine, self._engine.instance)
        # the start time only tells restarts of counters apart: not read here
        self._wanted = tuple(sorted(n for n in gauges.reads() if PROCESS_START_TIME not in n))


def gauge_lines(body: str, names: Iterable[str]) -> str:
    """The lines of ``body`` that belong to the families ``names``, in body order.

    Args:
        body: a Prometheus text exposition.
        names: family (and sample) names, e.g. ``["vllm:num_requests_running"]``.

    Returns:
        Their ``# HELP``/``# TYPE`` lines and sample lines (a name followed by ``{``, a
        space, a tab or the line's end), joined with newlines; ``""`` when none occurs.
        Found by one ``str.find`` pass per name: the cost grows with the names, not the
        lines.
    """
    found: list[tuple[int, str]] = []
    for name in names:
        # one search per name: each hit is kept when it starts a sample line or is the
        # name of a ``# HELP``/``# TYPE`` line (most names occur only on their own lines)
        size = len(name)
        i = body.find(name)
        while i >= 0:
            if body[i + size : i + size + 1] in ("", " ", "\t", "{", "\r", "\n"):
                start = body.rfind("\n", 0, i) + 1
                if i == start or body[start:i] in ("# HELP ", "# TYPE "):
                    end = body.find("\n", i)
                    found.append((start, body[start : end if end >= 0 else len(body)]))
            i = body.find(name, i + size)
    found.sort()
    return "".join(line + "\n" for _, line in found)


_LINE_ENDS: Final = (b"", b" ", b"\t", b"{", b"\r", b"\n")
_HEADS: Final = (b"# HELP ", b"# TYPE ")


def gauge_lines_raw(raw: bytes, names: Iterable[str], content_type: str | None) -> str:
    """:func:`gauge_lines` of an undecoded body: only the lines found are decoded.

    Args:
        raw: the body's bytes.
        names: family (and sample) names, ASCII.
        content_type: the response's ``Content-Type`` (its charset).

    Returns:
        ``gauge_lines(body, names)`` of the body decoded as :func:`~.http.http_get` decodes
        it. For a UTF-8 (or ASCII, or unstated) charset the names are searched in the bytes
        and each line found decoded alone (equal, since a newline never falls inside a
        UTF-8 sequence); any other charset decodes the whole body first.
    """
    if not ascii_compatible(content_type):
        return gauge_lines(HttpResult(200, content_type, "", raw=raw).text(), names)
    found: list[tuple[int, bytes]] = []
    for text in names:
        name = text.encode("ascii")
        size = len(name)
        i = raw.find(name)
        while i >= 0:
            if raw[i + size : i + size + 1] in _LINE_ENDS:
                start = raw.rfind(b"\n", 0, i) + 1
                if i == start or raw[start:i] in _HEADS:
                    end = raw.find(b"\n", i)
                    found.append((start, raw[start : end if end >= 0 else len(raw)]))
            i = raw.find(name, i + size)
    if not found:
        return ""
    found.sort()
    lines = b"\n".join(line for _, line in found)
    return HttpResult(200, content_type, "", raw=lines).text() + "\n"
