"""The diagnosis's statistics against scipy.stats (the reference, a test dependency only) and
against brute force: counted pairs, exact permutation p-values, resampling by hand."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from scipy import stats as sp

from phasewatch.diagnosis.statistics import (
    Moments,
    average_ranks,
    binomial_greater,
    interval,
    mann_whitney_greater,
    mean_replicates,
    quantile_replicates,
    rank_of,
    rate_ratio_greater,
    ratio,
    ratios,
    spearman,
    two_proportions_greater,
)


def samples(seed: int, n: int, ties: bool) -> np.ndarray:
    """Continuous values, or small integers full of ties (requests in flight, prompt tokens)."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, 30, n).astype(float) if ties else rng.lognormal(0, 1, n)


def pairs_u(x: list[float], y: list[float]) -> float:
    return sum(1.0 if a > b else 0.5 if a == b else 0.0 for a in x for b in y)


@pytest.mark.parametrize("seed", range(6))
def test_average_ranks_are_scipys(seed: int) -> None:
    values = samples(seed, 500, ties=seed % 2 == 1)
    ranks, ties = average_ranks(values)
    np.testing.assert_array_equal(ranks, sp.rankdata(values, method="average"))
    _, counts = np.unique(values, return_counts=True)
    np.testing.assert_array_equal(ties, counts[counts > 1])


def test_average_ranks_share_ties() -> None:
    ranks, ties = average_ranks([3.0, 1.0, 3.0, 2.0, 3.0])
    assert ranks.tolist() == [4.0, 1.0, 4.0, 2.0, 4.0] and ties.tolist() == [3]
    ranks, ties = average_ranks([])
    assert ranks.size == 0 and ties.size == 0


@pytest.mark.parametrize(("seed", "ties"), [(s, t) for s in range(4) for t in (False, True)])
@pytest.mark.parametrize("sizes", [(20, 20), (300, 3000), (8, 40)])
def test_mann_whitney_is_scipys_asymptotic_test(seed: int, ties: bool,
                                                sizes: tuple[int, int]) -> None:
    x = samples(seed, sizes[0], ties) * 1.1
    y = samples(seed + 100, sizes[1], ties)
    ours = mann_whitney_greater(x, y)
    theirs = sp.mannwhitneyu(x, y, alternative="greater", method="asymptotic",
                             use_continuity=True)
    assert ours.u == pytest.approx(theirs.statistic, rel=1e-12)
    assert ours.p_value == pytest.approx(theirs.pvalue, rel=1e-9, abs=1e-15)
    assert ours.effect == pytest.approx(theirs.statistic / (sizes[0] * sizes[1]))


@pytest.mark.parametrize("seed", range(3))
def test_u_counts_the_pairs_and_p_matches_the_permutation_test(seed: int) -> None:
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 13, 7).astype(float).tolist()  # ties on purpose
    y = rng.integers(0, 10, 6).astype(float).tolist()
    test = mann_whitney_greater(x, y)
    assert test.u == pairs_u(x, y)
    pooled = x + y
    at_least = total = 0
    for chosen in itertools.combinations(range(13), 7):
        xs = [pooled[i] for i in chosen]
        ys = [pooled[i] for i in range(13) if i not in chosen]
        total += 1
        at_least += pairs_u(xs, ys) >= test.u
    assert test.p_value == pytest.approx(at_least / total, abs=0.03)


def test_identical_values_give_no_evidence() -> None:
    test = mann_whitney_greater([5.0] * 30, [5.0] * 30)
    assert test.p_value == 1.0 and test.effect == 0.5
    assert mann_whitney_greater([], [1.0]).p_value == 1.0


@pytest.mark.parametrize(("seed", "ties"), [(s, t) for s in range(4) for t in (False, True)])
def test_spearman_rho_is_scipys(seed: int, ties: bool) -> None:
    x = samples(seed, 200, ties)
    y = x + samples(seed + 7, 200, ties) * 3
    ours = spearman(x.tolist(), y.tolist())
    theirs = sp.spearmanr(x, y)
    assert ours is not None and ours.rho == pytest.approx(theirs.statistic, rel=1e-12)
    # The p-value's approximation: rho * sqrt(n - 1) standard normal under independence.
    assert ours.p_value == pytest.approx(sp.norm.sf(ours.rho * math.sqrt(199)), rel=1e-9)
    # ... within a little of scipy's t-based one-sided p-value where it matters (small p).
    one_sided = sp.spearmanr(x, y, alternative="greater").pvalue
    assert (ours.p_value < 0.01) == (one_sided < 0.01)


def test_spearman_edges() -> None:
    x = [float(i) for i in range(30)]
    backwards = spearman(x, [-v for v in x])
    assert backwards is not None and backwards.rho == pytest.approx(-1.0)
    assert backwards.p_value > 0.99
    assert spearman(x, [1.0] * 30) is None  # no variation
    assert spearman(x[:4], x[:4]) is None  # too few pairs


