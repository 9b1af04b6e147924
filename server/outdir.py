"""The server's ``out-dir``: one run's outcome and tapped updates, written through one guarded writer.

A run with ``out-dir`` set (``server.run``, ``flwr run``, a deployment) owns the folder while it
runs: it holds the folder's lock (:func:`fedmjp.folder_lock.take_lock`, one process at a time),
writes the marker ``server-run.json`` naming the run first, and writes every file through
:meth:`OutDir.write` (:func:`fedmjp.folder_lock.write_atomic`: a temporary file beside it, then
``os.replace``; never through a symbolic link). Layout::

    server-run.json   {"run": <run id>, "finished": false|true}
    federation.json   the outcome (history, failures), written last
    final_state.pt    the global state after the last round
    updates/          round-0001-global.pt, round-0001-node-<id>.pt or round-0001-aggregate.pt

A new run refuses a folder that holds anything else (not a server out-dir), a symbolic link where
it writes, or a *finished* run (its results are never overwritten: choose another out-dir or remove
it). The files of an unfinished run (killed: a marker without ``federation.json``) are its own
files of no use to anyone, so the new run removes them; a reader therefore never mixes two runs.
"""
from __future__ import annotations

import io
import json
import os
import stat
import uuid
from pathlib import Path
from typing import IO, Any, Optional

import torch

from fedmjp.folder_lock import LOCK, FolderLocked, FolderLockLink, release_lock, take_lock, write_atomic

MARKER = "server-run.json"
OUTCOME_FILE = "federation.json"
FINAL_STATE_FILE = "final_state.pt"
UPDATES = "updates"
#: What a server run writes at the top of its out-dir (besides the lock).
OWN_FILES = (MARKER, OUTCOME_FILE, FINAL_STATE_FILE)


class OutDirError(ValueError):
    """The out-dir cannot be used or read; the message names the folder and what to do."""


def _is_temp(name: str) -> bool:
    return name.startswith(".") and name.endswith(".tmp")


def _lstat(path: Path) -> Optional[os.stat_result]:
    try:
        return os.lstat(path)
    except FileNotFoundError:
        return None


def read_marker(folder: Path) -> dict[str, Any]:
    """The marker of a server out-dir (``{}`` where there is none).

    Raises:
        OutDirError: the marker is a link, not a file, or not the JSON object a run writes.
    """
    path = folder / MARKER
    st = _lstat(path)
    if st is None:
        return {}
    if not stat.S_ISREG(st.st_mode):
        raise OutDirError(f"{path} is not a regular file (a link or a folder); remove it or use another out-dir")
    try:
        data = json.loads(path.read_bytes().decode())
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise OutDirError(f"{path} is damaged ({err}); remove the folder or use another out-dir") from None
    if not isinstance(data, dict) or not isinstance(data.get("run"), str):
        raise OutDirError(f"{path} does not name a run; remove the folder or use another out-dir")
    return data


class OutDir:
    """An out-dir owned by one run (see the module docstring); :meth:`open` to start one."""

    def __init__(self, folder: Path, run_id: str, lock: IO[str]) -> None:
        self.folder, self.run_id = folder, run_id
        self._lock: Optional[IO[str]] = lock
        self.updates = folder / UPDATES

    @classmethod
    def open(cls, folder: str | Path, run_id: Optional[str] = None) -> "OutDir":
        """Lock ``folder`` (created if missing), check that it may take a new run, remove an
        unfinished run's files and write this run's marker.

        Raises:
            OutDirError: another process holds the folder, or it holds something a run must not
                overwrite (the message says which file and what to do).
        """
        folder = Path(folder)
        run_id = run_id or uuid.uuid4().hex
        try:
            lock = take_lock(folder)
        except FolderLocked as err:
            raise OutDirError(f"out-dir {folder} is in use by another run ({err.owner or 'pid unknown'}); wait for it "
                              "or use another out-dir") from None
        except FolderLockLink:
            raise OutDirError(f"{folder / LOCK} is a symbolic link, which a run never writes through; remove it "
                              "or use another out-dir") from None
        except OSError as err:
            raise OutDirError(f"cannot use out-dir {folder}: {err.strerror or err}; choose a writable folder") from None
        try:
            _clear_unfinished(folder)
            out = cls(folder, run_id, lock)
            out.updates.mkdir(exist_ok=True)
            out.write_json(MARKER, {"run": run_id, "finished": False})
            return out
        except BaseException:
            release_lock(lock)
            raise

    def path(self, name: str) -> Path:
        return self.folder / name

    def write(self, name: str, data: bytes) -> None:
        """Write ``name`` (relative to the folder: ``federation.json``, ``updates/round-0001-...``)
        atomically, never through a link.

        Raises:
            OutDirError: it cannot be written (the reason and the path in the message).
        """
        path = self.folder / name
        try:
            write_atomic(path, data)
        except OSError as err:
            raise OutDirError(f"cannot write {path}: {err.strerror or err}; free space or choose another out-dir") \
                from None

    def write_json(self, name: str, data: Any) -> None:
        self.write(name, json.dumps(data, indent=2, allow_nan=False).encode())

    def save_torch(self, name: str, obj: Any) -> None:
        buf = io.BytesIO()
        torch.save(obj, buf)
        self.write(name, buf.getvalue())

    def finish(self) -> None:
        """Mark the run finished (after ``federation.json`` is written)."""
        self.write_json(MARKER, {"run": self.run_id, "finished": True})

    def close(self) -> None:
        """Release the folder's lock."""
        lock, self._lock = self._lock, None
        release_lock(lock)


def _clear_unfinished(folder: Path) -> None:
    """Check ``folder`` may take a new run; remove the files of an unfinished one (see module docs)."""
    names = sorted(n for n in os.listdir(folder) if n != LOCK and not _is_temp(n))
    if not names:
        return
    marker = read_marker(folder)
    foreign = [n for n in names if n not in (*OWN_FILES, UPDATES)]
    if not marker or foreign:
        shown = ", ".join((foreign or names)[:3])
        raise OutDirError(f"out-dir {folder} holds files that are not a server run's ({shown}); use an empty or new "
                          "folder")
    if marker.get("finished") is not False or _lstat(folder / OUTCOME_FILE) is not None:
        raise OutDirError(f"out-dir {folder} holds the finished run {marker['run']} (its {OUTCOME_FILE}); a new run "
                          "never overwrites it: use another out-dir, or remove this one first")
    updates = folder / UPDATES
    st = _lstat(updates)
    if st is not None:
        if not stat.S_ISDIR(st.st_mode):
            raise OutDirError(f"{updates} is not a folder (a link or a file); remove it or use another out-dir")
        for name in os.listdir(updates):
            if not (name.startswith("round-") and name.endswith(".pt")) and not _is_temp(name):
                raise OutDirError(f"{updates} holds {name}, which a server run never writes; use another out-dir")
            os.unlink(updates / name)  # a link is removed itself, never its target
    for name in (FINAL_STATE_FILE, MARKER):
        if _lstat(folder / name) is not None:
            os.unlink(folder / name)
