"""One place that turns a device name from a config or flag into a ``torch.device``."""
from __future__ import annotations

from typing import Optional

import torch


def resolve_device(name: Optional[str] = "auto", index: int = 0) -> torch.device:
    """``auto``/None: CUDA device ``index`` when CUDA is present, else CPU; ``cuda``: CUDA device
    ``index`` (a torchrun rank passes its local rank); otherwise the named device (``cuda:N``, ``cpu``).

    Raises:
        ValueError: CUDA requested without CUDA, or a name torch does not know.
    """
    name = "auto" if name is None else str(name)
    if name == "auto":
        return torch.device("cuda", index) if torch.cuda.is_available() else torch.device("cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available; use cpu or auto")
    if name == "cuda":
        return torch.device("cuda", index)
    try:
        return torch.device(name)
    except RuntimeError as err:
        raise ValueError(f"unknown device {name!r}; valid: auto, cpu, cuda, cuda:N ({err})") from err
