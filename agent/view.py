"""Read an ``/api/v1/snapshot`` document as rows: engines, GPUs, host pressure, samplers.

``kvpressure status`` and ``kvpressure top`` both render these rows; neither reaches into the
snapshot's samples directly. Every value is in the catalogue's base unit (bytes, seconds,
ratio 0-1, count) and is ``None`` when the agent did not report it (never 0).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from kvpressure.agent.catalogue import SampleName

STALL_REASONS: tuple[str, ...] = ("idle_with_queue", "memory_bound", "throttled")
"""The reasons of ``kvpressure_accelerator_stall_seconds_total``, in display order."""


class Snap:
    """Lookup over the samples of one snapshot document (see :mod:`agent.api`).

    Args:
        doc: the decoded JSON of ``GET /api/v1/snapshot``.
    """

    def __init__(self, doc: dict[str, Any]) -> None:
        self.doc = doc
        self._by_name: dict[str, list[tuple[dict[str, str], float]]] = {}
        for s in doc.get("samples", []):
            try:
                self._by_name.setdefault(str(s["name"]), []).append(
                    (dict(s.get("labels", {})), float(s["value"]))
                )
            except (KeyError, TypeError, ValueError):
                continue  # a malformed sample is skipped, never fatal

    def series(self, name: SampleName, **labels: str) -> Iterator[tuple[dict[str, str], float]]:
        """Yield ``(labels, value)`` of every series of ``name`` matching ``labels``."""
        for lab, v in self._by_name.get(name, []):
            if all(lab.get(k) == want for k, want in labels.items()):
                yield lab, v

    def one(self, name: SampleName, **labels: str) -> float | None:
        """The first value of ``name`` matching ``labels``; ``None`` when there is none."""
        for _, v in self.series(name, **labels):
            return v
        return None


def sampler_state(s: dict[str, Any]) -> str:
    """``up``, ``down`` or ``unsupported`` for one entry of the snapshot's ``samplers``.

    Reads the entry's ``state`` (agents from this version on); for older agents it is
    derived: ``down`` when ``up`` is false, ``unsupported`` when every source it reported is
    unsupported (e.g. ``nvml`` with ``library_not_found``), else ``up``.
    """
    state = s.get("state")
    if isinstance(state, str) and state:
        return state
    if not s.get("up"):
        return "down"
    sources = s.get("sources") or []
    if sources and all(x.get("state") == "unsupported" for x in sources):
        return "unsupported"
    return "up"


@dataclass(slots=True)
class EngineRow:
    """One engine instance as ``status`` and ``top`` show it.

    Attributes:
        engine: the ``engine`` label. instance: the ``instance`` label (host:port).
        up: 1.0 or 0.0 (``kvpressure_engine_up``).
        kv_ratio: KV-cache occupancy 0-1. kv_used / kv_capacity: tokens.
        running / waiting: requests.
        ttft_p50 / ttft_p99 / tpot_p50 / tpot_p99: seconds, the engine's windowed
            percentiles (``kvpressure_engine_latency_seconds``, phase ``ttft`` and ``itl``).
    """

    engine: str
    instance: str
    up: float | None = None
    kv_ratio: float | None = None
    kv_used: float | None = None
    kv_capacity: float | None = None
    running: float | None = None
    waiting: float | None = None
    ttft_p50: float | None = None
    ttft_p99: float | None = None
    tpot_p50: float | None = None
    tpot_p99: float | None = None


def engines(snap: Snap) -> list[EngineRow]:
    """One row per ``(engine, instance)`` that has ``kvpressure_engine_up``, sorted."""
    keys = sorted(
        {
            (lab.get("engine", ""), lab.get("instance", ""))
            for lab, _ in snap.series("kvpressure_engine_up")
        }
    )
    rows = []
    for eng, inst in keys:
        lab = {"engine": eng, "instance": inst}

        def lat(phase: str, pct: str, lab: dict[str, str] = lab) -> float | None:
            return snap.one("kvpressure_engine_latency_seconds", phase=phase, percentile=pct, **lab)

        rows.append(
            EngineRow(
                eng,
                inst,
                up=snap.one("kvpressure_engine_up", **lab),
                kv_ratio=snap.one("kvpressure_engine_kv_cache_usage_ratio", **lab),
                kv_used=snap.one("kvpressure_engine_kv_cache_used_tokens", **lab),
                kv_capacity=snap.one("kvpressure_engine_kv_cache_capacity_tokens", **lab),
                running=snap.one("kvpressure_engine_requests_running", **lab),
                waiting=snap.one("kvpressure_engine_requests_waiting", **lab),
                ttft_p50=lat("ttft", "p50"),
                ttft_p99=lat("ttft", "p99"),
                tpot_p50=lat("itl", "p50"),
                tpot_p99=lat("itl", "p99"),
            )
        )
    return rows


@dataclass(slots=True)
class ProcessRow:
    """A process holding memory on a GPU (``kvpressure_gpu_process_memory_bytes``).

    Attributes:
        pid: process id. process: its name. engine: the engine it serves, when the agent
        joined it to one (its listening port or a parent's). memory: bytes on the GPU.
    """

    pid: str
    process: str
    engine: str | None
    memory: float


@dataclass(slots=True)
class GpuRow:
    """One GPU (or MIG instance) from the GPU sampler's samples.

    Attributes:
        gpu: the ``gpu`` label (index, or ``index/mig``). name: product name when known.
        up: ``kvpressure_gpu_up``. used / reserved / total: bytes.
        utilization / bandwidth: ratios 0-1 (SM utilization, memory-bandwidth utilization).
        stall_s: reason to cumulative seconds (``kvpressure_accelerator_stall_seconds_total``).
        processes: processes on this GPU, largest first.
    """

    gpu: str
    name: str | None = None
    up: float | None = None
    used: float | None = None
    reserved: float | None = None
    total: float | None = None
    utilization: float | None = None
    bandwidth: float | None = None
    stall_s: dict[str, float] = field(default_factory=dict)
    processes: list[ProcessRow] = field(default_factory=list)


def _gpu_key(g: str) -> tuple[int, str]:
    head = g.split("/", 1)[0]
    return (int(head) if head.isdigit() else 1 << 30, g)


def gpus(snap: Snap) -> list[GpuRow]:
    """One row per ``gpu`` label seen in ``kvpressure_gpu_up`` or the memory gauges."""
    labels = {
        lab["gpu"]
        for name in ("kvpressure_gpu_up", "kvpressure_gpu_memory_total_bytes")
        for lab, _ in snap.series(name)
        if "gpu" in lab
    }
    rows = []
    for g in sorted(labels, key=_gpu_key):
        info = next(iter(snap.series("kvpressure_gpu_info", gpu=g)), None)
        row = GpuRow(
            g,
            name=info[0].get("name") if info else None,
            up=snap.one("kvpressure_gpu_up", gpu=g),
            used=snap.one("kvpressure_gpu_memory_used_bytes", gpu=g),
            reserved=snap.one("kvpressure_gpu_memory_reserved_bytes", gpu=g),
            total=snap.one("kvpressure_gpu_memory_total_bytes", gpu=g),
            utilization=snap.one("kvpressure_gpu_utilization_ratio", gpu=g),
            bandwidth=snap.one("kvpressure_gpu_memory_bandwidth_utilization_ratio", gpu=g),
        )
        for lab, v in snap.series("kvpressure_accelerator_stall_seconds_total", gpu=g):
            row.stall_s[lab.get("reason", "")] = v
        for lab, v in snap.series("kvpressure_gpu_process_memory_bytes", gpu=g):
            row.processes.append(
                ProcessRow(lab.get("pid", ""), lab.get("process", ""), lab.get("engine"), v)
            )
        row.processes.sort(key=lambda p: -p.memory)
        rows.append(row)
    return rows


@dataclass(slots=True)
class HostRow:
    """Host memory and pressure.

    Attributes:
        total / available / swap_used / swap_total: bytes.
        psi: ``"memory.some"`` style key to the 10 s average stall ratio 0-1 (system scope).
    """

    total: float | None
    available: float | None
    swap_used: float | None
    swap_total: float | None
    psi: dict[str, float]


def host(snap: Snap) -> HostRow:
    """Host memory, swap and PSI avg10 from the host sampler's samples."""
    psi: dict[str, float] = {}
    for res in ("cpu", "memory", "io"):
        for kind in ("some", "full"):
            v = snap.one("kvpressure_psi_avg10_ratio", resource=res, kind=kind, scope="system")
            if v is not None:
                psi[f"{res}.{kind}"] = v
    return HostRow(
        total=snap.one("kvpressure_host_memory_total_bytes"),
        available=snap.one("kvpressure_host_memory_available_bytes"),
        swap_used=snap.one("kvpressure_host_swap_used_bytes"),
        swap_total=snap.one("kvpressure_host_swap_total_bytes"),
        psi=psi,
    )


def fmt_bytes(v: float | None) -> str:
    """``1536`` -> ``1.5 KiB``; ``-`` for ``None``."""
    if v is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(v) < 1024 or unit == "TiB":
            return f"{v:.1f} {unit}" if unit != "B" else f"{v:.0f} B"
        v /= 1024
    return "-"  # pragma: no cover


def fmt_pct(v: float | None, spec: str = ".1f") -> str:
    """A ratio 0-1 as a percentage (``0.573`` -> ``57.3%``); ``-`` for ``None``."""
    return "-" if v is None else f"{v * 100:{spec}}%"


def fmt_num(v: float | None, spec: str = ".0f") -> str:
    """A number with ``spec``; ``-`` for ``None``."""
    return "-" if v is None else format(v, spec)
