"""What the benchmark costs over the work it cannot avoid: the victims' gradients, in one run.

    python bench/benchmark_overhead.py                        # paper preset, 9 images, 5 rows, settings a/b/c
    python bench/benchmark_overhead.py --num-images 18 --setting c
    python bench/benchmark_overhead.py --num-images 9 27          # also the marginal (steady-state) ratio

Two measurements of the same images and model rows, side by side:

* benchmark: ``run_benchmark.py`` end to end on ``configs/paper.yaml`` (in-process engine, one round
  per client, so every image is attacked once), wall time of ``main()`` into a fresh folder;
* bare victim gradients: for every model row and gradient group (x for setting a, x~ for b/c), the
  plain forward+backward of each client's private batch (``clients.update.fedsgd_gradients``: the same
  computation the clients run) in one loop, models built once. Nothing else: no Flower, no attack, no
  metric, no I/O.

The ratio benchmark / bare gradients is what issue 14 aims to bring to 1.5. Model building and image
loading happen on both sides once and are not part of the bare time; the benchmark's time includes
them (they are part of what a user waits for), so the ratio is an upper bound of the per-image overhead.

Set-up apart from steady state: with two sizes (``--num-images 9 27``) both sides run at each, and
the bench also prints the marginal ratio (benchmark(large) - benchmark(small)) / (bare(large) -
bare(small)): what each further image costs the benchmark against its bare gradients once the
start-up (imports, model builds, LPIPS, tables and grids) is paid. That ratio sets the time of a
long run such as the paper protocol.

The parts (``--parts``): at the largest size, the same updates once more, the work the benchmark
must do besides the victims, each part bare and timed on its own, one round at a time: the victims'
gradients, the Acc. column's top-1 forward of the unmodified model (rows with APRIL surgery), the
attack (one ``reconstruct_many`` per round, as the pipeline calls it) and the metrics (every setting
of the group, MJP regions included). The bench prints each part per update and the benchmark's
marginal time against their sum: near 1x (or below, where the attack thread overlaps the clients on
two cores) says the pipeline adds little of its own, and what is left is the work itself.

Measurement: both sides are warmed up first (a ``--dry-run`` of the benchmark's first model row:
imports, LPIPS, image cache, oneDNN kernels; one bare gradient per model), then timed ``--repeats`` times in alternating
order (benchmark first on even repeats, bare first on odd ones) and reported as median [min, max]
with the ratio of the medians, and the load average before and after.
"""
from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmark import config as C  # noqa: E402
from benchmark.inputs import client_run_config  # noqa: E402
from benchmark.pipeline import build_rows  # noqa: E402
from fedmjp.settings import SETTING_GROUPS  # noqa: E402
from run_benchmark import main as benchmark_main  # noqa: E402


@dataclass
class Victims:
    """One model row and gradient group: its resolved client config, the victims' model and the
    clients' private batches (round-major: ``clients`` per round)."""

    row: Any
    settings: list[str]
    resolved: dict
    model: torch.nn.Module
    batches: list
    dal: float


def bare_work(cfg: C.BenchmarkConfig) -> list[Victims]:
    """The victims per model row and gradient group (x for setting a, x~ for b/c), one warm-up
    gradient per model done."""
    from clients.partition import private_batch
    from clients.update import fedsgd_gradients, load_global_model

    rows = build_rows(cfg, torch.device("cpu"))
    groups = sorted({SETTING_GROUPS[s] for s in cfg.settings})
    clients, rounds = cfg.federation.clients, cfg.federation.rounds
    work = []
    for row in rows:
        for group in groups:
            resolved = client_run_config(cfg, row, group)
            model = load_global_model(resolved).to(getattr(torch, resolved.precision))
            batches = [private_batch(resolved, p, r, clients)
                       for r in range(1, rounds + 1) for p in range(clients)]
            work.append(Victims(row, [s for s in cfg.settings if SETTING_GROUPS[s] == group], resolved,
                                model, batches, resolved.dal_weight))
    for v in work:  # warm-up: one gradient per model
        fedsgd_gradients(v.model, v.batches[0], v.dal)
    return work


