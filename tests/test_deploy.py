"""Deployment artefacts: the systemd unit, its default config, and the Kubernetes manifests.

* ``systemd-analyze verify`` on the unit (a copy whose ExecStart points at this venv's
  ``kvpressure``, since verify needs the binary to exist) and the
  ``systemd-analyze security --offline=true`` exposure score, printed and bounded. Both
  skip only when ``systemd-analyze`` is missing outside CI (Debian package ``systemd``).
* ``deploy/kvpressure.yaml`` and the Kubernetes ConfigMap pass ``kvpressure check-config``.
* Core Kubernetes objects validate against the Kubernetes JSON schemas
  (``kubernetes-validate``, strict); the Prometheus-Operator ``PodMonitor`` and
  ``PrometheusRule`` validate against the operator's own CRDs (v0.93.0, vendored in
  tests/fixtures/crds/, through tests/k8s_crd.py: unknown fields rejected, ObjectMeta
  checked), are checked structurally, and the PrometheusRule must equal
  ``deploy/prometheus/kvpressure-rules.yml``.
"""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jsonpatch
import kubernetes_validate
import pytest
import yaml

from kvpressure.agent.config import parse

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
UNIT = DEPLOY / "systemd" / "kvpressure.service"
CONFIG = DEPLOY / "kvpressure.yaml"
K8S = DEPLOY / "kubernetes"
RULES = DEPLOY / "prometheus" / "kvpressure-rules.yml"
CONFIG_PATH = "/etc/kvpressure/kvpressure.yaml"
MAX_EXPOSURE = 3.0
K8S_VERSIONS = ("1.29", kubernetes_validate.latest_version())


def tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        if os.environ.get("CI"):
            pytest.fail(f"{name} is required in CI")
        pytest.skip(f"{name} not installed")
    return path


def parse_unit(text: str) -> dict[str, dict[str, list[str]]]:
    """Parse a unit file into section -> key -> values (keys may repeat)."""
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), {})
            continue
        key, _, value = line.partition("=")
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


SERVICE = parse_unit(UNIT.read_text(encoding="utf-8"))["Service"]


def one(key: str) -> str:
    (value,) = SERVICE[key]
    return value


# --- systemd ------------------------------------------------------------------------------


def test_default_config_passes_check_config():
    res = subprocess.run(
        [sys.executable, "-m", "kvpressure.agent.cli", "check-config", str(CONFIG)],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0, res.stderr
    assert "ok" in res.stdout
    assert one("ExecStart").endswith(f"run --config {CONFIG_PATH}")


def test_unit_is_a_notify_service_with_watchdog_and_reload():
    assert one("Type") == "notify"
    assert one("NotifyAccess") == "main"
    assert re.fullmatch(r"\d+s", one("WatchdogSec")) and int(one("WatchdogSec")[:-1]) >= 10
    assert one("Restart") == "on-failure"
    assert one("ExecReload") == "/bin/kill -HUP $MAINPID"


def test_unit_runs_unprivileged_with_nvidia_devices_only():
    assert one("DynamicUser") == "yes" or one("User") not in ("", "root")
    assert one("User") == "kvpressure"
    assert SERVICE["SupplementaryGroups"]
    assert one("DevicePolicy") == "closed"
    assert one("PrivateDevices") == "no"  # yes would hide /dev/nvidia*
    allowed = SERVICE["DeviceAllow"]
    assert all("nvidia" in d for d in allowed), allowed
    assert any(d.startswith("char-nvidia-frontend ") for d in allowed)
    assert one("CapabilityBoundingSet") == ""
    for key, value in {
        "NoNewPrivileges": "yes",
        "ProtectSystem": "strict",
        "ProtectHome": "yes",
        "PrivateTmp": "yes",
        "ProtectKernelTunables": "yes",
        "ProtectControlGroups": "yes",
        "RestrictSUIDSGID": "yes",
        "LockPersonality": "yes",
    }.items():
        assert one(key) == value, key
    families = one("RestrictAddressFamilies").split()
    assert {"AF_UNIX", "AF_INET", "AF_INET6"} <= set(families)  # sd_notify, HTTP
    assert "@system-service" in SERVICE["SystemCallFilter"]
    assert re.fullmatch(r"\d+[KMG]", one("MemoryMax"))
    # Above the agent's own connection caps (1000 per listener plus a 128 accept burst):
    # the systemd default soft limit of 1024 let idle connections exhaust it (issue 18).
    assert int(one("LimitNOFILE")) >= 8192
    # These would hide what the agent reads: other users' /proc/<pid> (GPU process ->
    # engine join) and /proc/pressure, /proc/vmstat, /proc/meminfo, /proc/diskstats.
    assert "ProtectProc" not in SERVICE
    assert "ProcSubset" not in SERVICE
    assert "PrivateNetwork" not in SERVICE


@pytest.fixture
def unit_copy(tmp_path: Path) -> Path:
    """The unit with ExecStart pointing at this venv's kvpressure (verify stats it)."""
    exe = Path(sys.executable).parent / "kvpressure"
    if not exe.exists():
        found = shutil.which("kvpressure")
        if found is None:
            pytest.fail("kvpressure entry point not installed (pip install -e .)")
        exe = Path(found)
    text = UNIT.read_text(encoding="utf-8")
    text = text.replace("ExecStart=/opt/kvpressure/bin/kvpressure ", f"ExecStart={exe} ")
    assert str(exe) in text
    path = tmp_path / "kvpressure.service"
    path.write_text(text, encoding="utf-8")
    return path


def test_systemd_analyze_verify(unit_copy: Path):
    res = subprocess.run(
        [tool("systemd-analyze"), "verify", str(unit_copy)],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "SYSTEMD_PAGER": "", "SYSTEMD_COLORS": "0"},
    )
    ours = [line for line in (res.stdout + res.stderr).splitlines() if "kvpressure" in line]
    assert res.returncode == 0 and ours == [], res.stdout + res.stderr


