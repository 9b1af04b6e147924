"""Tables and image grids of a run, built only from its output folder (``results.jsonl``, the stored
PNGs and ``config.yaml``), never from in-memory state: re-running this on a folder reproduces them.

Tables follow the paper's Table 5: one row per model and setting, columns Acc., MSE, FFT2D, PSNR,
SSIM, LPIPS, with an arrow for the direction that means *more private* (higher MSE/FFT2D/LPIPS,
lower PSNR/SSIM); with several attackers, one row per model, attacker and setting (an ``Attack``
column appears). ``table_full.csv`` adds standard deviations, counts and failures, and for the shape
of each row's distribution: the median, a seeded 95% bootstrap interval of the mean, and the share
of images recovered recognisably (SSIM >= 0.5; LPIPS <= 0.3), plus the per-region means of MJP rows.
``dist_<setting>.png`` shows the per-image PSNR and LPIPS distributions as box plots.

With several attackers, every (model, setting) also gets a ``strongest`` row, derived here at
report time and never stored in results.jsonl (:func:`strongest_rows`): per image, the attacker
whose reconstruction has the highest PSNR against the ground truth. The evaluator picks with the
true image, as worst-case privacy reporting does: a defence is only as private as the best attack
it faces on each image. Its ``winners`` column says which attacker won how often.
"""
from __future__ import annotations

import io
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
from PIL import Image, ImageDraw, ImageFont
from tabulate import tabulate

import metrics
from metrics.regions import REGION_COLUMNS

from .config import SETTING_GROUPS, SETTINGS
from .files import save_figure, write_bytes, write_text
from .rows import ROW_KEY
from .scoring import ROW_METRICS
from .store import RunFolder, load_png, rec_kind

_logger = logging.getLogger(__name__)

#: (column in results.jsonl, table header with the arrow towards "more private", decimals)
METRIC_COLUMNS = tuple((m, metrics.PAPER_COLUMN_LABELS[m], d)
                       for m, d in zip(metrics.PAPER_METRICS, (4, 4, 2, 4, 4)))
ACC_HEADER = "Acc. (%) ↑"
#: A reconstruction counts as recognisable at SSIM >= this, or (separately) at LPIPS <= that.
RECOGNISABLE_SSIM = 0.5
RECOGNISABLE_LPIPS = 0.3
BOOTSTRAP_RESAMPLES = 2000
BOOTSTRAP_SEED = 0
#: Columns of table_full.csv that get a median and a bootstrap interval.
SHAPE_METRICS = ("mse", "psnr", "ssim", "lpips")
ACC_NOTE = ("Acc.: top-1 of the model as trained (block 0 unmodified) on the setting's input (x for a, "
            "x~ for b/c). Rows with `april: surgery` were attacked on a copy whose block 0 had its norm1 and "
            "attention residual removed (APRIL design A); column `correct_attacked_model` of results.jsonl "
            "holds the top-1 of that modified model.")
UNTRAINED = " (untrained)"
#: The header arrows, which tabulate's LaTeX escaping leaves as Unicode (pdflatex has no glyph).
_TEX_ARROWS = {"↑": r"$\uparrow$", "↓": r"$\downarrow$"}
#: The ``attack`` column of the derived per-image best-of-all-attackers rows.
STRONGEST = "strongest"
#: PSNRs (dB) the strongest row ranks as equal: two attackers' reconstructions that close are the same
#: image up to rounding (e.g. two exact closed forms scored against x in setting c).
STRONGEST_TIE_DB = 1e-3
#: Columns that identify one attacked image of one model and setting (results.jsonl's row key
#: without the attack); a sweep adds ``sweep_index``.
IMAGE_KEY = tuple(k for k in ROW_KEY if k != "attack")
STRONGEST_NOTE = (
    "`strongest` rows: per image, the attacker whose reconstruction has the highest PSNR against the ground "
    "truth (the evaluator picks with the true image, as worst-case privacy reporting does; PSNRs above the "
    "100 dB cap are exact copies and count as ties, as do PSNRs within 0.001 dB; ties go to the attacker listed "
    "first); every other column of the row is that reconstruction's own value, so SSIM, "
    "LPIPS, MSE and FFT2D belong to the chosen image. A failed attack never wins; an image every attacker "
    "failed is failed in the `strongest` row too. `winners`: how many of the row's images each attacker won.")


