"""Which Kubernetes pod and container a process belongs to, from ``/proc/PID/cgroup``.

The kubelet puts every container in a cgroup under ``kubepods``; the path names the pod by
its UID and the container by its runtime ID. Forms read (cgroup v1 lines
``N:controller:/path`` and the v2 line ``0::/path``; a private cgroup namespace shows the
same path relative to the agent's own cgroup, ``/../..`` prefixed, which matches too):

* systemd driver: ``/kubepods.slice/kubepods-burstable.slice/``
  ``kubepods-burstable-pod<uid with _>.slice/<scope>``, Guaranteed pods without the QoS
  slice (``kubepods-pod<uid>.slice``);
* cgroupfs driver: ``/kubepods/burstable/pod<uid>/<id>`` and ``/kubepods/pod<uid>/<id>``;
* container scopes: containerd ``cri-containerd-<64 hex>.scope``, CRI-O ``crio-<64 hex>.scope``
  (``crio-conmon-<id>.scope`` is CRI-O's monitor, not the container: no container ID),
  Docker ``docker-<64 hex>.scope``, or the bare 64-hex ID (cgroupfs driver).

A process outside ``kubepods`` (a host process, or a path hidden by a cgroup namespace
rooted at the container, ``0::/``) has no pod: :func:`pod_of_cgroup` returns ``None``.
Only the pod UID and container ID come from the path; pod, namespace and container *names*
need another source (the kubelet pod-resources socket, see :mod:`agent.podresources`).
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Final, Literal

from kvpressure.agent.samples import Labels

if TYPE_CHECKING:
    from kvpressure.agent.state import SamplerReport

Runtime = Literal["containerd", "cri-o", "docker"]

_POD: Final = re.compile(
    r"(?:^|[/-])pod([0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12})"
    r"(?:\.slice)?(?:/|$)"
)
_SCOPE: Final = re.compile(r"^(cri-containerd|crio|docker)-([0-9a-f]{64})\.scope$")
_BARE_ID: Final = re.compile(r"^[0-9a-f]{64}$")
_RUNTIME: Final[dict[str, Runtime]] = {
    "cri-containerd": "containerd",
    "crio": "cri-o",
    "docker": "docker",
}


@dataclass(frozen=True, slots=True)
class PodRef:
    """The pod (and container) a cgroup path places a process in.

    Attributes:
        pod_uid: the pod's UID, dashed (``1f2e...-...``), as ``metadata.uid`` spells it.
        container_id: the runtime's 64-hex container ID, ``None`` when the path ends at the
            pod (a pod-level process) or at a runtime helper (CRI-O's conmon).
        runtime: ``containerd``, ``cri-o`` or ``docker`` when the scope names it, else
            ``None`` (the cgroupfs driver's bare ID does not say).
    """

    pod_uid: str
    container_id: str | None = None
    runtime: Runtime | None = None


def pod_of_path(path: str) -> PodRef | None:
    """The pod and container of one cgroup path.

    Args:
        path: a cgroup path as ``/proc/PID/cgroup`` writes it (after ``N:controllers:``).

    Returns:
        The :class:`PodRef`, or ``None`` when the path is not under a pod.
    """
    if "kubepods" not in path:
        return None
    m = _POD.search(path)
    if m is None:
        return None
    uid = m.group(1).replace("_", "-")
    last = path.rstrip("/").rsplit("/", 1)[-1]
    scope = _SCOPE.match(last)
    if scope is not None:
        return PodRef(uid, scope.group(2), _RUNTIME[scope.group(1)])
    if _BARE_ID.match(last):
        return PodRef(uid, last)
    return PodRef(uid)


def pod_of_cgroup(text: str) -> PodRef | None:
    """The pod of a process from the text of its ``/proc/PID/cgroup``.

    Args:
        text: the file's lines, ``hierarchy-ID:controller-list:cgroup-path`` (v1 has one
            line per hierarchy, v2 the single ``0::/path``; hybrid hosts have both).

    Returns:
        The first line's pod that names a container, else the first pod found, else
        ``None`` (not in a pod, or the path is hidden by a cgroup namespace).
    """
    found: PodRef | None = None
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        ref = pod_of_path(parts[2].strip())
        if ref is None:
            continue
        if ref.container_id is not None:
            return ref
        found = found or ref
    return found


def pod_of_pid(pid: int, procfs: Path = Path("/proc")) -> PodRef | None:
    """The pod of process ``pid``, read from ``<procfs>/<pid>/cgroup``.

    Args:
        pid: the process ID in ``procfs``'s PID namespace (the agent's, with
            ``hostPID: true`` the node's).
        procfs: the proc filesystem root.

    Returns:
        The :class:`PodRef`, or ``None`` when the process is not in a pod, is gone, or its
        cgroup file cannot be read. Never raises on a missing or unreadable file.
    """
    try:
        text = (procfs / str(pid) / "cgroup").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    return pod_of_cgroup(text)


POD_LABELS: Final = ("pod_uid", "namespace", "pod", "container")
"""The pod labels an engine's series carry when its pod is known (see :class:`EnginePods`)."""

PodNames = Callable[[str], tuple[str | None, str | None, str | None] | None]
"""``pod_uid -> (namespace, pod, container)`` (each ``None`` when not known), or ``None``."""


class EnginePods:
    """Which pod each engine runs in, from the PID listening on the engine's port.

    An engine's pod labels (``pod_uid``, and ``namespace``/``pod``/``container`` where a
    name source knows them) for its series, as dcgm-exporter labels a GPU's series with the
    pod it is assigned to. Sources: ``engine_pids()`` (the PID listening on each loopback
    engine's port, :func:`agent.discovery.listening_pids`), that PID's ``/proc/PID/cgroup``
    (:func:`pod_of_pid`), and ``names(pod_uid)`` (the kubelet's names, as the GPU sampler
    learned them from the pod-resources socket for that pod's GPU processes).

    Label sets stay bounded and steady: at most one per engine, a pod's labels are kept
    while no other PID answers on the engine's port (an engine that is down or restarting
    keeps its series), and replaced when another process (a new pod) does. An engine not on
    loopback, whose PID is not in a pod (a host process) or cannot be read, has none.

    The same lookup tells which PIDs listen on each engine's port (:meth:`pids`): the host
    sampler reads their process tree's CPU time (``kvpressure_engine_process_cpu_seconds_total``)
    without a ``psutil`` scan of its own.

    The scan runs in the thread of the sampler that found it due, outside the lock: the
    others go on with the labels and PIDs already known, never waiting for it.

    Args:
        engine_pids: ``() -> {pid: engine name}``; may raise (the last answer is kept).
        procfs: the proc filesystem the PIDs live in (the host's, with ``hostPID``).
        names: the pod-name source, or ``None`` (``pod_uid`` only).
        refresh_s: seconds between ``engine_pids()`` calls; an engine first asked for after
            the last call triggers one early call (not sooner than ``retry_s`` after it).
        retry_s: seconds between lookups of names not yet known, and the early-call floor.
            Early calls asked for by :meth:`pids` with ``gone`` (an engine whose PIDs are
            not known or exited) that find nothing new double the floor each time, up to
            ``refresh_s``; an answer that changes sets it back to ``retry_s``. So an engine
            that is never found (another PID namespace, no permission, a PID that serves
            several engines' ports) costs one scan per ``refresh_s``, not one per
            ``retry_s``, and a restarted engine is still found ``retry_s`` after it went.
        clock: monotonic clock (tests).
    """

    MAX_ENGINES: Final = 1024

    def __init__(
        self,
        engine_pids: Callable[[], Mapping[int, str]],
        procfs: Path = Path("/proc"),
        names: PodNames | None = None,
        refresh_s: float = 30.0,
        retry_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._engine_pids = engine_pids
        self._procfs = procfs
        self._names = names
        self._refresh_s = refresh_s
        self._retry_s = retry_s
        self._clock = clock
        self._lock = threading.Lock()
        self._refreshed: float | None = None
        self._scanning = False
        self._early_s = retry_s  # the floor of gone-asked early calls (see Args)
        self._answer: dict[int, str] | None = None  # the last engine_pids() answer
        self._pending: set[str] = set()  # asked for, not yet in an engine_pids() answer
        self._settled: set[str] = set()  # considered by an engine_pids() answer
        self._pods: dict[str, tuple[int, PodRef | None]] = {}
        self._labels: dict[str, dict[str, str]] = {}
        self._pids: dict[str, tuple[int, ...]] = {}
        self._names_tried: dict[str, float] = {}
        self.errors = 0
        """``engine_pids()`` or ``names()`` calls that raised (cumulative)."""

    def labels(self, engine: str) -> dict[str, str]:
        """The pod labels of ``engine``'s series.

        Args:
            engine: the engine's configured name (its ``engine`` label).

        Returns:
            ``{"pod_uid": ..., "namespace": ..., "pod": ..., "container": ...}`` with only
            the known ones, ``{}`` when the engine's pod is not known. Never raises.
        """
        now = self._refresh(engine)
        with self._lock:
            out = self._labels.get(engine)
            if out is None:
                return {}
            if self._names is not None and len(out) == 1:
                tried = self._names_tried.get(engine)
                if tried is None or now - tried >= self._retry_s:
                    self._names_tried[engine] = now
                    out = self._labels[engine] = self._with_names(out["pod_uid"])
            return dict(out)

    def pids(self, engine: str, gone: bool = False) -> tuple[int, ...]:
        """The PIDs listening on ``engine``'s port, as the last ``engine_pids()`` answer had them.

        The same bounded lookup as :meth:`labels` (one ``engine_pids()`` call per
        ``refresh_s``, shared with it): the host sampler reads these processes' CPU time.

        Args:
            engine: the engine's configured name.
            gone: the caller found the PIDs it was given exited (the engine restarted): ask
                ``engine_pids()`` again early, not sooner than ``retry_s`` after the last call.

        Returns:
            The PIDs, ascending (several when worker processes share the listening socket);
            ``()`` when none is known (not on loopback, not listening, no permission). Never
            raises.
        """
        self._refresh(engine, early=gone)
        with self._lock:
            return self._pids.get(engine, ())

    def _refresh(self, engine: str, early: bool = False) -> float:
        """Call ``engine_pids()`` when due (see the class doc); returns the clock's now."""
        with self._lock:
            now = self._clock()
            due = self._refreshed is None or now - self._refreshed >= self._refresh_s
            floor = self._early_s
            if engine not in self._settled and len(self._settled) < self.MAX_ENGINES:
                self._pending.add(engine)  # no engine_pids() answer has considered it yet
                early, floor = True, self._retry_s
            backoff = False
            if early and self._refreshed is not None and now - self._refreshed >= floor:
                backoff = not due and floor == self._early_s  # only a gone-asked early call
                due = True
            scan = due and not self._scanning
            if scan:
                # one caller scans, outside the lock; the others go on with what is known
                self._scanning = True
                self._refreshed = now
                self._settled |= self._pending
                self._pending.clear()
        if scan:
            try:
                pids: dict[int, str] | None = dict(self._engine_pids())
            except Exception:  # noqa: BLE001 - a failing source keeps the last answer
                pids = None
            with self._lock:
                self._scanning = False
                if pids is None:
                    self.errors += 1
                else:
                    if pids != self._answer:
                        self._early_s = self._retry_s
                    elif backoff:
                        self._early_s = min(self._refresh_s, 2 * self._early_s)
                    self._answer = pids
                    self._apply(pids)
        return now

    def _apply(self, pids: dict[int, str]) -> None:
        """Take one ``engine_pids()`` answer: each listed engine's PIDs and pod."""
        grouped: dict[str, list[int]] = {}
        for pid, engine in pids.items():
            if engine in grouped or len(grouped) < self.MAX_ENGINES:
                grouped.setdefault(engine, []).append(pid)
        self._pids = {engine: tuple(sorted(ps)) for engine, ps in grouped.items()}
        for pid, engine in pids.items():
            known = self._pods.get(engine)
            if known is not None and known[0] == pid:
                continue
            if known is None and len(self._pods) >= self.MAX_ENGINES:
                continue
            ref = pod_of_pid(pid, self._procfs)
            self._pods[engine] = (pid, ref)
            prev = self._labels.get(engine)
            if ref is None:
                self._labels.pop(engine, None)
            elif prev is None or prev["pod_uid"] != ref.pod_uid:  # same pod: names stay
                self._labels[engine] = {"pod_uid": ref.pod_uid}
                self._names_tried.pop(engine, None)

    def _with_names(self, pod_uid: str) -> dict[str, str]:
        out = {"pod_uid": pod_uid}
        if self._names is None:
            return out
        try:
            found = self._names(pod_uid)
        except Exception:  # noqa: BLE001 - names are optional: pod_uid stays
            self.errors += 1
            return out
        for key, value in zip(("namespace", "pod", "container"), found or (), strict=False):
            if value:
                out[key] = value
        return out


class PodNameJoin:
    """The kubelet's names of the pods on this node's GPUs, by ``pod_uid``: a derived join.

    Only the GPU source's process rows (``kvpressure_gpu_process_memory_bytes``) tie a
    ``pod_uid`` (a GPU process's ``/proc/PID/cgroup``) to the kubelet's names (its
    pod-resources assignment of that GPU), and :class:`EnginePods` needs those names for an
    engine's pod. So the join sits on the derived side of the pipeline, not in a source:
    :meth:`take` receives every published report (``AgentState.on_publish``) and keeps the
    GPU source's latest process rows; :meth:`get` answers from them. The engine source reads
    it only through :class:`EnginePods` (``Context.engine_pods``), as a lookup, and never
    reads the state or the GPU sampler.

    Args:
        sampler: the ``sampler`` label of the reports to take (the GPU source's).

    Thread-safety: :meth:`take` runs on the publishing sampler's thread, :meth:`get` on an
    engine sampler's; one lock guards the one reference they share.
    """

    def __init__(self, sampler: str = "gpu") -> None:
        self._sampler = sampler
        self._lock = threading.Lock()
        self._rows: tuple[Labels, ...] = ()

    def take(self, report: SamplerReport) -> None:
        """Keep the process rows of a published GPU report (none when it failed).

        Args:
            report: any published report; other samplers' are ignored.
        """
        if report.sampler != self._sampler:
            return
        batch = report.batch if report.ok else None
        rows = tuple(
            [s.labels for s in batch or () if s.name == "kvpressure_gpu_process_memory_bytes"]
        )
        with self._lock:
            self._rows = rows

    def get(self, pod_uid: str) -> tuple[str | None, str | None, str | None] | None:
        """``(namespace, pod, container)`` of ``pod_uid`` (see :func:`names_from_process_rows`)."""
        with self._lock:
            rows = self._rows
        return names_from_process_rows(rows, pod_uid)


def names_from_process_rows(
    rows: Iterable[Labels], pod_uid: str
) -> tuple[str | None, str | None, str | None] | None:
    """The names the GPU sampler gave a pod's processes, for :class:`EnginePods`.

    Args:
        rows: label sets of ``kvpressure_gpu_process_memory_bytes`` (the GPU sampler's
            latest batch: ``namespace``/``pod``/``container`` from the kubelet's
            pod-resources socket).
        pod_uid: the pod asked for.

    Returns:
        ``(namespace, pod, container)``: ``container`` is ``None`` when the pod's rows name
        more than one container (which one listens is not known); ``None`` when no row of
        that pod has names, or rows disagree on the pod's namespace or name.
    """
    found: set[tuple[str, str]] = set()
    containers: set[str | None] = set()
    for labels in rows:
        d = dict(labels)
        if d.get("pod_uid") != pod_uid or "pod" not in d or "namespace" not in d:
            continue
        found.add((d["namespace"], d["pod"]))
        containers.add(d.get("container"))
    if len(found) != 1:
        return None
    ((namespace, pod),) = found
    return namespace, pod, containers.pop() if len(containers) == 1 else None
