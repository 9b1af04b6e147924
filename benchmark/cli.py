"""Command line of ``run_benchmark.py``: flags, config resolution, logging set-up (``main`` lives in the script).

Precedence: ``configs/default.yaml`` (or ``--config FILE``) < flags (``--rounds`` ...) < ``--set key=value``.
Exit statuses: see :mod:`benchmark.errors`.

Building the parser imports nothing of the model code: ``--help`` and a usage error answer before
torch, timm or Flower load; the config, its validation and the rest are imported where they are used.
"""
from __future__ import annotations

import argparse
import copy
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Optional, Sequence


if TYPE_CHECKING:
    from . import config as C

_logger = logging.getLogger(__name__)

#: ``--setting`` values: :data:`fedmjp.settings.SETTINGS` and ``all``; ``--engine`` values:
#: :data:`benchmark.config.ENGINES`. Written out because both modules load with the model code
#: (torch); tests/test_cli_fast.py checks they equal the config's.
SETTING_CHOICES = ("a", "b", "c", "all")
ENGINE_CHOICES = ("inprocess", "simulation")

def integer(text: str) -> int:
    """An integer flag's value: what Python's int() reads (``1_000``) or an integral number written
    with an exponent (``1e3``), like an integer config key (fedmjp/config.py)."""
    from fedmjp.config import as_number

    value = as_number(int, text)
    if not isinstance(value, int):
        raise argparse.ArgumentTypeError(f"invalid integer value: {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="run_benchmark.py",
        description="Federated rounds -> gradient-inversion attacks -> privacy table and image grids "
                    "(settings a, b, c of the MJP paper). Defaults: configs/default.yaml (quick preset).",
        epilog="Exit status: 0 ok, 2 usage, 3 bad config/name, 4 bad input data, 5 checkpoint, "
               "6 output folder holds another config or provenance or is not a run folder (see --force), 7 federation failed, 8 an attack raised an unexpected error (tables written, tracebacks in errors/), 9 output folder in use, 10 output cannot be written (read-only, disk full, file-size limit; rows kept), 11 an attack worker died (rows kept), 130 interrupted, 143 terminated (re-run to resume).")
    p.add_argument("--setting", choices=SETTING_CHOICES, help="threat setting(s) to run (default: the config's)")
    p.add_argument("--config", metavar="FILE", help="YAML preset (default: configs/default.yaml)")
    p.add_argument("--images", metavar="DIR", help="attack image folder, or 'embedded' for scikit-image's bundled images")
    p.add_argument("--num-images", type=integer, metavar="N", help="use the first N images (sorted)")
    p.add_argument("--models", nargs="+", metavar="NAME", help="model rows of the config to run (names or a,b,c)")
    p.add_argument("--attack", metavar="NAME", help="the one attack to run (attacks.create_attack); replaces the "
                                                  "config's attacks list")
    p.add_argument("--rounds", type=integer, metavar="N", help="federated rounds")
    p.add_argument("--clients", type=integer, metavar="N", help="federated clients (partitions)")
    p.add_argument("--gamma", type=float, metavar="G", help="MJP shuffle ratio of the clients in settings b/c")
    p.add_argument("--output", metavar="DIR", help="output folder (default: runs/<time>-setting-<s>); "
                                                   "an existing one of the same config is resumed")
    p.add_argument("--seed", type=integer, metavar="N", help="seed of model init, partitions, shuffles")
    p.add_argument("--device", metavar="DEV", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--engine", choices=ENGINE_CHOICES, help="Flower simulation (Ray) or the in-process engine")
    p.add_argument("--attack-workers", type=integer, metavar="N",
                   help="attack on N Ray workers (0: in this process; at most the CPUs here without --ray-address)")
    p.add_argument("--ray-address", metavar="ADDR", help="a running Ray cluster for the attack workers (ray://host:10001)")
    p.add_argument("--on-corrupt", choices=("skip", "fail"), help="corrupt image files: skip (listed) or stop")
    p.add_argument("--train-missing", action="store_true",
                   help="first train the checkpoints of model rows that name a recipe and whose checkpoint is "
                        "missing or unfinished (resumable), then attack them")
    p.add_argument("--dry-run", action="store_true", help="run every stage once (1 round, 1 update per federation)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override any config value (dotted key, YAML value), e.g. --set federation.lr=0.05")
    p.add_argument("--sweep", dest="sweeps", action="append", default=[], metavar="KEY=V1,V2,...",
                   help="run a grid over any dotted key into one folder (sweep.csv, plots), "
                        "e.g. --sweep defence.sigma=0,0.01,0.1 or --sweep gamma=0,0.27,0.5")
    p.add_argument("--list", action="store_true",
                   help="list the config's model rows (the names --models takes, architecture, checkpoint present "
                        "or not), every attack with its threat model (what it needs), the defences and model "
                        "architectures a config can name (built-ins and installed plug-ins, with their origin) and exit")
    p.add_argument("--estimate", action="store_true",
                   help="print the plan (attack calls and rows per attacker) and the attacks' estimated time "
                        "from measured costs (benchmark/attack_costs.yaml), then exit without running")
    p.add_argument("--no-progress", action="store_true", help="hide progress bars")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    return p


def resolve(args: argparse.Namespace) -> C.BenchmarkConfig:
    """The validated, typed config the flags describe (file < flags < --set; edited as plain data)."""
    from . import config as C
    from .errors import ConfigError
    from .sweep_points import sweep_flags
    from .validation import validate

    cfg = C.load_config(args.config)
    # flag values go in as the Python values argparse made (a text round trip would read 5e-05 as a string)
    flags: list[tuple[list[str], object]] = []
    if args.setting:
        flags.append((["settings"], list(C.SETTINGS) if args.setting == "all" else [args.setting]))
    if args.images:
        source = args.images if args.images == "embedded" else flag_path("--images", args.images)
        cfg["data"]["source"] = source  # a flag path is relative to the working directory
    for flag, key in (("num_images", "data.num_images"), ("attack", "attack.name"), ("rounds", "federation.rounds"),
                      ("clients", "federation.clients"), ("gamma", "gamma"), ("seed", "seed"), ("device", "device"),
                      ("engine", "federation.engine"), ("on_corrupt", "data.on_corrupt"),
                      ("attack_workers", "attack_workers"), ("ray_address", "ray_address")):
        value = getattr(args, flag)
        if value is not None:
            flags.append((key.split("."), value))
    if args.attack:
        flags.append((["attacks"], []))  # --attack names the one attacker: it replaces a preset's attacks list
    if args.output:
        flags.append((["output"], flag_path("--output", args.output)))
    if args.dry_run:
        flags.append((["dry_run"], True))
    cfg = C.apply_overrides(C.with_values(cfg, flags), list(args.overrides))
    if getattr(args, "sweeps", None):
        if isinstance(cfg.get("sweep"), list) and cfg["sweep"]:
            raise ConfigError("--sweep adds grid keys, but the config's sweep is a list of points; "
                                "put the values into that list instead")
        cfg["sweep"] = {**(cfg.get("sweep") or {}), **sweep_flags(args.sweeps)}
    cfg = select_models(cfg, args.models)
    return validate(cfg)


def flag_path(flag: str, value: str) -> str:
    """A path flag's value as the config holds it: absolute (a relative path: to the working
    directory) with its links resolved by :func:`fedmjp.datadir.resolved`, the resolution of every
    path from a flag or the environment; ``$FEDMJP_DATA/...`` is kept for the config to expand.

    Raises:
        ConfigError: the path cannot be resolved (a loop of symbolic links), naming ``flag``.
    """
    from fedmjp import datadir

    from .errors import ConfigError

    if datadir.names_data_dir(value):
        return value
    try:
        return str(datadir.resolved(value, flag))
    except datadir.UnresolvablePath as err:
        raise ConfigError(str(err)) from None


def select_models(cfg: dict, names: Optional[Sequence[str]]) -> dict:
    """Keep only the model rows named (in the config's order); unknown names list the valid ones."""
    if not names:
        return cfg
    from .errors import ConfigError

    wanted = [n for item in names for n in str(item).split(",") if n]
    valid = [row["name"] for row in cfg["models"]]
    unknown = [n for n in wanted if n not in valid]
    if unknown:
        raise ConfigError(f"unknown model name(s) {', '.join(map(repr, unknown))}; valid: {', '.join(map(str, valid))}")
    cfg = copy.deepcopy(cfg)
    cfg["models"] = [row for row in cfg["models"] if row["name"] in wanted]
    return cfg


def catalog() -> dict[str, list[tuple[str, str]]]:
    """Every attack, defence and model architecture a config can name, as (name, origin) by kind:
    ``built-in`` or the entry point's package (``run_benchmark.py --list``). ``package.module:Name``
    references are not listed: any importable one is valid."""
    from attacks.api.registry import attack_catalog
    from defences.spec import defence_names
    from fedmjp.models import model_catalog

    return {"attacks": attack_catalog(), "defences": defence_names(), "models": model_catalog()}


def catalog_text(cfg: Optional[C.BenchmarkConfig] = None) -> str:
    """``--list``: the model rows of ``cfg`` (what ``--models`` takes), every attack with its origin
    and threat model (:func:`attacks.api.registry.attack_summary`), the defences and architectures."""
    from attacks.api.registry import attack_summary

    lines = []
    if cfg is not None:
        lines.append(f"model rows of {cfg.name or 'the config'} (--models NAME):")
        width = max((len(m.name) for m in cfg.models), default=0)
        for m in cfg.models:
            if m.checkpoint is None:
                weights = "no checkpoint (seeded fresh weights, untrained)"
            else:
                weights = f"checkpoint {'present' if Path(m.checkpoint).is_file() else 'MISSING'}: {m.checkpoint}"
            lines.append(f"  {m.name:<{width}}  {m.arch} ({m.variant})  {weights}")
    for kind, entries in catalog().items():
        lines.append(f"{kind}:" if kind != "models" else "model architectures (arch of a model row):")
        width = max((len(name) for name, _ in entries), default=0)
        for name, origin in entries:
            line = f"  {name:<{width}}  {origin}"
            if kind == "attacks":
                try:
                    line += f"  needs: {attack_summary(name)}"
                except ValueError as err:  # a plug-in that cannot be loaded: say so, list the rest
                    line += f"  cannot be loaded: {' '.join(str(err).split())}"
            lines.append(line)
    lines.append("plug-ins: an entry point of group fedmjp.attacks / fedmjp.defences / fedmjp.models, or "
                 "package.module:Name in the config (docs/plugins.md)")
    return "\n".join(lines)


def default_output(cfg: C.BenchmarkConfig) -> str:
    from . import config as C

    settings = "".join(cfg.settings)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    suffix = "-dry-run" if cfg.dry_run else ""
    return str(C.PROJECT_ROOT / "runs" / f"{stamp}-setting-{settings}{suffix}")


def setup_logging(verbose: bool) -> None:
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    from fedmjp.text import escape_log_output  # after parsing: the fedmjp package loads torch

    escape_log_output()  # names and reasons in log lines reach the terminal escaped (fedmjp/text.py)
    if not verbose:
        for name in ("flwr", "ray", "filelock", "PIL", "matplotlib", "urllib3", "datasets", "server", "clients"):
            logging.getLogger(name).setLevel(logging.WARNING)
