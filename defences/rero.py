"""Reconstruction robustness (ReRo) of the update the server taps: the most any attacker can read.

ReRo (Balle, Cherubin and Hayes, S&P 2022): a mechanism M is (eta, gamma)-ReRo against a prior pi
over the target image z when, for every attacker R and every rest of the batch D-,
P[R(M(D- + z)) reaches eta on z] <= gamma. Without the release the attacker's best is a fixed guess,
which reaches eta with probability kappa(eta) = sup_g P_{z ~ pi}[PSNR(z, g) >= eta] (the baseline,
:func:`metrics.prior.guess_share`). For a release that is mu-Gaussian-DP in the target (Dong, Roth
and Su 2022), reaching eta is a test between "z was in the batch" and "it was not" whose false
alarm rate is at most kappa, so its power is bounded by the Gaussian trade-off curve:

    gamma <= Phi(Phi^-1(kappa) + mu)                       (Hayes, Mahloujifar and Balle, NeurIPS 2023)

which is tight for the Gaussian mechanism itself. :func:`release_mu` gives mu of the update a client
sends under each of fedmjp's defences, at the protocol it was attacked in; :func:`rero_bound` the
bound, and :func:`needed_baseline` its inverse (the baseline kappa at which the bound reaches a given
success rate), which :func:`benchmark.frontier.rero_ceilings` turns into a PSNR ceiling with the prior.

Adjacency is add/remove of the target in its client's batch (the DP-SGD accountant's), so the
sensitivity of a clipped update is clip where the target is the whole batch (its absence sends 0)
and 2 clip otherwise. The attacked release is not subsampled (the server reads the batch the target
is in), so the subsampling amplification of :func:`defences.dp.dp_sgd_epsilon` does not apply to it.
"""
from __future__ import annotations

import math
from typing import Optional

from scipy.stats import norm

from .spec import DefenceSpec, DpSgd, LocalDp


def release_mu(spec: DefenceSpec, batch_size: int, local_steps: int) -> Optional[float]:
    """mu of one client's update as a Gaussian-DP release of one image of its batch (module docstring),
    or None where the tapped update is not a Gaussian mechanism in the image.

    * ``dp_sgd``: each of the ``local_steps`` steps adds N(0, (sigma clip)^2) to a sum of per-image
      gradients clipped to clip: each is 1/sigma-GDP, and they compose to sqrt(local_steps)/sigma.
    * ``local_dp`` with Gaussian noise: clip(u) + N(0, (sigma clip)^2) once: (1 or 2)/sigma, 1 where
      the image is the whole batch (without it the client sends clip(0) = 0), 2 otherwise.
    * ``central_dp``, Laplace noise, every other defence: None (the tap sees the client's clean
      update, or the noise is not Gaussian, or there is no noise).

    Raises:
        ValueError: ``batch_size`` or ``local_steps`` below 1.
    """
    if batch_size < 1 or local_steps < 1:
        raise ValueError(f"need batch_size >= 1 and local_steps >= 1, got {batch_size} and {local_steps}")
    if isinstance(spec, DpSgd):
        return math.inf if spec.sigma == 0 else math.sqrt(local_steps) / spec.sigma
    if isinstance(spec, LocalDp) and spec.noise == "gaussian":
        sensitivity = 1.0 if batch_size == 1 else 2.0
        return math.inf if spec.sigma == 0 else sensitivity / spec.sigma
    return None  # central_dp noises the server's mean, after the tap


def rero_bound(kappa: float, mu: float) -> float:
    """The most likely any attacker reaches a target that a fixed guess reaches with probability
    ``kappa``, from a mu-GDP release: Phi(Phi^-1(kappa) + mu) (module docstring).

    Raises:
        ValueError: ``kappa`` outside [0, 1] or ``mu`` negative or NaN.
    """
    if not 0.0 <= kappa <= 1.0:
        raise ValueError(f"the baseline kappa must be in [0, 1], got {kappa}")
    if not mu >= 0.0:
        raise ValueError(f"mu must be >= 0, got {mu}")
    if kappa in (0.0, 1.0) or mu == 0.0:
        return float(kappa)
    if math.isinf(mu):
        return 1.0
    return float(norm.cdf(norm.ppf(kappa) + mu))


def needed_baseline(success: float, mu: float) -> float:
    """The baseline kappa at which :func:`rero_bound` equals ``success``: Phi(Phi^-1(success) - mu).
    A target a fixed guess reaches less often than this is reached with probability below
    ``success`` by every attacker of a mu-GDP release (0.0: no such target, mu is infinite).

    Raises:
        ValueError: ``success`` outside (0, 1) or ``mu`` negative or NaN.
    """
    if not 0.0 < success < 1.0:
        raise ValueError(f"the success rate must be in (0, 1), got {success}")
    if not mu >= 0.0:
        raise ValueError(f"mu must be >= 0, got {mu}")
    if math.isinf(mu):
        return 0.0
    return float(norm.cdf(norm.ppf(success) - mu))
