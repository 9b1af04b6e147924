"""Training throughput: our MJP training step vs. a plain timm DeiT step, same augmentations.

Both go through ``fedmjp.engine.train_one_epoch`` (timm RandAugment + random erasing in the
loader, timm Mixup/CutMix, SoftTargetCrossEntropy, AdamW, cosine schedule, grad clip); the MJP model
additionally draws a block mask, permutes tokens, puts E_unk at shuffled positions and adds the DAL
loss on every step (``shuffle_prob=1``). Rounds alternate between the two models and the median is
reported, so load from other processes hits both alike. ``--no-aug`` measures the model step alone.

    python bench/train_throughput.py                     # 32 px, patch 4, ViT-Ti width, depth 4 (CPU, ~1 min)
    python bench/train_throughput.py --img-size 224 --patch-size 16 --depth 12 --batch-size 128 --device cuda
"""
from __future__ import annotations

import argparse
import logging
import statistics
import sys
from pathlib import Path

import numpy as np
import timm
import torch
from PIL import Image
from timm.loss import SoftTargetCrossEntropy
from timm.optim import create_optimizer_v2
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import fedmjp  # noqa: E402,F401  (registers mjp_* models)
from fedmjp.engine import StepContext, TrainStep, train_one_epoch  # noqa: E402
from fedmjp.train_data import build_mixup, build_transform  # noqa: E402
from fedmjp.trainconfig import TrainConfig  # noqa: E402
from fedmjp.devices import resolve_device  # noqa: E402
from fedmjp.trainutils import DistInfo, amp_dtype  # noqa: E402

_logger = logging.getLogger("train_throughput")


class RandomImages(Dataset):
    """``n`` random RGB PIL images (made once), passed through ``transform``; labels cycle over classes."""

    def __init__(self, n: int, size: int, num_classes: int, transform) -> None:
        rng = np.random.default_rng(0)
        self.images = [Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)) for _ in range(n)]
        self.num_classes, self.transform = num_classes, transform

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int):
        return self.transform(self.images[i]), i % self.num_classes


class PreAugmented(Dataset):
    """Fixed tensors (``--no-aug``): the model step without augmentation cost."""

    def __init__(self, n: int, size: int, num_classes: int) -> None:
        self.x = torch.randn(n, 3, size, size)
        self.num_classes = num_classes

    def __len__(self) -> int:
        return self.x.shape[0]

    def __getitem__(self, i: int):
        return self.x[i], i % self.num_classes


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--img-size", type=int, default=32)
    p.add_argument("--patch-size", type=int, default=4)
    p.add_argument("--embed-dim", type=int, default=192)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--heads", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--steps", type=int, default=8, help="optimizer steps per timed round")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds per model (median reported)")
    p.add_argument("--gamma", type=float, default=0.27)
    p.add_argument("--per-sample", action="store_true", help="one mask per image (default: per batch)")
    p.add_argument("--no-aug", action="store_true", help="pre-made tensors, no RandAugment/erasing/Mixup")
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--device", default="auto")
    p.add_argument("--amp", default="auto")
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    dtype = amp_dtype(args.amp, device)
    cfg = TrainConfig(img_size=args.img_size, batch_size=args.batch_size)
    num_classes = 10
    n = args.batch_size * args.steps
    data = (PreAugmented(n, args.img_size, num_classes) if args.no_aug
            else RandomImages(n, args.img_size, num_classes, build_transform(cfg, is_train=True)))
    loader = DataLoader(data, batch_size=args.batch_size, shuffle=True, num_workers=args.workers, drop_last=True)
    size = dict(img_size=args.img_size, patch_size=args.patch_size, embed_dim=args.embed_dim, depth=args.depth,
                num_heads=args.heads, num_classes=num_classes, drop_path_rate=0.1)
    models = {
        "timm deit_tiny_patch16_224": timm.create_model("deit_tiny_patch16_224", **size),
        "fedmjp mjp (shuffle+E_unk+DAL)": timm.create_model(
            "mjp_deit_tiny_patch16_224", variant="mjp", gamma=args.gamma, shuffle_prob=1.0,
            per_sample=args.per_sample, seed=0, **size),
    }
    info = DistInfo(device=device)
    contexts = {}
    for name, model in models.items():
        model.to(device)
        opt = create_optimizer_v2(model, opt="adamw", lr=1e-4, weight_decay=0.05)
        contexts[name] = StepContext(
            optimizer=opt, criterion=SoftTargetCrossEntropy(), device=device, info=info,
            mixup=None if args.no_aug else build_mixup(cfg, num_classes), amp_dtype=dtype,
            scaler=torch.amp.GradScaler(device.type) if dtype == torch.float16 else None,
            clip_grad=5.0, dal_lambda=0.01, shuffle=True, progress=False)
        if args.no_aug:
            contexts[name].criterion = torch.nn.CrossEntropyLoss()
    _logger.info("device %s, amp %s, %d px, patch %d, D=%d, depth %d, batch %d, %d steps x %d rounds, aug %s",
                 device, dtype, args.img_size, args.patch_size, args.embed_dim, args.depth, args.batch_size,
                 args.steps, args.rounds, not args.no_aug)
    rates: dict[str, list[float]] = {name: [] for name in models}
    for r in range(args.rounds + 1):  # round 0 warms up (allocator, autotuning) and is not counted
        for name, model in models.items():
            stats, _ = train_one_epoch(TrainStep(model), loader, contexts[name], epoch=r, global_step=0)
            if device.type == "cuda":
                torch.cuda.synchronize()
            if r > 0:
                rates[name].append(stats["images_per_s"])
    med = {name: statistics.median(v) for name, v in rates.items()}
    for name, v in med.items():
        _logger.info("%-32s %9.1f images/s  (rounds: %s)", name, v, ", ".join(f"{x:.1f}" for x in rates[name]))
    base, ours = med.values()
    _logger.info("ratio fedmjp/timm: %.3f", ours / base)
    return 0


if __name__ == "__main__":
    sys.exit(main())
