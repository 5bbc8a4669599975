"""The block manager's prefix cache, copy-on-write and allocation, case by case
(docs/design.md §2, §3, §5, §6, §7). The property tests over random operation sequences
are in test_block_manager_stateful.py."""

from dataclasses import asdict

import pagedserve.paging.block_manager as block_manager_module
from pagedserve.paging import BlockManager, BlockTable, PrefixMatch


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
    # Both blocks are cached: the second under its parent's generation, not the first's key.
    assert m.match_prefix([1, 2, 3, 4, 5], 4).block_ids == a.block_ids[:2]
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


def test_a_block_whose_parent_was_evicted_does_not_keep_its_content_out_of_the_cache():
    """Regression (a prefix-cache probe): two identical prompts computed at once share
    generations, so B's next block was cached under A's block; A freed first, A's block was
    evicted before B's. B's block, hittable no more, kept its hash: the same content
    computed again after a new parent was never cached, and every later prompt with that
    prefix recomputed it."""
    m = BlockManager(8, 2)
    prompt = [1, 2, 3, 4]
    a, b = BlockTable(), BlockTable()
    assert m.allocate_slots(a, prompt, 0, 4) == [] and m.allocate_slots(b, prompt, 0, 4) == []
    m.commit(a, prompt, 4)
    m.commit(b, prompt, 4)  # the same content: b adopts a's generations
    for end in (5, 6):  # B decodes 5, 6: its third block is cached, after a's second
        run(m, b, [*prompt, 5, 6][:end], end - 1, 1)
    m.free(a)
    m.free(b)
    other = BlockTable()  # evicts every block without content, then a's second block
    assert m.allocate_slots(other, [9] * 12, 0, 12) == []
    m.free(other)
    follow_up = [1, 2, 3, 4, 5, 6, 7]
    assert len(admit(m, follow_up)[1].block_ids) == 1  # a's first block: the rest is gone
    assert len(m.match_prefix(follow_up, 6).block_ids) == 3, (
        "the follow-up's blocks, computed again, are cached")
    m.check_invariants()


def test_a_fork_commits_its_parents_registered_block_once(monkeypatch):
    """A fork's parent and child commit the same physical blocks. Where a collision left
    their first block unregistered, each took its own generation for it; the second block,
    registered by the parent, must not be registered again under the child's (two keys for
    one block, the first left pointing at content that no longer names it)."""
    monkeypatch.setattr(block_manager_module, "chain_hash", lambda parent, tokens: 42)
    m = BlockManager(8, 2)
    other, _ = admit(m, [9, 9, 9])  # holds the key (0, 42): the prompt's first block collides
    prompt = [1, 2, 3, 4, 5]
    parent = BlockTable()
    assert m.allocate_slots(parent, prompt, 0, 5) == []
    child = m.fork(parent)  # after the forward, before commit (prefill-then-fork)
    m.commit(parent, prompt, 5)
    m.commit(child, prompt, 5)
    m.check_invariants()
    assert child.block_gens[1] == parent.block_gens[1]  # the block's one content
    for table in (parent, child, other):
        m.free(table)
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


def admit_salted(m: BlockManager, tokens, salt: str | None) -> tuple[BlockTable, PrefixMatch]:
    table = BlockTable(salt=salt)
    hit = m.match_prefix(tokens, len(tokens) - 1, salt=salt)
    cached = len(hit.block_ids) * m.block_size
    run(m, table, tokens, cached, len(tokens) - cached, hit)
    return table, hit


def test_a_salted_prefix_is_hit_under_its_salt_alone():
    """vLLM's cache_salt: blocks computed under a salt are hit by tables of that salt only
    (forks and the same salt's later prompts), not by unsalted ones, nor the reverse."""
    m = BlockManager(16, 2)
    prompt = [1, 2, 3, 4, 5]
    a, hit = admit_salted(m, prompt, "tenant-a")
    assert hit.block_ids == []
    assert m.match_prefix(prompt, 4).block_ids == []  # unsalted
    assert m.match_prefix(prompt, 4, salt="tenant-b").block_ids == []
    assert m.match_prefix(prompt, 4, salt="tenant-a").block_ids == a.block_ids[:2]
    assert m.fork(a).salt == "tenant-a"
    plain, hit = admit_salted(m, prompt, None)
    assert hit.block_ids == [] and set(plain.block_ids).isdisjoint(a.block_ids)
    assert admit_salted(m, [*prompt, 6], "tenant-a")[1].block_ids == a.block_ids[:2]
    assert admit_salted(m, [*prompt, 6], None)[1].block_ids == plain.block_ids[:2]
    m.check_invariants()


def test_a_hash_collision_across_salts_is_no_hit(monkeypatch):
    """Every hash equal: the salt is checked with the tokens, so another salt's block (or
    an unsalted one) is never served."""
    monkeypatch.setattr(block_manager_module, "chain_hash", lambda parent, tokens: 42)
    m = BlockManager(16, 2)
    prompt = [1, 2, 3, 4, 5]
    a, _ = admit_salted(m, prompt, "tenant-a")
    assert m.match_prefix(prompt, 4, salt="tenant-a").block_ids == a.block_ids[:2]
    for salt in (None, "tenant-b"):
        assert m.match_prefix(prompt, 4, salt=salt).block_ids == [], salt
        table, hit = admit_salted(m, prompt, salt)
        assert hit.block_ids == [] and set(table.block_ids).isdisjoint(a.block_ids)
    m.check_invariants()
