"""Step 1 of the block-0 read (:mod:`attacks.structure.block0_roots`): every token's MLP input as a
root of its own small problem, found by rounds of starts (:func:`find_roots`).

Every token's fc1 input u = norm2(h) lies in fc1's input span and GELU(W1 u + b1) in fc2's (both read
off their weight gradients, rank B T): each of the B T tokens is a root of the per-token problem of
:class:`attacks.structure.token_roots.MLPSpans`, solved in fc1's span (u = S1 alpha, where a root is
isolated) with exact Gauss-Newton terms. Random starts alone find the few tokens with large basins
again and again, so the search runs two kinds of round:

* **steered** (while they add at least 2 roots a round): random starts moved by Adam into the part of
  fc2's span the found tokens leave empty (:func:`steered_starts`), then solved on the plain
  residual. Cheap; slows as the last tokens with small basins remain.
* **missing**: the m missing tokens' activations fill the part E2 of fc2's span the found ones leave
  empty, so dL/dW_fc2 E2 = G_M (A_M E2) spans their output gradients g_j (Gamma, m columns), and
  likewise dL/dW_fc1 E1 spans their fc1 output gradients (W2^T g_j) * GELU'(W1 u_j + b1) (Gamma1). A
  missing token is therefore a root of

      r(u)  and  P_{Gamma1 perp} ((W2^T Gamma c) * GELU'(W1 u + b1)) / ||.||

  in (alpha, c), c in R^m; a token already found is not (its g is not in Gamma, and 4D - m equations
  hold against m unknowns): the second block deflates exactly, where one deflation factor per root
  found (Farrell et al.) stopped the starts converging at all. Costlier per start. Where the tokens
  crowd (design A) the added equations end a start a little off its root, so every start then takes
  plain polish steps. Where two tokens nearly coincide, the update's rounding leaves their roots above
  the search's tolerance: a missing round also keeps a point below :data:`FLOOR_TOL` that two of its
  starts or more reach.
* **tail** (past B T > D - 1, once D roots are found and at most :data:`attacks.structure.tail.TAIL_MAX`
  are missing): fc1's span is the whole input space, so the missing round has no equations; the
  missing tokens' fc1 inputs span a subspace that fc1's update gives once the found tokens' share is
  taken out (:func:`attacks.structure.tail.missing_span`), and the round's starts lie in it. A tail
  round that adds nothing hands over to a steered one.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn as nn

from ..api.progress import report
from ..solvers.lm import ROOTS, batched_lm
from ..solvers.spans import complement
from .tail import TAIL_MAX, missing_span, tail_starts
from .token_roots import MLPSpans, span_part, span_value

_logger = logging.getLogger(__name__)

#: a missing-token round also keeps a point whose plain squared residual is below this (not the
#: search's ``tol``) where two of its starts or more land on it: where two tokens nearly coincide in
#: the fc1/fc2 updates' weakest singular directions, the update's own float64 rounding leaves even
#: their true fc1 inputs above ``tol``, and the starts meet next to the missing one
#: (tests/test_block0_roots.py: test_a_missing_round_keeps_a_twin_token_at_the_updates_rounding_floor)
FLOOR_TOL = 1e-14

#: two roots closer than this (1 - cosine) are one token: two converged starts on one token agree far
#: more closely, distinct tokens of design A's crowded block 0 lie far further apart
#: (tests/test_block0_roots.py: test_the_missing_token_round_finishes_on_tightly_clustered_design_a_tokens,
#: test_a_missing_round_keeps_a_twin_token_at_the_updates_rounding_floor)
DISTINCT = 1e-11


@dataclass
class RootSearch:
    """Outcome of :func:`find_roots`: the distinct roots [k, D] (fc1 inputs), the starts run, the roots
    each round added, how that round started (``"steered"``, ``"missing"`` or ``"tail"``) and how many roots the
    search was given before its first round."""

    roots: torch.Tensor
    starts: int
    per_round: list[int]
    modes: list[str]
    given: int = 0


@dataclass(frozen=True)
class RootEquations:
    """What every round of :func:`find_roots` solves: block 0's per-token problem in fc1's span, fc1's
    and fc2's input spans (orthonormal, [D, r] and [4D, r]) and their weight gradients."""

    problem: MLPSpans
    fc1_basis: torch.Tensor
    fc2_basis: torch.Tensor
    fc1_grad: torch.Tensor
    fc2_grad: torch.Tensor


def dedupe(found: torch.Tensor, new: torch.Tensor, distinct_cos: float = 1 - DISTINCT) -> torch.Tensor:
    """``found`` [k, D] with the rows of ``new`` that are no root of it yet (1 - cos above :data:`DISTINCT`) appended, in order."""
    unit = lambda t: t / t.norm(dim=-1, keepdim=True)  # noqa: E731
    keep = found
    for i in range(new.shape[0]):
        if keep.shape[0] == 0 or float((unit(keep) @ unit(new[i])).max()) < distinct_cos:
            keep = torch.cat([keep, new[i:i + 1]])
    return keep


