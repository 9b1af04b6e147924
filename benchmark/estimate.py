"""The plan of a run (attack calls per attacker) and its time, estimated from measured costs.

Every run prints :func:`plan_text` before any work (``run_benchmark.py --estimate`` prints it and
exits): per attacker the attack calls (one per tapped update, model row and federation; settings b
and c share one) and the rows they give (images x settings), and an estimate of the attacks' time.

The estimate reads :data:`COSTS` (``benchmark/attack_costs.yaml``): measured seconds of one attack
call per (attack, device kind, model parameters, tokens, batch size, image size, ``iterations``
option). The nearest entry of the same attack and device kind is scaled linearly by parameters,
tokens, batch size and iterations; an attack without an entry says ``no estimate``. Federations
(training, model building) and scoring are not in it. The entries are measured from a finished run
folder by::

    python -m benchmark.estimate measure RUN_FOLDER   # merges the run's attack times into the file
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import yaml

from .config import BenchmarkConfig

#: The measured costs (module docstring).
COSTS = Path(__file__).with_name("attack_costs.yaml")
#: The keys of a cost entry besides ``seconds``.
SIZE_KEYS = ("params", "tokens", "batch_size", "image_size")


@dataclass(frozen=True)
class ModelSize:
    """What an attack's cost scales with on one model row."""

    params: int
    tokens: int


@dataclass
class AttackerPlan:
    """One attacker's share of a run: its calls, rows and estimated seconds (None: no estimate)."""

    label: str
    name: str
    calls: int = 0
    rows: int = 0
    seconds: Optional[float] = 0.0


def model_size(spec: Mapping[str, Any]) -> Optional[ModelSize]:
    """Parameters and tokens of a model row's architecture, built on the meta device (no weights
    allocated, no checkpoint read); None where it cannot be built so."""
    import torch

    from fedmjp.factory import create_model, spec_kwargs

    try:
        # create_model, not build_model: build_model keeps fresh models as templates for the run,
        # which must not hold a model on the meta device
        with torch.device("meta"):
            model = create_model(spec["arch"], **spec_kwargs(spec))
        grid: Any = getattr(model.patch_embed, "grid_size")
        tokens = int(grid[0]) * int(grid[1]) + int(getattr(model, "num_prefix_tokens", 1))
        return ModelSize(sum(p.numel() for p in model.parameters()), tokens)
    except Exception:  # a plug-in architecture that needs real tensors to build: no estimate for its row
        return None


def device_kind(cfg: BenchmarkConfig) -> str:
    """``cuda`` or ``cpu``: where the attacks of this config run."""
    name = str(cfg.device)
    if name == "auto":
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    return "cuda" if name.startswith("cuda") else "cpu"


def read_costs(path: Path = COSTS) -> list[dict[str, Any]]:
    """The entries of the cost file (empty when it is missing)."""
    if not path.is_file():
        return []
    data = yaml.safe_load(path.read_text()) or {}
    return list(data.get("entries") or [])


def per_call(costs: Sequence[Mapping[str, Any]], name: str, device: str, size: ModelSize, batch: int,
             image_size: int, iterations: Optional[int], trained: bool = False) -> Optional[float]:
    """Estimated seconds of one call of attack ``name``: the nearest measured entry (log distance
    over :data:`SIZE_KEYS`) of that attack on that device kind, scaled linearly; None: no entry.
    Entries measured on trained weights (``trained``: the row loads a checkpoint) are preferred for
    a trained row and the others for fresh weights: an optimisation attack converges at another
    pace on each (mjp_adaptive on the CIFAR DeiT+MJP checkpoint takes ~25x its time on fresh weights)."""
    mine = [c for c in costs if c.get("attack") == name and c.get("device") == device]
    if not mine:
        return None
    alike = [c for c in mine if bool(c.get("trained", False)) == trained]
    mine = alike or mine
    want = {"params": size.params, "tokens": size.tokens, "batch_size": batch, "image_size": image_size}

    def distance(c: Mapping[str, Any]) -> float:
        return sum(abs(math.log(max(float(want[k]), 1.0) / max(float(c[k]), 1.0))) for k in SIZE_KEYS)

    best = min(mine, key=distance)
    scale = (size.params / best["params"]) * (size.tokens / best["tokens"]) * (batch / best["batch_size"])
    if iterations is not None and best.get("iterations"):
        scale *= iterations / float(best["iterations"])
    return float(best["seconds"]) * scale


