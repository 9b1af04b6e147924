"""Past the span floor: fc2's input span completed, so that every token of block 0 is a root again.

Where B T > D - 1 (B >= 3 on the CIFAR geometry) block 0's dL/dW_fc2 = sum_t g_t a_t^T has rank
r <= D - 1 < B T (:func:`attacks.structure.block0_roots.max_tokens`): its row space R is a proper
subspace of span{a_t}, and no true activation a_t lies in it. What the update still fixes is that
span{a_t} = R + E for a k = B T - r dimensional E: every true a_t's part off R lies in the same
k-dimensional E. So m > k tokens u_1..u_m are true tokens exactly where the matrix W of their
normalised activations' parts off R, w_i = P_R-perp a(u_i) / ||a(u_i)||, has rank k: the residual
is W minus its best rank-k approximation, and E is then W's top k left singular vectors.

The fit (:func:`complete_span`) starts from local minima of the per-token residual against R alone
(:func:`near_roots`: they sit next to true tokens, docs/results/structure.md), and solves the rank-k
problem by Levenberg-Marquardt on the variable-projection Jacobian: with W ~ E S V^T, the residual
moves as P_E-perp dW (I - V V^T) to first order, so the m tokens are coupled through V alone
(Golub and Pereyra's variable projection, Kaufman's form). With R + E as fc2's span, every true
token is a root of the per-token problem again (:class:`attacks.structure.token_roots.MLPSpans`,
in the whole of fc1's input space, which B T > D fills), and the search of
:func:`attacks.structure.roots.find_roots` finds them (tests/test_block0_completion.py).

What B T > D - 1 still takes away is part of step 2 of the read: the scales and positions follow
(:func:`attacks.structure.linear.scales_past_floor`), the attention outputs only up to a part all
tokens share, so the roots are not yet a batch: docs/design.md, "What survives batching".
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch
import torch.nn as nn

from ..api.base import AttackFailure
from ..solvers.lm import ROOTS, dense_lm
from .roots import steered_starts
from .token_roots import MLPSpans

#: Bytes the completion's dense Jacobian (m 4D x m D, float64) may take; m = 3 k points
#: (k = B T - rank): k <= 10 on the CIFAR geometry.
COMPLETION_MEMORY = 2e9
#: fc2's span counts as completed where the fit's (k+1)-th singular value is below this: it ends at
#: the rounding floor (2e-13) when its points are true tokens, from ~2e-4 at its start
#: (tests/test_block0_completion.py: test_the_completed_span_makes_every_true_token_a_root_and_the_search_finds_only_true_ones)
COMPLETED_TOL = 1e-10
#: Points per missing dimension: m = POINTS_PER_DIMENSION k tokens fit (the count needs
#: (m - k)(4D - r - k) >= m D equations; at B = 3 on CIFAR, k = 4, m >= 7).
POINTS_PER_DIMENSION = 3


def jacobian_bytes(points: int, width: int) -> float:
    """Bytes of :func:`complete_span`'s dense Jacobian from m ``points`` at width D: (m 4D) x (m D) float64."""
    return 8.0 * (points * 4 * width) * (points * width)


def completion_bytes(k: int, width: int) -> float:
    """:func:`jacobian_bytes` for k missing dimensions (m = :data:`POINTS_PER_DIMENSION` k points)."""
    return jacobian_bytes(POINTS_PER_DIMENSION * k, width)


@dataclass(frozen=True)
class Completion:
    """Outcome of :func:`complete_span`.

    Attributes:
        basis: [4D, r + k] orthonormal basis of R + E, fc2's completed input span.
        points: [m, D] the fitted tokens (fc1 inputs), true tokens where ``value`` is at the floor.
        value_first, value: the rank-k residual ||W - W_k||^2 at the start and at the end.
        next_singular: W's (k+1)-th singular value at the end (the rounding floor where exact).
        jacobians: Levenberg-Marquardt Jacobians taken, over every refit.
        dropped: points dropped as off the rank-k problem's true tokens (:func:`complete_span`).
    """

    basis: torch.Tensor
    points: torch.Tensor
    value_first: float
    value: float
    next_singular: float
    jacobians: int
    dropped: int = 0


def near_roots(problem: MLPSpans, count: int, starts: int, iterations: int, generator: torch.Generator,
               steer_steps: int = 100, steer_lr: float = 0.05, distinct_cos: float = 1 - 1e-6) -> torch.Tensor:
    """Up to ``count`` distinct local minima [<= count, D] of the per-token residual against an
    incomplete fc2 span, lowest residual first: ``starts`` steered starts
    (:func:`attacks.structure.roots.steered_starts`) of ``iterations`` LM steps."""
    D = problem.S1.shape[0]
    v = steered_starts(problem, problem.S2, torch.zeros(0, D, dtype=torch.float64), starts, steer_steps, steer_lr,
                        generator)
    with torch.no_grad():
        u, value = problem.solve(problem.coordinates(v), iterations, settled=0.0)
        u = u @ problem.S1.T
    unit = u / u.norm(dim=1, keepdim=True)
    kept: list[int] = []
    for i in torch.argsort(value).tolist():
        if not kept or float((unit[kept] @ unit[i]).max()) < distinct_cos:
            kept.append(i)
        if len(kept) == count:
            break
    return u[kept]


