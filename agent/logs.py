"""One-line structured logs on stderr, journald-friendly (logfmt: ``key=value`` pairs).

Example line::

    ts=2026-11-30T16:40:01.123Z level=warning logger=kvpressure.agent.samplers.host \
        msg="PSI unsupported" hint="boot with psi=1"

Extra fields are passed with ``extra={"kv": {...}}``.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any


def _quote(value: object) -> str:
    s = str(value)
    if s and all(c.isalnum() or c in "._-:/@+" for c in s):
        return s
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


class LogfmtFormatter(logging.Formatter):
    """Format records as single logfmt lines; exceptions are folded into ``exc=``."""

    def format(self, record: logging.LogRecord) -> str:
        """Return ``record`` as one line of ``key=value`` pairs."""
        t = time.gmtime(record.created)
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", t) + f".{int(record.msecs):03d}Z"
        parts = [
            f"ts={ts}",
            f"level={record.levelname.lower()}",
            f"logger={record.name}",
            f"msg={_quote(record.getMessage())}",
        ]
        kv = getattr(record, "kv", None)
        if isinstance(kv, dict):
            parts.extend(f"{k}={_quote(v)}" for k, v in kv.items())
        if record.exc_info:
            parts.append(f"exc={_quote(self.formatException(record.exc_info))}")
        return " ".join(parts)


def setup(level: str = "info") -> None:
    """Send all ``agent``/``exporters`` logs to stderr as logfmt lines at ``level``."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(LogfmtFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    logging.getLogger("httpcore").setLevel(logging.WARNING)


def set_level(level: str) -> None:
    """Change the root log level (used on SIGHUP reload)."""
    logging.getLogger().setLevel(level.upper())


class RateLimitedLog:
    """Log one line per key and period, with how many times the event happened since.

    The first event of a key is logged at once; later ones within ``period_s`` are only
    counted, and the next event after the period logs one line carrying that count
    (``count`` in the line's fields). Thread-safe. At most ``max_keys`` keys are
    remembered (the least recently logged is forgotten first), so the memory is bounded
    whatever the keys.

    Args:
        logger: where the lines go.
        period_s: seconds between two lines of the same key.
        max_keys: keys remembered at most.
        clock: monotonic seconds (tests inject one).
    """

    def __init__(
        self,
        logger: logging.Logger,
        period_s: float = 60.0,
        max_keys: int = 1024,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._logger = logger
        self._period_s = period_s
        self._max_keys = max_keys
        self._clock = clock
        self._last: dict[str, float] = {}
        self._pending: Counter[str] = Counter()
        self._lock = threading.Lock()

    def __call__(
        self,
        key: str,
        level: int,
        msg: str,
        *args: object,
        kv: dict[str, Any] | None = None,
        exc_info: bool = False,
    ) -> bool:
        """Count one event of ``key``; log ``msg % args`` if its period has passed.

        Args:
            key: what is rate-limited together (e.g. ``"accept:127.0.0.1:9470"``).
            level: the logging level.
            msg: the message (``%`` format with ``args``).
            *args: ``%`` arguments of ``msg``.
            kv: structured fields for the logfmt line; ``count`` (events since the last
                line of this key, this one included) is added.
            exc_info: add the exception being handled (its traceback) to the line.

        Returns:
            True when a line was logged now.
        """
        with self._lock:
            now = self._clock()
            self._pending[key] += 1
            last = self._last.get(key)
            if last is not None and now - last < self._period_s:
                return False
            count = self._pending.pop(key)
            self._last.pop(key, None)
            self._last[key] = now
            while len(self._last) > self._max_keys:
                oldest = next(iter(self._last))
                del self._last[oldest]
                self._pending.pop(oldest, None)
        self._logger.log(
            level, msg, *args, extra={"kv": {**(kv or {}), "count": count}}, exc_info=exc_info
        )
        return True


class LogOnce:
    """Log a message once per key, e.g. "PSI unsupported", instead of every cycle.

    Thread-safe; :meth:`reset` re-arms a key when the condition clears so a later
    recurrence is logged again. At most ``max_keys`` keys are remembered (the oldest is
    forgotten first, and may then be logged once more), so keys built from values that
    churn cannot grow memory without bound.
    """

    def __init__(self, logger: logging.Logger, max_keys: int = 1024) -> None:
        self._logger = logger
        self._seen: dict[str, None] = {}
        self._max_keys = max_keys
        self._lock = threading.Lock()

    def __call__(self, key: str, level: int, msg: str, *args: object) -> bool:
        """Log ``msg % args`` at ``level`` unless ``key`` was logged already.

        Returns:
            True when the message was logged now.
        """
        with self._lock:
            if key in self._seen:
                return False
            self._seen[key] = None
            if len(self._seen) > self._max_keys:
                del self._seen[next(iter(self._seen))]
        self._logger.log(level, msg, *args)
        return True

    def reset(self, key: str) -> None:
        """Forget ``key`` so its next occurrence is logged again."""
        with self._lock:
            self._seen.pop(key, None)
