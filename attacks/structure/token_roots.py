"""Block 0's MLP tokens as roots of a small problem per token (DAGER's span check, continuous).

For a linear layer y = a W^T + c the weight gradient sum_t g_t a_t^T has the span of all its inputs
as row space (:func:`attacks.solvers.spans.input_spans`). In block 0's MLP the fc1 input of every token is
a LayerNorm output h = norm2(v), and its fc2 input is GELU(W1 h + b1); so each true token is a root
of

    r(v) = ( Q1^T h / ||h||,  Q2^T GELU(W1 h + b1) / ||GELU(W1 h + b1)|| ),   h = norm2(v),

with Q1, Q2 orthonormal bases of the complements of fc1's and fc2's input spans: 2D - r1 + 4D - r2
equations in D unknowns per token (r the spans' ranks, B T while B T <= D - 1: past that no true
token is a root, :func:`attacks.structure.block0_roots.max_tokens`). The problem does not couple
the tokens, so many starts run side by side (a batched Levenberg-Marquardt below, in fc1's span
where a root is isolated, with exact Gauss-Newton terms: :class:`MLPSpans`), and each converged
start is one token's fc1 input, without its position or its image.

Every start that converges lands on a true token (tests/test_batch_attacks.py:
test_batched_roots_of_the_per_token_mlp_problem_are_true_tokens); the starts' basins differ in size,
which :func:`attacks.structure.roots.find_roots` steers around. What is left to an attacker is where
each root sits (its position), which no part of this problem says.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch
from torch import nn

from ..solvers.lm import ROOTS, batched_lm
from ..solvers.spans import complement


@dataclass
class TokenRoots:
    """Outcome of :func:`mlp_token_roots`.

    Attributes:
        roots: [n, D] distinct fc1 inputs (norm2 outputs) whose residual is below the tolerance.
        residuals: [n] their squared residuals ||r||^2.
        converged: starts (of all) that reached the tolerance, duplicates included.
        starts: starts run.
    """

    roots: torch.Tensor
    residuals: torch.Tensor
    converged: int
    starts: int


def span_part(y: torch.Tensor, Y: torch.Tensor, S: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One part of a span residual with its Gauss-Newton terms, for K points at once.

    The residual is r = P y / ||y|| (P projects off span(S), S [N, k] orthonormal) for vectors y [K, N]
    whose Jacobians in the unknowns are Y [K, N, p]. Returns r [K, N], J^T J [K, p, p] and J^T r
    [K, p]. With Y~ = Y - r (y^T Y) / ||y|| the Jacobian is J = P Y~ / ||y||, so
    J^T J = (Y~^T Y~ - (S^T Y~)^T (S^T Y~)) / ||y||^2: two products with N p^2 terms each instead of
    the (N - k) N p of forming P Y~, and no forward-mode Jacobian."""
    n = y.norm(dim=-1, keepdim=True)
    r = (y - (y @ S) @ S.T) / n
    Yt = Y - r[:, :, None] * ((y / n)[:, None, :] @ Y)
    P = S.T @ Yt
    G = (Yt.mT @ Yt - P.mT @ P) / n[:, :, None] ** 2
    return r, G, (Yt.mT @ r[..., None])[..., 0] / n


def span_value(y: torch.Tensor, S: torch.Tensor) -> torch.Tensor:
    """||P y||^2 / ||y||^2 per row of y [K, N] (P projects off span(S)), as :func:`span_part`'s r."""
    return (y - (y @ S) @ S.T).pow(2).sum(-1) / y.pow(2).sum(-1)


