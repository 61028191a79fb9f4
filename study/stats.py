"""Statistics of a controlled study, plain numpy: intervals over seeds and paired bootstrap differences.

A study scores every run (one method, condition and seed) on the same items. Two questions follow:
- how well does a method do: the mean over its seeds with a Student-t 95% interval of that mean
  (`seed_interval`; with 3 seeds the interval is wide, which is the honest answer);
- does it beat the reference method (CLIP-FT) in the same condition: the difference of means with a paired
  bootstrap interval (`paired_bootstrap`) that resamples items and seeds together, so both the test-set
  sampling and the training noise of the seeds enter the interval. Items are paired (the same item for both
  methods); seeds are paired by index (seed i of both methods started from the same data order);
- the same question with the seed as the only unit: the per-seed differences of the paired runs (each the mean
  over the items) with a Student-t interval of their mean on n_seeds - 1 degrees of freedom and its two-sided
  p-value (`paired_seed_t`). With 3 seeds it has 2 degrees of freedom: wide, and honest about how few the
  training repeats are, where the bootstrap's item resampling can make a seed-driven difference look narrow;
- how far apart are two unpaired seed sets (a fine-tuned cell and the pretraining seeds of its backbones, the
  testbed validity table): the difference of means with Welch's t-interval (`difference_interval`).

The Student-t distribution is computed here exactly (the regularised incomplete beta function), not from a table.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

DEFAULT_LEVEL = 0.95
DEFAULT_RESAMPLES = 10_000


@dataclass(frozen=True)
class Interval:
    """An estimate with its confidence interval."""

    estimate: float
    low: float
    high: float

    def as_dict(self, prefix: str = "") -> dict:
        return {f"{prefix}mean": self.estimate, f"{prefix}low": self.low, f"{prefix}high": self.high}


def _student_t_cdf(t: float, df: int) -> float:
    """P(T <= t) for Student's t with `df` degrees of freedom, by the regularised incomplete beta function."""
    x = df / (df + t * t)
    tail = 0.5 * _regularised_beta(df / 2, 0.5, x)
    return 1.0 - tail if t > 0 else tail


def _regularised_beta(a: float, b: float, x: float) -> float:
    """I_x(a, b) by its continued fraction (Lentz's method), the standard numerical route."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    if x > (a + 1) / (a + b + 2):  # the fraction converges fast only below this point: use the symmetry
        return 1.0 - _regularised_beta(b, a, 1.0 - x)
    front = math.exp(a * math.log(x) + b * math.log(1 - x) - math.log(a) - _log_beta(a, b))
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    result = d
    for m in range(1, 500):
        for numerator in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                          -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            result *= c * d
        if abs(c * d - 1.0) < 1e-15:
            break
    return front * result


def _log_beta(a: float, b: float) -> float:
    return math.lgamma(a) + math.lgamma(b) - math.lgamma(a + b)


def student_t_two_sided_p(t: float, df: float) -> float:
    """P(|T| >= |t|) for Student's t with `df` degrees of freedom: I_x(df/2, 1/2) with x = df / (df + t^2)."""
    if df <= 0:
        raise ValueError(f"need df > 0, got {df}")
    return _regularised_beta(df / 2, 0.5, df / (df + t * t))


def student_t_quantile(probability: float, df: float) -> float:
    """The `probability` quantile of Student's t with `df` degrees of freedom, not necessarily whole (Welch)
    (bisection on the CDF)."""
    if not 0.0 < probability < 1.0 or df < 1:
        raise ValueError(f"need 0 < probability < 1 and df >= 1, got {probability}, {df}")
    low, high = -1e4, 1e4
    for _ in range(200):
        middle = (low + high) / 2
        if _student_t_cdf(middle, df) < probability:
            low = middle
        else:
            high = middle
    return (low + high) / 2


def seed_interval(values: Sequence[float], level: float = DEFAULT_LEVEL) -> Interval:
    """Mean over seeds with the Student-t interval of the mean (a single seed gives no interval: NaN bounds)."""
    values = np.asarray(values, dtype=np.float64)
    if values.size == 0:
        raise ValueError("no values to summarise")
    mean = float(values.mean())
    if values.size < 2:
        return Interval(mean, math.nan, math.nan)
    half = student_t_quantile(0.5 + level / 2, values.size - 1) * values.std(ddof=1) / math.sqrt(values.size)
    return Interval(mean, mean - half, mean + half)


@dataclass(frozen=True)
class SeedTest:
    """The seed-level paired t: the mean per-seed difference with its t-interval, the two-sided p-value of a zero
    mean and the degrees of freedom (n_seeds - 1). One seed: NaN bounds and p, 0 degrees of freedom."""

    interval: Interval
    p_value: float
    df: int

    def as_dict(self) -> dict:
        return {"estimate": self.interval.estimate, "low": self.interval.low, "high": self.interval.high,
                "p": self.p_value, "df": self.df}


