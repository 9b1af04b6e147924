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
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from tqdm.auto import tqdm

from fedmjp.data import DataError, ImageSet, load_images
from fedmjp.devices import resolve_device

from . import scoring
from .aggregates import tapped_batch, tapped_partitions
from .config import (
    SETTING_GROUPS,
    BenchmarkConfig,
    LabelledAttack,
    attack_entries,
    client_values,
    model_spec,
    row_defence,
)
from .errors import (
    AttackErrors,
    ConfigError,
    FederationFailed,
    InputDataError,
    ModelCheckpointError,
)
from .pictures import write_distributions, write_grids
from .tables import Tables, write_tables
from .rows import RowContext, RowKey, client_failure_rows
from .store import RunFolder, slug

if TYPE_CHECKING:
    from attacks.base import AttackMetadata
    from clients.runconfig import RunConfig

    from .workers import Runner

_logger = logging.getLogger(__name__)

GROUP_SETTING = {"clean": "a", "shuffled": "c"}  # the setting the clients are told (b == c on the client)
_END, _ABORT = object(), object()  # what the federation's end tells the attack thread


@dataclass
class ModelRow:
    """One model row: its config, factory spec and the server's copy of the model.

    ``model`` is what the attacks see (with ``april: surgery``: block 0 without norm1 and attention
    residual); ``acc_model`` is the model as trained (block 0 unmodified), on which the Acc. column is
    measured, or None when ``model`` is already the model as trained.
    """

    index: int
    name: str
    label: str
    spec: dict
    model: nn.Module
    trained: bool
    acc_model: nn.Module | None = None


@dataclass
class Attacker:
    """One attacker of the run: its ``attack`` column value, registry name and the attack object."""

    label: str
    name: str
    attack: Any


@dataclass
class Prepared:
    """Everything checked before any work starts (bad input fails here, not mid-run)."""

    cfg: BenchmarkConfig
    device: torch.device
    image_names: list[str]  # the attack set in order (the tensors stay with the clients' loader)
    images_record: dict[str, Any]  # their digest for the provenance record (benchmark/provenance.py)
    rows: list[ModelRow]
    attackers: list[Attacker]
    scorer: scoring.Scorer


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
                        "; ".join(f"{path} ({why})" for path, why in images.skipped))
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
    from attacks.base import attack_class, option_schema

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
def client_run_config(cfg: BenchmarkConfig, row: ModelRow, group: str,
                      extra: Mapping[str, Any] | None = None) -> RunConfig:
    """The clients' typed run config of one federation (:class:`clients.runconfig.RunConfig`): the
    benchmark keys that feed run-config keys (``client=`` in benchmark/config.py's schema), the row's
    model spec and defence, then ``federation.options`` and ``extra`` (run-config keys) on top.

    Raises:
        ConfigError: ``federation.options`` or ``extra`` hold a bad run-config key or value.
    """
    from clients.runconfig import model_keys, resolve_config

    values = {**client_values(cfg), **model_keys(row.spec), "setting": GROUP_SETTING[group],
              "defence": row_defence(cfg, row.index)}
    if cfg.dry_run:
        values["num-server-rounds"] = 1
    return resolve_config({**values, **cfg.federation.options, **(extra or {})})


def expected_updates(cfg: BenchmarkConfig) -> list[tuple[int, int]]:
    """(round, partition) pairs the attacker attacks (dry run: round 1, partition 0 only)."""
    if cfg.dry_run:
        return [(1, 0)]
    return [(r, p) for r in range(1, cfg.federation.rounds + 1) for p in tapped_partitions(cfg)]


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


