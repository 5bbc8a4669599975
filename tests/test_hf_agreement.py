"""Paged output equals HF transformers on the same weights: greedy tokens, and logprobs at
every step within a stated fp32 tolerance."""

import pytest
import torch
from engine_utils import check_agreement, make_engine, run, save_tiny_hf

from pagedserve.engine import SamplingParams

# fp32 on both sides; only the order of floating-point operations differs.
LOGPROB_ATOL = 2e-3
STEPS = 24

PROMPTS = [
    "The history of the printing press begins in the fifteenth century, when Johannes "
    "Gutenberg combined several existing technologies into a practical system. Explain how "
    "movable type changed the spread of ideas across Europe.",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number using an iterative "
    "loop, without recursion, and handle negative input by raising an error.\"\"\"\n",
    "Paris, Berlin, Madrid, Rome, Lisbon, Vienna, Prague, Warsaw, Budapest, Athens, Dublin, "
    "Brussels, Amsterdam, Copenhagen, Stockholm, Oslo, Helsinki, Tallinn, Riga, Vilnius, "
    "Bratislava, Ljubljana, Zagreb and",
]


@pytest.fixture(params=["default", "native-linears"])
def kernels(request):
    """The engine's default kernel set, and the C++ set with linear.cpp's float32 linears
    (the default only where the kernels' target is AVX2-only)."""
    if request.param == "default":
        return None
    from pagedserve.kernels import cpu

    ops = cpu.load()
    if ops is None or not ops.has_linear_f32():
        pytest.skip("C++ kernels without AVX2/FMA (or not built)")
    return cpu.kernel_set(ops, native_linear=True)


@pytest.mark.slow
def test_embedded_gguf_matches_transformers(embedded, hf_from_gguf, kernels):
    prompts = [embedded.tokenizer.encode(p) for p in PROMPTS]
    assert all(len(p) >= 32 for p in prompts)
    check_agreement(embedded, hf_from_gguf, prompts, STEPS, LOGPROB_ATOL, kernels=kernels)


def test_tiny_safetensors_dir_matches_transformers(tiny_llama, tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    prompts = [tiny_llama.tokenizer.encode(p) for p in PROMPTS]
    check_agreement(tiny_llama, hf, prompts, STEPS, LOGPROB_ATOL)


def test_embedded_model_answers_sensibly(embedded):
    """Garbage weights (e.g. a missed Q/K un-permute) would not name the capital."""
    engine = make_engine(embedded)
    text = embedded.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}])
    ids = embedded.tokenizer.encode(text, add_special_tokens=False)
    out = run(engine, [ids], SamplingParams(temperature=0, max_tokens=12))
    assert "Paris" in out[0].outputs[0].text


TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=4096, eos_token_id=2)


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama3-rope-scaling",
                                    "linear-rope-scaling", "tied-llama", "llama-biases",
                                    "mistral-window"])
def test_tiny_family_matches_transformers(family, embedded, tmp_path, kernels):
    """Qwen2's qkv bias, Qwen3's q/k norm and head_dim, Llama 3's and linear rope scaling,
    tied embeddings, Llama's attention and MLP biases, Mistral's sliding window (the context
    capped at it): each switch against transformers' own implementation."""
    import transformers as tf

    from pagedserve.models.loader import load_model_files

    vocab = embedded.tokenizer.vocab_size
    if family == "qwen2":
        cls, config = tf.Qwen2ForCausalLM, tf.Qwen2Config(vocab_size=vocab, **TINY)
    elif family == "qwen3":
        cls, config = tf.Qwen3ForCausalLM, tf.Qwen3Config(vocab_size=vocab, head_dim=32, **TINY)
    elif family == "llama3-rope-scaling":
        scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                   "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
        cls, config = tf.LlamaForCausalLM, tf.LlamaConfig(
            vocab_size=vocab, rope_scaling=scaling, rope_theta=500000.0, **TINY)
    elif family == "linear-rope-scaling":  # (positions divided by the factor)
        cls, config = tf.LlamaForCausalLM, tf.LlamaConfig(
            vocab_size=vocab, rope_scaling={"rope_type": "linear", "factor": 4.0}, **TINY)
    elif family == "llama-biases":
        cls, config = tf.LlamaForCausalLM, tf.LlamaConfig(
            vocab_size=vocab, attention_bias=True, mlp_bias=True, **TINY)
    elif family == "mistral-window":
        cls, config = tf.MistralForCausalLM, tf.MistralConfig(
            vocab_size=vocab, sliding_window=128, **TINY)
    else:
        cls, config = tf.LlamaForCausalLM, tf.LlamaConfig(
            vocab_size=vocab, tie_word_embeddings=True, **TINY)
    save_tiny_hf(tmp_path, cls, config, embedded.tokenizer)
    hf = tf.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    loaded = load_model_files(str(tmp_path), torch.float32)
    # Long prompts, so positions pass the rope-scaling wavelength thresholds; within the
    # window where there is one (the engine refuses more).
    prompts = [embedded.tokenizer.encode(p * 4) for p in PROMPTS[:2]]
    if family == "mistral-window":
        assert loaded.config.max_position_embeddings == 128
        prompts = [p[:128 - STEPS] for p in prompts]
    check_agreement(loaded, hf, prompts, STEPS, LOGPROB_ATOL, kernels=kernels)
