"""Decode steps replayed as CUDA graphs: the host launches one graph instead of hundreds of
kernels, which is most of a small model's decode step on a GPU.

A graph replays fixed addresses and fixed shapes, so:
- the step's inputs live in persistent device buffers, refilled by one host-to-device copy
  per dtype per step (from pinned staging buffers), of the rows the batch uses;
- a batch is padded up to the next captured size (the ladder 1, 2, 4, 8, 16, 32, ... as
  vLLM and nano-vllm do). A padding row writes no K/V (slot -1) and attends to one key of
  block 0; its logits are dropped;
- block tables are as wide as the longest sequence the engine admits.

Only decode-only batches run as graphs; prefill chunks (varying lengths) run eagerly.
Without capture (``capture=False``, and always on CPU) the same padded, persistent-buffer
path runs eagerly: that is how the CPU tests check it against the plain path.
"""

import array
import gc
from collections.abc import Callable, Hashable
from dataclasses import dataclass

import torch

from pagedserve.engine.step_inputs import BlockTableRows, CarriedTokens
from pagedserve.kernels import AttentionMetadata
from pagedserve.models.llama import LlamaForCausalLM
from pagedserve.scheduler import Sequence


def capture_in_one_pool(forwards: dict[Hashable, Callable[[], object]], device: torch.device
                        ) -> tuple[dict[Hashable, torch.cuda.CUDAGraph], dict[Hashable, object]]:
    """Each forward captured as a CUDA graph, in order, all in one memory pool (they never
    run at once, so a later graph may reuse an earlier one's temporaries; what a forward
    returns stays its own). Returns the graphs and the forwards' outputs, by key.
    The garbage collector is off meanwhile (as in vLLM): hundreds of captures in a row
    (piecewise_graphs.py), and a collection inside one would free CUDA memory mid-capture."""
    torch.cuda.synchronize(device)
    graphs, outputs, pool = {}, {}, None
    gc.collect()
    collecting = gc.isenabled()
    gc.disable()
    try:
        for key, forward in forwards.items():
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                outputs[key] = forward()
            pool = graph.pool()
            graphs[key] = graph
    finally:
        if collecting:
            gc.enable()
    torch.cuda.synchronize(device)
    return graphs, outputs


def padded_size(sizes: list[int], n: int) -> int:
    """The smallest captured size that holds n (sizes ascending)."""
    return next(size for size in sizes if size >= n)


