"""Benchmark configuration: the schema, and presets and dotted ``key=value`` overrides read against it.

:class:`BenchmarkConfig` and its sections hold every key, its type and default; :mod:`fedmjp.config`
loads and checks (an unknown key lists the valid ones, so a typo never silently does nothing).
Presets, flags and overrides are merged as plain data (:func:`load_config`, :func:`apply_overrides`,
:func:`with_values`); :func:`benchmark.validation.validate` turns the result into the typed
:class:`BenchmarkConfig` the run reads (``cfg.federation.rounds``), and :func:`plain` back into data
for ``config.yaml`` and the resume check. Presets live in ``configs/`` (``default.yaml`` quick,
``paper.yaml`` the paper's protocol). Overrides are YAML data (``--set data.num_images=null`` -> None),
never code. A field's ``client=`` names the clients' run-config key(s) it feeds
(:func:`benchmark.inputs.client_values`).

Relative paths in a config file (image folder, checkpoints, LPIPS backbone) are resolved against the
project root, so ``checkpoints/deit.pt`` means the same thing from any working directory; paths given
as flags (``--images``) are resolved against the working directory. A path that starts with
``$FEDMJP_DATA/`` names a file in the data folder (:mod:`fedmjp.datadir`: ``$FEDMJP_DATA/imagenet-sample``);
while the variable is unset it stays as written, and the step that reads the data says what to set.
"""
from __future__ import annotations

import copy
from pathlib import Path
from typing import Annotated, Any, Iterable, Literal, Mapping, Optional, Union, get_args

from pydantic import AfterValidator, BeforeValidator, Field, SerializeAsAny

from clients.runconfig import (MAX_BATCH_SIZE, MAX_CLASSES, MAX_CLIENTS, MAX_DATASET_IMAGES, MAX_IMAGE_SIZE,
                               MAX_LOCAL_STEPS, MAX_ROUNDS, Mode, Partitioner, Precision)
from defences.spec import DefenceSpec, NoDefence, validate_defence
from fedmjp import config as core
from fedmjp import datadir
from fedmjp.config import ByShape, Float, Int, Schema, option
from fedmjp.settings import SETTINGS, Setting

from .errors import ConfigError

PROJECT_ROOT = Path(__file__).resolve().parents[1]
#: Largest seed (torch, numpy and Flower's 64-bit config values all take it, with room for the
#: per-row and per-round offsets added to it).
SEED_MAX = 2**32 - 1
DEFAULT_CONFIG = PROJECT_ROOT / "configs" / "default.yaml"

Engine = Literal["inprocess", "simulation"]
LabelMode = Literal["known", "none"]
ENGINES: tuple[str, ...] = get_args(Engine)


def _settings_list(value: Any) -> list[str]:
    """``all``, one setting or a list of them as the list in SETTINGS order."""
    chosen = SETTINGS if value == "all" else [value] if isinstance(value, str) else value
    if not chosen:
        raise ValueError(f"must be a non-empty list of {', '.join(SETTINGS)}, got {value!r}")
    return [s for s in SETTINGS if s in chosen]


#: ``settings:`` as written (``all``, ``c`` or ``[a, c]``), read as the list in SETTINGS order.
Settings = Annotated[Union[list[Setting], Literal[Setting, "all"]], ByShape(), AfterValidator(_settings_list)]
#: A grid (dotted key -> non-empty list of values) or explicit points (non-empty mappings of dotted
#: key -> value): benchmark/sweep_points.py
Sweep = Annotated[Union[dict[str, Annotated[list, Field(min_length=1)]], list[Annotated[dict, Field(min_length=1)]]],
                  ByShape()]
#: A defence spec (defences/spec.py: built-in or plug-in), typed once read; dumped with all its keys.
Defence = Annotated[SerializeAsAny[DefenceSpec], BeforeValidator(validate_defence)]


def _resolve_path(value: Any) -> Any:
    """A config path as an absolute path (relative: to the project root), ``$FEDMJP_DATA/...``
    expanded while the variable is set; ``embedded`` and None unchanged."""
    if value is None or value == "embedded" or not isinstance(value, str):
        return value
    try:
        value.encode()  # YAML's "\ud800" escapes give unpaired surrogates, which no file system takes
    except UnicodeEncodeError:
        raise ConfigError(f"path {value!r} holds characters that are not valid text (unpaired surrogates); "
                          "write it in plain UTF-8") from None
    if "\x00" in value:
        raise ConfigError(f"path {value!r} holds a NUL character; no file name can")
    if datadir.names_data_dir(value):
        try:
            value = datadir.expand(value)
        except datadir.DataDirUnset:
            return value  # kept as written (unset, or an unusable folder): loading the data says what to fix
    try:
        p = Path(value).expanduser()
    except RuntimeError:  # pathlib's answer to a ~user of no known user
        raise ConfigError(f"path {value!r}: its ~ prefix names no known home folder; write the path out") from None
    return str(p if p.is_absolute() else datadir.resolved(PROJECT_ROOT / p, "path"))


#: A path key of a config file: resolved against the project root when read (_resolve_path), so a
#: new path key needs only this type.
ConfigPath = Annotated[str, AfterValidator(_resolve_path)]


