"""The CRD: valid for Kubernetes, the examples validate against it, bad manifests are rejected."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CRD_PATH = ROOT / "crds" / "usermemory.yaml"
EXAMPLES = sorted((ROOT / "crds" / "examples").glob("*.yaml"))


def crd() -> dict[str, Any]:
    return yaml.safe_load(CRD_PATH.read_text())


def schema() -> dict[str, Any]:
    (version,) = crd()["spec"]["versions"]
    return version["schema"]["openAPIV3Schema"]


def validate(obj: dict[str, Any]) -> None:
    """The schema, plus what field validation Strict (kubectl's default) adds on a structural schema: an undeclared
    field is refused (the real server's answer is in e2e/test_real_apiserver_crd.py)."""
    jsonschema.Draft7Validator(schema()).validate(obj)
    if extra := undeclared(schema(), obj):
        raise jsonschema.ValidationError(f"unknown field(s) {extra}")


def undeclared(sch: dict[str, Any], value: Any, path: str = "") -> list[str]:
    """Fields a structural-schema API server would prune (not declared, no additionalProperties)."""
    out: list[str] = []
    if isinstance(value, dict) and sch.get("type") == "object":
        props, extra = sch.get("properties") or {}, sch.get("additionalProperties")
        for k, v in value.items():
            if k in props:
                out += undeclared(props[k], v, f"{path}.{k}")
            elif isinstance(extra, dict):
                out += undeclared(extra, v, f"{path}.{k}")
            elif not sch.get("x-kubernetes-preserve-unknown-fields") and path != ".metadata":
                out.append(f"{path}.{k}")
    elif isinstance(value, list) and isinstance(sch.get("items"), dict):
        for i, v in enumerate(value):
            out += undeclared(sch["items"], v, f"{path}[{i}]")
    return out


def test_crd_names_and_columns() -> None:
    c = crd()
    assert c["metadata"]["name"] == "usermemories.inferscale.io"
    assert c["spec"]["scope"] == "Namespaced" and c["spec"]["names"]["shortNames"] == ["um"]
    (version,) = c["spec"]["versions"]
    assert version["name"] == "v1alpha1" and version["subresources"] == {"status": {}}
    assert [col["name"] for col in version["additionalPrinterColumns"]] == [
        "Ready", "Phase", "Items", "Tokens", "Bytes", "Nodes", "Age"]
    # Every printer column points at a declared field (a filter `[?(...)]` selects list items; its field follows).
    for col in version["additionalPrinterColumns"]:
        if col["jsonPath"].startswith(".status"):
            node = schema()
            path = col["jsonPath"].replace('[?(@.type=="Ready")]', "[]")
            for part in path.split(".")[1:]:
                if part.endswith("[]"):
                    node = node["properties"][part[:-2]]
                    assert node["type"] == "array"
                    node = node["items"]
                else:
                    node = node["properties"][part]
            assert node["type"] == col["type"]


def test_crd_is_a_valid_kubernetes_object() -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    kubernetes_validate.validate(crd(), "1.37.0", strict=True)


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_examples_validate(path: Path) -> None:
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    ums = [d for d in docs if d["kind"] == "UserMemory"]
    assert ums, f"{path.name} has no UserMemory"
    for um in ums:
        assert um["apiVersion"] == "inferscale.io/v1alpha1"
        validate(um)


def test_examples_cover_every_source() -> None:
    specs = [d["spec"] for p in EXAMPLES for d in yaml.safe_load_all(p.read_text()) if d and d["kind"] == "UserMemory"]
    assert any("memories" in s for s in specs)
    assert any("configMapKeyRef" in s.get("memoriesFrom", {}) for s in specs)
    assert any("secretKeyRef" in s.get("memoriesFrom", {}) for s in specs)


GOOD = {"apiVersion": "inferscale.io/v1alpha1", "kind": "UserMemory", "metadata": {"name": "u"},
        "spec": {"userId": "u1", "model": "gemma-3-270m", "memories": [{"id": "m1", "text": "hello"}]}}


def _with(path: str, value: Any) -> dict[str, Any]:
    obj = copy.deepcopy(GOOD)
    *parents, last = path.split(".")
    node = obj
    for p in parents:
        node = node[int(p)] if isinstance(node, list) else node[p]
    if value is _DELETE:
        del node[last]
    else:
        node[last] = value
    return obj


_DELETE = object()


@pytest.mark.parametrize("path, value", [
    ("spec.userId", _DELETE),
    ("spec.model", _DELETE),
    ("spec.memories", _DELETE),  # and no memoriesFrom: nothing to encode
    ("spec.userId", "../etc"),
    ("spec.userId", "x" * 129),
    ("spec.memories", [{"id": "bad id!", "text": "t"}]),
    ("spec.memories", [{"id": "m1", "text": ""}]),
    ("spec.memories", [{"id": "m1"}]),
    ("spec.memories", [{"id": "m1", "text": "t", "extra": 1}]),
    ("spec.memories", [{"id": f"m{i}", "text": "t"} for i in range(501)]),
    ("spec.memoriesFrom", {"configMapKeyRef": {"name": "a", "key": "k"}, "secretKeyRef": {"name": "b", "key": "k"}}),
    ("spec.memoriesFrom", {"configMapKeyRef": {"name": "Bad_Name", "key": "k"}}),
    ("spec.memoriesFrom", {}),
    ("spec.placement", {"replicas": 0}),
    ("spec.placement", {"replicas": 17}),
    ("spec.retention", {"maxItems": 0}),
    ("spec.model", ""),
])
def test_schema_rejects(path: str, value: Any) -> None:
    with pytest.raises(jsonschema.ValidationError):
        validate(_with(path, value))


def test_schema_accepts_reference_only() -> None:
    obj = _with("spec.memories", _DELETE)
    obj["spec"]["memoriesFrom"] = {"secretKeyRef": {"name": "s", "key": "items.jsonl"}}
    validate(obj)


def test_status_written_by_the_operator_is_declared() -> None:
    # A status as the operator writes it (see test_operator_lifecycle): nothing may be pruned.
    status = {
        "phase": "Ready", "message": "2/2", "observedGeneration": 1, "contentHash": "ab" * 32,
        "model": "gemma-3-270m", "nodes": "n0,n1", "counts": {"items": 1, "tokens": 10, "bytes": 1000},
        "encoded": {"m1": {"hash": "c" * 32, "node": "gpu-0"}},
        "job": {"name": "u-enc-0123456789", "items": 1, "phase": "Succeeded", "node": "gpu-0"},
        "placements": [{"node": "n0", "pod": "p0", "namespace": "ns", "uid": "u", "tier": "dram", "bytes": 1000}],
        "conditions": [{"type": "Ready", "status": "True", "reason": "Placed", "message": "ok",
                        "lastTransitionTime": "2025-01-01T00:00:00Z", "observedGeneration": 1}],
    }
    obj = {**GOOD, "status": status}
    validate(obj)
    assert undeclared(schema(), obj) == []

