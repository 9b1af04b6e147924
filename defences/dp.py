"""DP-SGD pieces: the per-sample clipped noisy gradient (pure torch) and its privacy accounting
(Opacus' RDP accountant).

Per-sample gradients are computed by one backward pass per example (exact; the batches attacked
here hold 1-16 images). ``torch.func.vmap`` or Opacus' GradSampleModule would be faster, but need
every op of the model, MJP's per-sample E_unk masks included, to be supported, which is not checked
here; the loop is exact for any model.

Accounting: Opacus' analysis of the Poisson-subsampled Gaussian mechanism (Mironov, Talwar, Zhang
2019) at Opacus' default orders, composed over the steps and converted to (epsilon, delta) with
Opacus' conversion (Balle et al. 2020; tighter than the classical log(1/delta)/(alpha-1)).
q = batch size / partition size. The clients here draw batches by walking seeded permutations of
their partition (sampling without replacement), not Poisson sampling: the figure is the one Opacus
reports for shuffled batches too, and is stated as such.
"""
from __future__ import annotations

import math
import warnings
from typing import Callable, Optional, Sequence

import torch


def dp_sgd_epsilon(q: float, sigma: float, steps: int, delta: float,
                   orders: Optional[Sequence[float]] = None) -> float:
    """(epsilon, delta)-DP of ``steps`` DP-SGD steps with sampling rate ``q`` and noise multiplier
    ``sigma`` (Opacus' RDP accountant; ``orders`` None: Opacus' default RDP orders 1.1 ... 63).
    ``sigma`` = 0 gives inf, ``steps`` = 0 gives 0."""
    # imported here: Opacus takes ~1 s to import and adds a root logging handler, and the defence
    # specs (defences.spec, read by every config) need none of it
    from opacus.accountants import RDPAccountant
    from opacus.accountants.analysis import rdp as opacus_rdp

    orders = RDPAccountant.DEFAULT_ALPHAS if orders is None else orders
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"sampling rate q must be in [0, 1], got {q}")
    if steps < 0:
        raise ValueError(f"steps must be >= 0, got {steps}")
    if not 0.0 < delta < 1.0:
        raise ValueError(f"delta must be in (0, 1), got {delta}")
    if steps == 0 or q == 0.0:
        return 0.0
    if sigma <= 0.0:
        return math.inf
    rdp = opacus_rdp.compute_rdp(q=q, noise_multiplier=sigma, steps=steps, orders=list(orders))
    with warnings.catch_warnings():  # "optimal order is the smallest alpha": expected for weak noise
        warnings.simplefilter("ignore", UserWarning)
        eps, _ = opacus_rdp.get_privacy_spent(orders=list(orders), rdp=rdp, delta=delta)
    return float(eps)


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
