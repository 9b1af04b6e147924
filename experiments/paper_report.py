"""The markdown report of the paper's tables: the command, the machine, the checkpoints, and each
part's tables with a verdict per difference (its interval above, below or around 0).
"""
from __future__ import annotations

import os
import platform
from collections.abc import Sequence
from pathlib import Path

import torch

from fedmjp import datadir

from .paper_checkpoints import Loaded


def _fmt(iv: dict, digits: int = 2, signed: bool = False) -> str:
    sign = "+" if signed else ""
    return f"{iv['value']:{sign}.{digits}f} [{iv['low']:{sign}.{digits}f}, {iv['high']:{sign}.{digits}f}]"


def machine_description() -> str:
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


def display_path(value: str) -> str:
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
