"""The kubelet pod-resources client against a real gRPC server on a unix socket."""

from __future__ import annotations

import logging
from concurrent import futures
from pathlib import Path

import pytest

from kvpressure.agent.podresources import LIST_METHOD, MESSAGES, assignments_of, make_client

grpc = pytest.importorskip("grpc")

UUID_A = "GPU-0b3c1a52-7f0e-4b0e-9d3c-2a1f6f1c0a01"
UUID_B = "GPU-0b3c1a52-7f0e-4b0e-9d3c-2a1f6f1c0a02"
MIG = "MIG-5c1b0a4e-1111-2222-3333-444455556666"


def response():
    resp = MESSAGES["ListPodResourcesResponse"]()
    vllm = resp.pod_resources.add(name="vllm-0", namespace="llm")
    c = vllm.containers.add(name="vllm")
    c.devices.add(resource_name="nvidia.com/gpu", device_ids=[UUID_A])
    c.devices.add(resource_name="example.com/nic", device_ids=["eth1"])  # not a GPU
    sglang = resp.pod_resources.add(name="sglang-0", namespace="llm")
    c2 = sglang.containers.add(name="server")
    c2.devices.add(resource_name="nvidia.com/mig-1g.10gb", device_ids=[MIG])
    # two pods time-slicing one GPU: replicas of UUID_B, owner unknowable from the device
    for i, name in enumerate(("a", "b")):
        p = resp.pod_resources.add(name=f"shared-{name}", namespace="dev")
        p.containers.add(name="main").devices.add(
            resource_name="nvidia.com/gpu", device_ids=[f"{UUID_B}::{i}"]
        )
    return resp


def test_assignments_map_gpu_and_mig_uuids_to_one_container_each():
    assert assignments_of(response()) == {
        UUID_A: ("llm", "vllm-0", "vllm"),
        MIG: ("llm", "sglang-0", "server"),
    }


def test_client_reads_a_kubelet_like_grpc_server(tmp_path: Path):
    sock = tmp_path / "kubelet.sock"
    body = response().SerializeToString()

    def handler(request, context):  # the kubelet answers List with every pod
        return MESSAGES["ListPodResourcesResponse"].FromString(body)

    rpc = grpc.unary_unary_rpc_method_handler(
        handler,
        request_deserializer=MESSAGES["ListPodResourcesRequest"].FromString,
        response_serializer=lambda m: m.SerializeToString(),
    )
    service, method = LIST_METHOD.strip("/").split("/")
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, {method: rpc}),))
    server.add_insecure_port(f"unix://{sock}")
    server.start()
    try:
        client = make_client(str(sock), timeout_s=5.0)
        assert client is not None
        assert client()[UUID_A] == ("llm", "vllm-0", "vllm")
    finally:
        server.stop(None)


def test_client_without_a_kubelet_returns_nothing(tmp_path: Path):
    client = make_client(str(tmp_path / "absent.sock"), timeout_s=0.5)
    assert client is not None
    assert client() == {}


def test_a_missing_socket_is_no_assignments_and_one_warning_a_minute(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    client = make_client(str(tmp_path / "no-such.sock"), timeout_s=0.5)
    assert client is not None
    with caplog.at_level(logging.WARNING, logger="kvpressure.agent.podresources"):
        got = [client() for _ in range(5)]  # the GPU sampler asks once per slow cycle
    assert got == [{}] * 5
    failed = [r for r in caplog.records if "pod-resources List" in r.getMessage()]
    assert len(failed) == 1 and "no-such.sock" in failed[0].getMessage()
