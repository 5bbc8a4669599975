"""A step whose forward and sampling are launched but whose tokens are not yet read back:
under asynchronous scheduling the engine schedules and launches the next step first, and
that step takes those tokens as input ids straight from the device."""

from dataclasses import dataclass

from pagedserve.engine.sampler import SampledTokens
from pagedserve.engine.step_inputs import CarriedTokens
from pagedserve.scheduler import PENDING_TOKEN, ScheduledBatch


@dataclass
class InFlightStep:
    batch: ScheduledBatch
    sampled: SampledTokens  # a row per sequence that completed its input, in batch order

    @property
    def request_ids(self) -> set[str]:
        """The requests still running in it (one that finished has had its last output)."""
        return {seq.request_id for seq in self.batch.seqs if not seq.is_finished}

    def carried_into(self, batch: ScheduledBatch) -> CarriedTokens | None:
        """The input ids ``batch`` takes from this step's tokens: its decodes whose one
        token is still PENDING_TOKEN (Scheduler.advance's placeholder)."""
        row_of = {seq.seq_id: i for i, seq in enumerate(self.sampled.rows)}
        dst, src = [], []
        for i, seq in enumerate(batch.seqs[: batch.num_decodes]):
            if seq.token_ids[seq.num_cached_tokens] == PENDING_TOKEN:
                dst.append(i)
                src.append(row_of[seq.seq_id])
        return CarriedTokens(self.sampled.tokens, dst, src) if dst else None
