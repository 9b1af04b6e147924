"""Central training of (MJP) ViTs: ``python -m fedmjp.train --config configs/train/<name>.yaml
--data-path DIR_OR_TAR [--output-dir DIR] [--resume PATH] [--key value ...]``.

Runs on one CPU or GPU, or on many processes under torchrun (DDP; nccl on CUDA, gloo on CPU)::

    torchrun --nproc_per_node 8 -m fedmjp.train --config configs/train/deit_s_mjp.yaml --data-path /imagenet

Every epoch writes ``<output_dir>/last.pth`` atomically and appends one JSON line to
``<output_dir>/metrics.jsonl``; a run whose output dir already holds ``last.pth`` resumes from it.
One training at a time per output dir (a lock, :data:`EXIT_LOCKED`). A resume must train what the
checkpoint trained: a key that changes the weights (everything but :data:`RUN_ONLY_KEYS`) that
differs from the checkpoint's config is refused, naming it, unless ``--allow-config-change``, which
goes on and records the change with its epoch in ``config.yaml``. On resume ``metrics.jsonl`` is
brought into agreement with the checkpoint: lines of epochs the checkpoint does not hold are
dropped, and the checkpoint's own line is restored if a kill took it.

``python -m fedmjp.train --export runs/train/cifar_deit/last.pth --to checkpoints/cifar_deit.safetensors``
writes a checkpoint's weights as float16 safetensors with the architecture in the header (no training).

Every value a run takes from the user (config file, keys, data path, output dir, ``--resume``) is
checked before anything is written (:func:`check_run`); the command line turns a bad one into one
line ``error: ...`` on stderr and exit status 2 (:data:`EXIT_BAD_CONFIG`).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
import yaml
from timm.loss import LabelSmoothingCrossEntropy, SoftTargetCrossEntropy
from timm.optim import create_optimizer_v2

from fedmjp.text import escape_log_output
from . import datadir
from .allocator import tune_malloc
from .config import ConfigError
from .dal import dal_weight
from .engine import StepContext, TrainStep, train_one_epoch, validate
from .factory import create_model
from .folder_lock import LOCK, FolderLocked, FolderLockLink, release_lock, take_lock
from .models import MJPVisionTransformer
from .archives import ARCHIVE_SUFFIXES, ArchiveError, find_imagefolder_root, resolve_data_path
from .train_data import build_datasets, build_loaders, build_mixup
from .trainconfig import TrainConfig, build_schedule, check_config, load_config, parse_overrides
from .trainutils import (
    CHECKPOINT_FORMAT,
    DistInfo,
    amp_dtype,
    check_output_dir,
    epoch_seed,
    export_weights,
    init_distributed,
    load_checkpoint_state,
    model_kwargs,
    save_checkpoint,
    seed_everything,
)

_logger = logging.getLogger(__name__)

#: Exit status of ``python -m fedmjp.train`` for a bad config, argument, data path or output dir
#: (as argparse's for a bad argument); nothing is written then.
EXIT_BAD_CONFIG = 2
#: Exit status when another training holds the output dir's lock; nothing is written.
EXIT_LOCKED = 9
#: Config keys a resume may change without changing what is trained: where things are and how the
#: run reports. Every other key (model, data selection, augmentation, optimizer, schedule, seed,
#: epochs) must equal the checkpoint's, or be allowed explicitly (``--allow-config-change``).
RUN_ONLY_KEYS = frozenset({"output_dir", "data_path", "data_cache", "device", "threads", "num_workers",
                           "stop_epoch", "eval_every", "log_interval"})
_DATA_HELP = f"an ImageFolder root with train/<class>/ and val/<class>/, or a {'/'.join(ARCHIVE_SUFFIXES)} of one"


@dataclass
class TrainResult:
    """What :func:`run_training` returns: the trained model (unwrapped, on its device), the last
    epoch's metrics row, the checkpoint path and this process's rank."""

    model: nn.Module
    metrics: dict
    checkpoint: Path
    rank: int


def scaled_lrs(cfg: TrainConfig, world_size: int) -> tuple[float, float, float]:
    """(lr, warmup_lr, min_lr) scaled linearly by the global batch / 512 (DeiT; official MJP code)."""
    scale = cfg.batch_size * world_size / 512.0
    lr = cfg.lr if cfg.lr is not None else cfg.blr * scale
    return lr, cfg.warmup_lr * scale, cfg.min_lr * scale


def _criterion(cfg: TrainConfig, mixup_active: bool) -> nn.Module:
    if mixup_active:
        return SoftTargetCrossEntropy()  # Mixup already folded label smoothing into the targets
    if cfg.smoothing > 0:
        return LabelSmoothingCrossEntropy(smoothing=cfg.smoothing)
    return nn.CrossEntropyLoss()


def _resume_path(cfg: TrainConfig, resume: Optional[str]) -> Optional[Path]:
    if resume:
        return Path(resume)
    last = Path(cfg.output_dir) / "last.pth"
    return last if last.exists() else None


class OutputDirLocked(ConfigError):
    """Another training holds the output dir (exit :data:`EXIT_LOCKED`)."""


def config_changes(saved: dict, cfg: TrainConfig) -> dict[str, tuple]:
    """{key: (checkpoint's value, this run's)} for the keys outside :data:`RUN_ONLY_KEYS` that differ
    (a key the checkpoint's config lacks counts as its default now)."""
    now = cfg.to_dict()
    return {k: (saved.get(k, v), v) for k, v in now.items()
            if k not in RUN_ONLY_KEYS and saved.get(k, v) != v}


def check_resume(state: dict, cfg: TrainConfig, where: Path, allow_change: bool) -> dict[str, tuple]:
    """The checkpoint ``state`` may be resumed by ``cfg``: returns the allowed changes.

    Raises:
        ValueError (:class:`fedmjp.config.ConfigError`): a key that changes the training differs and
            ``allow_change`` is off, naming every such key with both values.
    """
    changes = config_changes(state.get("config") or {}, cfg)
    if changes and not allow_change:
        listed = "; ".join(f"{k}: {a!r} in the checkpoint, {b!r} now" for k, (a, b) in sorted(changes.items()))
        raise ConfigError(f"--resume {where}: this run trains something else than the checkpoint ({listed}); "
                          "pass the checkpoint's values, use another --output-dir, or add --allow-config-change "
                          "to go on with the new values (recorded in config.yaml with the epoch)")
    return changes


def reconcile_metrics(path: Path, state: dict) -> None:
    """Make ``metrics.jsonl`` agree with the checkpoint ``state`` (epochs 0 .. state["epoch"] - 1):
    drop lines of later epochs (and unreadable ones) and restore the checkpoint's own line where a kill
    between the checkpoint and the metrics write lost it. Rewritten atomically, only when it changes."""
    done = int(state["epoch"])
    lines = path.read_text(encoding="utf-8").splitlines() if path.exists() else []
    kept, epochs = [], set()
    for line in lines:
        try:
            row = json.loads(line)
            epoch = int(row["epoch"])
        except (ValueError, TypeError, KeyError):
            continue
        if epoch < done and epoch not in epochs:
            kept.append(line)
            epochs.add(epoch)
    last = state.get("metrics") or {}
    if done > 0 and (done - 1) not in epochs and last.get("epoch") == done - 1:
        kept.append(json.dumps(last))
        _logger.warning("%s lacked epoch %d's line (a run stopped after its checkpoint): restored from it",
                        path, done - 1)
    if kept != lines:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(f"{line}\n" for line in kept), encoding="utf-8")
        tmp.replace(path)


