"""Attack what a Flower federation captured: the ``out-dir`` of a ``flwr run`` or a deployment.

    flwr run . --stream -c "out-dir='runs/fl' setting='c'"          # the server taps every update
    python run_benchmark.py --from-captured runs/fl --output runs/fl-attacked [--setting b] [--attack NAME]
    fedmjp attack-captured runs/fl --output runs/fl-attacked            # the same command

The out-dir holds the server's outcome (``federation.json``: history, failures) and every tapped
update (``updates/``, :func:`server.tap.load_tapped_updates`), each carrying the run config the
server ran with (``metadata["run-config"]``, :func:`server.rounds.server_metadata`). From it this
module makes a benchmark config of one model row, the federation's model, whose clients' run config
(:func:`benchmark.inputs.client_run_config`) equals the captured one, and a *replay* that the
pipeline runs in place of a federation (:func:`benchmark.pipeline.run_benchmark`'s ``federate``): the
tapped updates go through the same tap, attacks, scoring, ``results.jsonl``, tables, grids and
resume as a benchmark run's. What the capture fixes (model, rounds, clients, images, seed, gamma,
defence, ...) is not a flag here; the attackers, the settings of the captured gradient group, the
device, metrics and report are.

Ground truth: the clients' private batches are a function of the run config
(:func:`clients.partition.private_batch`), so they are rebuilt from the image source the run config
names (``images``: ``embedded``, or a folder, which must hold the same files on this machine). A
capture whose images cannot be read here has no ground truth to score reconstructions against; it
is refused with that reason before anything is written.
"""
from __future__ import annotations

import argparse
import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from .errors import ConfigError, InputDataError

if TYPE_CHECKING:
    from clients.runconfig import RunConfig
    from server.rounds import ServerOutcome
    from server.tap import TappedUpdate

    from .config import BenchmarkConfig

#: run_benchmark.py flags (argparse attribute -> flag) whose value the capture fixes.
FIXED_FLAGS = {"images": "--images", "num_images": "--num-images", "models": "--models", "rounds": "--rounds",
               "clients": "--clients", "gamma": "--gamma", "seed": "--seed", "engine": "--engine",
               "train_missing": "--train-missing", "sweeps": "--sweep"}
#: Config keys (first part of a dotted --set key) the capture fixes; ``data.on_corrupt`` stays free.
FIXED_KEYS = ("seed", "gamma", "defence", "data", "federation", "models", "sweep", "utility", "name")
#: Run-config keys that do not change what the clients computed: where the server stored the capture,
#: and where the clients ran (the attack's device is --device).
IGNORED_KEYS = ("out-dir", "device")


@dataclass
class Capture:
    """A federation's out-dir, read and checked: its run config, outcome and tapped updates."""

    folder: Path
    run_config: RunConfig
    outcome: ServerOutcome
    updates: list[TappedUpdate]
    digest: str  # of federation.json: names the capture in the output folder's config


