"""Cost of Flower's simulation engine over calling the same client computation directly, in one run.

    python bench/fl_overhead.py                       # 4 clients x 4 rounds, FedSGD, setting c
    python bench/fl_overhead.py --rounds 6 -c "mode='fedavg' local-steps=2"

Three ways of running the same rounds (same config, same clients.update.local_update per client):

* direct: a Python loop over clients and rounds plus the FedSGD/FedAvg server step; no Flower.
* inprocess: Flower's ServerApp/ClientApp/strategy with the in-process LocalGrid (no Ray).
* simulation: Flower's run_simulation with the Ray backend (each client in a Ray actor).

Per-round time is the median over rounds 2..R (round 1 pays the warm-up); the fixed start-up cost is
the whole run's wall time minus R times that median (Ray start, actor spawn, imports in the actors,
first-round warm-up, teardown). The direct loop gets torch threads = --client-cpus so one client's
compute matches one Ray actor's; Ray may still run up to num-cpus/client-cpus clients at once.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from flwr.common.config import parse_config_args  # noqa: E402

from clients.runconfig import RunConfig, resolve_config  # noqa: E402
from clients.update import clone_state, load_global_model, local_update  # noqa: E402
from server.federation import run_federation  # noqa: E402


def run_direct(cfg: RunConfig, rounds: int, clients: int) -> tuple[float, list[float]]:
    """(wall time, per-round times) of the rounds without Flower."""
    start = time.perf_counter()
    state = clone_state(load_global_model(cfg).state_dict())
    per_round = []
    for r in range(1, rounds + 1):
        t0 = time.perf_counter()
        updates = [local_update(cfg, state, pid, r, clients)[0] for pid in range(clients)]
        sign = -cfg.lr if cfg.mode == "fedsgd" else 1.0
        for name in updates[0]:
            mean = sum(u[name].double() for u in updates) / len(updates)
            state[name] = (state[name].double() + sign * mean).to(state[name].dtype)
        per_round.append(time.perf_counter() - t0)
    return time.perf_counter() - start, per_round


def summarize(name: str, wall: float, per_round: list[float]) -> dict:
    steady = statistics.median(per_round[1:]) if len(per_round) > 1 else per_round[0]
    return {"engine": name, "wall_s": wall, "round_s": per_round, "steady_round_s": steady,
            "startup_s": wall - len(per_round) * steady}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--client-cpus", type=float, default=1.0)
    p.add_argument("--num-cpus", type=int, default=min(2, os.cpu_count() or 1), help="CPUs Ray may use")
    p.add_argument("-c", "--run-config", action="append", default=[], help="run-config overrides (flwr -c syntax)")
    p.add_argument("--skip-inprocess", action="store_true")
    p.add_argument("--json", type=Path, default=None, help="also write the numbers here")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    for noisy in ("flwr", "server", "clients"):
        logging.getLogger(noisy).setLevel(logging.ERROR)

    given = {"setting": "c", "server-eval": False, "num-server-rounds": args.rounds, **parse_config_args(args.run_config)}
    given.update({"num-partitions": args.clients, "min-nodes": args.clients})
    cfg = resolve_config(given)

    rows = []
    torch.set_num_threads(max(1, int(args.client_cpus)))
    rows.append(summarize("direct", *run_direct(cfg, args.rounds, args.clients)))
    if not args.skip_inprocess:
        res = run_federation(cfg, engine="inprocess", num_supernodes=args.clients)
        rows.append(summarize("inprocess", res.seconds, [h["seconds"] for h in res.history]))
    res = run_federation(cfg, engine="simulation", num_supernodes=args.clients, client_cpus=args.client_cpus,
                         num_cpus=args.num_cpus)
    if not res.ok or res.failures:
        raise SystemExit(f"simulation run had failures: {res.failures}")
    rows.append(summarize("simulation", res.seconds, [h["seconds"] for h in res.history]))

    base = rows[0]["steady_round_s"]
    print(f"{args.clients} clients x {args.rounds} rounds, {cfg.mode}, setting {cfg.setting}, "
          f"model {cfg.model_arch} {cfg.model_kwargs}, Ray CPUs {args.num_cpus}, per client {args.client_cpus}")
    print(f"{'engine':<11} {'wall s':>8} {'round s (median 2..R)':>22} {'x direct':>9} {'start-up s':>11}")
    for row in rows:
        row["ratio_vs_direct"] = row["steady_round_s"] / base
        print(f"{row['engine']:<11} {row['wall_s']:8.2f} {row['steady_round_s']:22.3f} "
              f"{row['ratio_vs_direct']:9.2f} {row['startup_s']:11.2f}")
    if args.json:
        args.json.write_text(json.dumps({"config": cfg.wire(), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
