"""After the engine's warm-up (ModelRunner.warm_up), no step launches a Triton kernel at a
specialization that the warm-up did not launch: on a GPU each new one is a build of seconds
inside some request's step (kernels/triton/common.py, VARYING_ARGS).

The interpreter builds nothing, so each launch's specialization is computed the way Triton's
JIT computes it for a CUDA launch (kernels/triton/specializations.py)."""

import pytest
import torch
import triton
from engine_utils import greedy, make_engine, prompts_of_lengths, run
from triton.runtime.jit import JitFunctionInfo

from pagedserve.engine import SamplingParams
from pagedserve.kernels import triton as triton_kernels
from pagedserve.kernels.triton.common import INTERPRETED
from pagedserve.kernels.triton.specializations import SpecializationRecorder


@pytest.fixture(scope="module")
def one_layer_llama(tmp_path_factory, embedded):
    """conftest's tiny Llama with one layer: every layer launches the same kernels at the
    same specializations, and through the interpreter each costs seconds a step."""
    from engine_utils import save_tiny_hf
    from transformers import LlamaConfig, LlamaForCausalLM

    from pagedserve.models.loader import load_model_files

    path = tmp_path_factory.mktemp("one-layer-llama")
    config = LlamaConfig(
        vocab_size=embedded.tokenizer.vocab_size, hidden_size=64, intermediate_size=128,
        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=2048, tie_word_embeddings=False, eos_token_id=2,
        bos_token_id=1)
    save_tiny_hf(path, LlamaForCausalLM, config, embedded.tokenizer)
    return load_model_files(str(path), torch.float32)


# Table widths of 1 and of 16 blocks and more, contexts past 512 tokens with few sequences
# (split KV), prompt chunks beside decodes, forks copied on write, and a preemption.
PROMPTS = prompts_of_lengths([3, 15, 40, 250, 530], seed=21)


@pytest.mark.skipif(not INTERPRETED, reason="records the interpreter's launches")
# flash only (the default): basic, the baseline kept for benchmarks, cost 40-70 s of CI here
# through the interpreter; its kernels are compiled for sm_90 in test_triton_compile.py.
@pytest.mark.parametrize(("attention", "graphs"), [
    ("flash", "eager"),
    ("flash", "graphs"),  # decode graphs and piecewise graphs: captured first, then warm-up
    ("flash", "full"),  # the same with whole graphs: the prefill kernel's flat grid
])
def test_no_kernel_build_after_warm_up(one_layer_llama, attention: str, graphs: str) -> None:
    # Seats for the 6 samples: the decode graphs' ladder is then 1, 2, 4, 8 (128 seats would
    # make 12 sizes, each run through the interpreter below, as capture runs them).
    engine = make_engine(one_layer_llama, triton_kernels.kernel_set(attention),
                         enforce_eager=graphs == "eager", piecewise_graphs=graphs != "eager",
                         full_graphs=graphs == "full", max_num_seqs=8,
                         max_num_batched_tokens=64, num_kv_blocks=48, max_model_len=1024)
    assert (engine.runner.pieces is not None and engine.runner.pieces.whole) == (
        graphs == "full")
    with SpecializationRecorder().recording() as specializations:
        if graphs != "eager":  # what capture launches on a GPU (uncaptured here, not at start)
            engine.runner.graphs.run_each_size()
            engine.runner.pieces.run_each_piece()
        engine.runner.warm_up(engine.config.max_num_batched_tokens, engine.max_model_len)
        built = specializations.snapshot()
        # It wrote nothing: the caches are as allocated (zeros).
        assert engine.runner.k_caches.count_nonzero() == 0
        assert engine.runner.v_caches.count_nonzero() == 0
        params = [greedy(12)] * 4 + [SamplingParams(n=2, temperature=1.0, seed=5,
                                                    max_tokens=12, ignore_eos=True)]
        run(engine, PROMPTS, params)
    assert set(built) >= {"_store_kvcache_kernel", "_decode_kernel", "_prefill_kernel",
                          "_copy_blocks_kernel"}
    assert engine.stats()["preemptions"] > 0  # the pool of 48 blocks cannot hold them all
    assert specializations.new_since(built) == {}, "kernels built after the warm-up"


def test_recording_builds_chains_and_restores_the_hook() -> None:
    """recording_builds() sees a build the way Triton reports one (its post-compile hook,
    called with a JitFunctionInfo), passes it on to a hook set before, and puts that back.
    Off a GPU nothing builds, so the hook is called here as Triton's JIT calls it."""
    runtime = triton.knobs.runtime
    theirs: list[str] = []
    runtime.jit_post_compile_hook = lambda **kwargs: theirs.append(kwargs["fn"].name)
    try:
        with triton_kernels.recording_builds() as built:
            runtime.jit_post_compile_hook(key=(), fn=JitFunctionInfo("m", "_decode_kernel", None))
        assert built == theirs == ["_decode_kernel"]
        runtime.jit_post_compile_hook(key=(), fn=JitFunctionInfo("m", "_prefill_kernel", None))
        assert built == ["_decode_kernel"] and theirs[-1] == "_prefill_kernel"
    finally:
        runtime.jit_post_compile_hook = None


def test_full_graphs_warm_up_builds_what_an_eager_step_launches(one_layer_llama) -> None:
    """With whole graphs the warm-up's dummy steps fit the graphs, yet a step past their
    2,048 tokens runs the plain forward, on the kernels' host-sized grids: the warm-up must
    build those too (every specialization an eager engine's warm-up launches)."""
    def warm_up(**config) -> dict:
        engine = make_engine(one_layer_llama, triton_kernels.kernel_set("flash"), max_num_seqs=8,
                             max_num_batched_tokens=64, num_kv_blocks=48, max_model_len=1024,
                             **config)
        with SpecializationRecorder().recording() as specializations:
            if engine.runner.graphs is not None:  # what capture launches on a GPU
                engine.runner.graphs.run_each_size()
                engine.runner.pieces.run_each_piece()
            engine.runner.warm_up(engine.config.max_num_batched_tokens, engine.max_model_len)
        return specializations.snapshot()

    eager = warm_up(enforce_eager=True)
    full = warm_up(enforce_eager=False, piecewise_graphs=True, full_graphs=True)
    assert eager["_prefill_kernel"]
    for name, keys in eager.items():
        assert keys <= full.get(name, set()), f"{name}: built only by an eager step"
