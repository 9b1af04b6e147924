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
"""
from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .config import BenchmarkConfig

_logger = logging.getLogger(__name__)


def defence_utility(cfg: BenchmarkConfig, row: Any, federate: Callable[..., Any] | None = None
                    ) -> dict[str, Any]:
    """Top-1 of ``row`` after ``cfg.utility.rounds`` FedAvg rounds with its defence.

    Args:
        cfg: a validated benchmark config with a ``utility`` section (benchmark/config.py's ``Utility``).
        row: a :class:`benchmark.pipeline.ModelRow`.
        federate: the federation runner (default :func:`server.federation.run_federation`).
    Returns:
        {"utility_top1", "utility_top1_start", "utility_rounds", "utility_start" ("checkpoint" or
        "fresh"), "utility_num_eval", "utility_source"}.
    """
    from clients.runconfig import resolve_config
    from fedmjp.data import DataError, load_images
    from fedmjp.evaluate import loss_and_top1
    from server.federation import run_federation

    from .errors import InputDataError
    from .pipeline import client_run_config

    u = cfg.utility
    group = "shuffled" if set(cfg.settings) & {"b", "c"} else "clean"
    run_config = client_run_config(cfg, row, group)
    if row.acc_model is not None:  # ``april: surgery`` is the attacker's view: train the model as deployed
        run_config["model-april"] = ""
    run_config.update({
        "num-server-rounds": int(u.rounds), "mode": "fedavg", "local-steps": int(u.local_steps),
        "batch-size": int(u.batch_size), "lr": float(u.lr), "images": str(u.source),
        "num-images": int(u.num_train), "num-partitions": int(u.clients), "min-nodes": int(u.clients),
        "precision": "float32", "server-eval": False, "out-dir": "",
    })
    resolved = resolve_config(run_config)
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
    result = runner(resolved.wire(), engine=cfg.federation.engine)
    model.load_state_dict({k: v.float() for k, v in result.final_state.items()}, strict=True)
    _, top1 = loss_and_top1(model, data.images[held_out], data.labels[held_out])
    _logger.info("%s / %s: top-1 %.3f -> %.3f after %d FedAvg rounds", row.name,
                 resolved.defence_spec().name, top1_start, top1, u.rounds)
    return {"utility_top1": top1, "utility_top1_start": top1_start, "utility_rounds": int(u.rounds),
            "utility_start": "checkpoint" if row.trained else "fresh",
            "utility_num_eval": len(data) - held_out.start, "utility_source": str(u.source)}
