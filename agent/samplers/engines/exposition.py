"""Fetch-independent parsing of an engine's ``/metrics`` response.

Parsing is ``prometheus_client``'s two parsers:
``prometheus_client.parser.text_string_to_metric_families`` (Prometheus text format 0.0.4) and
``prometheus_client.openmetrics.parser.text_string_to_metric_families`` (OpenMetrics 1.0),
with one fast path in front of the text parser (:func:`parse_text`, at the end of this
module): the strict subset of the text format engines write, read with compiled regular
expressions and proven equal to the library by ``tests/test_engines_fastparse.py``; any
body it does not accept goes to the library. What this module adds around them:

* **Skipping**: a sampler that knows its engine's mapping passes ``wanted`` (the family
  names the mapping reads, :func:`wanted_families`); other families are not kept (on the
  fast path their labels are never parsed) and only their samples are counted
  (:attr:`ParseResult.skipped_samples`), the same on both paths.
* **Format choice** (case 18): the ``Content-Type`` decides (``application/openmetrics-text``
  selects OpenMetrics); as a safety net a body whose last non-empty line is ``# EOF``, or
  with a sample line containing ``" # {"`` (an exemplar), is parsed as OpenMetrics whatever
  the header says.
* **Line-level recovery** (cases 15, 17): ``prometheus_client``'s parsers raise on the first
  bad line and drop the rest of the body. On failure the body is split into family blocks
  (a new block starts at a ``# HELP``/``# TYPE`` line for a new name, or at a sample whose
  name does not belong to the current family) and each block is parsed on its own; a
  block that still fails is parsed line by line (each sample line with the block's
  ``# HELP``/``# TYPE`` header, then alone). Only the lines that fail alone are lost, and
  each one counts as one parse error (a failing block costs at least one).
* **Values**: ``NaN`` in any spelling (``NaN``, ``nan``, ``-nan``; case 12) means "no
  value" and the sample is dropped; infinities are kept here (a histogram's ``+Inf``
  bucket is a label, a ``+Inf`` value is left to the normalizer to skip). Sample
  timestamps are ignored; OpenMetrics exemplars are kept.
* **Response classification** (case 20): a non-2xx status is reason ``http_<code>`` and
  the body is not parsed; an empty 2xx body is usable with 0 samples (reason ``empty``);
  a JSON content type, a body starting with ``{``/``[`` (JSON) or ``<`` (HTML), or any
  body that yields no family at all, is reason ``not_exposition``. An OpenMetrics body
  without its final ``# EOF`` (truncated) is parsed as far as it goes and counts one
  parse error.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Final, Literal, NamedTuple

from prometheus_client.metrics_core import Metric
from prometheus_client.openmetrics.parser import (
    text_string_to_metric_families as _om_families,
)
from prometheus_client.parser import text_string_to_metric_families as _text_families

Format = Literal["text", "openmetrics"]

MAX_ERRORS_KEPT: Final = 50
"""At most this many :class:`ParseError` details are kept per response (all are counted)."""

MAX_FAILED_LINES: Final = 1000
"""Line-level recovery gives up (reason ``not_exposition``) after this many failed lines
with nothing parsed: a large HTML or log page must not cost a parse attempt per line."""

_ERROR_TEXT_BYTES: Final = 200
_OM_EOF: Final = "# EOF"
_NAME_END: Final = re.compile(r"[{ \t]")
# Suffixes a sample may carry on top of its family name (text and OpenMetrics).
_FAMILY_SUFFIXES: Final = (
    "_total",
    "_bucket",
    "_count",
    "_sum",
    "_created",
    "_gcount",
    "_gsum",
    "_info",
)

REASON_EMPTY: Final = "empty"
REASON_NOT_EXPOSITION: Final = "not_exposition"


@dataclass(frozen=True, slots=True)
class Exemplar:
    """An OpenMetrics exemplar attached to a sample.

    Attributes:
        labels: the exemplar's labels, e.g. ``{"trace_id": "0af7..."}``.
        value: the exemplar's observed value (in the family's unit).
    """

    labels: Mapping[str, str]
    value: float


class LabelSet(dict[str, str]):
    """The labels of the samples written with one label text: a read-only ``dict``.

    :func:`parse_text` parses each distinct label text once and gives every sample written
    with it (in this scrape and the next ones) the same instance, so whatever is derived
    from a sample's labels is derived once per text, not once per sample. Equal to, and
    read like, the plain ``dict`` ``prometheus_client`` gives (``dict(labels)`` copies it);
    writing raises ``TypeError`` since the instance is shared.

    Args:
        pairs: ``(label name, unescaped value)`` pairs, names unique.

    Attributes:
        pairs: the pairs sorted by label name: with the sample name, the series' identity
            (what :class:`~agent.samplers.engines.normalize.MetricIndex` keys series by).
        bucket: ``(pairs without le, le)`` of a histogram bucket sample, what
            :func:`bucket_key` gives; ``le`` is :func:`parse_le` of the ``le`` label
            (``None`` when absent or not a number). Worked out when the set is built (once
            per label text), a plain attribute so a reader of many samples can fetch it
            with :func:`operator.attrgetter`.
    """

    __slots__ = ("bucket", "pairs")

    def __init__(self, pairs: Iterable[tuple[str, str]] = ()) -> None:
        super().__init__(pairs)
        self.pairs: tuple[tuple[str, str], ...] = tuple(sorted(super().items()))
        self.bucket: tuple[tuple[tuple[str, str], ...], float | None] = (
            (tuple([p for p in self.pairs if p[0] != "le"]), parse_le(self.get("le")))
            if "le" in self
            else (self.pairs, None)
        )

    def _read_only(self, *_args: object, **_kwargs: object) -> None:
        raise TypeError("LabelSet is shared by every sample with these labels: copy it first")

    __setitem__ = __delitem__ = update = setdefault = clear = _read_only  # type: ignore[assignment]
    pop = popitem = __ior__ = _read_only  # type: ignore[assignment]


def parse_le(value: str | None) -> float | None:
    """The bound of a histogram bucket's ``le`` label value.

    Args:
        value: the label value (``"0.5"``, ``"+Inf"``), or ``None``.

    Returns:
        The bound as a float (``inf`` for ``+Inf``), ``None`` when absent, not a number, or
        NaN.
    """
    if value is None:
        return None
    try:
        le = float(value)
    except ValueError:
        return None
    return None if math.isnan(le) else le


def label_pairs(labels: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    """The label pairs of ``labels`` sorted by name (kept on a :class:`LabelSet`).

    Args:
        labels: a sample's labels, a :class:`LabelSet` or any mapping.
    """
    if type(labels) is LabelSet:
        return labels.pairs
    return tuple(sorted(labels.items()))


def bucket_key(labels: Mapping[str, str]) -> tuple[tuple[tuple[str, str], ...], float | None]:
    """``(sorted pairs without le, parsed le)`` of a bucket sample's labels.

    Args:
        labels: a sample's labels, a :class:`LabelSet` (computed once) or any mapping.
    """
    if type(labels) is LabelSet:
        return labels.bucket
    return (
        tuple(sorted((k, v) for k, v in labels.items() if k != "le")),
        parse_le(labels.get("le")),
    )


class ParsedSample(NamedTuple):
    """One sample line as the engine wrote it (after unescaping); a named tuple, cheap to build.

    Attributes:
        name: the sample name, e.g. ``vllm:prompt_tokens_total`` or ``x_bucket``.
        labels: label name to unescaped value (a shared, read-only :class:`LabelSet` from
            the fast path; a ``dict`` from ``prometheus_client``).
        value: the value as a float; never NaN (NaN samples are dropped), may be ±inf.
        exemplar: the OpenMetrics exemplar, if the line had one.
    """

    name: str
    labels: Mapping[str, str]
    value: float
    exemplar: Exemplar | None = None


@dataclass(slots=True)
class ParsedFamily:
    """One metric family.

    Attributes:
        name: the family name as ``prometheus_client`` reports it (for counters, without
            the ``_total`` suffix, e.g. ``vllm:prompt_tokens``).
        type: ``counter``, ``gauge``, ``histogram``, ``summary``, ``untyped``, ``unknown``,
            ``info``, ``stateset`` or ``gaugehistogram``, as declared by the engine.
        help: the HELP text ("" when absent).
        samples: the family's samples, NaN values already dropped.
    """

    name: str
    type: str
    help: str
    samples: list[ParsedSample] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class ParseError:
    """A line (or block) that could not be parsed and was skipped.

    Attributes:
        line: 1-based line number in the body.
        text: the line, truncated to 200 characters.
        message: the parser's message, truncated to 200 characters.
        key: a short stable key for log-once, the metric name the line starts with.
    """

    line: int
    text: str
    message: str
    key: str


@dataclass(slots=True)
class ParseResult:
    """The outcome of one metrics response.

    Attributes:
        families: parsed families, in body order.
        reason: ``""`` for a usable exposition; ``"empty"`` (usable, nothing in it);
            ``"not_exposition"``, ``"http_<code>"``, or a transport reason
            (``"connect"``, ``"timeout"``, ...) when unusable.
        format: the parser used, ``"text"`` or ``"openmetrics"``; ``None`` when not parsed.
        error_count: lines or blocks skipped as unparsable.
        errors: details of the first :data:`MAX_ERRORS_KEPT` errors.
        skipped_families: families not in the caller's ``wanted`` set, not kept.
        skipped_samples: their samples (NaN excluded), counted in :attr:`sample_count`.
        shape: ``None``, or a token :class:`Reparse` gives every result it built from one
            template: results with the same token (``is``) have the same families (names,
            types, HELP) with, in each, samples of the same names and the very same label
            objects in the same order; only the values differ. So what a reader derives
            from a result's structure alone (:class:`~.normalize.Normalizer`) holds for every
            result of that token. Not compared by ``==``.
    """

    families: list[ParsedFamily] = field(default_factory=list)
    reason: str = ""
    format: Format | None = None
    error_count: int = 0
    errors: list[ParseError] = field(default_factory=list)
    skipped_families: int = 0
    skipped_samples: int = 0
    shape: object | None = field(default=None, compare=False)

    @property
    def usable(self) -> bool:
        """True when the engine answered with exposition (possibly empty): engine up."""
        return self.reason in ("", REASON_EMPTY)

    @property
    def sample_count(self) -> int:
        """Samples in the body, skipped families' included (NaN and unparsable excluded)."""
        return sum(len(f.samples) for f in self.families) + self.skipped_samples

    def family_names(self) -> list[str]:
        """Return the family names, in body order."""
        return [f.name for f in self.families]

    def _error(self, line: int, text: str, message: str) -> None:
        self.error_count += 1
        if len(self.errors) < MAX_ERRORS_KEPT:
            self.errors.append(
                ParseError(
                    line,
                    text[:_ERROR_TEXT_BYTES],
                    message[:_ERROR_TEXT_BYTES],
                    _sample_name(text) or "?",
                )
            )


