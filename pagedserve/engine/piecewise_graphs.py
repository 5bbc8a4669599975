"""Steps that carry prefill chunks, replayed as CUDA graphs piecewise (vLLM's "piecewise"
mode): every op of the forward but attention is captured, per layer, for a ladder of
padded token counts; attention runs eagerly between the pieces, with the step's own
metadata, since its kernels' grids follow the batch's shape. Without graphs such a step
launches ~12 kernels a layer from Python (~0.45 ms of host time a layer on an H200, where
its GPU work is a fraction of that); with them, one graph and the attention launches.

The pieces of an L-layer model, at a padded count of n tokens:
- piece 0: the embeddings, layer 0's input norm and its q/k/v projection, RoPE and K/V store;
- piece i (1..L-1): layer i-1's output projection and MLP, then layer i's as piece 0's;
- piece L: layer L-1's output projection and MLP, and the final norm.
They hand each other their tensors through persistent buffers (q, the attention output,
the residual stream, the final hidden states), so that every piece reads and writes fixed
addresses. Padding rows (n - T of them) write no K/V (slot -1) and their hidden states
are never read; rows are independent in every captured op, so they do not touch real rows.

Steps of more than MAX_TOKENS tokens run eagerly: the larger a step, the more of its
launches (asynchronous) its GPU work hides, while every captured size costs start-up time
and pool memory.

Whole graphs (``whole``, --full-graphs; vLLM's "full" mode): each padded size's forward is
one graph, attention included, so a step launches one graph, not a graph and the attention
launches per layer (~0.25 ms of host time a layer on the H200, 6.3 of a 64-decode mixed
step's 8.8 ms). Attention then runs over persistent metadata as wide as the engine allows:
every sequence of the step in one list (decodes first, as the flat tokens are), padded
with empty ones, through the flash kernel's flat grid, which reads no length on the host.

Without capture (``capture=False``, and always on CPU) the same pieces run eagerly on the
same buffers: that is how the CPU tests check this path against the plain forward.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch

from pagedserve.engine.cuda_graphs import capture_in_one_pool, padded_size
from pagedserve.kernels import AttentionMetadata, KernelSet
from pagedserve.models.llama import LlamaForCausalLM

# On Qwen2.5-0.5B's shapes an eager step's launches took ~12 ms of host time on the H200,
# against ~2 ms of GPU work per 1,000 tokens (estimated: 2 FLOPs a parameter a token at
# ~500 TFLOP/s); an 8B model's GPU work hides them from a few hundred tokens. vLLM stops
# capturing at 512.
MAX_TOKENS = 2048


def takes_whole_graphs(kernels: KernelSet, device: torch.device) -> bool:
    """Whether ``kernels``' prefill attention takes a whole graph's padded metadata: the flash
    kernel's flat grid reads no length on the host; the references read them, so they serve
    only uncaptured, on CPU (the tests). The C++ kernels and the basic Triton ones read
    lengths too, and take no rows past the last chunk."""
    return kernels.name == "triton-flash" or (kernels.name == "reference"
                                              and device.type == "cpu")


def token_ladder(max_tokens: int) -> list[int]:
    """Captured token counts: 16, 24, 32, 48, 64, 96, ... (two a doubling, so a step pads by
    at most a third) up to max_tokens, which is always one."""
    sizes, size = [], 16
    while size < max_tokens:
        sizes.append(size)
        is_power_of_two = size & (size - 1) == 0
        size = size * 3 // 2 if is_power_of_two else size // 3 * 4  # 16 -> 24 -> 32 -> 48
    return sizes + [max_tokens]


class PiecewiseGraphs:
    """Runs the forward of steps of up to ``max_tokens`` tokens in pieces on persistent
    buffers, each piece a captured CUDA graph when ``capture`` is set; with ``whole``, (max
    sequences, max model length, block size), each size's whole forward one graph."""

    def __init__(self, model: LlamaForCausalLM, k_caches: torch.Tensor, v_caches: torch.Tensor,
                 max_tokens: int, device: torch.device, capture: bool,
                 whole: tuple[int, int, int] | None = None):
        cfg, attn = model.config, model.layers[0].self_attn
        self.model, self.k_caches, self.v_caches = model, k_caches, v_caches
        # Each layer's attention and caches, indexed once here, not on every step
        self.attention = [(layer.self_attn, k, v)
                          for layer, k, v in zip(model.layers, k_caches, v_caches, strict=True)]
        self.sizes, self.device = token_ladder(min(max_tokens, MAX_TOKENS)), device
        dtype = model.embed_tokens.weight.dtype
        n = self.sizes[-1]

        def buffer(*shape: int, dtype: torch.dtype = dtype) -> torch.Tensor:
            return torch.zeros(*shape, dtype=dtype, device=device)

        self.input_ids, self.positions = buffer(n, dtype=torch.int64), buffer(n, dtype=torch.int64)
        self.slot_mapping = buffer(n, dtype=torch.int64)
        self.q = buffer(n, attn.num_heads, attn.head_dim)
        self.attn_out = buffer(n, attn.num_heads, attn.head_dim)
        self.residual, self.hidden = buffer(n, cfg.hidden_size), buffer(n, cfg.hidden_size)
        self.seqs = None
        if whole is not None:
            max_seqs, max_model_len, block_size = whole
            self.seqs = _SequenceBuffers.allocate(max_seqs, -(-max_model_len // block_size),
                                                  device)
        # (size, piece), or (size, None) for a whole forward
        self.graphs: dict[tuple[int, int | None], torch.cuda.CUDAGraph] = {}
        if capture:
            self._capture_all()

    @property
    def whole(self) -> bool:
        """Each size's forward one graph, attention included (not pieces around it)."""
        return self.seqs is not None

    def covers(self, num_tokens: int, num_seqs: int) -> bool:
        fits = not self.whole or num_seqs <= len(self.seqs.context_lens)
        return 0 < num_tokens <= self.sizes[-1] and fits

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """The final hidden states [T, hidden] of a step of T tokens: the model's forward."""
        T = input_ids.shape[0]
        n = padded_size(self.sizes, T)
        self.input_ids[:T] = input_ids
        self.positions[:T] = positions
        self.slot_mapping[:T] = meta.slot_mapping
        # The padding rows' ids and positions are a past step's, valid either way; their
        # slots must not be, or they would write K/V over a live block.
        self.slot_mapping[T:n] = -1
        if not self.whole:
            self._layers(n, self._run_piece, T, meta)
            return self.hidden[:T]
        self.seqs.fill(meta, T)
        if self.graphs:
            self.graphs[(n, None)].replay()
        else:
            self._whole(n)
        return self.hidden[:T]

    def _whole(self, n: int) -> None:
        """The forward at ``n`` rows, attention included, on the persistent buffers: every
        row attends, the padding rows as part of no sequence (their output is never read)."""
        self._layers(n, self._piece, n, self.seqs.metadata(self.slot_mapping[:n]))

    def _layers(self, n: int, piece: Callable[[int, int], None], rows: int,
                meta: AttentionMetadata) -> None:
        """Each piece at ``n`` rows, and between two the attention of the first ``rows``."""
        q = self.q[:rows]
        for i, (attention, k_cache, v_cache) in enumerate(self.attention):
            piece(n, i)
            attention.attend(q, meta, k_cache, v_cache, out=self.attn_out)
        piece(n, len(self.attention))

    def _run_piece(self, n: int, i: int) -> None:
        if self.graphs:  # captured: every (size, piece) has its graph
            self.graphs[(n, i)].replay()
        else:
            self._piece(n, i)

    def _piece(self, n: int, i: int) -> None:
        """Piece ``i`` at ``n`` rows: reads and writes only the persistent buffers."""
        model, layers, residual = self.model, self.model.layers, self.residual[:n]
        if i == 0:  # the embeddings start the residual stream (layer 0 adds no residual)
            residual.copy_(model.tp.embed(model.embed_tokens, self.input_ids[:n], model.config))
            h = layers[0].input_layernorm(residual)
        else:
            prev = layers[i - 1]
            x = prev.after_attention(prev.self_attn.output(self.attn_out[:n]), residual)
            if i == len(layers):
                self.hidden[:n] = model.norm(x, residual)
                return
            h = layers[i].input_layernorm(x, residual)
        self.q[:n] = layers[i].self_attn.project(
            h, self.positions[:n], model.rope, self.slot_mapping[:n], self.k_caches[i],
            self.v_caches[i])

    @torch.inference_mode()
    def run_each_piece(self) -> None:
        """Every piece (or whole forward) at every size once, eagerly, writing no K/V and
        attending to nothing: Triton builds its kernels on first launch, which cannot
        happen inside a capture."""
        self.slot_mapping.fill_(-1)
        if self.whole:
            self.seqs.clear()
        for n in reversed(self.sizes):
            if self.whole:
                self._whole(n)
                continue
            for i in range(len(self.model.layers) + 1):
                self._piece(n, i)

    @torch.inference_mode()
    def _capture_all(self) -> None:
        """The largest size first, so the smaller pieces fit in the memory it pooled. The
        pieces return nothing: what they pass on is in the persistent buffers."""
        self.run_each_piece()
        if self.whole:
            forwards = {(n, None): lambda n=n: self._whole(n) for n in reversed(self.sizes)}
        else:
            pieces = range(len(self.model.layers) + 1)
            forwards = {(n, i): lambda n=n, i=i: self._piece(n, i)
                        for n in reversed(self.sizes) for i in pieces}
        self.graphs, _ = capture_in_one_pool(forwards, self.device)


@dataclass
class _SequenceBuffers:
    """A whole graph's attention metadata: the step's sequences in one list, decodes first,
    padded to ``max_seqs`` with empty ones (no tokens, no context), which the flat grid's
    programs skip."""

    cu_seqlens_q: torch.Tensor  # [max_seqs + 1] int32
    context_lens: torch.Tensor  # [max_seqs] int32
    block_tables: torch.Tensor  # [max_seqs, width] int32
    counting: torch.Tensor  # 0, 1, 2, ...: a decode's cu_seqlens_q entries

    @classmethod
    def allocate(cls, max_seqs: int, width: int, device: torch.device) -> "_SequenceBuffers":
        def zeros(*shape: int) -> torch.Tensor:
            return torch.zeros(*shape, dtype=torch.int32, device=device)

        counting = torch.arange(max_seqs + 1, dtype=torch.int32, device=device)
        return cls(zeros(max_seqs + 1), zeros(max_seqs), zeros(max_seqs, width), counting)

    def metadata(self, slot_mapping: torch.Tensor) -> AttentionMetadata:
        """Every sequence as a prefill chunk (a decode is a chunk of one token), with no
        longest chunk for the kernel to size its grid by."""
        return AttentionMetadata(
            slot_mapping=slot_mapping, num_decode_tokens=0,
            decode_block_tables=self.block_tables[:0], decode_context_lens=self.context_lens[:0],
            prefill_block_tables=self.block_tables, prefill_cu_seqlens_q=self.cu_seqlens_q,
            prefill_context_lens=self.context_lens, prefill_max_query_len=None)

    def fill(self, meta: AttentionMetadata, num_tokens: int) -> None:
        """The step's metadata, device to device (a few small copies, outside the graph)."""
        D, P = meta.num_decode_tokens, len(meta.prefill_context_lens)
        S = D + P
        cu, lens, tables = self.cu_seqlens_q, self.context_lens, self.block_tables
        cu[: D + 1] = self.counting[: D + 1]
        torch.add(meta.prefill_cu_seqlens_q[1:], D, out=cu[D + 1 : S + 1])
        cu[S + 1 :] = num_tokens
        lens[:D] = meta.decode_context_lens
        lens[D:S] = meta.prefill_context_lens
        lens[S:] = 0
        # A row's entries past its context are never read: no need to clear them.
        tables[:D, : meta.decode_block_tables.shape[1]] = meta.decode_block_tables
        tables[D:S, : meta.prefill_block_tables.shape[1]] = meta.prefill_block_tables

    def clear(self) -> None:
        """No sequence at all: every program of the flat grid attends to nothing."""
        self.cu_seqlens_q.zero_()
        self.context_lens.zero_()
