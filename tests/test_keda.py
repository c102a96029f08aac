"""The KEDA ScaledObject example (deploy/kubernetes/keda-scaledobject.yaml), issue 16 point 5.

No PyPI package ships KEDA's CRD schema (``kubernetes-validate`` has the core API only), so
the schema below is written from KEDA's documentation: the ``ScaledObject`` spec reference
and the ``keda.sh_scaledobjects.yaml`` CRD's ``openAPIV3Schema`` (``spec`` requires
``scaleTargetRef`` and ``triggers``; ``scaleTargetRef`` requires ``name``; each trigger
requires ``type`` and ``metadata``, a map of *strings*; replica counts and periods are
int32; ``metricType`` is ``AverageValue``, ``Value`` or ``Utilization``; the HPA
``behavior`` is autoscaling/v2's), plus the Prometheus scaler's required metadata
(``serverAddress``, ``query``, ``threshold``). It is stricter than the CRD in one way: unknown
fields are rejected (the API server would silently prune them, hiding a typo). Each query is
then checked against the metric catalogue and the recording rules, like the dashboards'.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from promql_parser import parse
from test_rules import rule_checker

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "deploy" / "kubernetes" / "keda-scaledobject.yaml"

INT32 = {"type": "integer", "minimum": 0, "maximum": 2**31 - 1}
STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
HPA_RULES = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "stabilizationWindowSeconds": {"type": "integer", "minimum": 0, "maximum": 3600},
        "selectPolicy": {"enum": ["Max", "Min", "Disabled"]},
        "policies": {
            "type": "array",
            "items": {
                "type": "object",
                "additionalProperties": False,
                "required": ["type", "value", "periodSeconds"],
                "properties": {
                    "type": {"enum": ["Pods", "Percent"]},
                    "value": {"type": "integer", "minimum": 1},
                    "periodSeconds": {"type": "integer", "minimum": 1, "maximum": 1800},
                },
            },
        },
    },
}
SCALED_OBJECT: dict[str, Any] = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "keda.sh/v1alpha1"},
        "kind": {"const": "ScaledObject"},
        "metadata": {
            "type": "object",
            "required": ["name"],
            "properties": {
                "name": {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"},
                "namespace": {"type": "string"},
                "labels": STRING_MAP,
                "annotations": STRING_MAP,
            },
        },
        "spec": {
            "type": "object",
            "required": ["scaleTargetRef", "triggers"],
            "additionalProperties": False,
            "properties": {
                "scaleTargetRef": {
                    "type": "object",
                    "required": ["name"],
                    "additionalProperties": False,
                    "properties": {
                        "apiVersion": {"type": "string"},
                        "kind": {"type": "string"},
                        "name": {"type": "string"},
                        "envSourceContainerName": {"type": "string"},
                    },
                },
                "pollingInterval": INT32,
                "cooldownPeriod": INT32,
                "initialCooldownPeriod": INT32,
                "idleReplicaCount": INT32,
                "minReplicaCount": INT32,
                "maxReplicaCount": INT32,
                "fallback": {
                    "type": "object",
                    "required": ["failureThreshold", "replicas"],
                    "properties": {"failureThreshold": INT32, "replicas": INT32},
                },
                "advanced": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "restoreToOriginalReplicaCount": {"type": "boolean"},
                        "horizontalPodAutoscalerConfig": {
                            "type": "object",
                            "additionalProperties": False,
                            "properties": {
                                "name": {"type": "string"},
                                "behavior": {
                                    "type": "object",
                                    "additionalProperties": False,
                                    "properties": {"scaleUp": HPA_RULES, "scaleDown": HPA_RULES},
                                },
                            },
                        },
                    },
                },
                "triggers": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "required": ["type", "metadata"],
                        "additionalProperties": False,
                        "properties": {
                            "type": {"type": "string"},
                            "name": {"type": "string"},
                            "metadata": STRING_MAP,
                            "metricType": {"enum": ["AverageValue", "Value", "Utilization"]},
                            "useCachedMetrics": {"type": "boolean"},
                            "authenticationRef": {
                                "type": "object",
                                "required": ["name"],
                                "properties": {"name": {"type": "string"}, "kind": {}},
                            },
                        },
                        "if": {"properties": {"type": {"const": "prometheus"}}},
                        "then": {
                            "properties": {
                                "metadata": {"required": ["serverAddress", "query", "threshold"]}
                            }
                        },
                    },
                },
            },
        },
    },
}


def load() -> dict[str, Any]:
    docs = [d for d in yaml.safe_load_all(EXAMPLE.read_text(encoding="utf-8")) if d]
    assert len(docs) == 1
    return docs[0]


def validate(obj: dict[str, Any]) -> None:
    jsonschema.Draft7Validator.check_schema(SCALED_OBJECT)
    jsonschema.Draft7Validator(SCALED_OBJECT).validate(obj)


def test_example_is_a_valid_scaled_object() -> None:
    obj = load()
    validate(obj)
    spec = obj["spec"]
    assert spec["scaleTargetRef"]["kind"] == "Deployment"
    assert 1 <= spec["minReplicaCount"] <= spec["maxReplicaCount"]
    for t in spec["triggers"]:
        float(t["metadata"]["threshold"])  # a number, written as the string KEDA wants
        float(t["metadata"]["activationThreshold"])


@pytest.mark.parametrize(
    ("path", "value"),
    [
        (("spec", "triggers", 0, "metadata", "threshold"), 0.8),  # unquoted: not a string
        (("spec", "scaleTargetRef", "deploymentName"), "vllm"),  # KEDA v1's field
        (("spec", "maxReplicaCount"), "8"),
        (("spec", "triggers", 0, "metricType"), "Average"),
    ],
)
def test_schema_rejects_the_usual_mistakes(path: tuple[Any, ...], value: Any) -> None:
    obj = copy.deepcopy(load())
    node: Any = obj
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    with pytest.raises(jsonschema.ValidationError):
        validate(obj)


def test_schema_requires_the_prometheus_metadata() -> None:
    obj = copy.deepcopy(load())
    del obj["spec"]["triggers"][1]["metadata"]["query"]
    with pytest.raises(jsonschema.ValidationError, match="query"):
        validate(obj)
    obj = copy.deepcopy(load())
    del obj["spec"]["triggers"]
    with pytest.raises(jsonschema.ValidationError, match="triggers"):
        validate(obj)


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
