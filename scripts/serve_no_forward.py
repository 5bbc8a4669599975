"""`pagedserve serve` with every forward replaced by fixed logits, for measuring the server:
what is left is the host's cost of serving (the engine's scheduling, sampling and outputs,
and the HTTP layer's per-token work on the event loop), at a token rate no CPU forward
reaches. On a GPU the forward is a few ms a step, so that host cost is what caps HTTP
throughput; here it can be measured, and compared with the engine's own rate
(`scripts/profile_step.py --no-forward`).

    .venv/bin/python scripts/serve_no_forward.py --port 8000 [pagedserve serve flags]
    .venv/bin/pagedserve bench serve --base-url http://127.0.0.1:8000 --ignore-eos ...

Send `ignore_eos` (or `--ignore-eos`): a fixed row of logits may well pick the EOS token.

``fake_forwards(width)`` (profile_step.py and step_events.py: ``--logits-width N``) makes the
rows N wide, not the vocabulary: sampling on a CPU then costs what launching it costs on a
GPU, a few us, where an argmax over 49,152 columns a row takes ~0.9 ms a 64-row step here
(device work on a GPU). The sampled ids are then in [32, N) (for N > 32): a greedy,
``ignore_eos`` load of text tokens.
This script takes N from the environment (``LOGITS_WIDTH=N``), for its engine process too;
with ``--num-threads 1`` that process's CPU is then its host work alone (ab_serve_loop.sh).
``FORWARD_MS=M`` (both scripts) makes each forward sleep M ms, as the host waits for a
GPU's forward: the host's costs then count as they would beside a GPU's step time.
"""

import os
import sys
import time

# isort: off
import pagedserve  # noqa: F401  (sets the OpenMP wait policy before torch loads OpenMP)
import torch
# isort: on

from pagedserve.engine.cuda_graphs import DecodeGraphs
from pagedserve.engine.model_runner import ModelRunner

_fixed: dict[torch.device, torch.Tensor] = {}
_width: int | None = None  # the rows' width; None: the vocabulary's
_forward_s = float(os.environ.get("FORWARD_MS") or 0) / 1000
# The embedded tokenizer's ids 0-16 are special tokens, which stream no text: a third of 64
# narrow random rows picked one, and a request sampled from such rows alone streamed nothing
# (`bench serve` failed ~7% of them, and the server skipped a third of the tokens' chunks).
_TEXTLESS_IDS = 32


def _logits(rows: int, vocab: int, device: torch.device) -> torch.Tensor:
    if _forward_s:
        time.sleep(_forward_s)
    vocab = _width or vocab
    table = _fixed.get(device)
    # 64 random rows, repeated (drawing is slow)
    if table is None or len(table) < rows or table.shape[1] != vocab:
        base = torch.randn(64, vocab, generator=torch.Generator().manual_seed(0))
        if _width:  # narrow rows: none may pick the low ids, special in most vocabularies
            base[:, :min(_TEXTLESS_IDS, _width - 1)] = float("-inf")
        table = _fixed[device] = base.repeat(-(-rows // 64), 1).to(device)
    return table[:rows]


def fixed_logits(self: ModelRunner, header: list[int], payload: torch.Tensor,
                 carried: object = None, plain: bool = False) -> torch.Tensor:
    """A fixed random row per logits row the step asks for (no forward, no KV written)."""
    return _logits(header[7], self.model.config.vocab_size, payload.device)  # [7]: rows


def fixed_graph_logits(self: DecodeGraphs, size: int) -> torch.Tensor:
    """The same for the decode graphs' padded batch (their inputs still filled as usual)."""
    return _logits(size, self.model.config.vocab_size, self.buffers.int64.device)


def fake_forwards(width: int | None = None) -> None:
    """Every forward, packed or a decode graph's, replaced by fixed logits (``width`` columns;
    None: the vocabulary's): on a CPU the decode graphs' path (--no-enforce-eager) is the
    one a GPU's decode steps take."""
    global _width
    _width = width
    ModelRunner.run = fixed_logits
    DecodeGraphs._forward = fixed_graph_logits


_env_width = int(os.environ["LOGITS_WIDTH"]) if os.environ.get("LOGITS_WIDTH") else None
if __name__ == "__mp_main__":  # the engine process of --frontend-multiprocessing (spawned)
    fake_forwards(_env_width)
if __name__ == "__main__":
    from pagedserve.cli import main  # here: profile_step.py imports fixed_logits alone

    fake_forwards(_env_width)
    sys.exit(main(["serve", *sys.argv[1:]]))
