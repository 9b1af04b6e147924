"""One place that turns a device name from a config or flag into a ``torch.device``."""
from __future__ import annotations

from typing import Optional

import torch

#: Device types a run computes on (``mps`` too, where torch has a usable MPS backend).
SUPPORTED = ("cpu", "cuda")


def resolve_device(name: Optional[str] = "auto", index: int = 0) -> torch.device:
    """``auto``/None: CUDA device ``index`` when CUDA is present, else CPU; ``cuda``: CUDA device
    ``index`` (a torchrun rank passes its local rank); otherwise the named device (``cuda:N``, ``cpu``).

    Raises:
        ValueError: CUDA (or MPS) requested where there is none, a CUDA index this machine lacks,
            ``meta`` or another device type the clients and attacks cannot compute on, or a name
            torch does not know.
    """
    name = "auto" if name is None else str(name)
    if name == "auto":
        return torch.device("cuda", index) if torch.cuda.is_available() else torch.device("cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available; use cpu or auto")
    if name == "cuda":
        return torch.device("cuda", index)
    try:
        device = torch.device(name)
    except RuntimeError as err:
        raise ValueError(f"unknown device {name!r}; valid: auto, cpu, cuda, cuda:N ({err})") from err
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise ValueError(f"device {name!r} requested but this machine has {torch.cuda.device_count()} CUDA "
                         "device(s); use cuda:0 .. or auto")
    if device.type == "mps":
        if not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
            raise ValueError(f"device {name!r} requested but this torch has no usable MPS backend; use cpu or auto")
        return device
    if device.type not in SUPPORTED:
        # meta tensors hold no values, and other backends (xla, hpu, ...) are not supported by the
        # clients and attacks: every client would fail mid-run
        raise ValueError(f"device {name!r} is not supported; valid: auto, cpu, cuda, cuda:N, mps (where available)")
    return device
