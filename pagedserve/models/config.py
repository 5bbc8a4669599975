"""Architecture hyper-parameters of a Llama-family decoder."""

import logging
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

log = logging.getLogger("pagedserve.models")


@dataclass
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # HF's dict, e.g. {"rope_type": "llama3", ...}
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # biases on the q/k/v projections (Qwen2's always)
    o_proj_bias: bool = False  # and on o_proj (Llama's and Qwen3's attention_bias)
    mlp_bias: bool = False  # on gate/up/down (Llama's mlp_bias)
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k before RoPE
    architecture: str = "llama"

    def __post_init__(self) -> None:
        # What no kernel can run is refused as the config is read, from either file format,
        # not at the first step.
        if self.num_heads < 1 or self.num_kv_heads < 1 or self.num_heads % self.num_kv_heads:
            raise ValueError(f"{self.num_heads} attention heads do not share "
                             f"{self.num_kv_heads} KV heads evenly")

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "ModelConfig":
        """From a Hugging Face config.json (Llama, Mistral, Qwen2 or Qwen3 for causal LM).
        ValueError for anything this decoder would compute differently from transformers:
        another architecture, activation or quantization, or a field of the wrong type."""
        if not isinstance(cfg, dict):
            raise ValueError("config.json must hold a JSON object")
        arch = _architecture(cfg)
        model_type = _HF_ARCHS[arch]
        if cfg.get("hidden_act", "silu") not in ("silu", "swish"):
            raise ValueError(f"hidden_act {cfg['hidden_act']!r} is not supported (only silu)")
        quant = cfg.get("quantization_config")
        if quant:
            method = quant.get("quant_method") if isinstance(quant, dict) else quant
            raise ValueError(f"quantized checkpoints ({method!r}) are not supported: use an "
                             "unquantized one, or a GGUF file")
        heads = _int(cfg, "num_attention_heads")
        hidden = _int(cfg, "hidden_size")
        bias = _flag(cfg, "attention_bias", False)
        layers = _int(cfg, "num_hidden_layers")
        context = _int(cfg, "max_position_embeddings", 2048)
        window = _sliding_window(cfg, model_type, layers)
        if window is not None and window < context:
            # Within the window every token sees the whole context, as with full attention,
            # which is all the kernels compute: the context is capped at the window.
            log.warning("%s attends within a sliding window of %d tokens: its context is "
                        "capped there, from %d", arch, window, context)
            context = window
        return cls(
            vocab_size=_int(cfg, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_int(cfg, "intermediate_size"),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=_int(cfg, "num_key_value_heads", heads),
            head_dim=_int(cfg, "head_dim", hidden // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(cfg.get("rope_theta")
                             or (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
            rope_scaling=_rope_scaling(cfg),
            max_position_embeddings=context,
            tie_word_embeddings=_flag(cfg, "tie_word_embeddings", False),
            # Qwen2's q/k/v always have biases; Llama's and Qwen3's attention_bias puts them on
            # o_proj too; Mistral has none.
            attention_bias=model_type == "qwen2" or (model_type in ("llama", "qwen3") and bias),
            o_proj_bias=model_type in ("llama", "qwen3") and bias,
            mlp_bias=model_type == "llama" and _flag(cfg, "mlp_bias", False),
            qk_norm=model_type == "qwen3",
            architecture=arch,
        )


# The transformers classes whose computation this decoder reproduces, and their model_type.
_HF_ARCHS = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
             "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}


def _architecture(cfg: dict[str, Any]) -> str:
    archs = cfg.get("architectures")
    if archs:
        arch = archs[0] if isinstance(archs, list) else archs
    else:  # no class named: the model_type's (llama when neither is there)
        by_type = {t: a for a, t in _HF_ARCHS.items()}
        arch = by_type.get(cfg.get("model_type", "llama"), f"model_type {cfg.get('model_type')!r}")
    if arch not in _HF_ARCHS:
        raise ValueError(f"unsupported architecture {arch} (supported: {', '.join(_HF_ARCHS)})")
    return arch


def _sliding_window(cfg: dict[str, Any], model_type: str, num_layers: int) -> int | None:
    """The window of the layers that attend within one, as transformers decides them: every
    layer of a Mistral with one; for Qwen2/Qwen3 with use_sliding_window set, the layers
    config.layer_types marks or, where it is absent, those from max_window_layers on."""
    if cfg.get("sliding_window") is None or model_type == "llama":
        return None
    if model_type in ("qwen2", "qwen3"):
        if not cfg.get("use_sliding_window"):
            return None
        types = cfg.get("layer_types")
        if types is None:
            types = ["sliding_attention" if i >= _int(cfg, "max_window_layers", 28, least=0) else ""
                     for i in range(num_layers)]
        if "sliding_attention" not in types:
            return None
    return _int(cfg, "sliding_window")


def _int(cfg: dict[str, Any], key: str, default: int | None = None, least: int = 1) -> int:
    value = cfg.get(key)
    if value is None:
        if default is None:
            raise ValueError(f"{key} is missing")
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{key} must be an integer of at least {least}, not {value!r}")
    return value


def _flag(cfg: dict[str, Any], key: str, default: bool) -> bool:
    value = cfg.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ValueError(f"{key} must be true or false, not {value!r}")
    return value


def _rope_scaling(cfg: dict[str, Any]) -> dict[str, Any] | None:
    scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters")
    if not scaling:
        return None
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return None
    if kind not in ROPE_SCALINGS:
        raise ValueError(f"unsupported rope scaling {kind!r} (supported: "
                         f"{', '.join(ROPE_SCALINGS)})")
    return dict(scaling, rope_type=kind)


ROPE_SCALINGS = ("llama3", "linear")  # what llama.rope_inv_freq computes


def llama3_rope_scaling(factors: np.ndarray, theta: float, head_dim: int) -> dict[str, Any] | None:
    """llama.cpp stores Llama 3.1's frequency scaling as a per-frequency tensor; recover the
    HF parameters by checking it against the formula with Meta's published constants."""
    factor, low, high, original = float(factors.max()), 1.0, 4.0, 8192
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    expected = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < original / high:
            expected.append(1.0)
        elif wavelen > original / low:
            expected.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            expected.append(1 / ((1 - smooth) / factor + smooth))
    if factors.shape != freqs.shape or not np.allclose(factors, expected, rtol=1e-3):
        return None
    return {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": low,
        "high_freq_factor": high,
        "original_max_position_embeddings": original,
    }
