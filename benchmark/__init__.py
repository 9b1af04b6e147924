"""The privacy benchmark behind ``run_benchmark.py``.

- :mod:`.config`: the schema, YAML presets and ``key=value`` overrides as plain data.
- :mod:`.validation`: the checked, typed config (every name, value and sweep point checked first).
- :mod:`.entries`: each model row's factory spec and the run's attackers with their labels.
- :mod:`.config_diff`: what of a config must match to resume a run folder.
- :mod:`.sweep`, :mod:`.sweep_points`, :mod:`.sweep_table`: a strength sweep run point by point,
  its grid, and its table; :mod:`.frontier`: privacy at matched utility over a sweep.
- :mod:`.pipeline`: federations -> attacks on tapped updates -> scores -> ``results.jsonl`` (resumable).
- :mod:`.group_attacker`: one federation: its tapped updates by round, the attacks dispatched, the
  results scored and stored.
- :mod:`.inputs`: the run's checked inputs (model rows, attackers) and each federation's run config.
- :mod:`.secure_aggregation`: with SecAgg+ a round's aggregate attacked as one batch of all clients.
- :mod:`.scoring`: metrics against the setting's reference and top-1 (the Acc. column), as pure
  functions (``score_round``, ``round_top1``) a test can call without threads or Flower.
- :mod:`.rows`: ``ResultRow``, the schema of ``results.jsonl`` and its one row key.
- :mod:`.store`: the output folder (rows appended as produced, stored images).
- :mod:`.files`: atomic, link-refusing writes every file of an output folder goes through.
- :mod:`.aggregate`: per-row statistics (means, medians, bootstrap intervals, the strongest rows).
- :mod:`.tables`, :mod:`.pictures`: tables, distributions and grids built only from the output folder.
- :mod:`.cli`: the command line; :mod:`.errors`: exit statuses.
"""
import importlib
from typing import Any

# Re-exports are imported on first use: the config imports the model code (torch, timm), which
# ``run_benchmark.py --help`` and the command line's parser do not need.
_EXPORTS = {"DEFAULTS": "config", "SETTINGS": "config", "apply_overrides": "config", "load_config": "config",
            "BenchmarkError": "errors", "validate": "validation"}


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)


__all__ = ["DEFAULTS", "SETTINGS", "BenchmarkError", "apply_overrides", "load_config", "validate"]