def failed(reason: str) -> ParseResult:
    """Return an unusable :class:`ParseResult` with ``reason`` and nothing parsed.

    Args:
        reason: e.g. ``"connect"``, ``"timeout"``, ``"http_500"``.
    """
    return ParseResult(reason=reason)


def choose_format(body: str, content_type: str | None) -> Format:
    """Pick the parser for ``body`` (case 18).

    Args:
        body: the response body.
        content_type: the ``Content-Type`` header, or ``None``.

    Returns:
        ``"openmetrics"`` when the content type is ``application/openmetrics-text``, the
        last non-empty line is ``# EOF``, or a sample line carries an exemplar
        (``" # {"``); ``"text"`` otherwise.
    """
    if content_type and content_type.split(";", 1)[0].strip().lower() == (
        "application/openmetrics-text"
    ):
        return "openmetrics"
    if _ends_with_eof(body):
        return "openmetrics"
    if " # {" in body:
        for line in body.splitlines():
            s = line.lstrip()
            if s and not s.startswith("#") and " # {" in s:
                return "openmetrics"
    return "text"


def is_json_response(body: str, content_type: str | None) -> bool:
    """Return True when the response is JSON rather than exposition (case 20).

    Args:
        body: the response body.
        content_type: the ``Content-Type`` header, or ``None``.
    """
    if content_type:
        mime = content_type.split(";", 1)[0].strip().lower()
        if mime == "application/json" or mime.endswith("+json"):
            return True
    return body.lstrip()[:1] in ("{", "[")