def load_capture(folder: str | Path) -> Capture:
    """Read the out-dir ``folder`` of a finished ``flwr run`` or deployment.

    Raises:
        InputDataError: not a finished run's out-dir, a damaged file, no tapped update, updates
            without the server's run config or of two different runs (the message names the file).
    """
    from clients.runconfig import resolve_config
    from server.rounds import ServerOutcome
    from server.tap import load_tapped_updates

    path = Path(folder).expanduser()
    where = f"--from-captured {folder}"
    if not path.is_dir():
        raise InputDataError(f"{where}: no such folder (give the out-dir of a flwr run or deployment, e.g. runs/fl)")
    if path.name == "updates" and (path.parent / "federation.json").is_file():
        raise InputDataError(f"{where}: this is the updates/ folder; give its out-dir {path.parent}")
    try:  # the server's own readers, which check every file (their errors name it)
        outcome = ServerOutcome.load(path)
        updates = load_tapped_updates(path / "updates")
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise InputDataError(f"{where}: {err}") from None
    if not updates:
        raise InputDataError(f"{where}: {path / 'updates'} holds no tapped update (did every client fail? "
                             f"python -m server.run --check {folder} shows the run's outcome)")
    configs = {json.dumps(u.metadata.get("run-config"), sort_keys=True) for u in updates}
    if "null" in configs:
        raise InputDataError(f"{where}: its tapped updates do not carry the server's run config (captured by an "
                             "older server); re-run the federation to capture it again")
    if len(configs) > 1:
        raise InputDataError(f"{where}: its tapped updates come from {len(configs)} runs of different run configs; "
                             "give the out-dir of one run")
    try:
        run_config = resolve_config(json.loads(configs.pop()))
    except ValueError as err:
        raise InputDataError(f"{where}: the captured run config is not valid here: {err}") from None
    parts = sorted({int(u.partition_id) for u in updates if not u.is_aggregate})
    if parts and not 0 <= parts[0] <= parts[-1] < run_config.num_partitions:
        raise InputDataError(f"{where}: updates of partitions {parts}, but the run config's num-partitions is "
                             f"{run_config.num_partitions}: the nodes' num-partitions differed from the run "
                             "config's, so their private batches cannot be rebuilt")
    digest = hashlib.sha256((path / "federation.json").read_bytes()).hexdigest()[:12]
    return Capture(path, run_config, outcome, updates, digest)


def check_ground_truth(capture: Capture) -> None:
    """The clients' private images can be read here (the ground truth every row is scored against).

    Raises:
        InputDataError: they cannot (the reason, and that without them nothing can be scored).
    """
    from fedmjp.data import DataError, load_images

    rc = capture.run_config
    try:  # read now, not from the clients' per-process cache: the files must be here
        load_images(rc.images, rc.image_size, rc.num_images or None, rc.num_classes)
    except (DataError, OSError, ValueError) as err:
        raise InputDataError(f"--from-captured {capture.folder}: the clients' private images (images={rc.images!r}) "
                             f"cannot be read here ({err}); without them there is no ground truth to score the "
                             "reconstructions against: put the same image folder at that path") from None


def captured_settings(capture: Capture, wanted: str | None) -> list[str]:
    """The settings a capture can be scored in: those of its gradient group (a: x; b and c: x~),
    all of them or ``wanted`` (``--setting``)."""
    from fedmjp.settings import SETTING_GROUPS, SETTINGS

    setting = capture.run_config.setting
    group = [s for s in SETTINGS if SETTING_GROUPS[s] == SETTING_GROUPS[setting]]
    if wanted in (None, "all"):
        return group
    if wanted not in group:
        raise ConfigError(f"--setting {wanted}: {capture.folder} captured gradients of setting {setting!r}, which "
                          f"are scored in setting(s) {', '.join(group)} only")
    return [str(wanted)]


def _check_flags(args: argparse.Namespace, capture: Capture) -> None:
    """Refuse a flag or --set key whose value the capture fixes (it would silently not apply)."""
    from fedmjp.config import parse_override

    for attr, flag in FIXED_FLAGS.items():
        if getattr(args, attr, None) not in (None, False, []):
            raise ConfigError(f"{flag} does not go with --from-captured: the capture {capture.folder} fixes it "
                              "(its run config says what the federation ran)")
    for text in getattr(args, "overrides", None) or []:
        parts, _ = parse_override(text)
        if parts[0] in FIXED_KEYS and parts[:2] != ["data", "on_corrupt"]:
            raise ConfigError(f"--set {text}: {'.'.join(parts)} does not go with --from-captured: the capture "
                              f"{capture.folder} fixes it (its run config says what the federation ran)")


