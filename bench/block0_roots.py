"""``block0_roots`` against ``batch_match`` on the same batch updates, side by side.

    FEDMJP_DATA=... OMP_NUM_THREADS=1 python bench/block0_roots.py --batch-sizes 2 --updates 4

Random batches of the first ``--pool`` CIFAR-10 validation images, the shipped CIFAR DeiT with its
block 0 as trained (the standard pre-norm block: ``block0_roots`` needs it), float64 FedSGD
updates, labels known. Per update: the roots found (of B T) and the starts they took, the mean
PSNR after pairing of ``block0_roots``, of ``batch_match`` (``--match-iterations``, tv 1) and of a
flat image of the normalisation mean colour, and each attack's wall time; then the medians per B
and the ratio of the wall times. ``--images`` takes a folder of JPEGs or an archive instead.

``--past-floor B`` reads the roots of a batch of B past B T = D - 1 (B >= 3 here), where no
layer's span holds a true token: near-roots against fc2's incomplete span (2 ``--starts``
steered starts), fc2's span completed from 3 k of them (k = B T - its rank;
:mod:`attacks.structure.completion`), then ``--rounds`` rounds of the root search in the completed
span. Per update: how many distinct true tokens the near-roots sit next to (1 - cos below
``NEAR_GAP``, against the count the fit needs), the completion's residual and its points' largest
1 - cos to a true token, the roots found of B T and how many are true tokens, each stage's wall
time; where the completion refuses, its reason beside the near-roots' count. ``--oracle N`` adds
what no search can beat: from each of N true tokens (a random draw; every token where N >= B T)
the same Levenberg-Marquardt steps against fc2's incomplete span, and how many of the minima they
reach lie within ``NEAR_GAP`` of their own token (scaled to B T where N < B T): a token whose own
start ends farther off has no near-root for any search to find.

``--membership B`` asks what the roots leave (docs/design.md, "What survives batching"): given every
true fc1 input of a batch of B, block 0's fc1 inputs of candidate images are fitted to them
(float64 L-BFGS from random images, ``--fit-iterations`` steps of 5) with each root at its true image and position,
and with the roots assigned by the fit itself (one optimal assignment over all B T tokens,
recomputed every step); it prints the PSNR after pairing of both.

``--design-a N`` reads instead N photographs (32 px, ``--images``, from index ``--first``) off the
shipped DeiT+MJP with APRIL's design-A block 0 (batch 1, float64, 17 of 64 positions shuffled, a
mask per image drawn from ``--seed`` and its index): the image given is x~ itself. Per image:
whether the read succeeded (else its reason), the roots' rounds, the attention solve's residual,
the PSNR of x~'s unshuffled region and of the shuffled set (the patches paired by an optimal
assignment: the update does not fix their order), and the wall time; then how many were read
exactly (both >= 90 dB).

    OMP_NUM_THREADS=1 python bench/block0_roots.py --images embedded --design-a 3"""
from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
from pathlib import Path

import timm
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import attacks  # noqa: E402
from attacks.api.base import AttackFailure  # noqa: E402
from attacks.structure.design_a import STRUCTURED_ROUNDS  # noqa: E402
from attacks.structure.polish import SPAN_POLISH_JACOBIANS  # noqa: E402
import fedmjp  # noqa: E402,F401  (registers the models)
from benchmark.scoring import pair_reconstructions  # noqa: E402
from fedmjp.checkpoint import load_checkpoint  # noqa: E402
from fedmjp.data import load_images  # noqa: E402

_logger = logging.getLogger("block0_roots")


def psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(10 * torch.log10(1 / ((a.double() - b.double()) ** 2).mean().clamp_min(1e-30)))


def paired_psnr(rec: torch.Tensor, x: torch.Tensor) -> float:
    order = pair_reconstructions(rec.float(), x.float())
    return statistics.mean(psnr(rec[order[b]], x[b]) for b in range(x.shape[0]))


