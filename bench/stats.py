"""Summary statistics of measured runs: median and median absolute deviation, never a best-of.

    summarize([10.0, 12.0, 11.0, 50.0])
    # {'n': 4, 'median': 11.5, 'mad': 1.0, 'min': 10.0, 'max': 50.0}

The MAD is the raw median of |x - median| (no 1.4826 normal-consistency factor), in the unit of
the data, so "11.5 ± 1.0 tok/s" reads directly.
"""

from __future__ import annotations

import math
from typing import Sequence


def median(values: Sequence[float]) -> float:
    """The middle value; the mean of the two middle values for an even count."""
    if not values:
        raise ValueError("median of no values")
    ordered = sorted(float(v) for v in values)
    mid = len(ordered) // 2
    if len(ordered) % 2:
        return ordered[mid]
    return (ordered[mid - 1] + ordered[mid]) / 2


def mad(values: Sequence[float]) -> float:
    """Median absolute deviation from the median."""
    center = median(values)
    return median([abs(float(v) - center) for v in values])


def summarize(values: Sequence[float]) -> dict:
    """n, median, MAD, min and max of `values` (which must all be finite)."""
    values = [float(v) for v in values]
    if not values:
        raise ValueError("no measured runs to summarize")
    if not all(math.isfinite(v) for v in values):
        raise ValueError(f"non-finite measurement in {values}")
    return {"n": len(values), "median": median(values), "mad": mad(values),
            "min": min(values), "max": max(values)}


def rate(count: float, seconds: float) -> float:
    """count / seconds, refusing a zero or negative duration (a clock or harness bug)."""
    if seconds <= 0:
        raise ValueError(f"non-positive duration {seconds!r} for {count} units")
    return count / seconds
