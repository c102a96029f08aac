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
from dataclasses import dataclass
from pathlib import Path
from typing import Final, Literal

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
