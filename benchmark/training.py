"""Checkpoints a benchmark needs, trained on demand (``run_benchmark.py --train-missing``).

A model row may name the training recipe that produces its checkpoint (``recipe:
configs/train/cifar_vit.yaml``). With ``--train-missing`` every such row whose checkpoint is missing,
or holds fewer epochs than its recipe asks for (a training run that was stopped), is trained first
with :func:`fedmjp.train.run_training` into the checkpoint's folder. Training resumes from that
folder's ``last.pth``, so an interrupted ``--train-missing`` run continues where it stopped, and a
finished checkpoint is never trained again.

A row whose checkpoint is a ``.safetensors`` file (the weights shipped in ``checkpoints/``) counts as
finished while that file exists; without it, ``--train-missing`` trains the recipe into the recipe's
``output_dir`` (resuming from its ``last.pth``) and then writes the weights file
(:func:`fedmjp.trainutils.export_weights`).

Without ``--train-missing``, a recipe row whose checkpoint does not exist yet (no training started)
is left out of the run with a one-line note naming the row and the flag
(:func:`leave_out_untrained`), and the other rows are attacked; a row whose training stopped part way
still fails the run (a half-trained model is never attacked), and so does a run that would be left
with no row.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from fedmjp import datadir

from .errors import ConfigError, InputDataError, ModelCheckpointError

if TYPE_CHECKING:
    from .config import BenchmarkConfig

_logger = logging.getLogger(__name__)


@dataclass
class TrainJob:
    """One model row's checkpoint and how far its training got."""

    row: str
    recipe: Path
    checkpoint: Path
    epochs_done: int
    epochs_wanted: int
    export_to: Optional[Path] = None  # the row's .safetensors file, written from ``checkpoint`` when trained

    @property
    def done(self) -> bool:
        return self.epochs_done >= self.epochs_wanted


def checkpoint_epochs(path: Path) -> int:
    """Epochs a fedmjp.train checkpoint holds (0 when absent); other formats count as finished."""
    from fedmjp.trainutils import load_checkpoint_state

    if not path.is_file():
        return 0
    try:
        state = load_checkpoint_state(path)
    except (ValueError, RuntimeError, OSError) as err:
        raise ModelCheckpointError(f"checkpoint {path} cannot be read ({err}); delete it to train it again") from err
    return int(state.get("epoch", 10 ** 9))


def train_jobs(cfg: BenchmarkConfig) -> list[TrainJob]:
    """A job for every model row with a ``recipe`` (validated: recipe loads, checkpoint is last.pth)."""
    from fedmjp.trainconfig import load_config

    jobs = []
    for row in cfg.models:
        if not row.recipe:
            continue
        recipe, ckpt = Path(row.recipe), row.checkpoint
        if not ckpt or (Path(ckpt).name != "last.pth" and Path(ckpt).suffix != ".safetensors"):
            raise ConfigError(f"model row {row.name!r} names a recipe, so its checkpoint must be "
                              f"<folder>/last.pth (where fedmjp.train writes) or a .safetensors weights file, "
                              f"got {ckpt!r}")
        try:
            recipe_cfg = load_config(recipe)
        except (OSError, ValueError, TypeError) as err:
            raise ConfigError(f"model row {row.name!r}: training recipe {recipe}: {err}") from err
        epochs = int(recipe_cfg.epochs)
        if Path(ckpt).suffix == ".safetensors":  # shipped weights: finished while the file exists
            from .config import PROJECT_ROOT

            out_dir = Path(recipe_cfg.output_dir)  # a relative one is the project's, as in the config's paths
            last = (out_dir if out_dir.is_absolute() else PROJECT_ROOT / out_dir) / "last.pth"
            done = epochs if Path(ckpt).is_file() else checkpoint_epochs(last)
            jobs.append(TrainJob(str(row.name), recipe, last, done, epochs, export_to=Path(ckpt)))
            continue
        jobs.append(TrainJob(str(row.name), recipe, Path(ckpt), checkpoint_epochs(Path(ckpt)), epochs))
    return jobs


def train_missing(cfg: BenchmarkConfig, progress: bool = True) -> list[TrainJob]:
    """Train every recipe row whose checkpoint is missing or unfinished; returns the jobs trained.

    Raises:
        ConfigError: no ``train_data`` for the recipes, or a bad recipe.
    """
    from fedmjp.train import check_run, run_training
    from fedmjp.trainconfig import load_config

    todo = [job for job in train_jobs(cfg) if not job.done]
    if not todo:
        return []
    data: Optional[str] = cfg.train_data
    try:
        data = datadir.expand(data, "train_data") if data else data
    except datadir.DataDirUnset as err:
        raise InputDataError(str(err)) from None
    if not data or not Path(data).exists():
        raise ConfigError(f"--train-missing needs the training data of the recipes: train_data={data!r} does not "
                          "exist (set train_data in the config or --set train_data=PATH to an ImageFolder or "
                          ".tar.gz with train/ and val/)")
    # every job's config, model, schedule, data and output folder checked before the first trains (a
    # bad last recipe must not surface after hours of training the others)
    configs = []
    for job in todo:
        train_cfg = load_config(job.recipe, {"data_path": str(data), "output_dir": str(job.checkpoint.parent)})
        try:
            check_run(train_cfg)
        except ValueError as err:
            raise ConfigError(f"model row {job.row!r}: training recipe {job.recipe}: {err}") from None
        configs.append(train_cfg)
    for i, (job, train_cfg) in enumerate(zip(todo, configs), 1):
        _logger.info("training %s (%d/%d) with %s into %s%s", job.row, i, len(todo), job.recipe,
                     job.checkpoint.parent,
                     f", resuming at epoch {job.epochs_done}" if job.epochs_done else "")
        run_training(train_cfg, progress=progress)
        job.epochs_done = checkpoint_epochs(job.checkpoint)
        if job.export_to is not None and job.done:
            from fedmjp.trainutils import export_weights

            export_weights(job.checkpoint, job.export_to)
            _logger.info("wrote %s from %s", job.export_to, job.checkpoint)
    return todo


def leave_out_untrained(cfg: BenchmarkConfig) -> list[str]:
    """Remove from ``cfg.models`` every recipe row whose checkpoint has not been trained at all.

    Returns one note per row left out, naming the row, its checkpoint and ``--train-missing``. When
    every row would go, none is removed (and no note returned): building the rows then fails with
    the error that says how to get the checkpoints.
    """
    with_recipe = [row for row in cfg.models if row.recipe]  # train_jobs' rows, in its order
    untrained = {id(row): job for row, job in zip(with_recipe, train_jobs(cfg))
                 if job.epochs_done == 0 and not job.done}
    if not untrained or len(untrained) == len(cfg.models):
        return []
    notes = [f"model row {job.row!r} left out: its checkpoint {job.export_to or job.checkpoint} does not exist; "
             f"run_benchmark.py --train-missing trains it with {job.recipe}" for job in untrained.values()]
    cfg.models = [row for row in cfg.models if id(row) not in untrained]
    return notes
