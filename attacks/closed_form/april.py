"""APRIL's closed-form attack on a ViT whose block 0 is "design A" (docs/design.md, "APRIL's closed form").

With design A the embedding Z = [prefix; W_e x + b_e] + P [T, D] feeds the qkv projection
(weight W [3D, D]) directly, so for a batch-1 gradient

    G_W = dL/dW = G_qkv^T Z,   G_Z = dL/dZ = G_qkv W = dL/dP   =>   W^T G_W = G_Z^T Z.

Z is unique iff rank(G_Z) = T (needs T <= D); the patches are unique iff the patch embedding
W_e [D, C p^2] has full column rank (needs C p^2 <= D). We solve both systems by least squares in
float64 (the system is badly conditioned: float32 loses most of the exactness), vectorised over updates.

MJP (E_unk at shuffled positions): those rows of dL/dP are exactly zero and their gradient is summed
into dL/dE_unk, so the system loses rank exactly there; the minimum-norm solution puts zero rows at
those tokens and the corresponding patches come back as garbage. The attacker does not know the
shuffle; by default it subtracts the plain P at every position, as APRIL does (``pe_mode="plain"``).
``pe_mode="detect_unk"`` is a stronger attacker that reads the shuffled positions off the zero rows
of dL/dP and subtracts E_unk there; either way the patches at those positions are lost and the
patches that were moved come back at the positions they were moved to, which setting (c) scores.
Note also that the shuffled tokens' contribution sum_t g_t z_t^T stays in W^T G_W, so even the
unshuffled rows are only least-squares approximations once anything is shuffled.
"""
from __future__ import annotations

import hashlib
import logging
import threading
import time
from typing import Any, Literal, Optional, Sequence

import cachetools
import torch
import torch.nn as nn
from patchgrid import unpatchify

from fedmjp.config import Float

from ..api.base import (AttackFailure, AttackOptions, BatchedSolveAttack, AttackMetadata, AttackResult, Update,
                   update_to_gradients)
from ..api.registry import Threat, register_attack
from .first_layer import PRECISIONS, Precision, check_conditions, gradient_of_Z, unwrap_vit

_logger = logging.getLogger(__name__)

PE_MODES = ("plain", "detect_unk")

#: (pseudo-inverse, rank) of the patch embeddings solved lately, by content: a benchmark attacks
#: every round of a federation with the same weights (the paper's lr 0), and the SVD of a DeiT-S
#: patch embedding costs ~45 ms per round on a CPU where hashing its bytes costs ~2 ms.
_PINV_CACHE: cachetools.LRUCache = cachetools.LRUCache(maxsize=8)
_PINV_LOCK = threading.Lock()


def _pinv_and_rank(W: torch.Tensor, rcond: Optional[float]) -> tuple[torch.Tensor, int]:
    """(pseudo-inverse, rank) of W [m, n] from one SVD, with the cut-offs of ``torch.linalg.pinv``
    (relative ``rcond``, default max(m, n) * eps) and ``torch.linalg.matrix_rank`` (max(m, n) * eps):
    two SVDs of the patch embedding cost more than the rest of a batch-1 solve at 224 px. The
    result for the same W (bytes, dtype, shape) and ``rcond`` is reused (:data:`_PINV_CACHE`)."""
    data = W.detach().cpu().contiguous()
    digest = hashlib.blake2b(f"{data.dtype}{tuple(data.shape)}{rcond!r}".encode(), digest_size=20)
    digest.update(data.view(torch.uint8).numpy().data)
    key = digest.digest()
    with _PINV_LOCK:
        hit = _PINV_CACHE.get(key)  # a hit counts as a use
    if hit is not None:
        return hit
    U, S, Vh = torch.linalg.svd(W, full_matrices=False)
    default = max(W.shape) * torch.finfo(W.dtype).eps * S.max()
    keep = S > (rcond * S.max() if rcond else default)
    inv = torch.where(keep, 1.0 / S, torch.zeros_like(S))
    result = ((Vh.mT * inv) @ U.mT, int((S > default).sum()))
    with _PINV_LOCK:
        _PINV_CACHE[key] = result  # the least recently used goes when 8 are held
    return result


