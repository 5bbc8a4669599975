"""Continuous batching: waiting and running queues under a token budget."""

from pagedserve.scheduler.scheduler import (
    ScheduledBatch,
    Scheduler,
    SchedulerConfig,
    SchedulerStats,
)
from pagedserve.scheduler.sequence import (
    MIN_TEMPERATURE,
    InvalidRequest,
    SamplingParams,
    Sequence,
    SequenceStatus,
)

__all__ = [
    "MIN_TEMPERATURE",
    "InvalidRequest",
    "SamplingParams",
    "ScheduledBatch",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerStats",
    "Sequence",
    "SequenceStatus",
]
