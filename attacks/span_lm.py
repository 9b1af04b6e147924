"""Second-order fit of the span residual: Levenberg-Marquardt on its vector form (float64, CPU).

:class:`attacks.spans.SpanResidual` is a mean over layers of ||A_l - A_l V_l V_l^T||^2 /
||A_l||^2, a sum of squares. Written as one vector r(theta) (every span layer's A_l Q_l / ||A_l||
/ sqrt(L), Q_l an orthonormal basis of the complement of layer l's span, theta the reduced
parameters (b, a) of :class:`attacks.mjp_maths.Reduction`), ||r||^2 equals the residual's value,
and the problem is a nonlinear least-squares problem whose Jacobian at the client's input has full
column rank on trained models (docs/design.md, "Attacking MJP with knowledge of MJP"): locally the
orbit is identified, and first-order methods stall only because the Jacobian is ill conditioned
(condition number ~1e4). Gauss-Newton steps with Levenberg-Marquardt damping converge from nearby
starts where L-BFGS stalls.

The Jacobian is exact, by forward-mode AD (``torch.func.jvp`` under ``vmap``, in column chunks so
the memory stays at one chunk's activations): at 32 px / patch 4 / D = 192 it is ~1.9e5 x 1,024,
1.5 GB in float64, and one costs about as much as 1,024 forwards (~40 CPU-s on one core).

Where that dense Jacobian does not fit (DeiT-S at 224 px: 3.1e6 rows x 85,456 unknowns, 2.1 TB),
:func:`matrix_free_lm` takes the same Levenberg-Marquardt steps without forming it: each step solves
(J^T J + mu I) h = -J^T r by conjugate gradients on Jacobian-vector and vector-Jacobian products
(:func:`linearise`), preconditioned by a low-rank model of J^T J read off a
Gaussian row sketch Omega J (m vector-Jacobian products; :class:`SketchPreconditioner`). The
preconditioner matters: measured at 32 px on the trained checkpoint's first two blocks (1,024
unknowns; docs/attacks.md), J^T J + mu I has condition number ~4e8, a sketch of m = n/8 rows brings
it to ~9e4 and m = n/2 to ~1.5e3, where the per-patch block-Jacobi preconditioner reaches only ~1.6e7.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional

import torch
import torch.nn as nn
from torch.func import jvp, vjp, vmap

from .base import AttackFailure
from .first_layer import check_conditions, gradient_of_Z
from .mjp_maths import Reduction, assemble, mjp_reduction, patches_to_image
from .spans import SpanResidual, complement, input_spans

_logger = logging.getLogger(__name__)

#: Columns of the Jacobian computed per vmapped forward-mode pass (memory ~ this many forwards' activations).
JACOBIAN_CHUNK = 64
#: Bytes the matrix-free solver's row sketch (m x n, float64) may take by default: at DeiT-S / 224 px
#: (~8.5e4 unknowns) ~1.2e4 rows. Measured at 32 px (320 unknowns): m = n/8, n/4, n/2 cut plain CG's
#: 1,594 iterations per step to 505, 278 and 176 (docs/attacks.md).
SKETCH_MEMORY = 8e9


def complement_bases(residual: SpanResidual) -> list[torch.Tensor]:
    """Per span layer, an orthonormal basis Q_l [fan_in, fan_in - r] of the complement of its span."""
    return [complement(span.basis) for span in residual.spans]


class SpanVector:
    """The span residual as a vector of reduced parameters theta = (b [nU, k], a [nS, k]) flattened.

    ``self(theta)`` [R] with ``self(theta).pow(2).sum()`` equal to ``residual.value(x)[0]`` for the
    image x that theta assembles (:func:`attacks.mjp_maths.assemble`).
    """

    def __init__(self, residual: SpanResidual, red: Reduction, grid: tuple[int, int], channels: int, p: int) -> None:
        self.residual, self.red, self.grid, self.channels, self.p = residual, red, grid, channels, p
        self.Q = complement_bases(residual)
        self.nU, self.k = red.x_unshuffled.shape[0], red.null_basis.shape[1]
        self.nS = int(red.shuffled.sum())

    @property
    def size(self) -> int:
        """Number of unknowns, (nU + nS) k."""
        return (self.nU + self.nS) * self.k

    def pack(self, b: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        """(b [nU, k], a [nS, k]) -> theta [(nU + nS) k]."""
        return torch.cat([b.reshape(-1), a.reshape(-1)])

    def unpack(self, theta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """theta -> (b [nU, k], a [nS, k])."""
        n = self.nU * self.k
        return theta[:n].reshape(self.nU, self.k), theta[n:].reshape(self.nS, self.k)

    def image(self, theta: torch.Tensor) -> torch.Tensor:
        """[1, C, H, W] model input that theta assembles."""
        b, a = self.unpack(theta)
        return assemble(self.red, b, a, self.grid, self.channels, self.p)

    def traced_image(self, theta: torch.Tensor) -> torch.Tensor:
        """[1, C, H, W] model input that theta assembles, as :meth:`image` but written without in-place
        writes into a preallocated buffer (unlike :func:`attacks.mjp_maths.assemble`) so that
        forward-mode AD under vmap sees one differentiable expression."""
        b, a = self.unpack(theta)
        red = self.red
        xu = red.x_unshuffled + b @ red.null_basis.T
        xs = red.x_bar + a @ red.null_basis.T
        order = torch.cat([torch.nonzero(~red.shuffled).flatten(), torch.nonzero(red.shuffled).flatten()])
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        patches = torch.cat([xu, xs])[inverse]
        return patches_to_image(patches, self.grid, self.channels, self.p)[None]

    def __call__(self, theta: torch.Tensor) -> torch.Tensor:
        inputs = self.residual.layer_inputs(self.traced_image(theta))
        L = len(self.residual.spans)
        parts = []
        for span, Q in zip(self.residual.spans, self.Q):
            A = inputs[span.name]
            A = A[:, None] if A.dim() == 2 else A
            if span.rows is not None:
                A = A[:, :span.rows]
            parts.append((A @ Q).reshape(-1) / (A.pow(2).sum().clamp_min(1e-300).sqrt() * math.sqrt(L)))
        return torch.cat(parts)

    def jacobian(self, theta: torch.Tensor, chunk: int = JACOBIAN_CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
        """(r [R], J [R, n]) at theta, J exact by forward-mode AD in column chunks."""
        n = theta.numel()
        with torch.no_grad():
            r = self(theta)
        J = torch.empty(r.numel(), n, dtype=torch.float64, device=theta.device)
        eye = torch.eye(n, dtype=torch.float64, device=theta.device)

        def column(t: torch.Tensor) -> torch.Tensor:
            return jvp(self, (theta,), (t,))[1]

        for i in range(0, n, chunk):
            J[:, i:i + chunk] = vmap(column)(eye[i:i + chunk]).T
        return r, J


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


@dataclass(frozen=True)
class SpanProblem:
    """What an attacker reads off a design-A MJP update (B = 1) for the span fit: the first layer's
    :class:`attacks.mjp_maths.Reduction` (APRIL's qkv equations on the shuffled set), the deeper
    layers' :class:`attacks.spans.SpanResidual`, and the image's grid, channels and patch size."""

    red: Reduction
    residual: SpanResidual
    grid: tuple[int, int]
    channels: int
    patch: int

    def vector(self) -> SpanVector:
        """The span residual as a vector of the reduced parameters (:class:`SpanVector`)."""
        return SpanVector(self.residual, self.red, self.grid, self.channels, self.patch)

    def image(self, b: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        """The model input [1, C, H, W] that the reduced parameters (b, a) assemble."""
        return assemble(self.red, b, a, self.grid, self.channels, self.patch)


def span_problem(vit: nn.Module, grads: Mapping[str, torch.Tensor], shuffled: torch.Tensor,
                 rcond: Optional[float] = None, device: Optional[torch.device] = None) -> SpanProblem:
    """The span fit's problem on a design-A MJP update: ``grads`` the update with the DAL term removed
    (:func:`attacks.mjp_update.read_mjp_update`), ``shuffled`` [N] the E_unk tokens' mask, ``rcond``
    the reduction's cut-off (:func:`attacks.mjp_maths.mjp_reduction`); the reduction and residual on
    ``device`` (default the CPU). The set-up ``block0_roots``' span polish and the benches share
    (``mjp_adaptive`` builds the same two parts apart: its residual only where the span fit runs)."""
    g = dict(grads)
    if "blocks.0.attn.qkv.weight" not in g:
        raise AttackFailure("update lacks 'blocks.0.attn.qkv.weight'")
    info = check_conditions(vit)
    dev = torch.device("cpu") if device is None else device
    red = mjp_reduction(vit, gradient_of_Z(vit, g, info), g["blocks.0.attn.qkv.weight"], shuffled, rcond).to(dev)
    T = shuffled.numel() + int(getattr(vit, "num_prefix_tokens", 1))
    residual = SpanResidual(vit, input_spans(vit, g, T), red.shuffled, dev)
    grid = (int(vit.patch_embed.grid_size[0]), int(vit.patch_embed.grid_size[1]))
    return SpanProblem(red, residual, grid, int(info["channels"]), int(info["patch_size"]))


def span_lm(residual: SpanResidual, red: Reduction, b: torch.Tensor, a: torch.Tensor, grid: tuple[int, int],
            channels: int, p: int, max_jacobians: int = 6, floor: float = 0.0,
            chunk: int = JACOBIAN_CHUNK, solver: str = "dense",
            sketch_rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor, LMResult]:
    """Levenberg-Marquardt on the span residual's vector form from (b [nU, k], a [nS, k]).

    ``solver``: ``dense`` (:func:`levenberg_marquardt` on the exact Jacobian) or ``matrix_free``
    (:func:`matrix_free_lm`, ``max_jacobians`` Gauss-Newton iterations, ``sketch_rows`` its sketch).
    Returns (b, a, :class:`LMResult`)."""
    vec = SpanVector(residual, red, grid, channels, p)
    if solver == "dense":
        res = levenberg_marquardt(vec, lambda t: vec.jacobian(t, chunk), vec.pack(b, a), max_jacobians, floor=floor)
    elif solver == "matrix_free":
        res = matrix_free_lm(vec, vec.pack(b, a), max_jacobians, sketch_rows=sketch_rows, floor=floor, chunk=chunk)
    else:
        raise ValueError(f"solver {solver!r}: give 'dense' or 'matrix_free'")
    b1, a1 = vec.unpack(res.theta)
    return b1, a1, res


def truth_coordinates(red: Reduction, x: torch.Tensor, p: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The reduced parameters (b [nU, k], a [nS, k]) of a model input x [1, C, H, W] (e.g. the client's
    normalised x~): its patches' coordinates in the null basis, relative to the reduction's base points.
    For diagnostics against a known truth only."""
    from patchgrid import patchify

    X = patchify(x.to(torch.float64), p).flatten(2)[0]  # [N, C p^2]
    S = red.shuffled
    return (X[~S] - red.x_unshuffled) @ red.null_basis, (X[S] - red.x_bar) @ red.null_basis


def identifiability(vec: SpanVector, theta: torch.Tensor, chunk: int = JACOBIAN_CHUNK,
                    rtol: float = 1e-7) -> dict:
    """Rank and condition number of the span vector's Jacobian at theta (e.g. the truth).

    The singular values come from the n x n Gram matrix J^T J (not the R x n Jacobian), which
    resolves them down to ~sqrt(eps) ~ 1.5e-8 of the largest; rank counts those above ``rtol``
    times the largest, so a condition number up to ~1/rtol is measurable."""
    _, J = vec.jacobian(theta, chunk)
    s = torch.linalg.svdvals(J.T @ J).clamp_min(0).sqrt()  # the Gram's: n x n instead of R x n
    del J
    rank = int((s > rtol * s[0]).sum())
    return dict(unknowns=int(theta.numel()), rank=rank, condition=float(s[0] / s[-1]) if float(s[-1]) > 0 else math.inf,
                sigma_max=float(s[0]), sigma_min=float(s[-1]))
