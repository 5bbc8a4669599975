"""vLLM's repetition_detection: a sample whose output ends in a pattern of tokens repeated
back to back ends early, with finish_reason "repetition" (a model caught in a loop would
otherwise run to max_tokens)."""

from collections.abc import Sequence
from dataclasses import dataclass

from pagedserve.scheduler.errors import InvalidRequest

REPETITION_STOP_REASON = "repetition_detected"  # vLLM's stop_reason beside the finish reason


@dataclass(frozen=True)
class RepetitionDetection:
    """The output ends a sample once its last ``p`` tokens, for some ``p`` in
    [min_pattern_size (0: 1), max_pattern_size], have come ``min_count`` times in a row.
    max_pattern_size 0 turns it off. Checked after min_tokens, as stop tokens are."""

    max_pattern_size: int = 0
    min_pattern_size: int = 0
    min_count: int = 0

    def __post_init__(self) -> None:
        sizes = (self.max_pattern_size, self.min_pattern_size, self.min_count)
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in sizes):
            raise InvalidRequest("max_pattern_size, min_pattern_size and min_count must be "
                                 "integers", "repetition_detection")
        # (vLLM's rules, in its words)
        if self.max_pattern_size < 0 or not 0 <= self.min_pattern_size <= self.max_pattern_size:
            raise InvalidRequest("max_pattern_size, min_pattern_size must be >=0, with "
                                 "min_pattern_size <= max_pattern_size. Set both to 0 to "
                                 "disable repetitive pattern detection.", "repetition_detection")
        if self.max_pattern_size > 0 and self.min_count < 2:
            raise InvalidRequest("min_count must be >= 2 to detect repetitive patterns in "
                                 "engine output. If you do not wish to detect repetitive "
                                 "patterns, set max_pattern_size to 0.", "repetition_detection")

    def found(self, tokens: Sequence[int], start: int) -> bool:
        """Whether ``tokens[start:]`` (a sample's output) ends in such a repetition. A
        pattern of p tokens repeated c times means each of the last p(c - 1) tokens equals
        the one p before it. Each step reads back from the end only while that holds, so a
        step costs one comparison for each pattern size whose run breaks at once."""
        count = self.min_count
        end = len(tokens)
        last = tokens[-1] if end > start else None
        for size in range(max(1, self.min_pattern_size), self.max_pattern_size + 1):
            if size * count > end - start:
                return False
            if tokens[end - 1 - size] != last:  # (the common case: no run at all)
                continue
            if all(tokens[i] == tokens[i - size]
                   for i in range(end - 2, end - 1 - size * (count - 1), -1)):
                return True
        return False


RepetitionDetectionParams = RepetitionDetection  # vLLM's name