# Choices are Literal types defined once, by the code that uses them (Mode by the clients' run
# config, Setting by fedmjp.settings); a tuple of the values is ``get_args`` of the type.


class Data(Schema):
    source: ConfigPath = option("embedded", client="images")  # "embedded" (scikit-image's bundled images) or a folder
    image_size: Int = option(32, ge=1, le=MAX_IMAGE_SIZE, client="image-size")
    # None: all images of the source (the run config has no null: 0 there means all)
    num_images: Optional[Int] = option(None, ge=1, client="num-images", client_null=0)
    num_classes: Int = option(10, ge=1, le=MAX_CLASSES, client="num-classes")  # labels are (sorted index) % num_classes
    on_corrupt: Literal["skip", "fail"] = "skip"


class Federation(Schema):
    engine: Engine = "inprocess"  # inprocess | simulation (Flower's Ray simulation)
    rounds: Int = option(2, ge=1, le=MAX_ROUNDS, client="num-server-rounds")
    clients: Int = option(4, ge=1, le=MAX_CLIENTS, client=("num-partitions", "min-nodes"))
    # fedsgd (one batch's gradient) | fedavg (weight delta of local steps)
    algorithm: Mode = option("fedsgd", client="mode")
    batch_size: Int = option(1, ge=1, le=MAX_BATCH_SIZE, client="batch-size")
    local_steps: Int = option(1, ge=1, le=MAX_LOCAL_STEPS, client="local-steps")
    lr: Float = option(0.01, ge=0.0, client="lr")
    partition: Partitioner = option("iid", client="partitioner")
    precision: Precision = option("float32", client="precision")  # client forward/backward dtype
    # Flower's SecAgg+: the server sees one aggregate per round, attacked as one batch of clients x batch_size images
    secagg: bool = option(False, client="secagg")
    options: dict = {}  # run-config keys on top (RunConfig's schema)


class ModelRowConfig(Schema):
    """A model row as the config writes it: the factory spec (:func:`fedmjp.factory.build_model`)
    and its weights (the built row of a run is :class:`benchmark.inputs.ModelRow`)."""

    name: str
    label: Optional[str] = None  # table label (default: name)
    arch: str
    variant: str = "plain"
    kwargs: dict = {}
    checkpoint: Optional[ConfigPath] = None  # None: seeded fresh weights, marked "untrained"
    april: Optional[str] = None  # surgery | trained | None
    seed: Optional[Int] = option(None, ge=0, le=SEED_MAX)  # None: the config's seed + row index
    recipe: Optional[ConfigPath] = None  # training recipe of --train-missing (configs/train/...)
    defence: Optional[Defence] = None  # replaces the top-level defence for this row


class Attack(Schema):
    name: str = "april_analytic"
    labels: LabelMode = "known"  # the threat model grants the server the labels (known) or not
    options: dict = {}


class AttackEntry(Schema):
    name: str
    options: dict = {}
    label: Optional[str] = None  # the ``attack`` column (default: name); unique
    # the entry runs only where federation.batch_size is at least this: a batch attacker in a preset
    # whose batch-1 rows the closed forms answer exactly (a --sweep over batch sizes gets it at B > 1)
    min_batch_size: Int = option(1, ge=1, le=MAX_BATCH_SIZE)


class Metrics(Schema):
    lpips_backbone: Optional[ConfigPath] = None  # AlexNet features file; None: $FEDMJP_LPIPS_BACKBONE or torchvision
    lpips: bool = True
    # breaching's registered PSNR (metrics/registered.py) beside PSNR: about 0.2-1 s per image on a CPU
    rpsnr: bool = False
    # image identifiability precision (metrics/identifiability.py) against the run's image set, by
    # these distances ([] for none; breaching's default is pixel; lpips costs one LPIPS per candidate)
    iip: list[Literal["pixel", "lpips"]] = ["pixel"]


class Report(Schema):
    """The picture grids. Bounded so that a grid's memory is bounded: one model row of a grid is at
    most 16 images x 3 columns of 256 px tiles (about 11 MB of RGB), whatever the data."""

    # the first N images attacked (by round, client) appear in the grids; a row of more than 16
    # images (48 tiles) is too wide to read
    grid_images: Int = option(4, ge=0, le=16)
    # grid tile side in pixels: 256 shows a 224 px image at its own size; larger tiles only
    # magnify (nearest neighbour) and multiply the grid's memory
    tile: Int = option(96, ge=8, le=256)


