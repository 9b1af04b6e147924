"""``block0_roots``: a batch read off block 0 exactly, through its MLP's per-token roots.

On a ViT whose block 0 is the standard pre-norm block (``norm1`` and a residual around attention,
the model as trained; not APRIL's design A), a FedSGD update of B images with B T <= D tokens
(T per image, D the width: B <= 2 on the CIFAR geometry, T = 65, D = 192) determines the batch.
No closed form of the first layer sees it (docs/design.md, "What survives batching"); block 0's MLP
and attention projection do:

1. **Roots.** Every token's fc1 input u = norm2(h) lies in fc1's input span and GELU(W1 u + b1) in
   fc2's (both read off their weight gradients, rank B T): each of the B T tokens is a root of a small
   problem of its own (:mod:`attacks.structure.token_roots`). Random starts alone find the few tokens with
   large basins again and again. The search (:func:`find_roots`) steers its starts into the part of
   fc2's span the found tokens leave empty while that pays, then adds equations only the tokens not
   yet found satisfy (their output gradients span what dL/dW_fc2 puts on that empty part). Every
   start is solved in fc1's span (u = S1 alpha, where a root is isolated) with exact Gauss-Newton
   terms. Measured at B = 2 (shipped CIFAR DeiT as trained): all 130 roots in 11-15 rounds of 32
   starts, 26-58 s on one core (three pairs of bundled photographs, four CIFAR-10 batches).
2. **Per-token backward quantities, linear.** With every token's activation a_t known,
   dL/dW_fc2 = sum_t g_t a_t^T gives each token's output gradient g_t (B T <= 4D), and with it the
   gradient reaching norm2's input up to the LayerNorm's scale 1/sigma_t, which dL/db_proj =
   sum_t dL/dh_t fixes (B T <= D unknowns); then dL/dW_proj = sum_t (dL/dh_t) c_t^T gives every
   token's attention output c_t (B T <= D).
3. **Tokens, positions and patches.** h_t = sigma_t n_t + mu_t (n_t = (u_t - beta) / gamma) and
   h_t = z_t + W_proj c_t + b_proj, so z_t = W_e x_t + b_e + P_p is known up to mu_t: for each
   position p, least squares in (mu_t, x_t) (1 + 3 p^2 unknowns, D equations) leaves a residual at
   the rounding floor at the token's own position only (the class token: z = cls + P_0).
4. **Which image.** A token's attention output is its image's values averaged by its softmax
   weights: sum_s m_s exp(q_t . k_s) (v_s - c_t) = 0 per head, linear in the indicators m_s of the
   tokens that share its image (D equations, B T - 1 unknowns). Solved for each class token, it says
   which token of every position belongs to which image (an optimal assignment per position).

Every step after the roots is linear algebra in float64: measured on the shipped CIFAR DeiT
(standard block 0) at B = 2 the attention outputs come back to 4e-14 (relative), every token's
position is right with a best residual of 6e-14 against a runner-up of 0.04, and the images to the
rounding floor. Labels are not needed (the labels row is the update's own, as ``batch_match``
reads it). On MJP (E_unk in place of the position embedding at the shuffled positions), E_unk is
one more candidate in step 3: the tokens that fit it give each image's shuffled set and its patches
exactly, and the update does not fix their order (attention without a position embedding does not
see it): ``images`` places them in the free positions in root order, ``unshuffled`` is the jigsaw
solver's arrangement (setting c, :mod:`attacks.solvers.jigsaw`).

**Design A** (APRIL's block 0: no norm1, no residual around attention) at B = 1: steps 1 and 2 hold
as they are, and with every token's attention output c_r known, c_r = Attention(Z)_r for all roots
r with Z indexed by the roots themselves determines the embeddings; with every token's dL/dc_r
too, each head's value update gives its mixes A^h Z linearly (:func:`_value_mixes`), a far better
posed system for the same unknowns (:func:`attention_tokens`: dense Levenberg-Marquardt from random
starts in the qkv update's row space, then a polish on c); step 3 then places them and checks
every token. Where the roots' floor, amplified through step 2, leaves c too noisy for any start to
reach the truth, the point the starts stop at still places most tokens: the position-structured
solve (:func:`structured_tokens`) assigns positions, fits each token's patch at its position and
assigns again until the assignment repeats, and is kept where it fits c to within step 2's own
noise (:func:`outputs_from_roots`); that answer, ~1e-3 off x~, is then polished on every layer's
input span (:func:`span_polish`), which holds x~ to the update's own precision. Refused, with the
reason: design A at B > 1 (the solve needs each token's image), B T > D, a FedAvg delta of several
local steps.
"""
from __future__ import annotations

import copy
import logging
import time
from itertools import groupby
from dataclasses import dataclass
from typing import Any, Callable, Mapping, cast

import torch
import torch.nn as nn
from scipy.optimize import linear_sum_assignment

from fedmjp.config import Int, option

from ..api.base import Attack, AttackFailure, AttackMetadata, AttackOptions, AttackResult, Update, update_to_gradients
from ..optimization.batch_match import batch_labels
from ..closed_form.first_layer import is_design_a, unwrap_vit
from ..solvers.jigsaw import unshuffle_image
from ..api.registry import register_attack
from ..solvers.spans import complement, input_spans
from .token_roots import MLPSpans, span_part, span_value, gauss_newton_lm

_logger = logging.getLogger(__name__)

#: a token is placed where its position residual (relative) is below this; measured 6e-14 at the
#: true position against >= 0.04 at every other one (shipped CIFAR DeiT, B = 1 and 2)
POSITION_TOL = 1e-6
#: the same on design A, where the embeddings come through the attention solve: step 2's error in c
#: (squared residual 1.5e-16 on one photograph) grows through the attention's inverse to 1.2e-5 in
#: the true tokens' position residuals, still 3,000 times below any other position's (>= 0.04)
DESIGN_A_POSITION_TOL = 1e-3
#: the design-A attention solve is dense in T^2 unknowns (Jacobian 3 T^4 doubles: 0.4 GB at T = 65,
#: 2.5 GB at T = 100); larger token counts are refused before any work
DESIGN_A_MAX_UNKNOWNS = 10_000
#: rms of a random start of the design-A attention solve (model units; the position embedding's is ~0.13)
_START_RMS = 0.5
#: a start of the attention solve below this squared residual at its last iteration gets as many again:
#: it is converging (bundled photograph 1 stood at 7.4e-16 after 40 iterations)
_CONVERGING = 1e-8
#: the attention solve keeps a start whose squared relative residual in c is below this. Its floor is
#: step 2's accuracy (2.9e-16 on one bundled photograph, 1e-22 on another); a wrong start stopped at
#: >= 1e-5; step 3's position test (DESIGN_A_POSITION_TOL) then checks every token on its own. On
#: bundled photograph 3 step 2's floor is 2.8e-7 (its roots' floor, amplified) and the starts stop at
#: 2.4e-6 on a wrong point: no fixed value here tells them apart (docs/attacks.md, `block0_roots`)
ATTENTION_TOL = 1e-12
#: design A: rounds of the position-structured solve where no start reaches ATTENTION_TOL (bundled
#: photograph 3: the first placed all 65 tokens and the next assignment repeated it; a round is 1-5
#: CPU-minutes at T = 65)
STRUCTURED_ROUNDS = 4
#: design A: Levenberg-Marquardt Jacobians of the span polish after the structured solve (bundled
#: photograph 3: its 52 / 45 dB answer to 146 / 113 dB in 5-6 Jacobians, ~3 CPU-minutes at 32 px)
SPAN_POLISH_JACOBIANS = 6


