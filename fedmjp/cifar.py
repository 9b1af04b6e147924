"""CIFAR-10 in torchvision's download format (``cifar-10-python.tar.gz``, or its extracted
``cifar-10-batches-py/`` folder), read without running any code from it.

torchvision's archive holds pickled batches: ``data_batch_1`` ... ``data_batch_5`` (training, 10,000
images each), ``test_batch`` (10,000) and ``batches.meta`` (the class names), each a dict whose
``data`` is a uint8 array [N, 3072] (the red, green, blue 32x32 planes of each image) and whose
``labels`` are class indices. A pickle can name any Python callable, so the batches are read by an
unpickler that rebuilds numpy arrays and nothing else; sizes are checked before anything is read.
:func:`write_imagefolder_archive` turns them into the ImageFolder archive the presets read
(``cifar10/train/<class>/*.png``, ``cifar10/val/<class>/*.png``; PNG, so the pixels are exactly
torchvision's). ``python -m fedmjp.prepare_data`` is the command around it.
"""
from __future__ import annotations

import codecs
import io
import os
import pickle
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Callable, Iterator, Optional

import numpy as np
from PIL import Image

#: The batches a CIFAR-10 download holds, by split.
TRAIN_BATCHES = tuple(f"data_batch_{i}" for i in range(1, 6))
TEST_BATCH = "test_batch"
META = "batches.meta"
FOLDER = "cifar-10-batches-py"
#: Upper bounds checked before reading: torchvision's archive is 170 MB, a batch 31 MB, the meta 158 B.
ARCHIVE_MAX_BYTES = 256 << 20
BATCH_MAX_BYTES = 40 << 20
META_MAX_BYTES = 1 << 20
#: The ten class names, used where the archive's batches.meta lacks them.
CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
SIDE = 32


class CifarError(ValueError):
    """Not a usable CIFAR-10 download: a missing or oversized batch, a pickle naming anything but
    numpy arrays, or arrays of another shape."""


#: numpy's array-rebuilding function, taken from an array's own pickle recipe (its module is
#: numpy.core.multiarray before numpy 2 and numpy._core.multiarray after).
_RECONSTRUCT = np.ndarray(0).__reduce__()[0]


class _ArraysOnly(pickle.Unpickler):
    """Rebuilds numpy arrays and plain containers; refuses every other global a pickle names."""

    #: numpy's array rebuilding, and ``_codecs.encode``: how Python 3 writes a bytes object (an
    #: array's buffer) at protocol 2, where torchvision's Python 2 batches use a plain string.
    ALLOWED = {("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
               ("numpy", "ndarray"), ("numpy", "dtype"), ("_codecs", "encode")}

    def find_class(self, module: str, name: str):  # noqa: ANN201 (pickle's signature)
        if (module, name) not in self.ALLOWED:
            raise pickle.UnpicklingError(f"refused global {module}.{name} (a CIFAR batch holds numpy arrays only)")
        if module == "_codecs":
            return codecs.encode
        return _RECONSTRUCT if name == "_reconstruct" else getattr(np, name)


def _load(handle: BinaryIO, limit: int, what: str) -> dict:
    data = handle.read(limit + 1)
    if len(data) > limit:
        raise CifarError(f"{what} is larger than {limit} bytes; not a CIFAR-10 batch")
    try:
        # torchvision's batches are Python 2 pickles: latin1 reads their byte strings as str
        obj = _ArraysOnly(io.BytesIO(data), encoding="latin1").load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError, KeyError) as err:
        raise CifarError(f"{what} is not a CIFAR-10 batch ({err})") from None
    if not isinstance(obj, dict):
        raise CifarError(f"{what} is not a CIFAR-10 batch (a {type(obj).__name__}, not a dict)")
    return obj


@dataclass
class Split:
    """One split's images [N, 32, 32, 3] uint8 (HWC, RGB) and labels [N]."""

    images: np.ndarray
    labels: np.ndarray


def _split(batches: list[dict], names: list[str], classes: int) -> Split:
    images, labels = [], []
    for batch, name in zip(batches, names):
        data, lab = batch.get("data"), batch.get("labels")
        if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3 * SIDE * SIDE:
            raise CifarError(f"{name}: 'data' is not a uint8 array [N, 3072]")
        lab = np.asarray(lab if lab is not None else [], dtype=np.int64)
        if lab.shape != (data.shape[0],) or (lab.size and (lab.min() < 0 or lab.max() >= classes)):
            raise CifarError(f"{name}: 'labels' is not one class index in 0..{classes - 1} per image")
        images.append(data.reshape(-1, 3, SIDE, SIDE).transpose(0, 2, 3, 1))
        labels.append(lab)
    return Split(np.concatenate(images), np.concatenate(labels))


