"""The measurements of the paper's tables, with 95 % bootstrap intervals over the images.

Part 1 (Tables 1 and 3, :func:`mjp_part`): top-1 on x and on the MJP-shuffled x~, Consistency and
Diff. Norm per gamma, and the paired differences of the two models. Part 2 (common corruptions,
:func:`corruption_part`): top-1 under each ImageNet-C corruption and severity, the corruption
error per corruption and mCE, unnormalised and relative to the baseline. Each part has its figure.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from fedmjp.evaluate import evaluate_gammas
from fedmjp.stats import Stat, bootstrap_interval, mean_stat

from .corruptions import cached_corruption, images_key
from .paper_checkpoints import Loaded, load_uint8, predict_uint8, split_transform

_logger = logging.getLogger(__name__)


def interval(values: np.ndarray, scale: float = 100.0, **kw) -> dict:
    point, low, high = bootstrap_interval(mean_stat(values, scale), len(values), **kw)
    return {"value": point, "low": low, "high": high}


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


# part 2: common corruptions

def corruption_part(loaded: Sequence[Loaded], data_path: str, split: str, n: int | None, subset_seed: int,
                    names: Sequence[str], severities: Sequence[int], seed: int, device: torch.device,
                    boot: dict, batch_size: int = 250, cache_dir: str | Path | None = None) -> dict:
    """Top-1 under each corruption and severity, CE per corruption, mCE (unnormalised and relative)."""
    cfg = loaded[0].state["config"]
    images, labels, indices = load_uint8(cfg, data_path, split, n, subset_seed)
    _, tensor_steps = split_transform(cfg)
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
