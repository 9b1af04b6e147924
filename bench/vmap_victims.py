"""Is one vectorised pass over a round's victims faster than the clients' loop? (issue 14)

    python bench/vmap_victims.py                      # paper model (DeiT-S/224, block-0 surgery), 9 clients
    python bench/vmap_victims.py --variant mjp --clients 9 --repeats 5

The in-process engine may compute the victim gradients of a round's simulated clients in one
``torch.func.vmap(grad(...))`` pass (each reply still its own Flower message) *when that is faster*.
This bench decides that on the machine it runs on. Side by side, on the same real images (x~ with
E_unk for ``--group shuffled``):

* loop: ``clients.update.fedsgd_gradients`` once per client, batch 1 (what the clients run);
* loop, explicit attention: the same loop with ``attn.fused_attn = False`` (is timm's fused CPU
  attention the faster one at 197 tokens?);
* vmap, fused attention: per-sample gradients of the batch of all clients, timm's SDPA attention
  (its backward has no batching rule: torch falls back to a loop over the batch inside it);
* vmap, explicit attention: the same with ``attn.fused_attn = False`` (softmax(QK^T)V as batched
  matmuls, which vmap batches).

Each side is warmed up once, then timed ``--repeats`` times in rotating order; median [min, max],
the ratio to the loop, and the largest difference of the other sides' gradients from the loop's
(relative to the largest loop gradient: summation order only, float32).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402


def vmap_gradients(model: torch.nn.Module, batches: list) -> dict[str, torch.Tensor]:
    """Per-client gradients [C, ...] by parameter name, in one vmap over the clients' batch-1 inputs."""
    from torch.func import functional_call, grad, vmap

    from fedmjp.factory import model_input

    params = {k: v.detach() for k, v in model.named_parameters() if v.requires_grad}
    buffers = dict(model.named_buffers())
    x = model_input(model, torch.cat([b.model_input for b in batches]))
    y = torch.cat([b.labels for b in batches])
    masks = None if batches[0].unk_mask is None else torch.cat([b.unk_mask for b in batches])

    def loss_one(p, xi, yi, mi):
        kwargs = {} if mi is None else {"unk_mask": mi.unsqueeze(0)}
        logits = functional_call(model, (p, buffers), (xi.unsqueeze(0),), kwargs)
        return F.cross_entropy(logits, yi.unsqueeze(0))

    if masks is None:
        return vmap(grad(lambda p, xi, yi: loss_one(p, xi, yi, None)), in_dims=(None, 0, 0))(params, x, y)
    return vmap(grad(loss_one), in_dims=(None, 0, 0, 0))(params, x, y, masks)


def set_fused(model: torch.nn.Module, fused: bool) -> None:
    for m in model.modules():
        if hasattr(m, "fused_attn"):
            m.fused_attn = fused


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", default="mjp_deit_small_patch16_224")
    p.add_argument("--variant", default="plain", choices=["plain", "nope", "mjp", "jp"])
    p.add_argument("--group", default="clean", choices=["clean", "shuffled"])
    p.add_argument("--clients", type=int, default=9)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--images", default="$FEDMJP_DATA/imagenet-sample",
                   help="an image folder (default: $FEDMJP_DATA/imagenet-sample; 'embedded' for the built-in set)")
    args = p.parse_args(argv)
    if args.clients < 1 or args.repeats < 1:
        p.error("--clients and --repeats must be positive")

    from clients.partition import private_batch
    from clients.update import fedsgd_gradients, load_global_model

    size = 224 if args.arch.endswith("224") else 32
    cfg = {"model-name": "bench", "model-arch": args.arch, "model-variant": args.variant, "model-kwargs": {},
           "model-checkpoint": "", "model-april": "surgery", "model-seed": 0, "images": args.images,
           "image-size": size, "num-images": args.clients, "num-classes": 1000 if size == 224 else 10,
           "num-partitions": args.clients, "batch-size": 1, "setting": "b" if args.group == "shuffled" else "a",
           "gamma": 0.27, "seed": 0, "device": "cpu"}
    from clients.runconfig import resolve_config

    try:
        cfg = resolve_config(cfg)
    except ValueError as err:
        raise SystemExit(f"bench/vmap_victims.py: {err}") from err
    model = load_global_model(cfg)
    batches = [private_batch(cfg, c, 1, args.clients) for c in range(args.clients)]

    def loop():
        return [fedsgd_gradients(model, b)[0] for b in batches]

    def loop_explicit():
        set_fused(model, False)
        try:
            return loop()
        finally:
            set_fused(model, True)

    def vmapped(fused: bool):
        def run():
            set_fused(model, fused)
            try:
                return vmap_gradients(model, batches)
            finally:
                set_fused(model, True)
        return run

    sides = {"loop (clients)": loop, "loop, explicit attention": loop_explicit, "vmap, fused attention": vmapped(True),
             "vmap, explicit attention": vmapped(False)}
    reference = loop()
    scale = max(float(g.abs().max()) for g in reference[0].values())
    diffs = {}
    for name, fn in sides.items():  # warm-up and check
        got = fn()
        if isinstance(got, dict):
            diffs[name] = max(float((got[k][c] - reference[c][k]).abs().max())
                              for c in range(args.clients) for k in got) / scale
        elif fn is not loop:
            diffs[name] = max(float((g[k] - reference[c][k]).abs().max())
                              for c, g in enumerate(got) for k in g) / scale
    times: dict[str, list[float]] = {n: [] for n in sides}
    names = list(sides)
    for i in range(args.repeats):
        for name in names[i % len(names):] + names[:i % len(names)]:
            t0 = time.perf_counter()
            sides[name]()
            times[name].append(time.perf_counter() - t0)
    base = statistics.median(times[names[0]])
    print(f"{args.arch} ({args.variant}, surgery), {args.group} group, {args.clients} clients at batch 1, "
          f"{torch.get_num_threads()} torch threads, {args.repeats} repeat(s):")
    for name in names:
        t = times[name]
        extra = f", max |diff| {diffs[name]:.1e} of the largest gradient" if name in diffs else ""
        print(f"  {name:<26} median {statistics.median(t):6.2f} s [min {min(t):.2f}, max {max(t):.2f}]"
              f" = {statistics.median(t) / base:.2f}x the loop{extra}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