def grid_image_ids(cfg: BenchmarkConfig, run_config: RunConfig) -> set[str]:
    """The fixed grid selection: the first ``report.grid_images`` images attacked, in (round,
    partition, batch index) order. Private batches do not depend on the model row or the setting
    group, so every grid row shows the same images."""
    k = cfg.report.grid_images
    ids: list[str] = []
    for rnd, part in expected_updates(cfg):
        if len(ids) >= k:
            break
        ids += tapped_batch(run_config, part, rnd, cfg.federation.clients).image_ids
    return set(ids[:k])


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
    t0 = time.perf_counter()
    run = RunFolder(output, force=force)
    run.check(cfg)  # a conflicting folder fails before any loading
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
    new_rows = failed = federations = errors = 0
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
    finally:
        if runner is not None:
            runner.close()
        _shutdown_ray()
    tables = write_tables(run)
    grids = write_grids(run, cfg.settings, cfg.report.grid_images, cfg.report.tile)
    grids += write_distributions(run, cfg.settings)
    return RunSummary(str(run.folder), new_rows, kept, failed, federations, errors, time.perf_counter() - t0,
                      tables, [str(g) for g in grids])


def attack_metadata(cfg: BenchmarkConfig, resolved: RunConfig, model: nn.Module, batch: Any) -> AttackMetadata:
    """What the server knows besides an update, typed: batch size, input normalisation, image size,
    the update type with its local SGD steps, the defence the clients run (its spec with parameters:
    Kerckhoffs, the server configures the protocol) and, when the threat model grants them, the
    labels, one per image.

    Args:
        cfg: the benchmark config; resolved: the federation's typed client config
            (:func:`client_run_config`); model: the server's model; batch: the private batch.
    """
    from attacks.base import AttackMetadata
    from fedmjp.factory import model_input_stats

    mean, std = model_input_stats(model)
    fed = cfg.federation
    fedavg = resolved.mode != fed.algorithm  # the fedavg defence turns FedSGD into FedAvg
    return AttackMetadata(
        num_images=len(batch.image_ids), image_size=(3, cfg.data.image_size, cfg.data.image_size),
        mean=torch.tensor(mean, dtype=torch.float64), std=torch.tensor(std, dtype=torch.float64),
        labels=batch.labels.detach().to("cpu", torch.long).clone() if cfg.attack.labels == "known" else None,
        update_type="gradient" if fed.algorithm == "fedsgd" and not fedavg else "delta",
        lr=float(fed.lr), local_steps=resolved.local_steps if fedavg else fed.local_steps,
        defence=resolved.defence)


def raise_for_errors(summary: RunSummary) -> None:
    """After a finished run: :class:`AttackErrors` (exit status 8) if any attack raised an
    unexpected error; its rows are stored as failures and the tracebacks are in ``errors/``."""
    if summary.error_rows:
        raise AttackErrors(f"{summary.error_rows} row(s) failed on an unexpected attack error (a bug, not a "
                           f"condition failure); tracebacks: {summary.folder}/errors/. The tables were written "
                           "but count these rows as failures: fix the attack and re-run into a new folder")


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


def row_context(cfg: BenchmarkConfig, row: ModelRow, group: str, resolved: RunConfig,
                image_names: list[str]) -> RowContext:
    """What every result row of one federation (model row, setting group) shares; ``resolved``: the
    federation's run config. The flat image of the ``flat_psnr`` column has the colour the model
    normalises its input with (:func:`fedmjp.factory.model_input_stats`), as the attacks are told."""
    from fedmjp.factory import model_input_stats

    return RowContext(model=row.name, label=row.label, trained=row.trained, arch=row.spec["arch"],
                      variant=row.spec["variant"], april=row.spec["april"], group=group, seed=cfg.seed,
                      defence=resolved.defence,
                      image_index={name: i for i, name in enumerate(image_names)},
                      federation={"batch_size": cfg.federation.batch_size, "local_steps": cfg.federation.local_steps,
                                  "labels": "known" if cfg.attack.labels == "known" else "recovered"},
                      flat_colour=tuple(float(v) for v in model_input_stats(row.model)[0]))


