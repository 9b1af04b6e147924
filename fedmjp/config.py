"""One configuration mechanism for the benchmark, central training, the Flower run config, defence
specs and attack options: pydantic v2 models read from YAML, with errors that name the key.

A schema is a :class:`Schema` (a strict pydantic ``BaseModel`` refusing unknown keys) with every
key's type and default: a section is a nested schema, a choice ``Literal[...]``, a nullable key
``Optional[...]``, a free-form mapping its own code checks ``dict``, a number :data:`Int` or
:data:`Float`, a range ``option(default, ge=..., le=..., gt=..., lt=...)`` (bounded numbers are finite), a key
of several shapes ``Annotated[Union[...], ByShape()]``. Schemas live with their owners (fedmjp/trainconfig.py,
clients/runconfig.py, benchmark/config.py, defences/spec.py; attack options: attacks/api/base.py).
:func:`parse` gives the model with defaults filled in, :func:`conform` the same as plain data; a
``ValidationError`` becomes a :class:`ConfigError` naming the key: an unknown key with the valid
keys, a wrong value with what the key takes. Types are YAML's: a bool is no number, an int is a
valid float (and becomes one), null only where Optional.

Numbers parse as numbers wherever a user types them: YAML is read with :class:`ConfigLoader`, which
reads floats the YAML 1.2 way (``1e-4``, ``5E-05``, ``.5``, ``1.``; YAML 1.1, PyYAML's default, reads
``1e-4`` as a string); a number key takes a string holding a Python number literal (``"1e-4"``,
``"1_000"``) as that number and an integer key an integral float (``1e3`` -> 1000, not ``2.5``).
"""
from __future__ import annotations

import copy
import functools
import math
import re
from pathlib import Path
from typing import Annotated, Any, Literal, Mapping, Optional, TypeVar, Union, cast, get_args, get_origin

import yaml
from pydantic import (BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, GetCoreSchemaHandler, Strict, Tag,
                      ValidationError)
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from .yaml_limits import MAX_CHARS, MAX_DEPTH, YamlLimitError, check_limits

M = TypeVar("M", bound=BaseModel)


class ConfigError(ValueError):
    """A config names an unknown key or holds a value its schema does not take (every config of the
    project: benchmark, training, run config, defences, attack options). ``exit_code``: the
    benchmark CLI's exit status for it."""

    exit_code = 3


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
    """YAML text as data (:class:`ConfigLoader`: safe, YAML 1.2 floats), after the size, depth and
    alias-expansion limits of :mod:`fedmjp.yaml_limits` (a ``yaml.YAMLError`` when over one)."""
    check_limits(text, ConfigLoader)
    return yaml.load(text, Loader=ConfigLoader)  # noqa: S506 (a SafeLoader subclass)


def dump_yaml(data: Any, **kwargs: Any) -> str:
    """Plain data as YAML text that :func:`load_yaml` reads back equal (:class:`ConfigDumper`)."""
    return yaml.dump(data, Dumper=ConfigDumper, **kwargs)


#: A Python number literal in decimal (``1e-4``, ``.5``, ``1_000``, ``-3``): what a number key's string may hold.
_NUMBER_TEXT = re.compile(r"[-+]?(?:\d(?:_?\d)*(?:\.(?:\d(?:_?\d)*)?)?|\.\d(?:_?\d)*)(?:[eE][-+]?\d(?:_?\d)*)?")


def as_number(kind: type, value: Any) -> Any:
    """``value`` as the number ``kind`` (int or float) when it is one written another way (``"1e-4"``,
    ``"1_000"``, 1e3 for an int, 3 for a float); anything else unchanged, for the type check to refuse."""
    if isinstance(value, str) and _NUMBER_TEXT.fullmatch(value.strip()):
        number = float(value) if any(c in value for c in ".eE") else int(value)
        value = number if kind is float or isinstance(number, int) or number.is_integer() else value
    if kind is int and isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    if kind is float and type(value) is int and abs(value) < 2**1023:  # bool is no number; a huge int stays
        return float(value)
    return value


Int = Annotated[int, BeforeValidator(functools.partial(as_number, int)), Strict()]
Float = Annotated[float, BeforeValidator(functools.partial(as_number, float)), Strict()]


class Schema(BaseModel):
    """Base of every config schema: strict types, unknown keys refused."""

    model_config = ConfigDict(strict=True, extra="forbid")


def option(default: Any = PydanticUndefined, *, ge: Optional[float] = None, le: Optional[float] = None,
           gt: Optional[float] = None, lt: Optional[float] = None, **extra: Any) -> Any:
    """A field with a range (``ge``/``le`` inclusive, ``gt``/``lt`` exclusive; bounded means finite)
    and owner metadata (``client=``: the run-config key a benchmark key feeds), ``json_schema_extra``."""
    finite = False if (ge, le, gt, lt) != (None, None, None, None) else None
    return Field(default, ge=ge, le=le, gt=gt, lt=lt, allow_inf_nan=finite, json_schema_extra=extra or None)


