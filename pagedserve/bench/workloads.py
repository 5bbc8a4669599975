"""Prompt sets: the fixed offline workloads of `bench throughput` and the datasets of
`bench serve`.

Prompts are random token ids drawn from ``[100, vocab - 100)`` (clear of the special tokens
at either end of most vocabularies) with fixed seeds, so every run sends the same tokens.
For the chat endpoint, which takes no token ids, a prompt is a text of random common words,
about one token per word in the usual BPE vocabularies (the server's ``usage`` reports the
exact count).

JSONL dataset format (``--dataset PATH.jsonl``), one object per line::

    {"prompt": "Explain paged attention.", "output_len": 128}
    {"prompt": [9906, 1917, 13], "output_len": 64}

``prompt`` is a string or a list of token ids (token ids only on the completions endpoint);
``output_len`` is optional and defaults to ``--output-len``. Blank lines are skipped; the
first ``--num-prompts`` lines are used.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

WORKLOADS = ("mixed", "decode-heavy", "shared-prefix", "fork", "custom")
DATASETS = ("random", "shared-prefix")
_EDGE = 100  # ids kept clear at each end of the vocabulary


@dataclass
class BenchRequest:
    prompt: list[int] | str
    output_len: int
    n: int = 1

    @property
    def prompt_len(self) -> int | None:
        return len(self.prompt) if isinstance(self.prompt, list) else None


@dataclass(frozen=True)
class WorkloadSpec:
    num_prompts: int
    input_len: tuple[int, int]  # inclusive range of prompt (or suffix) lengths
    output_len: int
    prefix_len: int = 0  # shared by every prompt
    n: int = 1  # samples per request
    description: str = ""


SPECS: dict[str, WorkloadSpec] = {
    "mixed": WorkloadSpec(64, (64, 512), 128,
                          description="64 prompts of 64-512 tokens, 128 output tokens each"),
    "decode-heavy": WorkloadSpec(128, (16, 64), 256,
                                 description="128 prompts of 16-64 tokens, 256 output tokens"),
    "shared-prefix": WorkloadSpec(32, (32, 32), 64, prefix_len=1536,
                                  description="32 prompts: one 1,536-token prefix + a unique "
                                              "32-token suffix, 64 output tokens"),
    "fork": WorkloadSpec(4, (1024, 1024), 64, n=16,
                         description="4 prompts of 1,024 tokens, n=16, 64 output tokens"),
    "custom": WorkloadSpec(16, (128, 128), 64,
                           description="--num-prompts prompts of --input-len tokens, "
                                       "--output-len output tokens"),
}


@dataclass
class Workload:
    name: str
    requests: list[BenchRequest]
    spec: WorkloadSpec
    seed: int


def id_range(vocab_size: int) -> tuple[int, int]:
    """The half-open range random prompt ids come from."""
    if vocab_size <= 4 * _EDGE:
        return 0, vocab_size
    return _EDGE, vocab_size - _EDGE


def random_ids(rng: np.random.Generator, length: int, vocab_size: int) -> list[int]:
    lo, hi = id_range(vocab_size)
    return rng.integers(lo, hi, size=length).tolist()


def build_workload(
    name: str,
    vocab_size: int,
    num_prompts: int | None = None,
    input_len: int | None = None,
    output_len: int | None = None,
    prefix_len: int | None = None,
    n: int | None = None,
    seed: int = 0,
) -> Workload:
    """A named workload; an override replaces the spec's value (``input_len`` fixes every
    prompt's length, or the unique suffix's for shared-prefix)."""
    if name not in SPECS:
        raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
    base = SPECS[name]
    spec = WorkloadSpec(
        num_prompts=base.num_prompts if num_prompts is None else num_prompts,
        input_len=base.input_len if input_len is None else (input_len, input_len),
        output_len=base.output_len if output_len is None else output_len,
        prefix_len=base.prefix_len if prefix_len is None else prefix_len,
        n=base.n if n is None else n,
        description=base.description,
    )
    for field_name, value in (("num-prompts", spec.num_prompts), ("output-len", spec.output_len),
                              ("n", spec.n), ("input-len", spec.input_len[0])):
        if value < 1:
            raise ValueError(f"--{field_name} must be at least 1")
    if spec.prefix_len < 0:
        raise ValueError("--prefix-len must not be negative")
    rng = np.random.default_rng(seed)
    prefix = random_ids(rng, spec.prefix_len, vocab_size)
    lo, hi = spec.input_len
    lengths = rng.integers(lo, hi + 1, size=spec.num_prompts).tolist()
    requests = [BenchRequest(prefix + random_ids(rng, k, vocab_size), spec.output_len, spec.n)
                for k in lengths]
    return Workload(name, requests, spec, seed)


# ---- bench serve datasets ----------------------------------------------------------------

_WORDS = [word for line in (
    "time year people way day man thing woman life child world school state family student ",
    "group country problem hand part place case week company system program question work ",
    "government number night point home water room mother area money story fact month lot ",
    "right study book eye job word business issue side kind head house service friend father ",
    "power hour game line end member law car city community name president team minute idea ",
    "kid body information back parent face others level office door health person art war ",
    "history party result change morning reason research girl guy moment air teacher force ",
    "education foot boy age policy music market sense nation plan college interest death ",
    "experience effect class control care field development role effort rate heart drug show ",
    "leader light voice wife police mind price report decision son view relationship town ",
    "road arm difference value building action model season society tax director position ",
    "player record paper space ground form event official matter center couple site project ",
    "activity star table need court oil situation cost industry figure street image phone ",
    "data picture practice piece land product doctor wall patient worker news test movie ",
    "north love support technology step baby computer type attention film tree source ",
    "organization hair window evidence population site training river garden stone",
) for word in line.split()]


def random_text(rng: np.random.Generator, num_words: int) -> str:
    return " ".join(_WORDS[i] for i in rng.integers(0, len(_WORDS), size=num_words))


def serve_dataset(
    dataset: str,
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    prefix_len: int = 0,
    seed: int = 0,
    vocab_size: int = 32000,
    as_text: bool = False,
) -> list[BenchRequest]:
    """Requests for `bench serve`: token-id prompts, or word texts when ``as_text``.

    random: prompt lengths uniform in [L*(1-R), L*(1+R)] (integers, at least 1).
    shared-prefix: a common prefix of ``prefix_len`` + a unique suffix of ``input_len``.
    anything else is a JSONL path (see the module docstring)."""
    if num_prompts < 1 or output_len < 1:
        raise ValueError("--num-prompts and --output-len must be at least 1")
    if dataset not in DATASETS:
        return load_jsonl(dataset, num_prompts, output_len, as_text)
    if input_len < 1 or not 0 <= range_ratio < 1:
        raise ValueError("--input-len must be at least 1 and --range-ratio in [0, 1)")
    rng = np.random.default_rng(seed)

    def make(k: int) -> list[int] | str:
        return random_text(rng, k) if as_text else random_ids(rng, k, vocab_size)

    if dataset == "shared-prefix":
        if as_text:
            text = random_text(rng, prefix_len)
            return [BenchRequest(f"{text} {random_text(rng, input_len)}".lstrip(), output_len)
                    for _ in range(num_prompts)]
        ids = random_ids(rng, prefix_len, vocab_size)
        return [BenchRequest(ids + random_ids(rng, input_len, vocab_size), output_len)
                for _ in range(num_prompts)]
    lo = max(1, int(input_len * (1 - range_ratio)))
    hi = max(lo, int(input_len * (1 + range_ratio)))
    lengths = rng.integers(lo, hi + 1, size=num_prompts).tolist()
    return [BenchRequest(make(k), output_len) for k in lengths]


def load_jsonl(path: str, num_prompts: int, output_len: int, as_text: bool) -> list[BenchRequest]:
    requests: list[BenchRequest] = []
    try:
        with open(path, encoding="utf-8") as f:
            lines = [line for line in f if line.strip()]
    except OSError as e:
        raise ValueError(f"--dataset: not random, shared-prefix or a readable file ({e})") from e
    for number, line in enumerate(lines[:num_prompts], 1):
        try:
            row = json.loads(line)
            prompt = row["prompt"]
            out = int(row.get("output_len", output_len))
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path}:{number}: expected {{\"prompt\": ..., "
                             f"\"output_len\": N}} ({e!r})") from e
        ok_ids = isinstance(prompt, list) and all(isinstance(t, int) for t in prompt)
        if not (isinstance(prompt, str) or ok_ids) or not prompt or out < 1:
            raise ValueError(f"{path}:{number}: prompt must be a non-empty string or list of "
                             "token ids, output_len at least 1")
        if as_text and not isinstance(prompt, str):
            raise ValueError(f"{path}:{number}: the chat endpoint needs text prompts")
        requests.append(BenchRequest(prompt, out))
    if not requests:
        raise ValueError(f"{path}: no prompts")
    return requests
