"""The per-sample sequence the scheduler moves around."""

import enum
import itertools
from dataclasses import dataclass, field

import numpy as np

from pagedserve.paging import BlockTable
from pagedserve.scheduler.sampling_params import BadWords, Guide, SamplingParams, ThinkingBudget

# Stands for a sampled token not yet read back from the device (asynchronous scheduling):
# never a valid id, so a forward that read it would fail instead of computing garbage.
PENDING_TOKEN = -1


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_seq_ids = itertools.count()


class OutputCounts:
    """A sequence's distinct output tokens, in the order they first came, and how often each
    came, counted as its tokens become known (a known token never changes): the penalties
    read these, so that their cost a step grows with the distinct tokens, not with the
    whole output read again (64 rows of 16k output tokens: ~24 ms a step on one CPU thread
    to convert the lists alone, then an op over every token)."""

    def __init__(self) -> None:
        self.num_read = 0  # output tokens counted so far
        self._at: dict[int, int] = {}  # token -> its place in _tokens and _counts
        self._tokens = np.empty(16, np.int64)
        self._counts = np.zeros(16, np.float32)  # (whole numbers, exact below 2**24)

    def update(self, token_ids: list[int], start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """Count token_ids[start + num_read:stop] (``start``: the first output token's
        index, ``stop``: the known tokens' end); the distinct tokens and their counts."""
        at = self._at
        for i in range(start + self.num_read, stop):
            token = token_ids[i]
            k = at.get(token)
            if k is None:
                k = at[token] = len(at)
                if k == len(self._tokens):  # (doubled: amortized O(1) a token)
                    self._tokens = np.resize(self._tokens, 2 * k)
                    self._counts = np.concatenate([self._counts, np.zeros(k, np.float32)])
                self._tokens[k] = token
            self._counts[k] += 1
        self.num_read = max(self.num_read, stop - start)
        n = len(at)
        return self._tokens[:n], self._counts[:n]


@dataclass(eq=False)
class Sequence:
    """One sample of one request: token ids plus the counters of docs/design.md §2."""

    request_id: str
    token_ids: list[int]
    params: SamplingParams
    arrival: float  # orders admission and preemption (oldest first, newest preempted)
    sample_index: int = 0
    num_forks_pending: int = 0  # siblings to fork off once the prompt is prefilled
    seq_id: int = field(default_factory=lambda: next(_seq_ids))
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_scheduled_tokens: int = 0
    block_table: BlockTable = field(default_factory=BlockTable)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "repetition" | "abort" | "error"
    stop_reason: int | None = None  # the stop token id that ended it (a stop string's: outputs)
    guide: Guide | None = None  # the structured-output matcher, if the request has one
    bad_words: BadWords | None = None  # params.bad_words, shared by a request's samples
    thinking_budget: ThinkingBudget | None = None  # params.thinking_token_budget's, shared
    # Its tokens read for think tags so far: (how many, the last start's index, the last
    # end's; -1: none), so that each step reads only the new ones (force_thinking_end)
    think_tags: tuple[int, int, int] = (0, -1, -1)
    priority: int = 0  # its request's under the priority policy, else 0 (Scheduler's order)
    # Prompt positions (from 0) whose next token's logprob is recorded; survives preemption.
    prompt_logprobs_done: int = 0
    # What sampling derives from the prompt, kept by the request's samples together (a fork
    # shares its parent's): repetition_penalty's prompt tokens on the device.
    prompt_derived: dict = field(default_factory=dict, repr=False)
    # The chain hashes of its leading full blocks, kept while it waits (matched against the
    # prefix cache every step it is not admitted); emptied when it is.
    waiting_hashes: list[int] = field(default_factory=list, repr=False)
    # Its known output tokens counted, for the penalties (made on their first read).
    output_counts: OutputCounts | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.num_prompt_tokens = self.num_prompt_tokens or len(self.token_ids)
        self.block_table.salt = self.params.cache_salt

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Prompt logprobs still to compute (by the sample that prefills): every prompt
        position must then run, so such a sequence takes no prefix-cache hit."""
        return (self.params.prompt_logprobs is not None and self.sample_index == 0
                and self.prompt_logprobs_done < self.num_prompt_tokens - 1)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def last_token_pending(self) -> bool:
        """Whether the last token is a PENDING_TOKEN placeholder: sampled, not yet read back."""
        return bool(self.token_ids) and self.token_ids[-1] == PENDING_TOKEN

    @property
    def num_known_tokens(self) -> int:
        """Tokens whose ids are on the host: all but a PENDING_TOKEN at the end."""
        return len(self.token_ids) - self.last_token_pending

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    def counted_outputs(self) -> tuple[np.ndarray, np.ndarray]:
        """Its distinct known output tokens and how often each came (OutputCounts)."""
        if self.output_counts is None:
            self.output_counts = OutputCounts()
        return self.output_counts.update(self.token_ids, self.num_prompt_tokens,
                                         self.num_known_tokens)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def may_stop(self) -> bool:
        """min_tokens reached: EOS or a stop token id appended now ends the sample."""
        return self.num_output_tokens >= self.params.min_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
