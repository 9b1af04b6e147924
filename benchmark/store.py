"""The results store of one benchmark run: an output folder with ``config.yaml``, ``results.jsonl`` and
the stored images under ``images/``.

Rows are appended and flushed as they are produced, so a killed run loses at most the row being
written. An unreadable line (a torn last line of a killed write, or a corrupt line anywhere) is
moved to ``results.quarantine.jsonl`` with its line number when a run resumes; the rows after it
are kept. A lock file (``.lock``, ``fcntl.flock``) stops two runs writing one folder. Tables and
grids read only this folder.
"""
from __future__ import annotations

import fcntl
import json
import logging
import math
import os
import re
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping, Optional

import numpy as np
import torch
import yaml
from PIL import Image

from .config import diff_configs, result_view, save_config
from .errors import OutputConflictError, OutputLockedError

_logger = logging.getLogger(__name__)

RESULTS = "results.jsonl"
LOCK = ".lock"
CONFIG = "config.yaml"
IMAGES = "images"

#: Fields that identify an attacked image; a resumed run skips rows whose key is stored.
ROW_KEY = ("model", "attack", "setting", "round", "partition_id", "batch_index", "image_id")


def row_key(row: Mapping[str, Any]) -> tuple:
    return tuple(row.get(k) for k in ROW_KEY)


def slug(text: str) -> str:
    """A file-name-safe form of a row name (``DeiT+MJP`` -> ``DeiT+MJP``, spaces -> ``_``)."""
    return re.sub(r"[^A-Za-z0-9+\-.]+", "_", str(text)).strip("_") or "row"


def jsonable(value: Any) -> Any:
    """Plain JSON data: tensors/arrays to lists, NaN to None, +-inf to "inf"/"-inf"."""
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().tolist()
    elif isinstance(value, np.ndarray):
        value = value.tolist()
    elif isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float):
        # JSON has no inf/NaN: +-inf (e.g. PSNR of an exact copy) is kept as a string pandas reads back
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, (str, int, bool)) or value is None:
        return value
    return str(value)


def _parse_line(raw: bytes) -> Optional[dict]:
    """A JSON object of one complete line, or None (torn, not JSON, not an object)."""
    if not raw.endswith(b"\n"):
        return None
    try:
        row = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    return row if isinstance(row, dict) else None


