"""Training configuration: one flat pydantic model (:class:`TrainConfig`, the schema and the object
training reads), loaded from YAML and ``--key value`` overrides.

Loading and checking is :mod:`fedmjp.config`'s (unknown keys list the valid ones, a value of the
wrong type or out of its range names the key and what it takes). Every number has the range the
training code needs (bounded numbers are finite) and every choice from a fixed set of timm's is a
``Literal``. Names that come from a registry (``model``, ``opt``, ``auto_augment``) and what needs
several keys at once are checked by :func:`check_config` with timm's own API, before anything is
written. Values are data: YAML is read with a safe loader and command-line
overrides are parsed the same way (``--gamma 0.1`` -> float, ``--train_subset null`` -> None), never
evaluated as code. The resolved config is stored in every checkpoint as a plain dict of
str/int/float/bool/None/list/dict, so checkpoints stay loadable with ``torch.load(weights_only=True)``.
"""
from __future__ import annotations

import difflib
from pathlib import Path
from typing import Annotated, Any, Literal, Optional

import timm
import timm.optim
import torch
from pydantic import AfterValidator
from timm.data.auto_augment import augment_and_mix_transform, auto_augment_transform, rand_augment_transform
from timm.scheduler import create_scheduler_v2

from .config import ConfigError, Float, Int, Schema, option, parse, parse_value, read_yaml
from .dal import DalHead
from .devices import resolve_device
from .models import FirstBlock, PeInit, Variant, model_plugin

AmpMode = Literal["auto", "none", "bf16", "fp16"]  # auto: bf16 on CUDA (fp16 on older GPUs), off on CPU
DalSchedule = Literal["constant", "official"]  # official: warm-up + cosine, per epoch
#: timm's interpolation names (timm.data.transforms.str_to_interp_mode); its 'random' is left out:
#: the evaluation transform at > 32 px cannot take it.
Interpolation = Literal["bicubic", "bilinear", "nearest", "box", "hamming", "lanczos"]
#: timm's RandomErasing modes: per-pixel normal noise, one normal colour per block, zeros.
EraseMode = Literal["pixel", "rand", "const"]
#: timm's Mixup modes: one lambda per batch, per pair of images, per image.
MixupMode = Literal["batch", "pair", "elem"]
#: timm.scheduler.create_scheduler_v2's schedules that step per optimizer update (fedmjp.train steps
#: the schedule every update: timm's 'plateau' steps per epoch on a metric, 'none' has no schedule).
Scheduler = Literal["cosine", "tanh", "step", "multistep", "poly", "constant", "wsd", "rsqrt"]


def _not_empty(value: str) -> str:
    if not value.strip():
        raise ValueError("must be a folder path, got an empty string")
    return value


#: Bounds checked before anything is loaded or written (each sets memory or time: a model's
#: position table and head, a batch, worker processes, threads; 1e6 threads crash the process).
MAX_IMG_SIZE = 1024
MAX_CLASSES = 100_000
MAX_IMAGES = 100_000_000
MAX_BATCH = 65_536
MAX_WORKERS = 256
MAX_THREADS = 1024
MAX_EPOCHS = 100_000

#: A path that must not be empty (``Path("")`` would be the current folder).
Folder = Annotated[str, AfterValidator(_not_empty)]