def fc1_inputs(model: torch.nn.Module, xn: torch.Tensor) -> torch.Tensor:
    """Block 0's fc1 inputs [B T, D] of model inputs xn (the standard pre-norm block)."""
    z = model.norm_pre(model._pos_embed(model.patch_embed(xn)))
    blk = model.blocks[0]
    return blk.norm2(z + blk.ls1(blk.attn(blk.norm1(z)))).reshape(-1, z.shape[-1])


def membership(model: torch.nn.Module, x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor, steps: int,
               gen: torch.Generator) -> dict[str, float]:
    """``--membership``: the fit to the true roots, assigned by the truth and by the fit itself."""
    from scipy.optimize import linear_sum_assignment

    m, s = mean[:, None, None], std[:, None, None]
    with torch.no_grad():
        U = fc1_inputs(model, (x - m) / s)
    start = 0.5 * torch.randn(x.shape, generator=gen, dtype=torch.float64)
    out = {}
    for how in ("true", "self-assigned"):
        X = start.clone().requires_grad_(True)
        opt = torch.optim.LBFGS([X], lr=1, max_iter=5, history_size=50, line_search_fn="strong_wolfe")

        def cost() -> torch.Tensor:
            opt.zero_grad()
            u = fc1_inputs(model, X)
            target = U
            if how != "true":
                col = linear_sum_assignment(torch.cdist(u.detach(), U).pow(2).numpy())[1]
                target = U[torch.as_tensor(col)]
            c = (u - target).pow(2).sum(1).mean()
            c.backward()
            return c

        t0 = time.perf_counter()
        for _ in range(steps):
            opt.step(cost)
        with torch.no_grad():
            out[how] = paired_psnr((X * s + m).clamp(0, 1), x)
        _logger.info("membership, B = %d (%d tokens, width %d): roots at their %s image and position: %.1f dB "
                     "after %d L-BFGS steps, %.0f s", x.shape[0], U.shape[0], U.shape[1],
                     "true" if how == "true" else "own (optimal assignment)", out[how], steps,
                     time.perf_counter() - t0)
    return out


#: ``--past-floor``: the 1 - cos to a true token within which a near-root counts as near it
#: (docs/results/structure.md, "At B = 4"; tests/test_bench_scripts.py: test_block0_roots_past_floor_mode_reads_true_roots_at_b3)
NEAR_GAP = 1e-2


def near_coverage(points: torch.Tensor, unit: torch.Tensor) -> int:
    """How many distinct true tokens (``unit``: their unit fc1 inputs) have a near-root among ``points``
    within :data:`NEAR_GAP`: the completion needs more than k true tokens among its points."""
    cos = (points / points.norm(dim=1, keepdim=True)) @ unit.T
    best = cos.max(1)
    return len(set(best.indices[1 - best.values < NEAR_GAP].tolist()))


def reachable(problem, truth: torch.Tensor, sample: int, generator: torch.Generator) -> tuple[int, int, float]:
    """``--oracle``: (tokens started, how many of them end within :data:`NEAR_GAP` of themselves, the
    median 1 - cos) when each of ``sample`` true tokens (fc1 inputs ``truth``; a random draw) starts
    the near-roots' Levenberg-Marquardt steps against ``problem``'s spans: the most true tokens any
    search for near-roots can reach (a start elsewhere ends at one of these minima or farther off)."""
    pick = torch.randperm(truth.shape[0], generator=generator)[:sample]
    with torch.no_grad():
        alpha, _ = problem.solve(truth[pick] @ problem.S1, 60, settled=0.0)  # the token itself (an fc1 input)
    u = alpha @ problem.S1.T
    gap = 1 - ((u / u.norm(dim=1, keepdim=True)) * (truth[pick] / truth[pick].norm(dim=1, keepdim=True))).sum(1)
    return int(pick.numel()), int((gap < NEAR_GAP).sum()), float(gap.median())


