"""deploy/k8s checked as an API server would: Kubernetes' own schemas, KEDA's own CRDs.

The core objects are validated by ``kubernetes-validate`` against the OpenAPI schemas of
the newest Kubernetes release it bundles, in strict mode (an unknown field is an error,
as with ``kubectl apply``'s strict field validation). The KEDA objects are validated
against the ``openAPIV3Schema`` of KEDA's CRDs (read from KEDA's own Go module, see
``tests/deploy/keda.py``), made strict the same way: unknown fields fail unless the
schema preserves them.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from kubernetes_validate import utils as kubernetes_validate

from tests.deploy import keda

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
#: The Kubernetes release the core objects are validated against: the newest bundled.
KUBERNETES_VERSION = kubernetes_validate.latest_version()


def _documents() -> list[dict[str, Any]]:
    """Every object of deploy/k8s (the kustomization is kustomize's file, not an object)."""
    paths = sorted(p for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")
    return [doc for path in paths for doc in yaml.safe_load_all(path.read_text()) if doc]


def _strict(node: Any) -> Any:
    """An OpenAPI v3 schema of a CRD as JSON Schema that refuses unknown fields."""
    if isinstance(node, list):
        return [_strict(item) for item in node]
    if not isinstance(node, dict):
        return node
    out = {key: _strict(value) for key, value in node.items()}
    if out.pop("x-kubernetes-int-or-string", False):
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    preserves = out.pop("x-kubernetes-preserve-unknown-fields", False)
    if "properties" in out and "additionalProperties" not in out and not preserves:
        out["additionalProperties"] = False
    return out


def _crd_schemas() -> dict[tuple[str, str], dict[str, Any]]:
    """(apiVersion, kind) → the strict schema of each version of KEDA's CRDs."""
    schemas = {}
    for text in keda.crd_texts().values():
        crd = yaml.safe_load(text)
        group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
        for version in crd["spec"]["versions"]:
            schema = _strict(version["schema"]["openAPIV3Schema"])
            schemas[(f"{group}/{version['name']}", kind)] = schema
    return schemas


def _is_custom(doc: dict[str, Any]) -> bool:
    return str(doc["apiVersion"]).split("/")[0].endswith("keda.sh")


def _validate_custom(doc: dict[str, Any]) -> None:
    schema = _crd_schemas()[(doc["apiVersion"], doc["kind"])]
    jsonschema.Draft7Validator(schema).validate(doc)


def _validate_core(doc: dict[str, Any]) -> None:
    kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_core_objects_validate_against_kubernetes() -> None:
    """ConfigMap, Secret, Deployment and Services validate (strict) against current Kubernetes."""
    core = [doc for doc in _documents() if not _is_custom(doc)]
    assert {doc["kind"] for doc in core} == {"ConfigMap", "Secret", "Deployment", "Service"}
    for doc in core:
        _validate_core(doc)
    assert tuple(map(int, KUBERNETES_VERSION.split("."))) >= (1, 33)


def test_keda_objects_validate_against_kedas_crds() -> None:
    """The ScaledObject and its TriggerAuthentication validate against KEDA's own CRD schemas."""
    custom = [doc for doc in _documents() if _is_custom(doc)]
    assert {doc["kind"] for doc in custom} == {"ScaledObject", "TriggerAuthentication"}
    for doc in custom:
        _validate_custom(doc)


def _one(kind: str) -> dict[str, Any]:
    (doc,) = [d for d in _documents() if d["kind"] == kind]
    return copy.deepcopy(doc)


def test_a_misspelt_field_fails_each_validator() -> None:
    """The checks above can fail: an unknown field in a container or a trigger is refused."""
    deployment = _one("Deployment")
    deployment["spec"]["template"]["spec"]["containers"][0]["imagePullPolicyy"] = "Always"
    with pytest.raises(kubernetes_validate.ValidationError):
        _validate_core(deployment)
    scaled = _one("ScaledObject")
    scaled["spec"]["triggers"][0]["metdata"] = scaled["spec"]["triggers"][0].pop("metadata")
    with pytest.raises(jsonschema.ValidationError):
        _validate_custom(scaled)
    scaled = _one("ScaledObject")
    scaled["spec"]["maxReplicaCount"] = "twelve"
    with pytest.raises(jsonschema.ValidationError):
        _validate_custom(scaled)


def test_kustomization_leaves_the_secret_to_the_user() -> None:
    """`kubectl apply -k` applies every manifest but the example Secret, never over the user's."""
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert set(kustomization) == {"apiVersion", "kind", "resources"}
    assert kustomization["kind"] == "Kustomization"
    resources = kustomization["resources"]
    assert all((K8S / name).is_file() for name in resources)
    secrets = {
        path.name
        for path in K8S.glob("*.yaml")
        if any(doc and doc.get("kind") == "Secret" for doc in yaml.safe_load_all(path.read_text()))
    }
    assert secrets == {"secret.yaml"} and secrets.isdisjoint(resources)
    others = {p.name for p in K8S.glob("*.yaml")} - secrets - {"kustomization.yaml"}
    assert set(resources) == others
