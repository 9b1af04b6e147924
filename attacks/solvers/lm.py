"""Levenberg-Marquardt for nonlinear least squares ||r(theta)||^2, dense and matrix-free (float64).

:func:`levenberg_marquardt` takes the exact dense Jacobian and forms its Gram matrix once per Jacobian.
Where the dense Jacobian does not fit (DeiT-S at 224 px: 3.1e6 rows x 85,456 unknowns, 2.1 TB),
:func:`matrix_free_lm` takes the same steps without forming it: each step solves
(J^T J + mu I) h = -J^T r by conjugate gradients on Jacobian-vector and vector-Jacobian products
(:func:`linearise`), preconditioned by a low-rank model of J^T J read off a Gaussian row sketch
Omega J (m vector-Jacobian products; :class:`SketchPreconditioner`). The preconditioner's effect
is measured in docs/results/solvers.md.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch.func import vjp, vmap

_logger = logging.getLogger(__name__)

#: Columns of the Jacobian computed per vmapped forward-mode pass (memory ~ this many forwards' activations).
JACOBIAN_CHUNK = 64
#: Bytes the matrix-free solver's row sketch (m x n, float64) may take by default: at DeiT-S / 224 px
#: (~8.5e4 unknowns) ~1.2e4 rows.
SKETCH_MEMORY = 8e9

@dataclass
class LMResult:
    """Outcome of :func:`levenberg_marquardt`."""

    theta: torch.Tensor
    value_first: float
    value: float
    jacobians: int
    evaluations: int
    history: list[float] = field(default_factory=list)


def levenberg_marquardt(fun: Callable[[torch.Tensor], torch.Tensor],
                        jac: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
                        theta0: torch.Tensor, max_jacobians: int = 6, tau: float = 1e-12,
                        floor: float = 0.0, max_trials: int = 12, stall: float = 1e-2) -> LMResult:
    """Minimise ||fun(theta)||^2 by Levenberg-Marquardt with Nielsen's damping update.

    Steps solve (J^T J + mu I) h = -J^T r by Cholesky; a step is kept when the residual falls
    (gain ratio rho > 0), mu then shrinks by max(1/3, 1 - (2 rho - 1)^3), else mu grows by nu
    (doubling each refusal). Written here rather than ``scipy.optimize.least_squares`` because the
    Jacobian is the cost (~1,024 forwards) and is dense and tall (~1.9e5 x 1,024): the 1,024 x 1,024
    Gram matrix is formed once per Jacobian and reused by every damping trial, where scipy's ``lm``
    and ``trf`` factor the tall matrix itself.

    Args:
        fun: theta [n] -> residual vector [R].
        jac: theta -> (r [R], J [R, n]).
        theta0: start [n].
        max_jacobians: Jacobian evaluations at most (each is one Gauss-Newton iteration).
        tau: initial mu = tau * max diag(J^T J).
        floor: stop once ||r||^2 <= floor.
        max_trials: damping increases per iteration before giving up.
        stall: stop after an iteration that lowers ||r||^2 by less than this fraction (at the
            residual's rounding floor a Jacobian buys nothing).
    """
    theta = theta0.clone()
    with torch.no_grad():
        value = float(fun(theta).pow(2).sum())
    first, history = value, [value]
    mu, nu, jacobians, evaluations = None, 2.0, 0, 1
    while jacobians < max_jacobians and value > floor:
        r, J = jac(theta)
        jacobians += 1
        G = J.T @ J
        g = J.T @ r
        del J
        if mu is None:
            mu = tau * float(G.diagonal().max())
        eye = torch.eye(G.shape[0], dtype=G.dtype, device=G.device)
        accepted = False
        for _ in range(max_trials):
            L, info = torch.linalg.cholesky_ex(G + mu * eye)
            if int(info) != 0:
                mu, nu = mu * nu, nu * 2
                continue
            h = -torch.cholesky_solve(g[:, None], L)[:, 0]
            predicted = float(h @ (G @ h) + 2 * mu * (h @ h))
            with torch.no_grad():
                trial = float(fun(theta + h).pow(2).sum())
            evaluations += 1
            rho = (value - trial) / max(predicted, 1e-300)
            if math.isfinite(trial) and trial < value:
                theta, value = theta + h, trial
                mu *= max(1 / 3, 1 - (2 * rho - 1) ** 3)
                nu, accepted = 2.0, True
                break
            mu, nu = mu * nu, nu * 2
        history.append(value)
        _logger.debug("LM iteration %d: residual %.3e, mu %.1e", jacobians, value, mu)
        if not accepted or value > (1 - stall) * history[-2]:
            break
    return LMResult(theta, first, value, jacobians, evaluations, history)


def linearise(fun: Callable[[torch.Tensor], torch.Tensor], theta: torch.Tensor) -> tuple[
        torch.Tensor, Callable[[torch.Tensor], torch.Tensor], Callable[[torch.Tensor], torch.Tensor], Callable]:
    """(r, v -> J v, u -> J^T u, the pullback) of ``fun`` at theta from one forward.

    J v is the pullback's own pullback (u -> J^T u is linear, its transpose is v -> J v): it reuses
    the kept forward, where forward mode reruns it; 0.017 against 0.052 s a product at 32 px, 2
    blocks, the same numbers to 5e-16. The pullback itself is what :func:`row_sketch` takes."""
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


@dataclass
class MatrixFreeResult(LMResult):
    """Outcome of :func:`matrix_free_lm`: :class:`LMResult` plus the CG iterations of every trial step."""

    cg_iterations: list[int] = field(default_factory=list)
    sketch_rows: int = 0


def matrix_free_lm(fun: Callable[[torch.Tensor], torch.Tensor], theta0: torch.Tensor, max_iterations: int = 6,
                   sketch_rows: int | None = None, cg_iterations: int = 500, cg_tol: float = 1e-8,
                   tau: float = 1e-12, floor: float = 0.0, max_trials: int = 12, stall: float = 1e-2,
                   xtol: float = 1e-9, relative_floor: float = 1e-16, seed: int = 0, chunk: int = JACOBIAN_CHUNK,
                   callback: Callable[[int, torch.Tensor, float], None] | None = None) -> MatrixFreeResult:
    """Levenberg-Marquardt on ||fun(theta)||^2 without forming the Jacobian (module docstring).

    Per iteration: r and the reverse-mode pullback at theta (one forward, kept for every J^T u and,
    transposed once more, every J v), a row sketch of ``sketch_rows`` vector-Jacobian products
    (:func:`row_sketch`) for the preconditioner, then for each damping trial a CG solve
    (:func:`damped_cg`) and one forward at the trial point. Damping as :func:`levenberg_marquardt`
    (Nielsen), mu starting at tau times the sketch's largest curvature; a step is kept when the residual falls. The predicted reduction is
    -2 g.h - ||J h||^2, exact for an inexact step.

    Args:
        fun: theta [n] -> residual [R], differentiable by ``torch.func`` (forward and reverse mode).
        theta0: start [n].
        max_iterations: Gauss-Newton iterations at most (each: one pullback, one sketch).
        sketch_rows: m; None: n / 2 (at least 64, at most n and what :data:`SKETCH_MEMORY` holds).
            0: no preconditioner (plain CG). Above n the sketch oversamples: its curvatures approach
            J^T J's (m = 4n: the preconditioned condition number ~9 whatever J's).
        cg_iterations: CG iterations per trial step at most.
        cg_tol: CG stops at ||(J^T J + mu I) h + g|| <= cg_tol ||g||.
        tau, floor, max_trials, stall: as :func:`levenberg_marquardt`.
        xtol: stop after a kept step shorter than ``xtol`` ||theta||; relative_floor: stop once ||r||^2
            is below ``relative_floor`` times the start's. At the residual's rounding floor every
            damping trial costs a CG solve and buys nothing (the dense solver's cost a Cholesky each):
            measured at 32 px from 0.05 noise, 7e-5 -> 9e-22 (a 2e-10 step) and 1e-4 -> 1.4e-21 in
            5 iterations, then 12 refused trials, ~1,900 CG iterations, in a sixth.
        seed: seed of the sketch's Gaussian rows.
        chunk: vector-Jacobian products per vmapped pass of the sketch.
        callback: called after every iteration with (iteration, theta, ||r||^2), e.g. to keep what a
            run stopped by a time limit had reached.
    """
    n = theta0.numel()
    m = min(n, max(64, n // 2), int(SKETCH_MEMORY // (8 * n))) if sketch_rows is None else int(sketch_rows)
    if not 0 <= m <= 4 * n:
        raise ValueError(f"sketch_rows {sketch_rows}: give 0 (no preconditioner) to 4 times the number of "
                         f"unknowns, {4 * n}")
    gen = torch.Generator(device=theta0.device).manual_seed(seed)
    theta = theta0.clone()
    with torch.no_grad():
        value = float(fun(theta).pow(2).sum())
    first, history, cg_its = value, [value], []
    mu, nu, iterations, evaluations = None, 2.0, 0, 1
    while iterations < max_iterations and value > max(floor, relative_floor * first):
        r, jvp_fn, vjp_fn, pullback = linearise(fun, theta)
        iterations += 1
        g = vjp_fn(r)
        pre = SketchPreconditioner(row_sketch(pullback, r.numel(), m, gen, chunk, r.dtype, r.device)) if m else None
        if mu is None:
            mu = tau * (float(pre.lam[0]) if pre is not None else float(g.norm()) ** 2 / max(value, 1e-300))
        accepted = False
        for _ in range(max_trials):
            step = damped_cg(jvp_fn, vjp_fn, g, mu, (lambda v: pre.apply(v, mu)) if pre is not None else None,
                             cg_iterations, cg_tol)
            cg_its.append(step.iterations)
            h = step.h
            predicted = -float(2 * (g @ h) + step.Jh.pow(2).sum())
            with torch.no_grad():
                trial = float(fun(theta + h).pow(2).sum())
            evaluations += 1
            rho = (value - trial) / max(predicted, 1e-300)
            if math.isfinite(trial) and trial < value:
                theta, value = (theta + h).detach(), trial
                mu *= max(1 / 3, 1 - (2 * rho - 1) ** 3)
                nu, accepted = 2.0, True
                break
            mu, nu = mu * nu, nu * 2
        history.append(value)
        step = float(h.norm()) / max(float(theta.norm()), 1e-300)
        _logger.debug("matrix-free LM iteration %d: residual %.3e, mu %.1e, CG %s, step %.1e", iterations, value, mu,
                      cg_its[-1:], step)
        del jvp_fn, vjp_fn, pullback
        if callback is not None:
            callback(iterations, theta, value)
        if not accepted or value > (1 - stall) * history[-2] or step <= xtol:
            break
    return MatrixFreeResult(theta, first, value, iterations, evaluations, history, cg_its, m)
