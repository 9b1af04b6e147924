"""Transforms of a finished client update (FedSGD gradients or FedAvg delta), pure torch.

An update is a mapping parameter name -> tensor. Every transform returns a new dict (the input is
never modified) with the same names, shapes and dtypes. Randomness comes only from the
``generator`` passed in, so a client's defended update is reproducible from its seed.

Why not Flower's ``LocalDpMod``: it reads the reply through the legacy FitIns/FitRes compatibility
layer (``recorddict_to_fitres``) and clips ``reply - sent weights``, i.e. it expects the reply to be
the full model weights. The ClientApp here replies an ArrayRecord "arrays" holding FedSGD gradients
or a FedAvg weight delta, so the mod would clip ``gradient - weights`` (meaningless) and its noise is
set by (epsilon, delta, sensitivity) of the one-shot Gaussian mechanism. The arithmetic below is
the same (L2 clip over the whole update, then i.i.d. noise), applied to the update itself.
"""
from __future__ import annotations

import math
from typing import Any, Mapping, Optional

import torch

from .spec import LocalDp, Prune, Quantize, plugin_defence, validate_defence

Update = Mapping[str, torch.Tensor]


def update_norm(update: Update) -> float:
    """L2 norm of the whole update (all tensors flattened together), in float64."""
    return math.sqrt(sum(float(t.double().pow(2).sum()) for t in update.values()))


def cosine_similarity(a: Update, b: Update) -> float:
    """Cosine similarity of two updates over the names of ``a`` (flattened together); 0.0 when
    either is all zeros. Names missing from ``b`` raise KeyError."""
    dot = sum(float((a[k].double() * b[k].double()).sum()) for k in a)
    na, nb = update_norm(a), update_norm({k: b[k] for k in a})
    return 0.0 if na == 0.0 or nb == 0.0 else dot / (na * nb)


def clip_update(update: Update, clip: float) -> dict[str, torch.Tensor]:
    """Scale the whole update by min(1, clip / ||u||_2) (one factor for all tensors)."""
    if clip <= 0:
        raise ValueError(f"clip must be > 0, got {clip}")
    norm = update_norm(update)
    factor = min(1.0, clip / norm) if norm > 0 else 1.0
    return {k: (v.double() * factor).to(v.dtype) for k, v in update.items()}


def add_noise(update: Update, std: float, generator: torch.Generator, noise: str = "gaussian"
              ) -> dict[str, torch.Tensor]:
    """Add i.i.d. noise to every entry: Gaussian of standard deviation ``std``, or Laplace of scale
    ``std`` (its standard deviation is sqrt(2) * std). Noise is drawn in float64 on the CPU."""
    if std < 0:
        raise ValueError(f"noise std must be >= 0, got {std}")
    if noise not in ("gaussian", "laplace"):
        raise ValueError(f"noise must be gaussian or laplace, got {noise!r}")
    out = {}
    for k, v in update.items():
        if std == 0:
            out[k] = v.clone()
            continue
        if noise == "gaussian":
            n = torch.randn(v.shape, generator=generator, dtype=torch.float64) * std
        else:  # Laplace by inversion: -b sign(u) log(1 - 2|u|), u ~ U(-1/2, 1/2)
            u = torch.rand(v.shape, generator=generator, dtype=torch.float64) - 0.5
            n = -std * torch.sign(u) * torch.log1p(-2 * u.abs())
        out[k] = (v.double().cpu() + n).to(dtype=v.dtype, device=v.device)
    return out


def local_dp(update: Update, clip: float, sigma: float, generator: torch.Generator,
             noise: str = "gaussian") -> dict[str, torch.Tensor]:
    """Clip the whole update to L2 norm ``clip``, then add noise of scale ``sigma * clip``."""
    return add_noise(clip_update(update, clip), sigma * clip, generator, noise)


def prune_update(update: Update, keep: float) -> dict[str, torch.Tensor]:
    """Top-k magnitude sparsification over the whole update: keep ceil(keep * n) entries of largest
    absolute value (ties broken by ``torch.topk``), zero the others."""
    if not 0.0 < keep <= 1.0:
        raise ValueError(f"keep must be in (0, 1], got {keep}")
    flat = torch.cat([v.detach().reshape(-1).double().cpu().abs() for v in update.values()])
    k = max(1, math.ceil(keep * flat.numel()))
    mask = torch.zeros(flat.numel(), dtype=torch.bool)
    mask[torch.topk(flat, k, sorted=False).indices] = True
    out, start = {}, 0
    for name, v in update.items():
        m = mask[start:start + v.numel()].view(v.shape).to(v.device)
        out[name] = torch.where(m, v, torch.zeros_like(v))
        start += v.numel()
    return out


def quantizer_step(m: float, bits: int) -> float:
    """The spacing of :func:`quantize_tensor`'s 2^bits levels on [-m, m] (bits > 1), m = max|t|:
    2 m / (2^bits - 1). The levels hold no 0: a zero entry lands half a step away."""
    return 2 * m / (2 ** bits - 1)


def quantize_tensor(t: torch.Tensor, bits: int, stochastic: bool = False,
                    generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """One tensor on at most 2^bits levels.

    bits = 1: sign(t) * mean|t| (zeros stay zero: signSGD with its scale kept).
    bits > 1: 2^bits evenly spaced levels on [-m, m], m = max|t|; nearest level, or stochastic
    rounding to one of the two neighbouring levels with probabilities that make it unbiased.
    """
    if bits < 1:
        raise ValueError(f"bits must be >= 1, got {bits}")
    x = t.double().cpu()
    if bits == 1:
        return (torch.sign(x) * x.abs().mean()).to(dtype=t.dtype, device=t.device)
    m = float(x.abs().max())
    if m == 0.0:
        return t.clone()
    steps = 2 ** bits - 1
    pos = (x + m) / (2 * m) * steps  # in [0, steps]
    if stochastic:
        low = pos.floor()
        u = torch.rand(pos.shape, generator=generator, dtype=torch.float64)
        idx = low + (u < (pos - low)).double()
    else:
        idx = pos.round()
    return (idx.clamp(0, steps) / steps * 2 * m - m).to(dtype=t.dtype, device=t.device)


def quantize_update(update: Update, bits: int, stochastic: bool = False,
                    generator: Optional[torch.Generator] = None) -> dict[str, torch.Tensor]:
    """:func:`quantize_tensor` on every tensor (levels per tensor)."""
    return {k: quantize_tensor(v, bits, stochastic, generator) for k, v in update.items()}


def apply_update_defence(update: Update, spec: Any, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Apply a defence spec's update transform (local_dp, prune, quantize, or a plug-in's); any
    other defence returns an unchanged copy (it acts in local training or on the server)."""
    spec = validate_defence(spec)
    plugin = plugin_defence(spec.name)  # a plug-in (docs/plugins.md) transforms the update itself
    if plugin is not None:
        return plugin.apply(update, spec.as_dict(), generator)
    if isinstance(spec, LocalDp):
        return local_dp(update, spec.clip, spec.sigma, generator, spec.noise)
    if isinstance(spec, Prune):
        return prune_update(update, spec.keep)
    if isinstance(spec, Quantize):
        return quantize_update(update, spec.bits, spec.stochastic, generator)
    return {k: v.clone() for k, v in update.items()}
