"""Which container the kubelet gave each GPU to: the pod-resources gRPC API.

The kubelet serves ``PodResourcesLister`` (``k8s.io/kubelet/pkg/apis/podresources/v1``) on
the unix socket ``/var/lib/kubelet/pod-resources/kubelet.sock``; its ``List`` call returns
every pod (``name``, ``namespace``) with its containers and the device IDs each was
assigned, per resource (``nvidia.com/gpu``: the NVIDIA device plugin's IDs are GPU UUIDs,
``GPU-...``, or MIG UUIDs, ``MIG-...``). dcgm-exporter labels its series from the same call.

Only the messages of ``List`` are declared, with their field numbers from the kubelet's
``api.proto``; fields not declared here (CPU IDs, memory, dynamic resources, topology) are
skipped by the protobuf decoder. The gRPC client is ``grpcio`` (the ``kubernetes`` extra);
without it, or without the socket, :func:`gpu_assignments` returns ``{}``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Final

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from kvpressure.agent.logs import RateLimitedLog

log = logging.getLogger(__name__)

DEFAULT_SOCKET: Final = "/var/lib/kubelet/pod-resources/kubelet.sock"
LIST_METHOD: Final = "/v1.PodResourcesLister/List"
GPU_RESOURCES: Final = ("nvidia.com/gpu", "nvidia.com/mig-")
"""Resource names whose device IDs are NVIDIA GPU or MIG UUIDs (``nvidia.com/mig-1g.10gb``
and the other MIG strategies' names start with the second)."""

Assignment = tuple[str, str, str]
"""``(namespace, pod, container)``."""

_STRING = descriptor_pb2.FieldDescriptorProto.TYPE_STRING
_MESSAGE = descriptor_pb2.FieldDescriptorProto.TYPE_MESSAGE
_OPTIONAL = descriptor_pb2.FieldDescriptorProto.LABEL_OPTIONAL
_REPEATED = descriptor_pb2.FieldDescriptorProto.LABEL_REPEATED


def _messages() -> dict[str, Any]:
    """The ``List`` request and response message classes, built from a descriptor."""
    f = descriptor_pb2.FileDescriptorProto(
        name="kvpressure/podresources/v1/api.proto", package="v1", syntax="proto3"
    )

    def message(name: str, *fields: tuple[str, int, int, int, str]) -> None:
        m = f.message_type.add(name=name)
        for fname, number, ftype, label, type_name in fields:
            fd = m.field.add(name=fname, number=number, type=ftype, label=label)
            if type_name:
                fd.type_name = type_name

    message("ListPodResourcesRequest")
    message(
        "ListPodResourcesResponse", ("pod_resources", 1, _MESSAGE, _REPEATED, ".v1.PodResources")
    )
    message(
        "PodResources",
        ("name", 1, _STRING, _OPTIONAL, ""),
        ("namespace", 2, _STRING, _OPTIONAL, ""),
        ("containers", 3, _MESSAGE, _REPEATED, ".v1.ContainerResources"),
    )
    message(
        "ContainerResources",
        ("name", 1, _STRING, _OPTIONAL, ""),
        ("devices", 2, _MESSAGE, _REPEATED, ".v1.ContainerDevices"),
    )
    message(
        "ContainerDevices",
        ("resource_name", 1, _STRING, _OPTIONAL, ""),
        ("device_ids", 2, _STRING, _REPEATED, ""),
    )
    pool = descriptor_pool.DescriptorPool()
    pool.Add(f)
    return {
        name: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"v1.{name}"))
        for name in (
            "ListPodResourcesRequest",
            "ListPodResourcesResponse",
            "PodResources",
            "ContainerResources",
            "ContainerDevices",
        )
    }


MESSAGES: Final = _messages()
"""Message classes by name (``ListPodResourcesResponse``, ``PodResources``, ...)."""


def assignments_of(response: Any) -> dict[str, Assignment]:
    """Map each GPU device ID to the one container it is assigned to.

    Args:
        response: a decoded ``ListPodResourcesResponse``.

    Returns:
        Device ID (GPU or MIG UUID) -> ``(namespace, pod, container)``. A device listed for
        more than one container (time-slicing or MPS sharing replicas) is left out: which
        container a process on it belongs to cannot be told from the device alone. Entries
        with an empty name are left out too (names are never empty labels).
    """
    seen: dict[str, Assignment | None] = {}
    for pod in response.pod_resources:
        for c in pod.containers:
            for dev in c.devices:
                if not dev.resource_name.startswith(GPU_RESOURCES):
                    continue
                for device_id in dev.device_ids:
                    who = (pod.namespace, pod.name, c.name)
                    if not all(who):
                        continue
                    # a replica suffix (time-slicing: "GPU-uuid::1") names the same GPU
                    uuid = device_id.split("::", 1)[0]
                    seen[uuid] = who if uuid not in seen or seen[uuid] == who else None
    return {k: v for k, v in seen.items() if v is not None}


def make_client(
    socket_path: str = DEFAULT_SOCKET, timeout_s: float = 2.0
) -> Callable[[], dict[str, Assignment]] | None:
    """A callable that asks the kubelet for the GPU assignments, for the GPU sampler.

    Args:
        socket_path: the kubelet's pod-resources socket (mount
            ``/var/lib/kubelet/pod-resources`` into the agent's pod).
        timeout_s: deadline of one ``List`` call, seconds.

    Returns:
        The callable (it returns ``{}`` and logs once a minute when the call fails), or
        ``None`` when ``grpcio`` is not installed.
    """
    try:
        import grpc
    except ImportError:
        log.info("grpcio not installed: no pod names from the kubelet pod-resources socket")
        return None
    channel = grpc.insecure_channel(f"unix://{socket_path}")
    request_cls = MESSAGES["ListPodResourcesRequest"]
    response_cls = MESSAGES["ListPodResourcesResponse"]
    call = channel.unary_unary(
        LIST_METHOD,
        request_serializer=lambda m: m.SerializeToString(),
        response_deserializer=response_cls.FromString,
    )

    warn = RateLimitedLog(log, 60.0)

    def gpu_assignments() -> dict[str, Assignment]:
        try:
            return assignments_of(call(request_cls(), timeout=timeout_s))
        except grpc.RpcError as exc:
            # the socket missing or the kubelet down: one line a minute with the count
            warn(
                "list-failed",
                logging.WARNING,
                "pod-resources List on %s failed: %s",
                socket_path,
                exc.code() if hasattr(exc, "code") else exc,
            )
            return {}

    return gpu_assignments
