"""Engine series labelled with the engine's pod (issue 16, gap b).

The PID listening on a loopback engine's port -> ``/proc/PID/cgroup`` (fixture files in a
fixture procfs) -> ``pod_uid``; ``namespace``/``pod``/``container`` from the names the GPU
sampler gave that pod's processes. The end-to-end test runs a real engine stand-in (a
subprocess serving recorded vLLM metrics on loopback), the daemon's real PID lookup
(``psutil``) and the real exporter.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from kvpressure.agent.catalogue import POD_LABELS, metric_of_sample
from kvpressure.agent.config import parse
from kvpressure.agent.daemon import Daemon
from kvpressure.agent.kube import EnginePods, names_from_process_rows
from kvpressure.agent.samplers.engines import make_engine_sampler
from kvpressure.agent.samples import Batch, make_labels
from kvpressure.agent.state import SamplerReport

UID = "6f1c2b3a-4d5e-4f60-8a9b-0c1d2e3f4a5b"
UID2 = "0b7d9e44-1c2a-4e0f-9b1d-5a6c7e8f9012"
CID = "a3f9" * 16
VLLM = Path(__file__).parent / "fixtures" / "engines" / "vllm" / "0.32.0-cpu-kv-metrics-load.txt"
NAMES = {UID: ("llm", "vllm-llama-0", "vllm"), UID2: ("llm", "vllm-llama-1", "vllm")}


def cgroup(procfs: Path, pid: int, text: str) -> None:
    (procfs / str(pid)).mkdir(parents=True, exist_ok=True)
    (procfs / str(pid) / "cgroup").write_text(text, encoding="utf-8")


def containerd_v2(uid: str) -> str:
    return (
        "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod"
        f"{uid.replace('-', '_')}.slice/cri-containerd-{CID}.scope\n"
    )


def crio_v1(uid: str) -> str:
    return (
        f"11:memory:/kubepods.slice/kubepods-pod{uid.replace('-', '_')}.slice/crio-{CID}.scope\n"
        f"1:name=systemd:/kubepods.slice/kubepods-pod{uid.replace('-', '_')}.slice/"
        f"crio-{CID}.scope\n"
    )


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class Pids:
    """The ``engine_pids`` input: what psutil found listening, and how often it was asked."""

    def __init__(self, answer: dict[int, str]) -> None:
        self.answer = answer
        self.calls = 0
        self.fail = False

    def __call__(self) -> dict[int, str]:
        self.calls += 1
        if self.fail:
            raise PermissionError("net_connections")
        return dict(self.answer)


def test_pod_uid_and_names_from_the_listening_pid(tmp_path: Path) -> None:
    cgroup(tmp_path, 4242, containerd_v2(UID))
    cgroup(tmp_path, 4343, crio_v1(UID2))
    cgroup(tmp_path, 4444, "0::/system.slice/llama-server.service\n")  # a host process
    pids = Pids({4242: "vllm", 4343: "sglang", 4444: "llama"})
    pods = EnginePods(pids, tmp_path, names=NAMES.get, clock=Clock())
    assert pods.labels("vllm") == {
        "pod_uid": UID,
        "namespace": "llm",
        "pod": "vllm-llama-0",
        "container": "vllm",
    }
    assert pods.labels("sglang")["pod_uid"] == UID2
    assert pods.labels("llama") == {}  # not in a pod: no pod labels, never empty ones
    assert pods.labels("remote") == {}  # on a pod IP: no PID
    without_names = EnginePods(pids, tmp_path, clock=Clock())
    assert without_names.labels("vllm") == {"pod_uid": UID}


def test_label_sets_stay_steady_and_bounded(tmp_path: Path) -> None:
    cgroup(tmp_path, 4242, containerd_v2(UID))
    clock = Clock()
    pids = Pids({4242: "vllm"})
    pods = EnginePods(pids, tmp_path, refresh_s=30, retry_s=5, clock=clock)
    first = pods.labels("vllm")
    assert first == {"pod_uid": UID}
    # the engine is down (no PID listens) or psutil fails: its series keep their labels
    pids.answer = {}
    clock.t += 31
    assert pods.labels("vllm") == first
    pids.fail = True
    clock.t += 31
    assert pods.labels("vllm") == first
    assert pods.errors == 1
    # a new pod answers on the port: the labels follow it
    pids.fail = False
    cgroup(tmp_path, 5252, containerd_v2(UID2))
    pids.answer = {5252: "vllm"}
    clock.t += 31
    assert pods.labels("vllm") == {"pod_uid": UID2}
    # psutil is asked once per refresh, plus once early for an engine first asked since
    calls = pids.calls
    for _ in range(50):
        clock.t += 1
        pods.labels("vllm")
        pods.labels("remote")  # never found: no early call after the first
    assert pids.calls - calls == 1 + 50 // 30
    # one label set per engine, whatever the number of cycles
    assert len(pods._labels) == 1


def test_a_slow_scan_holds_up_no_other_engine(tmp_path: Path) -> None:
    cgroup(tmp_path, 4242, containerd_v2(UID))
    clock = Clock()
    release = threading.Event()
    slow = False

    def engine_pids() -> dict[int, str]:
        if slow:
            release.wait(10)
        return {4242: "vllm"}

    pods = EnginePods(engine_pids, tmp_path, clock=clock)
    assert pods.labels("vllm") == {"pod_uid": UID}
    slow = True
    clock.t += 31
    scanning = threading.Thread(target=pods.labels, args=("vllm",))
    scanning.start()
    time.sleep(0.1)  # the scan is now blocked in engine_pids()
    t0 = time.monotonic()
    assert pods.labels("vllm") == {"pod_uid": UID}
    assert time.monotonic() - t0 < 1
    release.set()
    scanning.join(5)


def test_names_arrive_later_without_dropping_the_uid(tmp_path: Path) -> None:
    cgroup(tmp_path, 4242, containerd_v2(UID))
    known: dict[str, tuple[str, str, str]] = {}
    clock = Clock()
    pods = EnginePods(Pids({4242: "vllm"}), tmp_path, names=known.get, clock=clock)
    assert pods.labels("vllm") == {"pod_uid": UID}
    known[UID] = NAMES[UID]  # the GPU sampler's first slow cycle named the pod
    assert pods.labels("vllm") == {"pod_uid": UID}  # asked again only after retry_s
    clock.t += 5
    assert pods.labels("vllm")["pod"] == "vllm-llama-0"


def test_names_from_the_gpu_process_rows() -> None:
    row = {"gpu": "0", "pid": "1", "pod_uid": UID, "namespace": "llm", "pod": "p0"}
    rows = [
        make_labels({**row, "container": "vllm"}),
        make_labels({**row, "pid": "2", "container": "vllm"}),
        make_labels({"gpu": "1", "pid": "3", "pod_uid": UID2}),  # no names from the kubelet
    ]
    assert names_from_process_rows(rows, UID) == ("llm", "p0", "vllm")
    assert names_from_process_rows(rows, UID2) is None
    # two containers of the pod on GPUs: which one listens is not known
    rows.append(make_labels({**row, "pid": "4", "container": "sidecar"}))
    assert names_from_process_rows(rows, UID) == ("llm", "p0", None)


def test_the_daemon_joins_names_from_published_gpu_reports_never_the_state(
    tmp_path: Path, monkeypatch
) -> None:
    cgroup(tmp_path, 4242, containerd_v2(UID))
    d = Daemon(parse("listen: '127.0.0.1:0'\ndiscovery: {enabled: false}\n"))

    def no_state(*_args: object) -> object:
        raise AssertionError("the engine's pod lookup read the state")

    monkeypatch.setattr(d.state, "latest", no_state)
    clock = Clock()
    pods = EnginePods(Pids({4242: "vllm"}), tmp_path, names=d.pod_names.get, clock=clock)
    assert pods.labels("vllm") == {"pod_uid": UID}  # no GPU report yet: the uid alone
    row = {"gpu": "0", "pid": "4242", "pod_uid": UID, "namespace": "llm", "pod": "vllm-llama-0"}
    gpu = Batch()
    gpu.add("kvpressure_gpu_process_memory_bytes", 2e9, **row, container="vllm")
    other = Batch()
    other.add("kvpressure_gpu_process_memory_bytes", 2e9, **row, container="sidecar")
    d.state.publish(SamplerReport("gpu", time.time(), 0.01, True, batch=gpu))
    d.state.publish(SamplerReport("host", time.time(), 0.01, True, batch=other))  # not the GPU's
    clock.t += 5
    want = {"pod_uid": UID, "namespace": "llm", "pod": "vllm-llama-0", "container": "vllm"}
    assert pods.labels("vllm") == want
    # a failed GPU collection has no rows: as with no report, no names for a pod not yet named
    d.state.publish(SamplerReport("gpu", time.time(), 1.0, False, "timeout"))
    assert d.pod_names.get(UID) is None
    assert pods.labels("vllm") == want  # an engine keeps the names it was given


def test_every_engine_series_carries_the_pod_labels(tmp_path: Path) -> None:
    import httpx

    body = VLLM.read_bytes()
    transport = httpx.MockTransport(
        lambda r: httpx.Response(200, content=body, headers={"Content-Type": "text/plain"})
    )
    pod = {"pod_uid": UID, "namespace": "llm", "pod": "vllm-llama-0", "container": "vllm"}
    sampler = make_engine_sampler(
        "vllm", "http://127.0.0.1:8000", "vllm", transport=transport, pod_labels=lambda e: pod
    )
    batch = Batch()
    sampler.collect(batch)
    assert len(batch.samples) > 20
    for s in batch.samples:
        labels = dict(s.labels)
        assert {k: labels.get(k) for k in POD_LABELS} == pod, s
        metric = metric_of_sample(s.name)
        assert metric is not None and set(labels) <= set(metric.labels) | {"le"}, s
    plain = Batch()
    make_engine_sampler("vllm", "http://127.0.0.1:8000", "vllm", transport=transport).collect(plain)
    assert {s.name for s in plain.samples} == {s.name for s in batch.samples}
    assert not any(k in dict(s.labels) for s in plain.samples for k in POD_LABELS)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


ENGINE = """
import http.server, sys
body = open(sys.argv[2], "rb").read()
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def test_daemon_labels_a_loopback_engine_with_its_pod(tmp_path: Path, run_daemon) -> None:
    port = free_port()
    engine = subprocess.Popen([sys.executable, "-c", ENGINE, str(port), str(VLLM)])
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=1).read()
                break
            except OSError:
                time.sleep(0.05)
        procfs = tmp_path / "proc"
        cgroup(procfs, engine.pid, containerd_v2(UID))  # the engine's PID, in a pod
        cfg = parse(
            "listen: '127.0.0.1:0'\ninterval_s: 0.2s\n"
            f"engines: [{{name: vllm, type: vllm, url: 'http://127.0.0.1:{port}'}}]\n"
            "samplers: {host: {enabled: false}, gpu: {enabled: false}, "
            "capacity: {enabled: false}}\ndiscovery: {enabled: false}\n"
            "attribution: {enabled: false}\n"
        )
        d = Daemon(cfg)
        # the daemon's own PID lookup (psutil), a fixture procfs for the engine's cgroup
        d.engine_pods = EnginePods(d._engine_pids, procfs, names=NAMES.get)
        run_daemon(d)
        url = f"http://127.0.0.1:{d.bound_port}/metrics"
        deadline = time.monotonic() + 10
        kv: list[dict[str, str]] = []
        while not kv and time.monotonic() < deadline:
            text = urllib.request.urlopen(url, timeout=2).read().decode()
            families = {f.name: f for f in text_string_to_metric_families(text)}
            fam = families.get("kvpressure_engine_kv_cache_usage_ratio")
            kv = [s.labels for s in fam.samples] if fam else []
            time.sleep(0.1)
        assert kv, "no KV series"
        want = {"pod_uid": UID, "namespace": "llm", "pod": "vllm-llama-0", "container": "vllm"}
        for labels in kv:
            assert {k: labels.get(k) for k in POD_LABELS} == want, labels
        up = families["kvpressure_engine_up"].samples
        assert [s.labels.get("pod") for s in up] == ["vllm-llama-0"]
    finally:
        engine.kill()
        engine.wait(5)
