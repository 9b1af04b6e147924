"""Small helpers shared by the test files: dotted config changes and real images."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import numpy as np
import torch
from PIL import Image


def set_dotted(cfg: dict, changes: Mapping[str, Any]) -> dict:
    """Apply ``{"federation.rounds": 1, ...}`` to a nested config dict in place; returns it."""
    for key, value in changes.items():
        node = cfg
        *path, last = key.split(".")
        for part in path:
            node = node[part]
        node[last] = value
    return cfg


def load_images(folder: Path, n: int, size: int, start: int = 0) -> torch.Tensor:
    """[n, 3, size, size] float64 in [0, 1]: every (1000 // n)-th JPEG of ``folder`` from ``start``."""
    files = sorted(folder.glob("*.JPEG"))[start :: max(1, 1000 // n)][:n]
    imgs = [np.asarray(Image.open(f).convert("RGB").resize((size, size), Image.BILINEAR)) for f in files]
    return torch.from_numpy(np.stack(imgs)).permute(0, 3, 1, 2).double() / 255.0
