"""The privacy benchmark behind ``run_benchmark.py``.

- :mod:`.config`: YAML presets, ``key=value`` overrides, validation, the resolved config.
- :mod:`.pipeline`: federations -> attacks on tapped updates -> scores -> ``results.jsonl`` (resumable).
- :mod:`.group_attacker`: one federation: its tapped updates by round, the attacks dispatched, the
  results scored and stored.
- :mod:`.inputs`: the run's checked inputs (model rows, attackers) and each federation's run config.
- :mod:`.scoring`: metrics against the setting's reference and top-1 (the Acc. column), as pure
  functions (``score_round``, ``round_top1``) a test can call without threads or Flower.
- :mod:`.rows`: ``ResultRow``, the schema of ``results.jsonl`` and its one row key.
- :mod:`.store`: the output folder (rows appended as produced, stored images).
- :mod:`.files`: atomic, link-refusing writes every file of an output folder goes through.
- :mod:`.aggregate`: per-row statistics (means, medians, bootstrap intervals, the strongest rows).
- :mod:`.tables`, :mod:`.pictures`: tables, distributions and grids built only from the output folder.
- :mod:`.cli`: the command line; :mod:`.errors`: exit statuses.
"""
from .config import DEFAULTS, SETTINGS, apply_overrides, load_config, validate
from .errors import BenchmarkError

__all__ = ["DEFAULTS", "SETTINGS", "BenchmarkError", "apply_overrides", "load_config", "validate"]
