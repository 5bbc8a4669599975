"""What scripts/gpu-check.sh can count on where it runs: the GPU machine has torch, triton,
transformers and pytest, but no gguf, fastapi, uvicorn, httptools or openai, and no network.
Its engine-side steps must import without those packages, and its HTTP step installs every
server wheel scripts/gpu-wheels.sh brings (a missing one cost a GPU run its HTTP figures)."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Not on the GPU machine; the server's packages come from the wheels, for step 6 only.
ABSENT = ("gguf", "fastapi", "starlette", "uvicorn", "httptools", "openai",
          "prometheus_client")
# What the engine-side steps import: the CLI's bench throughput, the GPU tests, the scripts.
ENGINE_SIDE = ("pagedserve.cli", "pagedserve.engine.llm", "pagedserve.bench.throughput",
               "conftest", "engine_utils", "test_gpu_engine", "test_triton_kernels",
               "test_triton_prefill", "test_triton_elementwise", "profile_step",
               "sweep_triton_configs", "bench_triton_kernels")

_IMPORT_WITHOUT = """
import importlib, sys
absent, modules = sys.argv[1].split(","), sys.argv[2].split(",")

class Absent:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in absent:
            raise ModuleNotFoundError(f"No module named {name!r} (absent on the GPU machine)")

sys.meta_path.insert(0, Absent())
for module in modules:
    importlib.import_module(module)
"""


def test_the_engine_side_imports_without_the_packages_the_gpu_machine_lacks():
    env_path = f"{ROOT}:{ROOT / 'tests'}:{ROOT / 'scripts'}"
    result = subprocess.run(
        [sys.executable, "-c", _IMPORT_WITHOUT, ",".join(ABSENT), ",".join(ENGINE_SIDE)],
        capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": env_path},
        timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]


def _brought(script: str) -> set[str]:
    """The requirements gpu-wheels.sh downloads ("name>=version", quoted)."""
    return {name.lower() for name in re.findall(r'"([A-Za-z][\w.-]*)\s*[<>=]', script)}


def _installed(script: str) -> set[str]:
    """The packages gpu-check.sh's pip commands install: what follows --target DIR."""
    names = set()
    for command in script.replace("\\\n", " ").splitlines():
        if "pip install" in command and "--target" in command:
            after = command.split("||")[0].split("--target", 1)[1].split()[1:]
            names |= {word.lower() for word in after}
    return names


def test_gpu_check_installs_every_wheel_gpu_wheels_brings():
    brought = _brought((ROOT / "scripts/gpu-wheels.sh").read_text())
    installed = _installed((ROOT / "scripts/gpu-check.sh").read_text())
    assert {"fastapi", "uvicorn", "httptools", "llguidance"} <= brought
    assert brought <= installed, sorted(brought - installed)
