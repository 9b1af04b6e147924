"""``report.html``: one static page per run folder (and per sweep folder) that a reader can act on.

Built from the folder's stored files alone (``results.jsonl``, ``table.csv`` / ``table_full.csv`` or
``sweep.csv``, ``config.yaml``, ``provenance.json`` and the PNGs the run wrote), so
``python -m benchmark.report RUN_FOLDER`` rebuilds it from a copied folder. The page holds, in order:

* **Verdict**: one sentence per model row, against the strongest attacker (the ``strongest`` rows:
  per image the best attacker, :data:`benchmark.aggregate.STRONGEST_NOTE`; the one attacker's rows
  where only one ran), per setting: which attacker won most images, which reference it reads
  (x in (a) and (c), x~ in (b): :data:`metrics.SETTING_REFERENCE`) and at what mean PSNR (capped at
  :data:`metrics.PSNR_CAP_DB` as in the tables), beside the flat-image floor; a sweep gives the range
  over its grid points;
* the table (``table.csv``, or ``sweep.csv``'s strongest rows of a sweep), its notes, the failed
  rows with their reasons;
* the pictures present (grids, distributions, by-B, privacy-utility, sweep and frontier plots),
  embedded as base64 PNGs, each linked to the file beside the page;
* the command that resumes or re-runs the folder, and the provenance record.

The page has no script and loads nothing: every string read from the folder (names, labels,
reasons, config values) is HTML-escaped.
"""
from __future__ import annotations

import argparse
import base64
import html
import json
import math
import re
import urllib.parse
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Optional

import pandas as pd

import metrics

REPORT = "report.html"

#: The pictures a run or sweep writes, in the page's order: (file-name pattern, caption).
PICTURES: tuple[tuple[str, str], ...] = (
    ("grid_*.png", "Private images beside their reconstructions, per model row and attacker"),
    ("dist_*.png", "Per-image distributions of PSNR and LPIPS"),
    ("batch_size.png", "The strongest attacker against the clients' batch size B"),
    ("privacy_utility.png", "Privacy (strongest attacker) against utility"),
    ("frontier.png", "Privacy-utility frontier at matched utility"),
    ("sweep_*.png", "Means per grid point"),
)

_STYLE = """
body { font-family: sans-serif; margin: 1.5em auto; max-width: 1700px; padding: 0 1em; color: #111; }
h1 { font-size: 1.5em; } h2 { font-size: 1.2em; margin-top: 1.6em; border-bottom: 1px solid #ccc; }
table { border-collapse: collapse; font-size: 0.85em; }
th, td { border: 1px solid #ccc; padding: 2px 6px; } th { background: #f2f2f2; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
tr.strongest td { background: #fff8e0; }
figure { margin: 1em 0; } figcaption { font-size: 0.9em; color: #444; }
img { max-width: 100%; height: auto; border: 1px solid #ddd; }
pre { background: #f6f6f6; padding: 0.6em; overflow-x: auto; font-size: 0.8em; }
.verdict li { margin: 0.3em 0; } .note { color: #444; font-size: 0.9em; }
"""


def esc(value: Any) -> str:
    """Any value as HTML text (``html.escape`` with quotes: safe in text and attribute values)."""
    return html.escape(str(value), quote=True)


def _num(value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def _read_csv(path: Path) -> pd.DataFrame:
    """A stored CSV, empty where it is missing, empty or unreadable (the page says what is absent)."""
    if not path.is_file() or path.stat().st_size == 0:
        return pd.DataFrame()
    try:
        return pd.read_csv(path, dtype=str, keep_default_na=False)
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError, OSError):
        return pd.DataFrame()


# ------------------------------------------------------------------------------------ verdicts
_WINNER = re.compile(r"^(.+?) (\d+)/(\d+)(?:, |$)")


def top_winner(winners: Any) -> Optional[str]:
    """The attacker that won most images in a ``winners`` cell (``"<attacker> <won>/<n>, ..."``,
    most wins first: :func:`benchmark.aggregate.winners`); None where none won."""
    match = _WINNER.match(str(winners or ""))
    if not match or match.group(1).startswith("every attacker failed"):
        return None
    return match.group(1)