def test_systemd_analyze_security_exposure(unit_copy: Path):
    res = subprocess.run(
        [tool("systemd-analyze"), "security", "--offline=true", "--no-pager", str(unit_copy)],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "SYSTEMD_COLORS": "0"},
    )
    out = res.stdout + res.stderr
    if "--offline" in out and "unrecognized" in out:  # systemd < 250
        pytest.skip("systemd-analyze security --offline needs systemd 250 or later")
    m = re.search(r"Overall exposure level for kvpressure\.service: ([0-9.]+) (\w+)", out)
    assert m, out
    score = float(m.group(1))
    print(f"\n[deploy] systemd-analyze security exposure: {score} {m.group(2)}")
    assert score < MAX_EXPOSURE, out


# --- Kubernetes ---------------------------------------------------------------------------


EXAMPLES = {"keda-scaledobject.yaml"}  # needs KEDA; not in kustomization (tests/test_keda.py)


def k8s_objects() -> dict[str, dict]:
    out = {}
    for path in sorted(K8S.glob("*.yaml")):
        if path.name in EXAMPLES:
            continue
        for doc in yaml.safe_load_all(path.read_text(encoding="utf-8")):
            if doc:
                out[f"{doc['kind']}/{doc.get('metadata', {}).get('name', path.stem)}"] = doc
    return out


OBJECTS = k8s_objects()
CORE = {
    k: v
    for k, v in OBJECTS.items()
    if "." not in v["apiVersion"].split("/")[0] or v["apiVersion"].startswith("apps/")
}


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("name", sorted(CORE))
def test_core_objects_validate_against_kubernetes_schemas(name, version):
    kubernetes_validate.validate(CORE[name], version, strict=True)


CRD_FILES = {
    "PodMonitor": "monitoring.coreos.com_podmonitors.yaml",
    "PrometheusRule": "monitoring.coreos.com_prometheusrules.yaml",
}


@pytest.mark.parametrize("name", sorted(set(OBJECTS) - set(CORE) - {"Kustomization/kustomization"}))
def test_custom_resources_validate_against_their_crds(name):
    from k8s_crd import load_crd

    obj = OBJECTS[name]
    crd = load_crd(CRD_FILES[obj["kind"]])
    assert crd.errors(obj) == []
    # the CRD is strict where it should be: a misspelt field is refused, not pruned
    bad = {**obj, "spec": {**obj["spec"], "podMetricEndpoints": []}}
    assert any("'podMetricEndpoints' was unexpected" in e for e in crd.errors(bad))


