"""The points of a strength sweep: the grid a config's ``sweep:`` describes, each point's label and
run folder name, and the ``--sweep`` flag that adds grid keys.

A mapping of dotted keys to value lists is a grid (the Cartesian product, in the order given); a
list of mappings is the points themselves. Running them: :mod:`benchmark.sweep`; each point's
checked config: :func:`benchmark.validation.point_config`.
"""
from __future__ import annotations

import itertools
import json
import math
from typing import Any

from fedmjp import config as core

from .config import BenchmarkConfig
from .errors import ConfigError
from .files import short_name, slug

#: The most points one sweep runs (each is a whole benchmark run into the same folder).
MAX_SWEEP_POINTS = 1_000


def grid_points(cfg: BenchmarkConfig) -> list[dict[str, Any]]:
    """The sweep grid as a list of {dotted key: value}: the Cartesian product in the order given for
    a mapping, the points themselves for a list of mappings (an explicit grid, e.g. several defences
    and an MJP gamma series side by side)."""
    sweep = cfg.sweep or {}
    if isinstance(sweep, list):
        repeated = repeated_values(sweep)
        if repeated:
            raise ConfigError(f"sweep lists the point {point_label(repeated[0])} more than once; each point is a "
                              "whole run: list every point once")
        return [dict(point) for point in sweep]
    keys = list(sweep)
    for key in keys:
        check_values(key, sweep[key], f"sweep key {key!r}")
    return [dict(zip(keys, combo)) for combo in itertools.product(*(sweep[k] for k in keys))]


def grid_size(cfg: BenchmarkConfig) -> int:
    """How many points the sweep has, counted without building the grid (a product of long lists
    is astronomical)."""
    return len(cfg.sweep) if isinstance(cfg.sweep, list) else math.prod(len(v) for v in (cfg.sweep or {}).values())


def swept_keys(cfg: BenchmarkConfig) -> list[str]:
    """Every dotted key the sweep sets (a grid's keys, or those of each explicit point)."""
    return [k for p in cfg.sweep for k in p] if isinstance(cfg.sweep, list) else list(cfg.sweep)


def same_value_key(value: Any) -> tuple[str, Any]:
    """A hashable key equal for two sweep values that make the same point: numbers by value (``0.1``
    and ``0.10`` parse to one float; ``1`` and ``1.0`` are one number), booleans and null apart from
    numbers, mappings and lists by their canonical JSON (key order ignored)."""
    if value is None or isinstance(value, bool):
        return ("constant", value)
    if isinstance(value, (int, float)):
        return ("number", value)
    return ("data", json.dumps(value, sort_keys=True, default=str))


def repeated_values(values: list[Any]) -> list[Any]:
    """The values of ``values`` that an earlier one already makes (:func:`same_value_key`), in order."""
    seen: set[tuple[str, Any]] = set()
    repeated = []
    for value in values:
        key = same_value_key(value)
        if key in seen:
            repeated.append(value)
        seen.add(key)
    return repeated


def check_values(key: str, values: list[Any], where: str) -> None:
    """Refuse a grid key's values that repeat one another: a repeated value would run the same point
    twice (into two folders, counted twice in ``sweep.csv``). Raises ConfigError naming ``where``."""
    repeated = repeated_values(values)
    if repeated:
        raise ConfigError(f"{where} lists {key}={repeated[0]!r} more than once (values are compared as parsed: "
                          "0.1 and 0.10 are one value); list each value once")


def point_label(point: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in point.items())


def point_changes(point: dict[str, Any]) -> list[tuple[list[str], Any]]:
    """The (dotted key parts, value) changes that make the config of ``point``: no sweep, the
    point's values set as the Python objects themselves (a text round trip would turn 1e-06 into a
    YAML string)."""
    return [(["sweep"], {})] + [(key.split("."), value) for key, value in point.items()]


def point_folder_name(index: int, point: dict[str, Any]) -> str:
    """``NN-<label>`` of grid point ``index`` under ``<output>/points/`` (a long label: its head and a hash)."""
    return short_name(f"{index:02d}-{slug(point_label(point))}")


def parse_sweep_flag(text: str) -> tuple[str, list[Any]]:
    """``"defence.sigma=0,1e-2,0.1"`` -> ("defence.sigma", [0, 0.01, 0.1]) (values: YAML scalars, read
    like every config value by :func:`fedmjp.config.parse_value`)."""
    if "=" not in text:
        raise ConfigError(f"--sweep {text!r} must look like key=v1,v2,... (e.g. defence.sigma=0,0.01,0.1)")
    key, raw = text.split("=", 1)
    values = [core.parse_value(v, f"--sweep {text!r}") for v in raw.split(",") if v.strip()]
    if not key.strip() or not values:
        raise ConfigError(f"--sweep {text!r} needs a key and at least one value")
    check_values(key.strip(), values, f"--sweep {text!r}")
    return key.strip(), values


def sweep_flags(texts: list[str]) -> dict[str, list[Any]]:
    """The grid keys of every ``--sweep`` flag (:func:`parse_sweep_flag`), in the order given.

    Raises:
        ConfigError: a key given by two flags (the later one would silently replace the earlier
            one's values), naming the key and both flags.
    """
    grid: dict[str, list[Any]] = {}
    given: dict[str, str] = {}
    for text in texts:
        key, values = parse_sweep_flag(text)
        if key in grid:
            raise ConfigError(f"--sweep {key} is given twice ({given[key]!r} and {text!r}); give all its values "
                              f"in one flag: --sweep {key}=v1,v2,...")
        grid[key], given[key] = values, text
    return grid