def least_points(k: int, rows: int, rank: int, width: int) -> int:
    """The fewest points m > k whose rank-k fit has as many equations as unknowns: (m - k)(4D - r - k)
    >= m D, with ``rows`` = 4D the activations' length (7 at B = 3 on the CIFAR geometry)."""
    free = rows - rank - k  # the off-(R + E) equations each point adds
    if free <= width:
        return k + 1 + width  # past this no count suffices quickly; the memory bound refuses first
    return max(k + 1, -(-k * free // (free - width)))


def complete_span(block: nn.Module, fc2_basis: torch.Tensor, tokens: int, points: torch.Tensor,
                  max_jacobians: int = 30, memory: float = COMPLETION_MEMORY, tol: float = COMPLETED_TOL,
                  drops: int | None = None) -> Completion:
    """fc2's input span of ``tokens`` tokens completed from its rank-r part ``fc2_basis`` [4D, r]
    and m near-roots ``points`` [m, D] (module doc).

    A near-root can sit in the basin of a point that is not a true token of the rank-k problem: the
    fit then ends with W's (k+1)-th singular value above ``tol`` (the rounding floor where every
    point is a true token), and W without that point's row has the smallest. It is dropped and the others
    refitted from where they ended, at most ``drops`` times (None: down to :func:`least_points`).

    Raises:
        AttackFailure: nothing is missing (r >= tokens), too few points (m <= k), or the Jacobian
            would exceed ``memory`` bytes.
    """
    mlp = cast(nn.Module, block.mlp)
    N, r = fc2_basis.shape
    k = tokens - r
    m, D = points.shape
    if k <= 0:
        raise AttackFailure(f"fc2's span has rank {r} >= {tokens} tokens: nothing to complete")
    if m <= k:
        raise AttackFailure(f"completing fc2's span by {k} dimensions needs more than {k} near-roots; got {m}")
    if jacobian_bytes(m, D) > memory:
        raise AttackFailure(f"completing fc2's span by {k} dimensions from {m} points takes a {m * N} x {m * D} "
                            f"Jacobian ({jacobian_bytes(m, D) / 1e9:.1f} GB > {memory / 1e9:.1f} GB)")
    S2 = fc2_basis

    def off_span(u: torch.Tensor) -> torch.Tensor:
        a = mlp.act(mlp.fc1(u))
        a = a / a.norm(dim=-1, keepdim=True)
        return a - (a @ S2) @ S2.T

    def parts(u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        W = off_span(u)  # [m, 4D]
        left, sv, right = torch.linalg.svd(W.T, full_matrices=False)
        E = left[:, :k]
        return W - (W @ E) @ E.T, E, right[:k].T, sv

    def fun(u: torch.Tensor) -> torch.Tensor:
        return parts(u)[0].reshape(-1)

    one = torch.func.vmap(torch.func.jacrev(lambda u: off_span(u[None])[0]))

    def jacobian(u: torch.Tensor) -> torch.Tensor:
        _, E, V, _ = parts(u)
        n = u.shape[0]
        Jt = one(u)  # [m, 4D, D]: each point's own Jacobian
        PJ = Jt - E @ (E.T @ Jt)
        mix = torch.eye(n, dtype=u.dtype) - V @ V.T  # the coupling through W's right singular vectors
        return torch.einsum("ij,jab->iajb", mix, PJ).reshape(n * N, n * D)

    fewest = least_points(k, N, r, D)
    left = max(0, m - fewest) if drops is None else min(int(drops), max(0, m - fewest))
    theta, first, taken, dropped = points.to(torch.float64), None, 0, 0
    with torch.no_grad():
        while True:
            out = dense_lm(fun, jacobian, theta, max_jacobians, ROOTS, floor=0.0)
            _, E, _, sv = parts(out.theta)
            first = out.value_first if first is None else first
            taken += out.jacobians
            if float(sv[k]) <= tol or dropped == left:
                break
            W = off_span(out.theta)  # the point whose removal lowers the (k+1)-th singular value most
            worst = min(range(W.shape[0]), key=lambda i: float(torch.linalg.svdvals(
                torch.cat([W[:i], W[i + 1:]]))[k]))
            theta = torch.cat([out.theta[:worst], out.theta[worst + 1:]])
            dropped += 1
    basis = torch.linalg.qr(torch.cat([S2, E], 1))[0]
    return Completion(basis, out.theta, first, out.value, float(sv[k]), taken, dropped)
