"""Per-region scores of MJP reconstructions: the unshuffled positions and the shuffled patches as a set.

Why a set: every shuffled token carries the same E_unk and a ViT is permutation-equivariant over
tokens with equal position embeddings, so permuting the shuffled patches among the shuffled
positions S leaves every gradient unchanged (docs/design.md, "Attacking MJP with
knowledge of MJP"). Which true patch sits at which
position of S is therefore unknowable to any gradient attacker; an order-sensitive score of that
region would measure luck. The shuffled region is scored after matching the reconstructed patches
at S to the true patches at S by an assignment on MSE (``scipy.optimize.linear_sum_assignment``).

All functions are pure: images [B, 3, H, W] in [0, 1], ``mask`` [B, N] bool with N = (H/p)(W/p)
patch positions in row-major order (True = shuffled, carries E_unk), patch side ``p`` in pixels.
Scores are per image ([B] float64); an empty region gives NaN.

Per-region metrics: MSE and PSNR over the region's pixels; SSIM as the mean of scikit-image's SSIM
map (``structural_similarity(..., full=True)`` with the settings of :func:`metrics.ssim`: Gaussian
window sigma 1.5, data_range 1, the border filled by reflection) over the region's pixels, averaged
over channels. The map is computed in float64 by :mod:`metrics.structural` (scikit-image's map to
~1e-12, tests/test_ssim_torch.py). The SSIM window (about 11 px) reaches across region borders,
so the region SSIM also sees neighbouring pixels; MSE/PSNR see only the region.

:func:`masked_ssim` reduces each map to its region mean in the worker threads
(:func:`metrics.structural.ssim_region_means`). A caller that also needs the whole-image SSIM of the
same pair can compute the map once with :func:`metrics.structural.ssim_with_map` (it returns both)
and take region means with :func:`masked_map_mean`.
"""
from __future__ import annotations

import math

import numpy as np
import torch
from patchgrid import patchify, unpatchify
from scipy.optimize import linear_sum_assignment

from .structural import ssim_region_means

#: PSNR of a region reproduced exactly (MSE 0) is capped here, as the table caps per-image PSNR.
PSNR_CAP_DB = 100.0