def plan(cfg: BenchmarkConfig, costs: Optional[Sequence[Mapping[str, Any]]] = None) -> list[AttackerPlan]:
    """Per attacker of ``cfg`` (a sweep: summed over its points): calls, rows and estimated seconds."""
    from .validation import point_config

    if cfg.sweep:
        from .sweep_points import grid_points

        points = [point_config(cfg, p) for p in grid_points(cfg)]
    else:
        points = [cfg]
    costs = read_costs() if costs is None else costs
    sizes: dict[str, Optional[ModelSize]] = {}
    out: dict[str, AttackerPlan] = {}
    for pcfg in points:
        _plan_one(pcfg, costs, sizes, out)
    return list(out.values())


def _plan_one(cfg: BenchmarkConfig, costs: Sequence[Mapping[str, Any]], sizes: dict[str, Optional[ModelSize]],
              out: dict[str, AttackerPlan]) -> None:
    import json

    from fedmjp.settings import SETTING_GROUPS

    from .entries import attack_entries, model_spec
    from .inputs import expected_updates

    updates = len(expected_updates(cfg))
    batch = cfg.federation.batch_size * (cfg.federation.clients if cfg.federation.secagg else 1)
    groups = {SETTING_GROUPS[s] for s in cfg.settings}
    device = device_kind(cfg)
    for index in range(len(cfg.models)):
        spec = model_spec(cfg, index)
        key = json.dumps(spec, sort_keys=True, default=str)
        if key not in sizes:
            sizes[key] = model_size(spec)
        size = sizes[key]
        for entry in attack_entries(cfg):
            item = out.setdefault(entry.label, AttackerPlan(entry.label, entry.name))
            calls = updates * len(groups)
            item.calls += calls
            item.rows += updates * batch * len(cfg.settings)
            iterations = entry.options.get("iterations")
            each = None if size is None else per_call(costs, entry.name, device, size, batch, cfg.data.image_size,
                                                       iterations if isinstance(iterations, int) else None,
                                                       trained=cfg.models[index].checkpoint is not None)
            item.seconds = None if (each is None or item.seconds is None) else item.seconds + each * calls


def duration(seconds: float) -> str:
    """``12 s``, ``4.5 min``, ``2.1 h``."""
    if seconds < 90:
        return f"{seconds:.0f} s" if seconds >= 1 else f"{seconds:.1f} s"
    if seconds < 5400:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def plan_text(cfg: BenchmarkConfig, costs: Optional[Sequence[Mapping[str, Any]]] = None) -> str:
    """The plan and estimate a run prints before any work (module docstring)."""
    from tabulate import tabulate

    items = plan(cfg, costs)
    body = [[p.label, p.name, p.calls, p.rows, "no estimate" if p.seconds is None else f"~{duration(p.seconds)}"]
            for p in items]
    known = [p.seconds for p in items if p.seconds is not None]
    missing = [p.label for p in items if p.seconds is None]
    points = f" over {len(_points(cfg))} sweep points" if cfg.sweep else ""
    head = (f"plan: {len(cfg.models)} model row(s) x settings {', '.join(cfg.settings)} x "
            f"{cfg.federation.rounds} round(s) of {cfg.federation.clients} client(s), batch size "
            f"{cfg.federation.batch_size}, {cfg.data.image_size} px{points}{' (dry run)' if cfg.dry_run else ''}")
    total = f"estimate: ~{duration(sum(known))} of attacks on {device_kind(cfg)}" if known else "estimate: none"
    if missing:
        total += f" (no estimate for {', '.join(missing)})"
    total += f"; federations and scoring not included; costs measured in {COSTS.name}"
    table = tabulate(body, headers=["attacker", "attack", "calls", "rows", "attack time"], tablefmt="simple",
                     colalign=("left", "left", "right", "right", "right"))
    return "\n".join([head, table, total])


