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

What a defence sends is checked against the clean update in one place (:func:`check_sent_update`):
the same names and shapes, the same real floating-point dtype, finite, every entry at most
:data:`defences.spec.MAX_UPDATE_MAGNITUDE`. A defence that breaks it, exits or raises its own
KeyboardInterrupt is a :class:`fedmjp.plugins.PluginError` naming it, not an update sent.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Mapping, Optional

import torch
import torch.nn.functional as F

from defences import apply_update_defence, cosine_similarity, dp_sgd_epsilon, mix_batch, private_gradient
from defences.spec import MAX_UPDATE_MAGNITUDE, DpSgd, Mixup

from fedmjp import plugins
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


def sent_update_problem(clean: Mapping[str, torch.Tensor], sent: Any) -> Optional[str]:
    """What is wrong with the update a defence sends instead of ``clean`` (None: nothing): a mapping
    of the same names, each a torch tensor of its clean entry's shape and real floating-point dtype,
    finite, with every entry at most :data:`defences.spec.MAX_UPDATE_MAGNITUDE` in magnitude."""
    if not isinstance(sent, Mapping):
        return f"a {type(sent).__name__} instead of a dict of tensors by parameter name"
    missing, extra = sorted(set(clean) - set(sent), key=str), sorted(set(sent) - set(clean), key=str)
    if missing or extra:
        listed = "; ".join(part for part in (f"missing {missing[:3]}" + ("..." if len(missing) > 3 else "")
                                             if missing else "",
                                             f"unknown {extra[:3]}" + ("..." if len(extra) > 3 else "")
                                             if extra else "") if part)
        return f"its names differ from the update's ({listed})"
    for name, ref in clean.items():
        value = sent[name]
        if not isinstance(value, torch.Tensor):
            return f"{name!r} is a {type(value).__name__}, not a torch tensor"
        if value.dtype != ref.dtype:
            return f"{name!r} has dtype {value.dtype}, the update's is {ref.dtype}"
        if value.shape != ref.shape:
            return f"{name!r} has shape {tuple(value.shape)}, the update's is {tuple(ref.shape)}"
        if not bool(torch.isfinite(value).all()):
            return f"{name!r} holds non-finite values (NaN or inf)"
        if value.numel() and float(value.abs().max()) > MAX_UPDATE_MAGNITUDE:
            return (f"{name!r} holds {float(value.abs().max()):.3g}, beyond {MAX_UPDATE_MAGNITUDE:g} in magnitude "
                    "(its norm and cosine to the clean update cannot be computed)")
    return None


def check_sent_update(spec: Any, clean: Mapping[str, torch.Tensor], sent: Any) -> dict[str, torch.Tensor]:
    """``sent`` when it is an update the clean one may be replaced by (:func:`sent_update_problem`).

    Raises:
        PluginError: naming the defence (its label) and what was wrong.
    """
    problem = sent_update_problem(clean, sent)
    if problem is not None:
        raise plugins.PluginError(f"defence {spec.label!r} returned a bad update: {problem}; a defence must "
                                  "return every entry of the update with its shape and dtype, finite")
    return dict(sent)


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
        sent = check_sent_update(spec, clean, sent)
        if isinstance(spec, DpSgd):
            n_owned = len(partition_indices(cfg, partition_id, num_partitions))
            q = min(1.0, cfg.batch_size / n_owned)
            steps = server_round * (1 if cfg.mode == "fedsgd" else cfg.local_steps)
            info["dp-epsilon"] = dp_sgd_epsilon(q, spec.sigma, steps, spec.delta)
    else:
        # a copy: a defence that changes what it is given in place cannot change the clean reference
        given = {k: v.clone() for k, v in clean.items()}
        sent = check_sent_update(spec, clean, plugins.call(f"defence {spec.label!r}", apply_update_defence,
                                                           given, spec, gen))
    norm = update_norm(clean)
    info["defence-cos"] = cosine_similarity(sent, clean)
    info["defence-norm-ratio"] = update_norm(sent) / norm if norm > 0 else 0.0
    return sent, loss, batch, info
