"""Which private images each client owns, and the batch it trains on in each round (plain PyTorch).

Everything here is a deterministic function of the run config, the partition id and the round
number, so the benchmark rebuilds a client's private batch (the ground truth x and x~) by calling
:func:`private_batch` itself; the attack code never reads it. :func:`public_eval_set` is the
complement: the images of the same source that no client owns, for the server's evaluation.
"""
from __future__ import annotations

import functools
import hashlib
import json
import warnings
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn as nn

from fedmjp.data import ImageSet, load_images
from fedmjp.factory import create_model, spec_kwargs
from fedmjp.jigsaw import JigsawPlan

from .runconfig import RunConfig


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


def stable_seed(*parts: Any) -> int:
    """A 62-bit seed from any printable parts; stable across processes (unlike ``hash``)."""
    digest = hashlib.sha256("/".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 2


# Cached per process: every client of every round, and the benchmark's ground-truth lookup, ask for
# the same image set and the same partitions.
@functools.lru_cache(maxsize=4)
def _image_set(source: str, size: int, num_images: int, num_classes: int) -> ImageSet:
    return load_images(source, size, num_images or None, num_classes)


def private_image_set(cfg: RunConfig) -> ImageSet:
    """The whole private image set the clients' partitions are cut from (cached per process)."""
    return _image_set(cfg.images, cfg.image_size, cfg.num_images, cfg.num_classes)


def public_eval_set(cfg: RunConfig) -> ImageSet:
    """The server's evaluation images: the images of the source after the first ``num-images``
    (the private set), which no client owns; labels as the private set's ((sorted index) %
    num-classes).

    Raises:
        ValueError: the private set takes every image of the source (``num-images`` 0 or too
            large), so no public split is left.
    """
    n_private = cfg.num_images
    full = load_images(cfg.images, cfg.image_size, None, cfg.num_classes)
    if n_private <= 0 or n_private >= len(full):
        raise ValueError(f"server-eval needs a public split, but the private set (num-images={n_private or 'all'}) "
                         f"takes all {len(full)} images of {cfg.images!r}; lower num-images or set "
                         "server-eval=false")
    keep = torch.arange(n_private, len(full))
    return ImageSet(full.images[keep], full.labels[keep], [full.names[i] for i in keep.tolist()])


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


def partition_indices(cfg: RunConfig, partition_id: int,
                      num_partitions: Optional[int] = None) -> list[int]:
    """Positions in the private image set owned by ``partition_id`` (IID or Dirichlet by label).

    Raises:
        ValueError: bad partition id, or more partitions than images.
    """
    n_parts = int(num_partitions or cfg.num_partitions)
    if not 0 <= partition_id < n_parts:
        raise ValueError(f"partition id {partition_id} outside [0, {n_parts})")
    labels = tuple(private_image_set(cfg).labels.tolist())
    if len(labels) < n_parts:
        raise ValueError(f"{len(labels)} private images cannot be split into {n_parts} partitions; "
                         "raise num-images or lower the number of clients")
    parts = _partitions(labels, n_parts, cfg.partitioner, cfg.dirichlet_alpha, cfg.seed)
    return list(parts[partition_id])


@functools.lru_cache(maxsize=8)
def _shape_model(spec_json: str) -> nn.Module:
    """The model architecture on the meta device: grid, patch size and ``draw_plan`` for free
    (no weights are allocated, no checkpoint is read)."""
    spec = json.loads(spec_json)
    with torch.device("meta"):
        return create_model(spec["arch"], **spec_kwargs(spec))


def private_batch(cfg: RunConfig, partition_id: int, server_round: int,
                  num_partitions: Optional[int] = None) -> PrivateBatch:
    """The batch client ``partition_id`` trains on in ``server_round`` (1-based), and its shuffle.

    Images are drawn without replacement from seeded per-epoch permutations of the partition, so
    successive rounds walk through the whole partition. Settings b and c shuffle with ``gamma``
    using a generator seeded by (seed, partition, round); setting a does not shuffle.

    Args:
        num_partitions: number of clients (default: the config's ``num-partitions``).
    """
    if server_round < 1:
        raise ValueError(f"server rounds start at 1, got {server_round}")
    owned = partition_indices(cfg, partition_id, num_partitions)
    seed, B, n = cfg.seed, cfg.batch_size, len(owned)
    if B > n:  # a batch of distinct images (more would repeat them, and multiply the update's memory)
        raise ValueError(f"client {partition_id} holds {n} image(s), fewer than batch-size {B}; lower "
                         "batch-size, add images or use fewer (or IID) partitions")
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
    if cfg.setting == "a":
        return PrivateBatch(images, labels, names, index, None, None, 0.0)
    shape = _shape_model(json.dumps(cfg.model_spec(), sort_keys=True))
    gamma = cfg.gamma
    plan = shape.draw_plan(B, gamma=gamma, seed=stable_seed(seed, "shuffle", partition_id, server_round),
                           per_sample=cfg.per_sample)
    return PrivateBatch(images, labels, names, index, plan, shape.shuffle_images(images, plan), gamma)
