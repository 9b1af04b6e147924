"""What one federation's attacks are told and what its rows share: the metadata the server knows
besides an update (:func:`attack_metadata`), the rows' common columns (:func:`row_context`) and the
images the grids show (:func:`grid_image_ids`). Used by :mod:`benchmark.group_attacker`."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .config import BenchmarkConfig
from .inputs import ModelRow, expected_updates
from .rows import RowContext
from .secure_aggregation import tapped_batch

if TYPE_CHECKING:
    from attacks.api.base import AttackMetadata
    from clients.runconfig import RunConfig


def grid_image_ids(cfg: BenchmarkConfig, run_config: RunConfig) -> set[str]:
    """The fixed grid selection: the first ``report.grid_images`` images attacked, in (round,
    partition, batch index) order. Private batches do not depend on the model row or the setting
    group, so every grid row shows the same images."""
    k = cfg.report.grid_images
    ids: list[str] = []
    for rnd, part in expected_updates(cfg):
        if len(ids) >= k:
            break
        ids += tapped_batch(run_config, part, rnd, cfg.federation.clients).image_ids
    return set(ids[:k])


def attack_metadata(cfg: BenchmarkConfig, resolved: RunConfig, model: nn.Module, batch: Any) -> AttackMetadata:
    """What the server knows besides an update, typed: batch size, input normalisation, image size,
    the update type with its local SGD steps, the defence the clients run (its spec with parameters:
    Kerckhoffs, the server configures the protocol) and, when the threat model grants them, the
    labels, one per image.

    Args:
        cfg: the benchmark config; resolved: the federation's typed client config
            (:func:`client_run_config`); model: the server's model; batch: the private batch.
    """
    from attacks.api.base import AttackMetadata
    from fedmjp.factory import model_input_stats

    mean, std = model_input_stats(model)
    fed = cfg.federation
    fedavg = resolved.mode != fed.algorithm  # the fedavg defence turns FedSGD into FedAvg
    return AttackMetadata(
        num_images=len(batch.image_ids), image_size=(3, cfg.data.image_size, cfg.data.image_size),
        mean=torch.tensor(mean, dtype=torch.float64), std=torch.tensor(std, dtype=torch.float64),
        labels=batch.labels.detach().to("cpu", torch.long).clone() if cfg.attack.labels == "known" else None,
        update_type="gradient" if fed.algorithm == "fedsgd" and not fedavg else "delta",
        lr=float(fed.lr), local_steps=resolved.local_steps if fedavg else fed.local_steps,
        defence=resolved.defence)


def row_context(cfg: BenchmarkConfig, row: ModelRow, group: str, resolved: RunConfig,
                image_names: list[str]) -> RowContext:
    """What every result row of one federation (model row, setting group) shares; ``resolved``: the
    federation's run config. The flat image of the ``flat_psnr`` column has the colour the model
    normalises its input with (:func:`fedmjp.factory.model_input_stats`), as the attacks are told."""
    from fedmjp.factory import model_input_stats

    return RowContext(model=row.name, label=row.label, trained=row.trained, arch=row.spec["arch"],
                      variant=row.spec["variant"], april=row.spec["april"], group=group, seed=cfg.seed,
                      defence=resolved.defence,
                      image_index={name: i for i, name in enumerate(image_names)},
                      federation={"batch_size": cfg.federation.batch_size, "local_steps": cfg.federation.local_steps,
                                  "labels": "known" if cfg.attack.labels == "known" else "recovered"},
                      flat_colour=tuple(float(v) for v in model_input_stats(row.model)[0]))
