"""The offline API: generate for a list of prompts, in one continuous batch."""

import dataclasses
from collections.abc import Callable

from pagedserve.engine.config import EngineConfig
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.engine.outputs import OutputCollector, RequestOutput
from pagedserve.scheduler import RequestOutputKind, SamplingParams


class LLM:
    def __init__(self, model: str | None = None, **engine_args):
        self.engine = LLMEngine(EngineConfig(model=model, **engine_args))
        self.tokenizer = self.engine.tokenizer

    def generate(
        self,
        prompts: list[str | list[int]] | str,
        params: SamplingParams | list[SamplingParams] | None = None,
        on_step: Callable[[int], None] | None = None,
    ) -> list[RequestOutput]:
        """Outputs in prompt order. Every prompt is validated before any is queued."""
        if isinstance(prompts, str):
            prompts = [prompts]
        if not isinstance(params, list):
            params = [params or SamplingParams()] * len(prompts)
        # Only the whole outputs are wanted: no per-step deltas to build and join.
        params = [dataclasses.replace(p, output_kind=RequestOutputKind.FINAL_ONLY)
                  for p in params]
        ids = [self.engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
        done: dict[str, RequestOutput] = {}
        collector = OutputCollector()
        while self.engine.has_unfinished_requests():
            for delta in self.engine.step():
                if (out := collector.add(delta)) is not None:
                    done[out.request_id] = out
                    if on_step:
                        on_step(len(done))
        return [done[i] for i in ids]

    def chat(
        self,
        conversations: list[list[dict[str, str]]],
        params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        prompts = [self.chat_prompt(c) for c in conversations]
        return self.generate(prompts, params)

    def chat_prompt(self, messages: list[dict[str, str]]) -> list[int]:
        return self.tokenizer.encode_chat(messages, add_generation_prompt=True)
