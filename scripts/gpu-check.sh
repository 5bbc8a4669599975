#!/usr/bin/env bash
# The checks that need a CUDA GPU, as one run (a borrowed GPU machine has minutes, not hours):
#   1-2. in parallel, since compiling Triton kernels is CPU work: every Triton kernel against
#      its PyTorch reference (tests/test_triton_kernels.py, test_triton_prefill.py,
#      test_triton_elementwise.py), the engine end to end on CUDA against HF transformers,
#      chunked/preempted/forked runs, CUDA graphs against eager and the bf16 rule, for both
#      attention sets (tests/test_gpu_engine.py), and the config sweep's compile step;
#   3. the attention kernels over a grid of launch configs (scripts/sweep_triton_configs.py);
#   4. one decode step, 64 sequences x ~300 tokens, bf16: wall time, the host's time per
#      phase, GPU-busy time and launches, for flash with graphs (in order, and with
#      --async-scheduling, the default, also at ~4,000-token contexts; greedy, and at
#      temperature 1 with top_p 0.9), flash eager and basic eager
#      (scripts/profile_step.py; the two graph steps also under py-spy, whose collapsed
#      stacks land in results.tgz); then a mixed step (the decodes and a 400-token prompt),
#      its prefill eager, as piecewise graphs or as one whole graph (--full-graphs); and
#      (4w) the decode kernel as that long step's graph calls it, split against unsplit,
#      and a mixed step's attention as a whole graph runs it, against the eager split and
#      a sketch of split-KV inside a whole graph;
#   5. offline throughput on CUDA (mixed), the defaults (8,192 tokens a step, async
#      scheduling, piecewise graphs; the median of 3 timed parts, the same run's figures
#      moved by up to 1.5x) and HF transformers in the same run, and the Triton
#      kernels built in its timed part (none, after the engine's warm-up); then each step
#      in order with eager prefill steps (the defaults until 2026-12-04) at 8,192 and at
#      the CPU's 1,024, the piecewise graphs alone at both, and async scheduling alone;
#      and whole graphs (--full-graphs) against piecewise at 1,024, in order;
#   6. `pagedserve serve --device cuda` over HTTP, loaded by `pagedserve bench serve`,
#      against step 5's offline figures: the defaults (the engine loop in a process of its
#      own), the same with whole graphs for the steps that take in prompts (--full-graphs),
#      with 4 API server processes (--api-server-count 4), with both, with
#      --stream-interval 4, then the loop in the server's thread; each process's CPU a
#      token, the client's, and the output tokens an engine step (/metrics) against the
#      offline run's;
#   7. the kernel benchmarks (scripts/bench_triton_kernels.py) and the eager basic engine's
#      throughput, the old defaults.
# Uses what the machine has (torch, triton, transformers, tokenizers, safetensors, xxhash,
# jinja2, numpy, pytest with pytest-timeout) and the wheels in gpu-wheels/
# (scripts/gpu-wheels.sh: llguidance, and the server's fastapi, uvicorn, httptools, httpx); needs no
# network and no embedded model.
# Logs and results go to $OUT (default: gpu-check-out/): the console log (console.log) and
# its summary lines (summary.txt) there, everything else packed into $OUT/results.tgz (the
# `run` tool brings back only a few files). Exit status: 0 when all that ran passed; a step
# the budget leaves no time for, or cuts short, says so and fails nothing.
set -uo pipefail
script=$(realpath "$0")
cd "$(dirname "$script")/.." || exit 2
FINAL=${OUT:-gpu-check-out}
mkdir -p "$FINAL"
if [ -z "${GPU_CHECK_TEED:-}" ]; then  # the console to console.log too (a pipe it waits for)
    GPU_CHECK_TEED=1 bash "$script" "$@" 2>&1 | tee "$FINAL/console.log"
    status=${PIPESTATUS[0]}
    grep -E "^(==|FAILED|ERROR)|not run|cut short|HTTP/offline|out tok/s|median|GB/s|TFLOP|passed" \
        "$FINAL/console.log" > "$FINAL/summary.txt"
    exit "$status"
