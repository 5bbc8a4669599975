"""What the Triton kernels (the CUDA path) share: their helpers, and the conventions every
kernel in this package follows, and why. The kernels have the signatures and semantics of
``kernels/reference.py``.

Cache layout, per layer: ``[num_blocks, block_size, num_kv_heads, head_dim]``; a slot is
``block_id * block_size + offset``. The conventions:

- Block ids, slots and token indices are cast to int64 before they are multiplied by a
  stride: a large cache overflows int32 offsets, and the wrap is silent.
- Attention's matmuls run on tensor cores (``tl.dot``) in the cache's dtype with fp32
  accumulation; fp32 caches use ``input_precision="ieee"`` (no tf32), so fp32 matches the
  reference tightly. All other arithmetic (softmax, rescaling) is fp32.
- Triton's CPU interpreter computes bf16 on raw bits (wrong results, no error), bf16
  ``tl.dot`` included: under the interpreter bf16 operands are rounded to bf16 and then
  multiplied in fp32 (``DOT_EMULATE_BF16``), the numerics of a bf16 tensor-core dot.
- ``tl.arange`` extents must be powers of two, so head_dim, block_size and the GQA group are
  padded up and masked; ``tl.dot`` extents are padded to at least 16.
- Scores are masked with ``tl.where`` and masked loads use ``other=0``: unused cache slots
  may hold anything, NaN included, and ``NaN * 0`` is NaN, so a multiply never masks.
- Softmax runs in base 2 (``exp2``, with log2(e) folded into the scale): one multiply per
  score fewer than ``exp``.
- Arguments that change from step to step are left unspecialized (``VARYING_ARGS``,
  ``VARYING_POINTERS``), so that one build of a config serves every step.
- Fixed configs per kernel (no autotune: it cannot run without a GPU); where they come from
  is said next to each.

The launchers work on CUDA tensors and, with ``TRITON_INTERPRET=1`` set before the kernel
modules are imported, on CPU tensors under the interpreter (that is how the tests run).
"""

import functools

import torch
import triton
import triton.language as tl

# A finite "minus infinity" for the running max: exp2(m_old - m_new) stays 0, never NaN,
# even while every score seen so far is masked.
# constexpr: a compiled (non-interpreted) kernel may only read constexpr globals.
NEG_BIG: tl.constexpr = tl.constexpr(-1.0e30)
LOG2E = 1.4426950408889634

# Triton builds a kernel anew for each specialization of its arguments it meets: an integer
# equal to 1 becomes a constant, one divisible by 16 an alignment hint, and so does a
# pointer's 16-byte alignment. A build takes seconds, paid by the step that first meets it.
# These arguments follow a step's sizes (a block-table row's width, a partition count) and
# gain nothing from the hints (table entries are gathered per token), so they are left
# unspecialized: the engine's warm-up (ModelRunner.warm_up) then builds every variant.
VARYING_ARGS = ("stride_bts", "stride_btb", "num_parts", "num_seqs")
# Pointers into a step's packed inputs, at offsets that follow its sizes; each program
# reads one element from them, so their alignment buys nothing.
VARYING_POINTERS = ("slot_ptr", "positions_ptr", "src_ptr", "dst_ptr")

# tl.dot modes (a constexpr per launch): the cache dtype decides.
DOT_NATIVE = 0  # fp16/bf16 on tensor cores, fp32 accumulation
DOT_IEEE = 1  # fp32 operands, exact fp32 products (no tf32)
DOT_EMULATE_BF16 = 2  # bf16 under the interpreter: fp32 dot of bf16-rounded operands


def pow2(n: int, at_least: int = 1) -> int:
    """The power of two >= n (and >= at_least): a tl.arange extent."""
    return max(at_least, triton.next_power_of_2(max(n, 1)))


def longest_query(cu_seqlens_q: torch.Tensor) -> int:
    """The longest prefill chunk, read back from the device: a host sync, for callers that
    have no AttentionMetadata.prefill_max_query_len to pass."""
    return int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())


# Whether this package's @triton.jit kernels run under the CPU interpreter: @triton.jit
# decides when a kernel module is imported, and every kernel module imports this one first.
INTERPRETED = bool(triton.knobs.runtime.interpret)


def dot_mode(dtype: torch.dtype) -> int:
    """The tl.dot mode for caches of this dtype."""
    if dtype == torch.float32:
        return DOT_IEEE
    if dtype == torch.bfloat16 and INTERPRETED:
        return DOT_EMULATE_BF16
    return DOT_NATIVE


@functools.cache
def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors to fill; an H100/H200's 132 when there is no GPU."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132


@triton.jit
def dot(a, b, DOT_MODE: tl.constexpr):
    """a @ b with fp32 accumulation; a and b in the cache's dtype."""
    if DOT_MODE == 1:
        return tl.dot(a, b, input_precision="ieee")
    elif DOT_MODE == 2:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def token_rows(block_tables_ptr, stride_btn, pos, n_mask, block_size):
    """Each token position's row in the cache (block_id * stride_b gets added by the caller
    via these block ids): (block ids as int64, offsets within their blocks). Gathered per
    token, so a tile spans several blocks; masked positions read block 0."""
    block = tl.load(block_tables_ptr + (pos // block_size) * stride_btn, mask=n_mask, other=0)
    return block.to(tl.int64), (pos % block_size).to(tl.int64)


@triton.jit
def load_kv(cache_ptr, rows, offs_d, n_mask, d_mask, stride_d, MASK_N: tl.constexpr,
            EVEN_D: tl.constexpr):
    """A [N, D] tile of one KV head: rows are per-token element offsets (block, slot and
    head folded in). Masks only where needed, so full tiles load unpredicated."""
    ptrs = cache_ptr + rows[:, None] + offs_d[None, :] * stride_d
    if MASK_N:
        if EVEN_D:
            return tl.load(ptrs, mask=n_mask[:, None], other=0.0)
        else:
            return tl.load(ptrs, mask=n_mask[:, None] & d_mask[None, :], other=0.0)
    else:
        if EVEN_D:
            return tl.load(ptrs)
        else:
            return tl.load(ptrs, mask=d_mask[None, :], other=0.0)


@triton.jit
def softmax_step(q, k, v, m_i, l_i, acc, valid, qk_scale, DOT_MODE: tl.constexpr,
                 MASKED: tl.constexpr):
    """One online-softmax step over a [N] tile of keys for [M] query rows, in base 2:
    returns the new (running max, running sum, unnormalized output)."""
    s = dot(q, tl.trans(k), DOT_MODE)
    if MASKED:
        s = tl.where(valid, s, float("-inf"))
    # The scale goes on the row maxima, then into one fused multiply-add per score.
    m_new = tl.maximum(m_i, tl.max(s, axis=1) * qk_scale)
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s * qk_scale - m_new[:, None])  # masked: -inf, m_new finite: exactly 0
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, DOT_MODE)
    return m_new, l_i, acc
