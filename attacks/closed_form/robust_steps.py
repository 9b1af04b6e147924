"""april_robust's equations, built once per update, and the steps of its alternating least squares.

:class:`Equations` holds every first-layer equation of one batch-1 update (see
:mod:`attacks.closed_form.april_robust` for the observation model): the patch rows of dL/dP (G
observed), dL/dW_e = G^T X, the bias equations a^T G = target and, for a design-A block 0, the qkv
equation W_qkv^T dL/dW_qkv = G_Z^T Z(X). :class:`Targets` are the values the data terms fit (the
received ones, or their projections onto the quantisation cells), :class:`NoiseStd` and
:class:`Weights` each group's noise std and least-squares weight. :func:`x_step` and :func:`g_step`
are the two linear least squares the attack alternates: X given G, G given X.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch

from ..solvers.linalg import conjugate_gradient
from .pe_closed_form import images_to_patches, patches_to_images
from .robust_terms import _DT, PatchPriorTerm, noise_floor, smooth_normal


@dataclass(frozen=True)
class BiasEq:
    """One bias equation a^T G = target (a: [N]) on its observed entries ``mask`` [D]."""

    name: str
    a: torch.Tensor
    target: torch.Tensor
    mask: torch.Tensor


@dataclass(frozen=True)
class QkvEquation:
    """The design-A equation W^T G_W = G_pre^T Z_pre + G^T (X W_e^T + b_e + offset), R = W^T G_W."""

    G_W: torch.Tensor
    W: torch.Tensor
    R: torch.Tensor
    G_pre: torch.Tensor
    Z_pre: torch.Tensor
    offset: torch.Tensor

    def residual(self, X: torch.Tensor, G: torch.Tensor, W_e: torch.Tensor, b_e: torch.Tensor) -> torch.Tensor:
        """[D, D]: R - G_pre^T Z_pre - G^T (X W_e^T + b_e + offset)."""
        return self.R - self.G_pre.T @ self.Z_pre - G.T @ (X @ W_e.T + b_e + self.offset)


@dataclass(frozen=True)
class Equations:
    """Every first-layer equation of one update, on the solve's device in float64.

    ``G_obs`` [N, D] the received patch rows of dL/dP, ``mG`` their observed entries; ``dW`` [D, J]
    the received dL/dW_e, ``mW`` its observed entries; ``W_e`` [D, J], ``b_e`` [D] the patch
    embedding; ``bias`` the bias equations; ``qkv`` the design-A equation or None; ``info`` the
    model's :func:`attacks.closed_form.pe_closed_form.pe_conditions`."""

    info: Any
    G_obs: torch.Tensor
    mG: torch.Tensor
    dW: torch.Tensor
    mW: torch.Tensor
    W_e: torch.Tensor
    b_e: torch.Tensor
    bias: tuple[BiasEq, ...]
    qkv: Optional[QkvEquation]

    def observed(self) -> "Targets":
        """The received values as the data terms' targets."""
        return Targets(self.G_obs, self.dW, tuple(e.target for e in self.bias))


@dataclass(frozen=True)
class Targets:
    """What the data terms fit: G [N, D], dL/dW_e [D, J] and each bias equation's target."""

    G: torch.Tensor
    dW: torch.Tensor
    bias: tuple[torch.Tensor, ...]


@dataclass(frozen=True)
class NoiseStd:
    """Each equation group's noise std (``qkv``: per unit ||W_qkv[:, d]||^2; None without it)."""

    P: float
    We: float
    bias: tuple[float, ...]
    qkv: Optional[float]

    def as_dict(self, eqs: Equations) -> dict[str, float]:
        return dict(P=self.P, We=self.We, **{e.name: s for e, s in zip(eqs.bias, self.bias)},
                    **({"qkv": self.qkv} if self.qkv is not None else {}))