def _check(reconstruction: torch.Tensor, reference: torch.Tensor, mask: torch.Tensor, patch: int) -> None:
    if reconstruction.shape != reference.shape or reconstruction.dim() != 4:
        raise ValueError(f"reconstruction {tuple(reconstruction.shape)} and reference {tuple(reference.shape)} "
                         "must both be [B, 3, H, W]")
    B, _, H, W = reference.shape
    if H % patch or W % patch:
        raise ValueError(f"image size {H}x{W} is not a multiple of the patch size {patch}")
    n = (H // patch) * (W // patch)
    if tuple(mask.shape) != (B, n):
        raise ValueError(f"mask must be [B, N] = [{B}, {n}] for {H}x{W} images and patch {patch}, "
                         f"got {tuple(mask.shape)}")


def to_patches(images: torch.Tensor, patch: int) -> torch.Tensor:
    """[B, C, H, W] -> [B, N, C, p, p] patches in row-major grid order (:func:`patchgrid.patchify`)."""
    return patchify(images, patch)


def from_patches(patches: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """Inverse of :func:`to_patches`: [B, N, C, p, p] -> [B, C, H, W]."""
    p = patches.shape[-1]
    return unpatchify(patches, (height // p, width // p))


def pixel_mask(mask: torch.Tensor, patch: int, height: int, width: int) -> torch.Tensor:
    """[B, N] patch mask -> [B, H, W] bool pixel mask."""
    B = mask.shape[0]
    grid = mask.reshape(B, height // patch, width // patch)
    return grid.repeat_interleave(patch, dim=1).repeat_interleave(patch, dim=2)


def match_shuffled(reconstruction: torch.Tensor, reference: torch.Tensor, mask: torch.Tensor,
                   patch: int) -> tuple[torch.Tensor, list[list[int]]]:
    """Rearrange the reconstruction's patches at S to best match the reference's patches at S.

    For each image, the reconstructed patches at the shuffled positions are assigned to the true
    patches at those positions by a minimum-total-MSE assignment; the unshuffled positions are left
    as they are.

    Returns:
        (arranged [B, 3, H, W], assignment): ``assignment[b][k]`` is the patch position of the
        reconstruction placed at the k-th shuffled position (ascending order) of image b.
    """
    _check(reconstruction, reference, mask, patch)
    B, _, H, W = reference.shape
    rec_p, ref_p = to_patches(reconstruction.double(), patch), to_patches(reference.double(), patch)
    out = rec_p.clone()
    assignment: list[list[int]] = []
    for b in range(B):
        pos = torch.nonzero(mask[b].cpu(), as_tuple=False).flatten()
        if pos.numel() == 0:
            assignment.append([])
            continue
        r = rec_p[b, pos].flatten(1)  # [S, D]
        t = ref_p[b, pos].flatten(1)
        cost = torch.cdist(t, r).pow(2) / r.shape[1]  # cost[k, j]: true patch k vs reconstructed j
        rows, cols = linear_sum_assignment(cost.cpu().numpy())
        chosen = pos[torch.as_tensor(cols[np.argsort(rows)])]
        out[b, pos] = rec_p[b, chosen]
        assignment.append([int(c) for c in chosen])
    return from_patches(out, H, W).to(reconstruction.dtype), assignment


def masked_mse(reconstruction: torch.Tensor, reference: torch.Tensor, pixels: torch.Tensor) -> torch.Tensor:
    """MSE over the pixels where ``pixels`` [B, H, W] is True (all channels); NaN where none."""
    sq = (reconstruction.double() - reference.double()).pow(2).mean(dim=1)  # [B, H, W]
    count = pixels.sum(dim=(1, 2)).double()
    total = (sq * pixels.double()).sum(dim=(1, 2))
    return torch.where(count > 0, total / count.clamp(min=1), torch.full_like(total, math.nan))


def psnr_from_mse(mse: torch.Tensor, cap: float = PSNR_CAP_DB) -> torch.Tensor:
    """10 log10(1 / MSE) in dB for images in [0, 1], capped at ``cap`` (NaN stays NaN)."""
    return (10.0 * torch.log10(1.0 / mse)).clamp(max=cap)


def masked_map_mean(ssim_map: torch.Tensor, pixels: torch.Tensor) -> torch.Tensor:
    """Mean of an SSIM map over channels and then over the pixels where ``pixels`` is True.

    Args:
        ssim_map: [B, C, H, W] float64, e.g. the map of :func:`metrics.structural.ssim_with_map`.
        pixels: [B, H, W] bool.
    Returns:
        [B] float64; NaN where ``pixels`` selects nothing.
    """
    per_pixel = ssim_map.mean(dim=1)  # channel mean first, as scikit-image's smap.mean(axis=2)
    sel = pixels.to(per_pixel.device, torch.bool)
    count = sel.sum(dim=(1, 2))
    total = torch.where(sel, per_pixel, torch.zeros((), dtype=per_pixel.dtype)).sum(dim=(1, 2))
    return torch.where(count > 0, total / count.clamp(min=1), torch.full_like(total, math.nan))


def masked_ssim(reconstruction: torch.Tensor, reference: torch.Tensor, pixels: torch.Tensor) -> torch.Tensor:
    """Mean of the SSIM map (scikit-image's ``full=True`` map, Gaussian sigma 1.5, data_range 1) over
    ``pixels`` [B, H, W] bool; images [B, 3, H, W] in [0, 1], H, W >= 11. Returns [B] float64, NaN
    where ``pixels`` selects nothing."""
    return ssim_region_means(reconstruction, reference, pixels, validate=False)


def region_scores(reconstruction: torch.Tensor, reference: torch.Tensor, mask: torch.Tensor,
                  patch: int) -> dict[str, torch.Tensor]:
    """Scores of the unshuffled positions and of the shuffled patches as a set.

    Args:
        reconstruction, reference: [B, 3, H, W] in [0, 1].
        mask: [B, N] bool, True at the shuffled positions S.
        patch: patch side in pixels.
    Returns:
        ``{mse,psnr,ssim}_{unshuffled,shuffled}``: [B] float64 each (NaN for an empty region); the
        shuffled scores are computed after :func:`match_shuffled`, so they do not depend on the
        arrangement of the patches within S.
    """
    _check(reconstruction, reference, mask, patch)
    B, _, H, W = reference.shape
    rec = reconstruction.detach().double().cpu().clamp(0, 1)
    ref = reference.detach().double().cpu()
    shuffled = pixel_mask(mask.bool().cpu(), patch, H, W)
    arranged, _ = match_shuffled(rec, ref, mask.bool().cpu(), patch)
    out: dict[str, torch.Tensor] = {}
    for region, image, pixels in (("unshuffled", rec, ~shuffled), ("shuffled", arranged, shuffled)):
        m = masked_mse(image, ref, pixels)
        out[f"mse_{region}"] = m
        out[f"psnr_{region}"] = psnr_from_mse(m)
        out[f"ssim_{region}"] = masked_ssim(image, ref, pixels)
    return out


#: Column names :func:`region_scores` returns.
REGION_COLUMNS = tuple(f"{m}_{r}" for r in ("unshuffled", "shuffled") for m in ("mse", "psnr", "ssim"))
