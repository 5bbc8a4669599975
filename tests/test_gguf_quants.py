"""GGUF's simple block types dequantized with torch (models/gguf_quants.py) give the gguf
package's weights bit for bit: random blocks of every such type, any bytes in the scales
(infinities and NaNs included), rows of several blocks, and the embedded model."""

import numpy as np
import pytest
import torch

from pagedserve.models.gguf_file import read_gguf
from pagedserve.models.gguf_quants import dequantize
from pagedserve.models.loader import default_model_path

gguf = pytest.importorskip("gguf")
T = gguf.GGMLQuantizationType


def assert_bits_equal(ours: torch.Tensor, theirs: np.ndarray) -> None:
    theirs = np.asarray(theirs, np.float32)
    assert tuple(ours.shape) == theirs.shape and ours.dtype == torch.float32
    assert np.array_equal(ours.numpy().view(np.uint32), theirs.view(np.uint32))


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # NaN scales: numpy says so
@pytest.mark.parametrize("kind", [T.Q4_0, T.Q4_1, T.Q8_0, T.Q4_K, T.F16])
@pytest.mark.parametrize("rows", [(1,), (7,), (3, 5)])
def test_random_blocks_dequantize_as_the_gguf_package_does(kind, rows):
    block_weights, block_bytes = gguf.GGML_QUANT_SIZES[kind]
    blocks_per_row = 256 // block_weights
    data = np.random.default_rng(len(rows) * 100 + kind).integers(
        0, 256, (*rows, blocks_per_row * block_bytes), dtype=np.uint8)
    if kind == T.F16:
        data = data.view(np.float16)
    assert_bits_equal(dequantize(data, kind), gguf.quants.dequantize(data, kind))


def test_the_embedded_models_weights_are_the_gguf_packages():
    file = read_gguf(default_model_path())
    kinds = {t.tensor_type for t in file.tensors}
    assert T.Q4_1 in kinds and T.Q8_0 in kinds
    for t in file.tensors:
        assert_bits_equal(dequantize(t.data, t.tensor_type),
                          gguf.quants.dequantize(t.data, t.tensor_type))
