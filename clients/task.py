"""Client-side work of a federated round, in plain PyTorch (no Flower import).

Everything a client does is a deterministic function of the run config, its partition id and the
round number, so the benchmark can rebuild a client's private batch (the ground truth x and x~) by
calling :func:`private_batch` itself; the attack code never reads it.

Run-config keys (Flower style, flat, hyphenated; defaults in :data:`DEFAULTS`, mirrored by
``[tool.flwr.app.config]`` in pyproject.toml):

=================  ==========================================================================
key                meaning
=================  ==========================================================================
mode               ``fedsgd`` (reply one batch's gradients) or ``fedavg`` (reply a weight delta)
setting            ``a`` (gradient on x), ``b``/``c`` (gradient on the MJP-shuffled x~)
gamma              shuffle ratio of settings b and c
per-sample         one shuffle per image (true) or one per batch (false, official code)
batch-size         images per client update (the paper attacks batch size 1)
local-steps, lr    FedAvg local SGD steps and learning rate; lr is also FedSGD's server step
dal-weight         weight of the DAL loss in the client loss (0: cross-entropy only, as the
                   privacy study's gradients are classification gradients)
images, ...        private image set (``embedded`` or a folder), image-size, num-images (0: all),
                   num-classes
partitioner        ``iid`` or ``dirichlet`` (by label, ``dirichlet-alpha``), seeded by ``seed``
model-*            the model spec for :func:`fedmjp.factory.build_model` (model-kwargs is JSON)
precision          ``float32`` or ``float64``: dtype of the client's forward/backward (APRIL's
                   closed form is exact only on float64 gradients; DESIGN section 4)
device             where clients compute: ``auto`` (CUDA when present), ``cpu``, ``cuda``, ``cuda:N``
server-eval        false (default): the server evaluates nothing. true: after every round it
                   evaluates the global model on the *public split* (:func:`public_eval_set`): the
                   images of the same source after the first ``num-images`` ones, which no client
                   owns; never on the clients' private images
defence            JSON of a :mod:`defences` spec, e.g. '{"name": "local_dp", "clip": 1.0}';
                   ``fedavg`` sets mode fedavg and local-steps (see :mod:`clients.defence`)
=================  ==========================================================================
"""
from __future__ import annotations

import functools
import hashlib
import json
import logging
import threading
import warnings
from dataclasses import dataclass
from typing import Any, Mapping, Optional

import timm
import torch
import torch.nn as nn
import torch.nn.functional as F

from fedmjp.data import ImageSet, load_images
from fedmjp.devices import resolve_device
from fedmjp.factory import build_model, model_input_stats
from fedmjp.jigsaw import JigsawPlan

_logger = logging.getLogger(__name__)

MODES = ("fedsgd", "fedavg")
SETTINGS = ("a", "b", "c")
PARTITIONERS = ("iid", "dirichlet")
PRECISIONS = ("float32", "float64")

DEFAULTS: dict[str, Any] = {
    "num-server-rounds": 2,
    "mode": "fedsgd",
    "setting": "a",
    "gamma": 0.27,
    "per-sample": False,
    "batch-size": 1,
    "local-steps": 1,
    "lr": 0.1,
    "dal-weight": 0.0,
    "seed": 0,
    "images": "embedded",
    "image-size": 32,
    "num-images": 16,
    "num-classes": 10,
    "num-partitions": 2,
    "partitioner": "iid",
    "dirichlet-alpha": 0.5,
    "model-name": "ViT+MJP",
    "model-arch": "mjp_vit_cifar_patch4_32",
    "model-variant": "mjp",
    "model-kwargs": "{}",
    "model-checkpoint": "",
    "model-april": "",
    "model-seed": 0,
    "precision": "float32",
    "fraction-train": 1.0,
    "min-nodes": 2,
    "round-timeout": 600.0,
    "server-eval": False,
    "device": "auto",
    "out-dir": "",
    "fail-partition": -1,
    "slow-partition": -1,
    "slow-seconds": 0.0,
    "defence": '{"name": "none"}',
}

