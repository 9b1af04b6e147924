"""One process at a time per output folder: an exclusive ``fcntl.flock`` on ``<folder>/.lock``.

Used by the benchmark's result folders (``benchmark.store``) and training's ``--output-dir``
(``fedmjp.train``). The OS releases the lock when the process ends, however it ends, so a killed
run never leaves a folder locked. The lock file holds the owner's pid for people, not for logic.
"""
from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path
from typing import IO, Optional

LOCK = ".lock"


class FolderLocked(RuntimeError):
    """Another process holds the folder's lock; ``owner`` is what its lock file says (``pid N``)."""

    def __init__(self, folder: Path, owner: str) -> None:
        super().__init__(f"{folder} is in use by another process{f' ({owner})' if owner else ''}")
        self.owner = owner


class FolderLockLink(RuntimeError):
    """``<folder>/.lock`` is a symbolic link (never followed)."""


def take_lock(folder: Path) -> IO[str]:
    """Create ``folder`` if needed and lock ``folder/.lock`` without waiting; the open file holds the
    lock (close it, or let the process end, to release).

    Raises:
        FolderLocked: another process holds it (its pid in the message where readable).
        FolderLockLink: the lock file is a symbolic link.
        OSError: the folder or the lock file cannot be created or written.
    """
    folder.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(folder / LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise FolderLockLink(f"{folder / LOCK} is a symbolic link") from None
        raise
    fh = os.fdopen(fd, "r+")
    try:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        owner = _owner(fh)
        fh.close()
        raise FolderLocked(folder, owner) from None
    try:
        fh.seek(0)
        fh.truncate()
        fh.write(f"pid {os.getpid()}\n")
        fh.flush()
    except OSError:
        fh.close()
        raise
    return fh


def release_lock(fh: Optional[IO[str]]) -> None:
    """Release a lock from :func:`take_lock` (no-op for None)."""
    if fh is not None:
        fcntl.flock(fh.fileno(), fcntl.LOCK_UN)
        fh.close()


def _owner(fh: IO[str]) -> str:
    try:
        fh.seek(0)
        return fh.read(64).strip()
    except OSError:
        return ""
