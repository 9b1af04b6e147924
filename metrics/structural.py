"""SSIM in float64: scikit-image's definition (:func:`ssim_scipy`, :func:`ssim_torch`, :func:`ssim_with_map`)
and the official MJP code's (:func:`ssim_official`).

All use Wang et al.'s statistics with an 11-tap Gaussian window (sigma 1.5; scikit-image's
``truncate=3.5`` gives radius int(3.5 * 1.5 + 0.5) = 5, the same 11 taps the official code builds),
population covariance, K1 = 0.01, K2 = 0.03 and data range 1:

    S = (2 mu_x mu_y + C1)(2 s_xy + C2) / ((mu_x^2 + mu_y^2 + C1)(s_x^2 + s_y^2 + C2))

* scikit-image's value (``structural_similarity(x, y, data_range=1, channel_axis=..., gaussian_weights=True,
  sigma=1.5, use_sample_covariance=False)``): the map filtered with SciPy's ``reflect`` border, then
  averaged without the 5 border pixels per side (where the window fits), per channel, then over
  channels. ``full=True`` returns the whole map: :func:`ssim_with_map`.
* the official ``eval/basic.py`` (pytorch-ssim): zero padding of 5 and the mean over the whole map.

How: the statistics come from u = (x + y) / 2, v = (x - y) / 2 and their squares (four maps per
channel, as x, y, x^2 + y^2, xy would be): mu_x = M_u + M_v, mu_y = M_u - M_v,
s_x^2 + s_y^2 = 2 (s_u^2 + s_v^2), 2 s_xy = 2 (s_u^2 - s_v^2). For identical images v is exactly 0,
so numerator and denominator agree to the bit and the score is exactly 1. Everything is float64, as
scikit-image: the values agree with it to ~1e-13 per image and ~1e-12 per map pixel (real ImageNet
images at 224, 32 and 17 px against noisy, uniform-noise, constant, black, white, saturated and
other-image reconstructions, float32 inputs, constant references; scikit-image's bundled images;
tests/test_ssim_torch.py checks 1e-10 / 1e-9).

Why SciPy on the CPU: torch's intra-op threads are OpenMP teams that meet at a barrier after each of
the ~45 ops per image, so when another process holds a core every barrier waits for a time slice;
the CPU path (:func:`ssim_scipy`, used by :func:`metrics.ssim`) runs the same four-map formula per
image in NumPy/SciPy (one ``correlate1d`` per axis for all 12 maps, in-place arithmetic) in a pool
of Python threads, which release the GIL in the filter and the ufuncs and degrade only in proportion
to the load. :func:`ssim_torch` (float64, shifted views with fused multiply-adds) serves tensors on a
GPU and ``metrics.ssim(backend="torch")`` on a machine with idle cores. The measurements behind
this choice: docs/speed.md, "SSIM on the CPU".
"""
from __future__ import annotations

import math
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Optional

import numpy as np
import torch
import torch.nn.functional as F
from scipy.ndimage import correlate1d

from ._validate import check_pair, float64_chunks

#: Window of Wang et al. and of the official code.
WIN_SIZE = 11
SIGMA = 1.5
K1, K2 = 0.01, 0.03
#: Window radius: pixels the "valid" filter loses on every side, and scikit-image's crop.
RADIUS = WIN_SIZE // 2
#: Images per chunk of the torch code: one 224 px image's 12 float64 maps (4.8 MB) stay in the
#: last-level cache; 2 or 4 images per chunk were 20% and 80% slower (module docstring).
CHUNK = 1
#: Environment variable that sets the default number of CPU SSIM worker threads.
SSIM_WORKERS_ENV = "FEDMJP_SSIM_WORKERS"


