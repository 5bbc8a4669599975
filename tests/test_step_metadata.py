"""What a step's AttentionMetadata tells the kernels beyond its tensors: the longest prefill
chunk, taken on the host, so that a GPU launcher sizes its grid without reading
cu_seqlens_q back from the device on every layer."""

import dataclasses

from engine_utils import greedy, make_engine, prompts_of_lengths, run

from pagedserve.kernels import REFERENCE, reference


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
