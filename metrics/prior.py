"""What a server reaches without reading any update: the best fixed guess against a prior of images.

A reconstruction attack is measured against this baseline (the ReRo bound of
:mod:`defences.rero` starts from it): for a PSNR threshold eta, kappa(eta) is the largest share of
the prior's images that one fixed image g, chosen before the update is seen, reaches with
PSNR(z, g) >= eta. The prior is a sample of images from the clients' distribution (the data set the
targets come from); the guesses are its mean image, every one of its images (each scored against
the others only) and any ``guesses`` given (the flat image of the normalisation mean, say). Both are
estimates from the sample: the supremum over every image is at least the best of these guesses, and
a share below 1 / (sample size) is not resolved (:func:`guess_psnr` returns +inf there).
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from ._validate import check_image_batch
from .pixel import psnr_from_mse

#: Prior images scored against each other at most, and pixel values (N x 3 x H x W, held in float64)
#: at most: their pairwise PSNR is N^2 values (tests/test_rero.py: test_the_prior_is_bounded).
MAX_PRIOR_IMAGES = 4096
MAX_PRIOR_VALUES = 2 ** 27


def _psnr_rows(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[len(a), len(b)] PSNR (dB) of every pair of flattened images, by the Gram matrix (no
    len(a) x len(b) x pixels tensor)."""
    d = a.pow(2).sum(1)[:, None] + b.pow(2).sum(1)[None, :] - 2.0 * a @ b.T
    return psnr_from_mse(d.clamp_min(0.0) / a.shape[1])


def _guess_psnr_matrix(prior: torch.Tensor, guesses: Optional[torch.Tensor]) -> list[torch.Tensor]:
    """Per guess, the PSNR (dB) of every prior image it is scored against: the mean image, each extra
    guess, then each prior image against the others."""
    check_image_batch(prior, "prior")
    if len(prior) < 2:
        raise ValueError(f"the prior needs at least 2 images, got {len(prior)}")
    if len(prior) > MAX_PRIOR_IMAGES or prior.numel() > MAX_PRIOR_VALUES:
        raise ValueError(f"the prior holds {len(prior)} images of {tuple(prior.shape[1:])}; at most {MAX_PRIOR_IMAGES} "
                         f"images and {MAX_PRIOR_VALUES} values are scored against each other (take a smaller sample)")
    x = prior.detach().to("cpu", torch.float64).flatten(1).clamp(0.0, 1.0)
    g = [x.mean(0, keepdim=True)]
    if guesses is not None:
        check_image_batch(guesses, "guesses")
        if guesses.shape[1:] != prior.shape[1:]:
            raise ValueError(f"guesses {tuple(guesses.shape[1:])} and prior {tuple(prior.shape[1:])} differ in size")
        g.append(guesses.detach().to("cpu", torch.float64).flatten(1).clamp(0.0, 1.0))
    fixed = _psnr_rows(torch.cat(g), x)
    own = _psnr_rows(x, x)[~torch.eye(len(x), dtype=torch.bool)].reshape(len(x), len(x) - 1)
    return list(fixed) + list(own)


def guess_share(prior: torch.Tensor, eta: float, guesses: Optional[torch.Tensor] = None) -> float:
    """kappa(eta): the largest share of ``prior`` [N, 3, H, W] in [0, 1] that one fixed guess
    reaches with PSNR >= ``eta`` dB (module docstring)."""
    return max(float((v >= eta).double().mean()) for v in _guess_psnr_matrix(prior, guesses))


def guess_psnr(prior: torch.Tensor, share: float, guesses: Optional[torch.Tensor] = None) -> float:
    """The highest PSNR (dB) that one fixed guess reaches on at least ``share`` of ``prior``: the
    largest eta with :func:`guess_share` >= ``share``. +inf where ``share`` is below what the sample
    resolves (less than one image per guess) or is 0.

    Raises:
        ValueError: ``share`` outside [0, 1], or a bad prior (:func:`metrics.check_image_batch`).
    """
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"the share must be in [0, 1], got {share}")
    best = -math.inf
    for v in _guess_psnr_matrix(prior, guesses):
        if share * len(v) < 1.0:  # below one image: the sample does not resolve it
            return math.inf
        k = math.ceil(share * len(v) - 1e-9)
        best = max(best, float(torch.sort(v, descending=True).values[k - 1]))
    return best
