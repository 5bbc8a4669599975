"""`pagedserve serve` with every forward replaced by fixed logits, for measuring the server:
what is left is the host's cost of serving (the engine's scheduling, sampling and outputs,
and the HTTP layer's per-token work on the event loop), at a token rate no CPU forward
reaches. On a GPU the forward is a few ms a step, so that host cost is what caps HTTP
throughput; here it can be measured, and compared with the engine's own rate
(`scripts/profile_step.py --no-forward`).

    .venv/bin/python scripts/serve_no_forward.py --port 8000 [pagedserve serve flags]
    .venv/bin/pagedserve bench serve --base-url http://127.0.0.1:8000 --ignore-eos ...

Send `ignore_eos` (or `--ignore-eos`): a fixed row of logits may well pick the EOS token.
"""

import sys

# isort: off
import pagedserve  # noqa: F401  (sets the OpenMP wait policy before torch loads OpenMP)
import torch
# isort: on

from pagedserve.engine.model_runner import ModelRunner

_fixed: dict[torch.device, torch.Tensor] = {}


def fixed_logits(self: ModelRunner, header: list[int], payload: torch.Tensor,
                 carried: object = None) -> torch.Tensor:
    """A fixed random row per logits row the step asks for (no forward, no KV written)."""
    rows, vocab = header[7], self.model.config.vocab_size  # header[7]: the rows sampled
    table = _fixed.get(payload.device)
    if table is None or len(table) < rows:  # 64 random rows, repeated (drawing is slow)
        base = torch.randn(64, vocab, generator=torch.Generator().manual_seed(0))
        table = _fixed[payload.device] = base.repeat(-(-rows // 64), 1).to(payload.device)
    return table[:rows]


if __name__ == "__main__":
    from pagedserve.cli import main  # here: profile_step.py imports fixed_logits alone

    ModelRunner.run = fixed_logits
    sys.exit(main(["serve", *sys.argv[1:]]))
