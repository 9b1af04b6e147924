"""Privacy at matched utility: the privacy-utility frontier of a defence sweep and its matched-utility table.

Input: a sweep's ``sweep.csv`` (:func:`benchmark.sweep_table.sweep_table`) whose points carry the utility
of :func:`benchmark.utility.train_split_utility` (top-1 on the validation split with its bootstrap
interval, after FedAvg with the defence on). One frontier point per (grid point, model, setting): its
``strongest`` row (:func:`benchmark.sweep_table.strongest`), i.e. per image the best attacker's reconstruction.

* **Curves.** A point belongs to the curve of its defence (``defence`` column) in its setting; the
  MJP rows (``model`` is one of ``mjp_models``) with no defence form the ``MJP`` curve, ordered by
  gamma; the other rows with no defence are the ``none`` point, which is also the zero-strength end of
  every defence curve of the same model and setting. A curve is ordered by its defence's strength
  (:data:`STRENGTH`): sigma up for the DP defences, keep down for pruning, bits down for quantisation.
* **Interpolation.** :func:`privacy_at` walks a curve from its weak end and takes the first segment
  whose top-1 range holds the target, linearly in top-1 between its two ends; a target outside every
  segment is not reached (NaN). Its interval is the interpolation at the ends of the target's top-1
  interval (the privacy the curve gives over the accuracies the target is compatible with); where an
  end falls outside the curve, that end of the interval is NaN.
* **Table.** :func:`matched_table`: each defence's privacy at MJP's top-1 (MJP's accuracy cost), and
  MJP's privacy (interpolated along the MJP curve) at each defence point's top-1, with the two
  measured points the value lies between (:func:`between`).

Plot: :func:`frontier_plot` (x = top-1 with its interval, y = PSNR, then LPIPS; one line per curve,
in strength order; MJP and no defence as marked points; every point labelled with its parameter and,
for DP, epsilon).
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np
import pandas as pd

from metrics.prior import MAX_PRIOR_IMAGES

from .sweep_table import gather_rows, strongest, sweep_table

#: defence name -> (parameter, +1: larger is stronger / -1: smaller is stronger)
STRENGTH: dict[str, tuple[str, int]] = {
    "local_dp": ("sigma", 1), "dp_sgd": ("sigma", 1), "central_dp": ("sigma", 1), "prune": ("keep", -1),
    "quantize": ("bits", -1), "mixup": ("k", 1), "fedavg": ("steps", 1), "MJP": ("gamma", 1),
}
DP_DEFENCES = ("local_dp", "dp_sgd", "central_dp")
MJP = "MJP"
NONE = "none"
METRICS = ("psnr", "lpips")


def _defence_params(row: pd.Series) -> dict[str, Any]:
    """The point's defence keys (``sweep.defence`` JSON), {} where the point did not set a defence."""
    raw = row.get("sweep.defence")
    if isinstance(raw, str) and raw.strip().startswith("{"):
        return json.loads(raw)
    return {}


