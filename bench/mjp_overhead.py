"""Training-step time of MJP (shuffle + E_unk + DAL) over plain DeiT at the same size, side by side.

    python bench/mjp_overhead.py                  # DeiT-Ti at 224 px, batch 32 (the issue's setting)
    python bench/mjp_overhead.py --repeats 20 --steps 3 --per-sample

Both models share the same weights. After ``--warmup`` steps of each, every repeat times a block of
``--steps`` steps of each model back to back, the order alternated between repeats; the ratio of a
repeat's MJP block to its plain block is a *paired* ratio (both saw nearly the same load). Printed:
the median of the paired ratios with its interquartile range and a 95% bootstrap interval of that
median, next to the ratio of medians and of minimums. Target: at most 1.03; the printout says when
the interval is wider than the 3% it checks (then the run cannot decide; use more repeats or a
quieter machine).
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

import timm
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # a checkout without pip install -e
import fedmjp  # noqa: F401  (registers mjp_* models)


def step_plain(model, opt, x, y) -> float:
    t0 = time.perf_counter()
    loss = F.cross_entropy(model(x), y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return time.perf_counter() - t0


def step_mjp(model, opt, x, y, dal_weight: float) -> float:
    t0 = time.perf_counter()
    out = model.forward_mjp(x)
    loss = F.cross_entropy(out.logits, y) + dal_weight * out.dal_loss
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="deit_tiny_patch16_224")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=12)
    parser.add_argument("--steps", type=int, default=2, help="training steps per timed block")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--gamma", type=float, default=0.27)
    parser.add_argument("--per-sample", action="store_true", help="one mask per sample instead of per batch")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: leave default)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    torch.manual_seed(0)
    plain = timm.create_model(args.model, num_classes=1000).train()
    mjp = timm.create_model(f"mjp_{args.model}", variant="mjp", gamma=args.gamma, per_sample=args.per_sample,
                            seed=0).train()
    missing, _ = mjp.load_state_dict(plain.state_dict(), strict=False)
    assert set(missing) <= {"unk_embed"} | {k for k in missing if k.startswith("dal_head")}
    opt_p = torch.optim.AdamW(plain.parameters(), lr=1e-4)
    opt_m = torch.optim.AdamW(mjp.parameters(), lr=1e-4)
    x = torch.rand(args.batch, 3, 224, 224)
    y = torch.randint(0, 1000, (args.batch,))

    for _ in range(args.warmup):
        step_plain(plain, opt_p, x, y)
        step_mjp(mjp, opt_m, x, y, 0.01)
    tp, tm = [], []
    block_p = lambda: sum(step_plain(plain, opt_p, x, y) for _ in range(args.steps))  # noqa: E731
    block_m = lambda: sum(step_mjp(mjp, opt_m, x, y, 0.01) for _ in range(args.steps))  # noqa: E731
    for i in range(args.repeats):
        # alternate the order so neither model always runs right after the other
        if i % 2:
            tm.append(block_m()); tp.append(block_p())
        else:
            tp.append(block_p()); tm.append(block_m())
    paired = [m / p for m, p in zip(tm, tp)]
    med = statistics.median(paired)
    q1, _, q3 = statistics.quantiles(paired, n=4) if len(paired) > 1 else (med, med, med)
    rng = random.Random(0)
    boot = sorted(statistics.median(rng.choices(paired, k=len(paired))) for _ in range(2000))
    lo, hi = boot[49], boot[1949]
    mp, mm = statistics.median(tp), statistics.median(tm)
    print(f"model={args.model} batch={args.batch} gamma={args.gamma} per_sample={args.per_sample} "
          f"threads={torch.get_num_threads()} repeats={args.repeats} x {args.steps} steps, "
          f"load average {os.getloadavg()[0]:.1f}")
    print(f"plain DeiT block: median {mp:.3f} s  (all: {', '.join(f'{t:.2f}' for t in tp)})")
    print(f"MJP block:        median {mm:.3f} s  (all: {', '.join(f'{t:.2f}' for t in tm)})")
    print(f"paired ratio MJP/plain: median {med:.3f}, IQR [{q1:.3f}, {q3:.3f}], 95% bootstrap interval of the "
          f"median [{lo:.3f}, {hi:.3f}]  (target <= 1.03)")
    print(f"ratio of medians {mm / mp:.3f}; of minimums {min(tm) / min(tp):.3f}")
    if hi - lo > 0.03:
        print("the interval is wider than the 3% checked: this run cannot decide (more --repeats, quieter machine)")
    else:
        print("verdict: " + ("within" if hi <= 1.03 else "above" if lo > 1.03 else "undecided at") + " the 3% target")


if __name__ == "__main__":
    main()
