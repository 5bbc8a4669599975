"""The decodes' block tables kept as int32 rows between steps (engine/step_inputs.py
BlockTableRows): each step's rows equal the tables built afresh, through decodes that fill
blocks, a copy-on-write of a shared last block, and a sequence freed and allocated again
in the same table (as a preempted one is) that comes back later."""

import array
import random

import pytest
from engine_utils import greedy, make_engine, run

from pagedserve.engine.step_inputs import BlockTableRows, padded_tables
from pagedserve.paging import BlockManager
from pagedserve.scheduler import SamplingParams, Sequence

BLOCK = 4


def new_seq(manager: BlockManager, prompt_len: int, rng: random.Random) -> Sequence:
    seq = Sequence("r", [rng.randrange(1000) for _ in range(prompt_len)], SamplingParams(), 0.0)
    assert manager.allocate_slots(seq.block_table, seq.token_ids, 0, prompt_len) is not None
    manager.commit(seq.block_table, seq.token_ids, prompt_len)
    return seq


def decode(manager: BlockManager, seq: Sequence, rng: random.Random) -> None:
    seq.token_ids.append(rng.randrange(1000))
    n = len(seq.token_ids)
    assert manager.allocate_slots(seq.block_table, seq.token_ids, n - 1, 1) is not None
    manager.commit(seq.block_table, seq.token_ids, n)


def check(rows: BlockTableRows, seqs: list[Sequence]) -> None:
    """Both forms of the rows: padded (the packed path), and written in place over stale
    words (the decode graphs' staging buffer), each row its table and nothing past it."""
    flat, width = rows.padded(seqs)
    assert (flat.tolist(), width) == padded_tables(seqs)
    stride, stale = width + 3, -7
    words = array.array("i", [stale] * (stride * len(seqs)))
    rows.write(seqs, memoryview(words), stride)
    for i, seq in enumerate(seqs):
        ids = seq.block_table.block_ids
        assert words[i * stride : (i + 1) * stride].tolist() == ids + [stale] * (stride - len(ids))


def test_kept_rows_equal_fresh_tables() -> None:
    rng = random.Random(0)
    manager = BlockManager(256, BLOCK, enable_prefix_caching=False)
    rows = BlockTableRows()
    seqs = [new_seq(manager, n, rng) for n in (3, 9, 17)]
    for _ in range(10):  # decodes crossing block boundaries, every step checked
        for seq in seqs:
            decode(manager, seq, rng)
        check(rows, seqs)

    # A shared last block, written by its owner first: replaced in the same table.
    parent = seqs[0]
    while len(parent.token_ids) % BLOCK == 0:  # a partial last block, to be written again
        decode(manager, parent, rng)
        check(rows, seqs)
    child = Sequence("r", list(parent.token_ids), parent.params, 0.0,
                     block_table=manager.fork(parent.block_table))
    last = parent.block_table.block_ids[-1]
    decode(manager, parent, rng)
    assert parent.block_table.block_ids[-1] != last  # copied on write
    check(rows, [*seqs, child])

    # Freed and allocated again in the same table object, elsewhere in the pool (as a
    # preempted sequence's is): away for a step, then back at the same length.
    seq = seqs[1]
    table_ids, length = seq.block_table.block_ids, len(seq.token_ids)
    manager.free(seq.block_table)
    hold = [new_seq(manager, BLOCK * 3, rng) for _ in range(2)]  # take its old blocks
    check(rows, [seqs[0], seqs[2]])
    assert manager.allocate_slots(seq.block_table, seq.token_ids, 0, length) is not None
    assert seq.block_table.block_ids is table_ids
    check(rows, [*seqs, *hold])


@pytest.mark.parametrize("eager", [True, False], ids=["packed", "decode-graphs"])
def test_a_sequence_preempted_in_an_empty_step_decodes_as_if_alone(tiny_llama, eager) -> None:
    """Asynchronous scheduling, a pool of 4 blocks of 4 tokens, two greedy requests with one
    prompt: the longer one preempts itself in a step that schedules nothing (the other
    waits for its last token), so no table rows are built that step, and it comes back in
    the next on a prefix hit. Its tokens are those it makes alone: its row was rebuilt
    (before, its old table's rows were reused, pointing at blocks it no longer held)."""
    prompt = [17, 18]
    short, long = greedy(7), greedy(14)
    engine = make_engine(tiny_llama, block_size=BLOCK, num_kv_blocks=4, async_scheduling=True,
                         enforce_eager=eager)
    _, together = run(engine, [prompt, prompt], [short, long])
    assert engine.stats()["preemptions"] >= 1
    [alone] = run(make_engine(tiny_llama, block_size=BLOCK, async_scheduling=True,
                              enforce_eager=eager), [prompt], long)
    assert together.outputs[0].token_ids == alone.outputs[0].token_ids
