"""Prepare the data folder ``FEDMJP_DATA`` (:mod:`fedmjp.datadir`) from downloads a user has.

    python -m fedmjp.prepare_data --cifar PATH/cifar-10-python.tar.gz --out DIR
    export FEDMJP_DATA=DIR

``--cifar`` takes torchvision's CIFAR-10 download (``cifar-10-python.tar.gz``, what
``torchvision.datasets.CIFAR10(download=True)`` fetches) or its extracted ``cifar-10-batches-py``
folder, and writes ``DIR/cifar10.tar.gz``: the ImageFolder archive configs/cifar.yaml, the defence
presets and the CIFAR training recipes read (50,000 train and 10,000 val PNGs, exactly torchvision's
pixels). An existing ``DIR/cifar10.tar.gz`` is kept unless ``--force`` is given. LPIPS' AlexNet
weights are not part of it: ``scripts/setup.sh`` installs them (``python -m metrics.lpips_trunk``).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

from .cifar import CifarError, read_cifar10, write_imagefolder_archive

#: The file the presets name as ``$FEDMJP_DATA/cifar10.tar.gz``.
CIFAR_ARCHIVE = "cifar10.tar.gz"


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fedmjp.prepare_data", description=__doc__.split("\n\n")[0])
    parser.add_argument("--cifar", type=Path, required=True,
                        help="torchvision's cifar-10-python.tar.gz, or its extracted cifar-10-batches-py folder")
    parser.add_argument("--out", type=Path, required=True, help="the data folder to write (FEDMJP_DATA)")
    parser.add_argument("--force", action="store_true", help=f"replace an existing {CIFAR_ARCHIVE}")
    args = parser.parse_args(argv)
    dest = args.out / CIFAR_ARCHIVE
    if dest.exists() and not args.force:
        print(f"{dest} exists; kept (--force writes it again). export FEDMJP_DATA={args.out.resolve()}")
        return 0
    t0 = time.perf_counter()
    try:
        splits, classes = read_cifar10(args.cifar)
        write_imagefolder_archive(splits, classes, dest)
    except (CifarError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except OSError as err:
        print(f"error: cannot write {dest}: {err.strerror or err}; pass --out a writable folder", file=sys.stderr)
        return 2
    counts = ", ".join(f"{len(s.labels)} {name}" for name, s in splits.items())
    print(f"wrote {dest} ({counts} images, {len(classes)} classes) in {time.perf_counter() - t0:.0f} s; "
          f"export FEDMJP_DATA={args.out.resolve()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
