"""Image identifiability precision (IIP; Yin et al., CVPR'21, "See through Gradients"), as breaching
computes it (``breaching.analysis.metrics.image_identifiability_precision``): a reconstruction
*identifies* its image when, among the pool's images of the same label, the one nearest to the
reconstruction is the client's true image. IIP is the share of reconstructions that do. It asks
what PSNR cannot: could the server tell *whose* image it rebuilt, from a pool of candidates?

Distances, as breaching's:
- ``"pixel"``: the L2 norm of the difference (breaching's default score);
- ``"lpips"``: the LPIPS distance (:func:`metrics.lpips`, AlexNet v0.1: breaching's ``lpips.LPIPS(net="alex")``);
- ``"self"``: 1 - the cosine of the two images' features at the input of the model's last linear
  layer (breaching's ``_return_model_features``), given ``features``.

A candidate is the true image when their L2 distance is below ``fudge`` (breaching's 1e-3). The
pool must hold the true images (as breaching's validation set holds the user's data); a true
image it lacks is never identified. Where breaching's LPIPS variant passes its tensors to the
scorer without scaling them to [-1, 1], the images here are scaled as LPIPS expects. The chance
level of a reconstruction is 1 / its number of candidates (:func:`identified` returns the counts).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Optional

import torch

from ._validate import check_image_batch

#: Distances a pool can be searched by (module docstring).
IIP_DISTANCES = ("pixel", "lpips", "self")
#: breaching's tolerance for "the nearest candidate is the true image" (L2 in pixel space).
FUDGE = 1e-3


def _distances(rec: torch.Tensor, candidates: torch.Tensor, distance: str, lpips_model,
               lpips_cache, features: Optional[Callable[[torch.Tensor], torch.Tensor]]) -> torch.Tensor:
    """[N] distances of one reconstruction [1, 3, H, W] to N candidates [N, 3, H, W]."""
    if distance == "pixel":
        return (candidates.double() - rec.double()).flatten(1).norm(dim=1)
    if distance == "lpips":
        from .perceptual import lpips

        return lpips(rec.expand_as(candidates), candidates, model=lpips_model, validate=False, cache=lpips_cache)
    assert features is not None
    with torch.no_grad():
        f_rec, f_pool = features(rec).flatten(1).double(), features(candidates).flatten(1).double()
    return 1.0 - torch.nn.functional.cosine_similarity(f_pool, f_rec.expand_as(f_pool), dim=1)


def identified(reconstruction: torch.Tensor, truth: torch.Tensor, pool: torch.Tensor, *,
               labels: Optional[torch.Tensor] = None, pool_labels: Optional[torch.Tensor] = None,
               distance: str = "pixel", lpips_model=None, lpips_cache=None,
               features: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
               fudge: float = FUDGE) -> tuple[torch.Tensor, torch.Tensor]:
    """Whether each reconstruction identifies its true image in the pool (module docstring).

    Args:
        reconstruction, truth: [B, 3, H, W] in [0, 1], paired.
        pool: [N, 3, H, W] in [0, 1], the candidates (it should hold every true image).
        labels, pool_labels: [B] and [N] class labels: only candidates of the reconstruction's
            label compete (breaching's rule); both None: every pool image competes.
        distance: one of :data:`IIP_DISTANCES`.
        lpips_model, lpips_cache: for ``"lpips"`` (:func:`metrics.lpips`).
        features: for ``"self"``: [n, 3, H, W] in [0, 1] -> [n, ...] features (normalisation included).
        fudge: the L2 distance under which the nearest candidate counts as the true image.
    Returns:
        ``(hit, candidates)``: [B] bool, and [B] int64, how many pool images competed (the chance
        level is 1 / that; 0 where none had the label: never a hit).
    Raises:
        ValueError: bad images, shapes, labels or distance.
    """
    if distance not in IIP_DISTANCES:
        raise ValueError(f"IIP distance {distance!r}: give one of {', '.join(IIP_DISTANCES)}")
    if distance == "self" and features is None:
        raise ValueError("IIP distance 'self' needs the model's features (features=...)")
    check_image_batch(reconstruction, "reconstruction")
    check_image_batch(truth, "truth")
    check_image_batch(pool, "pool")
    if reconstruction.shape != truth.shape or pool.shape[1:] != truth.shape[1:]:
        raise ValueError(f"reconstruction {tuple(reconstruction.shape)}, truth {tuple(truth.shape)} and pool "
                         f"{tuple(pool.shape)} must share the image shape (and the first two their batch)")
    if (labels is None) != (pool_labels is None):
        raise ValueError("give both labels and pool_labels, or neither")
    if labels is not None and pool_labels is not None and (labels.shape != (len(truth),)
                                                           or pool_labels.shape != (len(pool),)):
        raise ValueError(f"labels {tuple(labels.shape)} and pool_labels {tuple(pool_labels.shape)} must be "
                         f"[{len(truth)}] and [{len(pool)}]")
    rec = reconstruction.detach().float().cpu().clamp(0.0, 1.0)
    pool = pool.detach().float().cpu()
    truth = truth.detach().float().cpu()
    hit = torch.zeros(len(rec), dtype=torch.bool)
    counts = torch.zeros(len(rec), dtype=torch.int64)
    for i in range(len(rec)):
        idx = (torch.arange(len(pool)) if labels is None
               else (pool_labels.cpu() == labels[i].cpu()).nonzero().flatten())  # type: ignore[union-attr]
        counts[i] = len(idx)
        if not len(idx):
            continue
        d = _distances(rec[i:i + 1], pool[idx], distance, lpips_model, lpips_cache, features)
        nearest = pool[idx[int(torch.argmin(d))]]
        hit[i] = bool((nearest.double() - truth[i].double()).norm() < fudge)
    return hit, counts


def head_features(model: torch.nn.Module, mean, std) -> Callable[[torch.Tensor], torch.Tensor]:
    """``features`` for the ``"self"`` distance: the input of ``model``'s last linear layer (its
    head: breaching's ``_return_model_features``) for images in [0, 1], normalised by the model's
    ``mean`` and ``std`` first."""
    last = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    if not last:
        raise ValueError("IIP distance 'self': the model has no linear layer to read features at")
    head = last[-1]
    param = next(model.parameters())
    m = torch.as_tensor(mean, dtype=param.dtype, device=param.device).view(1, -1, 1, 1)
    s = torch.as_tensor(std, dtype=param.dtype, device=param.device).view(1, -1, 1, 1)

    def features(images: torch.Tensor) -> torch.Tensor:
        got: list[torch.Tensor] = []
        hook = head.register_forward_hook(lambda _mod, inputs, _out: got.append(inputs[0].detach()))
        try:
            with torch.no_grad():
                model((images.to(param.device, param.dtype) - m) / s)
        finally:
            hook.remove()
        return got[0].cpu()

    return features
