"""Every number key parses like a number wherever a user types it.

The keys come from the schemas themselves (benchmark config, training config, the clients' Flower
run config, defence specs, the typed options of every attack), so a key added later is covered
without touching this file. Each is set in scientific notation through every route a user has:
a YAML file, ``--set``, a dedicated flag, ``--sweep``, training's ``--key value``, the run config's
TOML and JSON, an attack's options. ``true`` is refused as a number, and junk (``1e-4x``) is refused
with the key named.
"""
from __future__ import annotations

import json
import tomllib
import typing
from pathlib import Path
from typing import Any, Iterator, Union

import pytest
from pydantic import BaseModel
from pydantic.fields import FieldInfo

import attacks
from attacks.api import base as attack_base
from attacks.api import registry as attack_registry
from benchmark import config as C
from benchmark.entries import attack_entries
from benchmark.validation import owned_run_keys, point_config, validate
from benchmark.cli import build_parser, integer, resolve
from benchmark.errors import ConfigError as BenchmarkConfigError
from benchmark.sweep_points import grid_points, parse_sweep_flag
from clients.runconfig import RunConfig, resolve_config
from defences.spec import DEFENCES, NUMBER_KEYS, validate_defence
from fedmjp import config as core
from fedmjp.trainconfig import TrainConfig, config_from_dict, load_config as load_train_config, parse_overrides

# ------------------------------------------------------------------------------ the keys, from the schemas


def _number_type(tp: Any) -> type | None:
    """int or float when ``tp`` (possibly Optional, possibly fedmjp.config.Int/Float) is a number type, else None."""
    members = [typing.get_args(m)[0] if typing.get_origin(m) is typing.Annotated else m
               for m in (typing.get_args(tp) if typing.get_origin(tp) is Union else (tp,)) if m is not type(None)]
    return members[0] if len(members) == 1 and members[0] in (int, float) else None


def _is_schema(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, BaseModel)


def schema_number_keys(schema: type, prefix: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], type, FieldInfo]]:
    """(key parts, int or float, pydantic field) of every number key of ``schema``, sections and
    rows of lists of sections included (a list row as index 0)."""
    for key, info in core.keys(schema).items():
        tp = info.annotation
        args = typing.get_args(tp)
        if _is_schema(tp):
            yield from schema_number_keys(tp, prefix + (key,))
        elif typing.get_origin(tp) is list and args and _is_schema(args[0]):
            yield from schema_number_keys(args[0], prefix + (key, "0"))
        elif _number_type(tp) is not None:
            yield prefix + (key,), _number_type(tp), info


def _bound(info: FieldInfo, *names: str) -> Any:
    """The first of the field's range bounds ``names`` (ge, gt, le) that it has, or None."""
    return next((getattr(m, n) for n in names for m in info.metadata if hasattr(m, n)), None)


def pick(kind: type, default: Any, low: float | None = None, high: float | None = None) -> int | float:
    """A valid value of a number key that differs from its default (so a parsed value cannot be the
    default showing through)."""
    if kind is int:
        start = int(low) if low is not None else 0
        value = start + 1 if start + 1 != default else start + 2
        return value if high is None or value <= high else int(low)
    lo = low if low is not None else 0.0
    hi = high if high is not None else lo + 1.0
    value = lo + 0.375 * (hi - lo)
    return value if value != default else lo + 0.625 * (hi - lo)


def sci(value: int | float, upper: bool = False) -> str:
    """``value`` in scientific notation (``3.750000e-01``; ``2.000000E+00`` for an int)."""
    text = f"{value:e}"
    return text.upper() if upper else text


def _schema_cases(schema: type) -> list[tuple[str, type, Any]]:
    cases = []
    for parts, kind, info in schema_number_keys(schema):
        default = None if info.is_required() else info.default
        cases.append((".".join(parts), kind, pick(kind, default, _bound(info, "ge", "gt"), _bound(info, "le"))))
    return cases


BENCHMARK_KEYS = _schema_cases(C.BenchmarkConfig)

def _train_value(kind: type, default: Any) -> int | float:
    if default is None:
        return pick(kind, None)
    return default + 1 if kind is int else (default * 0.5 or 0.375)


TRAIN_KEYS = [(k, kind, _train_value(kind, getattr(TrainConfig(), k))) for k, kind, _ in _schema_cases(TrainConfig)]
RUN_KEYS = _schema_cases(RunConfig)
#: keys a run-config key needs beside it to be valid at all (drop-path acts only in train mode)
RUN_COMPANIONS: dict[str, dict[str, Any]] = {"drop-path": {"train-mode": True}, "server-lr": {"mode": "fedavg"}}
#: (defence, key, type, value): every number key of every built-in defence
DEFENCE_KEYS = [(name, key, NUMBER_KEYS[key], (default + 1) if NUMBER_KEYS[key] is int else default / 2)
                for name, keys in DEFENCES.items() for key, default in keys.items()
                if not isinstance(default, bool) and isinstance(default, (int, float))]