def past_floor(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, mean: torch.Tensor, std: torch.Tensor,
               starts: int, rounds: int, seed: int, oracle: int = 0) -> dict:
    """``--past-floor``: fc2's span completed, then the root search in it, against the true tokens;
    ``oracle`` > 0: :func:`reachable` from that many true tokens first (``row["oracle"]``)."""
    from attacks.structure.completion import POINTS_PER_DIMENSION, complete_span, least_points, near_roots
    from attacks.structure.roots import find_roots
    from attacks.structure.token_roots import MLPSpans

    B, D = x.shape[0], int(model.embed_dim)
    xn = (x - mean[:, None, None]) / std[:, None, None]
    update = attacks.compute_update(model, xn, y)
    with torch.no_grad():
        truth = fc1_inputs(model, xn)
    unit = truth / truth.norm(dim=1, keepdim=True)
    gap = lambda u: float((1 - ((u / u.norm(dim=1, keepdim=True)) @ unit.T).max(1).values).max())  # noqa: E731
    blk, n = model.blocks[0], truth.shape[0]
    G2 = update["blocks.0.mlp.fc2.weight"].double()
    _, sv, Vh = torch.linalg.svd(G2, full_matrices=False)
    r = int((sv > 1e-10 * sv[0]).sum())
    full = torch.eye(D, dtype=torch.float64)  # B T > D: fc1's span is the whole input space
    gen = torch.Generator().manual_seed(seed)
    problem = MLPSpans(blk, full, Vh[:r].T.contiguous())
    extra: dict = {}
    if oracle:
        t0 = time.perf_counter()
        started, within, median = reachable(problem, truth, oracle, torch.Generator().manual_seed(seed))
        extra = dict(oracle=f"{within} of {started} true tokens' own starts end within {NEAR_GAP:.0e} of them "
                     f"(median 1 - cos {median:.1e}; about {round(within * n / started)} of {n} tokens, "
                     f"{time.perf_counter() - t0:.0f} s)")
    t0 = time.perf_counter()
    points = near_roots(problem, POINTS_PER_DIMENSION * (n - r), 2 * starts, 60, gen)
    t1 = time.perf_counter()
    near = near_coverage(points, unit)
    try:
        done = complete_span(blk, Vh[:r].T.contiguous(), n, points)
    except AttackFailure as e:  # too few distinct near-roots (raise --starts), or too large
        return dict(extra, failed=str(e), near_s=t1 - t0, near=near, missing=n - r, points=int(points.shape[0]),
                    least=least_points(n - r, G2.shape[1], r, D))
    t2 = time.perf_counter()
    search = find_roots(blk, full, done.basis, update["blocks.0.mlp.fc1.weight"].double(), G2, n, starts, rounds, 60,
                        gen)
    t3 = time.perf_counter()
    hits = (search.roots / search.roots.norm(dim=1, keepdim=True)) @ unit.T
    true = (1 - hits.max(1).values < 1e-10)
    return dict(extra, tokens=n, rank=r, points=int(points.shape[0]), near=near, value=done.value, points_gap=gap(done.points),
                found=int(search.roots.shape[0]), true=int(true.sum()),
                distinct=len(set(hits.max(1).indices[true].tolist())), near_s=t1 - t0, complete_s=t2 - t1,
                search_s=t3 - t2)


def design_a_model() -> torch.nn.Module:
    """The shipped DeiT+MJP with the design-A block 0, float64 (``--design-a``)."""
    torch.manual_seed(0)
    model = timm.create_model("mjp_vit_cifar_patch4_32", variant="mjp", first_block="april", depth=4)
    load_checkpoint(model, ROOT / "checkpoints" / "cifar_deit_mjp.safetensors")
    return model.eval().double()


