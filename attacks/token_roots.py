"""Block 0's MLP tokens as roots of a small problem per token (DAGER's span check, continuous).

For a linear layer y = a W^T + c the weight gradient sum_t g_t a_t^T has the span of all its inputs
as row space (:func:`attacks.spans.input_spans`). In block 0's MLP the fc1 input of every token is
a LayerNorm output h = norm2(v), and its fc2 input is GELU(W1 h + b1); so each true token is a root
of

    r(v) = ( Q1^T h / ||h||,  Q2^T GELU(W1 h + b1) / ||GELU(W1 h + b1)|| ),   h = norm2(v),

with Q1, Q2 orthonormal bases of the complements of fc1's and fc2's input spans: 2D - r1 + 4D - r2
equations in D unknowns per token (r the spans' ranks, B T while B T <= D). The problem does not
couple the tokens, so many starts run side by side (a batched Levenberg-Marquardt below), and each
converged start is one token's fc1 input, without its position or its image.

Measured (docs/attacks.md, "Block 0's MLP tokens as roots"): on the shipped CIFAR DeiT+MJP checkpoint
at B = 1 every start that converges lands on a true token (no spurious roots); the starts' basins
differ in size, so a few hundred starts find about half of the 65 tokens. What is left to an
attacker is where each root sits (its position), which no part of this problem says.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, cast

import torch
from torch import nn
from torch.func import jacfwd, vmap

from .spans import complement


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


def _batched_lm(fun: Callable[[torch.Tensor], torch.Tensor], v: torch.Tensor, iterations: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Levenberg-Marquardt on every row of v [K, D] at once (one damping per row), minimising
    ||fun(v_k)||^2; exact Jacobians by forward mode (D columns, fewer than the residual's rows).

    Written here rather than with scipy.optimize.least_squares: the K problems are independent and
    small, and one vmapped Jacobian for all of them costs about what one problem's would in a loop."""
    jac, res = vmap(jacfwd(fun)), vmap(fun)
    with torch.no_grad():
        value = res(v).pow(2).sum(-1)
    mu = torch.full_like(value, 1e-3)
    eye = torch.eye(v.shape[1], dtype=v.dtype, device=v.device)
    for _ in range(iterations):
        with torch.no_grad():
            J, r = jac(v), res(v)
            G = J.transpose(1, 2) @ J
            g = (J.transpose(1, 2) @ r[..., None])[..., 0]
            scale = G.diagonal(dim1=1, dim2=2).amax(-1).clamp_min(1e-300)
            step = -torch.linalg.solve(G + (mu * scale)[:, None, None] * eye, g)
            trial = res(v + step).pow(2).sum(-1)
            better = torch.isfinite(trial) & (trial < value)
            v = torch.where(better[:, None], v + step, v)
            value = torch.where(better, trial, value)
            mu = torch.where(better, mu / 3, mu * 4).clamp(1e-15, 1e8)
    return v, value


def mlp_token_roots(block: nn.Module, fc1_basis: torch.Tensor, fc2_basis: torch.Tensor, starts: torch.Tensor,
                    iterations: int = 30, chunk: int = 64, tol: float = 1e-16,
                    distinct_cos: float = 0.99999) -> TokenRoots:
    """The fc1 inputs of a block's tokens, found as roots of the per-token span problem (module doc).

    Args:
        block: a timm ViT block (``norm2``, ``mlp.fc1``, ``mlp.act``), float64.
        fc1_basis, fc2_basis: [D, r1], [4D, r2] orthonormal bases of the input spans of ``mlp.fc1``
            and ``mlp.fc2`` (:func:`attacks.spans.input_spans`).
        starts: [K, D] starting points of the LayerNorm's input v (any scale: h = norm2(v)).
        iterations: Levenberg-Marquardt iterations per start.
        chunk: starts solved together (memory ~ chunk x D x residual length).
        tol: a start converged where ||r||^2 < tol (the true tokens sit at ~1e-21 in float64).
        distinct_cos: two roots are one token where their cosine exceeds this.
    """
    if starts.dim() != 2 or starts.shape[1] != fc1_basis.shape[0]:
        raise ValueError(f"starts must be [K, {fc1_basis.shape[0]}], got {list(starts.shape)}")
    Q1, Q2 = complement(fc1_basis), complement(fc2_basis)
    mlp = cast(nn.Module, block.mlp)
    norm, fc1, act = cast(nn.Module, block.norm2), cast(nn.Module, mlp.fc1), cast(nn.Module, mlp.act)

    def residual(v: torch.Tensor) -> torch.Tensor:
        h = norm(v)
        a = act(fc1(h))
        return torch.cat([(h @ Q1) / h.norm(), (a @ Q2) / a.norm()])

    found, values = [], []
    for i in range(0, starts.shape[0], chunk):
        v, value = _batched_lm(residual, starts[i:i + chunk].to(Q1), iterations)
        found.append(v)
        values.append(value)
    v, value = torch.cat(found), torch.cat(values)
    ok = value < tol
    with torch.no_grad():
        h = norm(v[ok])
    value = value[ok]
    order = torch.argsort(value)
    unit = h / h.norm(dim=-1, keepdim=True)
    keep: list[int] = []
    for i in order.tolist():  # greedy: the lowest residual of each cluster stands for it
        if not keep or float((unit[keep] @ unit[i]).max()) < distinct_cos:
            keep.append(i)
    idx = torch.tensor(keep, dtype=torch.long)
    return TokenRoots(h[idx], value[idx], int(ok.sum()), int(starts.shape[0]))
