"""A model's recommended sampling defaults (vLLM's ``--generation-config``): the values that a
request falls back to for each sampling field it leaves out, read from the model's files."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# generation_config.json's sampling fields, by the name a request gives each.
HF_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
             "min_p": "min_p", "repetition_penalty": "repetition_penalty",
             "max_new_tokens": "max_tokens"}
# transformers' own defaults: a file that restates one sets nothing, as vLLM reads only the
# file's difference from them (top_k 50 is in many files that never meant to sample top-k).
_HF_NEUTRAL = {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "repetition_penalty": 1.0}
# llama.cpp's GGUF keys. Its penalty_repeat is left out: it covers the last n tokens only,
# where a request's repetition_penalty covers them all.
GGUF_FIELDS = {"general.sampling.temp": "temperature", "general.sampling.top_p": "top_p",
               "general.sampling.top_k": "top_k", "general.sampling.min_p": "min_p"}

Fields = dict[str, float | int]  # by the name a request gives each


@dataclass(frozen=True)
class SamplingDefaults:
    """What a request's omitted sampling fields take (max_tokens among them, where a request
    may leave it out), and the most tokens any request may ask for (vLLM's rule: only an
    explicit config's max_new_tokens caps every request; a model's own is a default)."""

    fields: Fields = field(default_factory=dict)
    max_tokens_cap: int | None = None


def _number(key: str, name: str, value: Any) -> float | int:
    """``value`` of the file's ``key`` as request field ``name`` takes it."""
    if name in ("top_k", "max_tokens"):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{key} must be an integer, not {value!r}")
        if name == "max_tokens" and value < 1:  # (a request's 0 would generate nothing)
            raise ValueError(f"{key} must be at least 1, not {value!r}")
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{key} must be a finite number, not {value!r}")
    return float(value)


def from_hf(config: dict[str, Any], *, drop_neutral: bool = True) -> Fields:
    """The sampling defaults a generation_config.json (or an override in its names) sets:
    ValueError for a value of the wrong type."""
    found: Fields = {}
    for key, name in HF_FIELDS.items():
        value = config.get(key)
        if value is None or (drop_neutral and _HF_NEUTRAL.get(key) == value):
            continue
        found[name] = _number(key, name, value)
    return found


def read_hf_dir(path: str) -> Fields:
    """The defaults of ``path``/generation_config.json; none where it has no such file."""
    file = os.path.join(path, "generation_config.json")
    if not os.path.isfile(file):
        return {}
    with open(file, encoding="utf-8") as f:
        config = json.load(f)
    if not isinstance(config, dict):
        raise ValueError(f"{file}: not a JSON object")
    return from_hf(config)


def read_gguf(get: Callable[[str], Any]) -> Fields:
    """The defaults a GGUF file's ``general.sampling.*`` keys set (``get`` reads a key)."""
    found: Fields = {}
    for key, name in GGUF_FIELDS.items():
        value = get(key)
        if value is not None:
            number = _number(key, name, value)
            # Stored as float32: round so that 0.6 reads back as 0.6, not 0.60000002.
            found[name] = float(f"{number:.7g}") if isinstance(number, float) else number
    return found


def resolve(mode: str, model_fields: Fields,
            override: dict[str, Any] | None = None) -> SamplingDefaults:
    """vLLM's --generation-config: "auto" takes the model's own defaults, "vllm" none, and any
    other value is a directory whose generation_config.json holds them. The override's keys
    (generation_config.json's names) then go on top, restated defaults included, so that an
    override can undo a model's value (null: no default at all, as in vLLM). ValueError for
    an unknown key or a wrong type."""
    if mode == "auto":
        found = dict(model_fields)
    elif mode == "vllm":
        found = {}
    else:
        if not os.path.isfile(os.path.join(mode, "generation_config.json")):
            raise ValueError(f"--generation-config {mode}: no generation_config.json there")
        found = read_hf_dir(mode)
    unknown = sorted(set(override or {}) - set(HF_FIELDS))
    if unknown:
        raise ValueError(f"--override-generation-config: unknown key(s) {', '.join(unknown)} "
                         f"(known: {', '.join(HF_FIELDS)})")
    for key in [k for k, v in (override or {}).items() if v is None]:  # null: no default
        found.pop(HF_FIELDS[key], None)
    overridden = from_hf(override or {}, drop_neutral=False)
    explicit = overridden if mode in ("auto", "vllm") else found | overridden
    return SamplingDefaults(found | overridden, explicit.get("max_tokens"))  # type: ignore[arg-type]
