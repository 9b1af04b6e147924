"""Registered PSNR (rPSNR): the PSNR of a reconstruction after aligning it to the reference by a
similarity transform, as breaching reports it (``breaching.analysis.metrics.registered_psnr_compute``).

A gradient-inversion attack that recovers an image shifted, rotated or rescaled by a few pixels has
read the image, yet scores a low plain PSNR; rPSNR is the score that does not punish that. The
definition is breaching's, so that numbers compare across suites: kornia's ``ImageRegistrator``
with a ``"similarity"`` model (rotation, isotropic scale, translation), 2,500 iterations at most
per pyramid level, the reconstruction warped into the reference's frame by a ``HomographyWarper``
with reflection padding, on kornia's default 5-level pyramid (fewer for images below 16 px, which
it cannot halve that often); the value is the larger of the registered and the plain PSNR.

One difference, on purpose: breaching scores each warped image against the whole reference batch
(``((warped_img - ref_batch) ** 2).mean()``), so its value for a batch of several images mixes
the other images in; here each image is scored against its own reference. On batches of one the
two agree (``tests/test_registered_psnr.py`` compares them on the same pairs).

Written on kornia (a maintained library) rather than by hand: its registrator is the reference
implementation breaching calls.
"""
from __future__ import annotations

import functools
import math

import torch

from ._validate import check_pair

#: breaching's settings (``_registered_psnr_compute_kornia``): the transform model and the
#: iterations of its optimiser per pyramid level.
REGISTRATION_MODEL = "similarity"
REGISTRATION_ITERATIONS = 2500


#: kornia's (and so breaching's) number of pyramid levels, kept wherever the image allows it.
PYRAMID_LEVELS = 5


def pyramid_levels(side: int) -> int:
    """Pyramid levels for an image whose shorter side is ``side``: breaching's 5 from 16 px on,
    fewer below (kornia's pyramid pads each level by 2 pixels before halving it, which a 2 px
    level cannot take)."""
    return max(1, min(PYRAMID_LEVELS, int(math.floor(math.log2(max(side, 1))))))


def _psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    mse = float((a.double() - b.double()).pow(2).mean())
    return float("inf") if mse == 0.0 else -10.0 * torch.log10(torch.tensor(mse, dtype=torch.float64)).item()


def psnr_registered(reconstruction: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """[B] float64 rPSNR (dB) of each reconstruction against its reference (module docstring).

    Args:
        reconstruction, reference: [B, 3, H, W] in [0, 1].
    Raises:
        ValueError: invalid images.
        ImportError: kornia is not installed (it is a dependency of the package).
    """
    from kornia.geometry import HomographyWarper, ImageRegistrator

    check_pair(reconstruction, reference)
    out = torch.empty(reconstruction.shape[0], dtype=torch.float64)
    with torch.enable_grad():  # the registrator optimises its transform by gradient descent
        for i, (img, ref) in enumerate(zip(reconstruction.detach().float().cpu(), reference.detach().float().cpu())):
            img, ref = img[None], ref[None]
            plain = _psnr(img, ref)
            if plain == float("inf"):
                out[i] = plain
                continue
            registrator = ImageRegistrator(REGISTRATION_MODEL, num_iterations=REGISTRATION_ITERATIONS,
                                           pyramid_levels=pyramid_levels(min(img.shape[-2:])))
            # kornia annotates the warper as a class; it only calls it, and a partial is how breaching sets it
            registrator.warper = functools.partial(HomographyWarper, padding_mode="reflection")  # type: ignore[assignment]
            registrator.register(img, ref)
            with torch.no_grad():
                warped = registrator.warp_src_into_dst(img)
            registered = _psnr(warped, ref)
            out[i] = max(plain, registered) if registered == registered else plain
    return out
