"""Pixel-space metrics: MSE, PSNR and SSIM (scikit-image), per image.

The torch SSIM implementations (``ssim_torch``, ``ssim_official``) live in :mod:`metrics.structural`.

Every function takes ``(reconstruction, reference)``, both [B, 3, H, W] in [0, 1], and returns a
CPU float64 tensor [B]. Inputs are validated by :func:`metrics._validate.check_pair` (ValueError on a
bad shape, channel count, dtype, NaN/Inf or a value outside [0, 1] beyond ``RANGE_TOLERANCE``).
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

import numpy as np
import torch
from skimage.metrics import structural_similarity

from ._inner import pair_gram
from ._validate import check_pair, float64_chunks

#: Environment variable that sets the default number of SSIM worker threads.
SSIM_WORKERS_ENV = "FEDMJP_SSIM_WORKERS"


def mse_from_gram(gram: torch.Tensor, numel: int) -> torch.Tensor:
    """MSE [B] from :func:`metrics._inner.pair_gram` output [B, k, k]: <d, d> / pixels x channels."""
    return gram[:, 2, 2] / numel


def psnr_from_mse(err: torch.Tensor) -> torch.Tensor:
    """PSNR in dB [B] with data range 1 from MSE [B]; MSE 0 gives +inf (torch: 1/0 = inf, log10(inf) = inf)."""
    return 10.0 * torch.log10(1.0 / err)


def mse(reconstruction: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """Mean squared error over all pixels and channels of each image.

    Args:
        reconstruction, reference: [B, 3, H, W] in [0, 1].
    Returns:
        [B] float64, in [0, 1]; higher = less similar (more private).
    """
    return mse_from_gram(pair_gram(reconstruction, reference, reflect=False), reference[0].numel())


def psnr(reconstruction: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """Peak signal-to-noise ratio in dB with data range 1: ``10 * log10(1 / MSE)`` per image.

    Identical images have MSE 0 and give ``+inf``; :func:`metrics.aggregate` caps such values
    (``psnr_cap_db``) before averaging.

    Args:
        reconstruction, reference: [B, 3, H, W] in [0, 1].
    Returns:
        [B] float64 in [0, inf]; lower = less similar (more private).
    """
    return psnr_from_mse(mse(reconstruction, reference))


def _ssim_one(x: np.ndarray, y: np.ndarray) -> float:
    # Wang et al. 2004 parameters: 11x11 Gaussian window (sigma 1.5, truncate 3.5), population
    # covariance; channel_axis=0 averages the per-channel SSIM as scikit-image defines it.
    return float(
        structural_similarity(
            x,
            y,
            data_range=1.0,
            channel_axis=0,
            gaussian_weights=True,
            sigma=1.5,
            use_sample_covariance=False,
        )
    )


def _default_ssim_workers() -> int:
    env = os.environ.get(SSIM_WORKERS_ENV)
    if env is not None:
        try:
            return max(1, int(env))
        except ValueError as err:
            raise ValueError(f"{SSIM_WORKERS_ENV} must be an integer, got {env!r}") from err
    return min(2, os.cpu_count() or 1)


def ssim(
    reconstruction: torch.Tensor, reference: torch.Tensor, workers: Optional[int] = None, validate: bool = True
) -> torch.Tensor:
    """Structural similarity per image via ``skimage.metrics.structural_similarity``.

    The CPU path: faster here than the exact torch implementation :func:`metrics.ssim_torch`
    (same values to ~1e-7), which is meant for tensors on a GPU.

    Parameters: ``data_range=1``, ``channel_axis`` over RGB (mean of the per-channel SSIM),
    ``gaussian_weights=True``, ``sigma=1.5`` (an 11x11 window, as the official MJP code),
    ``use_sample_covariance=False``. Images must be at least 11 pixels on each side.

    Args:
        reconstruction, reference: [B, 3, H, W] in [0, 1].
        workers: threads for the per-image loop (SciPy's filters release the GIL in part); default
            from ``FEDMJP_SSIM_WORKERS`` or ``min(2, cpu_count)``. The result does not depend on it.
        validate: run the input checks (the scorer validates once and passes False).
    Returns:
        [B] float64 in [-1, 1]; 1 for identical images; lower = more private.
    """
    if validate:
        check_pair(reconstruction, reference)
    if min(reference.shape[-2:]) < 11:
        raise ValueError(f"ssim needs images of at least 11x11 pixels, got {tuple(reference.shape[-2:])}")
    n_workers = _default_ssim_workers() if workers is None else max(1, int(workers))
    values: list[float] = []
    with ThreadPoolExecutor(max_workers=n_workers) as pool:
        for x, y in float64_chunks(reconstruction, reference):
            xs, ys = x.numpy(), y.numpy()
            values.extend(pool.map(_ssim_one, list(xs), list(ys)))
    return torch.tensor(values, dtype=torch.float64)
