"""Continuous batching: waiting and running queues under a token budget."""

from pagedserve.scheduler.sampling_params import (
    MAX_BAD_WORD_TOKENS,
    MAX_BAD_WORDS,
    MIN_TEMPERATURE,
    TOO_MANY_BAD_WORDS,
    BadWords,
    Guide,
    InvalidRequest,
    RequestOutputKind,
    SamplingParams,
    StructuredOutputs,
    StructuredOutputsParams,
    ThinkingBudget,
)
from pagedserve.scheduler.scheduler import (
    ScheduledBatch,
    Scheduler,
    SchedulerConfig,
    SchedulerStats,
)
from pagedserve.scheduler.sequence import PENDING_TOKEN, Sequence, SequenceStatus

__all__ = [
    "MAX_BAD_WORD_TOKENS", "MAX_BAD_WORDS", "MIN_TEMPERATURE", "PENDING_TOKEN", "BadWords",
    "Guide",
    "InvalidRequest", "RequestOutputKind", "TOO_MANY_BAD_WORDS",
    "SamplingParams", "ScheduledBatch", "Scheduler", "SchedulerConfig", "SchedulerStats",
    "Sequence", "SequenceStatus", "StructuredOutputs", "StructuredOutputsParams", "ThinkingBudget",
]
