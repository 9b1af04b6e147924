"""Fixtures shared by the test files; plain helper functions are in helpers.py.

Large data sets reach the tests through one fixture, :func:`team_data`. Its folder is the data
folder of the product (``$FEDMJP_DATA``, fedmjp/datadir.py) when that variable is set, else the
team's mount ``../shared/data`` beside the project where it exists. At the start of the session
``FEDMJP_DATA`` is set to that folder, so that the product (and the processes the tests start)
finds the same files the fixtures do, e.g. the LPIPS weights of ``$FEDMJP_DATA/lpips``. Without
any data folder the core checks still run, on scikit-image's bundled images
(:func:`helpers.bundled_images`); a test that needs a large set skips and says which file.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
DATA_ENV = "FEDMJP_DATA"
#: The team's data mount beside the project (used only when FEDMJP_DATA is unset).
_TEAM_MOUNT = ROOT.parent / "shared" / "data"
#: What each data set is, for the skip reasons.
ABOUT = {
    "imagenet-sample": "1000 ImageNet validation JPEGs, one per class",
    "cifar10.tar.gz": "CIFAR-10 as train/ and val/ folders, 170 MB",
    "lpips/alexnet_features.pth": "torchvision's ImageNet AlexNet trunk for LPIPS",
}


def _data_folder() -> Optional[Path]:
    value = os.environ.get(DATA_ENV, "").strip()
    if value:
        return Path(value).expanduser().resolve()
    return _TEAM_MOUNT.resolve() if _TEAM_MOUNT.is_dir() else None


def pytest_configure(config: pytest.Config) -> None:
    folder = _data_folder()
    if folder is not None:
        os.environ[DATA_ENV] = str(folder)


class TeamData:
    """The data folder of this session (None: none), with a skip for what it lacks."""

    def __init__(self, root: Optional[Path]) -> None:
        self.root = root

    def has(self, name: str) -> bool:
        return self.root is not None and (self.root / name).exists()

    def path(self, name: str) -> Path:
        """``<data folder>/name``; skips the test (saying which file and why) where it is missing."""
        if self.has(name):
            return self.root / name
        what = f" ({ABOUT[name]})" if name in ABOUT else ""
        where = (f"not in {self.root}" if self.root is not None
                 else f"{DATA_ENV} is unset and ../shared/data is absent")
        pytest.skip(f"needs $FEDMJP_DATA/{name}{what}: {where}")


@pytest.fixture(scope="session")
def team_data() -> TeamData:
    """The large data sets (ImageNet sample, CIFAR-10 archive, LPIPS AlexNet weights); see the module docstring."""
    return TeamData(_data_folder())


@pytest.fixture(scope="session")
def imagenet_sample(team_data: TeamData) -> Path:
    """``$FEDMJP_DATA/imagenet-sample`` (skips without it)."""
    return team_data.path("imagenet-sample")


@pytest.fixture(scope="session")
def alexnet_features(team_data: TeamData, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An AlexNet ``features.*`` weights file for LPIPS: the data folder's trained trunk where it
    exists, else a seeded random trunk (torchvision's AlexNet, initialised with seed 0). What the
    LPIPS tests check holds for any trunk: our wrapper gives the ``lpips`` package's values, the
    feature cache gives the uncached values, resizing, identity, the weight routes. A test that
    needs the trained trunk's judgement uses :func:`trained_alexnet_features`."""
    if team_data.has("lpips/alexnet_features.pth"):
        return team_data.path("lpips/alexnet_features.pth")
    import warnings

    import torchvision

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            net = torchvision.models.alexnet(weights=None)
    path = tmp_path_factory.mktemp("lpips") / "alexnet_features.pth"
    torch.save({k: v for k, v in net.state_dict().items() if k.startswith("features.")}, path)
    return path


@pytest.fixture(scope="session")
def trained_alexnet_features(team_data: TeamData) -> Path:
    """``$FEDMJP_DATA/lpips/alexnet_features.pth`` (skips without it)."""
    return team_data.path("lpips/alexnet_features.pth")


@pytest.fixture
def no_data_folder(monkeypatch: pytest.MonkeyPatch) -> None:
    """The product sees no data folder (FEDMJP_DATA unset), as on a machine without the data sets."""
    monkeypatch.delenv(DATA_ENV, raising=False)


@pytest.fixture(scope="module")
def one_torch_thread():
    """One torch intra-op thread for a test module whose clients run in threads (the in-process
    engine): on 2 shared cores, torch's own threads on top of them oversubscribe (a tiny backward
    goes from 20 ms to ~2 s). Use with ``pytestmark = pytest.mark.usefixtures("one_torch_thread")``."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
