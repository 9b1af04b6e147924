"""A client's round with a defence on (plain PyTorch, no Flower import).

:func:`defended_local_update` computes the clean update of :func:`clients.update.local_update`
and, when a defence is configured, the defended one from the same weights and batch, and reports
their cosine similarity (a cheap utility proxy available for every row). What is sent is the
defended update; the ground truth the benchmark scores against stays the private image x.

Where each defence acts (:mod:`defences.spec` has the keys):
* local_dp, prune, quantize: on the finished update (FedSGD gradients or FedAvg delta).
* dp_sgd: in every local step (per-sample clipping, Gaussian noise); FedSGD sends the one noisy
  gradient. The RDP accountant's epsilon after this round's steps is reported (``dp-epsilon``).
* mixup: on the inputs of local training (mixed images, soft targets). In settings b/c the private
  image is x~ and its partners are unshuffled images of the partition, under the same E_unk mask.
* central_dp: nowhere on the client (the server's Flower wrapper, server/central_dp.py).
* fedavg: the run config's mode/local-steps (set by :class:`clients.runconfig.RunConfig` from the spec).
Randomness is seeded by (seed, partition, round), so a defended update is reproducible.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Mapping, Optional

import torch
import torch.nn.functional as F

from defences import apply_update_defence, cosine_similarity, dp_sgd_epsilon, mix_batch, private_gradient
from defences.spec import DpSgd, Mixup

from fedmjp.devices import resolve_device

from .partition import PrivateBatch, partition_indices, private_image_set, stable_seed
from .runconfig import RunConfig
from .update import client_loss, gradients, local_sgd, local_update, model_logits, round_model, stochastic_forward


def _soft_loss(model: torch.nn.Module, images: torch.Tensor, targets: torch.Tensor, mask: Optional[torch.Tensor],
               device: torch.device) -> torch.Tensor:
    logits = model_logits(model, images, mask, device)
    return F.cross_entropy(logits, targets.to(device=device, dtype=logits.dtype))


def _sample_loss(model: torch.nn.Module, batch: PrivateBatch, i: int, dal_weight: float,
                 device: torch.device) -> torch.Tensor:
    """Loss of example ``i`` alone (its own E_unk mask row)."""
    sl = slice(i, i + 1)
    sub = replace(batch, images=batch.images[sl], labels=batch.labels[sl], indices=batch.indices[sl],
                  image_ids=batch.image_ids[sl], shuffled=None if batch.shuffled is None else batch.shuffled[sl],
                  plan=None if batch.plan is None else batch.plan.select(sl))
    return client_loss(model, sub, dal_weight, device)


def _dp_sgd_update(model: torch.nn.Module, batch: PrivateBatch, cfg: RunConfig, spec: DpSgd,
                   gen: torch.Generator, device: torch.device) -> tuple[dict[str, torch.Tensor], float]:
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    params = [p for _, p in named]
    B, dal = int(batch.labels.numel()), cfg.dal_weight
    clip, sigma = spec.clip, spec.sigma
    model.eval()
    if cfg.mode == "fedsgd":
        grads, loss = private_gradient(lambda i: _sample_loss(model, batch, i, dal, device), params, B, clip, sigma, gen)
        return {n: g.detach().cpu().clone() for (n, _), g in zip(named, grads)}, loss
    before = [p.detach().clone() for p in params]
    losses = []
    for _ in range(cfg.local_steps):
        grads, loss = private_gradient(lambda i: _sample_loss(model, batch, i, dal, device), params, B, clip, sigma, gen)
        with torch.no_grad():
            for p, g in zip(params, grads):
                p -= cfg.lr * g
        losses.append(loss)
    delta = {n: (p.detach() - b).cpu() for (n, p), b in zip(named, before)}
    return delta, sum(losses) / len(losses)


def _mixup_update(model: torch.nn.Module, batch: PrivateBatch, cfg: RunConfig, spec: Mixup,
                  partition_id: int, num_partitions: Optional[int], gen: torch.Generator,
                  device: torch.device) -> tuple[dict[str, torch.Tensor], float]:
    data = private_image_set(cfg)
    pool = torch.tensor(partition_indices(cfg, partition_id, num_partitions), dtype=torch.long)
    mixed = mix_batch(batch.model_input, batch.labels, data.images[pool], data.labels[pool], cfg.num_classes,
                      spec.k, spec.alpha, spec.sign_flip, gen)
    def loss() -> torch.Tensor:
        return _soft_loss(model, mixed.images, mixed.targets, batch.unk_mask, device)

    if cfg.mode == "fedsgd":
        return gradients(model, loss)
    return local_sgd(model, loss, cfg.local_steps, cfg.lr)


def defended_local_update(cfg: RunConfig, state: Mapping[str, torch.Tensor], partition_id: int,
                          server_round: int, num_partitions: Optional[int] = None,
                          device: Optional[torch.device] = None
                          ) -> tuple[dict[str, torch.Tensor], float, PrivateBatch, dict[str, float]]:
    """A client's round with the config's defence.

    Returns:
        (update to send, loss, batch, info): info holds ``defence-cos`` (cosine similarity of the
        sent update to the clean one; 1.0 without a defence), ``defence-norm-ratio`` (||sent|| /
        ||clean||) and, for dp_sgd, ``dp-epsilon`` (RDP accountant, Poisson sampling rate
        batch-size / partition size, steps = rounds so far x local steps, at the spec's delta).
    """
    from defences import update_norm

    spec = cfg.defence
    device = device or resolve_device(cfg.device)
    clean, loss, batch = local_update(cfg, state, partition_id, server_round, num_partitions, device)
    if spec.name in ("none", "central_dp", "fedavg"):
        return clean, loss, batch, {"defence-cos": 1.0, "defence-norm-ratio": 1.0}
    gen = torch.Generator().manual_seed(stable_seed(cfg.seed, "defence", partition_id, server_round))
    info: dict[str, float] = {}
    if isinstance(spec, (DpSgd, Mixup)):
        model = round_model(cfg, state, device)
        with stochastic_forward(model, cfg, partition_id, server_round):
            if isinstance(spec, DpSgd):
                sent, loss = _dp_sgd_update(model, batch, cfg, spec, gen, device)
            else:
                sent, loss = _mixup_update(model, batch, cfg, spec, partition_id, num_partitions, gen, device)
        if isinstance(spec, DpSgd):
            n_owned = len(partition_indices(cfg, partition_id, num_partitions))
            q = min(1.0, cfg.batch_size / n_owned)
            steps = server_round * (1 if cfg.mode == "fedsgd" else cfg.local_steps)
            info["dp-epsilon"] = dp_sgd_epsilon(q, spec.sigma, steps, spec.delta)
    else:
        sent = apply_update_defence(clean, spec, gen)
    norm = update_norm(clean)
    info["defence-cos"] = cosine_similarity(sent, clean)
    info["defence-norm-ratio"] = update_norm(sent) / norm if norm > 0 else 0.0
    return sent, loss, batch, info
