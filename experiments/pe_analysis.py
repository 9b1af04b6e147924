"""Does the learned position embedding encode the 2-D patch grid? The paper's PE analyses on checkpoints.

Ren et al., "Masked Jigsaw Puzzle: A Versatile Position Embedding for Vision Transformers" (CVPR 2023)
look at the patch position embeddings (PE) of DeiT and DeiT+MJP three ways, all reproduced here for
fedmjp checkpoints, for the same architecture freshly initialised, and for a 2-D sin-cos embedding of
the same width (a PE that encodes the grid exactly, as the reference that makes the numbers readable):

* Fig. 1: 2-D projections (PCA and UMAP) of the PE vectors, coloured by row and by column.
* Table 6: cumulative PCA explained-variance ratio of the first k components.
* Table 8: linear regression from a PE vector to its 1-D index and to its (row, col), mean absolute
  error under 5-fold cross-validation, against the chance level (predicting the training folds' mean).

The vectors analysed are ``pos_embed[0, prefix:]``: the [CLS] entry is dropped, and E_unk (the MJP
"unknown" embedding) is a separate parameter, ``unk_embed`` [1, 1, D], so it is not among them.

    python -m experiments.pe_analysis --checkpoints checkpoints/cifar_deit.safetensors \\
        checkpoints/cifar_deit_mjp.safetensors --out docs/pe_analysis.md

writes ``docs/pe_analysis.md`` and the figure ``docs/pe_analysis.png`` (``--figure`` to move it).
Needs the ``analysis`` extra (scikit-learn, umap-learn) and matplotlib.
"""
from __future__ import annotations

import argparse
import datetime
import hashlib
import os
import pickle
import platform
import shlex
import sys
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn

PCA_KS = (1, 2, 3, 5, 10)
VARIANCE_TARGET = 0.90
FOLDS = 5
RIDGE_ALPHAS = np.logspace(-4, 6, 21)
# Share of the chance-level MAE (row, col) below which the grid counts as linearly readable from the
# PE, and above which it counts as not readable (between: partly). The 2-D sin-cos reference scores ~0,
# random vectors ~1.
GRID_ENCODED, GRID_ABSENT = 0.25, 0.75
_VARIANT_LABELS = {"plain": "DeiT", "mjp": "DeiT+MJP"}


class PEAnalysisError(ValueError):
    """A checkpoint whose position embedding cannot be analysed (message names the file)."""


@dataclass
class PESource:
    """The patch position embeddings of one model, in row-major grid order."""

    label: str
    source: str  # file, or how the vectors were made
    pe: np.ndarray  # [N, D], N = gh * gw
    grid: tuple[int, int]
    notes: list[str] = field(default_factory=list)
    variant: str | None = None  # the MJP variant of a checkpoint's model


# ----------------------------------------------------------------------------------- inputs
def grid_coords(grid: tuple[int, int]) -> np.ndarray:
    """[N, 2] (row, col) of each patch position in the row-major order of timm's patch tokens."""
    from fedmjp.dal import grid_targets

    return grid_targets(grid).numpy().astype(np.int64)


def model_label(variant: str | None) -> str:
    return _VARIANT_LABELS.get(variant or "plain", f"DeiT+{variant}")


def patch_pe(model: nn.Module, where: str) -> tuple[np.ndarray, tuple[int, int]]:
    """The learned PE of the patch positions of ``model`` ([N, D], [CLS]/prefix entries dropped) and
    its (rows, cols) grid. Raises :class:`PEAnalysisError` naming ``where`` when there is none to analyse."""
    pe = getattr(model, "pos_embed", None)
    if not isinstance(pe, nn.Parameter):
        kind = "none" if pe is None else f"a fixed {type(pe).__name__}"
        raise PEAnalysisError(f"{where}: the model has no learned position embedding (pos_embed is {kind}; "
                              f"variant {getattr(model, 'variant', '?')!r}); pass a checkpoint trained with a learned PE")
    patch_embed = getattr(model, "patch_embed", None)
    grid = tuple(int(s) for s in getattr(patch_embed, "grid_size", ()) or ())
    if len(grid) != 2:
        raise PEAnalysisError(f"{where}: the model's patch grid is unknown (no patch_embed.grid_size)")
    if grid[0] != grid[1]:
        raise PEAnalysisError(f"{where}: the patch grid is {grid[0]} x {grid[1]}, not square; this analysis "
                              "compares rows and columns of a square grid")
    n = grid[0] * grid[1]
    table = pe.detach().float().cpu().reshape(-1, pe.shape[-1])
    prefix = table.shape[0] - n
    if prefix not in (0, int(getattr(model, "num_prefix_tokens", 1))):
        raise PEAnalysisError(f"{where}: pos_embed has {table.shape[0]} entries, which does not fit a "
                              f"{grid[0]} x {grid[1]} grid plus {getattr(model, 'num_prefix_tokens', 1)} prefix tokens")
    return table[prefix:].numpy().astype(np.float64), grid


