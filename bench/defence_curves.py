"""A curve per defence: the attack's PSNR against the defence's parameter (quantisation bits, the
kept share of pruning, local DP's sigma), with the defended update's cosine to the clean one and
the flat image's PSNR beside, to where the attack meets the floor.

    FEDMJP_DATA=... python bench/defence_curves.py --num-images 8 --plot docs/defence_curves_cifar.png

The shipped CIFAR DeiT with its block 0 as trained (standard pre-norm), float64 FedSGD updates of
one CIFAR-10 validation image each (labels known), each defended by
``defences.transforms.apply_update_defence`` (seeded per image), the defence known to the attacker
(``--attack``, default ``april_robust``: the fast robust read; ``likelihood_match`` fits on top of
it at minutes per update, bench/likelihood_match.py). Per point: the median PSNR over the images,
their median cosine(sent, clean) and the median flat-image PSNR (a flat image of the model's
normalisation mean: what an attacker scores without reading the update) and, for local DP, the
ReRo median ceiling: the PSNR no attacker reaches on more than half the images of a batch-1 update
under that noise (``defences.rero``: mu = 1 / sigma at batch 1, the prior the first ``--prior-images``
images of ``--images``; "inf" where mu is too large for the prior to resolve any bound).

``--images`` takes a folder of JPEGs or ``embedded`` (the bundled photographs)."""
from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
from pathlib import Path

import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import attacks  # noqa: E402
from benchmark.frontier import load_prior  # noqa: E402
from benchmark.scoring import flat_psnr  # noqa: E402
from defences.rero import needed_baseline, release_mu  # noqa: E402
from defences.spec import validate_defence  # noqa: E402
from defences.transforms import cosine_similarity  # noqa: E402
from fedmjp.data import load_images  # noqa: E402
from fedmjp.factory import build_model  # noqa: E402
from metrics.prior import MAX_PRIOR_IMAGES, guess_psnr  # noqa: E402

_logger = logging.getLogger("defence_curves")

#: The shipped CIFAR DeiT as clients run it (configs/cifar.yaml's DeiT-std row).
MODEL = {"arch": "mjp_vit_cifar_patch4_32", "variant": "plain", "kwargs": {"depth": 4},
         "checkpoint": str(ROOT / "checkpoints" / "cifar_deit.safetensors")}
#: Each defence's swept parameter and its spec at a value.
FAMILIES = {
    "bits": lambda v: {"name": "quantize", "bits": int(v)},
    "keep": lambda v: {"name": "prune", "keep": float(v)},
    "sigma": lambda v: {"name": "local_dp", "clip": 1.0, "sigma": float(v)},
}


def psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(10 * torch.log10(1 / ((a.double() - b.double()) ** 2).mean().clamp_min(1e-30)))