@dataclass
class Tables:
    """``table`` is the paper layout (formatted strings); ``full`` the numbers behind it."""

    table: pd.DataFrame
    full: pd.DataFrame


def rows_frame(rows: Sequence[dict]) -> pd.DataFrame:
    """results.jsonl rows -> DataFrame with every metric column present and numeric (missing -> NaN)."""
    df = pd.DataFrame(list(rows))
    for col in ("model", "label", "setting", "trained", "failed", "correct", "attack", *ROW_METRICS,
                *REGION_COLUMNS):
        if col not in df.columns:
            df[col] = np.nan
    for col in ("correct", *ROW_METRICS, *REGION_COLUMNS):
        df[col] = pd.to_numeric(df[col], errors="coerce").astype(float)
    df["failed"] = df["failed"].fillna(False).astype(bool)
    df["attack"] = df["attack"].fillna("").astype(str)
    return df


def strongest_rows(df: pd.DataFrame, extra_keys: Sequence[str] = ()) -> pd.DataFrame:
    """Per image, the best reconstruction over every attacker run on it (:data:`STRONGEST_NOTE`).

    Rule: among the image's non-failed attacker rows, the highest PSNR, capped at
    ``metrics.PSNR_CAP_DB`` as in the means (above it every reconstruction is an exact copy; a NaN
    PSNR ranks below any number), ties to the attacker that appears first in the rows. The chosen row is copied whole (every metric, the region scores, ``correct``), its
    ``attack`` set to ``strongest`` and its attacker kept in ``winner``. Where every attacker
    failed on the image, the row is failed with the reasons of all of them (``winner`` None;
    ``error`` True when one of them was an unexpected error).

    Args:
        df: :func:`rows_frame` output.
        extra_keys: more columns that tell images apart (``sweep_index`` in a sweep).
    Returns:
        The derived rows (``attack_name`` ``strongest``, ``n_attackers`` competing), or an empty
        frame when the rows hold fewer than two attackers.
    """
    attackers = [a for a in dict.fromkeys(df["attack"]) if a != STRONGEST] if "attack" in df else []
    if len(attackers) < 2:
        return df.iloc[0:0].copy()
    keys = [k for k in (*extra_keys, *IMAGE_KEY) if k in df.columns]
    src = df[df["attack"].isin(attackers)].copy()
    src["_failed"] = src["failed"].fillna(False).astype(bool)
    # above the tables' cap every reconstruction is an exact copy and the digits are rounding noise:
    # such ties go to the attacker listed first, not to whichever rounded luckier
    # and below it PSNRs within STRONGEST_TIE_DB are the same reconstruction up to rounding
    src["_score"] = (pd.to_numeric(src["psnr"], errors="coerce").clip(upper=metrics.PSNR_CAP_DB)
                     .div(STRONGEST_TIE_DB).round().fillna(-math.inf))
    src["_order"] = src["attack"].map({a: i for i, a in enumerate(attackers)})
    ranked = src.sort_values(["_failed", "_score", "_order"], ascending=[True, False, True], kind="stable")
    best = ranked.drop_duplicates(keys, keep="first").copy()
    grouped = src.groupby(keys, dropna=False, sort=False)
    counts = grouped["attack"].nunique().rename("n_attackers").reset_index()
    best = best.merge(counts, on=keys, how="left")
    best["winner"] = best["attack"].where(~best["_failed"], None)
    if best["_failed"].any():
        # every attacker failed on these images: say why each did
        failed_src = src[src["_failed"]].copy()
        failed_src["_why"] = failed_src["attack"] + ": " + failed_src.get("reason", pd.Series(index=failed_src.index)
                                                                           ).fillna("failed").astype(str)
        err = (failed_src["error"].fillna(False).astype(bool) if "error" in failed_src
               else pd.Series(False, index=failed_src.index))
        failed_src["_err"] = err
        why = failed_src.groupby(keys, dropna=False, sort=False).agg(_why=("_why", "; ".join), _err=("_err", "any"))
        best = best.merge(why.reset_index(), on=keys, how="left")
        all_failed = best["_failed"]
        best.loc[all_failed, "reason"] = "every attacker failed (" + best.loc[all_failed, "_why"] + ")"
        if "error" in best:
            best["error"] = best["error"].astype(object)
            best.loc[all_failed, "error"] = best.loc[all_failed, "_err"].astype(bool)
            best.loc[~all_failed, "error"] = False
        best = best.drop(columns=["_why", "_err"])
    elif "error" in best:
        best["error"] = False
    best["attack"] = STRONGEST
    if "attack_name" in best:
        best["attack_name"] = STRONGEST
    return best.drop(columns=["_failed", "_score", "_order"]).reset_index(drop=True)


