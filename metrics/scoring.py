"""Settings-aware scoring of reconstructions and aggregation to a table (the settings: docs/design.md,
"Threat model and the settings (a), (b), (c)").

Settings: (a) the gradient of x, reconstruction compared with x; (b) the gradient of the MJP-shuffled
x~, compared with x~; (c) the same gradient as (b), compared with the original x.
"""
from __future__ import annotations

import logging
import math
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence, Union

import lpips as lpips_pkg
import pandas as pd
import torch

from ._inner import pair_gram
from ._validate import RANGE_TOLERANCE, check_image_batch, check_pair
from .fourier import fft2d_clamped_from_gram, fft2d_from_gram, fft2d_hermitian_from_gram
from .lpips_cache import LpipsFeatureCache
from .perceptual import lpips
from .pixel import mse_from_gram, psnr_from_mse, ssim
from .quantize import SUFFIX_8BIT, quantize_8bit
from .registry import METRICS, PAPER_METRICS, get_metric
from .structural import ssim_official

log = logging.getLogger(__name__)

#: Which image each setting compares the reconstruction with.
SETTING_REFERENCE: dict[str, str] = {"a": "x", "b": "x_tilde", "c": "x"}
#: PSNR values above this (identical images give +inf) are capped before averaging.
PSNR_CAP_DB = 100.0


def reference_for(setting: str, x: torch.Tensor, x_tilde: Optional[torch.Tensor]) -> tuple[str, torch.Tensor]:
    """(name, tensor) of the image a setting compares with: x for 'a' and 'c', x~ for 'b'.

    Raises:
        ValueError: unknown setting (lists the valid ones) or setting 'b' without ``x_tilde``.
    """
    if setting not in SETTING_REFERENCE:
        raise ValueError(f"unknown setting {setting!r}; valid settings: {', '.join(SETTING_REFERENCE)}")
    name = SETTING_REFERENCE[setting]
    if name == "x_tilde":
        if x_tilde is None:
            raise ValueError(f"setting {setting!r} compares with the shuffled image: x_tilde is required")
        return name, x_tilde
    return name, x


#: Metrics derived from one :func:`metrics._inner.pair_gram` pass: (needs reflections, [B,k,k], numel -> [B]).
_FROM_GRAM: dict[str, tuple[bool, Callable[[torch.Tensor, int], torch.Tensor]]] = {
    "mse": (False, mse_from_gram),
    "psnr": (False, lambda g, n: psnr_from_mse(mse_from_gram(g, n))),
    "fft2d": (True, fft2d_from_gram),
    "fft2d_clamped": (True, lambda g, n: fft2d_clamped_from_gram(g)),
    "fft2d_hermitian": (False, fft2d_hermitian_from_gram),
}


def score_all(
    reconstruction: torch.Tensor,
    reference: torch.Tensor,
    metrics: Sequence[str] = PAPER_METRICS,
    lpips_model: Optional[lpips_pkg.LPIPS] = None,
    lpips_resize: Union[str, int, None] = "auto",
    lpips_cache: Optional[LpipsFeatureCache] = None,
) -> dict[str, torch.Tensor]:
    """Several metrics of one batch in one pass: the values of the per-metric functions, computed once.

    The pair is validated once; MSE, PSNR and the FFT2D family come from one float64 pass over the
    images (PSNR from the same MSE), SSIM variants and LPIPS from one call each; ``<name>_8bit``
    metrics share one 8-bit quantisation of the pair.

    Args:
        reconstruction, reference: [B, 3, H, W] in [0, 1].
        metrics: registry names (:data:`metrics.METRICS`).
        lpips_model: model for LPIPS (default :func:`get_lpips_model` on CPU).
        lpips_resize: passed to :func:`metrics.lpips` as ``resize``.
        lpips_cache: passed to :func:`metrics.lpips` as ``cache`` (features of images seen before).
    Returns:
        name -> [B] float64 CPU tensor, in the order of ``metrics``.
    Raises:
        ValueError: unknown metric name or invalid images.
    """
    for name in metrics:
        get_metric(name)
    check_pair(reconstruction, reference)
    values: dict[str, torch.Tensor] = {}
    groups = {"": [m for m in metrics if not m.endswith(SUFFIX_8BIT)],
              SUFFIX_8BIT: [m[: -len(SUFFIX_8BIT)] for m in metrics if m.endswith(SUFFIX_8BIT)]}
    for suffix, names in groups.items():
        if not names:
            continue
        rec, ref = reconstruction, reference
        if suffix:
            rec, ref = quantize_8bit(rec.clamp(0.0, 1.0)), quantize_8bit(ref)
        gram_names = [n for n in names if n in _FROM_GRAM]
        if gram_names:
            reflect = any(_FROM_GRAM[n][0] for n in gram_names)
            gram = pair_gram(rec, ref, reflect=reflect, validate=False)
            for n in gram_names:
                values[n + suffix] = _FROM_GRAM[n][1](gram, ref[0].numel())
        for n in names:
            if n == "ssim":
                values[n + suffix] = ssim(rec, ref, validate=False)
            elif n == "ssim_official":
                values[n + suffix] = ssim_official(rec, ref, validate=False)
            elif n == "lpips":
                values[n + suffix] = lpips(rec, ref, model=lpips_model, resize=lpips_resize, validate=False,
                                           cache=lpips_cache)
            elif n not in _FROM_GRAM:
                values[n + suffix] = get_metric(n + suffix).fn(rec, ref)
    return {m: values[m] for m in metrics}