def _shape(value: Any) -> Optional[str]:
    """The YAML shape of a value or a type: bool, number, text, list or mapping."""
    tp = get_origin(value) or value
    tp = type(get_args(value)[0]) if tp is Literal else tp
    kinds: dict[str, type | tuple[type, ...]] = {"bool": bool, "number": (int, float), "text": str, "list": list,
                                                 "mapping": (Mapping, BaseModel)}
    return next((k for k, t in kinds.items() if isinstance(value, t) or isinstance(tp, type) and issubclass(tp, t)),
                None)


class ByShape:
    """``Annotated[Union[A, B], ByShape()]``: a key of several shapes (``Union[list[Setting],
    Literal["all"]]``), the union discriminated by the value's YAML shape (:func:`_shape`), so that an
    error is the chosen shape's own. The annotation stays a plain Union for type checkers."""

    def __get_pydantic_core_schema__(self, source: Any, handler: GetCoreSchemaHandler) -> Any:
        # cast: a member of no YAML shape gets Tag(None), which pydantic refuses while it builds the
        # schema (PydanticUserError callable-discriminator-no-tag), so a schema that builds has str tags.
        members = tuple(Annotated[m, Tag(cast(str, _shape(m)))] for m in get_args(source))
        return handler.generate_schema(Annotated[Union[members], Discriminator(_shape)])


def keys(schema: type[BaseModel]) -> dict[str, FieldInfo]:
    """Config key (the field's alias where it has one: Flower's hyphenated keys) -> field."""
    return {info.alias or name: info for name, info in schema.model_fields.items()}


def parse(schema: type[M], data: Any, where: str = "") -> M:
    """The ``schema`` model of ``data``, defaults filled in; ``where`` prefixes the keys named in errors.

    Raises:
        ConfigError: an unknown key (the valid keys listed), a missing key, or a value of the wrong
            type or out of range (the key and what it takes named).
    """
    if not isinstance(data, Mapping):
        raise ConfigError(f"config key {where.rstrip('.')!r} must be a mapping, got {data!r}")
    try:
        return schema.model_validate(data)
    except ValidationError as err:
        errors = err.errors(include_url=False)
        raise ConfigError(_message(schema, next((e for e in errors if e["type"] == "extra_forbidden"), errors[0]),
                                   where)) from None


def conform(schema: type[BaseModel], data: Any, where: str = "") -> dict[str, Any]:
    """:func:`parse` as plain data (sections as dicts, keys spelled as in the config)."""
    return parse(schema, data, where).model_dump(by_alias=True)


def defaults(schema: type[BaseModel]) -> dict[str, Any]:
    return conform(schema, {})


def _bare(tp: Any) -> Any:
    """``tp`` without ``Annotated`` metadata and, for an Optional of one type, without the null."""
    tp = get_args(tp)[0] if get_origin(tp) is Annotated else tp
    args = [a for a in get_args(tp) if a is not type(None)] if get_origin(tp) is Union else []
    return _bare(args[0]) if len(args) == 1 else tp


# Hand-written: pydantic's error location holds field aliases, list indices and union tags, not the
# type there, which the message describes.
def _at(schema: Any, loc: tuple) -> tuple[str, Any, Optional[FieldInfo]]:
    """The dotted config key, declared type and field of an error location."""
    parts: list[str] = []
    tp, info = schema, None
    for seg in loc:
        node = _bare(tp)
        tags = {_shape(_bare(m)): m for m in get_args(node)} if get_origin(node) is Union else {}
        if isinstance(node, type) and issubclass(node, BaseModel) and seg in keys(node):
            info = keys(node)[seg]
            tp = info.annotation
        elif seg in tags:
            tp = tags[seg]
            continue
        elif (get_origin(node) or node) in (list, dict):
            tp, info = (get_args(node) or (Any,))[-1], None
        else:  # a mapping's key or an untagged union's member: the key so far
            break
        parts.append(str(seg))
    return ".".join(parts), tp, info


def _message(schema: type[BaseModel], error: Mapping[str, Any], where: str) -> str:
    """A pydantic error as the key, what it takes and what it got."""
    loc, kind, value = tuple(error["loc"]), error["type"], error.get("input")
    if kind == "extra_forbidden":  # inside a section the valid keys are that section's
        key, tp, _ = _at(schema, loc[:-1])
        here = "valid keys here" if where or len(loc) > 1 else "valid"
        return (f"unknown config key {where + '.'.join(filter(None, [key, str(loc[-1])]))!r}; "
                f"{here}: {', '.join(sorted(keys(_bare(tp))))}")
    key, tp, info = _at(schema, loc)
    if kind == "value_error":  # a validator's own message (a field's names it, a whole schema's speaks for itself)
        return f"{where}{key}: {error['ctx']['error']}" if key else str(error["ctx"]["error"])
    key = where + key
    if kind in ("too_short", "missing"):
        return f"config key {key!r} " + (f"is required ({describe(tp)})" if kind == "missing"
                                         else f"must not be empty ({describe(tp)}), got {value!r}")
    if kind == "literal_error" and get_origin(_bare(tp)) is Literal:
        return f"config key {key!r}: unknown value {value!r}; valid: {', '.join(map(str, get_args(_bare(tp))))}"
    got = {k: v for m in (info.metadata if info else ()) for k in ("ge", "gt", "le", "lt")
           if (v := getattr(m, k, None)) is not None}
    lo = ("(", ">", got["gt"]) if "gt" in got else ("[", ">=", got["ge"]) if "ge" in got else None
    hi = (")", "<", got["lt"]) if "lt" in got else ("]", "<=", got["le"]) if "le" in got else None
    side = lo or hi
    if side and kind in ("greater_than_equal", "greater_than", "less_than_equal", "less_than", "finite_number"):
        bounds = f"in {lo[0]}{lo[2]}, {hi[2]}{hi[0]}" if lo and hi else f"{side[1]} {side[2]}"
        return f"config key {key!r} must be {describe(_bare(tp))} {bounds}, got {value!r}"
    return f"config key {key!r} must be {describe(tp)}, got {value!r}"


