"""Input checks shared by every metric: shapes, channel count, dtype, finiteness, value range."""
from __future__ import annotations

import math
from typing import Iterator

import torch

#: Values in ``[-RANGE_TOLERANCE, 1 + RANGE_TOLERANCE]`` count as in range (float round-off from
#: normalising and un-normalising an image); they are clipped to ``[0, 1]`` before scoring.
RANGE_TOLERANCE = 1e-6

#: Images converted to float64 at a time; keeps peak memory bounded for large sets (999 x 224^2).
CHUNK = 64


def check_image_batch(images: torch.Tensor, name: str) -> None:
    """Raise ValueError unless ``images`` is a finite float tensor [B, 3, H, W] with values in [0, 1].

    Args:
        images: tensor that should be [B, 3, H, W], floating point, in [0, 1] (within
            ``RANGE_TOLERANCE``).
        name: how the error message calls the tensor (e.g. "reconstruction").
    """
    if not isinstance(images, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor [B, 3, H, W], got {type(images).__name__}")
    if images.dim() != 4:
        raise ValueError(f"{name} must be 4-D [B, 3, H, W], got shape {tuple(images.shape)}")
    if images.shape[1] != 3:
        raise ValueError(
            f"{name} must have 3 (RGB) channels in dim 1 ([B, 3, H, W]), got shape {tuple(images.shape)}"
        )
    if images.shape[0] == 0 or images.shape[2] == 0 or images.shape[3] == 0:
        raise ValueError(f"{name} is empty: shape {tuple(images.shape)}")
    if not images.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor with values in [0, 1], got {images.dtype}")
    # One min/max pass instead of isfinite + min + max (3 passes over ~150M floats for 999 images):
    # min/max propagate NaN and report +-inf, so finite extremes imply a finite tensor.
    lo_t, hi_t = torch.aminmax(images.detach())
    lo, hi = float(lo_t), float(hi_t)
    if not (math.isfinite(lo) and math.isfinite(hi)):
        bad = (~torch.isfinite(images)).flatten(1).any(dim=1).nonzero().flatten().tolist()
        raise ValueError(f"{name} contains NaN or Inf values (images at batch indices {bad[:10]})")
    if lo < -RANGE_TOLERANCE or hi > 1.0 + RANGE_TOLERANCE:
        raise ValueError(
            f"{name} must have values in [0, 1] (tolerance {RANGE_TOLERANCE:g}), got min {lo:.6g} max {hi:.6g}"
        )


def check_pair(reconstruction: torch.Tensor, reference: torch.Tensor) -> None:
    """Validate both batches (see :func:`check_image_batch`) and that their shapes are equal."""
    check_image_batch(reconstruction, "reconstruction")
    check_image_batch(reference, "reference")
    if reconstruction.shape != reference.shape:
        raise ValueError(
            f"reconstruction and reference must have the same shape, got {tuple(reconstruction.shape)} "
            f"and {tuple(reference.shape)}"
        )


def float64_chunks(
    reconstruction: torch.Tensor, reference: torch.Tensor, chunk: int = CHUNK
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Yield aligned CPU float64 chunks [b, 3, H, W] of an already validated pair, clipped to [0, 1]."""
    for start in range(0, reconstruction.shape[0], chunk):
        # copy=True: the in-place clamp must never write into the caller's tensor.
        x = reconstruction[start : start + chunk].detach().to("cpu", torch.float64, copy=True).clamp_(0.0, 1.0)
        y = reference[start : start + chunk].detach().to("cpu", torch.float64, copy=True).clamp_(0.0, 1.0)
        yield x, y
