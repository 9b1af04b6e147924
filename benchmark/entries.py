"""The entries of a config's lists as a run reads them: each model row's factory spec, and the
attackers of the run with their labels resolved.

The checks (:mod:`benchmark.validation`), the store's file names (:mod:`benchmark.store`) and the
run (:mod:`benchmark.pipeline`) all read a row or an attacker through these, so all agree on which
seed a row is built with and which attackers run at the config's batch size.
"""
from __future__ import annotations

from .config import AttackEntry, BenchmarkConfig


class LabelledAttack(AttackEntry):
    """An attacker of a run (:func:`attack_entries`): its entry with the label resolved."""

    label: str


def attack_entries(cfg: BenchmarkConfig) -> list[LabelledAttack]:
    """The attackers of a run, each with its label (default: its name): the ``attacks`` list when
    it is not empty, else the single ``attack`` section."""
    entries = cfg.attacks or [AttackEntry(name=cfg.attack.name, options=cfg.attack.options)]
    return [LabelledAttack(name=e.name, options=dict(e.options), label=e.label or e.name, min_batch_size=e.min_batch_size)
            for e in entries if e.min_batch_size <= cfg.federation.batch_size]


def model_spec(cfg: BenchmarkConfig, index: int) -> dict:
    """The factory spec of model row ``index`` (label dropped; seed defaults to seed + index)."""
    spec = cfg.models[index].model_dump(exclude={"label", "recipe", "defence"})
    if spec["seed"] is None:
        spec["seed"] = cfg.seed + index
    return spec
