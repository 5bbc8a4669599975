"""The offline API, after vLLM's ``LLM``: generate for a list of prompts in one continuous
batch, or chat."""

import copy
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from tqdm import tqdm

from pagedserve.engine.beam_search import BeamSearch, BeamSearchOutput, BeamSearchParams
from pagedserve.engine.config import EngineConfig
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.engine.outputs import OutputCollector, RequestOutput
from pagedserve.models.chat_template import template_message
from pagedserve.models.tokenizer import Tokenizer
from pagedserve.scheduler import InvalidRequest, RequestOutputKind, SamplingParams

# A prompt: text, token ids, or vLLM's dict forms ({"prompt": text} and
# {"prompt_token_ids": ids}, each with an optional "cache_salt").
Prompt = str | list[int] | dict[str, Any]
Messages = list[dict[str, Any]]


class LLM:
    def __init__(self, model: str | None = None, trust_remote_code: bool = False,
                 **engine_args: Any):
        """``engine_args``: EngineConfig's fields. ``trust_remote_code`` is vLLM's, taken and
        unused: no model's own code is ever run here (as the server's flag)."""
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

    @property
    def llm_engine(self) -> LLMEngine:  # vLLM's name
        return self.engine

    def generate(
        self,
        prompts: Prompt | list[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., Any] = False,
        lora_request: None = None,
        priority: list[int] | None = None,
    ) -> list[RequestOutput]:
        """Outputs in prompt order. All prompts are queued or none: one the engine refuses
        takes the ones queued before it back out, and so does a failure (or Ctrl-C) while
        they run, which leaves every block free. ``use_tqdm``: a progress bar of finished
        prompts on stderr, or a tqdm-like factory to make one with (vLLM's; it shows one
        by default). ``lora_request``: vLLM's, taken where it asks nothing (no adapter),
        refused otherwise, as the server refuses it. ``priority``: one a prompt (vLLM's),
        used under ``scheduling_policy="priority"``."""
        if lora_request is not None:
            raise InvalidRequest("LoRA adapters are not supported", "lora_request")
        if isinstance(prompts, str | dict) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params
        if isinstance(params, SamplingParams | None):
            params = [params or self.get_default_sampling_params()] * len(prompts)
        if len(params) != len(prompts):
            raise InvalidRequest(f"{len(params)} sampling params for {len(prompts)} prompts: "
                                 "give one for all, or one per prompt", "sampling_params")
        # Only the whole outputs are wanted: no per-step deltas to build and join. One copy
        # of each params object, which its prompts share (validated and derived once).
        final = {id(p): dataclasses.replace(p, output_kind=RequestOutputKind.FINAL_ONLY)
                 for p in params}
        params = [final[id(p)] for p in params]
        if priority is not None and len(priority) != len(prompts):
            raise InvalidRequest(f"{len(priority)} priorities for {len(prompts)} prompts",
                                 "priority")
        # vLLM's {"prompt": ..., "cache_salt": ...} and priorities: fields of the params here
        own = {}
        for i, prompt in enumerate(prompts):
            salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
            rank = priority[i] if priority is not None else 0
            if salt is not None or rank:
                key = (id(params[i]), salt, rank)
                if key not in own:
                    own[key] = dataclasses.replace(params[i], cache_salt=salt, priority=rank)
                params[i] = own[key]
        ids: list[str] = []
        try:
            for prompt, sp in zip(prompts, params, strict=True):
                ids.append(self.engine.add_request(_prompt_input(prompt), sp))
            return self._run(ids, use_tqdm)
        except BaseException:
            self._withdraw(ids)
            raise

    def beam_search(self, prompts: Prompt | list[Prompt], params: BeamSearchParams,
                    use_tqdm: bool | Callable[..., Any] = False) -> list[BeamSearchOutput]:
        """vLLM's offline beam search (engine/beam_search.py): each prompt's beam_width best
        beams, best first, their ``tokens`` the prompt's and the output's (with the EOS that
        ended one), their ``text`` all of them decoded. Every prompt's beams step together,
        one engine request a beam a step; ``use_tqdm`` shows each step's."""
        if isinstance(prompts, str | dict) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        tokenizer = self.tokenizer
        eos = tokenizer.eos_token_ids[0] if tokenizer.eos_token_ids else None
        searches = []
        for prompt in prompts:
            ids = _prompt_input(prompt)
            ids = tokenizer.encode(ids) if isinstance(ids, str) else ids
            searches.append(BeamSearch(ids, params, eos, self.engine.max_model_len))
        step = params.step_params()
        while live := [s for s in searches if not s.done]:
            beams = [beam.tokens for s in live for beam in s.beams]
            outputs = iter(self.generate(beams, step, use_tqdm))
            for s in live:
                s.advance([next(outputs).outputs[0].logprobs[0] for _ in s.beams])
        results = []
        for s in searches:
            best = s.finish()
            for beam in best:
                beam.text = tokenizer.decode(beam.tokens, params.skip_special_tokens)
            results.append(BeamSearchOutput(best))
        return results

    def _run(self, ids: list[str], use_tqdm: bool | Callable[..., Any]) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        collector = OutputCollector()
        make_bar = use_tqdm if callable(use_tqdm) else tqdm if use_tqdm else None
        bar = make_bar(total=len(ids), desc="Processed prompts") if make_bar else None
        try:
            while self.engine.has_unfinished_requests():
                try:
                    deltas = self.engine.step()
                except BaseException:  # the failed step's requests dropped, blocks freed
                    if not self.engine.fail_step()[1]:
                        self.engine.reset()
                    raise
                for delta in deltas:
                    if (out := collector.add(delta)) is not None:
                        done[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        finally:
            if bar is not None:
                bar.close()
        return [done[i] for i in ids]

    def _withdraw(self, ids: list[str]) -> None:
        """Take a failed call's requests back out: aborted, their last outputs taken."""
        self.engine.abort_request(ids)
        while self.engine.has_unfinished_requests():
            self.engine.step()

    def chat(
        self,
        messages: Messages | list[Messages],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., Any] = False,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        lora_request: None = None,
    ) -> list[RequestOutput]:
        """One conversation (a list of messages) or several, rendered with the model's chat
        template (or ``chat_template``), as vLLM's ``LLM.chat`` takes them: OpenAI's message
        form, content parts and a call's arguments as a JSON string included."""
        if continue_final_message and add_generation_prompt:  # as the server and vLLM refuse it
            raise InvalidRequest("continue_final_message and add_generation_prompt cannot both "
                                 "be true", "continue_final_message")
        tokenizer = self.tokenizer
        if chat_template is not None:  # on a copy: the engine's stays as it is
            tokenizer = copy.copy(tokenizer)
            tokenizer.set_chat_template(chat_template)
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        texts = [tokenizer.apply_chat_template(
            [template_message(m) for m in c], add_generation_prompt, tools=tools,
            continue_final_message=continue_final_message,
            chat_template_kwargs=chat_template_kwargs) for c in conversations]
        # (the template writes any BOS it wants)
        prompts = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
        outputs = self.generate(prompts, sampling_params, use_tqdm, lora_request)
        for out, text in zip(outputs, texts, strict=True):
            out.prompt = text  # the rendered conversation, as vLLM's
        return outputs

    def chat_prompt(self, messages: Messages) -> list[int]:
        return self.tokenizer.encode_chat([template_message(m) for m in messages],
                                          add_generation_prompt=True)


def _prompt_input(prompt: Prompt) -> str | list[int]:
    if not isinstance(prompt, dict):
        return prompt
    if "prompt_token_ids" in prompt:
        return list(prompt["prompt_token_ids"])
    if "prompt" in prompt:
        return prompt["prompt"]
    raise InvalidRequest("a prompt dict needs 'prompt' or 'prompt_token_ids'", "prompt")
