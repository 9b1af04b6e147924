"""Levenberg-Marquardt for nonlinear least squares min ||r(theta)||^2: one family, three entry points.

- :func:`dense_lm`: one problem with its exact dense Jacobian; the Gram matrix J^T J is formed once
  per Jacobian and reused by every damping trial.
- :func:`batched_lm`: K independent small problems at once (one damping per row), each row's J^T J
  and J^T r given by the caller.
- :func:`matrix_free_lm`: one problem whose Jacobian does not fit (DeiT-S at 224 px: 3.1e6 rows x
  85,456 unknowns, 2.1 TB): each step solves (J^T J + mu I) h = -J^T r by conjugate gradients on
  Jacobian-vector and vector-Jacobian products (:func:`attacks.solvers.linalg.damped_cg`),
  preconditioned by a low-rank model of J^T J read off a Gaussian row sketch
  (:class:`attacks.solvers.linalg.SketchPreconditioner`).

How the damping mu moves is a parameter of all three, a :class:`Damping`: Nielsen's gain-ratio rule
(:data:`NIELSEN`) or a geometric rule (:data:`ROOTS`, :data:`MARQUARDT`). Schedules matter: from the
same start one can stall where another reaches the rounding floor (docs/results/solvers.md), so
each caller names the one its tests pin. Written here rather than with
``scipy.optimize.least_squares``: the Jacobian is the cost and is dense and tall (scipy's ``lm`` and
``trf`` factor the tall matrix at every trial), the batched problems are thousands of tiny ones
(scipy solves one per call), and the matrix-free steps run on torch's products on any device.
"""
from __future__ import annotations

import logging
import math
import sys
from dataclasses import dataclass, field
from typing import Callable, Literal

import torch

from .linalg import SketchPreconditioner, damped_cg, linearise, row_sketch

_logger = logging.getLogger(__name__)

#: Columns of the Jacobian computed per vmapped forward-mode pass (memory ~ this many forwards' activations).
JACOBIAN_CHUNK = 64
#: Bytes the matrix-free solver's row sketch (m x n, float64) may take by default: at DeiT-S / 224 px
#: (~8.5e4 unknowns) ~1.2e4 rows.
SKETCH_MEMORY = 8e9


@dataclass(frozen=True)
class Damping:
    """How Levenberg-Marquardt's damping mu moves, and what it multiplies.

    Attributes:
        rule: ``nielsen``: after a kept step with gain ratio rho, mu *= max(1/3, 1 - (2 rho - 1)^3);
            after a refused one mu *= nu, nu doubling with each refusal (Nielsen 1999).
            ``geometric``: mu /= ``shrink`` after a kept step, mu *= ``grow`` after a refused one.
        first: the first mu. ``nielsen``: relative to the largest diagonal entry of the first J^T J;
            ``geometric``: as given (it multiplies what ``scale`` says).
        scale: what mu multiplies in (J^T J + mu S): ``identity``; ``max_diag``, J^T J's largest
            diagonal entry at each Jacobian; ``diag``, J^T J's diagonal (Marquardt's scaling).
        solve: the damped system's solver: ``cholesky`` (a failed factorisation counts as a refused
            step), ``lu`` (``torch.linalg.solve``) or ``lstsq``.
        low, high: mu stays in [low, high]; the dense solver ends an iteration whose trials reach ``high``.
        max_trials: damping trials per Jacobian at most.
    """

    rule: Literal["nielsen", "geometric"]
    first: float
    scale: Literal["identity", "max_diag", "diag"] = "identity"
    solve: Literal["cholesky", "lu", "lstsq"] = "cholesky"
    shrink: float = 3.0
    grow: float = 4.0
    low: float = 0.0
    high: float = math.inf
    max_trials: int = sys.maxsize

    def initial(self, top: float) -> float:
        """The first mu, given J^T J's largest curvature ``top``."""
        return self.first * top if self.rule == "nielsen" else self.first

    def kept(self, mu: float, rho: float) -> float:
        """mu after a kept step of gain ratio ``rho`` (the nielsen rule's nu resets to 2)."""
        if self.rule == "nielsen":
            return mu * max(1 / 3, 1 - (2 * rho - 1) ** 3)
        return max(mu / self.shrink, self.low)

    def refused(self, mu: float, nu: float) -> tuple[float, float]:
        """(mu, nu) after a refused step."""
        if self.rule == "nielsen":
            return mu * nu, nu * 2
        return mu * self.grow, nu