def load_checkpoint_pe(path: str | Path) -> tuple[PESource, dict]:
    """The patch PE of a fedmjp checkpoint (shipped ``.safetensors`` or a training ``last.pth``) and
    the checkpoint's dict. Raises :class:`PEAnalysisError` with one line naming the file."""
    from fedmjp.trainutils import model_from_checkpoint

    path = Path(path)
    if not path.is_file():
        raise PEAnalysisError(f"checkpoint {path} does not exist; pass the path of a .safetensors or last.pth "
                              "file written by fedmjp.train")
    try:
        model, state = model_from_checkpoint(path)
    except (ValueError, RuntimeError, KeyError, TypeError, OSError, EOFError, pickle.UnpicklingError) as err:
        msg = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise PEAnalysisError(f"cannot read checkpoint {path}: {msg}") from err
    pe, grid = patch_pe(model, str(path))
    variant = getattr(model, "variant", None)
    notes = []
    if getattr(model, "unk_embed", None) is not None:
        notes.append("E_unk (`unk_embed`) is a separate parameter, not among the vectors")
    return PESource(model_label(variant), path.as_posix(), pe, grid, notes, variant), state


def fresh_pe(model_name: str, model_kwargs: dict, seed: int) -> PESource:
    """The PE of the architecture freshly initialised as ``fedmjp.train`` does it: the torch RNG seeded
    with ``seed``, then :func:`fedmjp.factory.create_model` (timm's trunc-normal std 0.02 for the PE).
    The global RNG state is restored afterwards."""
    from fedmjp.factory import create_model

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = create_model(model_name, **model_kwargs)
    pe, grid = patch_pe(model, f"fresh {model_name}")
    return PESource("fresh", f"`{model_name}`, seed {seed}", pe, grid)


def sincos_pe(grid: tuple[int, int], dim: int) -> PESource:
    """The 2-D sin-cos PE (MAE / timm style: a quarter of the width each for sin and cos of row and
    column at geometric frequencies) of ``grid`` at width ``dim``: timm's builder, row-major order."""
    from timm.layers.pos_embed_sincos import build_sincos2d_pos_embed

    if dim % 4:
        raise PEAnalysisError(f"the 2-D sin-cos reference needs a width divisible by 4, got {dim}")
    pe = build_sincos2d_pos_embed(list(grid), dim=dim).numpy().astype(np.float64)
    return PESource("2-D sin-cos", f"timm `build_sincos2d_pos_embed`, width {dim}", pe, grid)


# ----------------------------------------------------------------------------------- analyses
def pca_cumulative(pe: np.ndarray, ks: Sequence[int] = PCA_KS) -> dict[int, float]:
    """Cumulative explained-variance ratio of the first k principal components (Table 6), per k."""
    from sklearn.decomposition import PCA

    ratio = np.cumsum(PCA().fit(pe).explained_variance_ratio_)
    return {k: float(ratio[min(k, len(ratio)) - 1]) for k in ks}


def components_for(pe: np.ndarray, target: float = VARIANCE_TARGET) -> int:
    """Fewest principal components that explain ``target`` of the variance."""
    from sklearn.decomposition import PCA

    ratio = np.cumsum(PCA().fit(pe).explained_variance_ratio_)
    return int(np.searchsorted(ratio, target - 1e-12) + 1)


def chance_mae(n: int) -> float:
    """Mean absolute deviation of a uniform index over 0..n-1 from its mean: the MAE of always
    predicting the middle (2.0 for n = 8, 16.0 for n = 64)."""
    idx = np.arange(n, dtype=np.float64)
    return float(np.abs(idx - idx.mean()).mean())


