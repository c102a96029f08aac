"""The host parsers' fast paths give what their plain loops give, on any text.

``parse_kv`` with a key set finds candidate lines with one regex scan instead of a Python
loop over every line, and ``parse_diskstats`` reuses the last call's parse of an unchanged
line. Both must be invisible: these tests compare them with reference copies of the plain
loops on real files, on fixture lines and on generated text with odd line breaks, blank
lines, tabs, repeated keys and garbage.
"""

from __future__ import annotations

from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from kvpressure.agent.samplers import host
from kvpressure.agent.samplers.host import CGROUP_MEMORY_EVENTS, parse_diskstats, parse_kv

FIXTURES = Path(__file__).parent / "fixtures" / "host"


def parse_kv_reference(text: str, keys: object | None = None) -> dict[str, int]:
    """``parse_kv`` as it was before its regex fast path (every line in a Python loop)."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        if keys is not None and line.partition(" ")[0] not in keys:  # type: ignore[operator]
            continue
        parts = line.split()
        if len(parts) == 2:
            try:
                out[parts[0]] = int(parts[1])
            except ValueError:
                pass
    return out


VMSTAT_LINES = [
    "nr_free_pages 123456",
    "pgmajfault 42",
    "pswpin 0",
    "pswpout 7",
    "allocstall_normal 3",
    "allocstall_movable 5",
    "pgmajfault 43",  # a repeated key: the last one wins
    "pgmajfault",  # a key alone
    "pgmajfault 1 2",  # three fields
    "pgmajfault\t9",  # a tab, not a space, after the key
    " pgmajfault 9",  # a leading space
    "pgmajfaults 9",  # a longer name that starts with a key
    "pswpin x",  # not a number
    "pswpin +12",  # int() takes a sign
    "pswpin 1_000",  # and underscores
    "pswpin  12",  # two spaces
    "",
    "oom 1",
    "oom_kill 2",
    "high 3",
    "max 4",
    "usage_usec 99",
]
BREAKS = ["\n", "\r\n", "\r", "\x0b", "\x0c", "\x1c", "\x85", "\u2028"]
KEY_SETS = [
    host._VMSTAT_KEYS,
    frozenset(CGROUP_MEMORY_EVENTS),
    CGROUP_MEMORY_EVENTS,
    ("usage_usec",),
    frozenset(),
    ["pgmajfault"],  # a list: no fast path, same answer
    None,
]


def test_parse_kv_equals_the_plain_loop_on_this_machines_vmstat() -> None:
    text = Path("/proc/vmstat").read_text()
    for keys in KEY_SETS:
        assert parse_kv(text, keys) == parse_kv_reference(text, keys)
    assert set(parse_kv(text, host._VMSTAT_KEYS)) >= {"pgmajfault", "pswpin", "pswpout"}


@settings(max_examples=400, deadline=None)
@given(
    lines=st.lists(st.one_of(st.sampled_from(VMSTAT_LINES), st.text(max_size=20)), max_size=30),
    breaks=st.lists(st.sampled_from(BREAKS), min_size=1, max_size=30),
    trailing=st.booleans(),
    keys=st.sampled_from(KEY_SETS),
)
def test_parse_kv_equals_the_plain_loop_on_generated_text(
    lines: list[str], breaks: list[str], trailing: bool, keys: object
) -> None:
    text = "".join(line + breaks[i % len(breaks)] for i, line in enumerate(lines))
    if not trailing and text:
        text = text[: -len(breaks[(len(lines) - 1) % len(breaks)])]
    assert parse_kv(text, keys) == parse_kv_reference(text, keys)  # type: ignore[arg-type]


DISK_LINES = [
    "   7       0 loop0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0",
    " 259       0 nvme0n1 1 2 3 4 5 6 7 8 0 10 11 12 13 14 15 16 17",
    "   8       0 sda 1 2 3 4 5 6 7 8 0 10 11",  # 14 fields: no discard or flush group
    "   8       1 sda1 1 2 3 4 5 6 7 8 0 10",  # 13 fields: malformed
    "   8       2 sda2 1 2 3 -4 5 6 7 8 0 10 11",  # a negative counter: malformed
    "   8       3 sda3 1 2 3 4 5 6 7 8 0 10 11 x 1 2 3",  # garbage after the 11 counters
    "",
    "   ",
]


@settings(max_examples=300, deadline=None)
@given(
    cycles=st.lists(
        st.lists(st.one_of(st.sampled_from(DISK_LINES), st.text(max_size=30)), max_size=12),
        min_size=1,
        max_size=5,
    )
)
def test_parse_diskstats_with_the_last_lines_equals_a_fresh_parse(
    cycles: list[list[str]],
) -> None:
    memo: dict[str, object] = {}
    for lines in cycles:
        text = "\n".join(lines)
        assert parse_diskstats(text, memo) == parse_diskstats(text)  # type: ignore[arg-type]
        # the memo holds this call's lines only: bounded by the file, not by the run
        assert set(memo) == set(text.splitlines())


def test_parse_diskstats_memo_on_the_fixture_and_this_machine() -> None:
    for text in (
        (FIXTURES / "24-diskstats-nvme-20-fields.input.txt").read_text(),
        Path("/proc/diskstats").read_text(),
    ):
        memo: dict[str, object] = {}
        first = parse_diskstats(text, memo)  # type: ignore[arg-type]
        assert first == parse_diskstats(text)
        assert parse_diskstats(text, memo) == first  # type: ignore[arg-type]
