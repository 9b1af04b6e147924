"""Attack image sets: embedded images, flat folders, class folders, archives and bad input."""
from __future__ import annotations

import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from fedmjp.data import DataError, EMBEDDED_IMAGES, load_images

def _save(path: Path, mode: str = "RGB", size=(40, 30)) -> None:
    rng = np.random.default_rng(sum(map(ord, str(path))))
    channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    arr = rng.integers(0, 255, (size[1], size[0], channels), dtype=np.uint8).squeeze()
    Image.fromarray(arr, mode).save(path)


def test_embedded_images_are_rgb_in_range():
    s = load_images(None, 32, num_images=3)
    assert s.images.shape == (3, 3, 32, 32) and s.names == list(EMBEDDED_IMAGES[:3])
    assert 0.0 <= s.images.min() and s.images.max() <= 1.0
    assert len(load_images("embedded", 16)) == len(EMBEDDED_IMAGES)


def test_flat_folder_converts_and_lists_skipped(tmp_path):
    _save(tmp_path / "a.png", "L")
    _save(tmp_path / "b.png", "RGBA")
    _save(tmp_path / "c.jpg", "RGB", size=(8, 8))  # smaller than the target: upscaled
    (tmp_path / "notes.txt").write_text("not an image")
    (tmp_path / "d.jpg").write_bytes(b"corrupt")
    s = load_images(tmp_path, 24, num_classes=2)
    assert s.images.shape == (3, 3, 24, 24)
    assert s.names == ["a.png", "b.png", "c.jpg"] and s.labels.tolist() == [0, 1, 0]
    reasons = dict(s.skipped)
    assert "not an image" in reasons[str(tmp_path / "notes.txt")]
    assert "corrupt" in reasons[str(tmp_path / "d.jpg")]
    with pytest.raises(DataError, match="d.jpg"):
        load_images(tmp_path, 24, on_corrupt="fail")


def test_missing_and_empty_folders(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        load_images(tmp_path / "missing", 32)
    with pytest.raises(DataError, match="no image files"):
        load_images(tmp_path, 32)
    (tmp_path / "x.txt").write_text("")
    with pytest.raises(DataError, match="is a file"):
        load_images(tmp_path / "x.txt", 32)
    with pytest.raises(ValueError, match="num_images"):
        load_images(None, 32, num_images=0)


def _class_folder(root: Path) -> Path:
    for cls, n in (("cat", 3), ("dog", 1), ("eel", 2)):
        (root / cls).mkdir(parents=True)
        for i in range(n):
            _save(root / cls / f"{i}.png")
    return root


def test_class_folders_round_robin_with_true_labels(tmp_path):
    s = load_images(_class_folder(tmp_path / "val"), 16, num_images=4, num_classes=10)
    assert s.names == ["cat/0.png", "dog/0.png", "eel/0.png", "cat/1.png"]
    assert s.labels.tolist() == [0, 1, 2, 0]


def test_archive_uses_val_split(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDMJP_CACHE", str(tmp_path / "cache"))
    _class_folder(tmp_path / "ds" / "val")
    _class_folder(tmp_path / "ds" / "train")
    archive = tmp_path / "ds.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(tmp_path / "ds", arcname="ds")
    s = load_images(archive, 16, num_images=6, num_classes=3)
    assert len(s) == 6 and sorted(set(s.labels.tolist())) == [0, 1, 2]
    again = load_images(archive, 16, num_images=6, num_classes=3)  # extracted once, read again
    assert torch.equal(s.images, again.images)


def test_imagenet_sample_labels_follow_sorted_order(imagenet_sample: Path):
    s = load_images(imagenet_sample, 32, num_images=3)
    assert s.labels.tolist() == [0, 1, 2] and s.names[0] == "n01440764_tench.JPEG"
