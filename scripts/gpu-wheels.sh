#!/usr/bin/env bash
# Wheels for scripts/gpu-check.sh: the GPU machine has torch, triton and transformers but
# not llguidance (the engine imports it), fastapi, uvicorn or httpx (the HTTP step), nor
# py-spy (step 4's stacks), and no network. Run this here (PyPI reachable), then carry
# gpu-wheels/ with the run (`run` tool: carry=["gpu-wheels"]); gpu-check.sh installs from
# it offline into a scratch directory.
# Usage: scripts/gpu-wheels.sh [PYTHON_VERSION]   (default 3.12, the GPU machine's)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
version=${1:-3.12}
rm -rf gpu-wheels
$PY -m pip download -q -d gpu-wheels --only-binary=:all: --python-version "$version" \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_31_x86_64 --platform any \
    "fastapi>=0.110" "uvicorn>=0.29" "httptools>=0.6" "httpx>=0.28" "prometheus-client>=0.20" \
    "llguidance>=1.9.1" "py-spy>=0.4"
du -sh gpu-wheels
