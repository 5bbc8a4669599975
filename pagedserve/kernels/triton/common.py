"""What the Triton kernels (the CUDA path) share: their helpers, and the conventions every
kernel in this package follows, and why. The kernels have the signatures and semantics of
``kernels/reference.py``.

Cache layout, per layer: ``[num_blocks, block_size, num_kv_heads, head_dim]``; a slot is
``block_id * block_size + offset``. The conventions:

- Block ids, slots and token indices are cast to int64 before they are multiplied by a
  stride: a large cache overflows int32 offsets, and the wrap is silent.
- Every load is upcast to fp32 right away and all arithmetic is fp32: Triton's CPU
  interpreter computes bf16 arithmetic on raw bits (wrong results, no error), and fp32
  accumulation is what the references do.
- ``tl.arange`` extents must be powers of two, so head_dim, block_size and the GQA group are
  padded up and masked.
- Scores are masked with ``tl.where`` and masked loads use ``other=0``: unused cache slots
  may hold anything, NaN included, and ``NaN * 0`` is NaN, so a multiply never masks.
- One fixed config per kernel (no multi-config autotune: it cannot run without a GPU).

The launchers work on CUDA tensors and, with ``TRITON_INTERPRET=1`` set before the kernel
modules are imported, on CPU tensors under the interpreter (that is how the tests run).
"""

import triton


def pow2(n: int, at_least: int = 1) -> int:
    """The power of two >= n (and >= at_least): a tl.arange extent."""
    return max(at_least, triton.next_power_of_2(max(n, 1)))
