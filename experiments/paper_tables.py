"""The paper's Tables 1-3 and its common-corruption robustness (Table 2 / Table 10, ImageNet-C) at
CIFAR scale, for a DeiT and a DeiT+MJP checkpoint side by side, with bootstrap intervals:

    python -m experiments.paper_tables --checkpoints DEIT MJP --data-path DIR_OR_TAR --out docs/paper_tables.md

Part 1 (Tables 1 and 3): top-1 on x and on the MJP-shuffled x~ at each ``--gammas`` value,
Consistency and Diff. Norm (:func:`fedmjp.evaluate.evaluate_gammas`, one mask per image, seed
``--seed``), over the split (``--max-images`` for a fixed subset), and a sweep over
``--gamma-sweep``. Part 2 (common corruptions): top-1 on ``--corruption-images`` images of the split
under the 15 ImageNet-C corruptions at severities 1-5 (:mod:`experiments.corruptions`; seeded per
image, cached), the corruption error per corruption (error = 100 - top-1, averaged over the
severities), mCE unnormalised (mean over corruptions and severities) and relative to the first
checkpoint (per corruption, the summed error over severities divided by the baseline's, times 100,
then averaged over corruptions: the baseline is 100 by definition, as the paper normalises by a
baseline model).

Intervals: 95 % bootstrap over the images (``scipy.stats.bootstrap``, BCa, ``--n-resamples``,
seeded); a difference between the two models is bootstrapped on the same resampled images
(paired). The gammas' masks and the corruptions are fixed (drawn once with their seeds), so the
intervals cover the sampling of images, not of masks. Writes the markdown file ``--out``, beside it
``<stem>_gamma_sweep.png``, ``<stem>_corruptions.png`` and ``<stem>.json`` (all figures).
"""
from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import logging
import math
import os
import platform
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torchvision import datasets

from fedmjp import datadir
from fedmjp.data import rgb_loader
from fedmjp.devices import resolve_device
from fedmjp.evaluate import DEFAULT_SWEEP, build_eval_loader, cls_and_logits, evaluate_gammas
from fedmjp.stats import bootstrap_interval, mean_stat
from fedmjp.train_data import ArchiveError, build_transform, fixed_subset, resolve_data_path
from fedmjp.trainconfig import config_from_dict
from fedmjp.trainutils import model_from_checkpoint

from .corruptions import (
    SEVERITIES,
    cached_corruption,
    check_corruptions,
    corruption_names,
    images_key,
)

_logger = logging.getLogger(__name__)

#: The paper's inference gammas of Tables 1-3.
TABLE_GAMMAS = (0.1, 0.27, 0.5)
#: model_kwargs that set training behaviour, not the architecture.
_TRAINING_KWARGS = {"variant", "gamma", "per_sample", "shuffle_prob", "dal_head", "dal_normalize", "drop_path_rate"}
_LABELS = {"plain": "DeiT", "mjp": "DeiT+MJP"}
#: parameters only some MJP variants have (E_unk, the DAL head, index embeddings).
_VARIANT_PARAMS = ("unk_embed", "dal_head", "index_embed")

# ----------------------------------------------------------------------------------------------
# bootstrap intervals over images (fedmjp.stats)

def interval(values: np.ndarray, scale: float = 100.0, **kw) -> dict:
    point, low, high = bootstrap_interval(mean_stat(values, scale), len(values), **kw)
    return {"value": point, "low": low, "high": high}


def _fmt(iv: dict, digits: int = 2, signed: bool = False) -> str:
    sign = "+" if signed else ""
    return f"{iv['value']:{sign}.{digits}f} [{iv['low']:{sign}.{digits}f}, {iv['high']:{sign}.{digits}f}]"


# ----------------------------------------------------------------------------------------------
# checkpoints and data

@dataclass
class Loaded:
    path: Path
    model: nn.Module
    state: dict
    label: str
    sha256: str


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _architecture(state: dict) -> dict:
    kwargs = {k: v for k, v in dict(state.get("model_kwargs", {})).items() if k not in _TRAINING_KWARGS}
    return {"model_name": state["model_name"], **kwargs}