def classify_response(
    status: int, content_type: str | None, body: str, wanted: frozenset[str] | None = None
) -> ParseResult:
    """Classify and parse one HTTP response from a metrics endpoint (case 20).

    Args:
        status: the HTTP status code.
        content_type: the ``Content-Type`` header, or ``None``.
        body: the decoded body.
        wanted: family names to keep (see :func:`parse_exposition`); ``None`` for all.

    Returns:
        ``http_<status>`` (body not parsed) for a non-2xx status, else
        :func:`parse_exposition`'s result. Never raises.
    """
    if not 200 <= status < 300:
        return failed(f"http_{status}")
    return parse_exposition(body, content_type, wanted)


def parse_exposition(
    body: str,
    content_type: str | None,
    wanted: frozenset[str] | None = None,
    *,
    fast_path: bool = True,
) -> ParseResult:
    """Parse a metrics body into families, recovering from bad lines.

    Args:
        body: the decoded response body (Prometheus text or OpenMetrics).
        content_type: the response ``Content-Type``, or ``None``; see :func:`choose_format`.
        wanted: family names to keep (:func:`wanted_families`); ``None`` keeps every family.
            Other families are dropped and their samples counted in ``skipped_samples``.
        fast_path: False parses with ``prometheus_client`` only (tests and benchmarks
            compare both paths).

    Returns:
        A :class:`ParseResult`. ``reason`` is ``"empty"`` for a blank body and
        ``"not_exposition"`` for JSON, HTML, or a body of which no line parsed. Never raises:
        any exception from ``prometheus_client`` is caught and costs only the lines it
        came from (counted in ``error_count``).
    """
    if not body.strip():
        return ParseResult(reason=REASON_EMPTY)
    if is_json_response(body, content_type) or body.lstrip().startswith("<"):
        return ParseResult(reason=REASON_NOT_EXPOSITION)  # JSON, HTML or XML
    fmt = choose_format(body, content_type)
    result = ParseResult(format=fmt)
    fast = parse_text(body, wanted) if fast_path and fmt == "text" else None
    if fast is not None:
        result.families = fast.families
        result.skipped_families = fast.skipped_families
        result.skipped_samples = fast.skipped_samples
        if not result.families and not result.skipped_families:
            result.reason = REASON_NOT_EXPOSITION
        return result
    metrics = _parse_whole(body, fmt)
    if metrics is None and fmt == "openmetrics" and not _declares_openmetrics(content_type):
        # The safety net picked OpenMetrics for a body the server calls text; a
        # classic-format body that merely contains " # {" in a label value still parses.
        metrics = _parse_whole(body, "text")
        if metrics is not None:
            result.format = "text"
    if result.format == "openmetrics" and not _ends_with_eof(body):
        result._error(body.count("\n") + 1, "", "OpenMetrics body without # EOF (truncated?)")
    if metrics is None:
        metrics = _parse_blocks(body, fmt, result)
    for m in metrics:
        family = _convert(m)
        if wanted is None or family.name in wanted:
            result.families.append(family)
        else:
            result.skipped_families += 1
            result.skipped_samples += len(family.samples)
    if not result.families and not result.skipped_families:
        result.reason = REASON_NOT_EXPOSITION
    return result


def _declares_openmetrics(content_type: str | None) -> bool:
    return content_type is not None and "openmetrics" in content_type.lower()


def _ends_with_eof(body: str) -> bool:
    """True when the last non-empty line is ``# EOF`` (OpenMetrics' terminator)."""
    return body.rstrip().rsplit("\n", 1)[-1].strip() == _OM_EOF


def _parser(fmt: Format) -> Callable[[str], Iterable[Metric]]:
    return _om_families if fmt == "openmetrics" else _text_families


