"""A Hugging Face config.json read as transformers reads it: which biases each family has,
the context a sliding window caps, and a clear refusal (one line through the loader) of
whatever this decoder would compute differently, rather than a silently wrong model."""

import json

import pytest
import torch
from safetensors import torch as safetensors_torch

from pagedserve.models.config import ModelConfig
from pagedserve.models.loader import ModelLoadError, load_model_files

BASE = {"vocab_size": 32, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}


def config(arch: str, **fields) -> dict:
    model_type = arch.removesuffix("ForCausalLM").lower()
    return BASE | {"architectures": [arch], "model_type": model_type} | fields


@pytest.mark.parametrize("cfg, biases", [
    (config("LlamaForCausalLM"), (False, False, False)),
    (config("LlamaForCausalLM", attention_bias=True), (True, True, False)),
    (config("LlamaForCausalLM", mlp_bias=True), (False, False, True)),
    (config("Qwen2ForCausalLM"), (True, False, False)),
    (config("Qwen2ForCausalLM", attention_bias=False), (True, False, False)),  # not read
    (config("Qwen3ForCausalLM", attention_bias=True), (True, True, False)),
    (config("MistralForCausalLM", attention_bias=True), (False, False, False)),  # not read
])
def test_biases_follow_each_family(cfg, biases):
    """(q/k/v, o_proj, MLP) biases, as transformers' classes build their Linear layers."""
    c = ModelConfig.from_hf(cfg)
    assert (c.attention_bias, c.o_proj_bias, c.mlp_bias) == biases


@pytest.mark.parametrize("cfg, context", [
    (config("MistralForCausalLM", sliding_window=16), 16),
    (config("MistralForCausalLM", sliding_window=None), 64),
    (config("MistralForCausalLM", sliding_window=4096), 64),
    (config("Qwen2ForCausalLM", use_sliding_window=True, sliding_window=32,
            max_window_layers=1), 32),
    # max_window_layers defaults to 28, past the last layer: no layer slides
    (config("Qwen2ForCausalLM", use_sliding_window=True, sliding_window=32), 64),
    (config("Qwen2ForCausalLM", use_sliding_window=False, sliding_window=32,
            max_window_layers=0), 64),
    (config("Qwen3ForCausalLM", use_sliding_window=True, sliding_window=24,
            layer_types=["full_attention", "sliding_attention"]), 24),
    (config("Qwen3ForCausalLM", use_sliding_window=True, sliding_window=24,
            layer_types=["full_attention", "full_attention"], max_window_layers=0), 64),
    (config("LlamaForCausalLM", sliding_window=8), 64),  # no such thing in a Llama
])
def test_a_sliding_window_caps_the_context(cfg, context):
    """Within its window a sliding layer sees the whole context, as a full one does."""
    assert ModelConfig.from_hf(cfg).max_position_embeddings == context


@pytest.mark.parametrize("cfg, message", [
    (config("GemmaForCausalLM"), "unsupported architecture GemmaForCausalLM"),
    (config("LlamaForSequenceClassification"), "unsupported architecture"),
    (BASE | {"model_type": "gpt2"}, "unsupported architecture model_type 'gpt2'"),
    (config("LlamaForCausalLM", hidden_act="gelu"), "hidden_act 'gelu'"),
    (config("LlamaForCausalLM", quantization_config={"quant_method": "fp8"}),
     "quantized checkpoints ('fp8')"),
    (config("LlamaForCausalLM", num_attention_heads="4"), "num_attention_heads must be an int"),
    (config("LlamaForCausalLM", num_attention_heads=0), "num_attention_heads must be an int"),
    (config("LlamaForCausalLM", tie_word_embeddings="yes"), "tie_word_embeddings must be"),
    (config("LlamaForCausalLM", vocab_size=None), "vocab_size is missing"),
    ([BASE], "must hold a JSON object"),
    (config("LlamaForCausalLM", num_key_value_heads=3), "4 attention heads do not share 3 KV"),
    (config("LlamaForCausalLM", rope_scaling={"rope_type": "yarn", "factor": 4.0}),
     "unsupported rope scaling 'yarn'"),
    (config("LlamaForCausalLM", rope_scaling=[1]), "bad config.json"),
])
def test_what_would_compute_differently_is_one_line_from_the_loader(tmp_path, cfg, message):
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="bad config.json") as err:
        load_model_files(str(tmp_path))
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_layer_weight_the_config_does_not_use_is_refused(tmp_path):
    """An o_proj bias under a config without attention_bias: dropped, it would change every
    output. An old checkpoint's RoPE table is no such weight."""
    cfg = ModelConfig.from_hf(config("LlamaForCausalLM"))
    from pagedserve.models.weights import expected_shapes

    weights = {name: torch.zeros(shape) for name, shape in expected_shapes(cfg).items()}
    weights["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.zeros(2)
    (tmp_path / "config.json").write_text(json.dumps(config("LlamaForCausalLM")))
    safetensors_torch.save_file(weights, tmp_path / "model.safetensors")
    with pytest.raises(ModelLoadError, match="tokenizer"):  # the weights passed
        load_model_files(str(tmp_path))
    weights["model.layers.1.self_attn.o_proj.bias"] = torch.zeros(16)
    safetensors_torch.save_file(weights, tmp_path / "model.safetensors")
    with pytest.raises(ModelLoadError, match="weight model.layers.1.self_attn.o_proj.bias is "
                                             "not part of the model"):
        load_model_files(str(tmp_path))


def test_rope_scaling_named_by_its_older_type_key():
    """Older configs name the scaling "type" (transformers reads it as rope_type)."""
    cfg = ModelConfig.from_hf(config("LlamaForCausalLM",
                                     rope_scaling={"type": "linear", "factor": 2.0}))
    assert cfg.rope_scaling is not None and cfg.rope_scaling["rope_type"] == "linear"
    assert cfg.rope_scaling["factor"] == 2.0


def test_rope_theta_from_rope_parameters():
    """transformers v5 writes rope_theta inside rope_parameters: read from there when the
    top level has none (a Llama 3 read with 10000 would drift from the first tokens)."""
    cfg = ModelConfig.from_hf(config("LlamaForCausalLM", rope_parameters={
        "rope_type": "default", "rope_theta": 500000.0}))
    assert cfg.rope_theta == 500000.0 and cfg.rope_scaling is None


def test_untied_unless_the_config_says_tied():
    """A config.json without tie_word_embeddings has its own lm_head (transformers'
    default for these architectures): its lm_head.weight is read, not the embeddings."""
    assert ModelConfig.from_hf(config("LlamaForCausalLM")).tie_word_embeddings is False
    assert ModelConfig.from_hf(config("LlamaForCausalLM",
                                      tie_word_embeddings=True)).tie_word_embeddings


BASE = {"vocab_size": 32, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
        "architectures": ["LlamaForCausalLM"], "model_type": "llama"}


@pytest.mark.parametrize("act", ["silu", "swish"])
def test_silu_under_either_name_is_taken(act):
    assert ModelConfig.from_hf(BASE | {"hidden_act": act}).num_layers == 2
