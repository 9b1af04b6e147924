"""``april_robust`` against ``likelihood_match`` (a second-order fit of the whole update under the
defence's observation model) on the same defended updates (8-bit by default).

    FEDMJP_DATA=... python bench/likelihood_match.py --num-images 3 --iterations 12
    FEDMJP_DATA=... python bench/likelihood_match.py --defence '{name: prune, keep: 0.1}'
    FEDMJP_DATA=... python bench/likelihood_match.py --defence '{name: local_dp, clip: 1, sigma: 1e-4}'

The shipped CIFAR DeiT with its block 0 as trained (standard pre-norm), float64 FedSGD updates of
one CIFAR-10 validation image (labels known), each tensor quantised to ``--bits`` bits
(``defences.transforms.quantize_update``), or defended by ``--defence`` (a spec as in a config's
``defence:``, applied by ``defences.transforms.apply_update_defence``, seeded per image), the
defence known to the attacker. Per image:
``april_robust``'s read (``likelihood_match``'s start), then ``likelihood_match``
(:mod:`attacks.optimization.likelihood_match`: Levenberg-Marquardt with plain conjugate gradients
on every entry's rounding residual, ``--rounding``). It prints both PSNRs, the final residual
against the true image's own residual (the noise level: where the data stop telling images apart)
and the wall times, then the medians and the ratio of the times.

``--images`` takes a folder of JPEGs or ``embedded`` (the bundled photographs)."""
from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
from pathlib import Path

import timm
import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import attacks  # noqa: E402
import fedmjp  # noqa: E402,F401  (registers the models)
from attacks.optimization.breaching_adapter import attack_copy  # noqa: E402
from attacks.optimization.likelihood_match import defence_residual  # noqa: E402
from defences.spec import defence_label, validate_defence  # noqa: E402
from defences.transforms import cosine_similarity  # noqa: E402
from fedmjp.checkpoint import load_checkpoint  # noqa: E402
from fedmjp.data import load_images  # noqa: E402

_logger = logging.getLogger("likelihood_match")


def psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(10 * torch.log10(1 / ((a.double() - b.double()) ** 2).mean().clamp_min(1e-30)))


