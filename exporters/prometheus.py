"""Prometheus exposition of the agent's latest snapshot.

:class:`SnapshotCollector` is a ``prometheus_client`` custom collector: every scrape builds
metric families from :meth:`agent.state.AgentState.samples`, typed and documented from the
catalogue, so label sets that vanished from the snapshot disappear from the exposition
without bookkeeping. :func:`render` picks the text format or OpenMetrics from the
``Accept`` header (``prometheus_client.exposition.choose_encoder``).
:class:`ExpositionCache` renders once per change of the state (not once per scrape), per
format, and gzips the body for a scraper that accepts it (Prometheus always does:
:func:`gzip_acceptable` reads ``Accept-Encoding`` as RFC 9110 12.5.3 says, ``q=0`` included).
"""

from __future__ import annotations

import gzip
import logging
import math
import re
import threading
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from typing import Final

from prometheus_client.core import Metric
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, choose_encoder
from prometheus_client.openmetrics.exposition import CONTENT_TYPE_LATEST as OM_CONTENT_TYPE
from prometheus_client.registry import Collector, CollectorRegistry
from prometheus_client.utils import floatToGoString as _float_to_go

from kvpressure.agent.catalogue import CATALOGUE
from kvpressure.agent.catalogue import Metric as CatalogueMetric
from kvpressure.agent.samples import Sample
from kvpressure.agent.state import AgentState

log = logging.getLogger(__name__)

_PROM_TYPE = {"gauge": "gauge", "counter": "counter", "histogram": "histogram", "info": "gauge"}


def _family(name: str, metric: CatalogueMetric) -> tuple[str, str, str]:
    """Return ``(type, family name, unit)`` of catalogue entry ``name`` as exposed.

    A counter's family drops ``_total``; the unit is declared only when the family name
    ends with it (OpenMetrics), else it is ``""``.
    """
    typ = _PROM_TYPE[metric.kind]
    family = name.removesuffix("_total") if typ == "counter" else name
    unit = metric.unit if metric.unit and family.endswith("_" + metric.unit) else ""
    return typ, family, unit


def families(samples: Iterable[Sample], on_unknown: object = None) -> Iterator[Metric]:
    """Group ``samples`` into ``prometheus_client`` metric families using the catalogue.

    Args:
        samples: samples whose names should all be in :data:`agent.catalogue.CATALOGUE`.
        on_unknown: optional callable invoked once per sample whose name is not in the
            catalogue; such samples are dropped.

    Yields:
        One family per catalogue metric that has samples, in catalogue order. Duplicate
        label sets keep the first sample. Histogram samples are named ``<name>_bucket``
        (with an ``le`` label), ``<name>_count`` and ``<name>_sum``.
    """
    grouped: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]] = defaultdict(dict)
    for s in samples:
        family = _family_of(s.name)
        if family is None:
            if callable(on_unknown):
                on_unknown(s)
            continue
        grouped[family].setdefault((s.name, s.labels), s.value)
    for name, metric in CATALOGUE.items():
        series = grouped.get(name)
        if not series:
            continue
        typ, family_name, unit = _family(name, metric)
        fam = Metric(family_name, metric.help, typ, unit)
        for (sample_name, labels), value in series.items():
            fam.add_sample(sample_name, dict(labels), value)
        yield fam


_HISTOGRAM_SUFFIXES = ("_bucket", "_count", "_sum")


def _family_of(sample_name: str) -> str | None:
    """Return the catalogue metric a sample belongs to, or None when unknown.

    Gauges, counters and info metrics use their catalogue name as the sample name; a
    histogram's samples are ``<name>_bucket`` (with ``le``), ``<name>_count`` and
    ``<name>_sum``.
    """
    try:
        return _FAMILY_OF[sample_name]
    except KeyError:
        pass
    family: str | None = None
    if sample_name in CATALOGUE:
        family = None if CATALOGUE[sample_name].kind == "histogram" else sample_name
    else:
        for suffix in _HISTOGRAM_SUFFIXES:
            base = sample_name.removesuffix(suffix)
            if base != sample_name and base in CATALOGUE and CATALOGUE[base].kind == "histogram":
                family = base
                break
    if len(_FAMILY_OF) >= _FAMILIES_KEPT:  # names outside the catalogue (a bug) stay bounded
        _FAMILY_OF.clear()
    _FAMILY_OF[sample_name] = family
    return family


