"""DP-SGD pieces in pure torch: the per-sample clipped noisy gradient and an RDP accountant.

Per-sample gradients are computed by one backward pass per example (exact; the batches attacked
here hold 1-16 images). ``torch.func.vmap`` would be faster but needs every op of the model,
MJP's per-sample E_unk masks included, to be vmap-safe, which is not checked here; Opacus 1.6.0 is
on the package index but not installed in this environment.

Accountant: Renyi DP of the Poisson-subsampled Gaussian mechanism at integer orders (Mironov,
Talwar, Zhang 2019, "Renyi Differential Privacy of the Sampled Gaussian Mechanism", Sec. 3.3):

    A_a = sum_{k=0}^{a} C(a, k) (1 - q)^(a - k) q^k exp((k^2 - k) / (2 sigma^2)),
    RDP(a) = log(A_a) / (a - 1)  per step,  T steps compose additively,
    epsilon(delta) = min_a  T * RDP(a) + log(1 / delta) / (a - 1).

q = batch size / partition size. The clients here draw batches by walking seeded permutations of
their partition (sampling without replacement), not Poisson sampling: the figure is the one
libraries such as Opacus report for shuffled batches too, and is stated as such.
"""
from __future__ import annotations

import math
from typing import Callable, Sequence

import torch

ORDERS: tuple[int, ...] = tuple(range(2, 65)) + (80, 96, 128, 192, 256)


def _log_binom(n: int, k: int) -> float:
    return math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)


def rdp_subsampled_gaussian(q: float, sigma: float, order: int) -> float:
    """RDP of one step of the sampled Gaussian mechanism at integer ``order`` >= 2 (noise
    multiplier ``sigma``, sampling rate ``q``). ``sigma`` = 0 gives inf."""
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"sampling rate q must be in [0, 1], got {q}")
    if order < 2:
        raise ValueError(f"RDP order must be an integer >= 2, got {order}")
    if q == 0.0:
        return 0.0
    if sigma <= 0.0:
        return math.inf
    if q == 1.0:
        return order / (2 * sigma ** 2)
    terms = [_log_binom(order, k) + (order - k) * math.log1p(-q) + k * math.log(q)
             + (k * k - k) / (2 * sigma ** 2) for k in range(order + 1)]
    top = max(terms)
    return (top + math.log(sum(math.exp(t - top) for t in terms))) / (order - 1)


def dp_sgd_epsilon(q: float, sigma: float, steps: int, delta: float,
                   orders: Sequence[int] = ORDERS) -> float:
    """(epsilon, delta)-DP of ``steps`` DP-SGD steps by RDP composition and conversion."""
    if steps < 0:
        raise ValueError(f"steps must be >= 0, got {steps}")
    if not 0.0 < delta < 1.0:
        raise ValueError(f"delta must be in (0, 1), got {delta}")
    if steps == 0:
        return 0.0
    return min(steps * rdp_subsampled_gaussian(q, sigma, a) + math.log(1 / delta) / (a - 1) for a in orders)


def private_gradient(per_sample_loss: Callable[[int], torch.Tensor], params: Sequence[torch.nn.Parameter],
                     batch_size: int, clip: float, sigma: float, generator: torch.Generator
                     ) -> tuple[list[torch.Tensor], float]:
    """The DP-SGD gradient of one batch: (sum_i clip(g_i) + N(0, (sigma clip)^2 I)) / B.

    Args:
        per_sample_loss: i -> scalar loss of example i alone (a graph over ``params``).
        params: the trainable parameters, in a fixed order.
        batch_size: B, the number of examples.
        clip: per-example L2 bound (over all parameters together).
        sigma: noise multiplier.
        generator: CPU generator of the noise.
    Returns:
        (gradients in the order of ``params``, mean per-example loss).
    """
    if clip <= 0 or sigma < 0 or batch_size < 1:
        raise ValueError(f"need clip > 0, sigma >= 0, batch_size >= 1; got {clip}, {sigma}, {batch_size}")
    total = [torch.zeros_like(p, dtype=torch.float64) for p in params]
    losses = []
    for i in range(batch_size):
        loss = per_sample_loss(i)
        grads = torch.autograd.grad(loss, list(params), allow_unused=True)
        grads = [torch.zeros_like(p) if g is None else g for g, p in zip(grads, params)]
        norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads))
        factor = min(1.0, clip / norm) if norm > 0 else 1.0
        for t, g in zip(total, grads):
            t += g.double() * factor
        losses.append(float(loss.detach()))
    out = []
    for t, p in zip(total, params):
        noise = torch.randn(t.shape, generator=generator, dtype=torch.float64) * (sigma * clip)
        out.append(((t.cpu() + noise) / batch_size).to(dtype=p.dtype, device=p.device))
    return out, sum(losses) / len(losses)
