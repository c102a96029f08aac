"""PID -> pod from /proc/PID/cgroup: cgroup v1 and v2, systemd and cgroupfs drivers,
containerd, CRI-O and Docker scopes (issue 16, point 5)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvpressure.agent.kube import PodRef, pod_of_cgroup, pod_of_path, pod_of_pid

UID = "6f1c2b3a-4d5e-4f60-8a9b-0c1d2e3f4a5b"
UID_ = UID.replace("-", "_")
CID = "a3f9" * 16


@pytest.mark.parametrize(
    ("text", "want"),
    [
        # cgroup v2, systemd driver, containerd, Burstable pod
        (
            f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_}.slice/"
            f"cri-containerd-{CID}.scope\n",
            PodRef(UID, CID, "containerd"),
        ),
        # cgroup v2, systemd driver, CRI-O, Guaranteed pod (no QoS slice)
        (
            f"0::/kubepods.slice/kubepods-pod{UID_}.slice/crio-{CID}.scope\n",
            PodRef(UID, CID, "cri-o"),
        ),
        # cgroup v2, private cgroup namespace: the path is relative to the agent's cgroup
        (
            f"0::/../../kubepods-besteffort.slice/kubepods-besteffort-pod{UID_}.slice/"
            f"cri-containerd-{CID}.scope\n",
            PodRef(UID, CID, "containerd"),
        ),
        # cgroup v1, cgroupfs driver: bare container ID, runtime unknown
        (
            "12:pids:/kubepods/burstable/pod" + UID + "/" + CID + "\n"
            "11:memory:/kubepods/burstable/pod" + UID + "/" + CID + "\n"
            "1:name=systemd:/kubepods/burstable/pod" + UID + "/" + CID + "\n",
            PodRef(UID, CID),
        ),
        # cgroup v1, systemd driver, Docker (dockershim / cri-dockerd)
        (
            f"10:cpu,cpuacct:/kubepods.slice/kubepods-besteffort.slice/"
            f"kubepods-besteffort-pod{UID_}.slice/docker-{CID}.scope\n",
            PodRef(UID, CID, "docker"),
        ),
        # hybrid: the v1 line has the container, the v2 line only the pod
        (
            f"0::/kubepods.slice/kubepods-pod{UID_}.slice\n"
            f"4:memory:/kubepods.slice/kubepods-pod{UID_}.slice/crio-{CID}.scope\n",
            PodRef(UID, CID, "cri-o"),
        ),
        # CRI-O's conmon monitor sits in the pod but is not the container
        (
            f"0::/kubepods.slice/kubepods-pod{UID_}.slice/crio-conmon-{CID}.scope\n",
            PodRef(UID),
        ),
    ],
)
def test_pod_and_container_from_the_path(text: str, want: PodRef) -> None:
    assert pod_of_cgroup(text) == want


@pytest.mark.parametrize(
    "text",
    [
        "0::/\n",  # cgroup namespace rooted at the container: nothing to read
        "0::/system.slice/nvidia-persistenced.service\n",
        "0::/user.slice/user-1000.slice/session-3.scope\n",
        f"0::/system.slice/docker-{CID}.scope\n",  # plain Docker, no Kubernetes
        "0::/kubepods.slice/kubepods-burstable.slice\n",  # a QoS slice, no pod
        "garbage\n",
        "",
    ],
)
def test_not_in_a_pod(text: str) -> None:
    assert pod_of_cgroup(text) is None


def test_pod_of_path_keeps_the_uid_dashed() -> None:
    ref = pod_of_path(f"/kubepods/pod{UID}")
    assert ref == PodRef(UID)


def test_pod_of_pid_reads_procfs_and_survives_a_vanished_process(tmp_path: Path) -> None:
    (tmp_path / "4242").mkdir()
    (tmp_path / "4242" / "cgroup").write_text(
        f"0::/kubepods.slice/kubepods-pod{UID_}.slice/cri-containerd-{CID}.scope\n"
    )
    assert pod_of_pid(4242, tmp_path) == PodRef(UID, CID, "containerd")
    assert pod_of_pid(4243, tmp_path) is None  # gone between listing and reading
