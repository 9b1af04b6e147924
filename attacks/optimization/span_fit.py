"""The span residual as a vector of the reduced parameters, and its second-order fit (float64).

:class:`attacks.solvers.spans.SpanResidual` is a mean over layers of ||A_l - A_l V_l V_l^T||^2 /
||A_l||^2, a sum of squares. Written as one vector r(theta) (every span layer's A_l Q_l / ||A_l||
/ sqrt(L), Q_l an orthonormal basis of the complement of layer l's span, theta the reduced
parameters (b, a) of :class:`attacks.closed_form.mjp_maths.Reduction`), ||r||^2 equals the residual's value,
and the problem is a nonlinear least-squares problem whose Jacobian at the client's input has full
column rank on trained models (docs/design.md, "Attacking MJP with knowledge of MJP"): locally the
orbit is identified, and first-order methods stall only because the Jacobian is ill conditioned
(condition number ~1e4). Gauss-Newton steps with Levenberg-Marquardt damping converge from nearby
starts where L-BFGS stalls.

The Jacobian is exact, by forward-mode AD (``torch.func.jvp`` under ``vmap``, in column chunks so
the memory stays at one chunk's activations): at 32 px / patch 4 / D = 192 it is ~1.9e5 x 1,024,
1.5 GB in float64, and one costs about as much as 1,024 forwards (~40 CPU-s on one core).
:mod:`attacks.solvers.lm` holds the solvers (dense and matrix-free Levenberg-Marquardt).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Optional

import torch
import torch.nn as nn
from torch.func import jvp, vmap

from ..api.base import AttackFailure
from ..closed_form.first_layer import check_conditions, gradient_of_Z
from ..closed_form.mjp_maths import Reduction, assemble, mjp_reduction, patches_to_image
from ..solvers.lm import JACOBIAN_CHUNK, NIELSEN, LMResult, dense_lm, matrix_free_lm
from ..solvers.spans import SpanResidual, complement, input_spans


def complement_bases(residual: SpanResidual) -> list[torch.Tensor]:
    """Per span layer, an orthonormal basis Q_l [fan_in, fan_in - r] of the complement of its span."""
    return [complement(span.basis) for span in residual.spans]


class SpanVector:
    """The span residual as a vector of reduced parameters theta = (b [nU, k], a [nS, k]) flattened.

    ``self(theta)`` [R] with ``self(theta).pow(2).sum()`` equal to ``residual.value(x)[0]`` for the
    image x that theta assembles (:func:`attacks.closed_form.mjp_maths.assemble`).
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
        writes into a preallocated buffer (unlike :func:`attacks.closed_form.mjp_maths.assemble`) so that
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


@dataclass(frozen=True)
class SpanProblem:
    """What an attacker reads off a design-A MJP update (B = 1) for the span fit: the first layer's
    :class:`attacks.closed_form.mjp_maths.Reduction` (APRIL's qkv equations on the shuffled set), the deeper
    layers' :class:`attacks.solvers.spans.SpanResidual`, and the image's grid, channels and patch size."""

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
    (:func:`attacks.closed_form.mjp_update.read_mjp_update`), ``shuffled`` [N] the E_unk tokens' mask, ``rcond``
    the reduction's cut-off (:func:`attacks.closed_form.mjp_maths.mjp_reduction`); the reduction and residual on
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

    ``solver``: ``dense`` (:func:`attacks.solvers.lm.dense_lm` on the exact Jacobian) or ``matrix_free``
    (:func:`attacks.solvers.lm.matrix_free_lm`, ``max_jacobians`` Gauss-Newton iterations, ``sketch_rows`` its sketch).
    Returns (b, a, :class:`LMResult`)."""
    vec = SpanVector(residual, red, grid, channels, p)
    if solver == "dense":
        res = dense_lm(vec, lambda t: vec.jacobian(t, chunk)[1], vec.pack(b, a), max_jacobians, NIELSEN, floor=floor)
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