def truth_residual(model: torch.nn.Module, update: dict, meta: attacks.AttackMetadata, x: torch.Tensor,
                   rounding: str) -> float:
    """The client's own image's residual under the attack's likelihood (the noise level)."""
    fun = defence_residual(attack_copy(model, torch.float64), update, meta, meta.labels, rounding)[0]
    with torch.no_grad():
        return float(fun(meta.normalize(x).reshape(-1)).pow(2).sum())


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--images", default="$FEDMJP_DATA/cifar10.tar.gz")
    p.add_argument("--num-images", type=int, default=4)
    p.add_argument("--bits", type=int, default=8, help="quantize to this many bits (without --defence)")
    p.add_argument("--defence", default=None,
                   help="a defence spec in YAML, e.g. '{name: prune, keep: 0.1}' (replaces --bits)")
    p.add_argument("--iterations", type=int, default=12, help="Gauss-Newton iterations at most")
    p.add_argument("--cg-iterations", type=int, default=60, help="conjugate-gradient iterations per trial step")
    p.add_argument("--sketch-rows", type=int, default=0,
                   help="likelihood_match's CG preconditioner: vector-Jacobian products per iteration (0: plain CG)")
    p.add_argument("--first", type=int, default=0, help="skip this many images of --images")
    p.add_argument("--rounding", choices=("gaussian", "cells"), default="gaussian")
    p.add_argument("--start", choices=("april_robust", "block0_roots", "invertinggradients_batched", "mean"), default="april_robust",
                   help="likelihood_match's start (the baseline printed beside it)")
    p.add_argument("--prior", choices=("none", "gaussian"), default="none",
                   help="likelihood_match's prior (gaussian: the shipped CIFAR-10 patch prior, a MAP fit)")
    p.add_argument("--prior-weight", type=float, default=None, help="the prior's weight (default 1 / p^2)")
    p.add_argument("--start-options", default=None,
                   help="the start attacker's options in YAML, e.g. '{defence_model: true, iterations: 300}'")
    args = p.parse_args(argv)
    for flag in ("num_images", "iterations", "cg_iterations"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} {getattr(args, flag)}: give at least 1")
    if not 0 <= args.sketch_rows <= 4 * 3 * 32 * 32:
        p.error(f"--sketch-rows {args.sketch_rows}: give 0 to {4 * 3 * 32 * 32} (4 x the image's entries)")
    if args.first < 0:
        p.error(f"--first {args.first}: give 0 or more")
    if not 2 <= args.bits <= 16:
        p.error(f"--bits {args.bits}: give 2 to 16 (1 bit keeps signs only: no rounding error to model)")
    try:
        spec = validate_defence(yaml.safe_load(args.defence) if args.defence else
                                {"name": "quantize", "bits": args.bits})
    except (yaml.YAMLError, ValueError) as err:
        p.error(f"--defence {args.defence!r}: {err}")
    try:
        start_options = yaml.safe_load(args.start_options) if args.start_options else {}
        if not isinstance(start_options, dict):
            raise ValueError("give a mapping")
        attacks.create_attack("likelihood_match", start=args.start, start_options=start_options)
    except (yaml.YAMLError, ValueError) as err:
        p.error(f"--start-options {args.start_options!r}: {err}")
    if args.prior_weight is not None and not (args.prior == "gaussian" and args.prior_weight > 0):
        p.error(f"--prior-weight {args.prior_weight}: give a weight > 0 with --prior gaussian")
    if spec.name == "none" or not spec.observation().perturbs:
        p.error(f"--defence {args.defence!r}: give a defence that changes the update (quantize, prune, local_dp)")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    ims = load_images(args.images, 32, args.first + args.num_images, 10)
    torch.manual_seed(0)
    model = timm.create_model("mjp_vit_cifar_patch4_32", variant="plain", first_block="standard", depth=4)
    load_checkpoint(model, ROOT / "checkpoints" / "cifar_deit.safetensors")
    model = model.eval().double()
    mean = torch.tensor(model.default_cfg["mean"]).double()
    std = torch.tensor(model.default_cfg["std"]).double()
    robust = attacks.create_attack(args.start, **start_options) if args.start != "mean" else None
    lm = attacks.create_attack("likelihood_match", iterations=args.iterations, cg_iterations=args.cg_iterations,
                               rounding=args.rounding, start=args.start, start_options=start_options,
                               sketch_rows=args.sketch_rows,
                               prior=args.prior, **({"prior_weight": args.prior_weight} if args.prior_weight else {}))
    rows = []
    for i in range(args.first, len(ims)):
        x, y = ims.images[i:i + 1].double(), ims.labels[i:i + 1]
        meta = attacks.AttackMetadata(1, (3, 32, 32), mean, std, y, defence=spec)
        clean, q = attacks.defended_update(model, meta, x, y, i)
        t0 = time.perf_counter()
        start = (robust.reconstruct(model, q, meta) if robust is not None else
                 attacks.AttackResult(meta.denormalize(torch.zeros(1, 3, 32, 32, dtype=torch.float64)), [{}]))
        t_start = time.perf_counter() - t0
        got = lm.reconstruct(model, q, meta)
        if start.failed or got.failed:
            _logger.info("image %d: failed: %s", i, start.reason or got.reason)
            continue
        st = got.stats[0]
        row = dict(i=i, start=psnr(start.images, x), lm=psnr(got.images, x), residual=st["residual_end"],
                   truth=truth_residual(model, q, meta, x, args.rounding), its=st["iterations"],
                   t_start=t_start, t_lm=st["time_s"], cos=cosine_similarity(q, clean), name=args.start,
                   cg=st.get("cg_steps", 0))
        rows.append(row)
        _logger.info("image %(i)d: %(name)s %(start).2f dB (%(t_start).1f s); likelihood_match %(lm).2f dB "
                     "after %(its)d iterations, %(cg)d CG steps (%(t_lm).0f s), residual %(residual).3e against the true "
                     "image's %(truth).3e; the update's cosine to the clean one %(cos).4f", row)
    if rows:
        med = {k: statistics.median(r[k] for r in rows) for k in ("start", "lm", "t_start", "t_lm")}
        _logger.info("median of %d images, %s, %s rounding: %s %.2f dB, likelihood_match %.2f dB "
                     "(%+.2f dB), time ratio likelihood_match / %s %.0fx", len(rows), defence_label(spec),
                     args.rounding, args.start, med["start"], med["lm"], med["lm"] - med["start"], args.start,
                     med["t_lm"] / max(med["t_start"], 1e-9))


if __name__ == "__main__":
    main()
