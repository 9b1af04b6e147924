"""SSIM in torch: scikit-image's definition (:func:`ssim_torch`) and the official MJP code's (:func:`ssim_official`).

Both use Wang et al.'s statistics with an 11-tap Gaussian window (sigma 1.5; scikit-image's
``truncate=3.5`` gives radius int(3.5 * 1.5 + 0.5) = 5, the same 11 taps the official code builds),
population covariance, K1 = 0.01, K2 = 0.03 and data range 1:

    S = (2 mu_x mu_y + C1)(2 s_xy + C2) / ((mu_x^2 + mu_y^2 + C1)(s_x^2 + s_y^2 + C2))

They differ at the border and in the average:

* :func:`ssim_torch` = ``skimage.metrics.structural_similarity(x, y, data_range=1, channel_axis=...,
  gaussian_weights=True, sigma=1.5, use_sample_covariance=False)``: the map is computed where the
  window fits (scikit-image filters with reflection and then crops (win_size - 1) // 2 = 5 pixels from
  every side, so the padding never reaches the average); mean per channel, then over channels.
* :func:`ssim_official` = the official ``eval/basic.py`` (the classic pytorch-ssim formulation):
  ``F.conv2d(..., padding=5)``, i.e. zero padding, and the mean over the whole [3, H, W] map.

Why hand-written: the official variant has no library implementation, and a torch SSIM runs on any
device. torch has no fast float64 convolution on CPU (grouped float64 conv2d is ~100x slower than
float32 with oneDNN), and a plain float32 filter moves the SSIM mean by 1e-6..1e-5 on real images
(cancellation in E[x^2] - mu^2). So the separable Gaussian runs as float32 convolutions on an exact
hi/lo split (:func:`_filter_pass`), after shifting each image channel by its own mean (variances and
covariance do not change under a constant shift; the means get it back). Result: scikit-image's
float64 values to ~1e-7. On CPU this is still slower than scikit-image (measured: ~3x on a shared
2-core machine; the split triples the filter work and adds float64 elementwise passes), so
:func:`metrics.ssim` stays on scikit-image and this is the implementation for ``ssim_official``
and for tensors on a GPU.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ._validate import check_pair

#: Window of Wang et al. and of the official code.
WIN_SIZE = 11
SIGMA = 1.5
K1, K2 = 0.01, 0.03
#: Images per chunk: small enough that the float64 maps (2 x 12 x 224^2 x 8 bytes = 9.6 MB) stay in
#: the cache; the work is memory-bound, not compute-bound.
CHUNK = 2


def gaussian_taps(win_size: int = WIN_SIZE, sigma: float = SIGMA) -> torch.Tensor:
    """[win_size] float64 normalised Gaussian taps, centred (SciPy's ``_gaussian_kernel1d`` and the
    official ``gaussian(window_size, sigma)`` give the same values)."""
    k = torch.arange(win_size, dtype=torch.float64) - (win_size // 2)
    g = torch.exp(-(k**2) / (2.0 * sigma**2))
    return g / g.sum()


def _taps(horizontal: bool) -> torch.Tensor:
    """[3, 1, 1, 11] (or [3, 1, 11, 1]) float32 taps (g_hi, g_lo, g): g_hi a multiple of 2^-16
    (<= 15 bits, as g < 0.27), g_lo = g - g_hi."""
    g = gaussian_taps()
    g_hi = torch.round(g * 65536.0) / 65536.0
    taps = torch.stack([g_hi, g - g_hi, g]).to(torch.float32)
    return taps.view(3, 1, 1, -1) if horizontal else taps.view(3, 1, -1, 1)


_TAPS = {True: _taps(True), False: _taps(False)}


def _filter_pass(v: torch.Tensor, lo_extra: Optional[torch.Tensor], horizontal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One 1-D Gaussian pass ("valid") of v (+ lo_extra) [n, m, H, W] -> (big, small) float32.

    v (float64, or float32 from the previous pass) is split into hi, a multiple of 2^-8 (<= 9 bits
    for |v| <= 1), and lo = v - hi. big = conv(hi, g_hi) is exact in float32: every product is a
    multiple of 2^-24 below 2^-1 and every partial sum a multiple of 2^-24 below 1 in magnitude, so no
    rounding happens in any order of summation. small = conv(hi, g_lo) + conv(lo + lo_extra, g) is
    below ~2^-8, so its float32 rounding is ~1e-10 absolute. big + small = conv(v, g) to ~1e-10 (a
    plain float32 filter is off by ~1e-7, enough to move the SSIM mean by 1e-6..1e-5 on real images).
    """
    n, m, h, w = v.shape
    inp = torch.empty(n, 3 * m, h, w, dtype=torch.float32, memory_format=torch.channels_last)
    hi = torch.round(v * 256.0).div_(256.0)
    inp[:, :m].copy_(hi)
    inp[:, m : 2 * m].copy_(inp[:, :m])
    lo = inp[:, 2 * m :]
    lo.copy_(torch.sub(v, hi, out=hi))  # exact: v - hi has at most v's significant bits
    if lo_extra is not None:
        lo.add_(lo_extra)
    weight = _TAPS[horizontal].repeat_interleave(m, dim=0)
    out = F.conv2d(inp, weight, groups=3 * m).contiguous()  # back to NCHW, see _ssim_mean
    return out[:, :m], out[:, m : 2 * m] + out[:, 2 * m :]


