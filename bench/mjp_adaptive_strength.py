"""How strong is the MJP-aware attacker? Per-image PSNR of ``mjp_adaptive`` against APRIL.

For each image (32 px, float64 clients, gamma 0.27) a design-A MJP ViT (``mjp_vit_cifar_patch4_32``,
depth 4, variant mjp, April surgery as in configs/default.yaml) with fresh weights, and the same
weights with the query/key rows of every block's qkv scaled (``--qk-scale``, 4 by default: attention
about as sharp as a trained model's), produces a client update; each attacker reconstructs it:

- ``april``: ``april_analytic`` (plain APRIL, the attacker MJP was designed against);
- ``prior``: ``mjp_adaptive`` with ``refine="prior"`` (first layer only + an image prior);
- ``span``: ``mjp_adaptive`` with ``refine="span"`` (the default: the deeper layers' input spans).

Printed per image: PSNR of the unshuffled region, of the shuffled patches as a set (after the
best matching; their order is invisible), of setting (c) (the jigsaw's unshuffled image against
the original), and the attack's CPU seconds (process time: with OMP_NUM_THREADS=1, one core's work
even on a shared machine); and once per image the *oracle* (c): the same jigsaw solver given the
true x~ (:func:`attacks.solvers.jigsaw.oracle_c`), the bound on (c) that the solver sets.

    OMP_NUM_THREADS=1 python bench/mjp_adaptive_strength.py                   # scikit-image's images
    OMP_NUM_THREADS=1 python bench/mjp_adaptive_strength.py --images DIR      # the first 4 JPEGs of DIR

``--basin 0.05,0.2,1`` asks instead how far from the client's x~ the span fit still finds it: the
fit starts at the truth's reduced parameters (b, a) plus Gaussian noise of ``eps`` times their spread
and runs ``--basin-iterations`` L-BFGS iterations (``--basin-solver lbfgs``) or ``--basin-jacobians``
Levenberg-Marquardt iterations (``lm``, :mod:`attacks.solvers.lm`); printed: the residual, the RMS
distance to the truth (model-input units) and the PSNR of x~ before and after. ``--basin-part a``
(or ``b``) perturbs only the shuffled (unshuffled) patches' coordinates. ``--identifiability``
prints, before the basin test, the rank and condition number of the span residual's Jacobian at the
truth (:func:`attacks.optimization.span_fit.identifiability`; about one Jacobian's time, ~45 CPU-s at depth 4).

``--roots K`` asks whether block 0's MLP tokens can be found and used (:mod:`attacks.structure.token_roots`):
K starts (the ``prior`` estimate's own fc1 inputs plus noise, and random ones) solved per token;
printed: distinct roots, how many are true tokens, and the LM fit of the reduced parameters to the
roots (``--roots-jacobians`` Jacobians) with each root placed two ways: at the position the start's
own fc1 inputs are nearest to (assignment; what an attacker can do) and at its true position (an
oracle, up to the order of the shuffled positions, which no gradient shows).
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import timm
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import attacks  # noqa: E402
import fedmjp  # noqa: E402,F401  (registers the models)
from attacks.solvers.jigsaw import oracle_c  # noqa: E402
from attacks.closed_form.mjp_maths import lbfgs  # noqa: E402
from attacks.closed_form.mjp_maths import assemble  # noqa: E402
from attacks.solvers.spans import SpanResidual, input_spans  # noqa: E402
from attacks.solvers.linalg import SketchPreconditioner, damped_cg, linearise, row_sketch  # noqa: E402
from attacks.solvers.lm import MatrixFreeResult  # noqa: E402
from attacks.optimization.span_fit import SpanVector, identifiability, span_lm, truth_coordinates  # noqa: E402
from fedmjp.checkpoint import load_checkpoint  # noqa: E402
from fedmjp.factory import normalize  # noqa: E402
from metrics.regions import region_scores  # noqa: E402

MEAN, STD = torch.tensor([0.485, 0.456, 0.406]).double(), torch.tensor([0.229, 0.224, 0.225]).double()
SKIMAGE = ("astronaut", "coffee", "chelsea", "rocket")


def square(img: Image.Image, size: int) -> torch.Tensor:
    """[3, size, size] float64 in [0, 1]: center crop and bilinear resize."""
    img = img.convert("RGB")
    s = min(img.size)
    left, top = (img.width - s) // 2, (img.height - s) // 2
    img = img.crop((left, top, left + s, top + s)).resize((size, size), Image.BILINEAR)
    return torch.from_numpy(np.array(img)).permute(2, 0, 1).double() / 255


def load_images(folder: Path | None, n: int, size: int) -> list[tuple[str, torch.Tensor]]:
    if folder is None:
        import skimage.data

        return [(name, square(Image.fromarray(getattr(skimage.data, name)()), size)) for name in SKIMAGE[:n]]
    files = sorted(p for p in folder.iterdir() if p.suffix.lower() in (".jpeg", ".jpg", ".png"))[:n]
    if len(files) < n:
        raise SystemExit(f"--images {folder}: need {n} images, found {len(files)}")
    return [(f.name, square(Image.open(f), size)) for f in files]


def make_model(qk_scale: float, depth: int, checkpoint: Path | None = None) -> torch.nn.Module:
    torch.manual_seed(0)
    model = timm.create_model("mjp_vit_cifar_patch4_32", variant="mjp", first_block="april", depth=depth)
    if checkpoint is not None:  # the shipped checkpoint's block-0 norm1 is dropped: APRIL's surgery
        load_checkpoint(model, checkpoint)
    model = model.eval().double()
    if qk_scale != 1.0:
        with torch.no_grad():
            for blk in model.blocks:
                D = blk.attn.qkv.weight.shape[1]
                blk.attn.qkv.weight[:2 * D] *= qk_scale
                if blk.attn.qkv.bias is not None:
                    blk.attn.qkv.bias[:2 * D] *= qk_scale
    return model


def _residuals(model: torch.nn.Module, update: dict, mask: torch.Tensor, x_t: torch.Tensor, res) -> str:
    """The span residual (mean relative squared distance of every layer's inputs from the span its
    weight gradient gives) of the client's x~ and of the attack's estimate, the same normalised input."""
    _, grads, _ = attacks.create_attack("mjp_adaptive").read_update(model, dict(update))  # DAL term removed
    T = int(mask.numel()) + int(getattr(model, "num_prefix_tokens", 1))
    spans = input_spans(model, grads, T)
    residual = SpanResidual(model, spans, mask)
    with torch.no_grad():
        truth = float(residual.value(normalize(x_t, MEAN, STD))[0])
        est = float(residual.value(normalize(res.images.double().clamp(0, 1), MEAN, STD))[0])
    return f"residual truth {truth:.1e} estimate {est:.1e} ({len(spans)} layers)"


def span_problem(model: torch.nn.Module, update: dict, xin: torch.Tensor) -> tuple:
    """What the attacker reads off ``update`` for the span fit: (shuffled mask S, the first layer's
    :class:`attacks.closed_form.mjp_maths.Reduction`, the deeper layers' :class:`SpanResidual`, grid, channels,
    patch size) for inputs shaped like ``xin`` [1, C, H, W] (:func:`attacks.optimization.span_fit.span_problem`)."""
    S, grads, _ = attacks.create_attack("mjp_adaptive").read_update(model, dict(update))
    prob = attacks.optimization.span_fit.span_problem(model, grads, S)
    if prob.channels != xin.shape[1]:
        raise ValueError(f"x~ has {xin.shape[1]} channels, the model {prob.channels}")
    return S, prob.red, prob.residual, prob.grid, prob.channels, prob.patch


def basin(model: torch.nn.Module, update: dict, xin: torch.Tensor, eps_list: list[float], iterations: int,
          part: str, seed: int, solver: str = "lm", jacobians: int = 6, ident: bool = False) -> list[str]:
    """The span fit started at the truth (b, a) + eps x spread noise: residual, RMS distance to the
    client's normalised x~ ``xin`` [1, C, H, W] and PSNR of x~, before -> after ``iterations`` L-BFGS
    iterations (``solver="lbfgs"``) or ``jacobians`` Levenberg-Marquardt iterations (``"lm"``); with
    ``ident`` first the rank and condition number of the span Jacobian at the truth."""
    S, red, residual, grid, C, p = span_problem(model, update, xin)
    b_t, a_t = truth_coordinates(red, xin, p)  # the truth's reduced parameters
    vec = SpanVector(residual, red, grid, C, p)

    def objective(vb: torch.Tensor, va: torch.Tensor) -> torch.Tensor:
        return residual.value(assemble(red, vb, va, grid, C, p))

    def dist(vb: torch.Tensor, va: torch.Tensor) -> float:
        return float((assemble(red, vb, va, grid, C, p) - xin).pow(2).mean().sqrt())

    def psnr(vb: torch.Tensor, va: torch.Tensor) -> float:
        err = (assemble(red, vb, va, grid, C, p) - xin) * STD[:, None, None]
        return float(-10 * torch.log10(err.pow(2).mean()))

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        lines = [f"k={red.null_basis.shape[1]} truth residual {float(objective(b_t[None], a_t[None])[0]):.1e}"]
    if ident:
        t0 = time.process_time()
        info = identifiability(vec, vec.pack(b_t, a_t))
        lines.append(f"span Jacobian at the truth: {vec(vec.pack(b_t, a_t)).numel()} x {info['unknowns']}, rank "
                     f"{info['rank']}, condition {info['condition']:.1e} ({time.process_time() - t0:.0f} CPU s)")
    for eps in eps_list:
        nb = torch.randn(b_t.shape, generator=gen, dtype=torch.float64) * float(b_t.std()) * eps * (part != "a")
        na = torch.randn(a_t.shape, generator=gen, dtype=torch.float64) * float(a_t.std()) * eps * (part != "b")
        b0, a0 = (b_t + nb)[None], (a_t + na)[None]
        t0 = time.process_time()
        if solver in ("lm", "matrix_free"):
            b1, a1, out = span_lm(residual, red, b0[0], a0[0], grid, C, p, max_jacobians=jacobians,
                                  solver="dense" if solver == "lm" else solver)
            b1, a1, n = b1[None], a1[None], f"{out.jacobians} Jacobians"
            if isinstance(out, MatrixFreeResult):
                n = f"{out.jacobians} iterations, {sum(out.cg_iterations)} CG, sketch {out.sketch_rows}"
        else:
            b1, a1, it = lbfgs(lambda vb, va: objective(vb, va).sum(), b0.clone(), a0.clone(), iterations)
            n = f"{it} it"
        with torch.no_grad():
            lines.append(f"eps {eps:g} ({solver}): residual {float(objective(b0, a0)[0]):.1e} -> "
                         f"{float(objective(b1, a1)[0]):.1e}, distance {dist(b0, a0):.3f} -> {dist(b1, a1):.1e}, "
                         f"x~ {psnr(b0, a0):.1f} -> {psnr(b1, a1):.1f} dB ({n}, {time.process_time() - t0:.0f} CPU s)")
    return lines


def gn_step(model: torch.nn.Module, update: dict, xin: torch.Tensor, fractions: list[float], mu_rel: float,
            seed: int, eps: float = 0.05, max_cg: int = 3000, tol: float = 1e-10) -> list[str]:
    """One damped Gauss-Newton step of the span residual at the truth + ``eps`` noise, dense against
    matrix-free: the dense step (exact Jacobian, Cholesky) and, per sketch size (a fraction of the
    unknowns; 0: plain CG), the CG iterations to ``tol``, the step's distance from the dense one and
    the seconds (sketch + CG; process time)."""
    S, red, residual, grid, C, p = span_problem(model, update, xin)
    vec = SpanVector(residual, red, grid, C, p)
    theta = vec.pack(*truth_coordinates(red, xin, p))
    gen = torch.Generator().manual_seed(seed)
    th0 = theta + eps * float(theta.std()) * torch.randn(theta.shape, generator=gen, dtype=theta.dtype)
    n = theta.numel()
    t0 = time.process_time()
    r, J = vec.jacobian(th0)
    G, g = J.T @ J, J.T @ r
    del J
    mu = mu_rel * float(G.diagonal().max())
    h_dense = -torch.linalg.solve(G + mu * torch.eye(n, dtype=G.dtype), g)
    lines = [f"{n} unknowns, {r.numel()} rows, mu {mu_rel:g} max diag: dense step {time.process_time() - t0:.1f} s"]
    _, jv, jtu, pullback = linearise(vec, th0)
    for frac in fractions:
        m = int(round(frac * n))
        t0 = time.process_time()
        pre = (SketchPreconditioner(row_sketch(pullback, r.numel(), m, torch.Generator().manual_seed(seed + 1), 64,
                                               r.dtype, r.device)) if m else None)
        t_sketch = time.process_time() - t0
        st = damped_cg(jv, jtu, g, mu,
                       (lambda v: pre.apply(v, mu)) if pre is not None else None, max_cg, tol)
        err = float((st.h - h_dense).norm() / h_dense.norm())
        lines.append(f"sketch m = {m:5d} ({frac:g} n): CG {st.iterations:5d} iterations to {st.relative_residual:.0e}, "
                     f"step error {err:.1e}, {t_sketch:.1f} + {time.process_time() - t0 - t_sketch:.1f} s")
    return lines


def roots(model: torch.nn.Module, update: dict, xin: torch.Tensor, mask: torch.Tensor, starts: int,
          jacobians: int, seed: int) -> list[str]:
    """``--roots``: block 0's MLP tokens as per-token roots, then the fit to them (module doc)."""
    from scipy.optimize import linear_sum_assignment

    from attacks.solvers.lm import dense_lm
    from attacks.structure.token_roots import mlp_token_roots
    from patchgrid import patchify

    S, red, residual, grid, C, p = span_problem(model, update, xin)
    layer, blk = "blocks.0.mlp.fc1", residual.work.blocks[0]
    basis = {sp.name: sp.basis for sp in residual.spans}
    est = attacks.create_attack("mjp_adaptive", refine="prior").reconstruct(model, update, dict(mean=MEAN, std=STD))
    b0, a0 = truth_coordinates(red, normalize(est.images.double(), MEAN, STD), p)
    with torch.no_grad():
        true_in = residual.layer_inputs(xin)[layer][0]
        start_in = residual.layer_inputs(assemble(red, b0[None], a0[None], grid, C, p))[layer][0]
    gen = torch.Generator().manual_seed(seed)
    base = (start_in - blk.norm2.bias) / blk.norm2.weight
    pick = base[torch.randint(0, base.shape[0], (starts - starts // 2,), generator=gen)]
    v0 = torch.cat([pick + 0.3 * torch.randn(pick.shape, generator=gen, dtype=torch.float64),
                    torch.randn(starts // 2, base.shape[1], generator=gen, dtype=torch.float64)])
    t0 = time.process_time()
    out = mlp_token_roots(blk, basis[layer], basis["blocks.0.mlp.fc2"], v0)
    unit = lambda t: t / t.norm(dim=-1, keepdim=True)  # noqa: E731
    cos = unit(out.roots) @ unit(true_in).T
    true_pos = cos.argmax(dim=1)
    lines = [f"roots: {starts} starts, {out.converged} converged, {out.roots.shape[0]} distinct, "
             f"{int(cos.max(dim=1).values.gt(0.99999).sum())} true of {true_in.shape[0]} tokens "
             f"({time.process_time() - t0:.0f} CPU s)"]

    class Targets(SpanVector):
        rows: torch.Tensor
        target: torch.Tensor

        def __call__(self, theta: torch.Tensor) -> torch.Tensor:
            x = self.traced_image(theta)
            return (self.residual.layer_inputs(x)[layer][0][self.rows] - self.target).reshape(-1)

    def score(theta: torch.Tensor, vec: SpanVector) -> str:
        b, a = vec.unpack(theta)
        sd = STD.repeat_interleave(p * p)
        E = patchify(assemble(red, b[None], a[None], grid, C, p), p).flatten(2)[0] * sd
        X = patchify(xin, p).flatten(2)[0] * sd
        cost = torch.cdist(E[S], X[S]).pow(2).numpy()
        r_, c_ = linear_sum_assignment(cost)
        mse_s = float(cost[r_, c_].mean()) / E.shape[1]
        return f"unshuffled {float(-10 * torch.log10((E[~S] - X[~S]).pow(2).mean())):.1f} / shuffled set " \
               f"{-10 * math.log10(mse_s):.1f} dB"

    for how in ("assigned", "oracle"):
        vec = Targets(residual, red, grid, C, p)
        if how == "oracle":  # true positions; among the shuffled ones (order invisible) nearest the start's
            rows = true_pos.clone()
            in_s = S[(rows - 1).clamp_min(0)] & (rows > 0)
            s_pos = torch.nonzero(S).flatten() + 1
            r_, c_ = linear_sum_assignment(torch.cdist(start_in[s_pos], out.roots[in_s]).numpy())
            rows[torch.nonzero(in_s).flatten()[torch.as_tensor(c_)]] = s_pos[torch.as_tensor(r_)]
        else:
            r_, c_ = linear_sum_assignment(torch.cdist(start_in, out.roots).numpy())
            rows = torch.full((out.roots.shape[0],), -1, dtype=torch.long)
            rows[torch.as_tensor(c_)] = torch.as_tensor(r_)
        vec.rows, vec.target = rows[rows >= 0], out.roots[rows >= 0]
        theta = vec.pack(b0, a0)
        t0 = time.process_time()
        fit = dense_lm(vec, lambda t: vec.jacobian(t)[1], theta, max_jacobians=jacobians)
        lines.append(f"fit to the roots at their {how} positions: {score(theta, vec)} -> {score(fit.theta, vec)} "
                     f"({fit.jacobians} Jacobians, {time.process_time() - t0:.0f} CPU s)")
    return lines


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--images", type=Path, default=None, help="folder of images (default: scikit-image's)")
    p.add_argument("--num-images", type=int, default=4)
    p.add_argument("--first", type=int, default=0, help="skip this many images")
    p.add_argument("--weights", default="fresh,qk",
                   help="comma-separated: fresh, qk (the --qk-scale model), trained (--checkpoint)")
    p.add_argument("--checkpoint", type=Path, default=Path(__file__).resolve().parents[1] / "checkpoints"
                   / "cifar_deit_mjp.safetensors", help="weights of 'trained' (the shipped CIFAR-10 DeiT+MJP)")
    p.add_argument("--residual", action="store_true",
                   help="also print the span residual of the truth x~ and of span's estimate (is the fit "
                        "stuck above the truth's residual, or does another image fit the spans as well?)")
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--qk-scale", type=float, default=4.0)
    p.add_argument("--attacks", default="april,prior,span", help="comma-separated: april, prior, span, match")
    p.add_argument("--span-iterations", type=int, default=None, help="mjp_adaptive's span_iterations")
    p.add_argument("--starts", type=int, default=None, help="mjp_adaptive's starts")
    p.add_argument("--basin", default=None, help="comma-separated noise scales: run the basin test instead")
    p.add_argument("--basin-iterations", type=int, default=400)
    p.add_argument("--basin-part", choices=("both", "a", "b"), default="both")
    p.add_argument("--basin-solver", choices=("lm", "matrix_free", "lbfgs"), default="lm",
                   help="lm: dense Levenberg-Marquardt; matrix_free: its sketch-preconditioned CG form")
    p.add_argument("--gn-step", default=None, metavar="FRACTIONS",
                   help="comma-separated sketch sizes as fractions of the unknowns (0: plain CG): run the "
                        "Gauss-Newton step test instead")
    p.add_argument("--gn-mu", type=float, default=1e-8, help="damping of --gn-step, relative to max diag(J^T J)")
    p.add_argument("--basin-jacobians", type=int, default=6, help="Levenberg-Marquardt iterations of --basin-solver lm")
    p.add_argument("--identifiability", action="store_true",
                   help="with --basin: the span Jacobian's rank and condition number at the truth first")
    p.add_argument("--roots", type=int, default=None,
                   help="starts of block 0's per-token MLP roots: run the roots test instead")
    p.add_argument("--roots-jacobians", type=int, default=8, help="LM Jacobians of the fit to the roots")
    p.add_argument("--lm-jacobians", type=int, default=None, help="mjp_adaptive's lm_jacobians (0: L-BFGS only)")
    p.add_argument("--jigsaw-prediction", action="store_true",
                   help="the oracle (c) with the gradient-prediction boundary cost (solve_jigsaw's prediction)")
    args = p.parse_args(argv)
    if args.roots is not None and not 2 <= args.roots <= 100_000:
        p.error(f"--roots {args.roots}: give 2 to 100000 starts")
    if args.gn_step is not None:
        try:
            fractions = [float(f) for f in args.gn_step.split(",")]
        except ValueError:
            p.error(f"--gn-step {args.gn_step!r}: give comma-separated numbers, e.g. 0,0.25,0.5")
        if not all(0 <= f <= 4 for f in fractions):
            p.error(f"--gn-step {args.gn_step}: each sketch size is a fraction of the unknowns from 0 to 4")
    if args.roots_jacobians < 1:
        p.error(f"--roots-jacobians {args.roots_jacobians}: give at least 1")
    images = load_images(args.images, args.first + args.num_images, 32)[args.first:]
    extra = {k: v for k, v in (("span_iterations", args.span_iterations), ("starts", args.starts),
                               ("lm_jacobians", args.lm_jacobians)) if v is not None}
    makers = {"april": lambda: attacks.create_attack("april_analytic"),
              "prior": lambda: attacks.create_attack("mjp_adaptive", refine="prior"),
              "span": lambda: attacks.create_attack("mjp_adaptive", refine="span", **extra),
              "match": lambda: attacks.create_attack("mjp_adaptive", refine="match")}
    names = args.attacks.split(",")
    print(f"mjp_vit_cifar_patch4_32 depth {args.depth}, design A, float64, gamma 0.27, "
          f"threads {torch.get_num_threads()}; PSNR dB: unshuffled region / shuffled set / setting (c)")
    weights = {"fresh": ("fresh", 1.0, None), "qk": (f"qk x{args.qk_scale:g}", args.qk_scale, None),
               "trained": ("trained", 1.0, args.checkpoint)}
    for label, qk, ckpt in (weights[w] for w in args.weights.split(",")):
        model = make_model(qk, args.depth, ckpt)
        table: dict[str, list[tuple[float, float, float, float]]] = {n: [] for n in names}
        oracles: list[float] = []
        for i, (name, x) in enumerate(images):
            x = x[None]
            plan = model.draw_plan(1, gamma=0.27, seed=100 + args.first + i)
            x_t = model.shuffle_images(x, plan)
            update = attacks.compute_update(model, normalize(x_t, MEAN, STD), torch.tensor([(args.first + i) % 10]),
                                            unk_mask=plan.mask)
            oracle, _ = oracle_c(x, x_t, plan.mask[0], 4, prediction="prediction" if args.jigsaw_prediction else None)
            oracles.append(oracle)
            line = [f"[{label}] {name:12s} |S|={int(plan.mask.sum()):2d} oracle (c) {oracle:5.1f}"]
            if args.roots:
                out = roots(model, update, normalize(x_t, MEAN, STD), plan.mask, args.roots, args.roots_jacobians, i)
                print("  ".join(line) + "\n    " + "\n    ".join(out), flush=True)
                continue
            if args.gn_step:
                out = gn_step(model, update, normalize(x_t, MEAN, STD), [float(f) for f in args.gn_step.split(",")],
                              args.gn_mu, i)
                print("  ".join(line + out[:1]) + "\n    " + "\n    ".join(out[1:]), flush=True)
                continue
            if args.basin:
                eps = [float(e) for e in args.basin.split(",")]
                out = basin(model, update, normalize(x_t, MEAN, STD), eps, args.basin_iterations, args.basin_part, i,
                            args.basin_solver, args.basin_jacobians, args.identifiability)
                print("  ".join(line + out[:1]) + "\n    " + "\n    ".join(out[1:]), flush=True)
                continue
            for n in names:
                t0 = time.process_time()  # CPU seconds: the machine may be shared
                res = makers[n]().reconstruct(model, update, dict(mean=MEAN, std=STD))
                dt = time.process_time() - t0
                sc = region_scores(res.images.double(), x_t, plan.mask, 4)
                est = res.unshuffled if res.unshuffled is not None else res.images
                pc = float(-10 * torch.log10((est.double().clamp(0, 1) - x).pow(2).mean()))
                row = (float(sc["psnr_unshuffled"][0]), float(sc["psnr_shuffled"][0]), pc, dt)
                table[n].append(row)
                line.append(f"{n} {row[0]:5.1f} / {row[1]:5.1f} / {row[2]:5.1f} ({dt:5.1f} s)")
                if args.residual and n == "span":
                    line.append(_residuals(model, update, plan.mask[0], x_t, res))
            print("  ".join(line), flush=True)
        for n in names if not (args.basin or args.roots or args.gn_step) else []:
            cols = list(zip(*table[n]))
            print(f"[{label}] median {n:6s} {statistics.median(cols[0]):5.1f} / {statistics.median(cols[1]):5.1f} / "
                  f"{statistics.median(cols[2]):5.1f} dB (oracle (c) {statistics.median(oracles):5.1f}), "
                  f"{statistics.mean(cols[3]):5.1f} CPU s/image", flush=True)


if __name__ == "__main__":
    main()