def batch_size_ladder(max_batch: int) -> list[int]:
    """Captured sizes: powers of two to 16, then every multiple of 16, up to max_batch."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch]
    sizes += list(range(16, max_batch, 16))
    return sizes + [max_batch]


@dataclass
class _Buffers:
    """Persistent step inputs: two flat buffers (one per dtype) and views into them."""

    int64: torch.Tensor  # input ids | positions | slot mapping
    # context lengths | block tables: a batch of n rows reads the first rows + n * width
    # words, so a step copies those alone (the tables are most of the buffer: max_batch x
    # max_model_len / block_size words)
    int32: torch.Tensor
    int32_used: dict[int, torch.Tensor]  # batch size -> int32's prefix that it reads
    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor

    @classmethod
    def allocate(cls, rows: int, width: int, sizes: list[int], device: torch.device, pin: bool
                 ) -> "_Buffers":
        int64 = torch.zeros(3 * rows, dtype=torch.int64, device=device, pin_memory=pin)
        int32 = torch.zeros(rows + rows * width, dtype=torch.int32, device=device,
                            pin_memory=pin)
        used = {size: int32[: rows + size * width] for size in sizes}
        ids, positions, slots = int64.split(rows)
        context_lens, tables = int32.split([rows, rows * width])
        return cls(int64, int32, used, ids, positions, slots, tables.view(rows, width),
                   context_lens)


@dataclass
class _Staging:
    """A host copy of the buffers, written word by word through memoryviews: no torch call
    per field (each costs microseconds of dispatch, on every decode step)."""

    buffers: _Buffers
    int64_words: memoryview
    int32_words: memoryview

    @classmethod
    def allocate(cls, rows: int, width: int, sizes: list[int], pin: bool) -> "_Staging":
        b = _Buffers.allocate(rows, width, sizes, torch.device("cpu"), pin)
        return cls(b, memoryview(b.int64.numpy()).cast("B").cast("q"),
                   memoryview(b.int32.numpy()).cast("B").cast("i"))


class DecodeGraphs:
    """Runs decode-only batches of up to ``max_batch`` sequences on persistent buffers, as
    captured CUDA graphs when ``capture`` is set."""

    def __init__(self, model: LlamaForCausalLM, k_caches: torch.Tensor, v_caches: torch.Tensor,
                 max_batch: int, max_model_len: int, block_size: int, device: torch.device,
                 capture: bool, table_rows: BlockTableRows):
        self.model, self.k_caches, self.v_caches = model, k_caches, v_caches
        self.block_size, self.sizes = block_size, batch_size_ladder(max_batch)
        width = -(-max_model_len // block_size)
        self.device = device
        self.rows, self.width = max_batch, width
        self.buffers = _Buffers.allocate(max_batch, width, self.sizes, device, pin=False)
        self.staging = [_Staging.allocate(max_batch, width, self.sizes,
                                          pin=device.type == "cuda") for _ in range(2)]
        self.table_rows = table_rows  # the model runner's, shared with its packed path
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}  # each graph's output buffer
        if capture:
            self._capture_all()

    def covers(self, num_seqs: int, num_decodes: int) -> bool:
        return num_seqs == num_decodes and 0 < num_seqs <= self.sizes[-1]

    @torch.inference_mode()
    def run(self, seqs: list[Sequence], carried: CarriedTokens | None = None) -> torch.Tensor:
        """Logits [len(seqs), vocab] for a decode-only batch; ``carried``: input ids still
        on the device."""
        size = padded_size(self.sizes, len(seqs))
        self._fill(seqs, size)
        if carried is not None:
            carried.write_into(self.buffers.input_ids)
        if self.graphs:  # captured: every size has its graph
            self.graphs[size].replay()
            return self.logits[size][: len(seqs)]
        return self._forward(size)[: len(seqs)]

    def _fill(self, seqs: list[Sequence], size: int) -> None:
        """Writes the batch into the staging buffers, padded to ``size`` rows, then copies
        them to the device buffers (one copy per dtype). Host time on every decode step:
        each field goes in as one run of words."""
        # Two staging sets, used in turn: under asynchronous scheduling a step is filled
        # before the previous one's copy is known to have run (its tokens are read after).
        self.staging.reverse()
        s, bs, rows, width = self.staging[0], self.block_size, self.rows, self.width
        n, pad = len(seqs), size - len(seqs)
        # A decode computes exactly one token, at position num_cached_tokens.
        positions = [seq.num_cached_tokens for seq in seqs]
        ids = [seq.token_ids[pos] for seq, pos in zip(seqs, positions, strict=True)]
        slots = [seq.block_table.slot(pos, bs) for seq, pos in zip(seqs, positions, strict=True)]
        # Padding rows: token 0 at position 0, writing nothing (slot -1), one key of block 0.
        words = s.int64_words
        words[:size] = array.array("q", ids + [0] * pad)
        words[rows : rows + size] = array.array("q", positions + [0] * pad)
        words[2 * rows : 2 * rows + size] = array.array("q", slots + [-1] * pad)
        words = s.int32_words
        words[:size] = array.array("i", [pos + 1 for pos in positions] + [1] * pad)
        tables = words[rows:]  # the tables follow the context lengths
        self.table_rows.write(seqs, tables, width)
        for row in range(n, size):
            tables[row * width] = 0
        # Asynchronous from pinned memory; a staging set is rewritten two steps later, when
        # the step between has waited for the sampled ids of the step that used it.
        non_blocking = self.device.type == "cuda"
        self.buffers.int64.copy_(s.buffers.int64, non_blocking=non_blocking)
        self.buffers.int32_used[size].copy_(s.buffers.int32_used[size], non_blocking=non_blocking)

    def _forward(self, size: int) -> torch.Tensor:
        b = self.buffers
        empty = b.context_lens[:0]
        meta = AttentionMetadata(
            slot_mapping=b.slot_mapping[:size], num_decode_tokens=size,
            decode_block_tables=b.block_tables[:size], decode_context_lens=b.context_lens[:size],
            prefill_block_tables=b.block_tables[:0], prefill_cu_seqlens_q=empty,
            prefill_context_lens=empty)
        hidden = self.model(b.input_ids[:size], b.positions[:size], meta, self.k_caches,
                            self.v_caches)
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def run_each_size(self) -> None:
        """Every captured size once, eagerly, on padding rows (no K/V written): Triton
        compiles its kernels on first launch, which cannot happen inside a capture."""
        self.buffers.slot_mapping.fill_(-1)
        self.buffers.context_lens.fill_(1)
        for size in reversed(self.sizes):
            self._forward(size)

    @torch.inference_mode()
    def _capture_all(self) -> None:
        """Captures the largest size first, so the smaller graphs reuse its memory pool;
        the buffers still hold run_each_size()'s padding rows, so nothing writes K/V."""
        self.run_each_size()
        self.graphs, self.logits = capture_in_one_pool(
            {size: lambda size=size: self._forward(size) for size in reversed(self.sizes)},
            self.device)
