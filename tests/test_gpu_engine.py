"""The engine end to end on CUDA, with the Triton kernels, on a random-weight model of a
realistic size: Qwen2.5-0.5B's shapes (24 layers, 14 query heads on 2 KV heads, so a GQA
group of 7, qkv bias, tied embeddings), with a 32k vocabulary.

- Paged output equals HF transformers on the same weights (fp32, as in test_hf_agreement).
- Chunked, preempted and forked runs give the tokens of a plain run, with and without
  CUDA graphs (decode-only, and piecewise for steps with prefill chunks), and with each
  step launched before the previous step's tokens are read back (async scheduling), guided
  samples included (on a copy of the model with a byte-level tokenizer). Greedy tokens
  must be equal; seeded samples as assert_samples_agree says, since a GPU's kernels round
  differently at another batch size or padded length.
- bf16, many sequences at once: against fp32, the first choices and their logprobs are no
  worse than HF transformers' own bf16 run.
- After the engine's warm-up, no step builds a Triton kernel.

Marked ``gpu``; it needs CUDA and compiled Triton (``TRITON_INTERPRET=0``), as
scripts/gpu-check.sh runs it. Without a GPU every test here is skipped."""

import json
import os
import subprocess
import sys
from dataclasses import replace
from statistics import mean

import pytest
import torch
from engine_utils import (
    check_agreement,
    greedy,
    hf_logprobs,
    make_engine,
    prompts_of_lengths,
    random_prompts,
    run,
    save_byte_level_tokenizer,
    save_random_hf,
)

from pagedserve.engine import SamplingParams
from pagedserve.models.loader import load_model_files
from pagedserve.scheduler import StructuredOutputs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
        reason="needs a CUDA GPU and TRITON_INTERPRET=0 (scripts/gpu-check.sh)"),
]

DEVICE = "cuda"
SHAPES = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
              num_attention_heads=14, num_key_value_heads=2, vocab_size=32768,
              max_position_embeddings=8192, tie_word_embeddings=True, eos_token_id=2)
LENGTHS = [7, 200, 515, 1100]  # in and across 16-token blocks, up to 69 blocks
STEPS = 32
LOGPROB_ATOL = 5e-3  # fp32; 24 layers accumulate more rounding than the tiny models' 2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    path = tmp_path_factory.mktemp("qwen2-0.5b-shapes")
    save_random_hf(path, Qwen2ForCausalLM, Qwen2Config(**SHAPES))
    return path


@pytest.fixture(scope="module")
def loaded(model_dir):
    return load_model_files(str(model_dir), torch.float32)