fi
OUT=$(mktemp -d)
PY=${PYTHON:-python3}
pack() { tar czf "$FINAL/results.tgz" -C "$OUT" . ; }
trap pack EXIT
# Two scratch sites: llguidance for every step; the server's packages (and what they pull
# in, typing_extensions among them) only for step 6, so that the other steps run on the
# machine's own packages. (In step 6 the scratch site, being on PYTHONPATH, comes first.)
engine_site=$(mktemp -d) server_site=$(mktemp -d)
# Without llguidance the engine does not import: every step would fail, so none runs.
$PY -m pip install -q --no-index --find-links gpu-wheels --target "$engine_site" llguidance \
    || { echo "FAILED: no llguidance wheel: run scripts/gpu-wheels.sh and carry gpu-wheels/"
         exit 2; }
$PY -m pip install -q --no-index --find-links gpu-wheels --target "$engine_site" py-spy \
    || echo "no py-spy wheel: step 4 runs without it"
$PY -m pip install -q --no-index --find-links gpu-wheels --target "$server_site" fastapi \
    uvicorn httptools httpx prometheus-client || echo "no server wheels: step 6 is skipped"
export TRITON_INTERPRET=0 PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:$engine_site${PYTHONPATH:+:$PYTHONPATH}"
export PATH="$engine_site/bin:$PATH"  # py-spy
status=0
# The whole run must end within 9 minutes on an H200: each step's timeout is its own cap or
# what is left of the budget, whichever is less (SECONDS counts from the script's start).
BUDGET=${GPU_CHECK_BUDGET_S:-520}
cap() { local left=$((BUDGET - SECONDS)); echo $(( left < $1 ? (left > 1 ? left : 1) : $1 )); }
# Whether the budget leaves ``$1`` seconds for what ``$2`` names; if not it says so, and that
# part is not run (a command given a second or two only fails, and fails the run with it).
in_budget() {
    (( BUDGET - SECONDS >= $1 )) && return 0
    echo "not run (the budget ended): $2"
    return 1
}
# `budgeted CAP command...`: the command under `timeout`, at CAP or what is left of the
# budget; one the budget (not its own cap) cut short says so, and fails nothing.
budgeted() {
    local want=$1 limit rc
    shift
    limit=$(cap "$want")
    timeout "$limit" "$@"
    rc=$?
    if [ "$rc" = 124 ] && [ "$limit" -lt "$want" ]; then  # (listed again at the end)
        echo "cut short (the budget ended): $*" | cut -c1-160 | tee -a "$OUT/cut-short.txt"
        return 0
    fi
    return "$rc"
}
# GPU_CHECK_SKIP="3 7" leaves out those steps (the sweep and its compile; the kernel
# benchmarks): for a second run in one lease that rechecks the engine. "4" leaves out the
# step timings and "5b" step 5's comparisons (keeping the defaults' offline run, which step
# 6 reads), "5f" whole graphs against piecewise ones offline: GPU_CHECK_SKIP="3 4 4w 5b 5f 7"
# is the tests, offline and HTTP; "1" leaves out the
# tests too (a rerun of the timings on a tree whose tests passed on a GPU), "6f", "6a",
# "6af", "6i" and "6t" step 6's servers with whole graphs, with 4 API server processes,
# with both, with --stream-interval 4 and with the engine loop in its thread; "4w" the
# decode kernel in a decode graph's wide table, and mixed steps' attention (~25 s).
skipped() { [[ " ${GPU_CHECK_SKIP:-} " == *" $1 "* ]]; }

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
$PY -c "import torch, triton, transformers as t; print('torch', torch.__version__,
'triton', triton.__version__, 'transformers', t.__version__)" | tee -a "$OUT/gpu.txt"

