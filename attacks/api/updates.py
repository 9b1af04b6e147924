"""What a client sends: gradients by parameter name, shared by the Flower client, tests and benchmarks.

Both helpers compute the cross-entropy gradient (mean over the batch) of ``model(images)``, or of
``model(images, unk_mask=mask)`` for an MJP model fed an already shuffled image (settings b/c
of docs/design.md, "Threat model and the settings (a), (b), (c)"). They do not change the model's
train/eval mode: a client in training mode with dropout draws its own dropout masks.
"""
from __future__ import annotations

import copy
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.func import functional_call, grad, vmap


def _forward(model: nn.Module, images: torch.Tensor, unk_mask: Optional[torch.Tensor]) -> torch.Tensor:
    return model(images) if unk_mask is None else model(images, unk_mask=unk_mask)


def compute_update(model: nn.Module, images_normalized: torch.Tensor, labels: torch.Tensor,
                   unk_mask: Optional[torch.Tensor] = None) -> dict[str, torch.Tensor]:
    """FedSGD update of one client batch.

    Args:
        model: the global model (parameters are not modified, gradients not accumulated).
        images_normalized: [B, C, H, W] model inputs ((x - mean) / std; already shuffled for MJP).
        labels: [B] long.
        unk_mask: [B, N] bool, positions that get E_unk (MJP models only), or None.
    Returns:
        {name: gradient} for every parameter that requires grad; zeros for parameters the forward
        pass did not use (e.g. E_unk without a mask), detached, same dtype/device as the parameter.
    """
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    loss = F.cross_entropy(_forward(model, images_normalized, unk_mask), labels)
    grads = torch.autograd.grad(loss, [p for _, p in named], allow_unused=True)
    return {n: (torch.zeros_like(p) if g is None else g.detach()) for (n, p), g in zip(named, grads)}


def compute_per_sample_updates(model: nn.Module, images_normalized: torch.Tensor, labels: torch.Tensor,
                               unk_mask: Optional[torch.Tensor] = None) -> list[dict[str, torch.Tensor]]:
    """Independent batch-1 updates of B clients in one vectorised pass (``torch.func.vmap``).

    Same values as ``[compute_update(model, x[i:i+1], y[i:i+1], mask[i:i+1]) for i in range(B)]``.
    Timm's fused attention is switched off on a private copy (vmap of SDPA is fine, but this keeps
    one code path with the optimisation attacks).

    Returns:
        B dicts {name: gradient}.
    """
    work = copy.deepcopy(model)
    for block in getattr(work, "blocks", []):
        if hasattr(getattr(block, "attn", None), "fused_attn"):
            block.attn.fused_attn = False
    params = {n: p.detach() for n, p in work.named_parameters() if p.requires_grad}
    frozen = {n: p.detach() for n, p in work.named_parameters() if not p.requires_grad}
    buffers = dict(work.named_buffers())

    def loss_one(p: dict, x: torch.Tensor, y: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
        args = (x.unsqueeze(0),)
        kwargs = {} if mask is None else {"unk_mask": mask.unsqueeze(0)}
        out = functional_call(work, ({**p, **frozen}, buffers), args, kwargs)
        return F.cross_entropy(out, y.unsqueeze(0))

    in_dims = (None, 0, 0, None if unk_mask is None else 0)
    batched = vmap(grad(loss_one), in_dims=in_dims)(params, images_normalized, labels, unk_mask)
    B = images_normalized.shape[0]
    return [{n: g[i].detach().clone() for n, g in batched.items()} for i in range(B)]


def defended_update(model: nn.Module, meta, images: torch.Tensor, labels: torch.Tensor,
                    seed: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """``(clean, sent)``: the FedSGD update of ``images`` (in [0, 1]; normalised with ``meta``) and
    that update as a client sends it under ``meta.defence``
    (:func:`defences.transforms.apply_update_defence`, its generator seeded by ``seed``; an unchanged
    copy where the metadata names no defence)."""
    from defences.transforms import apply_update_defence

    clean = compute_update(model, meta.normalize(images), labels)
    return clean, apply_update_defence(clean, meta.defence, torch.Generator().manual_seed(seed))
