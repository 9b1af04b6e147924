"""What a client computes in a round, in plain PyTorch (no Flower import): the loss on its private
batch, FedSGD gradients or a FedAvg weight delta, and the whole round's :func:`local_update`.

This is the local-compute part of Flower's quickstart ``task.py``; the run config lives in
:mod:`clients.runconfig`, the private data in :mod:`clients.partition`, defences in
:mod:`clients.defence` and the Flower wiring in :mod:`clients.client_app`.
"""
from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Callable, Mapping, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from fedmjp.devices import resolve_device
from fedmjp.factory import build_model, model_input

from .partition import PrivateBatch, private_batch, stable_seed
from .runconfig import RunConfig


def load_global_model(cfg: RunConfig, state: Optional[Mapping[str, torch.Tensor]] = None,
                      device: Optional[torch.device] = None) -> nn.Module:
    """Build the run's model (seeded fresh weights or its checkpoint) and load ``state`` into it."""
    model = build_model(cfg.model_spec(), device=device or "cpu")
    if state is not None:
        model.load_state_dict({k: v.to(device or "cpu") for k, v in state.items()}, strict=True)
    return model


def model_logits(model: nn.Module, images: torch.Tensor, unk_mask: Optional[torch.Tensor] = None,
                 device: Optional[torch.device] = None) -> torch.Tensor:
    """Logits [B, K] of images [B, 3, H, W] in [0, 1] (x, or x~ with E_unk at the ``unk_mask``
    [B, N] positions), normalised and cast to the model's dtype on ``device``."""
    device = device or next(model.parameters()).device
    x = model_input(model, images.to(device=device, dtype=next(model.parameters()).dtype))
    return model(x, unk_mask=unk_mask.to(device)) if unk_mask is not None else model(x)


def client_loss(model: nn.Module, batch: PrivateBatch, dal_weight: float = 0.0,
                device: Optional[torch.device] = None) -> torch.Tensor:
    """Cross-entropy of the model on the batch's model input (x or x~ with E_unk at the shuffled
    positions), plus ``dal_weight`` times the DAL loss on the unshuffled positions for ``mjp``."""
    device = device or next(model.parameters()).device
    mask = None if batch.unk_mask is None else batch.unk_mask.to(device)
    loss = F.cross_entropy(model_logits(model, batch.model_input, mask, device), batch.labels.to(device))
    if dal_weight and getattr(model, "dal_head", None) is not None:
        loss = loss + dal_weight * model.compute_dal_loss(None if mask is None else ~mask)
    return loss


def gradients(model: nn.Module, loss_fn: Callable[[], torch.Tensor]) -> tuple[dict[str, torch.Tensor], float]:
    """Gradients of ``loss_fn()`` by parameter name, in eval mode so the gradient is a deterministic
    function of (weights, batch) that an attacker can model.

    Returns:
        (grads, loss): grads maps every trainable parameter name to a CPU float tensor of its
        shape (zeros where the loss does not reach it, e.g. E_unk in setting a); loss is a float.
    """
    model.eval()
    model.zero_grad(set_to_none=True)
    loss = loss_fn()
    loss.backward()
    # The .grad tensors are handed over, not copied: zero_grad(set_to_none) below detaches them
    # from the parameters, so nothing else holds them (a copy cost ~10% of a DeiT-S client's round).
    grads = {name: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().cpu()
             for name, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)
    return grads, float(loss.detach())


def local_sgd(model: nn.Module, loss_fn: Callable[[], torch.Tensor], local_steps: int,
              lr: float) -> tuple[dict[str, torch.Tensor], float]:
    """Weight delta after ``local_steps`` plain SGD steps on ``loss_fn()``; the model is trained in place.

    Returns:
        (delta, loss): delta = w_after - w_before by parameter name (CPU tensors); loss is the mean
        loss over the local steps.
    """
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr)
    model.train()
    losses = []
    for _ in range(int(local_steps)):
        opt.zero_grad(set_to_none=True)
        loss = loss_fn()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    model.eval()
    delta = {n: (p.detach() - before[n]).cpu() for n, p in model.named_parameters() if p.requires_grad}
    return delta, sum(losses) / len(losses)


def fedsgd_gradients(model: nn.Module, batch: PrivateBatch, dal_weight: float = 0.0,
                     device: Optional[torch.device] = None) -> tuple[dict[str, torch.Tensor], float]:
    """One batch's gradients by parameter name (FedSGD update); see :func:`gradients`."""
    return gradients(model, lambda: client_loss(model, batch, dal_weight, device))


def fedavg_update(model: nn.Module, batch: PrivateBatch, local_steps: int, lr: float,
                  dal_weight: float = 0.0, device: Optional[torch.device] = None
                  ) -> tuple[dict[str, torch.Tensor], float]:
    """Weight delta after ``local_steps`` plain SGD steps on the private batch (FedAvg update;
    see :func:`local_sgd`).

    Every step uses the same batch (and the same shuffle), so the ground truth of the update is
    exactly :func:`clients.partition.private_batch`.
    """
    return local_sgd(model, lambda: client_loss(model, batch, dal_weight, device), local_steps, lr)