echo "== 1-2: Triton kernels and the engine on CUDA (in parallel: compiling is CPU work)"
# Not tests/test_triton_compile.py: it is for hosts without a GPU; here every kernel
# compiles for real when the tests launch it, so it would only cost minutes of ptxas.
# Three pytest processes and the sweep's compile workers share the machine's cores; the
# timed steps below run only after all of them, alone on the GPU.
tests() {  # name, test files...
    local name=$1
    shift
    budgeted 330 $PY -m pytest -q -p no:cacheprovider "$@" \
        --junitxml="$OUT/pytest-$name.xml" > "$OUT/pytest-$name.log" 2>&1
}
pids=()
if ! skipped 1; then
    tests kernels tests/test_triton_kernels.py tests/test_triton_prefill.py &
    pids+=($!)
    tests engine tests/test_gpu_engine.py &
    pids+=($!)
    tests elementwise tests/test_triton_elementwise.py &
    pids+=($!)
fi
if ! skipped 3; then
    budgeted 240 $PY scripts/sweep_triton_configs.py --compile-only --workers 8 \
        > "$OUT/sweep-compile.log" 2>&1 &
    p4=$!
fi

model=$(mktemp -d)/qwen2-0.5b-shapes
$PY - "$model" <<'EOF' || status=1
import sys
from pathlib import Path

sys.path.insert(0, "tests")
from engine_utils import save_random_hf
from test_gpu_engine import SHAPES
from transformers import Qwen2Config, Qwen2ForCausalLM

save_random_hf(Path(sys.argv[1]), Qwen2ForCausalLM, Qwen2Config(**SHAPES))
EOF
for p in ${pids[@]+"${pids[@]}"}; do wait "$p" || status=1; done
if ! skipped 1; then
    tail -n 2 "$OUT"/pytest-*.log
    grep -h -E "^(FAILED|ERROR)" "$OUT"/pytest-*.log
fi
if ! skipped 3; then
wait "$p4" || status=1
tail -n 2 "$OUT/sweep-compile.log"
fi
echo "tests and compiles done at ${SECONDS} s"

if ! skipped 3 && in_budget 30 "step 3"; then
echo "== 3: attention configs swept (compiled above): decode GB/s, prefill against SDPA"
budgeted 90 $PY scripts/sweep_triton_configs.py --no-compile --json "$OUT/sweep.jsonl" \
    2>&1 | tee "$OUT/sweep.log" || status=1
fi

echo "== 4: one decode step, 64 sequences x ~300 tokens (target: <= 4 ms)"
if ! skipped 4; then
# Graphs in order (the default until 2026-12-04) and with async scheduling (the default
# since), and async at ~4,000-token contexts (the host builds each block table from its
# last block on since 2026-12-05: its cost no longer grows with the context); the sampled
# variant, OpenAI's default temperature with a top_p (rows sort on a GPU); the penalized
# one, async with Qwen2.5's generation_config repetition_penalty, a token in flight each
# step (the penalties' counts kept on the host since 2026-12-07). The two graph
# steps also under py-spy (from gpu-wheels/): the host's time by Python line.
for variant in "sync flash --no-enforce-eager --no-async-scheduling" \
        "async flash --no-enforce-eager --async-scheduling" \
        "async-long flash --no-enforce-eager --async-scheduling --context 4000" \
        "flash-eager flash --enforce-eager --no-async-scheduling" \
        "basic-eager basic --enforce-eager --no-async-scheduling" \
        "sampled flash --no-enforce-eager --temperature 1 --top-p 0.9" \
        "penalized flash --no-enforce-eager --async-scheduling --repetition-penalty 1.05"; do
    set -- $variant
    name="step-$1"
    shift
    in_budget 20 "$name" || continue
    spy=()
    if { [ "$name" = step-sync ] || [ "$name" = step-async ]; } \
            && command -v py-spy > /dev/null; then
        spy=(--py-spy "$OUT/$name-stacks.txt")
    fi
    budgeted 45 $PY scripts/profile_step.py --model "$model" --device cuda \
        --dtype bfloat16 --seqs 64 --context 300 --triton-attention "$@" \
        ${spy[@]+"${spy[@]}"} \
        --json "$OUT/$name.json" > "$OUT/$name.log" 2>&1 || status=1
    grep -E "median|phases|GPU busy" "$OUT/$name.log"
    grep -A6 "^py-spy" "$OUT/$name.log"
