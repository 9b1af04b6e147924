"""What produced a run: code version, library versions, device and checkpoint hashes
(``provenance.json`` in the run folder), and the resume check against it.

A resume refuses (:class:`~benchmark.errors.OutputConflictError`, exit status 6) when the git
commit, a library version, the device, a checkpoint's sha256 or the attack images (decoded pixels,
names and labels) differ from the stored record:
rows computed by different code or weights are never mixed in one table. The code is recorded by
commit and by a fingerprint of the project's source files (:func:`code_fingerprint`), so an
uncommitted edit of an attack refuses the resume and names the file, while editing a README or a
test changes nothing. A change of the *dirty* flag alone only warns. ``--force`` resumes anyway;
every resume is recorded in the file's ``resumes`` list with what differed.
"""
from __future__ import annotations

import functools
import hashlib
import json
import logging
import platform
import subprocess
from collections.abc import Mapping
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from .config import PROJECT_ROOT, BenchmarkConfig
from .errors import OutputConflictError

_logger = logging.getLogger(__name__)

PROVENANCE = "provenance.json"
#: Distributions whose versions are recorded (import name differs for scikit-image).
LIBRARIES = ("torch", "timm", "flwr", "lpips", "scikit-image", "breaching", "numpy", "scipy")
#: Keys whose change only warns on resume.
WARN_ONLY = ("code.dirty",)


def sha256_file(path: str | Path) -> str:
    """Hex sha256 of a file's bytes."""
    with Path(path).open("rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def code_version(root: Path = PROJECT_ROOT) -> dict[str, Any]:
    """``{"commit": sha or "unknown", "dirty": bool or None}``: untracked files do not count as dirty.

    Read once per process (the first run or sweep point): the code a process runs is what it imported
    at its start, so a commit made while a long sweep goes on does not relabel its later points (and
    a resume by the same code is not refused because the checkout moved on)."""
    return dict(_code_version(root))


@functools.cache
def _code_version(root: Path) -> dict[str, Any]:
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                                timeout=30, check=True).stdout.strip()
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                                capture_output=True, text=True, timeout=60, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return {"commit": "unknown", "dirty": None}
    return {"commit": commit or "unknown", "dirty": bool(status.strip())}


#: The project's packages whose source makes a row (the code fingerprint covers their ``.py`` files).
CODE_PACKAGES = ("patchgrid", "fedmjp", "attacks", "defences", "metrics", "clients", "server", "benchmark")


def code_fingerprint() -> dict[str, Any]:
    """``{"fingerprint": sha256, "files": {path: sha256[:16]}}`` of the ``.py`` files of
    :data:`CODE_PACKAGES` where this process imports them from (a checkout or an installed copy),
    read once per process like :func:`code_version`. Unlike the commit and the dirty flag it changes
    with every edit of the code and with no edit of anything else (README, tests), so a resume can
    tell rows of other code apart and name the files that differ."""
    return dict(_code_fingerprint())


@functools.cache
def _code_fingerprint() -> dict[str, Any]:
    import importlib.util

    files: dict[str, str] = {}
    for package in CODE_PACKAGES:
        spec = importlib.util.find_spec(package)
        for location in (spec.submodule_search_locations or []) if spec else []:
            base = Path(location)
            for path in sorted(base.rglob("*.py")):
                if "__pycache__" not in path.parts:
                    files[f"{package}/{path.relative_to(base).as_posix()}"] = sha256_file(path)[:16]
    total = hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()
    return {"fingerprint": total, "files": files}


def library_versions() -> dict[str, str]:
    """Installed versions of :data:`LIBRARIES` ("not installed" where absent)."""
    out = {}
    for name in LIBRARIES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


def device_record(device: torch.device) -> str:
    """The device in words: ``cpu`` or ``cuda:N (<name>)``."""
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return str(device)


def images_record(images: torch.Tensor, labels: torch.Tensor, names: list[str]) -> dict[str, Any]:
    """``{"count": N, "sha256": ...}`` of the attack images as decoded and resized (names, labels and
    pixels): a resume on an image folder whose files changed would score new images against rows
    rebuilt from the old ones."""
    digest = hashlib.sha256(json.dumps([list(names), labels.tolist()]).encode())
    digest.update(images.detach().to("cpu", torch.float32).contiguous().numpy().data)  # hashed in place, no copy
    return {"count": len(names), "sha256": digest.hexdigest()}


