"""Helpers shared by the test files (plain functions; fixtures live in conftest.py).

- images: :func:`bundled_images` (scikit-image's bundled photographs, available to every user) and
  :func:`folder_image` (a JPEG of a folder, for the tests that need the ImageNet sample);
- attack checks: :data:`MEAN`, :data:`STD`, :data:`MD`, :func:`normalize`, :func:`psnr`;
- configs: :func:`set_dotted`;
- benchmark runs: :func:`tiny_config`, :func:`write_config`, :func:`run`, :func:`metric_rows`,
  :func:`assert_same_scores`;
- training: :func:`make_imagefolder`, :func:`tiny_train_config`, :data:`RECIPE`.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import numpy as np
import pytest
import torch
import yaml
from PIL import Image

# --------------------------------------------------------------------------------------- images

#: scikit-image's colour photographs that ship inside its wheel (no download), in a fixed order.
BUNDLED_COLOUR = ("astronaut", "chelsea", "coffee", "rocket", "hubble_deep_field", "immunohistochemistry", "retina")


def crop_resize(img: Image.Image, size: int) -> torch.Tensor:
    """[3, size, size] float64 in [0, 1]: the centred square of ``img``, resized bilinearly."""
    img = img.convert("RGB")
    s = min(img.size)
    left, top = (img.width - s) // 2, (img.height - s) // 2
    img = img.crop((left, top, left + s, top + s)).resize((size, size), Image.BILINEAR)
    return torch.from_numpy(np.asarray(img).copy()).permute(2, 0, 1).double() / 255.0


def bundled_images(n: int, size: int, start: int = 0) -> torch.Tensor:
    """[n, 3, size, size] float64 in [0, 1]: scikit-image's colour photographs ``start``, ``start + 1``, ...
    (cycling through :data:`BUNDLED_COLOUR`), centre square, bilinear resize."""
    import skimage.data

    if n > len(BUNDLED_COLOUR):
        raise ValueError(f"only {len(BUNDLED_COLOUR)} bundled colour images, {n} asked for")
    names = [BUNDLED_COLOUR[(start + i) % len(BUNDLED_COLOUR)] for i in range(n)]
    return torch.stack([crop_resize(Image.fromarray(getattr(skimage.data, name)()), size) for name in names])


def folder_image(folder: Path, index: int, size: int) -> torch.Tensor:
    """[1, 3, size, size] float64 in [0, 1]: the ``index``-th JPEG of ``folder`` by name (centre crop, bilinear)."""
    files = sorted(folder.glob("*.JPEG"))
    if len(files) <= index:
        pytest.skip(f"{folder} holds fewer than {index + 1} JPEGs")
    return crop_resize(Image.open(files[index]), size)[None]


# ------------------------------------------------------------------------------- attack checks

MEAN = torch.tensor([0.485, 0.456, 0.406])
STD = torch.tensor([0.229, 0.224, 0.225])
#: normalisation metadata as the attacks take it
MD = dict(mean=MEAN, std=STD)


def normalize(x: torch.Tensor) -> torch.Tensor:
    """Images in [0, 1] -> the model's input (ImageNet mean/std), as the attacks' metadata does it."""
    from attacks import AttackMetadata

    return AttackMetadata(x.shape[0], tuple(x.shape[1:]), MEAN.double(), STD.double(), None).normalize(x)


def psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    """PSNR in dB of the whole batch (peak 1), in float64."""
    return float(10 * torch.log10(1 / ((a.double() - b.double()) ** 2).mean()))


# -------------------------------------------------------------------------------------- configs


def set_dotted(cfg: dict, changes: Mapping[str, Any]) -> dict:
    """Apply ``{"federation.rounds": 1, ...}`` to a nested config dict in place; returns it."""
    for key, value in changes.items():
        node = cfg
        *path, last = key.split(".")
        for part in path:
            node = node[part]
        node[last] = value
    return cfg


# ------------------------------------------------------------------------------- benchmark runs

KW = {"depth": 2}  # depth 1: only the cls token reaches the head, dL/dP has rank 7 < T


def tiny_config(**changes) -> dict:
    """2 model rows (plain, MJP) of a 32 px / patch 4 / width 192 / depth-2 design-A ViT,
    4 embedded images, 2 clients x 2 rounds, float64 clients (APRIL exact). LPIPS weights come
    from the metrics route ($FEDMJP_DATA/lpips where the data folder holds them; else the LPIPS
    column stays empty and says why)."""
    cfg = {
        "name": "tiny", "seed": 0, "device": "cpu", "settings": ["c"], "gamma": 0.27,
        "data": {"source": "embedded", "image_size": 32, "num_images": 4, "num_classes": 10},
        "federation": {"engine": "inprocess", "rounds": 2, "clients": 2, "precision": "float64", "lr": 0.01},
        "models": [
            {"name": "DeiT", "arch": "mjp_vit_cifar_patch4_32", "variant": "plain", "kwargs": KW, "april": "surgery"},
            {"name": "DeiT+MJP", "arch": "mjp_vit_cifar_patch4_32", "variant": "mjp", "kwargs": KW, "april": "surgery"},
        ],
        "attack": {"name": "april_analytic"},
        "report": {"grid_images": 2, "tile": 32},
    }
    set_dotted(cfg, changes)
    return cfg


def write_config(folder: Path, **changes) -> Path:
    """:func:`tiny_config` with ``changes`` written to ``folder/tiny.yaml``."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "tiny.yaml"
    path.write_text(yaml.safe_dump(tiny_config(**changes)))
    return path


