"""The batch token bitmask: one bit per vocabulary entry per row (bit ``t % 32`` of int32
word ``t // 32``, set when token ``t`` is allowed), the layout llguidance fills."""

import numpy as np
import torch


def allocate_bitmask(rows: int, vocab_size: int, pin: bool = False) -> torch.Tensor:
    """A CPU int32 bitmask with every token allowed (llguidance writes into CPU memory);
    ``pin``: in pinned memory, for a device copy that need not wait for queued kernels."""
    return torch.full((rows, (vocab_size + 31) // 32), -1, dtype=torch.int32, pin_memory=pin)


def allowed_tokens(bitmask: torch.Tensor, vocab_size: int,
                   device: torch.device | str = "cpu") -> torch.Tensor:
    """The bitmask as a bool [rows, vocab_size] tensor on ``device``."""
    if torch.device(device).type == "cpu":  # numpy's unpackbits: one pass, no int temporaries
        bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")
        return torch.from_numpy(bits[:, :vocab_size].view(np.bool_))
    # Only the packed words cross to the device.
    return unpack_words(bitmask.to(device, non_blocking=True), vocab_size)


def unpack_words(words: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The bitmask unpacked with tensor ops, on whatever device ``words`` is on."""
    shifts = torch.arange(32, device=words.device, dtype=torch.int32)
    bits = (words.unsqueeze(-1) >> shifts) & 1
    return bits.view(words.shape[0], -1)[:, :vocab_size].bool()


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor,
                  rows: torch.Tensor | None = None) -> None:
    """Set the logits of disallowed tokens to -inf, in place, in one batched operation.
    ``rows``: which logits rows the bitmask's rows stand for, an index on the logits'
    device (default: all, in order)."""
    allowed = allowed_tokens(bitmask, logits.shape[1], logits.device)
    if rows is None:
        logits.masked_fill_(~allowed, float("-inf"))
        return
    logits[rows] = torch.where(allowed, logits[rows], float("-inf"))