def _points(cfg: BenchmarkConfig) -> list:
    from .sweep_points import grid_points

    return grid_points(cfg)


# ---------------------------------------------------------------------------------- measuring
def measure(folder: Path) -> list[dict[str, Any]]:
    """Cost entries of a finished run folder: per (attack, model size, batch, image size) the
    median seconds of one attack call (``time_attack_s`` is per image: times the batch size)."""
    from .store import RunFolder, read_jsonl
    from .validation import validate

    cfg = validate(yaml.safe_load((folder / "config.yaml").read_text()))
    rows = read_jsonl(folder / "results.jsonl")
    from .entries import attack_entries, model_spec

    options = {e.label: e.options for e in attack_entries(cfg)}
    specs = {m.name: model_spec(cfg, i) for i, m in enumerate(cfg.models)}
    trained = {m.name: m.checkpoint is not None for m in cfg.models}
    device = device_kind(cfg)
    samples: dict[tuple, list[float]] = {}
    for row in rows:
        t, model = row.get("time_attack_s"), row.get("model")
        if not isinstance(t, (int, float)) or model not in specs or row.get("attack_name") is None:
            continue
        batch = int(row.get("batch_size") or cfg.federation.batch_size)
        iterations = options.get(row["attack"], {}).get("iterations")
        key = (row["attack_name"], model, batch, iterations)
        samples.setdefault(key, []).append(float(t) * batch)
    merged: dict[tuple, dict[str, Any]] = {}
    for (name, model, batch, iterations), times in samples.items():
        size = model_size(specs[model])
        if size is None:
            continue
        entry = {"attack": name, "device": device, "params": size.params, "tokens": size.tokens,
                 "batch_size": batch, "image_size": cfg.data.image_size, "trained": trained[model]}
        if isinstance(iterations, int):
            entry["iterations"] = iterations
        entry_key = tuple(entry.items())
        merged.setdefault(entry_key, {**entry, "samples": []})["samples"] += times
    return [{**{k: v for k, v in e.items() if k != "samples"}, "seconds": round(statistics.median(e["samples"]), 4)}
            for e in merged.values()]


def _entry_key(entry: Mapping[str, Any]) -> tuple:
    return tuple(entry.get(k) for k in ("attack", "device", *SIZE_KEYS, "iterations")) + (
        bool(entry.get("trained", False)),)


def write_costs(entries: Sequence[Mapping[str, Any]], path: Path = COSTS) -> None:
    """Merge ``entries`` into the cost file (an entry of the same key is replaced)."""
    kept = {_entry_key(e): dict(e) for e in read_costs(path)}
    kept.update({_entry_key(e): dict(e) for e in entries})
    header = ("# Measured seconds of one attack call (one update) by attack, device kind, model size, batch\n"
              "# size, image size and trained (a checkpoint loaded) or fresh weights; read by\n"
              "# benchmark/estimate.py. Measured with:\n"
              "#   python run_benchmark.py --setting all --output RUN   (any config)\n"
              "#   python -m benchmark.estimate measure RUN\n")
    body = yaml.safe_dump({"entries": sorted(kept.values(), key=lambda e: tuple(str(v) for v in _entry_key(e)))},
                          sort_keys=False, default_flow_style=None, width=200)
    path.write_text(header + body)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmark.estimate", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    m = sub.add_parser("measure", help="merge a finished run folder's attack times into the cost file")
    m.add_argument("folder", help="a run folder (config.yaml and results.jsonl)")
    args = p.parse_args(argv)
    folder = Path(args.folder)
    if not (folder / "config.yaml").is_file() or not (folder / "results.jsonl").is_file():
        print(f"error: {folder} is no run folder (it needs config.yaml and results.jsonl)", file=sys.stderr)
        return 3
    entries = measure(folder)
    write_costs(entries)
    print(f"{len(entries)} cost entries from {folder} written to {COSTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
