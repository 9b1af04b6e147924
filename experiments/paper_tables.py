"""The paper's Tables 1-3 and its common-corruption robustness (Table 2 / Table 10, ImageNet-C) at
CIFAR scale, for a DeiT and a DeiT+MJP checkpoint side by side, with bootstrap intervals:

    python -m experiments.paper_tables --checkpoints DEIT MJP --data-path DIR_OR_TAR --out docs/paper_tables.md

Part 1 (Tables 1 and 3): top-1 on x and on the MJP-shuffled x~ at each ``--gammas`` value,
Consistency and Diff. Norm (:func:`fedmjp.evaluate.evaluate_gammas`, one mask per image, seed
``--seed``), over the split (``--max-images`` for a fixed subset), and a sweep over
``--gamma-sweep``. Part 2 (common corruptions): top-1 on ``--corruption-images`` images of the split
under the 15 ImageNet-C corruptions at severities 1-5 (:mod:`experiments.corruptions`; seeded per
image, cached), the corruption error per corruption (error = 100 - top-1, averaged over the
severities), mCE unnormalised (mean over corruptions and severities) and relative to the first
checkpoint (per corruption, the summed error over severities divided by the baseline's, times 100,
then averaged over corruptions: the baseline is 100 by definition, as the paper normalises by a
baseline model).

Intervals: 95 % bootstrap over the images (``scipy.stats.bootstrap``, BCa, ``--n-resamples``,
seeded); a difference between the two models is bootstrapped on the same resampled images
(paired). The gammas' masks and the corruptions are fixed (drawn once with their seeds), so the
intervals cover the sampling of images, not of masks. Writes the markdown file ``--out``, beside it
``<stem>_gamma_sweep.png``, ``<stem>_corruptions.png`` and ``<stem>.json`` (all figures).

This module is the command; the checkpoints and images: :mod:`experiments.paper_checkpoints`, the
measurements: :mod:`experiments.paper_measures`, the markdown: :mod:`experiments.paper_report`.
"""
from __future__ import annotations

import argparse
import datetime
import json
import logging
import math
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from fedmjp.archives import ArchiveError
from fedmjp.devices import resolve_device
from fedmjp.evaluate import DEFAULT_SWEEP, build_eval_loader

from .corruptions import SEVERITIES, check_corruptions, corruption_names
from .paper_checkpoints import check_split, load_checkpoints
from .paper_measures import corruption_part, mjp_part, plot_corruptions, plot_sweep
from .paper_report import display_path, machine_description, render

_logger = logging.getLogger(__name__)

#: The paper's inference gammas of Tables 1-3.
TABLE_GAMMAS = (0.1, 0.27, 0.5)


