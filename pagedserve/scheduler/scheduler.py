"""Continuous batching under a token budget: decodes first, then chunked prefills, with
preemption by recompute. The scheduler talks to paging only through BlockManager's narrow
interface (match_prefix, allocate_slots, commit, fork, free)."""

import bisect
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from pagedserve.paging import BlockManager, BlockTable
from pagedserve.scheduler.sampling_params import InvalidRequest
from pagedserve.scheduler.sequence import PENDING_TOKEN, Sequence, SequenceStatus

log = logging.getLogger("pagedserve.scheduler")


@dataclass
class SchedulerConfig:
    max_model_len: int
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    eos_token_ids: tuple[int, ...] = ()


@dataclass
class ScheduledBatch:
    seqs: list[Sequence]  # decodes (one token each, which samples) first, then prefill chunks
    num_decodes: int
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write


@dataclass
class SchedulerStats:
    prefill_tokens_computed: int = 0
    prefix_cache_queried_tokens: int = 0
    prefix_cache_hit_tokens: int = 0
    preemptions: int = 0
    peak_kv_blocks_used: int = 0
    steps: int = 0  # batches scheduled: the engine's steps that ran a forward


@dataclass
class _Plan:
    """One step's batch as the scheduler builds it. A sequence preempted after it was
    planned in is dropped again: its tokens go back to the budget, and its block copies
    (to blocks its preemption frees) are not made."""

    budget: int
    seqs: list[Sequence] = field(default_factory=list)
    # by seq_id, in the order planned; only sequences with copies (few: a fork's first write)
    copies: dict[int, list[tuple[int, int]]] = field(default_factory=dict)
    preempted: list[Sequence] = field(default_factory=list)

    def add(self, seq: Sequence, n: int, copies: list[tuple[int, int]]) -> None:
        seq.num_scheduled_tokens = n
        self.seqs.append(seq)
        if copies:
            self.copies[seq.seq_id] = copies
        self.budget -= n

    def drop(self, seq: Sequence) -> None:
        self.seqs.remove(seq)
        self.copies.pop(seq.seq_id, None)
        self.budget += seq.num_scheduled_tokens
        seq.num_scheduled_tokens = 0

    def block_copies(self) -> list[tuple[int, int]]:
        return [pair for pairs in self.copies.values() for pair in pairs]


def _order(seq: Sequence) -> tuple[int, float, int]:
    """Admission and preemption order: by priority (lower first, vLLM's; all 0 unless
    --scheduling-policy priority), then arrival."""
    return (seq.priority, seq.arrival, seq.seq_id)