def read_jsonl(path: Path, repair: bool = False) -> list[dict]:
    """Rows of a JSON-lines file; unreadable lines are skipped, never the rows after them.

    With ``repair`` the unreadable lines (a torn last line of a killed write, a corrupt line
    anywhere) are moved to ``<name>.quarantine.jsonl`` beside the file, one JSON object per line
    with ``line`` (1-based number in the file as it was), ``text`` and ``quarantined_at``, and the
    file is rewritten atomically without them so that appends continue cleanly.
    """
    if not path.is_file():
        return []
    rows, good, bad = [], [], []
    with path.open("rb") as fh:
        for number, raw in enumerate(fh, start=1):
            row = _parse_line(raw)
            if row is None:
                bad.append((number, raw))
            else:
                rows.append(row)
                good.append(raw)
    for number, raw in bad:
        _logger.warning("%s line %d is unreadable%s; %s", path, number, " (a torn last write)"
                        if not raw.endswith(b"\n") else "", "moved to the quarantine file" if repair else "skipped")
    if repair and bad:
        import time

        quarantine = path.with_name(path.name.replace(".jsonl", "") + ".quarantine.jsonl")
        with quarantine.open("a") as fh:
            for number, raw in bad:
                fh.write(json.dumps({"line": number, "text": raw.decode("utf-8", errors="replace"),
                                     "quarantined_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}) + "\n")
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        tmp.write_bytes(b"".join(good))
        os.replace(tmp, path)
    return rows


class RunFolder:
    """One run's output folder.

    Args:
        folder: the output folder (created if missing).
    """

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        self.results_path = self.folder / RESULTS
        self.config_path = self.folder / CONFIG
        self.images_dir = self.folder / IMAGES
        self._lock_fh: Optional[Any] = None

    # ---------------------------------------------------------------------------------- lock
    def lock(self) -> None:
        """Take the folder's lock (created with the folder); held until :meth:`unlock` or exit.

        Raises:
            OutputLockedError: another run holds it.
        """
        if self._lock_fh is not None:
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        fh = (self.folder / LOCK).open("a+")
        try:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fh.close()
            raise OutputLockedError(f"output folder {self.folder} is in use by another run (its {LOCK} is locked); "
                                    "wait for that run to end or use another --output folder") from None
        fh.seek(0)
        fh.truncate()
        fh.write(f"pid {os.getpid()}\n")
        fh.flush()
        self._lock_fh = fh

    def unlock(self) -> None:
        """Release the lock (the OS releases it too when the process ends)."""
        if self._lock_fh is not None:
            fcntl.flock(self._lock_fh.fileno(), fcntl.LOCK_UN)
            self._lock_fh.close()
            self._lock_fh = None

    # ---------------------------------------------------------------------------------- config
    def check(self, cfg: dict) -> bool:
        """Check that the folder can take this config, writing nothing.

        Returns:
            True when it holds a run of the same config (resume).
        Raises:
            OutputConflictError: the folder holds results of a different config.
        """
        if self.config_path.is_file():
            old = yaml.safe_load(self.config_path.read_text()) or {}
            diffs = diff_configs(result_view(old), result_view(cfg))
            if diffs:
                raise OutputConflictError(
                    f"output folder {self.folder} holds a run with a different config; results are never mixed. "
                    f"Differences (stored -> requested): {'; '.join(diffs[:12])}. "
                    "Use a new --output folder, or the stored settings to resume.")
            return True
        if self.results_path.exists():
            raise OutputConflictError(f"output folder {self.folder} holds {RESULTS} but no {CONFIG}; "
                                      "refusing to mix results of an unknown config; use a new --output folder")
        return False

    def init(self, cfg: dict, provenance: Optional[Mapping[str, Any]] = None) -> None:
        """Lock the folder, save the resolved ``config.yaml`` (kept as is when resuming) and write or
        check ``provenance.json`` (:mod:`benchmark.provenance`).

        Raises:
            OutputLockedError: another run holds the folder.
            OutputConflictError: different config or provenance.
        """
        from .provenance import check_or_write

        self.lock()
        try:
            if not self.check(cfg):  # checked again under the lock
                save_config(cfg, self.config_path)
            if provenance is not None:
                check_or_write(self.folder, provenance)
        except BaseException:
            self.unlock()
            raise

    def load_config(self) -> dict:
        return yaml.safe_load(self.config_path.read_text())

    # ---------------------------------------------------------------------------------- rows
    def rows(self, repair: bool = False) -> list[dict]:
        """All stored result rows (one per attacked image and setting)."""
        return read_jsonl(self.results_path, repair=repair)

    def done_keys(self) -> set[tuple]:
        return {row_key(r) for r in self.rows(repair=True)}

    def append(self, rows: Iterable[Mapping[str, Any]]) -> int:
        """Append rows and flush them to disk; returns how many were written."""
        n = 0
        with self.results_path.open("a") as fh:
            for row in rows:
                fh.write(json.dumps(jsonable(row), allow_nan=False) + "\n")
                n += 1
            fh.flush()
            os.fsync(fh.fileno())
        return n

    # ---------------------------------------------------------------------------------- images
    def image_path(self, model: str, group: str, image_id: str, kind: str, round_: Optional[int] = None,
                   partition_id: Optional[int] = None) -> Path:
        """``images/<model>/<group>/<image>__r<round>-p<partition>__<kind>.png`` (``kind``: x, xs, rec)."""
        where = "" if round_ is None else f"__r{round_}-p{partition_id}"
        return self.images_dir / slug(model) / group / f"{slug(image_id)}{where}__{kind}.png"

    def save_image(self, path: Path, image: torch.Tensor) -> None:
        """Store [3, H, W] in [0, 1] as an 8-bit PNG (non-finite values become 0)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        save_png(image, path)

    def stored_images(self) -> Iterator[Path]:
        return self.images_dir.rglob("*.png") if self.images_dir.is_dir() else iter(())


def save_png(image: torch.Tensor, path: Path) -> None:
    """[3, H, W] float in [0, 1] -> 8-bit RGB PNG."""
    arr = torch.nan_to_num(image.detach().float().cpu(), nan=0.0, posinf=1.0, neginf=0.0)
    arr = (arr.clamp(0, 1) * 255.0).round().to(torch.uint8).permute(1, 2, 0).numpy()
    # Lossless either way; level 1 writes a 224 px tile ~5x faster than the default 6 (the grid
    # images of a run are a few dozen PNGs, a few percent larger).
    Image.fromarray(arr, "RGB").save(path, compress_level=1)


def load_png(path: Path) -> np.ndarray:
    """8-bit RGB PNG -> [H, W, 3] uint8."""
    with Image.open(path) as img:
        return np.asarray(img.convert("RGB"))
