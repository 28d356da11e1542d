"""The statistics, checked against brute force: counted pairs, exact permutation p-values,
resampling by hand."""

from __future__ import annotations

import itertools
import math
import random
import statistics

import pytest

from phasewatch.diagnosis import statistics as stats_module
from phasewatch.diagnosis.statistics import (
    Moments,
    average_ranks,
    beta_draws,
    interval,
    mann_whitney_greater,
    mean_replicates,
    quantile_replicates,
    rank_of,
    rate_ratio_greater,
    spearman,
    two_proportions_greater,
)


def pairs_u(x: list[float], y: list[float]) -> float:
    return sum(1.0 if a > b else 0.5 if a == b else 0.0 for a in x for b in y)


def test_average_ranks_share_ties() -> None:
    ranks, ties = average_ranks([3.0, 1.0, 3.0, 2.0, 3.0])
    assert ranks == [4.0, 1.0, 4.0, 2.0, 4.0]
    assert ties == [3]


@pytest.mark.parametrize("seed", range(4))
def test_average_ranks_match_counting(seed: int) -> None:
    """A value's average rank is 1 + (values below it) + (its other copies) / 2."""
    rng = random.Random(seed)
    values = [float(rng.randint(0, 30)) for _ in range(60)] if seed % 2 else [
        rng.random() for _ in range(60)]
    ranks, ties = average_ranks(values)
    for v, r in zip(values, ranks, strict=True):
        below = sum(1 for x in values if x < v)
        assert r == 1 + below + (values.count(v) - 1) / 2
    assert sorted(ties) == sorted(c for c in map(values.count, set(values)) if c > 1)


@pytest.mark.parametrize("seed", range(5))
def test_u_counts_the_pairs_and_p_matches_the_permutation_test(seed: int) -> None:
    rng = random.Random(seed)
    x = [float(rng.randint(0, 12)) for _ in range(7)]  # ties on purpose
    y = [float(rng.randint(0, 9)) for _ in range(6)]
    test = mann_whitney_greater(x, y)
    assert test.u == pairs_u(x, y)
    assert test.effect == pytest.approx(test.u / 42)
    # Exact one-sided p-value: the share of relabellings with a U at least as large.
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


def test_a_clear_shift_is_significant_one_way_only() -> None:
    low = [1.0 + i / 100 for i in range(30)]
    high = [2.0 + i / 100 for i in range(30)]
    assert mann_whitney_greater(high, low).p_value < 1e-9
    assert mann_whitney_greater(low, high).p_value > 0.999


def test_spearman() -> None:
    x = [float(i) for i in range(30)]
    result = spearman(x, [v**3 for v in x])  # monotone: rho 1
    assert result is not None and result.rho == pytest.approx(1.0) and result.p_value < 1e-6
    backwards = spearman(x, [-v for v in x])
    assert backwards is not None and backwards.rho == pytest.approx(-1.0)
    assert backwards.p_value > 0.99
    assert spearman(x, [1.0] * 30) is None  # no variation
    assert spearman(x[:4], x[:4]) is None  # too few pairs


def test_proportions_and_rates() -> None:
    assert two_proportions_greater(30, 50, 2, 50) < 1e-6
    assert two_proportions_greater(2, 50, 2, 50) == pytest.approx(0.5)
    assert two_proportions_greater(0, 50, 0, 50) == 1.0
    assert two_proportions_greater(1, 0, 0, 5) == 1.0
    # 200 events in 10 s against 100 in 10 s: twice the rate, far beyond chance.
    assert rate_ratio_greater(200, 10, 100, 10) < 1e-6
    assert rate_ratio_greater(100, 10, 100, 10) > 0.4
    assert rate_ratio_greater(0, 10, 0, 10) == 1.0


def test_quantile_replicates_match_resampling() -> None:
    """Drawn through order statistics, they have the distribution resampling gives."""
    rng = random.Random(3)
    values = sorted(rng.lognormvariate(0, 1) for _ in range(41))
    ranks = (rank_of(0.5, 41), rank_of(0.95, 41))
    drawn = list(zip(*quantile_replicates(values, ranks, 20000, rng), strict=True))
    resampled = []
    for _ in range(20000):
        sample = sorted(rng.choices(values, k=41))
        resampled.append((sample[ranks[0] - 1], sample[ranks[1] - 1]))
    for k in (0, 1):
        a = statistics.quantiles([d[k] for d in drawn], n=10)
        b = statistics.quantiles([r[k] for r in resampled], n=10)
        for qa, qb in zip(a, b, strict=True):
            assert qa == pytest.approx(qb, rel=0.05)
    # Jointly drawn: a replicate's p95 is never below its median.
    assert all(m <= t for m, t in drawn)


def test_one_value_and_equal_ranks() -> None:
    rng = random.Random(0)
    assert quantile_replicates([2.5], (1, 1), 3, rng) == [[2.5] * 3, [2.5] * 3]


