"""An attacker who knows MJP (Kerckhoffs): model, E_unk and the algorithm, not the mask or permutation.

docs/design.md, "Attacking MJP with knowledge of MJP". For one batch-1 update of an MJP model fed x~
(E_unk at the shuffled positions S):

1. Detection: the rows of dL/dP at S are exactly zero (their gradient went to dL/dE_unk), so S leaks.
   A DAL term (``lambda * dL_dal/dP``, data-independent given the head and S) is zero at S as well for
   the ``ln``/``nln`` heads; its weight is read off the DAL head's own gradient and the term is
   subtracted before the rows are used.
2. Reduction (design-A block 0, Z [T, D] feeds qkv directly): M = W_qkv^T G_W = sum_t g_t z_t^T with
   the rows g_t of dL/dZ known for the prefix and unshuffled tokens (G_U). With Q a basis of the
   orthogonal complement of span(G_U), rowspace(Q^T M) = span{z_s : s in S} (rank |S|); with Pi its
   projector, Z_U (I - Pi) = (G_U^T)^+ M (I - Pi). Each unshuffled patch is then known up to the null
   space of (I - Pi) W_e, which is the span of differences of the shuffled patches (|S| - 1 dims), and
   the shuffled patches lie on their affine hull x_bar + span(N). Parameters: b_u (unshuffled) and
   a_s (shuffled), each in R^k, k = dim N.
3. Refinement (``refine``): a quadratic smoothness prior over the unshuffled image solved in closed
   form, refined under a total-variation prior (``prior``), then gradient matching over (b, a) in float64 with the attacker's forward using
   ``unk_mask = S``, L-BFGS, alternating blocks (shuffled with unshuffled fixed, then both).
4. ``unshuffle=True``: solve the jigsaw (:mod:`attacks.jigsaw_solver`) and return ``result.unshuffled``.

The permutation of the shuffled patches among S is invisible in every gradient (all of S carries the
same E_unk and the ViT is permutation-equivariant over tokens with equal embeddings), so
``result.images`` places the shuffled patches at S in the attack's own order; score them as a set.
Models that are not design A get MJP-aware Inverting Gradients (``april_optimization`` with the
detected ``unk_mask``) from the same detection.
"""
from __future__ import annotations

import copy
import logging
import time
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.func import functional_call

from .april import _gradient_of_Z, _is_design_a, _vit, check_conditions
from .base import (Attack, AttackFailure, AttackMetadata, AttackResult, LazyGradients, Update, register_attack,
                   update_to_gradients)
from .jigsaw_solver import place, solve_jigsaw
from .matching import recover_labels

_logger = logging.getLogger(__name__)

REFINE_MODES = ("none", "prior", "match", "gauss_newton")


# ------------------------------------------------------------------------------------ detection
def detect_shuffled(g_pe_patches: torch.Tensor, atol: float = 0.0) -> torch.Tensor:
    """Shuffled positions from the patch rows of dL/dP [N, D]: rows whose max |entry| <= atol.

    Returns [N] bool. ``atol=0`` (default) is exact: an E_unk position receives no PE gradient at all.
    """
    return g_pe_patches.abs().amax(dim=-1) <= atol


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
    work = copy.deepcopy(vit).to("cpu", dtype)
    keep = ~shuffled.reshape(1, -1).to(torch.bool)
    loss = work.compute_dal_loss(keep)
    names = ["pos_embed"] + [n for n, _ in work.named_parameters() if n.startswith("dal_head.")]
    params = dict(work.named_parameters())
    grads = torch.autograd.grad(loss, [params[n] for n in names], allow_unused=True)
    out = {n: (torch.zeros_like(params[n]) if g is None else g.detach()) for n, g in zip(names, grads)}
    return out.pop("pos_embed"), out


# ------------------------------------------------------------------------------------ reduction
@dataclass
class Reduction:
    """The linear part of the attack (float64; shapes for N patches, nU unshuffled, k null dims).

    Attributes:
        shuffled: [N] bool, detected S.
        projector: [D, D] Pi onto span{z_s}.
        z_u_perp: [prefix + nU, D] Z_U (I - Pi), prefix rows first.
        x_unshuffled: [nU, C p^2] minimum-norm unshuffled patches (model-input space).
        null_basis: [C p^2, k] N, orthonormal: span of differences of the shuffled patches.
        x_bar: [C p^2] a point on the affine hull of the shuffled patches.
        stats: residuals and ranks.
    """

    shuffled: torch.Tensor
    projector: torch.Tensor
    z_u_perp: torch.Tensor
    x_unshuffled: torch.Tensor
    null_basis: torch.Tensor
    x_bar: torch.Tensor
    stats: dict[str, Any]


#: A gap ratio (largest dropped / smallest kept singular value) above this is reported as weak.
WEAK_GAP = 1e-2


