"""The results store of one benchmark run: an output folder with ``config.yaml``, ``results.jsonl`` and
the stored images under ``images/``.

The folder is verified before anything is written (:meth:`RunFolder.check`): it is new, empty, or a
run folder (it holds ``config.yaml`` or ``provenance.json``); a non-empty folder that is not a run
is refused unless the user passes ``--force``. No file is written through a symbolic link: a folder
holding a link where a run writes is refused, files are created with ``O_NOFOLLOW`` and replaced
atomically (a temporary file beside them, then ``os.replace``, which replaces a link itself and
never its target), and a temporary file is removed on every failure path (a full disk, a file-size
limit). A write that fails is :class:`~benchmark.errors.OutputWriteError` (exit status 10): the rows
appended so far are kept and the same command resumes.

Rows are appended and flushed as they are produced, so a killed run loses at most the row being
written. An unreadable line (a torn last line of a killed write, or a corrupt line anywhere) is
moved to ``results.quarantine.jsonl`` with its line number when a run resumes; the rows after it
are kept. A lock file (``.lock``, ``fcntl.flock``) stops two runs writing one folder. Tables and
grids read only this folder.
"""
from __future__ import annotations

import io
import json
import logging
import os
import time
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml
from PIL import Image

from fedmjp.config import dump_yaml, load_yaml
from fedmjp.folder_lock import LOCK, FolderLocked, FolderLockLink, release_lock, take_lock

from .config import BenchmarkConfig, plain
from .config_diff import diff_configs, result_view
from .entries import attack_entries
from .errors import (
    ConfigError,
    OutputConflictError,
    OutputLockedError,
    OutputWriteError,
)

# The atomic, link-safe writers live in benchmark/files.py (below this module and provenance.py);
# their names stay importable from here.
from .files import (  # noqa: F401
    MAX_NAME,
    distinct_slug,
    short_name,
    slug,
    open_append,
    write_error,
    append_line,
    append_lines,
    save_figure,
    write_bytes,
    write_text,
)
from .rows import (  # noqa: F401
    ROW_KEY,
    RUN_FAILURE_PREFIX,
    ResultRow,
    RowKey,
    is_run_failure,
    jsonable,
    row_key,
)

_logger = logging.getLogger(__name__)

RESULTS = "results.jsonl"
CONFIG = "config.yaml"
PROVENANCE = "provenance.json"
IMAGES = "images"
#: Rows of an earlier attempt that failed because the run failed, moved here when they are retried.
RETRIED = "results.retried.jsonl"
#: Files whose presence makes a folder a run folder (written by :meth:`RunFolder.init`).
RUN_MARKERS = (CONFIG, PROVENANCE)
#: Sub-folders a run writes into: a symbolic link anywhere below them is refused.
WRITTEN_FOLDERS = (IMAGES, "errors")
#: Folders of the operating system: never an output folder, even with ``--force`` (with the root of
#: a file system, :func:`system_folder`).
SYSTEM_FOLDERS = frozenset({"/bin", "/boot", "/dev", "/etc", "/lib", "/lib32", "/lib64", "/libx32", "/proc",
                            "/run", "/sbin", "/srv", "/sys", "/usr", "/var", "/opt", "/home", "/mnt", "/media", "/tmp"})


def system_folder(folder: Path) -> bool:
    """Whether ``folder`` is the root of a file system (``/``, a drive) or one of :data:`SYSTEM_FOLDERS`."""
    return folder.parent == folder or os.path.normpath(folder) in SYSTEM_FOLDERS


def rec_kind(attack: str, setting: str) -> str:
    """Stored-image kind of a reconstruction: per attacker and setting (an MJP-aware attack scores
    setting c on its own estimate of x, and batches are paired per setting)."""
    return f"rec-{slug(attack)}-{setting}"