def round_keys(model: str, attackers: list[Attacker], settings: list[str], rnd: int, part: int,
               image_ids: list[str]) -> dict[tuple[str, str, int], RowKey]:
    """(attacker label, setting, batch index) -> the row key, for every row one update gives."""
    return {(a.label, s, b): RowKey(model, a.label, s, rnd, part, b, image_id)
            for a in attackers for s in settings for b, image_id in enumerate(image_ids)}


class RoundCollector:
    """Groups a federation's tapped updates into rounds, in the order the server saw them.

    A round is complete once every expected client of it has replied; a round with a missing
    client is complete when the next round starts or the federation ends (:meth:`close`). Updates
    of (round, partition) pairs not expected (beyond a dry run's first) are dropped.
    """

    def __init__(self, wanted: set[tuple[int, int]]) -> None:
        self.wanted = wanted
        self.seen: set[tuple[int, int]] = set()  # (round, partition) pairs tapped
        self.buffer: list[Any] = []  # the current round's updates

    def add(self, update: Any) -> list[list[Any]]:
        """Take one update; returns the rounds it completed (zero, one or two)."""
        rnd, part = int(update.server_round), int(update.partition_id)
        if (rnd, part) not in self.wanted:
            return []
        done = []
        if self.buffer and int(self.buffer[0].server_round) != rnd:
            done.append(self.close())  # a round with a missing client: its updates are attacked now
        self.seen.add((rnd, part))
        self.buffer.append(update)
        if {(r, p) for r, p in self.wanted if r == rnd} <= self.seen:
            done.append(self.close())
        return [r for r in done if r]

    def close(self) -> list[Any]:
        """The updates collected (the round so far) and an empty buffer."""
        updates, self.buffer = self.buffer, []
        return updates

    def missing(self) -> list[tuple[int, int]]:
        """Expected (round, partition) pairs never tapped, in order."""
        return sorted(self.wanted - self.seen)


@dataclass
class _Round:
    """One round's tapped updates of one federation, on their way through attack and scoring.

    ``jobs`` holds, per attacker, the runner's job and the positions (in ``updates``) it attacks.
    """

    rnd: int
    updates: list
    batches: list
    keys: list[dict[tuple[str, str, int], RowKey]]
    top1: scoring.RoundTop1
    jobs: list[tuple[Attacker, Any, list[int]]] = field(default_factory=list)


