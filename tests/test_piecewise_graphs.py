"""Steps with prefill chunks run piecewise on persistent, padded buffers
(engine/piecewise_graphs.py) give the tokens and logprobs of the plain eager path, and so
do they run whole (--full-graphs: attention over padded metadata too). Here on CPU, where
the same pieces run uncaptured; on a GPU tests/test_gpu_engine.py checks the captured
graphs (scripts/gpu-check.sh).

The batches mix chunked prompts with decodes at token counts between the ladder's sizes
(padding rows in play, whose K/V must go nowhere), preempt and recompute, fork with
copy-on-write and seeded sampling, and ask for prompt logprobs (rows other than each
sequence's last)."""

import pytest
import torch
from engine_utils import greedy, make_engine, prompts_of_lengths, random_prompts, run

from pagedserve.engine import SamplingParams
from pagedserve.engine.piecewise_graphs import MAX_TOKENS, takes_whole_graphs, token_ladder
from pagedserve.kernels import REFERENCE, kernels_for

PROMPTS = prompts_of_lengths([15, 49, 64, 70, 3], seed=21)
OTHERS = random_prompts(9, 5, 60, seed=22)


def test_token_ladder() -> None:
    assert token_ladder(1024) == [16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024]
    assert token_ladder(MAX_TOKENS)[-3:] == [1024, 1536, 2048]
    assert token_ladder(100) == [16, 24, 32, 48, 64, 96, 100]
    assert token_ladder(16) == [16]
    assert token_ladder(5) == [5]


def _outputs(loaded, params, prompts, kernels=None, **config) -> tuple[list, int, dict]:
    """(each sample's (tokens, logprobs, prompt logprobs)), the number of piecewise steps,
    the engine's stats)."""
    engine = make_engine(loaded, kernels, **config)
    if config.get("full_graphs"):  # not left off for want of kernels that take it
        assert engine.runner.pieces.whole
    steps = 0
    if engine.runner.pieces is not None:
        pieces, plain_forward = engine.runner.pieces, engine.runner.pieces.forward

        def counted(*args):
            nonlocal steps
            steps += 1
            return plain_forward(*args)

        pieces.forward = counted
    outs = run(engine, prompts, params)
    samples = [(s.token_ids, [lp.logprob for lp in s.logprobs or []],
                [lp.logprob for lp in o.prompt_logprobs[1:]] if o.prompt_logprobs else [])
               for o in outs for s in o.outputs]
    return samples, steps, engine.stats()


def _same(eager, pieces) -> None:
    for (tokens_e, lps_e, prompt_e), (tokens_p, lps_p, prompt_p) in zip(
            eager, pieces, strict=True):
        assert tokens_p == tokens_e
        # Padded rows may take another matmul blocking: equal up to fp32 rounding.
        assert lps_p == pytest.approx(lps_e, abs=1e-4)
        assert prompt_p == pytest.approx(prompt_e, abs=1e-4)


def _params() -> list[SamplingParams]:
    return [greedy(12, logprobs=1, prompt_logprobs=1 if i == 1 else None)
            for i in range(len(PROMPTS))] + [
        greedy(1 + i % 6, logprobs=1) for i in range(len(OTHERS))]


@pytest.mark.parametrize(("config", "min_steps"), [
    ({}, 1),  # whole prompts in one step, then decodes (graph path)
    ({"max_num_batched_tokens": 37}, 8),  # chunks of up to 37 tokens beside decodes
    ({"max_num_batched_tokens": 40, "num_kv_blocks": 12}, 8),  # preempted and recomputed
], ids=["whole", "chunked", "preempted"])
def test_piecewise_path_equals_eager(tiny_llama, config, min_steps: int) -> None:
    prompts = PROMPTS + OTHERS
    eager, none, _ = _outputs(tiny_llama, _params(), prompts, **config)
    pieces, steps, stats = _outputs(tiny_llama, _params(), prompts, enforce_eager=False,
                                    piecewise_graphs=True, **config)
    assert none == 0 and steps >= min_steps
    assert (stats["preemptions"] > 0) == ("num_kv_blocks" in config)
    _same(eager, pieces)


