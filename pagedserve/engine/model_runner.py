"""Turns a scheduled batch into flat tensors and runs the model over the paged KV cache.

Input preparation (``prepare``) is kept apart from execution (``run``). ``prepare`` packs a
step into a small header of sizes and one int64 tensor holding every field back to back
(the int32 ones two to a word, read back as int32 views); under tensor parallelism that
pair is all the other ranks receive (engine/distributed.py), and every rank unpacks and
runs it the same way."""

import array
import itertools
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Protocol

import torch

from pagedserve.engine.cuda_graphs import DecodeGraphs
from pagedserve.engine.piecewise_graphs import PiecewiseGraphs
from pagedserve.engine.step_inputs import (
    BlockTableRows,
    CarriedTokens,
    on_device,
    padded_tables,
)
from pagedserve.kernels import AttentionMetadata, KernelSet
from pagedserve.models.llama import LlamaForCausalLM
from pagedserve.models.loader import LoadedModel
from pagedserve.models.parallel import TensorParallel
from pagedserve.scheduler import ScheduledBatch, Sequence

# header: [command, tokens, sequences, decodes, decode table width, prefill table width,
#          block copies, sampled rows, longest prefill chunk]
HEADER_LEN = 9
STEP, STOP = 1, 0


@dataclass
class ModelInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # the last token of each sequence that samples this step
    copy_src: torch.Tensor  # copy-on-write block copies, done before the forward
    copy_dst: torch.Tensor


class StepChannel(Protocol):
    """Rank 0's link to the other ranks (engine/distributed.py)."""

    def send(self, header: list[int], payload: torch.Tensor) -> torch.Tensor:
        """Broadcast a step; returns the payload on this rank's device."""

    def fatal_errors(self) -> AbstractContextManager[None]:
        """Any error inside leaves the ranks out of step (it becomes fatal)."""


def payload_sizes(header: list[int]) -> list[int]:
    """The lengths of the packed fields, in int64 words, in order, from a step's header:
    the int64 fields, a word of padding or none, then each int32 field (int32_sizes)."""
    _, T, S, nd, dw, pw, C, R, _ = header
    int64_fields = [T, T, T, R, C, C]
    return [*int64_fields, sum(int64_fields) % 2, *map(_int32_words, int32_sizes(header))]


def int32_sizes(header: list[int]) -> list[int]:
    """The lengths of the int32 fields, which the kernels read as int32: packed so, they
    need no conversion on the device (a launch each, every step)."""
    _, _, S, nd, dw, pw, *_ = header
    P = S - nd
    return [nd * dw, nd, P * pw, P + 1, P]