def with_strongest(df: pd.DataFrame, extra_keys: Sequence[str] = ()) -> pd.DataFrame:
    """``df`` and, with two or more attackers, its :func:`strongest_rows` after it (stored
    ``strongest`` rows, if any, are recomputed rather than kept)."""
    if df.empty or "attack" not in df:
        return df
    base = df[df["attack"] != STRONGEST]
    extra = strongest_rows(base, extra_keys)
    if extra.empty:
        return base
    out = pd.concat([base, extra], ignore_index=True, sort=False)
    out["failed"] = out["failed"].fillna(False).astype(bool)
    return out


def winners(df: pd.DataFrame, by: Sequence[str]) -> pd.DataFrame:
    """``winners`` per group of ``strongest`` rows: ``"<attacker> <won>/<images>, ..."``, most wins
    first (then in the attackers' order); images every attacker failed on count in the denominator."""
    sub = df[df["attack"] == STRONGEST]
    if sub.empty or "winner" not in sub:
        return pd.DataFrame(columns=[*by, "winners"])
    order = {a: i for i, a in enumerate(dict.fromkeys(a for a in df["attack"] if a != STRONGEST))}
    records = []
    for key, g in sub.groupby(list(by), dropna=False, sort=False):
        won = g["winner"].dropna().value_counts()
        ranked = sorted(won.items(), key=lambda kv: (-kv[1], order.get(kv[0], len(order))))
        text = ", ".join(f"{a} {int(c)}/{len(g)}" for a, c in ranked)
        failed = int(g["winner"].isna().sum())
        if failed:
            text += (", " if text else "") + f"every attacker failed {failed}/{len(g)}"
        records.append({**dict(zip(by, key if isinstance(key, tuple) else (key,))), "winners": text})
    return pd.DataFrame(records, columns=[*by, "winners"])


