"""The HF transformers baseline: the same weights in transformers' own model, run with
`generate` in static batches.

What is measured, per batch size b: the first m = min(N, max(b, K)) rows of the workload
(a row is one sample: a request with n samples is n rows; K = --hf-max-prompts, 0 = all)
run in consecutive static batches of b rows (the last one may be partial), each batch
left-padded to its longest prompt with an attention mask, greedy, with
min_new_tokens = max_new_tokens = output_len (so EOS never ends a row early, like
ignore_eos). wall_s is the time of those generate calls only (the model is built and warmed
up with one short generate first); output_tokens_per_s = generated tokens / wall_s. The
full workload's HF time is estimated as wall_s * N / m (the subset's rate extrapolated).
The best output_tokens_per_s over the batch sizes is the baseline.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable
from typing import Any

import torch

from pagedserve.models.config import ModelConfig
from pagedserve.models.loader import LoadedModel

_CLASSES = {
    "LlamaForCausalLM": ("LlamaConfig", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("Qwen2Config", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("Qwen3Config", "Qwen3ForCausalLM"),
}


def hf_config(cfg: ModelConfig, config_cls: Any) -> Any:
    kwargs: dict[str, Any] = dict(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=cfg.tie_word_embeddings,
    )
    if config_cls.__name__ == "LlamaConfig":
        kwargs |= {"attention_bias": cfg.attention_bias, "mlp_bias": cfg.mlp_bias}
    params = inspect.signature(config_cls.__init__).parameters
    if "rope_parameters" in params:  # transformers >= 5
        kwargs["rope_parameters"] = {"rope_type": "default", **(cfg.rope_scaling or {}),
                                     "rope_theta": cfg.rope_theta}
    else:
        kwargs |= {"rope_theta": cfg.rope_theta, "rope_scaling": cfg.rope_scaling}
    return config_cls(**kwargs)


def hf_model_from_loaded(loaded: LoadedModel, dtype: torch.dtype) -> torch.nn.Module:
    """transformers' model class for the architecture, with the LoadedModel's weights."""
    import transformers

    arch = loaded.config.architecture
    if arch not in _CLASSES:
        raise ValueError(f"--baseline hf: no transformers class for {arch!r}")
    config_name, model_name = _CLASSES[arch]
    config = hf_config(loaded.config, getattr(transformers, config_name))
    model = getattr(transformers, model_name)(config)
    missing, unexpected = model.load_state_dict(loaded.weights, strict=False)
    allowed = {"lm_head.weight"} if loaded.config.tie_word_embeddings else set()
    if set(missing) - allowed or unexpected:
        raise ValueError(f"--baseline hf: weights do not fit {model_name}: missing "
                         f"{sorted(set(missing) - allowed)[:5]}, unexpected {unexpected[:5]}")
    if loaded.config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.to(dtype).eval()


def _batch(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = [[pad_id] * (width - len(p)) + p for p in prompts]
    mask = [[0] * (width - len(p)) + [1] * len(p) for p in prompts]
    return torch.tensor(ids), torch.tensor(mask)


@torch.inference_mode()
def _generate(model: torch.nn.Module, prompts: list[list[int]], new_tokens: int,
              pad_id: int, eos_ids: list[int]) -> torch.Tensor:
    from transformers import GenerationConfig

    device = next(model.parameters()).device
    ids, mask = _batch(prompts, pad_id)
    gen = GenerationConfig(do_sample=False, max_new_tokens=new_tokens,
                           min_new_tokens=new_tokens, pad_token_id=pad_id,
                           eos_token_id=eos_ids or None)
    out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                         generation_config=gen)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return out[:, ids.shape[1]:].cpu()


def run_hf_baseline(
    model: torch.nn.Module,
    rows: list[tuple[list[int], int]],
    batch_sizes: list[int],
    max_prompts: int,
    pad_id: int,
    eos_ids: list[int],
    on_batch: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """``rows``: (prompt ids, output_len) per sample. See the module docstring."""
    _generate(model, [rows[0][0][:8]], 2, pad_id, eos_ids)  # warm-up
    runs = []
    first_row_tokens: list[int] | None = None
    for b in batch_sizes:
        m = len(rows) if max_prompts <= 0 else min(len(rows), max(b, max_prompts))
        subset = rows[:m]
        generated = prompt_tokens = 0
        start = time.perf_counter()
        for i in range(0, m, b):
            chunk = subset[i:i + b]
            new = max(out_len for _, out_len in chunk)
            out = _generate(model, [p for p, _ in chunk], new, pad_id, eos_ids)
            # The sanity check on the engine's output reads the first row of a batch of one:
            # in a padded batch, bf16 rounding alone can change a greedy token.
            if b == 1 and first_row_tokens is None:
                first_row_tokens = out[0].tolist()
            generated += out.numel()
            prompt_tokens += sum(len(p) for p, _ in chunk)
            if on_batch:
                on_batch(f"hf batch {b}: {min(i + b, m)}/{m} rows")
        wall = time.perf_counter() - start
        runs.append({
            "batch_size": b, "rows": m, "prompt_tokens": prompt_tokens,
            "output_tokens": generated, "wall_s": wall,
            "output_tokens_per_s": generated / wall,
            "total_tokens_per_s": (prompt_tokens + generated) / wall,
            "estimated_full_wall_s": wall * len(rows) / m,
        })
    best = max(runs, key=lambda r: r["output_tokens_per_s"])
    return {"rows_total": len(rows), "max_prompts": max_prompts, "runs": runs,
            "best": best, "first_row_tokens": first_row_tokens}
