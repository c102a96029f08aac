"""systemd service notifications (``sd_notify(3)``): READY, WATCHDOG, STATUS, RELOADING, STOPPING.

The protocol is one datagram of newline-separated ``KEY=VALUE`` assignments sent to the
``AF_UNIX`` socket named in ``$NOTIFY_SOCKET`` (a leading ``@`` means the abstract
namespace). Outside systemd (no ``$NOTIFY_SOCKET``) every call is a no-op. The watchdog
interval comes from ``$WATCHDOG_USEC`` (microseconds), honoured only when ``$WATCHDOG_PID``
is unset or names this process.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections.abc import Callable

log = logging.getLogger(__name__)


class Notifier:
    """Sends ``sd_notify`` messages; silent no-op when not run by systemd.

    Args:
        environ: the environment to read ``NOTIFY_SOCKET``/``WATCHDOG_USEC`` from
            (injectable for tests; defaults to ``os.environ``).
    """

    def __init__(self, environ: dict[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        path = env.get("NOTIFY_SOCKET", "")
        self._address = ("\0" + path[1:]) if path.startswith("@") else path
        self._sock: socket.socket | None = None
        usec = env.get("WATCHDOG_USEC", "")
        pid = env.get("WATCHDOG_PID", "")
        self.watchdog_interval_s: float | None = None
        if usec.isdigit() and int(usec) > 0 and (not pid or pid == str(os.getpid())):
            self.watchdog_interval_s = int(usec) / 1e6 / 2  # ping at half the timeout

    @property
    def enabled(self) -> bool:
        """True when ``$NOTIFY_SOCKET`` was set."""
        return bool(self._address)

    def send(self, **fields: str) -> bool:
        """Send one notification, e.g. ``send(READY="1", STATUS="sampling")``.

        Returns:
            True when the datagram was sent; False when disabled or the socket failed
            (logged at debug, never raised: monitoring must not die with its supervisor).
        """
        if not self._address:
            return False
        msg = "\n".join(f"{k}={v}" for k, v in fields.items()).encode()
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self._sock.sendto(msg, self._address)
        except OSError as exc:
            log.debug("sd_notify failed", extra={"kv": {"error": str(exc)}})
            return False
        return True

    def ready(self, status: str) -> bool:
        """Tell systemd start-up is complete (``READY=1``) with a ``STATUS=`` line."""
        return self.send(READY="1", STATUS=status)

    def watchdog(self) -> bool:
        """Keep-alive ping (``WATCHDOG=1``)."""
        return self.send(WATCHDOG="1")

    def reloading(self) -> bool:
        """Announce a reload (``RELOADING=1`` with the monotonic timestamp systemd wants)."""
        return self.send(RELOADING="1", MONOTONIC_USEC=str(int(time.monotonic() * 1e6)))

    def stopping(self) -> bool:
        """Announce shutdown (``STOPPING=1``)."""
        return self.send(STOPPING="1")

    def status(self, text: str) -> bool:
        """Update the one-line status ``systemctl status`` shows."""
        return self.send(STATUS=text)

    def close(self) -> None:
        """Close the socket."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    async def keepalive(self, all_stuck: Callable[[], bool], status: Callable[[], str]) -> None:
        """Send WATCHDOG=1 at half of WatchdogSec, and a STATUS= line every 10 s (forever).

        The ping is skipped while ``all_stuck()`` (every sampler timed out), so systemd
        restarts an agent whose samplers are all wedged (a hung driver call) rather than one
        that is merely busy. Returns at once outside systemd.
        """
        if not self.enabled:
            return
        interval = self.watchdog_interval_s or 10.0
        last_status = 0.0
        while True:
            if self.watchdog_interval_s and not all_stuck():
                self.watchdog()
            now = time.monotonic()
            if now - last_status >= 10.0:
                self.status(status())
                last_status = now
            await asyncio.sleep(min(interval, 10.0))