def _regressors() -> dict:
    from sklearn.dummy import DummyRegressor
    from sklearn.linear_model import LinearRegression, RidgeCV
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    # N = 64 vectors in D = 192 dimensions: ordinary least squares has more unknowns than equations
    # and fits any training targets exactly (the minimum-norm solution); ridge with its strength chosen
    # inside each training fold (efficient leave-one-out) is the stable read-out. Both are reported.
    return {
        "ridge": make_pipeline(StandardScaler(), RidgeCV(alphas=RIDGE_ALPHAS, alpha_per_target=True)),
        "ols": LinearRegression(),
        "chance": DummyRegressor(strategy="mean"),
    }


def regression_mae(pe: np.ndarray, grid: tuple[int, int], folds: int = FOLDS, seed: int = 0) -> dict[str, dict]:
    """Table 8: 5-fold cross-validated MAE of linear read-outs of the 1-D index and of (row, col).

    Returns ``{method: {target: mean, target + "_sd": sd}}`` for the methods ``ridge``, ``ols`` and
    ``chance`` (the training folds' mean) and the targets ``1d`` (index), ``2d`` ((row, col), the MAE
    averaged over both coordinates), ``row`` and ``col``; means and standard deviations over the folds
    (shuffled KFold, ``seed``).
    """
    from sklearn.model_selection import KFold, cross_val_score

    coords = grid_coords(grid).astype(np.float64)
    targets = {"1d": np.arange(len(coords), dtype=np.float64), "2d": coords, "row": coords[:, 0], "col": coords[:, 1]}
    cv = KFold(n_splits=folds, shuffle=True, random_state=seed)
    out: dict[str, dict] = {}
    for name, reg in _regressors().items():
        row = {}
        for key, y in targets.items():
            scores = -cross_val_score(reg, pe, y, cv=cv, scoring="neg_mean_absolute_error")
            row[key], row[f"{key}_sd"] = float(scores.mean()), float(scores.std())
        out[name] = row
    return out


def project_2d(pe: np.ndarray, method: str, seed: int = 0) -> np.ndarray:
    """[N, 2] projection of the PE vectors: ``pca`` or ``umap`` (``random_state=seed``)."""
    if method == "pca":
        from sklearn.decomposition import PCA

        return PCA(n_components=2, random_state=seed).fit_transform(pe)
    if method == "umap":
        with warnings.catch_warnings():  # "n_jobs overridden to 1 by setting random_state": intended
            warnings.simplefilter("ignore", UserWarning)
            import umap

            return umap.UMAP(n_components=2, n_neighbors=15, min_dist=0.1, random_state=seed).fit_transform(pe)
    raise ValueError(f"unknown projection {method!r}; valid: pca, umap")


@dataclass
class PEResult:
    source: PESource
    pca: dict[int, float]
    k90: int
    reg: dict[str, dict]


def analyse(source: PESource, folds: int = FOLDS, seed: int = 0) -> PEResult:
    return PEResult(source, pca_cumulative(source.pe), components_for(source.pe),
                    regression_mae(source.pe, source.grid, folds, seed))


def grid_verdict(result: PEResult, target: str = "2d") -> str:
    """``encoded``, ``partly`` or ``absent``: the ridge MAE of ``target`` (``2d`` for (row, col), ``row``,
    ``col`` or ``1d``) relative to its chance level, against :data:`GRID_ENCODED` and :data:`GRID_ABSENT`."""
    ratio = result.reg["ridge"][target] / result.reg["chance"][target]
    return "encoded" if ratio <= GRID_ENCODED else "partly" if ratio <= GRID_ABSENT else "absent"


# ----------------------------------------------------------------------------------- figure
def plot_projections(results: Sequence[PEResult], path: str | Path, seed: int = 0) -> Path:
    """Fig. 1: PCA and UMAP of every model's PE (one column each), coloured by row and by column;
    grey lines join grid neighbours, so a PE that keeps the grid shows a lattice."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("pca", 0, "row"), ("pca", 1, "column"), ("umap", 0, "row"), ("umap", 1, "column")]
    fig, axes = plt.subplots(len(panels), len(results), figsize=(2.7 * len(results) + 0.8, 2.6 * len(panels)),
                             squeeze=False)
    for c, res in enumerate(results):
        coords = grid_coords(res.source.grid)
        gh, gw = res.source.grid
        proj = {m: project_2d(res.source.pe, m, seed) for m in ("pca", "umap")}
        for r, (method, axis, what) in enumerate(panels):
            ax = axes[r, c]
            xy = proj[method]
            lattice = xy.reshape(gh, gw, 2)
            for line in list(lattice) + list(lattice.transpose(1, 0, 2)):
                ax.plot(line[:, 0], line[:, 1], color="0.8", lw=0.5, zorder=1)
            sc = ax.scatter(xy[:, 0], xy[:, 1], c=coords[:, axis], cmap="viridis", s=18, zorder=2,
                            vmin=0, vmax=max(gh, gw) - 1)
            ax.set_xticks([])
            ax.set_yticks([])
            if r == 0:
                ax.set_title(res.source.label, fontsize=10)
            if c == 0:
                ax.set_ylabel(f"{method.upper()}, by {what}", fontsize=9)
            if c == len(results) - 1:
                fig.colorbar(sc, ax=ax, fraction=0.06, pad=0.03, label=what)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ----------------------------------------------------------------------------------- report
def _sha256(path: str | Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def machine_description() -> str:
    """``<cores>-core <CPU>, <GPU or no GPU>`` of this machine."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    cpu = cpu.replace("(R)", "").replace("(TM)", "").replace(" Processor", "").strip()
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return f"{os.cpu_count()}-core {cpu}, {gpu}"


