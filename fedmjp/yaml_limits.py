"""Cheap limits checked on YAML text before it is turned into data: its length, its nesting depth
and the number of values it stands for once every alias is expanded.

A YAML alias (``*a``) refers to an anchored node (``&a``) without copying it, so a few hundred bytes
of nested anchors (the "billion laughs") stand for billions of values; PyYAML builds them as shared
objects, and the first deep copy, JSON dump or walk of the config (the schema check, the run
folder's ``config.yaml``, Flower's run config) expands them until memory runs out. A very deep
nesting makes PyYAML's recursive composer raise RecursionError. Both are refused here from the
parser's event stream, which is built iteratively (no recursion) and expands nothing: the expanded
size of each anchor is counted once and added at each alias.

No library offers this for PyYAML (ruamel.yaml and PyYAML expose no expansion cap), hence the
short event walk below.
"""
from __future__ import annotations

from typing import Any

import yaml

#: Characters of one YAML text (a config file, a ``--set`` value): configs are a few kB.
MAX_CHARS = 1 << 20
#: Nesting depth of mappings and lists (the shipped configs nest 4 deep).
MAX_DEPTH = 32
#: Values (scalars, mappings, lists) the text stands for with every alias expanded.
MAX_VALUES = 100_000


class YamlLimitError(yaml.YAMLError):
    """YAML text over one of the limits of this module; the message names the limit and the way out."""


def check_limits(text: str, loader: Any = yaml.SafeLoader, *, max_chars: int = MAX_CHARS,
                 max_depth: int = MAX_DEPTH, max_values: int = MAX_VALUES) -> None:
    """Raise :class:`YamlLimitError` when ``text`` is longer than ``max_chars``, nests deeper than
    ``max_depth`` or stands for more than ``max_values`` values with its aliases expanded. Syntax
    errors are left to the loader that reads the text afterwards (they raise its own YAMLError)."""
    if len(text) > max_chars:
        raise YamlLimitError(f"YAML text of {len(text):,} characters is longer than the limit of {max_chars:,}")
    total = 0
    sizes: dict[str, int] = {}  # anchor -> values it stands for (expanded)
    open_: list[tuple[Any, int]] = []  # (anchor, total before it) of each open mapping or list
    for event in yaml.parse(text, Loader=loader):
        if isinstance(event, yaml.AliasEvent):
            total += sizes.get(event.anchor, 1)  # an undefined anchor is the loader's error to report
        elif isinstance(event, yaml.ScalarEvent):
            total += 1
            if event.anchor:
                sizes[event.anchor] = 1
        elif isinstance(event, yaml.CollectionStartEvent):
            open_.append((event.anchor, total))
            total += 1
            if len(open_) > max_depth:
                raise YamlLimitError(f"YAML nests deeper than {max_depth} levels (line {event.start_mark.line + 1}); "
                                     "a config needs a few levels")
        elif isinstance(event, yaml.CollectionEndEvent):
            anchor, before = open_.pop()
            if anchor:
                sizes[anchor] = total - before
        if total > max_values:
            raise YamlLimitError(f"YAML stands for more than {max_values:,} values once its aliases (*name) are "
                                 f"expanded (line {event.start_mark.line + 1}); write the values out or use fewer "
                                 "nested aliases")
