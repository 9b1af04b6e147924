"""Training/validation data for central training: ImageFolder + timm transforms, samplers, Mixup.

``data_path`` is an ImageFolder root holding ``train/`` and ``val/`` (ImageNet layout), a folder
that contains exactly one such root (``cifar10/`` inside an extracted archive), or a ``.tar.gz`` /
``.tgz`` / ``.tar`` of one, which is extracted once into a cache folder with a marker file so that
re-runs skip the extraction.
"""
from __future__ import annotations

import hashlib
import logging
import lzma
import os
import shutil
import tarfile
import zlib
from pathlib import Path
from typing import Callable, Optional

import torch
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD, Mixup, create_transform
from timm.data.distributed_sampler import RepeatAugSampler
from torch.utils.data import DataLoader, Dataset, RandomSampler, SequentialSampler, Subset
from torchvision import datasets, transforms

from . import datadir
from .data import rgb_loader
from .trainconfig import TrainConfig

_logger = logging.getLogger(__name__)

ARCHIVE_SUFFIXES = (".tar.gz", ".tgz", ".tar")
_MARKER = ".fedmjp_extracted"


def default_cache_dir() -> Path:
    """``$FEDMJP_CACHE`` or ``~/.cache/fedmjp``; datasets go to its ``data/`` folder."""
    return Path(os.environ.get("FEDMJP_CACHE", Path.home() / ".cache" / "fedmjp"))


class ArchiveError(ValueError):
    """A dataset archive or cache folder that cannot be used: an unsafe member (``..``, an absolute
    path, a link out of the archive, a device file), not a readable tar file, no ``train/`` folder,
    or a cache location that is not a writable folder."""


def _find_imagefolder_root(path: Path) -> Path:
    if (path / "train").is_dir():
        return path
    subdirs = [d for d in sorted(path.iterdir()) if d.is_dir() and (d / "train").is_dir()]
    if len(subdirs) != 1:
        raise FileNotFoundError(f"{path} has no train/ folder (nor exactly one sub-folder with one)")
    return subdirs[0]


def _member_filter(member: tarfile.TarInfo, dest: str) -> tarfile.TarInfo:
    """tarfile's ``data`` filter (no links out of the destination or to absolute paths, no device
    files, no set-uid bits), and absolute or ``..`` member names refused rather than rewritten."""
    name = member.name.replace("\\", "/")
    if name.startswith("/") or ".." in name.split("/"):
        raise tarfile.OutsideDestinationError(member, os.path.join(dest, name))
    return tarfile.data_filter(member, dest)


def extract_archive(archive: Path, cache_dir: Optional[Path] = None) -> Path:
    """Extract ``archive`` once under ``cache_dir`` and return the extraction folder.

    The folder name carries a hash of the archive's path, size and mtime, so a changed archive gets a
    fresh folder. Extraction goes to a temporary sibling that is renamed into place once it holds a
    ``train/`` folder, and a marker file is written last: an interrupted extraction is never mistaken
    for a finished one, and a failed one leaves nothing behind. Members are filtered
    (:func:`_member_filter`): an archive with an unsafe member is refused as a whole.

    Raises:
        ArchiveError: an unsafe member, not a tar archive, no ``train/`` folder, or the cache
            folder cannot be created.
    """
    archive = archive.resolve()
    st = archive.stat()
    key = hashlib.sha1(f"{archive}:{st.st_size}:{int(st.st_mtime)}".encode()).hexdigest()[:10]
    stem = archive.name
    for suffix in ARCHIVE_SUFFIXES:
        stem = stem[: -len(suffix)] if stem.endswith(suffix) else stem
    root = Path(cache_dir or default_cache_dir() / "data") / f"{stem}-{key}"
    if (root / _MARKER).exists():
        return root
    try:
        root.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ArchiveError(f"cannot create the dataset cache folder {root.parent} ({err.strerror or err}); set "
                           "FEDMJP_CACHE to a writable folder") from err
    tmp = root.parent / f".{root.name}.tmp{os.getpid()}"
    _logger.info("extracting %s to %s (once)", archive, root)
    try:
        try:
            with tarfile.open(archive) as tar:
                tar.extractall(tmp, filter=_member_filter)
        except tarfile.FilterError as err:
            raise ArchiveError(f"dataset archive {archive} holds an unsafe member ({err}); refused, nothing of it "
                               "is kept") from err
        except (tarfile.TarError, EOFError, zlib.error, lzma.LZMAError, OSError) as err:
            raise ArchiveError(f"{archive} is not a readable tar archive ({' '.join(str(err).split())[:200]}); "
                               f"pass a {'/'.join(ARCHIVE_SUFFIXES)} of a folder with train/ and val/") from err
        try:
            _find_imagefolder_root(tmp)
        except (FileNotFoundError, OSError) as err:
            raise ArchiveError(f"dataset archive {archive} holds no train/ folder (nor one folder with train/ "
                               "and val/ inside); pack the ImageFolder layout: train/<class>/..., "
                               "val/<class>/...") from err
        if (root / _MARKER).exists():  # a concurrent run finished first
            return root
        if root.exists():  # a stale folder from an interrupted run (no marker)
            shutil.rmtree(root)
        tmp.rename(root)
        (root / _MARKER).write_text(str(archive) + "\n")
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return root


def resolve_data_path(data_path: str | Path, cache_dir: Optional[str | Path] = None) -> Path:
    """ImageFolder root (with ``train/`` and ``val/``) for a folder or an archive path; a path that
    starts with ``$FEDMJP_DATA`` is read from the data folder (:mod:`fedmjp.datadir`)."""
    path = Path(datadir.expand(str(data_path), "the data path"))
    if not path.exists():
        raise FileNotFoundError(f"data path {path} does not exist")
    if path.is_file():
        if not path.name.endswith(ARCHIVE_SUFFIXES):
            raise ValueError(f"{path} is a file but not a {'/'.join(ARCHIVE_SUFFIXES)} archive")
        path = extract_archive(path, Path(cache_dir) if cache_dir else None)
    return _find_imagefolder_root(path)


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
            re_prob=cfg.reprob, re_mode=cfg.remode, re_count=1,
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