class TrainConfig(Schema):
    """Every knob of central training; defaults are the DeiT/MJP ImageNet recipe (docs/design.md,
    "Central training recipe")."""

    # ---- model
    model: str = "mjp_deit_small_patch16_224"  # timm name; mjp_* names take the MJP arguments below
    variant: Variant = "mjp"
    gamma: Float = option(0.1, ge=0.0, le=1.0)  # training shuffle ratio (official train.sh: --mask-ratio 0.1)
    per_sample: bool = False  # official: one mask/permutation per batch
    shuffle_prob: Float = option(0.5, ge=0.0, le=1.0)  # official: a step is shuffled when rand > 0.5
    shuffle_start_epoch: Int = option(20, ge=0, le=MAX_EPOCHS)  # official: no shuffling during the warm-up epochs
    dal_head: DalHead = "nln"
    dal_normalize: bool = False  # official regresses raw grid indices
    dal_lambda: Float = option(0.01, ge=0.0)  # lambda of the DAL loss (paper)
    dal_final: Float = option(0.005, ge=0.0)  # end value of the official cosine lambda schedule
    dal_schedule: DalSchedule = "official"
    pe_init: PeInit = "timm"  # timm (trunc-normal, no decay) | official (N(0,1), decayed)
    first_block: FirstBlock = "standard"  # april: APRIL design A
    img_size: Int = option(224, ge=1, le=MAX_IMG_SIZE)
    num_classes: Optional[Int] = option(None, ge=1, le=MAX_CLASSES)  # None: number of class folders in train/
    drop_path: Float = option(0.1, ge=0.0, lt=1.0)  # 1 would drop every residual branch
    model_kwargs: dict = {}  # extra timm kwargs (depth, embed_dim, ...)

    # ---- data
    data_path: Optional[str] = None  # ImageFolder root (train/, val/) or a .tar.gz of one
    data_cache: Optional[str] = None  # where archives are extracted (default ~/.cache/fedmjp/data)
    train_subset: Optional[Int] = option(None, ge=1, le=MAX_IMAGES)  # train on a fixed random subset of this many images
    val_subset: Optional[Int] = option(None, ge=1, le=MAX_IMAGES)
    batch_size: Int = option(128, ge=1, le=MAX_BATCH)  # per process
    num_workers: Int = option(4, ge=0, le=MAX_WORKERS)  # 0: load in the training process
    aug_repeats: Int = option(3, ge=1, le=100)  # repeated augmentation (RepeatAugSampler; used when distributed)
    auto_augment: Optional[str] = "rand-m9-mstd0.5-inc1"  # timm policy (rand-*, augmix-*, original, v0, ...); null: off
    color_jitter: Float = option(0.4, ge=0.0)  # 0: off
    reprob: Float = option(0.25, ge=0.0, le=1.0)
    remode: EraseMode = "pixel"
    interpolation: Interpolation = "bicubic"
    # smallest share of the image's area a training random-resized crop keeps (timm's scale=(crop_min, 1));
    # DeiT's 0.08 suits 300 epochs of ImageNet, a short run on upsampled CIFAR learns faster near 1
    crop_min: Float = option(0.08, gt=0.0, le=1.0)
    mixup: Float = option(0.8, ge=0.0)  # Beta alpha; 0: off (Mixup is off when mixup and cutmix are 0)
    cutmix: Float = option(1.0, ge=0.0)
    mixup_prob: Float = option(1.0, ge=0.0, le=1.0)
    mixup_switch_prob: Float = option(0.5, ge=0.0, le=1.0)
    mixup_mode: MixupMode = "batch"
    smoothing: Float = option(0.1, ge=0.0, lt=1.0)  # label smoothing

    # ---- optimisation
    opt: str = "adamw"  # timm optimizer name (timm.optim.list_optimizers()), optionally lookahead_<name>
    blr: Float = option(5e-4, gt=0.0)  # lr = blr * global_batch / 512 unless lr is set
    lr: Optional[Float] = option(None, gt=0.0)
    weight_decay: Float = option(0.05, ge=0.0)
    opt_eps: Float = option(1e-8, gt=0.0)
    clip_grad: Optional[Float] = option(5.0, gt=0.0)  # max grad norm; null: no clipping
    sched: Scheduler = "cosine"
    epochs: Int = option(300, ge=1, le=MAX_EPOCHS)
    warmup_epochs: Int = option(20, ge=0, le=MAX_EPOCHS)
    warmup_lr: Float = option(5e-7, ge=0.0)  # scaled by global_batch / 512 like lr (official code)
    min_lr: Float = option(5e-6, ge=0.0)  # idem

    # ---- run
    seed: Int = option(0, ge=0, le=2**32 - 1)
    amp: AmpMode = "auto"
    device: str = "auto"  # auto | cpu | cuda
    output_dir: Folder = "runs/train"
    threads: Optional[Int] = option(None, ge=1, le=MAX_THREADS)  # torch.set_num_threads for CPU runs
    max_steps_per_epoch: Optional[Int] = option(None, ge=1, le=MAX_IMAGES)  # cap (smoke tests, benchmarks)
    stop_epoch: Optional[Int] = option(None, ge=1, le=MAX_EPOCHS)  # stop after this many epochs (time-limited jobs); resume later
    eval_every: Int = option(1, ge=1, le=MAX_EPOCHS)  # epochs between validations (the last epoch is always validated)
    log_interval: Int = option(50, ge=1, le=MAX_IMAGES)  # steps between progress-bar updates

    def replace(self, **changes: Any) -> "TrainConfig":
        """A copy with ``changes``, checked like a loaded config."""
        return config_from_dict({**self.to_dict(), **changes})

    def to_dict(self) -> dict:
        """Plain-typed dict (safe for ``torch.load(weights_only=True)`` and JSON)."""
        return self.model_dump()

    def mjp_kwargs(self) -> dict:
        """Model-constructor arguments of the MJP model."""
        return dict(variant=self.variant, gamma=self.gamma, per_sample=self.per_sample,
                    shuffle_prob=self.shuffle_prob, dal_head=self.dal_head, dal_normalize=self.dal_normalize,
                    pe_init=self.pe_init, first_block=self.first_block)


