"""The unit of data that flows from samplers to the core: :class:`Sample` and :class:`Batch`.

A sample is one value of one series: a catalogue metric name, a float in the metric's
base unit, and a sorted tuple of ``(label, value)`` pairs. Samplers never build samples
for values they do not have: :meth:`Batch.add` silently drops ``None`` and NaN, so
"missing" is always "absent" and never ``0`` or ``NaN`` in the agent's output.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final, Literal, NamedTuple

if TYPE_CHECKING:
    from kvpressure.agent.catalogue import SampleName

Labels = tuple[tuple[str, str], ...]
"""Label pairs sorted by label name, e.g. ``(("engine", "vllm"), ("instance", "h:8000"))``."""


def make_labels(labels: dict[str, str | None]) -> Labels:
    """Return ``labels`` as a sorted tuple, dropping labels whose value is ``None`` or empty.

    Args:
        labels: label name to value.

    Returns:
        Sorted ``(name, value)`` pairs; empty values are dropped because Prometheus
        treats an empty label value as an absent label.
    """
    return tuple(sorted((k, str(v)) for k, v in labels.items() if v is not None and v != ""))


_LABELS: dict[tuple[tuple[str, object], ...], Labels] = {}
"""Keyword labels as given (name, value pairs in call order) -> :func:`make_labels` of them:
a sampler adds the same label sets every cycle. Shared by every batch; bounded."""
_LABELS_KEPT: Final = 16384
_isfinite: Final = math.isfinite


class Sample(NamedTuple):
    """One value of one series (a named tuple: immutable, and built at C speed).

    Samplers build thousands a second (the 8-GPU node: about 8,000), and a named tuple is
    built in less than half the time of a frozen dataclass (0.35 against 0.8 µs here).
    Two samples are equal when their name, value and labels are.

    Attributes:
        name: the catalogue sample name (``kvpressure_*``), typed by
            :data:`agent.catalogue.SampleName` so a misspelt name fails ``mypy``.
        value: the value in the metric's base unit (bytes, seconds, ratio 0-1, count).
        labels: sorted label pairs (see :func:`make_labels`).
    """

    name: SampleName
    value: float
    labels: Labels = ()


SourceState = Literal["ok", "error", "unsupported"]
"""A source's health in one cycle (:class:`SourceStatus`)."""


class SourceStatus(NamedTuple):
    """Health of one data source inside a sampler (one /proc file, one HTTP endpoint).

    A named tuple, as :class:`Sample` (every sampler records one per source per cycle).

    Attributes:
        source: short source name, e.g. ``"psi"`` or ``"diskstats"``.
        state: ``"ok"``, ``"error"`` (failed this cycle) or ``"unsupported"`` (the system
            does not have it; logged once, not retried every cycle).
        reason: a short machine-readable reason (``"kernel_without_psi"``, ``"http_500"``);
            empty when ``state`` is ``"ok"``.
    """

    source: str
    state: SourceState
    reason: str = ""


@dataclass(slots=True)
class Batch:
    """The samples and source statuses a sampler produced in one cycle.

    A sampler fills a batch through :meth:`add`; a source that failed is recorded with
    :meth:`source_error` and the rest of the batch is still used (partial results are
    results).

    Attributes:
        samples: every sample of the cycle, the :meth:`held` ones last.
        sources: one status per source.
        held: how many of the last ``samples`` repeat an earlier cycle's reading of a
            source read less often than the sampler's interval (:meth:`hold`).
    """

    samples: list[Sample] = field(default_factory=list)
    sources: list[SourceStatus] = field(default_factory=list)
    held: int = 0

    def add(self, name: SampleName, value: float | int | None, /, **labels: str | None) -> None:
        """Append a sample unless ``value`` is missing.

        Args:
            name: catalogue metric name.
            value: value in base units; ``None``, NaN and infinities are dropped.
            **labels: label values; ``None`` or empty values are left out.
        """
        if value is None:
            return
        v = float(value)
        if not _isfinite(v):
            return
        key = tuple(labels.items())
        try:
            got = _LABELS.get(key)
        except TypeError:  # an unhashable value: sorted as given, not kept
            got = make_labels(labels)
        if got is None:
            got = make_labels(labels)
            if len(_LABELS) >= _LABELS_KEPT:
                _LABELS.clear()  # bounded: churning label values are sorted again
            _LABELS[key] = got
        self.samples.append(Sample(name, v, got))

    def add_labelled(self, name: SampleName, value: float | int | None, labels: Labels, /) -> None:
        """:meth:`add` with labels already built by :func:`make_labels`.

        For samplers that keep one label tuple per series across cycles (a GPU's
        ``gpu``/``uuid``/``mig`` set) instead of sorting keyword labels every cycle.

        Args:
            name: catalogue metric name.
            value: value in base units; ``None``, NaN and infinities are dropped.
            labels: sorted label pairs without empty values (:func:`make_labels`).
        """
        if value is None:
            return
        v = float(value)
        if not _isfinite(v):
            return
        self.samples.append(Sample(name, v, labels))

    def extend(self, samples: Iterable[Sample]) -> None:
        """Append samples built earlier (a sampler's cached, unchanged series).

        Args:
            samples: samples whose values are finite (each built through the typed
                :class:`Sample`, so its name is a catalogue :data:`SampleName`).
        """
        self.samples.extend(samples)

    def hold(self, samples: Sequence[Sample], sources: Iterable[SourceStatus] = ()) -> None:
        """Append the last reading of a source this cycle did not read again.

        A source read less often than its sampler (the host's disks and network, every
        second while memory and PSI are read ten times a second) repeats its last samples
        and statuses in the cycles between its reads, so ``/metrics`` and the derived
        stages' latest values keep them. They are not new points: :meth:`recorded` leaves
        them out, so the timeline keeps only the times they were read, and a counter's rate
        over a short window spans the reads around it (not a step to zero and back).

        Call it after every :meth:`add` of the cycle: the held samples are the batch's last.

        Args:
            samples: samples the sampler produced at an earlier read, unchanged.
            sources: the statuses recorded at that read.
        """
        self.samples.extend(samples)
        self.held += len(samples)
        self.sources.extend(sources)

    def recorded(self) -> list[Sample]:
        """The samples read this cycle: every sample but the :meth:`hold` ones (the timeline's)."""
        return self.samples[: len(self.samples) - self.held] if self.held else self.samples

    def source_ok(self, source: str) -> None:
        """Record that ``source`` was read successfully this cycle."""
        self.sources.append(SourceStatus(source, "ok"))

    def source_error(self, source: str, reason: str) -> None:
        """Record that ``source`` failed this cycle with a short ``reason``."""
        self.sources.append(SourceStatus(source, "error", reason))

    def source_unsupported(self, source: str, reason: str) -> None:
        """Record that ``source`` does not exist on this system (``reason`` says why)."""
        self.sources.append(SourceStatus(source, "unsupported", reason))

    def __iter__(self) -> Iterator[Sample]:
        return iter(self.samples)

    def __len__(self) -> int:
        return len(self.samples)