def collect(cfg: BenchmarkConfig, device: torch.device, images: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The provenance record of a run of ``cfg`` on ``device`` (``images``: :func:`images_record` of
    the attack set)."""
    from fedmjp.checkpoint import checkpoint_sha256

    checkpoints = {}
    for row in cfg.models:
        if row.checkpoint:  # in a run: the hash of the very bytes its rows' weights were read from
            checkpoints[row.name] = checkpoint_sha256(row.checkpoint)
    backbone = cfg.metrics.lpips_backbone
    files = {"lpips_backbone": sha256_file(backbone)} if backbone and Path(backbone).is_file() else {}
    return {"code": {**code_version(), **code_fingerprint()}, "libraries": library_versions(), "device": device_record(device),
            "python": platform.python_version(), "checkpoints": checkpoints, "files": files,
            **({"images": dict(images)} if images is not None else {})}


def _flatten(data: Any, where: str = "") -> dict[str, Any]:
    if isinstance(data, Mapping):
        out: dict[str, Any] = {}
        for k, v in data.items():
            out.update(_flatten(v, f"{where}{k}."))
        return out
    return {where.rstrip("."): data}


def differences(stored: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """``"key: stored -> current"`` for every differing leaf (dotted keys)."""
    a, b = _flatten(stored), _flatten(current)
    return [f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]


def read_record(folder: Path) -> dict[str, Any] | None:
    """The stored ``provenance.json`` of a run folder (None when there is none).

    Raises:
        OutputConflictError: the file is not a JSON object (it names the file and what to do).
    """
    path = Path(folder) / PROVENANCE
    if not path.is_file():
        return None
    try:
        stored = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError, OSError) as err:
        why = " ".join(str(err).split())[:200]
    else:
        if isinstance(stored, dict):
            return stored
        why = f"it holds a JSON {type(stored).__name__}, not an object"
    raise OutputConflictError(
        f"output folder {folder}: {path} is damaged ({why}); the stored rows cannot be checked against the code "
        f"that made them. Choose another --output folder, or delete {PROVENANCE} to resume without a provenance "
        "check (as for a run older than the record)")


def check_or_write(folder: Path, record: Mapping[str, Any], replace: bool = False, force: bool = False) -> None:
    """Write ``provenance.json`` for a new run; on resume compare with the stored one and record the
    resume (``resumes``: when, and what differed) in the rewritten file.

    Args:
        replace: write ``record`` over a stored one (a run folder that holds no finished rows).
        force: resume although the code, libraries, device or checkpoints differ (``--force``): the
            differences are logged and recorded in ``resumes``.
    Raises:
        OutputConflictError: anything but the dirty flag differs (the message lists every difference,
            a changed source file by name), or the stored file is damaged.
        OutputWriteError: the file cannot be written (:func:`benchmark.files.write_text`).
    """
    from .files import write_text

    folder = Path(folder)
    path = folder / PROVENANCE
    stored = None if replace else read_record(folder)
    if stored is None:
        if not replace and (folder / "results.jsonl").is_file():
            _logger.warning("%s has no %s (an older run): resuming without a provenance check", folder, PROVENANCE)
        write_text(path, json.dumps(record, indent=2, sort_keys=True) + "\n", sync=True)
        return
    current = {k: v for k, v in record.items() if k != "resumes"}
    diffs = differences({k: v for k, v in stored.items() if k != "resumes"}, current)
    if "fingerprint" not in stored.get("code", {}):  # recorded before code fingerprints existed
        diffs = [d for d in diffs if not d.startswith(("code.fingerprint", "code.files."))]
        _logger.warning("%s of %s holds no code fingerprint (an older run): source changes since its rows "
                        "cannot be detected", PROVENANCE, folder)
    if "images" not in stored and "images" in current:  # recorded before the images were
        diffs = [d for d in diffs if not d.startswith("images.")]
        _logger.warning("%s of %s holds no digest of the attack images (an older run): a changed image folder "
                        "cannot be detected", PROVENANCE, folder)
    refuse = [d for d in diffs if not d.startswith(WARN_ONLY)]
    if refuse and not force:
        raise OutputConflictError(
            f"output folder {folder} holds rows produced by different code, libraries, device, checkpoints or images; "
            f"results are never mixed. Differences (stored -> now): {'; '.join(refuse)}. "
            "Use a new --output folder, restore what produced the stored rows, or resume with --force to mix "
            f"them knowingly (recorded in {PROVENANCE})")
    for d in diffs:
        _logger.warning("resuming %s although %s%s", folder, d, "" if d in refuse else " (uncommitted edits)")
    import datetime

    resume = {"at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "forced_differences": refuse, "warned_differences": [d for d in diffs if d not in refuse]}
    # The record describes the newest code; the first record and every resume stay in `resumes`.
    history = list(stored.get("resumes") or [{"record": {k: v for k, v in stored.items() if k != "resumes"}}])
    write_text(path, json.dumps({**current, "resumes": [*history, resume]}, indent=2, sort_keys=True) + "\n",
               sync=True)
