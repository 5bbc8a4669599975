"""Helpers shared by the engine tests: build an engine, run prompts, and a plain reference."""

import contextlib
import json
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import torch

from pagedserve.engine import (
    EngineConfig,
    LLMEngine,
    OutputCollector,
    RequestOutput,
    SamplingParams,
)
from pagedserve.kernels import KernelSet
from pagedserve.models.loader import LoadedModel, load_model_files


@contextlib.contextmanager
def intra_op_threads(n: int) -> Iterator[None]:
    """torch's intra-op threads set to n meanwhile: the suite runs on one
    (tests/conftest.py), the engine on every core."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def make_engine(loaded: LoadedModel, kernels: KernelSet | None = None, **config) -> LLMEngine:
    config.setdefault("num_kv_blocks", 256)
    config.setdefault("block_size", 16)  # the tests' lengths and pool sizes count in 16s
    config.setdefault("dtype", "float32")  # the equivalence tolerances are fp32's
    return LLMEngine(EngineConfig(**config), loaded=loaded, kernels=kernels)


def run(
    engine: LLMEngine, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
) -> list[RequestOutput]:
    if not isinstance(params, list):
        params = [params] * len(prompts)
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    done = {}
    collector = OutputCollector()
    while engine.has_unfinished_requests():
        for delta in engine.step():
            if (out := collector.add(delta)) is not None:
                done[out.request_id] = out
    assert engine.block_manager.num_used_blocks == 0, "blocks leaked"
    engine.block_manager.check_invariants()
    return [done[i] for i in ids]


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def random_prompts(n: int, lo: int, hi: int, seed: int = 0, max_id: int = 40000
                   ) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    return prompts_of_lengths(lengths, seed, max_id)


def prompts_of_lengths(lengths: list[int], seed: int = 0, max_id: int = 40000
                       ) -> list[list[int]]:
    """Random token ids in [100, max_id), clear of the special tokens at the low end."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(100, max_id, (k,), generator=g).tolist() for k in lengths]


@torch.no_grad()
def hf_logprobs(hf_model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """The straightforward reference: one full forward (no KV cache) over the prompt and
    the generated tokens, teacher-forced. Row i is the log-softmax that chose tokens[i];
    if every row's argmax is tokens[i], HF's own greedy decode yields exactly ``tokens``."""
    ids = torch.tensor([prompt + tokens[:-1]], device=hf_model.device)
    logits = hf_model(ids, use_cache=False).logits[0, len(prompt) - 1 :].float()
    return torch.log_softmax(logits, -1)


def check_agreement(loaded: LoadedModel, hf_model, prompts: list[list[int]], steps: int,
                    atol: float, **engine_config) -> None:
    """Greedy paged decoding picks HF's greedy tokens, and every logprob it reports (the
    chosen token's and the top 5) is within atol of HF's teacher-forced full forward."""
    engine = make_engine(loaded, **engine_config)
    outs = run(engine, prompts, greedy(steps, logprobs=5))
    for prompt, out in zip(prompts, outs, strict=True):
        got = out.outputs[0]
        ref_logprobs = hf_logprobs(hf_model, prompt, got.token_ids).cpu()
        assert got.token_ids == ref_logprobs.argmax(-1).tolist()  # HF's greedy choices
        for step, (lp, ref) in enumerate(zip(got.logprobs, ref_logprobs, strict=True)):
            assert abs(lp.logprob - float(ref[lp.token_id])) < atol, step
            for token_id, value in lp.top:
                assert abs(value - float(ref[token_id])) < atol, (step, token_id)
            assert [t for t, _ in lp.top] == ref.topk(5).indices.tolist()


def save_tiny_hf(path: Path, model_cls, config, tokenizer) -> None:
    """Save a random-weight transformers model as a HF directory (safetensors) with the
    given tokenizer."""
    _random_model(model_cls, config).save_pretrained(path, safe_serialization=True)
    tokenizer.backend.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|im_start|>", "eos_token": "<|im_end|>",
        "chat_template": tokenizer.chat_template}))


def tiny_llama_with_embedded_tokenizer(num_layers: int, max_positions: int) -> LoadedModel:
    """A random-weight Llama of 64-wide layers (4 query heads on 2 KV heads) with the
    embedded model's tokenizer, saved as a HF directory and loaded: for the scripts that
    replay the engine's kernel launches on a CPU."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = load_model_files(None, torch.float32).tokenizer
    path = Path(tempfile.mkdtemp())
    config = LlamaConfig(
        vocab_size=tokenizer.vocab_size, hidden_size=64, intermediate_size=128,
        num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=max_positions, tie_word_embeddings=False, eos_token_id=2)
    save_tiny_hf(path, LlamaForCausalLM, config, tokenizer)
    return load_model_files(str(path), torch.float32)


def save_random_hf(path: Path, model_cls, config) -> None:
    """Save a random-weight transformers model of any size as a HF directory, with a
    word-level tokenizer ("t0" .. "t{vocab-1}") built here, so that nothing depends on the
    embedded model (the GPU machine does not have it)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    _random_model(model_cls, config).save_pretrained(path, safe_serialization=True)
    vocab = {f"t{i}": i for i in range(config.vocab_size)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "t2"}))


def save_byte_level_tokenizer(path: Path, vocab_size: int) -> None:
    """A byte-level BPE tokenizer of ``vocab_size`` ids built here (llguidance needs one
    whose tokens spell bytes; the word-level one above has no decoder): ids 0-2 the
    special <unk>, <s>, </s> (EOS, as in save_random_hf's models), then the 256 bytes, then
    two-byte merges of them."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = ByteLevel.alphabet()
    alphabet.sort()
    specials = ["<unk>", "<s>", "</s>"]
    vocab = {t: i for i, t in enumerate(specials + alphabet)}
    merges = []
    for a in alphabet:
        for b in alphabet:
            if len(vocab) == vocab_size:
                break
            vocab[a + b] = len(vocab)
            merges.append((a, b))
    backend = Tokenizer(models.BPE(vocab, merges))
    backend.add_special_tokens(specials)
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))


def _random_model(model_cls, config):
    """Weights wider than the default init, so that logits are far from ties; biases
    nonzero (transformers starts them at zero, where a dropped one would go unseen)."""
    torch.manual_seed(0)
    model = model_cls(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 or name.endswith(".bias"):
                p.normal_(0, 0.08)
    return model


@contextlib.contextmanager
def compile_threads_held() -> Iterator[None]:
    """Every compile thread (structured/workers.py) blocked until the block ends: what is
    submitted meanwhile stays queued, whatever the machine's speed."""
    from pagedserve.structured import workers

    release = threading.Event()
    started = [threading.Event() for _ in range(workers.NUM_THREADS)]

    def hold(started: threading.Event) -> None:
        started.set()
        release.wait(300)

    held = [workers.submit(hold, event) for event in started]
    assert all(event.wait(60) for event in started)
    try:
        yield
    finally:
        release.set()
        for future in held:
            future.result(60)
