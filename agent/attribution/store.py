"""Bounded in-memory history of requests, slow-request attributions and windows.

The attribution sampler writes here; ``/api/v1/attributions`` (and so ``kvpressure
explain``) reads :meth:`AttributionStore.query`. Everything is bounded: the newest
``recent_requests`` request summaries, ``recent_attributions`` slow-request attributions and
``recent_windows`` window attributions are kept, oldest dropped first. The cumulative slow
counts (``kvpressure_slow_requests_total``) live here too, so they survive a config reload
that rebuilds the sampler.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass
from typing import Any

from kvpressure.agent.attribution.detector import quantile
from kvpressure.agent.attribution.model import UNKNOWN, Attribution, WindowAttribution
from kvpressure.agent.requests.record import RequestRecord

PHASES: tuple[str, ...] = ("ttft", "e2e", "queue", "prefill", "decode", "tpot", "itl", "itl_max")
"""Latency phases summarised by :meth:`AttributionStore.query`; ``tpot`` is each request's
decode time per output token after the first, ``itl`` its mean inter-token gap and
``itl_max`` its longest."""


@dataclass(frozen=True, slots=True)
class RequestSummary:
    """The latency facts of one request kept for ``explain`` (no content, no ids).

    Attributes:
        engine: the ``engine`` label.
        end: request end, Unix seconds.
        outcome: the request's outcome.
        slow: judged slow.
        phases: phase name to seconds, for the phases the source observed.
        slo_missed: a phase missed its SLO (slow or not; see
            :attr:`agent.attribution.detector.Verdict.slo_missed`).
    """

    engine: str
    end: float
    outcome: str
    slow: bool
    phases: tuple[tuple[str, float], ...]
    slo_missed: bool = False

    @classmethod
    def of(cls, r: RequestRecord, slow: bool, slo_missed: bool = False) -> RequestSummary:
        """Summarise ``r``."""
        vals = {
            "ttft": r.ttft_s,
            "e2e": r.e2e_s,
            "queue": r.queue_s,
            "prefill": r.prefill_s,
            "decode": r.decode_s,
            "tpot": _tpot(r),
            "itl": (sum(r.itl_s) / len(r.itl_s)) if r.itl_s else None,
            "itl_max": max(r.itl_s) if r.itl_s else None,
        }
        return cls(
            r.engine,
            r.end,
            r.outcome,
            slow,
            tuple([(k, v) for k, v in vals.items() if v is not None]),
            slo_missed,
        )


def _tpot(r: RequestRecord) -> float | None:
    """Decode seconds per output token after the first; ``None`` when unknown."""
    if r.output_tokens is None or r.output_tokens < 2 or r.ttft_s is None:
        return None
    decode = (
        r.decode_s
        if r.decode_s is not None
        else (r.e2e_s - r.ttft_s if r.e2e_s is not None else None)
    )
    if decode is None or decode < 0:
        return None
    return decode / (r.output_tokens - 1)


def _q(values: list[float]) -> dict[str, float | int]:
    s = sorted(values)
    return {
        "n": len(s),
        "p50": quantile(s, 0.5),
        "p95": quantile(s, 0.95),
        "p99": quantile(s, 0.99),
    }


class AttributionStore:
    """Thread-safe bounded history for ``explain`` and the slow-request counters.

    Args:
        recent_requests: request summaries kept.
        recent_attributions: slow-request attributions kept.
        recent_windows: window attributions kept (all engines together).
    """

    def __init__(
        self,
        recent_requests: int = 20000,
        recent_attributions: int = 5000,
        recent_windows: int = 8640,
    ) -> None:
        self._lock = threading.Lock()
        self._requests: deque[RequestSummary] = deque(maxlen=recent_requests)
        self._attributions: deque[Attribution] = deque(maxlen=recent_attributions)
        self._windows: deque[WindowAttribution] = deque(maxlen=recent_windows)
        self._slow: Counter[tuple[str, str]] = Counter()
        self._engines: set[str] = set()
        self._latest: dict[str, WindowAttribution] = {}

    # --- writers -------------------------------------------------------------------------

    def add_request(self, summary: RequestSummary) -> None:
        """Keep one request's summary."""
        with self._lock:
            self._requests.append(summary)
            self._engines.add(summary.engine)

    def add_attribution(self, a: Attribution) -> None:
        """Keep a slow request's attribution and count it."""
        with self._lock:
            self._attributions.append(a)
            self._slow[(a.engine, a.cause)] += 1
            self._engines.add(a.engine)

    def add_window(self, w: WindowAttribution) -> None:
        """Keep a window attribution; it becomes the engine's latest."""
        with self._lock:
            self._windows.append(w)
            prev = self._latest.get(w.engine)
            if prev is None or w.end >= prev.end:
                self._latest[w.engine] = w

    # --- readers -------------------------------------------------------------------------

    def slow_counts(self) -> dict[tuple[str, str], int]:
        """Cumulative slow requests by ``(engine, cause)`` since the agent started."""
        with self._lock:
            return dict(self._slow)

    def engines_with_requests(self) -> set[str]:
        """Engines that have had at least one request."""
        with self._lock:
            return set(self._engines)

    def latest_windows(self) -> dict[str, WindowAttribution]:
        """The newest window attribution of every engine."""
        with self._lock:
            return dict(self._latest)

    def oldest(self) -> float | None:
        """The earliest end of a kept request or attribution (Unix seconds); ``None`` if none.

        Spans can arrive late for requests that ended before the agent started; the API's
        window reaches back to them but no further than that.
        """
        with self._lock:
            ends = [r.end for r in self._requests] + [a.end for a in self._attributions]
        return min(ends, default=None)

    def attributions(self, since: float = 0.0) -> list[Attribution]:
        """Slow-request attributions whose request ended at or after ``since``, oldest first."""
        with self._lock:
            return [a for a in self._attributions if a.end >= since]

    def query(
        self,
        since: float,
        now: float | None = None,
        engine: str | None = None,
        limit: int = 100,
        window_s: float = 10.0,
        min_score: float = 0.3,
    ) -> dict[str, Any]:
        """The ``/api/v1/attributions`` document for requests that ended at or after ``since``.

        Args:
            since: Unix seconds.
            now: the document's time (defaults to the current time).
            engine: only this engine.
            limit: most slow-request attributions listed (newest kept).
            window_s: window length, to merge adjacent windows into ranges.
            min_score: the score from which a cause counts (``attribution.min_score``):
                ``scored_by_cause`` counts every cause of a slow request at or above it,
                not only the primary one.

        Returns:
            ``{"time", "since", "min_score", "engines": [every engine the store has seen,
            whatever ``engine`` is], "requests": {engine: {"requests", "ok", "failed",
            "slow", "slo_missed", "slo_missed_not_slow", "outcomes", "phases": {phase: {"n",
            "p50", "p95", "p99"}}}},
            "slow_by_cause": {engine: {primary cause: n}}, "scored_by_cause": {engine:
            {cause: n}}, "evidence": [...], "dominant": [...], "unassessed": [...],
            "attributions": [...], "windows": [...], "totals": {engine: {cause: n}}}``.
            The phase percentiles are over the requests whose outcome is ``ok``: a failed
            or cancelled request's latency measures the failure, not the service, and is
            counted in ``failed`` (by outcome in ``outcomes``) instead.
        """
        now = time.time() if now is None else now
        with self._lock:
            reqs = [r for r in self._requests if r.end >= since]
            atts = [a for a in self._attributions if a.end >= since]
            wins = [w for w in self._windows if w.end > since]
            totals = dict(self._slow)
            known = set(self._engines) | {w.engine for w in self._windows}
        if engine is not None:
            reqs = [r for r in reqs if r.engine == engine]
            atts = [a for a in atts if a.engine == engine]
            wins = [w for w in wins if w.engine == engine]
            totals = {k: v for k, v in totals.items() if k[0] == engine}
        # windows are aligned to window_s: the first one can start before ``since`` (the
        # asked start, or the agent's start): no range is shown before it
        dominant = [{**d, "start": max(d["start"], since)} for d in _dominant(wins, atts, window_s)]
        unassessed = [
            {**u, "start": max(u["start"], since)} for u in _unassessed(atts, wins, window_s)
        ]
        return {
            "time": now,
            "since": since,
            "min_score": min_score,
            "engines": sorted(known),
            "requests": _request_stats(reqs),
            "slow_by_cause": _by_cause(atts),
            "scored_by_cause": _scored_by_cause(atts, min_score),
            "evidence": _strongest_evidence(atts, min_score),
            "dominant": dominant,
            "unassessed": unassessed,
            "attributions": [a.to_dict() for a in atts[-limit:]] if limit > 0 else [],
            "windows": [w.to_dict() for w in wins if w.cause is not None][-limit:],
            "totals": _nest(totals),
        }