def _values(text: str, flag: str, kind) -> list:
    try:
        out = [kind(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise SystemExit(f"defence_curves.py: error: {flag} {text!r}: give comma-separated numbers") from None
    return out


def curves(model, ims, attack, points: dict[str, list], prior: torch.Tensor | None = None) -> list[dict]:
    """One row per (family, value): medians over the images of PSNR, cosine and the flat floor, and
    with ``prior`` the ReRo median ceiling of a Gaussian DP point (``ceiling``, with its ``mu``)."""
    mean = torch.tensor(model.default_cfg["mean"]).double()
    std = torch.tensor(model.default_cfg["std"]).double()
    rows = []
    for family, values in points.items():
        for v in values:
            spec = validate_defence(FAMILIES[family](v))
            got, cos, flat, secs = [], [], [], []
            for i in range(len(ims)):
                x, y = ims.images[i:i + 1].double(), ims.labels[i:i + 1]
                meta = attacks.AttackMetadata(1, (3, 32, 32), mean, std, y, defence=spec)
                clean, sent = attacks.defended_update(model, meta, x, y, i)
                t0 = time.perf_counter()
                res = attack.reconstruct(model, sent, meta)
                secs.append(time.perf_counter() - t0)
                if not res.failed:
                    got.append(psnr(res.images, x))
                cos.append(cosine_similarity(sent, clean))
                flat.append(float(flat_psnr(x, model.default_cfg["mean"])[0]))
            row = dict(family=family, value=v, psnr=statistics.median(got) if got else float("nan"),
                       failed=len(ims) - len(got), cos=statistics.median(cos), flat=statistics.median(flat),
                       seconds=sum(secs))
            mu = release_mu(spec, 1, 1)
            if mu is not None and prior is not None:
                row.update(mu=mu, ceiling=guess_psnr(prior, needed_baseline(0.5, mu)))
            rows.append(row)
            _logger.info("%(family)s=%(value)g: PSNR %(psnr).2f dB (flat %(flat).2f), cos %(cos).4f, %(failed)d "
                         "failed, %(seconds).1f s", row)
            if "ceiling" in row:
                _logger.info("  mu %(mu).4g: ReRo median ceiling %(ceiling).2f dB", row)
    return rows


def plot(rows: list[dict], path: Path, attack: str, n: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = {"bits": "quantize: bits", "keep": "prune: kept share", "sigma": "local DP: sigma (clip 1)"}
    fams = [f for f in FAMILIES if any(r["family"] == f for r in rows)]
    fig, axes = plt.subplots(1, len(fams), figsize=(4.2 * len(fams), 3.4), squeeze=False)
    for ax, fam in zip(axes[0], fams):
        rs = [r for r in rows if r["family"] == fam]
        xs = [r["value"] for r in rs]
        ax.plot(xs, [r["psnr"] for r in rs], "o-", label=f"{attack} (median of {n})")
        ax.plot(xs, [r["flat"] for r in rs], ":", color="grey", label="flat image")
        if any("ceiling" in r for r in rs):  # the bound where the prior resolves it (inf: none)
            ax.plot(xs, [r.get("ceiling", float("nan")) if r.get("ceiling", 0) < float("inf") else float("nan")
                         for r in rs], "v-.", color="tab:green", ms=4, label="ReRo median ceiling")
        ax.set_xlabel(labels[fam])
        ax.set_ylabel("PSNR (dB)")
        if fam != "bits":
            ax.set_xscale("log")
        twin = ax.twinx()
        twin.plot(xs, [r["cos"] for r in rs], "s--", color="tab:red", ms=3, label="cos(sent, clean)")
        twin.set_ylim(0, 1.02)
        twin.set_ylabel("cosine", color="tab:red")
        ax.legend(loc="lower left" if fam == "sigma" else "lower right", fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--images", default="$FEDMJP_DATA/cifar10.tar.gz")
    p.add_argument("--num-images", type=int, default=8)
    p.add_argument("--attack", default="april_robust", help="a batch-1 attack that reads the defence from the metadata")
    p.add_argument("--options", default=None, help="its options in YAML, e.g. '{iterations: 3}'")
    p.add_argument("--bits", default="2,3,4,6,8,12,16")
    p.add_argument("--keep", default="0.01,0.03,0.1,0.3,0.6,0.9")
    p.add_argument("--sigma", default="1e-6,1e-5,1e-4,1e-3,1e-2,0.3,1")
    p.add_argument("--prior-images", type=int, default=MAX_PRIOR_IMAGES, help="images of --images the ReRo ceilings' prior "
                   "takes (0: no ceilings)")
    p.add_argument("--plot", type=Path, default=None, help="write the curves to this PNG")
    args = p.parse_args(argv)
    if args.num_images < 1:
        p.error(f"--num-images {args.num_images}: give at least 1")
    if args.prior_images != 0 and not 2 <= args.prior_images <= MAX_PRIOR_IMAGES:
        p.error(f"--prior-images {args.prior_images}: give 0 or 2 to {MAX_PRIOR_IMAGES}")
    points = {"bits": _values(args.bits, "--bits", int), "keep": _values(args.keep, "--keep", float),
              "sigma": _values(args.sigma, "--sigma", float)}
    try:
        for fam, values in points.items():
            for v in values:
                validate_defence(FAMILIES[fam](v))
        options = yaml.safe_load(args.options) if args.options else {}
        if not isinstance(options, dict):
            raise ValueError("--options: give a mapping")
        attack = attacks.create_attack(args.attack, **options)
    except (yaml.YAMLError, ValueError) as err:
        p.error(str(err))
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    ims = load_images(args.images, 32, args.num_images, 10)
    model = build_model(MODEL).double()
    prior = None
    if args.prior_images:
        try:
            prior = load_prior(args.images, 32, args.prior_images)
        except ValueError as err:
            _logger.warning("no ReRo ceilings: %s", err)
    rows = curves(model, ims, attack, {k: v for k, v in points.items() if v}, prior)
    if args.plot is not None and rows:
        plot(rows, args.plot, args.attack, len(ims))
        _logger.info("wrote %s", args.plot)


if __name__ == "__main__":
    main()