def _parse_whole(body: str, fmt: Format) -> list[Metric] | None:
    """Parse the whole body at once; ``None`` when the parser raised anywhere."""
    text = body
    if fmt == "openmetrics":
        if not _ends_with_eof(body):
            return None
        text = "\n".join(ln for ln in body.splitlines() if ln.strip()) + "\n"
    elif not text.endswith("\n"):
        text += "\n"
    try:
        return list(_parser(fmt)(text))
    except Exception:  # noqa: BLE001 - any parser failure means "use the slow path"
        return None


@dataclass(slots=True)
class _Block:
    name: str | None
    header: list[tuple[int, str]] = field(default_factory=list)
    samples: list[tuple[int, str]] = field(default_factory=list)
    sample_base: str | None = None


def _sample_name(line: str) -> str:
    """The metric name a sample line starts with ("" when there is none)."""
    return _NAME_END.split(line.strip(), maxsplit=1)[0]


def _belongs(sample_name: str, family: str) -> bool:
    if sample_name == family:
        return True
    return sample_name.startswith(family) and sample_name[len(family) :] in _FAMILY_SUFFIXES


def _split_blocks(body: str) -> list[_Block]:
    """Split a body into family blocks by HELP/TYPE boundaries and metric-name changes."""
    blocks: list[_Block] = []
    cur: _Block | None = None
    for lineno, raw in enumerate(body.splitlines(), 1):
        line = raw.strip()
        if not line or line == _OM_EOF:
            continue
        if line.startswith("#"):
            parts = line.split(None, 3)
            if len(parts) >= 3 and parts[1] in ("HELP", "TYPE", "UNIT"):
                name = parts[2]
                if cur is None or cur.name != name:
                    cur = _Block(name)
                    blocks.append(cur)
                cur.header.append((lineno, line))
            # other comments carry nothing
            continue
        sname = _sample_name(line)
        if cur is not None and cur.name is not None and _belongs(sname, cur.name):
            cur.samples.append((lineno, line))
            continue
        if cur is not None and cur.name is None and cur.sample_base == sname:
            cur.samples.append((lineno, line))
            continue
        cur = _Block(None, sample_base=sname)
        cur.samples.append((lineno, line))
        blocks.append(cur)
    return blocks


def _try_parse(lines: list[str], fmt: Format) -> list[Metric] | None:
    text = "\n".join(lines) + "\n"
    if fmt == "openmetrics":
        text += _OM_EOF + "\n"
    try:
        return list(_parser(fmt)(text))
    except Exception:  # noqa: BLE001 - caller falls back to a finer grain
        return None


def _parse_blocks(body: str, fmt: Format, result: ParseResult) -> list[Metric]:
    """Parse block by block, then line by line inside a block that fails."""
    out: list[Metric] = []
    for block in _split_blocks(body):
        if _hopeless(out, result):
            break
        header = [ln for _, ln in block.header]
        parsed = _try_parse(header + [ln for _, ln in block.samples], fmt)
        if parsed is not None:
            out.extend(parsed)
            continue
        before = result.error_count
        header_failed = False
        merged: dict[tuple[str, str], Metric] = {}
        for lineno, line in block.samples:
            if not merged and _hopeless(out, result):
                break
            got = _try_parse([*header, line], fmt)
            if got is None:
                got = _try_parse([line], fmt)
                if got is not None:
                    header_failed = True
            if got is None:
                result._error(lineno, line, _reason(line, fmt))
                continue
            for m in got:
                key = (m.name, m.type)
                if key in merged:
                    merged[key].samples.extend(m.samples)
                else:
                    merged[key] = m
        if header_failed or (result.error_count == before and block.header):
            # The header itself was bad, or the lines only fail together: one error.
            lineno, text = block.header[0] if block.header else block.samples[0]
            result._error(lineno, text, "family rejected as a whole")
        elif result.error_count == before:
            lineno, text = block.samples[0]
            result._error(lineno, text, "block rejected as a whole")
        out.extend(merged.values())
    return out


def _hopeless(parsed: list[Metric], result: ParseResult) -> bool:
    """True when nothing parsed yet and :data:`MAX_FAILED_LINES` lines failed: give up."""
    return not parsed and result.error_count >= MAX_FAILED_LINES


def _reason(line: str, fmt: Format) -> str:
    """Best-effort parser message for one failing line (for the log)."""
    try:
        list(_parser(fmt)(line + "\n" + (_OM_EOF + "\n" if fmt == "openmetrics" else "")))
    except Exception as exc:  # noqa: BLE001 - we only want the message
        return f"{type(exc).__name__}: {exc}"
    return "rejected with its family header"


def _convert(metric: Metric) -> ParsedFamily:
    samples: list[ParsedSample] = []
    for s in metric.samples:
        try:
            value = float(s.value)
        except OverflowError:  # an integer literal beyond a float: as float("1e999") reads
            value = math.inf if s.value > 0 else -math.inf
        except (TypeError, ValueError):
            continue
        if math.isnan(value):
            continue  # case 12: NaN / -nan is "no value"
        ex = None
        if s.exemplar is not None:
            try:
                ex = Exemplar(dict(s.exemplar.labels), float(s.exemplar.value))
            except (TypeError, ValueError):
                ex = None
        samples.append(ParsedSample(s.name, dict(s.labels), value, ex))
    return ParsedFamily(metric.name, metric.type, metric.documentation or "", samples)