def config_from_dict(values: dict) -> TrainConfig:
    """Build a config from a dict (defaults for absent keys).

    Only the schema is checked (types, ranges, choices): a config stored in a checkpoint loads
    wherever the checkpoint does. :func:`check_config` checks the rest before training.

    Raises:
        ValueError (:class:`fedmjp.config.ConfigError`): an unknown key (the valid ones listed) or
            a value of the wrong type or out of range.
    """
    return parse(TrainConfig, values)


def load_config(path: Optional[str | Path] = None, overrides: Optional[dict] = None) -> TrainConfig:
    """YAML file (optional) then ``overrides`` on top of the defaults."""
    return config_from_dict({**(read_yaml(path) if path is not None else {}), **(overrides or {})})


def parse_overrides(items: list[str]) -> dict:
    """``["--gamma", "0.2", "--per_sample=true"]`` -> ``{"gamma": 0.2, "per_sample": True}``.

    Dashes in keys become underscores; values are YAML data (:func:`fedmjp.config.parse_value`),
    checked against the schema.

    Raises:
        ValueError (:class:`fedmjp.config.ConfigError`): an item that is no ``--key value``, an
            unknown key, or a value the key does not take.
    """
    out: dict = {}
    rest = list(items)
    while rest:
        item = rest.pop(0)
        if not item.startswith("--"):
            raise ConfigError(f"expected --key value, got {item!r}")
        key, eq, value = item[2:].partition("=")
        if not eq and (not rest or rest[0].startswith("--")):
            raise ConfigError(f"missing value for {item} (--key value or --key=value)")
        out[key.replace("-", "_")] = parse_value(value if eq else rest.pop(0), item)
    parse(TrainConfig, out)  # unknown keys and wrong types fail here, before any training
    return out


# ------------------------------------------------------------------------------ beyond the schema
def check_config(cfg: TrainConfig) -> TrainConfig:
    """Check what the schema cannot: the names timm looks up (``model``, ``opt``, ``auto_augment``)
    with timm's own API, the schedule timm builds from ``sched``/``epochs``/``warmup_epochs``, the
    ``device``, and the keys that depend on each other. Cheap (no model is built); run before anything
    is written. Returns ``cfg``.

    Raises:
        ValueError (:class:`fedmjp.config.ConfigError`): the key, what it takes and what it got.
    """
    _check_model(cfg.model)
    _check_optimizer(cfg.opt)
    _check_schedule(cfg)
    _check_auto_augment(cfg.auto_augment, cfg.img_size)
    _check_device(cfg.device)
    if (cfg.mixup > 0 or cfg.cutmix > 0) and cfg.batch_size < 2:
        raise ConfigError(f"config key 'batch_size' must be >= 2 while mixup or cutmix is on (Mixup mixes pairs; "
                          f"an odd image is dropped from each batch), got {cfg.batch_size}")
    return cfg