def paired_seed_t(differences: Sequence[float], level: float = DEFAULT_LEVEL) -> SeedTest:
    """Student's paired t over seeds: `differences` holds one value per seed (method minus reference, each the mean
    over the items of that seed's paired runs). The interval is `seed_interval` of the differences; the p-value
    tests a zero mean. Differences without any spread give a point interval and p 1 (all zero) or 0 (not)."""
    values = np.asarray(differences, dtype=np.float64)
    interval = seed_interval(values, level)
    if values.size < 2:
        return SeedTest(interval, math.nan, 0)
    spread = float(values.std(ddof=1))
    if spread == 0.0:
        return SeedTest(interval, 1.0 if interval.estimate == 0.0 else 0.0, values.size - 1)
    t = interval.estimate / (spread / math.sqrt(values.size))
    return SeedTest(interval, student_t_two_sided_p(t, values.size - 1), values.size - 1)


def difference_interval(first: Sequence[float], second: Sequence[float], level: float = DEFAULT_LEVEL) -> Interval:
    """Difference of two means over independent seed sets (first - second) with Welch's t-interval.

    For two groups of runs that share no pairing (e.g. a fine-tuned cell's seeds against the pretraining seeds of
    its backbones, possibly different counts): standard error sqrt(s1^2/n1 + s2^2/n2), degrees of freedom by
    Welch-Satterthwaite. Fewer than two values on either side gives NaN bounds; no spread at all, a point.
    """
    first, second = np.asarray(first, dtype=np.float64), np.asarray(second, dtype=np.float64)
    if first.size == 0 or second.size == 0:
        raise ValueError("no values to compare")
    difference = float(first.mean() - second.mean())
    if first.size < 2 or second.size < 2:
        return Interval(difference, math.nan, math.nan)
    shares = first.var(ddof=1) / first.size, second.var(ddof=1) / second.size
    variance = shares[0] + shares[1]
    if variance == 0.0:
        return Interval(difference, difference, difference)
    df = variance ** 2 / (shares[0] ** 2 / (first.size - 1) + shares[1] ** 2 / (second.size - 1))
    half = student_t_quantile(0.5 + level / 2, df) * math.sqrt(variance)
    return Interval(difference, difference - half, difference + half)


def paired_bootstrap(method: np.ndarray, reference: np.ndarray, resamples: int = DEFAULT_RESAMPLES,
                     level: float = DEFAULT_LEVEL, seed: int = 0) -> Interval:
    """Difference of means (method - reference) with a paired bootstrap interval over items x seeds.

    Args:
        method, reference: per-item outcomes [seeds, items] (0/1 or scores) on the same items, seeds paired by
            row. Each resample draws seeds (rows) with replacement and, independently, items (columns) with
            replacement, and applies the same draw to both methods.
        resamples: bootstrap resamples. level: coverage of the percentile interval.
        seed: the bootstrap's own random seed (the report is reproducible).
    """
    method, reference = np.asarray(method, np.float64), np.asarray(reference, np.float64)
    if method.shape != reference.shape or method.ndim != 2 or method.size == 0:
        raise ValueError(f"need two [seeds, items] arrays of one shape, got {method.shape} and {reference.shape}")
    difference = method - reference
    rng = np.random.default_rng(seed)
    seeds, items = difference.shape
    rows = np.empty((resamples, seeds), dtype=np.int64)
    columns = np.empty((resamples, items), dtype=np.int64)
    for index in range(resamples):  # the draws in their order: a resample's seeds, then its items
        rows[index] = rng.integers(seeds, size=seeds)
        columns[index] = rng.integers(items, size=items)
    draws = resample_means(difference, rows, columns)
    tail = (1 - level) / 2
    low, high = np.quantile(draws, [tail, 1 - tail])
    return Interval(float(difference.mean()), float(low), float(high))


def resample_means(values: np.ndarray, rows: np.ndarray, columns: np.ndarray, chunk: int = 1000) -> np.ndarray:
    """Per resample r, `values[np.ix_(rows[r], columns[r])].mean()`, without building the resampled arrays: the
    mean over the drawn rows of each row's mean over the drawn columns (column draws counted per resample)."""
    resamples, items = columns.shape
    means = np.empty(resamples)
    for start in range(0, resamples, chunk):
        drawn = columns[start:start + chunk]
        flat = (np.arange(len(drawn))[:, None] * items + drawn).ravel()
        counts = np.bincount(flat, minlength=len(drawn) * items).reshape(len(drawn), items).astype(np.float64)
        row_means = counts @ values.T / items  # [resamples in chunk, rows]
        means[start:start + chunk] = np.take_along_axis(row_means, rows[start:start + chunk], axis=1).mean(axis=1)
    return means
