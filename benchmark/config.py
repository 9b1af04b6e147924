"""Benchmark configuration: YAML presets, dotted ``key=value`` overrides, validation, resolved copy.

A config is plain data (dicts, lists, scalars). Presets live in ``configs/`` (``default.yaml`` is the
quick preset, ``paper.yaml`` the paper's protocol); every key they may hold is in :data:`DEFAULTS`,
and an unknown key is an error that lists the valid ones (a typo never silently does nothing).
Overrides are parsed with ``yaml.safe_load`` (``--set gamma=0.5`` -> float, ``--set data.num_images=null``
-> None): values, never code.

Relative paths in a config file (image folder, checkpoints, LPIPS backbone) are resolved against the
project root, so ``../shared/data/imagenet-sample`` means the same thing from any working directory;
paths given as flags (``--images``) are resolved against the working directory.
"""
from __future__ import annotations

import copy
import logging
import os
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional, Sequence

import yaml

from .errors import ConfigError

_logger = logging.getLogger(__name__)

PROJECT_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = PROJECT_ROOT / "configs" / "default.yaml"

SETTINGS = ("a", "b", "c")
#: settings (b) and (c) attack the same gradient (of x~): one federation per model row serves both.
SETTING_GROUPS = {"a": "clean", "b": "shuffled", "c": "shuffled"}
ENGINES = ("inprocess", "simulation")
LABEL_MODES = ("known", "none")
MODEL_ROW_KEYS = ("name", "label", "arch", "variant", "kwargs", "checkpoint", "april", "seed", "recipe",
                  "defence")

#: Mappings whose content is free-form to the merge and type check and validated by their own code
#: (attack constructor, client run-config keys, defences/spec.py, the sweep's dotted keys).
FREE_MAPPINGS = ("options", "defence", "sweep")

#: Every key a config may hold, with its default. ``models`` has no default rows.
DEFAULTS: dict[str, Any] = {
    "name": "benchmark",
    "seed": 0,
    "device": "auto",  # auto | cpu | cuda | cuda:N
    "settings": ["c"],
    "gamma": 0.27,  # share of patches the client's MJP shuffle selects in settings (b)/(c)
    "dry_run": False,
    "output": None,  # output folder (--output); None: runs/<time>-setting-<s>
    "train_data": None,  # training data of the model rows' recipes (--train-missing); None: none
    # client-side defence of every model row (a row's own ``defence:`` replaces it); keys: defences/spec.py
    "defence": {"name": "none"},
    # strength sweep: dotted key -> list of values (e.g. {defence.sigma: [0, 0.01, 0.1]}); see sweep.py
    "sweep": {},
    # utility of each sweep point: top-1 after `rounds` FedAvg rounds with the defence on (0: off);
    # keys and meaning: benchmark/utility.py
    "utility": {"rounds": 0, "source": "../shared/data/cifar10.tar.gz", "num_train": 64, "num_eval": 200,
                "clients": 2, "local_steps": 2, "batch_size": 8, "lr": 0.05},
    "data": {
        "source": "embedded",  # "embedded" (scikit-image's bundled images) or an image folder
        "image_size": 32,
        "num_images": None,  # None: all images of the source
        "num_classes": 10,  # labels are (sorted index) % num_classes
        "on_corrupt": "skip",  # skip | fail
    },
    "federation": {
        "engine": "inprocess",  # inprocess | simulation (Flower's Ray simulation)
        "rounds": 2,
        "clients": 4,
        "algorithm": "fedsgd",  # fedsgd (one batch's gradient) | fedavg (weight delta of local steps)
        "batch_size": 1,
        "local_steps": 1,
        "lr": 0.01,
        "partition": "iid",
        "precision": "float32",  # client forward/backward dtype: float32 | float64
        "options": {},  # passed through to the federation's run config
    },
    "models": [],
    "attack": {
        "name": "april_analytic",
        "labels": "known",  # the threat model grants the server the labels (known) or not (none)
        "options": {},
    },
    # Several attackers per model row: [{name: ..., options: {...}, label: ...}, ...]; empty: the one
    # attack above. ``label`` (default: name) is the ``attack`` column and must be unique.
    "attacks": [],
    "metrics": {
        "lpips_backbone": None,  # AlexNet features file; None: $FEDMJP_LPIPS_BACKBONE or torchvision
        "lpips": True,
    },
    # Attacks on N Ray workers (0: in this process); on one machine N <= its CPUs. ray_address: a
    # running Ray cluster (e.g. ray://head:10001) to spread them over many machines (None: local).
    "attack_workers": 0,
    "ray_address": None,
    "report": {
        "grid_images": 4,  # the first N images attacked (by round, client) appear in the grids
        "tile": 96,  # grid tile side in pixels
    },
}

