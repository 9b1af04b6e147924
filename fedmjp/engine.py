"""Training and validation loops (MAE's ``engine_*`` split: entry script wires, this file loops).

One training step: Mixup/CutMix -> MJP forward (the model draws the shuffle: token permutation,
E_unk at shuffled positions, DAL on the unshuffled PEs) -> ``CE + lambda * dal_loss`` -> backward
(GradScaler for fp16) -> grad clip -> optimizer step -> per-update LR schedule.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

import torch
import torch.nn as nn
from tqdm import tqdm

from .models import MJPVisionTransformer
from .trainutils import DistInfo, all_reduce_sum, autocast

_logger = logging.getLogger(__name__)


class TrainStep(nn.Module):
    """Wrap a classifier so that one ``forward`` is one training forward, which DDP can wrap.

    ``forward(x, shuffle) -> (logits [B, K], dal_loss scalar or None)``. MJP models go through
    :meth:`MJPVisionTransformer.forward_mjp` when ``shuffle`` is True (the model's own seeded RNG then
    decides, with ``shuffle_prob``, whether this step is shuffled); with ``shuffle`` False (e.g. during
    the warm-up epochs) they run unshuffled and the DAL loss covers every position. Other timm models
    run their plain forward.
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.module = model

    def forward(self, x: torch.Tensor, shuffle: bool = True) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        m = self.module
        if not isinstance(m, MJPVisionTransformer):
            return m(x), None
        if shuffle:
            out = m.forward_mjp(x)
            return out.logits, out.dal_loss
        logits = m(x)  # forward() never shuffles without a plan
        dal = m.compute_dal_loss(None) if m.dal_head is not None else None
        return logits, dal


@dataclass
class StepContext:
    """What a training epoch needs besides the model and data."""

    optimizer: torch.optim.Optimizer
    criterion: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    device: torch.device
    info: DistInfo
    scheduler: Optional[object] = None  # timm scheduler stepped per update
    mixup: Optional[Callable] = None
    scaler: Optional[torch.amp.GradScaler] = None
    amp_dtype: Optional[torch.dtype] = None
    clip_grad: Optional[float] = None
    dal_lambda: float = 0.0
    shuffle: bool = True
    max_steps: Optional[int] = None
    log_interval: int = 50
    progress: bool = True


def train_one_epoch(step_module: nn.Module, loader: Iterable, ctx: StepContext, epoch: int,
                    global_step: int) -> tuple[dict, int]:
    """Train one epoch.

    Args:
        step_module: a :class:`TrainStep` (possibly inside DDP), in train mode.
        loader: yields (images [B, 3, H, W] float, labels [B] long).
        global_step: optimizer updates done before this epoch (drives the LR schedule).
    Returns:
        ({"loss", "ce_loss", "dal_loss", "train_acc", "images", "images_per_s", "lr", "time"}, global step
        after the epoch). Losses/accuracy are averaged over all ranks; ``train_acc`` compares the argmax
        with the labels before Mixup (a rough signal under Mixup/CutMix).
    """
    step_module.train()
    sums = {"loss": 0.0, "ce": 0.0, "dal": 0.0, "correct": 0.0, "n": 0.0, "dal_n": 0.0}
    n_steps = len(loader) if ctx.max_steps is None else min(len(loader), ctx.max_steps)
    # disable=None: tqdm turns itself off when stderr is not a terminal (logs, pipes, nohup); the
    # per-epoch log line of fedmjp.train is the progress record there.
    bar = tqdm(total=n_steps, desc=f"epoch {epoch}", disable=None if ctx.progress and ctx.info.is_main else True,
               leave=False, dynamic_ncols=True)
    t0 = time.perf_counter()
    for i, (images, labels) in enumerate(loader):
        if i >= n_steps:
            break
        images = images.to(ctx.device, non_blocking=True)
        labels = labels.to(ctx.device, non_blocking=True)
        targets = labels
        if ctx.mixup is not None:
            if images.shape[0] % 2:  # timm's Mixup needs an even batch
                images, labels = images[:-1], labels[:-1]
            images, targets = ctx.mixup(images, labels)
        with autocast(ctx.device, ctx.amp_dtype):
            logits, dal = step_module(images, ctx.shuffle)
            ce = ctx.criterion(logits, targets)
            loss = ce if dal is None else ce + ctx.dal_lambda * dal
        if not math.isfinite(loss.item()):
            raise FloatingPointError(f"non-finite loss {loss.item()} at epoch {epoch} step {i}")
        ctx.optimizer.zero_grad(set_to_none=True)
        if ctx.scaler is not None:
            ctx.scaler.scale(loss).backward()
            ctx.scaler.unscale_(ctx.optimizer)
        else:
            loss.backward()
        if ctx.clip_grad:
            torch.nn.utils.clip_grad_norm_(step_module.parameters(), ctx.clip_grad)
        if ctx.scaler is not None:
            ctx.scaler.step(ctx.optimizer)
            ctx.scaler.update()
        else:
            ctx.optimizer.step()
        global_step += 1
        if ctx.scheduler is not None:
            ctx.scheduler.step_update(num_updates=global_step)

        b = images.shape[0]
        sums["loss"] += loss.item() * b
        sums["ce"] += ce.item() * b
        if dal is not None:
            sums["dal"] += dal.item() * b
            sums["dal_n"] += b
        sums["correct"] += (logits.argmax(dim=1) == labels).sum().item()
        sums["n"] += b
        bar.update(1)
        if i % ctx.log_interval == 0:
            bar.set_postfix(loss=f"{loss.item():.3f}", lr=f"{ctx.optimizer.param_groups[0]['lr']:.2e}")
    bar.close()
    elapsed = time.perf_counter() - t0
    keys = list(sums)
    total = dict(zip(keys, all_reduce_sum([sums[k] for k in keys], ctx.info)))
    n = max(total["n"], 1.0)
    stats = {
        "loss": total["loss"] / n,
        "ce_loss": total["ce"] / n,
        "dal_loss": total["dal"] / total["dal_n"] if total["dal_n"] else None,
        "train_acc": 100.0 * total["correct"] / n,
        "images": int(total["n"]),
        "images_per_s": total["n"] / elapsed if elapsed > 0 else float("nan"),
        "lr": ctx.optimizer.param_groups[0]["lr"],
        "time": elapsed,
    }
    return stats, global_step


@torch.no_grad()
def validate(model: nn.Module, loader: Iterable, device: torch.device, info: DistInfo,
             amp_dtype: Optional[torch.dtype] = None) -> dict:
    """Top-1 accuracy (percent) of the unshuffled model over this rank's shard, summed over ranks.

    Returns {"val_top1": float, "val_images": int}.
    """
    was_training = model.training
    model.eval()
    correct, n = 0.0, 0.0
    for images, labels in loader:
        images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
        with autocast(device, amp_dtype):
            logits = model(images)
        correct += (logits.argmax(dim=1) == labels).sum().item()
        n += labels.shape[0]
    model.train(was_training)
    correct, n = all_reduce_sum([correct, n], info)
    return {"val_top1": 100.0 * correct / max(n, 1.0), "val_images": int(n)}
