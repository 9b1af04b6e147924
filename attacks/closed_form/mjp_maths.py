"""The linear algebra of the MJP-aware closed form (:class:`attacks.optimization.mjp_adaptive.MJPAdaptive`) on a
design-A model: the reduction of one batch-1 update to the orbit the first layer cannot resolve, the
images that orbit's parameters assemble, and the smoothness priors that pick a point of it.

docs/design.md, "Attacking MJP with knowledge of MJP", step 2 (the reduction) and step 3's priors:
:func:`mjp_reduction` gives a :class:`Reduction` (the minimum-norm unshuffled patches, the null space
N and a point of the shuffled patches' affine hull); :func:`assemble` turns the reduced parameters
(b, a) into model inputs; :func:`smoothness_prior_solve` and :func:`tv_prior_refine` choose (b, a)
without any model evaluation, :func:`draw_shuffled` draws starts of the shuffled patches and
:func:`lbfgs` runs L-BFGS over (b, a). Plain float64 torch, no attack state: :mod:`attacks.solvers.lm` and the
batch attacks reuse it.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, Optional

import torch
import torch.nn as nn

from patchgrid import unpatchify

from .first_layer import check_conditions
from ..solvers.linalg import conjugate_gradient


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

    @property
    def device(self) -> torch.device:
        return self.x_unshuffled.device

    def to(self, device: torch.device) -> "Reduction":
        """The same reduction with its tensors on ``device`` (the functions below compute where it is)."""
        return replace(self, shuffled=self.shuffled.to(device), projector=self.projector.to(device),
                       z_u_perp=self.z_u_perp.to(device), x_unshuffled=self.x_unshuffled.to(device),
                       null_basis=self.null_basis.to(device), x_bar=self.x_bar.to(device))


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
    """Analytic reduction on a design-A model (:mod:`attacks.optimization.mjp_adaptive`, step 2).

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
    lead, N = patches.shape[:-2], patches.shape[-2]
    x = unpatchify(patches.reshape(-1, N, channels, p, p), grid)  # leading dims flattened into the batch
    return x.reshape(*lead, *x.shape[1:])


def assemble(red: Reduction, b: torch.Tensor, a: torch.Tensor, grid: tuple[int, int], C: int, p: int) -> torch.Tensor:
    """Model-input images from the reduced parameters (shuffled at S in our order): b [nU, k],
    a [nS, k] -> [1, C, H, W]; b [B, nU, k], a [B, nS, k] -> [B, C, H, W]."""
    batched = b.dim() == 3
    b, a = (b, a) if batched else (b[None], a[None])
    N = red.shuffled.numel()
    x = torch.zeros(b.shape[0], N, C * p * p, dtype=torch.float64, device=red.device)
    x[:, ~red.shuffled] = red.x_unshuffled + b @ red.null_basis.T
    x[:, red.shuffled] = red.x_bar + a @ red.null_basis.T
    return patches_to_image(x, grid, C, p)


