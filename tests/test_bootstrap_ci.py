"""The tables' bootstrap interval of the mean (fedmjp.stats.bootstrap_ci, scipy.stats.bootstrap):
seeded, finite values only, and a point interval where there is nothing to resample."""
from __future__ import annotations

import math
import warnings

import numpy as np
import pytest

from fedmjp.stats import BOOTSTRAP_RESAMPLES, bootstrap_ci


def test_the_interval_is_seeded_and_ignores_non_finite_values() -> None:
    v = np.array([12.0, 15.5, 9.25, 30.0, 18.0, 11.0, 14.0, 22.5])
    lo, hi = bootstrap_ci(v)
    assert lo < v.mean() < hi
    assert bootstrap_ci(v) == (lo, hi)
    assert bootstrap_ci(np.concatenate([v, [np.nan, np.inf, -np.inf]])) == (lo, hi)
    assert bootstrap_ci(v, seed=1) != (lo, hi)


def test_the_interval_has_the_width_of_the_mean_s_sampling_spread() -> None:
    """For 400 normal values, the percentile interval is close to mean +- 1.96 sd / sqrt(n)."""
    v = np.random.default_rng(3).normal(5.0, 2.0, 400)
    lo, hi = bootstrap_ci(v)
    half = 1.96 * v.std(ddof=1) / math.sqrt(v.size)
    assert (hi - lo) / 2 == pytest.approx(half, rel=0.1)
    assert (lo + hi) / 2 == pytest.approx(v.mean(), abs=0.1 * half)
    narrower = bootstrap_ci(v, level=0.5)
    assert lo < narrower[0] < narrower[1] < hi


@pytest.mark.parametrize("values", [[], [np.nan], [np.inf, np.nan]])
def test_no_finite_value_gives_nan(values) -> None:
    assert all(math.isnan(t) for t in bootstrap_ci(np.array(values, dtype=float)))


@pytest.mark.parametrize("values", [[7.5], [7.5, np.nan], [100.0] * 8])
def test_one_value_or_all_equal_values_give_the_value_as_interval(values) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # scipy's DegenerateDataWarning / RuntimeWarning would fail here
        assert bootstrap_ci(np.array(values)) == (values[0], values[0])


def test_the_resample_count_is_the_module_constant() -> None:
    v = np.array([12.0, 15.5, 9.25, 30.0, 18.0, 11.0, 14.0, 22.5])
    assert bootstrap_ci(v) == bootstrap_ci(v, resamples=BOOTSTRAP_RESAMPLES)
    assert bootstrap_ci(v) != bootstrap_ci(v, resamples=BOOTSTRAP_RESAMPLES // 10)
