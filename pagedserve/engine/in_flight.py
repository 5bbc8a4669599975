"""A step whose forward and sampling are launched but whose tokens are not yet read back:
under asynchronous scheduling the engine schedules and launches the next step first, and
that step takes those tokens as input ids straight from the device."""

from dataclasses import dataclass
from functools import cached_property

import torch

from pagedserve.engine.logits_processors import needs_token_history, penalized
from pagedserve.engine.sampler import SampledTokens
from pagedserve.engine.step_inputs import CarriedTokens, on_device
from pagedserve.scheduler import PENDING_TOKEN, ScheduledBatch, Sequence


@dataclass
class InFlightStep:
    batch: ScheduledBatch
    sampled: SampledTokens  # a row per sequence that completed its input, in batch order

    @cached_property
    def row_of(self) -> dict[int, int]:
        """Each sampled sequence's row in ``sampled.tokens``."""
        return {seq.seq_id: i for i, seq in enumerate(self.sampled.rows)}

    @property
    def request_ids(self) -> set[str]:
        """The requests still running in it (one that finished has had its last output)."""
        return {seq.request_id for seq in self.batch.seqs if not seq.is_finished}

    def carried_into(self, batch: ScheduledBatch) -> CarriedTokens | None:
        """The input ids ``batch`` takes from this step's tokens: its decodes whose one
        token is still PENDING_TOKEN (Scheduler.advance's placeholder)."""
        dst, src = [], []
        for i, seq in enumerate(batch.seqs[: batch.num_decodes]):
            if seq.token_ids[seq.num_cached_tokens] == PENDING_TOKEN:
                dst.append(i)
                src.append(self.row_of[seq.seq_id])
        return CarriedTokens(self.sampled.tokens, dst, src) if dst else None

    def pending_tokens(self, rows: list[Sequence]) -> torch.Tensor | None:
        """For the penalties of the next step's sampled ``rows`` (sampler.sample's
        ``pending``): this step's token for each penalized row whose last token is still
        PENDING_TOKEN, -1 for the others, on the device; None where no such row waits."""
        waits = [penalized(r) and r.last_token_pending for r in rows]
        if not any(waits):
            return None
        src = on_device([self.row_of[r.seq_id] if w else -1
                         for r, w in zip(rows, waits, strict=True)],
                        self.sampled.tokens.device, torch.long)
        return torch.where(src >= 0, self.sampled.tokens.long()[src.clamp(min=0)], -1)


def samples_from_history(batch: ScheduledBatch) -> bool:
    """Whether sampling ``batch`` reads on the host a token still in flight (a grammar's
    matcher does): the previous step then settles between this step's forward and its
    sampling."""
    return any(needs_token_history(seq) and seq.last_token_pending
               for seq in batch.seqs[: batch.num_decodes])
