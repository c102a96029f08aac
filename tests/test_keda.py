"""The KEDA ScaledObject example (deploy/kubernetes/keda-scaledobject.yaml), issue 16 point 5.

Validated against KEDA's own CRD: ``keda.sh_scaledobjects.yaml`` of KEDA v2.20.1, vendored
unchanged in tests/fixtures/crds/ (its README names the commit), through tests/k8s_crd.py
(the CRD's ``openAPIV3Schema`` with Kubernetes' structural-schema semantics: unknown fields
rejected as ``kubectl apply``'s strict field validation does, CEL rules evaluated,
ObjectMeta checked). The CRD leaves two things to KEDA's scaler, checked here from KEDA
v2.20.1's ``pkg/scalers``: an external metric's ``metricType`` is ``Value`` or
``AverageValue`` (``Utilization`` is refused at runtime), and the Prometheus scaler's
metadata keys (``serverAddress``, ``query``, ``threshold`` required; no key it does not
read, where a typo would be silently ignored). Each query is then checked against the
metric catalogue and the recording rules, like the dashboards'.
"""

from __future__ import annotations

import copy
import hashlib
from pathlib import Path
from typing import Any

import pytest
import yaml
from k8s_crd import CRDS, load_crd
from promql_parser import parse
from test_rules import rule_checker

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "deploy" / "kubernetes" / "keda-scaledobject.yaml"
CRD = load_crd("keda.sh_scaledobjects.yaml")
VENDORED = {
    "keda.sh_scaledobjects.yaml": (
        "af35555862a83933b074af14ad439c4b4ceabaf4daa3e9338e9b23e36d308d80"
    ),
    "monitoring.coreos.com_podmonitors.yaml": (
        "45a93443daa687d3654f7e9631909ff7edcdf3ec09c5e60251b74aa2722aee5d"
    ),
    "monitoring.coreos.com_prometheusrules.yaml": (
        "78be98554b9c8506ab2b4f4feb91c5f3a56e536a0a510f3a8e876a459970d56d"
    ),
}
# KEDA v2.20.1 pkg/scalers/prometheus_scaler.go, prometheusMetadata's `keda:"name=..."` tags
PROMETHEUS_REQUIRED = {"serverAddress", "query", "threshold"}
PROMETHEUS_KEYS = PROMETHEUS_REQUIRED | {
    "queryParameters",
    "activationThreshold",
    "namespace",
    "customHeaders",
    "ignoreNullValues",
    "unsafeSsl",
    "awsRegion",
    "timeout",
    "identityOwner",
}
EXTERNAL_METRIC_TYPES = {"Value", "AverageValue"}  # pkg/scalers/scaler.go


def load() -> dict[str, Any]:
    docs = [d for d in yaml.safe_load_all(EXAMPLE.read_text(encoding="utf-8")) if d]
    assert len(docs) == 1
    return docs[0]


def errors(obj: dict[str, Any]) -> list[str]:
    """The CRD's errors, then the Prometheus scaler's (see the module docstring)."""
    out = CRD.errors(obj)
    for i, t in enumerate(obj.get("spec", {}).get("triggers") or ()):
        where = f"$.spec.triggers[{i}]"
        if t.get("metricType", "AverageValue") not in EXTERNAL_METRIC_TYPES:
            out.append(f"{where}.metricType: {t['metricType']!r} (KEDA: Value or AverageValue)")
        if t.get("type") == "prometheus":
            keys = set(t.get("metadata") or {})
            out += [f"{where}.metadata: {k!r} required" for k in PROMETHEUS_REQUIRED - keys]
            out += [f"{where}.metadata: {k!r} not read by KEDA" for k in keys - PROMETHEUS_KEYS]
    return out


def test_vendored_crds_are_unchanged() -> None:
    for name, digest in VENDORED.items():
        assert hashlib.sha256((CRDS / name).read_bytes()).hexdigest() == digest, name
        assert digest in (CRDS / "README.md").read_text(encoding="utf-8"), name