def bootstrap_ci(values: np.ndarray, resamples: int = BOOTSTRAP_RESAMPLES, seed: int = BOOTSTRAP_SEED,
                 level: float = 0.95) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean (``scipy.stats.bootstrap``, seeded: the same values
    give the same interval) over the finite ``values``; (NaN, NaN) for none.

    One value, or values all equal, have no spread to resample: the interval is the mean itself
    (scipy needs two observations and would give a zero-width interval anyway).
    """
    from scipy import stats

    values = np.asarray(values, dtype=float)
    values = values[np.isfinite(values)]
    if values.size == 0:
        return math.nan, math.nan
    point = float(values.mean())
    if values.size < 2 or np.ptp(values) == 0:
        return point, point
    # percentile, not scipy's default BCa: a handful of images per row, often tied (exact copies at the
    # PSNR cap), make BCa's jackknife acceleration erratic; the percentile interval is what the
    # tables always reported
    res = stats.bootstrap((values,), np.mean, n_resamples=resamples, confidence_level=level,
                          method="percentile", vectorized=True, rng=np.random.default_rng(seed))
    return float(res.confidence_interval.low), float(res.confidence_interval.high)


def shape_stats(df: pd.DataFrame, by: Sequence[str]) -> pd.DataFrame:
    """Per group, over non-failed rows: ``<m>_median``, ``<m>_ci_low``/``<m>_ci_high`` (95% bootstrap
    interval of the mean; PSNR capped as in the means), the recognisable shares ``recognisable_ssim``
    (SSIM >= 0.5) and ``recognisable_lpips`` (LPIPS <= 0.3) over the rows where the metric exists,
    and the means of the per-region columns."""
    ok = df[~df["failed"]].copy()
    ok["psnr"] = ok["psnr"].clip(upper=metrics.PSNR_CAP_DB)
    records = []
    for key, g in ok.groupby(list(by), dropna=False, sort=False):
        rec = dict(zip(by, key if isinstance(key, tuple) else (key,)))
        for m in SHAPE_METRICS:
            v = g[m].to_numpy(dtype=float)
            v = v[np.isfinite(v)]
            rec[f"{m}_median"] = float(np.median(v)) if v.size else math.nan
            rec[f"{m}_ci_low"], rec[f"{m}_ci_high"] = bootstrap_ci(v)
        ssim, lp = g["ssim"].dropna(), g["lpips"].dropna()
        rec["recognisable_ssim"] = float((ssim >= RECOGNISABLE_SSIM).mean()) if len(ssim) else math.nan
        rec["recognisable_lpips"] = float((lp <= RECOGNISABLE_LPIPS).mean()) if len(lp) else math.nan
        for col in REGION_COLUMNS:
            v = g[col].clip(upper=metrics.PSNR_CAP_DB) if col.startswith("psnr") else g[col]
            rec[f"{col}_mean"] = float(v.mean()) if v.notna().any() else math.nan
        records.append(rec)
    return pd.DataFrame(records, columns=[*by, *[f"{m}_{k}" for m in SHAPE_METRICS for k in ("median", "ci_low", "ci_high")],
                                          "recognisable_ssim", "recognisable_lpips",
                                          *[f"{c}_mean" for c in REGION_COLUMNS]])


def aggregate(rows: Sequence[dict], model_order: Sequence[str] | None = None) -> pd.DataFrame:
    """Per (model, attack, setting): ``n`` rows, ``n_failed``, ``n_error`` (failures from an
    unexpected attack error), mean/std/count of each metric (:func:`metrics.aggregate`: failed rows
    left out, PSNR capped at ``metrics.PSNR_CAP_DB``), ``acc_mean``/``acc_count``: top-1 of the model
    as trained over every attacked image (an attack failure does not change what the model
    predicted), and :func:`shape_stats`. With several attackers the derived ``strongest`` rows
    (:func:`strongest_rows`) are aggregated like any attacker's, after them, with their ``winners``.
    Ordered as the config's model rows, attackers in order of appearance, then settings a, b, c.
    """
    df = rows_frame(rows)
    if df.empty:
        return pd.DataFrame()
    df = with_strongest(df)
    by = ["model", "attack", "setting"]
    full = metrics.aggregate(df, by=by, metrics=list(ROW_METRICS))
    acc = df.groupby(by)["correct"].agg(acc_mean="mean", acc_count="count").reset_index()
    errors = (df["error"].fillna(False).astype(bool) if "error" in df.columns
              else pd.Series(False, index=df.index))
    n_error = errors.groupby([df[c] for c in by]).sum().astype(int).rename("n_error").reset_index()
    info = df.groupby("model")[["label", "trained"]].first().reset_index()
    full = (full.merge(acc, on=by).merge(n_error, on=by).merge(info, on="model")
            .merge(shape_stats(df, by), on=by, how="left"))
    if (df["attack"] == STRONGEST).any():
        full = full.merge(winners(df, by), on=by, how="left")
    full["trained"] = full["trained"].fillna(False).astype(bool)
    order = list(dict.fromkeys(list(model_order or []) + list(full["model"])))
    attacks = list(dict.fromkeys(df["attack"]))
    full["_m"] = full["model"].map({m: i for i, m in enumerate(order)})
    full["_a"] = full["attack"].map({a: i for i, a in enumerate(attacks)})
    full["_s"] = full["setting"].map({s: i for i, s in enumerate(SETTINGS)})
    full = full.sort_values(["_m", "_a", "_s"]).drop(columns=["_m", "_a", "_s"]).reset_index(drop=True)
    first = ["model", "label", "trained", "attack", "setting", "n", "n_failed", "n_error", "acc_mean", "acc_count"]
    return full[first + [c for c in full.columns if c not in first]]


def _fmt(value: float, decimals: int) -> str:
    return "—" if value is None or not math.isfinite(value) else f"{value:.{decimals}f}"


def paper_table(full: pd.DataFrame) -> pd.DataFrame:
    """The paper's Table 5 layout from :func:`aggregate`'s output (strings)."""
    records = []
    several = full["attack"].nunique() > 1 if "attack" in full.columns else False
    for _, r in full.iterrows():
        rec = {"Model": f"{r['label']}{'' if r['trained'] else UNTRAINED}"}
        if several:
            rec["Attack"] = str(r["attack"])
        rec.update({"Setting": f"({r['setting']})", ACC_HEADER: _fmt(100.0 * r["acc_mean"], 1)})
        for col, header, dec in METRIC_COLUMNS:
            rec[header] = _fmt(r[f"{col}_mean"], dec)
        errors = int(r.get("n_error", 0) or 0)
        rec["n"] = f"{int(r['n'])}" + (f" ({int(r['n_failed'])} failed{f', {errors} on errors' if errors else ''})"
                                       if r["n_failed"] else "")
        if "winners" in full.columns:
            rec["Winners"] = r["winners"] if isinstance(r["winners"], str) else ""
        records.append(rec)
    return pd.DataFrame(records)


def _colalign(table: pd.DataFrame) -> tuple[str, ...]:
    """Names (model, attack, setting) left, numbers right, the strongest rows' winners (last) left."""
    n_left = 3 if "Attack" in table.columns else 2
    n_right = len(table.columns) - n_left - ("Winners" in table.columns)
    return ("left",) * n_left + ("right",) * n_right + ("left",) * ("Winners" in table.columns)


