"""The checked config: every value a user can type, checked before anything is written.

:func:`validate` turns merged plain data (:mod:`benchmark.config`: presets, flags, overrides) into
the typed :class:`~benchmark.config.BenchmarkConfig` a run reads: keys, types and ranges against
the schema, names against their registries (model factory, attacks, defences),
``federation.options`` against the clients' run-config schema, and every sweep point as a config
of its own (:func:`point_config`).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping

from clients.runconfig import RunConfig
from fedmjp import config as core

from .config import Attack, AttackEntry, BenchmarkConfig, plain, with_values
from .entries import attack_entries, model_spec
from .errors import ConfigError
from .sweep_points import MAX_SWEEP_POINTS, grid_points, grid_size, point_changes, point_label, swept_keys


def validate(cfg: Mapping[str, Any] | BenchmarkConfig) -> BenchmarkConfig:
    """The checked, typed config: keys, types, names and values.

    Every value a user can type is checked here, before anything is written: keys, types and ranges
    against the schema, names against their registries (model factory, attacks, defences), and
    ``federation.options`` against the clients' run-config schema.
    """
    cfg = core.parse(BenchmarkConfig, plain(cfg))
    # the keys given, their values as the clients read them ("1e-4" -> 1e-4), ranges checked
    options = core.conform(RunConfig, cfg.federation.options, "federation.options.")
    cfg.federation.options = {k: options[k] for k in cfg.federation.options}
    owned = owned_run_keys()
    for key in cfg.federation.options:
        if key in owned:
            raise ConfigError(f"federation.options.{key} is a run-config key the benchmark sets (from {owned[key]}); "
                              f"set {owned[key]} instead (federation.options takes only the keys it does not set)")
    if not cfg.device.strip():
        raise ConfigError("device must be auto, cpu, cuda or cuda:N, got an empty string")
    cores = os.cpu_count() or 1
    if not cfg.ray_address and cfg.attack_workers > cores:  # Ray would wait for CPUs that never come
        raise ConfigError(f"attack_workers must be <= {cores} (this machine's CPUs) without a ray_address, "
                          f"got {cfg.attack_workers}")
    _validate_models(cfg)
    _validate_attack(cfg.attack)
    _validate_attack_list(cfg)
    validate_sweep(cfg)
    return cfg


#: Run-config keys the benchmark sets from its own keys besides the ``client=`` ones of the schema:
#: the setting each federation's group runs, the row's defence and model spec, and the server's
#: out-dir (the benchmark stores what it needs in its run folder, never in another folder).
_OWNED_BESIDES_SCHEMA = {
    "setting": "settings", "defence": "defence (or a model row's defence)", "model-name": "models[i].name",
    "model-arch": "models[i].arch", "model-variant": "models[i].variant", "model-kwargs": "models[i].kwargs",
    "model-checkpoint": "models[i].checkpoint", "model-april": "models[i].april", "model-seed": "models[i].seed",
    "out-dir": "output (the run folder, --output)",
}


def owned_run_keys() -> dict[str, str]:
    """Run-config key -> the benchmark key that sets it (every run-config key the benchmark owns:
    a ``client=`` target of the schema, or one of :data:`_OWNED_BESIDES_SCHEMA`)."""
    out: dict[str, str] = {}

    def walk(section: core.Schema, prefix: str) -> None:
        for key, info in type(section).model_fields.items():
            value = getattr(section, key)
            if isinstance(value, core.Schema):
                walk(value, f"{prefix}{key}.")
            targets: Any = (info.json_schema_extra or {}).get("client", ())  # type: ignore[union-attr]
            for target in (targets,) if isinstance(targets, str) else targets:
                out[target] = prefix + key

    walk(BenchmarkConfig(), "")
    return {**out, **_OWNED_BESIDES_SCHEMA}


def point_config(cfg: BenchmarkConfig, point: dict[str, Any]) -> BenchmarkConfig:
    """The validated config of one grid point (no sweep; the point's values set); the schema check
    names an unknown key and the valid ones."""
    return validate(with_values(cfg, point_changes(point)))


def validate_sweep(cfg: BenchmarkConfig) -> None:
    """Every swept key may be swept and every grid point is a valid config (names, ranges, defence
    keys), checked before anything is written (the sweep's shape is the schema's). Raises ConfigError."""
    for key in swept_keys(cfg):
        if key in ("sweep", "output") or str(key).startswith("sweep."):
            raise ConfigError(f"sweep key {key!r} cannot be swept")
    size = grid_size(cfg)
    if size > MAX_SWEEP_POINTS:
        raise ConfigError(f"the sweep has {size:,} points; at most {MAX_SWEEP_POINTS:,} (each point is a whole "
                          "benchmark run): sweep fewer values or split it into several folders")
    for point in grid_points(cfg) if cfg.sweep else []:
        try:
            point_config(cfg, point)
        except ConfigError as err:
            raise ConfigError(f"sweep point {point_label(point)}: {err}") from err


def _validate_models(cfg: BenchmarkConfig) -> None:
    """Rows (types checked by the schema): at least one, unique names, recipes exist, specs build."""
    from fedmjp.factory import validate_spec

    if not cfg.models:
        raise ConfigError("the config names no model rows (models: [...])")
    for index, row in enumerate(cfg.models):
        if row.recipe and not Path(row.recipe).is_file():
            raise ConfigError(f"model row {row.name!r}: training recipe {row.recipe} does not exist")
        try:
            validate_spec(model_spec(cfg, index))
        except ValueError as err:
            raise ConfigError(f"model row {row.name!r}: {err}") from err
    _check_unique([row.name for row in cfg.models], "model row names must be unique")


def _check_unique(names: list[str], what: str) -> None:
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ConfigError(f"{what}; repeated: {', '.join(duplicates)}")


def _validate_attack(entry: Attack | AttackEntry) -> None:
    """An attacker ``{name, options}``: a built-in, an installed plug-in's entry point or a
    ``package.module:Name`` reference that loads as an Attack subclass (a plug-in is imported here,
    so a bad one fails before any work), and options its schema takes (every value checked, number
    options converted in place: attacks.api.registry.attack_options)."""
    from attacks.api.registry import attack_options

    try:
        entry.options = attack_options(entry.name, entry.options)
    except ValueError as err:
        raise ConfigError(str(err)) from err


def _validate_attack_list(cfg: BenchmarkConfig) -> None:
    for entry in cfg.attacks:
        _validate_attack(entry)
    _check_unique([a.label or a.name for a in cfg.attacks],
                  "attack labels must be unique (give each entry of attacks a label)")
    if not attack_entries(cfg):
        raise ConfigError(f"no attack runs at federation.batch_size {cfg.federation.batch_size}: every entry of "
                          "attacks has a larger min_batch_size; lower one or add an attack without it")
