"""The block manager (DESIGN.md §2, §3, §5, §6): property tests over random scheduler-like
operation sequences against a shadow model of the KV pool, plus unit tests of the cache.

The shadow model remembers, for every slot of every physical block, which K/V was written
there. A token's K/V is a function of its whole prefix (token ids up to and including it,
hence also its position), so a slot holds ``tuple(token_ids[: pos + 1])``, or None if never
written. A sequence's view is correct when every computed position reads back its own
prefix through its block table.
"""

from collections import Counter
from dataclasses import asdict, dataclass, field

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

import pagedserve.paging.block_manager as block_manager_module
from pagedserve.paging import BlockManager, BlockTable, PrefixMatch

VOCAB = 3  # tiny, so prompts share prefixes and whole blocks repeat
MAX_PROMPT = 12
MAX_LEN = 20  # a sequence finishes once it has this many tokens
MAX_LIVE = 10

Kv = tuple[int, ...]  # what a slot holds: the K/V of token kv[-1] at position len(kv) - 1


@dataclass(eq=False)
class Seq:
    tokens: list[int]
    table: BlockTable = field(default_factory=BlockTable)
    computed: int = 0  # num_cached_tokens
    inflight: int = 0  # tokens allocated for the current step, not computed yet


class BlockManagerMachine(RuleBasedStateMachine):
    """Drives a BlockManager the way the scheduler does (match_prefix -> allocate_slots ->
    forward -> [fork] -> commit; decode; preempt and re-admit; abort) and checks DESIGN.md §3
    invariants 4-7 against a shadow of what each slot holds."""

    prefix_caching = True
    exact_hash = True  # False: chain_hash is patched to collide, hashes no longer identify

    def __init__(self):
        super().__init__()
        self.live: list[Seq] = []
        self.waiting: list[list[int]] = []  # token ids of preempted sequences

    @initialize(num_blocks=st.integers(8, 24), block_size=st.integers(2, 4))
    def setup(self, num_blocks, block_size):
        self.m = BlockManager(num_blocks, block_size, enable_prefix_caching=self.prefix_caching)
        self.bs = block_size
        self.shadow: list[list[Kv | None]] = [[None] * block_size for _ in range(num_blocks)]

    # ---- helpers ---------------------------------------------------------------------
    def _state(self, seq: Seq):
        """Everything allocate_slots may change, seen through the public interface."""
        refs = tuple(self.m.ref_count(b) for b in range(self.m.num_blocks))
        return refs, self.m.num_free_blocks, asdict(seq.table)

    def _check_hit(self, tokens: list[int], hit: PrefixMatch) -> None:
        """Prefix-cache correctness: hit blocks hold exactly the K/V this prompt needs."""
        bs = self.bs
        assert len(hit.block_ids) == len(hit.block_hashes)
        assert len(hit.block_ids) * bs <= len(tokens) - 1, "a hit must leave a token to compute"
        assert len(set(hit.block_ids)) == len(hit.block_ids), "one block hit at two positions"
        if not self.prefix_caching:
            assert not hit.block_ids and not hit.next_block_pending
        if hit.next_block_pending:
            # Someone live is computing the next block, same prefix, this very step; a stale
            # flag would make the scheduler wait for it forever. (Under colliding hashes the
            # flag may name another prefix's block: a one-step wait, not wrong K/V.)
            end = (len(hit.block_ids) + 1) * bs
            assert any(s.inflight and (not self.exact_hash or (
                s.computed < end <= s.computed + s.inflight and s.tokens[:end] == tokens[:end]))
                for s in self.live), "next_block_pending but nobody is computing that block"
        for i, block in enumerate(hit.block_ids):
            for offset in range(bs):
                pos = i * bs + offset
                assert self.shadow[block][offset] == tuple(tokens[: pos + 1]), (
                    f"prefix hit serves wrong K/V: block {block} slot {offset} holds "
                    f"{self.shadow[block][offset]}, position {pos} needs {tokens[: pos + 1]}")

    def _allocate(self, seq: Seq, num_new: int, hit: PrefixMatch | None = None) -> bool:
        before = self._state(seq)
        copies = self.m.allocate_slots(seq.table, seq.tokens, seq.computed, num_new, hit)
        if copies is None:
            assert self._state(seq) == before, "a failed allocate_slots changed something"
            return False
        for src, dst in copies:  # the copy-on-write is done before the forward
            assert src != dst
            assert self.m.ref_count(dst) == 1, "copy-on-write target is shared"
            assert self.m.ref_count(src) >= 1, "copy-on-write source was freed before the copy"
            assert dst in seq.table.block_ids and src not in seq.table.block_ids
            self.shadow[dst] = list(self.shadow[src])
        seq.inflight = num_new
        end = seq.computed + num_new
        assert len(seq.table.block_ids) >= self.m.blocks_needed(end)
        # Invariant 5 at allocation time: every block this step writes is exclusively ours.
        for pos in range(seq.computed, end):
            assert self.m.ref_count(seq.table.block_ids[pos // self.bs]) == 1
        # The child still sees its own prefix after the copies (and any hit).
        self._check_view(seq)
        return True

    def _write(self, seq: Seq) -> None:
        """The forward: store the K/V of the scheduled tokens through the slot mapping."""
        bs = self.bs
        for pos in range(seq.computed, seq.computed + seq.inflight):
            block = seq.table.block_ids[pos // bs]
            slot = seq.table.slot(pos, bs)
            assert slot == block * bs + pos % bs  # invariant 4
            assert self.m.ref_count(block) == 1, f"write into shared block {block}"  # inv. 5
            self.shadow[slot // bs][slot % bs] = tuple(seq.tokens[: pos + 1])

    def _check_view(self, seq: Seq) -> None:
        bs = self.bs
        for pos in range(seq.computed):
            block = seq.table.block_ids[pos // bs]
            assert self.shadow[block][pos % bs] == tuple(seq.tokens[: pos + 1]), (
                f"position {pos} reads K/V of {self.shadow[block][pos % bs]}, "
                f"not of {seq.tokens[: pos + 1]}")

    def _free(self, seq: Seq) -> None:
        self.m.free(seq.table)
        assert seq.table.block_ids == [] and seq.table.block_hashes == []
        self.live.remove(seq)

    def _admit(self, tokens: list[int], data) -> bool:
        seq = Seq(list(tokens))
        hit = self.m.match_prefix(seq.tokens, len(seq.tokens) - 1)
        self._check_hit(seq.tokens, hit)
        seq.computed = len(hit.block_ids) * self.bs
        num_new = data.draw(st.integers(1, len(seq.tokens) - seq.computed), label="chunk")
        if not self._allocate(seq, num_new, hit):
            assert seq.table.block_ids == []
            return False
        assert seq.table.block_ids[: len(hit.block_ids)] == hit.block_ids
        self.live.append(seq)
        return True

    def _idle(self) -> list[Seq]:
        return [s for s in self.live if not s.inflight]

    # ---- rules -----------------------------------------------------------------------
    @precondition(lambda self: len(self.live) < MAX_LIVE)
    @rule(tokens=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=MAX_PROMPT),
          data=st.data())
    def admit(self, tokens, data):
        self._admit(tokens, data)

    @precondition(lambda self: self.waiting and len(self.live) < MAX_LIVE)
    @rule(data=st.data())
    def readmit_preempted(self, data):
        i = data.draw(st.integers(0, len(self.waiting) - 1), label="waiting index")
        if self._admit(self.waiting[i], data):
            del self.waiting[i]

    @precondition(lambda self: any(not s.inflight for s in self.live))
    @rule(data=st.data())
    def schedule(self, data):
        """Blocks for the next chunk of a prompt, or for one decode token."""
        seq = data.draw(st.sampled_from(self._idle()), label="seq")
        remaining = len(seq.tokens) - seq.computed
        assert remaining >= 1
        self._allocate(seq, data.draw(st.integers(1, remaining), label="chunk"))

    @precondition(lambda self: any(s.inflight for s in self.live))
    @rule(data=st.data())
    def compute(self, data):
        """Forward, then (scheduler.fork) children, then postprocess: commit, append."""
        seq = data.draw(st.sampled_from([s for s in self.live if s.inflight]), label="seq")
        self._write(seq)
        end = seq.computed + seq.inflight
        group = [seq]
        if end == len(seq.tokens) and len(self.live) < MAX_LIVE:
            for _ in range(data.draw(st.integers(0, 3), label="forks")):
                child = Seq(list(seq.tokens), self.m.fork(seq.table), seq.computed, seq.inflight)
                self.live.append(child)
                group.append(child)
        for s in group:
            self.m.commit(s.table, s.tokens, end)
            s.computed, s.inflight = end, 0
            self._check_view(s)
            if end == len(s.tokens):  # the prompt is done: the sampled token is kept
                s.tokens.append(data.draw(st.integers(0, VOCAB - 1), label="sampled"))
                if len(s.tokens) >= MAX_LEN:
                    self._free(s)

    @precondition(lambda self: len(self.live) < MAX_LIVE
                  and any(not s.inflight and s.computed == len(s.tokens) - 1
                          for s in self.live))
    @rule(data=st.data())
    def fork_decoding(self, data):
        """Fork a sequence between decode steps; the child samples its own last token."""
        seq = data.draw(st.sampled_from(
            [s for s in self._idle() if s.computed == len(s.tokens) - 1]), label="seq")
        child = Seq(list(seq.tokens), self.m.fork(seq.table), seq.computed)
        child.tokens[-1] = data.draw(st.integers(0, VOCAB - 1), label="child token")
        self.live.append(child)
        assert child.table.block_ids == seq.table.block_ids
        assert child.table.block_ids is not seq.table.block_ids
        for block in seq.table.block_ids:
            assert self.m.ref_count(block) >= 2

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def finish_or_abort(self, data):
        """Free a sequence, possibly mid-step (an abort before its forward's postprocess)."""
        self._free(data.draw(st.sampled_from(self.live), label="seq"))

    @precondition(lambda self: any(not s.inflight for s in self.live))
    @rule(data=st.data())
    def preempt(self, data):
        seq = data.draw(st.sampled_from(self._idle()), label="seq")
        self._free(seq)
        self.waiting.append(seq.tokens)

    # ---- invariants ------------------------------------------------------------------
    @invariant()
    def pool_accounting(self):  # invariant 6
        m = self.m
        m.check_invariants()
        refs = [m.ref_count(b) for b in range(m.num_blocks)]
        assert min(refs) >= 0
        assert m.num_free_blocks + m.num_used_blocks == m.num_blocks
        assert m.num_used_blocks == sum(1 for r in refs if r > 0)
        assert m.num_shared_blocks == sum(1 for r in refs if r > 1)

    @invariant()
    def ref_counts_are_table_references(self):
        """A block's ref count is the number of live block tables holding it, so slots are
        unique across live sequences except in shared blocks."""
        counts = Counter()
        for seq in self.live:
            assert len(set(seq.table.block_ids)) == len(seq.table.block_ids)
            counts.update(seq.table.block_ids)
        for block in range(self.m.num_blocks):
            assert self.m.ref_count(block) == counts[block], f"block {block}"

    @invariant()
    def views_and_write_slots(self):
        slots = []
        for seq in self.live:
            self._check_view(seq)
            slots += [seq.table.slot(p, self.bs)
                      for p in range(seq.computed, seq.computed + seq.inflight)]
        assert len(set(slots)) == len(slots), "two in-flight tokens write the same slot"

    def teardown(self):
        if not hasattr(self, "m"):
            return
        for seq in list(self.live):
            self._free(seq)
        self.m.check_invariants()
        assert self.m.num_used_blocks == 0, "blocks leaked after every sequence was freed"
        assert self.m.num_free_blocks == self.m.num_blocks
        assert all(self.m.ref_count(b) == 0 for b in range(self.m.num_blocks))


class NoPrefixCachingMachine(BlockManagerMachine):
    prefix_caching = False


class CollidingHashMachine(BlockManagerMachine):
    exact_hash = False


STATEFUL = settings(
    max_examples=300, stateful_step_count=50, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])

TestBlockManagerStateful = BlockManagerMachine.TestCase
TestBlockManagerStateful.settings = STATEFUL
TestNoPrefixCachingStateful = NoPrefixCachingMachine.TestCase
TestNoPrefixCachingStateful.settings = settings(STATEFUL, max_examples=60)


# ---- unit tests ----------------------------------------------------------------------
def run(m: BlockManager, table: BlockTable, tokens, computed: int, num_new: int,
        hit: PrefixMatch | None = None) -> list[tuple[int, int]]:
    """One step: allocate, (forward), commit. Returns the copy-on-write pairs."""
    copies = m.allocate_slots(table, tokens, computed, num_new, hit)
    assert copies is not None
    m.commit(table, tokens, computed + num_new)
    return copies


def no_hit(match: PrefixMatch) -> bool:
    return match.block_ids == [] and match.block_hashes == [] and not match.next_block_pending


def admit(m: BlockManager, tokens) -> tuple[BlockTable, PrefixMatch]:
    """Match the prompt and prefill the rest of it in one step."""
    table = BlockTable()
    hit = m.match_prefix(tokens, len(tokens) - 1)
    cached = len(hit.block_ids) * m.block_size
    run(m, table, tokens, cached, len(tokens) - cached, hit)
    return table, hit


def test_freed_blocks_keep_their_hashes_and_are_hit():
    m = BlockManager(8, 2)
    prompt = [1, 2, 3, 4, 5]
    a, hit = admit(m, prompt)
    assert hit.block_ids == [] and m.num_used_blocks == 3
    full = a.block_ids[:2]
    m.free(a)
    assert m.num_used_blocks == 0 and m.num_free_blocks == 8
    b, hit = admit(m, prompt + [6, 7])
    assert hit.block_ids == full, "a freed block keeps its K/V and hash until evicted"
    assert b.block_ids[:2] == full
    assert all(m.ref_count(x) == 1 for x in b.block_ids)
    assert m.num_used_blocks == 4
    # The prompt's own last token is always computed: a fully cached prompt hits one less.
    assert m.match_prefix([1, 2, 3, 4], 3).block_ids == full[:1]
    m.free(b)
    m.check_invariants()


def test_uncommitted_blocks_are_not_hit():
    """Invariant 7: only computed full blocks are hittable (allocated is not enough)."""
    m = BlockManager(8, 2)
    prompt = [1, 2, 3, 4, 5, 6, 7]
    a = BlockTable()
    assert m.allocate_slots(a, prompt, 0, 3) == []  # a chunk: block 0 full, block 1 half
    assert m.match_prefix(prompt, 6).block_ids == []
    m.commit(a, prompt, 3)
    assert m.match_prefix(prompt, 6).block_ids == a.block_ids[:1]
    assert m.allocate_slots(a, prompt, 3, 4) == []
    assert m.match_prefix(prompt, 6).block_ids == a.block_ids[:1]
    m.commit(a, prompt, 7)
    assert m.match_prefix(prompt, 6).block_ids == a.block_ids[:3]


def test_abort_before_commit_leaves_nothing_hittable():
    m = BlockManager(8, 2)
    prompt = [1, 2, 3, 4, 5]
    a = BlockTable()
    assert m.allocate_slots(a, prompt, 0, 5) == []
    assert m.match_prefix(prompt, 4).next_block_pending
    m.free(a)  # aborted before its forward was committed: its K/V may never be written
    match = m.match_prefix(prompt, 4)
    assert match.block_ids == [] and not match.next_block_pending
    b, hit = admit(m, prompt)
    assert hit.block_ids == []
    assert m.match_prefix(prompt, 4).block_ids == b.block_ids[:2]


def test_lru_evicts_least_recently_freed_first():
    m = BlockManager(6, 2)
    a, _ = admit(m, [1, 1, 1, 1, 1])  # blocks: 2 full + 1 partial
    b, _ = admit(m, [2, 2, 2])  # 1 full + 1 partial
    a_full, b_full = a.block_ids[:2], b.block_ids[:1]
    assert m.num_free_blocks == 1
    m.free(a)
    m.free(b)  # b freed after a: a's blocks are older
    assert m.num_free_blocks == 6
    # Partial blocks hold nothing worth keeping: they are reused before any cached block.
    filler = BlockTable()
    assert m.allocate_slots(filler, [9] * 6, 0, 6) == []  # 3 fresh blocks, nothing evicted
    assert m.match_prefix([1, 1, 1, 1, 1], 4).block_ids == a_full
    assert m.match_prefix([2, 2, 2], 2).block_ids == b_full
    # The next block evicted is a's tail (least recently freed, tail before head).
    assert m.allocate_slots(filler, [9] * 8, 6, 2) == []
    assert m.match_prefix([1, 1, 1, 1, 1], 4).block_ids == a_full[:1]
    assert m.match_prefix([2, 2, 2], 2).block_ids == b_full
    # Then a's head, and only then b's block.
    assert m.allocate_slots(filler, [9] * 10, 8, 2) == []
    assert m.match_prefix([1, 1, 1, 1, 1], 4).block_ids == []
    assert m.match_prefix([2, 2, 2], 2).block_ids == b_full
    assert m.allocate_slots(filler, [9] * 12, 10, 2) == []
    assert m.match_prefix([2, 2, 2], 2).block_ids == []
    assert m.num_free_blocks == 0
    m.free(filler)
    m.check_invariants()
    assert m.num_used_blocks == 0


def test_prefix_head_is_evicted_last():
    m = BlockManager(5, 2)
    prompt = [1, 2, 3, 4, 5, 6, 7]
    a, _ = admit(m, prompt)  # 3 full blocks and a partial one
    full = a.block_ids[:3]
    m.free(a)
    other = BlockTable()
    # The never-used block and the freed partial one hold nothing cached: they go first.
    assert m.allocate_slots(other, [0] * 4, 0, 4) == []
    assert m.match_prefix(prompt, 6).block_ids == full
    for k in (1, 2, 3):  # one more block at a time: each evicts the LRU cached block
        assert m.allocate_slots(other, [0] * (4 + 2 * k), 2 + 2 * k, 2) == []
        assert m.match_prefix(prompt, 6).block_ids == full[: 3 - k], (
            "the tail of a prefix is evicted first, its head last")
    m.free(other)


def test_revived_block_is_not_evicted_while_in_use():
    m = BlockManager(4, 2)
    a, _ = admit(m, [1, 2, 3])
    m.free(a)
    b, hit = admit(m, [1, 2, 3, 4, 5])
    assert len(hit.block_ids) == 1 and m.ref_count(hit.block_ids[0]) == 1
    c = BlockTable()
    assert m.allocate_slots(c, [7] * 4, 0, 4) is None  # only 1 free block left
    assert m.allocate_slots(c, [7] * 2, 0, 2) == []
    assert m.match_prefix([1, 2, 3], 2).block_ids == hit.block_ids
    m.free(b)
    m.free(c)
    m.check_invariants()


def test_hash_collision_cannot_serve_wrong_tokens(monkeypatch):
    monkeypatch.setattr(block_manager_module, "chain_hash", lambda parent, tokens: 42)
    m = BlockManager(8, 2)
    a, _ = admit(m, [1, 2, 3, 4, 5])
    assert m.match_prefix([1, 2, 3, 4, 5], 4).block_ids == a.block_ids[:1]
    # Same hash everywhere, different tokens: refused.
    for prompt in ([3, 4, 5], [2, 1, 5], [1, 3, 5], [3, 4, 1, 2, 5]):
        assert m.match_prefix(prompt, len(prompt) - 1).block_ids == [], prompt
    # Block 1 of [1, 2, 1, 2] has the same hash and tokens as block 0, another parent.
    assert m.match_prefix([1, 2, 1, 2, 5], 4).block_ids == a.block_ids[:1]
    b, hit = admit(m, [7, 7, 3])
    assert hit.block_ids == [] and set(b.block_ids).isdisjoint(a.block_ids)
    m.free(a)
    m.free(b)
    m.check_invariants()


def test_hash_collision_on_a_parent_cannot_serve_wrong_kv(monkeypatch):
    """Regression: a block that names its parent by hash alone is hit after a *different*
    parent whose hash collides (block 0 of X and of Y below)."""
    real = block_manager_module.chain_hash

    def weak(parent, tokens):  # tokens 1 and 11 collide, nothing else does
        return real(parent, [t % 10 for t in tokens])

    monkeypatch.setattr(block_manager_module, "chain_hash", weak)
    m = BlockManager(8, 2)
    x_prompt, y_prompt = [1, 1, 5, 5, 9], [11, 11, 5, 5, 9]
    x = BlockTable()
    run(m, x, x_prompt, 0, 2)  # X prefills its first block only (a chunk): cached
    y, hit = admit(m, y_prompt)  # Y's block 0 collides with X's: refused, computed anew
    assert hit.block_ids == []
    # Y's block 1 (K/V of 5, 5 after 11, 11) is now cached under hash(hash(1, 1), (5, 5)).
    hit = m.match_prefix(x_prompt, 4)
    assert hit.block_ids[:1] == x.block_ids[:1]
    assert y.block_ids[1] not in hit.block_ids, (
        "X's continuation is served the K/V Y computed after a different prefix")


def test_fork_shares_every_block_and_copies_the_partial_one_per_writer():
    m = BlockManager(16, 4)
    prompt = [1, 2, 3, 4, 5, 6]  # one full block and a partial one
    parent = BlockTable()
    assert m.allocate_slots(parent, prompt, 0, 6) == []
    n = 4
    children = [m.fork(parent) for _ in range(n - 1)]  # after the forward, before commit
    tables = [parent, *children]
    for t in tables:
        m.commit(t, prompt, 6)
        assert t.block_ids == parent.block_ids
    full, partial = parent.block_ids
    assert m.ref_count(full) == n and m.ref_count(partial) == n
    assert m.num_used_blocks == 2 and m.num_shared_blocks == 2
    copies = []
    for i, t in enumerate(tables):  # each sample decodes its own token at position 6
        tokens = [*prompt, 100 + i]
        step = m.allocate_slots(t, tokens, 6, 1)
        copies += step
        assert m.ref_count(t.block_ids[1]) == 1, "about to write a shared block"
        assert t.block_ids[0] == full
        m.commit(t, tokens, 7)
    assert len(copies) == n - 1, "one copy per writer but the last"
    assert all(src == partial for src, _ in copies)
    assert len({dst for _, dst in copies}) == n - 1
    assert tables[-1].block_ids[1] == partial, "the last writer writes in place"
    assert m.ref_count(full) == n
    assert m.num_used_blocks == 1 + n
    # The full prompt block is never copied, however long the samples run.
    for i, t in enumerate(tables):
        tokens = [*prompt, 100 + i, 7]
        assert m.allocate_slots(t, tokens, 7, 1) == []
        m.commit(t, tokens, 8)
    for t in tables:
        m.free(t)
    m.check_invariants()
    assert m.num_used_blocks == 0


def test_fork_at_block_boundary_copies_nothing():
    m = BlockManager(8, 2)
    parent = BlockTable()
    assert m.allocate_slots(parent, [1, 2, 3, 4], 0, 4) == []
    child = m.fork(parent)
    for t, token in ((parent, 5), (child, 6)):
        m.commit(t, [1, 2, 3, 4], 4)
        assert m.allocate_slots(t, [1, 2, 3, 4, token], 4, 1) == []
        m.commit(t, [1, 2, 3, 4, token], 5)
    assert parent.block_ids[:2] == child.block_ids[:2]
    assert parent.block_ids[2] != child.block_ids[2]
    assert m.num_used_blocks == 4
    m.free(parent)
    m.free(child)
    assert m.num_used_blocks == 0


def test_allocate_slots_returns_none_and_changes_nothing_when_short():
    m = BlockManager(4, 2)

    def snapshot(table):
        return [m.ref_count(b) for b in range(4)], m.num_free_blocks, asdict(table)

    # Fresh blocks.
    t = BlockTable()
    before = snapshot(t)
    assert m.allocate_slots(t, [1] * 9, 0, 9) is None
    assert snapshot(t) == before
    assert no_hit(m.match_prefix([1] * 9, 8))

    # Reviving free cached blocks counts against the pool too.
    a, _ = admit(m, [1, 2, 3, 4, 5])  # 3 blocks
    m.free(a)
    t = BlockTable()
    hit = m.match_prefix([1, 2, 3, 4, 5, 6, 7, 8, 9], 8)
    assert len(hit.block_ids) == 2
    before = snapshot(t)
    assert m.allocate_slots(t, [1, 2, 3, 4, 5, 6, 7, 8, 9], 4, 5, hit) is None  # 2 + 3 > 4
    assert snapshot(t) == before
    assert m.match_prefix([1, 2, 3, 4, 5, 6, 7, 8, 9], 8).block_ids == hit.block_ids

    # A copy-on-write needs a block too.
    p = BlockTable()
    run(m, p, [5, 5, 5], 0, 3)
    c = m.fork(p)
    filler = BlockTable()
    assert m.allocate_slots(filler, [6, 6, 6, 6], 0, 4) == []
    assert m.num_free_blocks == 0
    before = snapshot(c)
    parent_before = snapshot(p)
    assert m.allocate_slots(c, [5, 5, 5, 8], 3, 1) is None
    assert snapshot(c) == before and snapshot(p) == parent_before
    m.free(filler)
    assert m.allocate_slots(c, [5, 5, 5, 8], 3, 1) == [(p.block_ids[1], c.block_ids[1])]
    for t in (p, c):
        m.free(t)
    m.check_invariants()
    assert m.num_used_blocks == 0


def test_identical_prompts_in_one_step_share_instead_of_duplicating():
    m = BlockManager(16, 2)
    prompt = [1, 2, 3, 4, 5]
    a = BlockTable()
    assert no_hit(m.match_prefix(prompt, 4))
    assert m.allocate_slots(a, prompt, 0, 5) == []  # being computed this step
    match = m.match_prefix(prompt, 4)
    assert match.block_ids == [] and match.next_block_pending, (
        "the block after the hits is being computed this step")
    # A prompt that diverges inside block 0 is not told to wait.
    assert not m.match_prefix([1, 9, 3, 4, 5], 4).next_block_pending
    # After a partial prefix: the pending flag is about the block right after the hits.
    m.commit(a, prompt, 5)
    b, hit = admit(m, prompt)  # the scheduler waited one step and now hits
    assert hit.block_ids == a.block_ids[:2] and not hit.next_block_pending
    assert b.block_ids[:2] == a.block_ids[:2]
    assert all(m.ref_count(x) == 2 for x in a.block_ids[:2])
    assert m.num_used_blocks == 4, "the shared prefix is stored once"
    m.free(a)
    m.free(b)
    assert m.num_used_blocks == 0


def test_pending_flag_after_a_partial_hit():
    m = BlockManager(16, 2)
    a, _ = admit(m, [1, 2, 3])
    longer = [1, 2, 3, 4, 5, 6, 7]
    b = BlockTable()
    hit = m.match_prefix(longer, 6)
    assert hit.block_ids == a.block_ids[:1] and not hit.next_block_pending
    assert m.allocate_slots(b, longer, 2, 5, hit) == []
    hit = m.match_prefix(longer, 6)
    assert hit.block_ids == a.block_ids[:1] and hit.next_block_pending


def test_duplicate_prompt_admitted_anyway_does_not_clobber_the_cache():
    m = BlockManager(16, 2)
    prompt = [1, 2, 3, 4, 5]
    a, b = BlockTable(), BlockTable()
    assert m.allocate_slots(a, prompt, 0, 5) == []
    assert m.allocate_slots(b, prompt, 0, 5) == []  # did not wait: computes its own copy
    assert set(a.block_ids).isdisjoint(b.block_ids)
    m.commit(a, prompt, 5)
    m.commit(b, prompt, 5)  # its blocks were never registered: the cache keeps pointing at a's
    a_full = a.block_ids[:2]
    assert m.match_prefix(prompt, 4).block_ids == a_full
    m.free(a)
    m.free(b)
    assert m.match_prefix(prompt, 4).block_ids == a_full  # still hittable while free
    m.check_invariants()
    assert m.num_used_blocks == 0


def test_prefix_caching_disabled_never_hits():
    m = BlockManager(8, 2, enable_prefix_caching=False)
    prompt = [1, 2, 3, 4, 5]
    a, hit = admit(m, prompt)
    assert no_hit(hit)
    assert a.block_hashes == []
    b, hit = admit(m, prompt)
    assert no_hit(hit)
    assert set(a.block_ids).isdisjoint(b.block_ids)
    m.free(a)
    m.free(b)
    assert no_hit(m.match_prefix(prompt, 4))
    c, hit = admit(m, prompt)
    assert hit.block_ids == []
    m.free(c)
    assert m.num_used_blocks == 0


# ---- the property test under a collision-prone hash --------------------------------
def _weak_hash(parent: int, tokens) -> int:
    """Seven values; tokens 0 and 2 look alike: collisions at every depth."""
    return hash((parent, *(t % 2 for t in tokens))) % 7


def test_stateful_under_hash_collisions(monkeypatch):
    """Invariant 7 for any hash: collisions may cost hits, never serve wrong K/V."""
    monkeypatch.setattr(block_manager_module, "chain_hash", _weak_hash)
    run_state_machine_as_test(CollidingHashMachine, settings=settings(STATEFUL, max_examples=200))