@dataclass
class RootSearch:
    """Outcome of :func:`find_roots`: the distinct roots [k, D] (fc1 inputs), the starts run, the roots
    each round added and how that round started (``"steered"`` or ``"missing"``)."""

    roots: torch.Tensor
    starts: int
    per_round: list[int]
    modes: list[str]


#: a missing-token round also keeps a point whose plain squared residual is below this (not ``tol``)
#: where two of its starts or more land on it. Where two tokens nearly coincide the update's own
#: float64 rounding sets the floor: on one bundled photograph (design A) two tokens 9.9e-6 apart in
#: 1 - cos sit in the fc1/fc2 updates' weakest singular directions (9e-15 of the largest, rounding
#: 5e-16), their true fc1 inputs leave 1.4e-16 and 7e-17 (that photograph's median token ~2.5e-19), and all 32
#: starts of a missing round met at 1.30e-16, 2.2e-9 in 1 - cos from the missing token
FLOOR_TOL = 1e-14

#: two roots closer than this (1 - cosine) are one token. A converged start sits ~2e-8 (relative) off
#: its token, two of them on one token ~1e-15 apart in 1 - cos; distinct tokens of design A's block 0
#: came as close as 7.5e-7 (a bundled photograph with 41 pairs above the 1e-5 this was before)
DISTINCT = 1e-11


def _dedupe(found: torch.Tensor, new: torch.Tensor, distinct_cos: float = 1 - DISTINCT) -> torch.Tensor:
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


