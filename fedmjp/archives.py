"""Dataset archives and ImageFolder roots: where a ``data_path`` or an image source's files are.

A data path is an ImageFolder root holding ``train/`` and ``val/`` (ImageNet layout), a folder that
contains exactly one such root (``cifar10/`` inside an extracted archive), or a ``.tar.gz`` /
``.tgz`` / ``.tar`` of one, which is extracted once into a cache folder with a marker file so that
re-runs skip the extraction. Central training (:mod:`fedmjp.train_data`), the evaluation and the
benchmark's image sources (:mod:`fedmjp.data`) all find their folders here.
"""
from __future__ import annotations

import hashlib
import logging
import lzma
import os
import shutil
import tarfile
import zlib
from pathlib import Path
from typing import Optional

from . import datadir

_logger = logging.getLogger(__name__)

ARCHIVE_SUFFIXES = (".tar.gz", ".tgz", ".tar")
_MARKER = ".fedmjp_extracted"


def default_cache_dir() -> Path:
    """``$FEDMJP_CACHE`` or ``~/.cache/fedmjp``; datasets go to its ``data/`` folder."""
    return Path(os.environ.get("FEDMJP_CACHE", Path.home() / ".cache" / "fedmjp"))


class ArchiveError(ValueError):
    """A dataset archive or cache folder that cannot be used: an unsafe member (``..``, an absolute
    path, a link out of the archive, a device file), not a readable tar file, no ``train/`` folder,
    or a cache location that is not a writable folder."""


def find_imagefolder_root(path: Path) -> Path:
    if (path / "train").is_dir():
        return path
    subdirs = [d for d in sorted(path.iterdir()) if d.is_dir() and (d / "train").is_dir()]
    if len(subdirs) != 1:
        raise FileNotFoundError(f"{path} has no train/ folder (nor exactly one sub-folder with one)")
    return subdirs[0]


def _member_filter(member: tarfile.TarInfo, dest: str) -> tarfile.TarInfo:
    """tarfile's ``data`` filter (no links out of the destination or to absolute paths, no device
    files, no set-uid bits), and absolute or ``..`` member names refused rather than rewritten."""
    name = member.name.replace("\\", "/")
    if name.startswith("/") or ".." in name.split("/"):
        raise tarfile.OutsideDestinationError(member, os.path.join(dest, name))
    return tarfile.data_filter(member, dest)


def extract_archive(archive: Path, cache_dir: Optional[Path] = None) -> Path:
    """Extract ``archive`` once under ``cache_dir`` and return the extraction folder.

    The folder name carries a hash of the archive's path, size and mtime, so a changed archive gets a
    fresh folder. Extraction goes to a temporary sibling that is renamed into place once it holds a
    ``train/`` folder, and a marker file is written last: an interrupted extraction is never mistaken
    for a finished one, and a failed one leaves nothing behind. Members are filtered
    (:func:`_member_filter`): an archive with an unsafe member is refused as a whole.

    Raises:
        ArchiveError: an unsafe member, not a tar archive, no ``train/`` folder, or the cache
            folder cannot be created.
    """
    archive = archive.resolve()
    st = archive.stat()
    key = hashlib.sha1(f"{archive}:{st.st_size}:{int(st.st_mtime)}".encode()).hexdigest()[:10]
    stem = archive.name
    for suffix in ARCHIVE_SUFFIXES:
        stem = stem[: -len(suffix)] if stem.endswith(suffix) else stem
    root = Path(cache_dir or default_cache_dir() / "data") / f"{stem}-{key}"
    if (root / _MARKER).exists():
        return root
    try:
        root.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ArchiveError(f"cannot create the dataset cache folder {root.parent} ({err.strerror or err}); set "
                           "FEDMJP_CACHE to a writable folder") from err
    tmp = root.parent / f".{root.name}.tmp{os.getpid()}"
    _logger.info("extracting %s to %s (once)", archive, root)
    try:
        try:
            with tarfile.open(archive) as tar:
                tar.extractall(tmp, filter=_member_filter)
        except tarfile.FilterError as err:
            raise ArchiveError(f"dataset archive {archive} holds an unsafe member ({err}); refused, nothing of it "
                               "is kept") from err
        except (tarfile.TarError, EOFError, zlib.error, lzma.LZMAError, OSError) as err:
            raise ArchiveError(f"{archive} is not a readable tar archive ({' '.join(str(err).split())[:200]}); "
                               f"pass a {'/'.join(ARCHIVE_SUFFIXES)} of a folder with train/ and val/") from err
        try:
            find_imagefolder_root(tmp)
        except (FileNotFoundError, OSError) as err:
            raise ArchiveError(f"dataset archive {archive} holds no train/ folder (nor one folder with train/ "
                               "and val/ inside); pack the ImageFolder layout: train/<class>/..., "
                               "val/<class>/...") from err
        if (root / _MARKER).exists():  # a concurrent run finished first
            return root
        if root.exists():  # a stale folder from an interrupted run (no marker)
            shutil.rmtree(root)
        tmp.rename(root)
        (root / _MARKER).write_text(str(archive) + "\n")
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return root


def resolve_data_path(data_path: str | Path, cache_dir: Optional[str | Path] = None) -> Path:
    """ImageFolder root (with ``train/`` and ``val/``) for a folder or an archive path; a path that
    starts with ``$FEDMJP_DATA`` is read from the data folder (:mod:`fedmjp.datadir`)."""
    path = Path(datadir.expand(str(data_path), "the data path"))
    if not path.exists():
        raise FileNotFoundError(f"data path {path} does not exist")
    if path.is_file():
        if not path.name.endswith(ARCHIVE_SUFFIXES):
            raise ValueError(f"{path} is a file but not a {'/'.join(ARCHIVE_SUFFIXES)} archive")
        path = extract_archive(path, Path(cache_dir) if cache_dir else None)
    return find_imagefolder_root(path)
