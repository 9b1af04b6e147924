"""Throughput of the metrics over 999 image pairs at 224x224 on CPU: all five in one pass vs LPIPS alone.

    python bench/metrics_throughput.py                       # 999 pairs, 224 px, 2 threads, 3 repeats
    python bench/metrics_throughput.py --per-metric          # also each metric function on its own
    python bench/metrics_throughput.py --pairs 200 --repeats 5

Pairs are (noisy image, image) built from the real ImageNet sample: ``--unique`` images, preprocessed
like ImageNet val (Resize 256, CenterCrop 224), each reused with different Gaussian noise levels
(sigma 0.02..0.3) until there are ``--pairs`` pairs.

Measurement: set-up (loading images, building LPIPS) is timed apart from the steady state. Every
side is warmed up once on ``--warmup`` pairs (oneDNN picks kernels on a first call), then the sides
are timed round-robin ``--repeats`` times, in reversed order every other round (so that load
drifting on a shared machine hits every side alike), and reported as median [min, max] wall seconds
with the load average seen over the rounds. The target of issue 14: all five metrics
(``metrics.score_all``) over the set in under 20 s on 2 cores, and at most 1.5x LPIPS alone, printed
as a ratio of medians from this one run. With ``--per-metric``, SSIM is timed on its own side by side:
``metrics.ssim`` (the NumPy/SciPy float64 CPU path) and scikit-image's own loop (the reference), and
with ``--ssim-torch`` also ``ssim_torch`` (torch float64; fast on idle cores, slow when other
processes share them: metrics/structural.py).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch
from PIL import Image
from torchvision.transforms import v2

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # a checkout without pip install -e
import metrics

#: the data folder (fedmjp/datadir.py): imagenet-sample/ and lpips/ inside it
DEFAULT_DATA = Path(os.environ["FEDMJP_DATA"]) if os.environ.get("FEDMJP_DATA") else None


def load_pairs(data: Path, n_pairs: int, n_unique: int, size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """([P, 3, S, S] noisy reconstructions, [P, 3, S, S] references), float32 in [0, 1]."""
    files = sorted((data / "imagenet-sample").glob("*.JPEG"))
    if not files:
        raise SystemExit(f"no images under {data / 'imagenet-sample'} (use --data)")
    files = files[:: max(1, len(files) // n_unique)][:n_unique]
    tf = v2.Compose([v2.PILToTensor(), v2.Resize(round(size * 256 / 224), antialias=True), v2.CenterCrop(size),
                     v2.ToDtype(torch.float32, scale=True)])
    base = torch.stack([tf(Image.open(f).convert("RGB")) for f in files])
    g = torch.Generator().manual_seed(seed)
    ref = base[torch.arange(n_pairs) % len(files)]
    sigma = torch.linspace(0.02, 0.3, n_pairs)[torch.randperm(n_pairs, generator=g)].view(-1, 1, 1, 1)
    rec = ref + sigma * torch.randn(ref.shape, generator=g)
    return rec.clamp_(0.0, 1.0), ref


def timed(fn: Callable[[], object]) -> tuple[object, float]:
    """(result, wall seconds)."""
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=999)
    parser.add_argument("--unique", type=int, default=111, help="distinct source images")
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--threads", type=int, default=2, help="torch threads (and CPU SSIM workers)")
    parser.add_argument("--lpips-batch", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=16, help="pairs in each side's warm-up call")
    parser.add_argument("--per-metric", action="store_true", help="also time each metric function on its own")
    parser.add_argument("--ssim-torch", action="store_true",
                        help="also time metrics.ssim_torch (slow when other processes share the cores)")
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, required=DEFAULT_DATA is None,
                        help="the data folder with imagenet-sample/ (default: $FEDMJP_DATA)")
    parser.add_argument("--backbone", type=Path, default=None,
                        help="AlexNet features file (default: metrics' route: env var, $FEDMJP_DATA/lpips, torch hub cache)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    from fedmjp.allocator import tune_malloc

    tune_malloc()  # as run_benchmark.py does (LPIPS 14.4 -> 13.1 s, all five 21.1 -> 19.7 s on 2 cores)
    (rec, ref), t_load = timed(lambda: load_pairs(args.data, args.pairs, args.unique, args.size, args.seed))
    print(f"{args.pairs} pairs of {args.size}x{args.size} from {args.unique} images; torch threads "
          f"{torch.get_num_threads()}, cpu_count {os.cpu_count()}, load average {os.getloadavg()[0]:.1f}")
    model, t_model = timed(lambda: metrics.get_lpips_model("cpu", backbone_path=args.backbone))
    print(f"set-up: images loaded in {t_load:.1f} s; LPIPS model built in {t_model:.2f} s "
          f"(weights: {metrics.lpips_source(model)})")

    five = list(metrics.PAPER_METRICS)
    sides: dict[str, Callable[[torch.Tensor, torch.Tensor], object]] = {
        "lpips alone": lambda a, b: metrics.lpips(a, b, model=model, batch_size=args.lpips_batch),
        "all five (score_all)": lambda a, b: metrics.score_all(a, b, five, lpips_model=model),
    }
    if args.per_metric:
        sides.update({
            "mse": metrics.mse,
            "psnr": metrics.psnr,
            "fft2d": metrics.fft2d,
            "ssim (scipy, default)": lambda a, b: metrics.ssim(a, b, workers=args.threads),
            "ssim (scikit-image)": lambda a, b: metrics.ssim_skimage(a, b, workers=args.threads),
            "mse+psnr+fft2d (score_all)": lambda a, b: metrics.score_all(a, b, ["mse", "psnr", "fft2d"]),
        })
    if args.ssim_torch:
        sides["ssim_torch"] = metrics.ssim_torch
    w = min(args.warmup, args.pairs)
    for call in sides.values():
        call(rec[:w], ref[:w])

    seconds: dict[str, list[float]] = {name: [] for name in sides}
    loads: dict[str, list[float]] = {name: [] for name in sides}
    for round_ in range(args.repeats):
        names = list(sides) if round_ % 2 == 0 else list(reversed(sides))
        for name in names:
            seconds[name].append(timed(lambda: sides[name](rec, ref))[1])
            loads[name].append(os.getloadavg()[0])

    print(f"steady state, {args.repeats} repeats round-robin (order reversed every other round): "
          f"median [min, max] wall seconds for {args.pairs} pairs, 1-minute load average after each")
    for name, values in seconds.items():
        med = statistics.median(values)
        print(f"  {name:<28}{med:>8.2f} s  [{min(values):.2f}, {max(values):.2f}]  {args.pairs / med:>7.1f} pairs/s"
              f"  load {min(loads[name]):.1f}-{max(loads[name]):.1f}")
    all_five = statistics.median(seconds["all five (score_all)"])
    alone = statistics.median(seconds["lpips alone"])
    ratio = all_five / alone
    print(f"all five / LPIPS alone = {ratio:.2f} (target <= 1.5: {'met' if ratio <= 1.5 else 'NOT met'}); "
          f"all five {all_five:.1f} s (target < 20 s: {'met' if all_five < 20 else 'NOT met'}); "
          f"load average now {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