#: Nielsen's rule on J^T J + mu I, Cholesky, 12 trials an iteration: the span fit's final stage
#: (tests/test_span_lm.py).
NIELSEN = Damping("nielsen", first=1e-12, max_trials=12)
#: /3 and x4 relative to J^T J's largest diagonal entry, no cap on trials below mu = 1e8: block 0's
#: roots and attention solves, dense and batched, and fc2's span completion (tests/test_block0_roots.py,
#: tests/test_solvers.py, tests/test_block0_completion.py).
ROOTS = Damping("geometric", first=1e-3, scale="max_diag", solve="lu", low=1e-15, high=1e8)
#: /3 and x4 on Marquardt's diagonal scaling, least-squares solves (a singular J^T J at a saturated
#: softmax stays solvable): the label-count per-image solves (tests/test_labels.py).
MARQUARDT = Damping("geometric", first=1e-2, scale="diag", solve="lstsq", low=1e-12, high=1e12)


@dataclass
class LMResult:
    """Outcome of :func:`dense_lm` (and, with more fields, :func:`matrix_free_lm`).

    Attributes:
        theta: the last kept point, shaped as the start.
        value_first, value: ||r||^2 at the start and at ``theta``.
        jacobians: Jacobians taken (Gauss-Newton iterations); evaluations: residuals evaluated.
        history: ||r||^2 after each iteration, the start's first.
    """

    theta: torch.Tensor
    value_first: float
    value: float
    jacobians: int
    evaluations: int
    history: list[float] = field(default_factory=list)


def _damped(G: torch.Tensor, mu: torch.Tensor | float, damping: Damping) -> torch.Tensor:
    """J^T J + mu S for one [n, n] or K [K, n, n] Gram matrices (``mu`` a float or [K])."""
    batched = G.dim() == 3
    eye = torch.eye(G.shape[-1], dtype=G.dtype, device=G.device)
    m = mu[:, None, None] if batched else mu  # type: ignore[index]
    if damping.scale == "identity":
        return G + m * eye
    if damping.scale == "max_diag":
        if batched:
            return G + (mu * G.diagonal(dim1=1, dim2=2).amax(-1).clamp_min(1e-300))[:, None, None] * eye
        return G + mu * max(float(G.diagonal().max()), 1e-300) * eye
    return G + torch.diag_embed(G.diagonal(dim1=-2, dim2=-1).clamp_min(1e-12)) * m


def _step(A: torch.Tensor, g: torch.Tensor, damping: Damping) -> torch.Tensor | None:
    """h = -A^-1 g for one [n] or K [K, n] right-hand sides; None where a factorisation fails (one
    system), NaN rows where a batch's system is singular (``lu``: the trial is then not finite and the
    row's step refused, as a failed factorisation is: tests/test_solvers.py:
    test_batched_lm_refuses_the_step_of_a_singular_row)."""
    if damping.solve == "cholesky":
        L, info = torch.linalg.cholesky_ex(A)
        if bool((info != 0).any()):
            return None
        return -torch.cholesky_solve(g[..., None], L)[..., 0]
    if damping.solve == "lu":
        h, info = torch.linalg.solve_ex(A, -g)
        bad = info != 0
        if not bool(bad.any()):
            return h
        if A.dim() == 2:
            return None
        return torch.where(bad[:, None], torch.full_like(h, math.nan), h)
    return torch.linalg.lstsq(A, -g[..., None]).solution[..., 0]


def _predicted(G: torch.Tensor, h: torch.Tensor, mu: float, damping: Damping) -> float:
    """The reduction of ||r||^2 the damped model predicts for the step h = -(G + mu S)^-1 g:
    h^T G h + 2 mu h^T S h (Nielsen's gain ratio divides the actual reduction by it)."""
    if damping.scale == "identity":
        return float(h @ (G @ h) + 2 * mu * (h @ h))
    if damping.scale == "max_diag":
        return float(h @ (G @ h) + 2 * mu * max(float(G.diagonal().max()), 1e-300) * (h @ h))
    return float(h @ (G @ h) + 2 * mu * (h @ (G.diagonal().clamp_min(1e-12) * h)))


