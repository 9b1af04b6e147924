"""The terms of april_robust's least squares besides the equations: the defence's noise model and
the image priors.

:class:`NoiseModel` is the std of the received update's entries: from the defence the metadata names
(:func:`defence_noise`, Kerckhoffs: what :meth:`defences.spec.DefenceSpec.observation` says it does,
scaled to gradient units by :meth:`attacks.api.base.AttackMetadata.defence_noise`), or unknown (read off
the update by the attack); :func:`noise_floor` is the smallest std assumed for a tensor. The priors:
the smoothness prior's normal operator and energy (:func:`smooth_normal`, :func:`smooth_energy`:
squared horizontal and vertical pixel differences) and the Gaussian patch prior as a quadratic term
(:class:`PatchPriorTerm`). Used by :mod:`attacks.closed_form.april_robust`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.nn.functional as F

from defences.spec import DefenceSpec
from defences.transforms import quantizer_step

from ..api.base import AttackMetadata
from .priors import PatchPrior

_DT = torch.float64  # the precision april_robust solves in


def noise_floor(t: torch.Tensor) -> float:
    """The smallest noise std assumed for a tensor: float64 rounding of its entries."""
    return 1e-13 * float(t.pow(2).mean().sqrt()) + 1e-150


def smooth_normal(img: torch.Tensor, edge: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> torch.Tensor:
    """L^T diag(edge) L img for L the horizontal and vertical pixel differences of [C, H, W] images
    (``edge``: per-difference weights of the x and y differences, None for all ones)."""
    out = torch.zeros_like(img)
    dx = img[..., :, 1:] - img[..., :, :-1]
    dy = img[..., 1:, :] - img[..., :-1, :]
    if edge is not None:
        dx, dy = dx * edge[0], dy * edge[1]
    out[..., :, 1:] += dx
    out[..., :, :-1] -= dx
    out[..., 1:, :] += dy
    out[..., :-1, :] -= dy
    return out


def smooth_energy(img: torch.Tensor) -> tuple[float, int]:
    """(sum of the squared horizontal and vertical pixel differences of ``img``, their number): the
    smoothness prior's energy, from which its weight is chosen."""
    dx = img[..., :, 1:] - img[..., :, :-1]
    dy = img[..., 1:, :] - img[..., :-1, :]
    return float(dx.pow(2).sum() + dy.pow(2).sum()), dx.numel() + dy.numel()


@dataclass
class NoiseModel:
    """The noise model of the received update's entries, and where it came from.

    ``std``: i.i.d. additive noise std per entry in gradient units (local DP, DP-SGD); ``quant``:
    (bits, stochastic) of a per-tensor quantiser; ``prune_keep``: the kept share of a top-k pruning
    (zeros are missing entries). ``known`` is False when
    nothing about the perturbation is known and the noise is read off the update."""

    source: str = "estimate"
    description: str = "unknown: noise std read off the update's redundancy"
    std: float = 0.0
    quant: Optional[tuple[int, bool]] = None
    prune_keep: Optional[float] = None
    notes: list[str] = field(default_factory=list)

    @property
    def known(self) -> bool:
        return self.std > 0 or self.quant is not None

    def tensor_std(self, t: torch.Tensor) -> Optional[float]:
        """The noise std of one received tensor's entries, or None when unknown."""
        if not self.known:
            return None
        var = self.std ** 2
        if self.quant is not None:
            bits, stochastic = self.quant
            m = float(t.abs().max())  # the largest level is max|u| itself (bits > 1), mean|u| (bits = 1)
            if bits == 1:
                var += m ** 2 / 3
            else:
                step = quantizer_step(m, bits)
                # nearest level: uniform error on [-step/2, step/2]; unbiased stochastic rounding:
                # variance p (1 - p) step^2, 1/6 step^2 on average over the position p in the step
                var += step ** 2 / (6 if stochastic else 12)
        return math.sqrt(var)

    def as_dict(self) -> dict[str, Any]:
        return dict(source=self.source, model=self.description, std=self.std,
                    quant_bits=None if self.quant is None else self.quant[0],
                    quant_stochastic=None if self.quant is None else self.quant[1], prune_keep=self.prune_keep)