@pytest.mark.parametrize("family", ["qwen3", "qwen2-tied"])
def test_piecewise_path_on_other_families(family, embedded, tmp_path) -> None:
    """Qwen3's q/k norms inside the pieces; Qwen2's qkv bias and tied embeddings."""
    import transformers as tf
    from engine_utils import save_tiny_hf

    from pagedserve.models.loader import load_model_files

    tiny = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                eos_token_id=2, vocab_size=embedded.tokenizer.vocab_size)
    if family == "qwen3":
        cls, config = tf.Qwen3ForCausalLM, tf.Qwen3Config(head_dim=32, **tiny)
    else:
        cls, config = tf.Qwen2ForCausalLM, tf.Qwen2Config(tie_word_embeddings=True, **tiny)
    save_tiny_hf(tmp_path, cls, config, embedded.tokenizer)
    loaded = load_model_files(str(tmp_path), torch.float32)
    eager, _, _ = _outputs(loaded, greedy(6, logprobs=1), PROMPTS, max_num_batched_tokens=40)
    pieces, steps, _ = _outputs(loaded, greedy(6, logprobs=1), PROMPTS, enforce_eager=False,
                                piecewise_graphs=True, max_num_batched_tokens=40)
    assert steps >= 5
    _same(eager, pieces)


def test_forked_seeded_samples_on_piecewise_path(tiny_llama) -> None:
    """n=3 samples share the prompt's blocks, copied on write at the first decode."""
    params = SamplingParams(n=3, temperature=0.9, top_p=0.95, seed=5, max_tokens=10,
                            ignore_eos=True, logprobs=2)
    eager, _, _ = _outputs(tiny_llama, params, PROMPTS[:3], max_num_batched_tokens=24)
    pieces, steps, _ = _outputs(tiny_llama, params, PROMPTS[:3], enforce_eager=False,
                                piecewise_graphs=True, max_num_batched_tokens=24)
    assert steps >= 3
    _same(eager, pieces)
    assert len({tuple(tokens) for tokens, _, _ in pieces[:3]}) > 1  # the samples do differ


def test_padding_rows_write_no_kv(tiny_llama) -> None:
    """Steps of varying sizes pad up to the ladder's, so the padding rows' slots would be a
    past step's (live blocks) if they were not -1: the KV caches must end as the eager
    path's (same blocks, same schedule)."""
    def caches(**config) -> tuple[torch.Tensor, torch.Tensor]:
        engine = make_engine(tiny_llama, enable_prefix_caching=False,
                             max_num_batched_tokens=37, **config)
        run(engine, PROMPTS, greedy(6))
        return engine.runner.k_caches, engine.runner.v_caches

    (k_eager, v_eager), (k, v) = caches(), caches(enforce_eager=False, piecewise_graphs=True)
    assert k.count_nonzero() > 0
    torch.testing.assert_close(k, k_eager, rtol=0, atol=1e-5)
    torch.testing.assert_close(v, v_eager, rtol=0, atol=1e-5)


def test_piecewise_path_with_triton_flash_kernels(tiny_llama) -> None:
    """The Triton "flash" set (here under the interpreter): its RMSNorm, RoPE, store and
    SwiGLU inside the pieces, its attention between them on the persistent q buffer."""
    flash = kernels_for(torch.device("cuda"), torch.float32, triton_attention="flash")
    prompts, params = PROMPTS[:3], greedy(4, logprobs=1)
    eager, _, _ = _outputs(tiny_llama, params, prompts, kernels=flash,
                           max_num_batched_tokens=40)
    pieces, steps, _ = _outputs(tiny_llama, params, prompts, kernels=flash, enforce_eager=False,
                                piecewise_graphs=True, max_num_batched_tokens=40)
    assert steps >= 3
    _same(eager, pieces)


