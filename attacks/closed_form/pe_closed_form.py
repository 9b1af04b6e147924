"""The patch-embedding closed form: any ViT with a learned additive position embedding.

A timm-style ViT forms its patch tokens as z_t = W_e x_t + b_e + P_t (learned P, added once), so
for a batch-1 gradient dL/dP_t = dL/dz_t exactly and

    dL/dW_e = G^T X,    dL/db_e = G^T 1,

with G [N, D] the patch rows of dL/dP and X [N, C p^2] the client's N patches (in the model's
normalised input space, timm's (C, p, p) order). With N <= D and rank(G) = N the patches are
X = (G^T)^+ dL/dW_e (least squares in float64). Unlike APRIL's qkv system (attacks/closed_form/april.py) this
needs no design-A surgery, no C p^2 <= D and holds whatever block 0 is (pre-norm included): only the
embedding itself must be affine in x (no ``patch_embed.norm``). ``norm_pre``, token dropout and the
PE's dropout sit after the sum and change nothing. The bias gradient is a redundant check:
G^T 1 = dL/db_e (``bias_residual``), zero up to rounding on a clean update.

Refused (condition failures, with the reason): no learned PE (variant ``nope``), a PE resampled to
the input (``dynamic_img_size``) or not matching the patch grid, inputs of another size, a
non-affine embedding, batch > 1 (the update then holds sum_b G_b and sum_b G_b^T X_b: the images'
patch systems are summed and cannot be told apart from the first layer alone).

MJP (fedmjp.models, variants jp_unk/mjp): E_unk replaces P_t at the shuffled positions S, so
those rows of dL/dP are exactly zero and their sum goes to dL/dE_unk instead, while dL/dW_e still
holds their term: dL/dW_e = G_U^T X_U + G_S^T X_S with G_U known and G_S unknown (but
sum_S g_t = dL/dE_unk). The attack then returns the least-squares solution from the known rows with
a note (the unshuffled patches carry the error G_S^T X_S, the shuffled ones come back at the
minimum-norm zero, i.e. the mean colour); :func:`pe_closed_form_system` hands the whole system to an
MJP-aware attack as its closed-form starting point.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

import torch
import torch.nn as nn

from patchgrid import patchify, unpatchify

from fedmjp.config import Float

from .first_layer import PRECISIONS, Precision, unwrap_vit
from ..api.base import (AttackFailure, AttackOptions, AttackMetadata, AttackResult, BatchedSolveAttack, Update,
                   update_to_gradients)
from ..api.registry import Threat, register_attack


@dataclass
class PEInfo:
    """What the closed form needs to know of a model (from :func:`pe_conditions`).

    Attributes:
        N: patch tokens; D: width; num_prefix: cls + register tokens.
        channels, patch_size, grid: C, p and the (rows, cols) patch grid.
        pe_patch_rows: slice of ``pos_embed``'s rows (flattened to [-1, D]) that the patch tokens get.
        prefix: the name prefix of the ViT inside the model given (``""`` for a bare ViT), so
            ``prefix + "pos_embed"`` is the update's key.
        has_unk: the model has MJP's E_unk (``unk_embed``).
    """

    N: int
    D: int
    num_prefix: int
    channels: int
    patch_size: int
    grid: tuple[int, int]
    pe_patch_rows: slice
    prefix: str
    has_unk: bool

    @property
    def patch_dim(self) -> int:
        return self.channels * self.patch_size ** 2


def _name_prefix(model: nn.Module, vit: nn.Module) -> str:
    if vit is model:
        return ""
    for name, module in model.named_modules():
        if module is vit:
            return name + "."
    return ""


def pe_conditions(model: nn.Module, image_size: Optional[Sequence[int]] = None) -> PEInfo:
    """Check that ``model`` is a ViT whose patch tokens are W_e x + b_e + P with a learned P.

    Args:
        model: a timm-style ViT (or a container of one, as breaching's views).
        image_size: (C, H, W) of the client's inputs, checked against the PE's grid when given.
    Raises:
        AttackFailure: naming the condition that fails.
    """
    vit = unwrap_vit(model)
    pe_mod = getattr(vit, "patch_embed", None)
    proj = getattr(pe_mod, "proj", None)
    if not isinstance(proj, nn.Conv2d):
        raise AttackFailure("condition failed: model is not a timm-style ViT (patch_embed.proj Conv2d)")
    p = int(proj.kernel_size[0])
    if tuple(proj.kernel_size) != tuple(proj.stride) or proj.kernel_size[0] != proj.kernel_size[1] \
            or any(int(v) for v in proj.padding) or proj.groups != 1:
        raise AttackFailure("condition failed: the patch embedding is not a non-overlapping square patchify "
                            f"(kernel {tuple(proj.kernel_size)}, stride {tuple(proj.stride)})")
    pos = getattr(vit, "pos_embed", None)
    if not isinstance(pos, nn.Parameter):
        raise AttackFailure("condition failed: the model has no learned position embedding (a 'nope' / "
                            "'w/o PE' model, or a fixed one): dL/dP, the closed form's coefficients, is not sent")
    if getattr(vit, "dynamic_img_size", False) or getattr(pe_mod, "dynamic_img_size", False):
        raise AttackFailure("condition failed: dynamic_img_size: the PE is resampled to each input's grid, so "
                            "dL/dP is not the gradient of the patch tokens (interpolated PEs are not handled)")
    if not isinstance(getattr(pe_mod, "norm", nn.Identity()), nn.Identity):
        raise AttackFailure("condition failed: patch_embed.norm makes the patch embedding non-affine in x")
    grid = tuple(int(g) for g in getattr(pe_mod, "grid_size"))
    N, D = grid[0] * grid[1], int(pos.shape[-1])
    rows = pos.numel() // D
    prefix = int(getattr(vit, "num_prefix_tokens", 0))
    if rows == N:
        pe_rows = slice(0, N)  # no_embed_class: the PE covers the patch tokens only
    elif rows == N + prefix:
        pe_rows = slice(prefix, prefix + N)
    else:
        raise AttackFailure(f"condition failed: pos_embed has {rows} rows for {N} patches and {prefix} prefix "
                            "tokens: the PE would be interpolated to the input's grid (not handled)")
    C = int(proj.weight.shape[1])
    if image_size is not None:
        want = (C, grid[0] * p, grid[1] * p)
        if tuple(int(s) for s in image_size) != want:
            raise AttackFailure(f"condition failed: inputs of size {tuple(image_size)} but the PE is learned for "
                                f"{want}; a resampled PE is not handled")
    return PEInfo(N, D, prefix, C, p, grid, pe_rows, _name_prefix(model, vit),
                  getattr(vit, "unk_embed", None) is not None)


@dataclass
class PESystem:
    """The first layer's equations of one batch-1 update: dW_e = G^T X, db_e = G^T 1 (+ dE_unk).

    Attributes:
        G: [N, D] patch rows of dL/dP (zero rows at MJP's shuffled positions).
        dW_e: [D, C p^2] dL/dW_e, columns in timm's (C, p, p) order.
        db_e: [D] dL/db_e, or None when the patch embedding has no bias.
        g_unk: [D] dL/dE_unk (the sum of the unknown rows G_S), or None without E_unk.
        zero_rows: [N] bool, rows of G that are exactly zero (MJP's shuffled set where ``info.has_unk``).
        info: the model's :class:`PEInfo`.
    """

    G: torch.Tensor
    dW_e: torch.Tensor
    db_e: Optional[torch.Tensor]
    g_unk: Optional[torch.Tensor]
    zero_rows: torch.Tensor
    info: PEInfo


def pe_closed_form_system(model: nn.Module, grads: Mapping[str, torch.Tensor],
                          dtype: torch.dtype = torch.float64, info: Optional[PEInfo] = None) -> PESystem:
    """Read the closed form's system off a batch-1 gradient (names of ``model.named_parameters()``).

    For an MJP-aware attack: ``G[~zero_rows]`` are the known rows G_U, ``G[zero_rows]`` the unknown
    G_S with ``G_S.sum(0) == g_unk``; ``dW_e - G_U^T X_U = G_S^T X_S``.

    Raises:
        AttackFailure: a condition of :func:`pe_conditions` fails or the update lacks an array.
    """
    info = pe_conditions(model) if info is None else info
    pre, D = info.prefix, info.D

    def get(name: str) -> torch.Tensor:
        if pre + name not in grads:
            raise AttackFailure(f"update lacks {pre + name!r}")
        return grads[pre + name].to("cpu", dtype)

    G = get("pos_embed").reshape(-1, D)[info.pe_patch_rows]
    dW_e = get("patch_embed.proj.weight").reshape(D, -1)
    db_e = get("patch_embed.proj.bias").reshape(D) if unwrap_vit(model).patch_embed.proj.bias is not None else None
    g_unk = get("unk_embed").reshape(D) if info.has_unk and pre + "unk_embed" in grads else None
    return PESystem(G, dW_e, db_e, g_unk, G.abs().amax(dim=1) == 0, info)


def patches_to_images(X: torch.Tensor, info: PEInfo) -> torch.Tensor:
    """[K, N, C p^2] patches (timm's (C, p, p) order, row-major grid) -> [K, C, H, W]."""
    C, p = info.channels, info.patch_size
    return unpatchify(X.reshape(X.shape[0], -1, C, p, p), info.grid)


def images_to_patches(x: torch.Tensor, info: PEInfo) -> torch.Tensor:
    """[K, C, H, W] -> [K, N, C p^2], the inverse of :func:`patches_to_images`."""
    return patchify(x, info.patch_size).flatten(2)


@register_attack("pe_closed_form")
class PEClosedForm(BatchedSolveAttack):
    """X = (G^T)^+ dL/dW_e for any ViT with a learned additive PE, batch 1, vectorised over updates.

    Args:
        precision: ``float64`` (default) or ``float32`` for the linear algebra.
        rcond: relative singular-value cut-off of the least squares (None: machine precision).
    """

    threat = Threat(batch="1 per update", labels="not needed",
                    architecture="any ViT with a learned additive position embedding",
                    precision="float64 clients for an exact copy")

    name = "pe_closed_form"

    class Options(AttackOptions):
        precision: Precision = "float64"
        rcond: Optional[Float] = None

    def __init__(self, **options: Any) -> None:
        o = self._parse_options(options)
        self.dtype, self.rcond = PRECISIONS[o.precision], o.rcond

    def _solve(self, model: nn.Module, updates: Sequence[Update], metas: Sequence[AttackMetadata]) -> list[AttackResult]:
        t0 = time.perf_counter()
        info = pe_conditions(model, metas[0].image_size)
        systems, notes = [], []
        for upd, meta in zip(updates, metas):
            if tuple(meta.image_size) != tuple(metas[0].image_size):
                raise AttackFailure("updates of different image sizes cannot be solved together")
            if meta.num_images != 1:
                raise AttackFailure(
                    f"the closed form needs batch size 1 per update, got num_images={meta.num_images}: with B "
                    "images the update holds sum_b G_b and sum_b G_b^T X_b, whose patch systems cannot be "
                    "separated from the first layer")
            grads, n = update_to_gradients(upd, meta)
            systems.append(pe_closed_form_system(model, grads, self.dtype, info))
            notes.append(list(n))
        G = torch.stack([s.G for s in systems])  # [K, N, D]
        dW = torch.stack([s.dW_e for s in systems])  # [K, D, C p^2]
        A = G.transpose(1, 2)  # [K, D, N]
        sol = torch.linalg.lstsq(A, dW, rcond=self.rcond, driver="gelsd")
        X = sol.solution  # [K, N, C p^2]
        res = (A @ X - dW).flatten(1).norm(dim=1) / dW.flatten(1).norm(dim=1).clamp_min(1e-300)
        sv = torch.linalg.svdvals(A)  # [K, min(D, N)]
        images = patches_to_images(X, info)
        elapsed = time.perf_counter() - t0

        results = []
        for k, (meta, s) in enumerate(zip(metas, systems)):
            note, rank, zero = notes[k], int(sol.rank[k]), int(s.zero_rows.sum())
            known = sv[k][sv[k] > sv[k].max() * max(info.N, info.D) * torch.finfo(self.dtype).eps]
            cond = float(known.max() / known.min()) if known.numel() else float("inf")
            bias_res = None
            if s.db_e is not None:
                total = s.G.sum(0) + (s.g_unk if s.g_unk is not None else 0.0)
                bias_res = float((total - s.db_e).norm() / s.db_e.norm().clamp_min(1e-300))
            if info.N > info.D:
                note.append(f"underdetermined: N = {info.N} patches > D = {info.D}; minimum-norm patches")
            if zero and info.has_unk:
                note.append(f"MJP: {zero} zero rows of dL/dP (E_unk positions): their gradient rows are unknown "
                            "and their term G_S^T X_S stays in dL/dW_e; the known rows are solved by least "
                            "squares, the shuffled patches come back at the minimum-norm zero")
            elif zero:
                note.append(f"{zero} zero rows of dL/dP: those patches had no gradient; minimum-norm zero there")
            if rank < info.N and not zero:
                note.append(f"rank-deficient: rank(G) = {rank} < N = {info.N}; minimum-norm patches")
            stats = dict(objective=float(res[k]), iterations=0, time_s=elapsed / len(metas), residual=float(res[k]),
                         rank=rank, N=info.N, D=info.D, condition_number=cond if rank == min(info.N, info.D) and not zero
                         else float("inf"), condition_number_nonzero=cond, bias_residual=bias_res,
                         zero_pe_grad_rows=zero, precision=str(self.dtype).replace("torch.", ""),
                         failed=False, notes=note)
            results.append(AttackResult(meta.denormalize(images[k:k + 1]), [stats], labels=meta.labels))
        return results
