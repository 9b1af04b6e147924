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
