"""The sampler interface shared by every sampler, and small helpers they use."""

from __future__ import annotations

import abc
import logging
import threading

from agent.samples import Batch

log = logging.getLogger(__name__)


class Sampler(abc.ABC):
    """A periodic reader of one kind of source.

    Subclasses implement :meth:`collect`. The daemon calls it on a dedicated worker thread
    every ``interval_s`` seconds; a call that runs longer than ``timeout_s`` marks the
    sampler down (``kvpressure_sampler_up 0``) without blocking any other sampler.

    Attributes:
        name: the value of the ``sampler`` label, e.g. ``"host"`` or ``"engine:vllm"``.
        interval_s: seconds between the starts of two collections.
        timeout_s: seconds after which a running collection counts as failed.
    """

    name: str = "sampler"

    def __init__(self, interval_s: float = 1.0, timeout_s: float | None = None) -> None:
        self.interval_s = interval_s
        self.timeout_s = timeout_s if timeout_s is not None else max(interval_s, 2.0)

    @abc.abstractmethod
    def collect(self, batch: Batch) -> None:
        """Read the sources and add samples to ``batch``.

        Args:
            batch: the batch to fill. A source that fails is recorded with
                :meth:`Batch.source_error`; what was read stays in the batch.

        Raises:
            Exception: anything raised means the whole sampler failed this cycle; the
                daemon logs it, sets ``kvpressure_sampler_up 0`` and drops the batch.
        """

    def close(self) -> None:  # noqa: B027 - optional hook, empty by default
        """Release resources (HTTP clients, NVML handles). Called once at shutdown."""


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