#: Keys that do not change any result; a resumed run may differ in them.
NON_RESULT_KEYS = ("output", "train_data", "attack_workers", "ray_address")


def _merge(base: dict, update: Mapping, where: str = "") -> dict:
    """Recursive merge of ``update`` into a copy of ``base``; unknown keys raise ConfigError."""
    out = copy.deepcopy(base)
    for key, value in update.items():
        path = f"{where}{key}"
        if key not in base:
            raise ConfigError(f"unknown config key {path!r}; valid keys here: {', '.join(sorted(base))}")
        if isinstance(base[key], dict) and key not in FREE_MAPPINGS:
            if not isinstance(value, Mapping):
                raise ConfigError(f"config key {path!r} must be a mapping, got {value!r}")
            out[key] = _merge(base[key], value, f"{path}.")
        else:
            out[key] = copy.deepcopy(value)
    return out


def read_yaml(path: str | Path) -> dict:
    """Read a YAML mapping with ``yaml.safe_load``."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise ConfigError(f"config file {path} is not valid YAML: {err}") from err
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping, got {type(data).__name__}")
    return data


def load_config(path: Optional[str | Path] = None) -> dict:
    """Defaults merged with a preset (``configs/default.yaml`` when ``path`` is None).

    Relative paths of the file are resolved against the project root.
    """
    data = read_yaml(DEFAULT_CONFIG if path is None else path)
    cfg = _merge(DEFAULTS, data)
    return _resolve_paths(cfg, PROJECT_ROOT)


def _resolve_path(value: Any, base: Path) -> Any:
    if value is None or value == "embedded" or not isinstance(value, str):
        return value
    p = Path(value).expanduser()
    return str(p if p.is_absolute() else (base / p).resolve())


def _resolve_paths(cfg: dict, base: Path) -> dict:
    cfg["data"]["source"] = _resolve_path(cfg["data"]["source"], base)
    cfg["metrics"]["lpips_backbone"] = _resolve_path(cfg["metrics"]["lpips_backbone"], base)
    cfg["train_data"] = _resolve_path(cfg["train_data"], base)
    for row in cfg["models"] if isinstance(cfg["models"], list) else ():  # validate() names a non-list
        for key in ("checkpoint", "recipe"):
            if isinstance(row, dict) and isinstance(row.get(key), str):
                row[key] = _resolve_path(row[key], base)
    cfg["utility"]["source"] = _resolve_path(cfg["utility"]["source"], base)
    return cfg


def parse_override(text: str) -> tuple[list[str], Any]:
    """``"a.b=1e-3"`` -> (["a", "b"], 0.001); the value is a YAML scalar/flow value (safe_load)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like key=value (e.g. federation.rounds=3)")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {text!r} has an empty key part")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as err:
        raise ConfigError(f"override {text!r}: value is not a YAML scalar: {err}") from err
    return key.split("."), value


def apply_overrides(cfg: dict, overrides: Iterable[str]) -> dict:
    """Apply ``key=value`` overrides (dotted keys; ``models.0.checkpoint=...`` indexes model rows).

    Unknown keys are caught by re-merging onto :data:`DEFAULTS`, which names the valid ones.
    """
    cfg = copy.deepcopy(cfg)
    for text in overrides:
        parts, value = parse_override(text)
        node: Any = cfg
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            if isinstance(node, list):
                if not part.isdigit() or int(part) >= len(node):
                    raise ConfigError(f"override {text!r}: {part!r} is not a row index below {len(node)}")
                key: Any = int(part)
            elif isinstance(node, dict):
                key = part
                if not last and node.get(key) is None:
                    node[key] = {}
            else:
                raise ConfigError(f"override {text!r}: {'.'.join(parts[:i])!r} is not a mapping")
            if last:
                node[key] = value
            else:
                node = node[key]
    cfg = _merge(DEFAULTS, cfg)
    return _resolve_paths(cfg, PROJECT_ROOT)


def select_models(cfg: dict, names: Optional[Sequence[str]]) -> dict:
    """Keep only the model rows named (in the config's order); unknown names list the valid ones."""
    if not names:
        return cfg
    wanted = [n for item in names for n in str(item).split(",") if n]
    if not isinstance(cfg["models"], list) or not all(isinstance(row, dict) for row in cfg["models"]):
        raise ConfigError(f"models must be a list of mappings (model rows), got {cfg['models']!r}")
    valid = [row.get("name") for row in cfg["models"]]
    unknown = [n for n in wanted if n not in valid]
    if unknown:
        raise ConfigError(f"unknown model name(s) {', '.join(map(repr, unknown))}; valid: {', '.join(map(str, valid))}")
    cfg = copy.deepcopy(cfg)
    cfg["models"] = [row for row in cfg["models"] if row["name"] in wanted]
    return cfg


