"""llama.cpp ``llama-server`` mapping, plus KV occupancy derived from ``/slots``.

Sources (checked against the captures in ``tests/fixtures/engines/llamacpp/``):

=============================================  ==========================================
catalogue metric                               llama.cpp source
=============================================  ==========================================
``kvpressure_engine_requests_running``         ``llamacpp:requests_processing``
``kvpressure_engine_requests_waiting``         ``llamacpp:requests_deferred``
``kvpressure_engine_prompt_tokens_total``      ``llamacpp:prompt_tokens_total`` (prompt
                                               tokens computed, prefix-cache hits excluded)
``kvpressure_engine_prefix_cache_hit_...``     ``llamacpp:prompt_tokens_cached_total``
``kvpressure_engine_generation_tokens_total``  ``llamacpp:tokens_predicted_total``
``kvpressure_engine_prompt_seconds_total``     ``llamacpp:prompt_seconds_total``
``kvpressure_engine_generation_seconds_total`` ``llamacpp:tokens_predicted_seconds_total``
``kvpressure_engine_kv_cache_usage_ratio``     ``llamacpp:kv_cache_usage_ratio`` (builds
                                               before its removal, case 13), else
                                               ``/slots`` (see :func:`slot_usage`)
``kvpressure_engine_kv_cache_used_tokens``     ``llamacpp:kv_cache_tokens`` (old builds),
                                               else ``/slots``
``kvpressure_engine_kv_cache_capacity_tokens`` ``/slots`` (sum of ``n_ctx``), else
                                               ``/props`` ``n_ctx`` x ``total_slots``
``kvpressure_engine_slots{state}``             ``/slots`` (``total``, ``processing``),
                                               else ``/props`` ``total_slots`` (total)
=============================================  ==========================================

The ``model`` label comes from the metrics' ``model`` label (router/aggregator setups) or
from ``/props`` ``model_alias`` (``model_path`` when there is no alias). ``/props`` is read
once, and again after a restart is seen (a cycle later). Throughput gauges
(``prompt_tokens_seconds``, ``predicted_tokens_seconds``) and averages typed as counters
(``n_busy_slots_per_decode``, case 12) are not mapped.

``/slots`` is read every cycle. A server without it (HTTP 404/501, or ``/props`` saying
``endpoint_slots: false``) is recorded as source ``slots`` unsupported, logged once, and
not asked again for :data:`UNSUPPORTED_RETRY_S`. A failing ``/slots`` is a source error;
the metrics part of the cycle still counts.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from kvpressure.agent.catalogue import SampleName
from kvpressure.agent.samplers.base import LogOnce
from kvpressure.agent.samplers.engines.http import HttpResult
from kvpressure.agent.samplers.engines.normalize import (
    RATIO,
    AddonContext,
    EngineAddon,
    EngineMapping,
    NormalizedScrape,
    Rule,
)

log = logging.getLogger(__name__)

UNSUPPORTED_RETRY_S: Final = 60.0
"""Seconds before asking again an endpoint that answered 404/501."""

KV_RATIO: Final = "kvpressure_engine_kv_cache_usage_ratio"
KV_USED: Final = "kvpressure_engine_kv_cache_used_tokens"
KV_CAPACITY: Final = "kvpressure_engine_kv_cache_capacity_tokens"
SLOTS: Final = "kvpressure_engine_slots"


@dataclass(frozen=True, slots=True)
class SlotUsage:
    """KV occupancy derived from one ``/slots`` response.

    Attributes:
        total: number of slots.
        processing: slots with ``is_processing`` true.
        capacity_tokens: sum of the slots' ``n_ctx``; ``None`` when a slot lacks it or
            there are no slots.
        used_tokens: see :func:`slot_usage`; ``None`` when a processing slot lacks the
            fields needed.
    """

    total: int
    processing: int
    capacity_tokens: int | None
    used_tokens: int | None

    @property
    def usage_ratio(self) -> float | None:
        """``used_tokens / capacity_tokens`` (0-1), or ``None`` when either is unknown or 0."""
        if self.used_tokens is None or not self.capacity_tokens:
            return None
        return self.used_tokens / self.capacity_tokens


def _count(value: object) -> int | None:
    """A non-negative JSON integer, else ``None`` (booleans are not integers here)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        return None
    return value