def check_run(cfg: TrainConfig, resume: Optional[str] = None) -> None:
    """Check everything a run takes from the user before anything is written: the config beyond its
    schema (:func:`fedmjp.trainconfig.check_config`: model, optimizer, schedule, augmentation policy,
    device), the data path, that the output dir can be created and written, and ``resume``.

    Raises:
        ValueError (:class:`fedmjp.config.ConfigError`): the key or path, what it takes and what it got.
    """
    check_config(cfg)
    _check_data_path(cfg.data_path)
    check_output_dir(cfg.output_dir, "config key 'output_dir'")
    if resume and not Path(resume).is_file():
        raise ConfigError(f"--resume {resume}: no such checkpoint file (default: <output_dir>/last.pth when present)")


def _check_data_path(data_path: Optional[str]) -> None:
    """The data path exists and is an archive or a folder with class folders in train/ and val/
    (an archive's content is checked when it is extracted: :class:`ArchiveError`)."""
    if data_path is None:
        raise ConfigError(f"config key 'data_path' is not set: pass --data-path, {_DATA_HELP}")
    try:
        path = Path(datadir.expand(data_path, "data_path"))
    except datadir.DataDirUnset as err:
        raise ConfigError(f"config key 'data_path': {err}") from None
    if not path.exists():
        raise ConfigError(f"config key 'data_path': {path} does not exist; pass {_DATA_HELP}")
    if path.is_file():
        if not path.name.endswith(ARCHIVE_SUFFIXES):
            raise ConfigError(f"config key 'data_path': {path} is a file but not a {'/'.join(ARCHIVE_SUFFIXES)} "
                              f"archive; pass {_DATA_HELP}")
        return
    try:
        root = find_imagefolder_root(path)
        for split in ("train", "val"):
            folder = root / split
            if not folder.is_dir() or not any(d.is_dir() for d in folder.iterdir()):
                what = "holds no class folders" if folder.is_dir() else "does not exist"
                raise ConfigError(f"config key 'data_path': {folder} {what}; pass {_DATA_HELP}")
    except (FileNotFoundError, PermissionError) as err:  # no train/ folder; an unreadable folder
        raise ConfigError(f"config key 'data_path': {err}; pass {_DATA_HELP}") from None


