"""LPIPS features computed once per image and reused (:class:`LpipsFeatureCache`), and the distance
from two images' features (:func:`feature_distance`), which :func:`metrics.perceptual.lpips` uses.
"""
from __future__ import annotations

import hashlib
import os
import threading
from typing import Optional

import cachetools
import lpips as lpips_pkg
import torch

#: Environment variable: megabytes of reference-image features an :class:`LpipsFeatureCache` keeps.
CACHE_ENV = "FEDMJP_LPIPS_CACHE_MB"
#: Most that ``FEDMJP_LPIPS_CACHE_MB`` defaults to: the x and x~ of the paper protocol's 999 images
#: at 224 px (1.94 MB of AlexNet features each) fit; less where an eighth of the RAM is less.
DEFAULT_CACHE_MB = 4096
#: Megabytes of the short-lived part of the cache (the last images scored, e.g. a reconstruction
#: scored under setting b and then c).
RECENT_CACHE_MB = 256


# LPIPS.forward computes both images' features and then their distance in one call; the two steps
# are written out below (the same operations in the same order, v0.1 with linear heads, spatially
# averaged) so that a feature map computed once serves every pair an image is in.
def _features(model: lpips_pkg.LPIPS, x: torch.Tensor) -> list[torch.Tensor]:
    """The unit-normalised AlexNet features per layer of LPIPS' input ``x``, as in ``LPIPS.forward``."""
    return [lpips_pkg.normalize_tensor(o) for o in model.net.forward(model.scaling_layer(x))]


def feature_distance(model: lpips_pkg.LPIPS, f0: list[torch.Tensor], f1: list[torch.Tensor]) -> torch.Tensor:
    """``LPIPS.forward``'s distance [B, 1, 1, 1] from two images' :func:`_features`."""
    val = 0
    for kk in range(model.L):
        val += lpips_pkg.spatial_average(model.lins[kk]((f0[kk] - f1[kk]) ** 2), keepdim=True)
    return val


def _check_cacheable(model: lpips_pkg.LPIPS) -> None:
    if getattr(model, "version", None) != "0.1" or not model.lpips or model.spatial:
        raise ValueError("LpipsFeatureCache needs an LPIPS v0.1 model with linear heads and a spatial average "
                         "(lpips.LPIPS(net='alex', version='0.1'), as get_lpips_model builds)")