#: Keys the server sends to clients each round (the rest comes from the client's run config).
ROUND_KEYS = ("mode", "setting", "gamma", "per-sample", "batch-size", "local-steps", "lr", "dal-weight",
              "fail-partition", "slow-partition", "slow-seconds", "defence")


@dataclass
class PrivateBatch:
    """One client's private batch for one round (ground truth; never sent to the server).

    Attributes:
        images: x, [B, 3, H, W] float32 in [0, 1].
        labels: [B] long.
        image_ids: names of the images in the private set, length B.
        indices: [B] long, positions in the private image set.
        plan: the MJP shuffle applied (settings b, c) or None (setting a).
        shuffled: x~, [B, 3, H, W] in [0, 1] (settings b, c) or None.
        gamma: shuffle ratio actually applied (0.0 for setting a).
    """

    images: torch.Tensor
    labels: torch.Tensor
    image_ids: list[str]
    indices: torch.Tensor
    plan: Optional[JigsawPlan]
    shuffled: Optional[torch.Tensor]
    gamma: float

    @property
    def model_input(self) -> torch.Tensor:
        """The image the client's gradient is computed on: x~ for settings b/c, else x."""
        return self.images if self.shuffled is None else self.shuffled

    @property
    def unk_mask(self) -> Optional[torch.Tensor]:
        """[B, N] bool positions that carry E_unk, or None."""
        return None if self.plan is None else self.plan.mask


# ------------------------------------------------------------------------------------- config
def resolve_config(run_config: Mapping[str, Any]) -> dict[str, Any]:
    """Defaults overlaid with ``run_config``, checked. ``model-kwargs`` may be a dict or JSON."""
    unknown = set(run_config) - set(DEFAULTS)
    if unknown:
        raise ValueError(f"unknown run-config keys {sorted(unknown)}; valid: {', '.join(DEFAULTS)}")
    cfg = {**DEFAULTS, **dict(run_config)}
    if isinstance(cfg["model-kwargs"], Mapping):
        cfg["model-kwargs"] = json.dumps(dict(cfg["model-kwargs"]), sort_keys=True)
    cfg["defence"] = _resolve_defence(cfg)
    for key, valid in (("mode", MODES), ("setting", SETTINGS), ("partitioner", PARTITIONERS),
                       ("precision", PRECISIONS)):
        if cfg[key] not in valid:
            raise ValueError(f"{key} must be one of {', '.join(valid)}, got {cfg[key]!r}")
    if not 0.0 <= float(cfg["gamma"]) <= 1.0:
        raise ValueError(f"gamma must be in [0, 1], got {cfg['gamma']}")
    for key in ("batch-size", "local-steps", "num-server-rounds", "num-partitions"):
        if int(cfg[key]) < 1:
            raise ValueError(f"{key} must be >= 1, got {cfg[key]}")
    return cfg


def _resolve_defence(cfg: dict[str, Any]) -> str:
    """The checked defence spec as canonical JSON; ``fedavg`` rewrites mode and local-steps."""
    from defences import validate_defence

    raw = cfg["defence"]
    if isinstance(raw, str):
        try:
            raw = json.loads(raw) if raw.strip() else None
        except json.JSONDecodeError as err:
            raise ValueError(f"defence must be JSON like '{{\"name\": \"local_dp\"}}', got {raw!r}: {err}") from err
    spec = validate_defence(raw)
    if spec["name"] == "fedavg":
        cfg["mode"], cfg["local-steps"] = "fedavg", int(spec["steps"])
    return json.dumps(spec, sort_keys=True)


