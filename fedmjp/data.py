"""Attack image sets: the embedded default (scikit-image's bundled images) and image folders.

Images are preprocessed like ImageNet validation: resize the short side to ``size / 0.875`` (256 for
224) and centre-crop ``size``; greyscale, palette and RGBA images are converted to RGB. Values are in
[0, 1]; normalisation is the model's business.

Labels: for a flat folder, image ``i`` of the sorted file list gets class ``i % num_classes`` (for the
ImageNet sample, one image per class named ``n<wnid>_<name>.JPEG``, that is its ImageNet index). A
folder of class sub-folders (ImageFolder layout) gives each image its sub-folder's sorted index, and
images are taken round-robin across classes so that a few images cover many classes. A dataset
archive (``.tar.gz``, e.g. ``$FEDMJP_DATA/cifar10.tar.gz``) is extracted once to the cache
(:func:`fedmjp.archives.resolve_data_path`) and its ``val/`` split is used. A source that starts
with ``$FEDMJP_DATA`` is read from the data folder (:mod:`fedmjp.datadir`).
"""
from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Optional, Sequence

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError
from torchvision.transforms import functional as TF
from torchvision.transforms import InterpolationMode

from . import datadir
from .archives import ARCHIVE_SUFFIXES, ArchiveError, resolve_data_path
from .text import printable

_logger = logging.getLogger(__name__)

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".ppm", ".pgm")
#: Pillow formats an image file may be decoded as, whatever its name says: the decoders of the
#: extensions above, all in-process. Anything else (PostScript/EPS, which Pillow hands to the
#: Ghostscript program, PDF, ICNS, ...) is a corrupt image, never reaches its plug-in.
IMAGE_FORMATS = ("PNG", "JPEG", "BMP", "TIFF", "WEBP", "PPM", "GIF")


def open_image(fp: "str | Path | BinaryIO") -> Image.Image:
    """``PIL.Image.open`` limited to :data:`IMAGE_FORMATS` (``UnidentifiedImageError`` otherwise):
    every image file fedmjp reads goes through here."""
    return Image.open(fp, formats=IMAGE_FORMATS)


def rgb_loader(path: str) -> Image.Image:
    """An RGB image for torchvision's ``ImageFolder(loader=...)`` (its default loader opens any format)."""
    with open_image(path) as img:
        check_pixels(*img.size)
        return img.convert("RGB")

# scikit-image images that ship inside its wheel (no pooch download). Colour first, then greyscale
# ones (converted to RGB), so small --num-images values stay natural colour photographs.
EMBEDDED_IMAGES = (
    "astronaut", "chelsea", "coffee", "rocket", "hubble_deep_field", "immunohistochemistry",
    "retina", "colorwheel", "camera", "moon", "coins", "brick", "grass", "gravel", "clock", "cell",
    "page", "text", "microaneurysms",
)


class DataError(ValueError):
    """Unusable input data (missing/empty folder, corrupt image with on_corrupt='fail')."""


@dataclass
class ImageSet:
    """A batch of attack images.

    Attributes:
        images: [N, 3, H, W] float32 in [0, 1].
        labels: [N] long.
        names: image ids (file names or embedded names), length N.
        skipped: (file, reason) for every file that was not used.
    """

    images: torch.Tensor
    labels: torch.Tensor
    names: list[str]
    skipped: list[tuple[str, str]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.names)

    def subset(self, index: Sequence[int]) -> "ImageSet":
        idx = torch.as_tensor(list(index), dtype=torch.long)
        return ImageSet(self.images[idx], self.labels[idx], [self.names[i] for i in idx.tolist()], self.skipped)


#: Largest image held, in pixels (8192 x 8192, 256 MB as 32-bit RGBA), both as decoded and as
#: resized by :func:`preprocess`: a file whose header claims more (a "decompression bomb": a few kB
#: that would decode to gigabytes), or whose aspect ratio makes the short-side resize larger (a
#: 300000 x 1 strip resized to a short side of 256 is 256 x 76.8M), is a corrupt file, skipped or
#: refused by ``on_corrupt``, before any pixel is decoded. Pillow's own guard
#: (``Image.MAX_IMAGE_PIXELS``) only warns below twice its 89 MP default.
MAX_IMAGE_PIXELS = 8192 * 8192


def resize_target(size: int) -> int:
    """The short side :func:`preprocess` resizes to before its centre crop of ``size``."""
    return int(round(size / 0.875))


def resized_shape(width: int, height: int, size: int) -> tuple[int, int]:
    """(width, height) of a ``width`` x ``height`` image after :func:`preprocess`'s resize (the
    short side to :func:`resize_target`, the aspect ratio kept: torchvision's rule)."""
    short, long = sorted((width, height))
    target = resize_target(size)
    new_long = int(target * long / short) if short else 0
    return (target, new_long) if width <= height else (new_long, target)


