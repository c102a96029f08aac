"""Prometheus exposition of the agent's latest snapshot.

:class:`SnapshotCollector` is a ``prometheus_client`` custom collector: every scrape builds
metric families from :meth:`agent.state.AgentState.samples`, typed and documented from the
catalogue, so label sets that vanished from the snapshot disappear from the exposition
without bookkeeping. :func:`render` picks the text format or OpenMetrics from the
``Accept`` header (``prometheus_client.exposition.choose_encoder``).
:class:`ExpositionCache` renders once per change of the state (not once per scrape), per
format, and gzips the body for a scraper that accepts it (Prometheus always does).
"""

from __future__ import annotations

import gzip
import logging
import threading
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from typing import Final

from prometheus_client.core import Metric
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector, CollectorRegistry

from agent.catalogue import CATALOGUE
from agent.samples import Sample
from agent.state import AgentState

log = logging.getLogger(__name__)

_PROM_TYPE = {"gauge": "gauge", "counter": "counter", "histogram": "histogram", "info": "gauge"}


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
        typ = _PROM_TYPE[metric.kind]
        family_name = name.removesuffix("_total") if typ == "counter" else name
        unit = metric.unit if family_name.endswith("_" + metric.unit) else ""
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
    if sample_name in CATALOGUE:
        return None if CATALOGUE[sample_name].kind == "histogram" else sample_name
    for suffix in _HISTOGRAM_SUFFIXES:
        base = sample_name.removesuffix(suffix)
        if base != sample_name and base in CATALOGUE and CATALOGUE[base].kind == "histogram":
            return base
    return None


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


def accepts_gzip(accept_encoding: str | None) -> bool:
    """True when an ``Accept-Encoding`` header accepts gzip (``gzip``/``*``, q > 0).

    Args:
        accept_encoding: the header, e.g. ``"gzip"`` (Prometheus), ``"gzip;q=0, br"``.
    """
    if not accept_encoding:
        return False
    for item in accept_encoding.split(","):
        coding, _, params = item.strip().partition(";")
        if coding.strip().lower() not in ("gzip", "x-gzip", "*"):
            continue
        q = 1.0
        for param in params.split(";"):
            key, _, value = param.strip().partition("=")
            if key.strip().lower() == "q":
                try:
                    q = float(value)
                except ValueError:
                    q = 0.0
        if q > 0:
            return True
    return False


class ExpositionCache:
    """``/metrics`` bodies rendered once per state change and format, gzipped on request.

    A scrape whose state version (:attr:`agent.state.AgentState.version`) and format match
    the last rendering gets the same bytes without rendering again; so does every scraper
    polling faster than the samplers publish (llm-d's endpoint picker polls every 50 ms).
    Holds at most one body per (format, gzip) pair: four.

    Args:
        registry: the registry to render (:func:`make_registry`).
        version: returns the state's current version.
    """

    def __init__(self, registry: CollectorRegistry, version: Callable[[], int]) -> None:
        self._registry = registry
        self._version = version
        self._lock = threading.Lock()
        self._bodies: dict[tuple[str, bool], tuple[int, bytes]] = {}

    def get(self, accept: str | None, accept_encoding: str | None) -> tuple[bytes, str, bool]:
        """Return ``(body, content_type, gzipped)`` for one scrape.

        Args:
            accept: the ``Accept`` header (format, see :func:`render`).
            accept_encoding: the ``Accept-Encoding`` header (:func:`accepts_gzip`).
        """
        encoder, content_type = choose_encoder(accept or "")
        zipped = accepts_gzip(accept_encoding)
        with self._lock:
            version = self._version()
            hit = self._bodies.get((content_type, zipped))
            if hit is not None and hit[0] == version:
                return hit[1], content_type, zipped
            plain = self._bodies.get((content_type, False))
            if plain is not None and plain[0] == version:
                body = plain[1]
            else:
                body = encoder(self._registry)
                self._bodies[(content_type, False)] = (version, body)
            if zipped:
                body = gzip.compress(body, compresslevel=GZIP_LEVEL, mtime=0)
                self._bodies[(content_type, True)] = (version, body)
            return body, content_type, zipped
