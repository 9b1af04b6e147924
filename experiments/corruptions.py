"""Common corruptions (ImageNet-C) of an evaluation set: seeded per image, cached on disk as uint8.

The 15 standard corruptions at severities 1-5 come from the ``imagecorruptions`` package (the
``imagecorruptions-imaug`` distribution, ``pip install fedmjp[analysis]``), which implements
Hendrycks & Dietterich's ImageNet-C with its parameters for 224 px ImageNet images. Applied to
32 px CIFAR images the same parameters are relatively much stronger (a defocus disk of radius 10 px,
the frost and snow textures at ImageNet scale); the results are ImageNet-C's corruptions on
CIFAR-10, not CIFAR-10-C, whose parameters were re-tuned for 32 px.

Randomness: each (image, corruption, severity) gets its own seed from
``numpy.random.SeedSequence([seed, image index, corruption index, severity])``; it seeds the
global NumPy generator that most corruptions draw from (restored afterwards) and is passed as
``seed=`` to the two that take one (``impulse_noise``, ``glass_blur``), so a corrupted image does
not depend on which other images, corruptions or severities were computed, nor in which order.

Cache: ``<FEDMJP_CACHE>/corruptions/<key>/<corruption>-s<severity>-seed<seed>.npy`` holds the
[N, H, W, 3] uint8 corrupted images of one set; ``<key>`` hashes the images' bytes with their
indices (so another data set or subset gets another folder) and the ``imagecorruptions`` version.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Sequence
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from fedmjp.archives import default_cache_dir

_logger = logging.getLogger(__name__)

#: The severities of ImageNet-C.
SEVERITIES = (1, 2, 3, 4, 5)


def _package():
    try:
        import imagecorruptions
    except ImportError as err:  # the 'analysis' extra
        raise ImportError("the common corruptions need the imagecorruptions package: "
                          "pip install 'fedmjp[analysis]' (or imagecorruptions-imaug)") from err
    return imagecorruptions


def corruption_names() -> list[str]:
    """The 15 standard ImageNet-C corruptions, in the package's order (noise, blur, weather, digital)."""
    return list(_package().get_corruption_names("common"))


def package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("imagecorruptions-imaug")
    except PackageNotFoundError:
        return getattr(_package(), "__version__", "unknown")


def check_corruptions(names: Sequence[str], severities: Sequence[int]) -> None:
    """Raise ValueError naming the first unknown corruption or severity outside 1-5."""
    known = corruption_names()
    for name in names:
        if name not in known:
            raise ValueError(f"unknown corruption {name!r}; choose from {', '.join(known)}")
    for s in severities:
        if s not in SEVERITIES:
            raise ValueError(f"severity {s!r} is not one of ImageNet-C's 1-5")


def image_seed(seed: int, index: int, corruption: str, severity: int) -> int:
    """The 32-bit seed of one image's corruption at one severity."""
    c = corruption_names().index(corruption)
    return int(np.random.SeedSequence([seed, index, c, severity]).generate_state(1)[0])


@contextmanager
def _numpy_global_state():
    state = np.random.get_state()
    try:
        yield
    finally:
        np.random.set_state(state)


def corrupt_images(images: np.ndarray, indices: Sequence[int], corruption: str, severity: int,
                   seed: int = 0) -> np.ndarray:
    """Corrupt uint8 images [N, H, W, 3] (H, W >= 32); ``indices[i]`` names image i in its data set
    (it enters the image's seed). Returns uint8 [N, H, W, 3]."""
    check_corruptions([corruption], [severity])
    if images.ndim != 4 or images.shape[-1] != 3 or images.dtype != np.uint8:
        raise ValueError(f"images must be uint8 [N, H, W, 3], got {images.dtype} {tuple(images.shape)}")
    if len(indices) != len(images):
        raise ValueError(f"{len(indices)} indices for {len(images)} images")
    if min(images.shape[1:3]) < 32:
        raise ValueError(f"imagecorruptions needs images of at least 32 x 32 pixels, got {images.shape[1:3]}")
    pkg = _package()
    takes_seed = corruption in ("impulse_noise", "glass_blur")
    out = np.empty_like(images)
    with _numpy_global_state():
        for i, (img, idx) in enumerate(zip(images, indices)):
            s = image_seed(seed, int(idx), corruption, severity)
            np.random.seed(s)
            kwargs = {"seed": s} if takes_seed else {}
            out[i] = pkg.corrupt(img, corruption_name=corruption, severity=severity, **kwargs)
    return out


def images_key(images: np.ndarray, indices: Sequence[int]) -> str:
    """Cache key of a set of images: sha256 of their indices, shape and bytes, and the package version."""
    h = hashlib.sha256()
    h.update(f"imagecorruptions {package_version()}|{tuple(images.shape)}|".encode())
    h.update(np.asarray(indices, dtype=np.int64).tobytes())
    h.update(np.ascontiguousarray(images).tobytes())
    return h.hexdigest()[:16]


def corruption_cache_dir() -> Path:
    return default_cache_dir() / "corruptions"


def cached_corruption(images: np.ndarray, indices: Sequence[int], corruption: str, severity: int, seed: int = 0,
                      cache_dir: str | Path | None = None, key: str | None = None) -> tuple[np.ndarray, dict]:
    """(corrupted images, info): :func:`corrupt_images` computed once per (images, corruption,
    severity, seed) and kept as ``.npy`` under ``cache_dir`` (default ``$FEDMJP_CACHE/corruptions``),
    with a ``.json`` beside it recording what computing it cost. ``info``: ``cached`` (read from the
    cache) and ``cpu_s`` (CPU seconds the computation took, when it ran or as recorded; None if
    unknown). ``key`` (from :func:`images_key`) saves rehashing the images."""
    folder = Path(cache_dir) if cache_dir is not None else corruption_cache_dir()
    folder = folder / (key or images_key(images, indices))
    path = folder / f"{corruption}-s{severity}-seed{seed}.npy"
    if path.exists():
        try:
            cached = np.load(path, allow_pickle=False)
        except (OSError, ValueError) as err:  # a damaged file: computed again below
            _logger.warning("corruption cache %s unreadable (%s); recomputing", path, err)
        else:
            if cached.shape == images.shape and cached.dtype == np.uint8:
                try:
                    cpu_s = json.loads(path.with_suffix(".json").read_text()).get("cpu_s")
                except (OSError, ValueError):
                    cpu_s = None
                return cached, {"cached": True, "cpu_s": cpu_s}
    t0 = time.process_time()
    out = corrupt_images(images, indices, corruption, severity, seed)
    cpu_s = time.process_time() - t0
    _logger.info("%s severity %d: %d images in %.1f CPU s", corruption, severity, len(images), cpu_s)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f".{path.stem}.{os.getpid()}.npy"
        np.save(tmp, out, allow_pickle=False)
        path.with_suffix(".json").write_text(json.dumps({"cpu_s": cpu_s, "images": len(images)}))
        tmp.replace(path)  # atomic: a reader sees the whole file or none
    except OSError as err:
        _logger.warning("cannot write the corruption cache %s (%s); set FEDMJP_CACHE to a writable folder", path, err)
    return out, {"cached": False, "cpu_s": cpu_s}
