"""The engine loop, sampling and the offline API."""

from pagedserve.engine.llm import LLM
from pagedserve.engine.llm_engine import EngineConfig, LLMEngine
from pagedserve.engine.outputs import CompletionOutput, RequestOutput
from pagedserve.scheduler import InvalidRequest, SamplingParams

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineConfig",
    "InvalidRequest",
    "LLMEngine",
    "RequestOutput",
    "SamplingParams",
]
