"""What an MJP client's update gives away before any attack: the shuffled positions (the zero rows of
dL/dP, where E_unk replaced the position embedding) and the DAL term the client added, removed.

Shared by the MJP-aware attacks (:mod:`attacks.optimization.mjp_adaptive` and the MJP-aware forward of
:mod:`attacks.optimization.matching`), so neither imports the other for it.
"""
from __future__ import annotations

import copy
from typing import Any, Optional

import torch
import torch.nn as nn

from defences.transforms import quantizer_step

from ..api.base import AttackFailure, AttackMetadata, LazyGradients


# ------------------------------------------------------------------------------------ detection
def detect_shuffled(g_pe_patches: torch.Tensor, atol: float = 0.0) -> torch.Tensor:
    """Shuffled positions from the patch rows of dL/dP [N, D]: rows whose max |entry| <= atol.

    Returns [N] bool. ``atol=0`` (default) is exact: an E_unk position receives no PE gradient at all.
    """
    return g_pe_patches.abs().amax(dim=-1) <= atol


#: a row of dL/dP counts as pure noise of std s while ||row||^2 <= s^2 (D + NOISE_ROW_SIGMAS sqrt(2 D)):
#: the chi-square's mean plus that many of its standard deviations, so that no E_unk row of a DP
#: client's update is taken for a position embedding's (tests/test_likelihood_match.py:
#: test_an_mjp_clients_update_gives_its_shuffled_positions_and_x_tilde_fits_it)
NOISE_ROW_SIGMAS = 6.0


def detect_shuffled_noisy(g_pe_patches: torch.Tensor, noise: float) -> torch.Tensor:
    """Shuffled positions from the patch rows of a noisy dL/dP [N, D] (additive Gaussian noise of std
    ``noise`` per entry): rows whose squared norm is within :data:`NOISE_ROW_SIGMAS` of pure noise's.
    ``noise`` 0 is :func:`detect_shuffled`'s exact test. Returns [N] bool."""
    if noise <= 0:
        return detect_shuffled(g_pe_patches)
    D = g_pe_patches.shape[-1]
    return g_pe_patches.pow(2).sum(-1) <= noise ** 2 * (D + NOISE_ROW_SIGMAS * (2 * D) ** 0.5)