@pytest.mark.parametrize(("k1", "n1", "k2", "n2"), [(30, 50, 2, 50), (12, 400, 5, 380),
                                                    (90, 1000, 70, 1000)])
def test_two_proportions_is_the_chi_square_test_halved(k1: int, n1: int, k2: int,
                                                       n2: int) -> None:
    """The pooled z-test is the 2x2 chi-square test without correction: z**2 = chi2, so the
    one-sided p-value is half the two-sided one when the first proportion is larger."""
    table = [[k1, n1 - k1], [k2, n2 - k2]]
    chi2 = sp.chi2_contingency(table, correction=False)
    assert two_proportions_greater(k1, n1, k2, n2) == pytest.approx(chi2.pvalue / 2,
                                                                    rel=1e-9)


def test_proportion_edges() -> None:
    assert two_proportions_greater(2, 50, 2, 50) == pytest.approx(0.5)
    assert two_proportions_greater(0, 50, 0, 50) == 1.0
    assert two_proportions_greater(1, 0, 0, 5) == 1.0


@pytest.mark.parametrize(("k", "n", "p"), [(1, 1, 0.5), (3, 10, 0.1), (40, 100, 0.3),
                                           (900, 1000, 0.88), (0, 5, 0.5), (6, 5, 0.5)])
def test_binomial_tail_is_scipys(k: int, n: int, p: float) -> None:
    assert binomial_greater(k, n, p) == pytest.approx(sp.binom.sf(k - 1, n, p), rel=1e-9)


@pytest.mark.parametrize(("n1", "t1", "n2", "t2"), [(200, 10, 100, 10), (120, 60, 100, 60),
                                                    (55, 5, 400, 50), (30, 10, 90, 20)])
def test_rate_ratio_is_near_the_exact_conditional_test(n1: int, t1: float, n2: int,
                                                       t2: float) -> None:
    """The normal approximation of the exact conditional (binomial) test of equal rates."""
    exact = sp.binomtest(n1, n1 + n2, t1 / (t1 + t2), alternative="greater").pvalue
    ours = rate_ratio_greater(n1, t1, n2, t2)
    assert ours == pytest.approx(exact, abs=0.01)


def test_rate_edges() -> None:
    assert rate_ratio_greater(0, 10, 0, 10) == 1.0
    assert rate_ratio_greater(3, 0, 1, 10) == 1.0


def test_ratio_by_element_is_ratio() -> None:
    num = np.array([1.0, 0.0, 2.0, 0.0, 3.0])
    den = np.array([2.0, 0.0, 0.0, 4.0, -1.0])
    assert ratios(num, den).tolist() == [ratio(a, b) for a, b in zip(num, den, strict=True)]


def test_quantile_replicates_match_resampling() -> None:
    """Drawn through order statistics, they have the distribution that resampling by hand
    gives (two-sample Kolmogorov-Smirnov, scipy), and a replicate's ranks come from one
    resample (its p95 is never below its median)."""
    rng = np.random.default_rng(3)
    values = np.sort(rng.lognormal(0, 1, 41))
    ranks = (rank_of(0.5, 41), rank_of(0.95, 41))
    median, p95 = quantile_replicates(values, ranks, 20000, rng)
    resamples = np.sort(rng.choice(values, size=(20000, 41)), axis=1)
    for drawn, rank in ((median, ranks[0]), (p95, ranks[1])):
        assert sp.ks_2samp(drawn, resamples[:, rank - 1]).pvalue > 0.001
    assert bool(np.all(median <= p95))


def test_one_value_and_equal_ranks() -> None:
    rng = np.random.default_rng(0)
    drawn = quantile_replicates(np.array([2.5]), (1, 1), 3, rng)
    assert [d.tolist() for d in drawn] == [[2.5] * 3, [2.5] * 3]


def test_mean_replicates_match_the_bootstrap_of_the_mean() -> None:
    """The normal approximation against scipy.stats.bootstrap's interval for the mean."""
    rng = np.random.default_rng(0)
    values = rng.lognormal(0, 0.5, 400)
    draws = mean_replicates(Moments.of(values), 20000, rng)
    low, high = interval(draws)
    reference = sp.bootstrap((values,), np.mean, n_resamples=5000, method="percentile",
                             random_state=np.random.default_rng(1)).confidence_interval
    assert low == pytest.approx(reference.low, rel=0.01)
    assert high == pytest.approx(reference.high, rel=0.01)
    assert Moments.of(np.array([7.0])).sd == 0.0


def test_interval_is_the_nearest_rank_percentile() -> None:
    values = np.arange(1.0, 1001.0)
    assert interval(values) == (25.0, 975.0)
    rng = np.random.default_rng(5)
    shuffled = rng.permutation(values)
    assert interval(shuffled, 0.9) == tuple(
        sp.scoreatpercentile(values, [5, 95], interpolation_method="lower"))
    assert interval(np.array([1.0])) == (1.0, 1.0)