_FAMILY_OF: dict[str, str | None] = {}
_FAMILIES_KEPT: Final = 4096


class SnapshotCollector(Collector):
    """Collector that renders an :class:`AgentState` on every scrape."""

    def __init__(self, state: AgentState) -> None:
        self._state = state
        self._warned: set[str] = set()

    def _unknown(self, sample: Sample) -> None:
        self._state.count_unknown_sample()
        if sample.name not in self._warned:
            self._warned.add(sample.name)
            log.error(
                "sample name not in the catalogue, dropped", extra={"kv": {"name": sample.name}}
            )

    def collect(self) -> Iterator[Metric]:
        """Yield the current snapshot as metric families."""
        yield from families(self._state.samples(), self._unknown)


def make_registry(state: AgentState) -> CollectorRegistry:
    """Return a registry holding only a :class:`SnapshotCollector` for ``state``."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SnapshotCollector(state))
    return registry


def render(registry: CollectorRegistry, accept: str | None) -> tuple[bytes, str]:
    """Render ``registry`` in the format the ``Accept`` header asks for.

    Returns:
        ``(body, content_type)``: OpenMetrics when ``accept`` names
        ``application/openmetrics-text``, otherwise the Prometheus text format 0.0.4.
    """
    encoder, content_type = choose_encoder(accept or "")
    return encoder(registry), content_type


GZIP_LEVEL: Final = 1
"""gzip level of ``/metrics`` bodies: level 1 already cuts a 50 KB exposition ~8x."""


class ExpositionCache:
    """``/metrics`` bodies rendered once per state change and format, gzipped on request.

    A scrape whose state version (:attr:`agent.state.AgentState.version`) and format match
    the last rendering gets the same bytes without rendering again; so does every scraper
    polling faster than the samplers publish (llm-d's endpoint picker polls every 50 ms).
    Holds one body per (content type, gzip) pair, at most :data:`BODIES_KEPT`.

    The two default formats (text 0.0.4, OpenMetrics with the default escaping) are
    written by :class:`Encoder` (the library's bytes, several times faster); any other,
    or what the encoder declines, by ``prometheus_client`` from ``registry``.

    Args:
        registry: the registry to render (:func:`make_registry` of ``state``).
        state: the agent state (its :attr:`~agent.state.AgentState.version` and samples).
    """

    def __init__(self, registry: CollectorRegistry, state: AgentState) -> None:
        self._registry = registry
        self._state = state
        self._unknown = SnapshotCollector(state)._unknown
        self._encoder = Encoder()
        self._lock = threading.Lock()
        self._bodies: dict[tuple[str, bool], tuple[object, bytes]] = {}
        self._negotiated: dict[
            tuple[str | None, str | None], tuple[Callable[[CollectorRegistry], bytes], str, bool]
        ] = {}

    def _render(self, encoder: Callable[[CollectorRegistry], bytes], content_type: str) -> bytes:
        """The body in ``content_type``: :class:`Encoder` where it applies, else the library."""
        openmetrics = _fast_format(content_type)
        if openmetrics is not None:
            body = self._encoder.encode(self._state.samples(), openmetrics, self._unknown)
            if body is not None:
                return body
        return encoder(self._registry)

    def negotiate(
        self, accept: str | None, accept_encoding: str | None
    ) -> tuple[Callable[[CollectorRegistry], bytes], str, bool]:
        """``(library encoder, content type, gzip)`` for a scrape's two headers.

        The format is ``prometheus_client``'s ``choose_encoder`` of ``accept``; gzip is
        :func:`gzip_acceptable` of ``accept_encoding``. A scraper sends the same two headers
        every time, so the answer is kept per header pair (at most
        :data:`NEGOTIATIONS_KEPT` pairs, then all are forgotten: a client varying its
        headers only costs the parsing again).
        """
        key = (accept, accept_encoding)
        hit = self._negotiated.get(key)
        if hit is None:
            encoder, content_type = choose_encoder(accept or "")
            hit = (encoder, content_type, gzip_acceptable(accept_encoding))
            if len(self._negotiated) >= NEGOTIATIONS_KEPT:
                self._negotiated.clear()
            self._negotiated[key] = hit
        return hit

    def get(self, accept: str | None, accept_encoding: str | None) -> tuple[bytes, str, bool]:
        """Return ``(body, content_type, gzipped)`` for one scrape.

        Args:
            accept: the ``Accept`` header (format, see :func:`render`).
            accept_encoding: the ``Accept-Encoding`` header (:func:`gzip_acceptable`).
        """
        encoder, content_type, zipped = self.negotiate(accept, accept_encoding)
        with self._lock:
            version = self._state.version
            hit = self._bodies.get((content_type, zipped))
            if hit is not None and hit[0] == version:
                return hit[1], content_type, zipped
            if len(self._bodies) >= BODIES_KEPT:
                # the content type carries the version the scraper asked for
                # (``version=1.0.1``): a client varying it must not grow this
                self._bodies.clear()
            plain = self._bodies.get((content_type, False))
            if plain is not None and plain[0] == version:
                body = plain[1]
            else:
                body = self._render(encoder, content_type)
                self._bodies[(content_type, False)] = (version, body)
            if zipped:
                body = gzip.compress(body, compresslevel=GZIP_LEVEL, mtime=0)
                self._bodies[(content_type, True)] = (version, body)
            return body, content_type, zipped


BODIES_KEPT: Final = 8
"""Most bodies :class:`ExpositionCache` keeps (per content type and gzip; the usual are four)."""


NEGOTIATIONS_KEPT: Final = 64
"""Most ``(Accept, Accept-Encoding)`` pairs :meth:`ExpositionCache.negotiate` remembers."""

_GZIP_CODINGS: Final = frozenset(("gzip", "x-gzip"))


def gzip_acceptable(accept_encoding: str | None) -> bool:
    """Whether a response may be gzipped for this ``Accept-Encoding`` header (RFC 9110 12.5.3).

    Each listed coding has a weight (``q``, 0 to 1, default 1); ``q=0`` means "not
    acceptable". gzip (or its alias ``x-gzip``, 8.4.1.3) is acceptable when it is listed
    with a weight above 0, or, not listed, when ``*`` is; and it is chosen unless
    ``identity`` (no coding) is listed with a higher weight. A coding whose weight is not
    a number from 0 to 1 counts as not listed. ``prometheus_client``'s ``gzip_accepted``
    reads the name only, so ``gzip;q=0`` got a gzipped body.

    Args:
        accept_encoding: the header's value; ``None`` or empty: no coding asked for.

    Returns:
        True to send ``Content-Encoding: gzip``; False for the plain body.
    """
    if not accept_encoding:
        return False
    weights: dict[str, float] = {}
    for element in accept_encoding.split(","):
        coding, *params = element.split(";")
        coding = coding.strip().lower()
        q = 1.0
        for param in params:
            name, _, value = param.partition("=")
            if name.strip().lower() == "q":
                try:
                    q = float(value.strip())
                except ValueError:
                    q = math.nan
        if coding and 0.0 <= q <= 1.0:  # NaN compares False: a bad weight is not listed
            weights.setdefault("gzip" if coding in _GZIP_CODINGS else coding, q)
    q_gzip = weights.get("gzip", weights.get("*", 0.0))
    return q_gzip > 0.0 and q_gzip >= weights.get("identity", weights.get("*", 0.0))


_LEGACY_LABEL_NAME: Final = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
_OM_ONLY_SUFFIXES: Final = ("_created", "_gsum", "_gcount")
_PREFIXES_KEPT: Final = 65536


def _fast_format(content_type: str) -> bool | None:
    """True for OpenMetrics, False for text 0.0.4, None for another escaping (library)."""
    if content_type == CONTENT_TYPE_PLAIN_0_0_4:
        return False
    if content_type == OM_CONTENT_TYPE or (
        content_type.startswith("application/openmetrics-text;")
        and content_type.endswith("escaping=underscores")
    ):
        return True
    return None


def _go(value: float) -> str:
    """``prometheus_client``'s own value formatting (``+Inf``, ``1e+06``)."""
    return str(_float_to_go(value))  # type: ignore[no-untyped-call]


def _escape_value(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


_CATALOGUE_ORDER: Final = {name: i for i, name in enumerate(CATALOGUE)}


def _family_head(name: str, openmetrics: bool) -> tuple[str, str]:
    """``(family name, its HELP/TYPE(/UNIT) lines)`` of catalogue metric ``name``.

    The lines are ``""`` when the family name is not a legacy name (:class:`Encoder`
    leaves such a family to the library).
    """
    metric = CATALOGUE[name]
    typ, family, unit = _family(name, metric)
    if not _LEGACY_LABEL_NAME.fullmatch(family):
        return family, ""
    if openmetrics:
        text = f"# HELP {family} {_escape_value(metric.help)}\n# TYPE {family} {typ}\n"
        return family, text + (f"# UNIT {family} {unit}\n" if unit else "")
    mname = family + "_total" if typ == "counter" else family
    doc = metric.help.replace("\\", r"\\").replace("\n", r"\n")
    return family, f"# HELP {mname} {doc}\n# TYPE {mname} {typ}\n"


class Encoder:
    """Writes samples as ``prometheus_client``'s encoders write :func:`families` of them.

    Prometheus text format 0.0.4 or OpenMetrics 1.0, byte for byte the library's output.
    The library re-escapes every name character by character and builds a ``Metric`` and
    a ``Sample`` per series on every scrape (about 8 us per series); this writes each
    series' ``name{labels}`` once, keeps it (at most 65,536 kept, then rebuilt), and per
    scrape only formats the values (``floatToGoString``, the library's own). It covers
    the names the catalogue uses (legacy metric and label names, no OpenMetrics-only
    ``_created``/``_gsum``/``_gcount`` samples); for anything else :meth:`encode` returns
    ``None`` and the caller uses the library. ``tests/test_exporter.py`` proves the
    equality on live agent states and generated ones.
    """

    def __init__(self) -> None:
        # per series: its ``name{labels}`` prefix, and its last line with the value it was
        # written for (a value that did not change since the last rendering, most of a
        # node's series, is not formatted again)
        self._lines: dict[tuple[str, tuple[tuple[str, str], ...]], tuple[str, float, str]] = {}
        # per (catalogue name, OpenMetrics): the family name and its HELP/TYPE/UNIT lines
        self._heads: dict[tuple[str, bool], tuple[str, str]] = {}

    def encode(
        self,
        samples: Iterable[Sample],
        openmetrics: bool,
        on_unknown: Callable[[Sample], None] | None = None,
    ) -> bytes | None:
        """Render ``samples``.

        Args:
            samples: the snapshot's samples (catalogue names; others are dropped and
                passed to ``on_unknown``, as :func:`families` does).
            openmetrics: True for OpenMetrics 1.0 (``# EOF`` terminated), False for the
                text format 0.0.4.
            on_unknown: called once per sample whose name is not in the catalogue.

        Returns:
            The UTF-8 body, or ``None`` when a name is outside what this encoder writes.
        """
        grouped: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]] = {}
        for s in samples:
            family = _family_of(s.name)
            if family is None:
                if on_unknown is not None:
                    on_unknown(s)
                continue
            series = grouped.get(family)
            if series is None:
                series = grouped[family] = {}
            series.setdefault((s.name, s.labels), s.value)
        if len(self._lines) > _PREFIXES_KEPT:
            self._lines.clear()
        lines = self._lines
        heads = self._heads
        out: list[str] = []
        for name in sorted(grouped, key=_CATALOGUE_ORDER.__getitem__):
            series = grouped[name]
            head = heads.get((name, openmetrics))
            if head is None:
                head = heads[(name, openmetrics)] = _family_head(name, openmetrics)
            family, text = head
            if not text:
                return None
            out.append(text)
            for key, value in series.items():
                last = lines.get(key)
                if last is None:
                    prefix = self._line_prefix(key, family)
                    if prefix is None:
                        return None
                else:
                    prefix, was, line = last
                    if was == value and (
                        value or math.copysign(1.0, value) == math.copysign(1.0, was)
                    ):
                        out.append(line)  # the same value (a zero of the same sign)
                        continue
                line = f"{prefix} {_go(value)}\n"
                lines[key] = (prefix, value, line)
                out.append(line)
        if openmetrics:
            out.append("# EOF\n")
        return "".join(out).encode("utf-8")

    @staticmethod
    def _line_prefix(key: tuple[str, tuple[tuple[str, str], ...]], family: str) -> str | None:
        name, labels = key
        if not _LEGACY_LABEL_NAME.fullmatch(name) or name in (
            family + sfx for sfx in _OM_ONLY_SUFFIXES
        ):
            return None
        if not labels:
            return name
        items = sorted(dict(labels).items())
        if any(not _LEGACY_LABEL_NAME.fullmatch(k) or k.startswith("__") for k, _ in items):
            return None
        inner = ",".join(f'{k}="{_escape_value(v)}"' for k, v in items)
        return f"{name}{{{inner}}}"
