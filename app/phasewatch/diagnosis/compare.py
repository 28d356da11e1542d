"""One comparison of a figure between the window and the baseline: did it rise, materially and
significantly?

A figure "rises" when either
- its centre (median, or mean for workload figures) rose by at least the threshold ratio
  (material) and the rise is significant (median: one-sided Mann-Whitney p < alpha; mean:
  fewer than alpha of the bootstrap replicates show no rise), or
- its p95 rose so much that even the low end of the 95% bootstrap interval of the p95 ratio
  is past the threshold (a tail that moved while the middle did not).

`support` is the share of bootstrap replicates in which the centre ratio is past the threshold
(or, when the tail rule fired, the p95 ratio): how often data like these would show the same
material rise. The
diagnosis builds its confidence from it. Bootstrap replicates of quantiles are drawn exactly
(`statistics.quantile_replicates`) and those of means from their normal approximation, so a
thousand replicates cost milliseconds whatever the sample size.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from phasewatch.diagnosis.statistics import (
    Moments,
    interval,
    mann_whitney_greater,
    mean_replicates,
    quantile_replicates,
    rank_of,
    ratio,
    ratios,
)

Center = Literal["median", "mean"]


@dataclass(frozen=True, slots=True)
class Shift:
    """The evidence of one comparison, window against baseline."""

    center: Center
    threshold: float  # the ratio that counts as material
    n_window: int
    n_baseline: int
    window: float  # the centre (median or mean)
    baseline: float
    window_p95: float
    baseline_p95: float
    ratio: float  # window centre / baseline centre
    ratio_ci: tuple[float, float]  # 95% bootstrap interval
    ratio_p95: float
    ratio_p95_ci: tuple[float, float]
    p_value: float  # one-sided, window larger
    effect: float  # P(window value > baseline value), 0.5 = none
    material: bool
    significant: bool
    tail: bool  # the p95 rose past the threshold, with the whole interval
    support: float  # share of replicates with a material rise

    @property
    def rising(self) -> bool:
        return (self.material and self.significant) or self.tail

    def evidence(self, unit: str = "s") -> dict[str, Any]:
        """JSON-ready figures (no NaN or infinity)."""
        return {
            "rising": self.rising,
            "material": self.material,
            "significant": self.significant,
            "tail_rising": self.tail,
            "threshold_ratio": self.threshold,
            "center": self.center,
            "unit": unit,
            "window": {"n": self.n_window, self.center: finite(self.window),
                       "p95": finite(self.window_p95)},
            "baseline": {"n": self.n_baseline, self.center: finite(self.baseline),
                         "p95": finite(self.baseline_p95)},
            "ratio": finite(self.ratio),
            "ratio_ci95": [finite(self.ratio_ci[0]), finite(self.ratio_ci[1])],
            "ratio_p95": finite(self.ratio_p95),
            "ratio_p95_ci95": [finite(self.ratio_p95_ci[0]), finite(self.ratio_p95_ci[1])],
            "p_value": round(self.p_value, 6),
            "effect_size": round(self.effect, 4),
            "support": round(self.support, 4),
        }


def finite(value: float) -> float | None:
    """A float fit for JSON: rounded to 6 significant digits; None for NaN or infinity."""
    if math.isnan(value) or math.isinf(value):
        return None
    return float(f"{value:.6g}")


def compare(
    window: Sequence[float],
    baseline: Sequence[float],
    *,
    threshold: float,
    alpha: float,
    rng: np.random.Generator,
    rounds: int,
    center: Center = "median",
    tail: bool = True,
) -> Shift | None:
    """Compare two samples of a positive figure; None when either is empty. `tail=False`
    judges the centre only (for a figure whose cause moves every value, not a few)."""
    if not len(window) or not len(baseline):
        return None
    w = np.sort(np.asarray(window, dtype=np.float64))
    b = np.sort(np.asarray(baseline, dtype=np.float64))
    nw, nb = w.size, b.size
    w95, b95 = float(w[rank_of(0.95, nw) - 1]), float(b[rank_of(0.95, nb) - 1])
    if center == "median":
        wc, bc = float(w[rank_of(0.5, nw) - 1]), float(b[rank_of(0.5, nb) - 1])
    else:
        wc, bc = float(w.mean()), float(b.mean())
    test = mann_whitney_greater(w, b)

    ranks_w = (rank_of(0.5, nw), rank_of(0.95, nw))
    ranks_b = (rank_of(0.5, nb), rank_of(0.95, nb))
    w50, w95r = quantile_replicates(w, ranks_w, rounds, rng)
    b50, b95r = quantile_replicates(b, ranks_b, rounds, rng)
    if center == "mean":
        centers = ratios(mean_replicates(Moments.of(w), rounds, rng),
                         mean_replicates(Moments.of(b), rounds, rng))
    else:
        centers = ratios(w50, b50)
    tails = ratios(w95r, b95r)
    ratio_ci = interval(centers)
    ratio_p95_ci = interval(tails)
    point = ratio(wc, bc)
    if center == "median":
        p_value = test.p_value
    else:
        # Bootstrap one-sided p-value: the share of replicates that show no rise.
        p_value = float(np.mean(centers <= 1.0))
    tail = tail and center == "median" and ratio_p95_ci[0] >= threshold
    support = float(np.mean(centers >= threshold))
    if tail:
        support = max(support, float(np.mean(tails >= threshold)))
    return Shift(
        center=center,
        threshold=threshold,
        n_window=nw,
        n_baseline=nb,
        window=wc,
        baseline=bc,
        window_p95=w95,
        baseline_p95=b95,
        ratio=point,
        ratio_ci=ratio_ci,
        ratio_p95=ratio(w95, b95),
        ratio_p95_ci=ratio_p95_ci,
        p_value=p_value,
        effect=test.effect,
        material=point >= threshold,
        significant=p_value < alpha,
        tail=tail,
        support=support,
    )
