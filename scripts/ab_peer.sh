#!/usr/bin/env bash
# pagedserve and a peer server (vLLM's CPU build, or llama.cpp's llama-server) side by side
# on this machine, in one sitting: for each workload, ROUNDS rounds of both servers, the order
# alternating (A B, B A, ...) so that the machine's drift hits both; each server is started,
# loaded by the same `pagedserve bench serve` client, and stopped before the other starts.
# Then the medians and their ratio.
#
# Needs the peer: ../shared/tools/peer-vllm-cpu.sh setup (PEER_TOOL overrides the path; for
# llama.cpp: PEER_TOOL=scripts/peer-llama-server.sh, after its `setup`).
#   AB_WORKLOADS   default: mixed decode-heavy shared-prefix (pagedserve/bench/peer.py)
#   AB_ROUNDS      rounds per workload (default 2)
#   AB_DTYPE       both servers' dtype (default: pagedserve's --dtype auto rule, which the
#                  peer tool applies too)
#   AB_PEER_WEIGHTS what the peer tool's `serve` gets for weights (default: AB_DTYPE's value;
#                  llama-server also takes q4_1, the embedded GGUF as shipped)
#   AB_SERVER_ARGS extra `pagedserve serve` flags;  AB_PEER_ARGS extra flags for the peer
#   AB_BENCH_ARGS  extra `bench serve` flags, after the workload's (e.g. "--num-prompts 8
#                  --output-len 8": a quick check that both servers run)
#   AB_OUT         result folder (default bench/results/peer, or peer-avx2); AB_PORT (8766)
#   AB_SUMMARY     the summary's path (default: 10-peer.json beside AB_OUT)
#   AB_HOLD_AVX2=1 both engines as on an AVX2-only CPU, in float32: oneDNN, MKL and inductor
#                  capped at AVX2, pagedserve's kernels built for x86-64-v3 (in build/,
#                  unless PAGEDSERVE_CPU_KERNELS_LIB names a build), and vLLM shown
#                  no AVX-512 or AMX (scripts/avx2_host), so that it loads its AVX2 kernels.
#                  The summary goes to 11-peer-avx2.json instead of 10-peer.json.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
PAGEDSERVE=${PAGEDSERVE:-.venv/bin/pagedserve}
PEER_TOOL=${PEER_TOOL:-../shared/tools/peer-vllm-cpu.sh}
HOLD_AVX2=${AB_HOLD_AVX2:-0}
OUT=${AB_OUT:-bench/results/$([[ $HOLD_AVX2 == 1 ]] && echo peer-avx2 || echo peer)}
PORT=${AB_PORT:-8766}
ROUNDS=${AB_ROUNDS:-2}
SUMMARY=${AB_SUMMARY:-$OUT/../10-peer.json}
HELD=()
PEER_PYTHONPATH=${PYTHONPATH:-}
if [[ $HOLD_AVX2 == 1 ]]; then
    export ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 ATEN_CPU_CAPABILITY=avx2
    AB_DTYPE=${AB_DTYPE:-float32}
    SUMMARY=${AB_SUMMARY:-$OUT/../11-peer-avx2.json}
    HELD=(--held-to "AVX2, $AB_DTYPE")
    PEER_PYTHONPATH=$PWD/scripts/avx2_host${PYTHONPATH:+:$PYTHONPATH}
    if [[ -z ${PAGEDSERVE_CPU_KERNELS_LIB:-} && ${PAGEDSERVE_CPU_KERNELS:-1} != 0 ]]; then
        kernels=$PWD/build/kernels-x86-64-v3
        mkdir -p "$kernels"
        PAGEDSERVE_CPU_ARCH=x86-64-v3 "$PY" -m pagedserve.kernels.cpu "$kernels" \
            > "$kernels/build.log" 2>&1
        export PAGEDSERVE_CPU_KERNELS_LIB=$kernels/pagedserve_cpu_ops.so
    fi
    if [[ ${PAGEDSERVE_CPU_KERNELS:-1} != 0 ]]; then  # a silent fallback would time the references
        "$PY" -c 'from pagedserve.kernels import cpu; assert cpu.load(), "no C++ kernels"'
    fi
fi
DTYPE=${AB_DTYPE:-$("$PY" -c 'import torch; print("bfloat16" if torch.ops.mkldnn._is_mkldnn_bf16_supported() else "float32")')}
PEER_WEIGHTS=${AB_PEER_WEIGHTS:-$DTYPE}
read -r -a SERVER_EXTRA <<< "${AB_SERVER_ARGS:-}"
read -r -a PEER_EXTRA <<< "${AB_PEER_ARGS:-}"
read -r -a BENCH_EXTRA <<< "${AB_BENCH_ARGS:-}"

start() {
    if [[ $1 == pagedserve ]]; then
        "$PAGEDSERVE" serve --port "$PORT" --dtype "$DTYPE" --log-level warning \
            "${SERVER_EXTRA[@]}" > "$OUT/server-pagedserve.log" 2>&1 &
        pid=$!
        "$PY" scripts/wait_ready.py "$PORT" "$pid"
    else
        PYTHONPATH=$PEER_PYTHONPATH bash "$PEER_TOOL" serve "$PORT" "$PEER_WEIGHTS" \
            "${PEER_EXTRA[@]}"
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
                "${BENCH_EXTRA[@]}" --json "$file" > "$file.log" 2>&1 ||
                { tail -5 "$file.log" >&2; exit 1; }
            stop "$server"
            trap - EXIT
            files+=("$file")
        done
    done
done
# A peer tool that names itself (`name WEIGHTS`) is named so; the vLLM one is read off its venv.
peer_name=$(bash "$PEER_TOOL" name "$PEER_WEIGHTS" 2> /dev/null) && [[ -n $peer_name ]] ||
    peer_name="vLLM $("$PY" - <<'PY'
import re, subprocess
out = subprocess.run(["bash", "-c", "ls ${PEER_DIR:-/tmp/peer-vllm}/venv/lib/python*/site-packages | grep -i '^vllm_cpu-.*dist-info'"], capture_output=True, text=True).stdout
m = re.search(r"vllm_cpu-([\w.]+)\.dist-info", out)
print(f"{m.group(1)} (CPU build)" if m else "(CPU build)")
PY
)"
"$PY" -m pagedserve.bench.peer summarize --peer-name "$peer_name" --json "$SUMMARY" \
    "${HELD[@]}" "${files[@]}"
