"""Turns a scheduled batch into flat tensors and runs the model over the paged KV cache.

Input preparation (``prepare``) is kept apart from execution (``execute``)."""

from dataclasses import dataclass

import torch

from pagedserve.kernels import AttentionMetadata, KernelSet
from pagedserve.models.llama import LlamaForCausalLM
from pagedserve.scheduler import ScheduledBatch, Sequence


@dataclass
class ModelInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # the last scheduled token of each sequence


def _padded_tables(seqs: list[Sequence], device: torch.device) -> torch.Tensor:
    width = max((len(s.block_table.block_ids) for s in seqs), default=0)
    rows = [s.block_table.block_ids + [0] * (width - len(s.block_table.block_ids)) for s in seqs]
    return torch.tensor(rows, dtype=torch.int32, device=device).view(len(seqs), width)


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kernels: KernelSet,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        cfg = model.config
        self.model, self.kernels = model, kernels
        self.block_size, self.device = block_size, device
        # The set lays the cache out for its kernels; the model sees [L, N, block_size, H, d].
        self.k_caches, self.v_caches = kernels.allocate_kv_cache(
            cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim, dtype, device)

    def prepare(self, batch: ScheduledBatch) -> ModelInputs:
        seqs, bs, dev = batch.seqs, self.block_size, self.device
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens: list[int] = []
        context_lens: list[int] = []
        for seq in seqs:
            start, n = seq.num_cached_tokens, seq.num_scheduled_tokens
            ids += seq.token_ids[start : start + n]
            positions += range(start, start + n)
            slots += seq.block_table.slots(start, start + n, bs)
            query_lens.append(n)
            context_lens.append(start + n)
        nd = batch.num_decodes
        cu = [0]
        for n in query_lens[nd:]:
            cu.append(cu[-1] + n)
        ends = torch.tensor(query_lens).cumsum(0) - 1

        def i32(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int32, device=dev)

        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            num_decode_tokens=nd,
            decode_block_tables=_padded_tables(seqs[:nd], dev),
            decode_context_lens=i32(context_lens[:nd]),
            prefill_block_tables=_padded_tables(seqs[nd:], dev),
            prefill_cu_seqlens_q=i32(cu),
            prefill_context_lens=i32(context_lens[nd:]),
        )
        return ModelInputs(
            input_ids=torch.tensor(ids, dtype=torch.int64, device=dev),
            positions=torch.tensor(positions, dtype=torch.int64, device=dev),
            meta=meta,
            logits_indices=ends.to(dev),
        )

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> torch.Tensor:
        """Logits [len(batch.seqs), vocab] (model dtype, CPU) at each sequence's last token."""
        if batch.block_copies:
            src, dst = zip(*batch.block_copies, strict=True)
            self.kernels.copy_blocks(
                self.k_caches, self.v_caches,
                torch.tensor(src, device=self.device), torch.tensor(dst, device=self.device))
        inputs = self.prepare(batch)
        hidden = self.model(
            inputs.input_ids, inputs.positions, inputs.meta, self.k_caches, self.v_caches)
        return self.model.compute_logits(hidden[inputs.logits_indices]).cpu()