@register_attack("april_analytic")
class AprilAnalytic(BatchedSolveAttack):
    """Closed-form APRIL on design-A ViTs, vectorised over independent batch-1 updates.

    Args:
        precision: ``float64`` (default) or ``float32`` for all linear algebra.
        driver: ``torch.linalg.lstsq`` driver (``gelsd`` default: SVD-based, minimum-norm, gives rank).
        pe_mode: ``plain`` (subtract P everywhere; APRIL) or ``detect_unk`` (see module docstring).
        rcond: relative singular-value cut-off for the rank decisions (None: machine precision).
    """

    threat = Threat(batch="1 per update", labels="not needed",
                    architecture="design-A block 0 (april: surgery) with a learned position embedding, T <= width",
                    precision="float64 clients for an exact copy")

    name = "april_analytic"

    class Options(AttackOptions):
        precision: Precision = "float64"
        driver: str = "gelsd"
        pe_mode: Literal[PE_MODES] = "plain"
        rcond: Optional[Float] = None

    def __init__(self, **options: Any) -> None:
        o = self._parse_options(options)
        self.dtype, self.driver, self.pe_mode, self.rcond = PRECISIONS[o.precision], o.driver, o.pe_mode, o.rcond

    check_conditions = staticmethod(check_conditions)

    # ------------------------------------------------------------------------------- the solve
    def _solve(self, model: nn.Module, updates: Sequence[Update],
               metas: Sequence[AttackMetadata]) -> list[AttackResult]:
        t0 = time.perf_counter()
        vit = unwrap_vit(model)
        info = check_conditions(vit)
        G_Z, G_W, notes = self._read(vit, info, updates, metas)
        Z, solve = self._solve_Z(vit, G_Z, G_W)
        zero_rows = G_Z.abs().amax(dim=2) == 0  # [K, T]: tokens whose PE was replaced (E_unk)
        emb = Z - self._known_offset(vit, info, zero_rows)  # [K, T, D]
        D, prefix, dt = info["D"], info["num_prefix"], self.dtype
        # Self-check: the recovered prefix rows minus their PE must equal the known prefix tokens.
        tokens = (getattr(vit, "cls_token", None), getattr(vit, "reg_token", None))
        prefix_ref = [t.detach().to("cpu", dt).reshape(-1, D) for t in tokens if t is not None]
        prefix_ref = torch.cat(prefix_ref) if prefix_ref else emb.new_zeros(0, D)
        cls_res = ((emb[:, :prefix] - prefix_ref).flatten(1).norm(dim=1)
                   / prefix_ref.flatten().norm().clamp_min(1e-300)) if prefix else emb.new_zeros(len(updates))
        images, patch_res, patch_rank = self._invert_patch_embedding(vit, info, emb)
        elapsed = time.perf_counter() - t0
        solve.update(cls_res=cls_res, patch_res=patch_res, patch_rank=patch_rank, zero_rows=zero_rows)
        return [self._result(info, meta, k, images, notes[k], solve, elapsed / len(metas)) for k, meta in enumerate(metas)]

    def _read(self, vit: nn.Module, info: dict, updates: Sequence[Update], metas: Sequence[AttackMetadata]
              ) -> tuple[torch.Tensor, torch.Tensor, list[list[str]]]:
        """(G_Z [K, T, D] = dL/dZ, G_W [K, 3D, D] = dL/dW_qkv, notes per update) of batch-1 updates."""
        dt = self.dtype
        notes: list[list[str]] = []
        G_Z, G_W = [], []
        for upd, meta in zip(updates, metas):
            if meta.num_images != 1:
                raise AttackFailure(f"the closed form needs batch size 1 per update, got num_images={meta.num_images}")
            grads, n = update_to_gradients(upd, meta)
            if "blocks.0.attn.qkv.weight" not in grads:
                raise AttackFailure("update lacks 'blocks.0.attn.qkv.weight'")
            G_Z.append(gradient_of_Z(vit, grads, info).to("cpu", dt))
            G_W.append(grads["blocks.0.attn.qkv.weight"].to("cpu", dt))
            notes.append(list(n))
        return torch.stack(G_Z), torch.stack(G_W), notes

    def _solve_Z(self, vit: nn.Module, G_Z: torch.Tensor, G_W: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """(Z [K, T, D], {sys_res, ranks, sv}): the least-squares solution of W^T G_W = G_Z^T Z."""
        W = vit.blocks[0].attn.qkv.weight.detach().to("cpu", self.dtype)  # [3D, D]
        rhs = torch.einsum("od,kof->kdf", W, G_W)  # W^T G_W, [K, D, D]
        A = G_Z.transpose(1, 2)  # [K, D, T]
        sol = torch.linalg.lstsq(A, rhs, rcond=self.rcond, driver=self.driver)
        Z = sol.solution  # [K, T, D]
        sys_res = (A @ Z - rhs).flatten(1).norm(dim=1) / rhs.flatten(1).norm(dim=1).clamp_min(1e-300)
        ranks = sol.rank if sol.rank.numel() else torch.linalg.matrix_rank(A)
        sv = sol.singular_values if sol.singular_values.numel() else torch.linalg.svdvals(A)
        return Z, dict(sys_res=sys_res, ranks=ranks, sv=sv)

    def _known_offset(self, vit: nn.Module, info: dict, zero_rows: torch.Tensor) -> torch.Tensor:
        """[K, T, D]: the known additive terms of Z, P (+ index embedding of jp_idx), E_unk where detected."""
        dt, D, T, prefix = self.dtype, info["D"], info["T"], info["num_prefix"]
        offset = vit.pos_embed.detach().to("cpu", dt).reshape(-1, D)
        if not info["pos_embed_covers_prefix"]:
            offset = torch.cat([torch.zeros(prefix, D, dtype=dt), offset])
        if getattr(vit, "index_embed", None) is not None:
            offset = offset + vit.index_embed.detach().to("cpu", dt).reshape(-1, D)
        offset = offset.expand(zero_rows.shape[0], T, D).clone()
        unk = getattr(vit, "unk_embed", None)
        if self.pe_mode == "detect_unk" and unk is not None:
            unk_row = offset[:, :prefix].new_zeros(D) + unk.detach().to("cpu", dt).reshape(D)
            patch_rows = zero_rows.clone()
            patch_rows[:, :prefix] = False
            offset = torch.where(patch_rows[..., None], unk_row, offset)
        return offset

    def _invert_patch_embedding(self, vit: nn.Module, info: dict, emb: torch.Tensor
                                ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(images [K, C, H, W], relative residual [K], rank(W_e)): W_e vec(patch) + b_e = emb row,
        vec in timm's (C, p, p) order, minimum-norm where underdetermined."""
        D, prefix, dt = info["D"], info["num_prefix"], self.dtype
        proj = vit.patch_embed.proj
        W_e = proj.weight.detach().to("cpu", dt).reshape(D, -1)  # [D, C p^2]
        b_e = proj.bias.detach().to("cpu", dt) if proj.bias is not None else W_e.new_zeros(D)
        target = emb[:, prefix:] - b_e  # [K, N, D]
        W_pinv, patch_rank = _pinv_and_rank(W_e, self.rcond)
        patches = target @ W_pinv.T  # [K, N, C p^2], minimum-norm where underdetermined
        patch_res = ((patches @ W_e.T - target).flatten(1).norm(dim=1)
                     / target.flatten(1).norm(dim=1).clamp_min(1e-300))
        p = info["patch_size"]
        images = unpatchify(patches.reshape(*patches.shape[:2], info["channels"], p, p), vit.patch_embed.grid_size)
        return images, patch_res, patch_rank

    def _result(self, info: dict, meta: AttackMetadata, k: int, images: torch.Tensor, note: list[str], solve: dict,
                time_s: float) -> AttackResult:
        """Update k's result: its image, the solve's residuals and ranks, notes on what is underdetermined."""
        T, prefix = info["T"], info["num_prefix"]
        sys_res, ranks, s = solve["sys_res"], solve["ranks"], solve["sv"][k]
        if not info["patches_unique"] or solve["patch_rank"] < info["patch_dim"]:
            note.append(f"underdetermined: minimum-norm solution (C*p^2 = {info['patch_dim']} > "
                        f"rank(W_e) = {solve['patch_rank']})")
        if int(ranks[k]) < T:
            note.append(f"rank-deficient: rank(dL/dP) = {int(ranks[k])} < T = {T}; minimum-norm Z")
        stats = dict(
            objective=float(sys_res[k]), iterations=0, time_s=time_s,
            system_residual=float(sys_res[k]), rank_G_Z=int(ranks[k]), T=T, D=info["D"],
            condition_number=float(s.max() / s.min()) if float(s.min()) > 0 else float("inf"),
            cls_residual=float(solve["cls_res"][k]), patch_residual=float(solve["patch_res"][k]),
            zero_pe_grad_rows=int(solve["zero_rows"][k, prefix:].sum()), precision=str(self.dtype).replace("torch.", ""),
            pe_mode=self.pe_mode, failed=False, notes=note,
        )
        return AttackResult(meta.denormalize(images[k:k + 1]), [stats], labels=meta.labels)
