"""LPIPS (Zhang et al. 2018) through the ``lpips`` package: AlexNet trunk, v0.1 linear heads.

The linear heads ship inside the ``lpips`` wheel. The AlexNet trunk (torchvision's ImageNet weights)
is resolved in this order (:func:`resolve_lpips_route`):

1. the ``backbone_path`` argument (a config key such as ``metrics.lpips_backbone`` feeds it),
2. the file named by the environment variable ``FEDMJP_LPIPS_BACKBONE``,
3. ``<project root>/../shared/data/lpips/alexnet_features.pth`` if it exists,
4. the ``lpips`` package's normal route: torchvision's AlexNet checkpoint in torch hub's cache
   (``$TORCH_HOME/hub/checkpoints/alexnet-owt-7be5be79.pth``; torchvision checks the hash only when it
   downloads, so a cached file works offline), downloaded there once where a network exists,
5. otherwise :class:`LpipsUnavailable` (a RuntimeError) saying why and naming the variable and file.

A file in 1-3 holds a state dict with torchvision's keys ``features.{0,3,6,8,10}.{weight,bias}`` (a
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

log = logging.getLogger(__name__)

#: Environment variable naming a local AlexNet ``features.*`` weights file.
BACKBONE_ENV = "FEDMJP_LPIPS_BACKBONE"
#: torchvision's ImageNet AlexNet checkpoint (AlexNet_Weights.IMAGENET1K_V1).
TORCHVISION_ALEXNET_URL = "https://download.pytorch.org/models/alexnet-owt-7be5be79.pth"
#: The converted copy that the tests and benchmarks use, looked up next to the project.
SHARED_BACKBONE = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "lpips" / "alexnet_features.pth"
SHARED_BACKBONE_HINT = "../shared/data/lpips/alexnet_features.pth"
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
        kind: "argument", "env", "shared", "torchvision-cache" or "torchvision-download".
        path: the weights file (for "torchvision-download": where it will be cached).
    """

    kind: str
    path: Path

    def __str__(self) -> str:
        return f"{self.kind}:{self.path}"


def hub_cache_file() -> Path:
    """Where torchvision caches its AlexNet checkpoint (follows ``TORCH_HOME``)."""
    return Path(torch.hub.get_dir()) / "checkpoints" / TORCHVISION_ALEXNET_URL.rsplit("/", 1)[-1]


def _reachable(url: str, timeout: float) -> bool:
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


def resolve_lpips_route(
    backbone_path: Optional[Union[str, os.PathLike[str]]] = None,
    shared_path: Optional[Path] = None,
    allow_download: bool = True,
) -> LpipsRoute:
    """The first available source of the AlexNet trunk, in the order of the module docstring.

    Args:
        backbone_path: explicit weights file.
        shared_path: the ../shared lookup (default :data:`SHARED_BACKBONE`).
        allow_download: allow route 4 to download when the cache is empty.
    Raises:
        LpipsUnavailable: an explicit file (argument or variable) is missing, or nothing is available.
    """
    for kind, value in (("argument", backbone_path), ("env", os.environ.get(BACKBONE_ENV))):
        if value:
            path = Path(value).expanduser().resolve()
            if not path.is_file():
                source = "backbone_path" if kind == "argument" else f"${BACKBONE_ENV}"
                raise LpipsUnavailable(f"LPIPS AlexNet weights given by {source} not found: {path}")
            return LpipsRoute(kind, path)
    shared = SHARED_BACKBONE if shared_path is None else shared_path
    if shared.is_file():
        return LpipsRoute("shared", shared.resolve())
    cached = hub_cache_file()
    if cached.is_file():
        return LpipsRoute("torchvision-cache", cached)
    why = "downloads are off (allow_download=False)"
    if allow_download:
        if _reachable(TORCHVISION_ALEXNET_URL, CONNECT_TIMEOUT_S):
            return LpipsRoute("torchvision-download", cached)
        why = f"download.pytorch.org cannot be reached (no network within {CONNECT_TIMEOUT_S:g} s)"
    raise LpipsUnavailable(_unavailable_message(why, shared))


def _unavailable_message(why: str, shared: Path) -> str:
    return (
        f"LPIPS needs torchvision's ImageNet AlexNet weights: none found locally and {why}. Looked at "
        f"${BACKBONE_ENV} (unset), {shared} (missing) and the torch hub cache {hub_cache_file()} "
        f"(missing). Set {BACKBONE_ENV} (or backbone_path / the config key metrics.lpips_backbone) to a "
        f"file of AlexNet features.* weights such as {SHARED_BACKBONE_HINT} (alexnet_features.pth), "
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
                _unavailable_message(f"the torchvision route failed ({type(err).__name__}: {err})", SHARED_BACKBONE)
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
    shared_path: Optional[Path] = None,
) -> lpips_pkg.LPIPS:
    """The LPIPS(AlexNet, v0.1) model on ``device``, built once per (device, weights route) and reused.

    Args:
        device: where the model runs.
        backbone_path: AlexNet ``features.*`` weights (route 1 of the module docstring).
        allow_download: let the torchvision route download when its cache is empty.
        shared_path: override of the ../shared lookup (route 3).
    Returns:
        The model; ``lpips_source(model)`` (or ``model.lpips_source``) says which route it came from.
    Raises:
        LpipsUnavailable: no weights (the message says why and names the variable and file).
    """
    route = resolve_lpips_route(backbone_path, shared_path, allow_download)
    return _cached(str(torch.device(device)), route)


def lpips_source(model: lpips_pkg.LPIPS) -> str:
    """``"<kind>:<path>"`` of the weights a model from :func:`get_lpips_model` was built with, e.g.
    ``"shared:/work/shared/data/lpips/alexnet_features.pth"``; "unknown" for other models."""
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
    Returns:
        [B] float64 on CPU, >= 0; 0 for identical images; higher = more private.
    """
    if validate:
        check_pair(reconstruction, reference)
    if model is None:
        model = get_lpips_model()
    param = next(model.parameters())
    size = _resize_target(reference.shape[-2], reference.shape[-1], resize)
    out = []
    with torch.inference_mode():
        for start in range(0, reconstruction.shape[0], batch_size):
            pair = []
            for t in (reconstruction, reference):
                x = t[start : start + batch_size].to(param.device, param.dtype).clamp(0.0, 1.0)
                if size is not None:
                    x = F.interpolate(x, size=size, mode="bilinear", align_corners=False)
                pair.append(x.mul(2.0).sub_(1.0).contiguous(memory_format=torch.channels_last))
            out.append(model(*pair).flatten().to("cpu", torch.float64))
    return torch.cat(out)
