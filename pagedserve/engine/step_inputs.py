"""A step's integer inputs built on the host, shared by the packed path (model_runner.py)
and the decode graphs' staging buffers (cuda_graphs.py): thousands of ints every step."""

import array
from collections.abc import Iterable

import torch

from pagedserve.scheduler import Sequence

_TYPECODES = {torch.int64: "q", torch.int32: "i"}


def int_tensor(values: Iterable[int], dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """A 1-D CPU tensor of ``values``, built through ``array.array``: torch.tensor() on a
    list inspects every element from Python, 3-6x slower."""
    buffer = array.array(_TYPECODES[dtype], values)
    return torch.frombuffer(buffer, dtype=dtype) if buffer else torch.empty(0, dtype=dtype)


def padded_tables(seqs: list[Sequence]) -> tuple[list[int], int]:
    """The block tables of ``seqs`` as one flat row-major list, each row padded with block 0
    to the widest, and that width."""
    width = max((len(s.block_table.block_ids) for s in seqs), default=0)
    flat: list[int] = []
    for s in seqs:
        flat += s.block_table.block_ids
        flat += [0] * (width - len(s.block_table.block_ids))
    return flat, width
