"""Utility of a defence: top-1 after a fixed number of FedAvg rounds with the defence on.

For one model row and its defence, :func:`defence_utility` runs a separate federation (Flower's
in-process or simulation engine, no tap, no attack) of ``utility.rounds`` FedAvg rounds on the
``utility.source`` images (a dataset archive such as ``$FEDMJP_DATA/cifar10.tar.gz``, a folder, or
``embedded``), starting from the row's checkpoint or, when it has none, from its seeded fresh
weights (``start`` in the result says which), on the model as deployed (a row's ``april: surgery``
is the attacker's view of the model and is left out here), and measures top-1 of the final global model on
``utility.num_eval`` held-out images of the same source (the images after the ``num_train`` that
the clients train on; the loader takes them round-robin over classes). Clients train on the
setting's input: x~ (MJP-shuffled, gamma) when the run's settings include b or c, else x.

Cost: rounds x clients x local_steps SGD steps of ``batch_size`` images (DP-SGD: one backward per
image), CPU-friendly at 32 px. From fresh weights a few rounds stay near chance (10 % on CIFAR-10):
the top-1 differences between defences are meaningful only from a trained checkpoint.

``utility.split: train`` is the measurement that separates defences (:func:`train_split_utility`): the
clients' partitions (``utility.partition``: IID or Dirichlet by label) are cut from the archive's
``train/`` split, and top-1 is scored on the first ``num_eval`` images of its ``val/`` split (all
10,000 for CIFAR-10) with a seeded bootstrap interval (:func:`fedmjp.stats.bootstrap_interval`),
before and after the rounds; ``utility.curve`` scores the global model after chosen rounds too (a
learning curve, to choose the budget), and a DP defence gets the federation's (epsilon, delta)
(:mod:`benchmark.accounting`).
"""
from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Optional

from fedmjp.text import escape_log_output

if TYPE_CHECKING:
    from clients.runconfig import RunConfig

    from .config import BenchmarkConfig

_logger = logging.getLogger(__name__)


def defence_utility(cfg: BenchmarkConfig, row: Any, federate: Callable[..., Any] | None = None
                    ) -> dict[str, Any]:
    """Top-1 of ``row`` after ``cfg.utility.rounds`` FedAvg rounds with its defence.

    Args:
        cfg: a validated benchmark config with a ``utility`` section (benchmark/config.py's ``Utility``).
        row: a :class:`benchmark.inputs.ModelRow`.
        federate: the federation runner (default :func:`server.federation.run_federation`).
    Returns:
        {"utility_top1", "utility_top1_start", "utility_rounds", "utility_start" ("checkpoint" or
        "fresh"), "utility_num_eval", "utility_source"}.
    """
    from fedmjp.data import DataError, load_images
    from fedmjp.evaluate import loss_and_top1
    from server.federation import run_federation

    from .errors import InputDataError

    u = cfg.utility
    if u.split == "train":
        return train_split_utility(cfg, row, federate)
    group, resolved = utility_run_config(cfg, row, str(u.source))
    try:
        data = load_images(u.source, int(cfg.data.image_size), int(u.num_train) + int(u.num_eval),
                           int(cfg.data.num_classes))
    except DataError as err:
        raise InputDataError(f"utility.source: {err}") from err
    held_out = slice(int(u.num_train), len(data))
    if held_out.start >= len(data):
        raise ValueError(f"utility.source {u.source} holds {len(data)} images, none left after num_train="
                         f"{u.num_train} for evaluation; lower utility.num_train")
    model = copy.deepcopy(row.model if row.acc_model is None else row.acc_model).float().cpu()
    _, top1_start = loss_and_top1(model, data.images[held_out], data.labels[held_out])
    runner = federate or run_federation
    result = runner(resolved, engine=cfg.federation.engine)
    model.load_state_dict({k: v.float() for k, v in result.final_state.items()}, strict=True)
    _, top1 = loss_and_top1(model, data.images[held_out], data.labels[held_out])
    _logger.info("%s / %s: top-1 %.3f -> %.3f after %d FedAvg rounds", row.name,
                 resolved.defence.name, top1_start, top1, u.rounds)
    return {"utility_top1": top1, "utility_top1_start": top1_start, "utility_rounds": int(u.rounds),
            "utility_start": "checkpoint" if row.trained else "fresh",
            "utility_num_eval": len(data) - held_out.start, "utility_source": str(u.source)}


#: Start top-1 per (checkpoint, eval set): every point of a sweep starts from the same weights.
_START_CACHE: dict[tuple, tuple[float, float, float]] = {}


