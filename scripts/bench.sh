#!/usr/bin/env bash
# `make bench`: the offline workloads (bench throughput), the online one (bench serve against a
# `pagedserve serve` started here, when that command exists), then the README table.
#
# Everything is overridable from the environment, e.g. a quick run:
#   BENCH_WORKLOADS=mixed BENCH_HF_WORKLOADS=mixed BENCH_ARGS="--num-prompts 8 --output-len 16" \
#   BENCH_SERVE_ARGS="--num-prompts 8 --output-len 16" make bench
#
#   BENCH_WORKLOADS     offline workloads to run (default: mixed decode-heavy shared-prefix fork)
#   BENCH_HF_WORKLOADS  those that also run the HF baseline (default: mixed decode-heavy)
#   BENCH_ARGS          extra `bench throughput` arguments (engine flags, --num-threads, overrides)
#   BENCH_SERVE=0       skip the online benchmark
#   BENCH_SERVE_ARGS    extra `bench serve` arguments (after the mixed-workload defaults; the
#                       prompts are random ids below --vocab-size 49152, the embedded model's)
#   BENCH_SERVER_ARGS   extra `pagedserve serve` arguments (engine flags, --model)
#   BENCH_PORT          port for the server (default 8765)
#   BENCH_PEER=0        skip the side-by-side with vLLM's CPU build (run when its peer harness
#                       is installed; knobs: scripts/ab_peer.sh)
#   BENCH_PEER_AVX2     1 (the default where the CPU has AVX-512): that sitting again with both
#                       engines held to AVX2 float32 (AB_HOLD_AVX2=1); 0 skips it
#   BENCH_PEER_LLAMA=0  skip the side-by-side with llama.cpp's llama-server (run when
#                       scripts/peer-llama-server.sh has built it): the GGUF at pagedserve's
#                       precision on the three peer workloads, then as shipped (Q4_1) on mixed
#                       and decode-heavy
#   BENCH_OUT           result folder (default bench/results)
#   BENCH_README        README to update (default README.md; empty: skip)
set -euo pipefail

PY=${PYTHON:-.venv/bin/python}
PAGEDSERVE=${PAGEDSERVE:-.venv/bin/pagedserve}
OUT=${BENCH_OUT:-bench/results}
WORKLOADS=${BENCH_WORKLOADS:-mixed decode-heavy shared-prefix fork}
HF_WORKLOADS=${BENCH_HF_WORKLOADS:-mixed decode-heavy}
PORT=${BENCH_PORT:-8765}
README=${BENCH_README-README.md}
read -r -a EXTRA <<< "${BENCH_ARGS:-}"
read -r -a SERVE_EXTRA <<< "${BENCH_SERVE_ARGS:-}"
read -r -a SERVER_EXTRA <<< "${BENCH_SERVER_ARGS:-}"

# The online benchmark: a server started here, the mixed workload at concurrency 64.
serve_bench() {
    echo "== pagedserve serve on port $PORT" >&2
    "$PAGEDSERVE" serve --port "$PORT" --log-level warning "${SERVER_EXTRA[@]}" &
    server=$!
    trap 'kill "$server" 2> /dev/null || true; wait "$server" 2> /dev/null || true' EXIT
    "$PY" scripts/wait_ready.py "$PORT" "$server" 300
    # The mixed workload: 64 prompts of 64-512 tokens (288 * (1 -/+ 0.778)), 128 output tokens.
    file="$OUT/09-serve-mixed.json"
    echo "== bench serve (mixed) ${SERVE_EXTRA[*]}" >&2
    "$PAGEDSERVE" bench serve --base-url "http://127.0.0.1:$PORT" --dataset random \
        --num-prompts 64 --input-len 288 --range-ratio 0.778 --output-len 128 --ignore-eos \
        --max-concurrency 64 --vocab-size 49152 --json "$file" "${SERVE_EXTRA[@]}"
    results+=("$file")
    kill "$server" 2> /dev/null || true
    wait "$server" 2> /dev/null || true
    trap - EXIT
}

mkdir -p "$OUT"
results=()
serve_enabled=0
if [[ "${BENCH_SERVE:-1}" != 0 ]] && "$PAGEDSERVE" serve --help > /dev/null 2>&1; then
    serve_enabled=1
else
    echo "== skipping bench serve (BENCH_SERVE=0 or no 'pagedserve serve')" >&2
fi
i=0
for w in $WORKLOADS; do
    i=$((i + 1))
    # Online right before offline on the same workload: shared machines drift within
    # minutes, and the serving target is a ratio of the two.
    if [[ "$w" == mixed && $serve_enabled == 1 ]]; then serve_bench; serve_enabled=0; fi
    baseline=()
    if [[ " $HF_WORKLOADS " == *" $w "* ]]; then baseline=(--baseline hf); fi
    file="$OUT/0$i-throughput-$w.json"
    echo "== bench throughput --workload $w ${baseline[*]} ${EXTRA[*]}" >&2
    "$PAGEDSERVE" bench throughput --workload "$w" "${baseline[@]}" --json "$file" "${EXTRA[@]}"
    results+=("$file")
done
if [[ $serve_enabled == 1 ]]; then serve_bench; fi

# Side by side with vLLM's CPU build, when its peer harness is installed (BENCH_PEER=0 skips).
if [[ "${BENCH_PEER:-1}" != 0 && -x "${PEER_DIR:-/tmp/peer-vllm}/venv/bin/python" ]]; then
    PYTHON="$PY" PAGEDSERVE="$PAGEDSERVE" AB_OUT="$OUT/peer" bash scripts/ab_peer.sh
    results+=("$OUT/10-peer.json")
    # Where the CPU has AVX-512, the same sitting again with both engines as on an AVX2-only
    # CPU in float32 (the ordering must hold there too).
    default_avx2=0
    if grep -qw avx512f /proc/cpuinfo 2> /dev/null; then default_avx2=1; fi
    if [[ "${BENCH_PEER_AVX2:-$default_avx2}" == 1 ]]; then
        PYTHON="$PY" PAGEDSERVE="$PAGEDSERVE" AB_OUT="$OUT/peer-avx2" AB_HOLD_AVX2=1 \
            bash scripts/ab_peer.sh
        results+=("$OUT/11-peer-avx2.json")
    fi
else
    echo "== skipping the vLLM side-by-side (no peer: ../shared/tools/peer-vllm-cpu.sh setup)" >&2
fi
if [[ "${BENCH_PEER_LLAMA:-1}" != 0 ]] && bash scripts/peer-llama-server.sh built; then
    for weights in same q4_1; do
        summary=$OUT/12-peer-llama.json; ab=(AB_OUT="$OUT/peer-llama")
        if [[ $weights == q4_1 ]]; then
            summary=$OUT/13-peer-llama-q4_1.json
            ab=(AB_OUT="$OUT/peer-llama-q4_1" AB_PEER_WEIGHTS=q4_1 AB_WORKLOADS="mixed decode-heavy")
        fi
        env PYTHON="$PY" PAGEDSERVE="$PAGEDSERVE" PEER_TOOL=scripts/peer-llama-server.sh \
            AB_SUMMARY="$summary" "${ab[@]}" bash scripts/ab_peer.sh
        results+=("$summary")
    done
else
    echo "== skipping the llama.cpp side-by-side (no peer: scripts/peer-llama-server.sh setup)" >&2
fi

if [[ -n "$README" ]]; then
    "$PY" -m pagedserve.bench.report --readme "$README" "${results[@]}"
    echo "== updated the Performance table in $README" >&2
fi
