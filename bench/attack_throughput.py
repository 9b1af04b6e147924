"""Attack throughput on CPU: our vectorised attacks against breaching's one-image-at-a-time loops.

1. APRIL closed form over ``--april-images`` real images (victim gradients + attack):
   ``april_analytic.reconstruct_many`` (one batched float64 lstsq) against breaching's
   ``AprilAttacker`` (built once, called once per image). Both sides get their victim gradients from
   the same per-image ``compute_update`` loop (``--victim vmap`` gives ours the vmapped per-sample
   pass instead; on a CPU it is not faster). Prints the max difference of the reconstructions and
   the speed ratios, total and attack only.
2. Inverting Gradients, B = ``--batch`` independent batch-1 updates: ``invertinggradients_batched``
   (one batched optimisation) against breaching's ``invertinggradients`` called once per update,
   same objective, schedule and iteration count. Prints image-iterations/s and the ratio.

Both sides of 1 and 2 are warmed up, then timed ``--repeats`` times with the order alternated;
times are median [min, max]. breaching's one-time set-up (its payload view and ``prepare_attack``)
is timed apart and printed, not counted in its per-image loop.
3. ``mjp_adaptive`` (the MJP-aware attack) on ``--mjp-images`` shuffled real images of a design-A
   MJP ViT (gamma 0.27, float64), next to ``april_analytic`` on the same updates: seconds per image
   and PSNR of the unshuffled region; ``--mjp-refine`` picks the refinement (``prior`` by default,
   fast; ``span``/``match`` take seconds to a minute per image on a CPU).
4. The first-layer attacks (``april_analytic``, ``pe_closed_form``, ``april_robust``) at 32 and
   224 px: seconds per image on float64 clean and 8-bit quantised updates (``--only closed``).
5. Every attack of the defence presets at 32 px (the presets' CIFAR model: design A, depth 4,
   D = 192) and 224 px (DeiT-S/16, design A): CPU seconds per image (``time.process_time``: one
   core's work with ``--threads 1``, meaningful on a loaded machine where wall time is not), each
   on the update where it does its full work: the closed forms and ``ig_closed_start`` on an 8-bit
   quantised update of the plain model (the clean update costs ig_closed_start one check: its exact
   start takes no steps), ``mjp_adaptive`` and ``ig_closed_start`` on a clean update of the MJP model
   with gamma 0.27 shuffled (setting b/c; ig_closed_start reuses mjp_adaptive's estimate as in a
   benchmark round, where mjp_adaptive runs first). ``ig_closed_start`` at 224 px runs ``--ig-224-steps``
   steps (its default cap is 2000); the table gives CPU seconds per step and what the cap would
   cost. An attack that refuses prints its reason (``--only table``).

    python bench/attack_throughput.py                     # short run (~1-2 min on 2 idle cores)
    python bench/attack_throughput.py --ig-iterations 50 --ig-depth 6 --ig-dim 192 --threads 2
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from typing import Any, Callable
from pathlib import Path

import numpy as np
import timm
import torch
from PIL import Image
from scipy.optimize import linear_sum_assignment

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import attacks  # noqa: E402
import fedmjp  # noqa: E402,F401
from attacks.optimization.breaching_adapter import BreachingApril  # noqa: E402
from fedmjp.factory import normalize  # noqa: E402

MEAN, STD = torch.tensor([0.485, 0.456, 0.406]), torch.tensor([0.229, 0.224, 0.225])


def load_images(folder: Path, n: int, size: int, start: int = 0, step: int = 1,
                dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[n, 3, size, size] in [0, 1]: center crop + bilinear resize of every ``step``-th JPEG from
    ``start`` (sorted by name)."""
    files = sorted(folder.glob("*.JPEG"))[start::step][:n]
    if len(files) < n:
        raise SystemExit(f"need {n} images in {folder}, found {len(files)}")
    out = []
    for f in files:
        img = Image.open(f).convert("RGB")
        s = min(img.size)
        box = ((img.width - s) // 2, (img.height - s) // 2)
        img = img.crop((*box, box[0] + s, box[1] + s)).resize((size, size), Image.BILINEAR)
        out.append(torch.from_numpy(np.array(img)).permute(2, 0, 1).to(dtype) / 255)
    return torch.stack(out)


def alternate(sides: dict[str, Callable[[], Any]], repeats: int) -> dict[str, list]:
    """Run every side ``repeats`` times, the order rotated each repeat (so load drifting on a shared
    machine hits every side alike); returns each side's return values in run order."""
    names = list(sides)
    out: dict[str, list] = {n: [] for n in names}
    for r in range(repeats):
        for n in names[r % len(names):] + names[:r % len(names)]:
            out[n].append(sides[n]())
    return out


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):7.3f}s [{min(values):.3f}, {max(values):.3f}]"