def _pct(x: float) -> str:
    return f"{100 * x:.1f}"


def answer(results: Sequence[PEResult]) -> list[str]:
    """The answer to "does the PE learn the 2-D grid?", one paragraph per trained model, from the numbers."""
    by_label = {r.source.label: r for r in results}
    fresh, ref = by_label.get("fresh"), by_label.get("2-D sin-cos")
    lines = []
    for res in results:
        if res.source.label in ("fresh", "2-D sin-cos"):
            continue
        rg, ch = res.reg["ridge"], res.reg["chance"]
        ratio = rg["2d"] / ch["2d"]
        verdict = grid_verdict(res)
        head = {"encoded": "Yes", "partly": "Partly", "absent": "No"}[verdict]
        text = (f"**{res.source.label}: {head}.** A linear read-out recovers (row, col) to {rg['2d']:.2f} patches "
                f"on average ({_pct(ratio)} % of the chance level {ch['2d']:.2f}) and the 1-D index to "
                f"{rg['1d']:.2f} (chance {ch['1d']:.2f}). Apart: the row to {rg['row']:.2f} "
                f"({_pct(rg['row'] / ch['row'])} % of chance, {grid_verdict(res, 'row')}), the column to "
                f"{rg['col']:.2f} ({_pct(rg['col'] / ch['col'])} %, {grid_verdict(res, 'col')})")
        if fresh is not None:
            fr = fresh.reg["ridge"]["2d"] / fresh.reg["chance"]["2d"]
            text += f". For (row, col), fresh weights give {_pct(fr)} % of chance"
        if ref is not None:
            rr = ref.reg["ridge"]["2d"] / ref.reg["chance"]["2d"]
            text += f", the 2-D sin-cos reference {_pct(rr)} %"
        text += (f". The first 2 principal components hold {_pct(res.pca[2])} % of its variance"
                 + (f" (fresh {_pct(fresh.pca[2])} %)" if fresh is not None else "")
                 + f", and {res.k90} components reach {_pct(VARIANCE_TARGET)} %"
                 + (f" (fresh {fresh.k90}, sin-cos {ref.k90})" if fresh is not None and ref is not None else "")
                 + ".")
        if res.source.variant == "mjp":
            text += " Its DAL loss trained a head to read (row, col) from these vectors."
        lines.append(text)
    trained = [r for r in results if r.source.label not in ("fresh", "2-D sin-cos")]
    if len(trained) > 1:
        ranked = sorted(trained, key=lambda r: r.reg["ridge"]["2d"] / r.reg["chance"]["2d"])
        order = " < ".join(f"{r.source.label} ({_pct(r.reg['ridge']['2d'] / r.reg['chance']['2d'])} %)" for r in ranked)
        lines.append(f"Ordered by the (row, col) error relative to chance (lower: more of the grid in the PE): {order}.")
    return lines


