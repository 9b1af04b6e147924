"""One process at a time per output folder, and whole files written into it safely.

:func:`take_lock`: an exclusive ``fcntl.flock`` on ``<folder>/.lock``. Used by the benchmark's
result folders (``benchmark.store``), training's ``--output-dir`` (``fedmjp.train``) and the
federation server's ``out-dir`` (``server.outdir``). The OS releases the lock when the process
ends, however it ends, so a killed run never leaves a folder locked. The lock file holds the
owner's pid for people, not for logic.

:func:`write_atomic`: a whole file written to a new temporary file beside it (created with
``O_NOFOLLOW | O_EXCL``) and moved over it with ``os.replace`` (which replaces a link itself, never
its target), so a reader sees the old file or the new one and a symbolic link planted in the
folder is never written through. It sits in the core so that every package writing an output
folder (the benchmark, the server) shares it.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import secrets
from pathlib import Path
from typing import IO, Optional

LOCK = ".lock"

#: Longest file name component written (most file systems allow 255 bytes; the rest is left for
#: the temporary-file prefix and suffix).
MAX_NAME = 200


def write_atomic(path: str | Path, data: bytes, sync: bool = False) -> None:
    """Write ``path`` atomically without following a symbolic link.

    The bytes go to a new temporary file beside ``path`` (``O_CREAT | O_EXCL | O_NOFOLLOW``: never an
    existing file or link), which then replaces ``path`` (``os.replace`` replaces a link itself,
    never its target). The temporary file is removed on every failure (a full disk, a file-size
    limit, an interrupt). Hand-written because ``tempfile`` creates files readable by the owner only
    (mode 0600), while outputs follow the user's umask.

    Raises:
        OSError: the file cannot be written (a directory where the file should be: EISDIR).
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name[:MAX_NAME]}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            if sync:
                os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


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
