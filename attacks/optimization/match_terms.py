"""The data terms of gradient matching: what a candidate's gradients are matched to, and how.

:class:`MatchTerms` holds K groups' target updates (parameters laid end to end in buckets) and
computes the data term per group: the plain cosine term, or the likelihood of the clients' defence
where the attacker knows it (pruned support, quantiser bins, local-DP / DP-SGD noise).
:func:`defence_match` reads that observation model from the metadata and builds the terms;
:func:`total_variation` is the image prior the optimisation attacks add beside them
(:mod:`attacks.optimization.matching`). Nothing here runs a model: the gradients come from the caller.
"""
from __future__ import annotations

import copy
import functools
from typing import Any, Optional, Sequence

import torch
import torch.nn.functional as F

from defences.spec import NoDefence
from defences.transforms import quantizer_step

from ..api.base import AttackMetadata

#: Elements per bucket of :class:`MatchTerms` on the CPU (1 MiB of float32); one bucket on a GPU.
MATCH_BUCKET_CPU = 1 << 18


def _sumsq(parts: list[torch.Tensor]) -> torch.Tensor:
    """[K]: the squared norm of each group's row over all buckets."""
    return sum(t.pow(2).sum(1) for t in parts)


def total_variation(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """breaching's anisotropic TV (inner/outer exponent 1) per group: x [K, n, C, H, W] -> [K]."""
    K, n, C, H, W = x.shape
    diffs = F.conv2d(x.reshape(K * n, C, H, W), weight, padding=1, groups=C)
    tv = (diffs.abs() + 1e-8).reshape(K, n, C, 2, H, W).sum(dim=3)
    return tv.flatten(1).mean(dim=1)


@functools.lru_cache(maxsize=16)
def tv_kernel(channels: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Forward differences along W and H (zero padding), as breaching's TotalVariation: [2C, 1, 3, 3].
    Made once per (channels, dtype, device): a step replayed from a CUDA graph cannot copy a new
    kernel from the host, and the callers never write to it."""
    k = torch.tensor([[0, 0, 0], [0, -1, 1], [0, 0, 0]], dtype=dtype, device=device)[None, None]
    return torch.cat([k.transpose(2, 3), k] * channels, dim=0)


class MatchTerms:
    """What the candidates' gradients are matched to: the updates [K, ...] by parameter name and,
    where the attacker knows the clients' defence (``AttackMetadata.defence``), its likelihood.

    ``data(g)`` [K] is the data term of the objective (restarts and starts are scored by it):

    - ``cosine``: 1 - cos(g, u), the whole update (Inverting Gradients);
    - ``support`` (top-k pruning): 1 - cos(g * m, u) with m the kept (nonzero) entries of u: the
      pruned update equals the client's gradient there and says nothing else about it;
    - ``bins`` (deterministic or stochastic quantisation): every entry of the client's gradient lies
      in the bin [lo, hi] of its level (half a level step either side, a whole step for stochastic
      rounding, |g| <= the tensor's largest level; 1 bit: the sign's half-line), a uniform
      likelihood; 1 - cos(g, P(g)) with P the projection onto those bins is zero exactly on the
      gradients the quantiser maps to the update and grows with the distance outside them (it is
      the cosine term where the bins shrink to points);
    - ``gaussian`` / ``laplace`` (local DP, DP-SGD): u = clip_C(g) + noise of scale s (C the clip,
      s = sigma C, divided by the batch size for DP-SGD): 1 - cos(g, u) plus the noise's negative
      log-likelihood per entry, ||u - clip_C(g)||^2 / (s^2 n) - 1 (Laplace: |u - clip_C(g)|_1 /
      (s n) - 1), zero in expectation at the client's gradient; its weight against the cosine term,
      1 / (s^2 n), is large where the noise is small and vanishes where the noise swamps the update.

    ``cosine(g)`` is always the plain cosine term: 1 - cos < ``exact_cos`` means the start's gradient
    equals the update (nothing to refine), which a defended update never shows.

    Built by :func:`defence_match` from the metadata (or directly: ``MatchTerms(targets)`` is the
    plain cosine term); ``select(idx)`` gives the terms of a subset of the groups (the active set).
    """

    def __init__(self, targets: dict[str, torch.Tensor], kind: str = "cosine",
                 bounds: Optional[tuple[dict, dict]] = None, support: Optional[dict] = None,
                 noise: Optional[torch.Tensor] = None, clip: Optional[torch.Tensor] = None) -> None:
        self.targets, self.kind = targets, kind
        self.noise, self.clip = noise, clip
        # The terms are computed on buckets of parameters laid end to end ([K, P_i] each), not per
        # parameter tensor: a DeiT-S has ~150, and on a GPU a batch-1 step costs kernel launches,
        # not arithmetic, so there one bucket holds them all. On the CPU a bucket stays near the
        # cache's size: a pass over one 88 MB vector per term streams from memory and was 2.7x
        # slower per step than cache-sized pieces (DeiT-S at 32 px, 2 cores).
        first = next(iter(targets.values()))
        limit = None if first.device.type == "cuda" else MATCH_BUCKET_CPU
        self.buckets: list[list[str]] = [[]]
        size = 0
        for nm, t in targets.items():
            if self.buckets[-1] and limit is not None and size + t[0].numel() > limit:
                self.buckets.append([])
                size = 0
            self.buckets[-1].append(nm)
            size += t[0].numel()
        self.flat = self.flatten(targets)
        self.lo = self.hi = self.keep = None
        if bounds is not None:
            self.lo, self.hi = self.flatten(bounds[0]), self.flatten(bounds[1])
        if support is not None:
            self.keep = self.flatten(support)
        self.tn = _sumsq(self.flat).sqrt()
        self.count = sum(t.shape[1] for t in self.flat)
        self._selected: dict[tuple, "MatchTerms"] = {}
        self._scale_cache: Optional[list[torch.Tensor]] = None

    def flatten(self, g: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        """Per bucket, [K, P_i]: the tensors of ``g`` named like the targets, flattened per group."""
        return [torch.cat([g[nm].flatten(1) for nm in names], dim=1) if len(names) > 1 else g[names[0]].flatten(1)
                for names in self.buckets]

    def select(self, idx: Optional[Sequence[int]]) -> "MatchTerms":
        """The same for the groups ``idx`` only (kept: the active set changes rarely)."""
        if idx is None:
            return self
        key = tuple(int(i) for i in idx)
        if key == tuple(range(self.tn.shape[0])):
            return self
        got = self._selected.get(key)
        if got is None:
            ix = torch.tensor(key, dtype=torch.long, device=self.tn.device)
            got = copy.copy(self)
            got.targets = {nm: v[ix] for nm, v in self.targets.items()}
            for attr in ("flat", "lo", "hi", "keep"):
                v = getattr(self, attr)
                setattr(got, attr, None if v is None else [t[ix] for t in v])
            for attr in ("noise", "clip", "tn"):
                v = getattr(self, attr)
                setattr(got, attr, None if v is None else v[ix])
            got._selected, got._scale_cache = {}, None
            self._selected = {key: got}
        return got

    def cosine(self, g: dict[str, torch.Tensor]) -> torch.Tensor:
        return self._cosine(self.flatten(g))

    def _cosine(self, gf: list[torch.Tensor]) -> torch.Tensor:
        dot = sum((gi * ti).sum(1) for gi, ti in zip(gf, self.flat))
        return 1 - dot / (_sumsq(gf).sqrt() * self.tn)

    def data(self, g: dict[str, torch.Tensor]) -> torch.Tensor:
        gf = self.flatten(g)
        if self.kind == "support":
            return self._cosine([gi * mi for gi, mi in zip(gf, self.keep)])
        if self.kind == "bins":
            proj = [torch.max(torch.min(gi, hi), lo) for gi, lo, hi in zip(gf, self.lo, self.hi)]
            dot = sum((gi * pi).sum(1) for gi, pi in zip(gf, proj))
            return 1 - dot / (_sumsq(gf).sqrt() * _sumsq(proj).sqrt()).clamp_min(1e-30)
        cos = self._cosine(gf)
        if self.kind in ("gaussian", "laplace"):
            gn = _sumsq(gf).sqrt()
            factor = torch.clamp(self.clip / gn.clamp_min(1e-30), max=1.0)[:, None]  # clip_C(g) = factor g
            res = [ti - factor * gi for gi, ti in zip(gf, self.flat)]
            if self.kind == "gaussian":
                return cos + _sumsq(res) / (self.noise.pow(2) * self.count) - 1
            return cos + sum(r.abs().sum(1) for r in res) / (self.noise * self.count) - 1
        return cos


    def residual(self, g: dict[str, torch.Tensor], rounding: str = "cells") -> torch.Tensor:
        """[K, entries]: the data term as the residual of a least squares, each entry divided by its
        noise scale, so a Gauss-Newton solver (:mod:`attacks.optimization.likelihood_match`) reads
        the same likelihood that :meth:`data` scores:

        - ``bins``: with ``rounding="cells"`` the distance of g outside its bin (zero on every
          gradient the quantiser maps to the update: the uniform likelihood's support), with
          ``rounding="gaussian"`` g - u (the rounding error as Gaussian noise of its own std), each
          per the tensor's rounding scale, step / sqrt 12;
        - ``support``: g - u on the kept entries, per the tensor's RMS there;
        - ``gaussian`` / ``laplace``: u - clip_C(g) per the noise scale (Laplace by its variance,
          2 b^2): the noise's own negative log-likelihood;
        - ``cosine``: g - u per the tensor's RMS (each tensor weighted alike: the plain match).
        """
        if rounding not in ("cells", "gaussian"):
            raise ValueError(f"rounding {rounding!r}: give 'cells' or 'gaussian'")
        gf, s = self.flatten(g), self._scales()
        if self.kind == "bins" and rounding == "cells":
            parts = [(gi - torch.max(torch.min(gi, hi), lo)) / si for gi, lo, hi, si in zip(gf, self.lo, self.hi, s)]
        elif self.kind == "support":
            parts = [(gi - ti) * mi / si for gi, ti, mi, si in zip(gf, self.flat, self.keep, s)]
        elif self.kind in ("gaussian", "laplace"):
            factor = torch.clamp(self.clip / _sumsq(gf).sqrt().clamp_min(1e-30), max=1.0)[:, None]
            noise = self.noise[:, None] * (2 ** 0.5 if self.kind == "laplace" else 1.0)
            parts = [(ti - factor * gi) / noise for gi, ti in zip(gf, self.flat)]
        else:
            parts = [(gi - ti) / si for gi, ti, si in zip(gf, self.flat, s)]
        return torch.cat(parts, dim=1)

    def _scales(self) -> list[torch.Tensor]:
        """Per bucket [K, P_i]: each tensor's scale, entry by entry (:meth:`residual`). Bins: the
        widest finite bin / sqrt 12 (the nearest quantiser's rounding std, step / sqrt 12), the
        level itself where no bin is finite (1 bit); otherwise the RMS of the tensor's nonzero target
        entries. A tensor without any (all zero) gets 1."""
        if self._scale_cache is not None:
            return self._scale_cache
        out = []
        for b, names in enumerate(self.buckets):
            pieces, at = [], 0
            for nm in names:
                n = self.targets[nm][0].numel()
                t = self.flat[b][:, at:at + n]
                nz = (t != 0).sum(1).clamp_min(1)
                s = (t.pow(2).sum(1) / nz).sqrt()
                if self.kind == "bins":
                    w = self.hi[b][:, at:at + n] - self.lo[b][:, at:at + n]
                    w = torch.where(torch.isfinite(w), w, torch.zeros_like(w)).amax(1) / 12 ** 0.5
                    s = torch.where(w > 0, w, t.abs().amax(1))
                s = torch.where(s > 0, s, torch.ones_like(s))
                pieces.append(s[:, None].expand(-1, n))
                at += n
            out.append(torch.cat(pieces, dim=1))
        self._scale_cache = out
        return out


def defence_match(targets: dict[str, torch.Tensor], raw: Sequence[Any], metas: Sequence[AttackMetadata],
                  names: Sequence[str]) -> tuple[MatchTerms, list[str]]:
    """The :class:`MatchTerms` of K groups' targets under their clients' defence (``metas[k].defence``;
    one kind for all: the groups of one call share a protocol, else the plain cosine) and a note.

    ``raw[k]``: group k's update in gradient units as sent (before any known term is removed), for
    the pruned support and the quantiser's levels."""
    specs = [m.defence or NoDefence() for m in metas]
    name, obs = specs[0].name, specs[0].observation()
    if any(sp != specs[0] for sp in specs) or obs is None or not obs.perturbs:
        return MatchTerms(targets), ([] if name == "none" or any(sp != specs[0] for sp in specs) else
                                 [f"defence {name!r}: not modelled, plain cosine matching"])
    meta = metas[0]
    dev, dt = next(iter(targets.values())).device, next(iter(targets.values())).dtype  # the terms' dtype: the targets'
    if obs.prune_keep is not None:
        support = {nm: torch.stack([r[nm] != 0 for r in raw]).to(dev, dt) for nm in names}
        return MatchTerms(targets, "support", support=support), [
            f"defence prune (keep {obs.prune_keep}): matched on the kept entries only"]
    if obs.quant_bits is not None:
        bits, stochastic = obs.quant_bits, obs.quant_stochastic
        lo, hi = {}, {}
        for nm in names:
            q = torch.stack([r[nm].detach().to("cpu", torch.float64) for r in raw])  # [K, ...] as sent
            # where a known term was removed from the target (MJP's DAL term), the bins move with it
            shift = targets[nm].detach().to("cpu", torch.float64) - q
            flat = q.flatten(1).abs()
            if bits == 1:  # sign(g) * mean|g|: g lies on the sign's half-line (zeros stay zero)
                inf = torch.full_like(q, float("inf"))
                lo[nm] = torch.where(q > 0, torch.zeros_like(q), torch.where(q < 0, -inf, torch.zeros_like(q)))
                hi[nm] = torch.where(q < 0, torch.zeros_like(q), torch.where(q > 0, inf, torch.zeros_like(q)))
            else:
                m = flat.amax(1).reshape(-1, *([1] * (q.dim() - 1)))  # the largest level: max |g|
                half = quantizer_step(m, bits) * (1.0 if stochastic else 0.5)
                lo[nm], hi[nm] = torch.maximum(q - half, -m), torch.minimum(q + half, m)
            lo[nm], hi[nm] = lo[nm] + shift, hi[nm] + shift
        what = f"{bits} bit{'s' if bits > 1 else ''}{', stochastic' if stochastic else ''}"
        return MatchTerms(targets, "bins", bounds=({k: v.to(dev, dt) for k, v in lo.items()},
                                               {k: v.to(dev, dt) for k, v in hi.items()})), [
            f"defence quantize ({what}): matched through the quantiser's bins"]
    if obs.noise is None:
        return MatchTerms(targets), [f"defence {name!r}: not modelled, plain cosine matching"]
    if obs.per_example and (meta.update_type != "gradient" or meta.num_images != 1):
        return MatchTerms(targets), ["defence dp_sgd on a FedAvg delta or a batch (per-example clipping): plain cosine"]
    scale, clip = meta.defence_noise(obs)  # in gradient units (a FedAvg delta was divided by -lr * steps)
    if scale <= 0:
        return MatchTerms(targets), [f"defence {name} without noise: plain cosine matching"]
    K = len(raw)
    # the clip bounds the whole update (local DP) or the one example's gradient (DP-SGD, batch 1)
    note = (f"defence {name} (clip {obs.clip:g}, sigma {obs.sigma:g}): {obs.noise} likelihood of scale {scale:.3g}")
    return MatchTerms(targets, obs.noise, noise=torch.full((K,), scale, device=dev, dtype=dt),
                      clip=torch.full((K,), clip, device=dev, dtype=dt)), [note + " beside the cosine term"]