def _nest(counts: dict[tuple[str, str], int]) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for (eng, cause), n in sorted(counts.items()):
        out.setdefault(eng, {})[cause] = n
    return out


def _request_stats(reqs: list[RequestSummary]) -> dict[str, Any]:
    by_engine: dict[str, list[RequestSummary]] = {}
    for r in reqs:
        by_engine.setdefault(r.engine, []).append(r)
    out: dict[str, Any] = {}
    for eng, rs in sorted(by_engine.items()):
        phases: dict[str, list[float]] = {}
        ok = [r for r in rs if r.outcome == "ok"]
        for r in ok:
            for k, v in r.phases:
                phases.setdefault(k, []).append(v)
        out[eng] = {
            "requests": len(rs),
            "ok": len(ok),
            "failed": len(rs) - len(ok),
            "slow": sum(1 for r in rs if r.slow),
            "slo_missed": sum(1 for r in rs if r.slo_missed),
            "slo_missed_not_slow": sum(1 for r in rs if r.slo_missed and not r.slow),
            "outcomes": dict(Counter(r.outcome for r in rs)),
            "phases": {k: _q(phases[k]) for k in PHASES if phases.get(k)},
        }
    return out


def _by_cause(atts: list[Attribution]) -> dict[str, dict[str, int]]:
    return _nest(dict(Counter((a.engine, a.cause) for a in atts)))


