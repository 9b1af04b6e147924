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

#: The environment variable naming the data folder.
DATA_ENV = "FEDMJP_DATA"
_PREFIX = re.compile(r"^\$(?:\{" + DATA_ENV + r"\}|" + DATA_ENV + r")(?=[/\\]|$)")


class DataDirUnset(ValueError):
    """A path names ``$FEDMJP_DATA`` but the variable is not set."""


def data_dir() -> Optional[Path]:
    """The folder ``$FEDMJP_DATA`` names (``~`` expanded, made absolute), or None when it is unset or empty."""
    value = os.environ.get(DATA_ENV, "").strip()
    return Path(value).expanduser().resolve() if value else None


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
            f"{what} {value} is inside the data folder, but {DATA_ENV} is not set: "
            f"export {DATA_ENV}=/path/to/data (the folder that holds {rest or 'the data sets'}), "
            f"or give {what} as a path of its own")
    return str(root / rest) if rest else str(root)