def utility_run_config(cfg: Any, row: Any, images: str, extra: Optional[dict] = None) -> tuple[str, RunConfig]:
    """(group, the clients' typed run config) of a utility federation: the row's run config as the
    attack federation builds it, trained as deployed (no APRIL surgery), FedAvg with the ``utility``
    section's rounds, local steps, batch, lr and clients on ``images``, plus ``extra`` run-config keys."""
    from .inputs import client_run_config

    u = cfg.utility
    group = "shuffled" if set(cfg.settings) & {"b", "c"} else "clean"
    values: dict[str, Any] = {
        "num-server-rounds": int(u.rounds), "mode": "fedavg", "local-steps": int(u.local_steps),
        "batch-size": int(u.batch_size), "lr": float(u.lr), "images": images,
        "num-images": int(u.num_train), "num-partitions": int(u.clients), "min-nodes": int(u.clients),
        "precision": "float32", "server-eval": False, "out-dir": "", "server-opt": u.server_opt,
        "server-lr": float(u.server_lr), "server-momentum": float(u.server_momentum),
        "server-tau": float(u.server_tau), "server-schedule": u.server_schedule, **(extra or {}),
    }
    if row.acc_model is not None:  # ``april: surgery`` is the attacker's view: train the model as deployed
        values["model-april"] = ""
    return group, client_run_config(cfg, row, group, values)


def top1_interval(correct: Any) -> tuple[float, float, float]:
    """(top-1, low, high) in [0, 1] of per-image 0/1 ``correct`` with the 95 % seeded BCa bootstrap
    interval of :func:`fedmjp.stats.bootstrap_interval` (9999 resamples, seed 0)."""
    import numpy as np

    from fedmjp.stats import bootstrap_interval, mean_stat

    values = np.asarray(correct, dtype=np.float64)
    return bootstrap_interval(mean_stat(values, scale=1.0), len(values))


def per_image_correct(model: Any, images: Any, labels: Any, batch_size: int = 250) -> Any:
    """Per image: whether ``model``'s top-1 class on x (normalised as it expects) is the label; a
    bool numpy array. float32, eval mode, no shuffle (MJP rows are scored on x, as deployed)."""
    import numpy as np
    import torch

    from fedmjp.factory import model_input

    model.eval()
    out = []
    with torch.inference_mode():
        for start in range(0, len(images), batch_size):
            logits = model(model_input(model, images[start:start + batch_size]))
            out.append((logits.argmax(-1) == labels[start:start + batch_size]).numpy())
    return np.concatenate(out) if out else np.zeros(0, dtype=bool)


def _split_folders(source: str) -> tuple[Any, Any]:
    """(train/, val/) folders of a dataset archive or ImageFolder root; InputDataError naming
    ``utility.source`` when it has not both."""
    from fedmjp.archives import ArchiveError, resolve_data_path

    from .errors import InputDataError

    try:
        root = resolve_data_path(source)
    except (ArchiveError, OSError, ValueError) as err:
        raise InputDataError(f"utility.source {source}: {err}") from err
    train, val = root / "train", root / "val"
    missing = [p.name for p in (train, val) if not p.is_dir()]
    if missing:
        raise InputDataError(f"utility.source {source} has no {' and no '.join(missing)}/ folder (in {root}); "
                             "utility.split: train needs a dataset with train/ and val/ class folders, or use "
                             "utility.split: holdout")
    return train, val


