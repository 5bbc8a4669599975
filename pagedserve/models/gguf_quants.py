"""GGUF's simple block quantizations (Q4_0, Q4_1, Q8_0) dequantized with torch; any other
type with the gguf package's numpy code.

The gguf package splits a tensor into groups of rows and works through them in Python:
1.0-1.2 s of every start for the embedded Q4_1 model on a 2-vCPU Zen 4, against 0.4 s for
these whole-tensor torch ops (docs/performance.md §14). The arithmetic is the gguf
package's, step for step (float32, no fused multiply-add): the same weights, bit for bit."""

import numpy as np
import torch
from gguf import GGMLQuantizationType

_BLOCK = 32  # weights per block in all three formats
# Bytes of a block: an fp16 scale, for Q4_1 an fp16 minimum, then the quants.
_BLOCK_BYTES = {GGMLQuantizationType.Q4_0: 18, GGMLQuantizationType.Q4_1: 20,
                GGMLQuantizationType.Q8_0: 34}


def dequantize(data: np.ndarray, tensor_type: GGMLQuantizationType) -> torch.Tensor:
    """The tensor's weights as float32 in the file's order, outermost dimension first:
    ``data`` is its bytes as the reader gives them (rows of whole blocks)."""
    block_bytes = _BLOCK_BYTES.get(tensor_type)
    if block_bytes is None:
        from gguf.quants import dequantize as numpy_dequantize

        arr = numpy_dequantize(data, tensor_type)  # float types come back as file views
        return torch.from_numpy(np.require(arr, np.float32, ["C", "W"]))
    rows = data.shape[:-1]
    blocks = torch.from_numpy(data.copy()).view(-1, block_bytes)  # a copy: the map is read-only
    scale = blocks[:, :2].contiguous().view(torch.float16).float()  # [n, 1]
    if tensor_type == GGMLQuantizationType.Q8_0:
        weights = blocks[:, 2:].contiguous().view(torch.int8) * scale
    else:
        packed = blocks[:, block_bytes - _BLOCK // 2:]  # 16 bytes: low nibbles, then high
        nibbles = torch.cat([packed & 0x0F, packed >> 4], dim=1)
        if tensor_type == GGMLQuantizationType.Q4_0:
            weights = scale * (nibbles.to(torch.int8) - 8)
        else:
            minimum = blocks[:, 2:4].contiguous().view(torch.float16).float()
            weights = (scale * nibbles).add_(minimum)
    return weights.reshape(*rows, -1)
