"""The derived ``capacity`` sampler: live headroom, saturation, the knee and reuse savings.

It reads no source of its own: each cycle it takes the engines' latest samples from
:class:`~agent.state.AgentState` (``latest``) and their recent history (``timeline``) and
adds, per ``engine`` label:

================================================  ==========================================
metric                                            formula
================================================  ==========================================
``kvpressure_kv_bytes_per_token{engine,model}``   the model's KV shape
                                                  (:mod:`agent.capacity.kvbytes`): from
                                                  ``capacity.engines.<name>.model`` (a GGUF
                                                  or HF config), else the GGUF a llama.cpp
                                                  engine serves (its ``model`` label, or
                                                  ``model_path`` from one ``/props`` read),
                                                  when it is readable on this host
``kvpressure_kv_headroom_tokens``                 capacity - used tokens (vLLM, which
                                                  exports no used tokens: capacity x
                                                  (1 - usage ratio))
``kvpressure_kv_headroom_bytes``                  headroom tokens x bytes per token
``kvpressure_kv_request_tokens``                  used tokens / running requests
``kvpressure_kv_saturation_concurrency``          capacity / a request's footprint at its
                                                  largest (see ``request_footprint``),
                                                  capped at the slot count where the
                                                  engine has slots (llama.cpp)
``kvpressure_kv_time_to_saturation_seconds``      headroom / growth rate of used tokens
                                                  (least squares over ``window_s``); absent
                                                  unless used tokens grow
``kvpressure_kv_occupancy_latency_seconds``       the knee (:mod:`agent.capacity.knee`)
``kvpressure_prefix_cache_saved_seconds_total``   delta prefix-cache hit tokens x measured
                                                  prefill seconds per computed prompt token
================================================  ==========================================

Knee sources. With a :class:`~agent.requests.record.RequestStream` (the daemon's, when it
has one) the sampler subscribes as consumer ``capacity``: each record's TTFT is observed at
the highest KV occupancy the engine reported between the request's start and its first
token, and each inter-token gap at the highest occupancy during decode. Without a stream
it falls back to the engines' decode counters: once per cycle, the mean inter-token time
``delta generation_seconds_total / delta generation_tokens_total`` (``phase="itl"``) at the
current occupancy; TTFT then has no source and is absent.

Prefill rate for savings: ``delta prompt_seconds_total / delta computed prompt tokens`` over
``window_s`` (at least 16 tokens), else the lifetime ratio. Computed tokens are
``prompt_tokens_total`` for llama.cpp (hits excluded) and ``prompt_tokens_total -
prefix_cache_hit_tokens_total`` for engines whose prompt count includes hits (vLLM, SGLang,
TensorRT-LLM). llama.cpp sums prefill time per slot, so the rate is request-seconds per
token: what a request would have waited, which is what "saved" means here. An engine
without a prompt-seconds counter (vLLM's is a histogram the engine sampler does not map)
has no savings series.
"""

from __future__ import annotations

import logging
import math
import operator
import time
from collections import defaultdict, deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import TYPE_CHECKING, Final

from kvpressure.agent.capacity.knee import KneeHistogram
from kvpressure.agent.capacity.kvbytes import DTYPE_BYTES, KVShape, ModelShapeError, load_shape
from kvpressure.agent.catalogue import SampleName
from kvpressure.agent.logs import LogOnce
from kvpressure.agent.pipeline import Context, Plan, Sampler, Stage, register
from kvpressure.agent.samples import Batch, Labels

if TYPE_CHECKING:
    from kvpressure.agent.config import Config
    from kvpressure.agent.requests.record import RequestRecord, RequestStream
    from kvpressure.agent.state import AgentState

log = logging.getLogger(__name__)

CONSUMER = "capacity"
"""This sampler's queue name on the RequestStream."""

USED: Final = "kvpressure_engine_kv_cache_used_tokens"
CAPACITY: Final = "kvpressure_engine_kv_cache_capacity_tokens"
RATIO: Final = "kvpressure_engine_kv_cache_usage_ratio"
RUNNING: Final = "kvpressure_engine_requests_running"
SLOTS: Final = "kvpressure_engine_slots"
INFO: Final = "kvpressure_engine_info"
HITS: Final = "kvpressure_engine_prefix_cache_hit_tokens_total"
PROMPT_TOKENS: Final = "kvpressure_engine_prompt_tokens_total"
PROMPT_SECONDS: Final = "kvpressure_engine_prompt_seconds_total"
GEN_TOKENS: Final = "kvpressure_engine_generation_tokens_total"
GEN_SECONDS: Final = "kvpressure_engine_generation_seconds_total"