def run(config: Path, output: Path, *extra: str) -> int:
    """``run_benchmark.py --config CONFIG --output OUTPUT --no-progress EXTRA...`` in this process."""
    from run_benchmark import main

    return main(["--config", str(config), "--output", str(output), "--no-progress", *extra])


def metric_rows(path: Path) -> list[dict]:
    """Rows without timings (which differ between runs), sorted by key."""
    from benchmark.store import read_jsonl

    rows = [{**{k: v for k, v in r.items() if not k.startswith("time_") and k != "attack_stats"},
             "_condition": float((r.get("attack_stats") or {}).get("condition_number") or 0.0)}
            for r in read_jsonl(path)]
    return sorted(rows, key=lambda r: (r["model"], r["setting"], r["round"], r["partition_id"], r["image_id"]))


PSNR_CAP = 100.0  # dB: the tables' cap; above it two reconstructions are both exact copies


def assert_same_scores(got: list[dict], want: list[dict]) -> None:
    """Rows equal in what is meaningful at their precision, never in digits below the noise floor.

    Uncapped PSNR of an exact copy (MSE ~1e-23 in float64) is set by the summation order alone
    (threads in a Ray worker vs the driver, OMP_NUM_THREADS), so PSNRs are compared capped at 100 dB;
    errors and distances of float64 reconstructions to 1e-9 absolute; LPIPS (AlexNet in float32) to
    1e-5; everything else exactly.
    """
    def number(v):  # results.jsonl keeps +-inf (PSNR of an exact copy) as the strings "inf"/"-inf"
        return float(v) if v in ("inf", "-inf") else v

    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert a.keys() == b.keys()
        # A minimum-norm answer of a rank-deficient system (APRIL on MJP's shuffled updates: condition
        # number ~1e16) keeps only ~1e-4 relative of its digits across thread counts and batchings.
        cond = max(a.get("_condition", 0.0), b.get("_condition", 0.0))
        rel, dpsnr = (1e-4, 1e-3) if cond > 1e8 else (1e-6, 1e-6)
        a, b = {k: number(v) for k, v in a.items()}, {k: number(v) for k, v in b.items()}
        for k in a:
            if k == "_condition":  # the attack's own diagnostic, as noisy as the digits it qualifies
                continue
            if isinstance(a[k], float) and isinstance(b[k], float):
                if k.startswith("psnr"):
                    assert min(a[k], PSNR_CAP) == pytest.approx(min(b[k], PSNR_CAP), abs=dpsnr), k
                elif k.startswith("lpips"):
                    assert a[k] == pytest.approx(b[k], abs=1e-5), k
                else:
                    assert a[k] == pytest.approx(b[k], rel=rel, abs=1e-9), k
            else:
                assert a[k] == b[k], k


# ------------------------------------------------------------------------------------- training


def make_imagefolder(root: Path, classes: int = 2, per_class: int = 8, size: int = 32) -> Path:
    """train/ and val/ with ``classes`` x ``per_class`` RGB images whose colour depends on the class."""
    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        for c in range(classes):
            d = root / split / f"class{c}"
            d.mkdir(parents=True, exist_ok=True)
            for i in range(per_class):
                base = np.zeros((size, size, 3))
                base[..., c % 3] = 160
                img = (base + rng.integers(0, 90, (size, size, 3))).clip(0, 255).astype(np.uint8)
                Image.fromarray(img).save(d / f"{i}.png")
    return root


def tiny_train_config(data: Path, out: Path, **changes):
    """A 1-block, width-48 MJP model at 32 px; 2 classes; every recipe component on (a TrainConfig)."""
    from fedmjp.trainconfig import TrainConfig

    cfg = TrainConfig(
        model="mjp_vit_cifar_patch4_32", model_kwargs={"depth": 1, "embed_dim": 48, "num_heads": 3},
        variant="mjp", gamma=0.5, shuffle_prob=1.0, shuffle_start_epoch=0, per_sample=True,
        dal_schedule="official", img_size=32, data_path=str(data), batch_size=4, num_workers=0,
        epochs=2, warmup_epochs=1, lr=1e-3, output_dir=str(out), threads=1, log_interval=1,
    )
    return cfg.replace(**changes)


RECIPE = {  # a 2-block, width-96 model: T = 65 <= D and 3 p^2 = 48 <= D, so APRIL's closed form applies
    "model": "mjp_vit_cifar_patch4_32", "model_kwargs": {"depth": 2, "embed_dim": 96, "num_heads": 3},
    "variant": "plain", "img_size": 32, "batch_size": 4, "num_workers": 0, "epochs": 2, "warmup_epochs": 1,
    "lr": 1.0e-3, "threads": 1, "log_interval": 1, "mixup": 0.0, "cutmix": 0.0,
}


def register_condition_failure(name: str) -> type:
    """Register attack ``name`` whose condition never holds: every image it attacks is an expected
    failure row (``AttackFailure``, not an error)."""
    from attacks.api.base import Attack, AttackFailure
    from attacks.api.registry import register_attack

    def _reconstruct(self, model, update, meta):
        raise AttackFailure("condition not met (test)")

    return register_attack(name)(type(f"ConditionFailure_{name}", (Attack,), {"name": name, "_reconstruct": _reconstruct}))
