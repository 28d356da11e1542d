"""Percentiles, one definition for every figure phasewatch reports: nearest rank.

The p-th percentile of n sorted values is the value at rank ceil(p * n): always an observed
value, never an interpolation between two.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def percentile(ordered: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile of already sorted values, `q` in [0, 1]; None when empty."""
    if not ordered:
        return None
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def percentiles(values: Sequence[float], qs: Sequence[float]) -> list[float | None]:
    ordered = sorted(values)
    return [percentile(ordered, q) for q in qs]
