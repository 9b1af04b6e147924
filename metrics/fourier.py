"""Fourier-space similarity: the official-code FFT2D distance and a Hermitian cosine similarity.

Let F be the unshifted 2-D DFT applied to each channel and R the circular point reflection,
``(R y)[c, i, j] = y[c, -i mod H, -j mod W]``. For real x, y of N = H*W pixels per channel:

* ``sum_k F(x)_k F(y)_k = N <x, R y>`` (a product *without* conjugation), and
* ``sum_k F(x)_k conj(F(y)_k) = N <x, y>`` (Parseval).

The official MJP code (``eval/cal_fft2d.py``) flattens ``np.fft.fft2`` of the [1, 3, H, W] image
and passes the complex vectors to ``scipy.spatial.distance.cosine``, which (in the SciPy versions it
ran with) computed ``1 - u.v / sqrt((u.u)(v.v))`` with plain, non-conjugated dot products; it then
took the modulus. Hence

    fft2d(x, y) = | 1 - <x, R y> / sqrt(<x, R x> <y, R y>) |                    (official column)

which is what :func:`fft2d` computes, exactly, in the pixel domain (recent SciPy refuses complex
input). For images in [0, 1], ``<x, R x> >= 0``. It is not a proper cosine (the bilinear form
``<u, R v>`` is indefinite), so values can exceed 1; higher = more private.

:func:`fft2d_hermitian` is the proper cosine similarity in Fourier space,
``Re <F(x), F(y)> / (|F(x)| |F(y)|)``, which by Parseval equals the pixel-space cosine
``<x, y> / (|x| |y|)``: 1 for identical images, invariant to scaling either image by a positive
constant; lower = more private.

Zero-energy images, where the official code divides by 0 (an all-black image; for fft2d any image
with ``<x, R x> = 0``): :func:`fft2d_clamped` returns 0 as the official script did (see there).
:func:`fft2d` and :func:`fft2d_hermitian` call an image's energy (``<x, R x>``, resp. ``<x, x>``)
zero when it is at most ``N * ZERO_ENERGY_LEVEL**2`` for N values per image, i.e. when its
root-mean-square is below half an 8-bit step of the [0, 1] scale: such an image is black to 8-bit
precision, and its cosine is rounding noise. Two such images score as identical (distance 0,
similarity 1) and one as orthogonal to anything (distance 1, similarity 0), so that a black
reconstruction scores as a finite "nothing recovered" instead of NaN/Inf, and a near-black
reconstruction of a black image (PSNR over 100 dB) scores as identical, as PSNR says.
"""
from __future__ import annotations

import torch

from ._inner import pair_gram


def point_reflect(images: torch.Tensor) -> torch.Tensor:
    """Circular point reflection R of the last two axes: ``out[..., i, j] = images[..., -i % H, -j % W]``.

    Args:
        images: [..., H, W].
    Returns:
        [..., H, W], same dtype.
    """
    return images.flatten(-2)[..., _reflection_index(images.shape[-2], images.shape[-1], images.device)].unflatten(
        -1, images.shape[-2:]
    )


def _reflection_index(h: int, w: int, device: torch.device) -> torch.Tensor:
    """[H*W] flat indices of R: position (i, j) reads (-i mod H, -j mod W); one gather instead of flip+roll."""
    rows = (-torch.arange(h, device=device)) % h
    cols = (-torch.arange(w, device=device)) % w
    return (rows[:, None] * w + cols[None, :]).flatten()


#: Root-mean-square pixel value (on the [0, 1] scale) below which an image's energy counts as zero:
#: half an 8-bit step.
ZERO_ENERGY_LEVEL = 0.5 / 255


def _zero_energy(energy: torch.Tensor, numel: int) -> torch.Tensor:
    """[B] bool: ``energy`` (a sum over ``numel`` values per image) is at most ``numel * ZERO_ENERGY_LEVEL**2``."""
    return energy.abs() <= numel * ZERO_ENERGY_LEVEL**2


def _ratio(num: torch.Tensor, den_sq: torch.Tensor, x_zero: torch.Tensor, y_zero: torch.Tensor) -> torch.Tensor:
    """num / sqrt(den_sq) with the zero-energy conventions of the module docstring."""
    safe = torch.where(den_sq > 0, den_sq, torch.ones_like(den_sq))
    out = num / torch.sqrt(safe)
    out = torch.where(x_zero | y_zero, torch.zeros_like(out), out)
    return torch.where(x_zero & y_zero, torch.ones_like(out), out)


