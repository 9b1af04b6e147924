"""What a client's precision or defence leaves of block 0's roots: float64 against float32 updates,
and defended ones, side by side.

    OMP_NUM_THREADS=1 python bench/roots_floor.py --checkpoint checkpoints/deits224_mjp.safetensors \\
        --images $FEDMJP_DATA/imagenet-sample --num-images 2
    OMP_NUM_THREADS=1 python bench/roots_floor.py --checkpoint checkpoints/cifar_deit.safetensors \\
        --images $FEDMJP_DATA/cifar10.tar.gz --num-images 4 --precisions float64 \\
        --defences '[{name: quantize, bits: 16}, {name: quantize, bits: 12}, {name: local_dp, sigma: 1.0e-6}]'

For each photograph (an MJP client's batch-1 FedSGD update, gamma ``--gamma`` of the patches shuffled
where the model has E_unk) and each precision (``--precisions``): fc2's update's singular values at
B T and B T + 1 (relative to the largest; the span is separable while the first stands well above the
second), the ranks of fc1's and fc2's spans the attack's rank test sees (T: the search can run), the
squared residual of the true tokens' fc1 inputs in block 0's per-token problem (median and largest)
against the root search's tolerance, and how many true tokens the warm start (the closed form's read,
:mod:`attacks.structure.warm`) converges to, with its wall time. A precision whose true tokens sit
above the tolerance leaves the search nothing to find.

Each ``--defences`` spec adds a row per photograph for the update as the client sends it under that
defence (``defences.transforms.apply_update_defence``, seeded). There the rank test refuses, and the
row says what a noise-aware read would still have: fc2's update's span truncated to its known rank
B T (the top B T right singular vectors: total least squares), and the distance of each true token's
unit fc2 input (its MLP activation) from it, median and largest, beside the smallest distance of a
token of the same photograph mirrored (tokens of no client, where a root search must not stop). True
tokens well below the mirrored ones: the roots are still separable at the defence's noise. The last
column runs the per-token problem on both truncated spans from each true token (``--iterations``
Levenberg-Marquardt steps) and gives how far the minimum it reaches lies from the token: the best a
noise-aware root search could return, before any linear step. The row then hands both sets to the
linear steps (:func:`attacks.structure.linear.token_equations` on the defended update, each token's
embedding against every position: :func:`attacks.structure.placement.position_residuals`) and
counts the tokens whose best position is their own, first from the true roots, then from those
minima: what the read's next step makes of roots that sit where a search would stop, and the PSNR
of the image (x~'s unshuffled region on an MJP client) that takes every best fit. With
``--search-rounds R`` the root search itself runs on the truncated spans
(:func:`attacks.structure.roots.find_roots`, 32 starts a round, at most R rounds, a start kept where
its squared residual is below ``--search-tol``): how many near-roots it finds from scratch, how
many of them lie within 1e-2 (1 - cos) of a true token, its wall time, and what the linear steps
make of the roots it found (as from the minima: a read from scratch that takes every best fit).
"""
from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import attacks  # noqa: E402
from attacks.solvers.spans import input_spans, span_rank, truncated_span  # noqa: E402
from patchgrid import patchify  # noqa: E402
from attacks.structure.linear import embeddings_less_shift, token_equations  # noqa: E402
from attacks.structure.placement import patch_at, position_residuals, token_offsets  # noqa: E402
from attacks.structure.roots import find_roots  # noqa: E402
from attacks.structure.token_roots import MLPSpans  # noqa: E402
from attacks.structure.warm import closed_form_tokens, warm_roots  # noqa: E402
from defences.spec import DefenceSpec, validate_defence  # noqa: E402
from defences.transforms import apply_update_defence  # noqa: E402
from fedmjp.data import load_images  # noqa: E402
from fedmjp.trainutils import model_from_checkpoint  # noqa: E402

_logger = logging.getLogger("roots_floor")
#: the root search's tolerance on a token's squared residual (attacks.structure.roots.find_roots)
SEARCH_TOL = 1e-16


