"""Helpers of central training: distributed set-up, AMP, seeding, model kwargs, checkpoints.

Training checkpoint format (``last.pth``; loadable with ``torch.load(weights_only=True)``)::

    {"model": state_dict, "optimizer": ..., "scheduler": ..., "scaler": ... or None,
     "epoch": completed epochs (int), "step": optimizer updates so far (int),
     "model_name": timm name (str), "model_kwargs": dict of plain types,
     "config": TrainConfig.to_dict(), "format": "fedmjp-train-v1"}

Shipped weights (``checkpoints/*.safetensors``, :func:`export_weights`): the model's tensors only, in
float16, with the architecture and the training config in the safetensors header (all strings)::

    {"format": "fedmjp-weights-v1", "model_name": ..., "model_kwargs": JSON, "variant": ...,
     "num_classes": ..., "img_size": ..., "epoch": ..., "config": JSON, "metrics": JSON, "source_commit": ...}
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn

from .checkpoint import WEIGHTS_FORMAT, describe_keys, nonfinite_keys, read_safetensors
from .devices import resolve_device
from .factory import create_model
from .trainconfig import TrainConfig

_logger = logging.getLogger(__name__)

CHECKPOINT_FORMAT = "fedmjp-train-v1"


# ----------------------------------------------------------------------------------- distributed
@dataclass
class DistInfo:
    """Where this process sits: ``rank`` of ``world_size``, its device, whether it owns the group."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    owns_group: bool = False

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(device: str = "auto") -> DistInfo:
    """Join the process group that torchrun describes (``WORLD_SIZE`` > 1): nccl on CUDA, gloo on
    CPU. A group that the caller already initialised is reused and left open on exit."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    joined = dist.is_available() and dist.is_initialized()
    # ``auto`` and ``cuda`` mean this rank's GPU; a single process uses GPU 0.
    dev = resolve_device(device, local_rank if joined or world > 1 else 0)
    if dev.type == "cuda":
        # NCCL and code that says plain "cuda" then use this rank's GPU.
        torch.cuda.set_device(dev)
    if joined:
        return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank, dev, owns_group=False)
    if world <= 1:
        return DistInfo(device=dev)
    dist.init_process_group(backend="nccl" if dev.type == "cuda" else "gloo")
    return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank, dev, owns_group=True)


def all_reduce_sum(values: list[float], info: DistInfo) -> list[float]:
    """Sum floats over ranks (float64; identity on one process)."""
    if not info.distributed:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64,
                     device=info.device if info.device.type == "cuda" else "cpu")
    dist.all_reduce(t)
    return t.tolist()


# ----------------------------------------------------------------------------------- AMP, seeds
def amp_dtype(mode: str, device: torch.device) -> Optional[torch.dtype]:
    """Autocast dtype for ``mode`` (auto | none | bf16 | fp16); None disables autocast.
    ``auto`` is bf16 on CUDA devices that support it, fp16 on older GPUs, off on CPU."""
    if mode == "none" or (mode == "auto" and device.type != "cuda"):
        return None
    if mode == "auto":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if mode in ("bf16", "fp16"):
        return torch.bfloat16 if mode == "bf16" else torch.float16
    raise ValueError(f"unknown amp mode {mode!r}; valid: auto, none, bf16, fp16")


def autocast(device: torch.device, dtype: Optional[torch.dtype]) -> contextlib.AbstractContextManager:
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch (augmentations, Mixup, sampler order, dropout/drop-path)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def epoch_seed(seed: int, rank: int, epoch: int) -> int:
    """Seed of ``rank`` in ``epoch``: ``seed + rank`` in epoch 0. Reseeding every epoch makes a resumed
    run draw the same augmentations and shuffles as an uninterrupted one."""
    return seed + rank + 10007 * epoch


# ----------------------------------------------------------------------------------- model
def model_kwargs(cfg: TrainConfig, num_classes: int) -> dict:
    """Constructor kwargs for :func:`fedmjp.factory.create_model` ``(cfg.model, **kwargs)`` (plain types only)."""
    kw = dict(num_classes=num_classes, img_size=cfg.img_size, drop_path_rate=cfg.drop_path)
    if cfg.model.startswith("mjp_"):
        kw.update(cfg.mjp_kwargs())
    kw.update(cfg.model_kwargs)
    return kw


# ----------------------------------------------------------------------------------- checkpoints
def save_checkpoint(path: str | Path, state: dict[str, Any]) -> None:
    """Write ``state`` atomically: to ``path.tmp`` first, then rename over ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def load_checkpoint_state(path: str | Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Load a training checkpoint with ``weights_only=True``."""
    state = torch.load(path, map_location=map_location, weights_only=True)
    if not isinstance(state, dict) or "model" not in state:
        raise ValueError(f"{path} is not a fedmjp training checkpoint (no 'model' entry)")
    return state


def export_weights(checkpoint: str | Path, out: str | Path, dtype: torch.dtype = torch.float16,
                   source_commit: Optional[str] = None) -> Path:
    """Write the model of training checkpoint ``checkpoint`` (``last.pth``) to the safetensors file
    ``out``: weights only, floating-point tensors in ``dtype``, the architecture, the training config
    (without machine paths), epochs and last metrics in the header. Atomic (``out.tmp`` renamed)."""
    from safetensors.torch import save_file

    state = load_checkpoint_state(checkpoint)
    if "model_name" not in state:
        raise ValueError(f"{checkpoint} has no 'model_name': not written by fedmjp.train")
    kwargs = dict(state.get("model_kwargs", {}))
    config = dict(state.get("config", {}))
    for key in ("data_path", "data_cache"):  # where the data lay on the training machine: not the user's
        config[key] = None
    tensors = {k: (v.detach().to(dtype) if v.is_floating_point() else v.detach()).contiguous().cpu()
               for k, v in state["model"].items()}
    metadata = {
        "format": WEIGHTS_FORMAT, "model_name": str(state["model_name"]), "model_kwargs": json.dumps(kwargs),
        "variant": str(kwargs.get("variant", "timm")), "num_classes": str(kwargs.get("num_classes", "")),
        "img_size": str(kwargs.get("img_size", "")), "epoch": str(state.get("epoch", "")),
        "config": json.dumps(config), "metrics": json.dumps(state.get("metrics", {})),
        "dtype": str(dtype).removeprefix("torch."),
    }
    if source_commit:
        metadata["source_commit"] = source_commit
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    save_file(tensors, str(tmp), metadata=metadata)
    os.replace(tmp, out)
    return out


def weights_state(path: str | Path) -> dict[str, Any]:
    """A shipped ``.safetensors`` weights file as the dict :func:`load_checkpoint_state` returns
    (``model`` in float32, ``model_name``, ``model_kwargs``, ``config``, ``epoch``, ``metrics``)."""
    tensors, meta = read_safetensors(path)
    if meta.get("format") != WEIGHTS_FORMAT or "model_name" not in meta:
        raise ValueError(f"{path} has no fedmjp architecture in its header (format {meta.get('format')!r}, "
                         f"expected {WEIGHTS_FORMAT!r}); load it into a model you build with "
                         "fedmjp.checkpoint.load_checkpoint")
    try:
        kwargs, config, metrics = (json.loads(meta.get(k, "{}")) for k in ("model_kwargs", "config", "metrics"))
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: the header's JSON cannot be read ({err})") from err
    epoch = meta.get("epoch", "")
    return {"model": tensors, "model_name": meta["model_name"], "model_kwargs": kwargs, "config": config,
            "epoch": int(epoch) if epoch.isdigit() else None, "metrics": metrics,
            "source_commit": meta.get("source_commit"), "format": WEIGHTS_FORMAT}


def model_from_checkpoint(path: str | Path, map_location: str | torch.device = "cpu") -> tuple[nn.Module, dict]:
    """Rebuild the trained model (eval mode) and return it with the checkpoint's dict: a training
    checkpoint (``last.pth``) or shipped weights (``.safetensors``, architecture in the header)."""
    state = weights_state(path) if Path(path).suffix == ".safetensors" else load_checkpoint_state(path, map_location)
    if "model_name" not in state:
        raise ValueError(f"{path} has no 'model_name': not written by fedmjp.train")
    bad = nonfinite_keys(state["model"]) if isinstance(state.get("model"), dict) else []
    if bad:  # a model of NaNs predicts one class and would score as if it worked
        raise ValueError(f"{path}: the model holds NaN or infinite values in {describe_keys(bad)} (a diverged "
                         "training?); use an earlier checkpoint")
    model = create_model(state["model_name"], **dict(state.get("model_kwargs", {})))
    model.load_state_dict(state["model"])
    return model.eval(), state


def unwrap(model: nn.Module) -> nn.Module:
    """The model inside DDP / the training-step wrapper."""
    while hasattr(model, "module"):
        model = model.module
    return model


def check_output_dir(output_dir: str | Path, what: str) -> None:
    """The output dir is a folder (or can be made one) that this process can write, checked with a
    probe folder made and removed in it or in its nearest existing parent; nothing in it is touched
    (``os.access`` says yes for /proc as root). ``what`` names it in the error (``--output-dir``).

    Raises:
        ValueError (:class:`fedmjp.config.ConfigError`): it cannot be created or written.
    """
    from .config import ConfigError

    path = Path(output_dir)
    existing = path
    while not os.path.lexists(existing) and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        state = "is not a folder" if existing == path else f"cannot be created: {existing} is not a folder"
        raise ConfigError(f"{what}: {path} {state}")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".fedmjp-write-check-", dir=existing))
    except OSError as err:
        raise ConfigError(f"{what}: {path} cannot be {'written' if existing == path else 'created'} "
                          f"({err.strerror or err} in {existing})") from None
