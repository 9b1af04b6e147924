"""Attention sharpness per block: fresh weights vs trained checkpoints, on real validation images.

For every block, the attention rows softmax(q k^T / sqrt(d)) of every head and token are read off
the block's input (a forward pre-hook on ``block.attn``; the same q, k the block computes) and
summarised over heads, tokens and images:

- entropy: mean normalised entropy of a row, H(row) / log T (1.0 = uniform over the T tokens);
- max x T: mean largest weight of a row times T (1.0 = uniform; T = 65 at 32 px, patch 4).

    python bench/attention_entropy.py --checkpoint checkpoints/cifar_deit.safetensors \\
        --checkpoint checkpoints/cifar_deit_mjp.safetensors --data-path $FEDMJP_DATA/cifar10.tar.gz --images 64

The fresh model of each checkpoint is its architecture initialised with seed 0. Prints a markdown
table (one row per model and block) and writes it as JSON with ``--out``.
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import sys
from pathlib import Path

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fedmjp.evaluate import build_eval_loader  # noqa: E402
from fedmjp.factory import create_model  # noqa: E402
from fedmjp.trainutils import model_from_checkpoint  # noqa: E402

_logger = logging.getLogger("attention_entropy")


def _attention_rows(attn: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Attention probabilities [B, heads, T, T] of a timm ``Attention`` module on its input ``x``."""
    b, t, _ = x.shape
    qkv = attn.qkv(x).reshape(b, t, 3, attn.num_heads, attn.head_dim).permute(2, 0, 3, 1, 4)
    q, k, _ = qkv.unbind(0)
    q, k = attn.q_norm(q), attn.k_norm(k)
    return ((q * attn.scale) @ k.transpose(-2, -1)).softmax(dim=-1)


@torch.no_grad()
def attention_sharpness(model: nn.Module, images: torch.Tensor) -> list[dict]:
    """Per block: {"block", "entropy", "max_x_T"} (means over images, heads and rows)."""
    model.eval()
    stats: list[dict] = []

    def hook(index: int):
        def fn(module: nn.Module, args: tuple) -> None:
            p = _attention_rows(module, args[0].float())
            t = p.shape[-1]
            ent = -(p * p.clamp_min(1e-12).log()).sum(-1) / math.log(t)
            stats.append({"block": index, "entropy": float(ent.mean()), "max_x_T": float(p.amax(-1).mean() * t)})
        return fn

    handles = [blk.attn.register_forward_pre_hook(hook(i)) for i, blk in enumerate(model.blocks)]
    try:
        model(images)
    finally:
        for h in handles:
            h.remove()
    return stats


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", action="append", required=True, help="trained weights (repeatable)")
    p.add_argument("--data-path", required=True, help="CIFAR-10 ImageFolder or .tar.gz with val/")
    p.add_argument("--images", type=int, default=64, help="fixed random subset of the validation images")
    p.add_argument("--seed", type=int, default=0, help="subset seed and the fresh models' init seed")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=None, help="JSON file for the rows")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(args.threads)
    rows = []
    for ckpt in args.checkpoint:
        model, state = model_from_checkpoint(ckpt)
        loader = build_eval_loader(state["config"], args.data_path, batch_size=args.images, num_workers=0,
                                   max_images=args.images, seed=args.seed)
        images, _ = next(iter(loader))
        torch.manual_seed(args.seed)
        fresh = create_model(state["model_name"], **state["model_kwargs"])
        for label, m in ((f"fresh ({Path(ckpt).stem})", fresh), (f"trained {Path(ckpt).stem}", model)):
            for s in attention_sharpness(m, images):
                rows.append({"model": label, **s, "images": int(images.shape[0])})
    _logger.info("| model | block | normalised entropy | max weight x T |\n|---|---|---|---|")
    for r in rows:
        _logger.info("| %s | %d | %.3f | %.2f |", r["model"], r["block"], r["entropy"], r["max_x_T"])
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
