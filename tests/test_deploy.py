"""deploy/ rendered with ``kubectl kustomize`` and every object validated: Kubernetes' own kinds
against the Kubernetes OpenAPI schema (``kubernetes-validate``'s bundled schemas, strict: an
unknown field fails), the others against the CRD schemas vendored under tests/fixtures/crds/
(InferencePool from GIE, EnvoyExtensionPolicy from Envoy Gateway, Gateway API's Gateway and
HTTPRoute, Istio's DestinationRule, llm-d's InferenceObjective; each file names its source and
commit). CRD schemas are structural: a field they do not declare is refused here as the API
server would prune it. CEL rules (``x-kubernetes-validations``) are not evaluated."""

from __future__ import annotations

import copy
import shutil
import subprocess
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from extproc.policyfile import load_texts

ROOT = Path(__file__).resolve().parents[1]
CRDS = ROOT / "tests" / "fixtures" / "crds"
KUBERNETES = "1.32"  # the kubectl on these machines (v1.32)
TARGETS = ["base", "examples/envoy-ai-gateway", "examples/istio", "examples/envoy-gateway-extproc"]
BUILTIN_GROUPS = {"", "apps", "rbac.authorization.k8s.io", "policy", "batch", "autoscaling"}


def render(target: str) -> list[dict[str, Any]]:
    return copy.deepcopy(_render(target))


@cache
def _render(target: str) -> list[dict[str, Any]]:
    kubectl = shutil.which("kubectl")
    assert kubectl, "kubectl (with its kustomize) is part of these machines' image; deploy/ is rendered with it"
    out = subprocess.run([kubectl, "kustomize", str(ROOT / "deploy" / target)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def _strict(schema: Any) -> Any:
    """A structural schema that refuses undeclared fields (the API server prunes them)."""
    if isinstance(schema, dict):
        out = {k: _strict(v) for k, v in schema.items()}
        if "properties" in out and "additionalProperties" not in out \
                and not out.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


@cache
def crd_schemas() -> dict[tuple[str, str, str], dict[str, Any]]:
    """(group, version, kind) -> the version's openAPIV3Schema, from every vendored CRD."""
    out = {}
    for path in sorted(CRDS.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if not doc or doc.get("kind") != "CustomResourceDefinition":
                continue
            spec = doc["spec"]
            for v in spec["versions"]:
                out[(spec["group"], v["name"], spec["names"]["kind"])] = _strict(v["schema"]["openAPIV3Schema"])
    return out


def validate(obj: dict[str, Any]) -> None:
    group, _, version = obj["apiVersion"].rpartition("/")
    if group in BUILTIN_GROUPS:
        kubernetes_validate.validate(obj, KUBERNETES, strict=True)
        return
    schema = crd_schemas().get((group, version, obj["kind"]))
    assert schema is not None, f"no vendored schema for {obj['apiVersion']} {obj['kind']}"
    envelope = {"apiVersion": {"type": "string"}, "kind": {"type": "string"}, "metadata": {"type": "object"}}
    jsonschema.validate(obj, {**schema, "properties": {**schema["properties"], **envelope}})


@pytest.mark.parametrize("target", TARGETS)
def test_every_object_validates_against_its_schema(target: str) -> None:
    objs = render(target)
    assert objs
    for obj in objs:
        validate(obj)


def by_kind(objs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    return next(o for o in objs if o["kind"] == kind and o["metadata"]["name"].startswith(name))


def test_the_picker_as_gateways_expect_it() -> None:
    objs = render("base")
    dep = by_kind(objs, "Deployment", "sluice-picker")
    assert dep["spec"]["replicas"] >= 2
    c = dep["spec"]["template"]["spec"]["containers"][0]
    assert "--picker=0.0.0.0:9002" in c["args"] and "--picker-health=0.0.0.0:9003" in c["args"]
    assert any(e["name"] == "SLUICE_REDIS_URL" for e in c["env"])  # the replicas share their state
    assert c["readinessProbe"]["grpc"] == {"port": 9003, "service": "readiness"}
    svc = by_kind(objs, "Service", "sluice-picker")
    assert sorted(p["port"] for p in svc["spec"]["ports"]) == [9002, 9003, 9090]
    role = by_kind(objs, "Role", "sluice-picker")
    watched = {r for rule in role["rules"] for r in rule["resources"] if "watch" in rule["verbs"]}
    assert watched == {"pods", "inferencepools", "inferenceobjectives"}
    pvc = by_kind(objs, "PersistentVolumeClaim", "sluice-console")
    console = by_kind(objs, "Deployment", "sluice-console")
    assert console["spec"]["strategy"]["type"] == "Recreate"  # one SQLite writer
    vols = console["spec"]["template"]["spec"]["volumes"]
    assert any(v.get("persistentVolumeClaim", {}).get("claimName") == pvc["metadata"]["name"] for v in vols)


@pytest.mark.parametrize("target", TARGETS)
def test_the_policy_configmap_is_a_valid_policy(target: str) -> None:
    cm = by_kind(render(target), "ConfigMap", "sluice-policy")
    policy = load_texts((Path(name), text) for name, text in sorted(cm["data"].items()))
    assert policy.backends and policy.tiers and policy.tenants


def test_the_pools_point_at_the_picker() -> None:
    for target in ("examples/envoy-ai-gateway", "examples/istio"):
        objs = render(target)
        pool = by_kind(objs, "InferencePool", "sluice-pool")
        ref = pool["spec"]["endpointPickerRef"]
        svc = by_kind(objs, "Service", "sluice-picker")
        assert ref["name"] == svc["metadata"]["name"] and ref["port"]["number"] == 9002
        route = by_kind(objs, "HTTPRoute", "sluice-pool")
        assert route["spec"]["rules"][0]["backendRefs"][0]["kind"] == "InferencePool"
    ext = render("examples/envoy-gateway-extproc")
    policy = by_kind(ext, "EnvoyExtensionPolicy", "sluice")
    port = policy["spec"]["extProc"][0]["backendRefs"][0]["port"]
    assert port in [p["port"] for p in by_kind(ext, "Service", "sluice-picker")["spec"]["ports"]]
    args = by_kind(ext, "Deployment", "sluice-picker")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert not any(a.startswith("--inference-pool") for a in args)  # one Service address, no pool to watch


@pytest.mark.parametrize("break_it", ["unknown field", "wrong type"])
def test_the_validation_can_fail(break_it: str) -> None:
    objs = render("examples/istio")
    pool = copy.deepcopy(by_kind(objs, "InferencePool", "sluice-pool"))
    dep = copy.deepcopy(by_kind(objs, "Deployment", "sluice-picker"))
    if break_it == "unknown field":
        pool["spec"]["endpointPickerRef"]["failMode"] = "FailOpen"
        dep["spec"]["replica"] = 2
    else:
        pool["spec"]["targetPorts"][0]["number"] = "eight thousand"
        dep["spec"]["replicas"] = "two"
    with pytest.raises(jsonschema.ValidationError):
        validate(pool)
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(dep)
