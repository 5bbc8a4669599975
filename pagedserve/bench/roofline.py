"""Model FLOPs of a workload and a matmul probe of this machine's peak FLOP/s.

FLOPs = 2 x multiply-accumulates. For every token the model processes (each prompt token
actually computed in prefill, each generated token fed back in decode):
  linear     q, k, v, o, gate, up, down projections: 2 * L * (h*(q+2kv) + q*h + 3*h*I)
  attention  QK^T and PV over the token's context (its position + 1): 2 * 2 * ctx * H * d * L
and for each row whose logits are computed (the last scheduled token of each sequence in a
step): lm_head 2 * h * V. Norms, RoPE, activations and softmax are left out (O(h) per token).

The bound is total FLOPs / peak, where peak is the best median rate of a matmul at the
model's shapes (256 rows) in the run's dtype: a compute roofline, the time the work would
take if every FLOP ran at the best matmul speed this process can reach.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from pagedserve.models.config import ModelConfig


def linear_macs_per_token(cfg: ModelConfig) -> int:
    h, inter = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return cfg.num_layers * (h * (q + 2 * kv) + q * h + 3 * h * inter)


def attention_flops(cfg: ModelConfig, start: int, num: int) -> int:
    """Tokens at positions start..start+num-1, each attending over position + 1 keys."""
    contexts = num * start + num * (num + 1) // 2
    return 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * contexts


@dataclass
class FlopCount:
    linear: int = 0
    attention: int = 0
    lm_head: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    logit_rows: int = 0

    @property
    def total(self) -> int:
        return self.linear + self.attention + self.lm_head

    def add_chunk(self, cfg: ModelConfig, start: int, num: int, num_prompt_tokens: int,
                  logits: bool = True) -> None:
        """One sequence's scheduled tokens in one forward (positions start..start+num-1);
        positions before ``num_prompt_tokens`` count as prefill tokens."""
        prefill = max(0, min(start + num, num_prompt_tokens) - start)
        self.prefill_tokens += prefill
        self.decode_tokens += num - prefill
        self.linear += 2 * linear_macs_per_token(cfg) * num
        self.attention += attention_flops(cfg, start, num)
        if logits:
            self.logit_rows += 1
            self.lm_head += 2 * cfg.hidden_size * cfg.vocab_size

    def as_dict(self) -> dict[str, int]:
        return dict(asdict(self), total=self.total)


class EngineFlopCounter:
    """Counts the FLOPs of every forward an LLMEngine runs, by wrapping its runner's
    ``execute(batch, carried)`` on this instance only; also sums the host's time inside it
    (on CUDA the launches: waiting for the GPU here would add a sync to every step, and
    take away asynchronous scheduling's overlap)."""

    def __init__(self, engine: Any, cfg: ModelConfig):
        self.reset()
        runner = engine.runner
        original = runner.execute

        def execute(batch: Any, carried: Any = None) -> Any:
            for seq in batch.seqs:
                self.count.add_chunk(cfg, seq.num_cached_tokens, seq.num_scheduled_tokens,
                                     seq.num_prompt_tokens)
            start = time.perf_counter()
            out = original(batch, carried)
            self.execute_s += time.perf_counter() - start
            self.forwards += 1
            return out

        runner.execute = execute

    def reset(self) -> None:
        self.count = FlopCount()
        self.execute_s = 0.0
        self.forwards = 0


def matmul_shapes(cfg: ModelConfig) -> list[tuple[str, int, int]]:
    """(name, in_features, out_features) of the model's matmuls, fused as an engine would."""
    h, inter = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return [("qkv", h, q + 2 * kv), ("o", q, h), ("gate_up", h, 2 * inter),
            ("down", inter, h), ("lm_head", h, cfg.vocab_size)]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def probe_peak(cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str = "cpu",
               rows: int = 256, warmup: int = 2, reps: int = 5) -> dict[str, Any]:
    """Median time of ``F.linear`` at each model shape; peak = the best rate."""
    device = torch.device(device)
    gen = torch.Generator().manual_seed(0)
    shapes = []
    for name, fan_in, fan_out in matmul_shapes(cfg):
        x = torch.randn(rows, fan_in, generator=gen).to(device, dtype)
        w = torch.randn(fan_out, fan_in, generator=gen).to(device, dtype)
        times = []
        for i in range(warmup + reps):
            _sync(device)
            start = time.perf_counter()
            torch.nn.functional.linear(x, w)
            _sync(device)
            if i >= warmup:
                times.append(time.perf_counter() - start)
        median = statistics.median(times)
        flops = 2 * rows * fan_in * fan_out
        shapes.append({"name": name, "in": fan_in, "out": fan_out,
                       "median_ms": median * 1e3, "gflops": flops / median / 1e9})
    peak = max(s["gflops"] for s in shapes)
    return {"rows": rows, "dtype": str(dtype).removeprefix("torch."), "reps": reps,
            "threads": torch.get_num_threads(), "shapes": shapes, "peak_gflops": peak}


def roofline(count: FlopCount, peak_gflops: float, wall_s: float) -> dict[str, Any]:
    bound = count.total / (peak_gflops * 1e9)
    return {
        "flops": count.as_dict(),
        "peak_gflops": peak_gflops,
        "bound_s": bound,
        "measured_s": wall_s,
        "achieved_fraction": bound / wall_s if wall_s > 0 else None,
        "achieved_gflops": count.total / wall_s / 1e9 if wall_s > 0 else None,
    }
