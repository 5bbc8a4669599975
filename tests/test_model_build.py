"""How the engine builds its model: weights materialized from the meta device, the RoPE
tables computed after, in float32 whatever the model's dtype."""

import subprocess
import sys

import torch
from engine_utils import make_engine

from pagedserve.kernels import REFERENCE
from pagedserve.models.llama import RotaryEmbedding


def test_fp16_model_keeps_float32_rope_tables_equal_to_an_eager_build(embedded):
    # float16, not bfloat16: bf16 on CPU packs the weights, which needs AVX-512 here.
    engine = make_engine(embedded, REFERENCE, dtype="float16", num_kv_blocks=8)
    rope = engine.model.rope
    eager = RotaryEmbedding(embedded.config, engine.max_model_len, REFERENCE)
    assert rope.cos.dtype == rope.sin.dtype == torch.float32
    assert torch.equal(rope.cos, eager.cos) and torch.equal(rope.sin, eager.sin)
    assert engine.model.embed_tokens.weight.dtype == torch.float16
    # Every module reads the set it was built with.
    assert all(m.kernels is REFERENCE for m in engine.model.modules() if hasattr(m, "kernels"))
    assert sum(hasattr(m, "kernels") for m in engine.model.modules()) > 3


def test_a_cpu_engine_starts_and_runs_without_torchs_compiler_stack(tiny_llama_dir):
    """Building the model on the meta device and giving it memory must not pull in
    torch._dynamo (with triton) or sympy: a random init of a meta embedding, and to_empty(),
    imported them, seconds of every start of `serve` and `generate`."""
    script = f"""
import sys
from pagedserve.engine import SamplingParams
from pagedserve.engine.llm import LLM
llm = LLM({str(tiny_llama_dir)!r}, dtype="float32", num_kv_blocks=16)
llm.generate(["Hello"], SamplingParams(max_tokens=2, temperature=0))
print(sorted(m for m in ("torch._dynamo", "triton", "sympy") if m in sys.modules))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"