def _int32_words(n: int) -> int:
    """The int64 words that hold n int32s, padded to 16 bytes: every field starts 16-byte
    aligned, as a tensor of its own would (Triton specializes a kernel on its pointers'
    alignment, so an offset that varied with the step would build new variants)."""
    return -(-n // 4) * 2


def pack_step(*, ids: list[int], positions: list[int], slots: list[int],
              sampled_rows: list[int], copy_src: list[int], copy_dst: list[int],
              decode_tables: list[int] | array.array, decode_width: int,
              decode_lens: list[int],
              prefill_tables: list[int], prefill_width: int, cu_seqlens_q: list[int],
              prefill_lens: list[int]) -> tuple[list[int], torch.Tensor]:
    """A step's fields as (header, payload), in the order payload_sizes() reads them back.
    Tables are row-major, each row padded to its width."""
    longest = max((b - a for a, b in itertools.pairwise(cu_seqlens_q)), default=0)
    nd = len(decode_lens)
    header = [STEP, len(ids), nd + len(prefill_lens), nd, decode_width, prefill_width,
              len(copy_src), len(sampled_rows), longest]
    words = array.array("q", itertools.chain(ids, positions, slots, sampled_rows, copy_src,
                                             copy_dst))
    words.extend([0] * (len(words) % 2))  # so the int32 fields start 16-byte aligned
    for field in (decode_tables, decode_lens, prefill_tables, cu_seqlens_q, prefill_lens):
        halves = array.array("i", field)
        halves.extend([0] * (-len(halves) % 4))
        words.frombytes(halves.tobytes())  # two to an int64 word
    return header, (torch.frombuffer(words, dtype=torch.int64) if words
                    else torch.empty(0, dtype=torch.int64))


def samples(seq: Sequence) -> bool:
    """A sequence samples a token when its whole input is computed by this step (a prompt
    chunk before the last samples nothing)."""
    return seq.num_cached_tokens + seq.num_scheduled_tokens == seq.num_tokens


def prompt_logprob_positions(seq: Sequence) -> range:
    """The prompt positions whose next-token logits this step's rows include for the
    request's prompt logprobs (position p's logits predict prompt token p + 1)."""
    if not seq.wants_prompt_logprobs:
        return range(0)
    start = seq.num_cached_tokens
    return range(max(start, seq.prompt_logprobs_done),
                 min(start + seq.num_scheduled_tokens, seq.num_prompt_tokens - 1))


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kernels: KernelSet,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        channel: StepChannel | None = None,
        decode_graphs: tuple[int, int] | None = None,
        piecewise_max_tokens: int | None = None,
        whole_graphs: bool = False,
    ):
        """``channel``: the other ranks under tensor parallelism. ``decode_graphs``: (max
        batch, max model length) to run decode-only batches on persistent buffers, as CUDA
        graphs on a GPU (engine/cuda_graphs.py); None: eager. ``piecewise_max_tokens``: the
        token budget, to run the other steps' forwards in pieces on persistent buffers,
        graphs on a GPU too (engine/piecewise_graphs.py); None: eager. ``whole_graphs``:
        those forwards whole, attention included (with the decode graphs' bounds)."""
        cfg, tp = model.config, model.tp
        self.model, self.kernels, self.channel = model, kernels, channel
        self.block_size, self.device = block_size, device
        # The set lays the cache out for its kernels; the model sees [L, N, block_size, H, d].
        # Under tensor parallelism a rank holds only its KV heads, at the same block ids.
        self.k_caches, self.v_caches = kernels.allocate_kv_cache(
            cfg.num_layers, num_blocks, block_size, len(tp.kv_heads(cfg)), cfg.head_dim,
            dtype, device)
        self.graphs, self.pieces = None, None
        self.table_rows = BlockTableRows()  # the decodes' block tables, kept between steps
        if (decode_graphs or piecewise_max_tokens) and channel is not None:
            raise ValueError("CUDA graphs do not run under tensor parallelism")
        capture = device.type == "cuda"
        if decode_graphs is not None:
            max_batch, max_model_len = decode_graphs
            self.graphs = DecodeGraphs(
                model, self.k_caches, self.v_caches, max_batch, max_model_len, block_size,
                device, capture, self.table_rows)
        if piecewise_max_tokens is not None:
            whole = (*decode_graphs, block_size) if whole_graphs and decode_graphs else None
            self.pieces = PiecewiseGraphs(
                model, self.k_caches, self.v_caches, piecewise_max_tokens, device, capture,
                whole)

    def prepare(self, batch: ScheduledBatch) -> tuple[list[int], torch.Tensor]:
        """The step as (header, payload): sizes, and every field in one int64 host tensor."""
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
        # Logits only for the rows that sample (a prompt chunk's would be thrown away), then
        # the prompt positions of requests that asked for prompt logprobs.
        ends = [end - 1 for end, seq in zip(itertools.accumulate(query_lens), seqs, strict=True)
                if samples(seq)]
        offset = 0
        for seq, n in zip(seqs, query_lens, strict=True):
            ends += [offset + p - seq.num_cached_tokens for p in prompt_logprob_positions(seq)]
            offset += n
        src, dst = (list(x) for x in zip(*batch.block_copies, strict=True)) \
            if batch.block_copies else ([], [])
        decode_tables, decode_width = self.table_rows.padded(seqs[:nd])
        prefill_tables, prefill_width = padded_tables(seqs[nd:])
        return pack_step(
            ids=ids, positions=positions, slots=slots, sampled_rows=ends, copy_src=src,
            copy_dst=dst, decode_tables=decode_tables, decode_width=decode_width,
            decode_lens=context_lens[:nd], prefill_tables=prefill_tables,
            prefill_width=prefill_width, cu_seqlens_q=cu, prefill_lens=context_lens[nd:])

    @staticmethod
    def unpack(header: list[int], payload: torch.Tensor) -> ModelInputs:
        """The fields of a packed step, as views (int32 where the kernels want it)."""
        nd, dw, pw = header[3:6]
        P = header[2] - nd
        fields = torch.split(payload, payload_sizes(header))
        ids, positions, slots, ends, src, dst = fields[:6]
        decode_tables, decode_ctx, prefill_tables, cu, prefill_ctx = (
            words.view(torch.int32)[:n]
            for words, n in zip(fields[7:], int32_sizes(header), strict=True))
        meta = AttentionMetadata(
            slot_mapping=slots,
            num_decode_tokens=nd,
            decode_block_tables=decode_tables.view(nd, dw),
            decode_context_lens=decode_ctx,
            prefill_block_tables=prefill_tables.view(P, pw),
            prefill_cu_seqlens_q=cu,
            prefill_context_lens=prefill_ctx,
            prefill_max_query_len=header[8],
        )
        return ModelInputs(ids, positions, meta, ends, src, dst)

    def execute(self, batch: ScheduledBatch, carried: CarriedTokens | None = None
                ) -> torch.Tensor:
        """Logits [sequences that sample, vocab] (model dtype, on the model's device), in
        batch order, at each such sequence's last token; sampling reads them there. Then a
        row per prompt_logprob_positions() of each sequence, in batch order. ``carried``:
        input ids still on the device (asynchronous scheduling; one rank only)."""
        if self.graphs is not None and self.graphs.covers(len(batch.seqs), batch.num_decodes):
            return self._run_graph(batch, carried)  # a decode-only batch: every row samples
        return self._run_everywhere(*self.prepare(batch), carried)

    def _run_everywhere(self, header: list[int], payload: torch.Tensor,
                        carried: CarriedTokens | None = None, plain: bool = False
                        ) -> torch.Tensor | None:
        """run() on this rank and, under tensor parallelism, on every other."""
        if self.channel is None:
            if self.device.type != "cpu":  # pinned, so the copy need not wait for the host
                payload = payload.pin_memory().to(self.device, non_blocking=True)
            return self.run(header, payload, carried, plain)
        if carried is not None:
            raise ValueError("carried input ids do not reach the other ranks")
        with self.channel.fatal_errors():
            return self.run(header, self.channel.send(header, payload))

    def warm_up(self, max_tokens: int, max_model_len: int) -> None:
        """Two dummy steps, so that no request waits for what a first step builds: every
        kernel variant a step can launch (Triton builds one, for up to seconds, on the launch
        that first needs it; kernels/triton/common.py) and, from the allocator, a large
        step's activations. Each step carries a block copy, a decode and a prefill chunk of up to
        ``max_tokens`` tokens: the first decode's block table spans ``max_model_len`` tokens
        (attention kernels split the KV of long contexts), the second's one block. They
        write nothing (every slot is -1) and read only block 0, which they copy onto itself."""
        bs = self.block_size
        prefill_len = max(1, min(max_tokens, max_model_len) - 1)
        prefill_width = -(-prefill_len // bs)
        tokens = 1 + prefill_len
        # With whole graphs these steps fit them, but a step past them runs the plain
        # forward, whose kernels' grids are sized on the host: each step both ways.
        whole = self.pieces is not None and self.pieces.whole
        for decode_width in (-(-max_model_len // bs), 1):
            step = pack_step(
                ids=[0] * tokens, positions=[0, *range(prefill_len)], slots=[-1] * tokens,
                sampled_rows=[0, tokens - 1], copy_src=[0], copy_dst=[0],
                decode_tables=[0] * decode_width, decode_width=decode_width, decode_lens=[1],
                prefill_tables=[0] * prefill_width, prefill_width=prefill_width,
                cu_seqlens_q=[0, prefill_len], prefill_lens=[prefill_len])
            for plain in (False, True) if whole else (False,):
                self._run_everywhere(*step, plain=plain)

    @torch.inference_mode()
    def _run_graph(self, batch: ScheduledBatch, carried: CarriedTokens | None) -> torch.Tensor:
        if batch.block_copies:
            src, dst = zip(*batch.block_copies, strict=True)
            self.kernels.copy_blocks(self.k_caches, self.v_caches,
                                     on_device(list(src), self.device),
                                     on_device(list(dst), self.device))
        return self.graphs.run(batch.seqs, carried)

    @torch.inference_mode()
    def run(self, header: list[int], payload: torch.Tensor,
            carried: CarriedTokens | None = None, plain: bool = False) -> torch.Tensor | None:
        """One forward of a packed step, on every rank; the logits on rank 0 only.
        ``plain``: the model's own forward, even where the pieces would cover the step."""
        inputs = self.unpack(header, payload)
        if carried is not None:
            carried.write_into(inputs.input_ids)
        if len(inputs.copy_src):
            self.kernels.copy_blocks(self.k_caches, self.v_caches, inputs.copy_src,
                                     inputs.copy_dst)
        if not plain and self.pieces is not None and self.pieces.covers(
                len(inputs.input_ids), header[2]):  # [2]: sequences
            hidden = self.pieces.forward(inputs.input_ids, inputs.positions, inputs.meta)
        else:
            hidden = self.model(
                inputs.input_ids, inputs.positions, inputs.meta, self.k_caches, self.v_caches)
        if not len(inputs.logits_indices):  # same on every rank: nobody gathers
            cfg = self.model.config
            return hidden.new_empty(0, cfg.vocab_size) if self.model.tp.rank == 0 else None
        return self.model.compute_logits(hidden[inputs.logits_indices])


def bf16_packing_supported() -> bool:
    return torch.ops.mkldnn._is_mkldnn_bf16_supported()


def build_model(
    loaded: LoadedModel, kernels: KernelSet, max_len: int, dtype: torch.dtype,
    device: torch.device, tp: TensorParallel | None = None,
) -> LlamaForCausalLM:
    """The model on ``device`` with ``loaded``'s weights (this rank's shard of them)."""
    tp = tp or TensorParallel()
    loaded = loaded.sharded(tp)
    with torch.device("meta"):  # no random init: every weight comes from the checkpoint
        model = LlamaForCausalLM(loaded.config, kernels, max_len, tp)
    # Memory for every tensor, floats in ``dtype``. Not to_empty(): its empty_like() of a meta
    # tensor goes through torch's Python reference ops and imports sympy (~0.4 s a start).
    model = model._apply(lambda t: torch.empty(
        t.shape, dtype=dtype if t.is_floating_point() else t.dtype, device=device))
    model.rope.compute_tables()  # in float32 again: their memory is unset and now in dtype
    # Copied in from the host one parameter at a time: never a second copy of every weight
    # on the device (it stayed in torch's cache, counted as used by the KV pool's check).
    model.load_weights(loaded.weights)
    # oneDNN packs float32 weights on any CPU, bf16 ones only where the CPU has native bf16
    # (AVX-512 BF16, AMX or AVX-NE-CONVERT); elsewhere bf16 matmuls stay plain (and slow:
    # dtype auto picks float32 there).
    if device.type == "cpu" and (dtype == torch.float32 or (
            dtype == torch.bfloat16 and bf16_packing_supported())):
        model.pack_for_cpu()
    return model.eval()
