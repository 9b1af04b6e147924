"""The closed-form attacks side by side on held-out photographs: PSNR per defence.

32 px (default): the quick preset's design-A DeiT (mjp_vit_cifar_patch4_32, depth 4, ``april:
surgery``, fresh weights, float64 clients) and the same architecture without surgery; per image one
batch-1 update, perturbed by defences.apply_update_defence (8-bit quantisation, top-10 % pruning,
local DP at clip 1), then attacked by ``april_analytic``, ``pe_closed_form``, ``april_robust``
without the defence's parameters, ``april_robust+known`` told them as options and ``april_robust+meta``
reading them from the metadata's defence spec (Kerckhoffs, the benchmark's route), each with the
smoothness prior and the Gaussian patch prior learned from CIFAR-10 train (``--priors``). Prints mean
and median PSNR (dB) over the images and the seconds per image.

224 px (``--size 224``): timm's standard ``deit_small_patch16_224`` (no surgery, fresh weights),
float64 and float32 clients, ``pe_closed_form`` (and ``april_robust`` on the perturbed rows).

    python bench/closed_forms.py                      # 4 images at 32 px (~5 min on 1 core)
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
    """april_robust's options for a defence the server knows (Kerckhoffs), set by hand."""
    if spec is None:
        return {}
    if spec["name"] == "quantize":
        return dict(quant_bits=spec["bits"])
    if spec["name"] == "local_dp":
        return dict(sigma=spec["sigma"], clip=spec["clip"])
    if spec["name"] == "prune":
        return dict(prune_keep=spec["keep"])
    return {}


def attack_columns(names: list, priors: list) -> list:
    """(column label, attack name, options, give the defence spec in metadata) for each column.

    ``april_robust`` (estimating: no defence parameters), ``april_robust+known`` (the parameters as
    options), ``april_robust+meta`` (the clients' defence spec in the metadata, the benchmark's route),
    each once per prior in ``priors``."""
    cols = []
    for name in names:
        if not name.startswith("april_robust"):
            cols.append((name, name, {}, False))
            continue
        for prior in priors:
            label = name if prior == "smooth" else f"{name} {prior}"
            opts = dict(prior=prior)
            if name == "april_robust":
                cols.append((label, "april_robust", dict(opts, known_defence=False), False))
            elif name == "april_robust+known":
                cols.append((label, "april_robust", dict(opts, known_defence=False, known=True), False))
            else:
                cols.append((label, "april_robust", opts, True))
    return cols


def run(model: torch.nn.Module, x: torch.Tensor, dtype: torch.dtype, defences: dict, attack_names: list,
        label: str, priors: tuple = ("smooth",)) -> None:
    md = dict(mean=MEAN, std=STD)
    model = model.to(dtype)
    # 224 px: one alternation of april_robust is ~10^2 CG steps over 150k unknowns; 4 alternations
    fast = dict(iterations=4, cg_tol=1e-8, cg_maxiter=200) if x.shape[-1] > 64 else {}
    updates = [attacks.compute_update(model, normalize(x[i:i + 1], MEAN, STD).to(dtype), torch.tensor([i % 10]))
               for i in range(len(x))]
    cols = attack_columns(attack_names, list(priors))
    width = max(34, max(len(c[0]) for c in cols) + 2)
    print(f"\n[{label}] {len(x)} held-out images, {str(dtype).replace('torch.', '')} clients; PSNR dB mean / median, s/image")
    print(f"  {'defence':16s}" + "".join(f"{c[0]:>{width}s}" for c in cols))
    for dname, spec in defences.items():
        spec = None if spec is None else validate_defence(spec)
        row = []
        for _, base, opts, give_spec in cols:
            opts = dict(opts)
            if opts.pop("known", False):
                opts.update(known_options(spec))
            if base == "april_robust":
                opts = {**opts, **fast}
            atk = attacks.create_attack(base, **opts)
            meta = dict(md, defence=spec if spec is not None else {"name": "none"}) if give_spec else md
            vals, t = [], 0.0
            for i, u in enumerate(updates):
                pert = u if spec is None else apply_update_defence(u, spec, torch.Generator().manual_seed(i))
                t0 = time.perf_counter()
                res = atk.reconstruct(model, pert, meta)
                t += time.perf_counter() - t0
                vals.append(float("nan") if res.failed else psnr(res.images, x[i:i + 1]))
            row.append(f"{np.mean(vals):7.1f} / {statistics.median(vals):6.1f} ({t / len(x):5.2f}s)")
        print(f"  {dname:16s}" + "".join(f"{c:>{width}s}" for c in row), flush=True)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", type=Path, default=Path(os.environ.get("FEDMJP_DATA", "")) / "imagenet-sample",
                   help="ImageNet-sample JPEGs (default: $FEDMJP_DATA/imagenet-sample)")
    p.add_argument("--images", type=int, default=4)
    p.add_argument("--start", type=int, default=41, help="first file index (every 97th after it)")
    p.add_argument("--size", type=int, choices=(32, 224), default=32)
    p.add_argument("--defences", default=",".join(DEFENCES), help="comma-separated names of the rows")
    p.add_argument("--priors", default="smooth,gaussian",
                   help="april_robust's priors, comma-separated (smooth, tv, gaussian; 224 px: smooth, tv)")
    p.add_argument("--sections", default="designA,float32,standard",
                   help="32 px sections to run: designA, float32, standard")
    p.add_argument("--threads", type=int, default=0)
    args = p.parse_args(argv)
    priors = tuple(args.priors.split(","))
    sections = set(args.sections.split(","))
    if args.threads:
        torch.set_num_threads(args.threads)
    defences = {k: DEFENCES[k] for k in args.defences.split(",")}
    x = load_images(args.data, args.images, args.size, start=args.start, step=97, dtype=torch.float64)
    if args.size == 32:
        spec = dict(name="DeiT", arch="mjp_vit_cifar_patch4_32", kwargs=dict(depth=4), variant="plain", seed=0)
        names = ["april_analytic", "pe_closed_form", "april_robust", "april_robust+known", "april_robust+meta"]
        if "designA" in sections:
            run(build_model(dict(spec, april="surgery")), x, torch.float64, defences, names,
                "32 px design-A DeiT (mjp_vit_cifar_patch4_32 depth 4, april surgery)", priors)
        if "float32" in sections:
            run(build_model(dict(spec, april="surgery")), x.float(), torch.float32, {"none": None},
                names[:3], "32 px design-A DeiT, float32 clients", priors)
        if "standard" in sections:
            run(build_model(spec), x, torch.float64, defences, names[1:],
                "32 px standard pre-norm DeiT (no surgery)", priors)
    else:
        torch.manual_seed(0)
        model = timm.create_model("deit_small_patch16_224").eval()
        priors = tuple(p for p in priors if p != "gaussian") or ("smooth",)  # the shipped prior is for p = 4
        run(model, x, torch.float64, defences, ["pe_closed_form", "april_robust", "april_robust+meta"],
            "224 px timm deit_small_patch16_224 (no surgery)", priors)
        run(model, x.float(), torch.float32, {"none": None}, ["pe_closed_form", "april_robust"],
            "224 px timm deit_small_patch16_224, float32 clients")


if __name__ == "__main__":
    main()