def dense_lm(fun: Callable[[torch.Tensor], torch.Tensor], jacobian: Callable[[torch.Tensor], torch.Tensor],
             theta0: torch.Tensor, max_jacobians: int = 6, damping: Damping = NIELSEN, floor: float = 0.0,
             stall: float = 1e-2, stall_below: float = math.inf, extend_below: float = 0.0) -> LMResult:
    """Minimise ||fun(theta)||^2 by Levenberg-Marquardt on the exact dense Jacobian.

    Each iteration takes one Jacobian, forms G = J^T J and g = J^T r once, then tries damped steps
    (G + mu S) h = -g (``damping``) until one lowers the residual. Stops once ||r||^2 <= ``floor``,
    after ``max_jacobians`` Jacobians, when no trial helps, or after an iteration that lowers ||r||^2
    by less than the fraction ``stall`` (at the rounding floor a Jacobian buys nothing), that test
    applied only where the residual was below ``stall_below``. A run still below ``extend_below``
    when its Jacobians run out gets as many again (converging, not yet at its floor).

    Args:
        fun: theta (any shape) -> residual vector [R].
        jacobian: theta -> J [R, theta.numel()].
        theta0: the start.
    """
    theta = theta0.clone()
    with torch.no_grad():
        r = fun(theta)
    value = float(r.pow(2).sum())
    first, history = value, [value]
    mu, nu, jacobians, evaluations, budget = None, 2.0, 0, 1, max_jacobians
    while jacobians < budget and value > floor:
        J = jacobian(theta)
        jacobians += 1
        G, g = J.T @ J, J.T @ r.reshape(-1)
        del J
        if mu is None:
            mu = damping.initial(float(G.diagonal().max()))
        accepted, trials = False, 0
        while trials < damping.max_trials and mu < damping.high:
            trials += 1
            h = _step(_damped(G, mu, damping), g, damping)
            if h is None:
                mu, nu = damping.refused(mu, nu)
                continue
            with torch.no_grad():
                trial_theta = theta + h.reshape(theta.shape)
                trial_r = fun(trial_theta)
            trial = float(trial_r.pow(2).sum())
            evaluations += 1
            if math.isfinite(trial) and trial < value:
                rho = (value - trial) / max(_predicted(G, h, mu, damping), 1e-300) if damping.rule == "nielsen" else 1.0
                theta, r, value = trial_theta, trial_r, trial
                mu, nu, accepted = damping.kept(mu, rho), 2.0, True
                break
            mu, nu = damping.refused(mu, nu)
        history.append(value)
        _logger.debug("LM iteration %d: residual %.3e, mu %.1e", jacobians, value, mu)
        if not accepted or (history[-2] < stall_below and value > (1 - stall) * history[-2]):
            break
        if jacobians == max_jacobians and value < extend_below:
            budget = 2 * max_jacobians
    return LMResult(theta, first, value, jacobians, evaluations, history)


