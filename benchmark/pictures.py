"""The run's pictures, built only from its output folder (``results.jsonl`` and the stored PNGs):
``dist_<setting>.png``, the per-image PSNR and LPIPS distributions as box plots, and
``grid_<setting>.png``, per model and attacker the private images beside their reconstructions.
"""
from __future__ import annotations

import io
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
from PIL import Image, ImageDraw, ImageFont

import metrics
from fedmjp.settings import SETTING_GROUPS

from .aggregate import RECOGNISABLE_LPIPS, STRONGEST, rows_frame, with_strongest
from .files import save_figure, write_bytes
from .store import RunFolder, load_png, rec_kind


#: Widest a distribution figure gets (inches at its 100 dpi): it fits a page without zooming.
DIST_MAX_WIDTH_IN = 16.0
#: Boxes per panel row of a distribution figure; more (model, attacker) pairs wrap into more rows.
DIST_PER_ROW = 8
#: Why an LPIPS panel is empty when the rows carry no LPIPS value and no note of their own.
NO_LPIPS = "LPIPS: no weights (see docs/metrics.md)"
#: ... when the run left the metric out (``metrics.lpips: false``), and when no row was scored.
NO_LPIPS_OFF = "LPIPS: not computed (metrics.lpips is off)"
NO_LPIPS_ROWS = "LPIPS: every row failed"


def _wrap(text: str, width: int) -> str:
    """``text`` broken into lines of at most ``width`` characters (words kept where they fit)."""
    import textwrap

    return "\n".join(textwrap.wrap(str(text), width, break_long_words=True, break_on_hyphens=False) or [""])


