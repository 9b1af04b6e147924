"""The data folder FEDMJP_DATA (fedmjp/datadir.py): config paths that start with $FEDMJP_DATA are read
inside it; where it is unset a preset still loads, and the run stops with exit status 4 and a message
that names the variable, before anything is written."""
from __future__ import annotations

from pathlib import Path

import pytest

from benchmark import config as C
from benchmark.validation import validate
from fedmjp import datadir
from fedmjp.archives import resolve_data_path
from fedmjp.data import DataError, load_images
from helpers import make_imagefolder, run, write_config

ROOT = Path(__file__).resolve().parents[1]


def test_expand_reads_the_prefix_only(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(datadir.DATA_ENV, str(tmp_path))
    assert datadir.expand("$FEDMJP_DATA/imagenet-sample") == str(tmp_path / "imagenet-sample")
    assert datadir.expand("${FEDMJP_DATA}/lpips/a.pth") == str(tmp_path / "lpips" / "a.pth")
    assert datadir.expand("$FEDMJP_DATA") == str(tmp_path)
    for other in ("embedded", "data/x", "/abs/$FEDMJP_DATA/x", "$FEDMJP_DATAX/x", "$HOME/x"):
        assert datadir.expand(other) == other and not datadir.names_data_dir(other)
    monkeypatch.setenv(datadir.DATA_ENV, "  ")  # blank counts as unset
    with pytest.raises(datadir.DataDirUnset, match=r"data.source \$FEDMJP_DATA/x .*FEDMJP_DATA is not set.*export"):
        datadir.expand("$FEDMJP_DATA/x", "data.source")


def test_core_loaders_read_the_data_folder(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    make_imagefolder(tmp_path / "imgs", classes=2, per_class=2)
    monkeypatch.setenv(datadir.DATA_ENV, str(tmp_path))
    assert len(load_images("$FEDMJP_DATA/imgs/val", 16)) == 4
    assert resolve_data_path("$FEDMJP_DATA/imgs") == tmp_path / "imgs"
    monkeypatch.delenv(datadir.DATA_ENV)
    with pytest.raises(DataError, match="FEDMJP_DATA is not set"):
        load_images("$FEDMJP_DATA/imgs/val", 16)
    with pytest.raises(datadir.DataDirUnset, match="FEDMJP_DATA is not set"):
        resolve_data_path("$FEDMJP_DATA/imgs")


def test_presets_name_the_data_folder(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No preset names a folder outside the project; unset, the path stays as written (the preset
    still validates); set, it is the file in the folder."""
    for preset in sorted((ROOT / "configs").glob("*.yaml")):
        assert "../" not in preset.read_text(), preset.name
    monkeypatch.delenv(datadir.DATA_ENV, raising=False)
    paper = validate(C.load_config(ROOT / "configs" / "paper.yaml"))
    assert paper.data.source == "$FEDMJP_DATA/imagenet-sample"
    cifar = validate(C.load_config(ROOT / "configs" / "cifar.yaml"))
    assert cifar.train_data == cifar.data.source == "$FEDMJP_DATA/cifar10.tar.gz"
    monkeypatch.setenv(datadir.DATA_ENV, str(tmp_path))
    paper = validate(C.load_config(ROOT / "configs" / "paper.yaml"))
    assert paper.data.source == str(tmp_path.resolve() / "imagenet-sample")
    assert validate(C.load_config(ROOT / "configs" / "defences_cifar.yaml")).utility.source == str(
        tmp_path.resolve() / "cifar10.tar.gz")


def test_run_without_the_data_folder_exits_4_before_writing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                            capsys) -> None:
    make_imagefolder(tmp_path / "data" / "imgs", classes=2, per_class=2)
    config = write_config(tmp_path, **{"data.source": "$FEDMJP_DATA/imgs/val", "federation.rounds": 1})
    monkeypatch.delenv(datadir.DATA_ENV, raising=False)
    out = tmp_path / "out"
    assert run(config, out, "--models", "DeiT", "--setting", "a", "--dry-run") == 4
    err = capsys.readouterr().err
    assert "$FEDMJP_DATA/imgs/val" in err and "FEDMJP_DATA is not set" in err and "Traceback" not in err
    assert not (out / "results.jsonl").exists()
    monkeypatch.setenv(datadir.DATA_ENV, str(tmp_path / "data"))
    assert run(config, out, "--models", "DeiT", "--setting", "a", "--dry-run") == 0