def frontier_points(frame: pd.DataFrame, mjp_models: Sequence[str] = ("DeiT+MJP",)) -> pd.DataFrame:
    """One row per (grid point, model, setting): the ``strongest`` row of ``frame`` with ``curve``
    (defence name, ``MJP`` or ``none``), ``param`` (the curve's strength parameter), ``strength`` (param
    signed so that larger is stronger; -inf for the ``none`` point), ``point_label`` and the columns
    ``top1``, ``top1_low``, ``top1_high`` (in %), ``epsilon``, ``delta``, ``psnr``, ``lpips``.

    Raises:
        ValueError: the frame has no utility (``utility_top1``) or no PSNR.
    """
    for col in ("utility_top1", "psnr"):
        if col not in frame or frame[col].isna().all():
            raise ValueError(f"sweep.csv has no {col} values: run the sweep with utility.rounds > 0 and attacks")
    best = strongest(frame).copy()
    out = []
    for _, row in best.iterrows():
        defence = str(row.get("defence", NONE))
        gamma = row.get("sweep.gamma")
        if defence == NONE and row["model"] in mjp_models and row["setting"] in ("b", "c"):
            curve = MJP
            param = float(gamma) if gamma is not None and not pd.isna(gamma) else math.nan
        elif defence == NONE:
            curve, param = NONE, math.nan
        else:
            curve = defence
            key = STRENGTH.get(defence, (None, 1))[0]
            param = float(_defence_params(row).get(key, math.nan)) if key else math.nan
        sign = STRENGTH.get(curve, (None, 1))[1]
        eps = row.get("utility_dp_epsilon", math.nan)
        label = NONE if curve == NONE else f"{STRENGTH.get(curve, ('?',))[0]} {param:g}"
        if curve in DP_DEFENCES and eps is not None and not pd.isna(eps):
            label += f", eps {eps:.3g}"
        out.append({
            "sweep_index": int(row["sweep_index"]), "sweep": row.get("sweep"), "model": row["model"],
            "setting": row["setting"], "curve": curve, "param": param,
            "strength": -math.inf if curve == NONE else sign * param, "point_label": label,
            "top1": 100.0 * float(row["utility_top1"]),
            "top1_low": 100.0 * float(row.get("utility_top1_low", math.nan)),
            "top1_high": 100.0 * float(row.get("utility_top1_high", math.nan)),
            "epsilon": float(eps) if eps is not None and not pd.isna(eps) else math.nan,
            "delta": float(row.get("utility_dp_delta", math.nan)),
            "psnr": float(row["psnr"]), "lpips": float(row.get("lpips", math.nan)), "n": int(row.get("n", 0)),
            "rero_mu": float(row.get("rero_mu", math.nan)) if not pd.isna(row.get("rero_mu", math.nan)) else math.nan,
        })
    return pd.DataFrame(out)


#: the success rate the ReRo ceiling is read at: the median image (frontier.md's column)
CEILING_SUCCESS = 0.5


def rero_ceilings(points: pd.DataFrame, prior: Any, success: float = CEILING_SUCCESS) -> pd.DataFrame:
    """``points`` with ``rero_ceiling``: for each point whose tapped update is a Gaussian-DP release
    (``rero_mu``), the PSNR (dB) that no attacker reaches on more than ``success`` of the images of
    the ``prior`` [N, 3, H, W] (in [0, 1], the clients' distribution): the highest PSNR the prior's
    best fixed guess reaches on the baseline share :func:`defences.rero.needed_baseline` (``success``,
    mu) (Hayes et al. 2023's bound, :mod:`defences.rero`; :func:`metrics.prior.guess_psnr`). +inf where
    that share is below one image of the prior (mu too large for any bound the sample resolves); NaN
    where the point is no Gaussian-DP release."""
    from defences.rero import needed_baseline
    from metrics.prior import guess_psnr

    out = points.copy()
    cache: dict[float, float] = {}
    ceilings = []
    for mu in out.get("rero_mu", pd.Series(math.nan, index=out.index)):
        if mu is None or pd.isna(mu):
            ceilings.append(math.nan)
            continue
        if float(mu) not in cache:
            cache[float(mu)] = guess_psnr(prior, needed_baseline(success, float(mu)))
        ceilings.append(cache[float(mu)])
    out["rero_ceiling"] = ceilings
    return out


def curves(points: pd.DataFrame) -> dict[tuple[str, str, str], pd.DataFrame]:
    """(model, setting, curve) -> its points in strength order; every defence curve starts at the
    ``none`` point of its model and setting (when the sweep has one)."""
    out = {}
    for (model, setting, curve), g in points.groupby(["model", "setting", "curve"]):
        if curve == NONE:
            continue
        none = points[(points["model"] == model) & (points["setting"] == setting) & (points["curve"] == NONE)]
        if curve != MJP and len(none):
            g = pd.concat([none.iloc[:1], g])
        out[(model, setting, curve)] = g.sort_values("strength", kind="stable").reset_index(drop=True)
    return out


def _segment(curve: pd.DataFrame, top1: float) -> Optional[int]:
    """Index i of the first segment (rows i, i + 1) from the weak end whose top-1 range holds ``top1``
    (a one-point curve: 0 when its top-1 is ``top1``); None when none does."""
    if top1 is None or math.isnan(top1):
        return None
    xs = curve["top1"].to_numpy(float)
    if len(xs) == 1:
        return 0 if xs[0] == top1 else None
    for i in range(len(xs) - 1):
        lo, hi = sorted((xs[i], xs[i + 1]))
        if lo <= top1 <= hi:
            return i
    return None


