"""A GGUF file's metadata and tensor table, read straight from its bytes (the layout is
ggml's docs/gguf.md). The gguf package's reader makes a numpy view of every string it meets:
~2.5 s for a 49k-token vocabulary, paid on every start of `serve` and `generate`, twice
where the config is read before the load. This reads the same file in well under a tenth of
that. The gguf package still dequantizes the tensors (gguf_loader.py)."""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import quant_shape_to_byte_shape

_VERSIONS = (2, 3)  # what the gguf package reads; version 1 is obsolete
_DEFAULT_ALIGNMENT = 32
# Metadata value types (gguf_type): the numbers' struct formats, then strings and arrays.
_NUMBERS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
            12: "d"}
_STRING, _ARRAY = 8, 9
_T = GGMLQuantizationType
# Tensor types whose data is a plain array (viewed as such, as the gguf package's reader
# does); every other type is rows of quantized blocks, viewed as bytes.
_PLAIN = {_T.F32: np.float32, _T.F16: np.float16, _T.F64: np.float64, _T.I8: np.int8,
          _T.I16: np.int16, _T.I32: np.int32, _T.I64: np.int64}


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # as the file lists them: innermost dimension first
    data: np.ndarray  # a read-only view of the file, outermost dimension first


@dataclass(frozen=True)
class GGUFFile:
    fields: dict[str, Any]  # metadata: numbers, bools and strings; lists for arrays
    tensors: list[GGUFTensor]


class _Reader:
    """A cursor over the file's bytes; every read checks it stays inside them."""

    def __init__(self, buf: mmap.mmap, order: str):
        self.buf, self.order, self.at = buf, order, 0
        self._length = struct.Struct(order + "Q")

    def take(self, size: int) -> int:
        start = self.at
        if size < 0 or start + size > len(self.buf):
            raise ValueError(f"truncated at byte {start} (wanted {size} more)")
        self.at += size
        return start

    def number(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        return struct.unpack_from(self.order + fmt, self.buf, self.take(size))[0]

    def string(self) -> str:
        size = self.number("Q")
        start = self.take(size)
        return str(self.buf[start : start + size], "utf-8")

    def strings(self, count: int) -> list[str]:
        # The hot loop (a vocabulary and its merges): no method call a string.
        buf, at, end, length = self.buf, self.at, len(self.buf), self._length
        out = []
        for _ in range(count):
            if at + 8 > end:
                raise ValueError(f"truncated at byte {at}")
            (size,) = length.unpack_from(buf, at)
            at += 8
            if at + size > end:
                raise ValueError(f"truncated at byte {at}")
            out.append(str(buf[at : at + size], "utf-8"))
            at += size
        self.at = at
        return out

    def value(self, kind: int) -> Any:
        if kind in _NUMBERS:
            return self.number(_NUMBERS[kind])
        if kind == _STRING:
            return self.string()
        if kind != _ARRAY:
            raise ValueError(f"unknown metadata value type {kind}")
        item, count = self.number("I"), self.number("Q")
        if item in _NUMBERS:
            dtype = np.dtype(self.order + _NUMBERS[item])
            start = self.take(count * dtype.itemsize)
            return np.frombuffer(self.buf, dtype, count, start).tolist()
        if count > len(self.buf) - self.at:  # every item takes a byte at least
            raise ValueError(f"an array of {count} items at byte {self.at}")
        if item == _STRING:
            return self.strings(count)
        return [self.value(item) for _ in range(count)]


def read_gguf(path: str) -> GGUFFile:
    """The file's metadata and tensors (views of the file, not yet dequantized). ValueError
    for a file that is not GGUF, truncated, or malformed."""
    with open(path, "rb") as f:
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)  # ValueError when empty
    if len(buf) < 24 or buf[:4] != b"GGUF":
        raise ValueError("not a GGUF file (no GGUF magic)")
    # The version is small: its two high bytes are zero when read in the file's order.
    order = "<" if struct.unpack_from("<I", buf, 4)[0] & 0xFFFF else ">"
    reader = _Reader(buf, order)
    reader.take(4)
    if (version := reader.number("I")) not in _VERSIONS:
        raise ValueError(f"GGUF version {version} (readable: {', '.join(map(str, _VERSIONS))})")
    tensor_count, field_count = reader.number("Q"), reader.number("Q")

    fields: dict[str, Any] = {}
    alignment = _DEFAULT_ALIGNMENT
    for _ in range(field_count):
        key, kind = reader.string(), reader.number("I")
        if key in fields:
            raise ValueError(f"metadata key {key} is listed twice")
        fields[key] = reader.value(kind)
        if key == "general.alignment":
            alignment = fields[key]
            if kind != 4 or alignment == 0 or alignment & (alignment - 1):
                raise ValueError(f"general.alignment {alignment!r}: not a power of two (uint32)")

    table = []
    for _ in range(tensor_count):
        name, dims = reader.string(), reader.number("I")
        shape = tuple(reader.number("Q") for _ in range(dims))
        kind, offset = _T(reader.number("I")), reader.number("Q")
        table.append((name, shape, kind, offset))
    data_start = reader.at + -reader.at % alignment

    tensors, names = [], set()
    for name, shape, kind, offset in table:
        if name in names:
            raise ValueError(f"tensor {name} is listed twice")
        names.add(name)
        block, block_bytes = GGML_QUANT_SIZES[kind]
        if shape and shape[0] % block:
            raise ValueError(f"tensor {name}: rows of {shape[0]} are not whole {kind.name} blocks")
        count = int(np.prod(shape, dtype=np.int64))
        size, start = count // block * block_bytes, data_start + offset
        if start + size > len(buf):
            raise ValueError(f"tensor {name} runs past the end of the file")
        outer_first = tuple(reversed(shape))
        if kind in _PLAIN:
            data = np.frombuffer(buf, np.dtype(_PLAIN[kind]).newbyteorder(order), count, start)
        else:
            data = np.frombuffer(buf, np.uint8, size, start)
            outer_first = quant_shape_to_byte_shape(outer_first, kind)
        tensors.append(GGUFTensor(name, kind, shape, data.reshape(outer_first)))
    return GGUFFile(fields, tensors)
