"""Every execution path gives the same tokens (docs/design.md §3.8): whole prefill, token by
token, chunked prefill, a prefix-cache hit, preempted and resumed, batched with others.
Run on a tiny random-weight Llama loaded from safetensors, in fp32."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from engine_utils import (
    greedy,
    hf_logprobs,
    make_engine,
    prompts_of_lengths,
    random_prompts,
    run,
)

import pagedserve.paging.block_manager as block_manager_module
from pagedserve.engine import SamplingParams
from pagedserve.engine.device_setup import default_block_size, default_max_num_batched_tokens
from pagedserve.kernels import REFERENCE, reference

# Lengths around block boundaries (block_size 16): 1 block - 1, 3 blocks + 1, 4, and odd.
PROMPTS = prompts_of_lengths([15, 49, 64, 70], seed=1)
STEPS = 16


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def baseline(tiny_llama) -> list[list[int]]:
    """Each prompt alone: its whole prompt in one prefill, then one decode per token."""
    return [tokens(run(make_engine(tiny_llama), [p], greedy(STEPS)))[0] for p in PROMPTS]


def test_baseline_equals_full_forward(tiny_llama_dir, baseline):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    for prompt, toks in zip(PROMPTS, baseline, strict=True):
        assert hf_logprobs(hf, prompt, toks).argmax(-1).tolist() == toks


@pytest.mark.parametrize("chunk", [1, 5, 16, 23, 64])
def test_chunked_prefill(tiny_llama, baseline, chunk):
    """chunk=1 computes the prompt token by token; 5 and 23 cut across block boundaries."""
    engine = make_engine(tiny_llama, max_num_batched_tokens=chunk)
    assert tokens(run(engine, PROMPTS, greedy(STEPS))) == baseline
    assert engine.stats()["prefill_tokens_computed"] == sum(len(p) for p in PROMPTS)


def test_prefix_cache_hit(tiny_llama, baseline):
    engine = make_engine(tiny_llama)
    assert tokens(run(engine, PROMPTS, greedy(STEPS))) == baseline
    before = engine.stats()
    assert tokens(run(engine, PROMPTS, greedy(STEPS))) == baseline
    after = engine.stats()
    hits = after["prefix_cache_hit_tokens"] - before["prefix_cache_hit_tokens"]
    assert hits == sum((len(p) - 1) // 16 * 16 for p in PROMPTS)
    computed = after["prefill_tokens_computed"] - before["prefill_tokens_computed"]
    assert computed == sum(len(p) for p in PROMPTS) - hits

    # A new prompt sharing the first 48 tokens of another hits 3 blocks.
    longest = max(PROMPTS, key=len)
    assert len(longest) > 48
    shared = longest[:48] + [777, 778, 779, 780, 781]
    alone = tokens(run(make_engine(tiny_llama, enable_prefix_caching=False),
                       [shared], greedy(STEPS)))
    before = engine.stats()["prefix_cache_hit_tokens"]
    assert tokens(run(engine, [shared], greedy(STEPS))) == alone
    assert engine.stats()["prefix_cache_hit_tokens"] - before == 48


def test_preempted_and_resumed(tiny_llama, baseline):
    # 4 sequences of up to 86 tokens need 2 + 5 + 5 + 6 blocks; the pool has 9.
    engine = make_engine(tiny_llama, num_kv_blocks=9)
    assert tokens(run(engine, PROMPTS, greedy(STEPS))) == baseline
    assert engine.stats()["preemptions"] > 0


def test_preempted_without_prefix_cache(tiny_llama, baseline):
    engine = make_engine(tiny_llama, num_kv_blocks=9, enable_prefix_caching=False)
    assert tokens(run(engine, PROMPTS, greedy(STEPS))) == baseline
    stats = engine.stats()
    assert stats["preemptions"] > 0
    # No cache, no query: a dashboard's hit rate would read 0% of every prompt (vLLM counts
    # none either).
    assert stats["prefix_cache_queried_tokens"] == stats["prefix_cache_hit_tokens"] == 0


@pytest.mark.parametrize("block_size", [8, 32])
def test_other_block_sizes(tiny_llama, baseline, block_size):
    """Other block sizes (32 is a CPU engine's default) give the baseline's tokens, chunked
    across their boundaries and preempted: the pool holds 160 tokens, the four sequences
    need 262."""
    engine = make_engine(tiny_llama, block_size=block_size, num_kv_blocks=160 // block_size,
                         max_num_batched_tokens=23)
    assert tokens(run(engine, PROMPTS, greedy(STEPS))) == baseline
    assert engine.stats()["preemptions"] > 0


def test_default_block_size_and_token_budget_follow_the_device(tiny_llama):
    """And on CPU the step runs eagerly and in order (graphs, pieces and async scheduling
    are CUDA's defaults)."""
    engine = make_engine(tiny_llama, block_size=None)
    assert engine.block_manager.block_size == 32
    assert engine.scheduler.config.max_num_batched_tokens == 1024
    assert engine.runner.graphs is None and engine.runner.pieces is None
    assert not engine.async_scheduling
    assert default_block_size(torch.device("cuda")) == 16
    assert default_max_num_batched_tokens(torch.device("cuda")) == 8192


def test_batched_with_other_requests(tiny_llama, baseline):
    others = random_prompts(12, 5, 120, seed=2)
    params = [greedy(STEPS)] * len(PROMPTS) + [greedy(1 + i % 7) for i in range(len(others))]
    outs = run(make_engine(tiny_llama, max_num_batched_tokens=96), PROMPTS + others, params)
    assert tokens(outs[: len(PROMPTS)]) == baseline


def test_sampling_is_path_independent(tiny_llama):
    """With a seed, random samples also match across chunking and preemption: a sample's
    stream advances once per emitted token, never for a discarded chunk."""
    params = SamplingParams(temperature=1.0, top_k=50, max_tokens=STEPS, seed=7, ignore_eos=True)
    whole = tokens(run(make_engine(tiny_llama), PROMPTS, params))
    chunked = tokens(run(make_engine(tiny_llama, max_num_batched_tokens=7), PROMPTS, params))
    preempted = tokens(run(make_engine(tiny_llama, num_kv_blocks=9), PROMPTS, params))
    assert whole == chunked == preempted


def test_identical_prompts_in_one_step_share_blocks(tiny_llama):
    prompt = random_prompts(1, 100, 100, seed=3)[0]
    engine = make_engine(tiny_llama)
    outs = run(engine, [prompt, prompt], greedy(4))
    assert tokens(outs)[0] == tokens(outs)[1]
    stats = engine.stats()
    # The second copy waits one step and hits the first one's 6 full blocks.
    assert stats["prefix_cache_hit_tokens"] == 96
    assert stats["prefill_tokens_computed"] == 100 + 4
    assert stats["peak_kv_blocks_used"] <= 7 + 1


def _broken_prefill(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale,
                    max_query_len=None, out=None):
    """A classic chunking bug: the causal mask counts query positions from the start of
    the chunk instead of from the start of the sequence."""
    out = torch.empty_like(q) if out is None else out
    starts = cu_seqlens_q.tolist()
    for i, ctx in enumerate(context_lens.tolist()):
        lo, hi = starts[i], starts[i + 1]
        keys = torch.stack(reference.gather_heads(k_cache, block_tables[i]))[:, :ctx]
        values = torch.stack(reference.gather_heads(v_cache, block_tables[i]))[:, :ctx]
        mask = torch.arange(ctx)[None, :] <= torch.arange(hi - lo)[:, None]  # the bug
        out[lo:hi] = F.scaled_dot_product_attention(
            q[lo:hi].transpose(0, 1), keys, values, attn_mask=mask, scale=scale,
            enable_gqa=True).transpose(0, 1)
    return out


def test_broken_chunk_mask_is_caught(tiny_llama, baseline):
    """Test the test: the bug is invisible when a prompt is prefilled whole (the chunk
    starts at 0), and the chunked-equivalence check exposes it."""
    broken = dataclasses.replace(REFERENCE, paged_prefill_attention=_broken_prefill)
    whole = run(make_engine(tiny_llama, kernels=broken), PROMPTS, greedy(STEPS))
    assert tokens(whole) == baseline
    chunked = run(make_engine(tiny_llama, kernels=broken, max_num_batched_tokens=16),
                  PROMPTS, greedy(STEPS, logprobs=1))
    assert tokens(chunked) != baseline
    # The deviation is gross, not a rounding effect: compare the first token's logprob.
    good = run(make_engine(tiny_llama, max_num_batched_tokens=16), PROMPTS,
               greedy(STEPS, logprobs=1))
    deviation = max(abs(b.outputs[0].logprobs[0].logprob - g.outputs[0].logprobs[0].logprob)
                    for b, g in zip(chunked, good, strict=True))
    assert deviation > 0.05


def test_a_waiting_prompt_hashes_its_prefix_once(tiny_llama, monkeypatch):
    """A prompt that hits the prefix cache but finds no room waits, and is matched again
    every step: its blocks' chain hashes are computed once while it waits, not once a
    step, and it then gets the same tokens as with room to spare."""
    first = random_prompts(1, 96, 96, seed=5)[0]
    second = first[:48] + random_prompts(1, 80, 80, seed=6)[0]  # 3 blocks to hit, 5 more
    params = [greedy(60), greedy(16)]
    roomy = tokens(run(make_engine(tiny_llama), [first, second], params))

    calls = []
    hash_blocks = block_manager_module.chain_hash
    monkeypatch.setattr(block_manager_module, "chain_hash",
                        lambda parent, ids: calls.append(1) or hash_blocks(parent, ids))
    # 10 blocks: the first request holds 7, then all 10, while the second waits for 5 more.
    engine = make_engine(tiny_llama, num_kv_blocks=10)
    assert tokens(run(engine, [first, second], params)) == roomy
    stats = engine.stats()
    assert stats["prefix_cache_hit_tokens"] == 48 and stats["preemptions"] == 0
    # Each full block a request computes is hashed once to be cached (9 + 6), and the
    # second prompt's leading 4 once more to match them while it waits (a step: ~240).
    assert len(calls) <= 9 + 6 + 4