def describe(tp: Any) -> str:
    """What a type takes, in YAML words (``an integer``, ``one of a, b``, ``a string or null``)."""
    tp = get_args(tp)[0] if get_origin(tp) is Annotated else tp
    if get_origin(tp) is Union:
        return " or ".join("null" if a is type(None) else describe(a) for a in get_args(tp))
    if get_origin(tp) is Literal:
        return "one of " + ", ".join(map(str, get_args(tp)))
    words: dict[Optional[str], str] = {"list": "a list", "mapping": "a mapping", "bool": "true or false",
                                       "text": "a string"}
    return words.get(_shape(tp)) or {int: "an integer", float: "a number"}.get(tp, str(tp))


def number_type(tp: Any) -> Any:
    """An annotation with its int and float members as :data:`Int` and :data:`Float` (a schema built
    from a signature or from defaults)."""
    if get_origin(tp) is Union:
        return Union[tuple(number_type(a) for a in get_args(tp))]
    return {int: Int, float: Float}.get(tp, tp)


def read_yaml(path: str | Path) -> dict[str, Any]:
    """A YAML mapping read with :func:`load_yaml` (data, never code); an empty file is ``{}``."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    if path.stat().st_size > 4 * MAX_CHARS:  # refused before reading (4 bytes per character at most)
        raise ConfigError(f"config file {path} is {path.stat().st_size:,} bytes; a config is a few kB "
                          f"(limit {MAX_CHARS:,} characters)")
    data = _load(path.read_text(), f"config file {path} is refused", f"config file {path} is not valid YAML")
    if not isinstance(data, (dict, type(None))):
        raise ConfigError(f"config file {path} must hold a mapping, got {type(data).__name__}")
    return data or {}


def parse_value(text: str, what: str) -> Any:
    """A command-line value as YAML data (``0.5`` and ``1e-4`` -> float, ``null`` -> None, ``{a: 1}``
    -> dict), read by :func:`load_yaml`."""
    return _load(text, f"{what}: value is refused", f"{what}: value is not a YAML scalar") if text.strip() else None


def _load(text: str, refused: str, invalid: str) -> Any:
    """:func:`load_yaml`, its errors as a ConfigError starting with ``refused`` (over a limit) or ``invalid``."""
    try:
        return load_yaml(text)
    except YamlLimitError as err:
        raise ConfigError(f"{refused}: {err}") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{invalid}: {' '.join(str(err).split())}") from err


def _shown(text: str, limit: int = 120) -> str:
    """``text`` quoted for a message, cut to ``limit`` characters (a hostile value can be megabytes)."""
    return repr(text) if len(text) <= limit else f"{text[:limit]!r}... ({len(text):,} characters)"


def parse_override(text: str) -> tuple[list[str], Any]:
    """``"a.b=0.5"`` -> (["a", "b"], 0.5); the value is YAML data (:func:`parse_value`)."""
    key, eq, raw = text.partition("=")
    if not eq:
        raise ConfigError(f"override {_shown(text)} must look like key=value (e.g. federation.rounds=3)")
    if not key.strip() or any(not part for part in key.strip().split(".")):
        raise ConfigError(f"override {_shown(text)} has an empty key part")
    if key.count(".") >= MAX_DEPTH:
        raise ConfigError(f"override key {key[:60]!r}... has more than {MAX_DEPTH} parts; no config key is that deep")
    return key.strip().split("."), parse_value(raw, f"override {_shown(text)}")


def set_dotted(data: dict, parts: list[str], value: Any) -> None:
    """Set ``data[p0][p1]... = value`` in place; a digit part indexes a list, missing mappings are
    created (the schema check afterwards names a key that does not exist)."""
    node: Any = data
    for i, part in enumerate(parts):
        if not isinstance(node, (list, dict)):
            raise ConfigError(f"{'.'.join(parts)}: {'.'.join(parts[:i])!r} is not a mapping")
        if isinstance(node, list) and not (part.isdecimal() and int(part) < len(node)):
            raise ConfigError(f"{'.'.join(parts)}: {part!r} is not a row index below {len(node)}")
        key: Any = int(part) if isinstance(node, list) else part
        if i == len(parts) - 1:
            node[key] = value
        else:
            if isinstance(node, dict) and node.get(key) is None:
                node[key] = {}
            node = node[key]

