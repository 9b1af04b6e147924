"""The table of a strength sweep: every point's stored rows gathered with the sweep columns, and
``sweep.csv``'s means per (grid point, model, setting, attack).

Built from the point folders alone (:func:`gather_rows`), so :mod:`benchmark.sweep` (after a run)
and :mod:`benchmark.frontier` (over the finished points of a sweep still running) read one table.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pandas as pd

from .sweep_points import point_label

#: the metric columns of sweep.csv (each also plotted against the grid point: ``sweep_<metric>.png``)
SWEEP_METRICS = ("psnr", "psnr_registered", "iip_pixel", "ssim", "mse", "lpips", "fft2d", "correct", "defence_cos", "dp_epsilon", "utility_top1",
                 "utility_top1_start")
#: metrics whose most-leaked image sweep.csv also holds (``<metric>_worst``)
WORST_METRICS = ("psnr", "ssim", "lpips")
#: per-point utility columns (:func:`benchmark.utility.train_split_utility`), one value per (point,
#: model): carried into sweep.csv beside the metrics, not plotted against the grid
UTILITY_COLUMNS = ("utility_top1_low", "utility_top1_high", "utility_top1_start_low", "utility_top1_start_high",
                   "utility_dp_epsilon", "utility_dp_delta", "utility_rounds", "utility_num_eval")
#: per-point privacy columns of the rows, carried into sweep.csv beside the metrics, not plotted: the
#: tapped update's mu as a Gaussian-DP release of each image (:func:`defences.rero.release_mu`)
PRIVACY_COLUMNS = ("rero_mu",)


def gather_rows(points: list[dict[str, Any]], folders: list[Path]) -> list[dict]:
    """Every point's stored rows with the sweep columns added."""
    from .store import RunFolder, read_jsonl

    rows = []
    for i, (point, folder) in enumerate(zip(points, folders)):
        utility = {}
        if (folder / "utility.jsonl").is_file():
            utility = {r["model"]: r for r in read_jsonl(folder / "utility.jsonl")}
        for row in RunFolder(folder).rows(repair=True):
            row = {**row, **{k: v for k, v in utility.get(row["model"], {}).items() if k != "model"},
                   "sweep": point_label(point), "sweep_index": i}
            row.update({f"sweep.{k}": (json.dumps(v, sort_keys=True) if isinstance(v, (dict, list)) else v)
                        for k, v in point.items()})
            rows.append(row)
    return rows


def sweep_table(rows: list[dict]) -> pd.DataFrame:
    """Means over scored images per (grid point, model, setting, attack), and the most-leaked image's
    PSNR, SSIM and LPIPS (``<metric>_worst``, :data:`WORST_METRICS`); failed rows counted apart;
    PSNR capped at ``metrics.PSNR_CAP_DB`` before averaging, as in the benchmark's table."""
    import metrics as M

    from .aggregate import STRONGEST, rows_frame, winners, with_strongest
    from .scoring import FLAT_COLUMN

    df = rows_frame(rows)  # metric columns numeric ("inf" strings of the store -> inf)
    if df.empty:
        return df
    # with several attackers: the per-image best of them as attack "strongest" (aggregate.STRONGEST_NOTE)
    df = with_strongest(df, extra_keys=("sweep_index",) if "sweep_index" in df else ())
    for col in ("defence_cos", "dp_epsilon", "utility_top1", "utility_top1_start", *UTILITY_COLUMNS, *PRIVACY_COLUMNS):
        if col in df:
            df[col] = pd.to_numeric(df[col], errors="coerce").astype(float)
    for col in (c for c in M.CAPPED_METRICS if c in df):  # exact reconstructions (+inf) count as the cap
        df[col] = df[col].clip(upper=M.PSNR_CAP_DB)
    if "defence" not in df:
        df["defence"] = "none"
    keys = ["sweep_index", "sweep", "model", "label", "defence", "setting", "attack"]
    keys = [k for k in keys if k in df] + sorted(c for c in df if c.startswith("sweep."))
    ok = df[~df["failed"].astype(bool)] if "failed" in df else df
    # flat_psnr: the images' floor of no information beside the PSNR (benchmark.scoring.flat_psnr)
    metrics = [m for m in (*SWEEP_METRICS, FLAT_COLUMN, *UTILITY_COLUMNS, *PRIVACY_COLUMNS) if m in df]
    table = ok.groupby(keys, dropna=False)[metrics].mean(numeric_only=True).reset_index()
    # the most-leaked image of each point (metrics.aggregate's <metric>_worst)
    worst = [m for m in WORST_METRICS if m in df]
    if worst:
        most = ok.groupby(keys, dropna=False)[worst].agg({m: M.METRICS[m].most_leaked for m in worst})
        table = table.merge(most.rename(columns=lambda m: f"{m}_worst").reset_index(), on=keys, how="left")
    counts = df.groupby(keys, dropna=False).agg(n=("failed", "size"), failed=("failed", "sum")).reset_index()
    out = counts.merge(table, on=keys, how="left")
    if (df["attack"] == STRONGEST).any():
        out = out.merge(winners(df, keys), on=keys, how="left")
    return out.sort_values([k for k in ("sweep_index", "model", "setting") if k in out], kind="stable")


def strongest(frame: pd.DataFrame) -> pd.DataFrame:
    """Per (grid point, model, setting): the ``strongest`` row (per image, the best attacker;
    :func:`benchmark.aggregate.strongest_rows`) where several attackers ran, else the one attacker's row."""
    from .aggregate import STRONGEST

    keys = ["sweep_index", "model", "setting"]
    has = frame.groupby(keys)["attack"].transform(lambda a: (a == STRONGEST).any())
    return frame[(frame["attack"] == STRONGEST) | ~has]


#: Decimals of sweep.csv's columns when printed (:func:`sweep_table_text`); the paper's metrics take
#: the run table's (:data:`benchmark.tables.METRIC_COLUMNS`), the rest this default.
TEXT_DECIMALS = {"psnr": 2, "psnr_worst": 2, "flat_psnr": 2, "dp_epsilon": 2, "utility_dp_epsilon": 2}
DEFAULT_DECIMALS = 4


def sweep_table_text(frame: pd.DataFrame) -> str:
    """sweep.csv as an aligned text table for the terminal: one line per (grid point, model,
    setting, attack), each number rounded to its column's decimals, empty columns left out (the
    ``sweep.<key>`` columns too: the ``sweep`` label names the point)."""
    from tabulate import tabulate

    from .tables import METRIC_COLUMNS

    if frame.empty:
        return "(no rows)"
    decimals = {**{m: d for m, _, d in METRIC_COLUMNS}, **TEXT_DECIMALS}
    shown = [c for c in frame.columns if not c.startswith("sweep.") and c not in ("sweep_index", "label")
             and frame[c].notna().any()]
    body = []
    for _, row in frame[shown].iterrows():
        line = []
        for c in shown:
            v = row[c]
            if isinstance(v, float) and c not in ("n", "failed"):
                line.append("" if pd.isna(v) else f"{v:.{decimals.get(c, DEFAULT_DECIMALS)}f}")
            elif c in ("n", "failed") and not pd.isna(v):
                line.append(str(int(v)))
            else:
                line.append("" if v is None or (isinstance(v, float) and pd.isna(v)) else str(v))
        body.append(line)
    return tabulate(body, headers=shown, tablefmt="simple", disable_numparse=True,
                    colalign=["right" if pd.api.types.is_numeric_dtype(frame[c]) else "left" for c in shown])
