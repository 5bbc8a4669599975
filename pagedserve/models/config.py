"""Architecture hyper-parameters of a Llama-family decoder."""

import math
from dataclasses import dataclass
from typing import Any

import numpy as np


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
    attention_bias: bool = False  # Qwen2: biases on the q/k/v projections
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k before RoPE
    architecture: str = "llama"

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "ModelConfig":
        """From a Hugging Face config.json (Llama, Qwen2 or Qwen3 for causal LM)."""
        arch = (cfg.get("architectures") or ["LlamaForCausalLM"])[0]
        model_type = cfg.get("model_type", "llama")
        heads = cfg["num_attention_heads"]
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=cfg.get("rope_theta")
            or (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0),
            rope_scaling=_rope_scaling(cfg),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=cfg.get("attention_bias", model_type == "qwen2"),
            qk_norm=model_type == "qwen3",
            architecture=arch,
        )


def _rope_scaling(cfg: dict[str, Any]) -> dict[str, Any] | None:
    scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters")
    if not scaling:
        return None
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    return None if kind == "default" else dict(scaling, rope_type=kind)


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
