#!/usr/bin/env bash
# llama.cpp's server (llama-server) as a peer, on the embedded SmolLM2-135M GGUF, for
# side-by-side runs: the same interface as ../shared/tools/peer-vllm-cpu.sh, so that
# `PEER_TOOL=scripts/peer-llama-server.sh scripts/ab_peer.sh` runs it.
#   peer-llama-server.sh setup        builds llama-server and llama-quantize in $LLAMA_PEER_DIR
#                                     (default /tmp/peer-llama) from the llama.cpp that
#                                     llama-cpp-python's sdist vendors (PyPI is reachable, GitHub
#                                     is not); ~12 min on 2 vCPUs. Writes the GGUF as bf16 and
#                                     f32 too (llama-quantize undoes the Q4_1 blocks).
#   peer-llama-server.sh serve PORT [WEIGHTS] [extra llama-server args]
#                                     starts it in the background (its own process group, pid in
#                                     $LLAMA_PEER_DIR/server.pid), waits for /health
#   peer-llama-server.sh stop         stops it
#   peer-llama-server.sh name WEIGHTS what the summary calls it
#   peer-llama-server.sh built        exit status 0 once setup has run
# WEIGHTS: q4_1 (the embedded file as shipped, what a llama.cpp user would load), bfloat16 or
# float32 (the same weights at pagedserve's precision); default: the --dtype auto rule.
# Slots: LLAMA_SLOTS (default 128, every request of the peer workloads in flight at once),
# each with a KV cache of its own of LLAMA_SLOT_CTX tokens (default 2048); threads: every CPU.
# Not --kv-unified: there each sequence's attention spans every slot's cells, and the mixed
# workload ran at 18.7 out tok/s against 62.4 with a cache per slot (Q4_1, 2 vCPUs, Zen 4).
set -euo pipefail
LLAMA_PEER_DIR=${LLAMA_PEER_DIR:-/tmp/peer-llama}
PY=${PYTHON:-$(cd "$(dirname "$0")/.." && pwd)/.venv/bin/python}
VERSION=0.3.36  # llama-cpp-python; its vendor/llama.cpp is what gets built
SRC=$LLAMA_PEER_DIR/llama_cpp_python-$VERSION/vendor/llama.cpp
BIN=$SRC/build/bin
cmd=${1:-}

weights() {  # WEIGHTS -> the GGUF file
  case "$1" in
    q4_1) "$PY" -c 'from pagedserve.models.loader import default_model_path as p; print(p())' ;;
    bfloat16) echo "$LLAMA_PEER_DIR/smollm2-bf16.gguf" ;;
    float32) echo "$LLAMA_PEER_DIR/smollm2-f32.gguf" ;;
    *) echo "weights: q4_1, bfloat16 or float32, not '$1'" >&2; exit 2 ;;
  esac
}

case "$cmd" in
  setup)
    mkdir -p "$LLAMA_PEER_DIR"
    if [ ! -x "$BIN/llama-server" ] || [ ! -x "$BIN/llama-quantize" ]; then
      "$PY" -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$VERSION" \
        -d "$LLAMA_PEER_DIR"
      tar xzf "$LLAMA_PEER_DIR/llama_cpp_python-$VERSION.tar.gz" -C "$LLAMA_PEER_DIR"
      cmake -S "$SRC" -B "$SRC/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
        -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF \
        -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON > "$LLAMA_PEER_DIR/cmake.log"
      cmake --build "$SRC/build" --target llama-server llama-quantize -j "$(nproc)" \
        > "$LLAMA_PEER_DIR/build.log"
    fi
    q4=$(weights q4_1)
    for w in bfloat16:BF16 float32:F32; do
      out=$(weights "${w%%:*}")
      [ -f "$out" ] || "$BIN/llama-quantize" --allow-requantize "$q4" "$out" "${w##*:}" \
        > "$LLAMA_PEER_DIR/quantize.log" 2>&1
    done
    echo "llama-server: $BIN/llama-server"
    ;;
  serve)
    port=${2:?port}; shift 2
    w=${1:-}; [ $# -gt 0 ] && shift
    if [ -z "$w" ]; then
      w=$("$PY" -c 'import torch; print("bfloat16" if torch.ops.mkldnn._is_mkldnn_bf16_supported() else "float32")')
    fi
    model=$(weights "$w")
    setsid "$BIN/llama-server" -m "$model" --host 127.0.0.1 --port "$port" \
      -t "$(nproc)" -tb "$(nproc)" -np "${LLAMA_SLOTS:-128}" -c "$(( ${LLAMA_SLOTS:-128} * ${LLAMA_SLOT_CTX:-2048} ))" \
      --alias smollm2 --no-webui "$@" > "$LLAMA_PEER_DIR/server.log" 2>&1 &
    echo $! > "$LLAMA_PEER_DIR/server.pid"
    for _ in $(seq 1 300); do
      curl -sf "http://127.0.0.1:$port/health" >/dev/null 2>&1 && { echo "llama-server ($w) ready on :$port"; exit 0; }
      kill -0 "$(cat "$LLAMA_PEER_DIR/server.pid")" 2>/dev/null || { tail -20 "$LLAMA_PEER_DIR/server.log"; exit 1; }
      sleep 1
    done
    echo "llama-server did not become healthy; see $LLAMA_PEER_DIR/server.log"; exit 1
    ;;
  stop)
    pid=$(cat "$LLAMA_PEER_DIR/server.pid" 2>/dev/null) || exit 0
    kill -- -"$pid" 2>/dev/null || true; sleep 2; kill -9 -- -"$pid" 2>/dev/null || true
    rm -f "$LLAMA_PEER_DIR/server.pid"
    ;;
  built)  # whether setup has run: the server and the converted GGUFs are there
    [ -x "$BIN/llama-server" ] && [ -f "$(weights float32)" ] && [ -f "$(weights bfloat16)" ]
    ;;
  name)
    commit=$(git -C "$SRC" rev-parse --short HEAD 2>/dev/null || true)
    case "${2:-}" in
      q4_1) w="the Q4_1 GGUF as shipped" ;; bfloat16) w="the GGUF in bf16" ;;
      float32) w="the GGUF in f32" ;; *) w="${2:-?} weights" ;;
    esac
    echo "llama.cpp ${commit:-?} (llama-server; llama-cpp-python $VERSION's), $w"
    ;;
  *) sed -n '2,21p' "$0"; exit 2 ;;
esac
