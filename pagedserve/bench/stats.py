"""Summary statistics shared by the benchmark reports."""

from __future__ import annotations

import math
from collections.abc import Sequence


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between closest ranks
    (numpy's default); nan for no values."""
    if not values:
        return math.nan
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    lo = math.floor(rank)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (rank - lo)


def summarize(values: Sequence[float], scale: float = 1.0) -> dict[str, float | None]:
    """mean, median, p90, p99 of ``values * scale`` (scale=1000: seconds to ms); None for
    no values, so the JSON stays valid (no NaN)."""
    if not values:
        return {"mean": None, "median": None, "p90": None, "p99": None}
    scaled = [v * scale for v in values]
    return {
        "mean": sum(scaled) / len(scaled),
        "median": percentile(scaled, 50),
        "p90": percentile(scaled, 90),
        "p99": percentile(scaled, 99),
    }


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or not denominator:
        return None
    return numerator / denominator
