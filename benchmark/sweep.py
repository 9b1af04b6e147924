"""Strength sweeps: one benchmark per grid point, gathered into one run folder with a ``sweep`` column.

``sweep:`` in a config (or ``--sweep defence.sigma=0,0.01,0.1`` on the command line) maps dotted
config keys to lists of values; the grid is their Cartesian product, in the order given. A list of
mappings instead is an explicit list of points (``[{defence: {name: prune, keep: 0.1}}, {gamma: 0.5}]``),
for one table of several defences and MJP's gamma series. Every grid
point is a complete benchmark run (resumable on its own) in ``<output>/points/<NN>-<slug>/``; the
run folder itself holds:

* ``results.jsonl``: every point's rows with ``sweep`` (``"defence.sigma=0.01"``), ``sweep_index``
  and one ``sweep.<key>`` column per swept key (rebuilt from the points' stores at the end);
* ``sweep.csv``: means per (grid point, model, setting, attack): PSNR, SSIM, MSE, LPIPS, FFT2D,
  top-1 (``correct``), ``defence_cos`` (cosine of the sent update to the clean one), ``dp_epsilon``,
  ``flat_psnr`` (a flat image of the model's normalisation mean colour scored against the same images:
  the floor of no information, :func:`benchmark.scoring.flat_psnr`);
  with several attackers also a ``strongest`` row per (grid point, model, setting), the per-image
  best reconstruction over the attackers picked by PSNR against the ground truth
  (:data:`benchmark.aggregate.STRONGEST_NOTE`), with ``winners`` saying which attacker won how often;
* ``sweep_<metric>.png`` (metric against the grid point, one curve per model and setting) and
  ``privacy_utility.png`` (PSNR and LPIPS of the ``strongest`` row against utility, one curve per
  model row and defence, so an MJP row swept over gamma is a curve beside the defences).

Utility on the x axis of ``privacy_utility.png``: top-1 after ``utility.rounds`` FedAvg rounds with
the defence on (:mod:`benchmark.utility`, ``utility.jsonl`` in each point folder) when
``utility.rounds`` > 0; otherwise the mean cosine similarity of the sent update to the clean update
(computed by every client for every row), a proxy; the axis label says which.
"""
from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pandas as pd

from .config import BenchmarkConfig
from .errors import ConfigError
from .files import append_line, save_figure, write_text
from .rows import ResultRow, jsonable
from .sweep_points import grid_points, point_folder_name, point_label
from .sweep_table import SWEEP_METRICS, gather_rows, strongest, sweep_table
from .validation import point_config

_logger = logging.getLogger(__name__)


def run_sweep(cfg: BenchmarkConfig, output: str, federate: Callable[..., Any] | None = None,
              progress: bool = True, force: bool = False) -> dict[str, Any]:
    """Run every grid point into ``output/points/`` (each resumable), then gather rows, write
    ``results.jsonl``, ``sweep.csv`` and the plots in ``output``. ``force`` (``--force``) is each
    point's and the top folder's (:class:`benchmark.store.RunFolder`): a point whose stored rows came
    from other code resumes with the differences recorded in its provenance.json.

    Returns:
        {"folder", "points": [point folders], "csv", "plots": [paths], "rows", "summaries": [each
        point's RunSummary, for its exit status (pipeline.raise_for_errors)]}.
    """
    from fedmjp.checkpoint import read_once

    with read_once():  # every point (and its utility) uses the checkpoints as read once, at the first
        return _run_points(cfg, output, federate, progress, force)


