"""Label counts at batch size B from the head's update: how often ``recover_label_counts`` is exact.

    FEDMJP_DATA=... python bench/batch_labels.py --batch-sizes 2,4,8 --updates 20

Random batches (classes may repeat) of the first ``--pool`` CIFAR-10 validation images, the shipped
CIFAR checkpoints (design A), float64 updates; per B: exact counts of the recovery (the head's
update, its LayerNorm and the last block's fc2 gradient; ``--head-only``: without the fc2
gradient, ``--no-norm``: the head alone) and of the bias's sign rule (the B most negative entries,
one image each), the methods the recovery took and the wall time."""
from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

import timm
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import attacks  # noqa: E402
import fedmjp  # noqa: E402,F401  (registers the models)
from attacks.optimization.batch_match import head_norm, norm_input_grad_name  # noqa: E402
from attacks.closed_form.labels import recover_label_counts  # noqa: E402
from fedmjp.checkpoint import load_checkpoint  # noqa: E402
from fedmjp.data import load_images  # noqa: E402

_logger = logging.getLogger("batch_labels")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default="$FEDMJP_DATA/cifar10.tar.gz")
    p.add_argument("--batch-sizes", default="2,4,8")
    p.add_argument("--updates", type=int, default=20)
    p.add_argument("--pool", type=int, default=200)
    p.add_argument("--starts", type=int, default=32)
    p.add_argument("--iterations", type=int, default=200)
    p.add_argument("--image-starts", type=int, default=8, help="starts per class of the per-image solve")
    p.add_argument("--no-norm", dest="norm", action="store_false",
                   help="without the head's LayerNorm equations (the per-image solve then needs B <= (C - 1) / 2)")
    p.add_argument("--head-only", dest="pre", action="store_false",
                   help="only the head's update (not the last block's fc2 gradient at the LayerNorm's input)")
    p.add_argument("--models", default="cifar_deit:plain,cifar_deit_mjp:mjp")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(1)
    ims = load_images(args.data, 32, args.pool, 10)
    for entry in args.models.split(","):
        ck, variant = entry.split(":")
        torch.manual_seed(0)
        model = timm.create_model("mjp_vit_cifar_patch4_32", variant=variant, first_block="april", depth=4)
        load_checkpoint(model, ROOT / "checkpoints" / f"{ck}.safetensors")
        model = model.eval().double()
        mean = torch.tensor(model.default_cfg["mean"]).double()[:, None, None]
        std = torch.tensor(model.default_cfg["std"]).double()[:, None, None]
        gen = torch.Generator().manual_seed(0)
        for B in [int(b) for b in args.batch_sizes.split(",")]:
            exact = exact_bias = 0
            methods: dict[str, int] = {}
            t0 = time.perf_counter()
            for _ in range(args.updates):
                idx = torch.randperm(len(ims), generator=gen)[:B]
                y = ims.labels[idx]
                upd = attacks.compute_update(model, (ims.images[idx].double() - mean) / std, y)
                gamma, beta = head_norm(model) if args.norm else (None, None)
                pre = norm_input_grad_name(model) if args.norm else None
                got = recover_label_counts(upd["head.bias"], upd["head.weight"], model.head.weight, model.head.bias,
                                           B, starts=args.starts, iterations=args.iterations,
                                           image_starts=args.image_starts, norm_weight=gamma, norm_bias=beta,
                                           norm_input_grad=upd[pre] if pre and args.pre else None)
                true = torch.bincount(y, minlength=10)
                exact += bool((got.counts == true).all())
                methods[got.method] = methods.get(got.method, 0) + 1
                rule = torch.zeros(10, dtype=torch.long)
                rule[upd["head.bias"].argsort()[:B]] = 1
                exact_bias += bool((rule == true).all())
            _logger.info("%s B=%d: counts exact %d/%d (bias rule %d/%d), methods %s, %.1f s", ck, B, exact,
                         args.updates, exact_bias, args.updates, methods, time.perf_counter() - t0)


if __name__ == "__main__":
    main()