def test_manifest_set_is_complete_and_listed_in_kustomization():
    kinds = {k.split("/")[0] for k in OBJECTS}
    assert {"Namespace", "ServiceAccount", "ConfigMap", "DaemonSet", "Service"} <= kinds
    assert {"PodMonitor", "PrometheusRule", "Kustomization"} <= kinds
    listed = set(OBJECTS["Kustomization/kustomization"]["resources"])
    files = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"} - EXAMPLES
    assert listed == files
    namespaces = {o.get("metadata", {}).get("namespace") for o in OBJECTS.values()} - {None}
    assert namespaces == {"kvpressure"}


def daemonset() -> dict:
    return OBJECTS["DaemonSet/kvpressure"]


def test_daemonset_host_access_is_read_only():
    pod = daemonset()["spec"]["template"]["spec"]
    assert pod["hostPID"] is True  # NVML's PIDs resolve to the engines' /proc/<pid>
    (c,) = pod["containers"]
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    host = {v["hostPath"]["path"]: n for n, v in volumes.items() if "hostPath" in v}
    assert set(host) == {"/proc", "/sys"}
    for name in host.values():
        assert mounts[name]["readOnly"] is True, name
    cfg = parse(OBJECTS["ConfigMap/kvpressure-config"]["data"]["kvpressure.yaml"], "configmap")
    assert cfg.procfs_root == mounts[host["/proc"]]["mountPath"]
    assert cfg.sysfs_root == mounts[host["/sys"]]["mountPath"]
    config_mount = mounts[next(n for n, v in volumes.items() if "configMap" in v)]
    assert f"{config_mount['mountPath']}/kvpressure.yaml" == CONFIG_PATH
    assert c["args"][:3] == ["run", "--config", CONFIG_PATH]