def run_training(cfg: TrainConfig, resume: Optional[str] = None, progress: bool = True,
                 allow_config_change: bool = False) -> TrainResult:
    """Train ``cfg`` end to end (resuming from ``resume`` or ``<output_dir>/last.pth``).

    Joins the torchrun process group when ``WORLD_SIZE`` > 1 (or uses one the caller opened).
    Nothing is written before the config, the data and the model are checked and built.

    Raises:
        ValueError (:class:`fedmjp.config.ConfigError`): a bad value (:func:`check_run`), or
            ``num_classes`` below the data's class count; :class:`fedmjp.archives.ArchiveError`: a
            data archive that cannot be used. Nothing is written then.
    """
    check_run(cfg, resume)
    info = init_distributed(cfg.device)
    out = Path(cfg.output_dir)
    created, lock_existed = not out.exists(), os.path.lexists(out / LOCK)
    lock = None
    try:
        if info.is_main:  # before the data and the model are built: a second run fails at once
            lock = _lock_output(out)
        return _train(cfg, info, resume, progress, allow_config_change)
    except (ConfigError, ArchiveError):
        if lock is not None:  # nothing was written: leave nothing that only the lock made
            release_lock(lock)
            lock = None
            if not lock_existed:
                (out / LOCK).unlink(missing_ok=True)
            if created:
                try:
                    out.rmdir()
                except OSError:
                    pass
        raise
    finally:
        release_lock(lock)
        if info.owns_group:
            dist.destroy_process_group()


def _lock_output(out: Path) -> IO[str]:
    """Take ``out``'s lock for this training (created with the folder).

    Raises:
        OutputDirLocked: another training holds it.
        ValueError (:class:`fedmjp.config.ConfigError`): the lock file is a link or cannot be made.
    """
    try:
        return take_lock(out)
    except FolderLocked as err:
        raise OutputDirLocked(f"--output-dir {out} is in use by another training{f' ({err.owner})' if err.owner else ''}"
                              "; wait for it to end or use another --output-dir") from None
    except FolderLockLink:
        raise ConfigError(f"--output-dir {out}: {LOCK} is a symbolic link, which training never writes through; "
                          "remove it or use another --output-dir") from None
    except OSError as err:
        raise ConfigError(f"--output-dir {out}: cannot create its {LOCK} ({err.strerror or err})") from None