class SeededDropPath(nn.Module):
    """Drop-path (stochastic depth, timm's rule: scaled by 1/keep) that acts whatever the module's
    mode and draws from its own generator, so a client's train-mode forward is reproducible and
    threads of the in-process engine do not share torch's global generator."""

    def __init__(self, rate: float, generator: torch.Generator) -> None:
        super().__init__()
        self.rate, self.generator = float(rate), generator

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.rate == 0.0:
            return x
        keep = 1.0 - self.rate
        mask = torch.empty((x.shape[0],) + (1,) * (x.ndim - 1), dtype=x.dtype, device=x.device)
        return x * mask.bernoulli_(keep, generator=self.generator).div_(keep)


class SeededDropout(nn.Module):
    """Element-wise dropout (scaled by 1/keep) from its own generator, active whatever the mode."""

    def __init__(self, rate: float, generator: torch.Generator) -> None:
        super().__init__()
        self.rate, self.generator = float(rate), generator

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        keep = 1.0 - self.rate
        mask = torch.empty_like(x).bernoulli_(keep, generator=self.generator)
        return x * mask.div_(keep)


@contextmanager
def stochastic_forward(model: nn.Module, cfg: RunConfig, partition_id: int, server_round: int
                       ) -> Iterator[None]:
    """With ``train-mode`` on, the model's stochastic layers act inside the block: every block's
    drop-path sites (``drop_path1``/``drop_path2``) at DeiT's linear rule (0 at the first block,
    ``drop-path`` at the last) and every ``nn.Dropout`` of rate > 0 the model spec built, all drawing
    from one generator seeded by (seed, partition, round). The modules are swapped in and restored
    afterwards; the model itself stays in eval mode, so nothing else that depends on the mode (the
    MJP model's own training shuffle) changes what the client computes.

    Raises:
        ValueError: ``drop-path`` > 0 on a model without drop-path sites (it would silently do nothing).
    """
    if not cfg.train_mode:
        yield
        return
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(stable_seed(cfg.seed, "train-mode", partition_id, server_round))
    swapped: list[tuple[nn.Module, str, nn.Module]] = []
    blocks = list(getattr(model, "blocks", []))
    for i, block in enumerate(blocks):
        rate = cfg.drop_path * i / max(len(blocks) - 1, 1)
        for name in ("drop_path1", "drop_path2"):
            if isinstance(getattr(block, name, None), nn.Module):
                swapped.append((block, name, getattr(block, name)))
    if cfg.drop_path > 0 and not swapped:
        raise ValueError(f"drop-path={cfg.drop_path}: model {cfg.model_arch!r} has no drop-path sites "
                         "(blocks with drop_path1/drop_path2)")
    for parent in list(model.modules()):
        for name, child in parent.named_children():
            if isinstance(child, nn.Dropout) and child.p > 0:
                swapped.append((parent, name, child))
    for parent, name, original in swapped:
        if isinstance(original, nn.Dropout):
            setattr(parent, name, SeededDropout(original.p, gen))
        else:
            index = blocks.index(parent)
            setattr(parent, name, SeededDropPath(cfg.drop_path * index / max(len(blocks) - 1, 1), gen))
    try:
        yield
    finally:
        for parent, name, original in swapped:
            setattr(parent, name, original)


def local_update(cfg: RunConfig, state: Mapping[str, torch.Tensor], partition_id: int,
                 server_round: int, num_partitions: Optional[int] = None,
                 device: Optional[torch.device] = None) -> tuple[dict[str, torch.Tensor], float, PrivateBatch]:
    """A client's whole round: batch, model at ``state``, FedSGD gradients or FedAvg delta (with
    ``train-mode``, under :func:`stochastic_forward`).

    Returns:
        (update, loss, batch).
    """
    device = device or resolve_device(cfg.device)
    batch = private_batch(cfg, partition_id, server_round, num_partitions)
    model = round_model(cfg, state, device)
    with stochastic_forward(model, cfg, partition_id, server_round):
        if cfg.mode == "fedsgd":
            update, loss = fedsgd_gradients(model, batch, cfg.dal_weight, device)
        else:
            update, loss = fedavg_update(model, batch, cfg.local_steps, cfg.lr, cfg.dal_weight, device)
    return update, loss, batch


_models = threading.local()


def round_model(cfg: RunConfig, state: Mapping[str, torch.Tensor],
                device: torch.device) -> nn.Module:
    """The run's model at the global ``state``, on ``device`` in the config's precision.

    One model object per thread and spec is reused (clients of the in-process engine run in
    threads): its weights are always overwritten by ``state``, so only the architecture carries over.
    """
    key = (json.dumps(cfg.model_spec(), sort_keys=True), str(device), cfg.precision)
    cache = getattr(_models, "cache", None)
    if cache is None or cache[0] != key:
        model = build_model(json.loads(key[0]), device=device).to(getattr(torch, key[2]))
        cache = _models.cache = [key, model, None, None]
    model = cache[1]
    # The same state object again (a resent record is decoded once: clients.records.DecodeCache)
    # and no tensor of the model written since it was loaded (every in-place write bumps a tensor's
    # version counter; a FedAvg step or a defence that trains does): the weights are already there.
    if cache[2] is not state or cache[3] != _versions(model):
        model.load_state_dict({k: v.to(device) for k, v in state.items()}, strict=True)
        cache[2], cache[3] = state, _versions(model)
    return model


def _versions(model: nn.Module) -> list[int]:
    """Version counters of the model's parameters and buffers (bumped by every in-place write)."""
    return [t._version for t in model.state_dict(keep_vars=True).values()]


def clone_state(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Detached CPU copy of a state dict."""
    return {k: v.detach().cpu().clone() for k, v in state.items()}