def batched_lm(system: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
               value_of: Callable[..., torch.Tensor], theta: torch.Tensor, iterations: int,
               damping: Damping = ROOTS, settled: float = -math.inf,
               rows: tuple[torch.Tensor, ...] = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """Levenberg-Marquardt on every row of theta [K, p] at once, one mu per row (a geometric ``damping``).

    ``system(theta_rows, *rows_data)`` gives those rows' (squared residual [k], J^T J [k, p, p],
    J^T r [k, p]); ``value_of(theta_rows, *rows_data)`` the squared residual [k] alone (inf where it
    is not finite). ``rows``: per-row data [K, ...] passed along, sliced like theta. A row whose value
    is at or below ``settled`` takes no more steps, so converged rows cost nothing. Returns
    (theta [K, p], squared residual [K]).
    """
    if damping.rule != "geometric" or damping.solve == "cholesky":
        raise ValueError(f"batched_lm takes a geometric damping with solve 'lu' or 'lstsq', not {damping}")
    theta = theta.clone()
    value = value_of(theta, *rows)
    mu = torch.full_like(value, damping.first)
    for _ in range(iterations):
        live = (value > settled).nonzero().flatten()
        if live.numel() == 0:
            break
        x, m, data = theta[live], mu[live], tuple(t[live] for t in rows)
        _, G, g = system(x, *data)
        step = _step(_damped(G, m, damping), g, damping)
        assert step is not None  # no Cholesky here
        trial = value_of(x + step, *data)
        better = torch.isfinite(trial) & (trial < value[live])
        theta[live] = torch.where(better[:, None], x + step, x)
        value[live] = torch.where(better, trial, value[live])
        mu[live] = torch.where(better, m / damping.shrink, m * damping.grow).clamp(damping.low, damping.high)
    return theta, value


@dataclass
class MatrixFreeResult(LMResult):
    """Outcome of :func:`matrix_free_lm`: :class:`LMResult` plus the CG iterations of every trial step."""

    cg_iterations: list[int] = field(default_factory=list)
    sketch_rows: int = 0


def matrix_free_lm(fun: Callable[[torch.Tensor], torch.Tensor], theta0: torch.Tensor, max_iterations: int = 6,
                   sketch_rows: int | None = None, cg_iterations: int = 500, cg_tol: float = 1e-8,
                   damping: Damping = NIELSEN, floor: float = 0.0, stall: float = 1e-2,
                   xtol: float = 1e-9, relative_floor: float = 1e-16, seed: int = 0, chunk: int = JACOBIAN_CHUNK,
                   callback: Callable[[int, torch.Tensor, float], None] | None = None) -> MatrixFreeResult:
    """Levenberg-Marquardt on ||fun(theta)||^2 without forming the Jacobian (module docstring).

    Per iteration: r and the reverse-mode pullback at theta (one forward, kept for every J^T u and,
    transposed once more, every J v), a row sketch of ``sketch_rows`` vector-Jacobian products
    (:func:`attacks.solvers.linalg.row_sketch`) for the preconditioner, then for each damping trial a
    CG solve (:func:`attacks.solvers.linalg.damped_cg`) and one forward at the trial point. mu moves
    as ``damping`` says (its ``scale`` must be ``identity``), starting from the sketch's largest
    curvature; a step is kept when the residual falls. The predicted reduction is -2 g.h - ||J h||^2,
    exact for an inexact step.

    Args:
        fun: theta [n] -> residual [R], differentiable by ``torch.func`` (forward and reverse mode).
        theta0: start [n].
        max_iterations: Gauss-Newton iterations at most (each: one pullback, one sketch).
        sketch_rows: m; None: n / 2 (at least 64, at most n and what :data:`SKETCH_MEMORY` holds).
            0: no preconditioner (plain CG). Above n the sketch oversamples: its curvatures approach
            J^T J's (m = 4n: the preconditioned condition number ~9 whatever J's).
        cg_iterations: CG iterations per trial step at most.
        cg_tol: CG stops at ||(J^T J + mu I) h + g|| <= cg_tol ||g||.
        floor, stall: as :func:`dense_lm`.
        xtol: stop after a kept step shorter than ``xtol`` ||theta||; relative_floor: stop once ||r||^2
            is below ``relative_floor`` times the start's. At the residual's rounding floor every
            damping trial costs a CG solve and buys nothing.
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
    if damping.scale != "identity":
        raise ValueError(f"matrix_free_lm damps J^T J + mu I: give a damping with scale 'identity', not {damping}")
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
            mu = damping.initial(float(pre.lam[0]) if pre is not None else float(g.norm()) ** 2 / max(value, 1e-300))
        accepted, trials, h = False, 0, torch.zeros_like(theta)
        while trials < damping.max_trials and mu < damping.high:
            trials += 1
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
                mu, nu, accepted = damping.kept(mu, rho), 2.0, True
                break
            mu, nu = damping.refused(mu, nu)
        history.append(value)
        rel_step = float(h.norm()) / max(float(theta.norm()), 1e-300)
        _logger.debug("matrix-free LM iteration %d: residual %.3e, mu %.1e, CG %s, step %.1e", iterations, value, mu,
                      cg_its[-1:], rel_step)
        del jvp_fn, vjp_fn, pullback
        if callback is not None:
            callback(iterations, theta, value)
        if not accepted or value > (1 - stall) * history[-2] or rel_step <= xtol:
            break
    return MatrixFreeResult(theta, first, value, iterations, evaluations, history, cg_its, m)
