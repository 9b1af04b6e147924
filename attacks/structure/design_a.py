"""Design A of the block-0 read (:mod:`attacks.structure.block0_roots`): APRIL's block 0 (no norm1, no
residual around attention) at B = 1, where the embeddings come from the attention solve.

With every token's attention output c_r known (step 2), c_r = Attention(Z)_r for all roots r with Z
indexed by the roots themselves determines the embeddings; with every token's dL/dc_r too, each
head's value update gives its mixes A^h Z linearly (:func:`attacks.structure.attention.value_mixes`),
a far better posed system for the same unknowns (:func:`attention_tokens`: dense Levenberg-Marquardt
from random starts in the qkv update's row space, then a polish on c). Where the roots' floor,
amplified through step 2, leaves c too noisy for any start to reach the truth, the point the starts
stop at still places most tokens: the position-structured solve (:func:`structured_tokens`) assigns
positions, fits each token's patch at its position and assigns again until the assignment repeats,
and is kept where it fits c to within step 2's own noise
(:func:`attacks.structure.linear.outputs_from_roots`).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Callable, Mapping, cast

import torch
import torch.nn as nn

from ..api.base import AttackFailure
from ..solvers.lm import ROOTS, dense_lm
from .attention import attention_jacobian, attention_output, mix_jacobian, mixes, value_mixes
from .linear import TokenEquations, gradient_of, lstsq, outputs_from_roots
from .placement import assign_positions, position_residuals, token_offsets

_logger = logging.getLogger(__name__)

#: the design-A attention solve is dense in T^2 unknowns (Jacobian 3 T^4 doubles: 0.4 GB at T = 65,
#: 2.5 GB at T = 100); larger token counts are refused before any work (tests/test_block0_roots.py:
#: test_conditions_it_cannot_meet_are_failed_rows_with_the_reason, "design_a_large")
DESIGN_A_MAX_UNKNOWNS = 10_000
#: rms of a random start of the design-A attention solve's embeddings (model units, a few times the
#: position embedding's); the suite's design-A tests start from given points, bench/block0_roots.py
#: --design-a runs the random starts
_START_RMS = 0.5
#: a start of the attention solve whose squared residual is below this is in the truth's basin: on the
#: mixes it goes on to the polish on c, and a run still below it when its iterations run out gets as
#: many again (tests/test_block0_roots.py: test_design_a_attention_outputs_give_the_embeddings_and_x_tilde)
_CONVERGING = 1e-8
#: the attention solve keeps a start whose squared relative residual in c is below this: step 2's
#: rounding floor in c lies below it, a start stopped at a wrong point far above it, and step 3's
#: position test (``DESIGN_A_POSITION_TOL``) then checks every token on its own. Where step 2's noise
#: in c exceeds it no fixed value tells the two apart: the structured solve is judged against that
#: noise instead (tests/test_block0_roots.py: test_design_a_attention_outputs_give_the_embeddings_and_x_tilde
#: keeps its one start, test_the_structured_solve_reads_x_tilde_from_a_wrong_point_of_the_attention_solve
#: goes on from one above it)
ATTENTION_TOL = 1e-12
#: design A: rounds of the position-structured solve at most, where no start reaches ATTENTION_TOL; it
#: stops earlier when an assignment repeats (tests/test_block0_roots.py:
#: test_the_structured_solve_reads_x_tilde_from_a_wrong_point_of_the_attention_solve: 2 rounds read x~
#: there, 1 does not)
STRUCTURED_ROUNDS = 4


def _dense_lm(residual: Callable[[torch.Tensor], torch.Tensor], jacobian: Callable[[torch.Tensor], torch.Tensor],
              x: torch.Tensor, iterations: int, damping: float, stop: float) -> tuple[torch.Tensor, float]:
    """Block 0's dense solves: :func:`attacks.solvers.lm.dense_lm` with the :data:`~attacks.solvers.lm.ROOTS`
    schedule from mu = ``damping``, stopping at ``stop``; below ``_CONVERGING`` an iteration that gains
    less than half ends the run (its floor), and a run still below it when its ``iterations`` run out
    gets as many again. Returns (x, squared residual)."""
    res = dense_lm(residual, jacobian, x, iterations, replace(ROOTS, first=damping), floor=stop, stall=0.5,
                   stall_below=_CONVERGING, extend_below=_CONVERGING)
    return res.theta, res.value


@dataclass(frozen=True)
class AttentionEquations:
    """c_r = Attention(Z)_r for one image's tokens, each side divided by ``scale`` (C's largest entry);
    Z = beta basis^T in the qkv update's row space (``basis`` [D, k])."""

    attn: nn.Module
    C: torch.Tensor
    basis: torch.Tensor
    scale: torch.Tensor

    def tokens_residual(self, Z: torch.Tensor) -> torch.Tensor:
        return ((attention_output(self.attn, Z) - self.C) / self.scale).flatten()

    def residual(self, beta: torch.Tensor) -> torch.Tensor:
        return self.tokens_residual(beta @ self.basis.T)

    def jacobian(self, beta: torch.Tensor) -> torch.Tensor:
        return attention_jacobian(self.attn, beta @ self.basis.T, self.basis) / self.scale