def to_markdown(table: pd.DataFrame) -> str:
    """Markdown table keeping the formatted strings as they are (no re-parsing into numbers)."""
    return table.to_markdown(index=False, disable_numparse=True, colalign=_colalign(table))


def to_latex(table: pd.DataFrame) -> str:
    """A booktabs tabular (tabulate's ``latex_booktabs``: escapes _ % & # ~ and friends), the
    formatted strings kept as they are."""
    tex = tabulate(table.values.tolist(), headers=list(table.columns), tablefmt="latex_booktabs",
                   disable_numparse=True, colalign=_colalign(table))
    for arrow, math_arrow in _TEX_ARROWS.items():
        tex = tex.replace(arrow, math_arrow)
    return tex + "\n"


def build_tables(run: RunFolder) -> Tables:
    """Aggregate ``results.jsonl`` of a run folder."""
    cfg = run.load_config() if run.config_path.is_file() else {}
    order = [row["name"] for row in cfg.get("models", [])]
    full = aggregate(run.rows(), order)
    return Tables(paper_table(full) if not full.empty else pd.DataFrame(), full)


def failure_notes(rows: Sequence[dict]) -> list[str]:
    """``"<model> (<setting>): <count> x <reason>"`` for every failure reason in the rows."""
    counts: dict[tuple[str, str, str], int] = {}
    for r in rows:
        if r.get("failed"):
            who = str(r.get("label") or r.get("model")) + (f" / {r['attack']}" if r.get("attack") else "")
            key = (who, str(r.get("setting")), str(r.get("reason")))
            counts[key] = counts.get(key, 0) + 1
    return [f"{m} ({s}): {n} x {reason}" for (m, s, reason), n in counts.items()]


def write_tables(run: RunFolder) -> Tables:
    """Write ``table.csv``, ``table.md``, ``table.tex`` and ``table_full.csv``; return the tables."""
    tables = build_tables(run)
    folder = run.folder
    write_text(folder / "table.csv", tables.table.to_csv(index=False))
    write_text(folder / "table_full.csv", tables.full.to_csv(index=False))
    md = to_markdown(tables.table) if not tables.table.empty else "(no results)"
    rows = run.rows()
    if any(r.get("april") == "surgery" for r in rows):
        md += "\n\n" + ACC_NOTE
    if "winners" in tables.full.columns:
        md += "\n\n" + STRONGEST_NOTE
    lpips_notes = sorted({str(r["lpips_note"]) for r in rows if r.get("lpips_note")})
    if lpips_notes:  # the run went on without LPIPS weights: say why the column is empty
        md += "\n\n" + "\n".join(f"{n}." if not n.endswith(".") else n for n in lpips_notes)
    notes = failure_notes(rows)
    if notes:
        md += "\n\nFailed rows (left out of the means):\n" + "\n".join(f"- {n}" for n in notes)
    write_text(folder / "table.md", md + "\n")
    write_text(folder / "table.tex", to_latex(tables.table) if not tables.table.empty else "")
    return tables


