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
from typing import Iterator, Optional

from . import datadir
from .text import printable

_logger = logging.getLogger(__name__)

ARCHIVE_SUFFIXES = (".tar.gz", ".tgz", ".tar")
_MARKER = ".fedmjp_extracted"

#: Bytes an archive may extract to, per byte of the archive file: image data (JPEG, PNG) does not
#: compress, so a dataset archive extracts to about its own size; a few kB of gzip can stand for
#: gigabytes of zeros. Every member counts its data and :data:`MEMBER_COST` bytes.
MAX_EXPANSION = 20
#: Bytes any archive may extract to, however small it is (tiny test archives compress well).
MIN_EXTRACT_BYTES = 64 << 20
#: The environment variable that replaces the bound above by a number of gigabytes (10**9 bytes),
#: for a trusted archive that needs more.
LIMIT_ENV = "FEDMJP_ARCHIVE_LIMIT_GB"
#: Bytes one member may hold: one image of a data set, far above any photograph.
MAX_MEMBER_BYTES = 1 << 30
#: Members one archive may hold (ImageNet-1k's train and val splits are 1.33 million files).
MAX_MEMBERS = 5_000_000
#: What each member costs besides its data: its 512-byte tar header, and a file or folder (an
#: inode) on disk; millions of empty members compress to almost nothing.
MEMBER_COST = 512


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


def extract_limit(archive_bytes: int) -> tuple[int, str]:
    """(bytes, how the message names them) an archive of ``archive_bytes`` may extract to:
    ``$FEDMJP_ARCHIVE_LIMIT_GB`` when set, else :data:`MAX_EXPANSION` times its size, at least
    :data:`MIN_EXTRACT_BYTES`.

    Raises:
        ArchiveError: ``$FEDMJP_ARCHIVE_LIMIT_GB`` is not a number > 0.
    """
    raw = os.environ.get(LIMIT_ENV, "").strip()
    if raw:
        try:
            gb = float(raw)
        except ValueError:
            gb = float("nan")
        if not gb > 0 or gb == float("inf"):
            raise ArchiveError(f"{LIMIT_ENV}={printable(raw)} is not a number of gigabytes > 0; set it to the size "
                               "a trusted archive extracts to (e.g. 200 for ImageNet), or unset it")
        return int(gb * 1e9), f"{LIMIT_ENV}={printable(raw)}"
    limit = max(MAX_EXPANSION * archive_bytes, MIN_EXTRACT_BYTES)
    return limit, (f"{MAX_EXPANSION} times the archive's {archive_bytes:,} bytes, at least {MIN_EXTRACT_BYTES:,}; "
                   f"if the archive is trusted, set {LIMIT_ENV} to the gigabytes it extracts to")


def _bounded_members(tar: tarfile.TarFile, archive: Path, limit: tuple[int, str],
                     free: Optional[int]) -> Iterator[tarfile.TarInfo]:
    """The members of ``tar`` as their headers are read from the stream, each checked before its
    data is written: at most :data:`MAX_MEMBERS` members and :data:`MAX_MEMBER_BYTES` per member,
    and all together (data and :data:`MEMBER_COST` per member) within ``limit`` and the ``free``
    bytes of the cache's disk. tarfile writes exactly a member's header size for a regular file;
    sparse members (whose holes would make more) are refused, and a hard link counts its target's
    size (where a link cannot be made, tarfile writes a copy)."""
    total, count, sizes = 0, 0, {}
    where = f"dataset archive {printable(archive)}"
    for member in tar:
        count += 1
        if count > MAX_MEMBERS:
            raise ArchiveError(f"{where} holds more than {MAX_MEMBERS:,} members (fedmjp.archives.MAX_MEMBERS); "
                               "refused, nothing of it is kept")
        if member.issparse():
            raise ArchiveError(f"{where} holds a sparse member {printable(member.name)}; refused, nothing of it is "
                               "kept (pack the data set without --sparse)")
        size = sizes.get(member.linkname, 0) if member.islnk() else member.size
        sizes[member.name] = size
        if size > MAX_MEMBER_BYTES:
            raise ArchiveError(f"{where}: member {printable(member.name)} holds {size:,} bytes, more than the "
                               f"{MAX_MEMBER_BYTES:,} of one member (fedmjp.archives.MAX_MEMBER_BYTES); refused, "
                               "nothing of it is kept")
        total += size + MEMBER_COST
        if total > limit[0]:
            raise ArchiveError(f"{where} extracts to more than {limit[0]:,} bytes ({limit[1]}); refused at member "
                               f"{printable(member.name)}, nothing of it is kept")
        if free is not None and total > free:
            raise ArchiveError(f"{where} extracts to more than the {free:,} bytes free on the disk of the dataset "
                               f"cache; refused at member {printable(member.name)}, nothing of it is kept; free space "
                               "or set FEDMJP_CACHE to a folder on a larger disk")
        yield member


def extract_archive(archive: Path, cache_dir: Optional[Path] = None) -> Path:
    """Extract ``archive`` once under ``cache_dir`` and return the extraction folder.

    The folder name carries a hash of the archive's path, size and mtime, so a changed archive gets a
    fresh folder. Extraction goes to a temporary sibling that is renamed into place once it holds a
    ``train/`` folder, and a marker file is written last: an interrupted extraction is never mistaken
    for a finished one, and a failed one leaves nothing behind. Members are filtered
    (:func:`_member_filter`): an archive with an unsafe member is refused as a whole, and so is one
    over the size bounds (:func:`_bounded_members`, :func:`extract_limit`), checked on each member's
    header before its data is written.

    Raises:
        ArchiveError: an unsafe member, over a size bound, not a tar archive, no ``train/`` folder,
            or the cache folder cannot be created.
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
        raise ArchiveError(f"cannot create the dataset cache folder {printable(root.parent)} ({err.strerror or err}); set "
                           "FEDMJP_CACHE to a writable folder") from err
    tmp = root.parent / f".{root.name}.tmp{os.getpid()}"
    limit = extract_limit(st.st_size)
    try:
        free: Optional[int] = shutil.disk_usage(root.parent).free
    except OSError:
        free = None
    _logger.info("extracting %s to %s (once)", printable(archive), printable(root))
    try:
        try:
            with tarfile.open(archive) as tar:
                tar.extractall(tmp, members=_bounded_members(tar, archive, limit, free), filter=_member_filter)
        except tarfile.FilterError as err:
            raise ArchiveError(f"dataset archive {printable(archive)} holds an unsafe member ({printable(err)}); "
                               "refused, nothing of it is kept") from err
        except (tarfile.TarError, EOFError, zlib.error, lzma.LZMAError, OSError) as err:
            raise ArchiveError(f"{printable(archive)} is not a readable tar archive "
                               f"({printable(' '.join(str(err).split())[:200])}); "
                               f"pass a {'/'.join(ARCHIVE_SUFFIXES)} of a folder with train/ and val/") from err
        try:
            find_imagefolder_root(tmp)
        except (FileNotFoundError, OSError) as err:
            raise ArchiveError(f"dataset archive {printable(archive)} holds no train/ folder (nor one folder with train/ "
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
        raise FileNotFoundError(f"data path {printable(path)} does not exist")
    if path.is_file():
        if not path.name.endswith(ARCHIVE_SUFFIXES):
            raise ValueError(f"{printable(path)} is a file but not a {'/'.join(ARCHIVE_SUFFIXES)} archive")
        path = extract_archive(path, Path(cache_dir) if cache_dir else None)
    return find_imagefolder_root(path)
