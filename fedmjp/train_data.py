"""Training/validation data for central training: ImageFolder + timm transforms, samplers, Mixup.

The ImageFolder root (a folder or an extracted ``.tar.gz``) comes from :mod:`fedmjp.archives`.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

import torch
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD, Mixup, create_transform
from timm.data.distributed_sampler import RepeatAugSampler
from torch.utils.data import DataLoader, Dataset, RandomSampler, SequentialSampler, Subset
from torchvision import datasets, transforms

from .data import rgb_loader
from .trainconfig import TrainConfig

class _AtLeastOneBit:
    """Wrap a posterize level function so that it keeps at least 1 bit.

    timm's ``inc1`` RandAugment maps magnitude 10 (reached when the ``mstd`` noise is clipped) to
    ``posterize(img, 0)``, a black image, which Pillow >= 11 refuses with a ValueError; 1 bit is the
    strongest posterize it accepts.
    """

    def __init__(self, level_fn: Callable) -> None:
        self.level_fn = level_fn

    def __call__(self, level: float, hparams: dict) -> tuple:
        bits, *rest = self.level_fn(level, hparams)
        return (max(1, bits), *rest)


def _posterize_at_least_one_bit(tf: transforms.Compose) -> None:
    for t in tf.transforms:
        for op in getattr(t, "ops", ()):  # RandAugment / AutoAugment op lists
            if getattr(op, "name", "").startswith("Posterize") and not isinstance(op.level_fn, _AtLeastOneBit):
                op.level_fn = _AtLeastOneBit(op.level_fn)


def build_transform(cfg: TrainConfig, is_train: bool) -> transforms.Compose:
    """timm's DeiT transform: RandAugment, colour jitter, random erasing for training.

    At <= 32 px the random-resized crop becomes RandomCrop(padding=4) and evaluation uses no
    resize/crop, as the official MJP code does for CIFAR. Output: [3, img_size, img_size] float,
    ImageNet-normalised.
    """
    small = cfg.img_size <= 32
    if is_train:
        tf = create_transform(
            input_size=cfg.img_size, is_training=True,
            color_jitter=cfg.color_jitter if cfg.color_jitter > 0 else None,
            auto_augment=cfg.auto_augment or None, interpolation=cfg.interpolation,
            scale=(cfg.crop_min, 1.0), re_prob=cfg.reprob, re_mode=cfg.remode, re_count=1,
        )
        if small:
            tf.transforms[0] = transforms.RandomCrop(cfg.img_size, padding=4)
        _posterize_at_least_one_bit(tf)
        return tf
    if small:
        return transforms.Compose([
            transforms.Resize((cfg.img_size, cfg.img_size)), transforms.ToTensor(),
            transforms.Normalize(IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD),
        ])
    return create_transform(input_size=cfg.img_size, is_training=False, interpolation=cfg.interpolation,
                            crop_pct=224 / 256)


def fixed_subset(ds: Dataset, n: Optional[int], seed: int) -> Dataset:
    """A fixed random subset of ``n`` items (the same on every rank and every run)."""
    if n is None or n >= len(ds):
        return ds
    g = torch.Generator().manual_seed(seed)
    idx = torch.randperm(len(ds), generator=g)[:n].sort().values.tolist()
    return Subset(ds, idx)


def build_datasets(cfg: TrainConfig, root: Path) -> tuple[Dataset, Dataset, int]:
    """(train, val, num_classes) from ``root/train`` and ``root/val``."""
    train = datasets.ImageFolder(str(root / "train"), loader=rgb_loader, transform=build_transform(cfg, True))
    val = datasets.ImageFolder(str(root / "val"), loader=rgb_loader, transform=build_transform(cfg, False))
    if train.classes != val.classes:
        raise ValueError(f"train/ and val/ of {root} have different class folders")
    return (fixed_subset(train, cfg.train_subset, cfg.seed), fixed_subset(val, cfg.val_subset, cfg.seed + 1),
            len(train.classes))


def build_loaders(cfg: TrainConfig, train: Dataset, val: Dataset, rank: int = 0, world_size: int = 1,
                  pin_memory: bool = False) -> tuple[DataLoader, DataLoader]:
    """Training loader (repeated augmentation when distributed, drop_last) and this rank's shard of
    the validation set (every ``world_size``-th image, no padding: counts can be summed exactly)."""
    if world_size > 1:
        if cfg.aug_repeats > 1:
            sampler = RepeatAugSampler(train, num_replicas=world_size, rank=rank, num_repeats=cfg.aug_repeats)
        else:
            sampler = torch.utils.data.DistributedSampler(train, world_size, rank, shuffle=True, seed=cfg.seed)
    else:
        # timm applies repeated augmentation only across processes; one process samples plainly.
        sampler = RandomSampler(train)
    drop_last = len(sampler) >= cfg.batch_size
    train_loader = DataLoader(train, batch_size=cfg.batch_size, sampler=sampler, num_workers=cfg.num_workers,
                              pin_memory=pin_memory, drop_last=drop_last,
                              persistent_workers=cfg.num_workers > 0)
    shard = Subset(val, list(range(rank, len(val), world_size))) if world_size > 1 else val
    val_loader = DataLoader(shard, batch_size=cfg.batch_size, sampler=SequentialSampler(shard),
                            num_workers=cfg.num_workers, pin_memory=pin_memory)
    return train_loader, val_loader


def build_mixup(cfg: TrainConfig, num_classes: int) -> Optional[Mixup]:
    """timm Mixup/CutMix (label smoothing folded in), or None when both are off."""
    if cfg.mixup <= 0 and cfg.cutmix <= 0:
        return None
    return Mixup(mixup_alpha=cfg.mixup, cutmix_alpha=cfg.cutmix, prob=cfg.mixup_prob,
                 switch_prob=cfg.mixup_switch_prob, mode=cfg.mixup_mode,
                 label_smoothing=cfg.smoothing, num_classes=num_classes)