def model_spec(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The :func:`fedmjp.factory.build_model` spec a resolved run config describes."""
    kwargs = cfg["model-kwargs"]
    kwargs = json.loads(kwargs) if isinstance(kwargs, str) else dict(kwargs)
    return {
        "name": cfg["model-name"], "arch": cfg["model-arch"], "variant": cfg["model-variant"],
        "kwargs": kwargs, "checkpoint": cfg["model-checkpoint"] or None,
        "april": cfg["model-april"] or None, "seed": int(cfg["model-seed"]),
    }


def stable_seed(*parts: Any) -> int:
    """A 62-bit seed from any printable parts; stable across processes (unlike ``hash``)."""
    digest = hashlib.sha256("/".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 2


def public_eval_set(run_config: Mapping[str, Any]) -> ImageSet:
    """The server's evaluation images: the images of the source after the first ``num-images``
    (the private set), which no client owns; labels as the private set's ((sorted index) %
    num-classes).

    Raises:
        ValueError: the private set takes every image of the source (``num-images`` 0 or too
            large), so no public split is left.
    """
    cfg = resolve_config(run_config)
    n_private = int(cfg["num-images"])
    full = load_images(str(cfg["images"]), int(cfg["image-size"]), None, int(cfg["num-classes"]))
    if n_private <= 0 or n_private >= len(full):
        raise ValueError(f"server-eval needs a public split, but the private set (num-images={n_private or 'all'}) "
                         f"takes all {len(full)} images of {cfg['images']!r}; lower num-images or set "
                         "server-eval=false")
    keep = torch.arange(n_private, len(full))
    return ImageSet(full.images[keep], full.labels[keep], [full.names[i] for i in keep.tolist()])


def pick_device(preferred: Optional[str] = None) -> torch.device:
    """``preferred``, else CUDA when present, else CPU."""
    return resolve_device(preferred or "auto")


# ------------------------------------------------------------------------------------- data
@functools.lru_cache(maxsize=4)
def _image_set(source: str, size: int, num_images: int, num_classes: int) -> ImageSet:
    return load_images(source, size, num_images or None, num_classes)


def private_image_set(run_config: Mapping[str, Any]) -> ImageSet:
    """The whole private image set the clients' partitions are cut from (cached per process)."""
    cfg = resolve_config(run_config)
    return _image_set(str(cfg["images"]), int(cfg["image-size"]), int(cfg["num-images"]), int(cfg["num-classes"]))


@functools.lru_cache(maxsize=16)
def _partitions(labels: tuple[int, ...], num_partitions: int, partitioner: str, alpha: float,
                seed: int) -> tuple[tuple[int, ...], ...]:
    from datasets import Dataset
    from flwr_datasets.partitioner import DirichletPartitioner, IidPartitioner

    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed)).tolist()
    data = Dataset.from_dict({"index": order, "label": [labels[i] for i in order]})
    if partitioner == "iid":
        # IidPartitioner cuts contiguous shards: the seeded shuffle above makes them IID.
        part = IidPartitioner(num_partitions=num_partitions)
    else:
        part = DirichletPartitioner(num_partitions=num_partitions, partition_by="label", alpha=alpha,
                                    min_partition_size=1, seed=seed % 2**32)
    part.dataset = data
    try:
        with warnings.catch_warnings():
            # flwr-datasets warns on every Dirichlet resampling; failure is reported below instead.
            warnings.simplefilter("ignore", UserWarning)
            return tuple(tuple(sorted(part.load_partition(p)["index"])) for p in range(num_partitions))
    except ValueError as err:
        raise ValueError(f"Dirichlet partitioning of {len(labels)} images into {num_partitions} non-empty "
                         f"partitions failed ({err}); it needs several images per class: lower num-classes, "
                         "raise num-images or dirichlet-alpha, or use partitioner='iid'") from err


def partition_indices(run_config: Mapping[str, Any], partition_id: int,
                      num_partitions: Optional[int] = None) -> list[int]:
    """Positions in the private image set owned by ``partition_id`` (IID or Dirichlet by label).

    Raises:
        ValueError: bad partition id, or more partitions than images.
    """
    cfg = resolve_config(run_config)
    n_parts = int(num_partitions or cfg["num-partitions"])
    if not 0 <= partition_id < n_parts:
        raise ValueError(f"partition id {partition_id} outside [0, {n_parts})")
    labels = tuple(private_image_set(cfg).labels.tolist())
    if len(labels) < n_parts:
        raise ValueError(f"{len(labels)} private images cannot be split into {n_parts} partitions; "
                         "raise num-images or lower the number of clients")
    parts = _partitions(labels, n_parts, cfg["partitioner"], float(cfg["dirichlet-alpha"]), int(cfg["seed"]))
    return list(parts[partition_id])


