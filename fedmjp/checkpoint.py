"""Checkpoint loading: our training checkpoints, plain timm state dicts, and the official MJP format.

Checkpoints are untrusted input: everything goes through ``torch.load(..., weights_only=True)``.

Each read takes the file's bytes once, hashes them as read and parses the state dict from those
same bytes (:func:`checkpoint_read`); inside :func:`read_once` (a benchmark run) every later read of
the path returns that first read, so a file replaced mid-run changes neither the weights of a later
federation nor the hash its provenance records.

Official MJP format (github.com/yhlleo/MJP ``models/vit_timm.py``): with E_unk, the position table is
an ``nn.Embedding`` (``pos_embed.weight``, [N + 2, D]: row 0 the cls position, rows 1..N the patches,
row N + 1 the unknown embedding); an optional ``index_embed`` [1, N + 1, D]; the DAL head as
``dlocr.layers.*`` (``linear`` = our ``ln``, ``nonlinear`` = our ``nln``). Block names match timm's.
"""
from __future__ import annotations

import contextlib
import hashlib
import io
import logging
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Mapping

import torch
import torch.nn as nn

from .models import MJPVisionTransformer, is_april_model

_logger = logging.getLogger(__name__)

_WRAPPER_KEYS = ("model", "state_dict", "model_state", "model_ema")


class CheckpointError(ValueError):
    """A checkpoint that cannot be read or does not fit the model."""


@dataclass
class LoadReport:
    path: str
    official_format: bool
    dropped: list[str] = field(default_factory=list)


#: Lines of torch's ``weights_only`` error that give advice which is never right here (re-running
#: with ``weights_only=False`` would execute whatever the file holds).
_TORCH_ADVICE = ("Weights only load failed", "Please file an issue", "Check the documentation",
                 "In PyTorch 2.6", "Re-running `torch.load`", "(1) ", "(2) ", "WeightsUnpickler error:")


def load_error_text(err: BaseException) -> str:
    """One line saying why ``torch.load(..., weights_only=True)`` refused a file, without torch's
    advice to retry with ``weights_only=False``: what the file holds instead of tensors (a pickled
    global such as ``posix.system``), or that it is not a PyTorch file at all."""
    import pickle

    lines = [" ".join(line.split()) for line in str(err).splitlines()]
    kept = [line.removeprefix("WeightsUnpickler error:").strip() for line in lines
            if line and not line.startswith(_TORCH_ADVICE)]
    kept = [line for line in kept if line]
    detail = "; ".join(kept)[:300] or type(err).__name__
    if isinstance(err, pickle.UnpicklingError) and "GLOBAL" in detail:
        return (f"it holds Python objects, not only tensors ({detail}); such files are refused, never executed: "
                "save the weights as a plain state dict")
    if isinstance(err, (pickle.UnpicklingError, EOFError)) or "zip archive" in detail or "magic number" in detail:
        return f"not a PyTorch weights file ({detail})"
    return detail


def missing_checkpoint(path: Path) -> str:
    """Why ``path`` cannot be read as a checkpoint file, and what to do."""
    what = "is not a regular file" if path.exists() else "does not exist"
    return f"checkpoint {path} {what}; fix the path in the config or set it to null for a seeded fresh initialisation"


@dataclass(frozen=True)
class CheckpointRead:
    """One read of a checkpoint file: the sha256 of the bytes read and the state dict parsed from
    those same bytes (so the hash always names the weights that were used)."""

    path: str
    sha256: str
    state: Mapping[str, torch.Tensor]


#: The reads of the active :func:`read_once` block by absolute path (None outside one), and how
#: deep such blocks are nested; one lock, held across a read, so that a second thread asking for
#: the same file waits for the first read instead of reading the file again.
_READS: dict[str, CheckpointRead] | None = None
_READS_DEPTH = 0
_READS_LOCK = threading.RLock()


@contextlib.contextmanager
def read_once() -> Iterator[None]:
    """Within the block, each checkpoint path is read once: every :func:`read_state_dict`,
    :func:`load_checkpoint` and :func:`checkpoint_sha256` of it (any thread) gets the first read's
    state and hash, whatever happens to the file meanwhile. Re-entrant: a nested block (a sweep
    point inside a sweep) shares the outer one's reads; they are dropped when the outermost ends."""
    global _READS, _READS_DEPTH
    with _READS_LOCK:
        if _READS_DEPTH == 0:
            _READS = {}
        _READS_DEPTH += 1
    try:
        yield
    finally:
        with _READS_LOCK:
            _READS_DEPTH -= 1
            if _READS_DEPTH == 0:
                _READS = None


