"""Session-wide test hooks.

An engine that cannot start (a llama-server killed by SIGILL, say) fails every test that
needs it, each with the same error. The first such test reports it, in one line and without
a traceback; later ones are skipped with a pointer to that report, so the cause is read once.
The run still fails: the first report is an error.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import pytest

_reported: dict[str, str] = {}  # failure key -> node id of the test that reported it


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[Any]:
    outcome = yield
    rep = outcome.get_result()
    exc = call.excinfo.value if call.excinfo is not None else None
    if call.when not in ("setup", "call") or not getattr(exc, "reported_once", False):
        return
    key = str(getattr(exc, "key", exc))
    first = _reported.get(key)
    if first is None:
        _reported[key] = item.nodeid
        rep.longrepr = str(exc)
        return
    rep.outcome = "skipped"
    rep.longrepr = (str(item.path), item.location[1] or 0, f"Skipped: as {first} (reported there)")