def _hf(model_dir, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    return model.to(DEVICE).eval()


def _engine(loaded, **config):
    config.setdefault("num_kv_blocks", 1024)
    return make_engine(loaded, device=DEVICE, **config)


def _tokens(outputs) -> list[list[int]]:
    return [s.token_ids for o in outputs for s in o.outputs]


# Seeded samples (4 per prompt), with their logprobs for assert_samples_agree.
FORK = SamplingParams(n=4, temperature=0.8, top_p=0.95, seed=3, max_tokens=STEPS,
                      ignore_eos=True, logprobs=2)


def assert_samples_agree(got, want, max_parted: int = 2) -> None:
    """Seeded samples of two runs whose logits may differ in their last bits: on a GPU,
    cuBLAS and the split-KV decode round differently at another batch size or padded
    length. While a pair's tokens agree, so do their logprobs (to 1e-3). A draw moves only
    where its uniform number falls at a token's edge (a few draws in 1,000 at 1e-6
    relative noise: tests/test_sampler.py), and then to a neighbouring kept token, since
    the draw runs in vocabulary order; the pair parts there. So a few pairs may part, each
    between two close ids and on the same distribution (its top logprobs); a broken
    copy-on-write or block table moves the logprobs, and a wrong random stream draws an id
    anywhere in the vocabulary."""
    pairs = [(g, w) for go, wo in zip(got, want, strict=True)
             for g, w in zip(go.outputs, wo.outputs, strict=True)]
    parted = 0
    for g, w in pairs:
        pairs_of_tokens = enumerate(zip(g.token_ids, w.token_ids, strict=True))
        same = next((i for i, (a, b) in pairs_of_tokens if a != b), len(w.token_ids))
        assert [lp.logprob for lp in g.logprobs[:same]] == pytest.approx(
            [lp.logprob for lp in w.logprobs[:same]], abs=1e-3)
        if same < len(w.token_ids):
            parted += 1
            assert abs(g.token_ids[same] - w.token_ids[same]) <= 16, (same, g.token_ids[same],
                                                                     w.token_ids[same])
            assert [v for _, v in g.logprobs[same].top] == pytest.approx(
                [v for _, v in w.logprobs[same].top], abs=1e-3)
    assert parted <= max_parted, f"{parted} of {len(pairs)} samples parted"
    assert len({tuple(w.token_ids) for _, w in pairs}) > 1  # the samples do differ


@pytest.fixture(scope="module")
def baseline(loaded) -> list[list[int]]:
    """Each prompt alone, whole prefill then one decode per token."""
    return [_tokens(run(_engine(loaded), [p], greedy(STEPS)))[0] for p in _prompts()]


def _prompts() -> list[list[int]]:
    return prompts_of_lengths(LENGTHS, seed=1, max_id=SHAPES["vocab_size"] - 100)


@pytest.mark.parametrize("attention", ["basic", "flash"])
def test_engine_on_cuda_matches_transformers(loaded, model_dir, attention: str):
    check_agreement(loaded, _hf(model_dir, torch.float32), _prompts(), STEPS, LOGPROB_ATOL,
                    device=DEVICE, num_kv_blocks=1024, triton_attention=attention)


def test_chunked_preempted_and_batched_equal_plain_runs(loaded, baseline):
    prompts = _prompts()
    chunked = _engine(loaded, max_num_batched_tokens=96)  # cuts prompts across blocks
    assert _tokens(run(chunked, prompts, greedy(STEPS))) == baseline
    assert chunked.stats()["prefill_tokens_computed"] == sum(LENGTHS)
    # Room for the four prompts, not for their growth: decodes preempt one another.
    pool = sum(-(-n // 16) for n in LENGTHS) + 2
    tight = _engine(loaded, num_kv_blocks=pool, enable_prefix_caching=False)
    assert _tokens(run(tight, prompts, greedy(STEPS))) == baseline
    assert tight.stats()["preemptions"] > 0


@pytest.mark.parametrize("attention", ["basic", "flash"])
def test_cuda_graphs_equal_eager(loaded, baseline, attention: str):
    """Captured decode graphs (--no-enforce-eager) give the eager tokens: plain, chunked,
    preempted, and forked with seeded sampling (copy-on-write before a replay)."""
    prompts = _prompts()
    # The eager runs of the same kernels are the reference (on CUDA graphs are the default).
    eager = _engine(loaded, triton_attention=attention, enforce_eager=True)
    want = _tokens(run(eager, prompts, greedy(STEPS)))
    for config in ({}, {"max_num_batched_tokens": 96},
                   {"num_kv_blocks": sum(-(-n // 16) for n in LENGTHS) + 2,
                    "enable_prefix_caching": False}):
        graphs = _engine(loaded, triton_attention=attention, enforce_eager=False,
                         max_num_seqs=32, **config)
        assert graphs.runner.graphs is not None and graphs.runner.graphs.graphs
        assert _tokens(run(graphs, prompts, greedy(STEPS))) == want, config
    # Two fresh engines, so that the prompts' K/V come from the same prefill steps.
    fresh = {"triton_attention": attention, "max_num_seqs": 32}
    assert_samples_agree(run(_engine(loaded, enforce_eager=False, **fresh), prompts[:2], FORK),
                         run(_engine(loaded, enforce_eager=True, **fresh), prompts[:2], FORK))
    if attention == "basic":
        assert want == baseline


def test_piecewise_graphs_equal_eager(loaded):
    """Steps with prefill chunks replayed piecewise (--piecewise-graphs) give the eager
    tokens: whole and chunked prompts beside decodes (steps that fill the budget, and
    smaller ones, padded), preempted, and forked with seeded sampling."""
    prompts = _prompts()
    eager = _engine(loaded, enforce_eager=True)
    want = _tokens(run(eager, prompts, greedy(STEPS)))
    pool = sum(-(-n // 16) for n in LENGTHS) + 2
    for config in ({}, {"max_num_batched_tokens": 96},
                   {"num_kv_blocks": pool, "enable_prefix_caching": False}):
        config.setdefault("max_num_batched_tokens", 512)  # 11 sizes to capture, not 13
        graphs = _engine(loaded, enforce_eager=False, piecewise_graphs=True, max_num_seqs=32,
                         **config)
        pieces = graphs.runner.pieces
        assert len(pieces.graphs) == len(pieces.sizes) * (SHAPES["num_hidden_layers"] + 1)
        assert _tokens(run(graphs, prompts, greedy(STEPS))) == want, config
        assert (graphs.stats()["preemptions"] > 0) == ("num_kv_blocks" in config)
    # Fresh engines with the same budget: the same chunks, padded on the piecewise side.
    budget = {"max_num_batched_tokens": 512}
    assert_samples_agree(
        run(_engine(loaded, enforce_eager=False, piecewise_graphs=True, **budget),
            prompts[:2], FORK),
        run(_engine(loaded, enforce_eager=True, **budget), prompts[:2], FORK))


def test_full_graphs_equal_eager(loaded):
    """Steps with prefill chunks replayed as one whole graph each (--full-graphs: attention
    captured too, over padded metadata, through the flash kernel's flat grid) give the
    eager tokens: whole and chunked prompts beside decodes, preempted, and forked with
    seeded sampling."""
    prompts = _prompts()
    want = _tokens(run(_engine(loaded, enforce_eager=True), prompts, greedy(STEPS)))
    pool = sum(-(-n // 16) for n in LENGTHS) + 2
    whole = {"enforce_eager": False, "piecewise_graphs": True, "full_graphs": True,
             "max_num_seqs": 32, "max_num_batched_tokens": 512}
    for config in ({}, {"max_num_batched_tokens": 96},
                   {"num_kv_blocks": pool, "enable_prefix_caching": False}):
        graphs = _engine(loaded, **{**whole, **config})
        pieces = graphs.runner.pieces
        assert pieces.whole and len(pieces.graphs) == len(pieces.sizes)
        assert _tokens(run(graphs, prompts, greedy(STEPS))) == want, config
        assert (graphs.stats()["preemptions"] > 0) == ("num_kv_blocks" in config)
    budget = {"max_num_batched_tokens": 512}
    assert_samples_agree(run(_engine(loaded, **whole), prompts[:2], FORK),
                         run(_engine(loaded, enforce_eager=True, **budget), prompts[:2], FORK))


def test_async_scheduling_equals_sync(loaded):
    """Each step launched before the previous one's tokens are read back
    (--async-scheduling), its decodes' input ids taken on the device into the captured
    graphs' buffers: the tokens and logprobs of the synchronous engine, whole, chunked
    (eager prefill steps, and piecewise ones), preempted, forked with seeded sampling,
    with a stop token met while the next step was already launched, with penalties (the
    token in flight joins them on the device), with bad words, and with logprob_token_ids
    (their logprobs gathered on the device)."""
    prompts = _prompts()
    sync = _engine(loaded, max_num_seqs=32)
    want = _tokens(run(sync, prompts, greedy(STEPS)))
    stop = SamplingParams(temperature=0, max_tokens=STEPS, stop_token_ids=[want[0][5]])
    want_stop = _tokens(run(sync, prompts, stop))
    penalized = SamplingParams(temperature=0, max_tokens=STEPS, repetition_penalty=1.5,
                               presence_penalty=0.3, frequency_penalty=0.5)
    want_penalized = _tokens(run(sync, prompts, penalized))
    # (a word of several tokens settles the token in flight before sampling)
    banned = SamplingParams(temperature=0, max_tokens=STEPS, bad_words=["the", "of the", "and"])
    want_banned = _tokens(run(sync, prompts, banned))
    asked = SamplingParams(temperature=0, max_tokens=STEPS, logprob_token_ids=[5, 77, 5, 900])
    want_asked = [s.logprobs for o in run(sync, prompts, asked) for s in o.outputs]
    pool = sum(-(-n // 16) for n in LENGTHS) + 2
    for config in ({}, {"max_num_batched_tokens": 96},
                   {"max_num_batched_tokens": 96, "piecewise_graphs": True},
                   {"num_kv_blocks": pool, "enable_prefix_caching": False}):
        ahead = _engine(loaded, async_scheduling=True, max_num_seqs=32, **config)
        assert ahead.runner.graphs.graphs
        assert _tokens(run(ahead, prompts, greedy(STEPS))) == want, config
        assert _tokens(run(ahead, prompts, stop)) == want_stop, config
        assert _tokens(run(ahead, prompts, penalized)) == want_penalized, config
        assert _tokens(run(ahead, prompts, banned)) == want_banned, config
        got = [s.logprobs for o in run(ahead, prompts, asked) for s in o.outputs]
        for lps, want_lps in zip(got, want_asked, strict=True):
            for lp, want_lp in zip(lps, want_lps, strict=True):
                assert [t for t, _ in lp.top] == [t for t, _ in want_lp.top] \
                    == list(dict.fromkeys([lp.token_id, 5, 77, 900])), config
                assert all(abs(v - w) < LOGPROB_ATOL for (_, v), (_, w)
                           in zip(lp.top, want_lp.top, strict=True)), config
        assert (ahead.stats()["preemptions"] > 0) == ("num_kv_blocks" in config)
    assert_samples_agree(run(_engine(loaded, async_scheduling=True), prompts[:2], FORK),
                         run(_engine(loaded), prompts[:2], FORK))


def test_fork_shares_the_prompt_and_equals_independent_runs(loaded):
    """n=8 seeded samples of a 1,100-token prompt: one prefill, the prompt's blocks stored
    once (plus a copy of the shared tail block per sample: the Triton block copy), and
    sample i agrees with an n=1 request with seed + i. The eight requests run together
    afterwards: they decode in a batch of 8, as the samples did (a batch of 1 rounds
    differently), on the prompt's blocks that the fork's prefill cached, and each computes
    its own tail block (so the fork's K/V is the prefill's, not checked here: the other
    tests check it against transformers and plain runs)."""
    prompt = _prompts()[-1]

    def params(n: int, seed: int) -> SamplingParams:
        return SamplingParams(n=n, temperature=0.8, top_p=0.95, seed=seed,
                              max_tokens=STEPS, ignore_eos=True, logprobs=2)

    n, engine = 8, _engine(loaded)
    [forked] = run(engine, [prompt], params(n, seed=5))
    stats = engine.stats()
    assert stats["prefill_tokens_computed"] == len(prompt)
    assert stats["peak_kv_blocks_used"] <= -(-len(prompt) // 16) + n * (1 + STEPS // 16)
    alone = run(engine, [prompt] * n, [params(1, seed=5 + i) for i in range(n)])
    assert engine.stats()["prefix_cache_hit_tokens"] == n * (len(prompt) // 16 * 16)
    assert_samples_agree([forked], [replace(forked, outputs=[o.outputs[0] for o in alone])])


@pytest.mark.parametrize("attention", ["basic", "flash"])
def test_bf16_batch_is_as_close_to_fp32_as_transformers_bf16(model_dir, attention: str):
    """48 sequences at once in bf16, against HF in fp32 (the truth here), judged by HF's own
    bf16 run on the same prompts: bf16 rounding flips near-ties either way, so the bar is
    "no worse than transformers in bf16", not "fp32's tokens". Each side's first greedy
    token misses fp32's argmax no more often than HF bf16's does (plus one), and the
    logprob it reports for its choice is off from fp32's, on average, by no more than HF
    bf16's is for its own choice (a quarter more allowed: two bf16 runs over 48 prompts
    differ by noise of about that size)."""
    loaded = load_model_files(str(model_dir), torch.bfloat16)
    prompts = random_prompts(48, 16, 700, seed=2, max_id=SHAPES["vocab_size"] - 100)
    engine = _engine(loaded, dtype="bfloat16", num_kv_blocks=4096, max_num_seqs=48,
                     triton_attention=attention)
    outs = run(engine, prompts, greedy(1, logprobs=1))
    hf32, hf16 = _hf(model_dir, torch.float32), _hf(model_dir, torch.bfloat16)
    engine_misses = hf_misses = 0
    engine_err, hf_err = [], []
    for prompt, out in zip(prompts, outs, strict=True):
        token, logprob = out.outputs[0].token_ids[0], out.outputs[0].logprobs[0].logprob
        truth = hf_logprobs(hf32, prompt, [token]).cpu()[0]  # row 0: the prompt's next token
        hf_bf16 = hf_logprobs(hf16, prompt, [token]).cpu()[0]
        best, hf_token = int(truth.argmax()), int(hf_bf16.argmax())
        engine_misses += token != best
        hf_misses += hf_token != best
        engine_err.append(abs(logprob - float(truth[token])))
        hf_err.append(abs(float(hf_bf16[hf_token]) - float(truth[hf_token])))
    assert engine_misses <= hf_misses + 1, (engine_misses, hf_misses)
    assert mean(engine_err) <= 1.25 * mean(hf_err) + 1e-3, (mean(engine_err), mean(hf_err))


# In a fresh process: Triton keeps what it built for the life of the process, so the tests
# before this one would have built everything already.
_BUILDS_SCRIPT = """
import json, sys
import torch
sys.path.insert(0, "tests")
from engine_utils import greedy, make_engine, prompts_of_lengths, run
from pagedserve.engine import SamplingParams
from pagedserve.kernels.triton import recording_builds
from pagedserve.models.loader import load_model_files

loaded = load_model_files(sys.argv[1], torch.bfloat16)
with recording_builds() as at_start:
    engine = make_engine(loaded, device="cuda", dtype="bfloat16", num_kv_blocks=1024,
                         max_num_batched_tokens=96, piecewise_graphs=sys.argv[3] != "0",
                         full_graphs=sys.argv[3] == "2")
prompts = prompts_of_lengths(json.loads(sys.argv[2]), seed=1, max_id=30000)
fork = SamplingParams(n=4, temperature=0.8, seed=3, max_tokens=16, ignore_eos=True)
with recording_builds() as later:
    run(engine, prompts, greedy(16))
    run(engine, prompts[:2], fork)
print(json.dumps({"at_start": at_start, "later": later}))
"""


@pytest.mark.parametrize("graphs", [0, 1, 2], ids=["eager-prefills", "piecewise", "full"])
def test_no_kernel_build_after_warm_up(model_dir, graphs: int):
    """Chunked prompts beside decodes (eager, piecewise or whole-graph steps), decode-only
    steps (graphs), long contexts (split KV) and a fork (block copies) build nothing after
    the engine starts."""
    done = subprocess.run(
        [sys.executable, "-c", _BUILDS_SCRIPT, str(model_dir), json.dumps(LENGTHS),
         str(graphs)],
        capture_output=True, text=True, timeout=600,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert done.returncode == 0, done.stderr[-4000:]
    builds = json.loads(done.stdout.strip().splitlines()[-1])
    assert "_prefill_kernel" in builds["at_start"]  # the recorder sees builds
    assert builds["later"] == []


# Last in the file: the newest check, so that a run cut short by its cap loses it first.
@pytest.fixture(scope="module")
def byte_level_loaded(model_dir, tmp_path_factory):
    """The same weights with a byte-level tokenizer, which grammars need."""
    path = tmp_path_factory.mktemp("qwen2-0.5b-shapes-byte-level")
    for f in model_dir.iterdir():
        if not f.name.startswith("tokenizer"):
            (path / f.name).symlink_to(f)
    save_byte_level_tokenizer(path, SHAPES["vocab_size"])
    return load_model_files(str(path), torch.float32)


def test_async_scheduling_with_grammars_equals_sync(byte_level_loaded):
    """Guided samples under --async-scheduling (the forward launched with the token in
    flight, the previous step settled before the sampling): the synchronous engine's
    tokens, beside unguided greedy rows, whole and chunked."""
    prompts = _prompts()
    params = [SamplingParams(temperature=1.0, seed=4 + i, max_tokens=STEPS,
                             structured_outputs=StructuredOutputs(regex="(yes|no)-[0-9]{2,40}"))
              for i in range(2)] + [greedy(STEPS)] * 2
    want = _tokens(run(_engine(byte_level_loaded, max_num_seqs=32), prompts, params))
    assert all(len(t) > 4 for t in want[:2])
    for config in ({}, {"max_num_batched_tokens": 96}):
        ahead = _engine(byte_level_loaded, async_scheduling=True, max_num_seqs=32, **config)
        assert _tokens(run(ahead, prompts, params)) == want, config


def test_available_memory_counts_what_the_allocator_holds_unused():
    """The KV pool's check after the load: what the load freed stays in torch's cache, where
    the driver counts it as used; new allocations may still take it."""
    from pagedserve.engine.device_setup import available_memory

    device = torch.device(DEVICE)
    staging = torch.empty(512 * 2**20, dtype=torch.uint8, device=device)
    del staging
    # (the driver's figure moves with the other pytest processes' allocations: the two
    # readings are microseconds apart, and their difference is the cache alone)
    assert available_memory(device) - torch.cuda.mem_get_info(device)[0] >= 448 * 2**20


def test_gpu_memory_utilization_fills_the_engines_share_with_the_pool(loaded, baseline):
    """vLLM's --gpu-memory-utilization: the weights, a profiled step's activations and the
    pool fit in the engine's share of the GPU, the pool takes the bulk of it, and its tokens
    are a fixed pool's. (The share is a quarter of what is free: two other pytest processes
    use the GPU meanwhile.)"""
    import gc

    gc.collect()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    share = free // 4
    before = torch.cuda.memory_allocated()  # the module's fixtures; the profile counts them
    # Eager: CUDA graphs, captured once the pool is in, come out of the rest (1 - F). 1,024
    # sequences: the sampler's step over them (~1.3 GB of temporaries over a 32k vocabulary)
    # outgrows the warm-up's prefill (~0.6 GB), so that the last check below needs it profiled.
    engine = _engine(loaded, num_kv_blocks=None, gpu_memory_utilization=share / total,
                     enforce_eager=True, max_num_seqs=1024)
    pool = engine.num_blocks * 16 * loaded.config.kv_bytes_per_token(4)
    weights = sum(t.numel() * t.element_size()
                  for t in [*engine.model.parameters(), *engine.model.buffers()])
    assert before + weights + pool <= share
    # A step's activations (8,192 tokens of fp32) and cuBLAS's workspaces take far less.
    assert pool >= share - before - weights - 4 * 2**30, (pool, share, before, weights)
    assert _tokens(run(engine, _prompts(), greedy(STEPS))) == baseline
    # The sampler's largest step (a row per sequence, each asking for all it may) stays in
    # the share too: the profile ran it.
    torch.cuda.reset_peak_memory_stats()
    heavy = SamplingParams(temperature=0.8, top_k=50, top_p=0.9, repetition_penalty=1.1,
                           presence_penalty=0.5, logprobs=20, max_tokens=4, ignore_eos=True)
    run(engine, [[7, 8, 9, i] for i in range(engine.config.max_num_seqs)], heavy)
    assert torch.cuda.max_memory_allocated() <= share