class MLPSpans:
    """Block 0's per-token MLP problem (module doc) in fc1's span: u = S1 alpha, alpha in R^{r1}.

    A root there is isolated (the LayerNorm's scale is no longer a free direction) and its residual
    is the fc2 part alone, Q2^T GELU(W1 S1 alpha + b1) / ||GELU(...)||: r1 unknowns against 4D - r2
    equations, solved with exact Gauss-Newton terms (:func:`span_part`). ``tokens``/``parts`` give
    the residual at LayerNorm inputs v, for starts made there."""

    def __init__(self, block: nn.Module, fc1_basis: torch.Tensor, fc2_basis: torch.Tensor) -> None:
        mlp = cast(nn.Module, block.mlp)
        self.norm = cast(nn.LayerNorm, block.norm2)
        fc1 = cast(nn.Linear, mlp.fc1)
        self.fc1, self.act = fc1, cast(nn.Module, mlp.act)
        self.W2 = cast(nn.Module, mlp.fc2).weight.to(torch.float64)
        self.S1, self.S2 = fc1_basis, fc2_basis
        self.Q1, self.Q2 = complement(fc1_basis), complement(fc2_basis)
        self.M = fc1.weight.to(torch.float64) @ fc1_basis  # fc1 on fc1's span: [4D, r1]
        self.b1 = fc1.bias.to(torch.float64) if fc1.bias is not None else torch.zeros(self.M.shape[0], dtype=torch.float64)

    def tokens(self, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """fc1 inputs u and activations a at LayerNorm inputs v, any leading shape."""
        u = self.norm(v)
        return u, self.act(self.fc1(u))

    def parts(self, u: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual's two parts (relative) at fc1 inputs u with activations a."""
        return (u @ self.Q1) / u.norm(dim=-1, keepdim=True), (a @ self.Q2) / a.norm(dim=-1, keepdim=True)

    def coordinates(self, v: torch.Tensor) -> torch.Tensor:
        """Starts at LayerNorm inputs v [K, D] as coordinates alpha in fc1's span."""
        return self.norm(v) @ self.S1

    def slopes(self, pre: torch.Tensor, order: int = 1) -> list[torch.Tensor]:
        """The activation's derivatives (first, and second where ``order`` is 2) at ``pre``, elementwise
        by forward mode: whatever activation the block has."""
        ones = torch.ones_like(pre)
        first = lambda p: torch.func.jvp(self.act, (p,), (ones,))[1]  # noqa: E731
        if order == 1:
            return [first(pre)]
        return list(torch.func.jvp(first, (pre,), (ones,)))

    def value(self, alpha: torch.Tensor) -> torch.Tensor:
        return span_value(self.act(alpha @ self.M.T + self.b1), self.S2)

    def system(self, alpha: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        pre = alpha @ self.M.T + self.b1
        (s,) = self.slopes(pre)
        r, G, g = span_part(self.act(pre), s[:, :, None] * self.M, self.S2)
        return r.pow(2).sum(-1), G, g

    def solve(self, alpha: torch.Tensor, iterations: int, settled: float = 1e-26) -> tuple[torch.Tensor, torch.Tensor]:
        """Levenberg-Marquardt from every row of alpha [K, r1] (:func:`attacks.solvers.lm.batched_lm`,
        the ROOTS schedule): (alpha, squared residual); a row at or below ``settled`` stops (the float64
        rounding floor a true token sits at; 0: every row takes all ``iterations``, a polish)."""
        return batched_lm(self.system, self.value, alpha, iterations, ROOTS, settled)


def mlp_token_roots(block: nn.Module, fc1_basis: torch.Tensor, fc2_basis: torch.Tensor, starts: torch.Tensor,
                    iterations: int = 30, chunk: int = 64, tol: float = 1e-16,
                    distinct_cos: float = 0.99999) -> TokenRoots:
    """The fc1 inputs of a block's tokens, found as roots of the per-token span problem (module doc).

    Args:
        block: a timm ViT block (``norm2``, ``mlp.fc1``, ``mlp.act``), float64.
        fc1_basis, fc2_basis: [D, r1], [4D, r2] orthonormal bases of the input spans of ``mlp.fc1``
            and ``mlp.fc2`` (:func:`attacks.solvers.spans.input_spans`).
        starts: [K, D] starting points of the LayerNorm's input v (any scale: h = norm2(v)).
        iterations: Levenberg-Marquardt iterations per start.
        chunk: starts solved together (memory ~ chunk x 4D x r1).
        tol: a start converged where ||r||^2 < tol (a true token's sits at float64 rounding, below it).
        distinct_cos: two roots are one token where their cosine exceeds this.
    """
    if starts.dim() != 2 or starts.shape[1] != fc1_basis.shape[0]:
        raise ValueError(f"starts must be [K, {fc1_basis.shape[0]}], got {list(starts.shape)}")
    problem = MLPSpans(block, fc1_basis, fc2_basis)
    found, values = [], []
    with torch.no_grad():
        for i in range(0, starts.shape[0], chunk):
            alpha, value = problem.solve(problem.coordinates(starts[i:i + chunk].to(fc1_basis)), iterations)
            found.append(alpha)
            values.append(value)
    alpha, value = torch.cat(found), torch.cat(values)
    ok = value < tol
    h = alpha[ok] @ fc1_basis.T
    value = value[ok]
    order = torch.argsort(value)
    unit = h / h.norm(dim=-1, keepdim=True)
    keep: list[int] = []
    for i in order.tolist():  # greedy: the lowest residual of each cluster stands for it
        if not keep or float((unit[keep] @ unit[i]).max()) < distinct_cos:
            keep.append(i)
    idx = torch.tensor(keep, dtype=torch.long)
    return TokenRoots(h[idx], value[idx], int(ok.sum()), int(starts.shape[0]))
