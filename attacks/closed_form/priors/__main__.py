"""Build a Gaussian patch prior from a training set's images (see attacks/closed_form/priors/__init__.py).

    python -m attacks.closed_form.priors --data-path $FEDMJP_DATA/cifar10.tar.gz --patch 4 \\
        --out attacks/closed_form/priors/cifar10_patch4.npz

Every p x p x 3 patch of every training image at every offset (stride 1), in [0, 1] pixel space:
the exact mean and sample covariance over all of them (accumulated in float64), then shrunk towards
a multiple of the identity with scikit-learn's Ledoit-Wolf intensity, estimated on a seeded random
subsample of ``--lw-samples`` patches (sklearn needs the samples in memory; over all patches the
intensity is smaller still, so the subsample's is the conservative one).
"""
from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from . import PatchPrior, PriorError, iter_train_images, save_patch_prior, sha256


def build(data_path: Path, patch: int, lw_samples: int = 100_000, seed: int = 0, batch: int = 1000,
          limit: int = 0) -> tuple[PatchPrior, dict]:
    """The prior and its statistics (counts, shrinkage, eigenvalue range)."""
    try:
        from sklearn.covariance import ledoit_wolf_shrinkage, shrunk_covariance
    except ImportError:
        raise PriorError("building a prior needs scikit-learn: pip install 'fedmjp[analysis]'") from None
    rng = np.random.default_rng(seed)
    dim = 3 * patch * patch
    total, outer, count, images, size = np.zeros(dim), np.zeros((dim, dim)), 0, 0, None
    sub, keys = np.zeros((0, dim)), np.zeros(0)  # a uniform subsample: the rows of the smallest random keys
    buf: list[np.ndarray] = []

    def flush() -> None:
        nonlocal total, outer, count, sub, keys
        x = np.stack(buf).astype(np.float64) / 255.0  # [B, H, W, 3]
        x = x.transpose(0, 3, 1, 2)  # [B, 3, H, W]
        win = np.lib.stride_tricks.sliding_window_view(x, (patch, patch), axis=(2, 3))  # [B, 3, h, w, p, p]
        rows = win.transpose(0, 2, 3, 1, 4, 5).reshape(-1, dim)  # (channel, row, column) order
        total += rows.sum(0)
        outer += rows.T @ rows
        count += rows.shape[0]
        k = np.concatenate([keys, rng.random(rows.shape[0])])
        keep = np.argsort(k)[:lw_samples]
        sub, keys = np.concatenate([sub, rows])[keep], k[keep]
        buf.clear()

    for img in iter_train_images(data_path):
        if size is None:
            size = img.shape[:2]
        if img.shape[:2] != size:
            raise PriorError(f"{data_path}: images of different sizes ({size} and {img.shape[:2]}); the prior "
                             "describes one scale")
        buf.append(img)
        images += 1
        if len(buf) == batch:
            flush()
        if limit and images >= limit:
            break
    if buf:
        flush()
    if count < 2 * dim:
        raise PriorError(f"{data_path}: {count} patches are too few for a {dim}-dimensional covariance")
    mean = total / count
    cov = (outer - count * np.outer(mean, mean)) / (count - 1)
    sample = sub
    shrink = float(ledoit_wolf_shrinkage(sample))
    cov = shrunk_covariance(cov, shrink)
    eig = np.linalg.eigvalsh(cov)
    stats = dict(images=images, patches=count, image_size=list(size), lw_subsample=int(sample.shape[0]),
                 ledoit_wolf_shrinkage=shrink, eigenvalue_min=float(eig[0]), eigenvalue_max=float(eig[-1]))
    return PatchPrior(patch, 3, int(size[0]), mean, cov, source=data_path.name), stats


def _commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).resolve().parent, capture_output=True,
                             text=True, check=True)
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m attacks.closed_form.priors", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-path", type=Path, required=True,
                   help="an ImageFolder with train/<class>/ images, or a .tar/.tar.gz of one")
    p.add_argument("--patch", type=int, required=True, help="patch side p (the model's patch size)")
    p.add_argument("--out", type=Path, required=True, help="the .npz to write (a .json note goes beside it)")
    p.add_argument("--lw-samples", type=int, default=100_000, help="patches for the Ledoit-Wolf intensity")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--limit", type=int, default=0, help="use only the first N images (0: all)")
    args = p.parse_args(argv)
    if args.patch < 1:
        p.error(f"--patch must be >= 1, got {args.patch}")
    if not args.data_path.exists():
        p.error(f"--data-path {args.data_path} does not exist")
    try:
        prior, stats = build(args.data_path, args.patch, args.lw_samples, args.seed, limit=args.limit)
    except PriorError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    data_dir = os.environ.get("FEDMJP_DATA")
    argv = [a.replace(data_dir.rstrip("/"), "$FEDMJP_DATA") if data_dir else a for a in (argv or sys.argv[1:])]
    note = dict(command="python -m attacks.closed_form.priors " + " ".join(argv),
                data=args.data_path.name, data_sha256=sha256(args.data_path) if args.data_path.is_file() else None,
                commit=_commit(), date=datetime.date.today().isoformat(), split="train",
                patch=args.patch, order="(channel, row, column), pixels in [0, 1], every offset (stride 1)",
                estimator="sample mean and covariance of all patches, Ledoit-Wolf shrinkage (sklearn) "
                          "towards trace/d * I with the intensity from a seeded subsample", **stats)
    out = save_patch_prior(prior, args.out, note)
    print(f"wrote {out} and {out.with_suffix('.json')}: {stats}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
