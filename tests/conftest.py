# Must run before anything imports triton kernels: @triton.jit reads TRITON_INTERPRET when the
# defining module is imported, and without a GPU the interpreter is the only way to run them.
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from pagedserve.models.loader import LoadedModel, load_model_files  # noqa: E402

# One intra-op thread: on a shared 2-vCPU machine a second OpenMP thread spin-waits on a
# preempted vCPU and makes small matmuls 5-10x slower (docs/design.md §9). Tests want steady.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def embedded() -> LoadedModel:
    """The embedded SmolLM2-135M-Instruct GGUF, dequantized to fp32 once per session."""
    return load_model_files(None, torch.float32)


@pytest.fixture(scope="session")
def hf_from_gguf():
    """transformers' own reading of the embedded GGUF (an independent dequantizer and Q/K
    un-permuter), fp32, in eval mode; once per session (it takes ~15 s)."""
    import transformers.modeling_utils as mu
    from transformers import AutoModelForCausalLM

    from pagedserve.models.loader import default_model_path

    directory, filename = os.path.split(default_model_path())
    with pytest.MonkeyPatch.context() as mp:
        # transformers only wants accelerate for device maps; CPU loading does not use it.
        mp.setattr(mu, "is_accelerate_available", lambda: True)
        model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=filename,
                                                     dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, embedded) -> Path:
    """A tiny random-weight Llama saved by transformers as a HF directory (safetensors),
    with the embedded model's tokenizer."""
    from engine_utils import save_tiny_hf
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("tiny-llama")
    config = LlamaConfig(
        vocab_size=embedded.tokenizer.vocab_size, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=2048, rope_theta=10000.0, tie_word_embeddings=False,
        eos_token_id=2, bos_token_id=1)
    save_tiny_hf(path, LlamaForCausalLM, config, embedded.tokenizer)
    return path


@pytest.fixture(scope="session")
def tiny_llama(tiny_llama_dir) -> LoadedModel:
    return load_model_files(str(tiny_llama_dir), torch.float32)