def _opener(source: Path) -> tuple[Callable[[str, int], dict], Optional[tarfile.TarFile]]:
    """A function reading one batch by name from ``source`` (archive or folder), and the open archive."""
    if source.is_dir():
        folder = source / FOLDER if (source / FOLDER).is_dir() else source

        def read_file(name: str, limit: int) -> dict:
            path = folder / name
            if not path.is_file():
                raise CifarError(f"{path} is missing; pass torchvision's {FOLDER} folder or cifar-10-python.tar.gz")
            if path.stat().st_size > limit:
                raise CifarError(f"{path} is {path.stat().st_size} bytes, more than a CIFAR-10 batch ({limit})")
            with open(path, "rb") as handle:
                return _load(handle, limit, str(path))

        return read_file, None
    size = source.stat().st_size
    if size > ARCHIVE_MAX_BYTES:
        raise CifarError(f"{source} is {size} bytes, more than torchvision's CIFAR-10 archive ({ARCHIVE_MAX_BYTES})")
    try:
        tar = tarfile.open(source, "r:*")
    except (tarfile.TarError, OSError, EOFError) as err:
        raise CifarError(f"{source} is not a readable tar archive ({err}); pass cifar-10-python.tar.gz") from None
    members = {m.name.replace("\\", "/").split("/")[-1]: m for m in tar.getmembers() if m.isfile()}

    def read_member(name: str, limit: int) -> dict:
        member = members.get(name)
        if member is None:
            raise CifarError(f"{source} holds no {name}; pass torchvision's cifar-10-python.tar.gz")
        if member.size > limit:
            raise CifarError(f"{source}: {member.name} is {member.size} bytes, more than a CIFAR-10 batch ({limit})")
        handle = tar.extractfile(member)
        assert handle is not None  # a regular file member
        return _load(handle, limit, f"{source}:{member.name}")

    return read_member, tar


def read_cifar10(source: str | os.PathLike[str]) -> tuple[dict[str, Split], list[str]]:
    """``{"train": ..., "val": ...}`` (val is torchvision's test_batch) and the class names.

    Raises:
        CifarError: the source is not a CIFAR-10 download in torchvision's format.
        FileNotFoundError: ``source`` does not exist.
    """
    source = Path(source)
    if not source.exists():
        raise FileNotFoundError(f"{source} does not exist; pass cifar-10-python.tar.gz or its {FOLDER} folder")
    read, tar = _opener(source)
    try:
        meta = read(META, META_MAX_BYTES)
        names = [str(n) for n in meta.get("label_names", CLASSES)]
        if len(names) != len(CLASSES) or len(set(names)) != len(names) or not all(
                n and n.replace("_", "").isalnum() for n in names):
            raise CifarError(f"{META}: label_names {names[:12]!r} are not ten distinct plain names")
        train = _split([read(n, BATCH_MAX_BYTES) for n in TRAIN_BATCHES], list(TRAIN_BATCHES), len(names))
        val = _split([read(TEST_BATCH, BATCH_MAX_BYTES)], [TEST_BATCH], len(names))
    finally:
        if tar is not None:
            tar.close()
    return {"train": train, "val": val}, names


def _png_members(splits: dict[str, Split], classes: list[str], root: str) -> Iterator[tuple[str, bytes]]:
    for split, part in splits.items():
        for index, (image, label) in enumerate(zip(part.images, part.labels)):
            buffer = io.BytesIO()
            Image.fromarray(np.ascontiguousarray(image), "RGB").save(buffer, format="PNG")
            yield f"{root}/{split}/{classes[int(label)]}/{index:05d}.png", buffer.getvalue()


def write_imagefolder_archive(splits: dict[str, Split], classes: list[str], dest: Path, root: str = "cifar10") -> Path:
    """Write ``dest`` (a .tar.gz of ``<root>/{train,val}/<class>/NNNNN.png``), whole or not at all:
    it is written beside ``dest`` and renamed into place when complete."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(f".{dest.name}.{os.getpid()}.part")
    try:
        with tarfile.open(part, "w:gz", compresslevel=6) as tar:
            for name, data in _png_members(splits, classes, root):
                info = tarfile.TarInfo(name)
                info.size, info.mode = len(data), 0o644
                tar.addfile(info, io.BytesIO(data))
        os.replace(part, dest)
    finally:
        part.unlink(missing_ok=True)
    return dest