def _train(cfg: TrainConfig, info: DistInfo, resume: Optional[str], progress: bool,
           allow_config_change: bool = False) -> TrainResult:
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    out = Path(cfg.output_dir)  # created once data, model, optimizer and schedule are built
    assert cfg.data_path is not None  # check_run
    if info.is_main:  # rank 0 extracts archives; the others wait and then find the marker
        root = resolve_data_path(cfg.data_path, cfg.data_cache)
    if info.distributed:
        dist.barrier()
    if not info.is_main:
        root = resolve_data_path(cfg.data_path, cfg.data_cache)
    train_set, val_set, n_classes = build_datasets(cfg, root)
    if cfg.num_classes is not None and cfg.num_classes < n_classes:
        raise ConfigError(f"config key 'num_classes' is {cfg.num_classes}, but {root / 'train'} has {n_classes} class "
                          f"folders; set it to >= {n_classes}, or null for the folder count")
    num_classes = cfg.num_classes or n_classes
    train_loader, val_loader = build_loaders(cfg, train_set, val_set, info.rank, info.world_size,
                                             pin_memory=info.device.type == "cuda")
    steps_per_epoch = len(train_loader) if cfg.max_steps_per_epoch is None else min(
        len(train_loader), cfg.max_steps_per_epoch)
    if steps_per_epoch == 0:
        raise ConfigError(f"config key 'batch_size' is {cfg.batch_size}, but the training set holds {len(train_set)} "
                          "image(s): no training step; lower batch_size or add images")

    seed_everything(cfg.seed)  # same init on every rank (DDP also broadcasts rank 0's weights)
    kwargs = model_kwargs(cfg, num_classes)
    try:
        model = create_model(cfg.model, **kwargs).to(info.device)
    except ValueError as err:  # kwargs the model cannot take or whose parameters would not fit
        raise ConfigError(f"config keys 'model', 'img_size', 'num_classes', 'model_kwargs': {err}") from None
    mjp_model = isinstance(model, MJPVisionTransformer)
    lr, warmup_lr, min_lr = scaled_lrs(cfg, info.world_size)
    # Passing the module lets timm honour model.no_weight_decay() (PE, cls token, E_unk; not the
    # PE with pe_init=official) and skip decay on biases and norms.
    optimizer = create_optimizer_v2(model, opt=cfg.opt, lr=lr, weight_decay=cfg.weight_decay, eps=cfg.opt_eps)
    scheduler = build_schedule(optimizer, cfg, steps_per_epoch, warmup_lr, min_lr)
    dtype = amp_dtype(cfg.amp, info.device)
    scaler = torch.amp.GradScaler(info.device.type) if dtype == torch.float16 else None

    start_epoch, global_step = 0, 0
    ckpt_path = _resume_path(cfg, resume)
    state: Optional[dict] = None
    changes: dict[str, tuple] = {}
    if ckpt_path is not None:
        state = load_checkpoint_state(ckpt_path, info.device)
        changes = check_resume(state, cfg, ckpt_path, allow_config_change)
        try:
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            scheduler.load_state_dict(state["scheduler"])
            if scaler is not None and state.get("scaler"):
                scaler.load_state_dict(state["scaler"])
            start_epoch, global_step = int(state["epoch"]), int(state["step"])
        except (RuntimeError, ValueError, KeyError, TypeError) as err:
            first = (str(err).strip().splitlines() or [type(err).__name__])[0][:300]
            raise ConfigError(f"--resume {ckpt_path}: its state does not fit this config's model, optimizer or "
                              f"schedule ({first}); resume with the config it was trained with, or use another "
                              "--output-dir") from None
        if changes:
            _logger.warning("resuming with config changes from epoch %d (checkpoint, now): %s", start_epoch, changes)
        _logger.info("resumed from %s at epoch %d, step %d", ckpt_path, start_epoch, global_step)
    scheduler.step_update(num_updates=global_step)

    step_module: nn.Module = TrainStep(model)
    if info.distributed:
        # MJP steps leave parameters unused (E_unk on unshuffled steps; ranks shuffle independently).
        step_module = nn.parallel.DistributedDataParallel(
            step_module, device_ids=[info.local_rank] if info.device.type == "cuda" else None,
            find_unused_parameters=mjp_model)
    mixup = build_mixup(cfg, num_classes)
    ctx = StepContext(optimizer=optimizer, criterion=_criterion(cfg, mixup is not None), device=info.device,
                      info=info, scheduler=scheduler, mixup=mixup, scaler=scaler, amp_dtype=dtype,
                      clip_grad=cfg.clip_grad, max_steps=steps_per_epoch, log_interval=cfg.log_interval,
                      progress=progress)
    if info.is_main:
        out.mkdir(parents=True, exist_ok=True)
        history = _config_history(out / "config.yaml") if state is not None else []
        if changes:
            history.append({"from_epoch": start_epoch, "changes": {k: list(v) for k, v in changes.items()}})
        record = {**cfg.to_dict(), "resolved_lr": lr, "world_size": info.world_size}
        if history:
            record["config_changes"] = history
        with open(out / "config.yaml", "w") as f:
            yaml.safe_dump(record, f, sort_keys=False)
        if state is not None:
            reconcile_metrics(out / "metrics.jsonl", state)
        _logger.info("training %s (%s) on %d images, %d classes, %d steps/epoch, lr %.3g, world %d, %s",
                     cfg.model, cfg.variant if mjp_model else "timm", len(train_set), num_classes,
                     steps_per_epoch, lr, info.world_size, info.device)

    metrics: dict = {}
    last = out / "last.pth"
    end_epoch = cfg.epochs if cfg.stop_epoch is None else min(cfg.epochs, cfg.stop_epoch)
    for epoch in range(start_epoch, end_epoch):
        sampler = train_loader.sampler
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)
        seed = epoch_seed(cfg.seed, info.rank, epoch)
        seed_everything(seed)
        if mjp_model:
            model.set_seed(seed)  # epoch 0: seed + rank
        ctx.dal_lambda = dal_weight(epoch, cfg.epochs, cfg.dal_lambda, cfg.dal_final, cfg.warmup_epochs,
                                    cfg.dal_schedule)
        ctx.shuffle = epoch >= cfg.shuffle_start_epoch
        stats, global_step = train_one_epoch(step_module, train_loader, ctx, epoch, global_step)
        metrics = {"epoch": epoch, "step": global_step, **stats, "dal_lambda": ctx.dal_lambda,
                   "shuffle": ctx.shuffle}
        if (epoch + 1) % max(cfg.eval_every, 1) == 0 or epoch + 1 == cfg.epochs:
            metrics.update(validate(model, val_loader, info.device, info, dtype))
        if info.is_main:
            save_checkpoint(last, {
                "format": CHECKPOINT_FORMAT, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict() if scaler else None,
                "epoch": epoch + 1, "step": global_step, "model_name": cfg.model, "model_kwargs": kwargs,
                "config": cfg.to_dict(), "metrics": metrics,
            })
            with open(out / "metrics.jsonl", "a") as f:
                f.write(json.dumps(metrics) + "\n")
            _logger.info("epoch %d: %s", epoch, json.dumps({k: (round(v, 4) if isinstance(v, float) else v)
                                                            for k, v in metrics.items()}))
        if info.distributed:
            dist.barrier()  # nobody races ahead of the checkpoint write
    return TrainResult(model=model, metrics=metrics, checkpoint=last, rank=info.rank)