def bench_april(args: argparse.Namespace) -> None:
    import breaching.attacks

    torch.manual_seed(0)
    model = timm.create_model("mjp_vit_cifar_patch4_32", variant="plain", first_block="april",
                              depth=args.april_depth).eval().double()
    x = load_images(args.data, args.april_images, 32).double()
    y = torch.arange(len(x)) % model.num_classes
    md = dict(mean=MEAN, std=STD)
    ours = attacks.create_attack("april_analytic")
    meta = attacks.AttackMetadata.parse(md, model)

    def victims() -> list:
        if args.victim == "vmap":
            return attacks.compute_per_sample_updates(model, normalize(x, MEAN, STD), y)
        return [attacks.compute_update(model, normalize(x[i:i + 1], MEAN, STD), y[i:i + 1]) for i in range(len(x))]

    # breaching's set-up, once and timed apart: the payload view and its AprilAttacker.
    adapter = BreachingApril()
    t_setup = time.perf_counter()
    view, payload, _, cfg, _ = adapter.prepare(model, attacks.compute_update(model, normalize(x[:1], MEAN, STD), y[:1]), meta)
    attacker = breaching.attacks.prepare_attack(view, torch.nn.CrossEntropyLoss(), cfg, setup=adapter.device_setup())
    t_setup = time.perf_counter() - t_setup

    def run_ours() -> tuple[float, float, torch.Tensor]:
        t0 = time.perf_counter()
        updates = victims()
        t1 = time.perf_counter()
        res = ours.reconstruct_many(model, updates, md)
        t2 = time.perf_counter()
        assert not any(r.failed for r in res)
        return t1 - t0, t2 - t1, torch.cat([r.images for r in res])

    def run_breaching() -> tuple[float, float, torch.Tensor]:
        # per image, as breaching is used: victim gradient, then its attacker on that one update
        t_victim = t_attack = 0.0
        out = []
        for i in range(len(x)):
            t0 = time.perf_counter()
            upd = attacks.compute_update(model, normalize(x[i:i + 1], MEAN, STD), y[i:i + 1])
            t1 = time.perf_counter()
            shared = dict(gradients=[upd[n].double() for n in view.names], buffers=None,
                          metadata=dict(num_data_points=1, labels=None, local_hyperparams=None))
            rec, _ = attacker.reconstruct([payload], [shared], server_secrets={})
            out.append(meta.denormalize(rec["data"].double()))
            t_victim, t_attack = t_victim + t1 - t0, t_attack + time.perf_counter() - t1
        return t_victim, t_attack, torch.cat(out)

    alternate({"ours": run_ours, "breaching": run_breaching}, 1)  # warm-up of both sides
    got = alternate({"ours": run_ours, "breaching": run_breaching}, args.repeats)
    ours_img, ref_img = got["ours"][-1][2], got["breaching"][-1][2]
    psnr = lambda a: (-10 * torch.log10(((a.double() - x) ** 2).flatten(1).mean(1).clamp_min(1e-30))).mean().item()
    col = lambda side, k: [r[k] for r in got[side]]  # noqa: E731
    total = lambda side: [v + a for v, a, _ in got[side]]  # noqa: E731
    print(f"[april] {len(x)} images, model depth {args.april_depth}, float64, threads {torch.get_num_threads()}, "
          f"{args.repeats} alternating repeats after a warm-up of both; median [min, max]")
    print(f"  ours     : victim grads {spread(col('ours', 0))}  attack {spread(col('ours', 1))}  "
          f"total {spread(total('ours'))}  mean PSNR {psnr(ours_img):6.1f} dB")
    print(f"  breaching: victim grads {spread(col('breaching', 0))}  attack {spread(col('breaching', 1))}  "
          f"total {spread(total('breaching'))}  mean PSNR {psnr(ref_img):6.1f} dB")
    print(f"  breaching's one-time set-up (payload view, prepare_attack), not in its times: {t_setup:.3f}s")
    print(f"  max |ours - breaching| = {(ours_img - ref_img).abs().max().item():.3e}")
    med = statistics.median
    print(f"  speed ratio of medians: total {med(total('breaching')) / med(total('ours')):5.2f}x   "
          f"attack only {med(col('breaching', 1)) / med(col('ours', 1)):5.2f}x   (aim: total >= 3x)")


