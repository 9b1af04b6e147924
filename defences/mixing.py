"""Client-side input mixing (mixup / InstaHide style), pure torch.

Each private image is replaced by a convex combination of itself and ``k - 1`` other images of the
client's own partition, with weights drawn from Dirichlet(alpha, ..., alpha); the one-hot labels are
mixed with the same weights (soft targets). With ``sign_flip`` every pixel of the mixture is
multiplied by a random sign, as InstaHide does (the mixture then leaves [0, 1]). The attacker still
scores against the private image x: what it can reconstruct is the mixture.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Mixed:
    """A mixed batch. images: [B, C, H, W]; targets: [B, num_classes] soft labels (rows sum to 1);
    weights: [B, k] mixing weights, column 0 the private image's own."""

    images: torch.Tensor
    targets: torch.Tensor
    weights: torch.Tensor


def mix_batch(images: torch.Tensor, labels: torch.Tensor, pool_images: torch.Tensor, pool_labels: torch.Tensor,
              num_classes: int, k: int, alpha: float, sign_flip: bool, generator: torch.Generator) -> Mixed:
    """Mix each image with ``k - 1`` partners drawn (with replacement) from the pool.

    Args:
        images: [B, C, H, W] private images; labels: [B] long.
        pool_images: [P, C, H, W] the client's partition; pool_labels: [P] long.
        num_classes: width of the soft targets.
        k: images per mixture (1: no mixing, targets one-hot).
        alpha: Dirichlet concentration (small: one image dominates; large: even weights).
        sign_flip: multiply each pixel of the mixture by a random +-1.
        generator: CPU generator (partner choice, weights, signs).
    """
    if k < 1 or alpha <= 0:
        raise ValueError(f"need k >= 1 and alpha > 0, got k={k}, alpha={alpha}")
    B = images.shape[0]
    onehot = torch.nn.functional.one_hot(labels.cpu(), num_classes).double()
    if k == 1:
        weights = torch.ones(B, 1, dtype=torch.float64)
        mixed, targets = images.clone(), onehot
    else:
        gamma = torch._standard_gamma(torch.full((B, k), float(alpha), dtype=torch.float64), generator=generator)
        weights = gamma / gamma.sum(dim=1, keepdim=True)
        partners = torch.randint(len(pool_images), (B, k - 1), generator=generator)
        stack = torch.cat([images.cpu().double().unsqueeze(1), pool_images.cpu().double()[partners]], dim=1)
        mixed = (weights.view(B, k, 1, 1, 1) * stack).sum(dim=1)
        pool_onehot = torch.nn.functional.one_hot(pool_labels.cpu(), num_classes).double()
        targets = weights[:, :1] * onehot + (weights[:, 1:, None] * pool_onehot[partners]).sum(dim=1)
    if sign_flip:
        signs = torch.randint(0, 2, mixed.shape, generator=generator).double() * 2 - 1
        mixed = mixed.double() * signs
    return Mixed(mixed.to(images.dtype).to(images.device), targets.float(), weights)
