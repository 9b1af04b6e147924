"""Linear algebra the attacks share that torch and scipy do not provide on every device.

:func:`conjugate_gradient` solves A x = b for any symmetric positive definite operator;
:func:`damped_cg` solves Levenberg-Marquardt's (J^T J + mu I) h = -g on Jacobian products
(:func:`linearise`), preconditioned by :class:`SketchPreconditioner` from a row sketch
(:func:`row_sketch`): the steps of :func:`attacks.solvers.lm.matrix_free_lm`. It is a CG of its own
because it also accumulates J h from the J p of every step (which prices the step's predicted
reduction exactly when it stops early) and stops on the residual after each step.

:func:`conjugate_gradient` is hand-written: ``scipy.sparse.linalg.cg`` needs its operator's
vectors as numpy arrays on the host, so an operator built from CUDA tensors would copy every
vector to the CPU and back at every iteration, and torch has no conjugate-gradient solver. It
follows scipy's ``cg`` step for step (same stopping rule and iteration count), so on the CPU it
gives scipy's answer to rounding.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch.func import vjp, vmap

Operator = Callable[[torch.Tensor], torch.Tensor]


def conjugate_gradient(matvec: Operator, b: torch.Tensor, x0: Optional[torch.Tensor] = None,
                       precond: Optional[Operator] = None, rtol: float = 1e-5, maxiter: Optional[int] = None,
                       ) -> tuple[torch.Tensor, int, bool]:
    """Preconditioned conjugate gradients for ``A x = b``, A symmetric positive definite.

    Runs on the device and dtype of ``b``. Stops once ``||b - A x|| < rtol ||b||`` (checked before
    each iteration, as scipy's ``cg`` with ``atol=0``) or after ``maxiter`` iterations.

    Args:
        matvec: x -> A x, for vectors shaped like ``b``.
        b: the right-hand side [n] (any shape: the inner products run over all entries).
        x0: the start (None: zeros).
        precond: x -> M x, M approximating A^-1 (None: the identity).
        rtol: relative tolerance on the residual norm.
        maxiter: iteration cap (None: 10 n, scipy's default).

    Returns:
        (x, iterations done, converged).
    """
    x = torch.zeros_like(b) if x0 is None else x0.clone()
    bnorm = torch.linalg.vector_norm(b)
    if float(bnorm) == 0:
        return torch.zeros_like(b), 0, True
    atol = rtol * bnorm
    maxiter = 10 * b.numel() if maxiter is None else maxiter
    r = b - matvec(x) if x0 is not None and bool(x.any()) else b.clone()
    p = rho_prev = None
    for it in range(maxiter):
        # one host sync per iteration, for the stopping rule (as scipy): the matvecs dominate
        if bool(torch.linalg.vector_norm(r) < atol):
            return x, it, True
        z = r if precond is None else precond(r)
        rho = torch.vdot(r.flatten(), z.flatten())
        p = z.clone() if p is None else z + (rho / rho_prev) * p
        q = matvec(p)
        alpha = rho / torch.vdot(p.flatten(), q.flatten())
        x = x + alpha * p
        r = r - alpha * q
        rho_prev = rho
    return x, maxiter, False


def linearise(fun: Callable[[torch.Tensor], torch.Tensor], theta: torch.Tensor) -> tuple[
        torch.Tensor, Callable[[torch.Tensor], torch.Tensor], Callable[[torch.Tensor], torch.Tensor], Callable]:
    """(r, v -> J v, u -> J^T u, the pullback) of ``fun`` at theta from one forward.

    J v is the pullback's own pullback (u -> J^T u is linear, its transpose is v -> J v): it reuses
    the kept forward, where forward mode reruns it (docs/results/solvers.md compares the two). The
    pullback itself is what :func:`row_sketch` takes."""
    r, pullback = vjp(fun, theta)
    r = r.detach()

    def vjp_fn(u: torch.Tensor) -> torch.Tensor:
        return pullback(u)[0]

    _, pushforward = vjp(vjp_fn, torch.zeros_like(r))

    def jvp_fn(v: torch.Tensor) -> torch.Tensor:
        return pushforward(v)[0]

    return r, jvp_fn, vjp_fn, pullback


class SketchPreconditioner:
    """Inverse of a low-rank-plus-identity model of J^T J + mu I, read off a Gaussian row sketch.

    Y = Omega J [m, n] with Omega [m, R] i.i.d. N(0, 1) rows: E[Y^T Y] / m = J^T J, and the top right
    singular vectors V [n, m] of Y approximate J's (a randomized range finder on J^T with no power
    iteration). With lambda_i = s_i^2 / m the model is V diag(lambda) V^T + lambda_m (I - V V^T), and

        P^-1 v = V diag((lambda_m + mu) / (lambda_i + mu)) V^T v + (v - V V^T v)

    (the scaling of randomized Nystrom preconditioning, Frangella, Tropp & Udell 2023): directions
    the sketch resolved are divided by their own curvature, the rest by the sketch's smallest. Written
    here because the sketch is taken through vector-Jacobian products of a function no library
    preconditioner sees."""

    def __init__(self, Y: torch.Tensor) -> None:
        m, n = Y.shape
        if m < n:
            # through the m x m Gram matrix: one product and an m x m eigensolve, where the SVD of the
            # wide Y costs several passes over it (at 224 px Y is ~1.2e4 x 8.5e4); the squared
            # singular values lose the smallest directions' digits, which a preconditioner can spare
            ev, U = torch.linalg.eigh(Y @ Y.T)
            ev, U = ev.flip(0), U.flip(1)
            keep = ev > float(ev[0]) * 1e-13
            ev, U = ev[keep], U[:, keep]
            self.Vh, self.lam = (U.T @ Y) / ev.sqrt()[:, None], ev / m
        else:
            _, s, Vh = torch.linalg.svd(Y, full_matrices=False)
            self.Vh, self.lam = Vh, s.pow(2) / m
        self.floor = float(self.lam[-1])

    def apply(self, v: torch.Tensor, mu: float) -> torch.Tensor:
        c = self.Vh @ v
        scale = (self.floor + mu) / (self.lam + mu)
        return v + self.Vh.T @ (c * (scale - 1))


def row_sketch(vjp_fn: Callable[[torch.Tensor], tuple[torch.Tensor, ...]], rows: int, m: int,
               generator: torch.Generator, chunk: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Y = Omega J [m, n]: ``m`` vector-Jacobian products with i.i.d. N(0, 1) cotangents of length ``rows``,
    ``chunk`` at a time under ``vmap`` (Omega itself is never stored: at 224 px it would be m x ~4.5e6).
    ``generator`` lives on ``device``."""
    parts = []
    for i in range(0, m, chunk):
        omega = torch.randn(min(chunk, m - i), rows, generator=generator, dtype=dtype, device=device)
        parts.append(vmap(lambda u: vjp_fn(u)[0])(omega))
    return torch.cat(parts)


@dataclass
class CGResult:
    """A preconditioned conjugate-gradient solve of (J^T J + mu I) h = -g."""

    h: torch.Tensor
    Jh: torch.Tensor
    iterations: int
    relative_residual: float


def damped_cg(jvp_fn: Callable[[torch.Tensor], torch.Tensor], vjp_fn: Callable[[torch.Tensor], torch.Tensor],
              g: torch.Tensor, mu: float, precondition: Callable[[torch.Tensor], torch.Tensor] | None,
              max_iterations: int, tol: float) -> CGResult:
    """Solve (J^T J + mu I) h = -g by preconditioned conjugate gradients, one J v and one J^T u a step.

    Also returns J h (accumulated from the J p of every step, no extra product), which prices the
    step's predicted reduction exactly even when CG stops early. Stops when ||residual|| <= tol ||g||."""
    h = torch.zeros_like(g)
    res = -g
    z = precondition(res) if precondition else res
    p = z
    rz = float(res @ z)
    norm_g = float(g.norm())
    Jh: torch.Tensor | None = None
    it = 0
    rel = 1.0
    while it < max_iterations:
        Jp = jvp_fn(p)
        Ap = vjp_fn(Jp) + mu * p
        pAp = float(p @ Ap)
        if not pAp > 0:
            break
        alpha = rz / pAp
        h = h + alpha * p
        Jh = alpha * Jp if Jh is None else Jh + alpha * Jp
        res = res - alpha * Ap
        it += 1
        rel = float(res.norm()) / max(norm_g, 1e-300)
        if rel <= tol:
            break
        z = precondition(res) if precondition else res
        rz_new = float(res @ z)
        p = z + (rz_new / rz) * p
        rz = rz_new
    if Jh is None:
        Jh = jvp_fn(h)
    return CGResult(h, Jh, it, rel)