def _gaussian_valid(maps: torch.Tensor) -> torch.Tensor:
    """Separable 11x11 Gaussian of float64 maps [n, m, H, W] in [-1, 1] where the window fits:
    [n, m, H - 10, W - 10] float64, to ~1e-10 absolute (see :func:`_filter_pass`)."""
    big, small = _filter_pass(maps, None, horizontal=True)
    big, small = _filter_pass(big, small, horizontal=False)
    return big.to(torch.float64).add_(small)


def _ssim_mean(x: torch.Tensor, y: torch.Tensor, pad: int) -> torch.Tensor:
    """Mean SSIM map per image of float64 [n, C, H, W] inputs; ``pad`` zero pixels on every side first.

    Returns [n] float64: the mean over channels and the (H + 2 pad - 10) x (W + 2 pad - 10) map.
    """
    if pad:
        x, y = F.pad(x, (pad,) * 4), F.pad(y, (pad,) * 4)
    n, c, h, w = x.shape
    x_mean, y_mean = x.mean(dim=(-2, -1), keepdim=True), y.mean(dim=(-2, -1), keepdim=True)
    # Four maps per channel are enough: mu_x, mu_y, E[x^2 + y^2] / 2, E[xy] (only s_x^2 + s_y^2 is
    # used); all in [-1, 1] as :func:`_gaussian_valid` needs.
    # Elementwise work in NCHW (contiguous channel slices vectorise; channel slices of a channels_last
    # tensor are strided and ~10x slower); only the float32 convolution input is channels_last.
    maps = torch.empty(n, 4 * c, h, w, dtype=torch.float64)
    xs, ys, sq, xy = maps.split(c, dim=1)
    torch.sub(x, x_mean, out=xs)
    torch.sub(y, y_mean, out=ys)
    torch.mul(xs, xs, out=sq).addcmul_(ys, ys).mul_(0.5)
    torch.mul(xs, ys, out=xy)
    f = _gaussian_valid(maps)
    mx, my, exy2, exy = f.split(c, dim=1)
    # Shift invariance: variances and covariance come from the shifted maps directly; the means get
    # their shift back.
    c1, c2 = K1**2, K2**2
    den2 = exy2.mul_(2.0).sub_(mx * mx).sub_(my * my).add_(c2)  # s_x^2 + s_y^2 + C2
    num2 = exy.sub_(mx * my).mul_(2.0).add_(c2)  # 2 s_xy + C2
    mx.add_(x_mean)
    my.add_(y_mean)
    num1 = (mx * my).mul_(2.0).add_(c1)
    den1 = mx.mul_(mx).addcmul_(my, my).add_(c1)
    return (num1.mul_(num2)).div_(den1.mul_(den2)).mean(dim=(1, 2, 3))


def _ssim_batched(reconstruction: torch.Tensor, reference: torch.Tensor, pad: int, validate: bool) -> torch.Tensor:
    if validate:
        check_pair(reconstruction, reference)
    if min(reference.shape[-2:]) + 2 * pad < WIN_SIZE:
        raise ValueError(f"ssim needs images of at least 11x11 pixels, got {tuple(reference.shape[-2:])}")
    out = []
    with torch.inference_mode():
        for start in range(0, reference.shape[0], CHUNK):
            x = reconstruction[start : start + CHUNK].detach().to("cpu", torch.float64).clamp(0.0, 1.0)
            y = reference[start : start + CHUNK].detach().to("cpu", torch.float64).clamp(0.0, 1.0)
            out.append(_ssim_mean(x, y, pad))
    return torch.cat(out)


def ssim_torch(reconstruction: torch.Tensor, reference: torch.Tensor, validate: bool = True) -> torch.Tensor:
    """SSIM per image as ``skimage.metrics.structural_similarity`` with ``data_range=1``,
    ``channel_axis`` over RGB, ``gaussian_weights=True``, ``sigma=1.5``, ``use_sample_covariance=False``.

    Args:
        reconstruction, reference: [B, 3, H, W] in [0, 1], H and W >= 11.
        validate: run the input checks (the scorer validates once and passes False).
    Returns:
        [B] float64 in [-1, 1]; 1 for identical images; lower = more private. Agrees with
        scikit-image to ~1e-7 (float32 filtering, module docstring).
    """
    return _ssim_batched(reconstruction, reference, pad=0, validate=validate)


def ssim_official(reconstruction: torch.Tensor, reference: torch.Tensor, validate: bool = True) -> torch.Tensor:
    """SSIM per image as the official MJP evaluation (``eval/basic.py``, pytorch-ssim): 11x11
    Gaussian window (sigma 1.5), zero padding of 5 pixels, mean over the whole [3, H, W] map.

    The official code ran in float32 on saved 8-bit PNGs; this computes the same formula in float64
    after the float32 filter (use :func:`metrics.quantize_8bit` for the PNG step).

    Args:
        reconstruction, reference: [B, 3, H, W] in [0, 1].
        validate: run the input checks.
    Returns:
        [B] float64; 1 for identical images; lower = more private.
    """
    return _ssim_batched(reconstruction, reference, pad=WIN_SIZE // 2, validate=validate)
