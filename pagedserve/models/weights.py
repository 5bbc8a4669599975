"""What a loader returns (LoadedModel), its error, and the checks and tensor-parallel slicing
that both file formats share: weights under Hugging Face's names, each of the shape the
config implies."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from . import generation_config
from .config import ModelConfig
from .parallel import TensorParallel
from .tokenizer import Tokenizer


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
    if cols is not None and w.dim() == 1:  # a row-parallel bias: added once, by rank 0
        return w.clone() if tp.rank == 0 else torch.zeros_like(w)
    if cols is not None:
        return w[:, cols.start : cols.stop].clone()
    if module in ("model.embed_tokens", "lm_head"):
        vocab = tp.vocab_rows(cfg)
        out = w.new_zeros(len(vocab), *w.shape[1:])
        part = w[vocab.start : vocab.stop]  # the last rank's slice may be short: zero padding
        out[: len(part)] = part
        return out
    return w.clone()



def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
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
        if cfg.o_proj_bias:
            layer["self_attn.o_proj.bias"] = (h,)
        if cfg.mlp_bias:
            layer |= {"mlp.gate_proj.bias": (cfg.intermediate_size,),
                      "mlp.up_proj.bias": (cfg.intermediate_size,), "mlp.down_proj.bias": (h,)}
        if cfg.qk_norm:
            layer |= {"self_attn.q_norm.weight": (hd,), "self_attn.k_norm.weight": (hd,)}
        shapes |= {p + k: s for k, s in layer.items()}
    return shapes


def select_weights(
    cfg: ModelConfig, found: Mapping[str, torch.Tensor], path: str, dtype: torch.dtype,
    tp: TensorParallel,
) -> dict[str, torch.Tensor]:
    """Exactly the tensors the architecture needs, shape-checked, in ``dtype``, the rank's
    shard of each; extras outside the layers dropped. A layer tensor the architecture does
    not compute with (a bias or a scale of a variant this decoder lacks) is refused: dropped,
    it would change the output silently. Old checkpoints' RoPE tables are no such part."""
    shapes = expected_shapes(cfg)
    unknown = [name for name in found if name.startswith("model.layers.")
               and name not in shapes and "rotary_emb." not in name]
    if unknown:
        raise ModelLoadError(f"{path}: weight {unknown[0]} is not part of the model this "
                             f"config describes ({len(unknown)} such weights)")
    out = {}
    for name, shape in shapes.items():
        tensor = found.get(name)
        if tensor is None:
            raise ModelLoadError(f"{path}: missing weight {name}")
        if tuple(tensor.shape) != shape:
            raise ModelLoadError(
                f"{path}: weight {name} has shape {tuple(tensor.shape)}, expected {shape}"
            )
        out[name] = shard_weight(name, tensor, cfg, tp).to(dtype)
    return out
