"""Continuous batching: waiting and running queues under a token budget."""

from pagedserve.scheduler.scheduler import (
    ScheduledBatch,
    Scheduler,
    SchedulerConfig,
    SchedulerStats,
)
from pagedserve.scheduler.sequence import (
    MAX_BAD_WORD_TOKENS,
    MAX_BAD_WORDS,
    MIN_TEMPERATURE,
    PENDING_TOKEN,
    TOO_MANY_BAD_WORDS,
    BadWords,
    Guide,
    InvalidRequest,
    RequestOutputKind,
    SamplingParams,
    Sequence,
    SequenceStatus,
    StructuredOutputs,
    StructuredOutputsParams,
)

__all__ = [
    "MAX_BAD_WORD_TOKENS", "MAX_BAD_WORDS", "MIN_TEMPERATURE", "PENDING_TOKEN", "BadWords",
    "Guide",
    "InvalidRequest", "RequestOutputKind", "TOO_MANY_BAD_WORDS",
    "SamplingParams", "ScheduledBatch", "Scheduler", "SchedulerConfig", "SchedulerStats",
    "Sequence", "SequenceStatus", "StructuredOutputs", "StructuredOutputsParams",
]