def bench_ig(args: argparse.Namespace) -> None:
    torch.manual_seed(0)
    model = timm.create_model("mjp_vit_cifar_patch4_32", variant="plain", depth=args.ig_depth,
                              embed_dim=args.ig_dim, num_heads=3).eval()
    x = load_images(args.data, args.batch, 32)
    y = torch.arange(len(x)) % model.num_classes
    updates = attacks.compute_per_sample_updates(model, normalize(x, MEAN, STD), y)
    mds = [dict(mean=MEAN, std=STD, labels=y[i:i + 1]) for i in range(len(x))]
    its = args.ig_iterations
    batched = attacks.create_attack("invertinggradients_batched", iterations=its)
    ref_attack = attacks.create_attack("invertinggradients", iterations=its)

    def run_ours() -> tuple[float, list]:
        t0 = time.perf_counter()
        res = batched.reconstruct_many(model, updates, mds)
        return time.perf_counter() - t0, res

    def run_ref() -> tuple[float, list]:
        t0 = time.perf_counter()
        res = [ref_attack.reconstruct(model, u, m) for u, m in zip(updates, mds)]
        return time.perf_counter() - t0, res

    # warm-up of both (lazy initialisation, allocator, breaching's attacker set-up per call is part
    # of every call of the adapter, as the benchmark runs it)
    attacks.create_attack("invertinggradients_batched", iterations=1).reconstruct_many(model, updates[:2], mds[:2])
    attacks.create_attack("invertinggradients", iterations=1).reconstruct(model, updates[0], mds[0])
    got = alternate({"ours": run_ours, "ref": run_ref}, args.repeats)
    t_ours, t_ref = [t for t, _ in got["ours"]], [t for t, _ in got["ref"]]
    rate = lambda t: len(x) * its / statistics.median(t)  # noqa: E731
    obj = lambda rs: np.mean([r.stats[0]["objective_min"] for r in rs])  # noqa: E731
    print(f"[invertinggradients] B={len(x)} independent updates, {its} iterations, ViT depth {args.ig_depth} "
          f"D={args.ig_dim} 32px/4, threads {torch.get_num_threads()}, {args.repeats} alternating repeats "
          "after a warm-up; median [min, max]")
    print(f"  ours batched     : {spread(t_ours)}  {rate(t_ours):7.2f} image-it/s  "
          f"mean min objective {obj(got['ours'][-1][1]):.4f}")
    print(f"  breaching loop   : {spread(t_ref)}  {rate(t_ref):7.2f} image-it/s  "
          f"mean min objective {obj(got['ref'][-1][1]):.4f}")
    print(f"  ratio of medians: {rate(t_ours) / rate(t_ref):5.2f}x  (aim: >= 3x)")


