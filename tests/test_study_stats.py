"""Study statistics: Student-t quantiles, intervals over seeds, the paired items x seeds bootstrap."""
from __future__ import annotations

import math

import numpy as np
import pytest

from study.stats import paired_bootstrap, seed_interval, student_t_quantile

# Two-sided 95% and one-sided 95% critical values from a printed t table.
T_TABLE = [(1, 0.975, 12.706), (2, 0.975, 4.303), (3, 0.975, 3.182), (5, 0.975, 2.571), (10, 0.975, 2.228),
           (30, 0.975, 2.042), (2, 0.95, 2.920), (9, 0.95, 1.833), (120, 0.975, 1.980)]


@pytest.mark.parametrize("df,probability,expected", T_TABLE)
def test_student_t_quantiles_match_the_table(df, probability, expected):
    assert student_t_quantile(probability, df) == pytest.approx(expected, abs=6e-4)
    assert student_t_quantile(1 - probability, df) == pytest.approx(-expected, abs=6e-4)


def test_seed_interval_is_the_t_interval_of_the_mean():
    values = [61.0, 64.0, 70.0]
    interval = seed_interval(values)
    half = 4.302653 * np.std(values, ddof=1) / math.sqrt(3)
    assert interval.estimate == pytest.approx(65.0)
    assert (interval.low, interval.high) == pytest.approx((65.0 - half, 65.0 + half), rel=1e-6)
    single = seed_interval([3.0])
    assert single.estimate == 3.0 and math.isnan(single.low) and math.isnan(single.high)
    with pytest.raises(ValueError):
        seed_interval([])


def test_bootstrap_of_a_constant_difference_is_that_difference():
    rng = np.random.default_rng(0)
    reference = rng.random((3, 50))
    interval = paired_bootstrap(reference + 0.25, reference, resamples=200)
    assert (interval.estimate, interval.low, interval.high) == pytest.approx((0.25, 0.25, 0.25))


def test_bootstrap_resamples_items_and_seeds_jointly_as_a_slow_reference_does():
    rng = np.random.default_rng(1)
    method, reference = (rng.random((3, 40)) > 0.4).astype(float), (rng.random((3, 40)) > 0.5).astype(float)
    interval = paired_bootstrap(method, reference, resamples=300, seed=7)
    draws, generator = [], np.random.default_rng(7)
    for _ in range(300):
        rows = generator.integers(3, size=3)
        columns = generator.integers(40, size=40)
        draws.append(np.mean([[method[r, c] - reference[r, c] for c in columns] for r in rows]))
    assert interval.estimate == pytest.approx(float((method - reference).mean()))
    assert (interval.low, interval.high) == pytest.approx(tuple(np.quantile(draws, [0.025, 0.975])))


def test_bootstrap_interval_covers_the_true_difference_most_of_the_time():
    # 3 seeds x 200 items of 0/1 outcomes with a true difference of 0.1: the 95% interval should cover it in
    # most of 40 repetitions (a wrong resampling scheme, e.g. items only with seed effects, would under-cover).
    rng, covered = np.random.default_rng(2), 0
    for repetition in range(40):
        seed_effects = rng.normal(0, 0.03, size=(3, 1))
        reference = (rng.random((3, 200)) < 0.5 + seed_effects).astype(float)
        method = (rng.random((3, 200)) < 0.6 + seed_effects + rng.normal(0, 0.03, size=(3, 1))).astype(float)
        interval = paired_bootstrap(method, reference, resamples=400, seed=repetition)
        covered += interval.low <= 0.1 <= interval.high
    assert covered >= 30


def test_bootstrap_refuses_unpaired_shapes():
    with pytest.raises(ValueError, match="one shape"):
        paired_bootstrap(np.zeros((3, 5)), np.zeros((2, 5)))