class GroupAttacker:
    """Runs one federation and attacks its tapped updates, one round at a time, in an attack thread.

    The concurrency shell around :class:`RoundCollector`, :func:`benchmark.scoring.round_top1`,
    :func:`benchmark.scoring.score_round` and :func:`benchmark.rows.client_failure_rows`: the
    server's tap only queues each update (:meth:`tap`); the attack thread (:meth:`work`) takes them
    in the server's order, so the clients compute round r + 1 while round r is attacked and scored
    (on 2 CPU cores the two overlap; the rows do not depend on it: the attack thread alone touches
    the server's model copy, the scorer and the results file). Once a round is complete, each
    attacker gets all of its updates in one ``reconstruct_many`` call on the runner (batched attacks
    solve them together; on Ray workers, the federation goes on meanwhile); the round waits in
    :class:`benchmark.workers.RoundDispatch` until its attacks are done, then (:meth:`finish_round`)
    the results are scored per round and setting and appended. ``batched=False`` attacks one update per
    ``reconstruct`` call (the reference path; the rows are the same).
    """

    def __init__(self, prepared: Prepared, run: RunFolder, row: ModelRow, group: str, settings: list[str],
                 done: set[RowKey], progress: bool, runner: Runner | None = None, batched: bool = True) -> None:
        from .workers import LocalRunner, RoundDispatch

        self.p, self.run_folder, self.row, self.group, self.settings = prepared, run, row, group, settings
        self.cfg = prepared.cfg
        self.done = done
        # the rounds on the runner; each comes back to finish_round once its attacks are done
        self.dispatch: RoundDispatch[_Round] = RoundDispatch(
            runner if runner is not None else LocalRunner([a.attack for a in prepared.attackers]),
            self.finish_round, batched)
        self.resolved = client_run_config(self.cfg, row, group)
        self.ctx = row_context(self.cfg, row, group, self.resolved, prepared.image_names)
        # The classifier-bias gradient carries the attacked model's prediction when the update is a
        # plain FedSGD gradient (no defence transforms it); see scoring.round_top1.
        plain = self.resolved.mode == "fedsgd" and self.resolved.defence.name == "none"
        self.gradient_readout = scoring.classifier_bias_name(row.model) if plain else None
        self.forward_top1 = 0  # updates whose attacked-model top-1 needed a forward pass
        self.rounds = RoundCollector(set(expected_updates(self.cfg)))
        # The server's copy is the row's own model: every use loads the federation's weights first
        # (strict, so nothing of an earlier federation survives; block-0 norm1, which the surgery
        # removed, is never in them), and run() restores the row's weights at the end. A deepcopy
        # per federation cost more than the attacks of a round.
        self.model = row.model
        self.acc_model = row.acc_model
        self.pristine = {k: v.detach().clone() for k, v in row.model.state_dict().items()}
        self.grid_ids = grid_image_ids(self.cfg, self.resolved)
        self.new_rows = self.failed_rows = self.error_rows = 0
        self.error: BaseException | None = None
        self.aborted = False
        # Updates on their way from the server's tap to the attack thread; a round and a half of
        # them at most, so the server runs one round ahead and no further.
        self.inbox: queue.Queue[Any] = queue.Queue(maxsize=max(1, (3 * self.cfg.federation.clients) // 2))
        self.bar = tqdm(total=len(self.rounds.wanted), desc=f"attack {row.name} [{group}]", unit="upd",
                        leave=False, disable=None if progress else True)  # None: off a terminal

    def run(self, federate: Callable[..., Any] | None) -> None:
        from server.federation import run_federation

        t0 = time.perf_counter()
        worker = threading.Thread(target=self.work, name=f"attack-{self.row.name}-{self.group}", daemon=True)
        worker.start()
        finished = False
        try:
            if federate is None:
                # Ray stays up between federations of one benchmark (its start-up is paid once);
                # run_benchmark shuts it down at the end.
                result = run_federation(self.resolved, tap=self.tap, engine=self.cfg.federation.engine,
                                        keep_ray=True)
            else:
                result = federate(self.resolved, tap=self.tap, engine=self.cfg.federation.engine)
            finished = True
        finally:
            self.aborted = not finished  # an error or Ctrl-C: the thread drops what is queued
            self.inbox.put(_END if finished else _ABORT)
            worker.join()
            self.model.load_state_dict(self.pristine, strict=True)
        self.bar.close()
        if self.error is not None:
            raise self.error
        self.record_client_failures(result)
        _logger.info("%s/%s: federation and attacks took %.1f s; the attacked model's top-1 needed a forward for "
                     "%d update(s), the others were read off their gradients", self.row.name, self.group,
                     time.perf_counter() - t0, self.forward_top1)
        if self.p.scorer.lpips_cache is not None:
            _logger.info("LPIPS features so far: %(computed)d image(s) computed, %(reused)d reused; %(kept_images)d "
                         "reference(s) kept (%(kept_bytes)d bytes)", self.p.scorer.lpips_cache.stats())

    def tap(self, update: Any) -> None:
        """The server's tap: hands the update to the attack thread (:meth:`work`) and returns, so
        that the clients compute the next round while this one is attacked and scored. Waits while
        ``inbox`` is full (the updates held in memory stay bounded). An error of the attack thread
        is raised here (aborting the federation) and again after the federation returns, so that an
        engine running the ServerApp in a thread cannot swallow it."""
        while True:
            if self.error is not None:
                raise self.error
            try:
                self.inbox.put(update, timeout=0.2)
                return
            except queue.Full:
                continue

    def work(self) -> None:
        """The attack thread: every tapped update in the order the server saw them, then (at the
        end of the federation) the last round and every round still in flight."""
        update = None
        try:
            while True:
                update = self.inbox.get()
                if update is _ABORT:
                    return
                if update is _END:
                    last = self.rounds.close()
                    if last:
                        self.submit_round(last)
                    self.dispatch.drain(keep=0)
                    return
                if not self.aborted:
                    for updates in self.rounds.add(update):
                        self.submit_round(updates)
                    self.dispatch.drain()
        except BaseException as err:  # noqa: BLE001  (re-raised by tap() and run(); never swallowed)
            self.error = err
            # let tap() return until run() sends the end marker; an error while finishing (the marker
            # already taken, e.g. a Ray attack worker killed during the last drain) must not wait
            # for a second marker that never comes
            while update is not _END and self.inbox.get() not in (_END, _ABORT):
                pass

    # ---------------------------------------------------------------------------------- a round
    def submit_round(self, updates: list) -> None:
        """Top-1 of the round's images, then one runner job per attacker over the updates that
        still miss rows of that attacker; the round goes to :attr:`dispatch` until they are done."""
        rnd = int(updates[0].server_round)
        clients = self.cfg.federation.clients
        batches = [tapped_batch(self.resolved, int(u.partition_id), rnd, clients, getattr(u, "partition_ids", None))
                   for u in updates]
        keys = [round_keys(self.row.name, self.p.attackers, self.settings, rnd, int(u.partition_id), b.image_ids)
                for u, b in zip(updates, batches)]
        todo = [i for i, k in enumerate(keys) if not all(v in self.done for v in k.values())]
        self.bar.update(len(updates) - len(todo))
        if not todo:
            return
        updates, batches, keys = [updates[i] for i in todo], [batches[i] for i in todo], [keys[i] for i in todo]
        # Every update of a round carries the same global weights (the state the server sent).
        state = {k: v.to(self.p.device) for k, v in updates[0].global_state.items()}
        self.model.load_state_dict(state, strict=True)
        self.model.eval()
        acc_model = None if self.acc_model is None else self.acc_model_at(state)
        top1, forwards = scoring.round_top1(self.model, acc_model, updates, batches, self.p.device,
                                            self.gradient_readout)
        self.forward_top1 += forwards
        round_ = _Round(rnd, updates, batches, keys, top1)
        model = self.dispatch.share(self.model)  # e.g. shipped to Ray's object store once per round
        for index, attacker in enumerate(self.p.attackers):
            mine = [i for i, (batch, k) in enumerate(zip(batches, keys))
                    if not all(k[(attacker.label, s, b)] in self.done for s in self.settings
                               for b in range(len(batch.image_ids)))]
            if not mine:
                continue
            metadata = [attack_metadata(self.cfg, self.resolved, self.model, batches[i]) for i in mine]
            job = self.dispatch.submit(index, model, [updates[i].arrays for i in mine], metadata)
            round_.jobs.append((attacker, job, mine))
        self.dispatch.add(round_, [job for _, job, _ in round_.jobs])

    def finish_round(self, r: _Round) -> None:
        """Score every attacker's results of the round under each setting; append the rows and
        store the grid images."""
        scored: list[scoring.ScoredImage] = []
        for attacker, job, mine in r.jobs:
            results, seconds = job.result()
            n_images = sum(len(r.batches[i].image_ids) for i in mine)
            for i, result in zip(mine, results):
                if result.error is not None:
                    self.record_error(attacker.label, r.rnd, int(r.updates[i].partition_id), result.error)
            for s in self.settings:
                scored += scoring.score_round(
                    self.ctx, (attacker.label, attacker.name), s, [r.updates[i] for i in mine],
                    [r.batches[i] for i in mine], results, r.top1.take(mine), self.p.scorer,
                    # ignore: patch_size is a plain tuple attribute of a timm-style patch embedding,
                    # which torch types as Tensor | Module (see build_rows)
                    int(self.model.patch_embed.patch_size[0]),  # type: ignore[union-attr, index]
                    seconds / max(n_images, 1), skip=self.done,
                    grid_ids=self.grid_ids)
        batch_of = {int(u.partition_id): b for u, b in zip(r.updates, r.batches)}  # one update per partition
        for item in scored:
            if item.row.image_stored:
                batch, b = batch_of[item.row.partition_id], item.row.batch_index
                self.run_folder.save_row_images(item.row, batch.images[b],
                                                None if batch.shuffled is None else batch.shuffled[b],
                                                item.reconstruction)
        rows = [item.row for item in scored]
        self.run_folder.append(rows)
        for k in r.keys:
            self.done.update(k.values())
        self.new_rows += len(rows)
        self.failed_rows += sum(bool(x.failed) for x in rows)
        self.error_rows += sum(bool(x.error) for x in rows)
        self.bar.update(len(r.updates))

    def acc_model_at(self, state: dict) -> nn.Module:
        """The model as trained at the global weights ``state``: the row's unmodified model with the
        federation's weights (block 0's norm1, which the surgery removed, keeps its checkpoint or
        seeded values)."""
        if self.acc_model is None:  # finish_round calls it only for a row with an unmodified model
            raise RuntimeError(f"model row {self.row.name!r} has no unmodified model (acc_model)")
        result = self.acc_model.load_state_dict(state, strict=False)
        removed = [k for k in result.missing_keys if not k.startswith("blocks.0.norm1.")]
        if removed or result.unexpected_keys:
            raise RuntimeError(f"model row {self.row.name!r}: the unmodified model does not take the federation's "
                               f"weights (missing {removed}, unexpected {result.unexpected_keys})")
        return self.acc_model.eval()

    def record_error(self, attack: str, rnd: int, part: int, text: str) -> None:
        """Write an unexpected attack error's traceback to ``errors/`` of the run folder."""
        path = self.run_folder.write_error(f"{slug(self.row.name)}__{self.group}__{slug(attack)}__r{rnd}-p{part}.txt",
                                           text)
        _logger.error("%s/%s: attack %s raised an unexpected error (round %d, partition %d); traceback in %s",
                      self.row.name, self.group, attack, rnd, part, path)

    def record_client_failures(self, result: Any) -> None:
        """Updates that never reached the attacker (a client raised, timed out or sent a malformed
        reply): their rows (:func:`benchmark.rows.client_failure_rows`), so the table counts them
        and a resumed run does not wait for them. The server does not know a failed client's
        partition; the missing (round, partition) pairs are what was expected and not tapped. A
        federation where no update reached the attacker at all is an error."""
        failures = list(getattr(result, "failures", None) or [])
        for f in failures:
            _logger.warning("%s/%s: round %d, node %d: %s", self.row.name, self.group, f.server_round, f.node_id,
                            f.reason)
        rows = []
        attackers = [(a.label, a.name) for a in self.p.attackers]
        for rnd, part in self.rounds.missing():
            reasons = sorted({f.reason for f in failures if f.server_round == rnd and f.partition_id in (None, part)})
            batch = tapped_batch(self.resolved, part, rnd, self.cfg.federation.clients)
            rows += [r for r in client_failure_rows(self.ctx, rnd, part, batch, reasons, attackers, self.settings)
                     if r.key not in self.done]
        if rows:
            self.run_folder.append(rows)
            self.done.update(r.key for r in rows)
            self.new_rows += len(rows)
            self.failed_rows += len(rows)
        if not self.rounds.seen and self.rounds.wanted:
            counts = Counter(f.reason for f in failures)
            listed = "; ".join(f"{reason} ({n} update(s))" for reason, n in counts.most_common(3))
            more = f"; and {len(counts) - 3} other reason(s)" if len(counts) > 3 else ""
            raise FederationFailed(f"model row {self.row.name!r} ({self.group}): no client update reached the "
                                   f"attacker: {listed or 'no client answered'}{more}")