def write_distributions(run: RunFolder, settings: Sequence[str]) -> list[Path]:
    """``dist_<setting>.png``: per (model, attack) box plots of per-image PSNR (capped) and LPIPS over
    the non-failed rows, the shape that a mean hides. Built from results.jsonl (matplotlib, Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    df = rows_frame(run.rows())
    out: list[Path] = []
    if df.empty:
        return out
    df = with_strongest(df)
    df = df[~df["failed"]]
    for setting in settings:
        sub = df[df["setting"] == setting]
        if sub.empty:
            continue
        groups = list(dict.fromkeys(zip(sub["model"], sub["attack"])))
        names = [f"{m}\n{a}" if sub["attack"].nunique() > 1 else str(m) for m, a in groups]
        fig, axes = plt.subplots(1, 2, figsize=(max(6.0, 1.6 * len(groups) * 2), 3.6))
        for ax, col, title in ((axes[0], "psnr", f"PSNR (dB, capped at {metrics.PSNR_CAP_DB:g}) ↓ private"),
                               (axes[1], "lpips", "LPIPS ↑ private")):
            data = [sub[(sub["model"] == m) & (sub["attack"] == a)][col].clip(upper=metrics.PSNR_CAP_DB)
                    .dropna().to_numpy() for m, a in groups]
            ax.boxplot(data, showmeans=True)
            ax.set_xticks(range(1, len(groups) + 1), names, fontsize=7)
            ax.set_title(title, fontsize=9)
            if col == "lpips":
                ax.axhline(RECOGNISABLE_LPIPS, ls="--", lw=0.8, color="grey")
        fig.suptitle(f"setting ({setting}): per-image distributions (triangle = mean)", fontsize=10)
        fig.tight_layout()
        path = run.folder / f"dist_{setting}.png"
        save_figure(fig, path, dpi=100)
        plt.close(fig)
        out.append(path)
    return out


# ------------------------------------------------------------------------------------------ grids
def _font(size: int) -> ImageFont.FreeTypeFont | ImageFont.ImageFont:
    try:
        return ImageFont.load_default(size=size)
    except TypeError:  # Pillow without FreeType: fixed bitmap font
        return ImageFont.load_default()


@dataclass(frozen=True)
class GridLayout:
    """Pixel geometry of a grid: ``n_rows`` model rows by ``n_cols`` image tiles."""

    n_rows: int
    n_cols: int
    tile: int
    left: int = 150
    header: int = 34
    caption: int = 16
    pad: int = 4

    @property
    def size(self) -> tuple[int, int]:
        """(width, height) in pixels."""
        return (self.left + self.n_cols * (self.tile + self.pad) + self.pad,
                self.header + self.n_rows * (self.tile + self.caption + self.pad) + self.pad)

    def origin(self, row: int, col: int) -> tuple[int, int]:
        return (self.left + self.pad + col * (self.tile + self.pad),
                self.header + self.pad + row * (self.tile + self.caption + self.pad))


def grid_columns(setting: str) -> tuple[str, ...]:
    """Tile kinds per selected image: originals, x~ where it applies, the reconstruction."""
    return ("x", "rec") if setting == "a" else ("x", "xs", "rec")


_KIND_TITLE = {"x": "x", "xs": "x~", "rec": "recon."}


def _tile(path: Path | None, tile: int) -> Image.Image:
    if path is None or not path.is_file():
        img = Image.new("RGB", (tile, tile), (235, 235, 235))
        ImageDraw.Draw(img).text((4, tile // 2 - 6), "missing", fill=(120, 120, 120), font=_font(11))
        return img
    return Image.fromarray(load_png(path)).resize((tile, tile), Image.Resampling.NEAREST)


def select_images(rows: pd.DataFrame, setting: str, k: int) -> list[tuple[str, int, int, int]]:
    """The first ``k`` stored images in (round, partition, batch index) order, each image once:
    (image_id, round, partition_id, batch_index) of its first attack."""
    sub = rows[(rows["setting"] == setting) & rows["image_stored"].fillna(False).astype(bool)]
    if sub.empty:
        return []
    sub = sub.sort_values(["round", "partition_id", "batch_index"]).drop_duplicates("image_id")
    return [(r.image_id, int(r["round"]), int(r.partition_id), int(r.batch_index)) for _, r in sub.head(k).iterrows()]


def _psnr_caption(value: float) -> str:
    """ASCII only: PIL's default font lacks the dash and infinity glyphs."""
    if value is None or math.isnan(value):
        return "PSNR n/a"
    return "PSNR inf (exact)" if math.isinf(value) else f"PSNR {value:.1f} dB"


