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
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch.func import jvp, vmap

from .mjp_maths import Reduction, assemble, patches_to_image
from .spans import SpanResidual, complement

_logger = logging.getLogger(__name__)

#: Columns of the Jacobian computed per vmapped forward-mode pass (memory ~ this many forwards' activations).
JACOBIAN_CHUNK = 64


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


def span_lm(residual: SpanResidual, red: Reduction, b: torch.Tensor, a: torch.Tensor, grid: tuple[int, int],
            channels: int, p: int, max_jacobians: int = 6, floor: float = 0.0,
            chunk: int = JACOBIAN_CHUNK) -> tuple[torch.Tensor, torch.Tensor, LMResult]:
    """Levenberg-Marquardt on the span residual's vector form from (b [nU, k], a [nS, k]).

    Returns (b, a, :class:`LMResult`)."""
    vec = SpanVector(residual, red, grid, channels, p)
    res = levenberg_marquardt(vec, lambda t: vec.jacobian(t, chunk), vec.pack(b, a), max_jacobians, floor=floor)
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
