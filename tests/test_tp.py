"""Tensor parallelism on CPU with gloo: TP=N runs give TP=1's greedy tokens and logprobs
(float32, atol 1e-4), whole, chunked, preempted, forked and from the prefix cache; KV heads
that do not divide by N are replicated; sizes that cannot work are refused.

Each TP engine spawns N-1 worker processes (seconds each), so one engine per model serves
every case: it runs with a small KV pool and token budget, which chunks and preempts, and
its outputs are compared with a TP=1 engine of the same config and with TP=1 unchunked."""

import pytest
import torch
from engine_utils import greedy, make_engine, prompts_of_lengths, run
from tp_utils import assert_same, tiny_llama

from pagedserve import cli
from pagedserve.engine import EngineConfig, LLMEngine, SamplingParams, distributed
from pagedserve.models.config import ModelConfig
from pagedserve.models.loader import load_model_files, read_model_config
from pagedserve.models.parallel import TensorParallel, TensorParallelError
from pagedserve.server import launch

# Lengths around block boundaries (block_size 16), ids below the tiny vocabularies.
PROMPTS = prompts_of_lengths([15, 49, 64, 70], seed=1, max_id=1000)
STEPS = 12
# 9 blocks for 4 sequences of up to 82 tokens: preemptions; 16 tokens a step: chunks.
SMALL = {"num_kv_blocks": 9, "max_num_batched_tokens": 16}
FORKED = SamplingParams(n=3, temperature=0.9, top_k=20, seed=3, max_tokens=6, logprobs=2,
                        ignore_eos=True)


def engine_for(path, tp: int = 1, **config):
    loaded = load_model_files(str(path), torch.float32)
    return make_engine(loaded, model=str(path), tensor_parallel_size=tp, num_threads=1,
                       **config)


def scenarios(engine) -> dict[str, list]:
    """The runs each TP engine is checked on (their order matters for the prefix cache)."""
    out = {"greedy": run(engine, PROMPTS, greedy(STEPS, logprobs=5))}
    preemptions = engine.stats()["preemptions"]
    out["forked"] = run(engine, PROMPTS[:2], FORKED)
    before = engine.stats()["prefix_cache_hit_tokens"]
    out["cached"] = run(engine, PROMPTS[1:2], greedy(STEPS, logprobs=5))  # a prefix-cache hit
    out["cache_hits"] = engine.stats()["prefix_cache_hit_tokens"] - before
    out["preemptions"] = preemptions
    return out


@pytest.fixture(scope="module")
def kv4_dir(tmp_path_factory):
    """8 query heads, 4 KV heads: TP=2 splits them 4+2 per rank. Untied lm_head. Biases on
    every projection: the row-parallel ones (o_proj, down_proj) must be added once."""
    return tiny_llama(tmp_path_factory.mktemp("kv4"), heads=8, kv_heads=4, vocab=1000,
                      tied=False, biases=True)


@pytest.fixture(scope="module")
def kv1_dir(tmp_path_factory):
    """4 query heads, 1 KV head: TP=2 must replicate it. Tied embeddings, and an odd
    vocabulary, so that the last rank's vocabulary slice is padded."""
    return tiny_llama(tmp_path_factory.mktemp("kv1"), heads=4, kv_heads=1, vocab=1001,
                      tied=True)


@pytest.mark.parametrize("model", ["kv4_dir", "kv1_dir"])
def test_tp2_equals_tp1(model, request):
    path = request.getfixturevalue(model)
    whole = run(engine_for(path), PROMPTS, greedy(STEPS, logprobs=5))
    single = scenarios(engine_for(path, **SMALL))
    engine = engine_for(path, tp=2, **SMALL)
    try:
        assert engine.runner.k_caches.shape[3] == (2 if model == "kv4_dir" else 1)
        split = scenarios(engine)
        assert engine.block_manager.num_used_blocks == 0
    finally:
        engine.close()
    assert split["preemptions"] > 0 and split["cache_hits"] > 0
    for name in ("greedy", "forked", "cached"):
        assert_same(split[name], single[name])
    # Chunked and preempted under TP=2 = one unchunked, uninterrupted TP=1 run.
    assert_same(split["greedy"], whole)
    assert split["cache_hits"] == single["cache_hits"]


