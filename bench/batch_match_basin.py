"""How far ``batch_match``'s objective pins a B = 2 batch: the no-information baseline, the basin
around the client's batch, and the span agreement of the candidates' layer inputs.

    FEDMJP_DATA=... OMP_NUM_THREADS=1 python bench/batch_match_basin.py --noise 0.1,0.3 --iterations 50

The shipped CIFAR DeiT (plain, design A, depth 4), two ImageNet-sample photographs (files
``--files`` of the sorted folder) at 32 px as one float64 update with labels ``--labels``. Per line:

- ``flat``: the PSNR of the model's normalisation mean colour (default_cfg mean) as a reconstruction of each image, what an attacker
  scores without reading the update at all (``benchmark.scoring.flat_psnr``, the benchmark rows' ``flat_psnr``);
- ``basin``: from the client's batch plus Gaussian noise of RMS sigma (model-input units), the data
  term of ``batch_match`` (``attacks.optimization.batch_match.gradient_distance``) and PSNR after assignment at
  the start and after ``--iterations`` L-BFGS iterations (strong Wolfe, as the attack), with the RMS
  distance moved;
- ``span``: at the same starts, the one-sided span residual (every candidate token inside each
  layer's known input span, ``attacks.solvers.spans.SpanResidual``'s quantity) and the two-sided one
  (the span's basis inside the span of all candidates' tokens: sum of squared sines of the principal
  angles / r), both 0 at the client's batch; a duplicated image scores 0 on the first, not the second;
- ``attack``: ``batch_match`` itself from its random start (``--attack-iterations``, ``--tv``), PSNR
  after assignment and CPU time.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path

import timm
import torch
import torch.nn as nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import attacks  # noqa: E402
import fedmjp  # noqa: E402,F401  (registers the models)
from attacks.optimization.batch_match import gradient_distance  # noqa: E402
from attacks.optimization.breaching_adapter import matched_names  # noqa: E402
from attacks.solvers.spans import InputSpan, input_spans  # noqa: E402
from benchmark.scoring import flat_psnr, pair_reconstructions  # noqa: E402
from fedmjp.checkpoint import load_checkpoint  # noqa: E402
from fedmjp.data import open_image, preprocess  # noqa: E402

_logger = logging.getLogger("batch_match_basin")


def shipped_deit() -> nn.Module:
    """The shipped CIFAR DeiT in float64, eval mode, fused attention off (double backward)."""
    torch.manual_seed(0)
    model = timm.create_model("mjp_vit_cifar_patch4_32", variant="plain", first_block="april", depth=4)
    load_checkpoint(model, ROOT / "checkpoints" / "cifar_deit.safetensors")
    model = model.eval().double()
    for blk in model.blocks:
        blk.attn.fused_attn = False
    return model


def paired_psnr(rec: torch.Tensor, ref: torch.Tensor) -> list[float]:
    """PSNR (dB) of each reference image against the reconstruction the assignment pairs it with."""
    order = pair_reconstructions(rec, ref)
    mse = (rec[order].clamp(0, 1) - ref).pow(2).flatten(1).mean(1)
    return (10 * torch.log10(1 / mse)).tolist()


class SpanAgreement:
    """One- and two-sided agreement of candidates' layer inputs with the spans a batch update gives.

    For a layer whose weight gradient has the row space S (basis V, r = B*T columns at B*T <=
    fan-in), the B candidates' T tokens A [B*T, fan_in] satisfy the batch's identity when every
    token lies in S (one-sided: ||A - A V V^T||^2 / ||A||^2) and S lies in span(A) (two-sided:
    (r - ||Q^T V||_F^2) / r with Q an orthonormal basis of span(A), the mean squared sine of the
    principal angles). The first is per token, so B copies of one image satisfy it; the second needs
    all B*T directions and does not. Only layers with r equal to the candidates' row count enter the
    two-sided mean (in the last block and the head only the class tokens are constrained).
    """

    def __init__(self, model: nn.Module, spans: list[InputSpan]) -> None:
        self.model, self.spans, self._inputs = model, spans, {}
        modules = dict(model.named_modules())
        self._hooks = [modules[s.name].register_forward_hook(self._keep(s.name)) for s in spans]

    def _keep(self, name: str):
        def hook(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
            self._inputs[name] = args[0]
        return hook

    def __call__(self, x: torch.Tensor) -> tuple[float, float]:
        """(one-sided mean, two-sided mean) over the layers at candidates x [B, C, H, W]."""
        self._inputs = {}
        with torch.no_grad():
            self.model(x)
        one, two = [], []
        for span in self.spans:
            A = self._inputs[span.name]
            A = A[:, None] if A.dim() == 2 else A
            A = (A if span.rows is None else A[:, :span.rows]).reshape(-1, A.shape[-1])
            V = span.basis
            one.append(float((A - (A @ V) @ V.T).pow(2).sum() / A.pow(2).sum()))
            if V.shape[1] == A.shape[0]:
                Q, _ = torch.linalg.qr(A.T)
                two.append(float((V.shape[1] - (Q.T @ V).pow(2).sum()) / V.shape[1]))
        return sum(one) / len(one), sum(two) / max(len(two), 1)

    def close(self) -> None:
        for h in self._hooks:
            h.remove()


def lbfgs(objective, x0: torch.Tensor, iterations: int) -> torch.Tensor:
    """``iterations`` L-BFGS iterations (strong Wolfe, ``batch_match``'s settings) from x0."""
    x = x0.clone().requires_grad_(True)
    opt = torch.optim.LBFGS([x], lr=1, max_iter=iterations, history_size=50, line_search_fn="strong_wolfe",
                            tolerance_grad=1e-20, tolerance_change=1e-30)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        val = objective(x)
        val.backward()
        return val

    opt.step(closure)
    return x.detach()


def load_pair(folder: Path, files: list[int]) -> torch.Tensor:
    """Files ``files`` of the sorted image folder at 32 px, [B, 3, 32, 32] float64 in [0, 1]."""
    names = sorted(p for p in folder.iterdir() if p.is_file())
    if not names:
        raise SystemExit(f"no image files in {folder}")
    bad = [i for i in files if not 0 <= i < len(names)]
    if bad:
        raise SystemExit(f"--files {bad}: the folder {folder} has {len(names)} files")
    return torch.stack([preprocess(open_image(names[i]), 32) for i in files]).double()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default="$FEDMJP_DATA/imagenet-sample")
    p.add_argument("--files", default="41,138")
    p.add_argument("--labels", default="3,5")
    p.add_argument("--noise", default="0.1,0.3", help="RMS of the start's noise around the batch (comma list)")
    p.add_argument("--iterations", type=int, default=50, help="L-BFGS iterations from each noisy start")
    p.add_argument("--attack-iterations", type=int, default=0, help="batch_match's own run (0: skip)")
    p.add_argument("--tv", type=float, default=0.0, help="batch_match's tv for --attack-iterations")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(1)
    files = [int(v) for v in args.files.split(",")]
    labels = torch.tensor([int(v) for v in args.labels.split(",")])
    if len(labels) != len(files):
        raise SystemExit(f"--labels {args.labels} names {len(labels)} labels for {len(files)} --files")
    x = load_pair(Path(os.path.expandvars(args.data)), files)
    model = shipped_deit()
    mean = torch.tensor(model.default_cfg["mean"]).double()[:, None, None]
    std = torch.tensor(model.default_cfg["std"]).double()[:, None, None]
    xn = (x - mean) / std
    update = attacks.compute_update(model, xn, labels)
    B, tokens = len(files), model.patch_embed.num_patches + 1
    flat = flat_psnr(x, mean.flatten().tolist())  # the benchmark rows' flat_psnr column
    _logger.info("flat: mean colour PSNR %s dB", [round(v, 2) for v in flat.tolist()])

    params = dict(model.named_parameters())
    names = matched_names(model, update, tuple(x.shape[1:]))
    term = gradient_distance(model, [params[n] for n in names], [update[n] for n in names], labels)
    agree = SpanAgreement(model, input_spans(model, update, B * tokens))
    _logger.info("span at the batch: one-sided %.1e two-sided %.1e; image 1 twice: %.1e / %.2e",
                 *agree(xn), *agree(xn[:1].expand_as(xn)))
    gen = torch.Generator().manual_seed(0)
    for sigma in [float(v) for v in args.noise.split(",") if v.strip()]:
        x0 = xn + sigma * torch.randn(xn.shape, generator=gen, dtype=torch.float64)
        t0 = time.process_time()
        x1 = lbfgs(term, x0, args.iterations)
        cpu = time.process_time() - t0
        f0, f1 = float(term(x0).detach()), float(term(x1).detach())
        _logger.info("basin sigma %.2f: objective %.2e -> %.2e, PSNR %s -> %s dB, moved %.3f RMS, %d its, %.0f CPU-s",
                     sigma, f0, f1, [round(v, 2) for v in paired_psnr(x0 * std + mean, x)],
                     [round(v, 2) for v in paired_psnr(x1 * std + mean, x)], float((x1 - x0).pow(2).mean().sqrt()),
                     args.iterations, cpu)
        _logger.info("span sigma %.2f: one-sided %.1e two-sided %.1e", sigma, *agree(x0))
    agree.close()
    if args.attack_iterations > 0:
        t0 = time.process_time()
        res = attacks.create_attack("batch_match", iterations=args.attack_iterations, tv=args.tv).reconstruct(
            model, update, {"num_images": B, "labels": labels.tolist(), "mean": mean.flatten().tolist(),
                            "std": std.flatten().tolist()})
        if res.failed:
            raise SystemExit(f"batch_match failed: {res.reason}")
        _logger.info("attack batch_match %d its tv %g: PSNR %s dB, objective %.2e, %.0f CPU-s", args.attack_iterations,
                     args.tv, [round(v, 2) for v in paired_psnr(res.images.double(), x)], res.stats[0]["objective"],
                     time.process_time() - t0)


if __name__ == "__main__":
    main()
