"""Continuous batching: waiting and running queues under a token budget."""

from pagedserve.scheduler.errors import InvalidRequest
from pagedserve.scheduler.repetition import (
    REPETITION_STOP_REASON,
    RepetitionDetection,
    RepetitionDetectionParams,
)
from pagedserve.scheduler.sampling_params import (
    MAX_BAD_WORD_TOKENS,
    MAX_BAD_WORDS,
    MIN_TEMPERATURE,
    TOO_MANY_BAD_WORDS,
    BadWords,
    Guide,
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
    "MAX_BAD_WORD_TOKENS", "MAX_BAD_WORDS", "MIN_TEMPERATURE", "PENDING_TOKEN",
    "REPETITION_STOP_REASON", "BadWords", "Guide", "RepetitionDetection",
    "RepetitionDetectionParams",
    "InvalidRequest", "RequestOutputKind", "TOO_MANY_BAD_WORDS",
    "SamplingParams", "ScheduledBatch", "Scheduler", "SchedulerConfig", "SchedulerStats",
    "Sequence", "SequenceStatus", "StructuredOutputs", "StructuredOutputsParams", "ThinkingBudget",
]