TIMELINE_READS: Final = frozenset({USED, RATIO, RUNNING, PROMPT_SECONDS, PROMPT_TOKENS, HITS})
"""What :class:`CapacitySampler` reads back from the timeline (its windows: used-token
history and growth, peak occupancy, the request footprint, prefill rates); everything else
it reads from the latest state. The timeline keeps these for it (:mod:`agent.pipeline`)."""

PROMPT_INCLUDES_HITS = frozenset({"vllm", "sglang", "trtllm"})
"""Engine types whose prompt-token counter includes prefix-cache hits."""

MIN_RATE_TOKENS = 16.0

FINALS_KEPT = 1024
"""Finished requests' footprints kept per engine for :meth:`CapacitySampler.request_footprint`."""


@dataclass(frozen=True, slots=True)
class ModelSource:
    """Where the capacity sampler finds an engine's model shape.

    Attributes:
        path: a ``.gguf`` file, an HF ``config.json`` or its directory.
        kv_dtype: the engine's KV dtype; ``auto`` = the config's dtype (HF) or ``f16``
            (GGUF, llama.cpp's default).
    """

    path: str
    kv_dtype: str = "auto"


@dataclass(slots=True)
class EngineView:
    """One engine's latest values, summed over its series (models, instances)."""

    engine: str
    type: str | None = None
    model: str | None = None
    instance: str | None = None
    used: float | None = None
    capacity: float | None = None
    ratio: float | None = None
    running: float | None = None
    slots: float | None = None
    hits: float | None = None
    prompt_tokens: float | None = None
    prompt_seconds: float | None = None
    gen_tokens: float | None = None
    gen_seconds: float | None = None

    @property
    def used_tokens(self) -> float | None:
        """Used tokens, or ``ratio x capacity`` where the engine gives only the ratio."""
        if self.used is not None:
            return self.used
        if self.ratio is not None and self.capacity is not None:
            return self.ratio * self.capacity
        return None

    @property
    def occupancy(self) -> float | None:
        """KV occupancy ratio (0-1): the engine's ratio, else used / capacity."""
        if self.ratio is not None:
            return self.ratio
        if self.used is not None and self.capacity:
            return self.used / self.capacity
        return None


def _add(cur: float | None, v: float) -> float:
    return v if cur is None else cur + v


_SUMMED: Final[dict[SampleName, str]] = {
    USED: "used",
    CAPACITY: "capacity",
    RUNNING: "running",
    HITS: "hits",
    PROMPT_TOKENS: "prompt_tokens",
    PROMPT_SECONDS: "prompt_seconds",
    GEN_TOKENS: "gen_tokens",
    GEN_SECONDS: "gen_seconds",
}


def engine_views(latest: Callable[[SampleName], Mapping[Labels, float]]) -> dict[str, EngineView]:
    """Group the engines' latest samples by ``engine`` label.

    Args:
        latest: ``AgentState.latest``-like: metric name to ``{labels: value}``.

    Returns:
        ``engine label -> EngineView`` for every engine with a KV capacity, usage or
        running-request sample.
    """
    views: dict[str, EngineView] = {}

    def view(labels: Labels) -> EngineView | None:
        d = dict(labels)
        e = d.get("engine")
        if not e:
            return None
        v = views.setdefault(e, EngineView(e))
        if v.model is None and d.get("model"):
            v.model = d["model"]
        if v.instance is None and d.get("instance"):
            v.instance = d["instance"]
        return v

    for name, attr in _SUMMED.items():
        for labels, value in latest(name).items():
            v = view(labels)
            if v is not None:
                setattr(v, attr, _add(getattr(v, attr), value))
    for labels, value in latest(RATIO).items():
        v = view(labels)
        if v is not None:
            v.ratio = value if v.ratio is None else max(v.ratio, value)
    for labels, value in latest(SLOTS).items():
        if dict(labels).get("state") == "total":
            v = view(labels)
            if v is not None:
                v.slots = _add(v.slots, value)
    for labels, _value in latest(INFO).items():
        d = dict(labels)
        v = views.get(d.get("engine", ""))
        if v is not None:
            v.type = d.get("type") or v.type
            v.model = v.model or d.get("model") or None
    return {
        e: v
        for e, v in views.items()
        if v.capacity is not None or v.ratio is not None or v.running is not None
    }