def strongest_only(frame: pd.DataFrame, keys: Sequence[str]) -> pd.DataFrame:
    """Per ``keys`` group the ``strongest`` rows where several attackers ran, else the one attacker's."""
    from .aggregate import STRONGEST

    if frame.empty:
        return frame
    has = frame.groupby(list(keys))["attack"].transform(lambda a: (a == STRONGEST).any())
    return frame[(frame["attack"] == STRONGEST) | ~has]


def _reads(setting: str, psnr: float, flat: float, attacker: str, n: int, n_failed: int, where: str = "",
           worst: float = math.nan) -> str:
    """One clause: what the strongest attacker reads in one setting."""
    from .tables import FLAT_HEADER

    ref = {"x": "x", "x_tilde": "x~"}.get(metrics.SETTING_REFERENCE.get(setting, "x"), "x")
    if n and n_failed >= n or not math.isfinite(psnr):
        return f"every attacker failed on all {n} image(s) in ({setting}){where}"
    text = f"the strongest attacker ({attacker}) reads {ref} at {psnr:.1f} dB PSNR in ({setting}){where}"
    if psnr >= metrics.PSNR_CAP_DB:
        text += f" (the {metrics.PSNR_CAP_DB:g} dB cap: exact copies)"
    elif math.isfinite(flat) and psnr <= flat:
        text += f", no better than a flat image ({FLAT_HEADER} {flat:.1f} dB): nothing measurable recovered"
    elif math.isfinite(flat):
        text += f" ({psnr - flat:+.1f} dB over a flat image)"
    if math.isfinite(worst) and n - n_failed > 1 and worst > psnr:
        text += f"; its most-leaked image at {worst:.1f} dB"
    if n_failed:
        text += f"; {n_failed} of {n} image(s) failed for every attacker"
    return text


def run_verdicts(full: pd.DataFrame) -> list[str]:
    """One sentence per model row of a run from ``table_full.csv``'s rows (its strongest rows)."""
    from .tables import UNTRAINED

    if full.empty or "model" not in full:
        return []
    best = strongest_only(full, ["model", "setting"])
    out = []
    for model, g in best.groupby("model", sort=False):
        first = g.iloc[0]
        untrained = str(first.get("trained", "True")).lower() in ("false", "0", "")
        clauses = []
        for _, r in g.iterrows():
            attacker = top_winner(r.get("winners")) or str(r["attack"])
            clauses.append(_reads(str(r["setting"]), _num(r.get("psnr_mean")), _num(r.get("flat_psnr_mean")),
                                  attacker, int(_num(r.get("n")) or 0), int(_num(r.get("n_failed")) or 0),
                                  worst=_num(r.get("psnr_worst"))))
        label = str(first.get("label") or model)
        out.append(f"{label}{UNTRAINED if untrained else ''}: " + "; ".join(clauses) + ".")
    return out


def sweep_verdicts(frame: pd.DataFrame) -> list[str]:
    """One sentence per model row of a sweep from ``sweep.csv``: per setting, the strongest
    attacker's PSNR at the most and at the least private grid point."""
    if frame.empty or "model" not in frame:
        return []
    best = strongest_only(frame, ["sweep_index", "model", "setting"]).copy()
    best["_psnr"] = best["psnr"].map(_num) if "psnr" in best else math.nan
    out = []
    for model, g in best.groupby("model", sort=False):
        clauses = []
        for setting, s in g.groupby("setting", sort=False):
            scored = s[s["_psnr"].map(math.isfinite)]
            n = int(sum(_num(v) for v in s["n"])) if "n" in s else 0
            if scored.empty:
                clauses.append(f"every attacker failed on all {n} image(s) in ({setting}) at every grid point")
                continue
            lo, hi = scored.loc[scored["_psnr"].idxmin()], scored.loc[scored["_psnr"].idxmax()]

            def at(r: pd.Series) -> str:
                return f"{r['sweep']}, {top_winner(r.get('winners')) or r['attack']}"

            ref = {"x": "x", "x_tilde": "x~"}.get(metrics.SETTING_REFERENCE.get(str(setting), "x"), "x")
            if len(scored) == 1 or lo["_psnr"] == hi["_psnr"]:
                clauses.append(f"the strongest attacker reads {ref} at {hi['_psnr']:.1f} dB PSNR in ({setting}) "
                               f"at {'every grid point' if len(scored) > 1 else at(hi)}")
            else:
                clauses.append(f"the strongest attacker reads {ref} at {lo['_psnr']:.1f} dB PSNR ({at(lo)}) to "
                               f"{hi['_psnr']:.1f} dB ({at(hi)}) in ({setting})")
            missing = len(s) - len(scored)
            if missing:
                clauses[-1] += f"; every attacker failed at {missing} grid point(s)"
        label = str(g.iloc[0].get("label") or model)
        out.append(f"{label}: " + "; ".join(clauses) + ".")
    return out


