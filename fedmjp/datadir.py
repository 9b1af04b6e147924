"""The data folder: where the large data sets live, named by the environment variable ``FEDMJP_DATA``.

fedmjp reads data sets from one place the user chooses. A path in a config (``data.source``,
``utility.source``, ``train_data``, ``metrics.lpips_backbone``) or a ``--data-path`` that starts with
``$FEDMJP_DATA/`` (or ``${FEDMJP_DATA}/``) names a file or folder inside that folder; with
``FEDMJP_DATA=/data/fedmjp``, ``$FEDMJP_DATA/imagenet-sample`` is ``/data/fedmjp/imagenet-sample``.
The layout the presets expect::

    $FEDMJP_DATA/imagenet-sample/            ImageNet validation JPEGs, one per class (configs/paper.yaml)
    $FEDMJP_DATA/cifar10.tar.gz              CIFAR-10 with train/ and val/ folders (configs/cifar.yaml,
                                             configs/defences*.yaml, the CIFAR training recipes)
    $FEDMJP_DATA/lpips/alexnet_features.pth  AlexNet weights for LPIPS (metrics/perceptual.py looks
                                             there too when no other file is named)

The default preset needs none of it (scikit-image's bundled images). Only this prefix is expanded,
no other variable and no shell syntax: a config is data, not a script. Where the variable is unset,
a config keeps the path as written (a preset still loads, validates and lists); the step that reads
the data raises :class:`DataDirUnset`, which says what to set.
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Optional

from .text import printable

#: The environment variable naming the data folder.
DATA_ENV = "FEDMJP_DATA"
_PREFIX = re.compile(r"^\$(?:\{" + DATA_ENV + r"\}|" + DATA_ENV + r")(?=[/\\]|$)")


class DataDirUnset(ValueError):
    """A path names ``$FEDMJP_DATA`` but the variable is not set, or names a path that cannot be
    resolved (:class:`UnresolvablePath`)."""


class UnresolvablePath(ValueError):
    """A path given by a flag or an environment variable whose symbolic links lead nowhere (a loop
    of links), or whose ``~user`` prefix names no known user."""


def resolved(value: str | os.PathLike[str], what: str) -> Path:
    """``value`` with ``~`` expanded, made absolute (a relative path: to the working directory) and
    its symbolic links resolved: the one resolution of every path a flag or an environment
    variable gives (``--images``, ``--output``, ``$FEDMJP_DATA``).

    Args:
        what: how the error names the path's origin (``"--images"``, ``"FEDMJP_DATA"``).
    Raises:
        UnresolvablePath: a loop of symbolic links, or an unknown ``~user`` (one line naming
            ``what`` and the path; pathlib raises RuntimeError for both, which no caller expects).
    """
    shown = printable(os.fspath(value))
    try:
        path = Path(value).expanduser()
    except RuntimeError:
        raise UnresolvablePath(f"{what} {shown}: its ~ prefix names no known home folder; "
                               "write the path out") from None
    try:
        return path.resolve()
    except (RuntimeError, OSError) as err:
        why = "a loop of symbolic links" if isinstance(err, RuntimeError) else printable(err.strerror or err)
        raise UnresolvablePath(f"{what} {shown} cannot be resolved ({why}); fix the link or give another "
                               "path") from None


def data_dir() -> Optional[Path]:
    """The folder ``$FEDMJP_DATA`` names (``~`` expanded, made absolute), or None when it is unset or empty.

    Raises:
        DataDirUnset: the variable names a path that cannot be resolved (:func:`resolved`).
    """
    value = os.environ.get(DATA_ENV, "").strip()
    try:
        return resolved(value, DATA_ENV) if value else None
    except UnresolvablePath as err:
        raise DataDirUnset(str(err)) from None


def names_data_dir(value: object) -> bool:
    """Whether ``value`` is a path string that starts with ``$FEDMJP_DATA`` (or ``${FEDMJP_DATA}``)."""
    return isinstance(value, str) and _PREFIX.match(value) is not None


def expand(value: str, what: str = "the path") -> str:
    """``value`` with a leading ``$FEDMJP_DATA`` replaced by the data folder; other values unchanged.

    Args:
        value: a path as written in a config or on the command line.
        what: how the error message names it (e.g. ``"data.source"``).
    Raises:
        DataDirUnset: ``value`` starts with ``$FEDMJP_DATA`` and the variable is unset or empty.
    """
    match = _PREFIX.match(value) if isinstance(value, str) else None
    if match is None:
        return value
    rest = value[match.end():].lstrip("/\\")
    root = data_dir()
    if root is None:
        raise DataDirUnset(
            f"{what} {printable(value)} is inside the data folder, but {DATA_ENV} is not set: "
            f"export {DATA_ENV}=/path/to/data (the folder that holds {printable(rest) or 'the data sets'}), "
            f"or give {what} as a path of its own")
    return str(root / rest) if rest else str(root)