def expected_null_dims(n_shuffled: int, patch_dim: int, D: int) -> int:
    """Dimension of the null space of (I - Pi) W_e for |S| shuffled patches (generic data):
    {x : W_e x in span{z_s}}, z_s = W_e x_s + c with c = b_e + E_unk.

    Where the patch embedding is injective (C p^2 < D) and c lies outside its range, that is the
    span of differences of the shuffled patches, |S| - 1 dims; where C p^2 >= D (W_e onto R^D, e.g.
    DeiT-S/16: 768 > 384) it is null(W_e) plus a preimage of all of span{z_s}: C p^2 - D + |S|.
    """
    if n_shuffled == 0:
        return max(patch_dim - D, 0)
    return n_shuffled - 1 if patch_dim < D else patch_dim - D + n_shuffled


def mjp_reduction(vit: nn.Module, G_Z: torch.Tensor, G_W: torch.Tensor, shuffled: torch.Tensor,
                  rcond: Optional[float] = None) -> Reduction:
    """Analytic reduction on a design-A model (module docstring, step 2).

    Args:
        vit: the timm ViT (design A).
        G_Z: [T, D] dL/dZ rows (dL/dP with the prefix rows; zero at S), DAL term removed.
        G_W: [3D, D] dL/dW_qkv of block 0.
        shuffled: [N] bool.
        rcond: None (default): the null space of (I - Pi) W_e has the dimension the theory gives
            (:func:`expected_null_dims`), as the span step takes rank |S|. A float: the relative
            singular-value cut-off instead. A fixed cut-off is fragile: the "null" singular values
            sit at the noise floor of Pi (1e-6..1e-4 relative on real images, float64), so one
            cut-off at 1e-4 gave k = 15 on one CPU and 16 on another for the same update.
    """
    dt = torch.float64
    info = check_conditions(vit)
    prefix, D = info["num_prefix"], info["D"]
    G_Z, G_W = G_Z.to("cpu", dt), G_W.to("cpu", dt)
    W = vit.blocks[0].attn.qkv.weight.detach().to("cpu", dt)
    M = W.T @ G_W  # [D, D] = sum_t g_t z_t^T
    known = torch.cat([torch.ones(prefix, dtype=torch.bool), ~shuffled.cpu()])
    G_U = G_Z[known]  # [nU + prefix, D]
    nS = int(shuffled.sum())
    # Q: orthogonal complement of the row space of G_U.
    _, s_u, Vh_u = torch.linalg.svd(G_U, full_matrices=True)
    r_u = int((s_u > s_u[0] * 1e-12).sum())
    Q = Vh_u[r_u:].T  # [D, D - r_u]
    QM = Q.T @ M
    _, s_q, Vh_q = torch.linalg.svd(QM, full_matrices=False)
    V_S = Vh_q[:nS].T  # [D, |S|]
    Pi = V_S @ V_S.T
    I_P = torch.eye(D, dtype=dt) - Pi
    rhs = M @ I_P
    Z_U_perp = torch.linalg.lstsq(G_U.T, rhs, driver="gelsd").solution  # [nU + prefix, D]
    red_res = float((G_U.T @ Z_U_perp - rhs).norm() / rhs.norm().clamp_min(1e-300))
    # Known additive terms of the unshuffled rows: P (+ index embedding) and the patch bias.
    P = vit.pos_embed.detach().to("cpu", dt).reshape(-1, D)
    if not info["pos_embed_covers_prefix"]:
        P = torch.cat([torch.zeros(prefix, D, dtype=dt), P])
    if getattr(vit, "index_embed", None) is not None:
        P = P + vit.index_embed.detach().to("cpu", dt).reshape(-1, D)
    proj = vit.patch_embed.proj
    W_e = proj.weight.detach().to("cpu", dt).reshape(D, -1)
    b_e = proj.bias.detach().to("cpu", dt) if proj.bias is not None else W_e.new_zeros(D)
    unk = vit.unk_embed.detach().to("cpu", dt).reshape(D)
    A = I_P @ W_e  # [D, C p^2]
    U_a, s_a, Vh_a = torch.linalg.svd(A, full_matrices=True)
    if rcond is None:
        r = max(W_e.shape[1] - expected_null_dims(nS, W_e.shape[1], D), 0)
    else:
        r = int((s_a > rcond * s_a[0]).sum())
    pinv = Vh_a[:r].T @ torch.diag(1 / s_a[:r]) @ U_a[:, :r].T  # [C p^2, D]
    N_basis = Vh_a[r:].T  # [C p^2, k]
    targets = Z_U_perp[prefix:] - (P[prefix:][~shuffled.cpu()] + b_e) @ I_P  # (I - Pi) W_e x_u
    x_u = targets @ pinv.T
    x_bar = pinv @ (-(I_P @ (b_e + unk)))
    hull_res = float((A @ x_bar + I_P @ (b_e + unk)).norm() / (b_e + unk).norm())
    cls_ref = torch.cat([t.detach().to("cpu", dt).reshape(-1, D) for t in (vit.cls_token, getattr(vit, "reg_token", None))
                         if t is not None]) if prefix else None
    cls_res = (float(((Z_U_perp[:prefix] - (cls_ref + P[:prefix]) @ I_P).norm() / cls_ref.norm()))
               if prefix else 0.0)
    stats = dict(num_shuffled=nS, rank_G_U=r_u, reduction_residual=red_res, hull_residual=hull_res,
                 cls_residual_perp=cls_res, null_dims=int(N_basis.shape[1]),
                 span_gap=float(s_q[nS] / s_q[nS - 1]) if 0 < nS < len(s_q) else float("nan"),
                 null_gap=float(s_a[r] / s_a[r - 1]) if 0 < r < len(s_a) else float("nan"))
    if N_basis.shape[1] != expected_null_dims(nS, W_e.shape[1], D):  # only with an explicit rcond
        stats["note"] = (f"null space has {N_basis.shape[1]} dims, expected "
                         f"{expected_null_dims(nS, W_e.shape[1], D)} (rcond={rcond})")
    elif stats["null_gap"] > WEAK_GAP or stats["span_gap"] > WEAK_GAP:
        stats["note"] = (f"weak spectral gap (span {stats['span_gap']:.1e}, null space {stats['null_gap']:.1e}): "
                         "the split into known and unknown directions is noisy for this image")
    if r_u < G_U.shape[0]:
        # e.g. a depth-1 model: dL/dZ has rank ~ 2 heads + 1; the closed form is not unique either.
        stats["note"] = (f"rank(dL/dP known rows) = {r_u} < {G_U.shape[0]}: the unshuffled tokens are not "
                         "separable; minimum-norm estimates only")
    return Reduction(shuffled.cpu(), Pi, Z_U_perp, x_u, N_basis, x_bar, stats)


