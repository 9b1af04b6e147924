"""Accuracy and MJP consistency of a trained model:
``python -m fedmjp.evaluate --checkpoint PATH --data-path DIR_OR_TAR [--gamma G] [--gamma-sweep 0,0.1,...]``.

Metrics (docs/design.md, "MJP: selection, jigsaw, E_unk and DAL"), for each
image x and its MJP-shuffled x~ at ``gamma`` (block mask,
selected patches permuted among themselves; shuffled positions carry E_unk for unk variants):
- top1 / top1_shuffled: accuracy (percent) on x / on x~ (the benchmark's Acc. column: x for setting
  (a), x~ for (b)/(c));
- consistency: percent of images whose argmax is the same on x and x~;
- diff_norm: mean over images of ||cls(x) - cls(x~)||_2, cls = the final [CLS] embedding after the
  last norm (the head's input).
Each image gets its own mask (as the official script's batch of one); shuffles come from
``random.Random(f"{seed}:{gamma:.6f}")``, so results repeat for the same seed, gamma and batch size.
"""
from __future__ import annotations

import argparse
import csv
import json
import logging
import math
import random
import sys
from pathlib import Path
from typing import Iterable, Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader
from torchvision import datasets
from tqdm import tqdm

from fedmjp.text import escape_log_output
from .archives import resolve_data_path
from .data import rgb_loader
from .devices import resolve_device
from .factory import model_input
from .jigsaw import JigsawPlan, make_plan, shuffle_images
from .models import MJPVisionTransformer
from .trainconfig import MAX_BATCH, MAX_THREADS, MAX_WORKERS
from .train_data import build_transform, fixed_subset
from .trainconfig import config_from_dict
from .trainutils import autocast, model_from_checkpoint

_logger = logging.getLogger(__name__)

DEFAULT_SWEEP = (0.0, 0.1, 0.2, 0.27, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)


def plan_rng(seed: int, gamma: float) -> random.Random:
    """The shuffle RNG of one (seed, gamma) evaluation; independent of the other gammas of a sweep."""
    return random.Random(f"{seed}:{gamma:.6f}")


def draw_eval_plan(model: nn.Module, batch_size: int, gamma: float, rng: random.Random) -> JigsawPlan:
    """Per-image shuffle at ``gamma`` for an MJP model or any timm ViT with a ``patch_embed``."""
    if isinstance(model, MJPVisionTransformer):
        return model.draw_plan(batch_size, gamma=gamma, seed=rng, per_sample=True)
    grid = tuple(model.patch_embed.grid_size)
    return make_plan(batch_size, grid, gamma, rng, per_sample=True)


