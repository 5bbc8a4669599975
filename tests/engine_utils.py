"""Helpers shared by the engine tests: build an engine, run prompts, and a plain reference."""

import json
from pathlib import Path

import torch

from pagedserve.engine import EngineConfig, LLMEngine, RequestOutput, SamplingParams
from pagedserve.kernels import KernelSet
from pagedserve.models.loader import LoadedModel


def make_engine(loaded: LoadedModel, kernels: KernelSet | None = None, **config) -> LLMEngine:
    config.setdefault("num_kv_blocks", 256)
    config.setdefault("dtype", "float32")  # the equivalence tolerances are fp32's
    return LLMEngine(EngineConfig(**config), loaded=loaded, kernels=kernels)


def run(
    engine: LLMEngine, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
) -> list[RequestOutput]:
    if not isinstance(params, list):
        params = [params] * len(prompts)
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert engine.block_manager.num_used_blocks == 0, "blocks leaked"
    engine.block_manager.check_invariants()
    return [done[i] for i in ids]


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def random_prompts(n: int, lo: int, hi: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return prompts_of_lengths(torch.randint(lo, hi + 1, (n,), generator=g).tolist(), seed)


def prompts_of_lengths(lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(100, 40000, (k,), generator=g).tolist() for k in lengths]


@torch.no_grad()
def hf_logprobs(hf_model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """The straightforward reference: one full forward (no KV cache) over the prompt and
    the generated tokens, teacher-forced. Row i is the log-softmax that chose tokens[i];
    if every row's argmax is tokens[i], HF's own greedy decode yields exactly ``tokens``."""
    ids = torch.tensor([prompt + tokens[:-1]])
    logits = hf_model(ids, use_cache=False).logits[0, len(prompt) - 1 :].float()
    return torch.log_softmax(logits, -1)


def save_tiny_hf(path: Path, model_cls, config, tokenizer) -> None:
    """Save a random-weight transformers model as a HF directory (safetensors) with the
    given tokenizer. Weights are wider than the default init, so logits are far from ties."""
    torch.manual_seed(0)
    model = model_cls(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.backend.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|im_start|>", "eos_token": "<|im_end|>",
        "chat_template": tokenizer.chat_template}))