@functools.lru_cache(maxsize=8)
def _shape_model(spec_json: str) -> nn.Module:
    """The model architecture on the meta device: grid, patch size and ``draw_plan`` for free."""
    spec = json.loads(spec_json)
    kwargs = dict(spec["kwargs"])
    if spec.get("april") == "trained":
        kwargs["first_block"] = "april"
    with torch.device("meta"):
        return timm.create_model(spec["arch"], variant=spec["variant"], **kwargs)


def private_batch(run_config: Mapping[str, Any], partition_id: int, server_round: int,
                  num_partitions: Optional[int] = None) -> PrivateBatch:
    """The batch client ``partition_id`` trains on in ``server_round`` (1-based), and its shuffle.

    Images are drawn without replacement from seeded per-epoch permutations of the partition, so
    successive rounds walk through the whole partition. Settings b and c shuffle with ``gamma``
    using a generator seeded by (seed, partition, round); setting a does not shuffle.

    Args:
        num_partitions: number of clients (default: the config's ``num-partitions``).
    """
    cfg = resolve_config(run_config)
    if server_round < 1:
        raise ValueError(f"server rounds start at 1, got {server_round}")
    owned = partition_indices(cfg, partition_id, num_partitions)
    seed, B, n = int(cfg["seed"]), int(cfg["batch-size"]), len(owned)
    picks = []
    for k in range(B):
        pos = (server_round - 1) * B + k
        epoch = pos // n
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(stable_seed(seed, "batch", partition_id, epoch)))
        picks.append(owned[int(perm[pos % n])])
    data = private_image_set(cfg)
    index = torch.tensor(picks, dtype=torch.long)
    images, labels = data.images[index], data.labels[index]
    names = [data.names[i] for i in picks]
    if cfg["setting"] == "a":
        return PrivateBatch(images, labels, names, index, None, None, 0.0)
    shape = _shape_model(json.dumps(model_spec(cfg), sort_keys=True))
    gamma = float(cfg["gamma"])
    plan = shape.draw_plan(B, gamma=gamma, seed=stable_seed(seed, "shuffle", partition_id, server_round),
                           per_sample=bool(cfg["per-sample"]))
    return PrivateBatch(images, labels, names, index, plan, shape.shuffle_images(images, plan), gamma)


# ------------------------------------------------------------------------------------- compute
def load_global_model(cfg: Mapping[str, Any], state: Optional[Mapping[str, torch.Tensor]] = None,
                      device: Optional[torch.device] = None) -> nn.Module:
    """Build the run's model (seeded fresh weights or its checkpoint) and load ``state`` into it."""
    model = build_model(model_spec(cfg), device=device or "cpu")
    if state is not None:
        model.load_state_dict({k: v.to(device or "cpu") for k, v in state.items()}, strict=True)
    return model


def _normalize(model: nn.Module, images: torch.Tensor) -> torch.Tensor:
    mean, std = model_input_stats(model)
    mean_t = torch.tensor(mean, device=images.device, dtype=images.dtype).view(1, -1, 1, 1)
    std_t = torch.tensor(std, device=images.device, dtype=images.dtype).view(1, -1, 1, 1)
    return (images - mean_t) / std_t


def client_loss(model: nn.Module, batch: PrivateBatch, dal_weight: float = 0.0,
                device: Optional[torch.device] = None) -> torch.Tensor:
    """Cross-entropy of the model on the batch's model input (x or x~ with E_unk at the shuffled
    positions), plus ``dal_weight`` times the DAL loss on the unshuffled positions for ``mjp``."""
    device = device or next(model.parameters()).device
    x = _normalize(model, batch.model_input.to(device=device, dtype=next(model.parameters()).dtype))
    mask = None if batch.unk_mask is None else batch.unk_mask.to(device)
    logits = model(x, unk_mask=mask) if mask is not None else model(x)
    loss = F.cross_entropy(logits, batch.labels.to(device))
    if dal_weight and getattr(model, "dal_head", None) is not None:
        loss = loss + dal_weight * model.compute_dal_loss(None if mask is None else ~mask)
    return loss


