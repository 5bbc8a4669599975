"""A step's integer inputs built on the host, shared by the packed path (model_runner.py)
and the decode graphs' staging buffers (cuda_graphs.py): thousands of ints every step."""

import array
from dataclasses import dataclass

import numpy as np
import torch

from pagedserve.scheduler import Sequence


def padded_tables(seqs: list[Sequence]) -> tuple[list[int], int]:
    """The block tables of ``seqs`` as one flat row-major list, each row padded with block 0
    to the widest, and that width."""
    width = max((len(s.block_table.block_ids) for s in seqs), default=0)
    flat: list[int] = []
    for s in seqs:
        flat += s.block_table.block_ids
        flat += [0] * (width - len(s.block_table.block_ids))
    return flat, width


class BlockTableRows:
    """The block tables of decode steps as int32 rows, each sequence's row kept between
    steps: built afresh from Python ints, the tables of 64 sequences of 8k tokens (512
    blocks each) took ~0.5 ms of a step's host time on a 2-vCPU Xeon, and that grows with
    the context. A row is kept with its table object, which until it is freed only grows or
    has its last block replaced, and once freed is never refilled (BlockTable): the row is
    read again only from that last block on. Sequences not in a call are forgotten."""

    def __init__(self) -> None:
        # seq_id -> (its table's block_ids, the row: a copy of them as they were)
        self._rows: dict[int, tuple[list[int], array.array]] = {}

    def _take(self, seqs: list[Sequence]) -> list[array.array]:
        """The row of each of ``seqs``, brought up to date; the others forgotten."""
        rows, out = {}, []
        for seq in seqs:
            ids = seq.block_table.block_ids
            kept = self._rows.get(seq.seq_id)
            if kept is not None and kept[0] is ids and len(ids) >= len(kept[1]) > 0:
                row, m = kept[1], len(kept[1])
                if len(ids) != m or ids[m - 1] != row[m - 1]:  # grown, or last block replaced
                    row[m - 1 :] = array.array("i", ids[m - 1 :])
            else:
                row = array.array("i", ids)
            rows[seq.seq_id] = (ids, row)
            out.append(row)
        self._rows = rows
        return out

    def padded(self, seqs: list[Sequence]) -> tuple[array.array, int]:
        """padded_tables() of ``seqs`` as an int32 array, and the width."""
        rows = self._take(seqs)
        width = max(map(len, rows), default=0)
        zeros = memoryview(bytes(4 * width))
        parts: list[array.array | memoryview] = []
        for row in rows:
            parts.append(row)
            if len(row) < width:
                parts.append(zeros[: 4 * (width - len(row))])
        flat = array.array("i")
        flat.frombytes(b"".join(parts))
        return flat, width

    def write(self, seqs: list[Sequence], dest: memoryview, stride: int) -> None:
        """Row i of ``seqs``' tables into ``dest`` (int32 words) from word i * stride, each
        only as long as its table: what lies past it (stale block ids) counts for nothing.
        The C++ and Triton kernels read a row's first ceil(context_len / block_size)
        entries only; the reference gathers up to the batch's widest row and masks the
        keys past each context out."""
        for i, row in enumerate(self._take(seqs)):
            dest[i * stride : i * stride + len(row)] = row


def on_device(values: list[int] | list[float] | np.ndarray, device: torch.device,
              dtype: torch.dtype | None = None) -> torch.Tensor:
    """A host list or array on ``device`` (``dtype``: as torch.tensor() infers it, but an
    empty list of indices needs one); on CUDA through pinned memory, so that the copy does
    not wait for the kernels queued before it (a step launched ahead of the previous one's
    read-back would lose its overlap)."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


@dataclass
class CarriedTokens:
    """Input ids a step takes from the previous step's sampled tokens, still on the device
    (asynchronous scheduling): row ``dst[i]`` of its input ids is ``tokens[src[i]]``."""

    tokens: torch.Tensor
    dst: list[int]
    src: list[int]

    def write_into(self, input_ids: torch.Tensor) -> None:
        n = len(self.dst)
        if self.dst == self.src == list(range(n)):  # the same decodes as before: one copy
            input_ids[:n].copy_(self.tokens[:n])
        else:
            device = input_ids.device
            input_ids[on_device(self.dst, device)] = self.tokens[
                on_device(self.src, device)].to(input_ids.dtype)
