"""Scheduler promises checked on the Scheduler itself (no model; docs/design.md §6): decodes
before prefill chunks, the newest running sequence is the preemption victim (the least
urgent, by priority), even one planned into the step already, the context limit ends a
sample, and a sequence leaving by length frees its seat for a fork."""

import pytest

from pagedserve.paging import BlockManager
from pagedserve.scheduler import SamplingParams, Sequence
from pagedserve.scheduler.scheduler import Scheduler, SchedulerConfig


def seq(n_prompt: int, arrival: float, max_tokens: int | None = 100, first: int = 10) -> Sequence:
    return Sequence(f"r{arrival:g}", list(range(first, first + n_prompt)),
                    SamplingParams(max_tokens=max_tokens, ignore_eos=True), arrival=arrival)


def step(sch: Scheduler, token: int = 7):
    """One engine step with every sampled token ``token``, as LLMEngine drives the scheduler."""
    batch = sch.schedule()
    sch.advance(batch)
    done = [s for s in batch.seqs if s.last_token_pending]
    sch.settle(done, [token] * len(done), lambda s, i: False)
    return batch


def test_decodes_go_before_an_older_sequences_prefill_chunk():
    sch = Scheduler(SchedulerConfig(max_model_len=512, max_num_batched_tokens=16),
                    BlockManager(64, 16))
    young = seq(4, arrival=1.0)
    sch.add(young)
    step(sch)  # its prompt is in: it decodes from now on
    old = seq(64, arrival=0.0, first=100)  # older (e.g. a preempted sample back for recompute)
    sch.add(old)
    step(sch)  # young decodes one token; old takes the other 15 of the budget, and runs
    assert old in sch.running and old.num_cached_tokens == 15
    batch = sch.schedule()  # old still prefills (49 tokens left), young still decodes
    assert young in batch.seqs and batch.num_decodes == 1
    assert young.num_scheduled_tokens == 1 and old.num_scheduled_tokens == 15


def test_the_newest_running_sequence_is_preempted_not_the_oldest():
    # 2 blocks of 4: each sequence fills one block exactly; the older one's next token
    # needs a third block.
    sch = Scheduler(SchedulerConfig(max_model_len=64, max_num_batched_tokens=64),
                    BlockManager(2, 4, enable_prefix_caching=False))
    old, new = seq(4, arrival=0.0), seq(4, arrival=1.0, first=50)
    sch.add(old)
    sch.add(new)
    step(sch)  # both prefill (one full block each) and sample a 5th token
    batch = sch.schedule()
    assert sch.stats.preemptions == 1
    assert old in batch.seqs and new not in batch.seqs
    assert new in sch.waiting and old in sch.running


@pytest.mark.parametrize("decoding, prefilling", [((1.0, 0), (0.0, 0)), ((0.0, 5), (1.0, 0))],
                         ids=["older-by-arrival", "more-urgent-by-priority"])
def test_a_prefill_behind_planned_decodes_preempts_a_newer_decode_not_itself(
        decoding: tuple[float, int], prefilling: tuple[float, int]):
    """Decodes are planned before prefill chunks, so an older (or more urgent) sequence still
    in its prefill may find the pool taken by a newer decode planned before it this step.
    That decode is the victim, taken out of the batch, as vLLM's scheduler does; before,
    the prefill could only preempt itself, step after step (a priority-0 request was
    preempted six times while a priority-5 one decoded on)."""
    sch = Scheduler(SchedulerConfig(max_model_len=128, max_num_batched_tokens=8),
                    BlockManager(5, 4, enable_prefix_caching=False))

    def ranked(n_prompt: int, first: int, arrival: float, priority: int) -> Sequence:
        return Sequence(f"r{first}", list(range(first, first + n_prompt)), SamplingParams(
            max_tokens=100, ignore_eos=True), arrival=arrival, priority=priority)

    newer = ranked(4, 10, *decoding)
    sch.add(newer)
    step(sch)  # its prompt is in: it decodes from now on
    older = ranked(16, 100, *prefilling)
    sch.add(older)
    step(sch)  # newer decodes; older takes the other 7 tokens of the budget (4 of 5 blocks)
    batch = sch.schedule()  # newer's decode is planned, then older's 7 need 2 more blocks
    assert sch.stats.preemptions == 1
    assert batch.seqs == [older] and batch.num_decodes == 0 and older.num_scheduled_tokens == 7
    assert newer in sch.waiting and newer.num_scheduled_tokens == 0
    assert sch.blocks.num_used_blocks == len(older.block_table.block_ids) == 4


