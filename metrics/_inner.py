"""One pass over an image pair for every inner-product metric (MSE, PSNR, the FFT2D family).

MSE, PSNR, FFT2D (official, clamped) and FFT2D-H all derive from a handful of per-image inner
products of x (reconstruction), y (reference), d = x - y and their circular point reflections Rx, Ry
(see :mod:`metrics.fourier`). :func:`pair_gram` computes them in float64, a few images at a time, as
one batched Gram matrix: the float64 copy of the whole batch is never made, and the batch is read
once for all of these metrics instead of once per metric.
"""
from __future__ import annotations

import numpy as np
import torch

from ._validate import check_pair

#: Row order of :func:`pair_gram`'s Gram matrices.
ROWS = ("x", "y", "d", "rx", "ry")
#: Images per float64 chunk: 8 x 5 x 3 x 224^2 x 8 bytes = 48 MB, about the size of the L3 cache.
CHUNK = 8


def _reflect_into(dst: np.ndarray, src: np.ndarray) -> None:
    """dst[..., i, j] = src[..., -i mod H, -j mod W], as four strided copies.

    Hand-written with NumPy's negative-stride views: one pass, no index tensor; torch has no
    negative strides, and a gather or flip + roll costs two to three passes.
    """
    dst[..., 0, 0] = src[..., 0, 0]
    dst[..., 0, 1:] = src[..., 0, :0:-1]
    dst[..., 1:, 0] = src[..., :0:-1, 0]
    dst[..., 1:, 1:] = src[..., :0:-1, :0:-1]


def pair_gram(reconstruction: torch.Tensor, reference: torch.Tensor, reflect: bool = True,
              validate: bool = True) -> torch.Tensor:
    """Per-image Gram matrices of (x, y, x - y[, Rx, Ry]) in float64, inputs clipped to [0, 1].

    Args:
        reconstruction, reference: [B, 3, H, W] in [0, 1] (float32 or float64, any device).
        reflect: include the point reflections Rx, Ry (needed by the FFT2D family only).
        validate: run :func:`check_pair` (callers that validated already pass False).
    Returns:
        [B, k, k] float64 on CPU with k = 5 (rows :data:`ROWS`) or 3 without ``reflect``;
        ``G[b, i, j]`` = sum over channels and pixels of row_i * row_j of image b.
    """
    if validate:
        check_pair(reconstruction, reference)
    rec = reconstruction.detach().cpu()
    ref = reference.detach().cpu()
    b_all, c, h, w = rec.shape
    k = 5 if reflect else 3
    out = torch.empty(b_all, k, k, dtype=torch.float64)
    buf = np.empty((min(CHUNK, b_all), k, c, h, w), dtype=np.float64)
    for start in range(0, b_all, CHUNK):
        n = min(CHUNK, b_all - start)
        blk = buf[:n]
        # np.copyto converts float32 -> float64 in the same pass as the copy.
        np.copyto(blk[:, 0], rec[start : start + n].numpy())
        np.copyto(blk[:, 1], ref[start : start + n].numpy())
        np.clip(blk[:, :2], 0.0, 1.0, out=blk[:, :2])
        np.subtract(blk[:, 0], blk[:, 1], out=blk[:, 2])
        if reflect:
            _reflect_into(blk[:, 3], blk[:, 0])
            _reflect_into(blk[:, 4], blk[:, 1])
        rows = torch.from_numpy(blk).view(n, k, -1)
        torch.bmm(rows, rows.transpose(1, 2), out=out[start : start + n])
    return out