# ------------------------------------------------------------------------------------ pieces
def html_table(frame: pd.DataFrame, highlight: Optional[str] = None) -> str:
    """A frame of strings as an HTML table, every cell escaped; numbers right-aligned; rows whose
    ``highlight`` column reads ``strongest`` shaded."""
    from .aggregate import STRONGEST

    if frame.empty:
        return "<p class='note'>(no results)</p>"
    head = "".join(f"<th>{esc(c)}</th>" for c in frame.columns)
    body = []
    for _, row in frame.iterrows():
        cls = " class='strongest'" if highlight and str(row.get(highlight, "")) == STRONGEST else ""
        cells = "".join(
            f"<td class='num'>{esc(v)}</td>" if re.fullmatch(r"[-+]?\d[\d.]*( \(.*\))?", str(v)) else f"<td>{esc(v)}</td>"
            for v in row.tolist())
        body.append(f"<tr{cls}>{cells}</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def _fmt(value: Any, decimals: int) -> str:
    v = _num(value)
    return "—" if not math.isfinite(v) else f"{v:.{decimals}f}"


def sweep_display(frame: pd.DataFrame) -> pd.DataFrame:
    """``sweep.csv``'s rows as strings for the page: the point, model label, defence, setting,
    attacker, counts and the means present (PSNR capped as stored)."""
    if frame.empty:
        return frame
    cols = {"sweep": "Grid point", "label": "Model", "defence": "Defence", "setting": "Setting",
            "attack": "Attack", "n": "n", "failed": "failed"}
    numbers = (("psnr", "PSNR ↓", 2), ("psnr_worst", "PSNR max", 2), ("psnr_registered", "rPSNR ↓", 2),
               ("flat_psnr", "PSNR flat", 2), ("ssim", "SSIM ↓", 4),
               ("lpips", "LPIPS ↑", 4), ("mse", "MSE ↑", 4), ("defence_cos", "cos(sent, clean)", 4),
               ("utility_top1", "utility top-1", 4), ("dp_epsilon", "DP ε", 3))
    out = pd.DataFrame({h: frame[c] for c, h in cols.items() if c in frame})
    for col, header, dec in numbers:
        if col in frame and frame[col].map(lambda v: math.isfinite(_num(v))).any():
            out[header] = frame[col].map(lambda v, d=dec: _fmt(v, d))
    if "winners" in frame:
        out["Winners"] = frame["winners"]
    return out


def failed_rows(rows: Sequence[dict]) -> list[str]:
    """The failure reasons of the stored rows (:func:`benchmark.tables.failure_notes`), per grid
    point of a sweep."""
    from .tables import failure_notes

    if not any("sweep" in r for r in rows):
        return failure_notes(rows)
    points: dict[str, list[dict]] = {}
    for r in rows:
        points.setdefault(str(r.get("sweep", "")), []).append(r)
    return [f"[{point}] {note}" for point, group in points.items() for note in failure_notes(group)]


def pictures(folder: Path) -> list[tuple[Path, str]]:
    """The PNGs of :data:`PICTURES` present in ``folder`` (plain files, never through a link)."""
    out: list[tuple[Path, str]] = []
    for pattern, caption in PICTURES:
        for path in sorted(folder.glob(pattern)):
            if path.is_file() and not path.is_symlink():
                out.append((path, caption))
    return out


def figure(path: Path, caption: str) -> str:
    """An embedded PNG (base64) with its caption, linked to the file beside the page."""
    data = base64.b64encode(path.read_bytes()).decode("ascii")
    href = esc(urllib.parse.quote(path.name))
    return (f"<figure><a href='{href}'><img src='data:image/png;base64,{data}' alt='{esc(path.name)}'></a>"
            f"<figcaption>{esc(path.name)}: {esc(caption)}</figcaption></figure>")


def _pre(text: str) -> str:
    return f"<pre>{esc(text)}</pre>"


def provenance_html(folder: Path) -> str:
    """The provenance record's summary (code commit, device, Python, libraries, images,
    checkpoints) and the whole record folded; a missing or damaged record is said as such."""
    path = folder / "provenance.json"
    if not path.is_file():
        return "<p class='note'>No provenance.json in this folder" + (
            " (each grid point's folder holds its own record)." if (folder / "points").is_dir() else ".") + "</p>"
    try:
        record = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError, OSError) as err:
        return f"<p class='note'>provenance.json cannot be read: {esc(' '.join(str(err).split())[:200])}</p>"
    if not isinstance(record, dict):
        return f"<p class='note'>provenance.json holds a JSON {esc(type(record).__name__)}, not an object.</p>"
    code: dict[str, Any] = record["code"] if isinstance(record.get("code"), dict) else {}
    items = [("code commit", f"{code.get('commit', '?')}{' (uncommitted changes)' if code.get('dirty') else ''}"),
             ("code fingerprint", code.get("fingerprint", "?")), ("device", record.get("device", "?")),
             ("python", record.get("python", "?"))]
    libs = record.get("libraries")
    if isinstance(libs, dict):
        items.append(("libraries", ", ".join(f"{k} {v}" for k, v in libs.items())))
    images = record.get("images")
    if isinstance(images, dict):
        items.append(("attack images", f"{images.get('count', '?')} (sha256 {images.get('sha256', '?')})"))
    checkpoints = record.get("checkpoints")
    if isinstance(checkpoints, dict) and checkpoints:
        items.append(("checkpoints", "; ".join(f"{k}: {v}" for k, v in checkpoints.items())))
    rows = "".join(f"<tr><th>{esc(k)}</th><td>{esc(v)}</td></tr>" for k, v in items)
    shown = {k: v for k, v in record.items()}
    if isinstance(code.get("files"), dict):  # per-file hashes: long, and summarised by the fingerprint
        shown["code"] = {**code, "files": f"{len(code['files'])} file hashes (see provenance.json)"}
    return (f"<table>{rows}</table><details><summary>provenance.json</summary>"
            f"{_pre(json.dumps(shown, indent=1, sort_keys=True, default=str))}</details>")