def fedsgd_gradients(model: nn.Module, batch: PrivateBatch, dal_weight: float = 0.0,
                     device: Optional[torch.device] = None) -> tuple[dict[str, torch.Tensor], float]:
    """One batch's gradients by parameter name (FedSGD update), in eval mode so the gradient is a
    deterministic function of (weights, batch) that an attacker can model.

    Returns:
        (grads, loss): grads maps every trainable parameter name to a CPU float tensor of its
        shape (zeros where the loss does not reach it, e.g. E_unk in setting a); loss is a float.
    """
    model.eval()
    model.zero_grad(set_to_none=True)
    loss = client_loss(model, batch, dal_weight, device)
    loss.backward()
    grads = {name: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().cpu().clone()
             for name, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)
    return grads, float(loss.detach())


def fedavg_update(model: nn.Module, batch: PrivateBatch, local_steps: int, lr: float,
                  dal_weight: float = 0.0, device: Optional[torch.device] = None
                  ) -> tuple[dict[str, torch.Tensor], float]:
    """Weight delta after ``local_steps`` plain SGD steps on the private batch (FedAvg update).

    Every step uses the same batch (and the same shuffle), so the ground truth of the update is
    exactly :func:`private_batch`. The model is trained in place.

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
        loss = client_loss(model, batch, dal_weight, device)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    model.eval()
    delta = {n: (p.detach() - before[n]).cpu() for n, p in model.named_parameters() if p.requires_grad}
    return delta, sum(losses) / len(losses)


def local_update(cfg: Mapping[str, Any], state: Mapping[str, torch.Tensor], partition_id: int,
                 server_round: int, num_partitions: Optional[int] = None,
                 device: Optional[torch.device] = None) -> tuple[dict[str, torch.Tensor], float, PrivateBatch]:
    """A client's whole round: batch, model at ``state``, FedSGD gradients or FedAvg delta.

    Returns:
        (update, loss, batch).
    """
    cfg = resolve_config(cfg)
    device = device or pick_device(str(cfg["device"]))
    batch = private_batch(cfg, partition_id, server_round, num_partitions)
    model = _cached_model(json.dumps(model_spec(cfg), sort_keys=True), str(device), cfg["precision"])
    model.load_state_dict({k: v.to(device) for k, v in state.items()}, strict=True)
    if cfg["mode"] == "fedsgd":
        update, loss = fedsgd_gradients(model, batch, float(cfg["dal-weight"]), device)
    else:
        update, loss = fedavg_update(model, batch, int(cfg["local-steps"]), float(cfg["lr"]),
                                     float(cfg["dal-weight"]), device)
    return update, loss, batch


_models = threading.local()


def _cached_model(spec_json: str, device: str, precision: str = "float32") -> nn.Module:
    """One model per thread and spec: weights are always overwritten by the global state, only the
    architecture is reused (clients of the in-process engine run in threads)."""
    cache = getattr(_models, "cache", None)
    if cache is None or cache[0] != (spec_json, device, precision):
        model = build_model(json.loads(spec_json), device=device).to(getattr(torch, precision))
        cache = ((spec_json, device, precision), model)
        _models.cache = cache
    return cache[1]


@torch.no_grad()
def evaluate(model: nn.Module, images: torch.Tensor, labels: torch.Tensor,
             batch_size: int = 64) -> tuple[float, float]:
    """(mean cross-entropy, top-1 accuracy) of ``model`` on images [N, 3, H, W] in [0, 1]."""
    model.eval()
    device = next(model.parameters()).device
    total_loss, correct = 0.0, 0
    for start in range(0, len(images), batch_size):
        x = _normalize(model, images[start:start + batch_size].to(device))
        y = labels[start:start + batch_size].to(device)
        logits = model(x)
        total_loss += float(F.cross_entropy(logits, y, reduction="sum"))
        correct += int((logits.argmax(-1) == y).sum())
    return total_loss / len(images), correct / len(images)


def clone_state(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Detached CPU copy of a state dict."""
    return {k: v.detach().cpu().clone() for k, v in state.items()}