def _patch_rows(img: torch.Tensor, p: int) -> torch.Tensor:
    _, C, H, W = img.shape
    return img[0].reshape(C, H // p, p, W // p, p).permute(1, 3, 0, 2, 4).reshape(-1, C * p * p)


def bench_mjp(args: argparse.Namespace) -> None:
    torch.manual_seed(0)
    model = timm.create_model("mjp_vit_cifar_patch4_32", variant="mjp", first_block="april",
                              depth=args.april_depth).eval().double()
    x = load_images(args.data, args.mjp_images, 32).double()
    md = dict(mean=MEAN, std=STD)
    cases = []
    for i in range(len(x)):
        plan = model.draw_plan(1, gamma=0.27, seed=100 + i)
        x_t = model.shuffle_images(x[i:i + 1], plan)
        upd = attacks.compute_update(model, normalize(x_t, MEAN, STD), torch.tensor([i % model.num_classes]), unk_mask=plan.mask)
        cases.append((plan.mask[0], x_t, upd))
    psnr = lambda a, b: float(-10 * torch.log10(((a.double() - b.double()) ** 2).mean()))
    print(f"[mjp] {len(x)} shuffled images (gamma 0.27), design-A MJP ViT depth {args.april_depth}, float64, "
          f"threads {torch.get_num_threads()}")
    for name, opts in (("april_analytic", {}), ("mjp_adaptive", dict(refine=args.mjp_refine))):
        attack = attacks.create_attack(name, **opts)
        t0 = time.perf_counter()
        res = [attack.reconstruct(model, u, md) for _, _, u in cases]
        dt = (time.perf_counter() - t0) / len(cases)
        p_u, p_set, p_c = [], [], []
        for r, (S, xt, _), x0 in zip(res, cases, x):
            rec, ref = _patch_rows(r.images, 4), _patch_rows(xt, 4)
            p_u.append(psnr(rec[~S], ref[~S]))
            # shuffled region as a set: match recovered to true patches on MSE (the order is invisible)
            rows, cols = linear_sum_assignment(torch.cdist(rec[S].double(), ref[S]).pow(2).numpy())
            p_set.append(psnr(rec[S][rows], ref[S][cols]))
            p_c.append(psnr(r.unshuffled if r.unshuffled is not None else r.images, x0[None]))
        print(f"  {name:15s} {dt:8.3f} s/image  median PSNR: unshuffled region {np.median(p_u):6.2f} dB, "
              f"shuffled set {np.median(p_set):6.2f} dB, setting (c) {np.median(p_c):6.2f} dB  "
              f"failed {sum(r.failed for r in res)}")


def bench_closed(args: argparse.Namespace) -> None:
    """Seconds per image of the first-layer attacks at 32 px (design-A DeiT, depth 4) and 224 px
    (timm's deit_small_patch16_224, no surgery): float64 clients, clean and 8-bit quantised updates."""
    from defences import quantize_update

    md = dict(mean=MEAN, std=STD)
    for size in (int(s) for s in args.closed_sizes.split(",")):
        torch.manual_seed(0)
        model = (timm.create_model("mjp_vit_cifar_patch4_32", variant="plain", first_block="april", depth=4)
                 if size == 32 else timm.create_model("deit_small_patch16_224")).eval().double()
        x = load_images(args.data, args.closed_images, size).double()
        clean = [attacks.compute_update(model, normalize(x[i:i + 1], MEAN, STD), torch.tensor([i])) for i in range(len(x))]
        # at 224 px one alternation of april_robust costs ~10^2 CG steps over 150k unknowns: 4 of them
        fast = {} if size == 32 else dict(iterations=4, cg_tol=1e-8, cg_maxiter=200)
        for name, opts, defence in (("april_analytic", {}, None), ("pe_closed_form", {}, None),
                                    ("april_robust", {}, None), ("april_robust", dict(quant_bits=8, **fast), 8)):
            updates = clean if defence is None else [quantize_update(u, defence) for u in clean]
            attack = attacks.create_attack(name, **opts)
            t0 = time.perf_counter()
            res = [attack.reconstruct(model, u, md) for u in updates]
            dt = (time.perf_counter() - t0) / len(x)
            ok = [r for r in res if not r.failed]
            psnr = np.mean([float(-10 * torch.log10(((r.images.double() - x[i:i + 1]) ** 2).mean()))
                            for i, r in enumerate(res) if not r.failed]) if ok else float("nan")
            what = "clean" if defence is None else f"{defence}-bit"
            print(f"[closed forms] {size:3d} px {name:15s} {what:6s} {opts or ''} {dt:8.3f} s/image  mean PSNR {psnr:6.1f} dB  "
                  f"failed {len(res) - len(ok)} ({res[0].reason or ''})"[:160], flush=True)


def _table_cases(size: int, n: int, data: Path) -> list[tuple[str, torch.nn.Module, list, list, list]]:
    """(case, model, updates, metadata, truths) at one size: the plain model's 8-bit quantised
    updates and the MJP model's shuffled clean updates (float64 clients, design-A block 0)."""
    from defences import quantize_update

    arch = "mjp_vit_cifar_patch4_32" if size == 32 else "mjp_deit_small_patch16_224"
    kwargs = {"depth": 4} if size == 32 else {}
    x = load_images(data, n, size).double()
    cases = []
    for variant in ("plain", "mjp"):
        torch.manual_seed(0)
        model = timm.create_model(arch, variant=variant, first_block="april", **kwargs).eval().double()
        ups, mds, truths = [], [], []
        for i in range(n):
            y = torch.tensor([i % 10])
            md = dict(mean=MEAN, std=STD, num_images=1, image_size=(3, size, size), labels=y)
            if variant == "plain":
                u = attacks.compute_update(model, normalize(x[i:i + 1], MEAN, STD), y)
                ups.append(quantize_update(u, 8))
                mds.append({**md, "defence": {"name": "quantize", "bits": 8, "stochastic": False}})
                truths.append(x[i:i + 1])
            else:
                plan = model.draw_plan(1, gamma=0.27, seed=100 + i)
                x_t = model.shuffle_images(x[i:i + 1], plan)
                ups.append(attacks.compute_update(model, normalize(x_t, MEAN, STD), y, unk_mask=plan.mask))
                mds.append(md)
                truths.append(x[i:i + 1])
        cases.append(("8-bit quantised, plain" if variant == "plain" else "MJP shuffled (c)", model.float(), ups,
                      mds, truths))
    return cases


def bench_table(args: argparse.Namespace) -> None:
    """CPU seconds per image of every attack of the defence presets at 32 and 224 px (docstring, 5)."""
    names = ("april_analytic", "pe_closed_form", "april_robust", "mjp_adaptive", "ig_closed_start")
    print(f"[attack table] CPU seconds per image (time.process_time), threads {torch.get_num_threads()}, "
          "float64 clients, design-A block 0; PSNR against x (setting c: the attack's unshuffled estimate)")
    print(f"  {'px':>3s}  {'attack':16s} {'update':24s} {'CPU s/image':>11s}  {'PSNR dB':>7s}  note")
    for size in (32, 224):
        n = args.table_images if size == 32 else 1
        for case, model, ups, mds, truths in _table_cases(size, n, args.data):
            spent: dict[str, float] = {}  # CPU s per image of each attack on this case
            # one estimate store per update, shared by this case's attacks as in a benchmark round:
            # mjp_adaptive computes its x~ in full, ig_closed_start after it starts from it
            metas = [dataclasses.replace(attacks.AttackMetadata.parse(md, model), estimates=attacks.EstimateStore())
                     for md in mds]
            for name in names:
                if name == "mjp_adaptive" and case.startswith("8-bit"):
                    continue  # on a plain model it is april_analytic (no E_unk to undo)
                opts = {}
                note = ""
                if name == "ig_closed_start" and size == 224:
                    opts = dict(iterations=args.ig_224_steps, restarts=1)
                    note = f"{args.ig_224_steps} steps, 1 restart"
                attack = attacks.create_attack(name, **opts)
                t0 = time.process_time()
                res = attack.reconstruct_many(model, ups, metas)
                dt = (time.process_time() - t0) / len(ups)
                spent[name] = dt
                ok = [(r, t) for r, t in zip(res, truths) if not r.failed]
                est = [(r.unshuffled if r.unshuffled is not None else r.images).double() for r, _ in ok]
                psnr = np.mean([float(-10 * torch.log10((e - t).pow(2).mean().clamp_min(1e-10)))
                                for e, (_, t) in zip(est, ok)]) if ok else float("nan")
                if name == "ig_closed_start" and ok:
                    # its start runs the closed forms again (mjp_adaptive's estimate is reused): their
                    # CPU time, measured just above on the same updates, is the start's, not the steps'
                    start = sum(spent.get(s, 0.0) for s in ("april_robust", "pe_closed_form", "april_analytic")
                                if not (s == "april_analytic" and case.startswith("MJP")))
                    steps = [r.stats[0].get("iterations", 0) for r, _ in ok]
                    per_step = max(dt - start, 0.0) / max(np.mean(steps), 1)
                    note = (note + "; " if note else "") + (f"start {start:.2f} s, {np.mean(steps):.0f} steps, "
                                                            f"{per_step:.3f} s/step")
                    if size == 224:
                        note += f"; the 2000-step cap: {2000 * per_step:.0f} s"
                if len(ok) < len(res):
                    note = (note + "; " if note else "") + f"refused/failed: {res[0].reason or ''}"[:120]
                print(f"  {size:3d}  {name:16s} {case:24s} {dt:11.2f}  {psnr:7.1f}  {note}", flush=True)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", type=Path, default=Path(os.environ.get("FEDMJP_DATA", "")) / "imagenet-sample",
                   help="ImageNet-sample JPEGs (default: $FEDMJP_DATA/imagenet-sample)")
    p.add_argument("--april-images", type=int, default=64)
    p.add_argument("--april-depth", type=int, default=6, help="depth of the design-A ViT (32 px, D=192)")
    p.add_argument("--victim", choices=("loop", "vmap"), default="loop", help="our victim-gradient pass")
    p.add_argument("--batch", type=int, default=8, help="independent updates for Inverting Gradients")
    p.add_argument("--ig-iterations", type=int, default=10)
    p.add_argument("--ig-depth", type=int, default=2)
    p.add_argument("--ig-dim", type=int, default=96)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs of each side (order alternated)")
    p.add_argument("--mjp-images", type=int, default=4)
    p.add_argument("--mjp-refine", default="prior", help="mjp_adaptive's refine option")
    p.add_argument("--closed-images", type=int, default=2, help="images per size for --only closed")
    p.add_argument("--closed-sizes", default="32,224", help="comma-separated image sizes for --only closed")
    p.add_argument("--table-images", type=int, default=2, help="images at 32 px for --only table (224 px: 1)")
    p.add_argument("--ig-224-steps", type=int, default=5, help="ig_closed_start steps at 224 px (--only table)")
    p.add_argument("--only", choices=("april", "ig", "mjp", "closed", "table"), default=None)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.only in (None, "april"):
        bench_april(args)
    if args.only in (None, "ig"):
        bench_ig(args)
    if args.only in (None, "mjp"):
        bench_mjp(args)
    if args.only in (None, "closed"):
        bench_closed(args)
    if args.only == "table":  # minutes of CPU: only when asked for
        bench_table(args)


if __name__ == "__main__":
    main()