def _agreed(points: torch.Tensor, candidate: torch.Tensor) -> torch.Tensor:
    """Indices of the ``candidate`` rows of ``points`` [K, D] that another candidate lands on too
    (within :data:`DISTINCT` in 1 - cos): an attractor of several starts, not one start's stall."""
    idx = candidate.nonzero().flatten()
    if idx.numel() < 2:
        return idx[:0]
    unit = points[idx] / points[idx].norm(dim=-1, keepdim=True)
    near = (unit @ unit.T > 1 - DISTINCT).sum(1) > 1  # itself and at least one other
    return idx[near]


def _missing_part(basis: torch.Tensor, found: torch.Tensor) -> torch.Tensor:
    """Orthonormal basis of the part of span(``basis``) that the rows of ``found`` leave empty."""
    if found.shape[0] == 0:
        return basis
    return basis @ complement(torch.linalg.qr((found @ basis).T)[0])


def steered_starts(problem: MLPSpans, fc2_basis: torch.Tensor, found: torch.Tensor, starts: int, steps: int,
                    lr: float, generator: torch.Generator) -> torch.Tensor:
    """Random LayerNorm inputs moved by Adam towards the part E2 of fc2's span the found tokens leave
    empty (share of the activation in E2, minus the span residual). Random starts alone fall into
    the few tokens with large basins again and again; these fall near the ones not yet found."""
    D = problem.S1.shape[0]
    with torch.no_grad():
        empty = _missing_part(fc2_basis, problem.act(problem.fc1(found)))
    v = torch.randn(starts, D, generator=generator, dtype=torch.float64)
    opt = torch.optim.Adam([v.requires_grad_(True)], lr=lr)
    with torch.enable_grad():
        for _ in range(steps):
            u, a = problem.tokens(v)
            share = (a @ empty).pow(2).sum(1) / a.pow(2).sum(1)
            r1, r2 = problem.parts(u, a)
            loss = (r1.pow(2).sum(1) + r2.pow(2).sum(1) - share).sum()
            v.grad = torch.autograd.grad(loss, v)[0]  # v only: the block's weights take no gradient
            opt.step()
    return v.detach()