def _check_choice(value: Any, choices: Sequence[Any], what: str) -> None:
    if value not in choices:
        raise ConfigError(f"unknown {what} {value!r}; valid: {', '.join(map(str, choices))}")


def _check_int(value: Any, what: str, minimum: int = 1, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{what} must be an integer >= {minimum}, got {value!r}")


#: Keys whose default is None (or whose values may be None): the types they take besides None.
NULLABLE: dict[str, tuple[type, ...]] = {"output": (str,), "train_data": (str,), "data.num_images": (int,),
                                         "metrics.lpips_backbone": (str,), "ray_address": (str,)}
#: Keys that take another form besides their default's type (``settings: all``; a sweep as a list of points).
ALTERNATIVE_TYPES: dict[str, tuple[type, ...]] = {"settings": (list, str), "sweep": (dict, list)}
#: Model row keys and the types they take (None allowed where listed in MODEL_ROW_NULLABLE).
MODEL_ROW_TYPES: dict[str, tuple[type, ...]] = {
    "name": (str,), "label": (str,), "arch": (str,), "variant": (str,), "kwargs": (dict,),
    "checkpoint": (str,), "april": (str,), "seed": (int,), "recipe": (str,), "defence": (dict,)}
MODEL_ROW_NULLABLE = ("label", "kwargs", "checkpoint", "april", "seed", "recipe", "defence")

_KIND = {bool: "true or false", int: "an integer", float: "a number", str: "a string", list: "a list",
         dict: "a mapping"}


def _is_a(value: Any, types: tuple[type, ...]) -> bool:
    """``isinstance`` with YAML's view of numbers: bool is not a number, an int is a float."""
    if isinstance(value, bool):
        return bool in types
    if isinstance(value, int) and float in types:
        return True
    return isinstance(value, types)


def _check_type(value: Any, types: tuple[type, ...], what: str, nullable: bool = False) -> None:
    if (value is None and nullable) or _is_a(value, types):
        return
    kinds = " or ".join(_KIND.get(t, t.__name__) for t in types) + (" or null" if nullable else "")
    raise ConfigError(f"config key {what!r} must be {kinds}, got {value!r}")


def check_types(cfg: Mapping[str, Any], defaults: Mapping[str, Any] = DEFAULTS, where: str = "") -> None:
    """Every leaf of ``cfg`` has the type of its default (or a type in :data:`NULLABLE`).

    The types come from :data:`DEFAULTS` itself, so a key added there is checked without more code.
    """
    for key, default in defaults.items():
        path, value = f"{where}{key}", cfg.get(key)
        if path in NULLABLE:
            _check_type(value, NULLABLE[path], path, nullable=True)
        elif key == "models":
            _check_type(value, (list,), path)
        elif path in ALTERNATIVE_TYPES:
            _check_type(value, ALTERNATIVE_TYPES[path], path)
        elif isinstance(default, dict):
            _check_type(value, (dict,), path)
            if key not in FREE_MAPPINGS:
                check_types(value, default, f"{path}.")
        else:
            _check_type(value, (type(default),), path)


def _validate_client_options(options: Mapping[str, Any]) -> None:
    """``federation.options`` go into the clients' Flower run config: known keys, default types."""
    from clients.task import DEFAULTS as CLIENT_DEFAULTS

    for key, value in options.items():
        if key not in CLIENT_DEFAULTS:
            raise ConfigError(f"unknown key {key!r} in federation.options; valid: {', '.join(CLIENT_DEFAULTS)}")
        _check_type(value, (type(CLIENT_DEFAULTS[key]),), f"federation.options.{key}")


def validate(cfg: dict) -> dict:
    """Check names, types and values; normalises ``settings`` (``all`` -> a, b, c). Returns the config.

    Every value a user can type is checked here, before anything is written: types against
    :data:`DEFAULTS`, names against their registries (model factory, attacks), ranges by hand.
    """
    from clients.task import PARTITIONERS

    check_types(cfg)
    settings = cfg["settings"]
    if isinstance(settings, str):
        settings = list(SETTINGS) if settings == "all" else [settings]
    if not isinstance(settings, list) or not settings:
        raise ConfigError(f"settings must be a non-empty list of {', '.join(SETTINGS)}, got {settings!r}")
    for s in settings:
        _check_choice(s, SETTINGS, "setting")
    cfg["settings"] = [s for s in SETTINGS if s in settings]
    gamma = cfg["gamma"]
    if isinstance(gamma, bool) or not isinstance(gamma, (int, float)) or not 0.0 <= gamma <= 1.0:
        raise ConfigError(f"gamma must be a number in [0, 1], got {gamma!r}")
    _check_int(cfg["seed"], "seed", minimum=0)
    data, fed = cfg["data"], cfg["federation"]
    _check_int(data["image_size"], "data.image_size")
    _check_int(data["num_images"], "data.num_images", allow_none=True)
    _check_int(data["num_classes"], "data.num_classes")
    _check_choice(data["on_corrupt"], ("skip", "fail"), "data.on_corrupt")
    _check_choice(fed["engine"], ENGINES, "federation.engine")
    _check_choice(fed["algorithm"], ("fedsgd", "fedavg"), "federation.algorithm")
    _check_choice(fed["precision"], ("float32", "float64"), "federation.precision")
    for key in ("rounds", "clients", "batch_size", "local_steps"):
        _check_int(fed[key], f"federation.{key}")
    _check_choice(fed["partition"], PARTITIONERS, "federation.partition")
    if not 0.0 <= fed["lr"] < float("inf"):
        raise ConfigError(f"federation.lr must be a finite number >= 0, got {fed['lr']!r}")
    _validate_client_options(fed["options"])
    if not cfg["device"].strip():
        raise ConfigError("device must be auto, cpu, cuda or cuda:N, got an empty string")
    _check_choice(cfg["attack"]["labels"], LABEL_MODES, "attack.labels")
    _check_int(cfg["attack_workers"], "attack_workers", minimum=0)
    cores = os.cpu_count() or 1
    if not cfg["ray_address"] and cfg["attack_workers"] > cores:  # Ray would wait for CPUs that never come
        raise ConfigError(f"attack_workers must be <= {cores} (this machine's CPUs) without a ray_address, "
                          f"got {cfg['attack_workers']}")
    _check_int(cfg["report"]["grid_images"], "report.grid_images", minimum=0)
    _check_int(cfg["report"]["tile"], "report.tile", minimum=8)
    _validate_models(cfg)
    _validate_attack(cfg["attack"]["name"])
    _validate_attack_list(cfg)
    _validate_defences(cfg)
    return cfg


def _validate_defences(cfg: dict) -> None:
    """The top-level defence, every row's own, and the sweep grid (defences/spec.py)."""
    from .sweep import validate_sweep

    cfg["defence"] = _checked_defence(cfg["defence"], "defence")
    u = cfg["utility"]
    for key in ("rounds", "num_train"):
        _check_int(u[key], f"utility.{key}", minimum=0)
    for key in ("num_eval", "clients", "local_steps", "batch_size"):
        _check_int(u[key], f"utility.{key}")
    if isinstance(u["lr"], bool) or not isinstance(u["lr"], (int, float)) or u["lr"] < 0:
        raise ConfigError(f"utility.lr must be a number >= 0, got {u['lr']!r}")
    for index, row in enumerate(cfg["models"]):
        if row.get("defence") is not None:
            row["defence"] = _checked_defence(row["defence"], f"model row {row['name']!r}: defence")
    validate_sweep(cfg)


def _checked_defence(spec: Any, where: str) -> dict:
    from defences import validate_defence

    try:
        return validate_defence(spec)
    except ValueError as err:
        raise ConfigError(f"{where}: {err}") from err


def row_defence(cfg: dict, index: int) -> dict:
    """The defence of model row ``index``: its own ``defence:`` or else the top-level one."""
    row = cfg["models"][index]
    return _checked_defence(row.get("defence") if row.get("defence") is not None else cfg["defence"],
                            f"model row {row['name']!r}: defence")


def _validate_models(cfg: dict) -> None:
    from fedmjp.factory import validate_spec

    rows = cfg["models"]
    if not isinstance(rows, list) or not rows:
        raise ConfigError("the config names no model rows (models: [...])")
    names = []
    for index, row in enumerate(rows):
        if not isinstance(row, dict) or not row.get("name"):
            raise ConfigError(f"model row {index} must be a mapping with a name, got {row!r}")
        unknown = set(row) - set(MODEL_ROW_KEYS)
        if unknown:
            raise ConfigError(f"model row {row['name']!r}: unknown keys {sorted(unknown)}; valid: {', '.join(MODEL_ROW_KEYS)}")
        for key, value in row.items():
            _check_type(value, MODEL_ROW_TYPES[key], f"models.{index}.{key}", nullable=key in MODEL_ROW_NULLABLE)
        if row.get("recipe") and not Path(row["recipe"]).is_file():
            raise ConfigError(f"model row {row['name']!r}: training recipe {row['recipe']} does not exist")
        names.append(str(row["name"]))
        try:
            validate_spec(model_spec(cfg, index))
        except ValueError as err:
            raise ConfigError(f"model row {row['name']!r}: {err}") from err
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ConfigError(f"model row names must be unique; repeated: {', '.join(duplicates)}")


def _validate_attack(name: str) -> None:
    valid = available_attacks()
    if name not in valid:
        raise ConfigError(f"unknown attack {name!r}; valid: {', '.join(valid)}")


ATTACK_ENTRY_KEYS = ("name", "options", "label")


def _validate_attack_list(cfg: dict) -> None:
    entries = cfg["attacks"]
    if entries is None:
        cfg["attacks"] = entries = []
    if not isinstance(entries, list):
        raise ConfigError(f"attacks must be a list of mappings with a name, got {entries!r}")
    for index, entry in enumerate(entries):
        if not isinstance(entry, dict) or not entry.get("name"):
            raise ConfigError(f"attacks[{index}] must be a mapping with a name, got {entry!r}")
        unknown = set(entry) - set(ATTACK_ENTRY_KEYS)
        if unknown:
            raise ConfigError(f"attacks[{index}]: unknown keys {sorted(unknown)}; valid: {', '.join(ATTACK_ENTRY_KEYS)}")
        if not isinstance(entry.get("options") or {}, dict):
            raise ConfigError(f"attacks[{index}].options must be a mapping, got {entry['options']!r}")
        _validate_attack(entry["name"])
    labels = [a["label"] for a in attack_entries(cfg)]
    duplicates = sorted({n for n in labels if labels.count(n) > 1})
    if duplicates:
        raise ConfigError(f"attack labels must be unique (give each entry of attacks a label); repeated: "
                          f"{', '.join(duplicates)}")


def attack_entries(cfg: Mapping[str, Any]) -> list[dict]:
    """The attackers of a run, each ``{label, name, options}``: the ``attacks`` list when it is not
    empty, else the single ``attack`` section."""
    entries = cfg.get("attacks") or [{"name": cfg["attack"]["name"], "options": cfg["attack"]["options"]}]
    return [{"label": str(e.get("label") or e["name"]), "name": str(e["name"]),
             "options": dict(e.get("options") or {})} for e in entries]


def available_attacks() -> list[str]:
    """Names :func:`attacks.create_attack` knows."""
    import attacks

    return list(attacks.attack_names())


def model_spec(cfg: dict, index: int) -> dict:
    """The factory spec of model row ``index`` (label dropped; seed defaults to seed + index)."""
    row = cfg["models"][index]
    spec = {k: copy.deepcopy(v) for k, v in row.items() if k not in ("label", "recipe", "defence")}
    spec.setdefault("variant", "plain")
    spec.setdefault("kwargs", {})
    spec.setdefault("checkpoint", None)
    spec.setdefault("april", None)
    if spec.get("seed") is None:
        spec["seed"] = int(cfg["seed"]) + index
    return spec


def model_label(row: Mapping[str, Any]) -> str:
    return str(row.get("label") or row["name"])


def save_config(cfg: dict, path: str | Path) -> None:
    """Write the resolved config (``yaml.safe_dump``; plain data only) atomically: a temporary file
    beside it, then ``os.replace``, so a reader never sees half a config."""
    import os

    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(yaml.safe_dump(cfg, sort_keys=False, default_flow_style=None))
    os.replace(tmp, path)


def result_view(cfg: Mapping[str, Any]) -> dict:
    """The part of a config that determines results (what must match to resume)."""
    return {k: v for k, v in cfg.items() if k not in NON_RESULT_KEYS}


def diff_configs(old: Any, new: Any, where: str = "") -> list[str]:
    """Dotted keys whose values differ between two configs."""
    if isinstance(old, dict) and isinstance(new, dict):
        out = []
        for key in sorted(set(old) | set(new), key=str):
            out += diff_configs(old.get(key), new.get(key), f"{where}{key}.")
        return out
    if isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        out = []
        for i, (a, b) in enumerate(zip(old, new)):
            out += diff_configs(a, b, f"{where}{i}.")
        return out
    return [] if old == new else [f"{where.rstrip('.')}: {old!r} -> {new!r}"]
