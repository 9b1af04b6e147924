"""The privacy benchmark behind ``run_benchmark.py``.

- :mod:`.config`: YAML presets, ``key=value`` overrides, validation, the resolved config.
- :mod:`.pipeline`: federations -> attacks on tapped updates -> scores -> ``results.jsonl`` (resumable).
- :mod:`.scoring`: metrics against the setting's reference and top-1 (the Acc. column).
- :mod:`.store`: the output folder (rows appended as produced, stored images).
- :mod:`.report`: tables and grids built only from the output folder.
- :mod:`.cli`: the command line; :mod:`.errors`: exit statuses.
"""
from .config import DEFAULTS, SETTINGS, apply_overrides, load_config, validate
from .errors import BenchmarkError

__all__ = ["DEFAULTS", "SETTINGS", "BenchmarkError", "apply_overrides", "load_config", "validate"]
