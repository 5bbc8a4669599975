"""Load a GGUF file (llama.cpp's format): blocks dequantized once, here, and llama.cpp's
layout changes undone, so that weights come back under Hugging Face's names."""

from __future__ import annotations

import os
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from . import generation_config
from .config import ModelConfig, llama3_rope_scaling
from .gguf_file import GGUFFile, GGUFTensor, read_gguf
from .gguf_quants import dequantize
from .parallel import TensorParallel
from .tokenizer import Tokenizer
from .weights import LoadedModel, ModelLoadError, select_weights

_GGUF_ARCHS = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
_GGUF_GLOBAL = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_GGUF_BLOCK = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Quantization suffixes of GGUF file names ("model.Q4_1.gguf", "model-f16.gguf").
_QUANT_SUFFIX = re.compile(r"[.-](I?Q\d\w*|F16|F32|BF16)$", re.IGNORECASE)



def _unpermute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row order (per head: pairs interleaved) back to rotate-half halves."""
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _gguf_tensor(t: GGUFTensor) -> torch.Tensor:
    w = dequantize(t.data, t.tensor_type)
    return w.reshape(tuple(int(d) for d in reversed(t.shape)))  # GGUF lists dims innermost-first


def gguf_config(path: str) -> tuple[GGUFFile, ModelConfig]:
    """The file (its tensors not yet read) and the model's architecture."""
    try:
        file = read_gguf(path)
    except (OSError, ValueError) as e:  # unreadable, truncated or malformed
        raise ModelLoadError(f"{path}: cannot read GGUF ({e})") from e

    get = file.fields.get
    arch = get("general.architecture")
    if arch not in _GGUF_ARCHS:
        raise ModelLoadError(
            f"{path}: unsupported GGUF architecture {arch!r} (supported: {', '.join(_GGUF_ARCHS)})"
        )

    def meta(key: str, default: Any = None) -> Any:
        return get(f"{arch}.{key}", default)

    tensors = {t.name: t for t in file.tensors}
    if "token_embd.weight" not in tensors:
        raise ModelLoadError(f"{path}: GGUF has no token_embd.weight")
    try:
        hidden = int(meta("embedding_length"))
        heads = int(meta("attention.head_count"))
        config = ModelConfig(
            vocab_size=int(tensors["token_embd.weight"].shape[1]),
            hidden_size=hidden,
            intermediate_size=int(meta("feed_forward_length")),
            num_layers=int(meta("block_count")),
            num_heads=heads,
            num_kv_heads=int(meta("attention.head_count_kv", heads)),
            head_dim=int(meta("attention.key_length", hidden // heads)),
            # Stored as float32; round so 1e-5 reads back as 1e-5, not 9.99999974e-06.
            rms_norm_eps=float(f"{meta('attention.layer_norm_rms_epsilon', 1e-5):.7g}"),
            rope_theta=float(f"{meta('rope.freq_base', 10000.0):.7g}"),
            max_position_embeddings=int(meta("context_length", 2048)),
            tie_word_embeddings="output.weight" not in tensors,
            attention_bias="blk.0.attn_q.bias" in tensors,
            o_proj_bias="blk.0.attn_output.bias" in tensors,
            mlp_bias="blk.0.ffn_up.bias" in tensors,
            qk_norm="blk.0.attn_q_norm.weight" in tensors,
            architecture=_GGUF_ARCHS[arch],
        )
    except (TypeError, ValueError, ZeroDivisionError) as e:
        raise ModelLoadError(f"{path}: incomplete {arch} metadata ({e})") from e
    config.rope_scaling = _gguf_rope_scaling(meta, tensors, config, path)
    return file, config


def load_gguf(path: str, dtype: torch.dtype, tp: TensorParallel) -> LoadedModel:
    file, config = gguf_config(path)
    tp.check(config)  # before any tensor is dequantized

    get = file.fields.get
    arch, heads, kv_heads = get("general.architecture"), config.num_heads, config.num_kv_heads
    tensors = {t.name: t for t in file.tensors}

    # (HF name, GGUF tensor, heads to un-permute by or 0)
    plan: list[tuple[str, GGUFTensor, int]] = []
    for name, t in tensors.items():
        m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", name)
        g = re.fullmatch(r"(\w+)\.weight", name)
        if m and m.group(2) in _GGUF_BLOCK:
            hf = f"model.layers.{m.group(1)}.{_GGUF_BLOCK[m.group(2)]}.{m.group(3)}"
            # llama.cpp permutes Q/K rows for the llama arch only (Q by heads, K by KV heads).
            permute = {"attn_q": heads, "attn_k": kv_heads}.get(m.group(2), 0)
            plan.append((hf, t, permute if arch == "llama" else 0))
        elif g and g.group(1) in _GGUF_GLOBAL:
            plan.append((f"{_GGUF_GLOBAL[g.group(1)]}.weight", t, 0))
        elif name != "rope_freqs.weight":  # rope_freqs is folded into config.rope_scaling
            raise ModelLoadError(f"{path}: unexpected GGUF tensor {name}")

    def convert(item: tuple[str, GGUFTensor, int]) -> torch.Tensor:
        w = _gguf_tensor(item[1])
        return (_unpermute(w, item[2]) if item[2] else w).to(dtype)

    # torch and numpy release the GIL while they dequantize: a few threads overlap tensors.
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        found = dict(zip([hf for hf, _, _ in plan], pool.map(convert, plan), strict=True))
    weights = select_weights(config, found, path, dtype, tp)

    try:
        tokenizer = Tokenizer.from_gguf(file.fields)
    except Exception as e:  # the tokenizers library raises bare Exceptions (bad merges)
        raise ModelLoadError(f"{path}: cannot build tokenizer ({e})") from e
    stem = os.path.basename(path).removesuffix(".gguf")
    name = _QUANT_SUFFIX.sub("", stem) or get("general.basename") or get("general.name") or stem
    try:
        defaults = generation_config.read_gguf(get)
    except ValueError as e:
        raise ModelLoadError(f"{path}: bad general.sampling metadata ({e})") from e
    return LoadedModel(config=config, weights=weights, tokenizer=tokenizer, name=name,
                       shard=(tp.rank, tp.size), sampling_defaults=defaults)


def _gguf_rope_scaling(
    meta: Any, tensors: dict[str, GGUFTensor], config: ModelConfig, path: str
) -> dict[str, Any] | None:
    if "rope_freqs.weight" in tensors:
        factors = _gguf_tensor(tensors["rope_freqs.weight"]).double().numpy()
        scaling = llama3_rope_scaling(factors, config.rope_theta, config.head_dim)
        if scaling is None:
            raise ModelLoadError(f"{path}: rope_freqs.weight does not match Llama 3 RoPE scaling")
        return scaling
    # As llama.cpp reads them: a factor without a type is linear, under the old key too.
    kind = meta("rope.scaling.type", "linear")
    factor = float(meta("rope.scaling.factor") or meta("rope.scale_linear") or 1.0)
    if kind in ("none", "") or (kind == "linear" and factor == 1.0):
        return None
    if kind != "linear":
        raise ModelLoadError(f"{path}: unsupported RoPE scaling {kind!r}")
    return {"rope_type": kind, "factor": factor}