def build_grid(run: RunFolder, setting: str, k: int, tile: int) -> Path | None:
    """``grid_<setting>.png`` from stored images: rows = models, columns = (x, [x~,] recon.) per image.

    Captions under the reconstructions give the row's PSNR in dB (against the setting's reference).
    """
    df = rows_frame(run.rows())
    if df.empty or "image_stored" not in df.columns:
        return None
    chosen = select_images(df, setting, k)
    if not chosen:
        return None
    df = with_strongest(df)  # a strongest row shows the winning attacker's stored reconstruction
    cfg = run.load_config()
    attacks = list(dict.fromkeys(df["attack"]))
    present = set(zip(df["model"], df["attack"]))
    pairs = [(r["name"], a) for r in cfg["models"] for a in attacks if (r["name"], a) in present]
    labels = {r["name"]: r.get("label") or r["name"] for r in cfg["models"]}
    kinds = grid_columns(setting)
    layout = GridLayout(len(pairs), len(chosen) * len(kinds), tile)
    canvas = Image.new("RGB", layout.size, (255, 255, 255))
    draw = ImageDraw.Draw(canvas)
    small, big = _font(11), _font(13)
    draw.text((6, 4), f"setting ({setting})", fill=(0, 0, 0), font=big)
    group = SETTING_GROUPS[setting]
    for j, (image_id, rnd, part, _) in enumerate(chosen):
        for c, kind in enumerate(kinds):
            x0, _ = layout.origin(0, j * len(kinds) + c)
            title = f"{str(image_id)[:14]}" if c == 0 else ""
            draw.text((x0, 2), title, fill=(0, 0, 0), font=small)
            draw.text((x0, 17), _KIND_TITLE[kind], fill=(60, 60, 60), font=small)
    for i, (model, attack) in enumerate(pairs):
        trained = bool(df[df["model"] == model]["trained"].fillna(False).iloc[0])
        _, y0 = layout.origin(i, 0)
        draw.text((6, y0 + tile // 2 - 14), str(labels[model])[:22], fill=(0, 0, 0), font=big)
        sub_label = ("" if trained else "untrained ") + (attack[:18] if len(attacks) > 1 else "")
        if sub_label.strip():
            draw.text((6, y0 + tile // 2 + 2), sub_label.strip(), fill=(110, 110, 110), font=small)
        for j, (image_id, rnd, part, bidx) in enumerate(chosen):
            match = df[(df["model"] == model) & (df["attack"] == attack) & (df["setting"] == setting)
                       & (df["image_id"] == image_id) & (df["round"] == rnd) & (df["partition_id"] == part)]
            shown = attack
            if attack == STRONGEST and not match.empty:
                winner = match.iloc[0].get("winner")
                shown = winner if isinstance(winner, str) else attack
            for c, kind in enumerate(kinds):
                stored = rec_kind(shown, setting) if kind == "rec" else kind
                path = run.image_path(model, group, image_id, stored, rnd, part)
                x0, y0 = layout.origin(i, j * len(kinds) + c)
                canvas.paste(_tile(path, tile), (x0, y0))
                if kind == "rec" and not match.empty:
                    r = match.iloc[0]
                    text = "failed" if bool(r["failed"]) else _psnr_caption(r["psnr"])
                    if attack == STRONGEST and shown != attack:  # the winner, short enough for a tile
                        text = f"{text.removeprefix('PSNR ')} {shown[:8]}"
                    draw.text((x0 + 2, y0 + tile + 1), text, fill=(0, 0, 0), font=small)
    out = run.folder / f"grid_{setting}.png"
    buf = io.BytesIO()
    canvas.save(buf, format="PNG")
    write_bytes(out, buf.getvalue())
    return out


def write_grids(run: RunFolder, settings: Sequence[str], k: int, tile: int) -> list[Path]:
    """One grid per setting that has stored images."""
    if k == 0:
        return []
    return [p for s in settings if (p := build_grid(run, s, k, tile)) is not None]