def bare_gradients(work: list[Victims]) -> tuple[float, int]:
    """(seconds, updates) of the victims' forward+backward passes alone."""
    from clients.update import fedsgd_gradients

    t0 = time.perf_counter()
    n = 0
    for v in work:
        for batch in v.batches:
            fedsgd_gradients(v.model, batch, v.dal)
            n += 1
    return time.perf_counter() - t0, n


def bare_parts(cfg: C.BenchmarkConfig, work: list[Victims]) -> tuple[dict[str, float], int]:
    """Seconds of each part of the benchmark's work on these updates, bare and one after the other
    (see the module docstring), and the number of updates."""
    import attacks
    from attacks.api.estimates import EstimateStore
    from benchmark import scoring
    from benchmark.entries import attack_entries
    from benchmark.group_attacker import attack_metadata
    from clients.update import fedsgd_gradients
    from metrics.regions import region_scores

    device = torch.device("cpu")
    scorer = scoring.Scorer(device, cfg.metrics.model_dump())
    attack = [attacks.create_attack(e.name, **e.options) for e in attack_entries(cfg)]
    clients = cfg.federation.clients
    parts = dict.fromkeys(("victim gradients", "Acc. forward", "attack", "metrics"), 0.0)
    n = 0
    for v in work:
        row = v.row
        for first in range(0, len(v.batches), clients):  # one round at a time, as the pipeline
            batches = v.batches[first:first + clients]
            t = time.perf_counter()
            grads = [fedsgd_gradients(v.model, b, v.dal)[0] for b in batches]
            parts["victim gradients"] += time.perf_counter() - t
            if row.acc_model is not None:
                t = time.perf_counter()
                scoring.top1_many(row.acc_model, batches, device)
                parts["Acc. forward"] += time.perf_counter() - t
            # one estimate store per update for the round's attacks, as the pipeline passes them
            md = [replace(attack_metadata(cfg, v.resolved, row.model, b), estimates=EstimateStore()) for b in batches]
            for a in attack:
                t = time.perf_counter()
                results = a.reconstruct_many(row.model, grads, md)
                parts["attack"] += time.perf_counter() - t
                t = time.perf_counter()
                x = torch.cat([b.images for b in batches])
                xs = None if batches[0].shuffled is None else torch.cat([b.shuffled for b in batches])
                for s in v.settings:
                    recon = torch.cat([r.unshuffled if s == "c" and r.unshuffled is not None else r.images
                                       for r in results])
                    scorer.score(s, recon, x, xs)
                    if s in ("b", "c") and batches[0].unk_mask is not None:
                        region_scores(recon.float(), (xs if s == "b" else x).float(),
                                      torch.cat([b.unk_mask for b in batches]),
                                      int(row.model.patch_embed.patch_size[0]))
                parts["metrics"] += time.perf_counter() - t
            n += len(batches)
    return parts, n


def run_once(flags: list[str]) -> float:
    """Wall seconds of one benchmark run into a fresh folder."""
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        code = benchmark_main(flags + ["--output", str(Path(tmp) / "run")])
        seconds = time.perf_counter() - t0
    if code != 0:
        raise SystemExit(f"benchmark exited {code}")
    return seconds


def summary(times: list[float]) -> str:
    return f"median {statistics.median(times):7.1f} s [min {min(times):.1f}, max {max(times):.1f}]"