@dataclass(frozen=True)
class Weights:
    """Each group's least-squares weight: P, We, bias scalars, ``omega`` [D] the qkv rows' (or None)."""

    P: float
    We: float
    bias: tuple[float, ...]
    omega: Optional[torch.Tensor]

    @staticmethod
    def of(std: NoiseStd, eqs: Equations) -> "Weights":
        """The inverse variances of ``std`` (the qkv rows' with the rounding floor of R)."""
        omega = None
        if eqs.qkv is not None:
            q = eqs.qkv
            omega = 1.0 / (std.qkv ** 2 * q.W.pow(2).sum(0) + noise_floor(q.R) ** 2)
        return Weights(1 / std.P ** 2, 1 / std.We ** 2, tuple(1 / s ** 2 for s in std.bias), omega)

    def scaled(self, factor: float) -> "Weights":
        """The data terms' weights times ``factor`` (the qkv rows' unchanged)."""
        return Weights(self.P * factor, self.We * factor, tuple(w * factor for w in self.bias), self.omega)


@dataclass(frozen=True)
class PriorState:
    """The image prior of one X solve: weight ``lam``, the TV reweighting ``edge`` (x and y
    difference weights, None: all ones) and the Gaussian patch prior's ``term`` (None: smoothness)."""

    lam: float
    edge: Optional[tuple[torch.Tensor, torch.Tensor]]
    term: Optional[PatchPriorTerm]


def cell_targets(eqs: Equations, X: torch.Tensor, G: torch.Tensor, cells: dict) -> Targets:
    """The current predictions of G, dL/dW_e and the bias targets projected onto the quantisation
    cells of the received values (exact zeros, the missing entries, are left as they are)."""
    def proj(pred, obs, h):
        return torch.where(obs != 0, torch.minimum(torch.maximum(pred, obs - h), obs + h), obs)
    tG = proj(G, eqs.G_obs, cells["P"])
    tW = proj(G.T @ X, eqs.dW, cells["We"])
    tb = tuple(proj(e.a @ G, e.target, h) for e, h in zip(eqs.bias, cells["bias"]))
    return Targets(tG, tW, tb)


def mean_squares(eqs: Equations, X: torch.Tensor, G: torch.Tensor) -> dict[str, float]:
    """Mean squared residual of each equation group (the qkv one per unit ||W_qkv[:, d]||^2)."""
    mG, mW = eqs.mG, eqs.mW
    out = {"P": float(((G - eqs.G_obs)[mG]).pow(2).mean()) if bool(mG.any()) else 0.0,
           "We": float(((G.T @ X - eqs.dW)[mW]).pow(2).mean()) if bool(mW.any()) else 0.0}
    for e in eqs.bias:
        out[e.name] = float(((e.a @ G - e.target)[e.mask]).pow(2).mean()) if bool(e.mask.any()) else 0.0
    if eqs.qkv is not None:
        r = eqs.qkv.residual(X, G, eqs.W_e, eqs.b_e)
        out["qkv"] = float((r.pow(2).mean(1) / eqs.qkv.W.pow(2).sum(0).clamp_min(1e-300)).mean())
    return out


def chi2_per_entry(eqs: Equations, w: Weights, X: torch.Tensor, G: torch.Tensor) -> dict[str, float]:
    """The weighted squared residual per observed entry of every equation group at (X, G)."""
    mG, mW = eqs.mG, eqs.mW
    chi = {"P": float(((G - eqs.G_obs)[mG]).pow(2).sum() * w.P / max(int(mG.sum()), 1)),
           "We": float(((G.T @ X - eqs.dW)[mW]).pow(2).sum() * w.We / max(int(mW.sum()), 1))}
    for e, wb in zip(eqs.bias, w.bias):
        chi[e.name] = float(((e.a @ G - e.target)[e.mask]).pow(2).sum() * wb / max(int(e.mask.sum()), 1))
    if eqs.qkv is not None:
        q = eqs.qkv
        Zp = X @ eqs.W_e.T + eqs.b_e + q.offset
        r = q.R - q.G_pre.T @ q.Z_pre - G.T @ Zp
        chi["qkv"] = float((r.pow(2).sum(1) * w.omega).sum() / r.numel())
    return chi


