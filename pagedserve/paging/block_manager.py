"""The block pool: reference-counted physical blocks, an LRU free queue that keeps block
hashes (so freed blocks can still be hit), and automatic prefix caching.

Paging knows block tables and token ids, never requests or sequences.
"""

import array
from collections import Counter, OrderedDict
from dataclasses import dataclass, field

import xxhash


@dataclass
class BlockTable:
    """One sequence's view of the pool: logical block i -> physical block ``block_ids[i]``.
    Until it is freed, a table only grows at its end, and only its last block is ever
    replaced (copy-on-write of the partial block that a step writes into): full blocks
    before it are computed and never written again. Freed, it stays empty: a sequence that
    runs again (preempted) gets a new table, so that a copy of a table's rows stays valid
    for as long as that table object lives (the model runner keeps them between steps)."""

    block_ids: list[int] = field(default_factory=list)
    # Chained hash of each leading full block that is computed or being computed this step.
    block_hashes: list[int] = field(default_factory=list)
    # Content generation of each leading computed full block (see _Content); its length is
    # the number of blocks already offered to the prefix cache.
    block_gens: list[int] = field(default_factory=list)
    # vLLM's cache_salt: blocks are hit only by tables with the same salt (None: unsalted),
    # so that a tenant cannot learn from a hit's speed what another one's prompts hold.
    salt: str | None = None

    def slot(self, pos: int, block_size: int) -> int:
        """The cache slot of position ``pos``: its block's id * block_size + its offset."""
        return self.block_ids[pos // block_size] * block_size + pos % block_size

    def slots(self, start: int, stop: int, block_size: int) -> list[int]:
        """slot() of each position in [start, stop): one call per sequence, so the model
        runner's per-token loop stays a list comprehension (same arithmetic, inlined)."""
        ids = self.block_ids
        return [ids[p // block_size] * block_size + p % block_size for p in range(start, stop)]

    def copy(self) -> "BlockTable":
        return BlockTable(list(self.block_ids), list(self.block_hashes), list(self.block_gens),
                          self.salt)


@dataclass
class PrefixMatch:
    block_ids: list[int]  # leading blocks whose K/V is already cached
    block_hashes: list[int]
    block_gens: list[int]
    next_block_pending: bool  # the block after the hits is being computed this step


@dataclass(frozen=True)
class _Content:
    """What a cached block holds, checked on every hit. ``gen`` numbers each registered
    content once and is never reused; a block names its parent by that number, so a hit
    chain is verified token by token back to the first block, and no hash collision (at
    any depth) can serve K/V that was computed after a different prefix."""

    hash: int
    parent_gen: int  # 0: the first block of a sequence
    token_ids: tuple[int, ...]
    gen: int
    salt: str | None  # the table's that computed it (checked too, so no collision shares it)


def root_hash(salt: str | None) -> int:
    """The parent hash of a table's first block: 0, or its salt's hash."""
    return 0 if salt is None else xxhash.xxh3_64_intdigest(salt.encode())


def chain_hash(parent: int, token_ids: list[int]) -> int:
    """A block's hash covers its parent's hash and its own tokens: equal hashes mean equal
    prefixes."""
    # (the ids as int64 bytes; an array.array is the cheapest way there for 16 of them)
    return xxhash.xxh3_64_intdigest(array.array("q", token_ids), seed=parent)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._refs = [0] * num_blocks
        # Free blocks, least recently used first; a free block may still hold cached K/V.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._content: dict[int, _Content] = {}  # block id -> content, once hittable
        # (parent's generation, hash) -> block id, computed full blocks. The parent is part
        # of the key so that a block whose parent left the cache (hittable no more) never
        # keeps the same content, computed again after a cached parent, out of the cache.
        self._cached: dict[tuple[int, int], int] = {}
        self._pending: dict[int, int] = {}  # hash -> block id, being computed this step
        self._next_gen = 1
        self._num_shared = 0  # blocks with ref_count > 1, kept current for cheap metrics

    # ---- accounting -------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_shared_blocks(self) -> int:
        return self._num_shared

    def ref_count(self, block_id: int) -> int:
        return self._refs[block_id]

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def check_invariants(self) -> None:
        """docs/design.md §3.6, checked in full; raises AssertionError (also under
        ``python -O``: the engine's fault barrier relies on it). O(pool)."""
        used = sum(1 for r in self._refs if r > 0)
        checks = [
            (all(r >= 0 for r in self._refs), "negative ref count"),
            (used + len(self._free) == self.num_blocks, "free + used != pool size"),
            (all(self._refs[b] == 0 for b in self._free), "a free block is referenced"),
            (self._num_shared == sum(1 for r in self._refs if r > 1), "shared count drifted"),
            (all((c.parent_gen, c.hash) == key if (c := self._content.get(b)) else False
                 for key, b in self._cached.items()),
             "cache map out of sync"),
        ]
        for ok, message in checks:
            if not ok:
                raise AssertionError(message)

    def consistent_with(self, tables: list[BlockTable]) -> bool:
        """The pool's own invariants, and every block's reference count equal to the number
        of ``tables`` (all the live ones) that hold it."""
        try:
            self.check_invariants()
        except AssertionError:
            return False
        held = Counter(b for table in tables for b in table.block_ids)
        return all(self._refs[b] == held[b] for b in range(self.num_blocks))

    # ---- prefix caching ---------------------------------------------------------------
    def match_prefix(self, token_ids: list[int], max_tokens: int,
                     hashes: list[int] | None = None, salt: str | None = None) -> PrefixMatch:
        """The longest run of cached full blocks at the start of ``token_ids[:max_tokens]``,
        computed under the same ``salt`` (BlockTable.salt).
        ``hashes``: the chain hashes of ``token_ids``' leading full blocks from earlier
        calls, extended here as far as this one reads; the caller keeps it only while the
        ids do not change but grow at their end (a waiting sequence, matched every step)."""
        match = PrefixMatch([], [], [], False)
        if not self.enable_prefix_caching:
            return match
        hashes = [] if hashes is None else hashes
        bs, parent_hash, parent_gen = self.block_size, root_hash(salt), 0
        for i in range(max_tokens // bs):
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            if i == len(hashes):
                hashes.append(chain_hash(parent_hash, tokens))
            h = hashes[i]
            block_id = self._cached.get((parent_gen, h))
            content = None if block_id is None else self._content[block_id]
            if content is None or content.token_ids != tokens or content.salt != salt:
                match.next_block_pending = h in self._pending
                break
            match.block_ids.append(block_id)
            match.block_hashes.append(h)
            match.block_gens.append(content.gen)
            parent_hash, parent_gen = h, content.gen
        return match

    def commit(self, table: BlockTable, token_ids: list[int], num_computed_tokens: int) -> None:
        """Make this table's blocks that are now full *and computed* hittable."""
        bs = self.block_size
        if not self.enable_prefix_caching or num_computed_tokens // bs == len(table.block_gens):
            return  # (most calls: a decode's token that fills no block)
        # A block whose last token was still being sampled when it was allocated is hashed
        # now that the token is known (allocate_slots' num_known_tokens).
        self._hash_new_full_blocks(table, token_ids, num_computed_tokens)
        for i in range(len(table.block_gens), num_computed_tokens // bs):
            h, block_id = table.block_hashes[i], table.block_ids[i]
            if self._pending.get(h) == block_id:
                del self._pending[h]
            own = self._content.get(block_id)
            if own is not None:  # registered by a table it is shared with (a fork's parent)
                table.block_gens.append(own.gen)  # its K/V is this table's: the same memory
                continue
            parent_gen = table.block_gens[i - 1] if i else 0
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            cached_id = self._cached.get((parent_gen, h))
            cached = None if cached_id is None else self._content[cached_id]
            if cached is not None and cached.token_ids == tokens and cached.salt == table.salt:
                table.block_gens.append(cached.gen)  # the same K/V is cached already
                continue
            gen, self._next_gen = self._next_gen, self._next_gen + 1
            table.block_gens.append(gen)
            if cached_id is None:  # (on a collision, the first comer keeps the key)
                self._cached[(parent_gen, h)] = block_id
                self._content[block_id] = _Content(h, parent_gen, tokens, gen, table.salt)

    # ---- allocation -------------------------------------------------------------------
    def allocate_slots(
        self,
        table: BlockTable,
        token_ids: list[int],
        num_computed_tokens: int,
        num_new_tokens: int,
        hit: PrefixMatch | None = None,
        num_known_tokens: int | None = None,
    ) -> list[tuple[int, int]] | None:
        """Make room to compute tokens [num_computed, num_computed + num_new).

        Attaches a prefix hit (to an empty table), copies every shared block in the write
        range to a fresh one (copy-on-write: a block with ref_count > 1 is never written),
        and appends new blocks. Returns the (src, dst) copies to perform before the forward,
        or None, changing nothing, when the pool cannot supply the blocks.
        ``num_known_tokens``: how many of ``token_ids`` are known, when the last is still
        being sampled (asynchronous scheduling); a block it completes is hashed at commit.
        """
        hit_ids = hit.block_ids if hit else []
        end = num_computed_tokens + num_new_tokens
        first_write = num_computed_tokens // self.block_size
        ids = table.block_ids
        if not hit_ids and first_write == len(ids) - 1 and end <= len(ids) * self.block_size \
                and self._refs[ids[-1]] == 1:
            # Most calls (a decode's token into the last block, its own): nothing to change
            # but the hashes, and none of the general path's lists to build.
            shared, new = [], 0
        else:
            shared = [i for i in range(first_write, len(ids)) if self._refs[ids[i]] > 1]
            new = max(0, self.blocks_needed(end) - len(ids) - len(hit_ids))
        revived = sum(1 for b in hit_ids if self._refs[b] == 0) if hit_ids else 0
        if revived + len(shared) + new > len(self._free):
            return None

        # The guards below only skip empty work: most calls are a decode's one token
        # into a block it already holds.
        if hit:
            for block_id in hit_ids:
                self._acquire(block_id)
            table.block_ids.extend(hit_ids)
            table.block_hashes.extend(hit.block_hashes)
            table.block_gens.extend(hit.block_gens)
        copies = []
        for i in shared:
            src, dst = table.block_ids[i], self._pop_free()
            self._release(src)
            table.block_ids[i] = dst
            copies.append((src, dst))
        if new:
            table.block_ids.extend(self._pop_free() for _ in range(new))
        known = end if num_known_tokens is None else min(end, num_known_tokens)
        if self.enable_prefix_caching and known // self.block_size > len(table.block_hashes):
            self._hash_new_full_blocks(table, token_ids, known)
        return copies

    def fork(self, table: BlockTable) -> BlockTable:
        """A child table sharing every block of ``table``, the partial last one included."""
        for block_id in table.block_ids:
            self._acquire(block_id)
        return table.copy()

    def free(self, table: BlockTable) -> None:
        # Tail first, so a prefix's head is the last of it to be evicted.
        for block_id in reversed(table.block_ids):
            self._release(block_id)
        table.block_ids.clear()
        table.block_hashes.clear()
        table.block_gens.clear()

    # ---- internals --------------------------------------------------------------------
    def _hash_new_full_blocks(self, table: BlockTable, token_ids: list[int], end: int) -> None:
        """Hash the blocks this step fills; commit() makes them hittable once computed."""
        bs = self.block_size
        for i in range(len(table.block_hashes), end // bs):
            parent = table.block_hashes[-1] if table.block_hashes else root_hash(table.salt)
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            h = chain_hash(parent, tokens)
            table.block_hashes.append(h)
            # Cached or not: the cache's key needs the parent's generation, known at commit.
            if h not in self._pending:
                self._pending[h] = table.block_ids[i]

    def _acquire(self, block_id: int) -> None:
        if self._refs[block_id] == 0:
            del self._free[block_id]
        self._refs[block_id] += 1
        self._num_shared += self._refs[block_id] == 2

    def _pop_free(self) -> int:
        block_id, _ = self._free.popitem(last=False)  # least recently used
        content = self._content.pop(block_id, None)
        if content is not None:  # evict: its K/V is about to be overwritten
            del self._cached[(content.parent_gen, content.hash)]
        self._refs[block_id] = 1
        return block_id

    def _release(self, block_id: int) -> None:
        self._refs[block_id] -= 1
        self._num_shared -= self._refs[block_id] == 1
        if self._refs[block_id] > 0:
            return
        self._free[block_id] = None
        if block_id not in self._content:
            self._free.move_to_end(block_id, last=False)  # nothing worth keeping: reuse first
            for h, pending_id in list(self._pending.items()):
                if pending_id == block_id:  # freed before its K/V was computed
                    del self._pending[h]