def cls_and_logits(model: nn.Module, images: torch.Tensor,
                   plan: Optional[JigsawPlan] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Final [CLS] embedding [B, D] (after the last norm; the head's input) and logits [B, K].

    With a plan, the model sees x~: MJP models permute tokens and put E_unk at shuffled positions
    (unk variants); other timm ViTs get the pixel-shuffled image.
    """
    if isinstance(model, MJPVisionTransformer):
        feats = model.forward_features(images, plan=plan)
    else:
        if plan is not None:
            images = shuffle_images(images, plan, int(model.patch_embed.patch_size[0]))
        feats = model.forward_features(images)
    cls = model.forward_head(feats, pre_logits=True)
    return cls, model.head(model.head_drop(cls))


@torch.no_grad()
def evaluate_gammas(model: nn.Module, loader: Iterable, gammas: Sequence[float], seed: int = 0,
                    device: Optional[torch.device] = None, amp_dtype: Optional[torch.dtype] = None,
                    max_batches: Optional[int] = None, progress: bool = False,
                    per_image: bool = False) -> list[dict]:
    """Top-1 on x, and top-1 / consistency / diff_norm on x~ for each gamma (one clean pass).

    Args:
        model: a timm ViT (MJP or not); evaluated in eval mode and restored afterwards.
        loader: yields (images [B, 3, H, W], labels [B]).
        gammas: inference shuffle ratios in [0, 1].
        per_image: also return each image's outcome (for intervals over the images).
    Returns:
        one dict per gamma: {"gamma", "seed", "images", "top1", "top1_shuffled", "consistency",
        "diff_norm"}; accuracies and consistency in percent, diff_norm in embedding units. With
        ``per_image``, each dict also has "per_image": numpy arrays of length ``images`` in loader
        order, "correct" and "correct_shuffled" (bool: prediction on x / x~ is the label), "agree"
        (bool: same prediction on x and x~) and "diff_norm" (float64), whose means give the figures.
    """
    device = device or next(model.parameters()).device
    was_training = model.training
    model.eval()
    rngs = [plan_rng(seed, g) for g in gammas]
    n, correct = 0, 0
    acc = [{"correct": 0, "agree": 0, "norm": 0.0} for _ in gammas]
    kept: list[dict[str, list[torch.Tensor]]] = [{"correct_shuffled": [], "agree": [], "diff_norm": []} for _ in gammas]
    kept_clean: list[torch.Tensor] = []
    for i, (images, labels) in enumerate(tqdm(loader, desc="evaluate", disable=None if progress else True, leave=False)):
        if max_batches is not None and i >= max_batches:
            break
        images, labels = images.to(device), labels.to(device)
        with autocast(device, amp_dtype):
            cls0, logits0 = cls_and_logits(model, images)
        pred0 = logits0.argmax(dim=1)
        n += labels.shape[0]
        correct += int((pred0 == labels).sum())
        if per_image:
            kept_clean.append((pred0 == labels).cpu())
        for gamma, rng, a, k in zip(gammas, rngs, acc, kept):
            plan = draw_eval_plan(model, images.shape[0], gamma, rng).to(device)
            with autocast(device, amp_dtype):
                cls1, logits1 = cls_and_logits(model, images, plan)
            pred1 = logits1.argmax(dim=1)
            a["correct"] += int((pred1 == labels).sum())
            a["agree"] += int((pred1 == pred0).sum())
            norms = (cls0.float() - cls1.float()).norm(dim=1)
            a["norm"] += float(norms.sum())
            if per_image:
                k["correct_shuffled"].append((pred1 == labels).cpu())
                k["agree"].append((pred1 == pred0).cpu())
                k["diff_norm"].append(norms.double().cpu())
    model.train(was_training)
    if n == 0:
        raise ValueError("evaluation loader yielded no images")
    rows = [{"gamma": float(g), "seed": seed, "images": n, "top1": 100.0 * correct / n,
             "top1_shuffled": 100.0 * a["correct"] / n, "consistency": 100.0 * a["agree"] / n,
             "diff_norm": a["norm"] / n} for g, a in zip(gammas, acc)]
    if per_image:
        clean = torch.cat(kept_clean).numpy()
        for row, k in zip(rows, kept):
            row["per_image"] = {"correct": clean, **{key: torch.cat(v).numpy() for key, v in k.items()}}
    return rows


def evaluate_model(model: nn.Module, loader: Iterable, gamma: float = 0.27, seed: int = 0,
                   device: Optional[torch.device] = None, amp_dtype: Optional[torch.dtype] = None,
                   max_batches: Optional[int] = None, progress: bool = False) -> dict:
    """Top-1, Consistency and Diff. Norm at one inference ``gamma`` (see :func:`evaluate_gammas`)."""
    return evaluate_gammas(model, loader, [gamma], seed, device, amp_dtype, max_batches, progress)[0]


@torch.no_grad()
def loss_and_top1(model: nn.Module, images: torch.Tensor, labels: torch.Tensor,
                  batch_size: int = 64) -> tuple[float, float]:
    """(mean cross-entropy, top-1 accuracy in [0, 1]) of ``model`` on in-memory images
    [N, 3, H, W] in [0, 1] (normalised here as the model expects) with labels [N]; no shuffle.
    The federated server's evaluation and the benchmark's utility use it on the public split."""
    model.eval()
    device = next(model.parameters()).device
    total_loss, correct = 0.0, 0
    for start in range(0, len(images), batch_size):
        x = model_input(model, images[start:start + batch_size].to(device))
        y = labels[start:start + batch_size].to(device)
        logits = model(x)
        total_loss += float(F.cross_entropy(logits, y, reduction="sum"))
        correct += int((logits.argmax(-1) == y).sum())
    return total_loss / len(images), correct / len(images)


def write_sweep(rows: list[dict], out_dir: str | Path, title: str = "") -> tuple[Path, Path]:
    """Write ``gamma_sweep.csv`` and ``gamma_sweep.png`` (accuracy and consistency vs. gamma)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    csv_path, png_path = out / "gamma_sweep.csv", out / "gamma_sweep.png"
    with open(csv_path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    g = [r["gamma"] for r in rows]
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.plot(g, [r["top1_shuffled"] for r in rows], "o-", label="top-1 on x~")
    ax.plot(g, [r["consistency"] for r in rows], "s--", label="consistency")
    ax.axhline(rows[0]["top1"], color="grey", lw=0.8, label="top-1 on x")
    ax.set_xlabel("inference gamma")
    ax.set_ylabel("percent")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)
    plt.close(fig)
    return csv_path, png_path


def build_eval_loader(state_config: dict, data_path: str, split: str = "val", batch_size: int = 128,
                      num_workers: int = 2, max_images: Optional[int] = None, seed: int = 0,
                      data_cache: Optional[str] = None) -> DataLoader:
    """Evaluation loader with the checkpoint's evaluation transform over ``<root>/<split>``;
    ``max_images`` takes a fixed random subset."""
    cfg = config_from_dict(state_config)
    root = resolve_data_path(data_path, data_cache or cfg.data_cache)
    ds = datasets.ImageFolder(str(root / split), loader=rgb_loader, transform=build_transform(cfg, is_train=False))
    return DataLoader(fixed_subset(ds, max_images, seed), batch_size=batch_size, shuffle=False, num_workers=num_workers)


#: Exit status of ``python -m fedmjp.evaluate`` for a bad argument, checkpoint, data path or output
#: dir (as argparse's for a bad argument); nothing is written then.
EXIT_BAD_INPUT = 2


def _gamma(text: str) -> float:
    """A shuffle ratio in [0, 1]."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {text!r}")
    return value


#: At most this many gammas in --gamma-sweep (each is a pass over the split).
MAX_GAMMAS = 101


def _floats(text: str) -> list[float]:
    values = text.split(",")
    if len(values) > MAX_GAMMAS:
        raise argparse.ArgumentTypeError(f"{len(values):,} values; at most {MAX_GAMMAS} (each is a pass over the split)")
    return [_gamma(v) for v in values if v.strip()]


def _count(minimum: int, maximum: int = 10**9):
    """An argparse type: an integer in [``minimum``, ``maximum``]."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text[:40]!r}") from None
        if not minimum <= value <= maximum:
            raise argparse.ArgumentTypeError(f"must be in [{minimum}, {maximum:,}], got {value}")
        return value
    parse.__name__ = f"integer in [{minimum}, {maximum}]"
    return parse


def _split(text: str) -> str:
    """An argparse type: the name of a folder inside the data root (never a path out of it)."""
    if not text or text in (".", "..") or "/" in text or "\\" in text:
        raise argparse.ArgumentTypeError(f"must be a folder name inside --data-path (val, train), got {text[:40]!r}")
    return text


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True, help="last.pth written by fedmjp.train")
    p.add_argument("--data-path", required=True, help="ImageFolder root (or .tar.gz) with the split")
    p.add_argument("--split", type=_split, default="val")
    p.add_argument("--gamma", type=_gamma, default=0.27, help="inference gamma of the main result")
    p.add_argument("--gamma-sweep", type=_floats, default=None,
                   help=f"comma-separated gammas for the sweep (e.g. {','.join(map(str, DEFAULT_SWEEP))})")
    p.add_argument("--seed", type=_count(0, 2**32 - 1), default=0)
    p.add_argument("--batch-size", type=_count(1, MAX_BATCH), default=128)
    p.add_argument("--num-workers", type=_count(0, MAX_WORKERS), default=2)
    p.add_argument("--max-images", type=_count(1), default=None, help="fixed random subset of the split")
    p.add_argument("--device", default="auto")
    p.add_argument("--threads", type=_count(1, MAX_THREADS), default=None)
    p.add_argument("--output-dir", default=None,
                   help="default: <checkpoint dir>/eval, or runs/eval/<name> for a .safetensors weights file")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    escape_log_output()  # untrusted names in log records are printed escaped
    if args.threads:
        torch.set_num_threads(args.threads)
    ckpt = Path(args.checkpoint)
    # shipped weights (checkpoints/*.safetensors) keep their folder clean: results go under runs/
    default_out = Path("runs") / "eval" / ckpt.stem if ckpt.suffix == ".safetensors" else ckpt.parent / "eval"
    out = Path(args.output_dir) if args.output_dir else default_out
    try:  # every input checked before the evaluation runs and anything is written
        model, state, loader, device = _open_inputs(args, out)
    except ValueError as err:  # ConfigError, ArchiveError and the checks' own messages
        print(f"error: {' '.join(str(err).splitlines())}", file=sys.stderr)
        return EXIT_BAD_INPUT
    gammas = [args.gamma] + [g for g in (args.gamma_sweep or []) if g != args.gamma]
    rows = evaluate_gammas(model, loader, gammas, args.seed, device, progress=True)
    out.mkdir(parents=True, exist_ok=True)
    main_row = {**rows[0], "checkpoint": str(args.checkpoint), "epoch": state.get("epoch")}
    with open(out / "eval.json", "w") as f:
        json.dump(strict_json(main_row), f, indent=1, allow_nan=False)
    _logger.info("gamma %.2f: top1 %.2f  top1(x~) %.2f  consistency %.2f  diff_norm %.4f", rows[0]["gamma"],
                 rows[0]["top1"], rows[0]["top1_shuffled"], rows[0]["consistency"], rows[0]["diff_norm"])
    if args.gamma_sweep:
        sweep = sorted((r for r in rows if r["gamma"] in args.gamma_sweep), key=lambda r: r["gamma"])
        csv_path, png_path = write_sweep(sweep, out, title=f"{Path(args.checkpoint).parent.name}")
        _logger.info("sweep written to %s and %s", csv_path, png_path)
    return 0