# Whole graphs: attention inside, over every sequence of the step in one padded list. The
# C++ kernels take no padding, so these run the references (and flash, interpreted); 6
# sequences at most leaves padding sequences in most steps.
WHOLE = {"enforce_eager": False, "piecewise_graphs": True, "full_graphs": True,
         "max_num_seqs": 6}


@pytest.mark.parametrize(("config", "min_steps"), [
    ({}, 2),  # whole prompts beside the decodes of the earlier ones
    ({"max_num_batched_tokens": 37}, 8),  # chunks of up to 37 tokens beside decodes
    ({"max_num_batched_tokens": 40, "num_kv_blocks": 12}, 8),  # preempted and recomputed
], ids=["whole", "chunked", "preempted"])
def test_whole_graph_path_equals_eager(tiny_llama, config, min_steps: int) -> None:
    prompts = PROMPTS + OTHERS
    eager, _, _ = _outputs(tiny_llama, _params(), prompts, kernels=REFERENCE,
                           max_num_seqs=6, **config)
    whole, steps, stats = _outputs(tiny_llama, _params(), prompts, kernels=REFERENCE,
                                   **WHOLE, **config)
    assert steps >= min_steps
    assert (stats["preemptions"] > 0) == ("num_kv_blocks" in config)
    _same(eager, whole)


def test_whole_graph_path_with_triton_flash_kernels(tiny_llama) -> None:
    """Interpreted: the flash kernel's flat grid over the padded sequences and rows, and a
    fork whose samples copy the prompt's last block on write."""
    flash = kernels_for(torch.device("cuda"), torch.float32, triton_attention="flash")
    params = [greedy(4, logprobs=1), SamplingParams(n=2, temperature=0.9, seed=3,
                                                    max_tokens=4, ignore_eos=True, logprobs=1)]
    prompts = PROMPTS[1:3]
    budget = {"max_num_batched_tokens": 40}
    eager, _, _ = _outputs(tiny_llama, params, prompts, kernels=flash, max_num_seqs=6,
                           **budget)
    whole, steps, _ = _outputs(tiny_llama, params, prompts, kernels=flash, **WHOLE, **budget)
    assert steps >= 3
    _same(eager, whole)


def test_full_graphs_need_kernels_that_take_padding(tiny_llama) -> None:
    """The C++ kernels read lengths on the host and refuse rows past the last chunk: with
    them --full-graphs is left off (piecewise graphs run), not an error."""
    engine = make_engine(tiny_llama, **WHOLE)
    assert engine.kernels.name not in ("triton-flash", "reference")
    assert engine.runner.pieces is not None and not engine.runner.pieces.whole
    engine = make_engine(tiny_llama, REFERENCE, **WHOLE)
    assert engine.runner.pieces.whole
    # The references read lengths on the host, which a capture cannot: CPU only.
    assert not takes_whole_graphs(REFERENCE, torch.device("cuda"))
    flash = kernels_for(torch.device("cuda"), torch.float32, triton_attention="flash")
    assert takes_whole_graphs(flash, torch.device("cuda"))


def test_steps_past_the_ladder_run_eagerly(tiny_llama) -> None:
    """Two prompts of 1,100 tokens in one step: past the ladder's 2,048, so the plain
    forward runs it (no piecewise step at all), with the eager path's results."""
    prompts, params = prompts_of_lengths([1100, 1100], seed=23), greedy(3, logprobs=1)
    eager, _, _ = _outputs(tiny_llama, params, prompts, max_num_batched_tokens=4096)
    pieces, steps, _ = _outputs(tiny_llama, params, prompts, enforce_eager=False,
                                piecewise_graphs=True, max_num_batched_tokens=4096)
    assert steps == 0
    _same(eager, pieces)
    engine = make_engine(tiny_llama, enforce_eager=False, piecewise_graphs=True,
                         max_num_batched_tokens=4096)
    assert engine.runner.pieces.sizes[-1] == MAX_TOKENS