def train_split_utility(cfg: BenchmarkConfig, row: Any, federate: Callable[..., Any] | None = None
                        ) -> dict[str, Any]:
    """Top-1 (with its interval) on the val/ split after ``utility.rounds`` FedAvg rounds with the
    row's defence, the clients' partitions cut from the train/ split (module docstring).

    Returns:
        the keys of :func:`defence_utility` plus ``utility_top1_low/high``,
        ``utility_top1_start_low/high``, ``utility_split``, ``utility_partition``, ``utility_clients``,
        ``utility_batch_size``, ``utility_local_steps``, ``utility_lr``, ``utility_train_images``,
        ``utility_server_opt``, ``utility_server_lr``, ``utility_server_tau``, ``utility_server_schedule``,
        ``utility_curve`` ([[round, top-1 on the first curve_eval images], ...]), ``utility_seconds``
        and, for a DP defence, ``utility_dp_epsilon``, ``utility_dp_delta``, ``utility_dp_accounting``.
    """
    import time

    from clients.partition import partition_indices, private_image_set
    from fedmjp.data import DataError, load_images
    from server.federation import run_federation

    from .accounting import federation_epsilon
    from .errors import InputDataError

    u = cfg.utility
    train, val = _split_folders(str(u.source))
    group, resolved = utility_run_config(cfg, row, str(train), {
        "partitioner": u.partition, "dirichlet-alpha": float(u.dirichlet_alpha)})
    try:
        data = load_images(str(val), int(cfg.data.image_size), int(u.num_eval), int(cfg.data.num_classes))
        n_train = len(private_image_set(resolved))
    except DataError as err:
        raise InputDataError(f"utility.source: {err}") from err
    try:
        sizes = [len(partition_indices(resolved, p, int(u.clients))) for p in range(int(u.clients))]
    except ValueError as err:
        raise InputDataError(f"utility.partition {u.partition}: {err}") from err
    model = copy.deepcopy(row.model if row.acc_model is None else row.acc_model).float().cpu()
    key = (row.name, str(row.spec.get("checkpoint")), str(val), len(data), group)
    if key not in _START_CACHE:
        _START_CACHE[key] = top1_interval(per_image_correct(model, data.images, data.labels))
    start = _START_CACHE[key]

    wanted = sorted({int(r) for r in u.curve if 0 < int(r) <= int(u.rounds)})
    n_curve = min(int(u.curve_eval), len(data))
    curve: dict[int, float] = {}
    probe = copy.deepcopy(model)

    def tap(update: Any) -> None:
        # the global model clients start round r from is the one after round r - 1
        done = int(update.server_round) - 1
        if done in wanted and done not in curve:
            probe.load_state_dict({k: v.float() for k, v in update.global_state.items()}, strict=True)
            curve[done] = float(per_image_correct(probe, data.images[:n_curve], data.labels[:n_curve]).mean())

    runner = federate or run_federation
    began = time.perf_counter()
    if wanted and any(r < int(u.rounds) for r in wanted):
        result = runner(resolved, engine=cfg.federation.engine, tap=tap)
    else:
        result = runner(resolved, engine=cfg.federation.engine)
    seconds = time.perf_counter() - began
    if result.failures:
        raise RuntimeError(f"utility federation of {row.name} / {resolved.defence.name}: "
                           f"{len(result.failures)} client failures, first: {result.failures[0]}")
    model.load_state_dict({k: v.float() for k, v in result.final_state.items()}, strict=True)
    correct = per_image_correct(model, data.images, data.labels)
    top1 = top1_interval(correct)
    if wanted:  # the curve ends at the final model, on the same images
        curve[int(u.rounds)] = float(correct[:n_curve].mean())
    spec = resolved.defence
    eps = federation_epsilon(spec, int(u.rounds), int(u.local_steps), int(u.batch_size), min(sizes), float(u.delta))
    _logger.info("%s / %s: top-1 %.4f -> %.4f [%.4f, %.4f] after %d FedAvg rounds (%.0f s)", row.name, spec.name,
                 start[0], top1[0], top1[1], top1[2], u.rounds, seconds)
    return {"utility_top1": top1[0], "utility_top1_low": top1[1], "utility_top1_high": top1[2],
            "utility_top1_start": start[0], "utility_top1_start_low": start[1], "utility_top1_start_high": start[2],
            "utility_rounds": int(u.rounds), "utility_start": "checkpoint" if row.trained else "fresh",
            "utility_num_eval": len(data), "utility_source": str(u.source), "utility_split": "train",
            "utility_partition": u.partition if u.partition == "iid" else f"dirichlet({u.dirichlet_alpha:g})",
            "utility_clients": int(u.clients), "utility_batch_size": int(u.batch_size),
            "utility_local_steps": int(u.local_steps), "utility_lr": float(u.lr), "utility_train_images": n_train,
            "utility_server_opt": u.server_opt, "utility_server_lr": float(u.server_lr),
            "utility_server_tau": float(u.server_tau), "utility_server_schedule": u.server_schedule,
            "utility_curve": [[r, curve[r]] for r in sorted(curve)], "utility_seconds": round(seconds, 1),
            **{f"utility_{k}": v for k, v in eps.items()}}


def main(argv: list[str] | None = None) -> int:
    """``python -m benchmark.utility --config FILE [--point N] [--set key=value ...]``: one point's
    utility federation alone (no attack), as JSON on stdout; with ``--set "utility.curve=[10,20]"``
    the learning curve a sweep's budget is chosen from (docs/defences.md)."""
    import argparse
    import json
    import sys

    import torch

    from .config import apply_overrides, load_config
    from .errors import BenchmarkError, ConfigError
    from .pipeline import build_rows
    from .sweep_points import grid_points
    from .validation import point_config, validate

    p = argparse.ArgumentParser(description="utility of one sweep point (FedAvg with its defence, then top-1)")
    p.add_argument("--config", required=True, help="benchmark config with a utility section")
    p.add_argument("--point", type=int, help="index of the config's sweep point (default: the config itself)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override (dotted key)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    escape_log_output()  # untrusted names in log records are printed escaped
    try:
        cfg = validate(apply_overrides(load_config(args.config), args.set))
        if args.point is not None:
            points = grid_points(cfg)
            if not 0 <= args.point < len(points):
                p.error(f"--point {args.point}: the config's sweep has {len(points)} points (0..{len(points) - 1})")
            cfg = point_config(cfg, points[args.point])
        if cfg.utility.rounds < 1:
            p.error("utility.rounds is 0: set it (--set utility.rounds=40)")
        results = [{"model": row.name, **defence_utility(cfg, row)} for row in build_rows(cfg, torch.device("cpu"))]
    except (BenchmarkError, ConfigError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