def load_checkpoints(paths: Sequence[str | Path]) -> list[Loaded]:
    """The baseline and the compared checkpoint, checked to share one architecture."""
    if len(paths) != 2:
        raise ValueError(f"--checkpoints takes two files (the baseline DeiT, then DeiT+MJP), got {len(paths)}")
    loaded = []
    for p in map(Path, paths):
        if not p.is_file():
            raise FileNotFoundError(f"checkpoint {p} does not exist; pass a .safetensors file from checkpoints/ "
                                    "or a last.pth written by fedmjp.train")
        try:
            model, state = model_from_checkpoint(p, "cpu")
        except (ValueError, KeyError, RuntimeError, OSError) as err:
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise ValueError(f"cannot load checkpoint {p}: {first}") from err
        variant = dict(state.get("model_kwargs", {})).get("variant") or state.get("config", {}).get("variant", "")
        loaded.append(Loaded(p, model, state, _LABELS.get(variant, variant or p.stem), _sha256(p)))
    # same architecture: the same tensors with the same shapes, apart from the MJP variants' extras
    sa, sb = ({k: tuple(v.shape) for k, v in x.model.state_dict().items()} for x in loaded)
    odd = sorted(k for k in sa.keys() ^ sb.keys() if not k.startswith(_VARIANT_PARAMS))
    odd += sorted(k for k in sa.keys() & sb.keys() if sa[k] != sb[k])
    if odd or loaded[0].state["model_name"] != loaded[1].state["model_name"]:
        a, b = (_architecture(x.state) for x in loaded)
        diff = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
        what = (f"{', '.join(diff)}: {[a.get(k) for k in diff]} vs {[b.get(k) for k in diff]}" if diff
                else f"parameters {', '.join(odd[:3])}")
        raise ValueError(f"{loaded[0].path} and {loaded[1].path} differ in architecture ({what}); pass a DeiT and "
                         "a DeiT+MJP checkpoint of the same architecture")
    t0, t1 = (repr(build_transform(config_from_dict(x.state["config"]), is_train=False)) for x in loaded)
    if t0 != t1:
        raise ValueError(f"{loaded[0].path} and {loaded[1].path} evaluate with different input transforms; "
                         "pass checkpoints trained at the same image size")
    if loaded[0].label == loaded[1].label:
        for x in loaded:
            x.label = f"{x.label} ({x.path.stem})"
    if loaded[0].label == loaded[1].label:
        for i, x in enumerate(loaded):
            x.label = f"{x.label} #{i + 1}"
    return loaded


def check_split(state_config: dict, data_path: str, split: str, num_classes: int) -> None:
    """Raise a clear error where ``<data>/<split>`` is missing or has more classes than the models."""
    root = resolve_data_path(data_path, config_from_dict(state_config).data_cache)
    folder = root / split
    if not folder.is_dir():
        raise FileNotFoundError(f"{root} has no {split}/ folder; pass --split with one of its folders")
    classes = [d for d in folder.iterdir() if d.is_dir()]
    if not classes or len(classes) > num_classes:
        raise ValueError(f"{folder} has {len(classes)} class folders, the checkpoints classify {num_classes}; "
                         "pass the data set the checkpoints were trained on")


def _split_transform(cfg_dict: dict) -> tuple[Callable, list[Callable]]:
    """The evaluation transform as (PIL steps before the tensor conversion, tensor steps after it)."""
    steps = build_transform(config_from_dict(cfg_dict), is_train=False).transforms
    cut = next(i for i, t in enumerate(steps) if "ToTensor" in type(t).__name__)

    def pil_steps(img):
        for t in steps[:cut]:
            img = t(img)
        return img

    return pil_steps, list(steps[cut + 1:])


