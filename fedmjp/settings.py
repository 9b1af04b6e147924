"""The three threat settings of the MJP privacy study, defined once (docs/design.md, "Threat model and
the settings (a), (b), (c)").

- ``a``: phi(grad M(x), x): the client's gradient is computed on the original image x; the
  reconstruction is compared with x.
- ``b``: phi(grad M(x~), x~): the gradient is computed on the MJP-shuffled image x~ (shuffled
  patches carry E_unk); compared with x~.
- ``c``: phi(grad M(x~), x): the same gradient as (b); compared with the original x.

The clients' run config, the benchmark config and the report all validate and order settings by
this tuple, so it lives in the core that every package may import.
"""
from __future__ import annotations

from typing import Literal, get_args

#: A setting's name (a type checker reads the values; :data:`SETTINGS` is the same, in order).
Setting = Literal["a", "b", "c"]
SETTINGS: tuple[str, ...] = get_args(Setting)

#: The gradient each setting attacks: the clean image's, or the shuffled one's (settings b and c
#: attack the same gradient of x~, so one federation per model row serves both).
SETTING_GROUPS = {"a": "clean", "b": "shuffled", "c": "shuffled"}
