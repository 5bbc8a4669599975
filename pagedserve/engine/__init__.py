"""The engine loop, sampling and the offline API."""

from pagedserve.engine.config import EngineConfig
from pagedserve.engine.llm import LLM
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.engine.outputs import CompletionOutput, OutputCollector, RequestOutput
from pagedserve.engine.sampler import TokenLogprob
from pagedserve.models.tokenizer import PromptTooLong
from pagedserve.scheduler import (
    InvalidRequest,
    RepetitionDetection,
    RepetitionDetectionParams,
    RequestOutputKind,
    SamplingParams,
    StructuredOutputs,
    StructuredOutputsParams,
)

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineConfig",
    "InvalidRequest",
    "LLMEngine",
    "OutputCollector",
    "PromptTooLong",
    "RepetitionDetection",
    "RepetitionDetectionParams",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
    "StructuredOutputs",
    "StructuredOutputsParams",
    "TokenLogprob",
]
