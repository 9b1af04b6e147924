"""Pixel-space metrics: MSE, PSNR and SSIM, per image.

SSIM on the CPU runs the float64 NumPy/SciPy code of :mod:`metrics.structural` (scikit-image's
values to ~1e-14, faster than scikit-image's own loop; measurements in that module's docstring);
``backend="torch"`` or ``"skimage"`` (or ``FEDMJP_SSIM_BACKEND``) picks the torch implementation or
scikit-image itself, the reference of the tests.

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
from .structural import SSIM_WORKERS_ENV, default_ssim_workers, ssim_scipy, ssim_torch  # noqa: F401 (re-export)

#: Environment variable that picks the default SSIM backend (:data:`SSIM_BACKENDS`).
SSIM_BACKEND_ENV = "FEDMJP_SSIM_BACKEND"
#: SSIM backends :func:`ssim` accepts; the first is the default.
SSIM_BACKENDS = ("scipy", "torch", "skimage")


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


def _ssim_backend(backend: Optional[str]) -> str:
    name = backend if backend is not None else os.environ.get(SSIM_BACKEND_ENV, SSIM_BACKENDS[0])
    if name not in SSIM_BACKENDS:
        raise ValueError(f"unknown SSIM backend {name!r} (from {'the argument' if backend is not None else SSIM_BACKEND_ENV}); "
                         f"valid backends: {', '.join(SSIM_BACKENDS)}")
    return name


def ssim_skimage(
    reconstruction: torch.Tensor, reference: torch.Tensor, workers: Optional[int] = None, validate: bool = True
) -> torch.Tensor:
    """SSIM per image with ``skimage.metrics.structural_similarity`` in a thread pool (the reference).

    Args:
        reconstruction, reference: [B, 3, H, W] in [0, 1], H and W >= 11.
        workers: threads for the per-image loop (SciPy's filters release the GIL in part); default
            from ``FEDMJP_SSIM_WORKERS`` or ``min(2, cpu_count)``. The result does not depend on it.
        validate: run the input checks.
    Returns:
        [B] float64 in [-1, 1]; 1 for identical images; lower = more private.
    """
    if validate:
        check_pair(reconstruction, reference)
    if min(reference.shape[-2:]) < 11:
        raise ValueError(f"ssim needs images of at least 11x11 pixels, got {tuple(reference.shape[-2:])}")
    n_workers = default_ssim_workers() if workers is None else max(1, int(workers))
    values: list[float] = []
    with ThreadPoolExecutor(max_workers=n_workers) as pool:
        for x, y in float64_chunks(reconstruction, reference):
            xs, ys = x.numpy(), y.numpy()
            values.extend(pool.map(_ssim_one, list(xs), list(ys)))
    return torch.tensor(values, dtype=torch.float64)


def ssim(
    reconstruction: torch.Tensor,
    reference: torch.Tensor,
    workers: Optional[int] = None,
    validate: bool = True,
    backend: Optional[str] = None,
) -> torch.Tensor:
    """Structural similarity per image: ``skimage.metrics.structural_similarity``'s values.

    Parameters: ``data_range=1``, ``channel_axis`` over RGB (mean of the per-channel SSIM),
    ``gaussian_weights=True``, ``sigma=1.5`` (an 11x11 window, as the official MJP code),
    ``use_sample_covariance=False``. Images must be at least 11 pixels on each side.

    Args:
        reconstruction, reference: [B, 3, H, W] in [0, 1].
        workers: threads of the "scipy" and "skimage" backends (the "torch" backend uses torch's
            intra-op threads); default ``FEDMJP_SSIM_WORKERS`` or ``min(2, cpu_count)``.
        validate: run the input checks (the scorer validates once and passes False).
        backend: "scipy" (:func:`metrics.structural.ssim_scipy`, float64 NumPy/SciPy, the fastest
            on CPU), "torch" (:func:`metrics.ssim_torch`, float64, any device) or "skimage"
            (:func:`ssim_skimage`, the reference); the first two equal scikit-image to ~1e-14.
            Default from ``FEDMJP_SSIM_BACKEND``, else "scipy".
    Returns:
        [B] CPU float64 in [-1, 1]; 1 for identical images; lower = more private.
    Raises:
        ValueError: invalid images or an unknown backend (lists the valid ones).
    """
    name = _ssim_backend(backend)
    if name == "skimage":
        return ssim_skimage(reconstruction, reference, workers=workers, validate=validate)
    if name == "torch":
        return ssim_torch(reconstruction, reference, validate=validate)
    return ssim_scipy(reconstruction, reference, workers=workers, validate=validate)
