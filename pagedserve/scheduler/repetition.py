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
        the one p before it. Each size's run is read back from the end while it holds: in
        the common case one comparison a size. An output made of long near-repeats (which a
        grammar can force) would make that quadratic in the output a step (0.8 s at 16k
        tokens), so past a budget of comparisons the runs are read in one linear pass."""
        count, end = self.min_count, len(tokens)
        if not self.max_pattern_size:  # off
            return False
        lo, hi = max(1, self.min_pattern_size), min(self.max_pattern_size, (end - start) // count)
        if hi < lo:
            return False
        last, budget = tokens[-1], RUN_BUDGET_PER_SIZE * (hi - lo + 1)
        for size in range(lo, hi + 1):
            if tokens[end - 1 - size] != last:  # (the common case: no run at all)
                continue
            i, stop = end - 2, end - 1 - size * (count - 1)
            while i > stop and tokens[i] == tokens[i - size]:
                i -= 1
            if i == stop:
                return True
            budget -= end - 1 - i
            if budget < 0:
                return _found_in_one_pass(tokens[end - hi * count:], lo, hi, count)
        return False


# Comparisons a check may spend a pattern size before it reads every run in one pass.
RUN_BUDGET_PER_SIZE = 4


def _found_in_one_pass(window: Sequence[int], lo: int, hi: int, count: int) -> bool:
    """The same answer in O(len(window)): read backwards, the output's run for size p is the
    longest common prefix of the reversed window and itself shifted by p, which the
    Z-function gives for every p at once."""
    text = window[::-1]
    n = len(text)
    z, left, right = [0] * n, 0, 0
    for i in range(1, n):
        k = min(right - i, z[i - left]) if i < right else 0
        while i + k < n and text[k] == text[i + k]:
            k += 1
        z[i] = k
        if i + k > right:
            left, right = i, i + k
    return any(z[size] >= size * (count - 1) for size in range(lo, hi + 1))


RepetitionDetectionParams = RepetitionDetection  # vLLM's name