def score(
    setting: str,
    reconstruction: torch.Tensor,
    x: torch.Tensor,
    x_tilde: Optional[torch.Tensor] = None,
    metrics: Sequence[str] = PAPER_METRICS,
    lpips_model: Optional[lpips_pkg.LPIPS] = None,
    clamp: bool = True,
    extra: Optional[Mapping[str, Any]] = None,
    lpips_resize: Union[str, int, None] = "auto",
    lpips_cache: Optional[LpipsFeatureCache] = None,
) -> list[dict[str, Any]]:
    """Score a batch of reconstructions under a setting; one row per image, every row kept.

    A reconstruction that contains NaN/Inf gives a row with ``failed=True``,
    ``failure="non-finite reconstruction"`` and NaN metric values. Reconstructions are clipped to
    [0, 1] when ``clamp`` (attacks may overshoot; ``clamped`` says whether a row was clipped beyond
    the range tolerance); with ``clamp=False`` an out-of-range row fails instead. The references must
    be valid (a bad reference is a caller bug and raises).

    Args:
        setting: 'a', 'b' or 'c' (module docstring).
        reconstruction: [B, 3, H, W], meant to be in [0, 1].
        x: [B, 3, H, W] in [0, 1], the original images.
        x_tilde: [B, 3, H, W] in [0, 1], the MJP-shuffled images; required for setting 'b'.
        metrics: registry names (:data:`metrics.METRICS`).
        lpips_model: model for "lpips" (default :func:`get_lpips_model` on CPU).
        clamp: clip reconstructions to [0, 1] instead of failing them.
        extra: fields copied into every row (model name, attack, seed, ...).
        lpips_resize: LPIPS input resizing (:func:`metrics.lpips`; default: upsample below 64 px).
        lpips_cache: features of images scored before (:class:`metrics.LpipsFeatureCache`).
    Returns:
        B dicts: ``index``, ``setting``, ``reference``, the ``extra`` fields, ``failed``, ``failure``,
        ``clamped`` and one float per metric.
    Raises:
        ValueError: unknown setting or metric, bad reference, or shapes that differ.
    """
    ref_name, reference = reference_for(setting, x, x_tilde)
    chosen = [get_metric(m) for m in metrics]
    check_image_batch(reference, ref_name)
    if not isinstance(reconstruction, torch.Tensor) or reconstruction.shape != reference.shape:
        got = tuple(reconstruction.shape) if isinstance(reconstruction, torch.Tensor) else type(reconstruction).__name__
        raise ValueError(f"reconstruction must have the shape of {ref_name} {tuple(reference.shape)}, got {got}")
    if not reconstruction.is_floating_point():
        raise ValueError(f"reconstruction must be floating point, got {reconstruction.dtype}")

    rec = reconstruction.detach()
    flat = rec.flatten(1)
    finite = torch.isfinite(flat).all(dim=1).cpu()
    # Replace non-finite values so min/max below stay meaningful; those rows fail anyway.
    safe = torch.nan_to_num(flat, nan=0.0, posinf=0.0, neginf=0.0)
    out_of_range = ((safe.min(dim=1).values < -RANGE_TOLERANCE) | (safe.max(dim=1).values > 1 + RANGE_TOLERANCE)).cpu()

    rows: list[dict[str, Any]] = []
    for i in range(rec.shape[0]):
        row: dict[str, Any] = {"index": i, "setting": setting, "reference": ref_name, **(extra or {})}
        row.update(failed=False, failure=None, clamped=bool(out_of_range[i] and finite[i]))
        if not finite[i]:
            row.update(failed=True, failure="non-finite reconstruction", clamped=False)
        elif out_of_range[i] and not clamp:
            row.update(failed=True, failure="reconstruction outside [0, 1]", clamped=False)
        row.update({m.name: math.nan for m in chosen})
        rows.append(row)

    ok = torch.tensor([not r["failed"] for r in rows])
    n_failed = int((~ok).sum())
    if n_failed:
        log.warning("setting %s: %d of %d reconstructions failed", setting, n_failed, len(rows))
    if not bool(ok.any()):
        return rows
    idx = ok.nonzero().flatten()
    rec_ok = rec[idx.to(rec.device)].clamp(0.0, 1.0)
    ref_ok = reference[idx.to(reference.device)]
    values = score_all(rec_ok, ref_ok.to(rec_ok.device), [m.name for m in chosen], lpips_model=lpips_model,
                       lpips_resize=lpips_resize, lpips_cache=lpips_cache)
    for name, vals in values.items():
        for j, v in zip(idx.tolist(), vals.tolist()):
            rows[j][name] = float(v)
    return rows


