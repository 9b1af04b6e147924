"""The two checkpoints of the paper's tables and the images they are measured on.

:func:`load_checkpoints` loads a DeiT and a DeiT+MJP checkpoint and checks that they share one
architecture and one evaluation transform; :func:`load_uint8` draws the fixed subset of a split as
the models see it before the tensor conversion (the corruptions are applied there), and
:func:`predict_uint8` classifies such images.
"""
from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torchvision import datasets

from fedmjp.archives import resolve_data_path
from fedmjp.data import rgb_loader
from fedmjp.evaluate import cls_and_logits
from fedmjp.train_data import build_transform, fixed_subset
from fedmjp.trainconfig import config_from_dict
from fedmjp.trainutils import model_from_checkpoint

#: model_kwargs that set training behaviour, not the architecture.
_TRAINING_KWARGS = {"variant", "gamma", "per_sample", "shuffle_prob", "dal_head", "dal_normalize", "drop_path_rate"}
_LABELS = {"plain": "DeiT", "mjp": "DeiT+MJP"}
#: parameters only some MJP variants have (E_unk, the DAL head, index embeddings).
_VARIANT_PARAMS = ("unk_embed", "dal_head", "index_embed")


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


def split_transform(cfg_dict: dict) -> tuple[Callable, list[Callable]]:
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
    pil_steps, _ = split_transform(state_config)
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