def check_pixels(width: int, height: int, size: Optional[int] = None) -> None:
    """Raise ``ValueError`` when a ``width`` x ``height`` image is over :data:`MAX_IMAGE_PIXELS` as
    decoded or, with ``size``, as :func:`preprocess` resizes it for ``size`` px: checked on the
    header, before any pixel is decoded or allocated."""
    if width * height > MAX_IMAGE_PIXELS:
        raise ValueError(f"{width}x{height} pixels is more than the {MAX_IMAGE_PIXELS} this loader decodes "
                         "(fedmjp.data.MAX_IMAGE_PIXELS)")
    if size is not None:
        w, h = resized_shape(width, height, size)
        if w * h > MAX_IMAGE_PIXELS:
            raise ValueError(f"{width}x{height} pixels would be resized to {w}x{h} for {size} px (its aspect "
                             f"ratio kept), more than the {MAX_IMAGE_PIXELS} this loader holds "
                             "(fedmjp.data.MAX_IMAGE_PIXELS)")


def _scaled_to_8bit(img: Image.Image) -> Image.Image:
    """A high-bit-depth greyscale image (``I;16*``, ``I``, ``F``) as 8-bit ``L``, scaled over its
    range instead of clipped (Pillow's ``convert("RGB")`` clips ``I;16`` at 255: 16-bit photographs
    would turn white). ``I;16``: 0..65535. ``I`` and ``F``: 0..255 when the values fit there (8-bit
    data in a wide container), 0..65535 for ``I`` values that fit 16 bits, 0..1 for ``F`` values that
    fit it, else the image's own min..max; non-finite values become 0."""
    arr = np.asarray(img).astype(np.float64)
    arr[~np.isfinite(arr)] = 0.0
    lo, hi = (float(arr.min()), float(arr.max())) if arr.size else (0.0, 0.0)
    if img.mode.startswith("I;16"):
        scaled = arr / 65535.0
    elif lo >= 0.0 and hi <= 1.0 and img.mode == "F":
        scaled = arr
    elif lo >= 0.0 and hi <= 255.0:
        scaled = arr / 255.0
    elif lo >= 0.0 and hi <= 65535.0 and img.mode == "I":
        scaled = arr / 65535.0
    else:
        scaled = (arr - lo) / (hi - lo) if hi > lo else np.zeros_like(arr)
    return Image.fromarray(np.round(np.clip(scaled, 0.0, 1.0) * 255.0).astype(np.uint8), "L")


def preprocess(img: Image.Image, size: int) -> torch.Tensor:
    """PIL image (any mode) -> [3, size, size] float32 in [0, 1], ImageNet-val style.

    16-bit and float greyscale are scaled to 8 bits (:func:`_scaled_to_8bit`), images with an alpha
    channel (or a palette's transparency) are composited on white, CMYK/YCbCr/LAB/HSV/1-bit are
    converted to RGB by Pillow.

    Raises:
        ValueError: the image, or its resized form, is over :data:`MAX_IMAGE_PIXELS` (:func:`check_pixels`).
    """
    check_pixels(*img.size, size)
    if img.mode in ("I", "F") or img.mode.startswith("I;16"):
        img = _scaled_to_8bit(img)
    if img.mode in ("La", "PA"):
        img = img.convert("LA")  # premultiplied / palette + alpha: Pillow converts these to LA only
    if img.mode in ("RGBA", "LA", "P", "RGBa") or "transparency" in img.info:
        img = img.convert("RGBA")
        background = Image.new("RGBA", img.size, (255, 255, 255, 255))
        img = Image.alpha_composite(background, img)
    img = img.convert("RGB")
    resize = resize_target(size)
    img = TF.resize(img, resize, interpolation=InterpolationMode.BICUBIC, antialias=True)
    img = TF.center_crop(img, [size, size])
    return TF.to_tensor(img).clamp_(0.0, 1.0)


def load_embedded(size: int, num_images: Optional[int] = None, num_classes: int = 1000) -> ImageSet:
    """scikit-image's bundled natural images (no download)."""
    import skimage.data

    names = list(EMBEDDED_IMAGES[:num_images] if num_images else EMBEDDED_IMAGES)
    if num_images and num_images > len(EMBEDDED_IMAGES):
        _logger.warning("only %d embedded images exist; using all of them", len(EMBEDDED_IMAGES))
    tensors = []
    for name in names:
        arr = np.asarray(getattr(skimage.data, name)())
        if arr.dtype == bool:
            arr = arr.astype(np.uint8) * 255
        tensors.append(preprocess(Image.fromarray(arr), size))
    labels = torch.arange(len(names)) % num_classes
    return ImageSet(torch.stack(tensors), labels, names)


def _is_image(path: Path) -> bool:
    return path.is_file() and path.suffix.lower() in IMAGE_EXTENSIONS


