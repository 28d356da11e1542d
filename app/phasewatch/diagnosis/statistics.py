"""The diagnosis's statistics, on numpy: rank tests, correlation, rates, bootstrap.

Invariants:
- every test is one-sided, asking "is the first sample larger?": the diagnosis only asks
  whether something rose;
- p-values use the normal approximation (tie- and continuity-corrected for ranks), good to a
  few percent from about eight values a side; the diagnosis judges nothing below its minimum
  sample size (20 by default);
- pure functions of their arguments: randomness comes from a `numpy.random.Generator` the
  caller seeds, so the same data always gives the same answer;
- tests/diagnosis/test_statistics.py holds each one to scipy.stats.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

Floats = npt.NDArray[np.float64]


def normal_sf(z: float) -> float:
    """P(Z > z) for a standard normal Z."""
    return 0.5 * math.erfc(z / math.sqrt(2.0))


def average_ranks(values: Sequence[float] | Floats) -> tuple[Floats, npt.NDArray[np.int64]]:
    """1-based ranks, ties given their average rank (scipy's `rankdata(method="average")`);
    and the size of each group of two or more ties, in the order of their values."""
    a = np.asarray(values, dtype=np.float64)
    n = a.size
    order = np.argsort(a, kind="stable")
    ordered = a[order]
    # Where each group of equal values starts in sorted order, and where the last one ends.
    starts = np.flatnonzero(np.r_[True, ordered[1:] != ordered[:-1]])
    bounds = np.r_[starts, n]
    sizes = np.diff(bounds)
    # Positions starts .. starts + size - 1 (0-based) share the rank start + (size + 1) / 2.
    group_rank = starts + (sizes + 1) / 2.0
    ranks = np.empty(n, dtype=np.float64)
    ranks[order] = np.repeat(group_rank, sizes)
    return ranks, sizes[sizes > 1].astype(np.int64)


@dataclass(frozen=True, slots=True)
class RankTest:
    """Mann-Whitney U of x against y, one-sided (x tends to be larger)."""

    u: float  # pairs (x_i, y_j) with x_i > y_j, ties counted one half
    z: float
    p_value: float
    # Probability of superiority P(X > Y) + P(X = Y)/2 (Vargha-Delaney A): 0.5 is no effect,
    # 0.64 a medium one, 0.71 a large one.
    effect: float


def mann_whitney_greater(x: Sequence[float] | Floats, y: Sequence[float] | Floats) -> RankTest:
    """Mann-Whitney U test that x is stochastically larger than y (normal approximation with
    tie and continuity corrections: scipy's `mannwhitneyu(x, y, alternative="greater",
    method="asymptotic")`). Identical values everywhere give p = 1."""
    n1, n2 = len(x), len(y)
    if n1 == 0 or n2 == 0:
        return RankTest(0.0, 0.0, 1.0, 0.5)
    ranks, ties = average_ranks(np.concatenate([np.asarray(x, np.float64),
                                                np.asarray(y, np.float64)]))
    u = float(ranks[:n1].sum()) - n1 * (n1 + 1) / 2.0
    n = n1 + n2
    t = ties.astype(np.float64)
    tie_term = float((t**3 - t).sum()) / (n * (n - 1)) if n > 1 else 0.0
    variance = n1 * n2 / 12.0 * ((n + 1) - tie_term)
    mean = n1 * n2 / 2.0
    if variance <= 0:
        return RankTest(u, 0.0, 1.0, u / (n1 * n2))
    z = (u - mean - 0.5) / math.sqrt(variance)
    return RankTest(u, z, normal_sf(z), u / (n1 * n2))


@dataclass(frozen=True, slots=True)
class Correlation:
    """Spearman's rank correlation and its one-sided p-value for rho > 0."""

    rho: float
    p_value: float
    n: int


def spearman(x: Sequence[float], y: Sequence[float]) -> Correlation | None:
    """Spearman's rho (Pearson on average ranks: scipy's `spearmanr`); None below 5 pairs or
    with no variation. The p-value takes rho * sqrt(n - 1) as standard normal."""
    n = len(x)
    if n != len(y) or n < 5:
        return None
    rx, _ = average_ranks(x)
    ry, _ = average_ranks(y)
    dx = rx - (n + 1) / 2.0
    dy = ry - (n + 1) / 2.0
    sxx, syy = float(dx @ dx), float(dy @ dy)
    if sxx <= 0 or syy <= 0:
        return None
    rho = max(-1.0, min(1.0, float(dx @ dy) / math.sqrt(sxx * syy)))
    return Correlation(rho, normal_sf(rho * math.sqrt(n - 1)), n)


def two_proportions_greater(k1: int, n1: int, k2: int, n2: int) -> float:
    """One-sided p-value that proportion k1/n1 exceeds k2/n2 (pooled two-proportion z-test)."""
    if n1 == 0 or n2 == 0:
        return 1.0
    pooled = (k1 + k2) / (n1 + n2)
    variance = pooled * (1 - pooled) * (1 / n1 + 1 / n2)
    if variance <= 0:
        return 1.0
    return normal_sf((k1 / n1 - k2 / n2) / math.sqrt(variance))


def binomial_greater(k: int, n: int, p: float) -> float:
    """P(X >= k) for X ~ Binomial(n, p), exact (summed in log space)."""
    if k <= 0:
        return 1.0
    if k > n or p <= 0:
        return 0.0
    if p >= 1:
        return 1.0
    log_p, log_q = math.log(p), math.log1p(-p)
    terms = [math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1)
             + i * log_p + (n - i) * log_q for i in range(k, n + 1)]
    top = max(terms)
    return min(1.0, math.exp(top) * math.fsum(math.exp(t - top) for t in terms))


def rate_ratio_greater(n1: int, t1: float, n2: int, t2: float) -> float:
    """One-sided p-value that the Poisson rate n1/t1 exceeds n2/t2: given n1 + n2 events,
    n1 is binomial with p = t1 / (t1 + t2) when the rates are equal (normal approximation,
    continuity-corrected)."""
    total = n1 + n2
    if total == 0 or t1 <= 0 or t2 <= 0:
        return 1.0
    p = t1 / (t1 + t2)
    sd = math.sqrt(total * p * (1 - p))
    return normal_sf((n1 - total * p - 0.5) / sd) if sd > 0 else 1.0


def ratio(numerator: float, denominator: float) -> float:
    """numerator / denominator, with 0/0 = 1 (no change) and x/0 = inf."""
    if denominator > 0:
        return numerator / denominator
    return 1.0 if numerator <= 0 else math.inf


def ratios(numerators: Floats, denominators: Floats) -> Floats:
    """`ratio` element by element."""
    positive = denominators > 0
    quotient = np.divide(numerators, denominators, out=np.zeros_like(numerators),
                         where=positive)
    return np.where(positive, quotient, np.where(numerators <= 0, 1.0, np.inf))


def rank_of(q: float, n: int) -> int:
    """The 1-based nearest rank of quantile q among n values."""
    return max(1, math.ceil(q * n))


def quantile_replicates(
    ordered: Floats, ranks: Sequence[int], k: int, rng: np.random.Generator
) -> list[Floats]:
    """k bootstrap replicates of several nearest-rank quantiles of sorted `ordered`, drawn
    exactly without building the resamples: one array of k values per rank (increasing), the
    i-th of each from the same resample.

    Resampling draws n indices uniformly, so the value at rank r of the resample is
    ordered[ceil(n * U_(r)) - 1], where U_(r), the r-th smallest of n uniforms, is
    Beta(r, n - r + 1). Given U_(s) = v (s < r), (U_(r) - v) / (1 - v) is Beta(r - s, n - r + 1):
    increasing ranks are drawn jointly, as one resample gives them. One beta draw per quantile
    and replicate instead of n draws and a sort.
    """
    n = ordered.size
    out: list[Floats] = []
    u = np.zeros(k)
    previous = 0
    for r in ranks:
        if r > previous:
            u = u + (1.0 - u) * rng.beta(r - previous, n - r + 1, size=k)
            previous = r
        index = np.clip(np.ceil(n * u).astype(np.int64), 1, n) - 1
        out.append(ordered[index])
    return out


@dataclass(frozen=True, slots=True)
class Moments:
    """Mean and standard deviation (population form, as the bootstrap sees the sample)."""

    n: int
    mean: float
    sd: float

    @classmethod
    def of(cls, values: Floats) -> Moments:
        return cls(int(values.size), float(values.mean()), float(values.std()))


def mean_replicates(moments: Moments, k: int, rng: np.random.Generator) -> Floats:
    """k bootstrap replicates of a sample mean, from its normal approximation: the mean of n
    draws with replacement has the sample's mean and sd / sqrt(n) (central limit theorem).
    Resampling would cost n draws per replicate; this costs one."""
    return rng.normal(moments.mean, moments.sd / math.sqrt(moments.n), size=k)


def interval(values: Floats, level: float = 0.95) -> tuple[float, float]:
    """Percentile interval of bootstrap replicates, the central `level` share, by nearest rank
    (the epsilon keeps 0.025 * 1000 at rank 25 despite binary fractions)."""
    n = values.size
    tail = (1 - level) / 2
    low = max(0, math.ceil(tail * n - 1e-9) - 1)
    high = max(0, math.ceil((1 - tail) * n - 1e-9) - 1)
    picked = np.partition(values, (low, high))
    return float(picked[low]), float(picked[high])
