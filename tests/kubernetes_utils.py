"""Helpers for tests/test_kubernetes.py (no tests here): rendering deploy/kubernetes with
kubectl's built-in kustomize, validating objects offline, and the container's environment as
the kubelet would build it."""

from __future__ import annotations

import argparse
import copy
import functools
import math
import subprocess
from pathlib import Path

import jsonschema
import kubernetes_validate
import yaml
from test_docker import ROOT, tool

K8S = ROOT / "deploy" / "kubernetes"
BUILDS = ["base", "overlays/cpu", "overlays/gpu"]
OVERLAYS = {"overlays/cpu": "pagedserve", "overlays/gpu": "pagedserve-gpu"}  # -> namespace
KUBE_VERSIONS = ["1.30", kubernetes_validate.latest_version()]
SECRET = ("pagedserve-api-key", "api-key")  # name, key
FAKE_KEY = "test-key-not-a-secret"


def run(*cmd: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, **kw)


def load_all(text: str) -> list[dict]:
    return [d for d in yaml.safe_load_all(text) if d]


def kustomize(path: Path) -> list[dict]:
    p = run(tool("kubectl"), "kustomize", str(path))
    assert p.returncode == 0, p.stderr
    return load_all(p.stdout)


@functools.cache
def rendered(build: str) -> tuple[dict, ...]:
    return tuple(kustomize(K8S / build))


def fresh(build: str) -> list[dict]:
    return copy.deepcopy(list(rendered(build)))


def only(objs, kind: str) -> dict:
    found = [o for o in objs if o["kind"] == kind]
    assert len(found) == 1, f"{len(found)} {kind}"
    return found[0]


def pod_spec(objs) -> dict:
    return only(objs, "Deployment")["spec"]["template"]["spec"]


def container(objs) -> dict:
    (c,) = pod_spec(objs)["containers"]
    return c


# ---- validation ----------------------------------------------------------------------------


def _strict(schema):
    """Reject unknown fields in every object that lists its fields, as the API server's strict
    field validation (kubectl's default) does for a structural CRD schema."""
    if isinstance(schema, dict):
        if "properties" in schema and "additionalProperties" not in schema:
            schema["additionalProperties"] = False
        for value in schema.values():
            _strict(value)
    elif isinstance(schema, list):
        for value in schema:
            _strict(value)
    return schema


@functools.cache
def podmonitor_validator() -> jsonschema.Validator:
    from cloudcoil.models.prometheus_operator.v1 import PodMonitor

    schema = _strict(PodMonitor.model_json_schema(by_alias=True, mode="validation"))
    return jsonschema.Draft202012Validator(schema)


def validate(obj: dict, version: str) -> None:
    """Raises jsonschema.ValidationError when `obj` does not validate."""
    if obj["kind"] == "PodMonitor":
        assert obj["apiVersion"] == "monitoring.coreos.com/v1"
        podmonitor_validator().validate(obj)
    else:  # a kind without a bundled schema raises SchemaNotFoundError: no silent pass
        kubernetes_validate.validate(obj, version, strict=True)


def kustomization_files() -> list[Path]:
    return sorted(K8S.rglob("kustomization.yaml"))


def manifest_files() -> list[Path]:
    """Every file some kustomization lists under `resources`."""
    files = set()
    for k in kustomization_files():
        for res in yaml.safe_load(k.read_text()).get("resources", []):
            if (k.parent / res).is_file():
                files.add((k.parent / res).resolve())
    return sorted(files)



def cpu_count(quantity) -> float:
    q = str(quantity)
    return int(q[:-1]) / 1000 if q.endswith("m") else float(q)


def container_env(objs, api_key: str = FAKE_KEY) -> dict[str, str]:
    """The container's environment as the kubelet builds it: envFrom first, env over it."""
    c = container(objs)
    configmaps = {o["metadata"]["name"]: o.get("data", {})
                  for o in objs if o["kind"] == "ConfigMap"}
    env: dict[str, str] = {}
    for source in c.get("envFrom", []):
        env.update(configmaps[source["configMapRef"]["name"]])  # generated in the same build
    for e in c["env"]:
        if "value" in e:
            env[e["name"]] = e["value"]
        elif "secretKeyRef" in e["valueFrom"]:
            ref = e["valueFrom"]["secretKeyRef"]
            assert (ref["name"], ref["key"]) == SECRET and not ref.get("optional")
            env[e["name"]] = api_key
        else:
            ref = e["valueFrom"]["resourceFieldRef"]
            assert ref["resource"] == "limits.cpu" and ref["containerName"] == c["name"]
            limit = cpu_count(c["resources"]["limits"]["cpu"]) / cpu_count(ref.get("divisor", 1))
            env[e["name"]] = str(math.ceil(limit))  # the kubelet rounds up
    return env



def start_container(objs, path: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    c = container(objs)
    return run(*c["command"], *c.get("args", []), env={"PATH": path, **env})


def parse_serve(argv: list[str]) -> argparse.Namespace:
    from pagedserve.server.cli import add_serve_parser

    sub = argparse.ArgumentParser().add_subparsers()
    add_serve_parser(sub)
    return sub.choices["serve"].parse_args(argv)


# The adapter's DiscoveryRule (pkg/config/config.go of kubernetes-sigs/prometheus-adapter), as
# a JSON schema: the fields and types it reads, nothing else.
_STR = {"type": "string"}
ADAPTER_RULE_SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["seriesQuery", "resources", "name", "metricsQuery"],
    "properties": {
        "seriesQuery": _STR,
        "seriesFilters": {"type": "array", "items": {
            "type": "object", "additionalProperties": False, "minProperties": 1,
            "maxProperties": 1, "properties": {"is": _STR, "isNot": _STR}}},
        "resources": {"type": "object", "additionalProperties": False, "properties": {
            "template": _STR,
            "overrides": {"type": "object", "additionalProperties": {
                "type": "object", "additionalProperties": False, "required": ["resource"],
                "properties": {"group": _STR, "resource": _STR}}}}},
        "name": {"type": "object", "additionalProperties": False,
                 "properties": {"matches": _STR, "as": _STR}},
        "metricsQuery": _STR,
        "labelValueReplacements": {"type": "array", "items": {
            "type": "object", "additionalProperties": False,
            "properties": {"find": _STR, "replace": _STR}}},
    },
}