def _run_points(cfg: BenchmarkConfig, output: str, federate: Callable[..., Any] | None,
                progress: bool, force: bool = False) -> dict[str, Any]:
    """The body of :func:`run_sweep`, inside its :func:`fedmjp.checkpoint.read_once` block."""
    from .pipeline import run_benchmark
    from .store import RunFolder

    points = grid_points(cfg)
    if not points:
        raise ConfigError("run_sweep needs a non-empty sweep (sweep: {key: [values]} or --sweep key=v1,v2)")
    configs = [point_config(cfg, p) for p in points]  # every bad point fails before any work
    top = RunFolder(output, force=force)
    top.init(cfg)
    folders, summaries = [], []
    for i, (point, pcfg) in enumerate(zip(points, configs)):
        folder = top.folder / "points" / point_folder_name(i, point)
        pcfg.output = str(folder)
        _logger.info("sweep point %d/%d: %s", i + 1, len(points), point_label(point))
        summaries.append(run_benchmark(pcfg, str(folder), federate=federate, progress=progress, force=force))
        if pcfg.utility.rounds > 0:
            point_utility(pcfg, folder, federate)
        folders.append(folder)
    rows = gather_rows(points, folders)
    write_text(top.results_path, "")  # derived from the points' stores: rebuilt on every run
    top.append(ResultRow.from_mapping(r) for r in rows)
    frame = sweep_table(rows)
    csv = top.folder / "sweep.csv"
    write_text(csv, frame.to_csv(index=False))
    keys = list(dict.fromkeys(k for p in points for k in p))
    plots = write_sweep_plots(frame, top.folder, keys if isinstance(cfg.sweep, dict) else keys + ["(points)"])
    from .batch_plot import batch_plot

    by_batch = batch_plot(frame, top.folder / "batch_size.png")  # None unless the sweep varies B
    plots += [by_batch] if by_batch is not None else []
    if any(pc.utility.rounds > 0 and pc.utility.split == "train" for pc in configs):
        from .frontier import write_frontier

        # the MJP rows: every row of an MJP variant in any point (their undefended points form MJP's curve)
        mjp = sorted({m.name for pc in configs for m in pc.models if m.variant == "mjp"})
        plots.append(Path(write_frontier(csv, top.folder, mjp, prior=_rero_prior(cfg, frame))["plot"]))
    from .report import write_report

    write_report(top.folder)  # report.html over sweep.csv and the plots, linking each point's report
    return {"folder": str(top.folder), "points": [str(f) for f in folders], "csv": str(csv),
            "plots": [str(p) for p in plots], "rows": len(rows), "summaries": summaries}


def _rero_prior(cfg: BenchmarkConfig, frame: Any) -> Any:
    """The ReRo ceilings' prior (:func:`benchmark.frontier.load_prior`: the attack images' source) where
    some point's tapped update is a Gaussian-DP release (``rero_mu``), else None; a source that cannot
    be read leaves the ceilings out with a warning, not the sweep's tables."""
    if "rero_mu" not in frame or not frame["rero_mu"].notna().any():
        return None
    from fedmjp.data import DataError

    from .frontier import load_prior

    try:
        return load_prior(cfg.data.source, cfg.data.image_size)
    except (DataError, ValueError) as err:
        _logger.warning("the ReRo ceilings are left out: no prior from %s (%s)", cfg.data.source, err)
        return None


def point_utility(cfg: BenchmarkConfig, folder: Path, federate: Callable[..., Any] | None = None
                  ) -> list[dict]:
    """Utility of every model row of one grid point, stored in ``utility.jsonl`` (kept when present:
    same folder, same config, same seeded result)."""
    import torch

    from .pipeline import build_rows
    from .store import read_jsonl
    from .utility import defence_utility

    path = folder / "utility.jsonl"
    stored = {r["model"]: r for r in read_jsonl(path)} if path.is_file() else {}
    out = []
    # defence_utility trains a CPU copy of each row's model, so the rows are built there too.
    for row in build_rows(cfg, torch.device("cpu")):
        if row.name not in stored:
            record = {"model": row.name, **defence_utility(cfg, row, federate)}
            append_line(path, json.dumps(jsonable(record), allow_nan=False))  # strict JSON (rows.jsonable)
            stored[row.name] = record
        out.append(stored[row.name])
    return out


