"""Small, exact-enough statistics in plain Python: rank tests, correlation, rates, bootstrap.

Every test here is one-sided, asking "is the first sample larger?", because the diagnosis only
asks whether something rose. p-values use the normal approximation, which is good to a few
percent of the p-value from about eight values a side; the diagnosis refuses to judge below its
minimum sample size (20 by default) anyway. No numpy or scipy: sizes are thousands at most.

Pure functions of their arguments; randomness comes from a `random.Random` the caller seeds,
so the same data always gives the same answer.

The hottest loops (`average_ranks`, the beta draws', the bootstrap's per quantile rank) run in
C (`_stats.c`) where that is built, giving to the bit what the Python here gives
(`average_ranks_py`, `beta_draws_py`, `quantile_replicates_py`: the references the tests hold
it to, and what runs where it is not built).
"""

from __future__ import annotations

import math
import random
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib import import_module
from itertools import compress, islice
from operator import eq, mul
from types import ModuleType

_LOG_4 = math.log(4.0)
_ONE_PLUS_LOG_5 = 1.0 + math.log(5.0)
_EXP_MAX = math.log(sys.float_info.max)


def normal_sf(z: float) -> float:
    """P(Z > z) for a standard normal Z."""
    return 0.5 * math.erfc(z / math.sqrt(2.0))


_stats: ModuleType | None
try:
    _stats = import_module("phasewatch.diagnosis._stats")
except ImportError:  # not built here: the Python below
    _stats = None


def average_ranks(values: Sequence[float]) -> tuple[list[float], list[int]]:
    """1-based ranks, ties given their average rank; and the size of each group of ties (in
    the order of their values). In C where built (`average_ranks_py` otherwise, and for values
    a double does not hold exactly)."""
    if _stats is not None:
        ranked: tuple[list[float], list[int]] | None = _stats.average_ranks(values)
        if ranked is not None:
            return ranked
    return average_ranks_py(values)


def average_ranks_py(values: Sequence[float]) -> tuple[list[float], list[int]]:
    """`average_ranks` in Python.

    One sort in C; the ranks by sorted position, where only tied positions (found in C) take
    a Python step each; then one pass placing each rank at its value's index. This runs a
    dozen times per diagnosis round on up to twice `diagnosis_max_samples` values, some of
    them integers full of ties (requests in flight, prompt tokens)."""
    n = len(values)
    order = sorted(range(n), key=values.__getitem__)
    ordered = [values[i] for i in order]
    by_position = list(map(float, range(1, n + 1)))
    # Sorted positions p with ordered[p] == ordered[p + 1]: a run of them is one tie group.
    same = list(compress(range(n - 1), map(eq, ordered, islice(ordered, 1, None))))
    ties: list[int] = []
    k, m = 0, len(same)
    while k < m:
        first = last = same[k]  # the group spans positions first .. last + 1
        k += 1
        while k < m and same[k] == last + 1:
            last += 1
            k += 1
        size = last - first + 2
        by_position[first:last + 2] = [(first + last + 3) / 2.0] * size  # ranks' average
        ties.append(size)
    ranks = [0.0] * n
    for rank, i in zip(by_position, order, strict=True):
        ranks[i] = rank
    return ranks, ties


@dataclass(frozen=True, slots=True)
class RankTest:
    """Mann-Whitney U of x against y, one-sided (x tends to be larger)."""

    u: float  # pairs (x_i, y_j) with x_i > y_j, ties counted one half
    z: float
    p_value: float
    # Probability of superiority P(X > Y) + P(X = Y)/2 (Vargha-Delaney A): 0.5 is no effect,
    # 0.64 a medium one, 0.71 a large one.
    effect: float


def mann_whitney_greater(x: Sequence[float], y: Sequence[float]) -> RankTest:
    """Mann-Whitney U test that x is stochastically larger than y (normal approximation with
    tie and continuity corrections). Identical values everywhere give p = 1."""
    n1, n2 = len(x), len(y)
    if n1 == 0 or n2 == 0:
        return RankTest(0.0, 0.0, 1.0, 0.5)
    ranks, ties = average_ranks([*x, *y])
    u = sum(ranks[:n1]) - n1 * (n1 + 1) / 2.0
    n = n1 + n2
    tie_term = sum(t**3 - t for t in ties) / (n * (n - 1)) if n > 1 else 0.0
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
    """Spearman's rho (Pearson on average ranks); None below 5 pairs or with no variation."""
    n = len(x)
    if n != len(y) or n < 5:
        return None
    rx, _ = average_ranks(x)
    ry, _ = average_ranks(y)
    mean = (n + 1) / 2.0
    # Deviations from the mean rank, and their products summed in C (the same floats, added
    # in the same order, as a generator over the pairs would add them).
    dx = [a - mean for a in rx]
    dy = [b - mean for b in ry]
    sxy = sum(map(mul, dx, dy))
    sxx = sum(map(mul, dx, dx))
    syy = sum(map(mul, dy, dy))
    if sxx <= 0 or syy <= 0:
        return None
    rho = max(-1.0, min(1.0, sxy / math.sqrt(sxx * syy)))
    # Under independence rho * sqrt(n - 1) is about standard normal.
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
    n1 is binomial with p = t1 / (t1 + t2) when the rates are equal."""
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


def rank_of(q: float, n: int) -> int:
    """The 1-based nearest rank of quantile q among n values."""
    return max(1, math.ceil(q * n))


def beta_draws(a: float, b: float, k: int, rng: random.Random) -> list[float]:
    """k draws from Beta(a, b), as `beta_draws_py` draws them; Cheng's loop in C where built."""
    lo, hi = (a, b) if a <= b else (b, a)
    if _stats is None or lo <= 1.0:
        return beta_draws_py(a, b, k, rng)
    draws: list[float] = _stats.cheng_bb(lo, hi, a == lo, k, rng.random)
    return draws