# -- the fast path of the text parser ------------------------------------------------------
#
# The fast path of the Prometheus text-format parser, equal to ``prometheus_client``'s.
#
# ``prometheus_client.parser.text_string_to_metric_families`` scans every label character by
# character in Python (about 480 ms per MB of exposition on a 2-core VM, more than a 1 s
# sampling interval for a LoRA-heavy vLLM). :func:`parse_text` reads the same format with a
# few compiled regular expressions per line and gives **the same families** (names, types,
# HELP, samples, values; NaN samples dropped as :func:`~.exposition.parse_exposition` does),
# for the strict subset of the format that engines write:
#
# * a sample line is ``name``, optionally ``{label="value",...}`` (no spaces around ``=`` or
#   ``,``, an optional trailing comma, legacy label names not starting with ``__``, no label
#   repeated), one space, a number (``1``, ``-2.5e-3``, ``+Inf``, ``NaN``, at most 64
#   characters), and optionally one space and a timestamp;
# * a ``# HELP``/``# TYPE`` line names its family with a legacy metric name (no quotes, no
#   backslash) and a ``# TYPE`` has a known type.
#
# Anything else (tabs, quoted UTF-8 names, exemplars, a line the library would reject)
# returns ``None``: the caller then parses the body with ``prometheus_client``, with its
# line-level recovery, so hostile input keeps exactly the behaviour it had.
# ``tests/test_engines_fastparse.py`` proves the equality on every fixture, every capture,
# every case and on generated expositions.
#
# Skipping: with ``wanted`` (a set of family names, see :func:`wanted_families`) the samples
# of any other family are checked against the grammar but their labels are not parsed; they
# are only counted (:attr:`FastParse.skipped_samples`, NaN excluded) so the scrape's sample
# count stays that of the whole body.

