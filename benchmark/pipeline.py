"""The benchmark pipeline: federated rounds -> attack every tapped update -> score -> results.jsonl.

One federation runs per (model row, gradient group): setting (a) attacks gradients of x, settings (b)
and (c) the same gradient of x~ (docs/design.md, "Threat model and the settings (a), (b), (c)"), so
``--setting all`` runs two federations per
row and scores the (b)/(c) reconstruction twice, against x~ and against x.

Data flow, one way: the server's tap hands each client update (round, node, partition, gradients,
global weights) to the attacker; the ground truth x, x~ reaches the scorer by a separate path,
:func:`clients.partition.private_batch`, which the attack never sees. Every scored image is appended to
``results.jsonl`` at once; a re-run skips stored rows (and whole federations whose rows are all
stored), so an interrupted run resumes where it stopped.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from tqdm.auto import tqdm

from fedmjp.data import DataError, ImageSet, load_images
from fedmjp.devices import resolve_device
from fedmjp.settings import SETTING_GROUPS
from fedmjp.text import printable

from . import scoring
from .config import BenchmarkConfig
from .entries import LabelledAttack, attack_entries, model_spec
from .errors import (
    AttackErrors,
    ConfigError,
    FederationFailed,
    InputDataError,
    ModelCheckpointError,
)
from .group_attacker import GroupAttacker
from .inputs import Attacker, ModelRow, Prepared, client_run_config, expected_updates
from .pictures import write_distributions, write_grids
from .rows import RowKey
from .secure_aggregation import tapped_batch
from .store import RunFolder
from .tables import Tables, write_tables

_logger = logging.getLogger(__name__)

@dataclass
class RunSummary:
    """What a run produced (paths are inside the output folder)."""

    folder: str
    new_rows: int
    kept_rows: int
    failed_rows: int
    federations: int
    error_rows: int
    seconds: float
    tables: Tables
    grids: list[str] = field(default_factory=list)
    client_failed_rows: int = 0  # rows of client updates that never reached the attacker


def pick_device(name: str) -> torch.device:
    """``auto`` -> CUDA when present, else CPU; a bad name is a :class:`ConfigError` (exit status)."""
    try:
        return resolve_device(name)
    except ValueError as err:
        raise ConfigError(f"{err} (--device)") from err


# ------------------------------------------------------------------------------------ preparation
def load_attack_images(cfg: BenchmarkConfig) -> ImageSet:
    """The attack image set; lists skipped files. Raises InputDataError."""
    data = cfg.data
    try:
        images = load_images(data.source, data.image_size, data.num_images, data.num_classes,
                             on_corrupt=data.on_corrupt)
    except DataError as err:
        raise InputDataError(str(err)) from err
    if images.skipped:
        _logger.warning("skipped %d file(s) of the image folder: %s", len(images.skipped),
                        "; ".join(f"{printable(path)} ({printable(why)})" for path, why in images.skipped))
    n_needed = cfg.federation.clients
    if len(images) < n_needed:
        raise InputDataError(f"{len(images)} usable image(s) cannot be split over {n_needed} clients; "
                             "add images or lower --clients")
    per_client, batch = len(images) // n_needed, cfg.federation.batch_size
    if batch > per_client:  # a batch holds distinct images; more would repeat them (and its memory)
        raise ConfigError(f"federation.batch_size is {batch}, but {len(images)} image(s) over {n_needed} clients "
                          f"leave {per_client} per client; lower federation.batch_size to <= {per_client}, "
                          "add images (data.num_images) or lower --clients")
    return images


def build_rows(cfg: BenchmarkConfig, device: torch.device) -> list[ModelRow]:
    """Build every model row (checkpoints loaded, APRIL surgery applied). Raises on bad rows."""
    from fedmjp.checkpoint import CheckpointError
    from fedmjp.factory import build_model

    rows = []
    for index, row in enumerate(cfg.models):
        spec = model_spec(cfg, index)
        try:
            model = build_model(spec, device=device)
        except CheckpointError as err:
            hint = f"; run_benchmark.py --train-missing trains it with {row.recipe}" if row.recipe else ""
            raise ModelCheckpointError(f"model row {row.name!r}: {err}{hint}") from err
        except (TypeError, ValueError) as err:  # timm: unknown or ill-typed constructor kwargs
            raise ConfigError(f"model row {row.name!r}: {err}") from err
        # ignores: torch types every attribute nn.Module.__getattr__ could serve as Tensor | Module, but
        # img_size and num_classes are plain attributes (a tuple, an int) of a timm-style ViT; an
        # isinstance check for timm's classes would refuse plug-in models this duck typing takes.
        size = tuple(model.patch_embed.img_size)  # type: ignore[union-attr, arg-type]
        if size != (cfg.data.image_size,) * 2:
            raise ConfigError(f"model row {row.name!r} takes {size[0]}x{size[1]} images but data.image_size is "
                              f"{cfg.data.image_size}; make them equal")
        if model.num_classes < cfg.data.num_classes:  # type: ignore[operator]
            raise ConfigError(f"model row {row.name!r} has {model.num_classes} classes, fewer than "
                              f"data.num_classes={cfg.data.num_classes}")
        acc_model = None
        if spec["april"] == "surgery":  # the unmodified model (same seed/checkpoint) for the Acc. column
            acc_model = build_model({**spec, "april": None}, device=device)
        rows.append(ModelRow(index, row.name, row.label or row.name, spec, model, bool(spec["checkpoint"]),
                             acc_model))
    return rows


def prepare(cfg: BenchmarkConfig) -> Prepared:
    """Load data, build models and attack and metrics: every input problem surfaces here."""
    import attacks

    from .training import train_jobs

    device = pick_device(str(cfg.device))
    for job in train_jobs(cfg):
        if 0 < job.epochs_done < job.epochs_wanted:  # a stopped training run: never attack half a model
            raise ModelCheckpointError(f"model row {job.row!r}: {job.checkpoint} holds {job.epochs_done} of the "
                                       f"{job.epochs_wanted} epochs of {job.recipe}; run_benchmark.py "
                                       "--train-missing finishes it")
    images = load_attack_images(cfg)
    rows = build_rows(cfg, device)
    attackers = []
    remote = int(cfg.attack_workers) >= 1 or bool(cfg.ray_address)
    for entry in attack_entries(cfg):
        try:
            options = attack_options_on(entry, device, remote)
            attackers.append(Attacker(entry.label, entry.name, attacks.create_attack(entry.name, **options)))
        except (TypeError, ValueError) as err:  # unknown or ill-typed options
            raise ConfigError(f"attack {entry.label!r}: {err} (attack options)") from err
    scorer = make_scorer(cfg, device)
    scorer.set_pool(images.images, images.labels)  # the identifiability columns' candidates
    check_partitions(cfg, rows[0])
    if cfg.ray_address:
        from .workers import check_ray_address

        check_ray_address(str(cfg.ray_address))  # an unreachable cluster fails here, before any work
    from .provenance import images_record

    return Prepared(cfg, device, images.names, images_record(images.images, images.labels, images.names), rows,
                    attackers, scorer)


def attack_options_on(entry: LabelledAttack, device: torch.device, remote: bool = False) -> dict[str, Any]:
    """The options an attacker is built with: its entry's, plus ``device`` = the run's device where
    the attack declares a ``device`` option and the entry sets none (an entry's own ``device`` wins).

    ``remote`` (attacks on Ray workers): a CUDA device is passed as ``cuda``, the GPU Ray gives
    each worker (it sets the worker's ``CUDA_VISIBLE_DEVICES``, so that GPU is the worker's ``cuda:0``).

    Raises:
        ValueError: an unknown attack name (the valid ones listed).
    """
    from attacks.api.registry import attack_class, option_schema

    options = dict(entry.options)
    if "device" not in options and "device" in option_schema(attack_class(entry.name)).model_fields:
        options["device"] = "cuda" if remote and device.type == "cuda" else str(device)
    return options


def make_scorer(cfg: BenchmarkConfig, device: torch.device) -> scoring.Scorer:
    """The run's scorer; an LPIPS weights file that cannot be loaded (random bytes, a pickle of
    other objects, a state dict of another network) is a :class:`ConfigError` naming it."""
    import pickle

    from fedmjp.checkpoint import load_error_text

    try:
        return scoring.Scorer(device, cfg.metrics.model_dump())
    except (pickle.UnpicklingError, RuntimeError, KeyError, ValueError, EOFError, OSError) as err:
        backbone = cfg.metrics.lpips_backbone
        if not backbone:
            raise
        raise ConfigError(f"LPIPS weights file {backbone} cannot be used: {load_error_text(err)} "
                          "(metrics.lpips_backbone; point it at AlexNet features weights, or --set "
                          "metrics.lpips=false to leave the column out)") from err


def check_partitions(cfg: BenchmarkConfig, row: ModelRow) -> None:
    """The clients' partitioning works for this image set (a Dirichlet split of too few images per
    class fails): found here, before the output folder is written, not inside a client."""
    from clients.partition import private_batch

    run_config = client_run_config(cfg, row, "clean")
    try:
        private_batch(run_config, 0, 1, cfg.federation.clients)
    except ValueError as err:
        raise ConfigError(f"federation.partition={cfg.federation.partition!r}: {err}") from err


# ------------------------------------------------------------------------------------ federation
def expected_keys(cfg: BenchmarkConfig, row: ModelRow, group: str, settings: list[str]) -> set[RowKey]:
    """Row keys a complete federation of this (row, group) stores (from the private batches)."""
    resolved = client_run_config(cfg, row, group)
    keys = set()
    for rnd, part in expected_updates(cfg):
        batch = tapped_batch(resolved, part, rnd, cfg.federation.clients)
        for b, image_id in enumerate(batch.image_ids):
            for s in settings:
                for entry in attack_entries(cfg):
                    keys.add(RowKey(row.name, entry.label, s, rnd, part, b, image_id))
    return keys


def run_benchmark(cfg: BenchmarkConfig, output: str, federate: Callable[..., Any] | None = None,
                  progress: bool = True, batched: bool = True, force: bool = False) -> RunSummary:
    """Run (or resume) a benchmark into ``output``; write tables and grids at the end.

    Args:
        cfg: a validated config (:func:`benchmark.config.validate`).
        output: the output folder; a stored config must equal ``cfg``.
        federate: the federation runner (default :func:`server.federation.run_federation`).
        progress: show tqdm bars.
        batched: attack each round's updates in one ``reconstruct_many`` call per attacker (False:
            one ``reconstruct`` call per update; the same rows, slower).
        force: write into a non-empty folder that is not a run folder (``--force``; benchmark/store.py).
    Raises:
        BenchmarkError subclasses for bad input (before any work) and a failed federation.
    """
    from fedmjp.checkpoint import read_once

    t0 = time.perf_counter()
    run = RunFolder(output, force=force)
    run.check(cfg)  # a conflicting folder fails before any loading
    # each checkpoint is read once for the whole run: the model rows, every federation's global model
    # and provenance.json all take the state and hash of that one read
    with read_once():
        prepared = prepare(cfg)  # every bad input fails here, before the folder is touched
        from .provenance import collect

        run.init(cfg, collect(cfg, prepared.device, prepared.images_record))
        try:
            return _run_locked(cfg, run, prepared, federate, progress, t0, batched)
        finally:
            run.unlock()


def _run_locked(cfg: BenchmarkConfig, run: RunFolder, prepared: Prepared, federate: Callable[..., Any] | None,
                progress: bool, t0: float, batched: bool = True) -> RunSummary:
    """The body of :func:`run_benchmark`, with the folder locked."""
    from .workers import make_runner

    done = run.done_keys()
    kept = len(done)
    if kept:
        _logger.info("resuming %s: %d stored row(s) kept", run.folder, kept)
    groups = sorted({SETTING_GROUPS[s] for s in cfg.settings}, key=["clean", "shuffled"].index)
    jobs = [(row, g) for row in prepared.rows for g in groups]
    quiet_flower(_logger.isEnabledFor(logging.DEBUG))
    new_rows = failed = federations = errors = client_failed = 0
    bar = tqdm(jobs, desc="federations", unit="fed", disable=None if progress else True)  # None: off a terminal
    runner = None
    try:
        for row, group in bar:
            bar.set_postfix_str(f"{row.name} ({group})")
            settings = [s for s in cfg.settings if SETTING_GROUPS[s] == group]
            todo = expected_keys(cfg, row, group, settings) - done
            if not todo:
                _logger.info("%s/%s: all rows stored, federation skipped", row.name, group)
                continue
            if runner is None:  # Ray workers start only when there is work for them
                runner = make_runner([a.attack for a in prepared.attackers], int(cfg.attack_workers),
                                     cfg.ray_address, prepared.device)
            attacker = GroupAttacker(prepared, run, row, group, settings, done, progress, runner, batched)
            federations += 1
            attacker.run(federate)
            new_rows += attacker.new_rows
            failed += attacker.failed_rows
            errors += attacker.error_rows
            client_failed += attacker.client_failed_rows
    finally:
        if runner is not None:
            runner.close()
        _shutdown_ray()
    tables = write_tables(run)
    grids = write_grids(run, cfg.settings, cfg.report.grid_images, cfg.report.tile)
    grids += write_distributions(run, cfg.settings)
    from .report import write_report

    write_report(run.folder)  # report.html: verdict, table, pictures, failures, command, provenance
    return RunSummary(str(run.folder), new_rows, kept, failed, federations, errors, time.perf_counter() - t0,
                      tables, [str(g) for g in grids], client_failed)


def raise_for_errors(summary: RunSummary) -> None:
    """After a finished run: :class:`AttackErrors` (exit status 8) if any attack raised an
    unexpected error; its rows are stored as failures and the tracebacks are in ``errors/``.
    :class:`FederationFailed` (exit status 7) if client updates never reached the attacker: their
    rows are stored failed with the reason and the same command resumes them."""
    if summary.error_rows:
        raise AttackErrors(f"{summary.error_rows} row(s) failed on an unexpected attack error (a bug, not a "
                           f"condition failure); tracebacks: {summary.folder}/errors/. The tables were written "
                           "but count these rows as failures: fix the attack and re-run into a new folder")
    if summary.client_failed_rows:
        raise FederationFailed(f"{summary.client_failed_rows} row(s) are marked failed because their client update "
                               "never reached the attacker (a client raised, timed out or dropped out; the reasons are "
                               f"in the rows' 'reason' of {summary.folder}/results.jsonl). The tables were written; run "
                               "the same command again to resume: those rows are tried again, the others are kept")


def _shutdown_ray() -> None:
    """Stop the Ray instance kept up across federations (simulation engine), if any."""
    import sys

    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()


def quiet_flower(verbose: bool = False) -> None:
    """Flower sets its own logger to INFO on import and prints every round's summary; keep it at
    WARNING unless verbose (its own handler prints, so do not propagate twice)."""
    import flwr  # noqa: F401  (configures its logger on import)

    log = logging.getLogger("flwr")
    log.setLevel(logging.DEBUG if verbose else logging.WARNING)
    log.propagate = False