def _config_history(path: Path) -> list:
    """The ``config_changes`` list of an earlier run's config.yaml (empty where there is none)."""
    try:
        saved = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError):
        return []
    history = saved.get("config_changes") if isinstance(saved, dict) else None
    return list(history) if isinstance(history, list) else []


def parse_args(argv: Optional[list[str]] = None) -> tuple[argparse.Namespace, dict]:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Any other --key value pair overrides that config key (see fedmjp/trainconfig.py and\n"
               "docs/training.md), e.g. --gamma 0.2 --epochs 5.\n\n"
               "Every value is checked before anything is written. Exit status:\n"
               "  0  trained (or exported)\n"
               f"  {EXIT_BAD_CONFIG}  a bad argument, config file, config key or value, data path, output dir or\n"
               "     --resume file: one line 'error: ...' on stderr naming it, nothing written\n"
               "     (also: --export could not read or write its files)\n"
               f"  {EXIT_LOCKED}  another training holds --output-dir (its .lock); nothing written\n"
               "  1  an unexpected error during training (a traceback)")
    p.add_argument("--config", help="YAML file under configs/train/")
    p.add_argument("--data-path", help="ImageFolder root with train/ and val/, or a .tar.gz of one")
    p.add_argument("--output-dir", help="checkpoints and metrics.jsonl (default: the config's output_dir)")
    p.add_argument("--resume", help="checkpoint to resume from (default: <output_dir>/last.pth if present)")
    p.add_argument("--allow-config-change", action="store_true",
                   help="resume although a key that changes the training differs from the checkpoint's (the "
                        "change is recorded in config.yaml with its epoch)")
    p.add_argument("--no-progress", action="store_true", help="no tqdm bar (background runs)")
    p.add_argument("--export", metavar="CHECKPOINT", help="instead of training: write CHECKPOINT's weights "
                   "(float16 safetensors, architecture in the header) to --to")
    p.add_argument("--to", metavar="FILE.safetensors", help="output of --export")
    p.add_argument("--source-commit", help="with --export: the commit that trained it, kept in the header")
    args, rest = p.parse_known_args(argv)
    if args.export and (not args.to or not args.to.endswith(".safetensors")):
        p.error("--export needs --to FILE.safetensors")
    overrides = parse_overrides(rest)
    if args.data_path:
        overrides["data_path"] = args.data_path
    if args.output_dir:
        overrides["output_dir"] = args.output_dir
    return args, overrides