def _attack_option_cases() -> list[tuple[str, str, type, Any]]:
    return [(name, *case) for name in attacks.attack_names()
            for case in _schema_cases(attack_registry.option_schema(attack_registry.attack_class(name)))]


ATTACK_OPTIONS = _attack_option_cases()
#: options an attack option needs beside it to be valid at all (april_robust's sigma multiplies a clip)
ATTACK_COMPANIONS: dict[tuple[str, str], dict[str, Any]] = {("april_robust", "sigma"): {"clip": 1.0}}


def test_the_schemas_have_the_number_keys_this_file_walks() -> None:
    """The walk finds keys in every schema (a broken walk would make every test below vacuous)."""
    keys = {k for k, _, _ in BENCHMARK_KEYS}
    assert {"gamma", "federation.lr", "federation.rounds", "utility.lr", "models.0.seed", "seed"} <= keys
    assert {"blr", "lr", "epochs", "opt_eps"} <= {k for k, _, _ in TRAIN_KEYS}
    assert {"lr", "gamma", "batch-size", "round-timeout"} <= {k for k, _, _ in RUN_KEYS}
    assert {("dp_sgd", "delta"), ("quantize", "bits"), ("local_dp", "sigma")} <= {(n, k) for n, k, _, _ in DEFENCE_KEYS}
    assert {("invertinggradients_batched", "lr"), ("mjp_adaptive", "iterations")} <= {(n, k) for n, k, _, _ in
                                                                                       ATTACK_OPTIONS}


def _same(got: Any, kind: type, value: int | float) -> None:
    assert type(got) is kind and got == pytest.approx(value, rel=1e-12), (got, kind, value)


def _dig(data: Any, key: str) -> Any:
    """The value at a dotted key of plain data or of a typed config (attributes; mappings in it by key)."""
    for part in key.split("."):
        data = data[int(part)] if isinstance(data, list) else data[part] if isinstance(data, dict) else \
            getattr(data, part)
    return data


def _preset_with(tmp_path: Path, changes: dict[str, str]) -> Path:
    """configs/default.yaml with each dotted key set to the given YAML text, as a file."""
    data = core.read_yaml(C.DEFAULT_CONFIG)
    for i, key in enumerate(changes):
        core.set_dotted(data, key.split("."), f"__VALUE{i}__")
    text = core.dump_yaml(data, sort_keys=False)
    for i, value in enumerate(changes.values()):
        text = text.replace(f"__VALUE{i}__", value)
    path = tmp_path / "preset.yaml"
    path.write_text(text)
    return path


# ------------------------------------------------------------------------------ spellings of one number


@pytest.mark.parametrize("text, value", [("1e-4", 1e-4), ("5E-05", 5e-05), (".5", 0.5), ("1.", 1.0),
                                         ("1_000.5", 1000.5), ("2.5e+1", 25.0), ("3", 3.0), ("1_000", 1000.0)])
def test_spellings_of_a_float(text: str, value: float) -> None:
    cfg = C.apply_overrides(C.load_config(), [f"federation.lr={text}"])
    _same(cfg["federation"]["lr"], float, value)


@pytest.mark.parametrize("text, value", [("1_000", 1000), ("1e3", 1000), ("+7", 7), ("2.0", 2)])
def test_spellings_of_an_integer(text: str, value: int) -> None:
    """An integer key takes what Python's int() reads and an integral number with an exponent."""
    _same(C.apply_overrides(C.load_config(), [f"seed={text}"])["seed"], int, value)
    _same(integer(text), int, value)


@pytest.mark.parametrize("text", ["2.5", "1e-1", "1e3x", "true", ".inf", "1e999", "'2.5'", "'1e999'"])
def test_an_integer_key_refuses_a_fraction_and_text(text: str) -> None:
    with pytest.raises(BenchmarkConfigError, match="config key 'seed' must be an integer"):
        C.apply_overrides(C.load_config(), [f"seed={text}"])


def test_the_loader_reads_yaml_1_2_floats_and_writes_strings_back_as_strings() -> None:
    assert core.load_yaml("[1e-4, 5E-05, .5, -.5, 1_000, 1.0e-6, 0.27, x1e5, '1e-4', 1e]") == \
        [1e-4, 5e-05, 0.5, -0.5, 1000, 1e-06, 0.27, "x1e5", "1e-4", "1e"]
    data = {"text": "1e-4", "half": ".5", "number": 1e-4}
    assert core.load_yaml(core.dump_yaml(data)) == data