def fc1_inputs(model: torch.nn.Module, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Every token's fc1 input [T, D] of the image ``x`` [1, C, H, W] (model input), float64."""
    seen: dict[str, torch.Tensor] = {}
    hook = model.blocks[0].mlp.fc1.register_forward_hook(lambda _m, a, _o: seen.__setitem__("u", a[0].detach()))
    with torch.no_grad():
        model(x, **({"unk_mask": mask} if mask is not None else {}))
    hook.remove()
    return seen["u"][0].double()


def span_distances(model: torch.nn.Module, fc2_update: torch.Tensor, rank: int, tokens: torch.Tensor) -> torch.Tensor:
    """[n] distance of each token's unit fc2 input (its activation) from the row space of fc2's update
    truncated to ``rank`` (:func:`attacks.solvers.spans.truncated_span`)."""
    V = truncated_span(fc2_update, rank).T
    blk = model.blocks[0]
    with torch.no_grad():
        a = blk.mlp.act(blk.mlp.fc1(tokens))
    a = a / a.norm(dim=-1, keepdim=True)
    return (a - (a @ V.T) @ V).norm(dim=-1)


def nearest_minima(model: torch.nn.Module, update: dict, rank: int, truth: torch.Tensor, iterations: int) -> torch.Tensor:
    """[n, D] the minimum of block 0's per-token problem (:class:`attacks.structure.token_roots.MLPSpans`)
    that Levenberg-Marquardt reaches from each true token's fc1 input, on fc1's and fc2's spans
    truncated to ``rank`` (total least squares): the best a noise-aware root search could land on,
    before any linear step."""
    S1, S2 = (truncated_span(update[f"blocks.0.mlp.{k}.weight"], rank) for k in ("fc1", "fc2"))
    problem = MLPSpans(model.blocks[0], S1, S2)
    with torch.no_grad():
        alpha = problem.solve(truth @ S1, iterations, 0.0)[0]
    return alpha @ S1.T


def read_from_roots(model: torch.nn.Module, update: dict, roots: torch.Tensor, mask: torch.Tensor | None,
                    x: torch.Tensor, tokens: torch.Tensor | None = None) -> tuple[int, float]:
    """What the linear steps make of a batch-1 update's roots [n, D], each the fc1 input of the token
    ``tokens`` [n] names (None: n = T, in token order: the class token, then the patches): step 2 on
    ``update`` (:func:`attacks.structure.linear.token_equations`), each embedding against every
    position (:func:`attacks.structure.placement.position_residuals`). Returns how many roots sit best
    at their own token's position (an MJP client's shuffled patches at E_unk's), and
    the PSNR against ``x`` (the model input, [1, C, H, W]) of the image with each grid position's
    best-fitting root's patch there (:func:`attacks.structure.placement.patch_at`) and the mean colour
    where none fits best (an MJP client's: x~'s unshuffled region, whose patches have a position), in
    [0, 1]: a read that takes every best fit, however far off."""
    with torch.no_grad():
        eq = token_equations(model, update, roots)
        _, off, M, Qm = token_offsets(model)
        base = embeddings_less_shift(model.blocks[0].attn, eq)
        res = position_residuals(base, off, Qm)
    best, pos = res.min(1)
    T = int(model.pos_embed.shape[1])
    own = torch.arange(T)
    if mask is not None:  # E_unk's row of the offsets follows the T positions
        own[1:][mask[0]] = T
    own = own if tokens is None else own[tokens]
    p = int(model.patch_embed.patch_size[0])
    patches = torch.zeros(T - 1, M.shape[1] - 1, dtype=torch.float64)  # the mean colour: 0 here
    filled: set[int] = set()
    for j in torch.argsort(best).tolist():
        at = int(pos[j])
        if 1 <= at < T and at not in filled:
            patches[at - 1] = patch_at(M, off[at], base[j])[1]
            filled.add(at)
    std, mean = (torch.tensor(model.default_cfg[k], dtype=torch.float64).repeat_interleave(p * p) for k in ("std", "mean"))
    pixels = lambda v: v * std + mean  # noqa: E731  (model input -> [0, 1])
    err = (pixels(patches).clamp(0, 1) - pixels(patchify(x.double(), p)[0].flatten(1))).pow(2)
    region = torch.ones(err.shape[0], dtype=torch.bool) if mask is None else ~mask[0]
    return int((pos == own).sum()), float(10 * torch.log10(1 / err[region].mean()))


def searched(model: torch.nn.Module, update: dict, rank: int, truth: torch.Tensor, iterations: int, rounds: int,
             tol: float, seed: int, mask: torch.Tensor | None, x: torch.Tensor) -> str:
    """``--search-rounds``: the root search from scratch on fc1's and fc2's spans truncated to ``rank``,
    a start kept below ``tol``: "found (near a true token) in seconds; at their own position, the image
    of every best fit" (:func:`read_from_roots` on the roots found)."""
    S1, S2 = (truncated_span(update[f"blocks.0.mlp.{k}.weight"], rank) for k in ("fc1", "fc2"))
    t0 = time.perf_counter()
    got = find_roots(model.blocks[0], S1, S2, update["blocks.0.mlp.fc1.weight"], update["blocks.0.mlp.fc2.weight"],
                     rank, 32, rounds, iterations, torch.Generator().manual_seed(seed), tol=tol).roots
    if not got.shape[0]:
        return f"0 ({time.perf_counter() - t0:.0f} s)"
    seconds = time.perf_counter() - t0
    cos = ((got / got.norm(dim=1, keepdim=True)) @ (truth / truth.norm(dim=1, keepdim=True)).T).max(1)
    placed, db = read_from_roots(model, update, got, mask, x, cos.indices)
    return f"{got.shape[0]} ({int((1 - cos.values < 1e-2).sum())}) in {seconds:.0f} s; {placed}, {db:.2f} dB"


def one_update(model: torch.nn.Module, x: torch.Tensor, mask: torch.Tensor | None, dtype: torch.dtype,
               iterations: int, defence: DefenceSpec | None = None, seed: int = 0, search_rounds: int = 0,
               search_tol: float = 1e-3) -> dict:
    """The row of one photograph ``x`` [1, C, H, W] (model input) at the client's ``dtype``, the update
    sent under ``defence`` (seeded by ``seed``) where one is given."""
    m = model.to(dtype)
    seen: dict[str, torch.Tensor] = {}
    hook = m.blocks[0].mlp.fc1.register_forward_hook(lambda _m, a, _o: seen.__setitem__("u", a[0].detach()))
    kw = {"unk_mask": mask} if mask is not None else {}
    update = attacks.compute_update(m, x.to(dtype), torch.tensor([3]), **kw)
    hook.remove()
    m.double()
    update = {k: v.double() for k, v in update.items()}
    if defence is not None:
        update = {k: v.double() for k, v in
                  apply_update_defence(update, defence, torch.Generator().manual_seed(seed)).items()}
    T = int(m.pos_embed.shape[1])
    sv = torch.linalg.svdvals(update["blocks.0.mlp.fc2.weight"])
    spans = {sp.name: sp.basis for sp in input_spans(m, update, T)}
    row = dict(tokens=T, gap_in=float(sv[T - 1] / sv[0]), gap_out=float(sv[T] / sv[0]))
    truth = seen["u"][0].double()
    own = span_distances(m, update["blocks.0.mlp.fc2.weight"], T, truth)
    mirrored = span_distances(m, update["blocks.0.mlp.fc2.weight"], T, fc1_inputs(m, x.double().flip(-1), mask))
    row.update(span_median=float(own.median()), span_worst=float(own.max()), span_other=float(mirrored.min()))
    if "blocks.0.mlp.fc1" not in spans or "blocks.0.mlp.fc2" not in spans:  # the rank test sees no span of B T
        ranks = [span_rank(update[f"blocks.0.mlp.{k}.weight"], T)[0] for k in ("fc1", "fc2")]
        minima = nearest_minima(m, update, T, truth, iterations)
        near = (minima - truth).norm(dim=-1) / truth.norm(dim=-1)
        return dict(row, ranks=ranks, median=float("nan"), worst=float("nan"), warm=0, true=0, warm_s=0.0,
                    near_median=float(near.median()), near_worst=float(near.max()),
                    placed_true=read_from_roots(m, update, truth, mask, x), placed_near=read_from_roots(m, update, minima, mask, x),
                    search=searched(m, update, T, truth, iterations, search_rounds, search_tol, seed, mask, x)
                    if search_rounds else "—")
    S1, S2 = spans["blocks.0.mlp.fc1"], spans["blocks.0.mlp.fc2"]
    problem = MLPSpans(m.blocks[0], S1, S2)
    with torch.no_grad():
        value = problem.value(truth @ S1)
    t0 = time.perf_counter()
    near = closed_form_tokens(m, update)
    roots = warm_roots(problem, S1, near, iterations) if near is not None else truth[:0]
    unit = lambda t: t / t.norm(dim=-1, keepdim=True)  # noqa: E731
    true = int((1 - (unit(roots) @ unit(truth).T).max(1).values < 1e-10).sum()) if roots.shape[0] else 0
    return dict(row, ranks=[T, T], median=float(value.median()), worst=float(value.max()), warm=int(roots.shape[0]),
                true=true, warm_s=time.perf_counter() - t0, near_median=float("nan"), near_worst=float("nan"),
                placed_true=None, placed_near=None, search="—")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", default=str(ROOT / "checkpoints" / "cifar_deit_mjp.safetensors"))
    p.add_argument("--images", default="embedded", help="a folder of photographs, an archive, or 'embedded'")
    p.add_argument("--num-images", type=int, default=2)
    p.add_argument("--gamma", type=float, default=0.27, help="share of the patches an MJP client shuffles")
    p.add_argument("--iterations", type=int, default=60, help="the warm start's Levenberg-Marquardt steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--search-rounds", type=int, default=0, help="defended rows: rounds of the root search from "
                   "scratch on the truncated spans (0: off)")
    p.add_argument("--search-tol", type=float, default=1e-3, help="the search's squared-residual tolerance")
    p.add_argument("--precisions", default="float64,float32", help="the clients' precisions, comma-separated")
    p.add_argument("--defences", default=None, help="defences to apply to each precision's update, a YAML list "
                   "of specs, e.g. '[{name: quantize, bits: 16}]' (docs/defences.md)")
    args = p.parse_args(argv)
    defences: list[DefenceSpec | None] = [None]
    if args.defences:
        try:
            specs = yaml.safe_load(args.defences)
            if not isinstance(specs, list) or not specs:
                raise ValueError("give a non-empty YAML list of defence specs")
            defences += [validate_defence(spec) for spec in specs]
        except (yaml.YAMLError, ValueError) as err:
            p.error(f"--defences {args.defences!r}: {err}")
    dtypes = {"float64": torch.float64, "float32": torch.float32}
    if not args.precisions or any(d not in dtypes for d in args.precisions.split(",")):
        p.error(f"--precisions {args.precisions!r}: give float64 and/or float32, comma-separated")
    if args.num_images < 1 or args.iterations < 1:
        p.error("--num-images and --iterations take at least 1")
    if not 0 <= args.search_rounds <= 1000 or not 0 < args.search_tol < 1:
        p.error(f"--search-rounds {args.search_rounds} / --search-tol {args.search_tol}: give 0 to 1000 rounds and "
                "a tolerance in (0, 1)")
    if not 0.0 <= args.gamma <= 1.0:
        p.error(f"--gamma {args.gamma}: give a share in [0, 1]")
    if not Path(args.checkpoint).is_file():
        p.error(f"--checkpoint {args.checkpoint}: no such file")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(1)
    model, _ = model_from_checkpoint(args.checkpoint)
    for blk in model.blocks:
        blk.attn.fused_attn = False
    side = int(model.patch_embed.img_size[0])
    ims = load_images(args.images, side, args.num_images, int(model.num_classes))
    mean = torch.tensor(model.default_cfg["mean"])[:, None, None]
    std = torch.tensor(model.default_cfg["std"])[:, None, None]
    N = int(model.patch_embed.num_patches)
    print("| photograph | client | fc2 sv at B T / B T + 1 | fc1, fc2 span ranks seen (of T) | true tokens' squared "
          f"residual: median, largest (search tol {SEARCH_TOL:g}) | warm roots (true) of T | warm start s | "
          "distance from fc2's rank-B T span: true tokens median, largest; mirrored tokens smallest | "
          "per-token minimum reached from each true token: relative distance median, largest | "
          "the linear steps: roots at their own position (of T), the image of every best fit (dB): from the true "
          "roots; from those minima | search from scratch: near-roots (near a true token); at their own position, the "
          "image of every best fit |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for i in range(len(ims)):
        mask = None
        if getattr(model, "unk_embed", None) is not None:
            mask = torch.zeros(1, N, dtype=torch.bool)
            gen = torch.Generator().manual_seed(1000 * args.seed + i)
            mask[0, torch.randperm(N, generator=gen)[:round(args.gamma * N)]] = True
        x = ((ims.images[i:i + 1] - mean) / std).double()
        for name in args.precisions.split(","):
            for defence in defences:
                r = one_update(model, x, mask, dtypes[name], args.iterations, defence, 1000 * args.seed + i,
                               args.search_rounds, args.search_tol)
                client = name if defence is None else f"{name}, {defence.label}"
                print(f"| {i} | {client} | {r['gap_in']:.1e} / {r['gap_out']:.1e} | {r['ranks'][0]}, {r['ranks'][1]} | "
                      f"{r['median']:.1e}, {r['worst']:.1e} | {r['warm']} ({r['true']}) of {r['tokens']} | "
                      f"{r['warm_s']:.0f} | {r['span_median']:.1e}, {r['span_worst']:.1e}; {r['span_other']:.1e} | "
                      f"{r['near_median']:.1e}, {r['near_worst']:.1e} | "
                      + ("— |" if r["placed_true"] is None else "{}, {:.2f}; {}, {:.2f} |".format(
                          *r["placed_true"], *r["placed_near"])) + f" {r['search']} |",
                      flush=True)


if __name__ == "__main__":
    main()
