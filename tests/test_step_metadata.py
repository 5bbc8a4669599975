"""What a step's AttentionMetadata tells the kernels beyond its tensors: the longest prefill
chunk, taken on the host, so that a GPU launcher sizes its grid without reading
cu_seqlens_q back from the device on every layer; and the packed step it is read from."""

import dataclasses

import pytest
import torch
from engine_utils import greedy, make_engine, prompts_of_lengths, run

from pagedserve.engine.model_runner import ModelRunner, pack_step
from pagedserve.kernels import REFERENCE, reference


@pytest.mark.parametrize("num_decodes", [2, 3])  # an even and an odd count of int32 fields
def test_a_packed_step_unpacks_to_its_fields(num_decodes: int) -> None:
    """One int64 payload (what tensor parallelism broadcasts), whose int32 fields come back
    as int32 views, with no conversion to launch on the device, each 16-byte aligned."""
    nd, width = num_decodes, 3
    fields = dict(ids=[100 + i for i in range(nd + 4)], positions=list(range(nd + 4)),
                  slots=[-1, 2**40, *range(nd + 2)], sampled_rows=[0, nd + 3],
                  copy_src=[4], copy_dst=[2**33],
                  decode_tables=list(range(nd * width)), decode_width=width,
                  decode_lens=[40 + i for i in range(nd)],
                  prefill_tables=[7, 8, 2**31 - 1, 0], prefill_width=2,
                  cu_seqlens_q=[0, 1, 4], prefill_lens=[1, 20])
    header, payload = pack_step(**fields)
    assert payload.dtype == torch.int64 and payload.dim() == 1
    inputs = ModelRunner.unpack(header, payload)
    meta = inputs.meta
    for tensor, want in [(inputs.input_ids, fields["ids"]), (inputs.positions,
                         fields["positions"]), (meta.slot_mapping, fields["slots"]),
                         (inputs.logits_indices, fields["sampled_rows"]),
                         (inputs.copy_src, fields["copy_src"]),
                         (inputs.copy_dst, fields["copy_dst"])]:
        assert tensor.dtype == torch.int64 and tensor.tolist() == want
    for tensor, want in [(meta.decode_block_tables.flatten(), fields["decode_tables"]),
                         (meta.decode_context_lens, fields["decode_lens"]),
                         (meta.prefill_block_tables.flatten(), fields["prefill_tables"]),
                         (meta.prefill_cu_seqlens_q, fields["cu_seqlens_q"]),
                         (meta.prefill_context_lens, fields["prefill_lens"])]:
        assert tensor.dtype == torch.int32 and tensor.tolist() == want
        # 16-byte aligned, as tensors of their own: Triton specializes on the alignment.
        assert (tensor.data_ptr() - payload.data_ptr()) % 16 == 0
    assert meta.decode_block_tables.shape == (nd, width)
    assert meta.prefill_block_tables.shape == (2, 2) and meta.prefill_max_query_len == 3


def test_longest_prefill_chunk_matches_the_chunks_of_every_step(tiny_llama):
    seen: list[tuple[int, int]] = []

    def recording_prefill(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale,
                          max_query_len=None, out=None):
        lengths = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).tolist()
        seen.append((max_query_len, max(lengths)))
        return reference.paged_prefill_attention(q, k_cache, v_cache, block_tables,
                                                 cu_seqlens_q, context_lens, scale, out=out)

    kernels = dataclasses.replace(REFERENCE, paged_prefill_attention=recording_prefill)
    # A 40-token budget: long prompts go in chunks, next to other prompts and to decodes.
    engine = make_engine(tiny_llama, kernels, max_num_batched_tokens=40)
    run(engine, prompts_of_lengths([70, 9, 33, 5, 21]), greedy(4))
    longest = {m for m, _ in seen}
    assert len(longest) >= 3  # steps with chunks of several lengths
    assert all(hint == actual for hint, actual in seen), seen