def test_a_dropped_decode_takes_its_block_copy_with_it():
    """A forked sample's first decode copies the shared last block (copy-on-write); dropped
    from the step as a victim, it takes that copy with it: the copy's target went back to
    the pool with its blocks and may be another sequence's by the forward."""
    sch = Scheduler(SchedulerConfig(max_model_len=128, max_num_batched_tokens=7),
                    BlockManager(5, 4, enable_prefix_caching=False))
    parent = seq(10, arrival=1.0)
    parent.num_forks_pending = 1  # n=2
    sch.add(parent)
    step(sch)  # 7 of its 10 prompt tokens
    older = seq(9, arrival=0.0, first=100)
    sch.add(older)
    batch = sch.schedule()  # the parent's last 3 (then it forks), older's first 4
    [(child, _)] = sch.fork(batch)
    sch.advance(batch)
    sch.settle([parent, child], [7, 8], lambda s, i: False)
    shared = parent.block_table.block_ids[-1]
    assert child.block_table.block_ids[-1] == shared and sch.blocks.num_used_blocks == 4
    batch = sch.schedule()  # the parent's decode copies the shared block to the free one;
    # then older's 5 tokens need 2 more blocks: the child goes, then the parent with its copy
    assert sch.stats.preemptions == 2 and parent in sch.waiting and child in sch.waiting
    assert batch.seqs == [older] and batch.block_copies == []
    assert sch.blocks.num_used_blocks == len(older.block_table.block_ids) == 3


def test_max_model_len_ends_a_sample_without_max_tokens():
    sch = Scheduler(SchedulerConfig(max_model_len=12, max_num_batched_tokens=64),
                    BlockManager(16, 4))
    s = seq(8, arrival=0.0, max_tokens=None)
    sch.add(s)
    for _ in range(20):
        if s.is_finished:
            break
        step(sch)
    assert s.finish_reason == "length"
    assert s.num_tokens == 12  # the context is full: no position past max_model_len


def test_a_sequence_leaving_by_length_frees_its_seat_for_a_fork():
    """Asynchronous scheduling: a sequence whose in-flight token ends it by length holds no
    seat, for admission and for the forks of a prompt completing this step alike."""
    sch = Scheduler(SchedulerConfig(max_model_len=64, max_num_batched_tokens=64, max_num_seqs=2),
                    BlockManager(16, 4))
    leaving = seq(4, arrival=0.0, max_tokens=1)
    sch.add(leaving)
    sch.advance(sch.schedule())  # its one token is in flight (not settled): it ends by length
    parent = seq(5, arrival=1.0, first=60)
    parent.num_forks_pending = 1  # n=2
    sch.add(parent)
    batch = sch.schedule()
    assert batch.seqs == [parent]  # admitted: the leaving sequence's seat counts as free
    [(child, _)] = sch.fork(batch)
    assert child in batch.seqs and child in sch.running and child not in sch.waiting


def test_a_preempted_salted_sample_keeps_its_salt():
    """A preempted sample gets a new block table: with its request's cache_salt, so that its
    recompute hits its own salt's blocks and none of an unsalted prompt's."""
    sch = Scheduler(SchedulerConfig(max_model_len=64, max_num_batched_tokens=64),
                    BlockManager(3, 4))
    old = seq(4, arrival=0.0)
    new = Sequence("salted", list(range(10, 14)), SamplingParams(
        max_tokens=100, ignore_eos=True, cache_salt="s"), arrival=1.0)
    sch.add(old)
    sch.add(new)
    step(sch)  # both prefill a full block, the same tokens, cached under two keys
    step(sch)  # each needs a second block: one is left, and the salted one is preempted
    assert sch.stats.preemptions == 1 and new in sch.waiting
    assert new.block_table.salt == "s"
    hit = sch.blocks.match_prefix(new.token_ids, 4, salt="s")
    assert len(hit.block_ids) == 1 and hit.block_ids != old.block_table.block_ids[:1]