def _scored_by_cause(atts: list[Attribution], min_score: float) -> dict[str, dict[str, int]]:
    """Slow requests per engine and cause for every cause that scored at least ``min_score``."""
    c: Counter[tuple[str, str]] = Counter()
    for a in atts:
        for cause, score in a.scores.items():
            if score >= min_score:
                c[(a.engine, cause)] += 1
    return _nest(dict(c))


def _strongest_evidence(atts: list[Attribution], min_score: float) -> list[dict[str, Any]]:
    """Per cause, its top three signals across the slow requests where it scored.

    A cause counts for a request when it is the primary cause or scored at least
    ``min_score``, so a secondary cause (network 0.30 beside compute 0.71) shows its
    evidence too; ``of`` is the number of such requests.
    """
    groups: dict[tuple[str, str], list[Any]] = {}
    per_cause: Counter[str] = Counter()
    for a in atts:
        causes = {a.cause} | {c for c, v in a.scores.items() if v >= min_score}
        for cause in causes:
            per_cause[cause] += 1
        for e in a.evidence:
            if e.cause in causes:
                groups.setdefault((e.cause, e.signal), []).append(e)
    out: list[dict[str, Any]] = []
    for cause in sorted(per_cause, key=lambda c: -per_cause[c]):
        if cause == UNKNOWN:
            continue
        sigs = [(k[1], v) for k, v in groups.items() if k[0] == cause]
        sigs.sort(key=lambda kv: (-len(kv[1]), -max(e.score for e in kv[1])))
        for signal, evs in sigs[:3]:
            first = evs[0]
            out.append(
                {
                    "cause": cause,
                    "signal": signal,
                    "metric": first.metric,
                    "unit": first.unit,
                    "threshold": first.threshold,
                    "saturation": first.saturation,
                    "median": statistics.median(e.value for e in evs),
                    "max": max(e.value for e in evs),
                    "requests": len(evs),
                    "of": per_cause[cause],
                    "labels": dict(first.labels),
                }
            )
    return out


def _dominant(
    wins: list[WindowAttribution], atts: list[Attribution], window_s: float
) -> list[dict[str, Any]]:
    """Merge consecutive slow windows with the same dominant cause into time ranges.

    A window's dominant cause is the most common primary cause of the slow requests that
    ended in it, or the window's own attribution when none did.
    """
    per_window: dict[tuple[str, float], Counter[str]] = {}
    for a in atts:
        key = (a.engine, a.end - (a.end % window_s))
        per_window.setdefault(key, Counter())[a.cause] += 1
    cells: dict[tuple[str, float], tuple[str, int]] = {}
    for w in wins:
        if w.cause is not None:
            cells[(w.engine, w.start)] = (w.cause, w.slow)
    for key, counter in per_window.items():
        cause, _ = counter.most_common(1)[0]
        cells[key] = (cause, sum(counter.values()))
    ranges: list[dict[str, Any]] = []
    for (eng, start), (cause, slow) in sorted(cells.items()):
        last = ranges[-1] if ranges else None
        if (
            last is not None
            and last["engine"] == eng
            and last["cause"] == cause
            and start - last["end"] <= window_s * 0.5
        ):
            last["end"] = start + window_s
            last["windows"] += 1
            last["slow"] += slow
        else:
            ranges.append(
                {
                    "engine": eng,
                    "cause": cause,
                    "start": start,
                    "end": start + window_s,
                    "windows": 1,
                    "slow": slow,
                }
            )
    return ranges


def _unassessed(
    atts: list[Attribution], wins: list[WindowAttribution], window_s: float
) -> list[dict[str, Any]]:
    """Time ranges where something (engine metrics) could not be assessed."""
    spans: dict[tuple[str, str], list[tuple[float, float, int]]] = {}
    for a in atts:
        for what in a.unassessed:
            spans.setdefault((a.engine, what), []).append((a.start, a.end, 1))
    for w in wins:
        for what in w.unassessed:
            spans.setdefault((w.engine, what), []).append((w.start, w.end, 0))
    out: list[dict[str, Any]] = []
    for (eng, what), items in sorted(spans.items()):
        items.sort()
        cur: list[float | int] | None = None
        for s, e, n in items:
            if cur is not None and s <= float(cur[1]) + window_s:
                cur[1] = max(float(cur[1]), e)
                cur[2] = int(cur[2]) + n
            else:
                if cur is not None:
                    out.append({"engine": eng, "what": what, "start": cur[0], "end": cur[1],
                                "slow_requests": cur[2]})  # fmt: skip
                cur = [s, e, n]
        if cur is not None:
            out.append({"engine": eng, "what": what, "start": cur[0], "end": cur[1],
                        "slow_requests": cur[2]})  # fmt: skip
    return out
