"""The root search's tail past B T > D - 1: the missing tokens' fc1 inputs, read off fc1's update.

Once D roots are found past B T > D - 1, fc1's span is the whole input space and the missing-token
rounds of :mod:`attacks.structure.roots` have no equations left; random starts rarely fall into the
small basins of the last few tokens. The found roots and the two MLP updates still fix the span of
the m missing fc1 inputs (docs/design.md, "The search's tail past D"):

* fc2's update is dL/dW_fc2 = sum_t g_t a_t^T. Least squares on the found tokens' activations A_f
  [k, 4D] gives g^_t = g_t + sum_m kappa_tm g_m (each missing activation's part in span(A_f) is
  spread over the found tokens), so every error lies in Gamma = span{g_m}, the row space of the
  rank-m residual dL/dW_fc2^T - A_f^T G^.
* fc1's update is dL/dW_fc1 = sum_t d_t u_t^T with d_t = (W2^T g_t) * GELU'(W1 u_t + b1). With the
  found tokens' share taken at g^_t, what is left is

      R1 = sum_m d_m u_m^T  -  sum_{t, j} lambda_tj ((W2^T gamma_j) * s_t) u_t^T,

  rank m plus a term linear in k m unknowns lambda (gamma_j a basis of Gamma, s_t the found
  tokens' slopes). For the true lambda, R1 + L(lambda) has rank m and its row space is
  span{u_m}.

:func:`missing_span` alternates between the best rank-m fit of R1 + L(lambda) (a truncated SVD)
and lambda by least squares against it (one fixed normal matrix); each step lowers the misfit, and
on real updates it converges linearly to the missing tokens' span (tests/test_block0_completion.py:
test_the_tail_round_finds_the_last_roots_past_d). Starts in that m-dimensional span lie at or next
to the missing fc1 inputs, which the per-token problem then solves exactly. It needs every found
root to be a true token: a point that is none leaves R1 + L(lambda) of rank above m, and the
misfit then stays above :data:`TAIL_FLOOR`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch
import torch.nn as nn

#: at most this many missing tokens are read off fc1's update: its normal matrix is (m k)^2 doubles
#: (m = 8, k = 4D = 768: 300 MB), and the alternation slows with m (measured: m = 1 reaches
#: 1e-14 in 200 steps, m = 3 1e-7 in 300; tests/test_block0_completion.py:
#: test_the_tail_round_finds_the_last_roots_past_d)
TAIL_MAX = 8

#: alternation steps at most
TAIL_ITERATIONS = 400

#: the alternation stops where the misfit has not halved in this many steps: with m >= 2 one
#: missing token's part can stall while another's has converged; the round's starts then find the
#: converged ones and the next round reads the rest (tests/test_block0_completion.py:
#: test_the_tail_round_finds_the_last_roots_past_d)
TAIL_STALL = 25

#: the alternation stops once the (m+1)-th singular value of R1 + L(lambda) is below this share of
#: the first: the float64 floor of the updates (starts from a span this close converge at once)
TAIL_FLOOR = 1e-13


@dataclass
class MissingSpan:
    """Outcome of :func:`missing_span`: an orthonormal basis [D, m] of the missing tokens' fc1
    inputs, the (m+1)-th singular value of the fit relative to its first (the misfit) and the
    alternation steps taken."""

    basis: torch.Tensor
    misfit: float
    steps: int


def missing_span(block: nn.Module, found: torch.Tensor, fc1_grad: torch.Tensor, fc2_grad: torch.Tensor,
                 missing: int, iterations: int = TAIL_ITERATIONS, floor: float = TAIL_FLOOR) -> MissingSpan:
    """The span of the ``missing`` tokens' fc1 inputs (module doc) from the ``found`` roots [k, D]
    (every one a true token) and block 0's fc1/fc2 weight updates ([4D, D], [D, 4D]), float64."""
    if not 1 <= missing <= TAIL_MAX:
        raise ValueError(f"missing must be 1 to {TAIL_MAX}, got {missing}")
    mlp = cast(nn.Module, block.mlp)
    fc1, fc2, act = cast(nn.Linear, mlp.fc1), cast(nn.Linear, mlp.fc2), cast(nn.Module, mlp.act)
    W1, W2 = fc1.weight.detach().to(torch.float64), fc2.weight.detach().to(torch.float64)
    b1 = torch.zeros(W1.shape[0], dtype=torch.float64) if fc1.bias is None else fc1.bias.detach().to(torch.float64)
    U = found.to(torch.float64)
    ones = torch.ones(U.shape[0], W1.shape[0], dtype=torch.float64)
    pre = U @ W1.T + b1
    A, S = torch.func.jvp(act, (pre,), (ones,))[:2]  # activations and slopes, whatever the activation
    G1, G2 = fc1_grad.to(torch.float64), fc2_grad.to(torch.float64)
    Gh = torch.linalg.lstsq(A.T, G2.T).solution  # [k, D] g^_t
    gam = torch.linalg.svd(G2.T - A.T @ Gh, full_matrices=False)[2][:missing]  # [m, D]: Gamma
    R1 = G1 - ((Gh @ W2) * S).T @ U  # [4D, D]
    Wj = gam @ W2  # [m, 4D]: W2^T gamma_j
    k, m = U.shape[0], missing
    SS = [[(S * (Wj[j] * Wj[i])) @ S.T for i in range(m)] for j in range(m)]

    def lifted(lam: torch.Tensor) -> torch.Tensor:  # L(lambda) [4D, D]
        return sum(Wj[j][:, None] * (S.T @ (lam[j][:, None] * U)) for j in range(m))

    misfit, steps, Q = float("inf"), 0, None
    history: list[float] = []
    X = R1
    for steps in range(1, iterations + 1):
        _, s, Vh = torch.linalg.svd(X, full_matrices=False)
        Q = Vh[:m].T
        misfit = float(s[m] / s[0])
        history.append(misfit)
        if misfit < floor or (steps > TAIL_STALL and misfit > 0.5 * history[-TAIL_STALL - 1]):
            break  # converged, or stalled (a part of the span the found roots do not pin yet)
        # lambda minimising the part of R1 + L(lambda) off the current row space span(Q)
        Up = U - (U @ Q) @ Q.T  # u_t P_perp
        UU = Up @ U.T
        normal = torch.cat([torch.cat([SS[j][i] * UU for i in range(m)], 1) for j in range(m)], 0)
        XU = R1 @ Up.T  # [4D, k]
        rhs = torch.cat([-((Wj[j][:, None] * S.T) * XU).sum(0) for j in range(m)])
        lam = torch.linalg.lstsq(normal, rhs[:, None]).solution[:, 0].reshape(m, k)
        X = R1 + lifted(lam)
    assert Q is not None
    return MissingSpan(Q.contiguous(), misfit, steps)


def tail_starts(span: torch.Tensor, norms: torch.Tensor, starts: int, generator: torch.Generator) -> torch.Tensor:
    """``starts`` fc1 inputs [starts, D] in the missing tokens' ``span`` [D, m]: random directions
    there, both signs, at norms drawn from the found roots' ``norms`` (a LayerNorm output's norm
    varies little between tokens)."""
    a = torch.randn(starts, span.shape[1], generator=generator, dtype=torch.float64)
    u = a @ span.T
    pick = torch.randint(0, norms.numel(), (starts,), generator=generator)
    sign = torch.where(torch.arange(starts) % 2 == 0, 1.0, -1.0).to(torch.float64)
    return u / u.norm(dim=1, keepdim=True) * (norms[pick] * sign)[:, None]