def test_priority_orders_admission_and_preemption():
    """Lower priority values are admitted first and preempted last, whatever their arrival
    (vLLM's priority policy); equal priorities keep the order of arrival."""
    sch = Scheduler(SchedulerConfig(max_model_len=64, max_num_batched_tokens=64,
                                    max_num_seqs=1), BlockManager(16, 4))

    def ranked(arrival: float, priority: int, prompt: tuple = (5, 6, 7), max_tokens: int = 2
               ) -> Sequence:
        return Sequence(f"r{arrival:g}", list(prompt), SamplingParams(
            max_tokens=max_tokens, ignore_eos=True), arrival=arrival, priority=priority)

    seqs = [ranked(0.0, 3), ranked(1.0, -1), ranked(2.0, 3), ranked(3.0, 0)]
    for s in seqs:
        sch.add(s)
    admitted = []
    while sch.waiting or sch.running:
        batch = step(sch)
        admitted += [s for s in batch.seqs if s not in admitted]
    assert admitted == [seqs[1], seqs[3], seqs[0], seqs[2]]
    # Preemption: the older sequence of a higher priority value is the victim.
    sch = Scheduler(SchedulerConfig(max_model_len=64, max_num_batched_tokens=64),
                    BlockManager(2, 4, enable_prefix_caching=False))
    old, urgent = ranked(0.0, 1, (1, 2, 3, 4), 10), ranked(1.0, 0, (5, 6, 7, 8), 10)
    for s in (old, urgent):
        sch.add(s)
    step(sch)  # both fill their block; the next tokens need a third
    batch = sch.schedule()
    assert sch.stats.preemptions == 1 and batch.seqs == [urgent] and old in sch.waiting


def test_a_prompt_chunk_of_one_token_is_no_decode():
    """A decode dropped as a victim gives its token back to the budget, so a prompt chunk
    cut to one token may now have sequences after it. The batch's decodes are the rows that
    sample: the decode graphs give one logits row each, and a chunk of one token that ends
    no prompt samples nothing (counted a decode, the row after it got its logits)."""
    sch = Scheduler(SchedulerConfig(max_model_len=8, max_num_batched_tokens=2),
                    BlockManager(8, 1, enable_prefix_caching=False))  # 8 tokens: the pool's

    def ranked(prompt: list[int], arrival: float, priority: int) -> Sequence:
        return Sequence(f"r{arrival:g}", prompt, SamplingParams(max_tokens=8, ignore_eos=True),
                        arrival=arrival, priority=priority)

    sch.add(ranked([7], 0.0, 5))
    step(sch)  # it decodes from now on
    urgent = ranked(list(range(20, 26)), 1.0, 0)
    sch.add(urgent)
    sch.add(ranked([9], 2.0, 5))
    beside_a_chunk = 0
    while sch.running or sch.waiting:
        batch = sch.schedule()
        one = [s.num_scheduled_tokens == 1 for s in batch.seqs]
        sampling = [s.num_cached_tokens + s.num_scheduled_tokens == s.num_tokens
                    for s in batch.seqs]
        assert all(one[:batch.num_decodes]) and all(sampling[:batch.num_decodes])
        beside_a_chunk += batch.num_decodes > 0 and any(
            o and not t for o, t in zip(one, sampling, strict=True))
        sch.advance(batch)
        done = [s for s in batch.seqs if s.last_token_pending]
        sch.settle(done, [7] * len(done), lambda s, i: False)
    assert sch.stats.preemptions >= 1 and beside_a_chunk >= 1
