"""Hostile image files: images are opened with a format allow-list, so a file in another format
(PostScript, which Pillow hands to Ghostscript, and the rest of Pillow's plug-ins) is a corrupt file
whatever its name, for the attack images and the training folders; then Hypothesis fuzzing of such
files, whole or cut short. docs/security.md describes the rules tested.
"""
from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch
from PIL import Image


# ------------------------------------------------------------------ code execution from an image
_EPS = (b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 8 8\n%%EndComments\n"
        b"0 0 moveto 8 8 lineto stroke\nshowpage\n%%EOF\n")


def test_a_postscript_file_named_png_never_reaches_ghostscript(tmp_path: Path, monkeypatch) -> None:
    """Image files are opened with a format allow-list: EPS (decoded by running the gs program) is a
    corrupt file whatever its name, and Pillow's Ghostscript hand-off is never called."""
    from PIL import EpsImagePlugin

    from fedmjp.data import load_folder

    def no_ghostscript(*args, **kwargs):
        raise AssertionError("Ghostscript was called on an input image")

    monkeypatch.setattr(EpsImagePlugin, "Ghostscript", no_ghostscript)
    (tmp_path / "9.png").write_bytes(_EPS)
    Image.fromarray((torch.rand(8, 8, 3) * 255).byte().numpy()).save(tmp_path / "ok.png")
    images = load_folder(tmp_path, 32, on_corrupt="skip")
    assert images.names == ["ok.png"]
    assert [Path(p).name for p, _ in images.skipped] == ["9.png"] and "corrupt" in images.skipped[0][1]


def test_a_training_image_folder_refuses_other_formats(tmp_path: Path) -> None:
    """torchvision's ImageFolder opens any format by default; the training loader does not."""
    from PIL import UnidentifiedImageError

    from fedmjp.data import rgb_loader

    (tmp_path / "x.jpg").write_bytes(_EPS)
    with pytest.raises(UnidentifiedImageError):
        rgb_loader(str(tmp_path / "x.jpg"))


# ------------------------------------------------------------------ fuzzing
hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402




_FORMATS = ["EPS", "PDF", "ICNS", "ICO", "IM", "PCX", "SGI", "TGA", "XBM", "DDS", "QOI", "SPIDER", "MSP"]


@settings(max_examples=40, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(fmt=st.sampled_from(_FORMATS), suffix=st.sampled_from([".png", ".jpg", ".bmp", ".tiff", ".webp"]),
       side=st.integers(1, 16), truncate=st.integers(0, 300))
def test_fuzz_image_bytes_of_other_formats_are_corrupt(tmp_path_factory, fmt: str, suffix: str, side: int,
                                                       truncate: int) -> None:
    """An image in a format outside the allow-list (written by Pillow, whole or cut short), under a
    name of an allowed one: skipped as corrupt, never decoded by that format's plug-in."""
    from fedmjp.data import load_folder

    folder = tmp_path_factory.mktemp("fmt")
    if fmt == "EPS":
        payload = _EPS
    else:
        buf = io.BytesIO()
        img = Image.new("RGB" if fmt not in ("XBM", "MSP") else "1", (side * 2, side * 2), "white")
        try:
            img.save(buf, fmt)
        except (OSError, ValueError, KeyError):
            return  # Pillow cannot write this format here
        payload = buf.getvalue()
    if truncate and truncate < len(payload):
        payload = payload[:truncate]
    (folder / f"x{suffix}").write_bytes(payload)
    Image.new("RGB", (8, 8), "red").save(folder / "y.png")
    images = load_folder(folder, 32, on_corrupt="skip")
    assert images.names == ["y.png"]
    assert len(images.skipped) == 1 and "corrupt" in images.skipped[0][1]