def _check_model(name: str) -> None:
    if timm.is_model(name):
        return
    try:
        if model_plugin(name) is not None:  # a plug-in architecture (docs/plugins.md)
            return
    except ValueError as err:  # fedmjp.plugins.PluginError: named a plug-in that cannot be loaded
        raise ConfigError(f"config key 'model': {err}") from None
    close = difflib.get_close_matches(name, timm.list_models(), n=3, cutoff=0.7)
    raise ConfigError(
        f"config key 'model': unknown model {name!r}" + (f" (did you mean {', '.join(close)}?)" if close else "")
        + f"; valid: fedmjp's {', '.join(timm.list_models('mjp_*'))}, any of timm's "
        "(python -c 'import timm; print(timm.list_models())'), or a plug-in's package.module:fn")


def _check_optimizer(opt: str) -> None:
    parts = opt.lower().split("_")  # timm.optim.create_optimizer_v2 reads [lookahead_]<name>
    try:
        if len(parts) > 2 or (len(parts) == 2 and parts[0] != "lookahead"):
            raise ValueError(opt)
        timm.optim.get_optimizer_info(parts[-1])
    except ValueError:
        names = ", ".join(map(str, timm.optim.list_optimizers()))
        raise ConfigError(f"config key 'opt': unknown optimizer {opt!r}; valid: timm's {names}, "
                          "each also as lookahead_<name>") from None
    try:
        timm.optim.get_optimizer_class(parts[-1])  # imports apex / bitsandbytes classes, needs CUDA for them
    except (ImportError, AssertionError) as err:
        raise ConfigError(f"config key 'opt': optimizer {opt!r} cannot be used here ({err})") from None


def build_schedule(optimizer: torch.optim.Optimizer, cfg: TrainConfig, updates_per_epoch: int, warmup_lr: float,
                   min_lr: float) -> Any:
    """timm's schedule of ``cfg`` (stepped per update, as :mod:`fedmjp.train` steps it).

    Raises:
        ValueError (:class:`fedmjp.config.ConfigError`): timm cannot build it (wsd/rsqrt: a decay
            phase too short for these epochs and steps).
    """
    try:
        return create_scheduler_v2(optimizer, sched=cfg.sched, num_epochs=cfg.epochs, warmup_epochs=cfg.warmup_epochs,
                                   warmup_lr=warmup_lr, min_lr=min_lr, step_on_epochs=False,
                                   updates_per_epoch=updates_per_epoch)[0]
    except ValueError as err:
        raise ConfigError(f"config key 'sched': timm cannot build the {cfg.sched!r} schedule for {cfg.epochs} epochs "
                          f"of {updates_per_epoch} steps, {cfg.warmup_epochs} of them warm-up ({err})") from None


def _check_schedule(cfg: TrainConfig) -> None:
    """Build the schedule on a stand-in optimizer (a large stand-in epoch, so that only what no data
    set can fix is refused: wsd/rsqrt need epochs > warmup_epochs)."""
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    build_schedule(optimizer, cfg, cfg.max_steps_per_epoch or 10_000, cfg.warmup_lr, cfg.min_lr)


_AA_HELP = ("rand-m9-mstd0.5-inc1 (RandAugment: rand-<section>..., sections mN magnitude, nN ops, mstdF, incN), "
            "augmix-m3-w3 (AugMix), an AutoAugment policy original, originalr, v0, v0r, 3a (optionally -mstdF), "
            "or null for none")


def _check_auto_augment(policy: Optional[str], img_size: int) -> None:
    """Parse ``policy`` with the timm function :func:`timm.data.create_transform` would call."""
    if not policy:
        return
    parse_fn = (rand_augment_transform if policy.startswith("rand") else augment_and_mix_transform
                if policy.startswith("augmix") else auto_augment_transform)
    hparams = {"translate_const": int(img_size * 0.45), "img_mean": (124, 116, 104)}
    try:
        parse_fn(policy, hparams)
    except (AssertionError, ValueError, KeyError) as err:  # timm's parsers assert on an unknown policy/section
        detail = f" ({err})" if str(err) else ""
        raise ConfigError(f"config key 'auto_augment': timm cannot read {policy!r}{detail}; "
                          f"valid: {_AA_HELP}") from None


def _check_device(device: str) -> None:
    try:
        resolve_device(device)
    except ValueError as err:
        raise ConfigError(f"config key 'device': {err}") from None
