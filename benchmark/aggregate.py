"""Statistics of a run's rows: per (model, attack, setting) means, spreads, medians, seeded bootstrap
intervals and recognisable shares (:func:`aggregate`), and the derived ``strongest`` rows.

With several attackers, every (model, setting) also gets a ``strongest`` row, derived at report
time and never stored in results.jsonl (:func:`strongest_rows`): per image, the attacker whose
reconstruction has the highest PSNR against the ground truth. The evaluator picks with the true
image, as worst-case privacy reporting does: a defence is only as private as the best attack it
faces on each image. Its ``winners`` column says which attacker won how often.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import pandas as pd

import metrics
from fedmjp.stats import bootstrap_ci
from metrics.regions import REGION_COLUMNS

from .config import SETTINGS
from .rows import ROW_KEY
from .scoring import FLAT_COLUMN, IIP_COLUMNS, ROW_METRICS

#: A reconstruction counts as recognisable at SSIM >= this, or (separately) at LPIPS <= that.
RECOGNISABLE_SSIM = 0.5
RECOGNISABLE_LPIPS = 0.3
#: Columns of table_full.csv that get a median and a bootstrap interval.
SHAPE_METRICS = ("mse", "psnr", "ssim", "lpips")
#: The chance level of the identifiability columns (benchmark.scoring.IIP_COLUMNS), per row.
IIP_CHANCE = "iip_chance"
#: Suffix of a model row without a checkpoint, in the table's Model column and the plots' labels.
UNTRAINED = " (untrained)"
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


def rows_frame(rows: Sequence[dict]) -> pd.DataFrame:
    """results.jsonl rows -> DataFrame with every metric column present and numeric (missing -> NaN)."""
    df = pd.DataFrame(list(rows))
    for col in ("model", "label", "setting", "trained", "failed", "correct", "attack", *ROW_METRICS,
                FLAT_COLUMN, *REGION_COLUMNS, *IIP_COLUMNS, "iip_candidates"):
        if col not in df.columns:
            df[col] = np.nan
    for col in ("correct", *ROW_METRICS, FLAT_COLUMN, *REGION_COLUMNS, *IIP_COLUMNS, "iip_candidates"):
        df[col] = pd.to_numeric(df[col], errors="coerce").astype(float)
    # the identifiability columns' chance level: one over the candidates the image competed with
    df[IIP_CHANCE] = 1.0 / df["iip_candidates"].where(df["iip_candidates"] > 0)
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
    predicted), ``flat_psnr_mean`` (the rows' :func:`benchmark.scoring.flat_psnr` floor, over the
    rows the PSNR mean is over; NaN for runs stored without it), and :func:`shape_stats`. With
    several attackers the derived ``strongest`` rows (:func:`strongest_rows`) are aggregated like
    any attacker's, after them, with their ``winners``.
    Ordered as the config's model rows, attackers in order of appearance, then settings a, b, c.
    """
    df = rows_frame(rows)
    if df.empty:
        return pd.DataFrame()
    df = with_strongest(df)
    by = ["model", "attack", "setting"]
    # flat_psnr averaged over the same (non-failed) rows as psnr: the floor of exactly those images
    full = metrics.aggregate(df, by=by, metrics=[*ROW_METRICS, FLAT_COLUMN, *IIP_COLUMNS, IIP_CHANCE])
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