def checkpoint_read(path: str | Path) -> CheckpointRead:
    """The checkpoint at ``path`` read once (bytes read, hashed as read, parsed from those bytes);
    inside :func:`read_once`, the block's first read of that path.

    Raises:
        CheckpointError: not a readable file, or not a state dict of finite tensors.
    """
    key = os.path.abspath(os.fspath(path))
    with _READS_LOCK:
        if _READS is not None:
            if key not in _READS:
                _READS[key] = _read_checkpoint(Path(path))
            return _READS[key]
    return _read_checkpoint(Path(path))


def checkpoint_sha256(path: str | Path) -> str:
    """Hex sha256 of a checkpoint: inside :func:`read_once` the hash of the bytes the run's weights
    were parsed from, else of the file's bytes now."""
    with _READS_LOCK:
        if _READS is not None:
            return checkpoint_read(path).sha256
    with Path(path).open("rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def read_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """Read a state dict from a checkpoint file (unwrapping ``{"model": ...}`` and DDP prefixes);
    a new dict of the tensors of :func:`checkpoint_read` (callers may drop keys; tensors are shared
    and never written: ``load_state_dict`` copies them)."""
    return dict(checkpoint_read(path).state)


def _read_checkpoint(path: Path) -> CheckpointRead:
    if not path.is_file():
        raise CheckpointError(missing_checkpoint(path))
    try:
        data = path.read_bytes()
    except OSError as err:
        raise CheckpointError(f"cannot read checkpoint {path}: {err.strerror or err}") from err
    digest = hashlib.sha256(data).hexdigest()
    state = _safetensors_state(path, data) if path.suffix == ".safetensors" else _torch_state(path, data)
    return CheckpointRead(str(path), digest, state)


def _safetensors_state(path: Path, data: bytes) -> dict[str, torch.Tensor]:
    """The float32 state dict of a ``.safetensors`` file's bytes (as :func:`read_safetensors`)."""
    from safetensors import SafetensorError
    from safetensors.torch import load

    try:
        state = load(data)
    except (SafetensorError, ValueError) as err:
        raise CheckpointError(f"cannot read checkpoint {path}: not a valid safetensors file ({err})") from err
    return {k.removeprefix("module."): (v.float() if v.is_floating_point() else v) for k, v in state.items()}


def _torch_state(path: Path, data: bytes) -> dict[str, torch.Tensor]:
    try:
        obj = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as err:  # torch raises several types (pickle, zip, runtime); report them all alike
        raise CheckpointError(f"cannot read checkpoint {path}: {load_error_text(err)}") from err
    for key in _WRAPPER_KEYS:
        if isinstance(obj, Mapping) and key in obj and isinstance(obj[key], Mapping):
            obj = obj[key]
            break
    if not isinstance(obj, Mapping) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise CheckpointError(f"checkpoint {path} holds no state dict of tensors")
    bad = nonfinite_keys(obj)
    if bad:
        raise CheckpointError(f"checkpoint {path} holds NaN or infinite values in {describe_keys(bad)}; it "
                              "cannot give a meaningful model (a diverged training?): use an earlier checkpoint")
    return {k.removeprefix("module."): v for k, v in obj.items()}


def nonfinite_keys(state: Mapping[str, Any]) -> list[str]:
    """The keys of ``state`` whose floating-point tensor holds a NaN or an infinity."""
    return [k for k, v in state.items()
            if isinstance(v, torch.Tensor) and v.is_floating_point() and not bool(torch.isfinite(v).all())]


def describe_keys(keys: list[str], limit: int = 3) -> str:
    """``'a', 'b', 'c' and 4 more`` for an error message."""
    shown = ", ".join(repr(k) for k in keys[:limit])
    return shown + (f" and {len(keys) - limit} more" if len(keys) > limit else "")


def is_official_format(state: Mapping[str, torch.Tensor]) -> bool:
    """True for the official code's layout (PE table as an nn.Embedding, or its DAL ``dlocr`` head)."""
    return "pos_embed.weight" in state or any(k.startswith("dlocr.") for k in state)


def convert_official(state: Mapping[str, torch.Tensor], num_prefix_tokens: int = 1) -> dict[str, torch.Tensor]:
    """Map an official MJP state dict onto :class:`MJPVisionTransformer` names."""
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if key == "pos_embed.weight":
            n_rows = value.shape[0]
            # rows: prefix positions, patches, then one unknown embedding
            out["pos_embed"] = value[: n_rows - 1].unsqueeze(0).clone()
            out["unk_embed"] = value[n_rows - 1:].reshape(1, 1, -1).clone()
        elif key.startswith("dlocr.layers."):
            out["dal_head.layers." + key[len("dlocr.layers."):]] = value
        elif key in ("dist_token", "head_dist.weight", "head_dist.bias"):
            _logger.warning("dropping distillation parameter %s from the official checkpoint", key)
        else:
            out[key] = value
    if "pos_embed" in out and out["pos_embed"].shape[1] < num_prefix_tokens:
        raise CheckpointError("official position table is too short for the model's prefix tokens")
    return out


def load_checkpoint(model: nn.Module, path: str | Path) -> LoadReport:
    """Load weights into ``model`` strictly; any mismatch raises a :class:`CheckpointError` listing keys.

    A design-A (APRIL) model has no ``blocks.0.norm1``; those keys of a standard checkpoint are dropped,
    which is exactly the block-0 surgery.
    """
    state = read_state_dict(path)
    official = is_official_format(state)
    if official:
        state = convert_official(state, getattr(model, "num_prefix_tokens", 1))
    dropped = []
    if is_april_model(model):
        dropped = [k for k in state if k.startswith("blocks.0.norm1.")]
        for k in dropped:
            del state[k]
    own = model.state_dict()
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    shapes = sorted(f"{k}: checkpoint {tuple(state[k].shape)} vs model {tuple(own[k].shape)}"
                    for k in set(own) & set(state) if state[k].shape != own[k].shape)
    if missing or unexpected or shapes:
        parts = []
        if missing:
            parts.append(f"missing from checkpoint ({len(missing)}): {', '.join(missing[:20])}")
        if unexpected:
            parts.append(f"not in model ({len(unexpected)}): {', '.join(unexpected[:20])}")
        if shapes:
            parts.append(f"shape mismatches ({len(shapes)}): {'; '.join(shapes[:20])}")
        arch = type(model).__name__
        variant = getattr(model, "variant", None)
        raise CheckpointError(f"checkpoint {path} does not fit {arch}"
                              f"{f' (variant {variant})' if variant else ''}: " + " | ".join(parts))
    model.load_state_dict(state, strict=True)
    return LoadReport(str(path), official, dropped)


def official_state_dict(model: MJPVisionTransformer) -> dict[str, torch.Tensor]:
    """Export a model in the official layout (inverse of :func:`convert_official`; used by tests)."""
    out = {}
    for key, value in model.state_dict().items():
        if key == "pos_embed" and model.unk_embed is not None:
            out["pos_embed.weight"] = torch.cat([value[0], model.unk_embed.detach()[0]], dim=0).clone()
        elif key == "unk_embed":
            continue
        elif key.startswith("dal_head.layers."):
            out["dlocr.layers." + key[len("dal_head.layers."):]] = value.clone()
        else:
            out[key] = value.clone()
    return out


# ----------------------------------------------------------------------------------- safetensors
#: ``format`` entry of the header of fedmjp's weights files (checkpoints/*.safetensors).
WEIGHTS_FORMAT = "fedmjp-weights-v1"


def read_safetensors(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(float32 state dict, header metadata) of a ``.safetensors`` weights file.

    safetensors holds tensors and a JSON header only, never code, so it is safe to read from anyone.
    Floating-point tensors (float16 in the shipped files) come back as float32; the metadata of a
    file written by :func:`fedmjp.trainutils.export_weights` names the architecture (``model_name``,
    ``model_kwargs`` as JSON) and the training config.
    """
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    if not path.is_file():
        raise CheckpointError(missing_checkpoint(path))
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            metadata = dict(f.metadata() or {})
            state = {k: f.get_tensor(k) for k in f.keys()}
    except (SafetensorError, OSError, ValueError) as err:
        raise CheckpointError(f"cannot read checkpoint {path}: not a valid safetensors file ({err})") from err
    state = {k.removeprefix("module."): (v.float() if v.is_floating_point() else v) for k, v in state.items()}
    return state, metadata
