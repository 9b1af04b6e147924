"""Files a run writes, written safely: atomically and never through a symbolic link.

Every file of a run folder (``config.yaml``, ``provenance.json``, ``results.jsonl``, tables, PNGs)
goes through these functions: a whole file is written to a new temporary file beside it (created
with ``O_NOFOLLOW | O_EXCL``) and moved over it with ``os.replace`` (which replaces a link itself,
never its target); an appended line goes through ``O_APPEND | O_NOFOLLOW``. A write that fails is
:class:`~benchmark.errors.OutputWriteError` (exit status 10) with the reason and what to do.

This module sits below :mod:`benchmark.store` and :mod:`benchmark.provenance`, which both write
files, so neither has to import the other for it; the atomic writer itself is
:func:`fedmjp.folder_lock.write_atomic`, which the federation server's ``out-dir`` shares.
"""
from __future__ import annotations

import errno
import hashlib
import io
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from fedmjp.folder_lock import MAX_NAME, write_atomic

from .errors import OutputWriteError


def write_error(path: Path, err: OSError) -> OutputWriteError:
    """A failed write as the user-facing error (exit status 10)."""
    what = err.strerror or str(err)
    if err.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        hint = "free disk space or raise the file-size limit (ulimit -f), then run the same command to resume"
    elif err.errno == errno.ELOOP:
        hint = "it is a symbolic link, which a run never writes through; remove the link or use another --output"
    elif err.errno == errno.ENAMETOOLONG:
        hint = "the path is longer than the file system allows; use a shorter --output folder (or shorter labels)"
    else:
        hint = "make the folder writable or choose another --output folder"
    return OutputWriteError(f"cannot write {path}: {what}; rows written so far are kept; {hint}")


def write_bytes(path: str | Path, data: bytes, sync: bool = False) -> None:
    """Write ``path`` atomically without following a symbolic link
    (:func:`fedmjp.folder_lock.write_atomic`: a temporary file beside it, then ``os.replace``).

    Raises:
        OutputWriteError: the file cannot be written (exit status 10).
    """
    try:
        write_atomic(path, data, sync)
    except OSError as err:
        raise write_error(Path(path), err) from err


def write_text(path: str | Path, text: str, sync: bool = False) -> None:
    """:func:`write_bytes` of UTF-8 text."""
    write_bytes(path, text.encode(), sync)


def save_figure(fig: Any, path: str | Path, **savefig_kwargs: Any) -> None:
    """A matplotlib figure as PNG through :func:`write_bytes` (atomic, never through a link)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", **savefig_kwargs)
    write_bytes(path, buf.getvalue())


def append_line(path: str | Path, line: str) -> None:
    """Append one line to ``path`` (created if missing), never through a symbolic link."""
    with open_append(Path(path)) as fh:
        fh.write(line.rstrip("\n") + "\n")


def open_append(path: Path) -> Any:
    """``path`` opened for appending, created if missing, never through a symbolic link."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    return os.fdopen(fd, "a")


def append_lines(path: Path, lines: Iterable[str]) -> int:
    """Append text lines (each gets a newline) to ``path``, flushed to disk; never through a link.

    Raises:
        OutputWriteError: the file cannot be written (the lines before the failure are kept).
    """
    n = 0
    try:
        with open_append(path) as fh:
            for line in lines:
                fh.write(line + "\n")
                n += 1
            fh.flush()
            os.fsync(fh.fileno())
    except OSError as err:
        raise write_error(path, err) from err
    return n


# ------------------------------------------------------------- file names of untrusted strings
def slug(text: str) -> str:
    """A file-name-safe form of a row name (``DeiT+MJP`` -> ``DeiT+MJP``, spaces -> ``_``)."""
    return re.sub(r"[^A-Za-z0-9+\-.]+", "_", str(text)).strip("_") or "row"


def distinct_slug(text: str) -> str:
    """:func:`slug`, with ``~`` and a hash of ``text`` where the cleaning changed it: names that
    clean up the same (``a b.png``, ``a_b.png``, ``a/b.png``) keep distinct files, and a name that
    is already clean keeps its own (a clean name never holds ``~``, so it cannot meet a hashed one)."""
    clean = slug(text)
    if clean == str(text):
        return clean
    return f"{clean}~{hashlib.sha256(str(text).encode()).hexdigest()[:10]}"


def short_name(name: str, limit: int = MAX_NAME) -> str:
    """``name`` when it fits ``limit`` bytes, else its head and a hash of the whole (distinct names
    stay distinct; the same name always gives the same file)."""
    if len(name.encode()) <= limit:
        return name
    digest = hashlib.sha256(name.encode()).hexdigest()[:16]
    head = name.encode()[: limit - len(digest) - 1].decode("utf-8", errors="ignore")
    return f"{head}~{digest}"
