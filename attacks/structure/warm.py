"""Warm roots for block 0's root search at B = 1, from the patch-embedding closed form's read.

At B = 1 the position embedding's gradient is each token's gradient dL/dz_t wherever the token
carries its PE, and the closed form reads the patches off it (:mod:`attacks.closed_form.pe_closed_form`):
exactly on a plain model; on MJP up to the shuffled tokens' term, whose own patches come back at the
minimum-norm zero (the mean colour). Block 0's forward at that read gives every token's fc1 input
near the true one, since a token's fc1 input depends on the others only through attention's
averages. Solved in fc1's span from there (the per-token problem of
:class:`attacks.structure.token_roots.MLPSpans`), the starts that lie in their own token's basin
converge to it; every converged start is a true token, whichever basin it fell into, so the read
loses nothing where a start is off. The root search (:func:`attacks.structure.roots.find_roots`)
then only has the rest to find: random starts alone keep falling into the few tokens with large
basins, which at T = 197 costs rounds of starts per handful of roots.
"""
from __future__ import annotations

from typing import Mapping, cast

import torch
import torch.nn as nn

from ..api.base import AttackFailure
from ..closed_form.pe_closed_form import patches_to_images, pe_closed_form_system
from .roots import dedupe
from .token_roots import MLPSpans


def closed_form_tokens(vit: nn.Module, grads: Mapping[str, torch.Tensor]) -> torch.Tensor | None:
    """Block 0's fc1 inputs [T, D] (float64) of every token at the closed form's read of a batch-1
    update, or None where the closed form's conditions do not hold (no learned PE, another layout)."""
    try:
        system = pe_closed_form_system(vit, grads)
    except AttackFailure:
        return None
    known = ~system.zero_rows if system.info.has_unk else torch.ones_like(system.zero_rows)
    if not bool(known.any()):
        return None
    X = torch.zeros(system.G.shape[0], system.dW_e.shape[1], dtype=torch.float64)
    X[known] = torch.linalg.lstsq(system.G[known].T, system.dW_e).solution  # the known rows' patches
    image = patches_to_images(X[None], system.info).to(torch.float64)
    shuffled = system.zero_rows if system.info.has_unk and bool(system.zero_rows.any()) else None
    return fc1_inputs(vit, image, shuffled)


def fc1_inputs(vit: nn.Module, image: torch.Tensor, shuffled: torch.Tensor | None = None) -> torch.Tensor:
    """Block 0's fc1 inputs [T, D] (float64) of every token of the model input ``image`` [1, C, H, W],
    E_unk in place of the position embedding at the ``shuffled`` [N] positions (None: none)."""
    captured: list[torch.Tensor] = []
    fc1 = cast(nn.Module, vit.blocks[0].mlp.fc1)
    hook = fc1.register_forward_pre_hook(lambda _m, args: captured.append(args[0].detach()))
    try:
        with torch.no_grad():
            if shuffled is not None and bool(shuffled.any()):
                vit.forward_features(image, unk_mask=shuffled.reshape(1, -1))
            else:
                vit.forward_features(image)
    finally:
        hook.remove()
    return captured[0][0].to(torch.float64)


def warm_roots(problem: MLPSpans, fc1_basis: torch.Tensor, starts: torch.Tensor, iterations: int,
               tol: float = 1e-16, polish_iterations: int = 30) -> torch.Tensor:
    """The distinct roots [k, D] that the fc1 inputs ``starts`` [K, D] converge to in fc1's span
    (``iterations`` Levenberg-Marquardt steps, the search's ``tol``; each polished
    ``polish_iterations`` steps more), in the order of their residuals."""
    with torch.no_grad():
        alpha, value = problem.solve(starts.to(torch.float64) @ fc1_basis, iterations)
        good = (value < tol).nonzero().flatten()
        if good.numel() == 0:
            return torch.zeros(0, fc1_basis.shape[0], dtype=torch.float64)
        alpha, value = problem.solve(alpha[good], polish_iterations, settled=0.0)
        order = torch.argsort(value)
        empty = torch.zeros(0, fc1_basis.shape[0], dtype=torch.float64)
        return dedupe(empty, alpha[order] @ fc1_basis.T)