VIEW_NAMES: Final[tuple[SampleName, ...]] = (*_SUMMED, RATIO, SLOTS, INFO)
"""Every metric :func:`engine_views` reads (asked in one ``AgentState.latest_many`` call)."""


def saturation_concurrency(
    capacity: float | None,
    request_tokens: float | None,
    slots: float | None = None,
) -> float | None:
    """Return how many concurrent requests fit at ``request_tokens`` tokens each.

    ``capacity / request_tokens``, capped at ``slots`` where the engine runs at most that
    many requests (llama.cpp). With llama.cpp's default per-slot contexts (each slot owns
    ``n_ctx / slots`` cells) a request that fits a slot occupies the whole slot, so the
    pooled figure is at least ``slots`` and the cap is what binds: requests wait for a
    slot, not for tokens. ``None`` when ``capacity`` or ``request_tokens`` is unknown or 0.
    """
    if not capacity or not request_tokens or request_tokens <= 0:
        return None
    pooled = capacity / request_tokens
    return min(pooled, slots) if slots else pooled


def growth_rate(ts: Sequence[float], vs: Sequence[float]) -> float | None:
    """Least-squares slope (units per second) of the points ``(ts[i], vs[i])``.

    Args:
        ts: timestamps, seconds.
        vs: the values, as many as ``ts``.

    Returns:
        The slope, 0.0 for a constant series, ``None`` with fewer than 3 points or one
        timestamp.
    """
    n = len(ts)
    if n < 3:
        return None
    if len(set(vs)) == 1:
        return 0.0  # constant: exactly flat (the mean of equal floats can differ from them)
    mt = sum(ts) / n
    mv = sum(vs) / n
    den = sum((t - mt) ** 2 for t in ts)
    if den <= 0:
        return None
    return sum((t - mt) * (v - mv) for t, v in zip(ts, vs, strict=True)) / den


Columns = tuple[Sequence[float], Sequence[float]]
"""``(timestamps, values)`` of equal length, as :meth:`agent.timeline.Timeline.columns` gives."""


def _summed_series(series: Mapping[Labels, Columns]) -> Columns:
    """The series of ``series`` summed at each timestamp, as columns in time order.

    Args:
        series: label set to its ``(timestamps, values)`` (``Timeline.columns``).

    Returns:
        ``(timestamps, sums)``. One series whose timestamps only rise (an engine with one
        model: the usual case, and a 60 s window of a 0.1 s gauge is 600 points read once a
        second per engine) is that series' columns as they are; several, or a timestamp
        repeated or out of order, are summed.
    """
    if len(series) == 1:
        ((ts, vs),) = series.values()
        if all(map(operator.lt, ts, islice(ts, 1, None))):
            return ts, vs
    acc: dict[float, float] = defaultdict(float)
    for ts, vs in series.values():
        for t, v in zip(ts, vs, strict=True):
            acc[t] += v
    ordered = sorted(acc.items())
    return [t for t, _ in ordered], [v for _, v in ordered]


@dataclass(slots=True)
class _EngineMemory:
    last_hits: float | None = None
    saved_s: float = 0.0
    saving_known: bool = False
    last_gen: tuple[float, float] | None = None  # (tokens, seconds)


