"""pagedserve's own GGUF reader (models/gguf_file.py) reads what the gguf package's reader
reads: every metadata value type, tensors of float and block types, either byte order, a
custom alignment, the embedded model; and a malformed or truncated file is a ValueError
(ModelLoadError from the loader), never another exception or a hang."""

import struct

import numpy as np
import pytest

from pagedserve.models.gguf_file import read_gguf
from pagedserve.models.loader import ModelLoadError, default_model_path, load_model_files

gguf = pytest.importorskip("gguf")
T, V = gguf.GGMLQuantizationType, gguf.GGUFValueType


def _theirs(path) -> tuple[dict, list]:
    reader = gguf.GGUFReader(str(path))
    fields = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    return fields, reader.tensors


def _flat(value):
    """Arrays of arrays as the gguf package's reader gives them: flattened (its FIXME)."""
    if isinstance(value, list) and value and isinstance(value[0], list):
        return [item for inner in value for item in _flat(inner)]
    return value


def assert_reads_as_gguf_reads(path) -> None:
    ours = read_gguf(str(path))
    fields, tensors = _theirs(path)
    assert list(ours.fields) == list(fields)  # the file's order too
    for key, value in fields.items():
        mine = _flat(ours.fields[key])
        assert mine == value and type(mine) is type(value), key
    assert [t.name for t in ours.tensors] == [t.name for t in tensors]
    for mine, theirs in zip(ours.tensors, tensors, strict=True):
        assert mine.tensor_type == theirs.tensor_type
        assert list(mine.shape) == theirs.shape.tolist()
        assert (mine.data.dtype, mine.data.shape) == (theirs.data.dtype, theirs.data.shape)
        assert mine.data.tobytes() == theirs.data.tobytes(), mine.name


