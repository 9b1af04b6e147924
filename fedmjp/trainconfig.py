"""Training configuration: one flat pydantic model (:class:`TrainConfig`, the schema and the object
training reads), loaded from YAML and ``--key value`` overrides.

Loading and checking is :mod:`fedmjp.config`'s (unknown keys list the valid ones, a value of the
wrong type names the key). Values are data: YAML is read with a safe loader and command-line
overrides are parsed the same way (``--gamma 0.1`` -> float, ``--train_subset null`` -> None), never
evaluated as code. The resolved config is stored in every checkpoint as a plain dict of
str/int/float/bool/None/list/dict, so checkpoints stay loadable with ``torch.load(weights_only=True)``.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, Optional

from .config import Float, Int, Schema, parse, parse_value, read_yaml
from .dal import DalHead
from .models import FirstBlock, PeInit, Variant

AmpMode = Literal["auto", "none", "bf16", "fp16"]  # auto: bf16 on CUDA (fp16 on older GPUs), off on CPU
DalSchedule = Literal["constant", "official"]  # official: warm-up + cosine, per epoch


class TrainConfig(Schema):
    """Every knob of central training; defaults are the DeiT/MJP ImageNet recipe (docs/design.md,
    "Central training recipe")."""

    # ---- model
    model: str = "mjp_deit_small_patch16_224"  # timm name; mjp_* names take the MJP arguments below
    variant: Variant = "mjp"
    gamma: Float = 0.1  # training shuffle ratio (official train.sh: --mask-ratio 0.1)
    per_sample: bool = False  # official: one mask/permutation per batch
    shuffle_prob: Float = 0.5  # official: a step is shuffled when rand > 0.5
    shuffle_start_epoch: Int = 20  # official: no shuffling during the warm-up epochs
    dal_head: DalHead = "nln"
    dal_normalize: bool = False  # official regresses raw grid indices
    dal_lambda: Float = 0.01  # lambda of the DAL loss (paper)
    dal_final: Float = 0.005  # end value of the official cosine lambda schedule
    dal_schedule: DalSchedule = "official"
    pe_init: PeInit = "timm"  # timm (trunc-normal, no decay) | official (N(0,1), decayed)
    first_block: FirstBlock = "standard"  # april: APRIL design A
    img_size: Int = 224
    num_classes: Optional[Int] = None  # None: number of class folders in train/
    drop_path: Float = 0.1
    model_kwargs: dict = {}  # extra timm kwargs (depth, embed_dim, ...)

    # ---- data
    data_path: Optional[str] = None  # ImageFolder root (train/, val/) or a .tar.gz of one
    data_cache: Optional[str] = None  # where archives are extracted (default ~/.cache/fedmjp/data)
    train_subset: Optional[Int] = None  # train on a fixed random subset of this many images
    val_subset: Optional[Int] = None
    batch_size: Int = 128  # per process
    num_workers: Int = 4
    aug_repeats: Int = 3  # repeated augmentation (RepeatAugSampler; used when distributed)
    auto_augment: Optional[str] = "rand-m9-mstd0.5-inc1"
    color_jitter: Float = 0.4
    reprob: Float = 0.25
    remode: str = "pixel"
    interpolation: str = "bicubic"
    mixup: Float = 0.8
    cutmix: Float = 1.0
    mixup_prob: Float = 1.0
    mixup_switch_prob: Float = 0.5
    mixup_mode: str = "batch"
    smoothing: Float = 0.1

    # ---- optimisation
    opt: str = "adamw"
    blr: Float = 5e-4  # lr = blr * global_batch / 512 unless lr is set
    lr: Optional[Float] = None
    weight_decay: Float = 0.05
    opt_eps: Float = 1e-8
    clip_grad: Optional[Float] = 5.0
    sched: str = "cosine"
    epochs: Int = 300
    warmup_epochs: Int = 20
    warmup_lr: Float = 5e-7  # scaled by global_batch / 512 like lr (official code)
    min_lr: Float = 5e-6  # idem

    # ---- run
    seed: Int = 0
    amp: AmpMode = "auto"
    device: str = "auto"  # auto | cpu | cuda
    output_dir: str = "runs/train"
    threads: Optional[Int] = None  # torch.set_num_threads for CPU runs
    max_steps_per_epoch: Optional[Int] = None  # cap (smoke tests, benchmarks)
    stop_epoch: Optional[Int] = None  # end this run after this many epochs (time-limited jobs); resume later
    eval_every: Int = 1  # epochs between validations (the last epoch is always validated)
    log_interval: Int = 50

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

    Raises:
        ValueError (:class:`fedmjp.config.ConfigError`): an unknown key (the valid ones listed) or
            a value of the wrong type.
    """
    return parse(TrainConfig, values)


def load_config(path: Optional[str | Path] = None, overrides: Optional[dict] = None) -> TrainConfig:
    """YAML file (optional) then ``overrides`` on top of the defaults."""
    return config_from_dict({**(read_yaml(path) if path is not None else {}), **(overrides or {})})


def parse_overrides(items: list[str]) -> dict:
    """``["--gamma", "0.2", "--per_sample=true"]`` -> ``{"gamma": 0.2, "per_sample": True}``.

    Dashes in keys become underscores; values are YAML data (:func:`fedmjp.config.parse_value`),
    checked against the schema.
    """
    out: dict = {}
    i = 0
    while i < len(items):
        item = items[i]
        if not item.startswith("--"):
            raise ValueError(f"expected --key value, got {item!r}")
        key, eq, value = item[2:].partition("=")
        if not eq:
            if i + 1 >= len(items) or items[i + 1].startswith("--"):
                raise ValueError(f"missing value for {item}")
            value = items[i + 1]
            i += 1
        out[key.replace("-", "_")] = parse_value(value, item)
        i += 1
    parse(TrainConfig, out)  # unknown keys and wrong types fail here, before any training
    return out