class CapacitySampler(Sampler):
    """Derived capacity metrics from what the engine samplers published.

    Args:
        state: the agent state to read (``latest`` and ``timeline``).
        interval_s: seconds between cycles.
        window_s: window of growth rates and prefill rates, in seconds.
        models: engine label to :class:`ModelSource` (configured shapes).
        auto_gguf: read a llama.cpp engine's ``model`` label as a GGUF path when it is one.
        stream: the daemon's request stream, if any (knee from per-request TTFT/ITL).
        clock: Unix time in seconds (injectable for tests).
    """

    name = "capacity"
    timeline_reads = TIMELINE_READS

    def __init__(
        self,
        state: AgentState,
        interval_s: float = 1.0,
        window_s: float = 60.0,
        models: Mapping[str, ModelSource] | None = None,
        auto_gguf: bool = True,
        stream: RequestStream | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        super().__init__(interval_s)
        self.state = state
        self.window_s = window_s
        self.models = dict(models or {})
        self.auto_gguf = auto_gguf
        self.stream = stream
        self.clock = clock
        self.props_timeout_s = 1.0
        self.knee = KneeHistogram()
        self._mem: dict[str, _EngineMemory] = defaultdict(_EngineMemory)
        self._shapes: dict[tuple[str, str | None], KVShape | None] = {}
        self._finals: dict[str, deque[tuple[float, float]]] = defaultdict(
            lambda: deque(maxlen=FINALS_KEPT)
        )
        self._log = LogOnce(log)
        # this collection's used-token history per engine (cleared at each collect)
        self._history: dict[tuple[str, float, float | None], Columns] = {}
        if stream is not None:
            stream.subscribe(CONSUMER)

    # ---- shapes ------------------------------------------------------------------------
    def shape_for(self, view: EngineView, batch: Batch | None = None) -> KVShape | None:
        """Return the engine's model shape (configured, else llama.cpp's GGUF); cached."""
        key = (view.engine, view.model)
        if key in self._shapes:
            return self._shapes[key]
        src = self.models.get(view.engine)
        path: str | None = None
        dtype = "auto"
        if src is not None:
            path, dtype = src.path, src.kv_dtype
        elif self.auto_gguf and view.type == "llamacpp":
            path = self._llamacpp_gguf(view)
        shape: KVShape | None = None
        if path is not None:
            try:
                shape = load_shape(path, dtype)
            except (OSError, ValueError, ModelShapeError) as exc:
                self._log(
                    f"shape:{view.engine}",
                    logging.WARNING,
                    "capacity: cannot read the model shape of engine %s from %s: %s",
                    view.engine,
                    path,
                    exc,
                )
                if batch is not None:
                    batch.source_error(f"model_shape:{view.engine}", type(exc).__name__)
        self._shapes[key] = shape
        return shape

    def _llamacpp_gguf(self, view: EngineView) -> str | None:
        """Return the local GGUF a llama-server serves, or ``None`` (:func:`llamacpp_gguf_path`).

        Read once per engine and model.
        """
        return llamacpp_gguf_path(view.model, view.instance, self.props_timeout_s)

    # ---- collect -----------------------------------------------------------------------
    def collect(self, batch: Batch) -> None:
        """Add the capacity metrics of every engine the state knows (see the module doc)."""
        now = self.clock()
        latest = self.state.latest_many(VIEW_NAMES)  # one walk of the reports, not one a name
        views = engine_views(latest.__getitem__)
        if self.stream is not None:
            self._drain_stream(now)
        else:
            for view in views.values():
                self._counter_itl(view)
        try:
            for view in views.values():
                self._engine(batch, view, now)
        finally:
            self._history.clear()  # a collection's windows are not held until the next one
        for name, value, labels in self.knee.samples():
            batch.add(name, value, **labels)

    def _engine(self, batch: Batch, v: EngineView, now: float) -> None:
        e = v.engine
        shape = self.shape_for(v, batch)
        bpt = shape.bytes_per_token if shape is not None else None
        batch.add("kvpressure_kv_bytes_per_token", bpt, engine=e, model=v.model)
        used = v.used_tokens
        headroom = (
            max(v.capacity - used, 0.0) if v.capacity is not None and used is not None else None
        )
        batch.add("kvpressure_kv_headroom_tokens", headroom, engine=e)
        if headroom is not None and bpt is not None:
            batch.add("kvpressure_kv_headroom_bytes", headroom * bpt, engine=e)
        if used is not None and v.running and v.running > 0 and used > 0:
            batch.add("kvpressure_kv_request_tokens", used / v.running, engine=e)
            batch.add(
                "kvpressure_kv_saturation_concurrency",
                saturation_concurrency(v.capacity, self.request_footprint(v, now), v.slots),
                engine=e,
            )
        batch.add("kvpressure_kv_time_to_saturation_seconds", self._tts(v, headroom, now), engine=e)
        self._savings(batch, v, now)

    def _used_history(self, v: EngineView, now: float) -> Columns:
        # asked twice per engine and collection (footprint, time to saturation): read once
        key = (v.engine, now, v.capacity)
        got = self._history.get(key)
        if got is None:
            got = self._history[key] = self._read_used_history(v, now)
        return got

    def _read_used_history(self, v: EngineView, now: float) -> Columns:
        tl = self.state.timeline
        match = {"engine": v.engine}
        cols = _summed_series(tl.columns(USED, now - self.window_s, now, match))
        if cols[0] or v.capacity is None:
            return cols
        ts, ratios = _summed_series(tl.columns(RATIO, now - self.window_s, now, match))
        capacity = v.capacity
        return ts, [r * capacity for r in ratios]

    def request_footprint(self, v: EngineView, now: float) -> float | None:
        """Return the KV tokens one request needs at its largest, for saturation.

        Requests grow while they decode and the pool fills at their largest, so the
        instantaneous mean (``kvpressure_kv_request_tokens``) underestimates what a request
        will need. In order:

        * the mean ``input_tokens + output_tokens`` of the requests that finished in the
          window (request stream): each one's final footprint;
        * else the largest ``used / running`` seen in the window (timeline), which reaches
          the final footprint when requests run in step and lies between the mean and it
          otherwise;
        * else the current ``used / running``.
        """
        finals = [n for t, n in self._finals.get(v.engine, ()) if t >= now - self.window_s]
        if finals:
            return sum(finals) / len(finals)
        tl = self.state.timeline
        run_ts, run_vs = _summed_series(
            tl.columns(RUNNING, now - self.window_s, now, {"engine": v.engine})
        )
        running = dict(zip(run_ts, run_vs, strict=True))
        ts, used_tokens = self._used_history(v, now)
        ratios = [
            u / r
            for t, u in zip(ts, used_tokens, strict=True)
            if u > 0 and (r := running.get(t, 0)) > 0
        ]
        used = v.used_tokens
        if used is not None and v.running:
            ratios.append(used / v.running)
        return max(ratios) if ratios else None

    def _tts(self, v: EngineView, headroom: float | None, now: float) -> float | None:
        if headroom is None:
            return None
        slope = growth_rate(*self._used_history(v, now))
        if slope is None or slope <= 0:
            return None
        return headroom / slope

    def _window_delta(self, name: SampleName, engine: str, now: float) -> float | None:
        _, vs = _summed_series(
            self.state.timeline.columns(name, now - self.window_s, now, {"engine": engine})
        )
        if len(vs) < 2:
            return None
        return vs[-1] - vs[0]

    def prefill_seconds_per_token(self, v: EngineView, now: float) -> float | None:
        """Measured prefill seconds per computed prompt token (see the module doc)."""
        if v.prompt_seconds is None or v.prompt_tokens is None:
            return None
        includes_hits = (v.type or "") in PROMPT_INCLUDES_HITS
        d_sec = self._window_delta(PROMPT_SECONDS, v.engine, now)
        d_tok = self._window_delta(PROMPT_TOKENS, v.engine, now)
        if includes_hits and d_tok is not None:
            d_hits = self._window_delta(HITS, v.engine, now) or 0.0
            d_tok -= d_hits
        if d_sec is not None and d_tok is not None and d_tok >= MIN_RATE_TOKENS and d_sec > 0:
            return d_sec / d_tok
        computed = v.prompt_tokens - ((v.hits or 0.0) if includes_hits else 0.0)
        if computed > 0 and v.prompt_seconds > 0:
            return v.prompt_seconds / computed
        return None

    def _savings(self, batch: Batch, v: EngineView, now: float) -> None:
        if v.hits is None:
            return
        mem = self._mem[v.engine]
        rate = self.prefill_seconds_per_token(v, now)
        if mem.last_hits is not None and rate is not None:
            delta = v.hits - mem.last_hits
            if delta < 0:  # counter reset the engine sampler did not hide
                delta = v.hits
            mem.saved_s += delta * rate
        if rate is not None:
            mem.saving_known = True
        mem.last_hits = v.hits
        if mem.saving_known:
            batch.add("kvpressure_prefix_cache_saved_seconds_total", mem.saved_s, engine=v.engine)

    # ---- knee ----------------------------------------------------------------------------
    def _counter_itl(self, v: EngineView) -> None:
        mem = self._mem[v.engine]
        if v.gen_tokens is None or v.gen_seconds is None:
            return
        cur = (v.gen_tokens, v.gen_seconds)
        prev, mem.last_gen = mem.last_gen, cur
        occ = v.occupancy
        if prev is None or occ is None:
            return
        d_tok, d_sec = cur[0] - prev[0], cur[1] - prev[1]
        if d_tok > 0 and d_sec > 0:
            self.knee.observe(v.engine, "itl", d_sec / d_tok, occ)

    def peak_occupancy(self, engine: str, start: float, end: float) -> float | None:
        """Return the highest KV occupancy ``engine`` reported in ``[start, end]``.

        Falls back to the last value reported up to ``5 x interval_s`` before ``start``
        when no sample falls inside (a phase shorter than a sampling interval).
        """
        tl = self.state.timeline
        slack = 5 * self.interval_s
        series = tl.window(RATIO, start - slack, max(end, start), {"engine": engine})
        if not series:
            return None
        inside = [v for pts in series.values() for t, v in pts if start <= t <= end]
        if inside:
            return max(inside)
        before = [(t, v) for pts in series.values() for t, v in pts if t < start]
        return max(before)[1] if before else None

    def observe_record(self, r: RequestRecord) -> None:
        """Fold one finished request's TTFT and inter-token gaps into the knee.

        Its final KV footprint (``input_tokens + output_tokens``) is kept for
        :meth:`request_footprint`.
        """
        if r.outcome != "ok":
            return
        if r.input_tokens is not None and r.output_tokens is not None:
            self._finals[r.engine].append((r.end, float(r.input_tokens + r.output_tokens)))
        if r.ttft_s is not None:
            occ = self.peak_occupancy(r.engine, r.start, r.start + r.ttft_s)
            if occ is not None:
                self.knee.observe(r.engine, "ttft", r.ttft_s, occ)
        if r.itl_s:
            first = r.start + (r.ttft_s or 0.0)
            occ = self.peak_occupancy(r.engine, first, r.end)
            if occ is not None:
                for gap in r.itl_s:
                    self.knee.observe(r.engine, "itl", gap, occ)

    def _drain_stream(self, now: float) -> None:
        assert self.stream is not None
        for r in self.stream.drain(CONSUMER):
            if math.isfinite(r.start):
                self.observe_record(r)


def llamacpp_gguf_path(model: str | None, instance: str | None, timeout_s: float) -> str | None:
    """The GGUF file a llama-server serves, when it is readable on this host, or ``None``.

    The engine's ``model`` label when that is a path to a ``.gguf`` file, else ``model_path``
    from one ``GET http://<instance>/props`` (builds whose alias is the bare file name).
    ``None`` when neither names a readable file here (the agent runs elsewhere, the engine
    is gone, or ``/props`` fails within ``timeout_s`` seconds).
    """
    if model and model.lower().endswith(".gguf") and Path(model).is_file():
        return model
    if not instance:
        return None
    import httpx

    try:
        r = httpx.get(f"http://{instance}/props", timeout=timeout_s)
        r.raise_for_status()
        path = r.json().get("model_path")
    except (httpx.HTTPError, ValueError, AttributeError):
        return None
    if isinstance(path, str) and path.lower().endswith(".gguf") and Path(path).is_file():
        return path
    return None


def _check(config: Config) -> Iterator[tuple[str, str]]:
    """Each ``capacity.engines.<engine>.kv_dtype`` is ``auto`` or a known dtype."""
    for engine, m in config.capacity.engines.items():
        if m.kv_dtype != "auto" and m.kv_dtype not in DTYPE_BYTES:
            yield (
                f"capacity.engines.{engine}.kv_dtype",
                f"expected auto or one of {', '.join(sorted(DTYPE_BYTES))}",
            )


@register(
    "capacity",
    Stage.DERIVED,
    "KV headroom, saturation, time to saturation, latency knee, prefix-reuse savings",
    check=_check,
    reads=CapacitySampler.timeline_reads,
)
def _plan(ctx: Context) -> list[Plan]:
    cfg = ctx.config
    interval = ctx.interval_s("capacity")
    if not cfg.samplers.capacity.interval_s and cfg.samplers.engines.enabled:
        # Every input but the request stream is an engine sample: computing faster than the
        # engines are scraped repeats the same answer (and costs as much each time).
        interval = max(interval, ctx.interval_s("engines"))
    spec = ("capacity", interval, cfg.capacity.model_dump_json())
    return [
        Plan(
            "capacity",
            spec,
            lambda: CapacitySampler(
                ctx.state,
                interval_s=interval,
                window_s=cfg.capacity.window_s,
                models={
                    k: ModelSource(m.model, m.kv_dtype) for k, m in cfg.capacity.engines.items()
                },
                auto_gguf=cfg.capacity.auto_gguf,
                stream=ctx.requests,  # consumer "capacity": the latency knee
            ),
        )
    ]