def flags_for(args: argparse.Namespace, num_images: int) -> list[str]:
    """run_benchmark.py flags of one size: one round per 9 clients, so every image is attacked once."""
    clients = min(num_images, 9)
    rounds = max(num_images // clients, 1)
    flags = ["--config", args.config, "--setting", args.setting, "--num-images", str(num_images),
             "--clients", str(clients), "--rounds", str(rounds), "--engine", "inprocess", "--device", "cpu",
             "--no-progress"]
    for o in args.overrides:
        flags += ["--set", o]
    return flags


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=str(ROOT / "configs" / "paper.yaml"))
    p.add_argument("--num-images", type=int, nargs="+", default=[9],
                   help="one size, or two for the marginal (steady-state) ratio as well")
    p.add_argument("--setting", default="all")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--set", dest="overrides", action="append", default=[])
    p.add_argument("--parts", action="store_true",
                   help="also time each part of the benchmark's work bare (victims, Acc. forward, attack, metrics)")
    args = p.parse_args(argv)
    if len(args.num_images) > 2 or any(n < 1 for n in args.num_images):
        p.error("--num-images takes one or two positive sizes")
    logging.basicConfig(level=logging.WARNING)
    from fedmjp.allocator import tune_malloc

    tune_malloc()  # as run_benchmark.py does: the bare side gets the same allocator settings
    from benchmark.cli import build_parser, resolve

    sizes = sorted(set(args.num_images))
    cfgs = {n: resolve(build_parser().parse_args(flags_for(args, n))) for n in sizes}
    load_before = os.getloadavg()
    # warm-up of the benchmark side: one update of the first model row (imports, LPIPS, images, kernels)
    first = cfgs[sizes[0]]
    run_once(flags_for(args, sizes[0]) + ["--dry-run", "--models", first.models[0].name])
    work = {n: bare_work(cfgs[n]) for n in sizes}  # models, batches and one warm-up gradient per model
    bench: dict[int, list[float]] = {n: [] for n in sizes}
    bare: dict[int, list[float]] = {n: [] for n in sizes}
    updates: dict[int, int] = {}
    for i in range(args.repeats):
        for n in sizes:
            for side in (("bench", "bare") if i % 2 == 0 else ("bare", "bench")):
                if side == "bench":
                    bench[n].append(run_once(flags_for(args, n)))
                else:
                    seconds, updates[n] = bare_gradients(work[n])
                    bare[n].append(seconds)
    load_after = os.getloadavg()
    med = {n: (statistics.median(bench[n]), statistics.median(bare[n])) for n in sizes}
    print(f"\n{len(first.models)} model rows, settings {''.join(first.settings)}, "
          f"{torch.get_num_threads()} torch threads, {args.repeats} repeat(s), "
          f"load average {load_before[0]:.1f} before, {load_after[0]:.1f} after")
    for n in sizes:
        print(f"{n} images, {updates[n]} victim updates:")
        print(f"  benchmark (run_benchmark.py, in-process engine): {summary(bench[n])}")
        print(f"  bare victim gradients (forward+backward only):   {summary(bare[n])}")
        print(f"  ratio of medians: {med[n][0] / med[n][1]:.2f}x (aim: <= 1.5x); per update: benchmark "
              f"{med[n][0] / max(updates[n], 1):.3f} s, bare {med[n][1] / max(updates[n], 1):.3f} s")
    if len(sizes) == 2:
        small, large = sizes
        d_bench, d_bare = med[large][0] - med[small][0], med[large][1] - med[small][1]
        d_updates = max(updates[large] - updates[small], 1)
        print(f"marginal ({small} -> {large} images, start-up excluded): benchmark {d_bench / d_updates:.3f} s vs "
              f"bare {d_bare / d_updates:.3f} s per further update = {d_bench / d_bare:.2f}x")
    if args.parts:
        largest = sizes[-1]
        parts, n = bare_parts(cfgs[largest], work[largest])
        per = {k: v / max(n, 1) for k, v in parts.items()}
        total = sum(per.values())
        if len(sizes) == 2:
            against, what = d_bench / d_updates, "marginal"
        else:
            against, what = med[largest][0] / max(updates[largest], 1), "whole-run"
        print(f"parts, bare, one after the other ({largest} images, {n} updates), per update:")
        for k, v in per.items():
            print(f"  {k:<18} {v:.3f} s ({v / total:5.1%})")
        print(f"  sum of the parts   {total:.3f} s; the benchmark's {what} time per update {against:.3f} s = "
              f"{against / total:.2f}x the parts, {against / per['victim gradients']:.2f}x the victims alone")
    return 0


if __name__ == "__main__":
    sys.exit(main())
