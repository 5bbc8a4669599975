"""Tensor parallelism inside the model (Megatron's split): which query heads, KV heads, MLP
columns and vocabulary rows one rank holds, and the collectives the forward pass needs.

Column-parallel layers (QKV, gate/up) keep whole output rows of the rank's heads/columns;
row-parallel layers (o_proj, down) take the matching input columns, so each yields a partial
sum that one all-reduce completes. The embedding and lm_head split the vocabulary."""

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from pagedserve.models.config import ModelConfig


class TensorParallelError(ValueError):
    """The model cannot be split over this many ranks."""


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1
    group: Any = None  # the torch.distributed group of the ranks (None for one rank)

    def check(self, cfg: ModelConfig) -> None:
        """Raise TensorParallelError, naming the sizes that work, unless this one does."""
        n = self.size
        if not _splits(cfg, n):
            return
        valid = [k for k in range(1, cfg.num_heads + 1) if not _splits(cfg, k)]
        raise TensorParallelError(
            f"--tensor-parallel-size {n} cannot split this model ({cfg.num_heads} query heads, "
            f"{cfg.num_kv_heads} KV heads, MLP width {cfg.intermediate_size}): "
            f"{_splits(cfg, n)}. Sizes that work: {', '.join(map(str, valid))}.")

    def q_heads(self, cfg: ModelConfig) -> range:
        per = cfg.num_heads // self.size
        return range(self.rank * per, (self.rank + 1) * per)

    def kv_heads(self, cfg: ModelConfig) -> range:
        """The rank's KV heads; with fewer KV heads than ranks each rank keeps (a replica
        of) the one its query heads read, as vLLM does."""
        if cfg.num_kv_heads % self.size == 0:
            per = cfg.num_kv_heads // self.size
            return range(self.rank * per, (self.rank + 1) * per)
        head = self.rank // (self.size // cfg.num_kv_heads)
        return range(head, head + 1)

    def mlp_columns(self, cfg: ModelConfig) -> range:
        per = cfg.intermediate_size // self.size
        return range(self.rank * per, (self.rank + 1) * per)

    def vocab_rows(self, cfg: ModelConfig) -> range:
        """The rank's vocabulary rows, padded to an equal count on every rank (the last
        rank's padding rows are zeros and never looked up)."""
        per = -(-cfg.vocab_size // self.size)
        return range(self.rank * per, (self.rank + 1) * per)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum the ranks' partial results, in place."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def embed(self, embedding: torch.nn.Embedding, ids: torch.Tensor, cfg: ModelConfig
              ) -> torch.Tensor:
        """Vocab-parallel lookup: each rank fills the rows of its own ids, zeros elsewhere,
        and an all-reduce adds them up."""
        if self.size == 1:
            return embedding(ids)
        rows = self.vocab_rows(cfg)
        local = ids - rows.start
        mine = (local >= 0) & (local < len(rows))
        x = embedding(torch.where(mine, local, 0))
        x.mul_(mine.unsqueeze(-1).to(x.dtype))
        return self.all_reduce(x)

    def gather_logits(self, local: torch.Tensor, cfg: ModelConfig) -> torch.Tensor | None:
        """The full logits on rank 0 (None on the others): each rank's vocabulary slice,
        concatenated, padding dropped."""
        if self.size == 1:
            return local
        parts = [torch.empty_like(local) for _ in range(self.size)] if self.rank == 0 else None
        dist.gather(local, parts, dst=0, group=self.group)
        return None if parts is None else torch.cat(parts, dim=-1)[:, : cfg.vocab_size]


def _splits(cfg: ModelConfig, n: int) -> str:
    """Why ``n`` ranks cannot split the model ("" when they can)."""
    if cfg.num_heads % n:
        return f"{cfg.num_heads} query heads do not divide by {n}"
    if cfg.num_kv_heads % n and n % cfg.num_kv_heads:
        return (f"{cfg.num_kv_heads} KV heads neither divide by {n} nor can be replicated "
                f"evenly over {n} ranks")
    if cfg.intermediate_size % n:
        return f"the MLP width {cfg.intermediate_size} does not divide by {n}"
    return ""