class Utility(Schema):
    """Utility of each sweep point: top-1 after ``rounds`` FedAvg rounds with the defence on (0: off);
    meaning: benchmark/utility.py."""

    rounds: Int = option(0, ge=0, le=MAX_ROUNDS)
    source: ConfigPath = Field("$FEDMJP_DATA/cifar10.tar.gz", validate_default=True)
    num_train: Int = option(64, ge=0, le=MAX_DATASET_IMAGES)
    num_eval: Int = option(200, ge=1, le=MAX_DATASET_IMAGES)
    clients: Int = option(2, ge=1, le=MAX_CLIENTS)
    local_steps: Int = option(2, ge=1, le=MAX_LOCAL_STEPS)
    batch_size: Int = option(8, ge=1, le=MAX_BATCH_SIZE)
    lr: Float = option(0.05, ge=0.0)
    # the server's step on the mean client delta (clients/runconfig.py's server-* keys): fedavg with
    # server_lr 1 is plain FedAvg; fedadam is FedOpt's Adam (betas server_momentum, 0.99; eps 1e-3)
    server_opt: Literal["fedavg", "fedavgm", "fedadam"] = "fedavg"
    server_lr: Float = option(1.0, gt=0.0, le=1e6)
    server_momentum: Float = option(0.9, ge=0.0, lt=1.0)
    server_tau: Float = option(1e-3, gt=0.0, le=1.0)  # fedadam's eps
    server_schedule: Literal["constant", "cosine"] = "constant"  # server_lr constant or cosine-annealed to 0
    # holdout: the clients train on the source's first num_train images, top-1 on the next num_eval;
    # train: the clients train on the archive's train/ split (num_train 0: all of it), top-1 on the
    # first num_eval images of its val/ split, with a bootstrap interval
    split: Literal["holdout", "train"] = "holdout"
    partition: Partitioner = "iid"  # iid | dirichlet (by label, dirichlet_alpha)
    dirichlet_alpha: Float = option(0.5, gt=0.0)
    curve: list[Int] = []  # rounds after which the global model is also scored (a learning curve, ending at rounds)
    curve_eval: Int = option(2000, ge=1, le=MAX_DATASET_IMAGES)  # images the curve's points are scored on (the first of num_eval)
    delta: Float = option(1e-5, gt=0.0, lt=1.0)  # delta of local and central DP's epsilon (dp_sgd: its own)


class BenchmarkConfig(Schema):
    name: str = "benchmark"
    seed: Int = option(0, ge=0, le=SEED_MAX, client="seed")
    device: str = option("auto", client="device")  # auto | cpu | cuda | cuda:N
    # "all" is a, b, c; either form is read as the list in SETTINGS order
    settings: Settings = ["c"]
    # share of patches the client's MJP shuffle selects in settings (b)/(c)
    gamma: Float = option(0.27, ge=0.0, le=1.0, client="gamma")
    dry_run: bool = False
    output: Optional[str] = None  # output folder (--output); None: runs/<time>-setting-<s>
    train_data: Optional[ConfigPath] = None  # training data of the model rows' recipes (--train-missing)
    # client-side defence of every model row (a row's own ``defence:`` replaces it); keys: defences/spec.py
    defence: Defence = NoDefence()
    # strength sweep: dotted key -> list of values, or a list of points; see benchmark/sweep.py
    sweep: Sweep = {}
    utility: Utility = Utility()
    data: Data = Data()
    federation: Federation = Federation()
    models: list[ModelRowConfig] = []
    attack: Attack = Attack()
    # Several attackers per model row; empty: the one attack above
    attacks: list[AttackEntry] = []
    metrics: Metrics = Metrics()
    # Attacks on N Ray workers (0: in this process); on one machine N <= its CPUs. ray_address: a
    # running Ray cluster (e.g. ray://head:10001) to spread them over many machines (None: local).
    attack_workers: Int = option(0, ge=0)
    ray_address: Optional[str] = None
    report: Report = Report()


#: Every key a config may hold, with its default. ``models`` has no default rows.
DEFAULTS: dict[str, Any] = core.defaults(BenchmarkConfig)


def conform(data: Mapping[str, Any]) -> dict:
    """:data:`DEFAULTS` with ``data`` on top, every key and type checked (raises ConfigError)."""
    return core.conform(BenchmarkConfig, data)


def load_config(path: Optional[str | Path] = None) -> dict:
    """Defaults merged with a preset (``configs/default.yaml`` when ``path`` is None); relative paths
    resolved against the project root (:data:`ConfigPath`)."""
    return conform(core.read_yaml(DEFAULT_CONFIG if path is None else path))


def apply_overrides(cfg: Mapping[str, Any] | BenchmarkConfig, overrides: Iterable[str]) -> dict:
    """Apply ``key=value`` overrides (dotted keys; ``models.0.checkpoint=...`` indexes model rows),
    then check the whole config against the schema, which names an unknown key and the valid ones."""
    return with_values(cfg, [core.parse_override(text) for text in overrides])


def with_values(cfg: Mapping[str, Any] | BenchmarkConfig, changes: Iterable[tuple[list[str], Any]]) -> dict:
    """A copy of ``cfg`` as plain data with each (dotted key parts, Python value) set, checked against
    the schema (paths resolved: :data:`ConfigPath`)."""
    cfg = plain(cfg)
    for parts, value in changes:
        core.set_dotted(cfg, parts, copy.deepcopy(value))
    return conform(cfg)


def plain(cfg: Mapping[str, Any] | BenchmarkConfig) -> dict:
    """A config as plain data (a deep copy): what overrides edit and ``config.yaml`` holds."""
    return cfg.model_dump() if isinstance(cfg, BenchmarkConfig) else copy.deepcopy(dict(cfg))