done
# A mixed step: the same decodes beside a new 400-token prompt (464 tokens, padded to 512
# on the piecewise path), its prefill run eagerly, as piecewise graphs, or as one whole
# graph (--full-graphs; in order, so that the step holds its own prefill).
for variant in --no-piecewise-graphs --piecewise-graphs "--piecewise-graphs --full-graphs"; do
    name="mixed-step-${variant##*--}"
    in_budget 20 "$name" || continue
    budgeted 60 $PY scripts/profile_step.py --model "$model" --device cuda \
        --dtype bfloat16 --seqs 64 --context 300 --prefill-chunk 400 --no-enforce-eager \
        --no-async-scheduling --max-num-batched-tokens 512 $variant \
        --json "$OUT/$name.json" > "$OUT/$name.log" 2>&1 || status=1
    grep -E "median|phases|GPU busy" "$OUT/$name.log"
done
fi
if ! skipped 4w && in_budget 30 "step 4w"; then
# The decode kernel as step-async-long's decode graph calls it: a table as wide as the
# 32k max_model_len, contexts of 4,000 tokens; split (each sequence's partitions cut from
# its own context, 2026-12-05) against unsplit (what the kernel did there before). Then a
# mixed step's attention as a whole graph runs it (--full-graphs: decodes in the prefill
# kernel's flat grid, unsplit) against the eager split and the sketch of split-KV inside
# a whole graph, at ~300- to 16k-token contexts:
# whether whole graphs may be the default where contexts are long.
echo "== 4w: decode attention in a decode graph's wide table; a mixed step's, whole or split"
budgeted 75 $PY - <<'EOF' 2>&1 | tee "$OUT/decode-wide-table.log" || status=1
import sys

import torch

sys.path.insert(0, "scripts")
from bench_triton_kernels import bench_decode, bench_mixed, mixed_cases, print_mixed

case = dict(seqs=64, ctx=4000, heads=14, kv_heads=2, d=64, table_ctx=32768)
row = bench_decode(case, torch.bfloat16, torch.device("cuda"), 50, with_reference=False)
print(f"{case}: {row['splits']} partitions {row['triton_ms']:.3f} ms "
      f"({row['gb_per_s']:,.0f} GB/s); unsplit {row.get('no_split_ms', float('nan')):.3f} ms")
for case in mixed_cases():
    print_mixed(bench_mixed(case, torch.bfloat16, torch.device("cuda"), 50))
EOF
fi

echo "== 5: offline throughput on CUDA (mixed workload): the defaults, HF"
if in_budget 45 "step 5"; then
budgeted 120 $PY -m pagedserve.cli bench throughput --model "$model" --device cuda \
    --dtype bfloat16 --workload mixed --repeats 3 --baseline hf --hf-batch-sizes 32 \
    --json "$OUT/throughput.json" 2>&1 | tee "$OUT/throughput.log" || status=1
$PY - "$OUT/throughput.json" <<'EOF' || status=1
import json, os, sys

if not os.path.exists(sys.argv[1]):  # (it failed, or the budget cut it short: said above)
    sys.exit(0)