_NAME: Final = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
_LVALUE: Final = r'"[^"\\]*+(?:\\.[^"\\]*+)*+"'  # "(?:[^"\\]|\\.)*", unrolled (faster)
_LABEL: Final = rf"[a-zA-Z_][a-zA-Z0-9_]*={_LVALUE}"
_NUM: Final = (
    r"[+-]?(?:(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?"
    r"|[iI][nN][fF](?:[iI][nN][iI][tT][yY])?|[nN][aA][nN])"
)
_SAMPLE: Final = re.compile(
    rf"({_NAME})(?:\{{((?:{_LABEL}(?:,{_LABEL})*,?)?)\}})? ({_NUM})(?: {_NUM})?"
)
_PAIR: Final = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="([^"\\]*+(?:\\.[^"\\]*+)*+)"')
_METRIC_NAME: Final = re.compile(_NAME)
_NUMBER: Final = re.compile(_NUM)
_WS: Final = re.compile(r"[ \t\n\r\x0b\x0c]+")  # string.whitespace, as the library splits
_ESCAPES: Final = {"\\\\": "\\", "\\n": "\n", '\\"': '"'}
_LABEL_ESCAPE: Final = re.compile(r'\\[\\n"]')
_HELP_ESCAPE: Final = re.compile(r"\\[\\n]")
_MAX_VALUE_CHARS: Final = 64
_TYPES: Final = frozenset(
    {"counter", "gauge", "summary", "histogram", "gaugehistogram", "unknown", "info", "stateset"}
)
_ALLOWED_SUFFIXES: Final = {
    "summary": ("_count", "_sum", ""),
    "histogram": ("_count", "_sum", "_bucket"),
}
_SUFFIXES: Final = ("_total", "_bucket", "_count", "_sum", "_created", "_info")
_ADDED_SUFFIXES: Final = tuple(s for s in _SUFFIXES if s != "_created")
"""What :func:`wanted_families` adds to a name: a ``_created`` sample (the time a series was
created, which Python clients write as a family of its own) is never read by a mapping."""


def wanted_families(names: Iterable[str]) -> frozenset[str]:
    """The family names to keep for a mapping that reads ``names``.

    Args:
        names: sample or family names a mapping reads (``vllm:prompt_tokens``,
            ``x_bucket``), in any spelling; both the ``prefix:`` and ``prefix_`` forms are
            added.

    Returns:
        Each name, its ``prefix_`` spelling, and each of those with every sample suffix
        (``_total``, ``_bucket``, ``_count``, ``_sum``, ``_created``, ``_info``) removed
        and every one but ``_created`` added, so a family is found however the engine
        declared it (``# TYPE x_total counter``, ``# TYPE x counter`` or an untyped
        ``x_total`` line), while the ``x_created`` families Python clients write beside
        each counter and histogram are skipped (no mapping reads a creation time). The set
        is closed under adding and removing ``_total``. The same ``names`` give the same
        set object (the last :data:`_WANTED_KEPT` are kept): each engine of one type holds
        one shared set, not a copy (~70 KiB for vLLM's mapping).
    """
    return _wanted_families(tuple(names))


_WANTED_KEPT: Final = 64
"""Distinct name lists whose :func:`wanted_families` sets are kept (one per engine mapping
and gauge subset in use; a node runs a handful)."""


@functools.lru_cache(maxsize=_WANTED_KEPT)
def _wanted_families(names: tuple[str, ...]) -> frozenset[str]:
    out: set[str] = set()
    for name in names:
        for variant in {name, name.replace(":", "_", 1)}:
            out.add(variant)
            for sfx in _SUFFIXES:
                if variant.endswith(sfx):
                    base = variant[: -len(sfx)]
                    out.add(base)
                    out.update(base + s for s in _ADDED_SUFFIXES)
            out.update(variant + s for s in _ADDED_SUFFIXES)
    out.update([n[:-6] for n in out if n.endswith("_total")])
    out.update([n + "_total" for n in out if not n.endswith("_total")])
    return frozenset(out)


@dataclass(slots=True)
class FastParse:
    """What :func:`parse_text` read.

    Attributes:
        families: the kept families, in body order (NaN samples dropped).
        skipped_families: families not in ``wanted`` (their labels never parsed).
        skipped_samples: non-NaN samples in the skipped families.
    """

    families: list[ParsedFamily] = field(default_factory=list)
    skipped_families: int = 0
    skipped_samples: int = 0


class _Reject(Exception):
    """The body is outside the fast path's grammar: parse it with the library."""


def _unescape(value: str) -> str:
    return _LABEL_ESCAPE.sub(lambda m: _ESCAPES[m.group(0)], value) if "\\" in value else value


_LABEL_PAIRS: dict[str, LabelSet | tuple[tuple[str, str], ...]] = {}
"""Label text (between the braces) -> its :class:`LabelSet`, or only its pairs (unescaped)
while just skipped samples were written with it; shared by every engine's parse."""
_LABEL_PAIRS_KEPT: Final = 65536
_VALUES: dict[str, float] = {}
"""Value token -> its value, for tokens that matched the number grammar (``_NUMBER``): a
sample line whose label text and value token were both read before is split without a
regular expression (histogram counts repeat from bucket to bucket and scrape to scrape);
cleared when it holds :data:`_VALUES_KEPT` tokens."""
_VALUES_KEPT: Final = 8192
_NO_LABELS: Final = LabelSet()


def _label_pairs(
    text: str, find_pairs: Callable[[str], list[tuple[str, str]]]
) -> tuple[tuple[str, str], ...]:
    """The pairs of one sample's label text, as the library reads them; _Reject otherwise."""
    pairs = find_pairs(text)
    names = {k for k, _ in pairs}
    if len(names) != len(pairs):
        raise _Reject  # a repeated label name: the library rejects the line
    if "__" in text and any(k[:2] == "__" for k in names):
        raise _Reject  # a reserved label name
    if "\\" in text:
        return tuple([(k, _unescape(v)) for k, v in pairs])
    return tuple(pairs)


def parse_text(body: str, wanted: frozenset[str] | None = None) -> FastParse | None:
    """Parse a Prometheus text-format body, or say it needs the library.

    Args:
        body: the response body.
        wanted: family names to keep (see :func:`wanted_families`); ``None`` keeps all.

    Returns:
        A :class:`FastParse` equal to ``prometheus_client``'s parse of ``body`` (through
        :func:`~.exposition.parse_exposition`'s conversion), restricted to ``wanted``;
        ``None`` when any line is outside the fast grammar (module docstring). Never raises.
    """
    try:
        return _parse(body, wanted)
    except (_Reject, ValueError, OverflowError):
        return None


def _parse(body: str, wanted: frozenset[str] | None) -> FastParse:
    out = FastParse()
    name = ""
    doc = ""
    typ = "untyped"
    keep = False
    samples: list[ParsedSample] = []
    allowed: tuple[str, ...] = ()
    match_sample = _SAMPLE.fullmatch
    match_number = _NUMBER.fullmatch
    match_name = _METRIC_NAME.fullmatch
    find_pairs = _PAIR.findall
    labels_of = _LABEL_PAIRS.get
    value_of = _VALUES.get
    new_tuple = tuple.__new__
    isnan = math.isnan

    def emit(fname: str, fdoc: str, ftyp: str, fsamples: list[ParsedSample], kept: bool) -> None:
        if ftyp == "counter":
            if fname.endswith("_total"):
                fname = fname[:-6]
            elif kept:
                fsamples = [ParsedSample(s.name + "_total", s.labels, s.value) for s in fsamples]
        if not fname:
            raise _Reject  # the library raises on an empty family name
        if ftyp == "untyped":
            ftyp = "unknown"
        if kept:
            out.families.append(ParsedFamily(fname, ftyp, fdoc, fsamples))
        else:
            out.skipped_families += 1

    for raw in body.split("\n"):
        line = raw.strip()
        if not line:
            continue
        if line[0] == "#":
            parts = _WS.split(line, 3)
            if len(parts) < 2:
                continue
            if '"' in "".join(parts[:3]):
                raise _Reject
            kind = parts[1]
            if kind not in ("HELP", "TYPE"):
                continue
            if len(parts) == 2:
                raise _Reject
            cand = parts[2]
            if not _METRIC_NAME.fullmatch(cand):
                raise _Reject
            if kind == "HELP":
                if cand != name:
                    if name:
                        emit(name, doc, typ, samples, keep)
                    name, typ, samples, allowed = cand, "untyped", [], (cand,)
                    keep = wanted is None or cand in wanted
                doc = (
                    _HELP_ESCAPE.sub(lambda m: _ESCAPES[m.group(0)], parts[3])
                    if len(parts) == 4
                    else ""
                )
            else:
                if len(parts) < 4:
                    raise _Reject
                if cand != name:
                    if name:
                        emit(name, doc, typ, samples, keep)
                    name, doc, samples = cand, "", []
                    keep = wanted is None or cand in wanted
                typ = parts[3]
                if typ not in _TYPES and typ != "untyped":
                    raise _Reject
                allowed = tuple(name + s for s in _ALLOWED_SUFFIXES.get(typ, ("",)))
            continue
        # Split without the line's regular expression where what it would check is known:
        # a label text in the cache matched it before, a name the family allows is its
        # declared name plus a suffix, and the value is matched on its own. Anything else
        # (a text not seen yet, a timestamp, odd spacing) goes through the whole-line match.
        labels: LabelSet | tuple[tuple[str, str], ...] | None = None
        labels_text: str | None = None
        sname = value_text = ""
        brace = line.find("{")
        if brace > 0:
            close = line.rfind("}")
            if close > brace and line[close + 1 : close + 2] == " ":
                labels_text = line[brace + 1 : close]
                labels = labels_of(labels_text)
                sname = line[:brace]
                value_text = line[close + 2 :]
        elif brace < 0:
            sname, _, value_text = line.partition(" ")
            labels = _NO_LABELS
        own = sname in allowed
        # a value token read before (it matched the number grammar then): its float
        value = value_of(value_text) if labels is not None else None
        if value is None or not (own or match_name(sname)):
            if labels is None or not match_number(value_text) or not (own or match_name(sname)):
                m = match_sample(line)
                if m is None:
                    raise _Reject
                sname, labels_text, value_text = m.group(1, 2, 3)
                own = sname in allowed
                labels = labels_of(labels_text) if labels_text else _NO_LABELS
            if len(value_text) > _MAX_VALUE_CHARS:
                raise _Reject
            value = float(value_text)
            if value == 0.0 and value_text.lstrip("+-").isdigit():
                value = 0.0  # the library reads an integer literal with int(): "-0" is 0
            if match_number(value_text):
                if len(_VALUES) >= _VALUES_KEPT:
                    _VALUES.clear()  # bounded: values that keep changing are read afresh
                _VALUES[value_text] = value
        kept = keep if own else (wanted is None or sname in wanted)
        if labels is None:
            # a label text not seen yet: parsed once, and the samples written with it share
            # one LabelSet (built when one of them is kept; skipped ones need only the check)
            assert labels_text is not None
            labels = _label_pairs(labels_text, find_pairs)
            if kept:
                labels = LabelSet(labels)
            if len(_LABEL_PAIRS) >= _LABEL_PAIRS_KEPT:
                _LABEL_PAIRS.clear()  # bounded: churning label values re-parse
            _LABEL_PAIRS[labels_text] = labels
        elif kept and type(labels) is tuple:
            assert labels_text is not None
            labels = _LABEL_PAIRS[labels_text] = LabelSet(labels)
        # kept: a LabelSet by now (a bare pairs tuple only ever stands for skipped samples)
        # built with tuple.__new__: the named tuple's own __new__ is a Python function
        sample = new_tuple(ParsedSample, (sname, labels, value, None)) if kept else None
        if own:
            if isnan(value):  # no sample
                continue
            if sample is not None:
                samples.append(sample)
            else:
                out.skipped_samples += 1
            continue
        if name:
            emit(name, doc, typ, samples, keep)
        name, doc, typ, samples, allowed, keep = "", "", "untyped", [], (), False
        if sample is not None:
            emit(sname, "", "untyped", [] if math.isnan(value) else [sample], True)
        else:
            if not math.isnan(value):
                out.skipped_samples += 1
            emit(sname, "", "untyped", [], False)
    if name:
        emit(name, doc, typ, samples, keep)
    return out


_NUM_NOT_NAN: Final = (
    r"[+-]?(?:(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?"
    r"|[iI][nN][fF](?:[iI][nN][iI][tT][yY])?)"
)
_NUMBERS: Final = re.compile(rf"(?:{_NUM_NOT_NAN}(?: {_NUM_NOT_NAN})*)?")
"""Value tokens joined by spaces, each a number :func:`parse_text` reads, none NaN."""
REPARSE_MAX_CHARS: Final = 8 * 1024 * 1024
"""Bodies longer than this are parsed whole every time (a template holds the body's lines)."""


def _numbers(tokens: list[str]) -> bool:
    """True when every token is a value :func:`parse_text` reads as a number, none NaN."""
    return (not tokens or max(map(len, tokens)) <= _MAX_VALUE_CHARS) and bool(
        _NUMBERS.fullmatch(" ".join(tokens))
    )


def _value(token: str) -> float:
    """A token :func:`_numbers` accepted, as :func:`parse_text` reads it."""
    value = float(token)
    if value == 0.0 and token.lstrip("+-").isdigit():
        return 0.0  # an integer literal: "-0" is 0, as the library reads it
    return value


class Reparse:
    """Parses a body that repeats the last one's lines with other values, without parsing.

    An engine writes the same lines scrape after scrape, only the values change (a new
    model, label value or family is the exception). When every line of ``body`` equals the
    last cleanly parsed body's up to its value token (the text after the line's last
    space), and every value token is a number (none NaN), the last parse's families are
    reused with the new values: no label, name or comment is read again. Anything else (a
    changed line, a NaN or oddly written value, CRLF line ends, a timestamp that moves, a
    parse with errors, by the library or with exemplars, another ``Content-Type`` or
    ``wanted``) is parsed by :func:`classify_response`, and a clean parse becomes the next
    template. The result is always equal to ``classify_response(status, content_type, body,
    wanted)`` (``tests/test_engines_gauges.py`` checks it on generated changes).

    Holds one template per instance (one per engine reader): the last body's lines less
    their values, and its families' names and label sets; bodies over
    :data:`REPARSE_MAX_CHARS` keep none. Not thread-safe: one per sampler.
    """

    __slots__ = ("_families", "_key", "_misses", "_probe", "_shape", "_skipped", "_tries")

    MISSES: Final = 4
    """After this many bodies in a row that did not fit the last shape, only every
    :data:`RETRY`-th body is compared, and the one after it when that one taught a new
    shape (a body whose lines change every scrape, e.g. a churning label value, pays the
    comparison and the learning rarely; lines that hold still again are reused within
    ``RETRY + 1`` bodies)."""
    RETRY: Final = 16

    def __init__(self) -> None:
        # (content type, wanted, every line less its value, joined by "\n": one string,
        # not ~600 of them; the lines hold no "\n", so equal keys are equal line lists)
        self._key: tuple[str | None, frozenset[str] | None, str] | None = None
        self._misses = 0
        self._tries = 0
        self._probe = False
        # (family name, type, help, [(value token index, sample name, labels)]) in body order
        self._families: list[tuple[str, str, str, list[tuple[int, str, Mapping[str, str]]]]] = []
        self._skipped = (0, 0)
        self._shape: object | None = None  # ParseResult.shape of the template's results

    def parse(
        self,
        status: int,
        content_type: str | None,
        body: str,
        wanted: frozenset[str] | None = None,
    ) -> ParseResult:
        """``classify_response(status, content_type, body, wanted)``, reusing the last shape.

        Args:
            status: the HTTP status code.
            content_type: the ``Content-Type`` header, or ``None``.
            body: the decoded body.
            wanted: family names to keep (:func:`wanted_families`); ``None`` for all.

        Returns:
            A :class:`ParseResult` equal to :func:`classify_response`'s. Never raises.
        """
        if not 200 <= status < 300:
            return failed(f"http_{status}")
        if len(body) > REPARSE_MAX_CHARS:
            self._key = None
            return classify_response(status, content_type, body, wanted)
        probe, self._probe = self._probe, False
        if self._misses >= self.MISSES and not probe:
            self._tries += 1
            if self._tries % self.RETRY:
                return classify_response(status, content_type, body, wanted)
        heads: list[str] = []
        tokens: list[str] = []
        for line in body.split("\n"):
            if not line or line[0] == "#":
                heads.append(line)
                continue
            head, _, token = line.rpartition(" ")
            heads.append(head)
            tokens.append(token)
        key = (content_type, wanted, "\n".join(heads))
        if key == self._key and _numbers(tokens):
            result = ParseResult(
                format="text",
                skipped_families=self._skipped[0],
                skipped_samples=self._skipped[1],
                shape=self._shape,
            )
            for fname, ftype, fhelp, samples in self._families:
                result.families.append(
                    ParsedFamily(
                        fname,
                        ftype,
                        fhelp,
                        [ParsedSample(n, labels, _value(tokens[i])) for i, n, labels in samples],
                    )
                )
            self._misses = 0
            return result
        self._misses += 1
        result = classify_response(status, content_type, body, wanted)
        if self._learn(key, heads, tokens, result) and self._misses > self.MISSES and not probe:
            self._probe = True  # a periodic try learnt a shape: see whether it holds
        return result

    def _learn(
        self,
        key: tuple[str | None, frozenset[str] | None, str],
        lines: list[str],
        tokens: list[str],
        result: ParseResult,
    ) -> bool:
        """Keep ``result``'s shape when each value token is one kept or one skipped sample.

        Returns True when it was kept.

        Each kept sample is matched, in body order, to the next sample line with its name
        (or, for a counter the parser renamed, its name less ``_total``), its very label
        set (the parser's shared :class:`LabelSet` for that label text) and its value; the
        lines passed over must be exactly the skipped samples.
        """
        if result.reason or result.format != "text" or result.error_count:
            return False
        if not _numbers(tokens):
            return False  # a NaN (dropped) or odd value: which lines make samples is not fixed
        heads = [h for h in lines if h and h[0] != "#"]
        if len(heads) != len(tokens):
            return False
        j = 0
        families = []
        for f in result.families:
            samples: list[tuple[int, str, Mapping[str, str]]] = []
            for s in f.samples:
                if s.exemplar is not None:
                    return False
                while j < len(heads) and not _same_sample(heads[j], s):
                    j += 1
                if j == len(heads):
                    return False
                value = _value(tokens[j])
                if value != s.value or math.copysign(1.0, value) != math.copysign(1.0, s.value):
                    return False
                samples.append((j, s.name, s.labels))
                j += 1
            families.append((f.name, f.type, f.help, samples))
        kept = sum(len(f[3]) for f in families)
        if kept + result.skipped_samples != len(tokens):
            return False
        self._key = key
        self._families = families
        self._skipped = (result.skipped_families, result.skipped_samples)
        self._shape = result.shape = object()  # a new template: a new token
        return True


def _same_sample(head: str, sample: ParsedSample) -> bool:
    """True when a sample line's ``head`` (the line less its value) wrote ``sample``."""
    brace = head.find("{")
    name = head if brace < 0 else head[:brace]
    if name != sample.name and not (sample.name.endswith("_total") and name == sample.name[:-6]):
        return False
    if brace < 0:
        return not sample.labels
    if not head.endswith("}"):
        return False
    return _LABEL_PAIRS.get(head[brace + 1 : -1]) is sample.labels