def _section(title: str, body: str) -> str:
    return f"<h2>{esc(title)}</h2>\n{body}\n"


def _list(items: Iterable[str], cls: str = "") -> str:
    lis = "".join(f"<li>{esc(i)}</li>" for i in items)
    return f"<ul{f' class={chr(39)}{cls}{chr(39)}' if cls else ''}>{lis}</ul>"


# ------------------------------------------------------------------------------------ the page
def build_report(folder: str | Path) -> str:
    """The HTML text of ``folder``'s report (reads only the folder's files)."""
    from .aggregate import STRONGEST_NOTE
    from .store import RunFolder
    from .tables import ACC_NOTE, FLAT_HEADER, FLAT_NOTE, build_tables

    folder = Path(folder)
    run = RunFolder(folder)
    rows = run.rows() if run.results_path.is_file() else []
    config_text = run.config_path.read_text(errors="replace") if run.config_path.is_file() else ""
    try:
        cfg = run.load_config() if config_text else {}
    except Exception:  # a damaged config.yaml: the page still shows the rows and says so
        cfg = {}
    cfg = cfg if isinstance(cfg, dict) else {}
    sweep = (folder / "sweep.csv").is_file()
    name = cfg.get("name") or folder.name
    parts = [f"<h1>{esc(name)}: {'sweep' if sweep else 'run'} report</h1>",
             f"<p class='note'>Folder {esc(folder.resolve())}; {len(rows)} stored row(s); settings "
             f"{esc(', '.join(map(str, cfg.get('settings', []))) or '?')}.</p>"]
    notes: list[str] = []
    if sweep:
        frame = _read_csv(folder / "sweep.csv")
        verdicts = sweep_verdicts(frame)
        table = sweep_display(strongest_only(frame, ["sweep_index", "model", "setting"])) if not frame.empty else frame
        table_html = html_table(table)
        points = sorted(p for p in (folder / "points").glob("*/" + REPORT) if p.is_file()) \
            if (folder / "points").is_dir() else []
        if points:
            links = "".join(f"<li><a href='{esc(urllib.parse.quote(str(p.relative_to(folder))))}'>"
                            f"{esc(p.parent.name)}</a></li>" for p in points)
            table_html += f"<p>Each grid point's own report (its table, grids and failures):</p><ul>{links}</ul>"
    else:
        full, table = _read_csv(folder / "table_full.csv"), _read_csv(folder / "table.csv")
        if (full.empty or table.empty) and rows:  # a folder without stored tables: rebuilt from its rows
            tables = build_tables(run)
            full, table = tables.full.astype(str), tables.table
        verdicts = run_verdicts(full)
        table_html = html_table(table, highlight="Attack" if "Attack" in table.columns else None)
        if any(r.get("april") == "surgery" for r in rows):
            notes.append(ACC_NOTE)
        if FLAT_HEADER in table.columns:
            notes.append(FLAT_NOTE)
    if any(str(r.get("attack")) for r in rows) and len({r.get("attack") for r in rows}) > 1:
        notes.append(STRONGEST_NOTE.replace("`", ""))
    notes += sorted({str(r["lpips_note"]) for r in rows if r.get("lpips_note")})
    parts.append(_section("Verdict", _list(verdicts, "verdict") if verdicts else
                          "<p class='note'>No scored rows yet: nothing to conclude.</p>"))
    parts.append(_section("Table", table_html + (_list(notes) if notes else "")))
    failures = failed_rows(rows)
    parts.append(_section(f"Failed rows ({sum(bool(r.get('failed')) for r in rows)})",
                          _list(failures) if failures else "<p class='note'>None.</p>"))
    pics = pictures(folder)
    parts.append(_section("Pictures", "".join(figure(p, c) for p, c in pics) if pics else
                          "<p class='note'>No pictures in this folder.</p>"))
    command = (f"python run_benchmark.py --config {folder / 'config.yaml'} --output {folder}")
    parts.append(_section("Command", "<p>Resume or re-run this folder (its config.yaml holds every "
                          "resolved setting):</p>" + _pre(command)
                          + (f"<details><summary>config.yaml</summary>{_pre(config_text)}</details>"
                             if config_text else "<p class='note'>No config.yaml in this folder.</p>")))
    parts.append(_section("Provenance", provenance_html(folder)))
    return ("<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'>"
            f"<title>{esc(name)}: report</title><style>{_STYLE}</style></head><body>\n"
            + "\n".join(parts) + "\n</body></html>\n")


def write_report(folder: str | Path) -> Path:
    """Write ``report.html`` into ``folder`` (atomically, never through a link); returns its path.

    Raises:
        OutputWriteError: the page cannot be written (exit status 10).
    """
    from .files import write_text

    path = Path(folder) / REPORT
    write_text(path, build_report(folder))
    return path


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m benchmark.report RUN_FOLDER``: (re)build the folder's report.html."""
    from .errors import BenchmarkError

    p = argparse.ArgumentParser(prog="python -m benchmark.report", description=__doc__.split("\n")[0])
    p.add_argument("folder", help="a run or sweep folder (with results.jsonl or sweep.csv)")
    args = p.parse_args(argv)
    folder = Path(args.folder)
    if not folder.is_dir():
        p.error(f"{folder} is not a folder: pass a run folder (the --output of run_benchmark.py)")
    if not any((folder / n).is_file() for n in ("results.jsonl", "sweep.csv", "config.yaml")):
        p.error(f"{folder} is not a run folder (no results.jsonl, sweep.csv or config.yaml)")
    try:
        path = write_report(folder)
    except BenchmarkError as err:
        print(f"error: {err}")
        return err.exit_code
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