def dal_pe_term(vit: nn.Module, shuffled: torch.Tensor, dtype: torch.dtype = torch.float64
                ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Gradient of the unit-weight DAL loss on the unshuffled positions (the client's extra term).

    Args:
        vit: an MJP model with a DAL head.
        shuffled: [N] bool.
    Returns:
        (d dal / d pos_embed [1, T, D], {head parameter name: d dal / d param}); the names are those
        of ``vit.named_parameters()`` (``dal_head.*``).
    """
    work = copy.deepcopy(vit).to("cpu", dtype).requires_grad_(True)  # a private copy: the caller's may be frozen
    keep = ~shuffled.reshape(1, -1).to(torch.bool)
    names = ["pos_embed"] + [n for n, _ in work.named_parameters() if n.startswith("dal_head.")]
    params = dict(work.named_parameters())
    with torch.enable_grad():
        loss = work.compute_dal_loss(keep)
        grads = torch.autograd.grad(loss, [params[n] for n in names], allow_unused=True)
    out = {n: (torch.zeros_like(params[n]) if g is None else g.detach()) for n, g in zip(names, grads)}
    return out.pop("pos_embed"), out


def read_mjp_update(vit: nn.Module, grads: dict[str, torch.Tensor], dal_weight: Optional[float] = None,
                    noise: float = 0.0, atol: float = 0.0) -> tuple[torch.Tensor, dict, dict]:
    """(S [N] bool, gradients with the DAL term removed, stats) from one update's gradients.

    ``dal_weight``: the client's DAL weight where the attacker knows it; None: fitted to the DAL
    head's gradients (least squares on the unit-weight term). ``noise``: the std of additive noise
    on every entry (a DP defence's, in gradient units): the shuffled rows are then those at the
    noise's level (:func:`detect_shuffled_noisy`); ``atol``: rows whose every entry is within it of
    zero (a quantiser's half step: its levels need not hold 0); both 0: the exact zero rows.
    """
    if "pos_embed" not in grads:
        raise AttackFailure("update lacks 'pos_embed': the shuffled positions cannot be read")
    if getattr(vit, "unk_embed", None) is None:
        raise AttackFailure("the model has no E_unk (unk_embed): not an MJP jp_unk/mjp model")
    D = int(vit.embed_dim)
    grads = LazyGradients(grads, lambda v: v.to("cpu", torch.float64))  # each array when first read
    g_pe = grads["pos_embed"].reshape(-1, D)
    patch_rows = g_pe[-vit.patch_embed.num_patches:]
    S = detect_shuffled_noisy(patch_rows, noise) if noise > 0 else detect_shuffled(patch_rows, atol)
    stats: dict[str, Any] = dict(shuffled_positions=[int(i) for i in torch.nonzero(S).flatten()])
    head = getattr(vit, "dal_head", None)
    head_names = [n for n in grads if n.startswith("dal_head.")]
    if head is not None and head.kind == "pca":
        stats["dal_note"] = "PCA DAL head: its PE term touches every row; assumed absent"
    elif head is not None and (head_names or dal_weight):
        g_dal_pe, g_dal_head = dal_pe_term(vit, S)
        if dal_weight is not None:
            lam = float(dal_weight)
        else:
            num = sum(float((grads[n] * g_dal_head[n]).sum()) for n in head_names)
            den = sum(float(g_dal_head[n].pow(2).sum()) for n in head_names)
            lam = num / den if den > 0 else 0.0
        stats["dal_weight"] = lam
        if lam != 0.0:
            grads["pos_embed"] = grads["pos_embed"] - lam * g_dal_pe.reshape(grads["pos_embed"].shape)
            for n in head_names:
                grads[n] = grads[n] - lam * g_dal_head[n]
    return S, grads, stats


def read_defended_mjp_update(vit: nn.Module, grads: dict[str, torch.Tensor], meta: AttackMetadata
                             ) -> tuple[torch.Tensor, dict, dict, str]:
    """:func:`read_mjp_update` at the level the metadata's defence leaves E_unk's rows of dL/dP at:
    (S [N] bool, gradients with the DAL term removed, stats, that level in words). Additive noise
    (local DP, DP-SGD): rows at the noise's level; a quantiser: rows within half a step of zero (a
    zero entry lands on one of the two levels next to 0, whether rounded to the nearest or
    stochastically; m, the tensor's largest |entry|, stays a level); otherwise the exact zero rows.

    Raises:
        AttackFailure: every patch row or none is at that level: the shuffled positions cannot be read.
    """
    obs = meta.defence.observation() if meta.defence is not None else None
    noise = meta.defence_noise(obs)[0] if obs is not None and obs.noise is not None else 0.0
    atol = 0.0
    if obs is not None and obs.quant_bits is not None and obs.quant_bits > 1:
        pe = [nm for nm in grads if nm.split(".")[-1] == "pos_embed"]
        top = float(grads[pe[0]].abs().max()) if pe else 0.0
        atol = quantizer_step(top, obs.quant_bits) / 2 * (1 + 1e-9)
    S, clean, stats = read_mjp_update(vit, dict(grads), noise=noise, atol=atol)
    level = "noise" if noise else ("quantiser's nearest-to-zero" if atol else "zero")
    if not bool(S.any()) or bool(S.all()):
        raise AttackFailure(f"the update carries a nonzero E_unk gradient but {'every' if S.any() else 'no'} "
                            f"patch row of dL/dP is at the {level} level: the shuffled positions cannot be read")
    return S, clean, stats, level
