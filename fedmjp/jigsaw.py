"""Jigsaw shuffle of the selected patch positions, its inverse, and the SPP baseline.

A :class:`JigsawPlan` describes one shuffle of a batch: ``mask[b, i]`` says whether position ``i``
of sample ``b`` was selected, and ``perm[b, i]`` is the source position whose patch lands at ``i``
(``x~[b, i] = x[b, perm[b, i]]``). ``perm[b, i] == i`` wherever ``mask[b, i]`` is False, so only the
selected patches move, and only among the selected positions.

Shuffling pixels before the patch embedding and shuffling patch tokens after it are the same thing
(the embedding acts on each patch alone), so the model permutes tokens while clients and the
benchmark use :func:`shuffle_images` to build the image x~ that the gradient is computed on.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from patchgrid import patchify, unpatchify  # the one patch order of every layer (re-exported)

from .masking import BlockMaskGenerator, SeedLike, make_rng


@dataclass
class JigsawPlan:
    """One shuffle of a batch.

    Attributes:
        mask: [B, N] bool, True at selected (shuffled, "unknown") positions.
        perm: [B, N] long, source position of the patch placed at each position.
        pixel_perm: [B, p*p] long or None; SPP only: the within-patch pixel permutation.
    """

    mask: torch.Tensor
    perm: torch.Tensor
    pixel_perm: Optional[torch.Tensor] = None

    def to(self, device: torch.device | str) -> "JigsawPlan":
        pp = None if self.pixel_perm is None else self.pixel_perm.to(device)
        return JigsawPlan(self.mask.to(device), self.perm.to(device), pp)

    def inverse_perm(self) -> torch.Tensor:
        """[B, N] permutation that undoes ``perm`` (``x[b, i] = x~[b, inv[b, i]]``)."""
        return torch.argsort(self.perm, dim=1)

    def select(self, index: torch.Tensor | slice) -> "JigsawPlan":
        pp = None if self.pixel_perm is None else self.pixel_perm[index]
        return JigsawPlan(self.mask[index], self.perm[index], pp)


def permute_within_mask(mask: torch.Tensor, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Random permutation of each row's selected positions among themselves.

    Vectorised over the batch: sorting ``where(mask, key, inf)`` puts a row's selected positions
    first, once in index order and once in random order; pairing the two scatters a random
    permutation onto the selected positions and leaves the others in place.

    Args:
        mask: [B, N] bool.
    Returns:
        perm: [B, N] long with ``perm[b, i] == i`` where ``mask[b, i]`` is False.
    """
    B, N = mask.shape
    device = mask.device
    pos = torch.arange(N, device=device).expand(B, N)
    big = torch.full((B, N), float(N + 1), device=device)
    ordered = torch.argsort(torch.where(mask, pos.float(), big + pos), dim=1)
    noise = torch.rand(B, N, generator=generator, device="cpu").to(device)
    shuffled = torch.argsort(torch.where(mask, noise, big + pos), dim=1)
    perm = pos.clone()
    count = mask.sum(dim=1, keepdim=True)
    rows, ks = (pos < count).nonzero(as_tuple=True)
    perm[rows, ordered[rows, ks]] = shuffled[rows, ks]
    return perm


def make_plan(
    batch_size: int,
    grid_size: tuple[int, int],
    gamma: float,
    seed: SeedLike = None,
    per_sample: bool = False,
    min_block: int = 8,
    max_block: Optional[int] = None,
) -> JigsawPlan:
    """Draw block-wise masks and shuffle the selected positions.

    Args:
        per_sample: one mask and permutation per sample (True) or one shared by the batch (False,
            the official code's behaviour).
    """
    rng = make_rng(seed)
    gen = BlockMaskGenerator(grid_size, gamma, min_block=min_block, max_block=max_block)
    mask = gen.batch(batch_size, rng, per_sample=per_sample)
    tgen = torch.Generator().manual_seed(rng.getrandbits(62))
    if per_sample:
        perm = permute_within_mask(mask, tgen)
    else:
        perm = permute_within_mask(mask[:1], tgen).expand(batch_size, -1).clone()
    return JigsawPlan(mask, perm)


def make_spp_plan(
    batch_size: int, grid_size: tuple[int, int], patch_size: int, seed: SeedLike = None, per_sample: bool = False
) -> JigsawPlan:
    """SPP baseline: every patch shuffled, and the pixels within patches permuted too."""
    rng = make_rng(seed)
    tgen = torch.Generator().manual_seed(rng.getrandbits(62))
    n = grid_size[0] * grid_size[1]
    rows = batch_size if per_sample else 1
    perm = torch.stack([torch.randperm(n, generator=tgen) for _ in range(rows)])
    pix = torch.stack([torch.randperm(patch_size * patch_size, generator=tgen) for _ in range(rows)])
    if not per_sample:
        perm, pix = perm.expand(batch_size, -1).clone(), pix.expand(batch_size, -1).clone()
    mask = torch.ones(batch_size, n, dtype=torch.bool)
    return JigsawPlan(mask, perm, pix)


def _gather_tokens(tokens: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    index = perm.view(*perm.shape, *([1] * (tokens.dim() - 2))).expand_as(tokens)
    return torch.gather(tokens, 1, index)


def shuffle_tokens(tokens: torch.Tensor, plan: JigsawPlan) -> torch.Tensor:
    """Apply a plan to patch tokens [B, N, ...] (no pixel shuffle)."""
    return _gather_tokens(tokens, plan.perm.to(tokens.device))


def shuffle_images(images: torch.Tensor, plan: JigsawPlan, patch_size: int) -> torch.Tensor:
    """Build x~ from x: [B, C, H, W] -> [B, C, H, W] with the plan's patches (and pixels) moved."""
    B, C, H, W = images.shape
    patches = patchify(images, patch_size)
    if plan.pixel_perm is not None:
        flat = patches.reshape(B, patches.shape[1], C, patch_size * patch_size)
        idx = plan.pixel_perm.to(images.device)[:, None, None, :].expand_as(flat)
        patches = torch.gather(flat, 3, idx).reshape_as(patches)
    patches = _gather_tokens(patches, plan.perm.to(images.device))
    return unpatchify(patches, (H // patch_size, W // patch_size))


def unshuffle_images(shuffled: torch.Tensor, plan: JigsawPlan, patch_size: int) -> torch.Tensor:
    """Exact inverse of :func:`shuffle_images`."""
    B, C, H, W = shuffled.shape
    patches = _gather_tokens(patchify(shuffled, patch_size), plan.inverse_perm().to(shuffled.device))
    if plan.pixel_perm is not None:
        flat = patches.reshape(B, patches.shape[1], C, patch_size * patch_size)
        inv = torch.argsort(plan.pixel_perm.to(shuffled.device), dim=1)
        patches = torch.gather(flat, 3, inv[:, None, None, :].expand_as(flat)).reshape_as(patches)
    return unpatchify(patches, (H // patch_size, W // patch_size))
