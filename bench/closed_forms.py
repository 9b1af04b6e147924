"""The closed-form attacks side by side on held-out photographs: PSNR per defence.

32 px (default): the quick preset's design-A DeiT (mjp_vit_cifar_patch4_32, depth 4, ``april:
surgery``, fresh weights, float64 clients) and the same architecture without surgery; per image one
batch-1 update, perturbed by defences.apply_update_defence (8-bit quantisation, top-10 % pruning,
local DP at clip 1), then attacked by ``april_analytic``, ``pe_closed_form``, ``april_robust``
without the defence's parameters and ``april_robust`` told them (Kerckhoffs). Prints mean and
median PSNR (dB) over the images and the seconds per image.

224 px (``--size 224``): timm's standard ``deit_small_patch16_224`` (no surgery, fresh weights),
float64 and float32 clients, ``pe_closed_form`` (and ``april_robust`` on the perturbed rows).

    python bench/closed_forms.py                      # 4 images at 32 px (~1-2 min on 2 cores)
    python bench/closed_forms.py --size 224 --images 3
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import timm
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import attacks  # noqa: E402
from defences import apply_update_defence, validate_defence  # noqa: E402
from fedmjp.factory import build_model, normalize  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attack_throughput import load_images  # noqa: E402  (the bench scripts' one image loader)

MEAN, STD = torch.tensor([0.485, 0.456, 0.406]), torch.tensor([0.229, 0.224, 0.225])


def psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(10 * torch.log10(1 / ((a.double() - b.double()) ** 2).mean().clamp_min(1e-30)))


DEFENCES = {
    "none": None,
    "quantize 8 bit": dict(name="quantize", bits=8),
    "prune keep 0.1": dict(name="prune", keep=0.1),
    "local_dp 1e-6": dict(name="local_dp", clip=1.0, sigma=1e-6),
    "local_dp 1e-4": dict(name="local_dp", clip=1.0, sigma=1e-4),
}


def known_options(spec) -> dict:
    """april_robust's options for a defence the server knows (Kerckhoffs)."""
    if spec is None:
        return {}
    if spec["name"] == "quantize":
        return dict(quant_bits=spec["bits"])
    if spec["name"] == "local_dp":
        return dict(sigma=spec["sigma"], clip=spec["clip"])
    return {}


def run(model: torch.nn.Module, x: torch.Tensor, dtype: torch.dtype, defences: dict, attack_names: list,
        label: str) -> None:
    md = dict(mean=MEAN, std=STD)
    model = model.to(dtype)
    # 224 px: one alternation of april_robust is ~10^2 CG steps over 150k unknowns; 4 alternations
    fast = dict(iterations=4, cg_tol=1e-8, cg_maxiter=200) if x.shape[-1] > 64 else {}
    updates = [attacks.compute_update(model, normalize(x[i:i + 1], MEAN, STD).to(dtype), torch.tensor([i % 10]))
               for i in range(len(x))]
    print(f"\n[{label}] {len(x)} held-out images, {str(dtype).replace('torch.', '')} clients; PSNR dB mean / median, s/image")
    print(f"  {'defence':16s}" + "".join(f"{a:>34s}" for a in attack_names))
    for dname, spec in defences.items():
        spec = None if spec is None else validate_defence(spec)
        row = []
        for aname in attack_names:
            opts = {}
            base = aname
            if aname == "april_robust+known":
                base, opts = "april_robust", known_options(spec)
            if base == "april_robust":
                opts = {**opts, **fast}
            atk = attacks.create_attack(base, **opts)
            vals, t = [], 0.0
            for i, u in enumerate(updates):
                pert = u if spec is None else apply_update_defence(u, spec, torch.Generator().manual_seed(i))
                t0 = time.perf_counter()
                res = atk.reconstruct(model, pert, md)
                t += time.perf_counter() - t0
                vals.append(float("nan") if res.failed else psnr(res.images, x[i:i + 1]))
            row.append(f"{np.mean(vals):7.1f} / {statistics.median(vals):6.1f} ({t / len(x):5.2f}s)")
        print(f"  {dname:16s}" + "".join(f"{c:>34s}" for c in row), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", type=Path, default=Path(os.environ.get("FEDMJP_DATA", "")) / "imagenet-sample",
                   help="ImageNet-sample JPEGs (default: $FEDMJP_DATA/imagenet-sample)")
    p.add_argument("--images", type=int, default=4)
    p.add_argument("--start", type=int, default=41, help="first file index (every 97th after it)")
    p.add_argument("--size", type=int, choices=(32, 224), default=32)
    p.add_argument("--defences", default=",".join(DEFENCES), help="comma-separated names of the rows")
    p.add_argument("--threads", type=int, default=0)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    defences = {k: DEFENCES[k] for k in args.defences.split(",")}
    x = load_images(args.data, args.images, args.size, start=args.start, step=97, dtype=torch.float64)
    if args.size == 32:
        spec = dict(name="DeiT", arch="mjp_vit_cifar_patch4_32", kwargs=dict(depth=4), variant="plain", seed=0)
        names = ["april_analytic", "pe_closed_form", "april_robust", "april_robust+known"]
        run(build_model(dict(spec, april="surgery")), x, torch.float64, defences, names,
            "32 px design-A DeiT (mjp_vit_cifar_patch4_32 depth 4, april surgery)")
        run(build_model(dict(spec, april="surgery")), x.float(), torch.float32, {"none": None},
            names[:3], "32 px design-A DeiT, float32 clients")
        run(build_model(spec), x, torch.float64, defences, names[1:],
            "32 px standard pre-norm DeiT (no surgery)")
    else:
        torch.manual_seed(0)
        model = timm.create_model("deit_small_patch16_224").eval()
        run(model, x, torch.float64, defences, ["pe_closed_form", "april_robust", "april_robust+known"],
            "224 px timm deit_small_patch16_224 (no surgery)")
        run(model, x.float(), torch.float32, {"none": None}, ["pe_closed_form", "april_robust"],
            "224 px timm deit_small_patch16_224, float32 clients")


if __name__ == "__main__":
    main()