def redundancy_std(eqs: Equations) -> float:
    """Common noise std from the bias residual over fully observed columns (0 if none)."""
    if not eqs.bias:
        return 0.0
    e = eqs.bias[0]
    cols = eqs.mG.all(dim=0) & e.mask
    if len(eqs.bias) > 1 or not bool(cols.any()):
        return 0.0
    r = (e.a @ eqs.G_obs - e.target)[cols]
    return float(r.pow(2).mean().sqrt()) / math.sqrt(eqs.info.N + 1)


def mean_patch_start(eqs: Equations) -> torch.Tensor:
    """X with every patch equal to argmin_x sum_d (dW[d] - db[d] x)^2 (observed entries):
    dL/dW_e = db_e x^T exactly when all patches equal x."""
    N, J = eqs.info.N, eqs.info.patch_dim
    if not eqs.bias:
        return eqs.dW.new_zeros(N, J)
    db, mb = eqs.bias[0].target, eqs.bias[0].mask
    m = eqs.mW & mb[:, None]
    num = (m * eqs.dW * db[:, None]).sum(0)
    den = (m * db[:, None] ** 2).sum(0).clamp_min(1e-300)
    return (num / den).expand(N, J).clone()


def _x_normal_blocks(eqs: Equations, G: torch.Tensor, tW: torch.Tensor, wW: torch.Tensor,
                     omega: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(A1 [J, N, N], rhs [N, J]): the data terms' normal equations per patch entry j (the qkv
    term's diagonal part only: it couples the entries through W_e^T W_e)."""
    mW = eqs.mW
    if bool((mW == 1).all()):
        A1 = wW[:, None, None] * (G @ G.T)
    else:
        A1 = torch.einsum("nd,dj,md->jnm", G, mW.to(_DT) * wW, G)
    rhs = G @ (mW * tW * wW)
    if eqs.qkv is not None:
        q, W_e = eqs.qkv, eqs.W_e
        om = omega[:, None]
        R1 = q.R - q.G_pre.T @ q.Z_pre - G.T @ (eqs.b_e + q.offset)
        GoG = G @ (om * G.T)
        cj = (W_e * W_e).sum(0)  # diag of W_e^T W_e, [J]
        A1 = A1 + cj[:, None, None] * GoG
        rhs = rhs + G @ (om * R1) @ W_e
    return A1, rhs


def _x_preconditioner(eqs: Equations, A1: torch.Tensor, rhs: torch.Tensor, prior: PriorState,
                      eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(Cholesky factors [J, N, N] of the block-diagonal preconditioner, rhs with the patch prior's
    linear term): A1 plus the prior's diagonal (the smoothness prior's is at most 4 lam)."""
    info, lam = eqs.info, prior.lam
    jitter = 1e-12 * A1.diagonal(dim1=1, dim2=2).mean(1).clamp_min(1e-300)  # rounding of near-singular G G^T
    if prior.term is not None:  # the prior's exact diagonal, per patch entry
        dg = lam * images_to_patches(prior.term.diag_img, info)[0]  # [N, J]
        prec = A1 + torch.diag_embed(dg.T + (eps + jitter)[:, None])
        rhs = rhs + lam * images_to_patches(prior.term.rhs_img, info)[0]
    else:
        prec = A1 + ((4 * lam + eps) + jitter)[:, None, None] * torch.eye(info.N, dtype=_DT, device=A1.device)
    return torch.linalg.cholesky(prec), rhs


def block_cholesky_solve(L: torch.Tensor, X: torch.Tensor) -> torch.Tensor:
    """Column j of X [N, J] solved against the block L[j] L[j]^T (L [J, N, N] lower Cholesky factors):
    the x step's block-diagonal preconditioner. Two triangular solves rather than
    ``torch.cholesky_solve``: the same result to the bit, about a third of the time on a 224 px
    image's [768, 196, 196] factors (``python bench/block_solve.py``; docs/speed.md)."""
    Xc = X.T.contiguous()[:, :, None]  # [J, N, 1]
    return torch.linalg.solve_triangular(L.mT, torch.linalg.solve_triangular(L, Xc, upper=False), upper=True)[:, :, 0].T


def x_step(eqs: Equations, G: torch.Tensor, tW: torch.Tensor, wW: torch.Tensor, omega: Optional[torch.Tensor],
           prior: PriorState, X0: Optional[torch.Tensor], cg: tuple[float, int]) -> tuple[torch.Tensor, int]:
    """argmin_X sum_j wW_j |mW (G^T X - tW)_j|^2 + sum_d omega_d |(G^T X W_e^T - R1)_d|^2 + lam |L X|^2 + eps |X|^2
    (``wW`` [J]: per-entry weights; ``prior.term``: the Gaussian patch prior's Mahalanobis sum instead
    of |L X|^2), by preconditioned conjugate gradients from ``X0`` (``cg``: relative tolerance,
    iteration cap). Returns (X, CG iterations)."""
    info, mW = eqs.info, eqs.mW
    N, J = info.N, info.patch_dim
    lam = prior.lam
    eps = 1e-6 * lam
    A1, rhs = _x_normal_blocks(eqs, G, tW, wW, omega)
    L, rhs = _x_preconditioner(eqs, A1, rhs, prior, eps)

    def op(x: torch.Tensor) -> torch.Tensor:
        X = x.reshape(N, J)
        out = G @ (wW * mW * (G.T @ X))
        if eqs.qkv is not None:
            out = out + G @ (omega[:, None] * (G.T @ X @ eqs.W_e.T)) @ eqs.W_e
        img = patches_to_images(X[None], info)
        reg = smooth_normal(img, prior.edge) if prior.term is None else prior.term.apply(img)
        return out + lam * images_to_patches(reg, info)[0] + eps * X

    def pre(x: torch.Tensor) -> torch.Tensor:
        return block_cholesky_solve(L, x.reshape(N, J))

    b = rhs.reshape(-1)
    start = pre(b).reshape(-1) if X0 is None else X0.reshape(-1)
    sol, its, _ = conjugate_gradient(lambda v: op(v).reshape(-1), b, x0=start,
                                     precond=lambda v: pre(v).reshape(-1), rtol=cg[0], maxiter=cg[1])
    return sol.reshape(N, J), its


def g_step(eqs: Equations, X: torch.Tensor, tgt: Targets, w: Weights) -> torch.Tensor:
    """argmin_G of the same objective with X fixed: one N x N system per embedding dimension."""
    N, mW = eqs.info.N, eqs.mW
    mGd = eqs.mG.to(_DT)
    H = torch.diag_embed(w.P * mGd.T)  # [D, N, N]
    if bool((mW == 1).all()):
        H = H + w.We * (X @ X.T)
    else:
        H = H + w.We * torch.einsum("nj,dj,mj->dnm", X, mW.to(_DT), X)
    rhs = w.P * (mGd * tgt.G).T + w.We * ((mW * tgt.dW) @ X.T)  # [D, N]
    for e, t, wb in zip(eqs.bias, tgt.bias, w.bias):
        md = e.mask.to(_DT)
        H = H + (wb * md)[:, None, None] * torch.outer(e.a, e.a)
        rhs = rhs + (wb * md * t)[:, None] * e.a[None]
    if eqs.qkv is not None:
        q = eqs.qkv
        Zp = X @ eqs.W_e.T + eqs.b_e + q.offset  # [N, D]
        om = w.omega
        H = H + om[:, None, None] * (Zp @ Zp.T)
        target = q.R - q.G_pre.T @ q.Z_pre  # [D, D], row d = sum_t G[t, d] Zp[t]
        rhs = rhs + om[:, None] * (target @ Zp.T)
    scale = H.diagonal(dim1=1, dim2=2).mean(1).clamp_min(1e-300)
    H = H + (1e-12 * scale)[:, None, None] * torch.eye(N, dtype=_DT, device=X.device)
    return torch.linalg.solve(H, rhs[:, :, None])[:, :, 0].T