def _parse_line(raw: bytes) -> dict | None:
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
        quarantine = path.with_name(path.name.replace(".jsonl", "") + ".quarantine.jsonl")
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        append_lines(quarantine, [json.dumps({"line": number, "text": raw.decode("utf-8", errors="replace"),
                                              "quarantined_at": stamp}) for number, raw in bad])
        write_bytes(path, b"".join(good), sync=True)
    return rows


class RunFolder:
    """One run's output folder.

    Args:
        folder: the output folder (created if missing).
        force: write into an existing non-empty folder that is not a run folder (``--force``);
            files of the names a run writes are replaced there.
    """

    def __init__(self, folder: str | Path, force: bool = False) -> None:
        self.folder = Path(folder)
        self.force = bool(force)
        self.results_path = self.folder / RESULTS
        self.config_path = self.folder / CONFIG
        self.provenance_path = self.folder / PROVENANCE
        self.images_dir = self.folder / IMAGES
        self._lock_fh: Any | None = None

    # ---------------------------------------------------------------------------------- checks
    def verify(self) -> None:
        """Check, writing nothing, that a run may write into the folder.

        Raises:
            OutputWriteError: the folder is a file, lies under a file, or cannot be written.
            OutputConflictError: the folder is a symbolic link or holds one where a run writes, or
                it is a non-empty folder that is not a run folder (and ``force`` is off).
        """
        folder = self.folder
        if system_folder(folder):
            raise OutputConflictError(f"output folder {folder} is a system folder, not a run folder; it is refused "
                                      "even with --force: choose a folder of the run's own, e.g. --output runs/NAME")
        if folder.is_symlink():
            raise OutputConflictError(f"output folder {folder} is a symbolic link; a run never writes through a "
                                      "link: pass the real folder's path or another --output folder")
        if folder.exists() and not folder.is_dir():
            raise OutputWriteError(f"output {folder} is a file, not a folder; choose another --output folder")
        existing = folder
        while not existing.exists() and not existing.is_symlink() and existing != existing.parent:
            existing = existing.parent
        if not existing.is_dir():
            raise OutputWriteError(f"cannot create output folder {folder}: {existing} is "
                                   f"{'a dangling link' if existing.is_symlink() else 'a file'}, not a folder; "
                                   "choose another --output folder")
        if not os.access(existing, os.W_OK | os.X_OK):
            what = "the output folder" if existing == folder else f"{existing}"
            raise OutputWriteError(f"output folder {folder} cannot be written ({what} is read-only for this user); "
                                   "make it writable or choose another --output folder")
        if existing != folder:
            return  # a new folder: nothing in it yet
        names = sorted(os.listdir(folder))
        # not a run folder is what is wrong with it first (the links in it matter only with --force)
        others = [n for n in names if n != LOCK and not (n.startswith(".") and ".tmp" in n)]
        if others and not self.is_run() and not self.force:
            raise OutputConflictError(
                f"output folder {folder} is not empty and is not a fedmjp run folder (no {CONFIG}; it holds "
                f"{', '.join(others[:5])}{', ...' if len(others) > 5 else ''}); choose a new or empty --output "
                "folder, or pass --force to write into it (files of the names a run writes, e.g. table.csv, "
                "are replaced)")
        links = [n for n in names if (folder / n).is_symlink()]
        for sub in WRITTEN_FOLDERS:
            if (folder / sub).is_dir() and not (folder / sub).is_symlink():
                for root, dirs, files in os.walk(folder / sub):  # never follows links
                    links += [str(Path(root, n).relative_to(folder)) for n in dirs + files
                              if os.path.islink(os.path.join(root, n))]
        if links:
            raise OutputConflictError(
                f"output folder {folder} holds symbolic link(s) where a run writes ({', '.join(links[:5])}"
                f"{', ...' if len(links) > 5 else ''}); a run never writes through a link: remove them or choose "
                "another --output folder")
        if (folder / LOCK).exists() and not (folder / LOCK).is_file():
            raise OutputConflictError(f"output folder {folder}: {LOCK} is not a regular file; remove it or choose "
                                      "another --output folder")

    def is_run(self) -> bool:
        """The folder holds a run's ``config.yaml`` or ``provenance.json``."""
        return any((self.folder / m).is_file() for m in RUN_MARKERS)

    def stored_config(self) -> dict | None:
        """The stored ``config.yaml`` (None when there is none).

        Raises:
            OutputConflictError: it is not a readable YAML mapping (names the file and what to do).
        """
        if not self.config_path.is_file():
            return None
        try:
            old = load_yaml(self.config_path.read_text())  # the configs' own loader: YAML 1.2 floats, size limits
        except yaml.MarkedYAMLError as err:
            mark = err.problem_mark
            why = f"not YAML: {err.problem}{f' at line {mark.line + 1}' if mark is not None else ''}"
        except (yaml.YAMLError, UnicodeDecodeError, OSError) as err:
            why = " ".join(str(err).split())[:200]
        else:
            if isinstance(old, dict):
                return old
            why = f"it holds a YAML {type(old).__name__}, not a mapping of config keys"
        raise OutputConflictError(
            f"output folder {self.folder}: {self.config_path} is damaged ({why}); its rows cannot be matched to a "
            f"config. Choose another --output folder, or pass --force to start over in this one when it holds "
            f"no {RESULTS} rows")

    def check_provenance_file(self) -> None:
        """``provenance.json``, when present, is a JSON object (else OutputConflictError naming it)."""
        from .provenance import read_record

        read_record(self.folder)

    def check(self, cfg: BenchmarkConfig) -> bool:
        """Check that the folder can take this config, writing nothing.

        The device is not compared here: ``provenance.json`` records the device the rows were
        computed on (``auto`` and ``cpu`` are the same device on a machine without CUDA), and a
        folder whose stored rows are all failures of a failed run (no client update reached the
        attacker, e.g. a bad device or checkpoint) takes the corrected config: nothing would be mixed.

        Returns:
            True when it holds a run of the same config (resume).
        Raises:
            ConfigError: two model rows or attackers would share stored file names.
            OutputWriteError, OutputConflictError: see :meth:`verify`; different config; damaged
                ``config.yaml`` or ``provenance.json``.
        """
        check_names(cfg)
        self.verify()
        if not self.folder.is_dir():
            return False
        try:
            old = self.stored_config()
        except OutputConflictError:
            if self.force and not self.results_path.exists():
                _logger.warning("%s is damaged; --force: it is replaced", self.config_path)
                return False
            raise
        if self.provenance_path.exists() and not self.force:
            self.check_provenance_file()
        kept = [r for r in self.rows() if not is_run_failure(r)]
        if old is not None:
            diffs = [d for d in diff_configs(result_view(old), result_view(cfg)) if d.split(":")[0] != "device"]
            if diffs and not kept:
                _logger.warning("output folder %s holds no finished rows (only failures of a failed run); its "
                                "config is replaced (%s)", self.folder, "; ".join(diffs[:5]))
                return False
            if diffs:
                raise OutputConflictError(
                    f"output folder {self.folder} holds a run with a different config; results are never mixed. "
                    f"Differences (stored -> requested): {'; '.join(diffs[:12])}. "
                    "Use a new --output folder, or the stored settings to resume.")
            return True
        if kept:
            raise OutputConflictError(f"output folder {self.folder} holds {RESULTS} but no {CONFIG}; "
                                      "refusing to mix results of an unknown config; use a new --output folder")
        return False

    def init(self, cfg: BenchmarkConfig, provenance: Mapping[str, Any] | None = None) -> None:
        """Lock the folder, save the resolved ``config.yaml`` (kept as is when resuming), move the rows
        that failed because an earlier attempt failed to ``results.retried.jsonl`` (they are computed
        again), and write or check ``provenance.json`` (:mod:`benchmark.provenance`).

        Raises:
            OutputLockedError: another run holds the folder.
            OutputConflictError: different config or provenance.
            OutputWriteError: the folder cannot be written.
        """
        from .provenance import check_or_write

        self.check(cfg)  # before the lock creates the folder
        self.lock()
        try:
            resume = self.check(cfg)  # checked again under the lock
            retried = self.retry_run_failures()
            if not resume:
                text = dump_yaml(plain(cfg), sort_keys=False, default_flow_style=None)  # reads back equal
                write_text(self.config_path, text, sync=True)
            if provenance is not None:
                fresh = not resume or not self.results_path.is_file() or not self.rows()
                check_or_write(self.folder, provenance, replace=fresh or self.force and not self.rows(),
                               force=self.force)
            if retried:
                _logger.info("%d row(s) that failed because an earlier attempt of the run failed are computed "
                             "again (moved to %s)", retried, RETRIED)
        except BaseException:
            self.unlock()
            raise

    def retry_run_failures(self) -> int:
        """Move rows that failed because the run failed (:func:`is_run_failure`) from ``results.jsonl``
        to ``results.retried.jsonl``, so that they are computed again; returns how many."""
        rows = read_jsonl(self.results_path, repair=True)
        if not any(is_run_failure(r) for r in rows):
            return 0
        keep: list[bytes] = []
        moved: list[bytes] = []
        with self.results_path.open("rb") as fh:
            for raw in fh:
                (moved if is_run_failure(_parse_line(raw) or {}) else keep).append(raw)
        append_lines(self.folder / RETRIED, [raw.decode().rstrip("\n") for raw in moved])
        write_bytes(self.results_path, b"".join(keep), sync=True)
        return len(moved)

    # ---------------------------------------------------------------------------------- lock
    def lock(self) -> None:
        """Take the folder's lock (created with the folder); held until :meth:`unlock` or exit.

        Raises:
            OutputLockedError: another run holds it.
            OutputConflictError: ``.lock`` is a symbolic link (never followed).
            OutputWriteError: the folder cannot be created or written.
        """
        if self._lock_fh is not None:
            return
        try:
            self._lock_fh = take_lock(self.folder)
        except FolderLockLink:
            raise OutputConflictError(f"output folder {self.folder}: {LOCK} is a symbolic link; a run never writes "
                                      "through a link: remove it or choose another --output folder") from None
        except FolderLocked:
            raise OutputLockedError(f"output folder {self.folder} is in use by another run (its {LOCK} is locked); "
                                    "wait for that run to end or use another --output folder") from None
        except OSError as err:
            raise write_error(self.folder / LOCK, err) from None

    def unlock(self) -> None:
        """Release the lock (the OS releases it too when the process ends)."""
        release_lock(self._lock_fh)
        self._lock_fh = None

    def load_config(self) -> dict:
        return self.stored_config() or {}

    # ---------------------------------------------------------------------------------- rows
    def rows(self, repair: bool = False) -> list[dict]:
        """All stored result rows (one per attacked image and setting)."""
        return read_jsonl(self.results_path, repair=repair)

    def done_keys(self) -> set[RowKey]:
        return {row_key(r) for r in self.rows(repair=True)}

    def append(self, rows: Iterable[ResultRow]) -> int:
        """Append rows (:meth:`ResultRow.to_json`, the one writer of results.jsonl) and flush them to
        disk; returns how many were written.

        Raises:
            OutputWriteError: a full disk or a file-size limit (the rows before it are kept).
        """
        return append_lines(self.results_path, (row.to_json() for row in rows))

    # ---------------------------------------------------------------------------------- images
    def image_path(self, model: str, group: str, image_id: str, kind: str, round_: int | None = None,
                   partition_id: int | None = None) -> Path:
        """``images/<model>/<group>/<image>__r<round>-p<partition>__<kind>.png`` (``kind``: x, xs, rec).

        An image name that is not file-name-safe gets a hash of itself (:func:`distinct_slug`: two
        names that clean up the same never share a file), and a name longer than :data:`MAX_NAME`
        bytes keeps its head and gets a hash of the whole (:func:`short_name`), so a long image file
        name never fails a run mid-way.
        """
        where = "" if round_ is None else f"__r{round_}-p{partition_id}"
        tail = f"{where}__{slug(kind)}.png"
        stem = distinct_slug(image_id)
        name = stem + tail
        if len(name.encode()) > MAX_NAME:
            name = short_name(stem, MAX_NAME - len(tail.encode())) + tail
        return self.images_dir / short_name(slug(model)) / short_name(slug(group)) / name

    def save_image(self, path: Path, image: torch.Tensor) -> None:
        """Store [3, H, W] in [0, 1] as an 8-bit PNG (non-finite values become 0), atomically and
        never through a link (:func:`write_bytes`)."""
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise write_error(path.parent, err) from err
        save_png(image, path)

    def save_row_images(self, row: ResultRow, x: torch.Tensor, x_tilde: torch.Tensor | None,
                        reconstruction: torch.Tensor) -> None:
        """The PNGs the grids show for one row: the true image x, x~ (shuffled group) and the
        reconstruction scored against it."""
        name, group, image_id, rnd, part = row.model, str(row.group), row.image_id, row.round, row.partition_id
        self.save_image(self.image_path(name, group, image_id, "x", rnd, part), x)
        if x_tilde is not None:
            self.save_image(self.image_path(name, group, image_id, "xs", rnd, part), x_tilde)
        self.save_image(self.image_path(name, group, image_id, rec_kind(row.attack, row.setting), rnd, part),
                        reconstruction)

    def write_error(self, name: str, text: str) -> Path:
        """Write an unexpected error's traceback to ``errors/<name>`` (shortened to a safe file
        name); returns the path.

        Raises:
            OutputWriteError: the folder or file cannot be written.
        """
        folder = self.folder / "errors"
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise OutputWriteError(f"cannot create {folder}: {err.strerror}") from err
        path = folder / short_name(name)
        write_text(path, text)
        return path

    def stored_images(self) -> Iterator[Path]:
        return self.images_dir.rglob("*.png") if self.images_dir.is_dir() else iter(())


