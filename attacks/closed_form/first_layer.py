"""The first layer of a ViT as the closed-form attacks read it: the timm ViT inside a wrapper,
whether block 0 is APRIL's design A, the conditions of APRIL's closed form, and dL/dZ from an
update's position-embedding gradients (docs/design.md, "APRIL's closed form"). Shared by
``april_analytic``, ``april_robust``, ``pe_closed_form``, ``mjp_adaptive`` and ``ig_closed_start``.
"""
from __future__ import annotations

from typing import Any, Literal

import torch
import torch.nn as nn

from ..api.base import AttackFailure

#: The precisions of the closed forms' linear algebra (their ``precision`` option).
Precision = Literal["float64", "float32"]
PRECISIONS = {"float64": torch.float64, "float32": torch.float32}


class AprilConditionError(AttackFailure, ValueError):
    """The model violates a condition of APRIL's closed form; the message names it."""


def is_design_a(block: nn.Module) -> bool:
    """Whether a block is APRIL's design A: the embedding feeds its attention's qkv directly."""
    from fedmjp.models import AprilBlock

    if isinstance(block, AprilBlock):
        return True
    # breaching's vit_*_april surgery replaces block 0 by its own ModifiedBlock (attn fed directly).
    return type(block).__name__ == "ModifiedBlock" and not hasattr(block, "norm1")


def unwrap_vit(model: nn.Module) -> nn.Module:
    """Unwrap containers (breaching's VisionContainer, our breaching view) to the timm ViT."""
    while not hasattr(model, "blocks") and hasattr(model, "model"):
        model = model.model
    return model


def check_conditions(model: nn.Module) -> dict[str, Any]:
    """Check the conditions of the closed form on ``model`` (a timm-style ViT).

    Returns:
        info: ``T`` tokens, ``D`` width, ``num_prefix``, ``patch_size``, ``patch_dim`` (C p^2),
        ``patches_unique`` (C p^2 <= D) and ``pos_embed_covers_prefix``.
    Raises:
        AprilConditionError: naming the failing condition (pre-norm block 0, no PE, T > D, ...).
    """
    vit = unwrap_vit(model)
    blocks = getattr(vit, "blocks", None)
    if blocks is None or len(blocks) == 0 or not hasattr(getattr(blocks[0], "attn", None), "qkv"):
        raise AprilConditionError("condition failed: model is not a timm-style ViT (blocks[0].attn.qkv)")
    if not is_design_a(blocks[0]):
        raise AprilConditionError(
            "condition failed: block 0 is not APRIL's design A (it is a pre-norm block with norm1 and "
            "a residual around attention), so the embedding does not feed qkv directly; use "
            "fedmjp.april_surgery / first_block='april', or the 'april_optimization' attack")
    if getattr(vit, "pos_embed", None) is None:
        raise AprilConditionError("condition failed: model has no position embedding (dL/dP is needed)")
    pe_ok = (isinstance(getattr(vit, "norm_pre", nn.Identity()), nn.Identity)
             and isinstance(getattr(vit.patch_embed, "norm", nn.Identity()), nn.Identity))
    if not pe_ok:
        raise AprilConditionError("condition failed: a norm between the patch embedding and block 0 "
                                  "(norm_pre or patch_embed.norm) makes the embedding non-affine")
    prefix = int(getattr(vit, "num_prefix_tokens", 1))
    n_patches = int(vit.patch_embed.num_patches)
    T, D = prefix + n_patches, int(vit.embed_dim)
    if T > D:
        raise AprilConditionError(
            f"condition failed: T = {T} tokens > D = {D}: rank(dL/dP) <= D < T, the system "
            "W_qkv^T G_W = G_Z^T Z has no unique solution")
    proj = vit.patch_embed.proj
    C, p = int(proj.weight.shape[1]), int(proj.weight.shape[2])
    return dict(T=T, D=D, num_prefix=prefix, patch_size=p, channels=C, patch_dim=C * p * p,
                patches_unique=C * p * p <= D,
                pos_embed_covers_prefix=int(vit.pos_embed.shape[1]) == T)


def gradient_of_Z(vit: nn.Module, grads: dict[str, torch.Tensor], info: dict) -> torch.Tensor:
    """G_Z [T, D] from dL/dpos_embed (and dL/dcls_token, dL/dreg_token when the PE skips prefixes)."""
    if "pos_embed" not in grads:
        raise AttackFailure("update lacks 'pos_embed'")
    g_pe = grads["pos_embed"].reshape(-1, info["D"])
    if info["pos_embed_covers_prefix"]:
        return g_pe
    rows = []
    for name in ("cls_token", "reg_token"):
        if getattr(vit, name, None) is not None:
            if name not in grads:
                raise AttackFailure(f"update lacks {name!r}")
            rows.append(grads[name].reshape(-1, info["D"]))
    return torch.cat(rows + [g_pe], dim=0)