@pytest.mark.parametrize(("a", "b"), [(0.5, 3.0), (1.0, 1.0), (1.01, 1.01), (2.0, 50.0),
                                      (50.0, 2.0), (7.0, 7.0), (1000.0, 1001.0), (1900.0, 101.0)])
def test_beta_draws_have_the_beta_distribution(a: float, b: float) -> None:
    """Mean, variance and CDF at three points against Beta(a, b)'s, from 40,000 draws
    (Cheng's BB above shapes of 1, `betavariate` below)."""
    rng = random.Random(11)
    draws = beta_draws(a, b, 40000, rng)
    mean = a / (a + b)
    variance = a * b / ((a + b) ** 2 * (a + b + 1))
    assert all(0.0 <= d <= 1.0 for d in draws)
    assert statistics.fmean(draws) == pytest.approx(mean, abs=4 * math.sqrt(variance / 40000))
    assert statistics.pvariance(draws) == pytest.approx(variance, rel=0.05)
    # The CDF where Beta(a, b) has its quartiles, against betavariate's own draws.
    reference = sorted(rng.betavariate(a, b) for _ in range(40000))
    for q in (0.25, 0.5, 0.75):
        cut = reference[int(q * 40000)]
        share = sum(1 for d in draws if d <= cut) / 40000
        assert share == pytest.approx(q, abs=0.012)


def test_mean_replicates_centre_on_the_mean() -> None:
    rng = random.Random(0)
    values = [1.0, 2.0, 3.0, 10.0]
    moments = Moments.of(values)
    draws = mean_replicates(moments, 20000, rng)
    assert statistics.fmean(draws) == pytest.approx(4.0, abs=0.05)
    assert statistics.pstdev(draws) == pytest.approx(moments.sd / 2, rel=0.05)
    assert Moments.of([7.0]).sd == 0.0


def test_interval() -> None:
    values = [float(i) for i in range(1, 1001)]
    assert interval(values) == (25.0, 975.0)
    assert math.isclose(interval([1.0])[0], 1.0)


@pytest.mark.skipif(stats_module._stats is None, reason="the C loops are not built here")
@pytest.mark.parametrize("seed", range(6))
def test_the_c_ranks_are_the_python_ranks_to_the_bit(seed: int) -> None:
    """`average_ranks` (C) against `average_ranks_py`: floats, integers full of ties, both
    mixed, the sizes a round sees; values a double cannot hold exactly go to the Python."""
    rng = random.Random(seed)
    for n in (0, 1, 2, 3, 50, 3001):
        values: list[float] = [
            rng.choice((float(rng.randint(0, 9)), rng.randint(0, 9), rng.lognormvariate(0, 1)))
            for _ in range(n)]
        assert stats_module._stats.average_ranks(values) == \
            stats_module.average_ranks_py(values)
    assert stats_module._stats.average_ranks([1.0, float("nan")]) is None
    assert stats_module._stats.average_ranks([2**60, 1]) is None
    assert average_ranks([2**60, 1, 2**60]) == ([2.5, 1.0, 2.5], [2])  # by the Python


@pytest.mark.skipif(stats_module._stats is None, reason="the C loops are not built here")
@pytest.mark.parametrize(("a", "b"), [(1.01, 1.01), (2.0, 50.0), (50.0, 2.0), (7.0, 7.0),
                                      (1000.0, 1001.0), (1900.0, 101.0), (0.5, 3.0)])
def test_the_c_beta_draws_are_the_python_draws_to_the_bit(a: float, b: float) -> None:
    """The same draws from the same seed, every double equal, and the generator left in the
    same state (the bootstrap's next draws follow on)."""
    rng_c, rng_py = random.Random(3), random.Random(3)
    assert beta_draws(a, b, 5000, rng_c) == stats_module.beta_draws_py(a, b, 5000, rng_py)
    assert rng_c.random() == rng_py.random()


@pytest.mark.skipif(stats_module._stats is None, reason="the C loops are not built here")
@pytest.mark.parametrize("n", [1, 2, 7, 3000])
def test_the_c_bootstrap_is_the_python_bootstrap_to_the_bit(n: int) -> None:
    """`quantile_replicates` with its step in C against `quantile_replicates_py`: the same
    replicates of the same ranks (repeated ranks too) from the same seed, and the generator
    left in the same state."""
    rng = random.Random(n)
    ordered = sorted(rng.lognormvariate(0, 1) for _ in range(n))
    ranks = sorted({rank_of(q, n) for q in (0.5, 0.9, 0.95, 0.99)} | {rank_of(0.5, n)})
    ranks = [ranks[0], *ranks]  # a rank asked twice draws nothing the second time
    rng_c, rng_py = random.Random(9), random.Random(9)
    assert quantile_replicates(ordered, ranks, 2000, rng_c) == \
        stats_module.quantile_replicates_py(ordered, ranks, 2000, rng_py)
    assert rng_c.random() == rng_py.random()
