"""How the engine builds its model: weights materialized from the meta device, the RoPE
tables computed after, in float32 whatever the model's dtype."""

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