def beta_draws_py(a: float, b: float, k: int, rng: random.Random) -> list[float]:
    """k draws from Beta(a, b): Cheng's algorithm BB (Communications of the ACM 21(4), 1978)
    when both shapes exceed 1, as R's `rbeta` draws, and `random.betavariate` otherwise.

    Exact, like `betavariate` (which divides two gamma draws), at half its cost or less: two
    uniforms, a log and an exp per try, and 81-99% of draws accepted at the first try for
    shapes from (1.01, 1.01) to (2, 50) and (1000, 1000). The bootstrap makes thousands of
    these draws per diagnosis round, in a thread that shares the GIL with the relay, so the
    shapes' constants are worked out once for all k.
    """
    lo, hi = (a, b) if a <= b else (b, a)
    if lo <= 1.0:
        return [rng.betavariate(a, b) for _ in range(k)]
    total = lo + hi
    spread = math.sqrt((total - 2.0) / (2.0 * lo * hi - total))
    shift = lo + 1.0 / spread
    lo_first = a == lo
    uniform, log, exp = rng.random, math.log, math.exp
    out: list[float] = []
    for _ in range(k):
        while True:
            u1 = uniform()
            if u1 <= 0.0:  # log(0): draw again (once in 2**53)
                continue
            z = u1 * u1 * uniform()
            v = spread * log(u1 / (1.0 - u1))
            w = lo * exp(v) if v <= _EXP_MAX else sys.float_info.max
            r = shift * v - _LOG_4
            s = lo + r - w
            if s + _ONE_PLUS_LOG_5 >= 5.0 * z or z <= 0.0:  # z = 0: log(z) is -inf < s
                break
            t = log(z)
            if s > t or r + total * log(total / (hi + w)) >= t:
                break
        out.append(w / (hi + w) if lo_first else hi / (hi + w))
    return out


def quantile_replicates(
    ordered: Sequence[float], ranks: Sequence[int], k: int, rng: random.Random
) -> list[list[float]]:
    """k bootstrap replicates of several nearest-rank quantiles of sorted `ordered`, drawn
    exactly, without building the resamples: one list of k values per rank, the i-th of each
    list from the same resample.

    Resampling draws n indices uniformly, so the value at rank r of the resample is
    ordered[ceil(n * U_(r)) - 1], where U_(r) is the r-th smallest of n uniforms:
    Beta(r, n - r + 1). Given U_(s) = v (s < r), (U_(r) - v) / (1 - v) is Beta(r - s, n - r + 1),
    so increasing ranks are drawn jointly, as one resample would give them. The cost is one
    beta draw per quantile instead of n draws and a sort.
    """
    return _replicates(ordered, ranks, k, rng, _replicate_ranks)


def quantile_replicates_py(
    ordered: Sequence[float], ranks: Sequence[int], k: int, rng: random.Random
) -> list[list[float]]:
    """`quantile_replicates` with its step per rank in Python."""
    return _replicates(ordered, ranks, k, rng, _replicate_ranks_py)


Step = Callable[[Sequence[float], list[float], list[float] | None],
                tuple[list[float], list[float]]]


def _replicates(ordered: Sequence[float], ranks: Sequence[int], k: int, rng: random.Random,
                step: Step) -> list[list[float]]:
    n = len(ordered)
    out: list[list[float]] = []
    u, previous = [0.0] * k, 0
    for r in ranks:
        draws = None
        if r > previous:
            draws = beta_draws(r - previous, n - r + 1, k, rng)
            previous = r
        u, picked = step(ordered, u, draws)
        out.append(picked)
    return out


def _replicate_ranks_py(ordered: Sequence[float], u: list[float],
                        draws: list[float] | None) -> tuple[list[float], list[float]]:
    """One rank's step: with `draws`, each replicate's order statistic moves on to the next
    rank of the same resample (u + (1 - u) * draw); the value of `ordered` each falls on."""
    n = len(ordered)
    if draws is not None:
        u = [x + (1.0 - x) * d for x, d in zip(u, draws, strict=True)]
    return u, [ordered[min(n, max(1, math.ceil(n * x))) - 1] for x in u]


_replicate_ranks: Step = _replicate_ranks_py if _stats is None else _stats.replicate_ranks


@dataclass(frozen=True, slots=True)
class Moments:
    """Mean and standard deviation (population form, as the bootstrap sees the sample)."""

    n: int
    mean: float
    sd: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Moments:
        n = len(values)
        mean = math.fsum(values) / n
        return cls(n, mean, math.sqrt(max(0.0, math.fsum((v - mean) ** 2 for v in values) / n)))


def mean_replicates(moments: Moments, k: int, rng: random.Random) -> list[float]:
    """k bootstrap replicates of a sample mean, from its normal approximation: the mean of n
    draws with replacement has the sample's mean and sd / sqrt(n) (central limit theorem).
    Resampling would cost n draws per replicate; this costs one."""
    mean, sd = moments.mean, moments.sd / math.sqrt(moments.n)
    return [rng.gauss(mean, sd) for _ in range(k)]


def interval(values: Sequence[float], level: float = 0.95) -> tuple[float, float]:
    """Percentile interval of bootstrap replicates: the central `level` share."""
    ordered = sorted(values)
    n = len(ordered)
    tail = (1 - level) / 2
    # Nearest rank; the epsilon keeps 0.025 * 1000 at rank 25 despite binary fractions.
    low = ordered[max(0, math.ceil(tail * n - 1e-9) - 1)]
    high = ordered[max(0, math.ceil((1 - tail) * n - 1e-9) - 1)]
    return low, high