# ------------------------------------------------------------------------------ the benchmark config


@pytest.mark.parametrize("key, kind, value", BENCHMARK_KEYS, ids=[k for k, _, _ in BENCHMARK_KEYS])
def test_benchmark_key_in_scientific_notation(tmp_path: Path, key: str, kind: type, value: Any) -> None:
    from_file = C.load_config(_preset_with(tmp_path, {key: sci(value)}))
    _same(_dig(from_file, key), kind, value)
    from_set = C.apply_overrides(C.load_config(), [f"{key}={sci(value, upper=True)}"])
    _same(_dig(from_set, key), kind, value)


@pytest.mark.parametrize("key, kind, value", BENCHMARK_KEYS, ids=[k for k, _, _ in BENCHMARK_KEYS])
def test_benchmark_key_refuses_true_and_junk(key: str, kind: type, value: Any) -> None:
    for text, shown in (("true", "True"), ("1e-4x", "'1e-4x'")):
        with pytest.raises(BenchmarkConfigError) as err:
            C.apply_overrides(C.load_config(), [f"{key}={text}"])
        assert str(err.value).startswith(f"config key {key!r} must be ") and str(err.value).endswith(f"got {shown}")


#: the command line's number flags and the keys they set
FLAGS = {"--gamma": "gamma", "--num-images": "data.num_images", "--rounds": "federation.rounds",
         "--clients": "federation.clients", "--seed": "seed", "--attack-workers": "attack_workers"}


def test_every_number_flag_is_covered() -> None:
    numeric = {opt for action in build_parser()._actions if action.type in (float, int, integer)
               for opt in action.option_strings if opt.startswith("--")}
    assert numeric == set(FLAGS)


@pytest.mark.parametrize("flag", sorted(FLAGS))
def test_flag_in_scientific_notation(flag: str) -> None:
    key = FLAGS[flag]
    kind, value = next((kind, value) for k, kind, value in BENCHMARK_KEYS if k == key)
    cfg = resolve(build_parser().parse_args([flag, sci(value)]))
    _same(_dig(cfg, key), kind, value)


def test_gamma_flag_of_the_issue() -> None:
    """``--gamma 0.00005`` was once turned into the text 5e-05 and read back as a string."""
    _same(resolve(build_parser().parse_args(["--gamma", "0.00005"])).gamma, float, 5e-05)


def test_sweep_values_in_scientific_notation() -> None:
    assert parse_sweep_flag("gamma=0,1e-2,.5,5E-05") == ("gamma", [0, 0.01, 0.5, 5e-05])
    cfg = resolve(build_parser().parse_args(["--set", "defence.name=local_dp", "--sweep", "defence.sigma=1e-2,2E-1"]))
    assert cfg.sweep == {"defence.sigma": [0.01, 0.2]}


# ------------------------------------------------------------------------------ training


@pytest.mark.parametrize("key, kind, value", TRAIN_KEYS, ids=[k for k, _, _ in TRAIN_KEYS])
def test_training_key_in_scientific_notation(tmp_path: Path, key: str, kind: type, value: Any) -> None:
    path = tmp_path / "recipe.yaml"
    path.write_text(f"{key}: {sci(value)}\n")
    _same(getattr(load_train_config(path), key), kind, value)
    for argv in (["--" + key, sci(value, upper=True)], [f"--{key.replace('_', '-')}={sci(value)}"]):
        _same(getattr(config_from_dict(parse_overrides(argv)), key), kind, value)
    for text in ("true", "1e-4x"):
        with pytest.raises(core.ConfigError, match=f"config key '{key}' must be "):
            parse_overrides(["--" + key, text])


# ------------------------------------------------------------------------------ the clients' run config