# ------------------------------------------------------------------------------------ image helpers
def patches_to_image(patches: torch.Tensor, grid: tuple[int, int], channels: int, p: int) -> torch.Tensor:
    """[..., N, C p^2] (timm's (C, p, p) order) -> [..., C, H, W]."""
    lead = patches.shape[:-2]
    gh, gw = grid
    x = patches.reshape(*lead, gh, gw, channels, p, p)
    nd = len(lead)
    x = x.permute(*range(nd), nd + 2, nd, nd + 3, nd + 1, nd + 4)
    return x.reshape(*lead, channels, gh * p, gw * p)


def _neighbour_diffs(img: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Horizontal and vertical pixel differences of [..., C, H, W] where both pixels are valid [H, W]."""
    dh = (img[..., :, 1:] - img[..., :, :-1]) * (valid[:, 1:] & valid[:, :-1])
    dv = (img[..., 1:, :] - img[..., :-1, :]) * (valid[1:, :] & valid[:-1, :])
    return torch.cat([dh.flatten(-3), dv.flatten(-3)], dim=-1)


#: Above this many entries of the dense Jacobian (n_var k x N C p^2) the prior is solved matrix-free.
DENSE_PRIOR_LIMIT = 2 * 10 ** 7


def smoothness_prior_solve(red: Reduction, grid: tuple[int, int], channels: int, p: int,
                           std: torch.Tensor, ridge: float = 1e-6, joint: bool = True,
                           dense_limit: int = DENSE_PRIOR_LIMIT, cg_tol: float = 1e-10,
                           cg_iterations: int = 2000) -> tuple[torch.Tensor, torch.Tensor]:
    """Null-space coefficients that minimise the squared differences of neighbouring pixels (in
    [0, 1] pixel units): a linear least-squares problem in x_u = x_u0 + N b_u and, with ``joint``,
    x_s = x_bar + N a_s for the shuffled patches placed at S in index order (an inpainting of the
    holes from their borders inside the affine hull; without ``joint`` only the unshuffled region
    counts and a = 0).

    Returns:
        (b [nU, k], a [nS, k]).
    """
    nU, k = red.x_unshuffled.shape[0], red.null_basis.shape[1]
    N = red.shuffled.numel()
    nS = N - nU
    if k == 0:
        return red.x_unshuffled.new_zeros(nU, k), red.x_unshuffled.new_zeros(nS, k)
    order = torch.cat([torch.nonzero(~red.shuffled).flatten(), torch.nonzero(red.shuffled).flatten()])
    n_var = N if joint else nU
    scale = std.to(torch.float64).repeat_interleave(p * p)  # model input -> pixel units, (C, p, p) order
    region = torch.ones(N, dtype=torch.bool) if joint else ~red.shuffled
    valid = patches_to_image(region.double()[:, None].expand(N, channels * p * p), grid, channels, p)[0] > 0
    base = torch.zeros(N, channels * p * p, dtype=torch.float64)
    base[order[:nU]] = red.x_unshuffled * scale
    base[order[nU:]] = red.x_bar * scale
    d0 = _neighbour_diffs(patches_to_image(base, grid, channels, p), valid)  # [F]
    Ns = (red.null_basis * scale[:, None]).T  # [k, C p^2]
    if n_var * k * N * channels * p * p <= dense_limit:
        cols = torch.zeros(n_var * k, N, channels * p * p, dtype=torch.float64)
        for j in range(n_var):
            cols[j * k:(j + 1) * k, order[j]] = Ns
        J = _neighbour_diffs(patches_to_image(cols, grid, channels, p), valid)  # [n_var k, F]
        lhs = J @ J.T + ridge * torch.eye(n_var * k, dtype=torch.float64)
        coef = torch.linalg.solve(lhs, -(J @ d0)).reshape(n_var, k)
    else:
        coef = _prior_cg(Ns, order[:n_var], N, d0, valid, grid, channels, p, ridge, cg_tol, cg_iterations)
    a = coef[nU:] if joint else coef.new_zeros(nS, k)
    return coef[:nU], a


def _prior_cg(Ns: torch.Tensor, where: torch.Tensor, N: int, d0: torch.Tensor, valid: torch.Tensor,
              grid: tuple[int, int], channels: int, p: int, ridge: float, tol: float, iterations: int
              ) -> torch.Tensor:
    """The same least-squares problem as the dense path, matrix-free: conjugate gradients on the
    normal equations (J J^T + ridge) c = -J d0, with J applied as "coefficients -> image -> pixel
    differences" and its adjoint by autograd. Written by hand (no library CG takes an autograd
    operator); at 224 px / patch 16 the dense J would need ~10^10 entries.

    Returns:
        c [len(where), k].
    """
    k = Ns.shape[0]

    def forward(c: torch.Tensor) -> torch.Tensor:  # [n_var, k] -> pixel differences [F]
        patches = torch.zeros(N, Ns.shape[1], dtype=torch.float64)
        patches = patches.index_put((where,), c @ Ns)
        return _neighbour_diffs(patches_to_image(patches, grid, channels, p), valid)

    def normal(c: torch.Tensor) -> torch.Tensor:  # (J J^T + ridge) applied to c
        c = c.detach().requires_grad_(True)
        y = forward(c)
        (g,) = torch.autograd.grad(y, c, grad_outputs=y.detach())
        return g + ridge * c.detach()

    c0 = torch.zeros(len(where), k, dtype=torch.float64, requires_grad=True)
    (rhs,) = torch.autograd.grad(forward(c0), c0, grad_outputs=-d0)
    x = torch.zeros_like(rhs)
    r = rhs.clone()
    d = r.clone()
    rr = float((r * r).sum())
    stop = tol * tol * max(float((rhs * rhs).sum()), 1e-300)
    for _ in range(iterations):
        if rr <= stop:
            break
        q = normal(d)
        alpha = rr / float((d * q).sum())
        x = x + alpha * d
        r = r - alpha * q
        rr_new = float((r * r).sum())
        d = r + (rr_new / rr) * d
        rr = rr_new
    return x


def tv_prior_refine(red: Reduction, b0: torch.Tensor, grid: tuple[int, int], channels: int, p: int,
                    std: torch.Tensor, eps: float = 1e-4, iterations: int = 300) -> torch.Tensor:
    """Refine the unshuffled coefficients b [nU, k] under a total-variation prior (Charbonnier,
    sum sqrt(d^2 + eps) over neighbouring pixel differences of the unshuffled region, pixel units),
    from the quadratic prior's solution; L-BFGS, no model evaluations. Returns b."""
    if b0.numel() == 0:
        return b0
    scale = std.to(torch.float64).repeat_interleave(p * p)
    N = red.shuffled.numel()
    valid = patches_to_image((~red.shuffled).double()[:, None].expand(N, channels * p * p), grid, channels, p)[0] > 0
    U_idx = torch.nonzero(~red.shuffled).flatten()
    b = b0.clone().requires_grad_(True)
    opt = torch.optim.LBFGS([b], max_iter=iterations, history_size=50, line_search_fn="strong_wolfe",
                            tolerance_grad=1e-12, tolerance_change=1e-15)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        xu = (red.x_unshuffled + b @ red.null_basis.T) * scale
        full = torch.zeros(N, channels * p * p, dtype=torch.float64).index_put((U_idx,), xu)
        obj = (_neighbour_diffs(patches_to_image(full, grid, channels, p), valid).pow(2) + eps).sqrt().sum()
        obj.backward()
        return obj

    opt.step(closure)
    return b.detach()


