"""Image-similarity metrics for gradient-inversion reconstructions and the settings-aware scorer.

Metric functions are pure and batched: ``(reconstruction, reference)``, both [B, 3, H, W] in [0, 1]
(RGB), return a CPU float64 tensor [B] of per-image values and raise ValueError on bad input.
:func:`score_all` computes several of them in one pass.
"""
from ._validate import RANGE_TOLERANCE, check_image_batch, check_pair
from .fourier import fft2d, fft2d_clamped, fft2d_hermitian, point_reflect
from .lpips_cache import CACHE_ENV, LpipsFeatureCache, cache_budget_mb
from .perceptual import (
    BACKBONE_ENV,
    LPIPSWeightsError,
    LpipsRoute,
    LpipsUnavailable,
    get_lpips_model,
    lpips,
    lpips_source,
    resolve_lpips_route,
)
from .pixel import SSIM_BACKENDS, mse, psnr, ssim, ssim_skimage
from .quantize import quantize_8bit
from .registered import psnr_registered
from .registry import (
    METRICS,
    PAPER_COLUMN_LABELS,
    PAPER_COLUMN_ORDER,
    PAPER_METRICS,
    Metric,
    MetricFn,
    get_metric,
    on_8bit,
)
from .scoring import CAPPED_METRICS, PSNR_CAP_DB, SETTING_REFERENCE, aggregate, reference_for, score, score_all
from .structural import ssim_official, ssim_scipy, ssim_torch, ssim_with_map

__all__ = [
    "BACKBONE_ENV",
    "CAPPED_METRICS",
    "CACHE_ENV",
    "LPIPSWeightsError",
    "LpipsFeatureCache",
    "LpipsRoute",
    "LpipsUnavailable",
    "METRICS",
    "Metric",
    "MetricFn",
    "PAPER_COLUMN_LABELS",
    "PAPER_COLUMN_ORDER",
    "PAPER_METRICS",
    "PSNR_CAP_DB",
    "RANGE_TOLERANCE",
    "SETTING_REFERENCE",
    "SSIM_BACKENDS",
    "aggregate",
    "cache_budget_mb",
    "check_image_batch",
    "check_pair",
    "fft2d",
    "fft2d_clamped",
    "fft2d_hermitian",
    "get_lpips_model",
    "get_metric",
    "lpips",
    "lpips_source",
    "mse",
    "on_8bit",
    "point_reflect",
    "psnr",
    "psnr_registered",
    "quantize_8bit",
    "reference_for",
    "resolve_lpips_route",
    "score",
    "score_all",
    "ssim",
    "ssim_official",
    "ssim_scipy",
    "ssim_skimage",
    "ssim_torch",
    "ssim_with_map",
]