def _is_prefilling(seq: Sequence) -> bool:
    """More than one token left to compute: a prompt (or a recompute) not yet through."""
    return len(seq.token_ids) - seq.num_cached_tokens > 1


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager):
        self.config = config
        self.blocks = block_manager
        self.waiting: list[Sequence] = []  # by _order: first the most urgent, then oldest
        self.running: list[Sequence] = []  # by _order
        self.stats = SchedulerStats()

    # ---- admission --------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        """Queue a new sequence, refusing one that could never run."""
        limit = self.config.max_model_len
        if seq.num_tokens >= limit:
            raise InvalidRequest(
                f"This model's maximum context length is {limit} tokens, but the prompt "
                f"has {seq.num_tokens} tokens (no room left to generate).", "prompt",
                "context_length_exceeded")
        if self.blocks.blocks_needed(seq.num_tokens + 1) > self.blocks.num_blocks:
            raise InvalidRequest(
                f"The prompt ({seq.num_tokens} tokens) does not fit in the KV cache "
                f"({self.blocks.num_blocks} blocks of {self.blocks.block_size}).", "prompt")
        bisect.insort(self.waiting, seq, key=_order)

    # ---- one step ---------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        plan = _Plan(self.config.max_num_batched_tokens)

        # Running sequences: decodes first, then unfinished prefill chunks, oldest first.
        for seq in sorted(self.running, key=_is_prefilling):
            if plan.budget == 0:
                break
            # Preempted just now, or at a length limit with its last token still being
            # sampled (asynchronous scheduling): that token finishes it.
            if seq.status is not SequenceStatus.RUNNING or self._length_reached(seq):
                continue
            n = min(seq.num_tokens - seq.num_cached_tokens, plan.budget)
            new_copies = self._allocate_or_preempt(seq, n, plan)
            if new_copies is not None:
                plan.add(seq, n, new_copies)

        # Waiting sequences, oldest first, under what is left of the budget and the seats.
        held, leaving_counted = self._seats_held() if self.waiting else 0, False
        i = 0
        while i < len(self.waiting) and plan.budget > 0:
            seq = self.waiting[i]
            seats = 1 + seq.num_forks_pending
            if held + seats > self.config.max_num_seqs and not leaving_counted:
                held, leaving_counted = held - self._num_leaving(), True
            if held and held + seats > self.config.max_num_seqs:
                break  # (a group wider than max_num_seqs waits for an empty batch)
            hit = self.blocks.match_prefix(
                seq.token_ids, 0 if seq.wants_prompt_logprobs else seq.num_tokens - 1,
                seq.waiting_hashes, seq.block_table.salt)
            # Its next block is being computed this step by an identical prefix: wait one
            # step and hit it, rather than compute and store the same K/V twice.
            if seq in plan.preempted or hit.next_block_pending:
                i += 1
                continue
            num_cached = len(hit.block_ids) * self.blocks.block_size
            n = min(seq.num_tokens - num_cached, plan.budget)
            new_copies = self.blocks.allocate_slots(
                seq.block_table, seq.token_ids, num_cached, n, hit)
            if new_copies is None:
                break
            if self.blocks.enable_prefix_caching:  # off, there is no cache to query (vLLM)
                self.stats.prefix_cache_queried_tokens += seq.num_tokens
            self.stats.prefix_cache_hit_tokens += num_cached
            seq.num_cached_tokens = num_cached
            seq.status = SequenceStatus.RUNNING
            seq.waiting_hashes = []
            del self.waiting[i]
            bisect.insort(self.running, seq, key=_order)
            plan.add(seq, n, new_copies)
            held += seats

        decodes, prefills, prompt_tokens = [], [], 0
        for seq in plan.seqs:
            n, num_tokens = seq.num_scheduled_tokens, len(seq.token_ids)
            # A decode is one token that samples (the decode graphs give a row each): a
            # prompt chunk cut to one token is not, and may have rows after it (plan.drop).
            is_decode = n == 1 and seq.num_cached_tokens + 1 == num_tokens
            (decodes if is_decode else prefills).append(seq)
            # A decode past the prompt computes a sampled token; any other token is a prompt's.
            prompt_tokens += n - (is_decode and num_tokens > seq.num_prompt_tokens)
        self.stats.prefill_tokens_computed += prompt_tokens
        if plan.seqs:
            self.stats.steps += 1
        used = self.blocks.num_used_blocks
        self.stats.peak_kv_blocks_used = max(self.stats.peak_kv_blocks_used, used)
        return ScheduledBatch(decodes + prefills, len(decodes), plan.block_copies())

    def _allocate_or_preempt(self, seq: Sequence, n: int, plan: _Plan
                             ) -> list[tuple[int, int]] | None:
        """Blocks for ``n`` more tokens of ``seq``, preempting the newest (or least urgent:
        _order) running sequence until they fit, taken out of the plan if it was in it
        (vLLM's choice). Only later sequences in that order are victims, so the first always
        makes progress, even in its prefill behind decodes planned before it (no thrash);
        None when ``seq`` itself had to go."""
        while True:
            copies = self.blocks.allocate_slots(
                seq.block_table, seq.token_ids, seq.num_cached_tokens, n,
                num_known_tokens=seq.num_known_tokens)
            if copies is not None:
                return copies
            # Not one that its in-flight token finishes: its blocks are freed then anyway.
            candidates = [s for s in self.running if not self._length_reached(s)]
            victim = max(candidates, key=_order)  # seq itself is always a candidate
            if victim in plan.seqs:
                plan.drop(victim)
            self._preempt(victim)
            plan.preempted.append(victim)
            if victim is seq:
                return None

    def _seats_held(self) -> int:
        """At most max_num_seqs sequences run (the sampler's rows, the decode graphs'
        widest batch and the memory profile count on it): each running sequence holds a
        seat, and one for each sample it will fork once its prompt is in. A group of more
        samples than that runs alone, with the samples that find no seat waiting (fork)."""
        return len(self.running) + sum(s.num_forks_pending for s in self.running)

    def _num_leaving(self) -> int:
        """Running sequences that the token still in flight for them ends by length
        (asynchronous scheduling): they are not scheduled again, so hold no seat. A pass
        over the running, so counted only where the seats would otherwise be full."""
        return sum(1 for s in self.running if self._length_reached(s))

    def _preempt(self, seq: Sequence) -> None:
        """Free the blocks and recompute later; the blocks keep their hashes, so the
        recompute usually hits the prefix cache."""
        self.blocks.free(seq.block_table)
        # (a freed table is never refilled: BlockTable)
        seq.block_table = BlockTable(salt=seq.params.cache_salt)
        seq.num_cached_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.running.remove(seq)
        bisect.insort(self.waiting, seq, key=_order)
        self.stats.preemptions += 1

    # ---- after the forward --------------------------------------------------------------
    def fork(self, batch: ScheduledBatch) -> list[tuple[Sequence, Sequence]]:
        """Prefill-then-fork: each sequence whose prompt completes this step and still has
        samples to spawn is copied, sharing every block by reference count. Children join
        the batch so advance() and settle() treat them like their parent; those beyond
        max_num_seqs (a group wider than it) wait instead, with no blocks. Returns
        (child, parent) pairs."""
        pairs: list[tuple[Sequence, Sequence]] = []
        free: int | None = None  # seats left for children (_seats_held)
        for parent in list(batch.seqs):
            if not parent.num_forks_pending or (parent.num_cached_tokens
                                                + parent.num_scheduled_tokens
                                                != parent.num_tokens):
                continue
            if free is None:
                free = self.config.max_num_seqs - len(self.running) + self._num_leaving()
            for k in range(1, parent.num_forks_pending + 1):
                runs, free = free > 0, free - 1
                child = Sequence(
                    request_id=parent.request_id,
                    token_ids=list(parent.token_ids),
                    params=parent.params,
                    arrival=parent.arrival,
                    sample_index=parent.sample_index + k,
                    num_prompt_tokens=parent.num_prompt_tokens,
                    # Its own matcher, from the prompt's state (no output token yet).
                    guide=parent.guide.fork() if parent.guide is not None else None,
                    prompt_derived=parent.prompt_derived,
                    bad_words=parent.bad_words, thinking_budget=parent.thinking_budget,
                    priority=parent.priority,
                )
                if runs:
                    child.num_cached_tokens = parent.num_cached_tokens
                    child.num_scheduled_tokens = parent.num_scheduled_tokens
                    child.block_table = self.blocks.fork(parent.block_table)
                    child.status = SequenceStatus.RUNNING
                    bisect.insort(self.running, child, key=_order)
                    batch.seqs.append(child)
                else:  # no seat: it waits, as a preempted sample does, and prefills again
                    bisect.insort(self.waiting, child, key=_order)
                pairs.append((child, parent))
            parent.num_forks_pending = 0
        return pairs

    def advance(self, batch: ScheduledBatch) -> None:
        """Steps 1-3 of docs/design.md §4 for each sequence of a step whose forward is
        done, and a placeholder (PENDING_TOKEN) for the token each completing one samples:
        settle() writes it in. Under asynchronous scheduling the next step is scheduled in
        between, so a sequence already stopped (or aborted) meanwhile is skipped."""
        for seq in batch.seqs:
            if seq.is_finished:
                continue
            computed = seq.num_cached_tokens + seq.num_scheduled_tokens
            self.blocks.commit(seq.block_table, seq.token_ids, computed)  # 1. cache full blocks
            seq.num_cached_tokens = computed  # 2.
            seq.num_scheduled_tokens = 0
            if computed == seq.num_tokens:  # 3. a chunk samples nothing
                seq.token_ids.append(PENDING_TOKEN)

    def settle(self, seqs: list[Sequence], sampled: list[int],
               on_append: Callable[[Sequence, int], bool]) -> None:
        """Steps 4-5 of docs/design.md §4: ``sampled[i]`` is the token of ``seqs[i]`` (the
        sequences that completed their input in one step, in batch order); a sequence that
        has finished since, its token computed ahead of the stop, is skipped.
        ``on_append(seq, i)`` sees each appended token (the engine's detokenizer) and says
        whether a stop string ended the text."""
        if len(seqs) != len(sampled):
            raise ValueError(f"{len(sampled)} sampled tokens for {len(seqs)} sequences")
        finished = SequenceStatus.FINISHED
        for i, seq in enumerate(seqs):  # (this runs for every sequence every step)
            if seq.status is finished:
                continue
            token = seq.token_ids[-1] = sampled[i]  # 4. in place of advance()'s placeholder
            # The matcher consumes exactly the appended tokens, in order.
            grammar_done = seq.guide is not None and seq.guide.accept(token)
            reason = self._stop_reason(seq, on_append(seq, i), grammar_done)  # 5.
            if reason:
                self.finish(seq, reason)

    def _stop_reason(self, seq: Sequence, stop_string: bool, grammar_done: bool) -> str | None:
        """The one place a finish reason is decided, for the token just appended."""
        token = seq.token_ids[-1]
        if grammar_done:  # a complete grammar allows nothing but EOS
            if seq.guide.error:  # the matcher gave up (a resource limit): no "stop"
                log.warning("request %s: its structured-output matcher gave up after %d "
                            "tokens: %s", seq.request_id, seq.num_output_tokens, seq.guide.error)
                return "error"
            self._stop_token(seq, token)  # (a stop token that also ended it is named)
            return "stop"
        if stop_string or self._stop_token(seq, token):
            return "stop"
        if self._length_reached(seq):
            return "length"
        repetition = seq.params.repetition_detection  # (vLLM's order: after the length)
        if repetition is not None and seq.may_stop and repetition.found(
                seq.token_ids, seq.num_prompt_tokens):
            return "repetition"
        return None

    def _stop_token(self, seq: Sequence, token: int) -> bool:
        """Whether ``token`` ends ``seq`` as its EOS or one of its stop tokens; a stop token
        is named in ``stop_reason`` (vLLM's; EOS leaves it None)."""
        p = seq.params
        if not seq.may_stop:
            return False
        if not p.ignore_eos and token in self.config.eos_token_ids:
            return True
        if p.stop_token_ids and token in p.stop_token_set:
            seq.stop_reason = token
            return True
        return False

    def _length_reached(self, seq: Sequence) -> bool:
        """max_tokens or max_model_len reached, by the last token appended."""
        max_tokens, num_tokens = seq.params.max_tokens, len(seq.token_ids)
        return ((max_tokens is not None and num_tokens - seq.num_prompt_tokens >= max_tokens)
                or num_tokens >= self.config.max_model_len)

    def finish(self, seq: Sequence, reason: str) -> None:
        if seq.is_finished:
            return
        self.blocks.free(seq.block_table)
        (self.running if seq.status is SequenceStatus.RUNNING else self.waiting).remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def abort(self, request_ids: str | Iterable[str]) -> None:
        """Finish every sample of these requests at once, freeing their blocks: one pass over
        the queues however many there are (a client that leaves a request of 30,000 prompts
        aborts them all at once; one pass each took minutes)."""
        ids = {request_ids} if isinstance(request_ids, str) else set(request_ids)
        for name in ("running", "waiting"):
            queue = getattr(self, name)
            gone = [s for s in queue if s.request_id in ids]
            for seq in gone:
                self.blocks.free(seq.block_table)
                seq.status, seq.finish_reason = SequenceStatus.FINISHED, "abort"
            if len(gone) > 8:  # many: one pass to rebuild the queue, not a scan each
                setattr(self, name, [s for s in queue if not s.is_finished])
            else:
                for seq in gone:
                    queue.remove(seq)
