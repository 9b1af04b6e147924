"""One configuration mechanism for the benchmark, central training, the Flower run config, defence
specs and attack options.

A schema is a dataclass holding every key's type and default: sections are nested dataclasses, a
choice is ``Literal[...]``, a nullable key ``Optional[...]``, a free-form mapping that its own code
validates ``dict[str, Any]``, a range ``option(default, minimum=..., maximum=..., above=...)``. Each
schema lives with its owner (fedmjp/trainconfig.py, clients/runconfig.py, benchmark/config.py,
defences/spec.py; an attack's options are its ``__init__`` arguments, attacks/base.py); this module
loads and checks, and knows none of them. :func:`conform` gives the defaults with the data on top, every
value checked: an unknown key is named with the valid keys, a wrong value with what the key takes.
Types are YAML's: a bool is no number, an int is a valid float (and becomes one), null only where
Optional.

Numbers parse as numbers wherever a user types them (YAML files, ``--set``, ``--sweep``, training's
``--key value``): YAML is read with :class:`ConfigLoader`, which reads floats the YAML 1.2 way
(``1e-4``, ``5E-05``, ``.5``, ``-.5``, ``1.``; YAML 1.1, PyYAML's default, reads ``1e-4`` as a
string). At the schema boundary a string holding a Python number literal (``"1e-4"``, ``"1_000"``)
is taken as that number for a number key, and an integer key takes a float with an integral value
(``1e3`` -> 1000; ``2.5`` is refused). A bool is never a number; anything else that is not a number
(``1e-4x``) is refused with the key named.

Not OmegaConf (2.3, installed with breaching): its bool field takes 3 and its str field takes 5 (as
True, '5'), merging deep-merges a free-form mapping (a new ``defence`` would keep the old one's
keys), ``Union[list, str]`` is refused, and an unknown-key error does not list the valid keys.
Pydantic 2's ``BaseModel`` (``strict=True, extra="forbid"``; a number type ``Annotated[int,
BeforeValidator(as_number), Strict()]``) takes every semantic here (its dataclasses in strict mode
refuse a mapping for a nested section; ``BaseModel`` takes one); moving to it means ``BaseModel``
schemas plus a formatter over ``ValidationError.errors()`` that keeps these messages (the key, what
it takes, the valid keys), and typed objects for the code that reads a config.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import math
import re
import typing
from pathlib import Path
from typing import Any, Literal, Mapping, Optional, Union

import yaml


class ConfigError(ValueError):
    """A config names an unknown key or holds a value its schema does not take."""


_FLOAT_TAG = "tag:yaml.org,2002:float"
#: YAML 1.2 core-schema floats (exponent without a dot or without a sign, a signed leading dot) plus
#: YAML 1.1's forms that PyYAML reads (``_`` separators, sexagesimal, ``.inf``/``.nan``). Integers
#: never match: PyYAML's int resolver keeps them.
_YAML_FLOAT = re.compile(r"""^(?:[-+]?[0-9][0-9_]*\.[0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?\.[0-9][0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+
    |[-+]?[0-9][0-9_]*(?::[0-5]?[0-9])+\.[0-9_]*
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""", re.X)


class ConfigLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` (data, never code) that reads floats as YAML 1.2 does: ``1e-4`` is a
    float, not the string YAML 1.1 makes of it. Used for every config file and command-line value."""

    yaml_implicit_resolvers = {
        first: [(tag, regexp) for tag, regexp in resolvers if tag != _FLOAT_TAG]
        for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}


class ConfigDumper(yaml.SafeDumper):
    """``yaml.SafeDumper`` that quotes a string :class:`ConfigLoader` would read as a float
    (``'1e-4'``), so a written config reads back the same."""

    yaml_implicit_resolvers = copy.deepcopy(ConfigLoader.yaml_implicit_resolvers)


for _cls in (ConfigLoader, ConfigDumper):
    _cls.add_implicit_resolver(_FLOAT_TAG, _YAML_FLOAT, list("-+0123456789."))


def load_yaml(text: str) -> Any:
    """YAML text as data (:class:`ConfigLoader`: safe, YAML 1.2 floats)."""
    return yaml.load(text, Loader=ConfigLoader)  # noqa: S506 (a SafeLoader subclass)


def dump_yaml(data: Any, **kwargs: Any) -> str:
    """Plain data as YAML text that :func:`load_yaml` reads back equal (:class:`ConfigDumper`)."""
    return yaml.dump(data, Dumper=ConfigDumper, **kwargs)


#: A Python number literal in decimal (``1e-4``, ``5E-05``, ``.5``, ``1_000``, ``-3``); what a string
#: value of a number key may hold.
_NUMBER_TEXT = re.compile(r"[-+]?(?:\d(?:_?\d)*(?:\.(?:\d(?:_?\d)*)?)?|\.\d(?:_?\d)*)(?:[eE][-+]?\d(?:_?\d)*)?")


def _members(tp: Any) -> tuple[Any, ...]:
    return typing.get_args(tp) if typing.get_origin(tp) is Union else (tp,)


def as_number(tp: Any, value: Any) -> Any:
    """``value`` as the number a number type ``tp`` (int, float, or a Union holding one) takes, when
    it is one written another way: a str holding a number literal (``"1e-4"`` -> 1e-4, ``"1_000"``
    -> 1000) unless ``tp`` also takes str, and an integral float for an int-only key (1e3 -> 1000).
    Anything else (a bool, ``"1e-4x"``, 2.5 for an int) is returned unchanged for the type check to
    refuse."""
    members = _members(tp)
    numeric = [m for m in members if m in (int, float)]
    if not numeric or isinstance(value, bool):
        return value
    if isinstance(value, str) and str not in members and Any not in members:
        text = value.strip()
        if not _NUMBER_TEXT.fullmatch(text):
            return value
        number = float(text) if any(c in text for c in ".eE") else int(text)
        if float not in numeric and isinstance(number, float) and not number.is_integer():
            return value  # "2.5" or "1e999" for an integer key: refused as the user wrote it
        value = number
    if isinstance(value, float) and float not in numeric and math.isfinite(value) and value.is_integer():
        value = int(value)
    return value


def option(default: Any, minimum: Optional[float] = None, maximum: Optional[float] = None,
           above: Optional[float] = None, **metadata: Any) -> Any:
    """A schema field with a range that :func:`conform` checks (``minimum``/``maximum`` inclusive,
    ``above`` an exclusive lower bound), and owner metadata (e.g. the Flower run-config key a
    benchmark key feeds). Mutable defaults are copied per instance."""
    bounds = (("min", minimum), ("max", maximum), ("above", above))
    meta = {**metadata, **{k: v for k, v in bounds if v is not None}}
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: copy.deepcopy(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


@functools.cache
def fields(schema: type) -> dict[str, tuple[Any, dataclasses.Field]]:
    """Config key -> (type, dataclass field). A schema with ``HYPHENATED = True`` (Flower's run
    config) spells its keys with hyphens: field ``batch_size`` is key ``batch-size``."""
    hints = typing.get_type_hints(schema)
    hyphens = getattr(schema, "HYPHENATED", False)
    return {(f.name.replace("_", "-") if hyphens else f.name): (hints[f.name], f) for f in dataclasses.fields(schema)}


def conform(schema: type, data: Any, where: str = "") -> dict[str, Any]:
    """The schema's defaults with ``data`` on top, every value checked; new plain data.

    Raises:
        ConfigError: an unknown key (the valid keys listed), a missing required key, or a value
            of the wrong type or outside its range (the key and what it takes named).
    """
    if not isinstance(data, Mapping):
        raise ConfigError(f"config key {where.rstrip('.')!r} must be a mapping, got {data!r}")
    schema_fields = fields(schema)
    for key in data:
        if key not in schema_fields:
            # "here": inside a section the valid keys are that section's
            valid = f"{'valid keys here' if where else 'valid'}: {', '.join(sorted(schema_fields))}"
            raise ConfigError(f"unknown config key {where + str(key)!r}; {valid}")
    out = {}
    for key, (tp, f) in schema_fields.items():
        if key in data:
            out[key] = _check(tp, data[key], where + key, f.metadata)
        elif dataclasses.is_dataclass(tp):
            out[key] = conform(tp, {}, f"{where}{key}.")
        elif f.default is not dataclasses.MISSING:
            out[key] = copy.deepcopy(f.default)
        elif f.default_factory is not dataclasses.MISSING:
            out[key] = f.default_factory()
        else:
            raise ConfigError(f"config key {where + key!r} is required ({describe(tp)})")
    return out


def defaults(schema: type) -> dict[str, Any]:
    """The schema's defaults as plain data (sections as dicts)."""
    return conform(schema, {})


def describe(tp: Any) -> str:
    """What a type takes, in YAML words (``an integer``, ``one of a, b``, ``a string or null``)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Union:
        return " or ".join("null" if a is type(None) else describe(a) for a in args)
    if origin is Literal:
        return "one of " + ", ".join(map(str, args))
    if origin is list or tp is list:
        return "a list"
    if origin is dict or tp is dict or dataclasses.is_dataclass(tp):
        return "a mapping"
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(tp, str(tp))


def _matches(tp: Any, value: Any) -> Any:
    """The member of ``tp`` that ``value`` is an instance of (``tp`` itself unless a Union), or None."""
    origin = typing.get_origin(tp)
    if origin is Union:
        return next((a for a in typing.get_args(tp) if _matches(a, value) is not None), None)
    if tp is Any or (tp is type(None) and value is None):
        return tp
    if origin is Literal:
        return tp if any(value == a and type(value) is type(a) for a in typing.get_args(tp)) else None
    if dataclasses.is_dataclass(tp):
        return tp if isinstance(value, Mapping) else None
    if isinstance(value, bool):  # YAML's true is no number
        return tp if tp is bool else None
    if tp is float:
        return tp if isinstance(value, (int, float)) else None
    base = origin or tp
    return tp if isinstance(base, type) and isinstance(value, base) else None


def check_value(tp: Any, value: Any, key: str) -> Any:
    """``value`` checked against type ``tp`` the way :func:`conform` checks a key (numbers written
    another way converted, :func:`as_number`); for typed values outside a schema (attack options).

    Raises:
        ConfigError: the value is not of the type (``key`` and what it takes named).
    """
    return _check(tp, value, key, {})


def _check(tp: Any, value: Any, key: str, meta: Mapping[str, Any]) -> Any:
    value = as_number(tp, value)
    member = _matches(tp, value)
    if member is None and typing.get_origin(tp) is Literal:
        choices = ", ".join(map(str, typing.get_args(tp)))
        raise ConfigError(f"config key {key!r}: unknown value {value!r}; valid: {choices}")
    if member is None:
        raise ConfigError(f"config key {key!r} must be {describe(tp)}, got {value!r}")
    if dataclasses.is_dataclass(member):
        return conform(member, value, f"{key}.")
    args = typing.get_args(member)
    item = args[-1] if args and typing.get_origin(member) in (list, dict) else Any
    if item is not Any:  # typed items (rows of a list, values of a mapping): each checked
        if isinstance(value, list):
            return [_check(item, v, f"{key}.{i}", {}) for i, v in enumerate(value)]
        return {k: _check(item, v, f"{key}.{k}", {}) for k, v in value.items()}
    if member is float:
        value = float(value)
    if value is not None and ("min" in meta or "max" in meta or "above" in meta):
        open_ = "above" in meta
        lo, hi = meta.get("above", meta.get("min", -math.inf)), meta.get("max", math.inf)
        if not (math.isfinite(value) and (lo < value if open_ else lo <= value) and value <= hi):
            low = "min" in meta or open_
            bounds = (f"in {'(' if open_ else '['}{lo}, {hi}]" if low and "max" in meta
                      else f"{'>' if open_ else '>='} {lo}" if low else f"<= {hi}")
            raise ConfigError(f"config key {key!r} must be {describe(member)} {bounds}, got {value!r}")
    return copy.deepcopy(value)


def read_yaml(path: str | Path) -> dict[str, Any]:
    """A YAML mapping read with :func:`load_yaml` (data, never code); an empty file is ``{}``."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        data = load_yaml(path.read_text())
    except yaml.YAMLError as err:
        raise ConfigError(f"config file {path} is not valid YAML: {' '.join(str(err).split())}") from err
    if not isinstance(data, (dict, type(None))):
        raise ConfigError(f"config file {path} must hold a mapping, got {type(data).__name__}")
    return data or {}


def parse_value(text: str, what: str) -> Any:
    """A command-line value as YAML data (``0.5`` and ``1e-4`` -> float, ``null`` -> None, ``{a: 1}``
    -> dict), read by :func:`load_yaml`."""
    try:
        return load_yaml(text) if text.strip() else None
    except yaml.YAMLError as err:
        raise ConfigError(f"{what}: value is not a YAML scalar: {' '.join(str(err).split())}") from err


def parse_override(text: str) -> tuple[list[str], Any]:
    """``"a.b=0.5"`` -> (["a", "b"], 0.5); the value is YAML data (:func:`parse_value`)."""
    key, eq, raw = text.partition("=")
    if not eq:
        raise ConfigError(f"override {text!r} must look like key=value (e.g. federation.rounds=3)")
    if not key.strip() or any(not part for part in key.strip().split(".")):
        raise ConfigError(f"override {text!r} has an empty key part")
    return key.strip().split("."), parse_value(raw, f"override {text!r}")


def set_dotted(data: dict, parts: list[str], value: Any) -> None:
    """Set ``data[p0][p1]... = value`` in place; a digit part indexes a list, missing mappings are
    created (the schema check afterwards names a key that does not exist)."""
    node: Any = data
    for i, part in enumerate(parts):
        if isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                raise ConfigError(f"{'.'.join(parts)}: {part!r} is not a row index below {len(node)}")
            key: Any = int(part)
        elif isinstance(node, dict):
            key = part
            if i < len(parts) - 1 and node.get(key) is None:
                node[key] = {}
        else:
            raise ConfigError(f"{'.'.join(parts)}: {'.'.join(parts[:i])!r} is not a mapping")
        if i == len(parts) - 1:
            node[key] = value
        else:
            node = node[key]