def neighbour_diffs(img: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
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
    dev = red.device
    scale = std.to(dev, torch.float64).repeat_interleave(p * p)  # model input -> pixel units, (C, p, p) order
    region = torch.ones(N, dtype=torch.bool, device=dev) if joint else ~red.shuffled
    valid = patches_to_image(region.double()[:, None].expand(N, channels * p * p), grid, channels, p)[0] > 0
    base = torch.zeros(N, channels * p * p, dtype=torch.float64, device=dev)
    base[order[:nU]] = red.x_unshuffled * scale
    base[order[nU:]] = red.x_bar * scale
    d0 = neighbour_diffs(patches_to_image(base, grid, channels, p), valid)  # [F]
    Ns = (red.null_basis * scale[:, None]).T  # [k, C p^2]
    if n_var * k * N * channels * p * p <= dense_limit:
        cols = torch.zeros(n_var * k, N, channels * p * p, dtype=torch.float64, device=dev)
        for j in range(n_var):
            cols[j * k:(j + 1) * k, order[j]] = Ns
        J = neighbour_diffs(patches_to_image(cols, grid, channels, p), valid)  # [n_var k, F]
        lhs = J @ J.T + ridge * torch.eye(n_var * k, dtype=torch.float64, device=dev)
        coef = torch.linalg.solve(lhs, -(J @ d0)).reshape(n_var, k)
    else:
        coef = _prior_cg(Ns, order[:n_var], N, d0, valid, grid, channels, p, ridge, cg_tol, cg_iterations)
    a = coef[nU:] if joint else coef.new_zeros(nS, k)
    return coef[:nU], a


def _prior_cg(Ns: torch.Tensor, where: torch.Tensor, N: int, d0: torch.Tensor, valid: torch.Tensor,
              grid: tuple[int, int], channels: int, p: int, ridge: float, tol: float, iterations: int
              ) -> torch.Tensor:
    """The same least-squares problem as the dense path, matrix-free: conjugate gradients
    (:func:`attacks.solvers.linalg.conjugate_gradient`, scipy's ``cg`` step for step, on the device of ``Ns``)
    on the normal equations (J J^T + ridge) c = -J d0, with J applied as "coefficients -> image ->
    pixel differences" and its adjoint by autograd; at 224 px / patch 16 the dense J would need
    ~10^10 entries.

    Returns:
        c [len(where), k].
    """
    k, device = Ns.shape[0], Ns.device

    def forward(c: torch.Tensor) -> torch.Tensor:  # [n_var, k] -> pixel differences [F]
        patches = torch.zeros(N, Ns.shape[1], dtype=torch.float64, device=device)
        patches = patches.index_put((where.to(device),), c @ Ns)
        return neighbour_diffs(patches_to_image(patches, grid, channels, p), valid.to(device))

    def normal(c: torch.Tensor) -> torch.Tensor:  # (J J^T + ridge) applied to c
        c = c.detach().requires_grad_(True)
        y = forward(c)
        (g,) = torch.autograd.grad(y, c, grad_outputs=y.detach())
        return g + ridge * c.detach()

    c0 = torch.zeros(len(where), k, dtype=torch.float64, device=device, requires_grad=True)
    (rhs,) = torch.autograd.grad(forward(c0), c0, grad_outputs=-d0.to(device))
    sol, _, _ = conjugate_gradient(normal, rhs.detach(), rtol=tol, maxiter=iterations)
    return sol


def tv_prior_refine(red: Reduction, b0: torch.Tensor, grid: tuple[int, int], channels: int, p: int,
                    std: torch.Tensor, eps: float = 1e-4, iterations: int = 300) -> torch.Tensor:
    """Refine the unshuffled coefficients b [nU, k] under a total-variation prior (Charbonnier,
    sum sqrt(d^2 + eps) over neighbouring pixel differences of the unshuffled region, pixel units),
    from the quadratic prior's solution; L-BFGS, no model evaluations. Returns b."""
    if b0.numel() == 0:
        return b0
    scale = std.to(red.device, torch.float64).repeat_interleave(p * p)
    N = red.shuffled.numel()
    valid = patches_to_image((~red.shuffled).double()[:, None].expand(N, channels * p * p), grid, channels, p)[0] > 0
    U_idx = torch.nonzero(~red.shuffled).flatten()
    b = b0.clone().requires_grad_(True)
    opt = torch.optim.LBFGS([b], max_iter=iterations, history_size=50, line_search_fn="strong_wolfe",
                            tolerance_grad=1e-12, tolerance_change=1e-15)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        xu = (red.x_unshuffled + b @ red.null_basis.T) * scale
        full = torch.zeros(N, channels * p * p, dtype=torch.float64, device=red.device).index_put((U_idx,), xu)
        obj = (neighbour_diffs(patches_to_image(full, grid, channels, p), valid).pow(2) + eps).sqrt().sum()
        obj.backward()
        return obj

    opt.step(closure)
    return b.detach()


def draw_shuffled(red: Reduction, b: torch.Tensor, nS: int, gen: torch.Generator) -> torch.Tensor:
    """Shuffled patches' coefficients [nS, k] drawn from a Gaussian with the mean and full
    covariance of the unshuffled patches' null-space coordinates (spread like them; equivariant
    under a rotation of the basis, so the draw does not depend on how SVD picked it). Draws on the
    CPU from ``gen`` (the same on every device)."""
    nU = red.x_unshuffled.shape[0]
    coords = (red.x_unshuffled + b @ red.null_basis.T - red.x_bar) @ red.null_basis
    centred = coords - coords.mean(dim=0, keepdim=True)
    z = torch.randn(nS, nU, generator=gen, dtype=torch.float64).to(coords.device) / max(nU - 1, 1) ** 0.5
    return coords.mean(dim=0, keepdim=True) + z @ centred


# ------------------------------------------------------------------------------------ solver
def lbfgs(objective: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], b: torch.Tensor, a: torch.Tensor,
          iterations: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``iterations`` of L-BFGS (strong Wolfe) on objective(b, a) -> scalar over the reduced
    parameters; returns (b, a, iterations run)."""
    vb, va = b.clone().requires_grad_(True), a.clone().requires_grad_(True)
    opt = torch.optim.LBFGS([vb, va], lr=1.0, max_iter=iterations, history_size=50, line_search_fn="strong_wolfe",
                            tolerance_grad=1e-20, tolerance_change=1e-30)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        obj = objective(vb, va)
        obj.backward()
        return obj

    opt.step(closure)
    return vb.detach(), va.detach(), int(opt.state[opt.param_groups[0]["params"][0]].get("n_iter", 0))