def write_distributions(run: RunFolder, settings: Sequence[str]) -> list[Path]:
    """``dist_<setting>.png``: per (model, attack) box plots of per-image PSNR (capped at
    ``metrics.PSNR_CAP_DB`` as in the tables) and LPIPS over the non-failed rows, the shape that a
    mean hides. Built from results.jsonl (matplotlib, Agg).

    Boxes are labelled as the table's Model column (label, ``(untrained)``) and the attacker, in
    the config's row order, :data:`DIST_PER_ROW` to a panel row (wrapping into more rows, at most
    :data:`DIST_MAX_WIDTH_IN` inches wide); a pair whose rows all failed keeps its place and says so;
    an LPIPS panel without values says why (the rows' ``lpips_note``, else :data:`NO_LPIPS`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .aggregate import UNTRAINED

    df = rows_frame(run.rows())
    out: list[Path] = []
    if df.empty:
        return out
    df = with_strongest(df)
    cfg = run.load_config() if run.config_path.is_file() else {}
    order = {r["name"]: i for i, r in enumerate(cfg.get("models", []))}
    attack_order = {a: i for i, a in enumerate(dict.fromkeys(df["attack"]))}
    for setting in settings:
        every = df[df["setting"] == setting]
        if every.empty:
            continue
        ok = every[~every["failed"]]
        groups = sorted(dict.fromkeys(zip(every["model"], every["attack"])),
                        key=lambda g: (order.get(g[0], len(order)), attack_order.get(g[1], 0)))
        several = every["attack"].nunique() > 1
        names = {}
        for m, a in groups:
            first = every[every["model"] == m].iloc[0]
            label = first["label"] if isinstance(first["label"], str) and first["label"] else m
            trained = bool(first["trained"]) if isinstance(first["trained"], (bool, int)) else False
            names[(m, a)] = _wrap(f"{label}{'' if trained else UNTRAINED}", 16) + (f"\n{_wrap(a, 16)}" if several else "")
        chunks = [groups[i:i + DIST_PER_ROW] for i in range(0, len(groups), DIST_PER_ROW)]
        width = min(DIST_MAX_WIDTH_IN, max(6.0, 2 * (0.95 * min(len(groups), DIST_PER_ROW) + 0.9)))
        lpips_notes = sorted({str(n) for n in every.get("lpips_note", pd.Series(dtype=object)).dropna() if n})
        has_lpips = bool(ok["lpips"].notna().any())
        # without any LPIPS value its column is a narrow panel saying why
        fig, axes = plt.subplots(len(chunks), 2, figsize=(width, 3.0 * len(chunks) + 0.5), squeeze=False,
                                 sharey="col", gridspec_kw={"width_ratios": (1, 1) if has_lpips else (4, 1)})
        for row, chunk in enumerate(chunks):
            for ax, col, title in ((axes[row][0], "psnr", f"PSNR (dB, capped at {metrics.PSNR_CAP_DB:g}) ↓ private"),
                                   (axes[row][1], "lpips", "LPIPS ↑ private")):
                data = [ok[(ok["model"] == m) & (ok["attack"] == a)][col].clip(upper=metrics.PSNR_CAP_DB)
                        .dropna().to_numpy() for m, a in chunk]
                positions = range(1, len(chunk) + 1)
                ax.boxplot([d if len(d) else [float("nan")] for d in data], positions=list(positions),
                           showmeans=True)
                ax.set_xticks(list(positions), [names[g] for g in chunk], fontsize=7)
                ax.set_xlim(0.5, max(len(chunk), 2) + 0.5)
                ax.set_title(title, fontsize=9)
                if col == "lpips" and not has_lpips:
                    # no LPIPS value at all: the panel says why instead of standing empty
                    why = NO_LPIPS if lpips_notes else (NO_LPIPS_ROWS if ok.empty else NO_LPIPS_OFF)
                    ax.text(0.5, 0.5, _wrap(why, 24), transform=ax.transAxes, ha="center", va="center", fontsize=8,
                            color="dimgrey")
                    ax.set_xticks([])
                    ax.set_yticks([])
                    continue
                if col == "lpips":
                    ax.axhline(RECOGNISABLE_LPIPS, ls="--", lw=0.8, color="grey")
                for x, (g, d) in enumerate(zip(chunk, data), start=1):
                    if not len(d):  # kept in its place: a pair whose rows all failed (or lack the metric)
                        n = int(((every["model"] == g[0]) & (every["attack"] == g[1])).sum())
                        failed = int(((every["model"] == g[0]) & (every["attack"] == g[1]) & every["failed"]).sum())
                        text = f"all {n}\nfailed" if failed == n else "no\nvalues"
                        ax.text(x, 0.5, text, transform=ax.get_xaxis_transform(), ha="center", va="center",
                                fontsize=7, color="firebrick")
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


def _tile(path: Path | None, tile: int, text: str = "missing") -> Image.Image:
    """The stored PNG at ``path`` resized to the tile, or a grey tile saying ``text`` (wrapped)."""
    if path is None or not path.is_file():
        img = Image.new("RGB", (tile, tile), (235, 235, 235))
        font = _font(11)
        lines = _wrap_px(text, font, tile - 6)
        y = max(2, tile // 2 - 7 * len(lines))
        for line in lines:
            ImageDraw.Draw(img).text((4, y), line, fill=(120, 120, 120), font=font)
            y += LINE_PX
        return img
    return Image.fromarray(load_png(path)).resize((tile, tile), Image.Resampling.NEAREST)


#: Height in pixels of one line of the grids' 11 px text.
LINE_PX = 13


def _wrap_px(text: str, font: ImageFont.FreeTypeFont | ImageFont.ImageFont, width: int) -> list[str]:
    """``text`` in lines no wider than ``width`` pixels in ``font``: broken at spaces where a word
    fits, else inside the word (image ids and attacker names have no spaces)."""
    lines: list[str] = []
    for word in str(text).split(" "):
        line = f"{lines[-1]} {word}" if lines else word
        if lines and font.getlength(line) <= width:
            lines[-1] = line
            continue
        chunk = ""
        for ch in word:
            if chunk and font.getlength(chunk + ch) > width:
                lines.append(chunk)
                chunk = ""
            chunk += ch
        lines.append(chunk)
    return lines or [""]


def select_images(rows: pd.DataFrame, setting: str, k: int) -> list[tuple[str, int, int, int]]:
    """The first ``k`` stored images in (round, partition, batch index) order, each image once:
    (image_id, round, partition_id, batch_index) of its first attack."""
    sub = rows[(rows["setting"] == setting) & rows["image_stored"].fillna(False).astype(bool)]
    if sub.empty:
        return []
    sub = sub.sort_values(["round", "partition_id", "batch_index"]).drop_duplicates("image_id")
    return [(r.image_id, int(r["round"]), int(r.partition_id), int(r.batch_index)) for _, r in sub.head(k).iterrows()]


def _psnr_caption(value: float) -> str:
    """The PSNR capped at ``metrics.PSNR_CAP_DB`` as in the tables (above it every reconstruction is
    an exact copy: +inf and 229.6 dB read the same). ASCII only: PIL's default font lacks the dash
    and infinity glyphs."""
    if value is None or math.isnan(value):
        return "PSNR n/a"
    if value >= metrics.PSNR_CAP_DB:
        return f"PSNR {metrics.PSNR_CAP_DB:g} dB (cap)"
    return f"PSNR {value:.1f} dB"


def build_grid(run: RunFolder, setting: str, k: int, tile: int) -> Path | None:
    """``grid_<setting>.png`` from stored images: rows = models, columns = (x, [x~,] recon.) per image.

    Every image whose pictures were stored (the first ``report.grid_images`` attacked) is shown; the
    top-left corner says how many of the setting's attacked images that is. Image ids, model labels
    and attacker names are wrapped, never cut; captions under the reconstructions give the row's
    PSNR in dB against the setting's reference, capped as in the tables, and for a ``strongest``
    row the attacker that won the image. A failed reconstruction is a grey tile saying so.
    """
    df = rows_frame(run.rows())
    if df.empty or "image_stored" not in df.columns:
        return None
    chosen = select_images(df, setting, k)
    if not chosen:
        return None
    n_images = int(df[df["setting"] == setting]["image_id"].nunique())
    df = with_strongest(df)  # a strongest row shows the winning attacker's stored reconstruction
    cfg = run.load_config()
    attacks = list(dict.fromkeys(df["attack"]))
    present = set(zip(df["model"], df["attack"]))
    pairs = [(r["name"], a) for r in cfg["models"] for a in attacks if (r["name"], a) in present]
    labels = {r["name"]: r.get("label") or r["name"] for r in cfg["models"]}
    kinds = grid_columns(setting)
    small, big = _font(11), _font(13)
    left, span = GridLayout.left, len(kinds) * (tile + GridLayout.pad) - GridLayout.pad
    # the geometry grows only where a text needs more lines than the default one
    titles = [_wrap_px(str(image_id), small, span) for image_id, *_ in chosen]
    header = GridLayout.header + LINE_PX * (max(len(t) for t in titles) - 1)
    winner_lines = max((len(_wrap_px(a, small, tile)) for a in attacks if a != STRONGEST), default=1) \
        if STRONGEST in attacks else 0
    names = {(m, a): (_wrap_px(str(labels[m]), big, left - 10),
                      _wrap_px(" ".join(p for p in ("" if bool(df[df["model"] == m]["trained"].fillna(False).iloc[0])
                                                    else "untrained", a if len(attacks) > 1 else "") if p),
                               small, left - 10)) for m, a in pairs}
    label_px = max((15 * len(n) + LINE_PX * len(s) for n, s in names.values()), default=0)
    caption = max(GridLayout.caption + LINE_PX * winner_lines, label_px - tile)
    layout = GridLayout(len(pairs), len(chosen) * len(kinds), tile, header=header, caption=caption)
    canvas = Image.new("RGB", layout.size, (255, 255, 255))
    draw = ImageDraw.Draw(canvas)
    draw.text((6, 4), f"setting ({setting})", fill=(0, 0, 0), font=big)
    draw.text((6, 19), f"{len(chosen)} of {n_images} image(s)", fill=(60, 60, 60), font=small)
    group = SETTING_GROUPS[setting]
    for j, (image_id, rnd, part, _) in enumerate(chosen):
        x0, _ = layout.origin(0, j * len(kinds))
        for n, line in enumerate(titles[j]):
            draw.text((x0, 2 + LINE_PX * n), line, fill=(0, 0, 0), font=small)
        for c, kind in enumerate(kinds):
            x0, _ = layout.origin(0, j * len(kinds) + c)
            draw.text((x0, header - 17), _KIND_TITLE[kind], fill=(60, 60, 60), font=small)
    for i, (model, attack) in enumerate(pairs):
        _, y0 = layout.origin(i, 0)
        name, sub_label = names[(model, attack)]
        y = y0 + max(0, (tile + caption - 15 * len(name) - LINE_PX * len(sub_label)) // 2)
        for line in name:
            draw.text((6, y), line, fill=(0, 0, 0), font=big)
            y += 15
        for line in sub_label:
            draw.text((6, y), line, fill=(110, 110, 110), font=small)
            y += LINE_PX
        for j, (image_id, rnd, part, bidx) in enumerate(chosen):
            match = df[(df["model"] == model) & (df["attack"] == attack) & (df["setting"] == setting)
                       & (df["image_id"] == image_id) & (df["round"] == rnd) & (df["partition_id"] == part)]
            shown = attack
            if attack == STRONGEST and not match.empty:
                winner = match.iloc[0].get("winner")
                shown = winner if isinstance(winner, str) else attack
            failed = not match.empty and bool(match.iloc[0]["failed"])
            for c, kind in enumerate(kinds):
                stored = rec_kind(shown, setting) if kind == "rec" else kind
                path = run.image_path(model, group, image_id, stored, rnd, part)
                x0, y0 = layout.origin(i, j * len(kinds) + c)
                if kind == "rec" and failed:  # no reconstruction to show, whatever was stored
                    canvas.paste(_tile(None, tile, "no reconstruction"), (x0, y0))
                else:
                    canvas.paste(_tile(path, tile), (x0, y0))
                if kind == "rec" and not match.empty:
                    lines = [("every attacker failed" if attack == STRONGEST else "failed") if failed
                             else _psnr_caption(match.iloc[0]["psnr"])]
                    if attack == STRONGEST and shown != attack:  # the attacker that won this image
                        lines += _wrap_px(shown, small, tile)
                    for n, line in enumerate(lines):
                        draw.text((x0 + 2, y0 + tile + 1 + LINE_PX * n), line, fill=(0, 0, 0), font=small)
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
