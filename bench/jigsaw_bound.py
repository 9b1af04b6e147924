"""The jigsaw solver against its own bound: what of MJP's arrangement image statistics recover.

    OMP_NUM_THREADS=1 python bench/jigsaw_bound.py --images $FEDMJP_DATA/imagenet-sample --num-images 40
    OMP_NUM_THREADS=1 python bench/jigsaw_bound.py --images $FEDMJP_DATA/imagenet-sample --size 224 --num-images 24

Setting (c) scores x~ unshuffled against x. No gradient sees the order of the shuffled patches (the
position embedding E_unk is one vector for all of them), so even an attacker who holds every patch
of x~ exactly must solve a jigsaw: :func:`attacks.solvers.jigsaw.oracle_c` is that solver given the
true x~, the bound on (c) of every attack that hands it an estimate.

Per photograph (S drawn as MJP draws it, ``--gamma``, a seed per image; the patches at S permuted)
and per boundary cost of ``--costs``, the solver is given the true patches. Printed per cost: the
oracle (c) PSNR (median [min, max]), the patches it puts at their true position, the photographs
solved exactly, and who is to blame where it is not exact: **search** (the true arrangement costs
less than the one returned: a better search would find it) or **model** (the returned arrangement
costs less than the truth: no search under this cost can find the truth). Beside them, for scale:
the same true patches in a random order (chance), and the harmonic fill of S from the known pixels
(no patches at all).

``--per-image`` adds a row per photograph and cost.
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from attacks.solvers.jigsaw import COSTS, KICKS, arrangement_cost, harmonic_fill, place, solve_jigsaw  # noqa: E402
from fedmjp.data import DataError, load_images  # noqa: E402
from fedmjp.jigsaw import make_plan  # noqa: E402
from patchgrid import patchify  # noqa: E402

#: Relative cost difference under which the found and the true arrangement count as tied.
TIE = 1e-9


def psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    mse = float((a.double() - b.double()).pow(2).mean())
    return math.inf if mse == 0 else -10 * math.log10(mse)


def case(x: torch.Tensor, patch: int, gamma: float, seed: int) -> dict:
    """The true patches of x [1, C, H, W] at MJP's shuffled positions S, in a seeded random order
    (``candidates``); ``order_true[j]`` is the candidate that belongs at the j-th position of S (the
    solver's output format)."""
    grid = (x.shape[-2] // patch, x.shape[-1] // patch)
    S = make_plan(1, grid, gamma, seed).mask[0]
    pix = patchify(x, patch)[0]
    idx = torch.nonzero(S).flatten()
    perm = torch.randperm(idx.numel(), generator=torch.Generator().manual_seed(seed))
    order_true = torch.empty(idx.numel(), dtype=torch.long)
    order_true[perm] = torch.arange(idx.numel())
    return dict(grid=grid, S=S, pix=pix, idx=idx, candidates=pix[idx[perm]], order_true=order_true.numpy())


def solve_one(c: dict, cost: str, inpaint: float | None, kicks: int = KICKS) -> dict:
    """The solver on one case under one cost: PSNR on the whole image, placed right, blame."""
    t0 = time.perf_counter()
    order, info = solve_jigsaw(c["candidates"], c["grid"], c["S"], c["pix"], prediction=cost, inpaint=inpaint,
                               kicks=kicks)
    dt = time.perf_counter() - t0
    truth_cost = arrangement_cost(c["candidates"], c["grid"], c["S"], c["pix"], c["order_true"], prediction=cost,
                                  inpaint=inpaint)
    found = info["cost_final"]
    right = int((order == c["order_true"]).sum())
    k = len(order)
    scale = max(abs(truth_cost), abs(found), 1e-300)
    if right == k:
        blame = "exact"
    elif truth_cost < found - TIE * scale:
        blame = "search"
    elif found < truth_cost - TIE * scale:
        blame = "model"
    else:
        blame = "tie"
    est = place(c["candidates"], order, c["S"], c["pix"])
    return dict(psnr=psnr(est, c["pix"]), right=right, k=k, blame=blame, found=found, truth=truth_cost, seconds=dt)


def baselines(c: dict, rng: torch.Generator) -> dict:
    """PSNR of the true patches in a random order (chance) and of the harmonic fill of S (no patches)."""
    k = c["idx"].numel()
    shuffled = place(c["candidates"], torch.randperm(k, generator=rng).numpy(), c["S"], c["pix"])
    fill = harmonic_fill(c["pix"], c["S"], c["grid"])
    return dict(chance=psnr(shuffled, c["pix"]), fill=psnr(fill, c["pix"]))


def fmt(values: list[float]) -> str:
    finite = [min(v, 300.0) for v in values]
    return f"{statistics.median(finite):6.2f} [{min(finite):6.2f}, {max(finite):6.2f}]"


def bound(argv: list[str] | None = None) -> dict:
    """:func:`main`'s work; returns per cost its median PSNR, patches placed right and the blame counts."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--images", default="$FEDMJP_DATA/imagenet-sample", help="an image folder, or 'embedded'")
    p.add_argument("--num-images", type=int, default=40)
    p.add_argument("--size", type=int, default=32, help="image side in pixels")
    p.add_argument("--patch", type=int, default=None, help="patch side (default: 4 at 32 px, else 16)")
    p.add_argument("--gamma", type=float, default=0.27, help="MJP's shuffled share of the positions")
    p.add_argument("--costs", default="l2,prediction,mgc,lp", help=f"comma-separated, of {', '.join(COSTS)}")
    p.add_argument("--inpaint", type=float, default=None, help="harmonic-fill weight (default: the solver's)")
    p.add_argument("--kicks", type=int, default=KICKS, help="the iterated local search's perturbations")
    p.add_argument("--seed", type=int, default=100, help="S and the order of image i from seed + i")
    p.add_argument("--per-image", action="store_true")
    args = p.parse_args(argv)
    patch = args.patch if args.patch is not None else (4 if args.size == 32 else 16)
    if not 1 <= args.num_images <= 10_000:
        p.error(f"--num-images {args.num_images}: give 1 to 10000")
    if not 8 <= args.size <= 1024:
        p.error(f"--size {args.size}: give 8 to 1024 pixels")
    if patch < 1 or args.size % patch or args.size // patch < 2:
        p.error(f"--patch {patch}: give a divisor of --size {args.size} that leaves at least 2 x 2 patches")
    if not 0 < args.gamma < 1:
        p.error(f"--gamma {args.gamma}: give a share strictly between 0 and 1")
    if args.inpaint is not None and not (args.inpaint >= 0 and math.isfinite(args.inpaint)):
        p.error(f"--inpaint {args.inpaint}: give a finite weight >= 0")
    if not 0 <= args.kicks <= 100_000:
        p.error(f"--kicks {args.kicks}: give 0 to 100000")
    costs = [c.strip() for c in args.costs.split(",") if c.strip()]
    bad = [c for c in costs if c not in COSTS]
    if not costs or bad:
        p.error(f"--costs {args.costs!r}: give names of {', '.join(COSTS)}")
    try:
        images = load_images(args.images, args.size, args.num_images).images.double()
    except (DataError, ValueError, OSError) as err:
        p.error(f"--images {args.images}: {err}")
    torch.set_num_threads(1)
    print(f"jigsaw bound: {len(images)} photographs from {args.images}, {args.size} px, patch {patch}, "
          f"gamma {args.gamma}, {args.kicks} kicks; the solver given the true patches of x~")
    rng = torch.Generator().manual_seed(args.seed)
    cases = [case(images[i:i + 1], patch, args.gamma, args.seed + i) for i in range(len(images))]
    base = [baselines(c, rng) for c in cases]
    results: dict[str, list[dict]] = {}
    for cost in costs:
        results[cost] = [solve_one(c, cost, args.inpaint, args.kicks) for c in cases]
        if args.per_image:
            for i, r in enumerate(results[cost]):
                print(f"  {cost:10s} image {i:3d}: {r['psnr']:6.2f} dB, {r['right']:3d}/{r['k']} placed right, "
                      f"{r['blame']:6s} (found {r['found']:.6g}, truth {r['truth']:.6g}), {r['seconds']:.2f} s")
    n = len(cases)
    print(f"\n| cost | oracle (c) dB, median [min, max] | patches placed right | exact | search-limited | "
          f"model-limited | s per image |")
    print("|---|---|---|---|---|---|---|")
    summary = {}
    for cost, rows in results.items():
        right, total = sum(r["right"] for r in rows), sum(r["k"] for r in rows)
        count = {b: sum(r["blame"] == b for r in rows) for b in ("exact", "search", "model", "tie")}
        summary[cost] = dict(median_db=statistics.median(min(r["psnr"], 300.0) for r in rows), right=right,
                             total=total, **count)
        print(f"| {cost} | {fmt([r['psnr'] for r in rows])} | {right}/{total} ({100 * right / max(total, 1):.0f} %) | "
              f"{count['exact']}/{n} | {count['search']}/{n} | {count['model']}/{n} | "
              f"{statistics.median(r['seconds'] for r in rows):.2f} |")
    chance_right = statistics.mean(1 / max(c["idx"].numel(), 1) for c in cases)  # a random order's share
    print(f"| (true patches, random order) | {fmt([b['chance'] for b in base])} | ~{100 * chance_right:.0f} % | | | | |")
    print(f"| (harmonic fill of S, no patches) | {fmt([b['fill'] for b in base])} | | | | | |")
    print("\nsearch-limited: the true arrangement costs less than the one found; model-limited: the one found "
          "costs less than the truth (no search under that cost finds the truth).")
    return summary


def main(argv: list[str] | None = None) -> None:
    bound(argv)


if __name__ == "__main__":
    main()
