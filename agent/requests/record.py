"""The per-request record every request source produces, and the bounded stream carrying it.

Sources (the OTLP trace receiver, the streaming proxy) build one :class:`RequestRecord` per
finished request and :meth:`RequestStream.submit` it; consumers (request-latency metrics,
the attribution engine) each read from their own bounded queue. Nothing here stores prompt
or completion content.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final, Literal, get_args

MAX_ITL_GAPS = 4096
"""Most inter-token gaps kept per record (a longer stream keeps its first gaps)."""


Outcome = Literal[
    "ok",
    "client_error",
    "server_error",
    "upstream_down",
    "cancelled",
    "context_exceeded",
    "kv_exhausted",
]
"""How a request ended (the ``outcome`` label; see :class:`RequestRecord`)."""
OUTCOMES: Final[frozenset[str]] = frozenset(get_args(Outcome))
RecordSource = Literal["otlp", "proxy"]
"""Where a record came from."""


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """One finished inference request, as far as its source could observe it.

    Times are Unix seconds (``start``, ``end``) or durations in seconds; ``None`` means the
    source did not observe that value (never 0 as a stand-in).

    Attributes:
        engine: the ``engine`` label of the engine that served it.
        start: when the request arrived (source's clock).
        end: when the last byte of the response was sent, or the request failed.
        outcome: ``ok``, ``client_error`` (4xx), ``server_error`` (5xx), ``upstream_down``
            (connect refused/timeout at a proxy), ``cancelled`` (client went away),
            ``context_exceeded`` (the prompt does not fit the context),
            ``kv_exhausted`` (the engine's KV pool filled mid-request).
        source: ``otlp`` or ``proxy``.
        model: the served model where known.
        ttft_s: time to first token (first content chunk for streams).
        e2e_s: end-to-end latency.
        queue_s: time waiting for a slot/KV space (engine-reported).
        prefill_s: time in prefill (engine-reported).
        decode_s: time in decode (engine-reported).
        itl_s: inter-token (inter-chunk) gaps in arrival order, at most MAX_ITL_GAPS.
        input_tokens: prompt tokens.
        output_tokens: generated tokens.
        cached_tokens: prompt tokens served from the prefix cache.
        upstream_connect_s: proxy-measured TCP connect time to the engine.
        status: HTTP status code the client got (proxy) or None.
        error_type: the engine's error type (e.g. ``exceed_context_size_error``).
        trace_id: 32-hex-digit trace id of the source span, when known.
        span_id: 16-hex-digit span id of the source span, when known.
    """

    engine: str
    start: float
    end: float
    outcome: Outcome = "ok"
    source: RecordSource = "proxy"
    model: str | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    queue_s: float | None = None
    prefill_s: float | None = None
    decode_s: float | None = None
    itl_s: tuple[float, ...] = ()
    input_tokens: int | None = None
    output_tokens: int | None = None
    cached_tokens: int | None = None
    upstream_connect_s: float | None = None
    status: int | None = None
    error_type: str | None = None
    trace_id: str | None = None
    span_id: str | None = None

    @property
    def latency_s(self) -> float | None:
        """The latency slowness is judged on: TTFT, or end-to-end where TTFT is unknown."""
        return self.ttft_s if self.ttft_s is not None else self.e2e_s


@dataclass
class _Subscriber:
    queue: deque[RequestRecord]
    dropped: int = 0


@dataclass
class RequestStream:
    """Fan-out of finished requests to bounded per-consumer queues.

    Each consumer gets its own ``deque(maxlen=capacity)``; when a slow consumer's queue is
    full the oldest record is dropped and counted in its ``dropped`` total, so a stuck
    consumer costs bounded memory and never blocks a source.

    Args:
        capacity: queue length per consumer.
    """

    capacity: int = 10000
    _subs: dict[str, _Subscriber] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _listeners: list[Callable[[RequestRecord], None]] = field(default_factory=list)

    def subscribe(self, name: str) -> None:
        """Create the queue of consumer ``name`` (idempotent)."""
        with self._lock:
            self._subs.setdefault(name, _Subscriber(deque(maxlen=self.capacity)))

    def submit(self, record: RequestRecord) -> None:
        """Hand ``record`` to every consumer; never blocks, never raises."""
        with self._lock:
            for sub in self._subs.values():
                if len(sub.queue) == sub.queue.maxlen:
                    sub.dropped += 1
                sub.queue.append(record)

    def drain(self, name: str, limit: int | None = None) -> list[RequestRecord]:
        """Remove and return up to ``limit`` records queued for consumer ``name``.

        Raises:
            KeyError: ``name`` never subscribed.
        """
        with self._lock:
            q = self._subs[name].queue
            n = len(q) if limit is None else min(limit, len(q))
            return [q.popleft() for _ in range(n)]

    def dropped(self) -> dict[str, int]:
        """Records dropped per consumer because its queue was full."""
        with self._lock:
            return {k: s.dropped for k, s in self._subs.items()}