def interpolate(curve: pd.DataFrame, top1: float, metric: str) -> float:
    """``metric`` at ``top1`` along ``curve`` (rows in strength order): the first segment from the weak
    end whose top-1 range holds ``top1``, linear in top-1; NaN when none does (or top1 is NaN)."""
    i = _segment(curve, top1)
    if i is None:
        return math.nan
    xs, ys = curve["top1"].to_numpy(float), curve[metric].to_numpy(float)
    if len(xs) == 1 or xs[i + 1] == xs[i]:
        return float(ys[i])
    t = (top1 - xs[i]) / (xs[i + 1] - xs[i])
    return float(ys[i] + t * (ys[i + 1] - ys[i]))


def between(curve: pd.DataFrame, top1: float) -> str:
    """The two measured points (``point_label``) whose segment :func:`interpolate` uses at ``top1``,
    as "a .. b" ("" when none): a matched value between ``none`` and a defence's weakest point is a
    line through the undefended point's privacy, not a measurement of the defence."""
    i = _segment(curve, top1)
    if i is None:
        return ""
    labels = list(curve["point_label"]) if "point_label" in curve else [str(j) for j in range(len(curve))]
    return labels[i] if len(labels) == 1 else f"{labels[i]} .. {labels[i + 1]}"


def privacy_at(curve: pd.DataFrame, top1: float, low: float, high: float) -> dict[str, float]:
    """{metric, metric_low, metric_high} for PSNR and LPIPS: the curve at ``top1`` and at the ends of
    ``top1``'s interval [low, high] (module docstring); low/high are the smaller and larger of the two."""
    out = {}
    for metric in METRICS:
        at = [interpolate(curve, x, metric) for x in (top1, low, high)]
        ends = [v for v in at[1:] if not math.isnan(v)]
        out[metric] = at[0]
        out[f"{metric}_low"] = min(ends) if len(ends) == 2 else math.nan
        out[f"{metric}_high"] = max(ends) if len(ends) == 2 else math.nan
    return out


def matched_table(points: pd.DataFrame) -> pd.DataFrame:
    """The matched-utility table: per MJP point and defence curve, the defence's privacy at MJP's
    top-1 (``at: defence @ MJP``), and per defence point, MJP's privacy at its top-1
    (``at: MJP @ defence``), beside the matched point's own privacy."""
    by = curves(points)
    mjp_curves = {k: v for k, v in by.items() if k[2] == MJP}
    rows = []
    for (mjp_model, mjp_setting, _), mcurve in mjp_curves.items():
        for _, m in mcurve.iterrows():
            for (model, setting, curve), dcurve in by.items():
                if curve == MJP:
                    continue
                got = privacy_at(dcurve, m["top1"], m["top1_low"], m["top1_high"])
                rows.append({"at": "defence @ MJP", "defence": curve, "defence_setting": f"{model} ({setting})",
                             "matched_point": f"MJP {m['point_label']} ({mjp_model}, {mjp_setting})",
                             "between": between(dcurve, m["top1"]),
                             "top1": m["top1"], "top1_low": m["top1_low"], "top1_high": m["top1_high"],
                             "own_psnr": m["psnr"], "own_lpips": m["lpips"], **got})
        for (model, setting, curve), dcurve in by.items():
            if curve == MJP:
                continue
            for _, d in dcurve[dcurve["curve"] != NONE].iterrows():
                got = privacy_at(mcurve, d["top1"], d["top1_low"], d["top1_high"])
                rows.append({"at": "MJP @ defence", "defence": curve, "defence_setting": f"{model} ({setting})",
                             "matched_point": f"{curve} {d['point_label']}", "between": between(mcurve, d["top1"]),
                             "top1": d["top1"],
                             "top1_low": d["top1_low"], "top1_high": d["top1_high"], "own_psnr": d["psnr"],
                             "own_lpips": d["lpips"], **got})
    return pd.DataFrame(rows)


def _fmt(v: float, lo: float, hi: float, digits: int) -> str:
    if math.isnan(v):
        return "not reached"
    inner = "" if math.isnan(lo) or math.isnan(hi) else f" [{lo:.{digits}f}, {hi:.{digits}f}]"
    return f"{v:.{digits}f}{inner}"


