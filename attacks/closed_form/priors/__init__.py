"""Learned image priors for the closed-form attacks: a Gaussian over p x p x 3 image patches.

The prior is N(mean, cov) over every p x p patch of an image in [0, 1] pixel space, the patch
flattened in (channel, row, column) order (the order of ``Conv2d.weight.reshape(D, -1)`` and of
``torch.nn.functional.unfold``). Its statistics are estimated from a training set's images at every
offset (stride 1) and stored as a small ``.npz`` beside a ``.json`` note of how it was made; only
the statistics are stored, no image data.

    prior = load_patch_prior()               # the shipped CIFAR-10 prior (p = 4, 32 px images)
    prior.precision                          # [3 p^2, 3 p^2] inverse covariance

Builder (needs scikit-learn, the ``analysis`` extra, for the Ledoit-Wolf shrinkage)::

    python -m attacks.closed_form.priors --data-path $FEDMJP_DATA/cifar10.tar.gz --patch 4 \\
        --out attacks/closed_form/priors/cifar10_patch4.npz
"""
from __future__ import annotations

import hashlib
import io
import json
import tarfile
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Iterator
from typing import Optional

import numpy as np

#: The prior shipped with the package: CIFAR-10 train, 4 x 4 patches, 32 px images.
DEFAULT_PRIOR = Path(__file__).resolve().parent / "cifar10_patch4.npz"
_IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp")


class PriorError(ValueError):
    """A prior file that cannot be used (missing, malformed) or a builder input that cannot be read."""


@dataclass(frozen=True)
class PatchPrior:
    """A Gaussian over p x p x C patches in [0, 1] pixel space.

    Attributes:
        patch: p.
        channels: C.
        image_size: side of the training images the statistics come from (the scale they describe).
        mean: [C p^2] mean patch.
        cov: [C p^2, C p^2] covariance (shrunk, positive definite).
        source: what it was estimated from (the note's ``data`` entry).
        path: the file it was read from, or None.
    """

    patch: int
    channels: int
    image_size: int
    mean: np.ndarray
    cov: np.ndarray
    source: str = ""
    path: Optional[Path] = None

    @property
    def dim(self) -> int:
        return self.channels * self.patch * self.patch

    @property
    def precision(self) -> np.ndarray:
        """The inverse covariance, symmetrised."""
        prec = np.linalg.inv(self.cov)
        return (prec + prec.T) / 2


def load_patch_prior(path: Optional[str | Path] = None) -> PatchPrior:
    """Read a prior file written by :func:`save_patch_prior` (default: the shipped CIFAR-10 one).

    Raises:
        PriorError: the file is missing or lacks or mis-shapes an entry.
    """
    path = Path(path) if path is not None else DEFAULT_PRIOR
    if not path.is_file():
        raise PriorError(f"patch prior file {path} not found; build one with `python -m attacks.closed_form.priors "
                         "--data-path <images> --patch <p> --out <file.npz>`")
    try:
        with np.load(path, allow_pickle=False) as z:
            patch, channels, size = int(z["patch"]), int(z["channels"]), int(z["image_size"])
            mean, cov = z["mean"].astype(np.float64), z["cov"].astype(np.float64)
            source = str(z["source"]) if "source" in z else ""
    except (KeyError, ValueError, OSError) as err:
        raise PriorError(f"patch prior file {path} is not a prior written by attacks.closed_form.priors: {err}") from None
    dim = channels * patch * patch
    if mean.shape != (dim,) or cov.shape != (dim, dim):
        raise PriorError(f"patch prior file {path}: mean {mean.shape} / cov {cov.shape} do not match "
                         f"patch {patch} x {patch} x {channels} ({dim} values)")
    if not np.all(np.linalg.eigvalsh((cov + cov.T) / 2) > 0):
        raise PriorError(f"patch prior file {path}: the covariance is not positive definite")
    return PatchPrior(patch, channels, size, mean, cov, source, path)


def save_patch_prior(prior: PatchPrior, out: str | Path, note: dict) -> Path:
    """Write ``out`` (.npz: mean, cov, patch, channels, image_size, source) and
    ``out`` with suffix .json (``note``)."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(out, mean=prior.mean, cov=prior.cov,
                        patch=np.int64(prior.patch), channels=np.int64(prior.channels),
                        image_size=np.int64(prior.image_size), source=np.str_(prior.source))
    out.with_suffix(".json").write_text(json.dumps(note, indent=2, sort_keys=True) + "\n")
    return out


def sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def iter_train_images(data_path: Path, split: str = "train") -> Iterator[np.ndarray]:
    """[H, W, 3] uint8 RGB arrays of the ``split`` images of an ImageFolder (a folder with
    ``<split>/<class>/*.jpg``) or of a .tar/.tar.gz of one, read in sorted name order (an archive
    is streamed, nothing is extracted)."""
    from fedmjp.data import open_image

    def decode(raw) -> np.ndarray:
        with open_image(raw) as img:
            return np.asarray(img.convert("RGB"))

    if data_path.is_dir():
        root = data_path if (data_path / split).is_dir() else next(
            (p for p in data_path.iterdir() if (p / split).is_dir()), None)
        if root is None:
            raise PriorError(f"{data_path} has no {split}/ folder (an ImageFolder with {split}/<class>/ images)")
        files = sorted(p for p in (root / split).rglob("*") if p.suffix.lower() in _IMAGE_SUFFIXES)
        for f in files:
            yield decode(f)
        return
    if not tarfile.is_tarfile(data_path):
        raise PriorError(f"{data_path} is neither a folder nor a tar archive of an ImageFolder")
    found = False
    with tarfile.open(data_path, "r:*") as tar:
        for m in tar:  # streamed in archive order; the statistics do not depend on the order
            parts = Path(m.name).parts
            if m.isfile() and split in parts[:-1] and Path(m.name).suffix.lower() in _IMAGE_SUFFIXES:
                found = True
                yield decode(io.BytesIO(tar.extractfile(m).read()))
    if not found:
        raise PriorError(f"{data_path} holds no {split}/ images")
