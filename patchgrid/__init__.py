"""Patch grids of images: the one patchify/unpatchify pair every layer of fedmjp uses.

A bottom-layer package (it imports torch only), so that the core (``fedmjp``), the attacks and the
metrics, which may not import each other downwards, share one definition of the patch order:
row-major over the grid, each patch in (C, p, p) order, as timm's ``PatchEmbed`` reads it.

    patches = patchify(images, p)           # [B, C, H, W] -> [B, N, C, p, p]
    images = unpatchify(patches, (gh, gw))  # [B, N, C, p, p] -> [B, C, gh p, gw p]
"""
from __future__ import annotations

import torch

__all__ = ["grid_size", "patchify", "unpatchify"]


def grid_size(height: int, width: int, patch_size: int) -> tuple[int, int]:
    """(rows, cols) of the patch grid; ValueError when the size is not a multiple of the patch."""
    if patch_size <= 0 or height % patch_size or width % patch_size:
        raise ValueError(f"image size {height}x{width} is not divisible by patch size {patch_size}")
    return height // patch_size, width // patch_size


def patchify(images: torch.Tensor, patch_size: int) -> torch.Tensor:
    """[B, C, H, W] -> [B, N, C, p, p], patches in row-major grid order."""
    B, C, H, W = images.shape
    p = patch_size
    gh, gw = grid_size(H, W, p)
    x = images.reshape(B, C, gh, p, gw, p).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(B, gh * gw, C, p, p)


def unpatchify(patches: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
    """Inverse of :func:`patchify`: [B, N, C, p, p] (or [B, N, C p^2] with ``C = 3`` rows of
    ``p x p``) -> [B, C, gh p, gw p] for ``grid = (gh, gw)``."""
    gh, gw = (int(g) for g in grid)
    if patches.dim() == 3:
        B, N, F = patches.shape
        p = int(round((F / 3) ** 0.5))
        patches = patches.reshape(B, N, F // (p * p), p, p)
    B, N, C, p, _ = patches.shape
    if N != gh * gw:
        raise ValueError(f"{N} patches do not fill a {gh}x{gw} grid")
    x = patches.reshape(B, gh, gw, C, p, p).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(B, C, gh * p, gw * p)