def fft2d_from_gram(gram: torch.Tensor, numel: int) -> torch.Tensor:
    """:func:`fft2d` [B] from :func:`metrics._inner.pair_gram` output [B, 5, 5] of images of ``numel`` values."""
    xy, xx, yy = gram[:, 0, 4], gram[:, 0, 3], gram[:, 1, 4]  # <x,Ry>, <x,Rx>, <y,Ry>
    return torch.abs(1.0 - _ratio(xy, xx * yy, _zero_energy(xx, numel), _zero_energy(yy, numel)))


def fft2d_clamped_from_gram(gram: torch.Tensor) -> torch.Tensor:
    """:func:`fft2d_clamped` [B] from :func:`metrics._inner.pair_gram` output [B, 5, 5]."""
    xy, xx, yy = gram[:, 0, 4], gram[:, 0, 3], gram[:, 1, 4]
    den_sq = xx * yy
    dist = torch.abs(1.0 - xy / torch.sqrt(torch.where(den_sq > 0, den_sq, torch.ones_like(den_sq))))
    # Old SciPy: 0/0 -> NaN, then max(0, min(NaN, 2.0)) = 0 (Python's min/max keep the first
    # argument when a comparison with NaN is False).
    return torch.where(den_sq > 0, dist.clamp(max=2.0), torch.zeros_like(dist))


def fft2d_hermitian_from_gram(gram: torch.Tensor, numel: int) -> torch.Tensor:
    """:func:`fft2d_hermitian` [B] from :func:`metrics._inner.pair_gram` output [B, k, k] of images of
    ``numel`` values."""
    xx, yy = gram[:, 0, 0], gram[:, 1, 1]
    return _ratio(gram[:, 0, 1], xx * yy, _zero_energy(xx, numel), _zero_energy(yy, numel))


def fft2d(reconstruction: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """Official-code-compatible FFT2D distance (the paper's FFT2D column).

    ``| 1 - <x, R y> / sqrt(<x, R x> <y, R y>) |`` with inner products over all channels and pixels
    of one image, equal to SciPy's cosine distance of the flattened non-conjugated per-channel
    ``fft2`` as the official code evaluates it (module docstring), without SciPy's clamp to [0, 2]
    (see :func:`fft2d_clamped`) and with this module's zero-energy conventions.

    Args:
        reconstruction, reference: [B, 3, H, W] in [0, 1].
    Returns:
        [B] float64 >= 0; 0 for identical images; higher = more private.
    """
    return fft2d_from_gram(pair_gram(reconstruction, reference), reference[0].numel())


def fft2d_clamped(reconstruction: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """FFT2D exactly as the official script's SciPy evaluated it: :func:`fft2d` clamped to [0, 2],
    and 0 where either image has zero energy (``<x, R x> = 0``, e.g. an all-black image).

    The official script ran with Python 3.6 / PyTorch 1.6, so SciPy <= 1.5, whose
    ``cosine(u, v) = max(0, min(correlation(u, v, centered=False), 2.0))`` and whose ``correlation``
    returned ``np.abs(1 - mean(u*v) / np.sqrt(mean(u*u) * mean(v*v)))`` for complex input. For an
    all-black image that is 0/0 = NaN, and Python's ``min(NaN, 2.0)`` is NaN, ``max(0, NaN)`` is 0:
    the official FFT2D of a black reconstruction is 0, the "identical" value. Current SciPy rejects
    complex input (TypeError), so this reproduces that arithmetic instead of calling SciPy.

    Args:
        reconstruction, reference: [B, 3, H, W] in [0, 1].
    Returns:
        [B] float64 in [0, 2]; 0 for identical images; higher = more private.
    """
    return fft2d_clamped_from_gram(pair_gram(reconstruction, reference))


def fft2d_hermitian(reconstruction: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """Hermitian cosine similarity of the per-channel 2-D DFTs: ``Re<F(x), F(y)> / (|F(x)| |F(y)|)``.

    Equal (Parseval) to the pixel-space cosine ``<x, y> / (|x| |y|)`` over all channels and pixels.

    Args:
        reconstruction, reference: [B, 3, H, W] in [0, 1].
    Returns:
        [B] float64 in [0, 1] for non-negative images; 1 for identical images (and for
        ``reconstruction = c * reference``, c > 0); lower = more private.
    """
    return fft2d_hermitian_from_gram(pair_gram(reconstruction, reference, reflect=False), reference[0].numel())