def list_class_files(folder: Path) -> Optional[list[tuple[Path, int]]]:
    """ImageFolder layout: (file, class index) round-robin over sorted class folders; None if flat."""
    entries = [p for p in sorted(folder.iterdir()) if not p.name.startswith(".")]
    classes = [p for p in entries if p.is_dir()]
    if not classes or any(_is_image(p) for p in entries):
        return None
    per_class = [[f for f in sorted(c.iterdir()) if _is_image(f)] for c in classes]
    out: list[tuple[Path, int]] = []
    for depth in range(max((len(f) for f in per_class), default=0)):
        out.extend((files[depth], label) for label, files in enumerate(per_class) if depth < len(files))
    return out


def list_image_files(folder: Path) -> tuple[list[Path], list[tuple[str, str]]]:
    """Sorted image files of a folder (not recursive) and the skipped non-image entries."""
    files, skipped = [], []
    for path in sorted(folder.iterdir()):
        if path.name.startswith("."):
            continue
        if _is_image(path):
            files.append(path)
        else:
            skipped.append((str(path), "not an image file" if path.is_file() else "not a file"))
    return files, skipped


def load_folder(
    folder: str | Path,
    size: int,
    num_images: Optional[int] = None,
    num_classes: int = 1000,
    on_corrupt: str = "skip",
) -> ImageSet:
    """Load the first ``num_images`` readable images of a folder (sorted by name).

    Args:
        on_corrupt: ``skip`` (log and list the file) or ``fail`` (raise :class:`DataError` naming it).
    Raises:
        DataError: missing or empty folder, no readable image, or a corrupt one with ``fail``.
    """
    if on_corrupt not in ("skip", "fail"):
        raise ValueError(f"on_corrupt must be 'skip' or 'fail', got {on_corrupt!r}")
    folder = Path(folder)
    if not folder.is_dir():
        raise DataError(f"image folder {printable(folder)} does not exist or is not a folder; pass --images DIR "
                        "with image files, or leave it out for the embedded default")
    by_class = list_class_files(folder)
    if by_class is not None:
        files, skipped = [f for f, _ in by_class], []
        file_labels = [label for _, label in by_class]
    else:
        files, skipped = list_image_files(folder)
        file_labels = list(range(len(files)))
    if not files:
        raise DataError(f"image folder {printable(folder)} holds no image files ({', '.join(IMAGE_EXTENSIONS)})")
    if skipped:
        _logger.warning("skipped %d non-image entries in %s: %s", len(skipped), printable(folder),
                        ", ".join(printable(Path(s).name) for s, _ in skipped[:10]))
    tensors, labels, names = [], [], []
    for path, file_label in zip(files, file_labels):
        if num_images is not None and len(names) >= num_images:
            break
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", Image.DecompressionBombWarning)
                with open_image(path) as img:
                    check_pixels(*img.size, size)  # on the header, before decoding or resizing
                    img.load()
                    tensors.append(preprocess(img, size))
        except (UnidentifiedImageError, Image.DecompressionBombError, OSError, SyntaxError, ValueError,
                MemoryError) as err:
            if on_corrupt == "fail":
                raise DataError(f"corrupt image {printable(path)}: {printable(err)} (use --on-corrupt skip to "
                                "skip it)") from err
            _logger.warning("skipping corrupt image %s: %s", printable(path), printable(err))
            skipped.append((str(path), f"corrupt: {err}"))
            continue
        labels.append(file_label % num_classes)
        names.append(path.name if by_class is None else f"{path.parent.name}/{path.name}")
    if not names:
        raise DataError(f"no readable image in {printable(folder)}; skipped: "
                        + "; ".join(f"{printable(Path(s).name)} ({printable(r)})" for s, r in skipped[:10]))
    return ImageSet(torch.stack(tensors), torch.tensor(labels, dtype=torch.long), names, skipped)


def load_images(
    source: Optional[str | Path],
    size: int,
    num_images: Optional[int] = None,
    num_classes: int = 1000,
    on_corrupt: str = "skip",
) -> ImageSet:
    """``source`` None or ``"embedded"``: the bundled images; else an image folder."""
    if num_images is not None and num_images < 1:
        raise ValueError(f"num_images must be >= 1, got {num_images}")
    if size < 1:
        raise ValueError(f"image size must be >= 1, got {size}")
    if source is None or str(source) == "embedded":
        return load_embedded(size, num_images, num_classes)
    try:
        source = datadir.expand(str(source), "the image source")
    except datadir.DataDirUnset as err:
        raise DataError(str(err)) from None
    if Path(source).is_file():
        if not str(source).endswith(ARCHIVE_SUFFIXES):
            raise DataError(f"{printable(source)} is a file, not an image folder or a {'/'.join(ARCHIVE_SUFFIXES)} dataset archive")
        try:
            root = resolve_data_path(source)
        except ArchiveError as err:
            raise DataError(str(err)) from None
        except OSError as err:  # the cache folder cannot be read or written
            raise DataError(f"cannot use dataset archive {printable(source)}: {printable(err)}; set FEDMJP_CACHE to a writable "
                            "folder") from None
        source = root / "val" if (root / "val").is_dir() else root / "train"
    return load_folder(source, size, num_images, num_classes, on_corrupt)