def gaussian_taps(win_size: int = WIN_SIZE, sigma: float = SIGMA) -> torch.Tensor:
    """[win_size] float64 normalised Gaussian taps, centred (SciPy's ``_gaussian_kernel1d`` and the
    official ``gaussian(window_size, sigma)`` give the same values)."""
    k = torch.arange(win_size, dtype=torch.float64) - (win_size // 2)
    g = torch.exp(-(k**2) / (2.0 * sigma**2))
    return g / g.sum()


#: The taps as Python floats: ``add_(alpha=...)`` takes a scalar.
_TAPS: tuple[float, ...] = tuple(gaussian_taps().tolist())
_TAPS_NP: np.ndarray = gaussian_taps().numpy()


def _filter_valid(maps: torch.Tensor, dim: int) -> torch.Tensor:
    """1-D Gaussian correlation along ``dim`` where the window fits ("valid"): size L -> L - 10.

    Eleven shifted views, one fused multiply-add each, in the dtype of ``maps`` (float64 here):
    no float64 convolution is fast on CPU, and the views need no copy (module docstring).
    """
    n = maps.shape[dim] - 2 * RADIUS
    out = maps.narrow(dim, 0, n) * _TAPS[0]
    for k in range(1, WIN_SIZE):
        out.add_(maps.narrow(dim, k, n), alpha=_TAPS[k])
    return out


def _symmetric_pad(x: torch.Tensor, pad: int) -> torch.Tensor:
    """Pad the last two dims by ``pad`` as SciPy's ``mode='reflect'`` (d c b a | a b c d | d c b a),
    which scikit-image's SSIM uses; torch's ``reflect`` mode leaves out the edge pixel, so index."""
    for dim in (-2, -1):
        size = x.shape[dim]
        idx = torch.arange(-pad, size + pad, device=x.device)
        # Half-sample symmetric reflection, folded for pads longer than the image (period 2 size).
        idx = torch.remainder(idx, 2 * size)
        idx = torch.where(idx >= size, 2 * size - 1 - idx, idx)
        x = x.index_select(dim, idx)
    return x


def _ssim_map_valid(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """SSIM map of float64 [n, C, H, W] pairs where the 11x11 window fits: [n, C, H - 10, W - 10].

    Filters u = (x + y) / 2, v = (x - y) / 2 and their squares rather than x, y, x^2, y^2, xy (four
    maps per channel either way): mu_x = M + D, mu_y = M - D, s_x^2 + s_y^2 = 2 (s_u^2 + s_v^2),
    2 s_xy = 2 (s_u^2 - s_v^2). For x == y, v is exactly 0, so numerators and denominators agree to
    the bit and identical images score exactly 1.
    """
    n, c, h, w = x.shape
    maps = torch.empty(n, 4 * c, h, w, dtype=torch.float64, device=x.device)
    u, v, uu, vv = maps.split(c, dim=1)
    torch.add(x, y, out=u).mul_(0.5)
    torch.sub(x, y, out=v).mul_(0.5)
    torch.mul(u, u, out=uu)
    torch.mul(v, v, out=vv)
    # Vertical first: the horizontal pass then runs on 10 fewer rows.
    f = _filter_valid(_filter_valid(maps, -2), -1)
    m_u, m_v, e_uu, e_vv = f.split(c, dim=1)
    a, b = m_u * m_u, m_v * m_v
    var_u, var_v = e_uu.sub_(a), e_vv.sub_(b)  # float64: the cancellation costs ~1e-16, not 1e-6
    c1, c2 = K1**2, K2**2
    num = (a - b).mul_(2.0).add_(c1).mul_((var_u - var_v).mul_(2.0).add_(c2))
    den = a.add_(b).mul_(2.0).add_(c1).mul_(var_u.add_(var_v).mul_(2.0).add_(c2))
    return num.div_(den)


def _ssim_map_numpy(x: np.ndarray, y: np.ndarray, mode: str) -> np.ndarray:
    """SSIM map of one float64 pair [C, H, W] in [0, 1], full size [C, H, W] (NumPy/SciPy).

    The same statistics as :func:`_ssim_map_valid` (u, v and their squares), each axis filtered by
    one :func:`scipy.ndimage.correlate1d` call over all 4 C maps at once; ``mode`` fills the border:
    "reflect" is scikit-image's (half-sample symmetric), "constant" the official code's zero padding.
    Interior pixels (5 from every side) do not depend on ``mode``.
    """
    c = x.shape[0]
    # In-place arithmetic on two buffers: fresh 1-5 MB temporaries would each fault their pages in.
    maps = np.empty((4 * c,) + x.shape[1:])
    u, v, uu, vv = maps[:c], maps[c : 2 * c], maps[2 * c : 3 * c], maps[3 * c :]
    np.add(x, y, out=u)
    u *= 0.5
    np.subtract(x, y, out=v)
    v *= 0.5
    np.multiply(u, u, out=uu)
    np.multiply(v, v, out=vv)
    work = np.empty_like(maps)
    correlate1d(maps, _TAPS_NP, axis=-2, output=work, mode=mode)
    correlate1d(work, _TAPS_NP, axis=-1, output=maps, mode=mode)
    m_u, m_v, var_u, var_v = maps[:c], maps[c : 2 * c], maps[2 * c : 3 * c], maps[3 * c :]
    a, b, num, den = work[:c], work[c : 2 * c], work[2 * c : 3 * c], work[3 * c :]
    np.multiply(m_u, m_u, out=a)
    np.multiply(m_v, m_v, out=b)
    var_u -= a
    var_v -= b
    c1, c2 = K1**2, K2**2
    # num = (2 (a - b) + C1)(2 (var_u - var_v) + C2), den = (2 (a + b) + C1)(2 (var_u + var_v) + C2)
    np.subtract(a, b, out=num)
    num *= 2.0
    num += c1
    np.add(a, b, out=den)
    den *= 2.0
    den += c1
    np.subtract(var_u, var_v, out=a)
    a *= 2.0
    a += c2
    num *= a
    var_u += var_v
    var_u *= 2.0
    var_u += c2
    den *= var_u
    return np.divide(num, den, out=num)


def default_ssim_workers() -> int:
    """Threads of the CPU SSIM loops: ``FEDMJP_SSIM_WORKERS`` or ``min(2, cpu_count)``."""
    env = os.environ.get(SSIM_WORKERS_ENV)
    if env is not None:
        try:
            return max(1, int(env))
        except ValueError as err:
            raise ValueError(f"{SSIM_WORKERS_ENV} must be an integer, got {env!r}") from err
    return min(2, os.cpu_count() or 1)


def _per_image_numpy(reconstruction: torch.Tensor, reference: torch.Tensor, workers: Optional[int],
                     reduce: Callable[[np.ndarray, int], Any]) -> list[Any]:
    """``reduce(map [C, H, W], index)`` for every image of a checked pair on the CPU, in order.

    A Python thread pool rather than torch threads: NumPy's ufuncs and SciPy's correlate1d release
    the GIL, and independent threads keep their speed when other processes share the cores, where
    torch's OpenMP barriers do not (module docstring). ``reduce`` runs in the worker too, so maps
    need not be kept.
    """
    n_workers = default_ssim_workers() if workers is None else max(1, int(workers))
    out: list[Any] = []
    with ThreadPoolExecutor(max_workers=n_workers) as pool:
        start = 0
        for x, y in float64_chunks(reconstruction, reference):
            tasks = zip(x.numpy(), y.numpy(), range(start, start + x.shape[0]))
            out.extend(pool.map(lambda t: reduce(_ssim_map_numpy(t[0], t[1], "reflect"), t[2]), tasks))
            start += x.shape[0]
    return out


def _interior_mean(smap: np.ndarray) -> float:
    """scikit-image's SSIM from its full map [C, H, W]: the mean without the 5-pixel border."""
    return float(smap[:, RADIUS:-RADIUS, RADIUS:-RADIUS].mean())


def _prepare(reconstruction: torch.Tensor, reference: torch.Tensor, pad: int, validate: bool) -> None:
    if validate:
        check_pair(reconstruction, reference)
    if min(reference.shape[-2:]) + 2 * pad < WIN_SIZE:
        raise ValueError(f"ssim needs images of at least 11x11 pixels, got {tuple(reference.shape[-2:])}")


def _float64(t: torch.Tensor) -> torch.Tensor:
    """A float64 copy clipped to [0, 1] on the tensor's device (copy: the clamp is in place)."""
    return t.detach().to(torch.float64, copy=True).clamp_(0.0, 1.0)


def _ssim_batched(reconstruction: torch.Tensor, reference: torch.Tensor, pad: int, validate: bool) -> torch.Tensor:
    _prepare(reconstruction, reference, pad, validate)
    out = []
    with torch.inference_mode():
        for start in range(0, reference.shape[0], CHUNK):
            x = _float64(reconstruction[start : start + CHUNK])
            y = _float64(reference[start : start + CHUNK])
            if pad:
                x, y = F.pad(x, (pad,) * 4), F.pad(y, (pad,) * 4)
            out.append(_ssim_map_valid(x, y).mean(dim=(1, 2, 3)))
    return torch.cat(out).cpu()


def ssim_torch(reconstruction: torch.Tensor, reference: torch.Tensor, validate: bool = True) -> torch.Tensor:
    """SSIM per image as ``skimage.metrics.structural_similarity`` with ``data_range=1``,
    ``channel_axis`` over RGB, ``gaussian_weights=True``, ``sigma=1.5``, ``use_sample_covariance=False``.

    Args:
        reconstruction, reference: [B, 3, H, W] in [0, 1] (any float dtype and device), H, W >= 11.
        validate: run the input checks (the scorer validates once and passes False).
    Returns:
        [B] CPU float64 in [-1, 1]; exactly 1 for identical images; lower = more private. Agrees
        with scikit-image to ~1e-14 (float64 throughout, module docstring).
    """
    return _ssim_batched(reconstruction, reference, pad=0, validate=validate)


def ssim_scipy(
    reconstruction: torch.Tensor, reference: torch.Tensor, workers: Optional[int] = None, validate: bool = True
) -> torch.Tensor:
    """SSIM per image as :func:`ssim_torch`, computed with NumPy/SciPy in float64 on the CPU, one
    image per task of a thread pool (the CPU path of :func:`metrics.ssim`).

    Args:
        reconstruction, reference: [B, 3, H, W] in [0, 1] (any float dtype and device), H, W >= 11.
        workers: threads; default ``FEDMJP_SSIM_WORKERS`` or ``min(2, cpu_count)``. The result does
            not depend on it.
        validate: run the input checks.
    Returns:
        [B] CPU float64 in [-1, 1]; exactly 1 for identical images; scikit-image's values to ~1e-14.
    """
    _prepare(reconstruction, reference, 0, validate)
    values = _per_image_numpy(reconstruction, reference, workers, lambda smap, i: _interior_mean(smap))
    return torch.tensor(values, dtype=torch.float64)


def ssim_with_map(
    reconstruction: torch.Tensor, reference: torch.Tensor, workers: Optional[int] = None, validate: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """SSIM per image and the full SSIM map, as ``structural_similarity(..., full=True)``.

    The map covers every pixel: like scikit-image, the border is filled by SciPy's ``reflect`` mode
    (half-sample symmetric); the per-image value is the mean over the map without its 5-pixel
    border, so one call serves both the image score and region means
    (:func:`metrics.regions.masked_map_mean`). CPU tensors run on NumPy/SciPy in a thread pool
    (as :func:`ssim_scipy`), other devices on torch.

    Args:
        reconstruction, reference: [B, 3, H, W] in [0, 1] (any float dtype and device), H, W >= 11.
        workers: CPU threads (as :func:`ssim_scipy`).
        validate: run the input checks.
    Returns:
        (ssim [B], map [B, 3, H, W]): CPU float64; ``map[b, c]`` is scikit-image's ``S[..., c]``
        (channel_axis=-1) to ~1e-12, ``ssim[b]`` its SSIM to ~1e-14.
    """
    _prepare(reconstruction, reference, 0, validate)
    if reference.device.type == "cpu" and reconstruction.device.type == "cpu":
        pairs = _per_image_numpy(reconstruction, reference, workers, lambda smap, i: (_interior_mean(smap), smap))
        return torch.tensor([v for v, _ in pairs], dtype=torch.float64), torch.from_numpy(np.stack([m for _, m in pairs]))
    return ssim_with_map_torch(reconstruction, reference)


def ssim_region_means(
    reconstruction: torch.Tensor, reference: torch.Tensor, pixels: torch.Tensor, workers: Optional[int] = None,
    validate: bool = True,
) -> torch.Tensor:
    """Mean of scikit-image's full SSIM map (:func:`ssim_with_map`) over channels, then over the
    pixels where ``pixels`` is True, per image, on the CPU; the maps are reduced in the worker
    threads and never stacked.

    Args:
        reconstruction, reference: [B, 3, H, W] in [0, 1], H, W >= 11.
        pixels: [B, H, W] bool.
        workers: threads (as :func:`ssim_scipy`).
        validate: run the input checks.
    Returns:
        [B] float64; NaN where ``pixels`` selects nothing.
    """
    _prepare(reconstruction, reference, 0, validate)
    sel = pixels.detach().to("cpu", torch.bool).numpy()

    def region_mean(smap: np.ndarray, i: int) -> float:
        # Channel mean first, as scikit-image's smap.mean(axis=2)[sel].mean().
        return float(smap.mean(axis=0)[sel[i]].mean()) if sel[i].any() else math.nan

    return torch.tensor(_per_image_numpy(reconstruction, reference, workers, region_mean), dtype=torch.float64)


def ssim_with_map_torch(reconstruction: torch.Tensor, reference: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`ssim_with_map` in torch on the tensors' device (a checked pair)."""
    values_t, maps_t = [], []
    with torch.inference_mode():
        for start in range(0, reference.shape[0], CHUNK):
            x = _symmetric_pad(_float64(reconstruction[start : start + CHUNK]), RADIUS)
            y = _symmetric_pad(_float64(reference[start : start + CHUNK]), RADIUS)
            full = _ssim_map_valid(x, y)
            values_t.append(full[..., RADIUS:-RADIUS, RADIUS:-RADIUS].mean(dim=(1, 2, 3)))
            maps_t.append(full)
    return torch.cat(values_t).cpu(), torch.cat(maps_t).cpu()


def ssim_official(reconstruction: torch.Tensor, reference: torch.Tensor, validate: bool = True) -> torch.Tensor:
    """SSIM per image as the official MJP evaluation (``eval/basic.py``, pytorch-ssim): 11x11
    Gaussian window (sigma 1.5), zero padding of 5 pixels, mean over the whole [3, H, W] map.

    The official code ran in float32 on saved 8-bit PNGs; this computes the same formula in float64
    (use :func:`metrics.quantize_8bit` for the PNG step).

    Args:
        reconstruction, reference: [B, 3, H, W] in [0, 1].
        validate: run the input checks.
    Returns:
        [B] CPU float64; 1 for identical images; lower = more private.
    """
    return _ssim_batched(reconstruction, reference, pad=RADIUS, validate=validate)