def test_daemonset_is_non_root_with_limits_and_gpu_via_runtime():
    pod = daemonset()["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    sc = c["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"]
    assert "privileged" not in sc
    res = c["resources"]
    assert {"cpu", "memory"} <= set(res["requests"]) and {"cpu", "memory"} <= set(res["limits"])
    # NVML only: no GPU taken from the device plugin; the NVIDIA runtime injects the nodes.
    assert not any(k.startswith("nvidia.com/") for k in res["limits"])
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["NVIDIA_VISIBLE_DEVICES"] == "all"
    assert "utility" in env["NVIDIA_DRIVER_CAPABILITIES"]
    assert pod["runtimeClassName"] == "nvidia"
    assert pod["automountServiceAccountToken"] is False


POD_RESOURCES = DEPLOY / "kubernetes-pod-resources"


def pod_resources_variant() -> dict[str, dict]:
    """The objects of deploy/kubernetes-pod-resources/, its JSON patches applied in Python.

    The kustomization takes ``../kubernetes`` whole and patches two of its objects
    (RFC 6902, applied with ``jsonpatch``); what ``kubectl kustomize`` renders is compared
    with this where kubectl is installed.
    """
    kust = yaml.safe_load((POD_RESOURCES / "kustomization.yaml").read_text(encoding="utf-8"))
    assert kust["resources"] == ["../kubernetes"]
    out = {k: v for k, v in OBJECTS.items() if k != "Kustomization/kustomization"}
    for patch in kust["patches"]:
        name = f"{patch['target']['kind']}/{patch['target']['name']}"
        ops = yaml.safe_load((POD_RESOURCES / patch["path"]).read_text(encoding="utf-8"))
        out[name] = jsonpatch.apply_patch(out[name], ops)
    return out


def test_pod_resources_variant_mounts_the_socket_and_runs_as_uid_0_without_capabilities():
    variant = pod_resources_variant()
    ds = variant["DaemonSet/kvpressure"]
    for version in K8S_VERSIONS:
        kubernetes_validate.validate(ds, version, strict=True)
    pod = ds["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    host = {v["hostPath"]["path"]: v["name"] for v in pod["volumes"] if "hostPath" in v}
    assert set(host) == {"/proc", "/sys", "/var/lib/kubelet/pod-resources"}
    assert all(mounts[n]["readOnly"] is True for n in host.values())
    # the config's socket lies in the mounted directory
    text = variant["ConfigMap/kvpressure-config"]["data"]["kvpressure.yaml"]
    socket = parse(text, "variant").gpu.pod_resources_socket
    mount = mounts[host["/var/lib/kubelet/pod-resources"]]["mountPath"]
    assert socket == f"{mount}/kubelet.sock"
    # uid 0 (the socket is root's, no write bit for others), and nothing more than that
    assert pod["securityContext"]["runAsUser"] == 0
    sc = c["securityContext"]
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True
    assert "privileged" not in sc
    # only what the variant is about differs from the default DaemonSet and ConfigMap
    base = OBJECTS["DaemonSet/kvpressure"]
    diff = {op["path"] for op in jsonpatch.make_patch(base, ds)}
    assert diff == {
        "/spec/template/spec/securityContext/runAsNonRoot",
        "/spec/template/spec/securityContext/runAsUser",
        "/spec/template/spec/containers/0/securityContext/runAsNonRoot",
        "/spec/template/spec/volumes/5",
        "/spec/template/spec/containers/0/volumeMounts/5",
    }
    base_cfg = yaml.safe_load(OBJECTS["ConfigMap/kvpressure-config"]["data"]["kvpressure.yaml"])
    assert yaml.safe_load(text) == {
        **base_cfg,
        "gpu": {**base_cfg["gpu"], "pod_resources_socket": socket},
    }
    for name, obj in variant.items():
        if name in CORE:
            for version in K8S_VERSIONS:
                kubernetes_validate.validate(obj, version, strict=True)


def test_pod_resources_variant_is_what_kubectl_kustomize_renders():
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl not installed (the variant is still checked in Python above)")
    res = subprocess.run(
        [kubectl, "kustomize", str(POD_RESOURCES)],
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    )
    rendered = {
        f"{d['kind']}/{d['metadata']['name']}": d for d in yaml.safe_load_all(res.stdout) if d
    }
    assert rendered == pod_resources_variant()


def test_configmap_config_passes_check_config_and_matches_ports(tmp_path):
    text = OBJECTS["ConfigMap/kvpressure-config"]["data"]["kvpressure.yaml"]
    path = tmp_path / "kvpressure.yaml"
    path.write_text(text, encoding="utf-8")
    res = subprocess.run(
        [sys.executable, "-m", "kvpressure.agent.cli", "check-config", str(path)],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0, res.stderr
    cfg = parse(text)
    (c,) = daemonset()["spec"]["template"]["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert cfg.listen_host == "127.0.0.1"  # the DaemonSet's --listen replaces it
    assert arg(c["args"], "--listen") == f"$(POD_IP):{ports['metrics']}"
    svc = OBJECTS["Service/kvpressure"]["spec"]
    assert svc["selector"].items() <= daemonset()["spec"]["template"]["metadata"]["labels"].items()
    assert {p["targetPort"] for p in svc["ports"]} <= set(ports)


# Fields of the Prometheus-Operator PodMonitor used or allowed here (monitoring.coreos.com/v1).
PODMONITOR_SPEC = {
    "jobLabel",
    "namespaceSelector",
    "selector",
    "podMetricsEndpoints",
    "podTargetLabels",
    "sampleLimit",
    "targetLimit",
    "attachMetadata",
}
ENDPOINT = {
    "port",
    "portNumber",
    "path",
    "scheme",
    "interval",
    "scrapeTimeout",
    "honorLabels",
    "honorTimestamps",
    "relabelings",
    "metricRelabelings",
    "params",
    "enableHttp2",
    "filterRunning",
    "followRedirects",
    "basicAuth",
    "tlsConfig",
}
RELABEL = {"sourceLabels", "separator", "targetLabel", "regex", "modulus", "replacement", "action"}
ACTIONS = {
    "replace",
    "keep",
    "drop",
    "hashmod",
    "labelmap",
    "labeldrop",
    "labelkeep",
    "lowercase",
    "uppercase",
    "keepequal",
    "dropequal",
}
DURATION = re.compile(
    r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?"
    r"(([0-9]+)s)?(([0-9]+)ms)?)$"
)


def test_podmonitor_structure():
    from kvpressure.agent.catalogue import CATALOGUE

    pm = OBJECTS["PodMonitor/kvpressure"]
    assert pm["apiVersion"] == "monitoring.coreos.com/v1"
    spec = pm["spec"]
    assert set(spec) <= PODMONITOR_SPEC, set(spec) - PODMONITOR_SPEC
    pod_labels = daemonset()["spec"]["template"]["metadata"]["labels"]
    assert spec["selector"]["matchLabels"].items() <= pod_labels.items()
    # job="kvpressure", as KvpressureAgentDown and the dashboards' job variable expect
    assert pod_labels[spec["jobLabel"]] == "kvpressure"
    assert spec["namespaceSelector"]["matchNames"] == [pm["metadata"]["namespace"]]
    (c,) = daemonset()["spec"]["template"]["spec"]["containers"]
    port_names = {p["name"] for p in c["ports"]}
    catalogue_labels = {label for m in CATALOGUE.values() for label in m.labels}
    assert spec["podMetricsEndpoints"]
    for ep in spec["podMetricsEndpoints"]:
        assert set(ep) <= ENDPOINT, set(ep) - ENDPOINT
        assert ep["port"] in port_names
        assert ep.get("honorLabels", False) is False  # see the README, honor_labels
        for key in ("interval", "scrapeTimeout"):
            assert DURATION.match(ep.get(key, "0")), key
        for r in ep.get("relabelings", []):
            assert set(r) <= RELABEL and r.get("action", "replace") in ACTIONS, r
            # a target label named like an agent label pushes the agent's aside (exported_*)
            assert r.get("targetLabel") not in catalogue_labels, r


def arg(args: list[str], flag: str) -> str:
    """The value after ``flag`` in a container's args."""
    return args[args.index(flag) + 1]


WEB_SECRET = "kvpressure-web"


def test_no_manifest_listens_on_every_address():
    """Issue 18, point 5: with hostNetwork a 0.0.0.0 listener is open on every node address."""

    def strings(node: object) -> list[str]:
        if isinstance(node, dict):
            return [s for v in node.values() for s in strings(v)]
        if isinstance(node, list):
            return [s for v in node for s in strings(v)]
        return [node] if isinstance(node, str) else []

    for name, obj in OBJECTS.items():
        for s in strings(obj):
            assert "0.0.0.0" not in s and "[::]" not in s, (name, s)
    cfg = parse(OBJECTS["ConfigMap/kvpressure-config"]["data"]["kvpressure.yaml"], "configmap")
    assert cfg.listen_host not in ("0.0.0.0", "::", "", "*")


def test_daemonset_binds_the_pod_ip_with_tls_and_basic_auth():
    pod = daemonset()["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    env = {e["name"]: e for e in c["env"]}
    # $(POD_IP) is expanded by the kubelet from the downward API: the node's address under
    # hostNetwork, not its loopback or other interfaces.
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert arg(c["args"], "--listen") == "$(POD_IP):9470"
    web = Path(arg(c["args"], "--web.config.file"))
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    (name,) = [n for n, v in volumes.items() if "secret" in v]
    secret = volumes[name]["secret"]
    assert secret["secretName"] == WEB_SECRET and secret.get("optional", False) is False
    assert mounts[name]["mountPath"] == str(web.parent) and mounts[name]["readOnly"] is True
    # Only what the agent reads: the scrape password and the CA stay with Prometheus.
    items = {i["key"]: i["path"] for i in secret["items"]}
    assert items == {web.name: web.name, "tls.crt": "tls.crt", "tls.key": "tls.key"}
    assert secret["defaultMode"] & 0o007 == 0
    assert pod["securityContext"]["fsGroup"] == pod["securityContext"]["runAsGroup"]
    # A probe cannot carry the password without writing it here: TCP connects.
    for probe in ("readinessProbe", "livenessProbe"):
        assert c[probe]["tcpSocket"] == {"port": "metrics"}, probe


def test_podmonitor_scrapes_over_tls_with_basic_auth():
    (ep,) = OBJECTS["PodMonitor/kvpressure"]["spec"]["podMetricsEndpoints"]
    assert ep["scheme"] == "https"
    tls = ep["tlsConfig"]
    assert tls["ca"] == {"secret": {"name": WEB_SECRET, "key": "ca.crt"}}
    assert tls["serverName"] == "kvpressure.kvpressure.svc"
    assert "insecureSkipVerify" not in tls
    assert ep["basicAuth"] == {
        "username": {"name": WEB_SECRET, "key": "username"},
        "password": {"name": WEB_SECRET, "key": "password"},
    }


def readme_secret_recipe() -> list[str]:
    """The README's shell lines that create the Kubernetes web-config Secret."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```sh\n(.*?)```", text, flags=re.DOTALL)
    (block,) = [b for b in blocks if f"create secret generic {WEB_SECRET}" in b]
    return block.strip().splitlines()


def test_readme_secret_recipe_serves_tls_and_basic_auth(tmp_path: Path):
    """Run the README's Secret recipe (all but kubectl), then the agent with the DaemonSet's
    arguments on 127.0.0.1, and scrape it as the PodMonitor does: TLS checked against the
    CA with the serverName, basic auth with the Secret's username and password."""
    import socket
    import ssl
    import time

    import httpx

    tool("openssl")
    lines = readme_secret_recipe()
    (kubectl,) = [line for line in lines if line.startswith("kubectl ")]
    script = "\n".join(line for line in lines if line != kubectl)
    script += '\nprintf %s "$PASSWORD" > password\n'
    # the recipe runs in a checkout, with the project's venv (bcrypt is its dependency, not
    # the system Python's): point its `.venv/bin/python` at this one; PATH stays the user's
    assert ".venv/bin/python -c 'import bcrypt" in script
    script = script.replace(".venv/bin/python", sys.executable)
    subprocess.run(["bash", "-euc", script], cwd=tmp_path, check=True, timeout=120)
    for f in re.findall(r"--from-file=([\w.-]+)", kubectl):
        assert (tmp_path / f).is_file(), f
    password = (tmp_path / "password").read_text()

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    (c,) = daemonset()["spec"]["template"]["spec"]["containers"]
    config = OBJECTS["ConfigMap/kvpressure-config"]["data"]["kvpressure.yaml"]
    config = config.replace("/host/proc", "/proc").replace("/host/sys", "/sys")
    config += "discovery: {enabled: false}\n"  # nothing probed but the agent itself
    (tmp_path / "kvpressure.yaml").write_text(config, encoding="utf-8")
    args = [
        a.replace("$(POD_IP):9470", f"127.0.0.1:{port}")
        .replace(CONFIG_PATH, str(tmp_path / "kvpressure.yaml"))
        .replace("/etc/kvpressure/web/", f"{tmp_path}/")
        for a in c["args"]
    ]
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvpressure.agent.cli", *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        ca = ssl.create_default_context(cafile=str(tmp_path / "ca.crt"))
        url = f"https://127.0.0.1:{port}/metrics"
        sni = {"sni_hostname": "kvpressure.kvpressure.svc"}
        with httpx.Client(verify=ca, timeout=5) as client:
            deadline = time.monotonic() + 30
            while True:
                try:
                    first = client.get(url, extensions=sni)
                    break
                except httpx.ConnectError:
                    assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
                    assert time.monotonic() < deadline, "agent did not start"
                    time.sleep(0.2)
            assert first.status_code == 401
            ok = client.get(url, extensions=sni, auth=("prometheus", password))
            assert ok.status_code == 200 and "kvpressure_build_info" in ok.text
        # the certificate names the Service, not 127.0.0.1: without serverName it fails
        with httpx.Client(verify=ca, timeout=5) as client, pytest.raises(httpx.ConnectError):
            client.get(url, auth=("prometheus", password))
    finally:
        proc.terminate()
        proc.wait(10)


def test_prometheusrule_is_the_rules_file():
    sys.path.insert(0, str(K8S))
    import prometheusrule

    committed = (K8S / "prometheusrule.yaml").read_text(encoding="utf-8")
    assert committed == prometheusrule.render(), (
        "deploy/kubernetes/prometheusrule.yaml is stale: run "
        ".venv/bin/python deploy/kubernetes/prometheusrule.py"
    )
    pr = OBJECTS["PrometheusRule/kvpressure"]
    assert pr["apiVersion"] == "monitoring.coreos.com/v1"
    assert pr["spec"] == yaml.safe_load(RULES.read_text(encoding="utf-8"))