def defence_noise(spec: DefenceSpec, meta: AttackMetadata) -> NoiseModel:
    """The noise model of the defence spec in the metadata (Kerckhoffs: what the defence states it
    does, :meth:`defences.spec.DefenceSpec.observation`); an unmodelled defence gives the estimating
    model with a note saying why."""
    obs, src = spec.observation(), "defence metadata"
    if obs is None:
        return NoiseModel(notes=[f"defence {spec.name!r} in metadata is not modelled by april_robust: treated as "
                                 "unknown, noise estimated"])
    if not obs.perturbs:
        return NoiseModel(src, f"{obs.what}: noise std read off the update's redundancy")
    if obs.noise is not None and obs.per_example:
        # per-sample clip (a common factor at batch 1), Gaussian noise on the sum, / batch size; a
        # FedAvg delta's mean gradient averages ``local_steps`` independent draws
        std, _ = meta.defence_noise(obs)
        steps = 1 if meta.update_type == "gradient" else max(meta.local_steps, 1)
        return NoiseModel(src, f"dp_sgd: Gaussian noise, std {std:.3g} per entry of the mean gradient (sigma "
                               f"{obs.sigma} x clip {obs.clip} / batch {meta.num_images}"
                               + (f" / sqrt({steps} steps)" if steps > 1 else "") + ")", std=std)
    if obs.noise is not None:
        # the clip scales every equation alike (X unchanged); Laplace noise is modelled by its variance
        laplace = obs.noise == "laplace"
        std = meta.defence_noise(obs)[0] * (math.sqrt(2) if laplace else 1.0)
        desc = (f"local_dp: i.i.d. {'Laplace (by its variance)' if laplace else 'Gaussian'} noise, std {std:.3g} "
                f"per entry (sigma {obs.sigma} x clip {obs.clip}" + (", x sqrt 2" if laplace else "")
                + (", / (lr steps) of the delta" if abs(meta.gradient_scale) != 1 else "") + ")")
        return NoiseModel(src, desc, std=std)
    if obs.quant_bits is not None:
        bits, stochastic = obs.quant_bits, obs.quant_stochastic
        kind = "sign x mean|u| per tensor" if bits == 1 else (
            f"{2 ** bits} levels per tensor, {'stochastic' if stochastic else 'nearest'} rounding error of the step")
        return NoiseModel(src, f"quantize {bits} bit: {kind}", quant=(bits, stochastic))
    return NoiseModel(src, f"prune keep {obs.prune_keep}: zeros are missing entries, the kept ones exact (their "
                           "rounding estimated)", prune_keep=obs.prune_keep)


class PatchPriorTerm:
    """The Gaussian patch prior as a quadratic term of the normalised image ``img`` [1, C, H, W]:
    sum over every p x p patch at every offset of (u_p - mu)^T Lambda (u_p - mu), u = std img + mean
    the pixels in [0, 1]. ``torch.nn.functional.unfold``/``fold`` are the patch extraction and its adjoint."""

    def __init__(self, prior: PatchPrior, meta: AttackMetadata, info, device: torch.device) -> None:
        p, C = prior.patch, info.channels
        self.p, self.size = p, (info.grid[0] * p, info.grid[1] * p)
        self.s = meta.std.to(device, _DT).reshape(1, C, 1, 1)
        self.lam_mat = torch.from_numpy(prior.precision).to(device, _DT)
        # u_p - mu = unfold(std img) - c, c = mu - mean (per channel, repeated over the patch)
        self.c = torch.from_numpy(prior.mean).to(device, _DT) - meta.mean.to(device, _DT).repeat_interleave(p * p)
        self.count = (self.size[0] - p + 1) * (self.size[1] - p + 1)
        ones = torch.ones(1, self.c.numel(), self.count, dtype=_DT, device=device)
        self.rhs_img = self.s * F.fold(self.lam_mat @ self.c[:, None] * ones, self.size, p)
        self.diag_img = self.s ** 2 * F.fold(self.lam_mat.diagonal()[:, None] * ones, self.size, p)

    def apply(self, img: torch.Tensor) -> torch.Tensor:
        """The term's Hessian (halved) times ``img``: std fold(Lambda unfold(std img))."""
        return self.s * F.fold(self.lam_mat @ F.unfold(self.s * img, self.p), self.size, self.p)

    def energy(self, img: torch.Tensor) -> tuple[float, int]:
        """(sum of squared Mahalanobis distances, number of patch values)."""
        r = F.unfold(self.s * img, self.p)[0] - self.c[:, None]
        return float((r * (self.lam_mat @ r)).sum()), r.numel()