def _missing_token_round(eq: RootEquations, found: torch.Tensor, m: int, starts: int, iterations: int,
                         generator: torch.Generator) -> torch.Tensor:
    """Coordinates in fc1's span of starts run on the plain residual plus the equations only the m
    missing tokens satisfy (module doc), in (alpha, c): exact Gauss-Newton terms."""
    problem = eq.problem
    D, r1 = problem.S1.shape[0], problem.M.shape[1]
    gam = torch.linalg.svd(eq.fc2_grad @ _missing_part(eq.fc2_basis, problem.act(problem.fc1(found))),
                           full_matrices=False)[0][:, :m]
    gam1 = torch.linalg.svd(eq.fc1_grad @ _missing_part(eq.fc1_basis, found), full_matrices=False)[0][:, :m]
    lift = problem.W2.T @ gam  # [4D, m]: fc1's output gradient of a missing token is (lift c) * GELU'

    def split(theta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        pre = theta[:, :r1] @ problem.M.T + problem.b1
        return pre, problem.act(pre), theta[:, r1:] @ lift.T

    def value(theta: torch.Tensor) -> torch.Tensor:
        pre, a, q = split(theta)
        (s,) = problem.slopes(pre)
        return span_value(a, problem.S2) + span_value(q * s, gam1)

    def system(theta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        pre, a, q = split(theta)
        s, s2 = problem.slopes(pre, order=2)
        zero = torch.zeros(theta.shape[0], a.shape[1], m, dtype=theta.dtype)
        r_a, G_a, g_a = span_part(a, torch.cat([s[:, :, None] * problem.M, zero], 2), problem.S2)
        Y = torch.cat([(q * s2)[:, :, None] * problem.M, s[:, :, None] * lift], 2)
        r_g, G_g, g_g = span_part(q * s, Y, gam1)
        return r_a.pow(2).sum(-1) + r_g.pow(2).sum(-1), G_a + G_g, g_a + g_g

    v = torch.randn(starts, D, generator=generator, dtype=torch.float64)
    start = torch.cat([problem.coordinates(v), torch.randn(starts, m, generator=generator, dtype=torch.float64)], 1)
    return batched_lm(system, value, start, iterations, ROOTS, settled=1e-26)[0][:, :r1]


def _new_roots(eq: RootEquations, found: torch.Tensor, alpha: torch.Tensor, missing: bool, tol: float,
               floor_tol: float, polish_iterations: int) -> torch.Tensor:
    """``found`` with the new tokens among a round's starts ``alpha`` (fc1 coordinates) appended: those
    converged below ``tol`` (a missing round's also where two agree below ``floor_tol``), one start
    each, polished (``polish_iterations``)."""
    problem, basis = eq.problem, eq.fc1_basis
    raw = problem.value(alpha)
    good = (raw < tol).nonzero().flatten()
    if missing:
        good = torch.cat([good, _agreed(alpha @ basis.T, (raw >= tol) & (raw < floor_tol))])
    before = found.shape[0]
    fresh = dedupe(found, alpha[good[torch.argsort(raw[good])]] @ basis.T)[before:]
    if fresh.shape[0]:
        roots, value = problem.solve(fresh @ basis, polish_iterations, settled=0.0)
        found = dedupe(found, roots[torch.argsort(value)] @ basis.T)
    return found


def find_roots(block: nn.Module, fc1_basis: torch.Tensor, fc2_basis: torch.Tensor, fc1_grad: torch.Tensor,
               fc2_grad: torch.Tensor, count: int, starts: int, rounds: int, iterations: int,
               generator: torch.Generator, tol: float = 1e-16, floor_tol: float = FLOOR_TOL,
               found: torch.Tensor | None = None,
               steer_steps: int = 100, steer_lr: float = 0.05, polish_iterations: int = 30,
               steered: bool = True, patience: int = 0) -> RootSearch:
    """Up to ``count`` distinct roots of block 0's per-token MLP problem (module doc).

    Each round knows the roots found so far (``found`` before the first) and runs ``starts`` starts
    of at most ``iterations`` Levenberg-Marquardt steps in fc1's span; a start converged where the
    plain residual's square is below ``tol`` (or, in a missing round, two agree below ``floor_tol``);
    each new root is polished (``polish_iterations`` more steps) before it joins. Steered rounds move
    their starts by ``steer_steps`` Adam steps (``steer_lr``). The search starts with steered rounds
    (missing ones at once where ``steered`` is False and some roots are given) and stops when
    ``count`` roots are found, after ``rounds`` rounds, or (``patience`` > 0) after that many rounds
    in a row that add no root: on a defended update (:mod:`attacks.structure.noisy`) a token without
    a minimum next to it is never found, and the rounds would run out for nothing."""
    eq = RootEquations(MLPSpans(block, fc1_basis, fc2_basis), fc1_basis, fc2_basis, fc1_grad, fc2_grad)
    problem = eq.problem
    found = torch.zeros(0, fc1_basis.shape[0], dtype=torch.float64) if found is None else found.to(torch.float64)
    given = found.shape[0]
    per_round: list[int] = []
    modes: list[str] = []
    steering = steered
    for _ in range(rounds):
        if found.shape[0] >= count:  # every root given or found
            break
        # the search of block0_roots (its one caller among the attacks): its rounds as progress
        report("block0_roots", len(per_round), rounds, f"root search: {found.shape[0]} of {count} roots found")
        # a missing round needs the part of fc1's span the found roots leave empty: past B T > D
        # (fc1's span the whole input space) it is gone once D roots are found, and steered rounds go on
        missing = count - found.shape[0]
        past_d = found.shape[0] >= fc1_basis.shape[1]
        if past_d and missing <= TAIL_MAX and not (modes and modes[-1] == "tail" and per_round[-1] == 0):
            # past D the missing tokens' span comes off fc1's update (attacks.structure.tail); a tail
            # round that added nothing (a found point that is no token) hands over to a steered one
            with torch.no_grad():
                span = missing_span(block, found, fc1_grad, fc2_grad, missing).basis
                u = tail_starts(span, found.norm(dim=1), starts, generator)
                alpha = problem.solve(u @ fc1_basis, iterations)[0]
            modes.append("tail")
        elif steering or found.shape[0] == 0 or past_d:
            v = steered_starts(problem, fc2_basis, found, starts, steer_steps, steer_lr, generator)
            with torch.no_grad():
                alpha = problem.solve(problem.coordinates(v), iterations)[0]
            modes.append("steered")
        else:
            with torch.no_grad():
                alpha = _missing_token_round(eq, found, count - found.shape[0], starts, iterations, generator)
                # the added equations rest on the missing tokens' small gradients and on the found
                # roots (a little off the tokens where they crowd, design A): a start on a missing
                # root stops just off it, a plain residual above tol; the plain steps finish it
                alpha = problem.solve(alpha, polish_iterations)[0]
            modes.append("missing")
        before = found.shape[0]
        with torch.no_grad():
            found = _new_roots(eq, found, alpha, modes[-1] == "missing", tol, floor_tol, polish_iterations)
        per_round.append(found.shape[0] - before)
        _logger.info("block0_roots: %s round %d: %d new roots, %d of %d found", modes[-1], len(per_round),
                     per_round[-1], found.shape[0], count)
        if patience and len(per_round) >= patience and not any(per_round[-patience:]):
            break
        if modes[-1] == "steered" and per_round[-1] < 2:
            steering = False
    return RootSearch(found, len(per_round) * starts, per_round, modes, given)
