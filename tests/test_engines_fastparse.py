"""The text parser's fast path equals prometheus_client's parser, and skipping changes nothing.

``parse_exposition`` reads a Prometheus text body with its own fast path
(:func:`agent.samplers.engines.exposition.parse_text`) and falls back to
``prometheus_client`` for anything the fast path does not accept. These tests compare both
paths (``fast_path=False`` forces the library) on every fixture, every shared capture and
case, and on generated expositions, with and without each mapping's ``wanted`` families;
and they check that normalizing a scrape parsed with skipping gives exactly the samples of
one parsed whole.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_engines_property import mutated

from kvpressure.agent.samplers.engines import ENGINE_TYPES
from kvpressure.agent.samplers.engines.exposition import (
    LabelSet,
    ParseResult,
    parse_exposition,
    parse_text,
    wanted_families,
)
from kvpressure.agent.samplers.engines.normalize import Normalizer

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
_SKIP_SUFFIXES = (".md", ".json", ".yaml", ".yml", ".py", ".sh")


def _bodies() -> list[Path]:
    roots = [ROOT / "tests" / "fixtures", SHARED / "captures", SHARED / "cases"]
    out: list[Path] = []
    for root in roots:
        if root.is_dir():
            out += sorted(
                p for p in root.rglob("*") if p.is_file() and not p.name.endswith(_SKIP_SUFFIXES)
            )
    return out


BODIES = _bodies()
CONTENT_TYPES = [None, "text/plain; version=0.0.4", "application/openmetrics-text"]
WANTED: list[frozenset[str] | None] = [None, *(m.reads() for m in ENGINE_TYPES.values())]


def _read(path: Path) -> str:
    return path.read_bytes().decode("utf-8", errors="replace")


def _exemplar_key(e: Any) -> tuple[object, ...] | None:
    """An exemplar compared by value: ``Exemplar(..., value=nan)`` is never ``==`` itself."""
    if e is None:
        return None
    return (dict(e.labels), repr(e.value))


def key(r: ParseResult) -> tuple[object, ...]:
    """Everything a caller reads from a result, values compared bit for bit (-0.0 != 0.0)."""
    families = [
        (
            f.name,
            f.type,
            f.help,
            [
                (
                    s.name,
                    dict(s.labels),
                    math.copysign(1.0, s.value),
                    repr(s.value),
                    _exemplar_key(s.exemplar),
                )
                for s in f.samples
            ],
        )
        for f in r.families
    ]
    errors = [(e.line, e.text, e.key) for e in r.errors]
    return (
        r.reason,
        r.format,
        r.error_count,
        errors,
        r.sample_count,
        r.skipped_families,
        r.skipped_samples,
        families,
    )


def assert_same(body: str, content_type: str | None, wanted: frozenset[str] | None) -> None:
    fast = parse_exposition(body, content_type, wanted)
    slow = parse_exposition(body, content_type, wanted, fast_path=False)
    assert key(fast) == key(slow)


def test_bodies_found() -> None:
    # the comparison below must run over the real captures, not over nothing
    names = {p.name for p in BODIES}
    assert "metrics_load.txt" in names
    assert len(BODIES) >= 40


@pytest.mark.parametrize("path", BODIES, ids=lambda p: str(p.relative_to(ROOT.parent)))
def test_fast_path_equals_library_on_every_file(path: Path) -> None:
    body = _read(path)
    for content_type in CONTENT_TYPES:
        for wanted in WANTED:
            assert_same(body, content_type, wanted)


def test_fast_path_takes_the_real_expositions() -> None:
    # the fast path is what runs on engines' real output (else it would prove nothing)
    engines = ROOT / "tests" / "fixtures" / "engines"
    real = [p for p in engines.rglob("*.txt") if "openmetrics" not in p.name]
    captures = SHARED / "captures"
    if captures.is_dir():
        real += [p for p in captures.rglob("metrics*.txt")]
    assert real
    for path in real:
        assert parse_text(_read(path)) is not None, path


def test_fast_path_declines_what_it_does_not_read() -> None:
    for body in (
        'x{a="1"}  1\n',  # two spaces
        'x{a = "1"} 1\n',  # spaces in labels
        "x\t1\n",  # tab
        'x{a="1",a="2"} 1\n',  # repeated label: the library rejects the line
        'x{__name__="y"} 1\n',  # reserved label
        '{"x"} 1\n',  # quoted UTF-8 name
        'x 1 # {a="b"} 1\n',  # exemplar
        "# TYPE x foo\nx 1\n",  # unknown type
        "x " + "1" * 400 + "\n",  # an integer beyond a float
        'x{a="\\"} 1\n',  # unterminated value
    ):
        assert parse_text(body) is None, body
        assert_same(body, None, None)


def test_skipping_keeps_the_sample_count_and_drops_unread_families() -> None:
    body = (
        "# TYPE vllm:num_requests_running gauge\n"
        'vllm:num_requests_running{model_name="m"} 3\n'
        "# TYPE python_gc_objects_collected_total counter\n"
        'python_gc_objects_collected_total{generation="0"} 10\n'
        'python_gc_objects_collected_total{generation="1"} NaN\n'
        "unrelated_untyped 7\n"
    )
    whole = parse_exposition(body, None)
    part = parse_exposition(body, None, ENGINE_TYPES["vllm"].reads())
    assert [f.name for f in part.families] == ["vllm:num_requests_running"]
    assert part.skipped_families == 2
    assert part.sample_count == whole.sample_count == 3
    assert_same(body, None, ENGINE_TYPES["vllm"].reads())


def test_wanted_families_is_closed_under_total() -> None:
    w = wanted_families(["vllm:prompt_tokens", "x_bucket", "sglang:y_total"])
    for name in ("vllm:prompt_tokens", "vllm_prompt_tokens_total", "x", "x_sum", "x_total"):
        assert name in w
    for name in w:
        assert (name + "_total" in w) or name.endswith("_total")
        if name.endswith("_total"):
            assert name[:-6] in w


def test_engines_of_one_type_share_one_wanted_set() -> None:
    # each engine sampler keeps its mapping's wanted set: 8 vLLM engines hold one set,
    # not 8 equal copies (issue 15, the node's memory)
    first, second = ENGINE_TYPES["vllm"].reads(), ENGINE_TYPES["vllm"].reads()
    assert first is second
    assert wanted_families(iter(["x_bucket"])) is wanted_families(["x_bucket"])


def _normalized(etype: str, bodies: list[str], wanted: frozenset[str] | None) -> list[object]:
    n = Normalizer(ENGINE_TYPES[etype], "e", "h:1")
    out: list[object] = []
    for i, body in enumerate(bodies):
        scrape = n.normalize(parse_exposition(body, None, wanted), default_model="m", now=i * 5.0)
        out.append(
            (
                sorted((s.name, s.labels, repr(s.value)) for s in scrape.samples),
                scrape.models,
                sorted(scrape.missing),
                scrape.invalid,
                scrape.restarted,
                scrape.merged,
                scrape.models_dropped,
                scrape.withheld,
            )
        )
    return out


@pytest.mark.parametrize("etype", list(ENGINE_TYPES))
def test_skipping_unread_families_normalizes_the_same(etype: str) -> None:
    engines = ROOT / "tests" / "fixtures" / "engines"
    bodies = [_read(p) for p in sorted(engines.rglob("*.txt"))]
    bodies += [_read(p) for p in sorted((ROOT / "tests" / "fixtures" / "cases").glob("*.txt"))]
    assert len(bodies) > 10
    wanted = ENGINE_TYPES[etype].reads()
    # consecutive pairs too, so counters, windows and restarts see a second scrape
    for i in range(len(bodies)):
        pair = bodies[i : i + 2]
        assert _normalized(etype, pair, wanted) == _normalized(etype, pair, None)


# -- generated expositions ------------------------------------------------------------------

_NAMES = st.sampled_from(
    [
        "vllm:num_requests_running",
        "vllm:kv_cache_usage_perc",
        "vllm:prompt_tokens",
        "vllm:prompt_tokens_total",
        "vllm:e2e_request_latency_seconds",
        "vllm:e2e_request_latency_seconds_bucket",
        "vllm:e2e_request_latency_seconds_sum",
        "vllm_num_requests_waiting",
        "process_start_time_seconds",
        "x",
        "x_total",
        "x_count",
        "_total",
        "a:b_created",
    ]
) | st.from_regex(r"[a-zA-Z_:][a-zA-Z0-9_:]{0,12}", fullmatch=True)
_LABEL_NAMES = st.sampled_from(["model_name", "le", "engine", "a", "__x", "_", "le2"]) | (
    st.from_regex(r"[a-zA-Z_][a-zA-Z0-9_:]{0,6}", fullmatch=True)
)
_VALUES = st.sampled_from(
    ["1", "-0", "0", "+1", "1.5", "-2e-3", "1E5", ".5", "5.", "NaN", "-nan", "+Inf", "-Inf",
     "inf", "Infinity", "1_0", "0x1", "", "1e999", "007", "1" * 70, "٣", "nan1"]
) | st.floats(allow_nan=True).map(repr) | st.integers().map(str)  # fmt: skip
_LABEL_VALUES = st.lists(
    st.sampled_from([*list('ab{}=, "\\n\t#é'), "\\\\", '\\"', "\\n", "\\t"]), max_size=8
).map("".join)
_TYPES = st.sampled_from(
    ["counter", "gauge", "histogram", "summary", "untyped", "unknown", "info", "foo", ""]
)
_SEP = st.sampled_from([" ", " ", " ", "  ", "\t"])


_STRICT_VALUES = st.sampled_from(["1", "-0", "0.5", "NaN", "+Inf", "3e2"]) | st.floats().map(repr)
_STRICT_LABEL_VALUES = st.lists(
    st.sampled_from([*list("ab{}=, #é"), "\\\\", '\\"', "\\n", "\\t"]), max_size=6
).map("".join)


@st.composite
def _sample_line(draw: st.DrawFn, strict: bool = False) -> str:
    """A sample line; ``strict`` draws mostly lines the fast path reads."""
    name = draw(_NAMES)
    values = _STRICT_LABEL_VALUES if strict else _LABEL_VALUES
    pairs = draw(st.lists(st.tuples(_LABEL_NAMES, values), max_size=3))
    quote = '"' if strict else draw(st.sampled_from(['"', '"', '"', "'", ""]))
    labels = ",".join(f"{k}={quote}{v}{quote}" for k, v in pairs)
    if draw(st.booleans()):
        labels += draw(st.sampled_from(["", ","] if strict else ["", ",", " ", ",,"]))
    head = f"{name}{{{labels}}}" if pairs or draw(st.booleans()) else name
    sep = " " if strict else draw(_SEP)
    line = f"{head}{sep}{draw(_STRICT_VALUES if strict else _VALUES)}"
    if draw(st.integers(0, 5)) == 0:
        line += f"{sep}{draw(_STRICT_VALUES if strict else _VALUES)}"
    return line


@st.composite
def _comment_line(draw: st.DrawFn) -> str:
    kind = draw(st.sampled_from(["HELP", "TYPE", "TYPE", "other", "EOF"]))
    name = draw(_NAMES)
    if kind == "HELP":
        text = draw(st.text(alphabet=st.sampled_from(list('ab \\n"é\t')), max_size=10))
        return f"# HELP{draw(_SEP)}{name} {text}".rstrip()
    if kind == "TYPE":
        return f"# TYPE{draw(_SEP)}{name}{draw(_SEP)}{draw(_TYPES)}".rstrip()
    if kind == "EOF":
        return "# EOF"
    return "#" + draw(st.text(max_size=12))


def test_generated_expositions_reach_the_fast_path() -> None:
    # the property below must exercise the fast path, not only the fallback
    accepted = []

    @settings(max_examples=200, database=None, deadline=None)
    @given(lines=_STRICT_LINES)
    def probe(lines: list[str]) -> None:
        accepted.append(parse_text("\n".join(lines) + "\n") is not None)

    probe()
    assert sum(accepted) >= len(accepted) // 4


_LINES = st.lists(
    st.one_of(_sample_line(), _sample_line(), _comment_line(), st.just(""), st.text(max_size=12)),
    max_size=14,
)
_STRICT_LINES = st.lists(
    st.one_of(
        _sample_line(strict=True),
        _sample_line(strict=True),
        _sample_line(strict=True),
        _comment_line(),
        st.just(""),
    ),
    max_size=14,
)
PROFILE = settings(
    max_examples=400,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@PROFILE
@given(
    lines=_LINES | _STRICT_LINES,
    end=st.sampled_from(["\n", "", "\r\n"]),
    content_type=st.sampled_from(CONTENT_TYPES),
    wanted=st.sampled_from(WANTED),
)
def test_fast_path_equals_library_on_generated_expositions(
    lines: list[str], end: str, content_type: str | None, wanted: frozenset[str] | None
) -> None:
    assert_same(end.join(lines) + end, content_type, wanted)


@PROFILE
@given(body=mutated(), wanted=st.sampled_from(WANTED))
def test_fast_path_equals_library_on_mutated_fixtures(
    body: str, wanted: frozenset[str] | None
) -> None:
    assert_same(body, None, wanted)


@PROFILE
@given(lines=_LINES | _STRICT_LINES, wanted=st.sampled_from(WANTED))
def test_a_second_parse_of_the_same_body_still_equals_the_library(
    lines: list[str], wanted: frozenset[str] | None
) -> None:
    # the second parse splits lines whose label text is known without the line's regular
    # expression: it must accept and reject exactly what the first (and the library) did
    body = "\n".join(lines) + "\n"
    assert_same(body, None, wanted)
    assert_same(body, None, wanted)


def test_samples_written_with_one_label_text_share_one_read_only_label_set() -> None:
    body = (
        "# TYPE x histogram\n"
        'x_bucket{m="a",le="1"} 1\nx_bucket{m="a",le="+Inf"} 2\n'
        'x_count{m="a"} 2\nx_sum{m="a"} 1.5\n'
    )
    first = parse_exposition(body, None).families[0].samples
    again = parse_exposition(body, None).families[0].samples
    assert first[2].labels is first[3].labels is again[2].labels  # parsed once per text
    assert first[0].labels == {"m": "a", "le": "1"}  # equal to the library's dict
    assert isinstance(first[0].labels, LabelSet)
    assert first[0].labels.pairs == (("le", "1"), ("m", "a"))
    assert first[1].labels.bucket == ((("m", "a"),), math.inf)
    with pytest.raises(TypeError):
        first[0].labels["m"] = "b"  # type: ignore[index]
    with pytest.raises(TypeError):
        first[0].labels.pop("m")
    assert dict(first[0].labels) == {"m": "a", "le": "1"}  # a copy is an ordinary dict


def test_created_families_are_skipped_and_normalize_the_same() -> None:
    # Python clients write an x_created gauge family beside each counter and histogram; no
    # mapping reads a creation time, so it is skipped (counted, labels never kept)
    body = (ROOT / "tests/fixtures/engines/vllm/0.32.0-cpu-kv-metrics-load.txt").read_text()
    wanted = ENGINE_TYPES["vllm"].reads()
    assert "vllm:prompt_tokens" in wanted and "vllm:prompt_tokens_created" not in wanted
    whole = parse_exposition(body, None)
    part = parse_exposition(body, None, wanted)
    created = [f for f in whole.families if f.name.endswith("_created")]
    assert len(created) > 10
    assert not [f for f in part.families if f.name.endswith("_created")]
    assert part.sample_count == whole.sample_count
    assert _normalized("vllm", [body, body], wanted) == _normalized("vllm", [body, body], None)


@pytest.mark.parametrize("etype", ["vllm", "sglang", "triton", "tgi", "llamacpp"])
def test_normalizing_the_library_parse_equals_the_fast_parse(etype: str) -> None:
    # the normalizer reads the fast path's shared label sets and the library's dicts alike
    engines = ROOT / "tests" / "fixtures" / "engines"
    bodies = [_read(p) for p in sorted(engines.rglob("*.txt")) if "openmetrics" not in p.name]
    for i in range(len(bodies)):
        pair = bodies[i : i + 2]
        fast = Normalizer(ENGINE_TYPES[etype], "e", "h:1")
        slow = Normalizer(ENGINE_TYPES[etype], "e", "h:1")
        for j, body in enumerate(pair):
            a = fast.normalize(parse_exposition(body, None), default_model="m", now=j * 5.0)
            b = slow.normalize(
                parse_exposition(body, None, fast_path=False), default_model="m", now=j * 5.0
            )
            assert [(s.name, s.labels, repr(s.value)) for s in a.samples] == [
                (s.name, s.labels, repr(s.value)) for s in b.samples
            ]
            assert (a.models, a.missing, a.merged, a.emitted_labels) == (
                b.models,
                b.missing,
                b.merged,
                b.emitted_labels,
            )