def write_report(results: Sequence[PEResult], out: str | Path, figure: str | Path, command: str, date: str,
                 machine: str, checkpoint_states: dict[str, dict], fresh_note: str) -> Path:
    out = Path(out)
    fig_rel = os.path.relpath(Path(figure).resolve(), out.resolve().parent)
    grid = results[0].source.grid
    n, dim = results[0].source.pe.shape
    L = ["# Position-embedding analyses: does the PE learn the 2-D grid?", ""]
    L += [(f"The analyses of the position embedding (PE) in Ren et al., CVPR 2023 (Fig. 1, Tables 6 and 8) on "
          f"the CIFAR-10 checkpoints, on the same architecture freshly initialised, and on a 2-D sin-cos "
          f"embedding of the same width (a PE that encodes the grid exactly). Each model has {n} patch "
          f"positions ({grid[0]} x {grid[1]} grid) with a {dim}-wide PE vector each; the [CLS] entry of "
          "`pos_embed` is left out, and E_unk, which DeiT+MJP keeps as its own parameter `unk_embed`, is not "
          "among the vectors."), ""]
    L += ["Produced by (from the repository root):", "", f"    {command}", "",
          (f"on {date}, {machine}. The command writes this page and the figure; rerun it after new checkpoints "
          "land."), ""]
    L += ["| model | vectors from | PE shape | notes |", "|---|---|---|---|"]
    for res in results:
        s = res.source
        state = checkpoint_states.get(s.source)
        where = s.source
        notes = list(s.notes)
        if state is not None:
            where = f"`{s.source}`"
            notes.insert(0, f"epoch {state.get('epoch')}, sha256 `{_sha256(s.source)[:16]}`")
        elif s.label == "fresh":
            notes.insert(0, fresh_note)
        L.append(f"| {s.label} | {where} | {s.pe.shape[0]} x {s.pe.shape[1]} | {'; '.join(notes)} |")
    L += ["", "## Table 6: PCA explained variance", "",
          ("Cumulative share of the PE's variance in the first k principal components (percent), and the fewest "
          f"components that hold {_pct(VARIANCE_TARGET)} %."), ""]
    L += ["| model | " + " | ".join(f"k = {k}" for k in PCA_KS) + f" | components for {_pct(VARIANCE_TARGET)} % |",
          "|---|" + "---|" * (len(PCA_KS) + 1)]
    for res in results:
        L.append(f"| {res.source.label} | " + " | ".join(_pct(res.pca[k]) for k in PCA_KS) + f" | {res.k90} |")
    L += ["", "## Table 8: linear regression from the PE to the position", "",
          (f"Mean absolute error (in patches) of predicting a position's 1-D index (0..{n - 1}) and its (row, col) "
          f"(0..{grid[0] - 1} each, MAE averaged over both) from its PE vector, {FOLDS}-fold cross-validation "
          "(shuffled, seed 0), mean +- standard deviation over the folds. Ridge: standardised features, "
          "strength chosen inside each training fold by leave-one-out from 1e-4..1e6. Least squares: the "
          f"paper's plain linear regression (with {dim} features and about {n * (FOLDS - 1) // FOLDS} training "
          "vectors it fits any training targets exactly). Chance: predicting the training folds' mean "
          f"(analytically {chance_mae(n):.1f} and {chance_mae(grid[0]):.1f} for a uniform index)."), ""]
    L += [("| model | ridge: 1-D | ridge: (row, col) | ridge: row | ridge: col | least squares: 1-D | "
           "least squares: (row, col) | chance: 1-D | chance: (row, col) | ridge (row, col) / chance |"),
          "|---|" + "---|" * 9]
    for res in results:
        g = res.reg
        cells = [f"{g['ridge'][k]:.2f} +- {g['ridge'][k + '_sd']:.2f}" for k in ("1d", "2d")]
        cells += [f"{g['ridge'][k]:.2f}" for k in ("row", "col")]
        cells += [f"{g['ols'][k]:.2f} +- {g['ols'][k + '_sd']:.2f}" for k in ("1d", "2d")]
        cells += [f"{g['chance']['1d']:.2f}", f"{g['chance']['2d']:.2f}", f"{_pct(g['ridge']['2d'] / g['chance']['2d'])} %"]
        L.append(f"| {res.source.label} | " + " | ".join(cells) + " |")
    L += ["", "## Fig. 1: PCA and UMAP of the PE", "",
          f"![PCA and UMAP of the position embeddings]({fig_rel})", "",
          ("One column per model; rows: the first two principal components and a 2-D UMAP (15 neighbours, "
          "min_dist 0.1, random_state 0), each coloured by the patch's row and by its column. Grey lines join "
          "horizontally and vertically adjacent patches."), ""]
    L += ["## How to read it", "",
          ("- **Table 8** is the direct test. A PE that encodes the grid lets a linear map read row and column "
          "back: the 2-D sin-cos reference does so with an error near 0. A PE without grid information cannot "
          "beat the chance column (the fresh, random PE shows where that lies: about 100 %). The last column "
          f"puts every model on that scale; this page calls the grid encoded at <= {_pct(GRID_ENCODED)} % of "
          f"chance, absent above {_pct(GRID_ABSENT)} %, partly encoded between."),
          (f"- The 1-D index is row x {grid[1]} + col, a linear function of (row, col): a PE that gives (row, col) "
          f"linearly gives the index too, with the row error weighted {grid[1]} times; compare it with its own chance "
          "level. Row and column are listed apart because a PE can encode one better than the other."),
          ("- DeiT+MJP's DAL loss trains a small head to predict (row, col) from each PE vector during training, so "
          "a grid code in its PE is partly by design; plain DeiT learns its PE from the classification loss alone."),
          ("- **Table 6**: random vectors spread their variance over many components (no direction stands out); "
          "a PE organised by the grid concentrates it in a few. The sin-cos reference needs at most "
          f"2 x ({grid[0]} - 1) = {2 * (grid[0] - 1)} components (each of its features is a function of the row "
          "alone or of the column alone), not 2, so a high k = 2 share is not required for a grid code; compare "
          "each model with the fresh row."),
          ("- **Fig. 1**: colour running smoothly across a panel, and a lattice of grey lines that does not "
          "cross itself, show the grid in the PE; random colours and tangled lines show none. UMAP keeps "
          "neighbourhoods, PCA the two directions of largest variance."), ""]
    L += ["## Does the PE learn the 2-D grid at this scale?", ""]
    for line in answer(results):
        L += [line, ""]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(L))
    return out


