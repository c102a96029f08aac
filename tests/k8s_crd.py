"""Validate a custom resource against its CRD's ``openAPIV3Schema``, as the API server would.

Used by tests/test_keda.py (KEDA ``ScaledObject``) and tests/test_deploy.py (Prometheus
Operator ``PodMonitor`` and ``PrometheusRule``), with the CRDs vendored unchanged under
tests/fixtures/crds/ (see the README there for their source and version).

The CRD's OpenAPI v3 schema is translated into a JSON Schema (``jsonschema``'s Draft 2020-12
validator) with Kubernetes' structural-schema semantics:

* unknown fields are **rejected**, not pruned: in an object schema without
  ``x-kubernetes-preserve-unknown-fields: true`` a field not in ``properties`` (and no
  ``additionalProperties`` schema) is an error. The API server would prune it silently
  under ``fieldValidation=Ignore``; ``kubectl apply``'s default (``--validate=strict``,
  server-side ``fieldValidation=Strict``) rejects it, which is what is enforced here;
* ``x-kubernetes-preserve-unknown-fields: true`` keeps any field below that node;
* ``x-kubernetes-int-or-string`` takes an integer or a string; ``nullable`` adds ``null``;
* ``format: int32`` / ``int64`` bound integers; OpenAPI 3.0's boolean
  ``exclusiveMinimum``/``exclusiveMaximum`` become JSON Schema's numeric ones;
* ``anyOf``/``allOf``/``oneOf``/``not`` are value validations only (in a structural schema
  they never declare fields), so no unknown-field rule is added inside them;
* ``x-kubernetes-list-type: set`` means unique items; ``map`` means unique
  ``x-kubernetes-list-map-keys`` tuples;
* ``x-kubernetes-validations`` CEL rules are evaluated with ``cel-python`` (``self`` is the
  node's value); transition rules (those naming ``oldSelf``) apply to updates only and are
  skipped;
* ``metadata`` is ``ObjectMeta`` (the CRD only says ``type: object``): it is validated
  against Kubernetes' own ObjectMeta schema (``kubernetes-validate``'s, strict) and the name
  must be a DNS-1123 subdomain, as the API server requires of custom resources.

``default`` values are not applied (they do not make an object invalid); ``format`` values
other than the integer ones are not checked.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import celpy
import jsonschema
import kubernetes_validate
import yaml
from kubernetes_validate.utils import all_versions, major_minor, schema_contents
from referencing import Registry, Resource

CRDS = Path(__file__).resolve().parent / "fixtures" / "crds"
INT_BOUNDS = {"int32": (-(2**31), 2**31 - 1), "int64": (-(2**63), 2**63 - 1)}
DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_COMBINATORS = ("anyOf", "allOf", "oneOf")
_COPIED = (
    "enum",
    "pattern",
    "minLength",
    "maxLength",
    "minItems",
    "maxItems",
    "minProperties",
    "maxProperties",
    "multipleOf",
    "uniqueItems",
    "required",
)


def to_json_schema(node: dict[str, Any], fields: bool = True) -> dict[str, Any]:
    """Translate one OpenAPI v3 (Kubernetes structural) schema node into JSON Schema.

    Args:
        node: an ``openAPIV3Schema`` node.
        fields: whether this node declares fields (``False`` inside ``anyOf``/``allOf``/
            ``oneOf``/``not``, where a structural schema only validates values).

    Returns:
        The JSON Schema node (Draft 2020-12); see the module docstring for the semantics.
    """
    out: dict[str, Any] = {}
    preserve = bool(node.get("x-kubernetes-preserve-unknown-fields"))
    if node.get("x-kubernetes-int-or-string"):
        types: list[str] | None = ["integer", "string"]
    elif "type" in node:
        types = [node["type"]]
    else:
        types = None
    if types is not None:
        out["type"] = [*types, "null"] if node.get("nullable") else types
    for key in _COPIED:
        if key in node:
            out[key] = node[key]
    if node.get("nullable") and "enum" in out:
        out["enum"] = [*out["enum"], None]
    low, high = INT_BOUNDS.get(node.get("format", ""), (None, None))
    if "minimum" in node:
        key = "exclusiveMinimum" if node.get("exclusiveMinimum") is True else "minimum"
        out[key] = node["minimum"]
    elif low is not None:
        out["minimum"] = low
    if "maximum" in node:
        key = "exclusiveMaximum" if node.get("exclusiveMaximum") is True else "maximum"
        out[key] = node["maximum"]
    elif high is not None:
        out["maximum"] = high
    if node.get("x-kubernetes-list-type") == "set":
        out["uniqueItems"] = True
    if "items" in node:
        out["items"] = to_json_schema(node["items"], fields)
    props = node.get("properties")
    if props is not None:
        out["properties"] = {k: to_json_schema(v, fields) for k, v in props.items()}
    extra = node.get("additionalProperties")
    if isinstance(extra, dict):
        out["additionalProperties"] = to_json_schema(extra, fields)
    elif isinstance(extra, bool):
        out["additionalProperties"] = extra
    elif fields and not preserve and node.get("type") == "object":
        out["additionalProperties"] = False  # unknown field: rejected (strict)
    for key in _COMBINATORS:
        if key in node:
            out[key] = [to_json_schema(s, fields=False) for s in node[key]]
    if "not" in node:
        out["not"] = to_json_schema(node["not"], fields=False)
    return out


class Crd:
    """One CustomResourceDefinition, read from a YAML file.

    Args:
        path: the CRD's file (``apiextensions.k8s.io/v1``).

    Attributes:
        group, kind: the resource's API group and kind.
        schemas: served version name -> its ``openAPIV3Schema``.
    """

    def __init__(self, path: Path) -> None:
        doc = next(d for d in yaml.safe_load_all(path.read_text(encoding="utf-8")) if d)
        assert (
            doc["apiVersion"] == "apiextensions.k8s.io/v1"
            and doc["kind"] == "CustomResourceDefinition"
        )
        spec = doc["spec"]
        self.group: str = spec["group"]
        self.kind: str = spec["names"]["kind"]
        self.schemas: dict[str, dict[str, Any]] = {
            v["name"]: v["schema"]["openAPIV3Schema"] for v in spec["versions"] if v["served"]
        }

    def errors(self, obj: dict[str, Any], k8s_version: str | None = None) -> list[str]:
        """Why the API server would refuse ``obj`` (an empty list when it would accept it).

        Args:
            obj: the custom resource as parsed from YAML.
            k8s_version: the Kubernetes release whose ObjectMeta schema checks ``metadata``
                (``kubernetes-validate``'s latest when ``None``).

        Returns:
            One message per problem: apiVersion/kind not served by this CRD, a schema
            violation (with its JSON path), a failed CEL rule, a duplicate list-map key,
            or invalid metadata.
        """
        group, _, version = str(obj.get("apiVersion", "")).rpartition("/")
        if group != self.group or version not in self.schemas or obj.get("kind") != self.kind:
            return [f"{obj.get('apiVersion')} {obj.get('kind')} is not served by this CRD"]
        schema = self.schemas[version]
        js = to_json_schema({**schema, "properties": {**schema["properties"]}})
        js["properties"]["metadata"] = {"type": "object"}  # checked as ObjectMeta below
        out = [
            f"{e.json_path}: {e.message}"
            for e in jsonschema.Draft202012Validator(js).iter_errors(obj)
        ]
        out += _metadata_errors(obj.get("metadata"), k8s_version)
        if not out:
            out += _walk(obj, schema, "$")
        return out


def _metadata_errors(meta: Any, k8s_version: str | None) -> list[str]:
    want = major_minor(k8s_version or kubernetes_validate.latest_version())
    version = [v for v in all_versions() if major_minor(v) <= want][-1]
    folder = f"kubernetes-json-schema/v{version}-local-strict"
    meta_schema = schema_contents(f"{folder}/objectmeta-meta-v1.json", version)
    defs = schema_contents(f"{folder}/_definitions.json", version)
    registry: Registry = Resource.from_contents(defs) @ Registry()
    validator = jsonschema.Draft202012Validator(meta_schema, registry=registry)
    out = [f"$.metadata{e.json_path[1:]}: {e.message}" for e in validator.iter_errors(meta)]
    name = meta.get("name") if isinstance(meta, dict) else None
    if not isinstance(name, str) or len(name) > 253 or not DNS_SUBDOMAIN.match(name):
        out.append(f"$.metadata.name: {name!r} is not a DNS-1123 subdomain")
    return out


def _walk(value: Any, node: dict[str, Any], path: str) -> list[str]:
    """CEL rules and list-map key uniqueness, on an object the JSON Schema accepted."""
    out: list[str] = []
    for rule in node.get("x-kubernetes-validations", ()):
        if "oldSelf" in rule["rule"]:
            continue  # transition rule: updates only
        env = celpy.Environment()
        program = env.program(env.compile(rule["rule"]))
        if not bool(program.evaluate({"self": celpy.json_to_cel(value)})):
            out.append(f"{path}: {rule.get('message', rule['rule'])}")
    if isinstance(value, list):
        keys = node.get("x-kubernetes-list-map-keys")
        if node.get("x-kubernetes-list-type") == "map" and keys:
            seen = [tuple(item.get(k) for k in keys) for item in value]
            if len(seen) != len(set(seen)):
                out.append(f"{path}: duplicate list-map keys {keys}")
        for i, item in enumerate(value):
            if "items" in node:
                out += _walk(item, node["items"], f"{path}[{i}]")
    elif isinstance(value, dict):
        props = node.get("properties", {})
        extra = node.get("additionalProperties")
        for k, v in value.items():
            if k in props:
                out += _walk(v, props[k], f"{path}.{k}")
            elif isinstance(extra, dict):
                out += _walk(v, extra, f"{path}.{k}")
    return out


def load_crd(filename: str) -> Crd:
    """The vendored CRD ``tests/fixtures/crds/<filename>``."""
    return Crd(CRDS / filename)