def check_names(cfg: BenchmarkConfig) -> None:
    """Model rows and attackers whose names give the same stored file name (``"X Y"`` and ``"X_Y"``
    both give ``images/X_Y/``) are refused: one's images would show under the other's label.

    Raises:
        ConfigError: naming both and what to do.
    """
    groups = (("model rows", [r.name for r in cfg.models]), ("attackers", [e.label for e in attack_entries(cfg)]))
    for what, names in groups:
        seen: dict[str, str] = {}
        for name in names:
            key = short_name(slug(name))
            if key in seen and seen[key] != name:
                raise ConfigError(f"{what} {seen[key]!r} and {name!r} would share the stored file name {key!r} "
                                  "(one's images would show under the other's label); rename one")
            seen.setdefault(key, name)


def save_png(image: torch.Tensor, path: Path) -> None:
    """[3, H, W] float in [0, 1] -> 8-bit RGB PNG."""
    arr = torch.nan_to_num(image.detach().float().cpu(), nan=0.0, posinf=1.0, neginf=0.0)
    pixels = (arr.clamp(0, 1) * 255.0).round().to(torch.uint8).permute(1, 2, 0).numpy()
    # Lossless either way; level 1 writes a 224 px tile ~5x faster than the default 6 (the grid
    # images of a run are a few dozen PNGs, a few percent larger).
    buffer = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(buffer, format="PNG", compress_level=1)
    write_bytes(path, buffer.getvalue())


def load_png(path: Path) -> np.ndarray:
    """8-bit RGB PNG -> [H, W, 3] uint8."""
    with Image.open(path, formats=["PNG"]) as img:  # fedmjp writes these: PNG only
        return np.asarray(img.convert("RGB"))