def _steered_starts(problem: MLPSpans, fc2_basis: torch.Tensor, found: torch.Tensor, starts: int, steps: int,
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


def _missing_token_round(problem: MLPSpans, fc1_basis: torch.Tensor, fc2_basis: torch.Tensor,
                         fc1_grad: torch.Tensor, fc2_grad: torch.Tensor, found: torch.Tensor, m: int,
                         starts: int, iterations: int, generator: torch.Generator) -> torch.Tensor:
    """Coordinates in fc1's span of starts run on the plain residual plus the equations only the m
    missing tokens satisfy (:func:`find_roots`), in (alpha, c): exact Gauss-Newton terms."""
    D, r1 = problem.S1.shape[0], problem.M.shape[1]
    gam = torch.linalg.svd(fc2_grad @ _missing_part(fc2_basis, problem.act(problem.fc1(found))),
                           full_matrices=False)[0][:, :m]
    gam1 = torch.linalg.svd(fc1_grad @ _missing_part(fc1_basis, found), full_matrices=False)[0][:, :m]
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
    return gauss_newton_lm(system, value, start, iterations)[0][:, :r1]


def find_roots(block: nn.Module, fc1_basis: torch.Tensor, fc2_basis: torch.Tensor, fc1_grad: torch.Tensor,
               fc2_grad: torch.Tensor, count: int, starts: int, rounds: int, iterations: int,
               generator: torch.Generator, tol: float = 1e-16, floor_tol: float = FLOOR_TOL,
               found: torch.Tensor | None = None,
               steer_steps: int = 100, steer_lr: float = 0.05, polish_iterations: int = 30,
               steered: bool = True) -> RootSearch:
    """Up to ``count`` distinct roots of block 0's per-token MLP problem (module doc, step 1).

    Each round knows the roots found so far (``found`` before the first) and runs ``starts`` starts
    of at most ``iterations`` Levenberg-Marquardt steps in fc1's span (u = S1 alpha, where a root is
    isolated: :class:`attacks.structure.token_roots.MLPSpans`); a start converged where the plain residual's
    square is below ``tol``; each new root is polished (``polish_iterations`` more steps) before it
    joins. Two kinds of round:

    * **steered** (while they add at least 2 roots a round): random starts moved by ``steer_steps``
      Adam steps (``steer_lr``) into the part of fc2's span the found tokens leave empty
      (:func:`_steered_starts`), then solved on the plain residual. Cheap; slows as the last tokens
      with small basins remain.
    * **missing**: the m missing tokens' activations fill the part E2 of fc2's span the found ones
      leave empty, so dL/dW_fc2 E2 = G_M (A_M E2) spans their output gradients g_j (Gamma, m
      columns), and likewise dL/dW_fc1 E1 spans their fc1 output gradients (W2^T g_j) *
      GELU'(W1 u_j + b1) (Gamma1). A missing token is therefore a root of

          r(u)  and  P_{Gamma1 perp} ((W2^T Gamma c) * GELU'(W1 u + b1)) / ||.||

      in (alpha, c), c in R^m; a token already found is not (its g is not in Gamma, and 4D - m equations
      hold against m unknowns): the second block deflates exactly, where one deflation factor per
      root found (Farrell et al.) stopped the starts converging at all. Costlier per start. Where the
      tokens crowd (design A: fc1 inputs within 1.5-3.4 % of each other) the added equations end a
      start ~1e-7 off its root, so every start then takes ``polish_iterations`` plain steps.
      Where two tokens nearly coincide, the update's rounding leaves their roots above ``tol``: a
      missing round also keeps a point below ``floor_tol`` that two of its starts or more reach
      (:data:`FLOOR_TOL`).

    The search starts with steered rounds (missing ones at once where ``steered`` is False and some
    roots are given) and stops when ``count`` roots are found or after ``rounds`` rounds."""
    problem = MLPSpans(block, fc1_basis, fc2_basis)
    D = fc1_basis.shape[0]
    found = torch.zeros(0, D, dtype=torch.float64) if found is None else found.to(torch.float64)
    per_round: list[int] = []
    modes: list[str] = []
    steering = steered
    for _ in range(rounds):
        m = count - found.shape[0]
        if steering or found.shape[0] == 0:
            v = _steered_starts(problem, fc2_basis, found, starts, steer_steps, steer_lr, generator)
            with torch.no_grad():
                alpha = problem.solve(problem.coordinates(v), iterations)[0]
            modes.append("steered")
        else:
            with torch.no_grad():
                alpha = _missing_token_round(problem, fc1_basis, fc2_basis, fc1_grad, fc2_grad, found, m, starts,
                                             iterations, generator)
                # the added equations rest on the missing tokens' small gradients and on the found
                # roots (2e-8 off the tokens where they crowd, design A): a start on a missing root
                # stops ~1e-7 off it, a plain residual of ~1e-15 > tol; the plain steps finish it
                alpha = problem.solve(alpha, polish_iterations)[0]
            modes.append("missing")
        with torch.no_grad():
            raw = problem.value(alpha)
            good = (raw < tol).nonzero().flatten()
            if modes[-1] == "missing":
                good = torch.cat([good, _agreed(alpha @ fc1_basis.T, (raw >= tol) & (raw < floor_tol))])
            before = found.shape[0]
            # the new tokens among the converged starts (one start each), then polished
            fresh = _dedupe(found, alpha[good[torch.argsort(raw[good])]] @ fc1_basis.T)[before:]
            if fresh.shape[0]:
                roots, value = problem.solve(fresh @ fc1_basis, polish_iterations, settled=0.0)
                found = _dedupe(found, roots[torch.argsort(value)] @ fc1_basis.T)
        per_round.append(found.shape[0] - before)
        _logger.info("block0_roots: %s round %d: %d new roots, %d of %d found", modes[-1], len(per_round),
                     per_round[-1], found.shape[0], count)
        if modes[-1] == "steered" and per_round[-1] < 2:
            steering = False
        if found.shape[0] >= count:
            break
    return RootSearch(found, len(per_round) * starts, per_round, modes)


@dataclass
class BatchFromRoots:
    """Outcome of :func:`batch_from_roots`.

    Attributes:
        images: [B, C, H, W] model inputs.
        position: [B T] each root's position (0: the class token).
        image: [B T] each root's image.
        position_residual: [B T] relative residual of each root at its position.
        runner_up: [B T] its smallest residual at any other position.
        membership_margin: the smallest |m - 0.5| of the indicators the assignment used.
        shuffled: [B, T - 1] bool, the patch positions whose token carried MJP's E_unk (position T
            in ``position``): their patches are placed in them in an order the update does not fix.
        attention_residual: design A only: the squared relative residual the attention solve
            (:func:`attention_tokens`, or :func:`structured_tokens` where its starts failed) ended at
            (None on the standard block).
        attention_floor: design A, where the structured solve ran: the noise in c it was held to
            (:func:`outputs_from_roots`); None elsewhere.
        structured_rounds: design A: the structured solve's rounds (0: the free solve's start kept).
    """

    images: torch.Tensor
    position: torch.Tensor
    image: torch.Tensor
    position_residual: torch.Tensor
    runner_up: torch.Tensor
    membership_margin: float
    shuffled: torch.Tensor
    attention_residual: float | None = None
    attention_floor: float | None = None
    structured_rounds: int = 0


def _lstsq(A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    """Least squares by SVD (gelsd: rank-revealing, the same answer on every LAPACK build)."""
    return torch.linalg.lstsq(A, B, driver="gelsd").solution


def _attention_output(attn: nn.Module, Z: torch.Tensor) -> torch.Tensor:
    """timm Attention's proj input for tokens Z [n, D] that all attend to each other."""
    n, D = Z.shape
    heads = int(attn.num_heads)
    qkv = attn.qkv(Z).reshape(n, 3, heads, D // heads).permute(1, 2, 0, 3)
    q, k, v = attn.q_norm(qkv[0]), attn.k_norm(qkv[1]), qkv[2]
    weights = ((q * float(attn.scale)) @ k.transpose(-2, -1)).softmax(-1)
    return (weights @ v).transpose(0, 1).reshape(n, D)


def _attention_jacobian(attn: nn.Module, Z: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    """d Attention(Z) / d beta for Z = beta basis^T, [n D, n k], in closed form.

    Written out rather than by forward mode: a change of beta's row r moves token r's query, key and
    value only, so each column block is three outer products (values: A_tr W_v; keys: s A_tr
    (v_r - c_t) (q_t . W_k); the query: token r's own row), 9 times faster than 4,225 tangents
    through the layer on the CIFAR geometry (tests check it against forward mode)."""
    n, D = Z.shape
    heads = int(attn.num_heads)
    d, k = D // heads, basis.shape[1]
    W = attn.qkv.weight.to(torch.float64).reshape(3, heads, d, D) @ basis  # [3, h, d, k]
    qkv = attn.qkv(Z).reshape(n, 3, heads, d).permute(1, 2, 0, 3)
    q, kk, v = qkv[0], qkv[1], qkv[2]  # [h, n, d]
    sc = float(attn.scale)
    A = ((q * sc) @ kk.transpose(-2, -1)).softmax(-1)  # [h, t, r]
    c = A @ v
    J = torch.einsum("htr,hei->theri", A, W[2])
    J += sc * torch.einsum("htr,htre,hti->theri", A, v[:, None, :, :] - c[:, :, None, :], q @ W[1])
    M = sc * (torch.einsum("hrj,hje,hjf->href", A, v, kk) - c[..., None] * (A @ kk)[:, :, None, :])
    own = torch.einsum("href,hfi->rhei", M, W[0])  # the query of token r moves its own row only
    idx = torch.arange(n)
    J[idx, :, :, idx, :] += own
    return J.reshape(n * D, n * k)


def _value_mixes(attn: nn.Module, C: torch.Tensor, dC: torch.Tensor, qkv_grad: torch.Tensor,
                 basis: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """Design A: each head's Y^h = A^h Z (every token's attention-weighted mix of all embeddings, in
    ``basis`` coordinates [n, k]) from the update, linearly, up to a few directions.

    Head h's value weights' gradient is dL/dW_v^h = sum_s dv_s z_s^T with dv_s = sum_t A_ts dc_t, that
    is dC^h^T Y^h; and its attention outputs are C^h = Y^h W_v^h^T + b_v^h (A's rows sum to 1). With
    every token's c_t and dL/dc_t known (step 2) both are linear in Y^h: the first fixes it up to
    N_h W^T (N_h [n, n - d]: the null space of dC^h^T; W free), the second fixes W but its part that
    W_v^h on the basis does not see (M_h [k, k - d]). Returns (Y0 [h, n, k], N_h, M_h) with
    Y^h = Y0^h + N_h L_h M_h^T, L_h free [(n - d), (k - d)]: 1 x 1 on the CIFAR geometry (n = k = 65
    tokens, head width d = 64). Measured with the truth's attention weights: Z from Y^1..3 to 1e-8."""
    n, D = C.shape
    heads = int(attn.num_heads)
    d = D // heads
    W = attn.qkv.weight.to(torch.float64)
    b = attn.qkv.bias.to(torch.float64)
    Y0, Ns, Ms = [], [], []
    for h in range(heads):
        rows = slice(2 * D + h * d, 2 * D + (h + 1) * d)
        Wb, Gb = W[rows] @ basis, qkv_grad[rows] @ basis  # [d, k]
        dCh, Ch = dC[:, h * d:(h + 1) * d], C[:, h * d:(h + 1) * d] - b[rows]  # [n, d]
        U = torch.linalg.svd(dCh, full_matrices=True)[0]
        N = U[:, min(n, d):]  # [n, n - d]: dC^h^T N = 0
        base = _lstsq(dCh.T, Gb)  # [n, k]
        Vh = torch.linalg.svd(Wb, full_matrices=True)[2]
        M = Vh[min(d, Wb.shape[1]):].T  # [k, k - d]: W_v^h on the basis kills it
        if N.shape[1]:  # C^h fixes the part of N L that W_v^h sees
            base = base + N @ _lstsq(Wb, (Ch - base @ Wb.T).T @ N).T
        Y0.append(base)
        Ns.append(N)
        Ms.append(M)
    return torch.stack(Y0), Ns, Ms


def _mixes(attn: nn.Module, beta: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    """Y^h = A^h(Z) beta for Z = beta basis^T, [h, n, k] (:func:`_value_mixes`)."""
    n, k = beta.shape
    heads = int(attn.num_heads)
    D = basis.shape[0]
    d = D // heads
    qkv = attn.qkv(beta @ basis.T).reshape(n, 3, heads, d).permute(1, 2, 0, 3)
    A = ((qkv[0] * float(attn.scale)) @ qkv[1].transpose(-2, -1)).softmax(-1)
    return A @ beta


def _mix_jacobian(attn: nn.Module, beta: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    """d Y / d beta [h n k, n k] for the mixes Y^h = A^h(Z) beta (:func:`_mixes`): the closed form of
    :func:`_attention_jacobian` with each token's coordinates as its value."""
    n, k = beta.shape
    heads = int(attn.num_heads)
    D = basis.shape[0]
    d = D // heads
    W = attn.qkv.weight.to(torch.float64)
    b = attn.qkv.bias.to(torch.float64)
    sc = float(attn.scale)
    eye = torch.eye(k, dtype=torch.float64)
    idx = torch.arange(n)
    Js = []
    for h in range(heads):
        Wq, Wk = W[h * d:(h + 1) * d] @ basis, W[D + h * d:D + (h + 1) * d] @ basis
        q = beta @ Wq.T + b[h * d:(h + 1) * d]
        kk = beta @ Wk.T + b[D + h * d:D + (h + 1) * d]
        A = ((q * sc) @ kk.T).softmax(-1)
        Y = A @ beta
        diff = beta[None, :, :] - Y[:, None, :]  # [t, s, k]
        J = torch.einsum("tr,ij->tirj", A, eye)
        J += sc * torch.einsum("tr,tri,tj->tirj", A, diff, q @ Wk)
        J[idx, :, idx, :] += sc * torch.einsum("rs,rsi,sj->rij", A, diff, kk @ Wq)
        Js.append(J.reshape(n * k, n * k))
    return torch.cat(Js)


def _dense_lm(residual: Callable[[torch.Tensor], torch.Tensor], jacobian: Callable[[torch.Tensor], torch.Tensor],
              x: torch.Tensor, iterations: int, damping: float, stop: float) -> tuple[torch.Tensor, float]:
    """Levenberg-Marquardt on a dense Jacobian: damping relative to J^T J's largest diagonal entry,
    divided by 3 on success and multiplied by 4 on refusal (no cap on refusals; span_lm's Nielsen
    schedule stopped the same attention start at 5.5e-7 where this reaches 1.2e-22). Stops below
    ``stop``, when no step helps, or at its floor (below ``_CONVERGING``, a step that gains less than
    half); one below ``_CONVERGING`` when its ``iterations`` run out gets as many again. Returns
    (x, squared residual)."""
    r = residual(x)
    value, mu = float(r.pow(2).sum()), damping
    eye = torch.eye(x.numel(), dtype=torch.float64)
    it, budget = 0, iterations
    settled = False
    while it < budget and value >= stop:
        it += 1
        J = jacobian(x)
        G, g = J.T @ J, J.T @ r
        top = float(G.diagonal().max())
        while mu < 1e8:
            trial_x = x - torch.linalg.solve(G + mu * top * eye, g).reshape(x.shape)
            trial_r = residual(trial_x)
            trial = float(trial_r.pow(2).sum())
            if trial < value:
                settled = value < _CONVERGING and trial > 0.5 * value  # at its floor: no more to gain
                x, r, value, mu = trial_x, trial_r, trial, max(mu / 3, 1e-15)
                break
            mu *= 4
        if mu >= 1e8 or settled:
            break
        if it == iterations and value < _CONVERGING:
            budget = 2 * iterations
    return x, value


def attention_tokens(attn: nn.Module, C: torch.Tensor, basis: torch.Tensor, iterations: int, starts: int,
                     generator: torch.Generator, dC: torch.Tensor, qkv_grad: torch.Tensor,
                     tol: float = ATTENTION_TOL, start: torch.Tensor | None = None, damping: float = 1e-3,
                     polish_iterations: int = 10) -> tuple[torch.Tensor, float, int]:
    """Design A: every token's attention input z_r from every token's attention output c_r (one image).

    Block 0's attention reads the embeddings z directly, so with all n = T roots' outputs c_r known
    (step 2), c_r = Attention(Z)_r holds for every root r with Z indexed by the roots themselves: no
    position or assignment is needed. Z lies in the qkv update's row space (``basis`` [D, n]), so the
    unknowns are Z = beta basis^T (n^2). Given dL/dc_r too (``dC``, step 2) and dL/dW_qkv
    (``qkv_grad``), each head's value update gives the mixes Y^h = A^h Z themselves up to a few
    directions (:func:`_value_mixes`): 3 n k equations that hold c's n D and more. Each start (random,
    Z entries of rms ``_START_RMS``) first solves A^h(Z) beta = Y^h (``iterations``, dense
    Levenberg-Marquardt with the closed-form Jacobian, :func:`_mix_jacobian`), then polishes on
    c_r = Attention(Z)_r (``polish_iterations``, :func:`_attention_jacobian`) where the mixes' squared
    residual fell below ``_CONVERGING``. Measured on the shipped DeiT+MJP with APRIL's surgery (32 px,
    bundled photograph 2, 17 of 64 shuffled, true c and dL/dc): two random starts of the c equations
    alone stopped at 2.1e-5 and 1.1e-5 after 40 iterations; of three random starts on the mixes two
    reached the truth (Z to 5e-9) in 17 and 19 iterations, one stopped at 1.5e-4. ``start`` [n, D]:
    the first start instead of a random one; ``damping``: the first damping (from random starts 1e-3;
    from close by 1e-6 is faster). A start is kept when its squared relative residual in c is below
    ``tol``; step 3's position test then checks every token. Returns (Z [n, D], squared relative
    residual in c, starts used)."""
    if not (isinstance(attn.q_norm, nn.Identity) and isinstance(attn.k_norm, nn.Identity)):
        raise AttackFailure("design A: the attention solve needs attention without q/k norms")
    n, k = C.shape[0], basis.shape[1]
    scale = C.abs().max()

    def residual(beta: torch.Tensor) -> torch.Tensor:
        return ((_attention_output(attn, beta @ basis.T) - C) / scale).flatten()

    def jacobian(beta: torch.Tensor) -> torch.Tensor:
        return _attention_jacobian(attn, beta @ basis.T, basis) / scale

    Y0, Ns, Ms = _value_mixes(attn, C, dC, qkv_grad, basis)
    ysc = Y0.flatten(1).abs().max(1).values  # [h]
    free = [N.shape[1] * M.shape[1] for N, M in zip(Ns, Ms)]
    # each free direction's pattern N_h e_i e_j^T M_h^T, as a column of the mixes' Jacobian
    cols = torch.zeros(Y0.numel(), sum(free), dtype=torch.float64)
    at = 0
    for h, (N, M) in enumerate(zip(Ns, Ms)):
        pattern = torch.einsum("ti,kj->ijtk", N, M).reshape(free[h], n * k) / ysc[h]
        cols[h * n * k:(h + 1) * n * k, at:at + free[h]] = -pattern.T
        at += free[h]

    def mix_split(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x[:n * k].reshape(n, k), x[n * k:]

    def mix_residual(x: torch.Tensor) -> torch.Tensor:
        beta, lam = mix_split(x)
        return ((_mixes(attn, beta, basis) - Y0) / ysc[:, None, None]).flatten() + cols @ lam

    def mix_jacobian(x: torch.Tensor) -> torch.Tensor:
        J = _mix_jacobian(attn, mix_split(x)[0], basis).reshape(len(ysc), n * k, n * k) / ysc[:, None, None]
        return torch.cat([J.reshape(-1, n * k), cols], 1)

    best, best_value = torch.zeros(n, k, dtype=torch.float64), float("inf")
    sigma = (C.shape[1] / k) ** 0.5 * _START_RMS  # beta's entries for Z entries of that rms
    for s in range(starts):
        beta = torch.randn(n, k, generator=generator, dtype=torch.float64) * sigma
        if s == 0 and start is not None:
            beta = start.to(torch.float64) @ basis
        x = torch.cat([beta.flatten(), torch.zeros(cols.shape[1], dtype=torch.float64)])
        x, mix_value = _dense_lm(mix_residual, mix_jacobian, x, iterations, damping, 1e-26)
        beta = mix_split(x)[0]
        if mix_value < _CONVERGING:  # in the truth's basin: finish on c itself
            beta, value = _dense_lm(residual, jacobian, beta, polish_iterations, 1e-9, tol * 1e-6)
        else:
            value = float(residual(beta).pow(2).sum())
        _logger.info("block0_roots: design A attention solve, start %d: the mixes to %.1e, c to %.1e",
                     s + 1, mix_value, value)
        if value < best_value:
            best, best_value = beta, value
        if best_value < tol:
            return best @ basis.T, best_value, s + 1
    return best @ basis.T, best_value, starts


def _token_offsets(vit: nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(W_e [D, C p^2], each candidate position's offset [T (+1 with MJP's E_unk), D] with the class
    token's row cls + P_0 and every other row P_p + b_e, M [D, 1 + C p^2] the (mu, x) unknowns of
    step 3, its orthonormal basis), detached in float64."""
    D = int(vit.pos_embed.shape[-1])
    f64 = lambda t: t.detach().to(torch.float64)  # noqa: E731
    We = f64(vit.patch_embed.proj.weight).reshape(D, -1)
    be = f64(vit.patch_embed.proj.bias)
    P = f64(vit.pos_embed[0])
    unk = getattr(vit, "unk_embed", None)
    if unk is not None:  # MJP: a shuffled token's "position" is E_unk (index T here)
        P = torch.cat([P, f64(unk).reshape(1, D)])
    off = P + be
    off[0] = f64(vit.cls_token[0, 0]) + P[0]
    M = torch.cat([torch.ones(D, 1, dtype=torch.float64), -We], 1)
    return We, off, M, torch.linalg.qr(M)[0]


def _position_residuals(base: torch.Tensor, off: torch.Tensor, Qm: torch.Tensor) -> torch.Tensor:
    """[n, positions] each token's relative residual at each position (step 3): the class token's
    up to a multiple of the ones vector, every other up to (mu, x)."""
    D = base.shape[1]
    one = torch.ones(D, dtype=torch.float64) / D ** 0.5
    scale = base.norm(dim=1)
    res = torch.empty(base.shape[0], off.shape[0], dtype=torch.float64)
    r0 = base - off[0]
    res[:, 0] = (r0 - (r0 @ one)[:, None] * one).norm(dim=1) / scale
    for p in range(1, off.shape[0]):
        r = base - off[p]
        res[:, p] = (r - (r @ Qm) @ Qm.T).norm(dim=1) / scale
    return res


def _assign_positions(res: torch.Tensor, T: int) -> torch.Tensor:
    """Design A: one position per token [n] by an optimal assignment on the residuals ``res``
    [n, T (+1 with E_unk)]: one class token, each patch position at most once, E_unk any number."""
    n = res.shape[0]
    cols = torch.arange(T)
    if res.shape[1] > T:  # E_unk (index T) as often as there are tokens
        cols = torch.cat([cols, torch.full((n,), T)])
    rows, picked = linear_sum_assignment(res[:, cols].numpy())
    pos = torch.empty(n, dtype=torch.long)
    pos[torch.as_tensor(rows, dtype=torch.long)] = cols[torch.as_tensor(picked, dtype=torch.long)]
    return pos


def outputs_from_roots(attn: nn.Module, C: torch.Tensor, nh: torch.Tensor) -> torch.Tensor:
    """Design A: step 2's attention outputs C [n, D] read again through the roots themselves.

    Without the residual around attention, block 0's norm2 input is h_t = W_proj c_t + b_proj, and
    a root (fc1 input) gives h_t up to its LayerNorm's scale and shift: h_t = sigma_t nh_t + mu_t 1
    (``nh`` = (u - beta) / gamma). So c_t lies on a plane of two unknowns, W_proj^-1 (sigma_t nh_t +
    mu_t 1 - b_proj); the point of that plane nearest step 2's c_t is a second reading of it that
    rests on the root alone. Measured on bundled photograph 3 (design A): 5.3e-7 off the true c
    (median, relative) against step 2's 7.4e-6; their disagreement (2.2e-7 in the attention solve's
    squared residual) is close to the truth's own residual against step 2's c (2.8e-7): the
    attacker's own measure of c's noise, which :func:`structured_tokens` is judged against."""
    Wp, bp = attn.proj.weight.to(torch.float64), attn.proj.bias.to(torch.float64)
    ones = torch.ones(Wp.shape[0], 1, dtype=torch.float64)
    a = torch.linalg.solve(Wp, nh.T).T  # [n, D]: W_proj^-1 nh_t
    o = torch.linalg.solve(Wp, ones)[:, 0]
    c0 = -torch.linalg.solve(Wp, bp[:, None])[:, 0]
    out = torch.empty_like(C)
    for t in range(C.shape[0]):
        plane = torch.stack([a[t], o], 1)
        out[t] = c0 + plane @ _lstsq(plane, (C[t] - c0)[:, None])[:, 0]
    return out


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


def structured_tokens(attn: nn.Module, C: torch.Tensor, Z: torch.Tensor, vit: nn.Module, basis: torch.Tensor,
                      rounds: int, iterations: int, polish_iterations: int = 10) -> StructuredTokens:
    """Design A: the embeddings from a wrong point of the attention solve, through the positions.

    Where step 2's error in c is large no start of :func:`attention_tokens` reaches the truth (bundled
    photograph 3: the roots' floor, amplified ~1e5 through step 2, leaves the truth's own squared
    residual at 2.8e-7 and both starts stop at 2.4e-6, 20 % off), but the point it stops at still
    places most tokens at their true position (61 of 65 there). So each round assigns a position to
    every token (:func:`_assign_positions` on step 3's residuals), solves c_r = Attention(Z)_r over the
    patches alone with each token held at its assigned position (Z = offset + x W_e^T: C p^2
    unknowns a token where the free solve has n; ``iterations`` of dense Levenberg-Marquardt) and
    polishes that freely in the qkv update's row space (``polish_iterations``), whose point the next
    round assigns again. It stops when an assignment repeats the one before (``stable``) or after
    ``rounds``. The held point is the answer: every token exactly at a position, its patch the
    solve's. Written here because no library solves a nonlinear least-squares problem over an
    assignment; the assignment itself is scipy's."""
    n, D = C.shape
    T = int(vit.pos_embed.shape[1])
    We, off_all, _, Qm = _token_offsets(vit)
    scale = C.abs().max()

    def free_residual(b: torch.Tensor) -> torch.Tensor:
        return ((_attention_output(attn, b @ basis.T) - C) / scale).flatten()

    def free_jacobian(b: torch.Tensor) -> torch.Tensor:
        return _attention_jacobian(attn, b @ basis.T, basis) / scale

    last: torch.Tensor | None = None
    held, value = Z, float("inf")
    for r in range(rounds):
        pos = _assign_positions(_position_residuals(Z, off_all, Qm), T)
        if last is not None and bool((pos == last).all()):
            return StructuredTokens(held, value, pos, r, True)
        off = off_all[pos]
        idx = (pos != 0).nonzero().flatten()  # the class token is fixed: cls + P_0

        def build(x: torch.Tensor) -> torch.Tensor:
            Zx = off.clone()
            Zx[idx] = off[idx] + x.reshape(len(idx), -1) @ We.T
            return Zx

        def residual(x: torch.Tensor) -> torch.Tensor:
            return ((_attention_output(attn, build(x)) - C) / scale).flatten()

        def jacobian(x: torch.Tensor) -> torch.Tensor:
            J = _attention_jacobian(attn, build(x), We) / scale  # moves along W_e: [n D, n C p^2]
            return J.reshape(n * D, n, -1)[:, idx].reshape(n * D, -1)

        x = _lstsq(We, (Z[idx] - off[idx]).T).T.flatten()  # each token's patch nearest where it stands
        x, value = _dense_lm(residual, jacobian, x, iterations, 1e-3, 0.0)
        moved = n if last is None else int((pos != last).sum())
        _logger.info("block0_roots: design A structured round %d: %d tokens (re)placed, c to %.1e",
                     r + 1, moved, value)
        held, last = build(x), pos
        if r + 1 < rounds:  # the polish only feeds the next round's assignment
            Z = _dense_lm(free_residual, free_jacobian, held @ basis, polish_iterations, 1e-9, 0.0)[0] @ basis.T
    final = last if last is not None else torch.zeros(n, dtype=torch.long)
    return StructuredTokens(held, value, final, rounds, False)


def batch_from_roots(vit: nn.Module, grads: Mapping[str, torch.Tensor], roots: torch.Tensor, batch: int,
                     attention_iterations: int = 40, attention_starts: int = 2,
                     generator: torch.Generator | None = None,
                     structured_rounds: int = STRUCTURED_ROUNDS) -> BatchFromRoots:
    """The batch, from all B T roots (fc1 inputs) of block 0's MLP and the update (module doc, steps 2-4).

    On design A (B = 1) the tokens' embeddings come from the attention solve
    (:func:`attention_tokens`, ``attention_iterations`` and ``attention_starts``, ``generator``)
    instead of the residual around attention. Where no start reaches :data:`ATTENTION_TOL`, up to
    ``structured_rounds`` rounds of :func:`structured_tokens` (0: none) start from the best one; their
    answer is kept when its assignment repeated and its residual in c is at most step 2's own noise
    in c (:func:`outputs_from_roots`) or :data:`ATTENTION_TOL`.

    Raises:
        AttackFailure: the attention solve fails (design A), a token fits no position, a position
            gets a wrong number of tokens, or the class tokens are not B.
    """
    blk = cast(nn.Module, vit.blocks[0])
    attn, mlp = cast(nn.Module, blk.attn), cast(nn.Module, blk.mlp)
    name = {id(p): n for n, p in vit.named_parameters()}
    g = lambda p: grads[name[id(p)]].to(torch.float64)  # noqa: E731
    U = roots.to(torch.float64)
    n, D = U.shape
    W1, b1, W2 = mlp.fc1.weight, mlp.fc1.bias, mlp.fc2.weight
    gamma, beta = blk.norm2.weight, blk.norm2.bias
    with torch.no_grad():
        pre = U @ W1.T + b1
    pre_r = pre.clone().requires_grad_(True)
    with torch.enable_grad():
        A = mlp.act(pre_r)
        dact = torch.autograd.grad(A.sum(), pre_r)[0]
    with torch.no_grad():
        A = A.detach()
        G2 = _lstsq(A.T, g(mlp.fc2.weight).T)  # [n, D]: each token's block-0 output gradient
        gu = ((G2 @ W2) * dact) @ W1  # dL/du per token
        nh = (U - beta) / gamma  # (h - mu) / sigma
        gn = gu * gamma
        w = gn - gn.mean(1, keepdim=True) - nh * (gn * nh).mean(1, keepdim=True)  # sigma * dL/dh via norm2
        s = _lstsq(w.T, (g(attn.proj.bias) - G2.sum(0))[:, None])[:, 0]  # 1 / sigma per token
        Dh = G2 + s[:, None] * w  # dL/dh per token
        C = _lstsq(Dh.T, g(attn.proj.weight))  # [n, D] attention outputs (proj inputs)
        attention_residual = attention_floor = None
        structured = 0
        design_a = is_design_a(blk)
        if design_a:  # no residual around attention: the embeddings from the attention solve
            if batch != 1:
                raise AttackFailure(f"design A: the attention solve reads one image's tokens, not {batch}")
            basis = torch.linalg.svd(g(attn.qkv.weight), full_matrices=False)[2][:n].T
            gen = generator if generator is not None else torch.Generator().manual_seed(0)
            base, attention_residual, _ = attention_tokens(attn, C, basis, attention_iterations,
                                                           attention_starts, gen, dC=Dh @ attn.proj.weight,
                                                           qkv_grad=g(attn.qkv.weight))
            if attention_residual > ATTENTION_TOL:
                if not structured_rounds:
                    raise AttackFailure(f"design A: the attention solve ended at a squared residual of "
                                        f"{attention_residual:.1e} after {attention_starts} starts of "
                                        f"{attention_iterations} iterations (raise attention_starts; where every "
                                        "start stops near the same residual, step 2's error in c is what stops "
                                        "it, not the starts: set structured_rounds, docs/attacks.md, "
                                        "`block0_roots`)")
                floor = float(((C - outputs_from_roots(attn, C, nh)) / C.abs().max()).pow(2).sum())
                st = structured_tokens(attn, C, base, vit, basis, structured_rounds, attention_iterations)
                if not st.stable:
                    raise AttackFailure(f"design A: the attention solve's starts ended at {attention_residual:.1e} "
                                        f"and the position-structured solve's assignment did not repeat in "
                                        f"{structured_rounds} rounds (raise structured_rounds)")
                if st.value > max(floor, ATTENTION_TOL):  # ATTENTION_TOL: where c's noise is rounding
                    raise AttackFailure(f"design A: the position-structured solve ended at a squared residual of "
                                        f"{st.value:.1e} in c, above {floor:.1e}, the disagreement of step 2's "
                                        "two readings of c (its noise): not the client's tokens")
                base, attention_residual, attention_floor, structured = st.Z, st.value, floor, st.rounds
        else:
            base = nh / s[:, None] - (C @ attn.proj.weight.T + attn.proj.bias)  # z - mu * 1
        # step 3: every token against every position, unknowns (mu, x)
        We, off, M, Qm = _token_offsets(vit)
        T = int(vit.pos_embed.shape[1])
        unk = getattr(vit, "unk_embed", None)
        res = _position_residuals(base, off, Qm)
        best, pos = res.min(1)
        runner_up = res.scatter(1, pos[:, None], float("inf")).min(1).values
        tol = DESIGN_A_POSITION_TOL if design_a else POSITION_TOL
        bad = (best > tol).nonzero().flatten()
        if bad.numel():
            raise AttackFailure(f"{bad.numel()} of the {n} roots fit no position (best relative residual "
                                f"{float(best.max()):.1e} > {tol:g}): not the client's tokens")
        counts = torch.bincount(pos, minlength=off.shape[0])[:T]
        # one token per image at every position, but where MJP's shuffle put E_unk instead
        ok = (counts == batch) if unk is None else (counts <= batch)
        ok[0] = counts[0] == batch  # the class tokens
        if not bool(ok.all()):
            p_bad = int((~ok).nonzero()[0])
            raise AttackFailure(f"position {p_bad} holds {int(counts[p_bad])} roots where a batch of {batch} has "
                                f"{batch}: roots missing or duplicated")
        Z = torch.empty(n, D, dtype=torch.float64)
        X = torch.zeros(n, We.shape[1], dtype=torch.float64)
        for i in range(n):
            p = int(pos[i])
            if p == 0:
                Z[i] = off[0]
            else:
                sol = _lstsq(M, (off[p] - base[i])[:, None])[:, 0]
                X[i], Z[i] = sol[1:], base[i] + sol[0]
        # step 4: which tokens share each class token's image
        heads = int(attn.num_heads)
        hd = D // heads
        qkv = attn.qkv(blk.norm1(Z)).reshape(n, 3, heads, hd)
        q, k, v = attn.q_norm(qkv[:, 0]), attn.k_norm(qkv[:, 1]), qkv[:, 2]
        cls_rows = (pos == 0).nonzero().flatten()
        m = torch.zeros(batch, n, dtype=torch.float64)
        for j, t in enumerate(cls_rows.tolist()):
            logits = torch.einsum("hd,shd->hs", q[t], k) * float(attn.scale)
            wgt = torch.exp(logits - logits.max(1, keepdim=True).values)
            E = (wgt[:, :, None] * (v.transpose(0, 1) - C[t].reshape(heads, hd)[:, None, :]))
            E = E.permute(0, 2, 1).reshape(heads * hd, n)
            others = (pos != 0).nonzero().flatten()  # the class tokens' own columns are all equal
            m[j, others] = _lstsq(E[:, others], -E[:, t:t + 1])[:, 0]
            m[j, t] = 1.0
        image = torch.empty(n, dtype=torch.long)
        image[cls_rows] = torch.arange(batch)
        margin = 0.5
        for p in range(1, T):  # at most one token of a position per image
            idx = (pos == p).nonzero().flatten()
            if idx.numel() == 0:
                continue
            score = m[:, idx]  # [image, token]
            rows, cols = linear_sum_assignment(-score.numpy())
            image[idx[cols]] = torch.as_tensor(rows, dtype=torch.long)
            margin = min(margin, float((score[rows, cols] - 0.5).abs().min()))
        free = torch.ones(batch, T - 1, dtype=torch.bool)  # patch positions no placed token holds
        placed = (pos >= 1) & (pos < T)
        free[image[placed], pos[placed] - 1] = False
        idx = (pos == T).nonzero().flatten()
        if idx.numel():  # E_unk tokens: as many to each image as it has free positions
            if idx.numel() != int(free.sum()):
                raise AttackFailure(f"{idx.numel()} roots carry E_unk where the placed tokens leave "
                                    f"{int(free.sum())} positions free: roots missing or duplicated")
            slots = torch.repeat_interleave(torch.arange(batch), free.sum(1))
            rows, cols = linear_sum_assignment(-m[slots][:, idx].numpy())
            image[idx[cols]] = slots[torch.as_tensor(rows, dtype=torch.long)]
            margin = min(margin, float((m[slots[rows], idx[cols]] - 0.5).abs().min()))
        elif bool(free.any()):
            raise AttackFailure("an image lacks tokens at some positions and no root carries E_unk")
        # assemble
        C_in = vit.patch_embed.proj.weight.shape[1]
        ps = int(vit.patch_embed.patch_size[0])
        gh, gw = (int(s_) for s_ in vit.patch_embed.grid_size)
        images = torch.zeros(batch, C_in, gh * ps, gw * ps, dtype=torch.float64)
        spots = [free[b].nonzero().flatten().tolist() for b in range(batch)]  # E_unk patches, in root order
        for i in range(n):
            p = int(pos[i])
            if p == T:
                p = 1 + spots[int(image[i])].pop(0)
            if p:
                r_, c_ = divmod(p - 1, gw)
                images[image[i], :, r_ * ps:(r_ + 1) * ps, c_ * ps:(c_ + 1) * ps] = X[i].reshape(C_in, ps, ps)
    return BatchFromRoots(images, pos, image, best, runner_up, margin, free, attention_residual, attention_floor,
                          structured)


@dataclass
class SpanPolish:
    """Outcome of :func:`span_polish`: the model input [1, C, H, W], the span residual before and after,
    and the Levenberg-Marquardt Jacobians taken."""

    image: torch.Tensor
    residual_before: float
    residual_after: float
    jacobians: int


def span_polish(vit: nn.Module, grads: Mapping[str, torch.Tensor], image: torch.Tensor, shuffled: torch.Tensor,
                jacobians: int) -> SpanPolish:
    """Design A, B = 1: x~ from a close estimate, to the precision the whole update holds.

    The structured solve's answer rests on c, whose noise (the roots' floor amplified through step
    2) keeps it 1e-3 off (44-55 dB); refining the roots on block 0's MLP update does not help
    (docs/attacks.md, `block0_roots`). Every layer's input span does: the span residual's Jacobian
    has full column rank at x~ and Levenberg-Marquardt on it converges from within ~0.05 RMS
    (:func:`attacks.optimization.span_fit.span_lm`, the final stage of ``mjp_adaptive``). The estimate ``image``
    (model input) is taken to the reduced coordinates of APRIL's qkv equations on the shuffled set
    ``shuffled`` [N] (the E_unk tokens'; the span residual does not see their order) and fitted there.
    Measured on bundled photograph 3, end to end: the structured answer (52.2 / 44.6 dB, unshuffled /
    shuffled set) to 146.3 / 112.9 dB."""
    from ..closed_form.mjp_update import read_mjp_update
    from ..optimization.span_fit import span_lm, span_problem, truth_coordinates

    g = {k: v.to(torch.float64) for k, v in grads.items()}
    if getattr(vit, "unk_embed", None) is not None:
        _, g, _ = read_mjp_update(vit, g)  # dL/dP without the DAL term (G_Z below)
        g = {k: g[k] for k in grads}
    prob = span_problem(vit, g, shuffled)
    red = prob.red
    b, a = truth_coordinates(red, image, prob.patch)  # any image's coordinates, the estimate's here
    with torch.no_grad():
        before = float(prob.residual.value(prob.image(b, a))[0])
    taken, after = 0, before
    if red.null_basis.shape[1]:  # else the qkv equations alone fix every patch: nothing left to fit
        b, a, out = span_lm(prob.residual, red, b, a, prob.grid, prob.channels, prob.patch, max_jacobians=jacobians)
        taken, after = out.jacobians, out.value
    with torch.no_grad():
        polished = prob.image(b, a)
    return SpanPolish(polished, before, after, taken)


def check_model(vit: nn.Module, grads: Mapping[str, torch.Tensor], batch: int) -> None:
    """Raise AttackFailure naming the first condition the model or update does not meet."""
    blocks = getattr(vit, "blocks", None)
    if blocks is None or len(blocks) == 0 or not hasattr(getattr(blocks[0], "attn", None), "proj"):
        raise AttackFailure("block0_roots needs a timm-style ViT (blocks[0].attn.proj, blocks[0].mlp)")
    blk = blocks[0]
    if is_design_a(blk):
        if batch != 1:
            raise AttackFailure(f"block0_roots reads APRIL's design-A block 0 at B = 1 only (its attention solve "
                                f"needs each token's image); got B = {batch}")
    elif not isinstance(getattr(blk, "norm1", None), nn.LayerNorm):
        raise AttackFailure("block0_roots needs a standard pre-norm block 0 (norm1 and the residual around "
                            "attention) or APRIL's design A")
    if not isinstance(getattr(blk, "norm2", None), nn.LayerNorm) or blk.norm2.weight is None:
        raise AttackFailure("block0_roots needs block 0's norm2 to be a LayerNorm with its affine weights")
    if int(getattr(vit, "num_prefix_tokens", 0)) != 1 or getattr(vit, "cls_token", None) is None \
            or getattr(vit, "pos_embed", None) is None:
        raise AttackFailure("block0_roots needs one class token and a learned position embedding "
                            "(the class tokens say which image each token belongs to)")
    D = int(vit.embed_dim)
    T = int(vit.pos_embed.shape[1])
    if batch * T > D:
        raise AttackFailure(f"block0_roots needs B T <= D: {batch} images x {T} tokens = {batch * T} > width {D} "
                            f"(the attention projection's update then no longer separates the tokens; "
                            f"B <= {D // T} on this model)")
    if is_design_a(blk) and T * T > DESIGN_A_MAX_UNKNOWNS:
        raise AttackFailure(f"block0_roots reads design A through a dense solve in T^2 = {T * T} unknowns "
                            f"({T} tokens); it takes at most {DESIGN_A_MAX_UNKNOWNS} (T <= "
                            f"{int(DESIGN_A_MAX_UNKNOWNS ** 0.5)}: its Jacobian grows as 3 T^4 doubles)")
    if blk.attn.qkv.bias is None or blk.mlp.fc1.bias is None or blk.attn.proj.bias is None:
        raise AttackFailure("block0_roots needs biases on block 0's qkv, proj and fc1 (dL/db_proj fixes the "
                            "LayerNorm scales)")


def _runs(modes: list[str]) -> str:
    """"steered x 8, missing x 3" for a list of round kinds."""
    return ", ".join(f"{m} x {len(list(g))}" for m, g in groupby(modes))


@register_attack("block0_roots")
class Block0Roots(Attack):
    """The batch read off block 0 of a standard pre-norm ViT (module doc).

    Args:
        starts: root-finding starts per round.
        rounds: rounds at most (stops when every token's root is found).
        iterations: Levenberg-Marquardt iterations per start.
        attention_iterations, attention_starts: design A (B = 1): the attention solve's
            Levenberg-Marquardt iterations per random start, and its starts.
        structured_rounds: design A: rounds of the position-structured solve where no start of the
            attention solve reaches the truth (0: fail instead; :func:`structured_tokens`).
        span_polish: design A: Levenberg-Marquardt Jacobians of the span polish of the structured
            solve's answer (0: off; :func:`span_polish`).
        seed: seed of the starts.
    """

    name = "block0_roots"

    class Options(AttackOptions):
        starts: Int = option(32, ge=1, le=4096)
        rounds: Int = option(40, ge=1, le=1000)
        iterations: Int = option(60, ge=1, le=10_000)
        attention_iterations: Int = option(40, ge=1, le=1000)
        attention_starts: Int = option(2, ge=1, le=64)
        structured_rounds: Int = option(STRUCTURED_ROUNDS, ge=0, le=50)
        span_polish: Int = option(SPAN_POLISH_JACOBIANS, ge=0, le=100)
        seed: Int = 0

    def __init__(self, **options: Any) -> None:
        o = self._parse_options(options)
        self.starts, self.rounds = o.starts, o.rounds
        self.iterations, self.seed = o.iterations, o.seed
        self.attention_iterations, self.attention_starts = o.attention_iterations, o.attention_starts
        self.structured_rounds = o.structured_rounds
        self.span_polish = o.span_polish

    def _reconstruct(self, model: nn.Module, update: Update, meta: AttackMetadata) -> AttackResult:
        t0, c0 = time.perf_counter(), time.process_time()
        B = meta.num_images
        if meta.update_type == "delta" and meta.local_steps > 1:
            raise AttackFailure(f"block0_roots reads one gradient; a FedAvg delta of {meta.local_steps} local "
                                "steps is not one (batch_match's unroll simulates them)")
        grads, notes = update_to_gradients(update, meta)
        vit = unwrap_vit(model)
        check_model(vit, grads, B)
        work = cast(nn.Module, copy.deepcopy(vit)).to("cpu", torch.float64).eval().requires_grad_(False)
        T = int(work.pos_embed.shape[1])
        spans = {sp.name: sp.basis for sp in input_spans(work, grads, B * T)}
        fc1, fc2 = "blocks.0.mlp.fc1", "blocks.0.mlp.fc2"
        if fc1 not in spans or fc2 not in spans or spans[fc1].shape[1] != B * T or spans[fc2].shape[1] != B * T:
            got = {k: spans[k].shape[1] if k in spans else 0 for k in (fc1, fc2)}
            raise AttackFailure(f"block 0's fc1/fc2 updates do not have rank B T = {B * T} (got {got}): "
                                "tokens coincide or the update is not one plain gradient")
        gen = torch.Generator().manual_seed(self.seed)
        search = find_roots(work.blocks[0], spans[fc1], spans[fc2], grads[fc1 + ".weight"].to(torch.float64),
                            grads[fc2 + ".weight"].to(torch.float64), B * T, self.starts, self.rounds,
                            self.iterations, gen)
        if search.roots.shape[0] != B * T:
            raise AttackFailure(f"found {search.roots.shape[0]} of the {B * T} roots of block 0's MLP after "
                                f"{len(search.per_round)} rounds of {self.starts} starts (new per round: "
                                f"{search.per_round}, the rounds {_runs(search.modes)}); the batch is read off "
                                "all of them (raise rounds or starts)")
        out = batch_from_roots(work, grads, search.roots, B, self.attention_iterations, self.attention_starts, gen,
                               self.structured_rounds)
        polish: SpanPolish | None = None
        polish_failed: str | None = None
        if out.attention_floor is not None and self.span_polish:  # design A, the structured solve's answer
            try:
                polish = span_polish(work, grads, out.images, out.shuffled[0], self.span_polish)
                out.images = polish.image
            except (AttackFailure, RuntimeError, ValueError) as e:  # keep the structured answer, say why
                polish_failed = str(e)
        y, label_stats = batch_labels(model, grads, meta, self.seed)
        notes.append(f"block 0's {B * T} MLP roots found in {search.starts} starts; positions, images and "
                     "patches solved linearly")
        images = meta.denormalize(out.images)
        unshuffled = None
        shuffled = int(out.shuffled.sum())
        if shuffled:  # MJP: the E_unk tokens' patches are exact, their places a jigsaw (setting c)
            ps = int(work.patch_embed.patch_size[0])
            unshuffled = torch.cat([unshuffle_image(images[b:b + 1], out.shuffled[b], ps)[0] for b in range(B)])
            notes.append(f"{shuffled} tokens carried E_unk: their patches are exact, their order in the "
                         "shuffled positions is the jigsaw solver's (the update does not fix it)")
        stats = dict(roots_per_round=search.per_round, root_round_modes=search.modes, root_starts=search.starts,
                     position_residual_max=float(out.position_residual.max()),
                     position_runner_up_min=float(out.runner_up.min()), membership_margin=out.membership_margin,
                     estimate_cpu_s=time.process_time() - c0, time_s=(time.perf_counter() - t0) / B,
                     attack=self.name, notes=notes, **label_stats)
        if out.attention_residual is not None:
            stats["attention_residual"] = out.attention_residual
            stats["structured_rounds"] = out.structured_rounds
        if out.attention_floor is not None:
            stats["attention_floor"] = out.attention_floor
            notes.append(f"design A: no start of the attention solve reached the truth; the position-structured "
                         f"solve placed every token in {out.structured_rounds} rounds, c to "
                         f"{out.attention_residual:.1e} against step 2's noise {out.attention_floor:.1e}")
        if polish_failed is not None:
            notes.append(f"design A: the span polish failed ({polish_failed}); the structured solve's answer is kept")
        if polish is not None:
            stats.update(span_residual_before=polish.residual_before, span_residual=polish.residual_after,
                         span_polish_jacobians=polish.jacobians)
            notes.append(f"design A: the structured answer polished on every layer's input span (Levenberg-Marquardt, "
                         f"{polish.jacobians} Jacobians): span residual {polish.residual_before:.1e} -> "
                         f"{polish.residual_after:.1e}")
        return AttackResult(images, [dict(stats, shuffled_positions=int(out.shuffled[b].sum())) for b in range(B)],
                            labels=y, unshuffled=unshuffled)
