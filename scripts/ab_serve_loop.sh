#!/bin/bash
# The server's host cost per token with the forward faked out (serve_no_forward.py): a base
# checkout and this tree, each with the engine loop in the server's process and in a process
# of its own, measured in interleaved rounds with CPU time per process.
#
#   git worktree add /tmp/base <commit>
#   bash scripts/ab_serve_loop.sh /tmp/base [rounds]
set -euo pipefail
base=$(realpath "$1")
rounds=${2:-4}
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
start 8810 "$base" --no-frontend-multiprocessing
start 8811 "$base" --frontend-multiprocessing
start 8812 "$PWD" --no-frontend-multiprocessing
start 8813 "$PWD" --frontend-multiprocessing
engines=("" "$(pgrep -P "${PIDS[1]}" -f spawn_main | head -1)" "" \
         "$(pgrep -P "${PIDS[3]}" -f spawn_main | head -1)")
cpu() { [ -n "$1" ] && awk '{print ($14 + $15) / 100}' "/proc/$1/stat" || echo 0; }
for round in $(seq "$rounds"); do
    for i in 0 1 2 3; do
        port=$((8810 + i)) server=${PIDS[$i]} engine=${engines[$i]}
        s0=$(cpu "$server") e0=$(cpu "$engine")
        "$PY" -m pagedserve.cli bench serve --base-url "http://127.0.0.1:$port" \
            --num-prompts 512 --input-len 128 --output-len 128 --max-concurrency 64 \
            --ignore-eos --request-rate inf --json "/tmp/ab_serve_loop-$port.json" > /dev/null
        s1=$(cpu "$server") e1=$(cpu "$engine")
        "$PY" - "$i" "$round" "$s0" "$s1" "$e0" "$e1" "$port" <<'PYEOF'
import json, sys

i, round_, s0, s1, e0, e1, port = sys.argv[1:]
run = json.load(open(f"/tmp/ab_serve_loop-{port}.json"))
tokens = run["completed"] * 128
name = ["base, one process", "base, split", "this, one process", "this, split"][int(i)]
engine = (f", engine process {(float(e1) - float(e0)) / tokens * 1e6:.1f} us/tok"
          if float(e1) else "")
print(f"round {round_} {name}: {run['output_throughput']:.0f} out tok/s, server process "
      f"{(float(s1) - float(s0)) / tokens * 1e6:.1f} us/tok{engine}, client "
      f"{run.get('client_cpu_s', 0) / tokens * 1e6:.1f} us/tok ({run['failed']} failed)")
PYEOF
    done
done