def design_a(model: torch.nn.Module, x: torch.Tensor, mask: torch.Tensor, attack, mean: torch.Tensor,
             std: torch.Tensor) -> dict:
    """``--design-a``: one read of x [1, C, 32, 32] (x~, pixels in [0, 1]) with ``mask`` [1, 64] shuffled
    off ``model`` (:func:`design_a_model`); the row the bench prints, as a dict."""
    from scipy.optimize import linear_sum_assignment

    upd = attacks.compute_update(model, (x - mean[:, None, None]) / std[:, None, None], torch.tensor([3]),
                                 unk_mask=mask)
    meta = {"num_images": 1, "mean": mean.tolist(), "std": std.tolist(), "labels": [3]}
    t0 = time.perf_counter()
    res = attack.reconstruct(model, upd, meta)
    row: dict = {"time_s": time.perf_counter() - t0, "failed": res.failed, "reason": res.reason}
    if res.failed:
        return row
    patches = lambda im: im.double().reshape(3, 8, 4, 8, 4).permute(1, 3, 0, 2, 4).reshape(64, 48)  # noqa: E731
    got, true = patches(res.images[0]), patches(x[0])
    S = mask[0]
    err = ((got[S][:, None] - true[S][None]) ** 2).mean(-1)
    rows, cols = linear_sum_assignment(err.numpy())
    to_db = lambda m: float(10 * torch.log10(1 / torch.as_tensor(m).clamp_min(1e-30)))  # noqa: E731
    s = res.stats[0]
    row.update(unshuffled_db=to_db(((got[~S] - true[~S]) ** 2).mean()), shuffled_db=to_db(err[rows, cols].mean()),
               roots_per_round=s["roots_per_round"], attention_residual=s.get("attention_residual"),
               structured_rounds=s.get("structured_rounds", 0), attention_floor=s.get("attention_floor"),
               span_polish=s.get("span_polish_jacobians"))
    return row


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--images", default="$FEDMJP_DATA/cifar10.tar.gz")
    p.add_argument("--batch-sizes", default="1,2")
    p.add_argument("--updates", type=int, default=4)
    p.add_argument("--pool", type=int, default=200)
    p.add_argument("--starts", type=int, default=32, help="root-finding starts per round")
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--match-iterations", type=int, default=200, help="batch_match's L-BFGS iterations (0: skip it)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--membership", type=int, default=0, help="batch size B of the membership test (0: off)")
    p.add_argument("--past-floor", type=int, default=0, help="batch size B of the roots read past B T = D - 1 "
                   "(0: off; B T must exceed D - 1)")
    p.add_argument("--oracle", type=int, default=0, help="--past-floor: true tokens to start the near-roots' "
                   "steps from, to count the tokens that have a near-root at all (0: off)")
    p.add_argument("--fit-iterations", type=int, default=40, help="--membership: L-BFGS steps")
    p.add_argument("--design-a", type=int, default=0, help="photographs to read off design A at B = 1 (0: off)")
    p.add_argument("--attention-iterations", type=int, default=40, help="--design-a: the attention solve's "
                   "iterations per start")
    p.add_argument("--attention-starts", type=int, default=2, help="--design-a: its random starts")
    p.add_argument("--structured-rounds", type=int, default=STRUCTURED_ROUNDS, help="--design-a: rounds of the position-structured "
                   "solve where no start reaches the truth (0: off)")
    p.add_argument("--span-polish", type=int, default=SPAN_POLISH_JACOBIANS, help="--design-a: Levenberg-Marquardt Jacobians of the span "
                   "polish of the structured solve's answer (0: off)")
    p.add_argument("--first", type=int, default=0, help="--design-a: the index of the first photograph")
    args = p.parse_args(argv)
    if args.first < 0 or not 0 <= args.design_a <= args.pool - args.first:
        p.error(f"--design-a {args.design_a} from --first {args.first}: give photographs that --pool {args.pool} "
                "holds (0: off)")
    try:  # the attack's own option checks (ranges of starts, rounds, attention_*)
        roots_attack = attacks.create_attack("block0_roots", starts=args.starts, rounds=args.rounds, seed=args.seed,
                                             attention_iterations=args.attention_iterations,
                                             attention_starts=args.attention_starts,
                                             structured_rounds=args.structured_rounds,
                                             span_polish=args.span_polish)
    except ValueError as e:
        p.error(str(e))
    if not 0 <= args.past_floor <= args.pool:
        p.error(f"--past-floor {args.past_floor}: give a batch size between 1 and --pool {args.pool} (0: off)")
    if args.oracle < 0 or (args.oracle and not args.past_floor):
        p.error(f"--oracle {args.oracle}: give a count of true tokens (0: off) together with --past-floor")
    if not 0 <= args.membership <= args.pool:
        p.error(f"--membership {args.membership}: give a batch size between 1 and --pool {args.pool} (0: off)")
    for flag in ("updates", "pool", "starts", "rounds", "fit_iterations"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} {getattr(args, flag)}: give at least 1")
    try:
        sizes = [int(b) for b in args.batch_sizes.split(",")]
    except ValueError:
        p.error(f"--batch-sizes {args.batch_sizes!r}: give comma-separated integers, e.g. 1,2")
    if not (args.design_a or args.membership or args.past_floor) and any(not 1 <= b <= args.pool for b in sizes):
        p.error(f"--batch-sizes {args.batch_sizes}: each must be between 1 and --pool {args.pool}")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(1)
    ims = load_images(args.images, 32, args.pool, 10)
    torch.manual_seed(0)
    model = timm.create_model("mjp_vit_cifar_patch4_32", variant="plain", first_block="standard", depth=4)
    load_checkpoint(model, ROOT / "checkpoints" / "cifar_deit.safetensors")
    model = model.eval().double()
    for blk in model.blocks:
        blk.attn.fused_attn = False
    mean = torch.tensor(model.default_cfg["mean"]).double()
    std = torch.tensor(model.default_cfg["std"]).double()
    gen = torch.Generator().manual_seed(args.seed)
    if args.design_a:
        model_a = design_a_model()
        exact = read = 0
        for i in range(args.first, args.first + args.design_a):
            mask = torch.zeros(1, 64, dtype=torch.bool)  # each image's own draw: the same with any --first
            mask[0, torch.randperm(64, generator=torch.Generator().manual_seed(1000 * args.seed + i))[:17]] = True
            row = design_a(model_a, ims.images[i:i + 1].double(), mask, roots_attack, mean, std)
            if row["failed"]:
                _logger.info("design A, image %d: failed: %s (%.0f s)", i, row["reason"], row["time_s"])
                continue
            exact += row["unshuffled_db"] >= 90 and row["shuffled_db"] >= 90
            read += row["unshuffled_db"] >= 35 and row["shuffled_db"] >= 30
            how = (f"structured solve, {row['structured_rounds']} rounds, against step 2's noise "
                   f"{row['attention_floor']:.1e}" if row["attention_floor"] is not None else "first starts")
            if row["span_polish"] is not None:
                how += f", span polish {row['span_polish']} Jacobians"
            _logger.info("design A, image %d: x~ unshuffled %.1f dB, shuffled set %.1f dB (roots per round %s, "
                         "attention residual %.1e, %s), %.0f s", i, row["unshuffled_db"], row["shuffled_db"],
                         row["roots_per_round"], row["attention_residual"], how, row["time_s"])
        _logger.info("design A: %d of %d images read exactly (both parts >= 90 dB), %d read to unshuffled "
                     ">= 35 dB and shuffled set >= 30 dB", exact, args.design_a, read)
        return
    if args.past_floor:
        if args.past_floor * int(model.pos_embed.shape[1]) <= int(model.embed_dim) - 1:
            p.error(f"--past-floor {args.past_floor}: B T = {args.past_floor * int(model.pos_embed.shape[1])} is "
                    f"within the floor D - 1 = {int(model.embed_dim) - 1}; give a larger B")
        for u in range(args.updates):
            idx = torch.randperm(len(ims), generator=gen)[:args.past_floor]
            row = past_floor(model, ims.images[idx].double(), ims.labels[idx], mean, std, args.starts, args.rounds,
                             args.seed + u, args.oracle)
            if "oracle" in row:
                _logger.info("past the floor, B=%d update %d: near-roots from the true tokens: %s", args.past_floor, u,
                             row["oracle"])
            if "failed" in row:
                _logger.info("past the floor, B=%d update %d: %d near-roots, near %d distinct true tokens (1 - cos < "
                             "%.0e; k = %d missing dimensions, the fit needs at least %d true tokens); failed: %s "
                             "(%.0f s)", args.past_floor, u, row["points"], row["near"], NEAR_GAP, row["missing"],
                             row["least"], row["failed"], row["near_s"])
                continue
            _logger.info("past the floor, B=%(B)d update %(u)d: fc2's span rank %(rank)d of %(tokens)d tokens, completed "
                         "from %(points)d near-roots (near %(near)d distinct true tokens) to a residual of %(value).1e (their largest 1 - cos to a true token "
                         "%(points_gap).1e); roots found %(found)d of %(tokens)d, %(true)d true tokens (%(distinct)d "
                         "distinct); near-roots %(near_s).0f s, completion %(complete_s).0f s, search %(search_s).0f s",
                         dict(row, B=args.past_floor, u=u))
        return
    if args.membership:
        x = ims.images[torch.randperm(len(ims), generator=gen)[:args.membership]].double()
        membership(model, x, mean, std, args.fit_iterations, gen)
        return
    match = attacks.create_attack("batch_match", iterations=args.match_iterations, tv=1.0) if args.match_iterations else None
    for B in sizes:
        got: dict[str, list[float]] = {"block0_roots": [], "batch_match": [], "flat": []}
        secs: dict[str, list[float]] = {"block0_roots": [], "batch_match": []}
        for u in range(args.updates):
            idx = torch.randperm(len(ims), generator=gen)[:B]
            x, y = ims.images[idx].double(), ims.labels[idx]
            upd = attacks.compute_update(model, (x - mean[:, None, None]) / std[:, None, None], y)
            meta = {"num_images": B, "mean": mean.tolist(), "std": std.tolist(), "labels": y.tolist()}
            flat = mean[None, :, None, None].expand_as(x)
            got["flat"].append(paired_psnr(flat, x))
            t0 = time.perf_counter()
            res = roots_attack.reconstruct(model, upd, meta)
            secs["block0_roots"].append(time.perf_counter() - t0)
            if res.failed:
                _logger.info("B=%d update %d: block0_roots failed: %s (%.0f s)", B, u, res.reason, secs["block0_roots"][-1])
                got["block0_roots"].append(float("nan"))
            else:
                got["block0_roots"].append(paired_psnr(res.images, x))
                s = res.stats[0]
                _logger.info("B=%d update %d: block0_roots %.1f dB (roots per round %s, %d starts, position "
                             "residual <= %.0e, runner-up >= %.2g), %.0f s", B, u, got["block0_roots"][-1],
                             s["roots_per_round"], s["root_starts"], s["position_residual_max"],
                             s["position_runner_up_min"], secs["block0_roots"][-1])
            if match is not None:
                t0 = time.perf_counter()
                res = match.reconstruct(model, upd, meta)
                secs["batch_match"].append(time.perf_counter() - t0)
                got["batch_match"].append(float("nan") if res.failed else paired_psnr(res.images, x))
                _logger.info("B=%d update %d: batch_match %.1f dB, flat image %.1f dB, %.0f s", B, u,
                             got["batch_match"][-1], got["flat"][-1], secs["batch_match"][-1])
        # a failed read has no images: the medians are over the reads that returned some
        med = {k: statistics.median([p for p in v if p == p]) if any(p == p for p in v) else float("nan")
               for k, v in got.items()}
        ok = sum(v == v for v in got["block0_roots"])
        ratio = (statistics.mean(secs["block0_roots"]) / statistics.mean(secs["batch_match"])
                 if secs["batch_match"] else float("nan"))
        _logger.info("B=%d, %d updates: median PSNR block0_roots %.1f dB (over %d/%d reads), batch_match %.1f dB, "
                     "flat image %.1f dB; wall time block0_roots / batch_match %.2f", B, args.updates,
                     med["block0_roots"], ok, args.updates, med["batch_match"], med["flat"], ratio)


if __name__ == "__main__":
    main()