def default_cache_mb() -> int:
    """:data:`DEFAULT_CACHE_MB` or an eighth of the machine's RAM, whichever is less (a saving of
    ~2% of a benchmark's CPU time should not crowd out the run on a small machine)."""
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # no sysconf (Windows): assume 16 GiB
        ram = 16 << 30
    return max(0, min(DEFAULT_CACHE_MB, (ram >> 20) // 8))


def cache_budget_mb() -> int:
    """Megabytes an :class:`LpipsFeatureCache` keeps by default: ``FEDMJP_LPIPS_CACHE_MB`` or
    :func:`default_cache_mb` (0 keeps nothing beyond the last images scored)."""
    env = os.environ.get(CACHE_ENV)
    if env is None:
        return default_cache_mb()
    try:
        value = int(env)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"{CACHE_ENV} must be a whole number of megabytes >= 0, got {env!r}")
    return value


def _nbytes(feats: list[torch.Tensor]) -> int:
    return sum(f.numel() * f.element_size() for f in feats)


class LpipsFeatureCache:
    """The AlexNet features of images LPIPS has scored, found again by the images' content.

    A benchmark scores the same reference many times: x under setting (a) in every model row's
    clean federation and under (c) in every shuffled one, x~ under (b) in every row, and a
    reconstruction under (b) and then (c). LPIPS' AlexNet forward is at its FLOP limit on a CPU, so
    the only saving left is not to repeat it: each image's features are computed once and reused.

    Two parts: reference images (``keep=True``) are kept while their features fit in ``keep_mb``
    (first come, kept for the run: a benchmark goes through the same images in the same order in
    every federation, where a least-recently-used policy would evict each image just before it comes
    back); every other image computed enters a least-recently-used part of ``recent_mb``. Keys are
    BLAKE2b digests of the images' bytes (dtype, shape and the resize target included), so a hit
    means the same input, whatever tensor carries it. The features, and thus the values, are those
    ``LPIPS.forward`` computes: the same operations in the same order, on the images of a batch that
    were not cached (tests/test_metrics.py checks the values to the float32 noise floor; on the CPUs
    tried they are equal bit for bit, since oneDNN's AlexNet gives an image the same features in
    any batch).

    Args:
        model: the LPIPS model (:func:`metrics.perceptual.get_lpips_model`); the cache is only valid for it.
        keep_mb: budget of the kept part (default :func:`cache_budget_mb`).
        recent_mb: budget of the recent part.
    """

    def __init__(self, model: lpips_pkg.LPIPS, keep_mb: Optional[int] = None,
                 recent_mb: int = RECENT_CACHE_MB) -> None:
        _check_cacheable(model)
        self.model = model
        self.keep_bytes = (cache_budget_mb() if keep_mb is None else int(keep_mb)) << 20
        self.recent_bytes = int(recent_mb) << 20  # property: sets up the recent part
        self._kept: dict[bytes, list[torch.Tensor]] = {}
        self._kept_size = 0
        self._lock = threading.Lock()
        self.computed = 0  # images whose features were computed
        self.reused = 0  # images whose features came from the cache

    @property
    def recent_bytes(self) -> int:
        """Budget of the recent part in bytes; setting it empties that part."""
        return self._recent_bytes

    @recent_bytes.setter
    def recent_bytes(self, value: int) -> None:
        self._recent_bytes = int(value)
        # cachetools' size-weighted LRU (maxsize in bytes): it evicts the least recently used entries
        # until a new one fits; one larger than the whole budget is not stored (_store checks).
        self._recent = cachetools.LRUCache(maxsize=max(self._recent_bytes, 1), getsizeof=_nbytes)

    @staticmethod
    def _key(image: torch.Tensor, size: Optional[tuple[int, int]]) -> bytes:
        data = image.detach().cpu().contiguous()
        digest = hashlib.blake2b(f"{data.dtype}{tuple(data.shape)}{size}".encode(), digest_size=20)
        digest.update(data.view(torch.uint8).numpy().data if data.numel() else b"")
        return digest.digest()

    def _lookup(self, key: bytes) -> Optional[list[torch.Tensor]]:
        if key in self._kept:
            return self._kept[key]
        return self._recent.get(key)  # a hit counts as a use

    def _store(self, key: bytes, feats: list[torch.Tensor], keep: bool) -> None:
        if key in self._kept or key in self._recent:  # the same image twice in one batch
            return
        nbytes = _nbytes(feats)
        if keep and self._kept_size + nbytes <= self.keep_bytes:
            self._kept[key] = feats
            self._kept_size += nbytes
            return
        if nbytes > self.recent_bytes:
            return
        self._recent[key] = feats

    def features(self, images: torch.Tensor, model_input: torch.Tensor, size: Optional[tuple[int, int]],
                 keep: bool) -> list[torch.Tensor]:
        """Per layer, the features [B, C_l, H_l, W_l] of ``model_input`` (:func:`metrics.perceptual._model_input` of
        ``images``, which key the cache), computing only those not cached."""
        keys = [self._key(image, size) for image in images]
        with self._lock:
            found = [self._lookup(k) for k in keys]
        missing = [i for i, f in enumerate(found) if f is None]
        fresh = _features(self.model, model_input[missing]) if missing else []
        with self._lock:
            for j, i in enumerate(missing):
                found[i] = [f[j : j + 1].clone() for f in fresh]
                self._store(keys[i], found[i], keep)
            self.computed += len(missing)
            self.reused += len(keys) - len(missing)
        if len(missing) == len(keys):
            return fresh
        return [torch.cat([f[layer] for f in found]) for layer in range(len(found[0]))]

    def stats(self) -> dict[str, int]:
        """Images computed and reused, and the bytes held in each part."""
        with self._lock:
            return dict(computed=self.computed, reused=self.reused, kept_images=len(self._kept),
                        kept_bytes=self._kept_size, recent_images=len(self._recent), recent_bytes=self._recent.currsize)
