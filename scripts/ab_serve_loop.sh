#!/bin/bash
# The server's host cost with the forward faked out (serve_no_forward.py): a base checkout and
# this tree, each with the engine loop in the server's process and in a process of its own,
# measured in interleaved rounds with CPU time per process (a token, and a request).
#
#   git worktree add /tmp/base <commit>
#   bash scripts/ab_serve_loop.sh /tmp/base [rounds]
#
# The load, from the environment (defaults: 512 prompts of 128 random tokens, 128 out, 64
# concurrent): NUM_PROMPTS, INPUT_LEN, RANGE_RATIO, OUTPUT_LEN (1: the cost of taking a
# request in); SPLIT_ONLY=1 starts only the two split servers; THIS_FLAGS, more flags for
# this tree's split server (with BASE = this tree: one flag against none, e.g.
# THIS_FLAGS="--api-server-count 2"; the server CPU then sums the server processes);
# COMMON_FLAGS, flags for every server. With LOGITS_WIDTH=64 COMMON_FLAGS="--num-threads 1"
# the engine process's CPU is its host work alone, as on a GPU: no argmax over the
# vocabulary, and no OpenMP pool woken for each small op (on 2 vCPUs shared with the client
# and the server, the pool doubled it).
set -euo pipefail
base=$(realpath "$1")
rounds=${2:-4}
prompts=${NUM_PROMPTS:-512} input_len=${INPUT_LEN:-128} range_ratio=${RANGE_RATIO:-0}
output_len=${OUTPUT_LEN:-128}
PY=$PWD/.venv/bin/python
PIDS=()
trap 'kill "${PIDS[@]}" 2> /dev/null || true' EXIT
start() {  # port, tree, flags...
    local port=$1 tree=$2
    shift 2
    (cd "$tree" && PYTHONPATH="$tree" exec "$PY" scripts/serve_no_forward.py --port "$port" \
        --log-level warning "$@" > "/tmp/ab_serve_loop-$port.log" 2>&1) &
    PIDS+=($!)
    "$PY" scripts/wait_ready.py "$port" $! 180
}
names=("base, one process" "base, split" "this, one process" "this, split")
servers=(0 1 2 3)
[ "${SPLIT_ONLY:-0}" = 1 ] && servers=(1 3)
for i in "${servers[@]}"; do
    tree=$base
    [ "$i" -ge 2 ] && tree=$PWD
    flag=--no-frontend-multiprocessing
    [ $((i % 2)) = 1 ] && flag=--frontend-multiprocessing
    more=()
    [ "$i" = 3 ] && read -r -a more <<< "${THIS_FLAGS:-}"
    read -r -a common <<< "${COMMON_FLAGS:-}"
    start $((8810 + i)) "$tree" "$flag" ${common[@]+"${common[@]}"} ${more[@]+"${more[@]}"}
    server[i]=${PIDS[-1]}
    engine[i]=""
    if [ $((i % 2)) = 1 ]; then  # the engine process is the first child started
        engine[i]=$(pgrep -P "${PIDS[-1]}" -f spawn_main | head -1)
        server[i]="${PIDS[-1]} $(pgrep -P "${PIDS[-1]}" -f spawn_main | tail -n +2 | tr '\n' ' ')"
    fi
done
cpu() {  # "PID ..." -> their CPU seconds together (0 for none)
    local pid files=()
    for pid in $1; do files+=("/proc/$pid/stat"); done
    [ ${#files[@]} -gt 0 ] && awk '{t += ($14 + $15) / 100} END {print t}' "${files[@]}" \
        || echo 0
}
steps() {  # port -> the engine's steps so far (/metrics; 0 where a tree has no such counter)
    curl -s "http://127.0.0.1:$1/metrics" | awk '/^pagedserve_engine_steps_total/ {t += $2}
        END {print t + 0}'
}
for round in $(seq "$rounds"); do
    for i in "${servers[@]}"; do
        port=$((8810 + i))
        s0=$(cpu "${server[i]}") e0=$(cpu "${engine[i]}") n0=$(steps $port)
        "$PY" -m pagedserve.cli bench serve --base-url "http://127.0.0.1:$port" \
            --num-prompts "$prompts" --input-len "$input_len" --range-ratio "$range_ratio" \
            --output-len "$output_len" --max-concurrency 64 --vocab-size 32000 --seed "$round" \
            --ignore-eos --request-rate inf --json "/tmp/ab_serve_loop-$port.json" > /dev/null
        s1=$(cpu "${server[i]}") e1=$(cpu "${engine[i]}") n1=$(steps $port)
        "$PY" - "${names[i]}" "$round" "$s0" "$s1" "$e0" "$e1" "$port" $((n1 - n0)) <<'PYEOF'
import json, sys

name, round_, s0, s1, e0, e1, port, steps = sys.argv[1:]
run = json.load(open(f"/tmp/ab_serve_loop-{port}.json"))
tokens, requests = run["total_output_tokens"], run["completed"]
server, engine = float(s1) - float(s0), float(e1) - float(e0)
engine_part = f", engine process {engine / tokens * 1e6:.1f} us/tok" if engine else ""
print(f"round {round_} {name}: {run['output_throughput']:.0f} out tok/s, "
      f"{run['request_throughput']:.0f} req/s, TTFT median {run['ttft_ms']['median']:.1f} ms; "
      f"server process {server / tokens * 1e6:.1f} us/tok, {server / requests * 1e3:.3f} "
      f"ms/req{engine_part}; client {run.get('client_cpu_s', 0) / tokens * 1e6:.1f} us/tok; "
      f"{f'{tokens / int(steps):.1f}' if int(steps) else '?'} out tokens a step "
      f"({run['failed']} failed)")
PYEOF
    done
done
