"""What the benchmark costs over the work it cannot avoid: the victims' gradients, in one run.

    python bench/benchmark_overhead.py                        # paper preset, 9 images, 5 rows, settings a/b/c
    python bench/benchmark_overhead.py --num-images 18 --setting c

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
"""
from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmark import config as C  # noqa: E402
from benchmark.pipeline import build_rows, client_run_config  # noqa: E402
from run_benchmark import main as benchmark_main  # noqa: E402


def bare_gradients(cfg: dict) -> tuple[float, int]:
    """(seconds, updates) of the victims' forward+backward passes alone."""
    from clients.partition import private_batch
    from clients.runconfig import resolve_config
    from clients.update import fedsgd_gradients, load_global_model

    rows = build_rows(cfg, torch.device("cpu"))
    groups = sorted({C.SETTING_GROUPS[s] for s in cfg["settings"]})
    clients, rounds = cfg["federation"]["clients"], cfg["federation"]["rounds"]
    work = []
    for row in rows:
        for group in groups:
            run_config = resolve_config(client_run_config(cfg, row, group))
            model = load_global_model(run_config).to(getattr(torch, run_config["precision"]))
            batches = [private_batch(run_config, p, r, clients)
                       for r in range(1, rounds + 1) for p in range(clients)]
            work.append((model, batches))
    fedsgd_gradients(work[0][0], work[0][1][0])  # warm-up
    t0 = time.perf_counter()
    n = 0
    for model, batches in work:
        for batch in batches:
            fedsgd_gradients(model, batch)
            n += 1
    return time.perf_counter() - t0, n


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=str(ROOT / "configs" / "paper.yaml"))
    p.add_argument("--num-images", type=int, default=9)
    p.add_argument("--setting", default="all")
    p.add_argument("--set", dest="overrides", action="append", default=[])
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    clients = min(args.num_images, 9)
    rounds = max(args.num_images // clients, 1)
    flags = ["--config", args.config, "--setting", args.setting, "--num-images", str(args.num_images),
             "--clients", str(clients), "--rounds", str(rounds), "--engine", "inprocess", "--device", "cpu",
             "--no-progress"]
    for o in args.overrides:
        flags += ["--set", o]
    from benchmark.cli import build_parser, resolve

    cfg = resolve(build_parser().parse_args(flags))
    torch.set_num_threads(torch.get_num_threads())
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        code = benchmark_main(flags + ["--output", str(Path(tmp) / "run")])
        bench = time.perf_counter() - t0
    if code != 0:
        print(f"benchmark exited {code}", file=sys.stderr)
        return code
    bare, n = bare_gradients(cfg)
    print(f"\n{len(cfg['models'])} model rows, settings {''.join(cfg['settings'])}, {args.num_images} images, "
          f"{n} victim updates, {torch.get_num_threads()} torch threads")
    print(f"benchmark (run_benchmark.py, in-process engine): {bench:8.1f} s")
    print(f"bare victim gradients (forward+backward only):   {bare:8.1f} s")
    print(f"ratio: {bench / bare:.2f}x (aim: <= 1.5x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
