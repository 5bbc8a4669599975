"""The offline API, after vLLM's ``LLM``: generate for a list of prompts in one continuous
batch, or chat."""

import dataclasses
from collections.abc import Callable
from typing import Any

from pagedserve.engine.config import EngineConfig
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.engine.outputs import OutputCollector, RequestOutput
from pagedserve.models.tokenizer import Tokenizer
from pagedserve.scheduler import InvalidRequest, RequestOutputKind, SamplingParams

# A prompt: text, token ids, or vLLM's dict forms ({"prompt": text} and
# {"prompt_token_ids": ids}).
Prompt = str | list[int] | dict[str, Any]
Messages = list[dict[str, Any]]


class LLM:
    def __init__(self, model: str | None = None, **engine_args: Any):
        self.engine = LLMEngine(EngineConfig(model=model, **engine_args))
        self.tokenizer = self.engine.tokenizer

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> "LLM":
        """Around an engine already built (one loaded model shared, as the tests do)."""
        llm = cls.__new__(cls)
        llm.engine, llm.tokenizer = engine, engine.tokenizer
        return llm

    def get_tokenizer(self) -> Tokenizer:
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What a call without sampling_params samples with: the model's generation config
        where it sets any value (--generation-config), else SamplingParams()'s own."""
        return SamplingParams(**self.engine.sampling_defaults.fields)

    def generate(
        self,
        prompts: Prompt | list[Prompt],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        on_step: Callable[[int], None] | None = None,
    ) -> list[RequestOutput]:
        """Outputs in prompt order. All prompts are queued or none: one the engine refuses
        takes the ones queued before it back out."""
        if isinstance(prompts, str | dict) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params
        if not isinstance(params, list):
            params = [params or self.get_default_sampling_params()] * len(prompts)
        # Only the whole outputs are wanted: no per-step deltas to build and join.
        params = [dataclasses.replace(p, output_kind=RequestOutputKind.FINAL_ONLY)
                  for p in params]
        ids: list[str] = []
        try:
            for prompt, sp in zip(prompts, params, strict=True):
                ids.append(self.engine.add_request(_prompt_input(prompt), sp))
        except BaseException:
            self.engine.abort_request(ids)
            self.engine.step()  # takes the aborted requests' final outputs
            raise
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
        messages: Messages | list[Messages],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """One conversation (a list of messages) or several, rendered with the model's chat
        template; the flags as vLLM's ``LLM.chat`` takes them."""
        if continue_final_message and add_generation_prompt:  # as the server and vLLM refuse it
            raise InvalidRequest("continue_final_message and add_generation_prompt cannot both "
                                 "be true", "continue_final_message")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.tokenizer.encode_chat(
            c, add_generation_prompt, tools=tools, continue_final_message=continue_final_message,
            chat_template_kwargs=chat_template_kwargs) for c in conversations]
        return self.generate(prompts, sampling_params)

    def chat_prompt(self, messages: Messages) -> list[int]:
        return self.tokenizer.encode_chat(messages, add_generation_prompt=True)


def _prompt_input(prompt: Prompt) -> str | list[int]:
    if not isinstance(prompt, dict):
        return prompt
    if "prompt_token_ids" in prompt:
        return list(prompt["prompt_token_ids"])
    if "prompt" in prompt:
        return prompt["prompt"]
    raise InvalidRequest("a prompt dict needs 'prompt' or 'prompt_token_ids'", "prompt")
