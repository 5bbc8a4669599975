"""How the KV pool is sized: vLLM's --gpu-memory-utilization (its share of the GPU, less what
a profiled step holds; the profile itself runs in tests/test_gpu_engine.py), its flag's
checks, and its place beside the fixed sizes on a CPU."""

import pytest
from engine_utils import make_engine
from kubernetes_utils import parse_serve

from pagedserve.engine.args import engine_config
from pagedserve.engine.kv_pool import GpuMemory, kv_budget, requested_bytes
from pagedserve.scheduler import InvalidRequest

GIB = 2**30


def test_the_engines_share_must_be_free_at_start():
    """As vLLM: a share that another process's memory already takes is refused, not an OOM
    once the pool is allocated."""
    idle = GpuMemory(free=130 * GIB, total=140 * GIB, torch_reserved=0)
    assert requested_bytes(0.9, idle) == int(0.9 * 140 * GIB)
    busy = GpuMemory(free=100 * GIB, total=140 * GIB, torch_reserved=0)
    assert requested_bytes(0.7, busy) == int(0.7 * 140 * GIB)
    with pytest.raises(ValueError, match="asks for 126.00 GiB .* only 100.00 GiB is free"):
        requested_bytes(0.9, busy)


def test_the_pool_gets_the_share_less_the_peak_and_what_grew_outside_torch():
    start = GpuMemory(free=138 * GIB, total=140 * GIB, torch_reserved=0)  # 2 GiB: a context
    # The profile: torch's peak of 5 GiB, 6 GiB reserved, and cuBLAS's 1 GiB outside torch.
    end = GpuMemory(free=131 * GIB, total=140 * GIB, torch_reserved=6 * GIB)
    assert end.outside_torch - start.outside_torch == GIB
    assert kv_budget(100 * GIB, 5 * GIB, start, end) == 94 * GIB
    # Memory freed outside torch meanwhile (another process's) gives the pool nothing.
    shrunk = GpuMemory(free=136 * GIB, total=140 * GIB, torch_reserved=4 * GIB)
    assert kv_budget(100 * GIB, 5 * GIB, start, shrunk) == 95 * GIB


def test_the_flag_parses_as_vllms():
    config = engine_config(parse_serve(["--gpu-memory-utilization", "0.9"]))
    assert (config.gpu_memory_utilization, config.kv_cache_memory_gib) == (0.9, 2.0)
    config = engine_config(parse_serve(["--kv-cache-memory-gib", "3"]))
    assert (config.gpu_memory_utilization, config.kv_cache_memory_gib) == (None, 3.0)


@pytest.mark.parametrize("argv, message", [
    (["--gpu-memory-utilization", "0"], "a fraction above 0, at most 1"),
    (["--gpu-memory-utilization", "1.5"], "a fraction above 0, at most 1"),
    (["--gpu-memory-utilization", "nan"], "a fraction above 0, at most 1"),
    (["--gpu-memory-utilization", "0.9", "--kv-cache-memory-gib", "4"],
     "--kv-cache-memory-gib and --gpu-memory-utilization: each sizes the KV pool; give one"),
    (["--num-kv-blocks", "64", "--gpu-memory-utilization", "0.9"],
     "--num-kv-blocks and --gpu-memory-utilization: each sizes"),
])
def test_a_bad_or_second_pool_size_is_refused(argv, message):
    with pytest.raises(InvalidRequest, match=message):
        engine_config(parse_serve(argv))


def test_on_a_cpu_the_flag_is_unused_and_said(tiny_llama, caplog):
    """vLLM's CPU backend ignores it too: a GPU's command line still starts here, its pool
    the fixed size."""
    with caplog.at_level("WARNING", logger="pagedserve.engine"):
        engine = make_engine(tiny_llama, num_kv_blocks=None, kv_cache_memory_gib=0.01,
                             gpu_memory_utilization=0.9)
    block_bytes = 16 * tiny_llama.config.kv_bytes_per_token(4)
    assert engine.num_blocks == int(0.01 * GIB // block_bytes)
    assert any("--gpu-memory-utilization: unused on a CPU" in r.getMessage()
               for r in caplog.records)


def test_the_profile_runs_the_sampler_over_a_row_per_sequence(tiny_llama, monkeypatch):
    """vLLM's dummy sampler run: the profiled peak includes the sampler's largest step, a
    row of the vocabulary per sequence. Run here on a CPU with torch.cuda's memory calls
    standing in for a GPU's."""
    import torch

    from pagedserve.engine import kv_pool
    from pagedserve.engine.config import EngineConfig
    from pagedserve.kernels import kernels_for
    from pagedserve.models.parallel import TensorParallel

    gpu = {"free": 100 * GIB, "reserved": 0}
    for name, fake in {
        "synchronize": lambda device=None: None,
        "mem_get_info": lambda device=None: (gpu["free"], 140 * GIB),
        "memory_reserved": lambda device=None: gpu["reserved"],
        "reset_peak_memory_stats": lambda device=None: None,
        "max_memory_allocated": lambda device=None: 5 * GIB,
        "empty_cache": lambda: None,
    }.items():
        monkeypatch.setattr(torch.cuda, name, fake)
    sampled = []
    real_sample = kv_pool.sample

    def spy(logits, rows, *args, **kwargs):
        sampled.append((tuple(logits.shape), {r.params.logprobs for r in rows},
                        sorted({(r.params.greedy, r.params.top_p) for r in rows})))
        gpu["free"], gpu["reserved"] = 97 * GIB, 2 * GIB  # cuBLAS: 1 GiB outside torch
        return real_sample(logits, rows, *args, **kwargs)

    monkeypatch.setattr(kv_pool, "sample", spy)
    config = EngineConfig(max_num_seqs=96, max_num_batched_tokens=64, block_size=16,
                          gpu_memory_utilization=0.5, dtype="float32")
    device = torch.device("cpu")
    torch.manual_seed(5)
    want = torch.rand(4)
    torch.manual_seed(5)
    _, blocks = kv_pool.profiled_model_and_pool(
        tiny_llama, kernels_for(device, torch.float32), config, torch.float32, GIB, device,
        TensorParallel())
    assert torch.equal(torch.rand(4), want)  # --seed's stream untouched by the profile
    vocab = tiny_llama.config.vocab_size
    # Every kind of row (greedy, plain random, filtered), so that the mixed paths' copies count.
    assert sampled == [((96, vocab), {20}, [(False, 0.9), (False, 1.0), (True, 1.0)])]
    assert blocks == 70 - 5 - 1  # the share, less the peak and what grew outside torch