#: The PSNR columns :func:`aggregate` caps at ``psnr_cap_db`` (an exact copy scores +inf).
CAPPED_METRICS = ("psnr", "psnr_registered", "psnr_8bit")


def aggregate(
    rows: Iterable[Mapping[str, Any]] | pd.DataFrame,
    by: Sequence[str] = ("model", "setting"),
    metrics: Optional[Sequence[str]] = None,
    psnr_cap_db: Optional[float] = PSNR_CAP_DB,
) -> pd.DataFrame:
    """Mean, standard deviation (pandas' sample std, ddof=1) and count of each metric per group.

    Failed rows (``failed`` True) are left out of the statistics and counted in ``n_failed``;
    ``n`` counts all rows of the group. PSNR values above ``psnr_cap_db`` (identical images give
    +inf) are replaced by the cap before averaging (every column of :data:`CAPPED_METRICS`), those of
    ``psnr`` counted in ``psnr_n_capped``; pass None to
    keep them (means may then be inf).

    Args:
        rows: result rows (from :func:`score` plus any grouping fields) or a DataFrame of them.
        by: grouping columns; empty for one group over everything.
        metrics: metric columns; default every registered metric present in the rows.
        psnr_cap_db: cap for PSNR in dB.
    Returns:
        One row per group: the ``by`` columns, ``n``, ``n_failed``, then ``<m>_mean``, ``<m>_std``,
        ``<m>_count`` per metric, ``<m>_worst`` per registered metric: the most-leaked image's value
        (:meth:`Metric.most_leaked`: the highest PSNR / SSIM, the lowest MSE / LPIPS; a defence is
        only as private as its worst-protected image), and ``psnr_n_capped`` when PSNR is present.
    Raises:
        ValueError: a grouping or metric column is missing.
    """
    df = rows.copy() if isinstance(rows, pd.DataFrame) else pd.DataFrame(list(rows))
    by = list(by)
    missing = [c for c in by if c not in df.columns]
    if missing:
        raise ValueError(f"grouping columns {missing} not in the rows; available: {', '.join(map(str, df.columns))}")
    if metrics is None:
        metrics = [m for m in METRICS if m in df.columns]
    else:
        absent = [m for m in metrics if m not in df.columns]
        if absent:
            raise ValueError(f"metric columns {absent} not in the rows; available: {', '.join(map(str, df.columns))}")
    failed = df["failed"].fillna(False).astype(bool) if "failed" in df.columns else pd.Series(False, index=df.index)
    df["failed"] = failed

    keys = by if by else ["_all"]
    if not by:
        df["_all"] = "all"
    capped = pd.Series(False, index=df.index)
    if psnr_cap_db is not None:
        for m in (m for m in CAPPED_METRICS if m in metrics):
            values = pd.to_numeric(df[m], errors="coerce")
            over = (values > psnr_cap_db) & ~failed
            df[m] = values.where(~over, psnr_cap_db)
            capped = over if m == "psnr" else capped
    df["_capped"] = capped

    groups = df.groupby(keys, dropna=False, sort=True)
    table = pd.DataFrame({"n": groups.size(), "n_failed": groups["failed"].sum().astype(int)})
    ok = df[~failed]
    if len(metrics):
        by_group = ok.groupby(keys, dropna=False, sort=True)
        stats = by_group[list(metrics)].agg(["mean", "std", "count"])
        stats.columns = [f"{m}_{s}" for m, s in stats.columns]
        table = table.join(stats, how="left")
        for m in metrics:
            table[f"{m}_count"] = table[f"{m}_count"].fillna(0).astype(int)
        for m in (m for m in metrics if m in METRICS):
            table[f"{m}_worst"] = by_group[m].agg(METRICS[m].most_leaked)
    if "psnr" in metrics and psnr_cap_db is not None:
        table["psnr_n_capped"] = groups["_capped"].sum().astype(int)
    table = table.reset_index()
    return table.drop(columns=["_all"]) if not by else table
