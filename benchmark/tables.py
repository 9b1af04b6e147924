"""The run's tables, built only from its output folder (``results.jsonl`` and ``config.yaml``):
re-running this on a folder reproduces them.

Tables follow the paper's Table 5: one row per model and setting, columns Acc., MSE, FFT2D, PSNR,
SSIM, LPIPS, with an arrow for the direction that means *more private* (higher MSE/FFT2D/LPIPS,
lower PSNR/SSIM), and beside PSNR the floor of no information (``PSNR flat``: a flat image of the
model's normalisation mean colour scored against the same images); with several attackers, one
row per model, attacker and setting (an ``Attack`` column appears), and beside the mean PSNR the most-leaked
image's (``PSNR max``). ``table_full.csv`` adds standard deviations, counts and failures, and for the shape
of each row's distribution: the median, a seeded 95% bootstrap interval of the mean, and the share
of images recovered recognisably (SSIM >= 0.5; LPIPS <= 0.3), plus the per-region means of MJP rows
(:mod:`benchmark.aggregate`).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import pandas as pd
from tabulate import tabulate

import metrics

from .aggregate import STRONGEST_NOTE, UNTRAINED, aggregate  # noqa: F401  (UNTRAINED: importable here too)
from .files import write_text
from .store import RunFolder

#: (column in results.jsonl, table header with the arrow towards "more private", decimals)
METRIC_COLUMNS = tuple((m, metrics.PAPER_COLUMN_LABELS[m], d)
                       for m, d in zip(metrics.PAPER_METRICS, (4, 4, 2, 4, 4)))
ACC_HEADER = "Acc. (%) ↑"
#: Header of the flat-image floor beside the PSNR column (no arrow: not a privacy score of the row).
FLAT_HEADER = "PSNR flat"
FLAT_NOTE = ("PSNR flat: the PSNR of a flat image of the model's normalisation mean colour against the same "
             "images as the row's PSNR (column `flat_psnr` of results.jsonl), what an attacker scores without "
             "reading the update; a PSNR at or below it recovered nothing measurable.")
#: Header of the most-leaked image's PSNR beside the mean (``psnr_worst`` of table_full.csv).
WORST_HEADER = "PSNR max"
WORST_NOTE = ("PSNR max: the row's most-leaked image (its highest PSNR, capped at 100 dB like the mean); "
              "table_full.csv holds every metric's most-leaked value (`<metric>_worst`: the highest PSNR and "
              "SSIM, the lowest MSE, LPIPS and FFT2D). A defence is only as private as its worst-protected image.")
RPSNR_HEADER = f"{metrics.PAPER_COLUMN_LABELS['psnr_registered']}"
RPSNR_NOTE = ("rPSNR: breaching's registered PSNR, the PSNR after a similarity alignment of the reconstruction "
              "to its image (kornia's ImageRegistrator; docs/metrics.md), at least the PSNR: the score that does "
              "not punish a shifted, rotated or rescaled read.")
#: The network behind the LPIPS column (metrics/perceptual.py), named as suites compare it.
LPIPS_NOTE = ("LPIPS: the `lpips` package's AlexNet trunk with its v0.1 linear heads (`lpips.LPIPS(net=\"alex\")`, "
              "as breaching builds it); images below 64 px are upsampled to 64 px first, which breaching does not do, "
              "so at 32 px the two suites' LPIPS differ (docs/metrics.md).")
#: Headers of the identifiability columns (benchmark.scoring.IIP_COLUMNS), the chance level beside.
IIP_HEADERS = {"iip_pixel": "IIP ↓ (chance)", "iip_lpips": "IIP-LPIPS ↓ (chance)"}
IIP_NOTE = ("IIP: image identifiability precision (Yin et al. 2021, as breaching computes it): the share of "
            "reconstructions whose nearest image of the same label in the run's image set (by pixel L2; "
            "IIP-LPIPS: by LPIPS) is the client's own; in brackets the chance level, the mean of one over the "
            "number of candidates. Settings a and c (the set holds x, not x~); docs/metrics.md.")
ACC_NOTE = ("Acc.: top-1 of the model as trained (block 0 unmodified) on the setting's input (x for a, "
            "x~ for b/c). Rows with `april: surgery` were attacked on a copy whose block 0 had its norm1 and "
            "attention residual removed (APRIL design A); column `correct_attacked_model` of results.jsonl "
            "holds the top-1 of that modified model.")
#: The header arrows, which tabulate's LaTeX escaping leaves as Unicode (pdflatex has no glyph).
_TEX_ARROWS = {"↑": r"$\uparrow$", "↓": r"$\downarrow$"}


@dataclass
class Tables:
    """``table`` is the paper layout (formatted strings); ``full`` the numbers behind it."""

    table: pd.DataFrame
    full: pd.DataFrame


def _fmt(value: float, decimals: int) -> str:
    return "—" if value is None or not math.isfinite(value) else f"{value:.{decimals}f}"


def paper_table(full: pd.DataFrame) -> pd.DataFrame:
    """The paper's Table 5 layout from :func:`aggregate`'s output (strings)."""
    records = []
    several = full["attack"].nunique() > 1 if "attack" in full.columns else False
    # the floor of no information, where the rows carry it (runs stored before the column have none)
    flat = "flat_psnr_mean" in full.columns and bool(full["flat_psnr_mean"].notna().any())
    # breaching's registered PSNR, where the run computed it (metrics.rpsnr)
    registered = "psnr_registered_mean" in full.columns and bool(full["psnr_registered_mean"].notna().any())
    iip = [c for c in IIP_HEADERS if f"{c}_mean" in full.columns and bool(full[f"{c}_mean"].notna().any())]
    for _, r in full.iterrows():
        rec = {"Model": f"{r['label']}{'' if r['trained'] else UNTRAINED}"}
        if several:
            rec["Attack"] = str(r["attack"])
        rec.update({"Setting": f"({r['setting']})", ACC_HEADER: _fmt(100.0 * r["acc_mean"], 1)})
        for col, header, dec in METRIC_COLUMNS:
            rec[header] = _fmt(r[f"{col}_mean"], dec)
            if col == "psnr" and flat:
                rec[FLAT_HEADER] = _fmt(r["flat_psnr_mean"], dec)
            if col == "psnr" and "psnr_worst" in full.columns:
                rec[WORST_HEADER] = _fmt(r["psnr_worst"], dec)
            if col == "psnr" and registered:
                rec[RPSNR_HEADER] = _fmt(r["psnr_registered_mean"], dec)
        for col in iip:
            rec[IIP_HEADERS[col]] = (f"{_fmt(r[f'{col}_mean'], 2)} ({_fmt(r['iip_chance_mean'], 2)})"
                                     if math.isfinite(r[f"{col}_mean"]) else "—")
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
    if FLAT_HEADER in tables.table.columns:
        md += "\n\n" + FLAT_NOTE
    if WORST_HEADER in tables.table.columns:
        md += "\n\n" + WORST_NOTE
    if RPSNR_HEADER in tables.table.columns:
        md += "\n\n" + RPSNR_NOTE
    if any(h in tables.table.columns for h in IIP_HEADERS.values()):
        md += "\n\n" + IIP_NOTE
    if "winners" in tables.full.columns:
        md += "\n\n" + STRONGEST_NOTE
    lpips_notes = sorted({str(r["lpips_note"]) for r in rows if r.get("lpips_note")})
    if lpips_notes:  # the run went on without LPIPS weights: say why the column is empty
        md += "\n\n" + "\n".join(f"{n}." if not n.endswith(".") else n for n in lpips_notes)
    elif "lpips_mean" in tables.full.columns and tables.full["lpips_mean"].notna().any():
        md += "\n\n" + LPIPS_NOTE
    notes = failure_notes(rows)
    if notes:
        md += "\n\nFailed rows (left out of the means):\n" + "\n".join(f"- {n}" for n in notes)
    write_text(folder / "table.md", md + "\n")
    write_text(folder / "table.tex", to_latex(tables.table) if not tables.table.empty else "")
    return tables