def test_embedded_model_tp3_greedy_equals_tp1(embedded):
    """SmolLM2-135M: 9 query heads and 3 KV heads over 3 ranks (a GGUF, sharded on load)."""
    prompts = [embedded.tokenizer.encode(p) for p in ["The capital of France is", "1, 2, 3,"]]
    single = run(make_engine(embedded, num_threads=1), prompts, greedy(4, logprobs=1))
    engine = make_engine(embedded, tensor_parallel_size=3, num_threads=1)
    try:
        split = run(engine, prompts, greedy(4, logprobs=1))
    finally:
        engine.close()
    assert [o.outputs[0].token_ids for o in split] == [o.outputs[0].token_ids for o in single]
    for s, t in zip(split, single, strict=True):
        for a, b in zip(s.outputs[0].logprobs, t.outputs[0].logprobs, strict=True):
            assert abs(a.logprob - b.logprob) < 1e-3  # 30 layers of reordered fp32 sums


def config(heads: int, kv_heads: int, width: int = 72) -> ModelConfig:
    return ModelConfig(vocab_size=100, hidden_size=8 * heads, intermediate_size=width,
                       num_layers=1, num_heads=heads, num_kv_heads=kv_heads, head_dim=8)


@pytest.mark.parametrize("heads, kv_heads, n, message", [
    (9, 3, 2, "9 query heads do not divide by 2. Sizes that work: 1, 3."),
    (6, 3, 2, "3 KV heads neither divide by 2 nor can be replicated evenly"),
    (4, 4, 8, "4 query heads do not divide by 8"),
])
def test_impossible_splits_are_refused(heads, kv_heads, n, message):
    with pytest.raises(TensorParallelError, match=message):
        TensorParallel(0, n).check(config(heads, kv_heads))


def test_kv_heads_follow_the_query_heads():
    """Each rank's query heads read only its KV heads (GQA groups stay whole)."""
    for heads, kv_heads, n in [(8, 4, 2), (8, 2, 4), (4, 1, 2), (9, 3, 3), (8, 8, 4)]:
        cfg = config(heads, kv_heads)
        group = heads // kv_heads
        for rank in range(n):
            tp = TensorParallel(rank, n)
            needed = {q // group for q in tp.q_heads(cfg)}
            assert needed == set(tp.kv_heads(cfg)), (heads, kv_heads, n, rank)


def test_refused_before_any_worker_starts(embedded, monkeypatch):
    with pytest.raises(TensorParallelError, match="Sizes that work: 1, 3"):
        make_engine(embedded, tensor_parallel_size=2)

    def spawned(*args, **kwargs):
        raise AssertionError("a worker was spawned")

    # From a path too: only the model's config is read, and -tp 1000 spawns no process.
    monkeypatch.setattr(distributed.subprocess, "Popen", spawned)
    with pytest.raises(TensorParallelError, match="Sizes that work: 1, 3"):
        LLMEngine(EngineConfig(tensor_parallel_size=1000, dtype="float32"))
    assert read_model_config(None) == embedded.config
    if torch.cuda.device_count() < 2:  # more CUDA ranks than GPUs: refused before a spawn too
        spec = distributed.WorkerSpec(None, "float32", "cuda", 16, False, "flash", None, 60.0)
        with pytest.raises(ValueError, match="needs 2 GPUs"):
            distributed.start(2, spec)


@pytest.mark.parametrize("env, argv, message", [
    ({}, ["generate", "--distributed-timeout", "inf", "x"], "--distributed-timeout must be"),
    ({}, ["generate", "--distributed-timeout", "nan", "x"], "--distributed-timeout must be"),
    ({}, ["generate", "--distributed-timeout", "1e300", "x"], "--distributed-timeout must be"),
    # serve: refused before the server starts, as generate is (embedded model: 9 heads)
    ({}, ["serve", "--port", "18631", "-tp", "2"], "Sizes that work: 1, 3."),
    # torchrun's ranks and -tp disagree: each rank would run a whole engine (or wait)
    ({"RANK": "0", "WORLD_SIZE": "2"}, ["generate", "-tp", "1", "x"], "torchrun started 2"),
    ({"RANK": "1", "WORLD_SIZE": "2"}, ["generate", "-tp", "3", "x"], "torchrun started 2"),
], ids=["timeout-inf", "timeout-nan", "timeout-huge", "serve-split", "torchrun-rank-0",
        "torchrun-rank-1"])
def test_bad_tp_flags_refused_in_one_line_before_anything_starts(env, argv, message,
                                                                 monkeypatch, capsys):
    def started(*args, **kwargs):
        raise AssertionError("something started")

    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(cli, "LLM", started)
    monkeypatch.setattr(launch, "run_server", started)
    monkeypatch.setattr(distributed, "worker_main", started)
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