def test_example_is_a_valid_scaled_object() -> None:
    obj = load()
    assert errors(obj) == []
    spec = obj["spec"]
    assert spec["scaleTargetRef"]["kind"] == "Deployment"
    assert 1 <= spec["minReplicaCount"] <= spec["maxReplicaCount"]
    for t in spec["triggers"]:
        float(t["metadata"]["threshold"])  # a number, written as the string KEDA wants
        float(t["metadata"]["activationThreshold"])


@pytest.mark.parametrize(
    ("path", "value", "says"),
    [
        # the CRD's own schema
        (("spec", "triggers", 0, "metadata", "threshold"), 0.8, "not of type 'string'"),
        (("spec", "scaleTargetRef", "deploymentName"), "vllm", "'deploymentName' was unexp"),
        (("spec", "maxReplicaCount"), "8", "not of type 'integer'"),
        (("spec", "maxReplicaCount"), 2**31, "maximum"),  # format: int32
        (("spec", "pollingInterval"), 0, "minimum"),
        (("spec", "fallback"), {"replicas": 2}, "'failureThreshold' is a required"),
        (("spec", "triggers"), [], "should be non-empty"),
        (
            ("spec", "triggers", 0, "authenticationRef"),
            {"name": "a", "kind": "Secret"},
            "is not one of",
        ),
        (("spec", "minReplicaCount"), 9, "minReplicaCount must be less than or equal"),  # CEL
        (("metadata", "name"), "vLLM_8b", "DNS-1123"),  # ObjectMeta, as the API server
        (("metadata", "labelz"), {}, "'labelz' was unexpected"),
        (("apiVersion",), "keda.sh/v1beta1", "not served"),
        # KEDA's scaler, beyond the CRD
        (("spec", "triggers", 0, "metricType"), "Utilization", "Value or AverageValue"),
        (("spec", "triggers", 0, "metadata", "treshold"), "0.8", "'treshold' not read"),
    ],
)
def test_crd_rejects_the_usual_mistakes(path: tuple[Any, ...], value: Any, says: str) -> None:
    obj = copy.deepcopy(load())
    node: Any = obj
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    found = errors(obj)
    assert any(says in e for e in found), found


@pytest.mark.parametrize("key", ["query", "serverAddress", "threshold"])
def test_prometheus_metadata_is_required(key: str) -> None:
    obj = copy.deepcopy(load())
    del obj["spec"]["triggers"][1]["metadata"][key]
    assert errors(obj) == [f"$.spec.triggers[1].metadata: {key!r} required"]


def test_required_fields_of_the_crd() -> None:
    for path in (("spec", "triggers"), ("spec", "scaleTargetRef"), ("spec",)):
        obj = copy.deepcopy(load())
        node: Any = obj
        for key in path[:-1]:
            node = node[key]
        del node[path[-1]]
        found = CRD.errors(obj)
        assert any(f"'{path[-1]}' is a required property" in e for e in found), found


def test_preserve_unknown_fields_and_int_or_string_follow_the_crd() -> None:
    """Structural-schema semantics of tests/k8s_crd.py, on the nodes of KEDA's CRD."""
    obj = copy.deepcopy(load())
    # status.conditions items are typed; status as a whole takes what the CRD declares only
    obj["status"] = {"hpaName": "keda-hpa-vllm", "unknownStatusField": 1}
    assert any("'unknownStatusField' was unexpected" in e for e in CRD.errors(obj))
    # a preserve-unknown-fields node keeps any field (the schema is extended here to test it)
    from k8s_crd import to_json_schema

    node = {"type": "object", "x-kubernetes-preserve-unknown-fields": True, "properties": {}}
    assert "additionalProperties" not in to_json_schema(node)
    ios = to_json_schema({"x-kubernetes-int-or-string": True, "anyOf": [{"type": "integer"}]})
    assert ios["type"] == ["integer", "string"]


def test_queries_use_recording_rules_and_catalogue_labels() -> None:
    checker, recorded = rule_checker()
    for t in load()["spec"]["triggers"]:
        query = t["metadata"]["query"]
        parse(query)
        labels = checker.check(query, f"keda trigger {t['name']}")
        assert labels is not None and {"engine", "model"} <= labels, (t["name"], labels)
        used = query.split("{", 1)[0]
        assert used in recorded, f"{used} is not a recording rule in kvpressure-rules.yml"
    assert checker.errors == [], "\n".join(checker.errors)