def write_sweep_plots(frame: pd.DataFrame, folder: Path, keys: list[str]) -> list[Path]:
    """``sweep_<metric>.png`` per metric present and ``privacy_utility.png`` (matplotlib Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if frame.empty:
        return []
    out = []
    numeric_x = (len(keys) == 1 and f"sweep.{keys[0]}" in frame
                 and pd.api.types.is_numeric_dtype(frame[f"sweep.{keys[0]}"]))
    xcol = f"sweep.{keys[0]}" if numeric_x else "sweep_index"
    for metric in [m for m in SWEEP_METRICS if m in frame and frame[m].notna().any()]:
        fig, ax = plt.subplots(figsize=(9.0, 4.2))
        from .batch_plot import curve_style

        # colour per (model row, setting), marker and line style per attacker, strongest dashed on top
        colours: dict[tuple[str, str], str] = {}
        attackers = list(dict.fromkeys(frame["attack"]))
        for (name, setting, attack), g in frame.groupby(["label" if "label" in frame else "model", "setting",
                                                         "attack"], sort=False):
            g = g.sort_values(xcol)
            colour = colours.setdefault((name, setting), f"C{len(colours) % 10}")
            ax.plot(g[xcol], g[metric], color=colour, label=f"{name} ({setting}, {attack})",
                    **curve_style(attackers.index(attack), attack))
        ax.set_xlabel(keys[0] if numeric_x else "grid point")
        if not numeric_x:
            labels = frame.drop_duplicates("sweep_index").sort_values("sweep_index")
            ax.set_xticks(labels["sweep_index"], labels["sweep"], rotation=30, ha="right", fontsize=7)
        ax.set_ylabel(metric)
        ax.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.02, 1.0), ncol=1 + len(ax.lines) // 24)
        fig.tight_layout()
        path = folder / f"sweep_{metric}.png"
        save_figure(fig, path, dpi=120)
        plt.close(fig)
        out.append(path)
    out.append(privacy_utility_plot(frame, folder / "privacy_utility.png"))
    return out


def privacy_utility_plot(frame: pd.DataFrame, path: Path) -> Path:
    """PSNR and LPIPS of the strongest attack (rows) against utility (columns: measured top-1 when
    present, and the cosine of the sent update to the clean one). One colour per model row and
    defence, a marker and line style per setting (benchmark.batch_plot.curve_style); points are numbered by
    grid index. A utility that is one value at every point gives way to the grid point on its axis."""
    import matplotlib.pyplot as plt

    best = strongest(frame)
    from .batch_plot import constant, curve_style

    xs = [x for x in ("utility_top1", "defence_cos") if x in best and best[x].notna().any()]
    # one value at every point (an MJP gamma sweep sends the clean update of x~: cosine 1.0) would
    # stack every point on one x: such an axis gives way to the grid point, and its label says why
    flat = {x: float(pd.to_numeric(best[x]).dropna().iloc[0]) for x in xs
            if constant(best[x]) and best["sweep_index"].nunique() > 1}
    if flat:
        best = best.assign(**{x: best["sweep_index"] for x in flat})
    ys = [m for m in ("psnr", "lpips") if m in best and best[m].notna().any()]
    xlabel = {"utility_top1": "utility: top-1 after FedAvg with the defence",
              "defence_cos": "utility proxy: cosine(sent update, clean update)"}
    if not xs or not ys:  # every row failed (no score), or no utility column: a figure that says so
        fig, ax = plt.subplots(figsize=(6.0, 2.0))
        ax.axis("off")
        ax.text(0.5, 0.5, "no privacy-utility curve: " + ("no row of the strongest attack has a score (every "
                "attack failed: see the table's failed rows)" if not ys else "no utility was measured"),
                ha="center", va="center", wrap=True, fontsize=9)
        save_figure(fig, path, dpi=130)
        plt.close(fig)
        return path
    curves = list(best.groupby(["label", "defence"]).groups)
    fig, axes = plt.subplots(len(ys), len(xs), figsize=(5.0 * len(xs) + 3.2, 3.6 * len(ys)), squeeze=False)
    for r, metric in enumerate(ys):
        for c, x in enumerate(xs):
            ax = axes[r][c]
            for k, key in enumerate(curves):
                for setting, g in best[(best["label"] == key[0]) & (best["defence"] == key[1])].groupby("setting"):
                    g = g.sort_values(x)
                    ax.plot(g[x], g[metric], color=f"C{k % 10}", **curve_style("abc".find(setting) + 1),
                            label=f"{key[0]} / {key[1]} ({setting})" if (r, c) == (0, len(xs) - 1) else None)
                    for _, row in g.iterrows():
                        ax.annotate(str(row["sweep_index"]), (row[x], row[metric]), fontsize=5,
                                    textcoords="offset points", xytext=(2, 2))
            if x in flat:
                ticks = best.drop_duplicates("sweep_index").sort_values("sweep_index")
                ax.set_xticks(ticks["sweep_index"], ticks["sweep"], rotation=30, ha="right", fontsize=7)
            ax.set_xlabel(xlabel[x] if x not in flat else f"grid point ({xlabel[x]} is {flat[x]:.3g} at every "
                          "point; utility.rounds > 0 measures top-1)", fontsize=8)
            ax.set_ylabel(f"{metric.upper()} of the strongest attack", fontsize=8)
    axes[0][-1].legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.02, 1.0), ncol=1 + len(curves) // 16)
    fig.tight_layout()
    save_figure(fig, path, dpi=130)
    plt.close(fig)
    return path
