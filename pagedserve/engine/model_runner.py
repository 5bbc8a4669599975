"""Turns a scheduled batch into flat tensors and runs the model over the paged KV cache.

Input preparation (``prepare``) is kept apart from execution (``execute``)."""

import math
import mmap
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


def _kv_cache_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
                    ) -> torch.Tensor:
    """Zeros for a KV cache. On Linux CPUs, in fresh memory advised to use transparent huge
    pages: decode reads scattered blocks across GBs, and with 4 KiB pages nearly every block
    is a TLB miss (huge pages made decode attention 1.2-1.35x faster here). Fresh because
    malloc may hand back heap pages already mapped small."""
    if device.type != "cpu" or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.zeros(shape, dtype=dtype, device=device)
    private = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS  # not shared memory: its THP is off
    memory = mmap.mmap(-1, max(1, math.prod(shape)) * dtype.itemsize, flags=private)
    memory.madvise(mmap.MADV_HUGEPAGE)
    cache = torch.frombuffer(memory, dtype=dtype).view(shape)  # keeps the mapping alive
    return cache.zero_()  # touch every page now, so the memory is committed up front


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
        L, H, d = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim
        if kernels.key_blocks_d_major:
            # The C++ CPU kernels: head-major in memory, so that one head's block is
            # contiguous, with key blocks d-major; the kernels still see [L, N, block_size,
            # H, d] views.
            head_major = (L, H, num_blocks, block_size, d)
            self.v_caches = _kv_cache_zeros(head_major, dtype, device).permute(0, 2, 3, 1, 4)
            k_cache = _kv_cache_zeros((L, H, num_blocks, d, block_size), dtype, device)
            self.k_caches = k_cache.permute(0, 2, 4, 1, 3)
        else:  # Triton and the references: each block one contiguous run (block copy)
            block_major = (L, num_blocks, block_size, H, d)
            self.k_caches = _kv_cache_zeros(block_major, dtype, device)
            self.v_caches = _kv_cache_zeros(block_major, dtype, device)

    def prepare(self, batch: ScheduledBatch) -> ModelInputs:
        seqs, bs, dev = batch.seqs, self.block_size, self.device
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens: list[int] = []
        context_lens: list[int] = []
        for seq in seqs:
            start, n = seq.num_cached_tokens, seq.num_scheduled_tokens
            table = seq.block_table.block_ids
            ids += seq.token_ids[start : start + n]
            positions += range(start, start + n)
            slots += [table[p // bs] * bs + p % bs for p in range(start, start + n)]
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