def _ceiling_text(p: pd.Series) -> str:
    """A point's ReRo cells: mu of the tapped update and the median ceiling (:func:`rero_ceilings`)."""
    mu = p.get("rero_mu", math.nan)
    if mu is None or pd.isna(mu):
        return "| |" if p["curve"] != "central_dp" else "| none: the tap sees the clean update |"
    ceiling = p.get("rero_ceiling", math.nan)
    if ceiling is None or pd.isna(ceiling):
        return f"{mu:.3g} | |"
    return f"{mu:.3g} | {'none the prior resolves' if math.isinf(ceiling) else f'{ceiling:.1f}'} |"


def points_markdown(points: pd.DataFrame) -> str:
    """The frontier's points as a Markdown table (top-1 with interval, epsilon, PSNR, LPIPS, and the
    tapped update's mu with its ReRo median ceiling where :func:`rero_ceilings` ran)."""
    lines = ["| point | model (setting) | curve | top-1 % [95 % CI] | epsilon (delta) | PSNR dB | LPIPS | images | "
             "mu (tapped update) | ReRo median ceiling dB |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for _, p in points.sort_values("sweep_index").iterrows():
        eps = "" if math.isnan(p["epsilon"]) else f"{p['epsilon']:.3g} ({p['delta']:g})"
        name = "no defence" if p["curve"] == NONE else f"{p['curve']} {p['point_label']}"
        lines.append(f"| {name} | {p['model']} ({p['setting']}) | {p['curve']} | "
                     f"{_fmt(p['top1'], p['top1_low'], p['top1_high'], 2)} | {eps} | {p['psnr']:.1f} | "
                     f"{p['lpips']:.2f} | {p['n']} | {_ceiling_text(p)}")
    return "\n".join(lines) + "\n"


def table_markdown(table: pd.DataFrame) -> str:
    """:func:`matched_table` as Markdown: PSNR and LPIPS with the intervals from the top-1 interval."""
    if table.empty:
        return "(no MJP point and defence curve to match)\n"
    lines = ["| privacy of | at the top-1 of | top-1 % [95 % CI] | its PSNR dB | matched PSNR dB | its LPIPS | "
             "matched LPIPS | between |", "|---|---|---|---|---|---|---|---|"]
    for _, r in table.iterrows():
        who = f"{r['defence']} ({r['defence_setting']})" if r["at"] == "defence @ MJP" else "MJP"
        lines.append(f"| {who} | {r['matched_point']} | {_fmt(r['top1'], r['top1_low'], r['top1_high'], 2)} | "
                     f"{r['own_psnr']:.1f} | {_fmt(r['psnr'], r['psnr_low'], r['psnr_high'], 1)} | "
                     f"{r['own_lpips']:.2f} | {_fmt(r['lpips'], r['lpips_low'], r['lpips_high'], 2)} | "
                     f"{r.get('between', '')} |")
    return "\n".join(lines) + "\n"


def psnr_cap(points: pd.DataFrame, exact: float = 60.0, margin: float = 4.0) -> float:
    """Top of the PSNR axis: ``margin`` dB above the highest point below ``exact`` dB when some point
    is an exact reconstruction (>= ``exact``), else no cut (inf)."""
    values = points["psnr"].to_numpy(float)
    values = values[np.isfinite(values)]
    if not len(values) or values.max() < exact or not (values < exact).any():
        return math.inf
    return float(values[values < exact].max()) + margin


def frontier_plot(points: pd.DataFrame, path: str | Path, title: Optional[str] = None) -> Path:
    """PSNR (left) and LPIPS (right) of the strongest attacker against top-1 with its interval; one
    line per defence curve in strength order, MJP points as stars, no defence as a black square, and
    where :func:`rero_ceilings` gave one, each DP point's ReRo median ceiling as a green triangle."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .files import save_figure

    fig, axes = plt.subplots(1, 2, figsize=(13.0, 5.2), squeeze=False)
    colours = plt.get_cmap("tab10")
    by = curves(points)
    for a, metric in enumerate(METRICS):
        ax = axes[0][a]
        # An exact reconstruction (100 dB: the closed forms on an undefended update) would squash every
        # defence into the bottom of the PSNR panel: the axis stops above the highest other point and
        # such points sit on its top edge, marked with their value.
        cap = psnr_cap(points) if metric == "psnr" else math.inf
        for k, ((model, setting, curve), g) in enumerate(by.items()):
            style = dict(marker="*", ms=11, color="crimson") if curve == MJP else dict(marker="o", ms=4,
                                                                                     color=colours(k % 10))
            xerr = np.vstack([g["top1"] - g["top1_low"], g["top1_high"] - g["top1"]])
            ax.errorbar(g["top1"], np.minimum(g[metric], cap), xerr=np.nan_to_num(xerr), capsize=2, lw=1.2,
                        label=f"{curve}: {g['label'].iloc[0] if 'label' in g else model} ({setting})", **style)
            for _, p in g.iterrows():
                if p["curve"] != NONE:
                    ax.annotate(p["point_label"], (p["top1"], min(p[metric], cap)), fontsize=6,
                                textcoords="offset points", xytext=(3, 3))
        if metric == "psnr" and "rero_ceiling" in points:  # what DP allows at each DP point (rero_ceilings)
            bounded = points[np.isfinite(points["rero_ceiling"].to_numpy(float))]
            if len(bounded):
                ax.scatter(bounded["top1"], np.minimum(bounded["rero_ceiling"], cap), marker="v", s=40,
                           facecolors="none", edgecolors="tab:green", zorder=6, label="ReRo median ceiling (DP)")
        none = points[points["curve"] == NONE]
        if len(none):
            xerr = np.vstack([none["top1"] - none["top1_low"], none["top1_high"] - none["top1"]])
            ax.errorbar(none["top1"], np.minimum(none[metric], cap), xerr=np.nan_to_num(xerr), fmt="s", ms=8,
                        color="black", capsize=2, label="no defence", zorder=5)
        if math.isfinite(cap):
            for _, p in points[points[metric] > cap].iterrows():
                ax.annotate(f"{p[metric]:.0f} dB (axis cut)", (p["top1"], cap), fontsize=7, textcoords="offset points",
                            xytext=(-30, -12))
            ax.set_ylim(top=cap + 0.5)
        ax.set_xlabel("top-1 (%) on the validation split after federated training with the defence (95 % CI)",
                      fontsize=8)
        ax.set_ylabel(f"{metric.upper()} of the strongest attacker" + (" (dB)" if metric == "psnr" else ""),
                      fontsize=8)
        ax.grid(alpha=0.3)
    shown: dict[str, Any] = {}  # both panels' entries once each (the ceiling is drawn on PSNR's alone)
    for ax in axes[0]:
        for handle, text in zip(*ax.get_legend_handles_labels()):
            shown.setdefault(text, handle)
    axes[0][1].legend(list(shown.values()), list(shown), fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    save_figure(fig, path, dpi=130)
    plt.close(fig)
    return Path(path)


def write_frontier(sweep_csv: str | Path, out_dir: str | Path, mjp_models: Sequence[str] = ("DeiT+MJP",),
                   title: Optional[str] = None, prior: Any = None) -> dict[str, str]:
    """``frontier_points.csv``, ``matched_utility.csv``, ``frontier.md`` (both tables) and
    ``frontier.png`` of a sweep's ``sweep.csv`` in ``out_dir``; with ``prior`` (images [N, 3, H, W]
    of the clients' distribution) the DP points' ReRo ceilings too (:func:`rero_ceilings`)."""
    from .files import write_text

    out = Path(out_dir)
    points = frontier_points(pd.read_csv(sweep_csv), mjp_models)
    if prior is not None:
        points = rero_ceilings(points, prior)
    table = matched_table(points)
    write_text(out / "frontier_points.csv", points.to_csv(index=False))
    write_text(out / "matched_utility.csv", table.to_csv(index=False))
    write_text(out / "frontier.md", "## Frontier points\n\n" + points_markdown(points)
               + "\n## Privacy at matched utility\n\n" + table_markdown(table))
    plot = frontier_plot(points, out / "frontier.png", title)
    return {"points": str(out / "frontier_points.csv"), "table": str(out / "matched_utility.csv"),
            "markdown": str(out / "frontier.md"), "plot": str(plot)}


#: prior images the ReRo ceilings are estimated from by default: as many as metrics.prior scores
#: against each other (4,096 resolve a baseline share down to 2.4e-4: mu up to ~3.3 at the median)
PRIOR_IMAGES = MAX_PRIOR_IMAGES


def load_prior(source: Any, size: int, num_images: int = PRIOR_IMAGES) -> Any:
    """The ReRo ceilings' prior: ``num_images`` images of ``source`` (an image folder, a data set
    archive or ``embedded``: :func:`fedmjp.data.load_images`) at ``size`` px, [N, 3, H, W] in [0, 1].

    Raises:
        fedmjp.data.DataError: the source cannot be read; ValueError: fewer than 2 images."""
    from fedmjp.data import load_images

    images = load_images(source, size, num_images).images
    if len(images) < 2:
        raise ValueError(f"the prior {source} holds {len(images)} image(s): the ReRo ceiling needs at least 2")
    return images


def finished_points_csv(config: str | Path, sweep_dir: str | Path) -> tuple[Path, list[str], int]:
    """The ``sweep.csv`` of the points of ``config``'s sweep that have finished in ``sweep_dir``
    (rows stored and utility measured), written as ``sweep_dir/sweep_finished.csv``, for a sweep that
    is still running or was stopped; returns (path, the MJP row names, number of grid points)."""
    from .config import load_config
    from .files import write_text
    from .sweep_points import grid_points, point_folder_name
    from .validation import point_config, validate

    cfg = validate(load_config(config))
    points = grid_points(cfg)
    done, folders = [], []
    for i, point in enumerate(points):
        folder = Path(sweep_dir) / "points" / point_folder_name(i, point)
        if (folder / "utility.jsonl").is_file() and (folder / "results.jsonl").is_file():
            done.append(point)
            folders.append(folder)
    rows = gather_rows(done, folders)
    # gather_rows numbers the finished points 0..n-1: give them back their grid index
    index = {id(p): i for i, p in enumerate(points)}
    for row in rows:
        row["sweep_index"] = index[id(done[row["sweep_index"]])]
    path = Path(sweep_dir) / "sweep_finished.csv"
    write_text(path, sweep_table(rows).to_csv(index=False))
    mjp = sorted({m.name for p in points for m in point_config(cfg, p).models if m.variant == "mjp"})
    return path, mjp, len(points)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m benchmark.frontier SWEEP_DIR [--mjp-model NAME ...] [--plot PATH] [--prior SOURCE]``."""
    import argparse
    import shutil

    from fedmjp.data import DataError

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("sweep_dir", help="a sweep's run folder (with sweep.csv)")
    p.add_argument("--mjp-model", action="append", help="model rows whose undefended points are MJP "
                   "(default: DeiT+MJP)")
    p.add_argument("--plot", help="also copy frontier.png here")
    p.add_argument("--title")
    p.add_argument("--config", help="the sweep's config: use the points that have finished so far (a sweep "
                   "still running or stopped) instead of sweep.csv")
    p.add_argument("--prior", help="images of the clients' distribution (a folder, a data set archive or "
                   "'embedded'): the DP points get their ReRo median ceiling (defences/rero.py)")
    p.add_argument("--prior-images", type=int, default=PRIOR_IMAGES, help="images of --prior to use (default "
                   f"{PRIOR_IMAGES})")
    p.add_argument("--image-size", type=int, default=32, help="--prior's images are resized to this (default 32)")
    args = p.parse_args(argv)
    if not 2 <= args.prior_images <= MAX_PRIOR_IMAGES:
        p.error(f"--prior-images must be in [2, {MAX_PRIOR_IMAGES}], got {args.prior_images}")
    if not 8 <= args.image_size <= 512:
        p.error(f"--image-size must be in [8, 512], got {args.image_size}")
    csv = Path(args.sweep_dir) / "sweep.csv"
    mjp = args.mjp_model or ["DeiT+MJP"]
    if args.config:
        csv, found, n = finished_points_csv(args.config, args.sweep_dir)
        mjp = args.mjp_model or found
        print(f"{len(pd.read_csv(csv).drop_duplicates('sweep_index')) if csv.stat().st_size > 1 else 0} of {n} "
              "grid points finished")
    elif not csv.is_file():
        p.error(f"{csv} does not exist: run the sweep first (python run_benchmark.py --config ... --output DIR), "
                "or pass --config for the points finished so far")
    try:
        prior = load_prior(args.prior, args.image_size, args.prior_images) if args.prior else None
        written = write_frontier(csv, args.sweep_dir, mjp, args.title, prior)
    except (ValueError, DataError) as err:
        p.error(str(err))
    if args.plot:
        shutil.copyfile(written["plot"], args.plot)
    print(Path(written["markdown"]).read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
