"""Session-wide test hooks.

An engine that cannot start (a llama-server killed by SIGILL, say) fails every test that
needs it, each with the same error. The first such test reports it, in one line and without
a traceback; later ones are skipped with a pointer to that report, so the cause is read once.
The run still fails: the first report is an error.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Generator, Iterator
from typing import Any

import pytest

from kvpressure.agent.daemon import Daemon

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


@pytest.fixture
def run_daemon() -> Iterator[Callable[[Daemon], asyncio.AbstractEventLoop]]:
    """Factory: run a :class:`Daemon` on a background event loop until it is ready.

    Returns the loop (for ``call_soon_threadsafe``/``run_coroutine_threadsafe``); every
    daemon started is asked to stop, and its thread joined, after the test.
    """
    running: list[tuple[asyncio.AbstractEventLoop, Daemon, threading.Thread]] = []

    def start(daemon: Daemon) -> asyncio.AbstractEventLoop:
        loop = asyncio.new_event_loop()
        ready = threading.Event()

        def main() -> None:
            asyncio.set_event_loop(loop)
            loop.run_until_complete(daemon.run(ready=ready.set))

        t = threading.Thread(target=main, daemon=True)
        t.start()
        assert ready.wait(5)
        running.append((loop, daemon, t))
        return loop

    yield start
    for loop, daemon, t in running:
        loop.call_soon_threadsafe(daemon.request_stop)
        t.join(5)
