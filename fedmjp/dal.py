"""Dense Absolute Localization (DAL): regress each unshuffled patch's grid position from its PE.

Heads (paper Sec. 3.3; official ``ssl/dlocr.py``):
- ``ln``:  Linear D -> 2.
- ``nln``: Linear D -> D, ReLU, Linear D -> 2 (the paper's default).
- ``pca``: no parameters; the PEs projected onto their top-2 principal directions. The official
  code uses ``torch.pca_lowrank`` (randomised, so not reproducible); we use an exact SVD.
Loss: L1 between the prediction and the (row, col) grid index, averaged over unshuffled positions.
"""
from __future__ import annotations

import math
from typing import Literal, get_args

import torch
import torch.nn as nn

DalHead = Literal["ln", "nln", "pca"]
DAL_HEADS: tuple[str, ...] = get_args(DalHead)


class DALHead(nn.Module):
    """Map position embeddings [N, D] to predicted grid coordinates [N, 2]."""

    def __init__(self, embed_dim: int, kind: str = "nln") -> None:
        super().__init__()
        if kind not in DAL_HEADS:
            raise ValueError(f"unknown DAL head {kind!r}; valid: {', '.join(DAL_HEADS)}")
        self.kind = kind
        if kind == "nln":
            self.layers = nn.Sequential(nn.Linear(embed_dim, embed_dim), nn.ReLU(), nn.Linear(embed_dim, 2))
        elif kind == "ln":
            self.layers = nn.Linear(embed_dim, 2)
        else:
            self.layers = nn.Identity()

    def forward(self, pe: torch.Tensor) -> torch.Tensor:
        if self.kind != "pca":
            return self.layers(pe)
        # Directions from the centred PEs, applied to the raw PEs as the official code does.
        centred = pe - pe.mean(dim=0, keepdim=True)
        _, _, vh = torch.linalg.svd(centred, full_matrices=False)
        return pe @ vh[:2].T


def grid_targets(grid_size: tuple[int, int], normalize: bool = False, device=None) -> torch.Tensor:
    """[N, 2] (row, col) of each position in row-major order; raw indices unless ``normalize``."""
    gh, gw = grid_size
    rows = torch.arange(gh, device=device).repeat_interleave(gw)
    cols = torch.arange(gw, device=device).repeat(gh)
    xy = torch.stack([rows, cols], dim=1).float()
    if normalize:
        xy = xy / torch.tensor([gh, gw], device=device, dtype=torch.float32)
    return xy


def dal_loss(pred: torch.Tensor, target: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
    """L1 over kept positions.

    Args:
        pred, target: [N, 2].
        keep: [B, N] bool (unshuffled positions per sample) or None for all positions. Each sample's
            positions count once, so a per-sample mask weights a PE row by how often it was kept.
    """
    err = (pred - target).abs().mean(dim=1)  # [N]
    if keep is None:
        return err.mean()
    keep = keep.to(err.dtype)
    return (keep * err).sum() / keep.sum().clamp_min(1.0)


def dal_weight(step: int, total_steps: int, base: float = 0.01, final: float = 0.005,
               warmup_steps: int = 0, schedule: str = "constant") -> float:
    """DAL loss weight at a step.

    ``constant`` returns ``base`` (paper: lambda = 0.01). ``official`` ramps linearly from 0 to ``base``
    over ``warmup_steps``, then follows a cosine from ``base`` down to ``final`` (official code:
    0.01 -> 0.005).
    """
    if schedule == "constant":
        return base
    if schedule != "official":
        raise ValueError(f"unknown DAL schedule {schedule!r}; valid: constant, official")
    if warmup_steps > 0 and step < warmup_steps:
        return base * step / warmup_steps
    span = max(total_steps - warmup_steps, 1)
    t = min(max(step - warmup_steps, 0) / span, 1.0)
    return final + 0.5 * (base - final) * (1 + math.cos(math.pi * t))