def _bad_config(err: Exception) -> int:
    """Print ``err`` as one line on stderr and return :data:`EXIT_BAD_CONFIG`."""
    print(f"error: {' '.join(str(err).splitlines())}", file=sys.stderr)
    return EXIT_BAD_CONFIG


def main(argv: Optional[list[str]] = None) -> int:
    try:
        args, overrides = parse_args(argv)
    except ConfigError as err:  # an item that is no --key value, an unknown key, a bad value
        return _bad_config(err)
    if args.export:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
        escape_log_output()  # untrusted names in log records are printed escaped
        try:
            out = export_weights(args.export, args.to, source_commit=args.source_commit)
        except (OSError, ValueError, RuntimeError) as err:
            _logger.error("cannot export %s: %s", args.export, err)
            return 2
        _logger.info("wrote %s (%.1f MB)", out, out.stat().st_size / 2**20)
        return 0
    try:
        cfg = load_config(args.config, overrides)
        check_run(cfg, args.resume)
    except ConfigError as err:
        return _bad_config(err)
    tune_malloc()
    rank0 = os.environ.get("RANK", "0") == "0"
    logging.basicConfig(level=logging.INFO if rank0 else logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    escape_log_output()  # untrusted names in log records are printed escaped
    try:
        result = run_training(cfg, resume=args.resume, progress=not args.no_progress,
                              allow_config_change=args.allow_config_change)
    except OutputDirLocked as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_LOCKED
    except (ConfigError, ArchiveError) as err:  # found in the data (num_classes, an archive): nothing written
        return _bad_config(err)
    if result.rank == 0:
        _logger.info("done: %s", result.checkpoint)
    return 0


if __name__ == "__main__":
    sys.exit(main())
