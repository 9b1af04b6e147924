"""``batch_size.png``: the strongest attacker's PSNR and LPIPS against the clients' batch size B.

Written by a sweep over ``federation.batch_size`` (``--sweep federation.batch_size=1,2,4,8``): one
curve per model row and defence, per setting, from ``sweep.csv``'s ``strongest`` rows (per image
the best attacker after each update's reconstructions were paired with its images by
``linear_sum_assignment``, as :func:`benchmark.sweep_table.strongest` picks them)."""
from __future__ import annotations

from pathlib import Path

import pandas as pd

from .files import save_figure

BATCH_KEY = "federation.batch_size"
#: Hollow markers and line styles cycled over the attackers of a plot, so that curves drawn over
#: each other (attackers that reconstruct alike) stay apart.
MARKERS = ("o", "s", "^", "v", "D", "P", "X", "<", ">")
LINESTYLES = ("-", "-.", ":")


def curve_style(index: int, attack: str = "") -> dict:
    """Matplotlib keywords of the ``index``-th attacker's curve: a hollow marker of its own shape and
    size (overlapping points all stay visible) and a line style; the ``strongest`` curve (it lies on
    the winning attacker's) dashed, thicker and drawn on top."""
    from .aggregate import STRONGEST

    if attack == STRONGEST:
        return dict(marker="o", ms=10, mfc="none", mew=1.4, linestyle="--", lw=2.0, zorder=5)
    return dict(marker=MARKERS[index % len(MARKERS)], ms=8 - 1.5 * (index % 3), mfc="none", mew=1.2,
                linestyle=LINESTYLES[index % len(LINESTYLES)], lw=1.2, zorder=3)


def constant(values: pd.Series) -> bool:
    """The values (NaN left out) hold one number: an axis of them collapses every point onto it."""
    v = pd.to_numeric(values, errors="coerce").dropna()
    return len(v) > 0 and float(v.max() - v.min()) <= 1e-12 * max(1.0, abs(float(v.max())))


def batch_plot(frame: pd.DataFrame, path: Path) -> Path | None:
    """Plot PSNR (left, with the images' flat-image floor dashed where the rows carry ``flat_psnr``)
    and LPIPS (right) of the strongest row against B; None where the sweep
    does not vary ``federation.batch_size`` or no row was scored.

    Args:
        frame: :func:`benchmark.sweep_table.sweep_table`'s frame (one row per grid point, model,
            setting, attack; a ``sweep.federation.batch_size`` column).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .aggregate import STRONGEST

    col = f"sweep.{BATCH_KEY}"
    if frame.empty or col not in frame:
        return None
    # the strongest row where several attackers ran, else the one attacker's (as sweep_table.strongest)
    keys = ["sweep_index", "model", "setting"]
    has = frame.groupby(keys)["attack"].transform(lambda a: (a == STRONGEST).any())
    best = frame[(frame["attack"] == STRONGEST) | ~has]
    metrics = [m for m in ("psnr", "lpips") if m in best and best[m].notna().any()]
    if not metrics:
        return None
    fig, axes = plt.subplots(1, len(metrics), figsize=(5.0 * len(metrics), 3.8), squeeze=False)
    for ax, metric in zip(axes[0], metrics):
        label = "label" if "label" in best else "model"  # the table's name of the row
        for k, ((name, defence, setting), g) in enumerate(best.groupby([label, "defence", "setting"])):
            g = g.sort_values(col)
            line, = ax.plot(pd.to_numeric(g[col]), g[metric], label=f"{name}, {defence} ({setting})",
                            **curve_style(k))
            if metric == "psnr" and "flat_psnr" in g and g["flat_psnr"].notna().any():
                # the floor of no information on the same images (benchmark.scoring.flat_psnr), dotted grey-ish
                ax.plot(pd.to_numeric(g[col]), g["flat_psnr"], linestyle=(0, (1, 2)), lw=1.0, color=line.get_color(),
                        label=f"{name}, {defence} ({setting}): flat image")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size B per client update")
        ax.set_ylabel(f"{metric} of the strongest attacker")
        ax.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, path, dpi=120)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    """``python -m benchmark.batch_plot SWEEP_DIR ... --out PNG``: one ``batch_size.png`` over several
    sweeps of ``federation.batch_size`` (their ``sweep.csv`` joined, each point kept apart), for batch
    sizes measured in separate runs (the larger ones on fewer updates, say)."""
    import argparse

    p = argparse.ArgumentParser(description=main.__doc__.split("\n")[0] if main.__doc__ else None)
    p.add_argument("sweep_dirs", nargs="+", type=Path, help="sweep run folders (each with sweep.csv)")
    p.add_argument("--out", type=Path, required=True, help="the PNG to write")
    args = p.parse_args(argv)
    frames: list[pd.DataFrame] = []
    for d in args.sweep_dirs:
        csv = d / "sweep.csv"
        if not csv.is_file():
            p.error(f"{csv} does not exist: give the folders of finished batch-size sweeps")
        frame = pd.read_csv(csv)
        if f"sweep.{BATCH_KEY}" not in frame:
            p.error(f"{csv} is not a sweep of {BATCH_KEY}")
        offset = sum(int(f["sweep_index"].max()) + 1 for f in frames)
        frames.append(frame.assign(sweep_index=frame["sweep_index"] + offset))
    if batch_plot(pd.concat(frames, ignore_index=True), args.out) is None:
        p.error("no scored rows to plot")
    print(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