# ------------------------------------------------------------------------------------ attack
@register_attack("mjp_adaptive")
class MJPAdaptive(Attack):
    """MJP-aware attack (module docstring).

    Args:
        refine: ``none`` (minimum norm), ``prior`` (smoothness prior, closed form), ``match``
            (prior, then L-BFGS gradient matching over the reduced parameters) or ``gauss_newton``
            (prior, then Levenberg-Marquardt on the gradient residual, matrix-free CG steps).
        iterations: L-BFGS iterations per matching round, or Levenberg-Marquardt steps.
        tv_prior: refine the quadratic prior's unshuffled coefficients under a total-variation prior.
        joint_prior: the prior also inpaints the shuffled patches inside their affine hull (else
            they start as random points of the hull).
        cg_iterations: conjugate-gradient iterations per Levenberg-Marquardt step; 0 builds the
            Jacobian explicitly (exact Gauss-Newton steps, ~P times the cost of one step's products).
        rounds: alternating rounds (shuffled block, then all parameters).
        prior_weight: weight of the smoothness prior inside gradient matching (relative units).
        unshuffle: solve the jigsaw and return ``result.unshuffled``.
        rcond: None: the reduction's null space has the dimension the theory gives; a float: a
            relative singular-value cut-off instead (see :func:`mjp_reduction`).
        dal_weight: the client's DAL weight if known; None estimates it from the DAL head's gradient.
        fallback_iterations: iterations of the MJP-aware ``april_optimization`` on non-design-A models.
        seed: seed of the shuffled patches' initialisation.
    """

    name = "mjp_adaptive"

    def __init__(self, refine: str = "prior", iterations: int = 30, rounds: int = 1, prior_weight: float = 1e-3,
                 unshuffle: bool = True, rcond: Optional[float] = None, dal_weight: Optional[float] = None,
                 cg_iterations: int = 40, joint_prior: bool = False, tv_prior: bool = True,
                 fallback_iterations: int = 200, seed: int = 0, raise_errors: bool = False) -> None:
        super().__init__(raise_errors)
        if refine not in REFINE_MODES:
            raise ValueError(f"refine must be one of {REFINE_MODES}, got {refine!r}")
        if iterations < 0 or rounds < 0:
            raise ValueError("iterations and rounds must be >= 0")
        self.refine, self.iterations, self.rounds = refine, int(iterations), int(rounds)
        self.prior_weight, self.unshuffle = float(prior_weight), bool(unshuffle)
        self.rcond = None if rcond is None else float(rcond)
        self.dal_weight, self.fallback_iterations, self.seed = dal_weight, int(fallback_iterations), int(seed)
        self.cg_iterations, self.joint_prior, self.tv_prior = int(cg_iterations), bool(joint_prior), bool(tv_prior)

    # ------------------------------------------------------------------------------- pieces
    def read_update(self, vit: nn.Module, grads: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict, dict]:
        """(S [N] bool, gradients with the DAL term removed, stats) from one update's gradients."""
        if "pos_embed" not in grads:
            raise AttackFailure("update lacks 'pos_embed': the shuffled positions cannot be read")
        if getattr(vit, "unk_embed", None) is None:
            raise AttackFailure("the model has no E_unk (unk_embed): not an MJP jp_unk/mjp model")
        prefix = int(getattr(vit, "num_prefix_tokens", 1))
        D = int(vit.embed_dim)
        grads = LazyGradients(grads, lambda v: v.to("cpu", torch.float64))  # each array when first read
        g_pe = grads["pos_embed"].reshape(-1, D)
        patch_rows = g_pe[-vit.patch_embed.num_patches:]
        S = detect_shuffled(patch_rows)
        stats: dict[str, Any] = dict(shuffled_positions=[int(i) for i in torch.nonzero(S).flatten()])
        head = getattr(vit, "dal_head", None)
        head_names = [n for n in grads if n.startswith("dal_head.")]
        if head is not None and head.kind == "pca":
            stats["dal_note"] = "PCA DAL head: its PE term touches every row; assumed absent"
        elif head is not None and (head_names or self.dal_weight):
            g_dal_pe, g_dal_head = dal_pe_term(vit, S)
            if self.dal_weight is not None:
                lam = float(self.dal_weight)
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

    # ------------------------------------------------------------------------------- attack
    def _reconstruct(self, model: nn.Module, update: Update, meta: AttackMetadata) -> AttackResult:
        t0 = time.perf_counter()
        if meta.num_images != 1:
            raise AttackFailure(f"mjp_adaptive needs batch size 1 per update, got num_images={meta.num_images}")
        vit = _vit(model)
        if getattr(vit, "unk_embed", None) is None and hasattr(vit, "pos_embed"):
            return self._not_mjp(model, update, meta)
        grads, notes = update_to_gradients(update, meta)
        S, grads, stats = self.read_update(vit, grads)
        if not bool(S.any()):
            notes.append("no shuffled position detected: plain closed form / matching")
        design_a = _is_design_a(vit.blocks[0])
        if design_a:
            x_tilde, more = self._design_a(vit, grads, S, meta)
        else:
            x_tilde, more = self._fallback(model, grads, S, meta)
            notes.append("block 0 is not design A: MJP-aware april_optimization with the detected mask")
        stats.update(more)
        C, H, W = meta.image_size
        p = int(vit.patch_embed.patch_size[0])
        grid = (H // p, W // p)
        images = meta.denormalize(x_tilde)
        unshuffled = None
        if self.unshuffle:
            pix = images.reshape(C, grid[0], p, grid[1], p).permute(1, 3, 0, 2, 4).reshape(-1, C, p, p)
            idx = torch.nonzero(S).flatten()
            order, jinfo = solve_jigsaw(pix[idx], grid, S, pix)
            placed = place(pix[idx], order, S, pix)
            unshuffled = placed.reshape(grid[0], grid[1], C, p, p).permute(2, 0, 3, 1, 4).reshape(1, C, H, W)
            stats.update(jigsaw_cost=jinfo["cost_final"], jigsaw_swaps=jinfo["swaps"])
        stats.update(time_s=time.perf_counter() - t0, failed=False, notes=notes, attack=self.name,
                     design_a=design_a)
        stats.setdefault("objective", float("nan"))
        stats.setdefault("iterations", 0)
        return AttackResult(images, [stats], labels=stats.pop("_labels", None), unshuffled=unshuffled)

    def _labels(self, vit: nn.Module, grads: dict, meta: AttackMetadata) -> torch.Tensor:
        if meta.labels is not None:
            return meta.labels
        head = vit.get_classifier()
        ids = {id(q) for q in head.parameters()}
        names = [n for n, q in vit.named_parameters() if id(q) in ids and n in grads]
        return recover_labels(grads, names, 1, "bias")

    def _design_a(self, vit: nn.Module, grads: dict, S: torch.Tensor, meta: AttackMetadata):
        info = check_conditions(vit)
        if "blocks.0.attn.qkv.weight" not in grads:
            raise AttackFailure("update lacks 'blocks.0.attn.qkv.weight'")
        G_Z = _gradient_of_Z(vit, grads, info)
        red = mjp_reduction(vit, G_Z, grads["blocks.0.attn.qkv.weight"], S, self.rcond)
        stats = dict(red.stats)
        C, p = info["channels"], info["patch_size"]
        grid = tuple(int(g) for g in vit.patch_embed.grid_size)
        nU, k = red.x_unshuffled.shape[0], red.null_basis.shape[1]
        nS = int(S.sum())
        std = meta.std.to(torch.float64)
        b = torch.zeros(nU, k, dtype=torch.float64)
        gen = torch.Generator().manual_seed(self.seed)
        # Break the permutation symmetry: distinct random points of the affine hull. Every draw is
        # made in pixel space or over the unshuffled patches and mapped into the null space, never
        # per coordinate of null_basis: inside the null space the singular values are rounding
        # noise, so the SVD's basis there is arbitrary (it rotates between CPUs and thread counts),
        # and a per-coordinate draw would give another image for the same seed and update.
        a = 0.1 * torch.randn(nS, red.null_basis.shape[0], generator=gen, dtype=torch.float64) @ red.null_basis
        if k == 0:
            stats.setdefault("note", "no null directions: the reduction leaves nothing to refine")
        elif self.refine in ("prior", "match"):
            b, a = smoothness_prior_solve(red, grid, C, p, std, joint=self.joint_prior)
            if self.tv_prior:
                b = tv_prior_refine(red, b, grid, C, p, std)
            if not self.joint_prior:
                # Gaussian with the mean and full covariance of the unshuffled patches' null-space
                # coordinates (spread like them; equivariant under a rotation of the basis).
                coords = (red.x_unshuffled + b @ red.null_basis.T - red.x_bar) @ red.null_basis
                centred = coords - coords.mean(dim=0, keepdim=True)
                z = torch.randn(nS, nU, generator=gen, dtype=torch.float64) / max(nU - 1, 1) ** 0.5
                a = coords.mean(dim=0, keepdim=True) + z @ centred
        if self.refine in ("match", "gauss_newton") and self.iterations > 0 and nS > 0 and k > 0:
            labels = self._labels(vit, grads, meta)
            solver = self._match if self.refine == "match" else self._gauss_newton
            b, a, mstats = solver(vit, grads, red, b, a, labels, grid, C, p, std)
            stats.update(mstats)
            stats["_labels"] = labels
        return self._assemble(red, b, a, grid, C, p), stats

    @staticmethod
    def _assemble(red: Reduction, b: torch.Tensor, a: torch.Tensor, grid, C: int, p: int) -> torch.Tensor:
        """Model-input image [1, C, H, W] from the reduced parameters (shuffled at S in our order)."""
        N = red.shuffled.numel()
        x = torch.zeros(N, C * p * p, dtype=torch.float64)
        x = x.index_put((torch.nonzero(~red.shuffled).flatten(),), red.x_unshuffled + b @ red.null_basis.T)
        x = x.index_put((torch.nonzero(red.shuffled).flatten(),), red.x_bar + a @ red.null_basis.T)
        return patches_to_image(x, grid, C, p)[None]

    def _match(self, vit: nn.Module, grads: dict, red: Reduction, b0: torch.Tensor, a0: torch.Tensor,
               labels: torch.Tensor, grid, C: int, p: int, std: torch.Tensor):
        """Gradient matching over (b, a) with the attacker's forward at unk_mask = S (float64)."""
        work = copy.deepcopy(vit).to("cpu", torch.float64).eval()
        for blk in work.blocks:
            if hasattr(blk.attn, "fused_attn"):
                blk.attn.fused_attn = False
        names = [n for n, q in work.named_parameters() if n in grads and not n.startswith("dal_head.")
                 and float(grads[n].abs().max()) > 0]
        params = {n: q.detach().requires_grad_(True) for n, q in work.named_parameters()}
        buffers = dict(work.named_buffers())
        targets = {n: grads[n].to(torch.float64) for n in names}
        norms = {n: float(t.pow(2).sum()) for n, t in targets.items()}
        mask = red.shuffled[None]
        y = labels.reshape(1)
        valid = patches_to_image((~red.shuffled).double()[:, None].expand(-1, C * p * p), grid, C, p)[0] > 0
        scale = std.repeat_interleave(p * p)

        def objective(b: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
            x = self._assemble(red, b, a, grid, C, p)
            out = functional_call(work, (params, buffers), (x,), {"unk_mask": mask})
            loss = F.cross_entropy(out, y)
            g = torch.autograd.grad(loss, [params[n] for n in names], create_graph=True)
            obj = sum((gi - targets[n]).pow(2).sum() / norms[n] for gi, n in zip(g, names)) / len(names)
            if self.prior_weight > 0:
                xu = torch.zeros(red.shuffled.numel(), C * p * p, dtype=torch.float64)
                xu = xu.index_put((torch.nonzero(~red.shuffled).flatten(),),
                                  (red.x_unshuffled + b @ red.null_basis.T) * scale)
                d = _neighbour_diffs(patches_to_image(xu, grid, C, p), valid)
                obj = obj + self.prior_weight * d.pow(2).mean()
            return obj

        b, a = b0.clone(), a0.clone()
        first = float(objective(b, a).detach())
        iters = 0
        for rnd in range(self.rounds):
            for block in ("a", "ab"):
                vb = b.clone().requires_grad_("b" in block)
                va = a.clone().requires_grad_(True)
                opt_vars = [va] + ([vb] if "b" in block else [])
                opt = torch.optim.LBFGS(opt_vars, lr=1.0, max_iter=self.iterations, history_size=50,
                                        line_search_fn="strong_wolfe", tolerance_grad=1e-14,
                                        tolerance_change=1e-18)

                def closure():
                    opt.zero_grad()
                    obj = objective(vb, va)
                    obj.backward()
                    return obj

                opt.step(closure)
                iters += opt.state[opt._params[0]].get("n_iter", 0)
                b, a = vb.detach(), va.detach()
        last = float(objective(b, a).detach())
        _logger.debug("mjp_adaptive matching: %.3e -> %.3e in %d iterations", first, last, iters)
        return b, a, dict(objective=last, objective_first=first, iterations=iters, matched_parameters=len(names))

    def _gauss_newton(self, vit: nn.Module, grads: dict, red: Reduction, b0: torch.Tensor, a0: torch.Tensor,
                      labels: torch.Tensor, grid, C: int, p: int, std: torch.Tensor):
        """Levenberg-Marquardt on r(theta) = (g(theta) - g*) / |g*| per parameter, theta = (b, a).

        Large gradients (> 20k entries, e.g. W_qkv) are sketched by a fixed random projection of
        their last axis (16 columns) so that r stays ~1e5 long. Each step solves
        (J^T J + lam diag) d = -J^T r by conjugate gradients with J v (forward over reverse) and
        J^T u (reverse) products, accepted if |r| drops, else lam grows ten-fold.
        """
        work = copy.deepcopy(vit).to("cpu", torch.float64).eval()
        for blk in work.blocks:
            if hasattr(blk.attn, "fused_attn"):
                blk.attn.fused_attn = False
        params = {n: q.detach() for n, q in work.named_parameters()}
        buffers = dict(work.named_buffers())
        names = [n for n in params if n in grads and not n.startswith("dal_head.") and float(grads[n].abs().max()) > 0]
        gen = torch.Generator().manual_seed(self.seed + 1)
        sketch, target = {}, {}
        for n in names:
            t = grads[n].to(torch.float64)
            if t.numel() > 20000:
                sketch[n] = torch.randn(t.shape[-1], 16, generator=gen, dtype=torch.float64) / 4
                t = t.reshape(-1, t.shape[-1]) @ sketch[n]
            target[n] = (t.reshape(-1), t.norm().clamp_min(1e-300))
        nU, k = b0.shape
        nS = a0.shape[0]
        mask, y = red.shuffled[None], labels.reshape(1)
        sub = {n: params[n] for n in names}

        def loss_fn(ps: dict, theta: torch.Tensor) -> torch.Tensor:
            x = self._assemble(red, theta[:nU * k].reshape(nU, k), theta[nU * k:].reshape(nS, k), grid, C, p)
            out = functional_call(work, ({**params, **ps}, buffers), (x,), {"unk_mask": mask})
            return F.cross_entropy(out, y)

        def resid(theta: torch.Tensor) -> torch.Tensor:
            g = torch.func.grad(loss_fn)(sub, theta)
            out = []
            for n in names:
                gi = g[n].reshape(-1, g[n].shape[-1]) @ sketch[n] if n in sketch else g[n]
                out.append((gi.reshape(-1) - target[n][0]) / target[n][1])
            return torch.cat(out) / len(names) ** 0.5

        theta = torch.cat([b0.flatten(), a0.flatten()])
        r = resid(theta)
        first, lam, steps = float(r.pow(2).sum()), 1e-3, 0
        for _ in range(self.iterations):
            _, jvp_fn = torch.func.linearize(resid, theta)
            _, vjp_fn = torch.func.vjp(resid, theta)
            rhs = -vjp_fn(r)[0]
            JtJ = None
            if self.cg_iterations == 0:  # explicit Jacobian, P forward-over-reverse products
                eye = torch.eye(theta.numel(), dtype=theta.dtype)
                col = lambda v: torch.func.jvp(resid, (theta,), (v,))[1]  # noqa: E731
                J = torch.cat([torch.func.vmap(col)(eye[c:c + 128]) for c in range(0, len(eye), 128)])  # [P, R]
                JtJ = J @ J.T
                del J
            while lam < 1e10:
                if JtJ is not None:
                    d = torch.linalg.solve(JtJ + lam * torch.diag(torch.diag(JtJ)).clamp_min(1e-30)
                                           + 1e-30 * torch.eye(len(JtJ), dtype=JtJ.dtype), rhs)
                    r_new = resid(theta + d)
                    if float(r_new.pow(2).sum()) < float(r.pow(2).sum()):
                        theta, r, lam = theta + d, r_new, max(lam / 3, 1e-12)
                        steps += 1
                        break
                    lam *= 10
                    continue
                # CG on (J^T J + lam I) d = rhs (Jacobi-free: the reduced coordinates are orthonormal)
                d = torch.zeros_like(theta)
                res_cg, direction = rhs.clone(), rhs.clone()
                rr = float(res_cg @ res_cg)
                for _ in range(self.cg_iterations):
                    Ap = vjp_fn(jvp_fn(direction))[0] + lam * direction
                    alpha = rr / float(direction @ Ap)
                    d = d + alpha * direction
                    res_cg = res_cg - alpha * Ap
                    rr_new = float(res_cg @ res_cg)
                    if rr_new < 1e-20 * float(rhs @ rhs):
                        break
                    direction = res_cg + (rr_new / rr) * direction
                    rr = rr_new
                r_new = resid(theta + d)
                if float(r_new.pow(2).sum()) < float(r.pow(2).sum()):
                    theta, r, lam = theta + d, r_new, max(lam / 3, 1e-12)
                    steps += 1
                    break
                lam *= 10
            _logger.debug("mjp_adaptive LM step %d: residual %.3e, lam %.1e", steps, float(r.pow(2).sum()), lam)
        last = float(r.pow(2).sum())
        b, a = theta[:nU * k].reshape(nU, k), theta[nU * k:].reshape(nS, k)
        return b.detach(), a.detach(), dict(objective=last, objective_first=first, iterations=steps,
                                            matched_parameters=len(names))

    def _not_mjp(self, model: nn.Module, update: Update, meta: AttackMetadata) -> AttackResult:
        """A model without E_unk: knowing MJP adds nothing, so the strongest attacker that knows the
        model is the plain one (APRIL's closed form on design A, else april_optimization). Keeps
        plain rows of a table comparable instead of failing them."""
        from .april import AprilAnalytic
        from .matching import AprilOptimization

        vit = _vit(model)
        if _is_design_a(vit.blocks[0]):
            attack: Attack = AprilAnalytic()
        else:
            attack = AprilOptimization(iterations=self.fallback_iterations, seed=self.seed)
        result = attack.reconstruct(model, update, dict(meta.__dict__))
        for st in result.stats:
            st.setdefault("notes", []).append(f"no E_unk in this model: plain {attack.name}")
        return result

    def _fallback(self, model: nn.Module, grads: dict, S: torch.Tensor, meta: AttackMetadata):
        """Non-design-A models: MJP-aware APRIL optimisation with the detected mask (gradients with
        the DAL term removed, in the model's dtype)."""
        from .matching import AprilOptimization

        attack = AprilOptimization(iterations=self.fallback_iterations, seed=self.seed, unk_mask=S)
        res = attack.reconstruct(model, grads, dict(num_images=1, image_size=meta.image_size, mean=meta.mean,
                                                    std=meta.std, labels=meta.labels))
        if res.failed:
            raise AttackFailure(f"MJP-aware april_optimization failed: {res.reason}")
        x = meta.normalize(res.images.double())
        return x, dict(objective=res.stats[0].get("objective", float("nan")),
                             iterations=res.stats[0].get("iterations", 0))