@pytest.mark.parametrize("key, kind, value", RUN_KEYS, ids=[k for k, _, _ in RUN_KEYS])
def test_run_config_key_in_scientific_notation(tmp_path: Path, key: str, kind: type, value: Any) -> None:
    extra = RUN_COMPANIONS.get(key, {})
    toml = tomllib.loads(f"{key} = {sci(value)}")  # Flower's run config is TOML (pyproject, --run-config)
    _same(resolve_config({**toml, **extra}).wire()[key], kind, value)
    _same(resolve_config({key: sci(value), **extra}).wire()[key], kind, value)  # a string holding a number
    for bad, shown in ((True, "True"), ("1e-4x", "'1e-4x'")):
        with pytest.raises(core.ConfigError, match=f"config key '{key}' must be .*got {shown}"):
            resolve_config({key: bad, **extra})
    if key in owned_run_keys() or set(extra) & set(owned_run_keys()):
        return  # the benchmark sets it from its own key (federation.options refuses it)
    dotted = f"federation.options.{key}"
    companions = {f"federation.options.{k}": str(v).lower() for k, v in extra.items()}
    _same(_dig(validate(C.load_config(_preset_with(tmp_path, {dotted: sci(value), **companions}))), dotted),
          kind, value)
    overrides = [f"{dotted}={sci(value)}", *(f"{k}={v}" for k, v in companions.items())]
    _same(_dig(validate(C.apply_overrides(C.load_config(), overrides)), dotted), kind, value)


# ------------------------------------------------------------------------------ defence specs


@pytest.mark.parametrize("name, key, kind, value", DEFENCE_KEYS, ids=[f"{n}.{k}" for n, k, _, _ in DEFENCE_KEYS])
def test_defence_key_in_scientific_notation(tmp_path: Path, name: str, key: str, kind: type, value: Any) -> None:
    from_file = validate(C.load_config(_preset_with(tmp_path, {"defence.name": name, f"defence.{key}": sci(value)})))
    _same(getattr(from_file.defence, key), kind, value)
    from_set = validate(C.apply_overrides(C.load_config(), [f"defence.name={name}", f"defence.{key}={sci(value)}"]))
    _same(getattr(from_set.defence, key), kind, value)
    swept = resolve(build_parser().parse_args(["--set", f"defence.name={name}", "--sweep", f"defence.{key}={sci(value)}"]))
    point = point_config(swept, grid_points(swept)[0])  # what the sweep point runs
    _same(getattr(point.defence, key), kind, value)
    run_config = resolve_config({"defence": json.dumps({"name": name, key: sci(value)})})  # a string in JSON
    _same(getattr(run_config.defence, key), kind, value)
    for bad, shown in ((True, "True"), ("1e-4x", "'1e-4x'")):
        with pytest.raises(ValueError, match=f"defence '{name}': config key '{key}' must be .*got {shown}"):
            validate_defence({"name": name, key: bad})


# ------------------------------------------------------------------------------ attack options


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch) -> dict[str, dict]:
    """Every attack's class replaced by a subclass that records the options it is built with (the
    attacks' own range checks are theirs; this checks what reaches them)."""
    seen: dict[str, dict] = {}
    for name in attacks.attack_names():
        real = attack_registry.attack_class(name)

        def init(self: Any, _name: str = name, **options: Any) -> None:
            seen[_name] = options
            attack_base.Attack.__init__(self)

        spy = type(f"Recording{real.__name__}", (real,), {"__init__": init, "__module__": __name__})
        monkeypatch.setitem(attack_registry._REGISTRY, name, spy)
    return seen


@pytest.mark.parametrize("name, key, kind, value", ATTACK_OPTIONS, ids=[f"{n}.{k}" for n, k, _, _ in ATTACK_OPTIONS])
def test_attack_option_in_scientific_notation(tmp_path: Path, recorded: dict, name: str, key: str, kind: type,
                                              value: Any) -> None:
    extra = ATTACK_COMPANIONS.get((name, key), {})
    from_file = C.load_config(_preset_with(tmp_path, {"attacks": "[]", "attack.name": name,
                                                      f"attack.options.{key}": sci(value),
                                                      **{f"attack.options.{k}": str(v) for k, v in extra.items()}}))
    from_set = C.apply_overrides(C.load_config(), ["attacks=[]", f"attack.name={name}",
                                                   f"attack.options.{key}={sci(value, upper=True)}",
                                                   *(f"attack.options.{k}={v}" for k, v in extra.items())])
    _same(validate(from_set).attack.options[key], kind, value)  # converted when the config is checked
    for cfg in (from_file, from_set):  # typed, options as written: create_attack converts them
        recorded.clear()
        [entry] = attack_entries(C.BenchmarkConfig.model_validate(cfg))
        attacks.create_attack(entry.name, **entry.options)
        _same(recorded[name][key], kind, value)
    attacks.create_attack(name, **{key: sci(value)}, **extra)  # a string holding a number (the Python API)
    _same(recorded[name][key], kind, value)
    for bad, shown in ((True, "True"), ("1e-4x", "'1e-4x'")):
        with pytest.raises(ValueError, match=f"bad options for attack '{name}': config key 'options.{key}' "
                                             f"must be .*got {shown}"):
            attacks.create_attack(name, **{key: bad})