@dataclass(frozen=True)
class MixEquations:
    """A^h(Z) beta = Y^h for every head, in x = (beta [n k], the free directions' weights lambda):
    :func:`attacks.structure.attention.value_mixes`'s Y0 and free directions, each head divided by
    its largest entry ``ysc`` [h]; ``cols`` holds each free direction's pattern as a Jacobian column."""

    attn: nn.Module
    basis: torch.Tensor
    Y0: torch.Tensor
    ysc: torch.Tensor
    cols: torch.Tensor

    def split(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n, k = self.Y0.shape[1:]
        return x[:n * k].reshape(n, k), x[n * k:]

    def residual(self, x: torch.Tensor) -> torch.Tensor:
        beta, lam = self.split(x)
        return ((mixes(self.attn, beta, self.basis) - self.Y0) / self.ysc[:, None, None]).flatten() + self.cols @ lam

    def jacobian(self, x: torch.Tensor) -> torch.Tensor:
        n, k = self.Y0.shape[1:]
        J = mix_jacobian(self.attn, self.split(x)[0], self.basis).reshape(len(self.ysc), n * k, n * k)
        J = J / self.ysc[:, None, None]
        return torch.cat([J.reshape(-1, n * k), self.cols], 1)


def mix_equations(attn: nn.Module, C: torch.Tensor, dC: torch.Tensor, qkv_grad: torch.Tensor,
                  basis: torch.Tensor) -> MixEquations:
    """The mixes' equations of one image from its attention outputs C, their gradients dC and dL/dW_qkv."""
    n, k = C.shape[0], basis.shape[1]
    Y0, Ns, Ms = value_mixes(attn, C, dC, qkv_grad, basis)
    ysc = Y0.flatten(1).abs().max(1).values  # [h]
    free = [N.shape[1] * M.shape[1] for N, M in zip(Ns, Ms)]
    # each free direction's pattern N_h e_i e_j^T M_h^T, as a column of the mixes' Jacobian
    cols = torch.zeros(Y0.numel(), sum(free), dtype=torch.float64)
    at = 0
    for h, (N, M) in enumerate(zip(Ns, Ms)):
        pattern = torch.einsum("ti,kj->ijtk", N, M).reshape(free[h], n * k) / ysc[h]
        cols[h * n * k:(h + 1) * n * k, at:at + free[h]] = -pattern.T
        at += free[h]
    return MixEquations(attn, basis, Y0, ysc, cols)


def attention_tokens(attn: nn.Module, C: torch.Tensor, basis: torch.Tensor, iterations: int, starts: int,
                     generator: torch.Generator, dC: torch.Tensor, qkv_grad: torch.Tensor,
                     tol: float = ATTENTION_TOL, start: torch.Tensor | None = None, damping: float = 1e-3,
                     polish_iterations: int = 10) -> tuple[torch.Tensor, float, int]:
    """Design A: every token's attention input z_r from every token's attention output c_r (one image).

    The unknowns are Z = beta basis^T (n^2; ``basis`` [D, n] the qkv update's row space). Each start
    (random, Z entries of rms ``_START_RMS``) first solves the mixes A^h(Z) beta = Y^h that the value
    update ``qkv_grad`` and the outputs' gradients ``dC`` give (:func:`mix_equations`; ``iterations`` of
    dense Levenberg-Marquardt), then polishes on c_r = Attention(Z)_r (``polish_iterations``) where the
    mixes' squared residual fell below ``_CONVERGING``. ``start`` [n, D]: the first start instead of a
    random one; ``damping``: the first damping (from random starts 1e-3; from close by 1e-6 is faster).
    A start is kept when its squared relative residual in c is below ``tol``; step 3's position test
    then checks every token. Returns (Z [n, D], squared relative residual in c, starts used)."""
    if not (isinstance(attn.q_norm, nn.Identity) and isinstance(attn.k_norm, nn.Identity)):
        raise AttackFailure("design A: the attention solve needs attention without q/k norms")
    n, k = C.shape[0], basis.shape[1]
    eq = AttentionEquations(attn, C, basis, C.abs().max())
    mix = mix_equations(attn, C, dC, qkv_grad, basis)
    best, best_value = torch.zeros(n, k, dtype=torch.float64), float("inf")
    sigma = (C.shape[1] / k) ** 0.5 * _START_RMS  # beta's entries for Z entries of that rms
    for s in range(starts):
        beta = torch.randn(n, k, generator=generator, dtype=torch.float64) * sigma
        if s == 0 and start is not None:
            beta = start.to(torch.float64) @ basis
        x = torch.cat([beta.flatten(), torch.zeros(mix.cols.shape[1], dtype=torch.float64)])
        x, mix_value = _dense_lm(mix.residual, mix.jacobian, x, iterations, damping, 1e-26)
        beta = mix.split(x)[0]
        if mix_value < _CONVERGING:  # in the truth's basin: finish on c itself
            beta, value = _dense_lm(eq.residual, eq.jacobian, beta, polish_iterations, 1e-9, tol * 1e-6)
        else:
            value = float(eq.residual(beta).pow(2).sum())
        _logger.info("block0_roots: design A attention solve, start %d: the mixes to %.1e, c to %.1e",
                     s + 1, mix_value, value)
        if value < best_value:
            best, best_value = beta, value
        if best_value < tol:
            return best @ basis.T, best_value, s + 1
    return best @ basis.T, best_value, starts


@dataclass
class StructuredTokens:
    """Outcome of :func:`structured_tokens`: the embeddings Z [n, D] (every token at its assigned
    position), the squared relative residual in c there, the positions [n] (T: E_unk), the rounds
    run and whether the last assignment repeated the one before."""

    Z: torch.Tensor
    value: float
    position: torch.Tensor
    rounds: int
    stable: bool


def _fit_at_positions(eq: AttentionEquations, We: torch.Tensor, off: torch.Tensor, pos: torch.Tensor,
                      Z: torch.Tensor, iterations: int) -> tuple[torch.Tensor, float]:
    """One round of :func:`structured_tokens`: c_r = Attention(Z)_r over the patches alone, every token
    held at its position ``pos`` (Z = ``off`` + x W_e^T, the class token fixed), from each token's patch
    nearest where it stands in Z. Returns (the held embeddings, the squared relative residual in c)."""
    n, D = eq.C.shape
    idx = (pos != 0).nonzero().flatten()  # the class token is fixed: cls + P_0

    def build(x: torch.Tensor) -> torch.Tensor:
        Zx = off.clone()
        Zx[idx] = off[idx] + x.reshape(len(idx), -1) @ We.T
        return Zx

    def jacobian(x: torch.Tensor) -> torch.Tensor:
        J = attention_jacobian(eq.attn, build(x), We) / eq.scale  # moves along W_e: [n D, n C p^2]
        return J.reshape(n * D, n, -1)[:, idx].reshape(n * D, -1)

    x = lstsq(We, (Z[idx] - off[idx]).T).T.flatten()  # each token's patch nearest where it stands
    x, value = _dense_lm(lambda x: eq.tokens_residual(build(x)), jacobian, x, iterations, 1e-3, 0.0)
    return build(x), value


def structured_tokens(attn: nn.Module, C: torch.Tensor, Z: torch.Tensor, vit: nn.Module, basis: torch.Tensor,
                      rounds: int, iterations: int, polish_iterations: int = 10) -> StructuredTokens:
    """Design A: the embeddings from a wrong point Z of the attention solve, through the positions.

    Where step 2's error in c is large no start of :func:`attention_tokens` reaches the truth, but the
    point it stops at still places most tokens at their true position. So each round assigns a
    position to every token (:func:`attacks.structure.placement.assign_positions` on step 3's
    residuals), solves c_r = Attention(Z)_r over the patches alone with each token held at its assigned
    position (C p^2 unknowns a token where the free solve has n; ``iterations`` of dense
    Levenberg-Marquardt) and polishes that freely in the qkv update's row space (``polish_iterations``),
    whose point the next round assigns again. It stops when an assignment repeats the one before
    (``stable``) or after ``rounds``. The held point is the answer: every token exactly at a position,
    its patch the solve's. Written here because no library solves a nonlinear least-squares problem
    over an assignment; the assignment itself is scipy's."""
    n = C.shape[0]
    T = int(vit.pos_embed.shape[1])
    We, off_all, _, Qm = token_offsets(vit)
    eq = AttentionEquations(attn, C, basis, C.abs().max())
    last: torch.Tensor | None = None
    held, value = Z, float("inf")
    for r in range(rounds):
        pos = assign_positions(position_residuals(Z, off_all, Qm), T)
        if last is not None and bool((pos == last).all()):
            return StructuredTokens(held, value, pos, r, True)
        held, value = _fit_at_positions(eq, We, off_all[pos], pos, Z, iterations)
        moved = n if last is None else int((pos != last).sum())
        _logger.info("block0_roots: design A structured round %d: %d tokens (re)placed, c to %.1e",
                     r + 1, moved, value)
        last = pos
        if r + 1 < rounds:  # the polish only feeds the next round's assignment
            Z = _dense_lm(eq.residual, eq.jacobian, held @ basis, polish_iterations, 1e-9, 0.0)[0] @ basis.T
    final = last if last is not None else torch.zeros(n, dtype=torch.long)
    return StructuredTokens(held, value, final, rounds, False)


@dataclass(frozen=True)
class DesignAEmbeddings:
    """Outcome of :func:`design_a_embeddings`: every token's embedding [n, D], the squared relative
    residual in c the solve ended at, the noise in c the structured solve was held to (None where the
    attention solve's start was kept) and the structured solve's rounds (0: not run)."""

    tokens: torch.Tensor
    residual: float
    floor: float | None
    structured_rounds: int


def design_a_embeddings(vit: nn.Module, grads: Mapping[str, torch.Tensor], eq: TokenEquations, batch: int,
                        iterations: int, starts: int, generator: torch.Generator | None,
                        structured_rounds: int) -> DesignAEmbeddings:
    """Design A (B = 1): the embeddings from step 2's ``eq`` by the attention solve (:func:`attention_tokens`,
    ``iterations`` and ``starts``), and where no start reaches :data:`ATTENTION_TOL`, up to
    ``structured_rounds`` rounds of :func:`structured_tokens` from the best one (0: fail instead), kept
    when its assignment repeated and its residual in c is at most step 2's own noise in c or
    :data:`ATTENTION_TOL`."""
    attn = cast(nn.Module, vit.blocks[0].attn)
    g = gradient_of(vit, grads)
    C = eq.outputs
    if batch != 1:
        raise AttackFailure(f"design A: the attention solve reads one image's tokens, not {batch}")
    basis = torch.linalg.svd(g(attn.qkv.weight), full_matrices=False)[2][:C.shape[0]].T
    gen = generator if generator is not None else torch.Generator().manual_seed(0)
    base, residual, _ = attention_tokens(attn, C, basis, iterations, starts, gen, dC=eq.h_grads @ attn.proj.weight,
                                         qkv_grad=g(attn.qkv.weight))
    if not residual > ATTENTION_TOL:  # the start is kept (the solve's own test, :func:`attention_tokens`)
        return DesignAEmbeddings(base, residual, None, 0)
    if not structured_rounds:
        raise AttackFailure(f"design A: the attention solve ended at a squared residual of {residual:.1e} after "
                            f"{starts} starts of {iterations} iterations (raise attention_starts; where every "
                            "start stops near the same residual, step 2's error in c is what stops it, not the "
                            "starts: set structured_rounds, docs/attacks.md, `block0_roots`)")
    floor = float(((C - outputs_from_roots(attn, C, eq.normalized)) / C.abs().max()).pow(2).sum())
    st = structured_tokens(attn, C, base, vit, basis, structured_rounds, iterations)
    if not st.stable:
        raise AttackFailure(f"design A: the attention solve's starts ended at {residual:.1e} and the "
                            f"position-structured solve's assignment did not repeat in {structured_rounds} "
                            "rounds (raise structured_rounds)")
    if st.value > max(floor, ATTENTION_TOL):  # ATTENTION_TOL: where c's noise is rounding
        raise AttackFailure(f"design A: the position-structured solve ended at a squared residual of {st.value:.1e} "
                            f"in c, above {floor:.1e}, the disagreement of step 2's two readings of c (its noise): "
                            "not the client's tokens")
    return DesignAEmbeddings(st.Z, st.value, floor, st.rounds)
