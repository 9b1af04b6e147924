"""Bootstrap intervals: the one resampling routine behind the benchmark's tables
(``benchmark.aggregate``) and the experiment scripts (``experiments.paper_measures``).

:func:`bootstrap_interval` resamples image *indices*, so one statistic can read several per-image
arrays of the same images (a paired two-model difference, a ratio of sums); :func:`bootstrap_ci`
is the interval of a plain mean over finite values, as the benchmark's tables report it.
Resampling, the BCa jackknife and the percentile interval are ``scipy.stats.bootstrap``'s.
"""
from __future__ import annotations

import math
import warnings
from collections.abc import Callable

import numpy as np

__all__ = ["BOOTSTRAP_RESAMPLES", "BOOTSTRAP_SEED", "Stat", "bootstrap_ci", "bootstrap_interval", "mean_stat"]

#: Resamples and seed of the benchmark tables' intervals.
BOOTSTRAP_RESAMPLES = 2000
BOOTSTRAP_SEED = 0

#: A statistic over integer image indices of shape [..., m], one value per leading index.
Stat = Callable[[np.ndarray], np.ndarray]


def bootstrap_interval(stat: Stat, n: int, seed: int = 0, n_resamples: int = 9999, confidence: float = 0.95,
                       method: str = "BCa", batch: int | None = None) -> tuple[float, float, float]:
    """(point estimate, low, high) of ``stat`` over ``n`` images with a seeded bootstrap interval;
    (point, NaN, NaN) for fewer than two images.

    ``stat(idx)`` takes integer image indices of shape [..., m] (a resample along the last axis)
    and returns the statistic for each leading index, shape [...]. ``batch`` bounds the resamples
    scipy evaluates at once (memory; None: about 4 million indices at a time).
    """
    from scipy import stats

    point = float(stat(np.arange(n)))
    if n < 2:
        return point, math.nan, math.nan
    with warnings.catch_warnings():
        # all-equal resamples (e.g. Consistency 100 % on every image) give a degenerate interval
        warnings.simplefilter("ignore", stats.DegenerateDataWarning)
        warnings.simplefilter("ignore", RuntimeWarning)
        res = stats.bootstrap((np.arange(n),), lambda idx, axis=-1: stat(np.moveaxis(idx, axis, -1)),
                              vectorized=True, n_resamples=n_resamples, confidence_level=confidence,
                              method=method, batch=batch or max(1, min(n_resamples, 4_000_000 // n // 4)),
                              rng=np.random.default_rng(seed))
    low, high = float(res.confidence_interval.low), float(res.confidence_interval.high)
    dist = np.asarray(res.bootstrap_distribution)
    if np.ptp(dist) <= 1e-9 * max(1.0, abs(point)):
        # every resample gives the point value up to float64 rounding (e.g. a ratio of equal sums):
        # BCa's acceleration divides rounding noise by rounding noise, so the interval is the point
        return point, point, point
    if not (math.isfinite(low) and math.isfinite(high)):
        # BCa is undefined where the resamples barely vary: fall back to the percentile interval
        low, high = float(np.percentile(dist, 2.5)), float(np.percentile(dist, 97.5))
    return point, low, high


def mean_stat(values: np.ndarray, scale: float = 100.0) -> Stat:
    """Mean of per-image values (times ``scale``) as a :func:`bootstrap_interval` statistic."""
    values = np.asarray(values, dtype=np.float64)
    return lambda idx: scale * values[idx].mean(axis=-1)


def bootstrap_ci(values: np.ndarray, resamples: int = BOOTSTRAP_RESAMPLES, seed: int = BOOTSTRAP_SEED,
                 level: float = 0.95) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean over the finite ``values`` (seeded: the same values
    give the same interval); (NaN, NaN) for none.

    One value, or values all equal, have no spread to resample: the interval is the mean itself.
    Percentile, not BCa: a handful of images per row, often tied (exact copies at the PSNR cap),
    make BCa's jackknife acceleration erratic.
    """
    values = np.asarray(values, dtype=float)
    values = values[np.isfinite(values)]
    if values.size == 0:
        return math.nan, math.nan
    if values.size < 2 or np.ptp(values) == 0:
        point = float(values.mean())
        return point, point
    _, low, high = bootstrap_interval(mean_stat(values, 1.0), values.size, seed=seed, n_resamples=resamples,
                                      confidence=level, method="percentile")
    return low, high
