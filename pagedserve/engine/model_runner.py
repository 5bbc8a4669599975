"""Turns a scheduled batch into flat tensors and runs the model over the paged KV cache.

Input preparation (``prepare``) is kept apart from execution (``execute``)."""

import itertools
from dataclasses import dataclass

import torch

from pagedserve.engine.cuda_graphs import DecodeGraphs
from pagedserve.kernels import AttentionMetadata, KernelSet
from pagedserve.models.llama import LlamaForCausalLM
from pagedserve.scheduler import ScheduledBatch, Sequence


@dataclass
class ModelInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # the last scheduled token of each sequence


def _padded_tables(seqs: list[Sequence]) -> tuple[list[int], int]:
    """The block tables of ``seqs`` as one flat row-major list, padded to the widest."""
    width = max((len(s.block_table.block_ids) for s in seqs), default=0)
    flat: list[int] = []
    for s in seqs:
        flat += s.block_table.block_ids
        flat += [0] * (width - len(s.block_table.block_ids))
    return flat, width


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kernels: KernelSet,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        decode_graphs: tuple[int, int] | None = None,
    ):
        """``decode_graphs``: (max batch, max model length) to run decode-only batches on
        persistent buffers, as CUDA graphs on a GPU (engine/cuda_graphs.py); None: eager."""
        cfg = model.config
        self.model, self.kernels = model, kernels
        self.block_size, self.device = block_size, device
        # The set lays the cache out for its kernels; the model sees [L, N, block_size, H, d].
        self.k_caches, self.v_caches = kernels.allocate_kv_cache(
            cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim, dtype, device)
        self.graphs = None
        if decode_graphs is not None:
            max_batch, max_model_len = decode_graphs
            self.graphs = DecodeGraphs(
                model, self.k_caches, self.v_caches, max_batch, max_model_len, block_size,
                device, capture=device.type == "cuda")

    def prepare(self, batch: ScheduledBatch) -> ModelInputs:
        seqs, bs = batch.seqs, self.block_size
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
        ends = [c - 1 for c in itertools.accumulate(query_lens)]
        decode_tables, decode_width = _padded_tables(seqs[:nd])
        prefill_tables, prefill_width = _padded_tables(seqs[nd:])
        # One host-to-device copy per dtype; the fields are views into it.
        input_ids, position_ids, slot_mapping, logits_indices = self._to_device(
            torch.int64, ids, positions, slots, ends)
        decode_tables_t, decode_ctx, prefill_tables_t, cu_t, prefill_ctx = self._to_device(
            torch.int32, decode_tables, context_lens[:nd], prefill_tables, cu,
            context_lens[nd:])
        meta = AttentionMetadata(
            slot_mapping=slot_mapping,
            num_decode_tokens=nd,
            decode_block_tables=decode_tables_t.view(nd, decode_width),
            decode_context_lens=decode_ctx,
            prefill_block_tables=prefill_tables_t.view(len(seqs) - nd, prefill_width),
            prefill_cu_seqlens_q=cu_t,
            prefill_context_lens=prefill_ctx,
        )
        return ModelInputs(input_ids, position_ids, meta, logits_indices)

    def _to_device(self, dtype: torch.dtype, *parts: list[int]) -> tuple[torch.Tensor, ...]:
        host = torch.tensor([v for part in parts for v in part], dtype=dtype)
        if self.device.type != "cpu":  # pinned, so the copy need not wait for the host
            host = host.pin_memory().to(self.device, non_blocking=True)
        return torch.split(host, [len(part) for part in parts])

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> torch.Tensor:
        """Logits [len(batch.seqs), vocab] (model dtype, on the model's device) at each
        sequence's last token; sampling reads them there."""
        if batch.block_copies:
            src, dst = zip(*batch.block_copies, strict=True)
            self.kernels.copy_blocks(
                self.k_caches, self.v_caches,
                torch.tensor(src, device=self.device), torch.tensor(dst, device=self.device))
        if self.graphs is not None and self.graphs.covers(len(batch.seqs), batch.num_decodes):
            return self.graphs.run(batch.seqs)
        inputs = self.prepare(batch)
        hidden = self.model(
            inputs.input_ids, inputs.positions, inputs.meta, self.k_caches, self.v_caches)
        return self.model.compute_logits(hidden[inputs.logits_indices])
