"""Decode steps on persistent, padded buffers (engine/cuda_graphs.py) give the tokens and
logprobs of the plain eager path. Here on CPU, where the same path runs uncaptured; on a GPU
tests/test_gpu_engine.py checks the captured graphs the same way (scripts/gpu-check.sh).

Batches are shaped so that decode batches cross the ladder's sizes (padding rows in play),
sequences finish at different steps (the batch shrinks and re-pads), prefills are chunked
and mixed with decodes (those steps run eagerly), the pool is small enough to preempt, and
forks share blocks copied on write."""

import pytest
from engine_utils import greedy, make_engine, prompts_of_lengths, random_prompts, run

from pagedserve.engine import OutputCollector, SamplingParams
from pagedserve.engine.cuda_graphs import batch_size_ladder

PROMPTS = prompts_of_lengths([15, 49, 64, 70, 3], seed=11)
OTHERS = random_prompts(9, 5, 60, seed=12)


def test_batch_size_ladder() -> None:
    assert batch_size_ladder(128) == [1, 2, 4, 8, *range(16, 129, 16)]
    assert batch_size_ladder(20) == [1, 2, 4, 8, 16, 20]
    assert batch_size_ladder(3) == [1, 2, 3]
    assert batch_size_ladder(1) == [1]


def _outputs(loaded, params, prompts, kernels=None, **config) -> tuple[list, int]:
    """(each sample's (tokens, logprobs)), decode steps run on the graph path)."""
    engine = make_engine(loaded, kernels, **config)
    graph_steps = 0
    if engine.runner.graphs is not None:
        graphs, plain_run = engine.runner.graphs, engine.runner.graphs.run

        def counted(seqs, carried=None):
            nonlocal graph_steps
            graph_steps += 1
            return plain_run(seqs, carried)

        graphs.run = counted
    outs = run(engine, prompts, params)
    samples = [(s.token_ids, [lp.logprob for lp in s.logprobs or []])
               for o in outs for s in o.outputs]
    return samples, graph_steps


def _same(eager, graphs) -> None:
    for (tokens_e, logprobs_e), (tokens_g, logprobs_g) in zip(eager, graphs, strict=True):
        assert tokens_g == tokens_e
        # The padded batch may take another matmul blocking: equal up to fp32 rounding.
        assert logprobs_g == pytest.approx(logprobs_e, abs=1e-4)


@pytest.mark.parametrize(("config", "min_graph_steps"), [
    ({}, 10),  # whole prefills, then decode batches of 14 shrinking to 1 (padded to 16, 8...)
    ({"max_num_batched_tokens": 19}, 2),  # chunked prefills mixed with decodes: mostly eager
    ({"num_kv_blocks": 12}, 5),  # preempted and recomputed
    ({"max_num_seqs": 6}, 5),  # a ladder of 1, 2, 4, 6, and full batches of 6
], ids=["whole", "chunked", "preempted", "max-6-seqs"])
def test_graph_path_equals_eager(tiny_llama, config, min_graph_steps: int) -> None:
    prompts = PROMPTS + OTHERS
    params = [greedy(12, logprobs=1)] * len(PROMPTS) + [
        greedy(1 + i % 6, logprobs=1) for i in range(len(OTHERS))]
    eager, none = _outputs(tiny_llama, params, prompts, **config)
    graphs, steps = _outputs(tiny_llama, params, prompts, enforce_eager=False, **config)
    assert none == 0 and steps >= min_graph_steps
    _same(eager, graphs)


def test_forked_seeded_samples_on_graph_path(tiny_llama) -> None:
    """n=3 samples share the prompt's blocks, copied on write at the first decode; seeded
    random sampling reads the same logits on both paths."""
    params = SamplingParams(n=3, temperature=0.9, top_p=0.95, seed=5, max_tokens=10,
                            ignore_eos=True, logprobs=2)
    eager, _ = _outputs(tiny_llama, params, PROMPTS[:3])
    graphs, steps = _outputs(tiny_llama, params, PROMPTS[:3], enforce_eager=False)
    assert steps >= 9
    _same(eager, graphs)
    assert len({tuple(tokens) for tokens, _ in graphs[:3]}) > 1  # the samples do differ


def test_graph_path_with_triton_flash_kernels(tiny_llama) -> None:
    """The Triton "flash" set (here under the interpreter) on the padded path: its split-KV
    decode sizes partitions from the block tables' width, which the persistent buffers make
    as wide as the longest admissible sequence, so most partitions are empty."""
    import torch

    from pagedserve.kernels import kernels_for

    flash = kernels_for(torch.device("cuda"), torch.float32, triton_attention="flash")
    prompts, params = PROMPTS[:2], greedy(5, logprobs=1)
    eager, _ = _outputs(tiny_llama, params, prompts, kernels=flash)
    graphs, steps = _outputs(tiny_llama, params, prompts, kernels=flash, enforce_eager=False,
                             max_model_len=1024)
    assert steps >= 4
    _same(eager, graphs)


def test_graph_path_equals_eager_with_one_token_prompt_chunks(tiny_llama) -> None:
    """A budget of 2 and a pool of 8 one-token blocks: an urgent prompt goes in one token a
    step, its blocks taken from a decode that it preempts (dropped from the step, giving
    its token back to the budget), and a small prompt takes that token, behind the chunk.
    Each request's tokens are those it makes alone, on both paths."""
    def outputs(enforce_eager: bool, requests: list) -> dict[str, list[int]]:
        engine = make_engine(tiny_llama, block_size=1, num_kv_blocks=8,
                             max_num_batched_tokens=2, scheduling_policy="priority",
                             enforce_eager=enforce_eager)
        done, pending, step = {}, list(requests), 0
        collector = OutputCollector()
        while pending or engine.has_unfinished_requests():
            for request in [r for r in pending if r[3] <= step]:
                name, prompt, priority, _, max_tokens = request
                engine.add_request(prompt, greedy(max_tokens, priority=priority), name)
                pending.remove(request)
            for delta in engine.step():
                if (out := collector.add(delta)) is not None:
                    done[out.request_id] = out.outputs[0].token_ids
            step += 1
        assert engine.block_manager.num_used_blocks == 0
        return done

    # (name, prompt, priority, added at step, max_tokens)
    requests = [("decoding", [7], 5, 0, 8), ("urgent", list(range(20, 26)), 0, 1, 2),
                ("small", [9], 5, 1, 2)]
    alone = {r[0]: outputs(True, [(*r[:3], 0, r[4])])[r[0]] for r in requests}
    assert outputs(True, requests) == alone
    assert outputs(False, requests) == alone