# ----------------------------------------------------------------------------------- command line
def run(checkpoints: Sequence[str | Path], out: str | Path, figure: str | Path | None = None,
        seed: int | None = None, date: str | None = None, machine: str | None = None,
        command: str | None = None) -> tuple[Path, Path]:
    """Analyse ``checkpoints`` plus the fresh and the 2-D sin-cos rows; write ``out`` and ``figure``."""
    if not checkpoints:
        raise PEAnalysisError("no checkpoints given; pass at least one with --checkpoints")
    sources, states = [], {}
    for path in checkpoints:
        src, state = load_checkpoint_pe(path)
        sources.append(src)
        states[src.source] = state
    shapes = {(s.grid, s.pe.shape[1]) for s in sources}
    if len(shapes) > 1:
        listing = ", ".join(f"{s.source}: {s.grid[0]} x {s.grid[1]} grid, width {s.pe.shape[1]}" for s in sources)
        raise PEAnalysisError(f"the checkpoints differ in grid or width ({listing}); analyse checkpoints of one "
                              "architecture together")
    first = states[sources[0].source]
    fresh_seed = seed if seed is not None else int((first.get("config") or {}).get("seed", 0) or 0)
    kwargs = dict(first.get("model_kwargs") or {})
    fresh = fresh_pe(first["model_name"], kwargs, fresh_seed)
    fresh_note = (f"the architecture of `{sources[0].source}` (variant {kwargs.get('variant', 'plain')!r}), "
                  f"torch seeded with {fresh_seed} then `fedmjp.factory.create_model`, as `fedmjp.train` "
                  "initialises (PE: trunc-normal std 0.02)")
    sources += [fresh, sincos_pe(sources[0].grid, sources[0].pe.shape[1])]
    results = [analyse(s) for s in sources]
    out = Path(out)
    figure = Path(figure) if figure is not None else out.with_suffix(".png")
    plot_projections(results, figure)
    command = command or "python -m experiments.pe_analysis --checkpoints " + " ".join(map(str, checkpoints)) + f" --out {out}"
    write_report(results, out, figure, command, date or datetime.date.today().isoformat(),
                 machine or machine_description(), states, fresh_note)
    return out, figure


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.pe_analysis", description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoints", nargs="+", required=True,
                   help="fedmjp checkpoints (.safetensors weights or training last.pth) of one architecture")
    p.add_argument("--out", required=True, help="Markdown report to write, e.g. docs/pe_analysis.md")
    p.add_argument("--figure", default=None, help="figure to write (default: --out with .png)")
    p.add_argument("--seed", type=int, default=None,
                   help="seed of the fresh initialisation (default: the first checkpoint's training seed)")
    p.add_argument("--date", default=None, help="date written on the report (default: today)")
    p.add_argument("--machine", default=None, help="machine written on the report (default: detected)")
    args = p.parse_args(argv)
    command = "python -m experiments.pe_analysis " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    try:
        out, figure = run(args.checkpoints, args.out, args.figure, args.seed, args.date, args.machine, command)
    except PEAnalysisError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {out} and {figure}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
