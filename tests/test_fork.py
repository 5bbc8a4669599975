"""Prefill-then-fork (docs/design.md §5): n samples share one prefill and one copy of the
prompt's KV, and each equals an independent run on the same random stream."""

import pytest
from engine_utils import make_engine, prompts_of_lengths, run

from pagedserve.engine import SamplingParams

N = 8
PROMPT = prompts_of_lengths([1000], seed=11)[0]  # 62 full blocks + 8 tokens


def params(n: int, seed: int) -> SamplingParams:
    return SamplingParams(n=n, temperature=0.8, top_p=0.95, seed=seed, max_tokens=8,
                          ignore_eos=True)


@pytest.mark.slow
def test_fork_shares_prefill_and_blocks_and_matches_independent_runs(embedded):
    engine = make_engine(embedded, num_kv_blocks=600, max_num_batched_tokens=1024)
    [forked] = run(engine, [PROMPT], params(N, seed=5))
    stats = engine.stats()
    assert [o.index for o in forked.outputs] == list(range(N))
    # Prefilled once: the prompt, not 8x the prompt.
    assert stats["prefill_tokens_computed"] == len(PROMPT)
    # Stored once: 63 prompt blocks, plus one copy of the shared partial block for each
    # of the 7 samples that wrote into it first (the 8th writes in place).
    prompt_blocks = -(-len(PROMPT) // 16)
    assert stats["peak_kv_blocks_used"] == prompt_blocks + N - 1

    # Sample i of seed s is an independent n=1 request with seed s + i. (A fresh engine;
    # its prefix cache spares 7 of the 8 prefills, and cache hits are proven exact in
    # test_equivalence.)
    engine = make_engine(embedded, num_kv_blocks=600)
    for i, sample in enumerate(forked.outputs):
        [alone] = run(engine, [PROMPT], params(1, seed=5 + i))
        assert alone.outputs[0].token_ids == sample.token_ids, i
    # The samples really are random: not all identical.
    assert len({tuple(o.token_ids) for o in forked.outputs}) > 1


def test_fork_on_tiny_model_counts(tiny_llama):
    """Fork with a prompt that ends on a block boundary: nothing to copy-on-write."""
    prompt = prompts_of_lengths([64], seed=3)[0]
    engine = make_engine(tiny_llama)
    [out] = run(engine, [prompt], params(4, seed=1))
    stats = engine.stats()
    assert stats["prefill_tokens_computed"] == 64
    assert stats["peak_kv_blocks_used"] == 4 + 4  # the prompt once, one new block each
    assert len(out.outputs) == 4 and all(len(o.token_ids) == 8 for o in out.outputs)


@pytest.mark.parametrize("prefix_caching,async_scheduling", [(True, False), (False, True)])
def test_forks_take_seats_and_a_wider_group_waits(tiny_llama, prefix_caching, async_scheduling):
    """At most max_num_seqs samples run: a request takes a seat for each sample it will fork
    (128 requests of n=128 sampled 16,384 rows in one step, 20 GB of a CPU's memory), and a
    group wider than max_num_seqs runs alone, the samples without a seat prefilling again
    later. Every sample equals its run where seats are plenty."""
    prompts = prompts_of_lengths([40, 33, 57, 21], seed=4)
    sampling = [params(3, seed=1), params(4, seed=2), params(9, seed=3), params(2, seed=4)]
    peaks = []
    outputs = []
    for max_num_seqs in (64, 6):
        engine = make_engine(tiny_llama, max_num_seqs=max_num_seqs,
                             enable_prefix_caching=prefix_caching,
                             async_scheduling=async_scheduling)
        fork, widest = engine.scheduler.fork, [0]

        def counted_fork(batch, fork=fork, engine=engine, widest=widest):
            pairs = fork(batch)
            widest[0] = max(widest[0], len(batch.seqs))  # the rows sampled
            return pairs

        engine.scheduler.fork = counted_fork
        outputs.append(run(engine, prompts, sampling))
        peaks.append(widest[0])
    assert peaks[0] == 3 + 4 + 9 + 2  # (the check sees the forks)
    assert peaks[1] == 6
    wide, narrow = ([[o.token_ids for o in out.outputs] for out in run_] for run_ in outputs)
    assert narrow == wide
    assert [len(o) for o in narrow] == [3, 4, 9, 2]