def captured_config(args: argparse.Namespace, capture: Capture) -> BenchmarkConfig:
    """The benchmark config that attacks ``capture``: the preset and flags of ``args`` (attackers,
    device, metrics, report, ``--set``) with the capture's model row, data and federation, whose
    clients' run config equals the captured one.

    Raises:
        ConfigError: a flag the capture fixes, a setting outside its gradient group, or a captured
            key the benchmark cannot express.
    """
    from fedmjp.settings import SETTING_GROUPS

    from .cli import resolve
    from .config import plain
    from .entries import model_spec
    from .inputs import GROUP_SETTING, ModelRow, client_run_config
    from .validation import validate

    _check_flags(args, capture)
    rc = capture.run_config
    settings = captured_settings(capture, args.setting)
    data = plain(resolve(argparse.Namespace(**{**vars(args), "setting": None})))
    data.update(name=f"captured-{capture.digest}", seed=rc.seed, gamma=rc.gamma, defence=rc.defence.as_dict(),
                sweep={}, settings=settings)
    data["data"] = {**data["data"], "source": rc.images, "image_size": rc.image_size,
                    "num_images": rc.num_images or None, "num_classes": rc.num_classes}
    data["federation"] = {"engine": "inprocess", "rounds": rc.num_server_rounds, "clients": rc.num_partitions,
                          "algorithm": rc.mode, "batch_size": rc.batch_size, "local_steps": rc.local_steps,
                          "lr": rc.lr, "partition": rc.partitioner, "precision": rc.precision, "secagg": rc.secagg,
                          "options": {}}
    data["models"] = [{"name": rc.model_name, "arch": rc.model_arch, "variant": rc.model_variant,
                       "kwargs": dict(rc.model_kwargs), "checkpoint": rc.model_checkpoint or None,
                       "april": rc.model_april or None, "seed": rc.model_seed}]
    group = SETTING_GROUPS[rc.setting]
    ignored = set(IGNORED_KEYS) | ({"num-server-rounds"} if data.get("dry_run") else set())
    captured = {k: v for k, v in rc.wire().items() if k not in ignored}

    def clients_config(cfg: BenchmarkConfig) -> dict[str, Any]:
        # client_run_config reads a row's spec and index only: the model is built later, by the pipeline
        row = ModelRow(0, rc.model_name, rc.model_name, model_spec(cfg, 0), cast(Any, None), False)
        return client_run_config(cfg, row, group).wire()

    # every captured key the benchmark's own keys do not reproduce goes in as a run-config option
    first = clients_config(validate(data))
    data["federation"]["options"] = {k: v for k, v in captured.items() if first.get(k) != v}
    cfg = validate(data)
    got = clients_config(cfg)
    # settings b and c run the same client computation (GROUP_SETTING), so the group is what must match
    differ = sorted(k for k, v in captured.items() if got.get(k) != v
                    and not (k == "setting" and GROUP_SETTING[group] == got.get(k)))
    if differ:
        raise ConfigError(f"--from-captured {capture.folder}: the benchmark cannot reproduce the captured run "
                          f"config's {', '.join(differ)} ({', '.join(f'{k}={captured[k]!r}' for k in differ)})")
    return cfg


def replay(capture: Capture) -> Callable[..., ServerOutcome]:
    """A ``federate`` for :func:`benchmark.pipeline.run_benchmark`: instead of running a federation,
    hands the captured updates to the attacker's tap in the order the server saw them and returns
    the server's outcome (its failures become the failed rows of updates never tapped)."""

    def federate(resolved: RunConfig, tap: Callable[[Any], None], engine: str | None = None) -> ServerOutcome:
        for update in capture.updates:
            tap(update)
        return capture.outcome

    return federate


def from_captured(args: argparse.Namespace) -> tuple[BenchmarkConfig, Callable[..., ServerOutcome]]:
    """``run_benchmark.py --from-captured FOLDER``: the config and the replay that attack the capture.

    Raises:
        InputDataError, ConfigError: see :func:`load_capture`, :func:`check_ground_truth`,
            :func:`captured_config`.
    """
    capture = load_capture(args.from_captured)
    cfg = captured_config(args, capture)
    check_ground_truth(capture)
    return cfg, replay(capture)