def _write(path, endianess=gguf.GGUFEndian.LITTLE, alignment: int | None = None) -> None:
    w = gguf.GGUFWriter(str(path), "llama", endianess=endianess)
    if alignment:
        w.add_custom_alignment(alignment)
    w.add_uint8("t.u8", 250)
    w.add_int8("t.i8", -7)
    w.add_uint16("t.u16", 65000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_float32("t.f32", 1e-5)
    w.add_uint64("t.u64", 2**63 + 5)
    w.add_int64("t.i64", -(2**62))
    w.add_float64("t.f64", 0.1)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo, 世界 👋")
    w.add_string("t.empty", "")
    w.add_array("t.strs", ["a", "", "Ġthe", "<|im_end|>", "é" * 300])
    w.add_array("t.ints", [3, -1, 7])
    w.add_array("t.floats", [0.5, -2.25])
    w.add_array("t.bools", [True, False, True])
    w.add_key_value("t.nested", [[1, 2], [3]], V.ARRAY)
    rng = np.random.default_rng(0)
    for kind in (T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1):
        rows = rng.standard_normal((3, 256), dtype=np.float32)
        data = rows if kind == T.F32 else gguf.quants.quantize(rows, kind)
        w.add_tensor(f"w.{kind.name}", data, raw_dtype=kind)
    for kind in (T.Q4_K, T.Q6_K):  # no quantizer in the gguf package: any bytes will do
        block, block_bytes = gguf.GGML_QUANT_SIZES[kind]
        data = rng.integers(0, 256, (3, 512 // block * block_bytes), dtype=np.uint8)
        w.add_tensor(f"w.{kind.name}", data, raw_dtype=kind)
    w.add_tensor("norm", rng.standard_normal(40, dtype=np.float32))  # one dimension
    w.add_tensor("ids", np.arange(12, dtype=np.int32).reshape(2, 2, 3))  # three
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize(("endianess", "alignment"), [
    (gguf.GGUFEndian.LITTLE, None), (gguf.GGUFEndian.LITTLE, 64), (gguf.GGUFEndian.BIG, 128)])
def test_every_type_reads_as_the_gguf_package_reads_it(tmp_path, endianess, alignment):
    path = tmp_path / "types.gguf"
    _write(path, endianess, alignment)
    assert_reads_as_gguf_reads(path)
    ours = read_gguf(str(path))
    assert ours.fields["t.str"] == "héllo, 世界 👋" and ours.fields["t.nested"] == [[1, 2], [3]]


def test_the_embedded_model_reads_as_the_gguf_package_reads_it():
    assert_reads_as_gguf_reads(default_model_path())


def _write_tiny_model(path) -> None:
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(0)
    w.add_embedding_length(8)
    w.add_feed_forward_length(8)
    w.add_head_count(2)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(["a", "b", "c"])
    w.add_tensor("token_embd.weight", np.ones((3, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_every_truncation_is_a_value_error(tmp_path):
    """Cut at every byte of the header and metadata, and inside the tensor data: each read
    ends in a ValueError (the loader's one-line ModelLoadError), not an IndexError or a
    struct.error."""
    whole = tmp_path / "whole.gguf"
    _write_tiny_model(whole)
    data = whole.read_bytes()
    assert read_gguf(str(whole)).fields["llama.attention.head_count"] == 2
    cut = tmp_path / "cut.gguf"
    for size in [*range(len(data) - 96), len(data) - 1]:  # the last 96 bytes are the tensor
        cut.write_bytes(data[:size])
        with pytest.raises(ValueError):
            read_gguf(str(cut))
    with pytest.raises(ModelLoadError, match="cut.gguf: cannot read GGUF"):
        load_model_files(str(cut))


def _header(version: int = 3, tensors: int = 0, fields: int = 1) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", version, tensors, fields)


def _string(text: str) -> bytes:
    return struct.pack("<Q", len(text)) + text.encode()


def test_empty_arrays_and_no_tensors(tmp_path):
    """What the gguf package can read but not write: arrays of no items."""
    path = tmp_path / "empty-arrays.gguf"
    path.write_bytes(_header(fields=2) + _string("a") + struct.pack("<IIQ", 9, 8, 0)
                     + _string("b") + struct.pack("<IIQ", 9, 5, 0))
    assert read_gguf(str(path)).fields == {"a": [], "b": []}
    assert_reads_as_gguf_reads(path)


@pytest.mark.parametrize(("data", "message"), [
    (b"", "empty"),
    (b"GGML" + bytes(40), "no GGUF magic"),
    (_header(version=1) + bytes(16), "GGUF version 1"),
    # An array that claims 2**60 strings: refused at once, not looped over.
    (_header() + _string("k") + struct.pack("<IIQ", 9, 8, 2**60) + bytes(64),
     "of 1152921504606846976 items"),
    (_header() + _string("k") + struct.pack("<I", 13) + bytes(16), "value type 13"),
    # The last string cut short, in a file with nothing after it.
    (_header() + _string("k") + struct.pack("<IIQQ", 9, 8, 1, 10) + b"abc", "truncated"),
    (_header() + _string("k") + struct.pack("<IQ", 8, 10) + b"abc", "truncated"),
    (_header(fields=2) + (_string("k") + struct.pack("<IB", 0, 1)) * 2, "listed twice"),
    (_header() + _string("general.alignment") + struct.pack("<II", 4, 24), "power of two"),
    (_header() + _string("general.alignment") + struct.pack("<IQ", 10, 64), "power of two"),
    (_header() + _string("k") + struct.pack("<IQ", 8, 2) + b"\xff\xfe", "utf-8"),
    (_header(tensors=1, fields=0) + _string("w") + struct.pack("<IQIQ", 1, 4, 99, 0),
     "99 is not a valid"),
    (_header(tensors=1, fields=0) + _string("w") + struct.pack("<IQIQ", 1, 8, 0, 0) + bytes(8),
     "past the end"),
    (_header(tensors=1, fields=0) + _string("w") + struct.pack("<IQIQ", 1, 30, 8, 0)
     + bytes(64), "not whole Q8_0 blocks"),
    (_header(tensors=2, fields=0) + (_string("w") + struct.pack("<IQIQ", 1, 1, 0, 0)) * 2
     + bytes(64), "listed twice"),
], ids=lambda value: value if isinstance(value, str) else "file")
def test_malformed_files_are_value_errors(tmp_path, data, message):
    path = tmp_path / "bad.gguf"
    path.write_bytes(data)
    with pytest.raises(ValueError, match=message):
        read_gguf(str(path))