def _floats(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of numbers") from None
    bad = [v for v in values if not 0.0 <= v <= 1.0 or math.isnan(v)]
    if bad or not values:
        raise argparse.ArgumentTypeError(f"gamma {bad[0] if bad else text!r} is outside [0, 1]; "
                                         "gammas are shares of the patches to shuffle")
    return values


def _names(text: str) -> list[str]:
    return [v.strip() for v in text.split(",") if v.strip()]


def _ints(text: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None


def _positive(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"{v} is negative")
    return v


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m experiments.paper_tables", description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoints", nargs=2, required=True, metavar=("DEIT", "DEIT_MJP"),
                   help="the baseline (DeiT) and the compared (DeiT+MJP) checkpoint, .safetensors or last.pth")
    p.add_argument("--data-path", required=True, help="ImageFolder root or .tar.gz with the split "
                   "(e.g. $FEDMJP_DATA/cifar10.tar.gz)")
    p.add_argument("--out", default="docs/paper_tables.md", help="markdown file; figures and JSON beside it")
    p.add_argument("--split", default="val")
    p.add_argument("--gammas", type=_floats, default=list(TABLE_GAMMAS), help="the tables' inference gammas")
    p.add_argument("--gamma-sweep", type=_floats, default=[0.1, 0.27, 0.5, 0.7, 1.0],
                   help=f"gammas of the sweep plot (evaluate's default sweep: {','.join(map(str, DEFAULT_SWEEP))})")
    p.add_argument("--seed", type=int, default=0, help="masks and corruptions")
    p.add_argument("--max-images", type=_positive, default=None, help="fixed subset for Tables 1-3 (default: all)")
    p.add_argument("--subset-seed", type=int, default=0, help="seed of the fixed subsets")
    p.add_argument("--corruption-images", type=_positive, default=1000,
                   help="fixed subset for the corruptions (0: skip them)")
    p.add_argument("--corruptions", type=_names, default=None, help="comma-separated (default: the 15 standard)")
    p.add_argument("--severities", type=_ints, default=list(SEVERITIES))
    p.add_argument("--corruption-cache", default=None,
                   help="folder of the corrupted images (default: $FEDMJP_CACHE/corruptions, ~/.cache/fedmjp/...)")
    p.add_argument("--skip-tables", action="store_true", help="only the corruptions")
    p.add_argument("--n-resamples", type=_positive, default=9999)
    p.add_argument("--bootstrap-seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=250)
    p.add_argument("--num-workers", type=int, default=0)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--device", default="cpu")
    return p


def run(args: argparse.Namespace, argv: Sequence[str]) -> Path:
    t_wall, t_cpu = time.time(), time.process_time()
    if args.threads:
        torch.set_num_threads(args.threads)
    names = args.corruptions if args.corruptions is not None else corruption_names()
    if args.corruption_images:
        check_corruptions(names, args.severities)
    if args.skip_tables and not args.corruption_images:
        raise ValueError("--skip-tables with --corruption-images 0 leaves nothing to do")
    out = Path(args.out)
    if out.suffix != ".md":
        raise ValueError(f"--out {out} must name a .md file (the figures go beside it)")
    out.parent.mkdir(parents=True, exist_ok=True)
    device = resolve_device(args.device)
    loaded = load_checkpoints(args.checkpoints)
    for x in loaded:
        x.model.to(device)
    num_classes = int(dict(loaded[0].state.get("model_kwargs", {})).get("num_classes")
                      or loaded[0].model.num_classes)
    check_split(loaded[0].state["config"], args.data_path, args.split, num_classes)
    boot = {"seed": args.bootstrap_seed, "n_resamples": args.n_resamples}
    figures = {"sweep": f"{out.stem}_gamma_sweep.png", "corruptions": f"{out.stem}_corruptions.png"}
    mjp = corr = None
    parts = {}
    if not args.skip_tables:
        t0, c0 = time.time(), time.process_time()
        loader = build_eval_loader(loaded[0].state["config"], args.data_path, args.split, args.batch_size,
                                   args.num_workers, args.max_images, args.subset_seed)
        batches = list(loader)  # decoded once, evaluated by both models
        mjp = mjp_part(loaded, batches, args.gammas, args.gamma_sweep, args.seed, device, boot)
        plot_sweep(mjp, out.parent / figures["sweep"])
        parts["Tables 1-3"] = (time.time() - t0, time.process_time() - c0)
    if args.corruption_images:
        t0, c0 = time.time(), time.process_time()
        corr = corruption_part(loaded, args.data_path, args.split, args.corruption_images, args.subset_seed,
                               names, args.severities, args.seed, device, boot, args.batch_size,
                               args.corruption_cache)
        plot_corruptions(corr, out.parent / figures["corruptions"])
        parts["corruptions"] = (time.time() - t0, time.process_time() - c0)
    shown = [display_path(a) if a in (args.data_path, *args.checkpoints) else a for a in argv]
    meta = {"command": "python -m experiments.paper_tables " + shlex.join(shown),
            "date": datetime.date.today().isoformat(), "machine": machine_description(), "threads": torch.get_num_threads(),
            "wall_s": time.time() - t_wall, "cpu_s": time.process_time() - t_cpu, "n_resamples": args.n_resamples,
            "boot_seed": args.bootstrap_seed, "seed": args.seed, "batch_size": args.batch_size,
            "parts": {k: {"wall_s": w, "cpu_s": c} for k, (w, c) in parts.items()}}
    out.write_text(render(mjp, corr, loaded, meta, figures))
    record = {"meta": meta, "checkpoints": [{"label": x.label, "path": x.path.as_posix(), "sha256": x.sha256,
                                             "epoch": x.state.get("epoch")} for x in loaded],
              "tables": mjp, "corruptions": corr}
    out.with_suffix(".json").write_text(json.dumps(record, indent=1, default=float))
    _logger.info("wrote %s (%.1f min wall)", out, meta["wall_s"] / 60)
    return out


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        run(args, argv)
    except (FileNotFoundError, ValueError, ArchiveError, ImportError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
