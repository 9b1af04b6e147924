"""The run's checked inputs and what each federation derives from them.

:func:`benchmark.pipeline.prepare` builds a :class:`Prepared` (model rows, attackers, scorer) before
any work starts. Each federation (a model row and a gradient group) runs with the clients' run config
of :func:`client_run_config`, and its attacker expects the (round, partition) pairs of
:func:`expected_updates`. The pipeline (run orchestration) and :mod:`benchmark.group_attacker` (one
federation's rounds) both read these, so this module sits below both.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from defences.spec import DefenceSpec
from fedmjp.config import Schema

from . import scoring
from .config import BenchmarkConfig
from .secure_aggregation import tapped_partitions

if TYPE_CHECKING:
    from clients.runconfig import RunConfig

GROUP_SETTING = {"clean": "a", "shuffled": "c"}  # the setting the clients are told (b == c on the client)


@dataclass
class ModelRow:
    """One model row: its config, factory spec and the server's copy of the model.

    ``model`` is what the attacks see (with ``april: surgery``: block 0 without norm1 and attention
    residual); ``acc_model`` is the model as trained (block 0 unmodified), on which the Acc. column is
    measured, or None when ``model`` is already the model as trained.
    """

    index: int
    name: str
    label: str
    spec: dict
    model: nn.Module
    trained: bool
    acc_model: nn.Module | None = None


@dataclass
class Attacker:
    """One attacker of the run: its ``attack`` column value, registry name and the attack object."""

    label: str
    name: str
    attack: Any


@dataclass
class Prepared:
    """Everything checked before any work starts (bad input fails here, not mid-run)."""

    cfg: BenchmarkConfig
    device: torch.device
    image_names: list[str]  # the attack set in order (the tensors stay with the clients' loader)
    images_record: dict[str, Any]  # their digest for the provenance record (benchmark/provenance.py)
    rows: list[ModelRow]
    attackers: list[Attacker]
    scorer: scoring.Scorer


def client_values(cfg: Schema) -> dict[str, Any]:
    """The Flower run-config values (clients/runconfig.py keys) of every benchmark key whose schema
    field names the run-config key(s) it feeds (``client=``)."""
    out: dict[str, Any] = {}
    for key, info in type(cfg).model_fields.items():
        value = getattr(cfg, key)
        if isinstance(value, Schema):
            out.update(client_values(value))
        meta: Any = info.json_schema_extra or {}
        targets = meta.get("client", ())
        for target in (targets,) if isinstance(targets, str) else targets:
            out[target] = meta.get("client_null") if value is None else value
    return out


def row_defence(cfg: BenchmarkConfig, index: int) -> DefenceSpec:
    """The defence of model row ``index``: its own ``defence:`` or else the top-level one."""
    return cfg.models[index].defence or cfg.defence


def client_run_config(cfg: BenchmarkConfig, row: ModelRow, group: str,
                      extra: Mapping[str, Any] | None = None) -> RunConfig:
    """The clients' typed run config of one federation (:class:`clients.runconfig.RunConfig`): the
    benchmark keys that feed run-config keys (``client=`` in benchmark/config.py's schema), the row's
    model spec and defence, then ``federation.options`` and ``extra`` (run-config keys) on top.

    Raises:
        ConfigError: ``federation.options`` or ``extra`` hold a bad run-config key or value.
    """
    from clients.runconfig import model_keys, resolve_config

    values = {**client_values(cfg), **model_keys(row.spec), "setting": GROUP_SETTING[group],
              "defence": row_defence(cfg, row.index)}
    if cfg.dry_run:
        values["num-server-rounds"] = 1
    return resolve_config({**values, **cfg.federation.options, **(extra or {})})


def expected_updates(cfg: BenchmarkConfig) -> list[tuple[int, int]]:
    """(round, partition) pairs the attacker attacks (dry run: round 1, partition 0 only)."""
    if cfg.dry_run:
        return [(1, 0)]
    return [(r, p) for r in range(1, cfg.federation.rounds + 1) for p in tapped_partitions(cfg)]