def load_uint8(state_config: dict, data_path: str, split: str, n: int | None, seed: int
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(images uint8 [N, H, W, 3] as the model sees them before the tensor conversion, labels [N],
    indices [N] in the split), for a fixed random subset of ``n`` images (:func:`fixed_subset`)."""
    cfg = config_from_dict(state_config)
    pil_steps, _ = _split_transform(state_config)
    root = resolve_data_path(data_path, cfg.data_cache)
    ds = datasets.ImageFolder(str(root / split), loader=rgb_loader)
    sub = fixed_subset(ds, n, seed)
    indices = np.asarray(getattr(sub, "indices", range(len(ds))), dtype=np.int64)
    images, labels = [], []
    for i in indices:
        img, y = ds[int(i)]
        images.append(np.asarray(pil_steps(img.convert("RGB")), dtype=np.uint8))
        labels.append(y)
    return np.stack(images), np.asarray(labels, dtype=np.int64), indices


@torch.no_grad()
def predict_uint8(model: nn.Module, images: np.ndarray, tensor_steps: Sequence[Callable], device: torch.device,
                  batch_size: int = 250) -> np.ndarray:
    """Argmax of ``model`` on uint8 images [N, H, W, 3] (converted as ToTensor does, then ``tensor_steps``)."""
    preds = []
    for start in range(0, len(images), batch_size):
        x = torch.from_numpy(images[start:start + batch_size]).permute(0, 3, 1, 2).float().div(255)
        for t in tensor_steps:
            x = t(x)
        preds.append(cls_and_logits(model, x.to(device))[1].argmax(dim=1).cpu().numpy())
    return np.concatenate(preds)


# ----------------------------------------------------------------------------------------------
# part 1: Tables 1-3 and the gamma sweep

def mjp_part(loaded: Sequence[Loaded], batches: list, gammas: Sequence[float], sweep: Sequence[float], seed: int,
             device: torch.device, boot: dict) -> dict:
    """Per model and gamma: top-1 on x / x~, Consistency, Diff. Norm with intervals, and paired differences."""
    all_g = sorted(set(gammas) | set(sweep))
    per = {}
    for x in loaded:
        t0 = time.time()
        rows = evaluate_gammas(x.model, batches, all_g, seed=seed, device=device, per_image=True)
        per[x.label] = {r["gamma"]: r for r in rows}
        _logger.info("%s: %d images x %d gammas in %.0f s", x.label, rows[0]["images"], len(all_g), time.time() - t0)
    base, comp = (x.label for x in loaded)
    out = {"gammas": list(gammas), "sweep": list(all_g), "images": per[base][all_g[0]]["images"], "models": {},
           "difference": {}}
    for label in (base, comp):
        rows = per[label]
        m = {"top1": interval(rows[all_g[0]]["per_image"]["correct"], **boot), "by_gamma": {}}
        for g in all_g:
            pi = rows[g]["per_image"]
            m["by_gamma"][g] = {"top1_shuffled": interval(pi["correct_shuffled"], **boot),
                                "consistency": interval(pi["agree"], **boot),
                                "diff_norm": interval(pi["diff_norm"], scale=1.0, **boot)}
            # the per-image means reproduce evaluate_gammas' figures
            assert abs(m["by_gamma"][g]["consistency"]["value"] - rows[g]["consistency"]) < 1e-6
        out["models"][label] = m
    pb, pc = per[base], per[comp]
    d = {"top1": interval(pc[all_g[0]]["per_image"]["correct"].astype(float)
                          - pb[all_g[0]]["per_image"]["correct"], **boot), "by_gamma": {}}
    for g in gammas:
        b, c = pb[g]["per_image"], pc[g]["per_image"]
        d["by_gamma"][g] = {
            "top1_shuffled": interval(c["correct_shuffled"].astype(float) - b["correct_shuffled"], **boot),
            "consistency": interval(c["agree"].astype(float) - b["agree"], **boot),
            "diff_norm": interval(c["diff_norm"] - b["diff_norm"], scale=1.0, **boot)}
    out["difference"] = d
    return out


def plot_sweep(part: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    g = part["sweep"]
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.4))
    for (label, m), style in zip(part["models"].items(), ("o-", "s--")):
        for ax, key in zip(axes, ("top1_shuffled", "consistency", "diff_norm")):
            v = [m["by_gamma"][x][key] for x in g]
            line, = ax.plot(g, [r["value"] for r in v], style, ms=4, label=label)
            ax.fill_between(g, [r["low"] for r in v], [r["high"] for r in v], color=line.get_color(), alpha=0.2)
            if key == "top1_shuffled":
                ax.axhline(m["top1"]["value"], color=line.get_color(), lw=0.8, ls=":")
    for ax, title in zip(axes, ("top-1 on x~ (dotted: on x), %", "Consistency, %", "Diff. Norm")):
        ax.set_xlabel("inference gamma")
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"{part['images']} validation images; bands: 95 % bootstrap intervals over the images", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ----------------------------------------------------------------------------------------------
# part 2: common corruptions

def corruption_part(loaded: Sequence[Loaded], data_path: str, split: str, n: int | None, subset_seed: int,
                    names: Sequence[str], severities: Sequence[int], seed: int, device: torch.device,
                    boot: dict, batch_size: int = 250, cache_dir: str | Path | None = None) -> dict:
    """Top-1 under each corruption and severity, CE per corruption, mCE (unnormalised and relative)."""
    cfg = loaded[0].state["config"]
    images, labels, indices = load_uint8(cfg, data_path, split, n, subset_seed)
    _, tensor_steps = _split_transform(cfg)
    key = images_key(images, indices)
    base, comp = (x.label for x in loaded)
    correct = {x.label: np.zeros((len(images), len(names), len(severities)), dtype=bool) for x in loaded}
    clean = {x.label: predict_uint8(x.model, images, tensor_steps, device, batch_size) == labels for x in loaded}
    cost = {}
    for ci, name in enumerate(names):
        cost[name] = {"cpu_s": 0.0, "cached": True}
        for si, s in enumerate(severities):
            corrupted, info = cached_corruption(images, indices, name, s, seed, cache_dir=cache_dir, key=key)
            cost[name]["cached"] = cost[name]["cached"] and info["cached"]
            if cost[name]["cpu_s"] is not None and info["cpu_s"] is not None:
                cost[name]["cpu_s"] += info["cpu_s"]
            else:
                cost[name]["cpu_s"] = None
            for x in loaded:
                correct[x.label][:, ci, si] = predict_uint8(x.model, corrupted, tensor_steps, device,
                                                            batch_size) == labels
        _logger.info("%s: corruption %s CPU s (%s); top-1 %s", name, cost[name]["cpu_s"] and round(cost[name]["cpu_s"], 1),
                     "cached" if cost[name]["cached"] else "computed",
                     " / ".join(f"{100 * correct[x.label][:, ci].mean():.1f}" for x in loaded))
    err = {k: ~v for k, v in correct.items()}
    out = {"images": len(images), "subset_seed": subset_seed, "seed": seed, "corruptions": list(names),
           "severities": list(severities), "cache_key": key, "cost": cost, "models": {}, "difference": {},
           "relative": {}}
    for label in (base, comp):
        e = err[label]
        out["models"][label] = {
            "clean_top1": interval(clean[label], **boot),
            "top1": {nm: [100.0 * float(correct[label][:, ci, si].mean()) for si in range(len(severities))]
                     for ci, nm in enumerate(names)},
            "top1_by_severity": [100.0 * float(correct[label][:, :, si].mean()) for si in range(len(severities))],
            "ce": {nm: interval(e[:, ci].mean(axis=1), **boot) for ci, nm in enumerate(names)},
            "mce": interval(e.mean(axis=(1, 2)), **boot)}
    eb, ec = err[base].astype(float), err[comp].astype(float)
    out["difference"] = {"clean_top1": interval(clean[comp].astype(float) - clean[base], **boot),
                         "ce": {nm: interval(ec[:, ci].mean(axis=1) - eb[:, ci].mean(axis=1), **boot)
                                for ci, nm in enumerate(names)},
                         "mce": interval(ec.mean(axis=(1, 2)) - eb.mean(axis=(1, 2)), **boot)}
    sb, sc = eb.sum(axis=2), ec.sum(axis=2)  # [N, C]: errors summed over severities

    def ratio(num: np.ndarray, den: np.ndarray) -> np.ndarray:
        # a resample where neither model erred has equal errors (100), not 0 / 0
        return np.where((num == 0) & (den == 0), 100.0, 100.0 * num / np.maximum(den, 1e-12))

    def rel_ce(ci: int) -> Stat:
        return lambda idx: ratio(sc[idx, ci].sum(-1), sb[idx, ci].sum(-1))

    def rel_mce(idx: np.ndarray) -> np.ndarray:
        return ratio(sc[idx].sum(-2), sb[idx].sum(-2)).mean(-1)

    n_img = len(images)
    for ci, nm in enumerate(names):
        p, lo, hi = bootstrap_interval(rel_ce(ci), n_img, **boot)
        out["relative"][nm] = {"value": p, "low": lo, "high": hi}
    p, lo, hi = bootstrap_interval(rel_mce, n_img, **boot)
    out["relative_mce"] = {"value": p, "low": lo, "high": hi}
    return out


def plot_corruptions(part: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = part["corruptions"] + ["mCE"]
    x = np.arange(len(names))
    fig, ax = plt.subplots(figsize=(11, 3.6))
    width = 0.38
    for k, (label, m) in enumerate(part["models"].items()):
        ivs = [m["ce"][nm] for nm in part["corruptions"]] + [m["mce"]]
        v = np.array([r["value"] for r in ivs])
        yerr = np.array([[r["value"] - r["low"] for r in ivs], [r["high"] - r["value"] for r in ivs]])
        ax.bar(x + (k - 0.5) * width, v, width, yerr=yerr, capsize=2, label=label)
    ax.set_xticks(x, [n.replace("_", " ") for n in names], rotation=40, ha="right", fontsize=8)
    ax.set_ylabel("error, % (mean over severities 1-5)")
    ax.set_title(f"ImageNet-C corruptions on {part['images']} CIFAR-10 validation images; "
                 "bars: 95 % bootstrap intervals", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ----------------------------------------------------------------------------------------------
# the report

def _machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return f"{os.cpu_count()}-core {cpu}, {gpu}"


def _display_path(value: str) -> str:
    """A path as the command should show it: the data folder as ``$FEDMJP_DATA``."""
    root = datadir.data_dir()
    if root is not None and not datadir.names_data_dir(value):
        try:
            return "$FEDMJP_DATA/" + Path(value).expanduser().resolve().relative_to(root).as_posix()
        except ValueError:
            pass
    return value


def _verdict(iv: dict, what: str, up: str, down: str, same: str) -> str:
    if iv["low"] > 0:
        return f"{what}: {up} ({_fmt(iv, signed=True)})"
    if iv["high"] < 0:
        return f"{what}: {down} ({_fmt(iv, signed=True)})"
    return f"{what}: {same} ({_fmt(iv, signed=True)}, the interval includes 0)"


def render(mjp: dict | None, corr: dict | None, loaded: Sequence[Loaded], meta: dict, figures: dict) -> str:
    base, comp = (x.label for x in loaded)
    L = [f"# MJP at CIFAR-10 scale: Tables 1-3 and common corruptions, {base} vs {comp}", "",
         ("The paper's (Masked Jigsaw Puzzle, CVPR 2023) accuracy/consistency tables and its ImageNet-C "
         "robustness claim, measured on the CIFAR-10 checkpoints. Written by `experiments.paper_tables`; "
         "regenerate with the command below."), "",
         f"- Command: `{meta['command']}`",
         (f"- Date: {meta['date']}; machine: {meta['machine']}; torch {torch.__version__}, "
         f"{meta['threads']} thread(s); wall time {meta['wall_s'] / 60:.1f} min, "
         f"CPU time {meta['cpu_s'] / 60:.1f} min"
         + "".join(f"; {k}: {v['wall_s'] / 60:.1f} min wall, {v['cpu_s'] / 60:.1f} min CPU"
                   for k, v in meta.get("parts", {}).items()) + "."),
         ("- Intervals: 95 % bootstrap over the images (scipy.stats.bootstrap, BCa, "
         f"{meta['n_resamples']} resamples, seed {meta['boot_seed']}); a difference is "
         f"{comp} minus {base}, bootstrapped over the same resampled images (paired). Each interval "
         "stands alone (no correction for the number of comparisons). Masks and corruptions are drawn "
         "once from their seeds, so the intervals cover the choice of images only."), "",
         "| | file | sha256 | variant | epoch |", "|---|---|---|---|---|"]
    for x in loaded:
        variant = dict(x.state.get("model_kwargs", {})).get("variant", "")
        L.append(f"| {x.label} | `{x.path.as_posix()}` | `{x.sha256[:16]}...` | {variant} | {x.state.get('epoch')} |")
    if mjp is not None:
        gs = mjp["gammas"]
        L += ["", "## Tables 1-3: accuracy, Consistency, Diff. Norm", "",
              (f"{mjp['images']} validation images; x~ is x with the patches of a block mask of gamma x 64 patches "
              f"permuted among themselves (E_unk at their positions for {comp}), one mask per image, seed "
              f"{meta['seed']}, batches of {meta['batch_size']} (`fedmjp.evaluate`; the masks depend on the seed "
              "and the batch size, so x~ figures of an evaluation at another batch size differ slightly). "
              "Top-1 and Consistency in percent."), "",
              "| model | top-1 on x | " + " | ".join(f"top-1 on x~, gamma {g}" for g in gs) + " |",
              "|---" * (2 + len(gs)) + "|"]
        for label, m in mjp["models"].items():
            L.append(f"| {label} | {_fmt(m['top1'])} | "
                     + " | ".join(_fmt(m["by_gamma"][g]["top1_shuffled"]) for g in gs) + " |")
        d = mjp["difference"]
        L.append(f"| {comp} - {base} | {_fmt(d['top1'], signed=True)} | "
                 + " | ".join(_fmt(d["by_gamma"][g]["top1_shuffled"], signed=True) for g in gs) + " |")
        for key, title, digits in (("consistency", "Consistency (same prediction on x and x~), %", 2),
                                   ("diff_norm", ("Diff. Norm (mean L2 distance of the final [CLS] embeddings "
                                                 "of x and x~)"), 3)):
            L += ["", f"**{title}**", "", "| model | " + " | ".join(f"gamma {g}" for g in gs) + " |",
                  "|---" * (1 + len(gs)) + "|"]
            for label, m in mjp["models"].items():
                L.append(f"| {label} | " + " | ".join(_fmt(m["by_gamma"][g][key], digits) for g in gs) + " |")
            L.append(f"| {comp} - {base} | "
                     + " | ".join(_fmt(d["by_gamma"][g][key], digits, signed=True) for g in gs) + " |")
        L += ["", f"![gamma sweep]({figures['sweep']})", "",
              (f"Sweep over inference gamma ({', '.join(map(str, mjp['sweep']))}), same images and seed; "
              "bands: 95 % bootstrap intervals."), "", "**Findings at this scale**", ""]
        L.append("- " + _verdict(d["top1"], f"accuracy on x ({comp} - {base}, points)", f"{comp} is more accurate",
                                 f"{comp} loses accuracy", f"{comp} keeps the accuracy"))
        for g in gs:
            L.append("- " + _verdict(d["by_gamma"][g]["consistency"], f"Consistency at gamma {g} (points)",
                                     f"{comp} is more consistent", f"{comp} is less consistent",
                                     "no difference resolved"))
            L.append("- " + _verdict(d["by_gamma"][g]["diff_norm"], f"Diff. Norm at gamma {g}",
                                     f"{comp}'s [CLS] moves more under the shuffle",
                                     f"{comp}'s [CLS] moves less under the shuffle", "no difference resolved"))
    if corr is not None:
        sev = corr["severities"]
        L += ["", "## Common corruptions (Table 2 / Table 10 counterpart)", "",
              (f"{corr['images']} validation images (fixed random subset, seed {corr['subset_seed']}; "
              f"`--corruption-images`), the {len(corr['corruptions'])} ImageNet-C corruptions of the "
              f"`imagecorruptions` package at severities {', '.join(map(str, sev))}, each image seeded by "
              f"(seed {corr['seed']}, image index, corruption, severity) and cached as uint8 under "
              "`$FEDMJP_CACHE/corruptions/` (`experiments.corruptions`). The package keeps ImageNet-C's parameters for "
              "224 px images; on 32 px images they are relatively much stronger (e.g. a defocus disk of "
              "radius up to 10 px, frost and snow textures at ImageNet scale), so these are ImageNet-C's "
              "corruptions applied to CIFAR-10, not CIFAR-10-C (whose parameters were re-tuned for 32 px)."), "",
              ("Error = 100 - top-1, in percent. CE: a corruption's error averaged over the severities. mCE: "
              "the mean over corruptions and severities (unnormalised). Relative CE: a corruption's error "
              f"summed over severities divided by {base}'s, times 100; relative mCE: its mean over "
              f"corruptions ({base} = 100 by definition, as the paper normalises by a baseline model)."), "",
              f"| corruption | {base}: CE | {comp}: CE | {comp} - {base} | {comp}: relative CE |",
              "|---|---|---|---|---|"]
        mb, mc = corr["models"][base], corr["models"][comp]
        def error(iv: dict) -> dict:  # error = 100 - top-1, its interval mirrored
            return {"value": 100 - iv["value"], "low": 100 - iv["high"], "high": 100 - iv["low"]}

        dc = corr["difference"]["clean_top1"]
        L.append(f"| clean (no corruption) | {_fmt(error(mb['clean_top1']))} | {_fmt(error(mc['clean_top1']))} | "
                 f"{_fmt({k: -v for k, v in dc.items()} | {'low': -dc['high'], 'high': -dc['low']}, signed=True)} "
                 "| |")
        for nm in corr["corruptions"]:
            L.append(f"| {nm} | {_fmt(mb['ce'][nm])} | {_fmt(mc['ce'][nm])} | "
                     f"{_fmt(corr['difference']['ce'][nm], signed=True)} | {_fmt(corr['relative'][nm], 1)} |")
        L.append(f"| **mCE** | **{_fmt(mb['mce'])}** | **{_fmt(mc['mce'])}** | "
                 f"**{_fmt(corr['difference']['mce'], signed=True)}** | **{_fmt(corr['relative_mce'], 1)}** |")
        L += ["", f"![corruption errors]({figures['corruptions']})", "",
              f"Top-1 per corruption and severity ({base} / {comp}, percent; intervals only in the table above):", "",
              "| corruption | " + " | ".join(f"severity {s}" for s in sev) + " |", "|---" * (1 + len(sev)) + "|"]
        for nm in corr["corruptions"]:
            L.append(f"| {nm} | " + " | ".join(f"{mb['top1'][nm][i]:.1f} / {mc['top1'][nm][i]:.1f}"
                                               for i in range(len(sev))) + " |")
        L.append("| all 15 (mean) | " + " | ".join(f"{mb['top1_by_severity'][i]:.1f} / {mc['top1_by_severity'][i]:.1f}"
                                                    for i in range(len(sev))) + " |")
        L += ["", "**Finding at this scale**", "",
              "- " + _verdict(corr["difference"]["mce"], f"mCE ({comp} - {base}, points)",
                              f"{comp} is less robust", f"{comp} is more robust", "no difference resolved"),
              "- " + _verdict({k: v - 100.0 for k, v in corr["relative_mce"].items()},
                              f"relative mCE - 100 ({comp} vs {base} = 100)", f"{comp} is less robust",
                              f"{comp} is more robust", "no difference resolved"), "",
              ("Cost of making the corrupted images (CPU seconds for all severities of the subset, one thread; "
              "'cached': read from the cache in this run, the cost as recorded when it was computed; glass_blur's "
              "includes numba's compilation, about 2 s):"), "",
              "| corruption | CPU s | CPU ms per image and severity | source |", "|---|---|---|---|"]
        for nm in corr["corruptions"]:
            c = corr["cost"][nm]
            cpu = c["cpu_s"]
            per = "" if cpu is None else f"{1000 * cpu / corr['images'] / len(sev):.2f}"
            L.append(f"| {nm} | {'unknown' if cpu is None else f'{cpu:.1f}'} | {per} | "
                     f"{'cached' if c['cached'] else 'computed'} |")
    return "\n".join(L) + "\n"


# ----------------------------------------------------------------------------------------------
# command line

def _floats(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of numbers") from None
    bad = [v for v in values if not 0.0 <= v <= 1.0 or math.isnan(v)]
    if bad or not values:
        raise argparse.ArgumentTypeError(f"gamma {bad[0] if bad else text!r} is outside [0, 1]; "
                                         "gammas are shares of the patches to shuffle")
    return values


def _names(text: str) -> list[str]:
    return [v.strip() for v in text.split(",") if v.strip()]


def _ints(text: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None


def _positive(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"{v} is negative")
    return v


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m experiments.paper_tables", description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoints", nargs=2, required=True, metavar=("DEIT", "DEIT_MJP"),
                   help="the baseline (DeiT) and the compared (DeiT+MJP) checkpoint, .safetensors or last.pth")
    p.add_argument("--data-path", required=True, help="ImageFolder root or .tar.gz with the split "
                   "(e.g. $FEDMJP_DATA/cifar10.tar.gz)")
    p.add_argument("--out", default="docs/paper_tables.md", help="markdown file; figures and JSON beside it")
    p.add_argument("--split", default="val")
    p.add_argument("--gammas", type=_floats, default=list(TABLE_GAMMAS), help="the tables' inference gammas")
    p.add_argument("--gamma-sweep", type=_floats, default=[0.1, 0.27, 0.5, 0.7, 1.0],
                   help=f"gammas of the sweep plot (evaluate's default sweep: {','.join(map(str, DEFAULT_SWEEP))})")
    p.add_argument("--seed", type=int, default=0, help="masks and corruptions")
    p.add_argument("--max-images", type=_positive, default=None, help="fixed subset for Tables 1-3 (default: all)")
    p.add_argument("--subset-seed", type=int, default=0, help="seed of the fixed subsets")
    p.add_argument("--corruption-images", type=_positive, default=1000,
                   help="fixed subset for the corruptions (0: skip them)")
    p.add_argument("--corruptions", type=_names, default=None, help="comma-separated (default: the 15 standard)")
    p.add_argument("--severities", type=_ints, default=list(SEVERITIES))
    p.add_argument("--corruption-cache", default=None,
                   help="folder of the corrupted images (default: $FEDMJP_CACHE/corruptions, ~/.cache/fedmjp/...)")
    p.add_argument("--skip-tables", action="store_true", help="only the corruptions")
    p.add_argument("--n-resamples", type=_positive, default=9999)
    p.add_argument("--bootstrap-seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=250)
    p.add_argument("--num-workers", type=int, default=0)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--device", default="cpu")
    return p


def run(args: argparse.Namespace, argv: Sequence[str]) -> Path:
    t_wall, t_cpu = time.time(), time.process_time()
    if args.threads:
        torch.set_num_threads(args.threads)
    names = args.corruptions if args.corruptions is not None else corruption_names()
    if args.corruption_images:
        check_corruptions(names, args.severities)
    if args.skip_tables and not args.corruption_images:
        raise ValueError("--skip-tables with --corruption-images 0 leaves nothing to do")
    out = Path(args.out)
    if out.suffix != ".md":
        raise ValueError(f"--out {out} must name a .md file (the figures go beside it)")
    out.parent.mkdir(parents=True, exist_ok=True)
    device = resolve_device(args.device)
    loaded = load_checkpoints(args.checkpoints)
    for x in loaded:
        x.model.to(device)
    num_classes = int(dict(loaded[0].state.get("model_kwargs", {})).get("num_classes")
                      or loaded[0].model.num_classes)
    check_split(loaded[0].state["config"], args.data_path, args.split, num_classes)
    boot = {"seed": args.bootstrap_seed, "n_resamples": args.n_resamples}
    figures = {"sweep": f"{out.stem}_gamma_sweep.png", "corruptions": f"{out.stem}_corruptions.png"}
    mjp = corr = None
    parts = {}
    if not args.skip_tables:
        t0, c0 = time.time(), time.process_time()
        loader = build_eval_loader(loaded[0].state["config"], args.data_path, args.split, args.batch_size,
                                   args.num_workers, args.max_images, args.subset_seed)
        batches = list(loader)  # decoded once, evaluated by both models
        mjp = mjp_part(loaded, batches, args.gammas, args.gamma_sweep, args.seed, device, boot)
        plot_sweep(mjp, out.parent / figures["sweep"])
        parts["Tables 1-3"] = (time.time() - t0, time.process_time() - c0)
    if args.corruption_images:
        t0, c0 = time.time(), time.process_time()
        corr = corruption_part(loaded, args.data_path, args.split, args.corruption_images, args.subset_seed,
                               names, args.severities, args.seed, device, boot, args.batch_size,
                               args.corruption_cache)
        plot_corruptions(corr, out.parent / figures["corruptions"])
        parts["corruptions"] = (time.time() - t0, time.process_time() - c0)
    shown = [_display_path(a) if a in (args.data_path, *args.checkpoints) else a for a in argv]
    meta = {"command": "python -m experiments.paper_tables " + shlex.join(shown),
            "date": datetime.date.today().isoformat(), "machine": _machine(), "threads": torch.get_num_threads(),
            "wall_s": time.time() - t_wall, "cpu_s": time.process_time() - t_cpu, "n_resamples": args.n_resamples,
            "boot_seed": args.bootstrap_seed, "seed": args.seed, "batch_size": args.batch_size,
            "parts": {k: {"wall_s": w, "cpu_s": c} for k, (w, c) in parts.items()}}
    out.write_text(render(mjp, corr, loaded, meta, figures))
    record = {"meta": meta, "checkpoints": [{"label": x.label, "path": x.path.as_posix(), "sha256": x.sha256,
                                             "epoch": x.state.get("epoch")} for x in loaded],
              "tables": mjp, "corruptions": corr}
    out.with_suffix(".json").write_text(json.dumps(record, indent=1, default=float))
    _logger.info("wrote %s (%.1f min wall)", out, meta["wall_s"] / 60)
    return out


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        run(args, argv)
    except (FileNotFoundError, ValueError, ArchiveError, ImportError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
