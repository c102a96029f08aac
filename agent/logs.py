"""One-line structured logs on stderr, journald-friendly (logfmt: ``key=value`` pairs).

Example line::

    ts=2026-11-30T16:40:01.123Z level=warning logger=agent.samplers.host \
        msg="PSI unsupported" hint="boot with psi=1"

Extra fields are passed with ``extra={"kv": {...}}``.
"""

from __future__ import annotations

import logging
import sys
import time


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
