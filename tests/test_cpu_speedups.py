"""The CPU fast paths change speed, never results."""

import torch
from engine_utils import make_engine, run
from torch import nn

from pagedserve.engine import SamplingParams
from pagedserve.models.llama import PackedLinear


def test_packed_linear_is_bit_identical_to_linear():
    torch.manual_seed(0)
    linear = nn.Linear(64, 96).to(torch.bfloat16)
    packed = PackedLinear(linear)
    for rows in (1, 5, 64, 130):
        x = torch.randn(rows, 64, dtype=torch.bfloat16)
        assert torch.equal(packed(x), linear(x))


def test_bf16_engine_with_packed_weights_answers(embedded):
    engine = make_engine(embedded, dtype="bfloat16")
    assert any(isinstance(m, PackedLinear) for m in engine.model.modules())
    text = embedded.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}])
    ids = embedded.tokenizer.encode(text, add_special_tokens=False)
    [out] = run(engine, [ids], SamplingParams(temperature=0, max_tokens=12))
    assert "Paris" in out.outputs[0].text