def slot_usage(slots: object) -> SlotUsage | None:
    """Derive KV occupancy from llama-server's ``GET /slots`` JSON.

    Each slot is ``{"id", "n_ctx", "is_processing", "n_prompt_tokens",
    "n_prompt_tokens_processed", "n_prompt_tokens_cache", "next_token": [{"n_decoded",
    ...}], ...}``. In llama-server's ``server_slot::to_json``, ``n_prompt_tokens`` is
    ``prompt.tokens.size()``: the tokens in the slot's KV cache. The server appends each
    prompt token to that list as it is batched and each sampled token as it is decoded, so
    it already includes the generated tokens (observed on a live server: a 365-token prompt
    with 128 generated tokens read 361 ... 489 while ``n_decoded`` went 0 ... 124).

    Formula::

        capacity_tokens = sum(slot.n_ctx for every slot)
        used_tokens     = sum(min(slot.n_ctx, slot.n_prompt_tokens)
                              for slots with is_processing)

    ``n_prompt_tokens + next_token[0].n_decoded`` would count the generated tokens twice.

    Approximations:

    * Only processing slots count. An idle slot keeps its last prompt's KV for reuse
      (prompt caching; ``/slots`` still reports it through the previous task), but those
      cells are evictable, so they count as free, as vLLM counts cached-but-unused blocks.
      The ratio is therefore the KV held by active requests, a lower bound of the
      occupied cells.
    * The count is read between two decode steps: it may lag the server by one batch.
    * ``n_ctx`` is per slot (``-c`` divided by ``-np``); with a unified KV cache the sum
      is the shared pool's size. ``min(n_ctx, ...)`` bounds a slot at its context.
    * Builds without ``n_prompt_tokens`` give ``used_tokens=None`` (KV usage unknown).

    Args:
        slots: the decoded JSON body.

    Returns:
        A :class:`SlotUsage`, or ``None`` when ``slots`` is not a JSON list.
    """
    if not isinstance(slots, list):
        return None
    total = processing = capacity = used = 0
    capacity_known = used_known = True
    for slot in slots:
        if not isinstance(slot, dict):
            continue
        total += 1
        n_ctx = _count(slot.get("n_ctx")) or None
        if n_ctx is None:
            capacity_known = False
        else:
            capacity += n_ctx
        if slot.get("is_processing") is not True:
            continue
        processing += 1
        n_prompt = _count(slot.get("n_prompt_tokens"))
        if n_prompt is None or n_ctx is None:
            used_known = False
            continue
        used += min(n_ctx, n_prompt)
    return SlotUsage(
        total=total,
        processing=processing,
        capacity_tokens=capacity if capacity_known and total else None,
        used_tokens=used if used_known and total else None,
    )


@dataclass(frozen=True, slots=True)
class Props:
    """What the sampler keeps from ``GET /props``.

    Attributes:
        model: ``model_alias`` (else ``model_path``), the ``model`` label; a path is
            reduced to its file name.
        n_ctx: per-slot context size in tokens (``default_generation_settings.n_ctx``).
        total_slots: number of slots (``total_slots``).
        endpoint_slots: whether ``/slots`` is enabled (``endpoint_slots``); ``None`` if
            not said.
    """

    model: str | None
    n_ctx: int | None
    total_slots: int | None
    endpoint_slots: bool | None


def parse_props(data: object) -> Props | None:
    """Extract :class:`Props` from the decoded ``/props`` JSON; ``None`` if not an object."""
    if not isinstance(data, dict):
        return None
    model = data.get("model_alias") or data.get("model_path")
    if isinstance(model, str) and "/" in model:
        # llama-server reports the GGUF path as the alias when none is set; the file name
        # names the model and keeps host-specific directories out of the label.
        model = model.rstrip("/").rsplit("/", 1)[-1]
    settings = data.get("default_generation_settings")
    n_ctx = _count(settings.get("n_ctx")) if isinstance(settings, dict) else None
    endpoint_slots = data.get("endpoint_slots")
    return Props(
        model=model if isinstance(model, str) and model else None,
        n_ctx=n_ctx or None,
        total_slots=_count(data.get("total_slots")) or None,
        endpoint_slots=endpoint_slots if isinstance(endpoint_slots, bool) else None,
    )


class _JsonEndpoint:
    """A llama-server JSON endpoint; a 404/501 answer marks it unsupported for a while.

    Args:
        source: the source name recorded in the batch (``"slots"``, ``"props"``).
        clock: monotonic clock in seconds.
    """

    def __init__(self, source: str, clock: Callable[[], float]) -> None:
        self.source = source
        self._clock = clock
        self._retry_at = 0.0
        self._unsupported = ""
        self._log = LogOnce(log)

    def get(self, ctx: AddonContext) -> tuple[object, bool]:
        """GET ``/<source>`` unless it is known unsupported.

        Returns:
            ``(decoded JSON or None, failed)``. ``None`` with ``failed`` False means
            unsupported (recorded with ``source_unsupported``); with ``failed`` True the
            request failed (recorded with ``source_error``). The caller records success.
        """
        if self._clock() < self._retry_at:
            ctx.batch.source_unsupported(self.source, self._unsupported)
            return None, False
        res = ctx.fetch("/" + self.source)
        reason = _endpoint_failure(res)
        if reason in ("http_404", "http_501"):
            self._unsupported = reason
            self._retry_at = self._clock() + UNSUPPORTED_RETRY_S
            ctx.batch.source_unsupported(self.source, reason)
            self._log(
                "unsupported",
                logging.INFO,
                "%s: llama-server answers %s on /%s (disabled in this build or by a flag); "
                "not asking again for %.0f s",
                ctx.engine,
                reason,
                self.source,
                UNSUPPORTED_RETRY_S,
            )
            return None, False
        data = _json(res.body) if not reason else None
        if data is None:
            ctx.batch.source_error(self.source, reason or "bad_json")
            return None, True
        return data, False


