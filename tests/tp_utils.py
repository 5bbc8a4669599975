"""Shared by the tensor-parallel tests: tiny random checkpoints whose heads split in the
ways TP must handle, and comparisons of one run against another."""

from pathlib import Path

from engine_utils import save_random_hf

from pagedserve.engine import RequestOutput

ATOL = 1e-4  # float32: TP only reorders the sums of the all-reduces


def tiny_llama(path: Path, heads: int, kv_heads: int, vocab: int, tied: bool,
               biases: bool = False) -> Path:
    """A 2-layer random Llama (head_dim 16) with a word-level tokenizer ("t0".."t{vocab-1}");
    with biases, on every projection (attention_bias and mlp_bias)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab, hidden_size=16 * heads, intermediate_size=32 * heads,
        num_hidden_layers=2, num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=1024, tie_word_embeddings=tied, eos_token_id=2, bos_token_id=1,
        attention_bias=biases, mlp_bias=biases)
    save_random_hf(path, LlamaForCausalLM, config)
    return path


def assert_same(got: list[RequestOutput], want: list[RequestOutput]) -> None:
    """Same tokens for every sample; the same logprobs (chosen and top) within ATOL."""
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert [o.token_ids for o in g.outputs] == [o.token_ids for o in w.outputs]
        for go, wo in zip(g.outputs, w.outputs, strict=True):
            for step, (a, b) in enumerate(zip(go.logprobs or [], wo.logprobs or [], strict=True)):
                assert abs(a.logprob - b.logprob) < ATOL, step
                assert [t for t, _ in a.top] == [t for t, _ in b.top], step
                for (_, x), (_, y) in zip(a.top, b.top, strict=True):
                    assert abs(x - y) < ATOL, step