built = json.load(open(sys.argv[1]))["runs"][0]["triton_builds"]
print(f"Triton kernels built in the timed part (after the engine's warm-up): {built}")
EOF
fi
if ! skipped 5b; then
# Against the defaults (8,192 tokens a step, async scheduling, piecewise graphs): each
# step in order with eager prefill steps (the defaults until 2026-12-04), at 8,192 and at
# the CPU's 1,024; the pieces alone at both budgets; async scheduling alone.
in_order="--no-async-scheduling --no-piecewise-graphs"
for variant in "sync:$in_order" "budget1024:$in_order --max-num-batched-tokens 1024" \
        "piecewise1024:--no-async-scheduling --max-num-batched-tokens 1024" \
        "piecewise8192:--no-async-scheduling" "async:--no-piecewise-graphs"; do
    name=${variant%%:*}
    in_budget 25 "throughput-$name" || continue
    budgeted 60 $PY -m pagedserve.cli bench throughput --model "$model" --device cuda \
        --dtype bfloat16 --workload mixed ${variant#*:} --json "$OUT/throughput-$name.json" \
        > "$OUT/throughput-$name.log" 2>&1 || status=1
done
$PY - "$OUT"/throughput.json "$OUT"/throughput-sync.json "$OUT"/throughput-budget1024.json \
    "$OUT"/throughput-piecewise1024.json "$OUT"/throughput-piecewise8192.json \
    "$OUT"/throughput-async.json <<'EOF' || status=1
import json, os, sys

runs = [json.load(open(p))["runs"][0] if os.path.exists(p) else {} for p in sys.argv[1:]]
d, s, a, pa, pb, aa = (run.get("output_tokens_per_s", float("nan")) for run in runs)
print(f"mixed, the defaults: {d:.0f} out tok/s; in order with eager prefill steps: {s:.0f} "
      f"at 8,192 tokens a step ({d / s:.2f}x), {a:.0f} at 1,024")
print(f"mixed, piecewise graphs alone: 1,024 {pa:.0f} out tok/s ({pa / a:.2f}x), 8,192 "
      f"{pb:.0f} ({pb / s:.2f}x); async scheduling alone: {aa:.0f} ({aa / s:.2f}x)")
print("Triton kernels built in the timed parts: "
      + ", ".join(str(run.get("triton_builds")) for run in runs))
EOF
fi

if ! skipped 5f; then
# Whole graphs (--full-graphs) against piecewise ones at 1,024 tokens a step, in order:
# there most steps carry a prompt chunk beside the decodes, as a server's do while requests
# arrive (5b's piecewise run is reused when it ran).
for variant in "piecewise1024:--max-num-batched-tokens 1024" \
        "full1024:--max-num-batched-tokens 1024 --full-graphs"; do
    name=${variant%%:*}
    [ -f "$OUT/throughput-$name.json" ] && continue
    in_budget 25 "throughput-$name" || continue
    budgeted 60 $PY -m pagedserve.cli bench throughput --model "$model" --device cuda \
        --dtype bfloat16 --workload mixed --no-async-scheduling ${variant#*:} \
        --json "$OUT/throughput-$name.json" > "$OUT/throughput-$name.log" 2>&1 || status=1
done
$PY - "$OUT"/throughput-piecewise1024.json "$OUT"/throughput-full1024.json <<'EOF' || status=1
import json, os, sys

pieces, whole = (json.load(open(p))["runs"][0]["output_tokens_per_s"] if os.path.exists(p)
                 else float("nan") for p in sys.argv[1:])
print(f"mixed at 1,024 tokens a step, in order: whole graphs {whole:.0f} out tok/s, "
      f"piecewise {pieces:.0f} ({whole / pieces:.2f}x)")
EOF
fi

echo "== 6: HTTP serving on CUDA (bench serve, mixed-like load), against step 5's offline runs"
# The defaults (the engine loop in a process of its own since 2026-12-04), then the same with
# the loop in the server's thread (one GIL for both), each against the defaults' offline
# figure of step 5. Each server first takes a warm-up pass of other prompts (seed 1).
# fastapi/uvicorn/httpx come from gpu-wheels/ (scripts/gpu-wheels.sh, carried with the run),
# installed offline into a scratch directory; without it this step is skipped, not failed.
stop_server() {  # PID: TERM (its engine process stops with it), then KILL after 10 s, so
    # that a server slow to stop does not eat the budget
    kill "$1" 2> /dev/null
    timeout 10 tail --pid="$1" -f /dev/null || kill -9 "$1" 2> /dev/null
    wait "$1" 2> /dev/null
}
serve_bench() {  # name, offline json, extra serve flags...
    local name=$1 offline=$2 port=8321
    shift 2
    in_budget 60 "$name" || return 0
    PYTHONPATH="$PYTHONPATH:$server_site" $PY -m pagedserve.cli serve --model "$model" \
        --device cuda --dtype bfloat16 --port $port "$@" > "$OUT/$name.log" 2>&1 &
    local server=$!
    local ready_cap
    ready_cap=$(cap 120)
    if ! PYTHONPATH="$PYTHONPATH:$server_site" $PY scripts/wait_ready.py $port $server \
            "$ready_cap"; then
        # Still starting when the budget ended: cut short, as a command the budget stops.
        # Exited, or not ready within its own cap: a failure.
        if kill -0 "$server" 2> /dev/null && [ "$ready_cap" -lt 120 ]; then
            echo "cut short (the budget ended): $name's server start" \
                | tee -a "$OUT/cut-short.txt"
        else
            echo "FAILED: $name's server did not start (its log: $name.log)"
            status=1
        fi
        stop_server "$server"
        return 0
    fi
    # CPU seconds (utime + stime) of the server and, when split, its engine process (the
    # first child started); with --api-server-count, "server" sums the servers' processes.
    local engine servers spied
    engine=$(pgrep -P "$server" -f spawn_main | head -1)
    servers="$server $(pgrep -P "$server" -f spawn_main | tail -n +2 | tr '\n' ' ')"
    spied=$(echo $servers | awk '{print (NF > 1 ? $2 : $1)}')  # a server, not the supervisor
    cpu() {  # "PID ..." -> their CPU seconds together (0 for none)
        local pid files=()
        for pid in $1; do files+=("/proc/$pid/stat"); done
        [ ${#files[@]} -gt 0 ] && awk -v hz="$(getconf CLK_TCK)" '{t += ($14 + $15) / hz}
            END {print t}' "${files[@]}" || echo 0
    }
    steps() {  # the engine's steps so far (/metrics), for the tokens a step of a pass
        $PY - "$port" <<'EOF' 2> /dev/null || echo 0
import re, sys, urllib.request

text = urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/metrics", timeout=10).read()
print(sum(float(v) for v in re.findall(r"^pagedserve_engine_steps_total\{[^}]*\} (\S+)",
                                       text.decode(), re.M)))
EOF
    }
    # Seed 1: a warm-up pass, not kept; 0, 4 and 5: the measured passes (the offline run's
    # shape; their median against the median of step 5's three), each load sent by 4 client
    # processes (one Python client spends 40-60 us of this host's CPU a chunk: at ~16,000
    # tok/s it was as busy as the server); 3: such a load from one client process; 2: 256
    # prompts at the same concurrency, a longer pass, under py-spy (a server process, and
    # the engine process with its idle time), for where the host's time goes once the
    # start-up is a small part.
    local pass seed workers n spies pid
    for pass in 1:4 0:4 4:4 5:4 3:1 2:4; do
        seed=${pass%:*} workers=${pass#*:} n=64 spies=()
        in_budget 20 "$name, seed $seed" || break
        if [ $seed = 2 ]; then
            n=256
            for pid in $spied $engine; do  # the engine's idle time too: is it the limit?
                command -v py-spy > /dev/null || break
                py-spy record --pid "$pid" --rate 200 --duration 30 --nonblocking --threads \
                    $([ "$pid" = "$engine" ] && echo --idle) \
                    --format raw -o "$OUT/$name-spy-$pid.txt" > /dev/null 2>&1 &
                spies+=($!)
            done
            sleep 0.5
        fi
        echo "$(cpu "$servers") $(cpu "$engine")" > "$OUT/$name-seed$seed.cpu"
        steps > "$OUT/$name-seed$seed.steps"
        budgeted 90 env PYTHONPATH="$PYTHONPATH:$server_site" $PY -m pagedserve.cli \
            bench serve --base-url "http://127.0.0.1:$port" --dataset random \
            --num-prompts $n --input-len 288 --range-ratio 0.77 --output-len 128 \
            --ignore-eos --vocab-size 32000 --max-concurrency 64 --seed $seed \
            --num-workers "$workers" \
            --json "$OUT/$name-seed$seed.json" > "$OUT/$name-bench-seed$seed.log" 2>&1 \
            || status=1
        echo "$(cpu "$servers") $(cpu "$engine")" >> "$OUT/$name-seed$seed.cpu"
        steps >> "$OUT/$name-seed$seed.steps"
        # Stopped as the pass ends (py-spy writes its stacks on SIGINT): an idle tail
        # would count as the engine's idle time.
        for pid in ${spies[@]+"${spies[@]}"}; do
            kill -INT "$pid" 2> /dev/null || true
            wait "$pid" || true
        done
    done
    cp "$OUT/$name-seed0.json" "$OUT/$name.json" && tail -n 25 "$OUT/$name-bench-seed0.log"
    stop_server "$server"
    $PY - "$offline" "$OUT/$name" "$spied" "$engine" <<'EOF' || status=1
import collections, json, os, re, statistics, sys

stem = sys.argv[2]
# (step 5's offline run may have failed or not run: the HTTP figures still print)
run = json.load(open(sys.argv[1]))["runs"][0] if os.path.exists(sys.argv[1]) else {}
a = run.get("output_tokens_per_s", float("nan"))
offline_per_step = (f"{run['output_tokens'] / max(run['stats']['steps'], 1):.1f}"
                    if run else "?")
measured = [json.load(open(p))["output_throughput"] for p in
            (f"{stem}-seed{seed}.json" for seed in (0, 4, 5)) if os.path.exists(p)]
if measured:
    m = statistics.median_low(measured)
    print(f"{os.path.basename(stem)}: HTTP/offline {m / a:.2f} (target >= 0.85), the median "
          f"of {len(measured)} HTTP passes ({', '.join(f'{x:.0f}' for x in measured)} out "
          f"tok/s) against the median of step 5's {len(run.get('repeats', []))} "
          f"({', '.join(f'{x:.0f}' for x in run.get('repeats', []))})")
for seed, what in ((0, "seed 0"), (4, "seed 4"), (5, "seed 5"), (3, "one client process"),
                   (2, "256 prompts")):
    if not os.path.exists(f"{stem}-seed{seed}.json"):
        print(f"{os.path.basename(stem)} ({what}): not run (the budget ended)")
        continue
    http = json.load(open(f"{stem}-seed{seed}.json"))
    (s0, e0), (s1, e1) = (map(float, line.split()) for line in open(f"{stem}-seed{seed}.cpu"))
    b, n = http["output_throughput"], max(http["total_output_tokens"], 1)
    # Output tokens a step: fewer over HTTP than offline where the requests reach the engine
    # over the server's intake (the steps then carry fewer sequences).
    steps = [float(x) for x in open(f"{stem}-seed{seed}.steps").read().split()]
    per_step = f"{n / (steps[1] - steps[0]):.1f}" if len(steps) == 2 and steps[1] > steps[0] \
        else "?"
    print(f"{os.path.basename(stem)} ({what}): HTTP {b:.0f} out tok/s ({http['completed']} "
          f"completed, {http['failed']} failed, {http['duration_s']:.2f} s), offline {a:.0f}: "
          f"{b / a:.2f}; CPU a token: server "
          f"{(s1 - s0) / n * 1e6:.1f} us, engine process {(e1 - e0) / n * 1e6:.1f} us, "
          f"client {http['client_cpu_s'] / n * 1e6:.1f} us; output tokens a step: HTTP "
          f"{per_step}, offline {offline_per_step}")
# Where the engine process's time goes: each sample counts in the first of these parts whose
# pattern its stack matches: waiting for commands (idle: nothing to run), reading them,
# waiting for the GPU (a step's tokens read back, with their copy), appending them, the
# forward's launches, sampling's, scheduling, the deltas, and the events pickled and
# written. If idle and GPU wait are small, the engine process's host work is what HTTP
# waits for.
PARTS = {"idle": r"PipeInbox\.take [^;]*;wait \(multiprocessing", "commands": r"PipeInbox\.take",
         "GPU wait": r"\.to_host \(", "settle": r"\._settle \(", "forward": r"\.execute \(",
         "sampling": r"\._launch_sampling \(", "schedule": r"Scheduler\.schedule \(",
         "outputs": r"\.take_outputs \(",
         "events": r"EngineLoop\.(_flush|_deliver|_take_events) \(|EventPipes\.emit \("}
for pid, role in ((sys.argv[3], "server"), (sys.argv[4], "engine process")):
    leaves, threads, parts = collections.Counter(), collections.Counter(), collections.Counter()
    path = f"{stem}-spy-{pid}.txt"
    for line in open(path) if pid and os.path.exists(path) else []:
        stack, _, count = line.rstrip().rpartition(" ")
        frames = stack.split(";")
        leaves[frames[-1]] += int(count)
        threads[frames[0]] += int(count)
        for part, pattern in PARTS.items() if role != "server" else ():
            if re.search(pattern, stack):
                parts[part] += int(count)
                break
    total = sum(leaves.values())
    if total:
        kind = "samples, idle ones too," if parts else "busy samples"
        print(f"py-spy, {role}: {total} {kind} at 200 Hz; threads: "
              + ", ".join(f"{t} {c / total:.0%}" for t, c in threads.most_common(4)))
        if parts:
            print("  by part: " + ", ".join(f"{p} {parts[p] / total:.0%}" for p in PARTS)
                  + f", other {1 - sum(parts.values()) / total:.0%}")
        for leaf, c in leaves.most_common(12):
            print(f"  {c / total:6.1%}  {leaf}")
# Any request failed in any pass: the run fails (bench serve exits 0 if one completed).
failed = sum(json.load(open(f"{stem}-seed{seed}.json"))["failed"] for seed in (0, 2, 3, 4, 5)
             if os.path.exists(f"{stem}-seed{seed}.json"))
sys.exit(0 if failed == 0 else 1)
EOF
}
# (the server's own modules: a package they need and the wheels lack shows here, not as
# servers that die at start-up)
if PYTHONPATH="$PYTHONPATH:$server_site" $PY -c "import pagedserve.server.app, httpx"; then
    # In order of need (a run the budget cuts short loses the last): the defaults, then the
    # candidate defaults together, then each alone.
    serve_bench serve "$OUT/throughput.json"
    skipped 6af || serve_bench serve-api4-full "$OUT/throughput.json" --api-server-count 4 \
        --full-graphs
    skipped 6f || serve_bench serve-full "$OUT/throughput.json" --full-graphs
    skipped 6a || serve_bench serve-api4 "$OUT/throughput.json" --api-server-count 4
    skipped 6i || serve_bench serve-interval4 "$OUT/throughput.json" --stream-interval 4
    skipped 6t || serve_bench serve-thread "$OUT/throughput.json" --no-frontend-multiprocessing
else
    echo "skipped: no gpu-wheels/ (run scripts/gpu-wheels.sh and carry it)"
fi

echo "== 7: the kernel benchmarks, and the eager basic engine's throughput (the old default)"
if ! skipped 7 && in_budget 45 "step 7"; then
budgeted 90 $PY scripts/bench_triton_kernels.py --json "$OUT/kernels.json" \
    2>&1 | tee "$OUT/kernels.log" || status=1
budgeted 60 $PY -m pagedserve.cli bench throughput --model "$model" --device cuda \
    --dtype bfloat16 --workload mixed --triton-attention basic --enforce-eager \
    --no-async-scheduling --max-num-batched-tokens 1024 --json "$OUT/throughput-basic.json" \
    > "$OUT/throughput-basic.log" 2>&1 || status=1
grep -E "output tok|tok/s" "$OUT/throughput-basic.log" | tail -3
fi

[ -f "$OUT/cut-short.txt" ] && cat "$OUT/cut-short.txt"  # (a step's own log may hold it)
echo "== gpu-check: $([ $status = 0 ] && echo passed || echo FAILED) in ${SECONDS} s"
exit $status
