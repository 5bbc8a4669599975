#!/usr/bin/env bash
# The checks that need a CUDA GPU, as one run (a borrowed GPU machine has minutes, not hours):
#   1. every Triton kernel compiled, against its PyTorch reference (attention, cache ops and
#      the fused RMSNorm/RoPE/SwiGLU), and the Triton set driving the engine
#      (tests/test_triton_kernels.py, test_triton_elementwise.py; on CUDA when
#      TRITON_INTERPRET=0);
#   2. the engine end to end on CUDA, random weights of Qwen2.5-0.5B's shapes, against HF
#      transformers; chunked, preempted and forked runs; CUDA graphs against eager, on both
#      attention sets (tests/test_gpu_engine.py, `gpu`);
#   3. one decode step (64 sequences x ~300 tokens, bf16): wall time, GPU-busy time and
#      launches, for eager basic, eager flash, and flash replayed as CUDA graphs
#      (scripts/profile_step.py);
#   4. the kernels against this GPU's memory bandwidth, decode with and without split-KV,
#      prefill against torch SDPA (scripts/bench_triton_kernels.py);
#   5. offline throughput on CUDA, the engine and HF transformers in the same run, then the
#      engine with --triton-attention flash --no-enforce-eager;
#   6. `pagedserve serve --device cuda` over HTTP, loaded by `pagedserve bench serve`, against
#      step 5's offline figure (needs gpu-wheels/: scripts/gpu-wheels.sh).
# Uses what the machine has (torch, triton, transformers, tokenizers, safetensors, xxhash,
# jinja2, numpy, pytest with pytest-timeout); needs no network and no embedded model.
# Results and logs go to $OUT (default: gpu-check-out/). Exit status: 0 when all passed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-check-out}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export TRITON_INTERPRET=0 PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
status=0
# The whole run must end within 9 minutes on an H200: each step's timeout is its own cap or
# what is left of the budget, whichever is less (SECONDS counts from the script's start).
BUDGET=${GPU_CHECK_BUDGET_S:-520}
cap() { local left=$((BUDGET - SECONDS)); echo $(( left < $1 ? (left > 1 ? left : 1) : $1 )); }

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
$PY -c "import torch, triton, transformers as t; print('torch', torch.__version__,
'triton', triton.__version__, 'transformers', t.__version__)" | tee -a "$OUT/gpu.txt"

echo "== 1-2: Triton kernels and the engine on CUDA"
# Not tests/test_triton_compile.py: it is for hosts without a GPU; here every kernel
# compiles for real when the tests launch it, so it would only cost minutes of ptxas.
timeout "$(cap 300)" $PY -m pytest -q -p no:cacheprovider tests/test_triton_kernels.py \
    tests/test_triton_elementwise.py tests/test_gpu_engine.py --junitxml="$OUT/pytest.xml" \
    2>&1 | tee "$OUT/pytest.log" || status=1

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

echo "== 3: one decode step, 64 sequences x ~300 tokens (target: <= 4 ms)"
for variant in "basic --enforce-eager" "flash --enforce-eager" "flash --no-enforce-eager"; do
    set -- $variant
    name="step-$1${2#--}"
    timeout "$(cap 60)" $PY scripts/profile_step.py --model "$model" --device cuda \
        --dtype bfloat16 --seqs 64 --context 300 --triton-attention "$1" "$2" \
        --json "$OUT/$name.json" 2>&1 | tee "$OUT/$name.log" || status=1
done

echo "== 4: kernels against memory bandwidth"
timeout "$(cap 80)" $PY scripts/bench_triton_kernels.py --json "$OUT/kernels.json" \
    2>&1 | tee "$OUT/kernels.log" || status=1

echo "== 5: offline throughput on CUDA (mixed workload), engine and HF transformers"
timeout "$(cap 150)" $PY -m pagedserve.cli bench throughput --model "$model" --device cuda \
    --dtype bfloat16 --workload mixed --baseline hf --hf-batch-sizes 32 \
    --json "$OUT/throughput.json" 2>&1 | tee "$OUT/throughput.log" || status=1

# The same workload on the new kernels replayed as CUDA graphs: the engine's defaults once
# this and the tests above pass.
timeout "$(cap 90)" $PY -m pagedserve.cli bench throughput --model "$model" --device cuda \
    --dtype bfloat16 --workload mixed --triton-attention flash --no-enforce-eager \
    --json "$OUT/throughput-flash-graphs.json" 2>&1 | tee "$OUT/throughput-flash-graphs.log" \
    || status=1

echo "== 6: HTTP serving on CUDA (bench serve, mixed-like load), against step 5's offline run"
# fastapi/uvicorn/httpx come from gpu-wheels/ (scripts/gpu-wheels.sh, carried with the run),
# installed offline into a scratch directory; without it this step is skipped, not failed.
if [ -d gpu-wheels ] && site=$(mktemp -d) && $PY -m pip install -q --no-index \
        --find-links gpu-wheels --target "$site" fastapi uvicorn httpx prometheus-client; then
    port=8321
    PYTHONPATH="$PYTHONPATH:$site" $PY -m pagedserve.cli serve --model "$model" \
        --device cuda --dtype bfloat16 --port $port > "$OUT/serve.log" 2>&1 &
    server=$!
    $PY - $port <<'EOF'  # wait for /health: the model loads and the server starts
import sys, time, urllib.request

for _ in range(120):
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/health", timeout=2)
        break
    except OSError:
        time.sleep(1)
EOF
    PYTHONPATH="$PYTHONPATH:$site" timeout "$(cap 90)" $PY -m pagedserve.cli bench serve \
        --base-url "http://127.0.0.1:$port" --dataset random --num-prompts 64 \
        --input-len 288 --range-ratio 0.77 --output-len 128 --ignore-eos \
        --vocab-size 32000 --max-concurrency 64 --json "$OUT/serve.json" 2>&1 \
        | tee "$OUT/serve-bench.log" || status=1
    kill "$server"; wait "$server"
    $PY - "$OUT/throughput.json" "$OUT/serve.json" <<'EOF' || status=1
import json, sys

offline, http = (json.load(open(p)) for p in sys.argv[1:])
a, b = offline["runs"][0]["output_tokens_per_s"], http["output_throughput"]
print(f"offline {a:.0f} out tok/s, HTTP {b:.0f} out tok/s ({http['completed']} completed, "
      f"{http['failed']} failed): HTTP/offline {b / a:.2f} (target >= 0.85)")
sys.exit(0 if http["failed"] == 0 else 1)
EOF
else
    echo "skipped: no gpu-wheels/ (run scripts/gpu-wheels.sh and carry it)"
fi

echo "== gpu-check: $([ $status = 0 ] && echo passed || echo FAILED)"
exit $status