def strict_json(row: dict) -> dict:
    """``row`` as strict JSON values: a NaN or infinite number is written ``null`` with
    ``<key>_raw`` (``"nan"``, ``"inf"``, ``"-inf"``) beside it, like the benchmark's results rows."""
    out: dict = {}
    for key, value in row.items():
        if isinstance(value, float) and not math.isfinite(value):
            out[key], out[f"{key}_raw"] = None, str(value)
        else:
            out[key] = value
    return out


def _open_inputs(args: argparse.Namespace, out: Path) -> tuple[nn.Module, dict, DataLoader, torch.device]:
    """The model, its checkpoint state, the evaluation loader and the device; the output dir checked.

    Raises:
        ValueError: a device this machine lacks, a checkpoint that is missing or not fedmjp.train's,
            a data path or split without class folders, an output dir that cannot be written.
    """
    import pickle

    from .checkpoint import load_error_text
    from .config import ConfigError
    from .trainutils import check_output_dir

    device = resolve_device(args.device)
    if not Path(args.checkpoint).is_file():
        raise ConfigError(f"--checkpoint {args.checkpoint}: no such file (a last.pth of fedmjp.train or a "
                          "checkpoints/*.safetensors weights file)")
    try:
        model, state = model_from_checkpoint(args.checkpoint, "cpu")
    except (pickle.UnpicklingError, RuntimeError, KeyError, TypeError, EOFError, OSError) as err:
        raise ConfigError(f"--checkpoint {args.checkpoint}: cannot be read: {load_error_text(err)}") from None
    check_output_dir(out, "--output-dir")
    try:
        loader = build_eval_loader(state["config"], args.data_path, args.split, args.batch_size, args.num_workers,
                                   args.max_images, args.seed)
    except FileNotFoundError as err:  # no such data path, split or class folder
        raise ConfigError(f"--data-path {args.data_path} (split {args.split!r}): {err}") from None
    return model.to(device), state, loader, device


if __name__ == "__main__":
    sys.exit(main())