class LlamaCppAddon(EngineAddon):
    """Reads ``/props`` (model, context size) and ``/slots`` (KV occupancy) for llama.cpp.

    Args:
        clock: monotonic clock in seconds (injectable for tests).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._props: Props | None = None
        self._props_due = True
        self._props_endpoint = _JsonEndpoint("props", clock)
        self._slots_endpoint = _JsonEndpoint("slots", clock)

    def before(self, ctx: AddonContext) -> str | None:
        """Fetch ``/props`` when due; return its model alias (the default ``model``)."""
        if self._props_due:
            data, failed = self._props_endpoint.get(ctx)
            props = parse_props(data)
            if props is not None:
                self._props = props
                self._props_due = False
                ctx.batch.source_ok("props")
            elif data is not None and not failed:
                ctx.batch.source_error("props", "bad_json")
        return self._props.model if self._props else None

    def after(self, ctx: AddonContext, scrape: NormalizedScrape) -> bool:
        """Fetch ``/slots`` and add KV occupancy and slot counts; True when it failed."""
        if scrape.restarted:
            self._props_due = True  # model or context size may have changed
        usage: SlotUsage | None = None
        failed = False
        if self._props is not None and self._props.endpoint_slots is False:
            ctx.batch.source_unsupported("slots", "disabled_in_props")
        else:
            data, failed = self._slots_endpoint.get(ctx)
            usage = slot_usage(data)
            if usage is not None:
                ctx.batch.source_ok("slots")
            elif data is not None:
                ctx.batch.source_error("slots", "bad_json")
                failed = True
        self._emit(ctx, scrape, self._props.model if self._props else None, usage)
        return failed

    def _emit(
        self,
        ctx: AddonContext,
        scrape: NormalizedScrape,
        model: str | None,
        usage: SlotUsage | None,
    ) -> None:
        props = self._props
        if usage is not None:
            capacity = usage.capacity_tokens
            values: dict[SampleName, float | None] = {
                KV_RATIO: usage.usage_ratio,
                KV_USED: usage.used_tokens,
            }
            ctx.add(SLOTS, usage.total, model, state="total")
            ctx.add(SLOTS, usage.processing, model, state="processing")
        else:
            capacity = (
                props.n_ctx * props.total_slots
                if (props and props.n_ctx and props.total_slots)
                else None
            )
            values = {}
            if props is not None:
                ctx.add(SLOTS, props.total_slots, model, state="total")
        values[KV_CAPACITY] = capacity
        for name, value in values.items():
            if value is None or scrape.has(name, model):
                continue  # the engine's own metric (old builds) wins
            if name == KV_RATIO and not RATIO[0] <= value <= RATIO[1]:
                continue
            ctx.add(name, value, model)


def _endpoint_failure(res: HttpResult) -> str:
    """``""`` for a 2xx response, else ``http_<code>`` or the transport reason."""
    if res.reason:
        return res.reason
    return "" if res.ok else f"http_{res.status}"


def _json(body: str) -> object:
    try:
        return json.loads(body)
    except ValueError:
        return None


MAPPING = EngineMapping(
    engine_type="llamacpp",
    prefixes=("llamacpp:", "llamacpp_"),
    model_labels=("model",),
    rules=(
        Rule("kvpressure_engine_requests_running", ("llamacpp:requests_processing",)),
        Rule("kvpressure_engine_requests_waiting", ("llamacpp:requests_deferred",)),
        Rule(
            "kvpressure_engine_prompt_tokens_total",
            ("llamacpp:prompt_tokens_total",),
            kind="counter",
        ),
        Rule(
            "kvpressure_engine_prefix_cache_hit_tokens_total",
            ("llamacpp:prompt_tokens_cached_total",),
            kind="counter",
        ),
        Rule(
            "kvpressure_engine_generation_tokens_total",
            ("llamacpp:tokens_predicted_total",),
            kind="counter",
        ),
        Rule(
            "kvpressure_engine_prompt_seconds_total",
            ("llamacpp:prompt_seconds_total",),
            kind="counter",
        ),
        Rule(
            "kvpressure_engine_generation_seconds_total",
            ("llamacpp:tokens_predicted_seconds_total",),
            kind="counter",
        ),
        Rule(KV_RATIO, ("llamacpp:kv_cache_usage_ratio",), valid=RATIO),
        Rule(KV_USED, ("llamacpp:kv_cache_tokens",)),
    ),
    addon=LlamaCppAddon,
)
"""The llama.cpp :class:`~agent.samplers.engines.normalize.EngineMapping`."""
