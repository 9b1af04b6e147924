"""Untrusted names and sizes: file and member names with terminal control characters reach the
terminal and the log escaped (fedmjp/text.py), image names that clean up to the same file name keep
distinct pictures, and sizes are bounded where memory or disk is spent (an image's resized pixels,
an archive's extracted bytes and members, a model's tokens per image)."""
from __future__ import annotations

import io
import logging
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from PIL import Image

from benchmark import config as C
from benchmark.entries import model_spec
from benchmark.store import RunFolder
from benchmark.validation import validate
from fedmjp import archives, data
from fedmjp.archives import ArchiveError, extract_archive
from fedmjp.data import DataError, load_folder
from fedmjp.factory import MAX_TOKENS, create_model, spec_kwargs
from fedmjp.settings import SETTING_GROUPS
from fedmjp.text import EscapingFormatter, printable
from test_hostile_inputs import _good_members, _png_bytes, _tar, cli, one_line_error, small_config

ROOT = Path(__file__).resolve().parents[1]
#: A name that clears the screen, sets the window title and forges a log line.
HOSTILE = "x\x1b[2J\x1b]0;owned\x07\nINFO all attacks failed, model is private\u202egnp\x9b"


def _no_controls(text: str) -> None:
    assert text.isprintable(), repr(text)


def test_printable_escapes_every_control_and_keeps_text() -> None:
    out = printable(HOSTILE + "\udcff\t\r")
    _no_controls(out)
    for escape in ("\\x1b[2J", "\\x07", "\\n", "\\u202e", "\\x9b", "\\udcff", "\\t", "\\r"):
        assert escape in out, (escape, out)
    assert printable("été 中文 a b/c.png") == "été 中文 a b/c.png"  # printable text stays as it is
    assert printable(out) == out  # idempotent: escaped twice reads the same
    assert printable(Path("/a\x1b/b")) == "/a\\x1b/b"


def test_log_formatter_escapes_string_arguments_only() -> None:
    record = logging.LogRecord("fedmjp.data", logging.WARNING, __file__, 1, "skipping %s: %s (%d, %.1f)",
                               (Path(HOSTILE), ValueError("bad\nthing"), 3, 0.5), None)
    text = EscapingFormatter(logging.Formatter("%(levelname)s %(message)s")).format(record)
    _no_controls(text)
    assert text.startswith("WARNING skipping x\\x1b[2J") and text.endswith("bad\\nthing (3, 0.5)")


def test_corrupt_image_with_a_hostile_name_is_logged_escaped(tmp_path: Path, caplog) -> None:
    folder = tmp_path / "imgs"
    folder.mkdir()
    (folder / "ok.png").write_bytes(_png_bytes(0))
    (folder / f"{HOSTILE}.png").write_bytes(b"not a png")
    with caplog.at_level(logging.WARNING, logger="fedmjp.data"):
        images = load_folder(folder, 16)
    assert images.names == ["ok.png"]
    messages = [r.getMessage() for r in caplog.records if "corrupt" in r.getMessage()]
    assert len(messages) == 1 and "x\\x1b[2J" in messages[0], messages
    _no_controls(messages[0])
    with pytest.raises(DataError) as err:
        load_folder(folder, 16, on_corrupt="fail")
    _no_controls(str(err.value))
    assert "\\x1b]0;owned\\x07\\nINFO all attacks failed" in str(err.value)


def test_cli_error_line_escapes_a_hostile_path(tmp_path: Path, capsys) -> None:
    missing = tmp_path / HOSTILE
    assert cli(small_config(tmp_path), tmp_path / "out", "--images", str(missing)) == 4
    err = capsys.readouterr().err
    assert "\x1b" not in err and "\u202e" not in err and "\nINFO all attacks" not in err, repr(err)
    one_line_error(err, "x\\x1b[2J", "does not exist")


def test_archive_member_and_path_are_escaped(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(archives, "MAX_MEMBER_BYTES", 5000)  # the good members' PNGs are under 5 kB
    bad = _tar(tmp_path / f"{HOSTILE}.tar.gz", _good_members() + [(tarfile.TarInfo(f"val/c0/{HOSTILE}"), b"x" * 5001)])
    with pytest.raises(ArchiveError) as err:
        extract_archive(bad, tmp_path / "cache")
    _no_controls(str(err.value))
    assert str(err.value).count("x\\x1b[2J") == 2  # the archive and its member, both named


# ------------------------------------------------------------------------------- stored names
def test_names_that_clean_up_the_same_keep_distinct_files(tmp_path: Path) -> None:
    run = RunFolder(tmp_path / "run")
    names = ["a b.png", "a_b.png", "a/b.png", "_a_b.png", "a  b.png", "", "row"]
    paths = {run.image_path("M", "clean", n, "x", 1, 0) for n in names}
    assert len(paths) == len(names), paths
    assert run.image_path("M", "clean", "astronaut", "x", 1, 0).name == "astronaut__r1-p0__x.png"  # clean: as is
    assert run.image_path("M", "clean", "a b.png", "x", 1, 0) == run.image_path("M", "clean", "a b.png", "x", 1, 0)


def test_grid_pictures_of_names_that_clean_up_the_same_stay_distinct(tmp_path: Path) -> None:
    folder = tmp_path / "imgs"
    folder.mkdir()
    colours = {"a b.png": (255, 0, 0), "a_b.png": (0, 0, 255)}
    for name, rgb in colours.items():
        Image.new("RGB", (40, 40), rgb).save(folder / name)
    out = tmp_path / "out"
    assert cli(small_config(tmp_path), out, "--images", str(folder)) == 0
    run = RunFolder(out)
    rows = [r for r in run.rows() if r["image_id"] in colours]
    assert {r["image_id"] for r in rows} == set(colours)
    for r in rows:
        path = run.image_path(r["model"], SETTING_GROUPS[r["setting"]], r["image_id"], "x", r["round"],
                              r["partition_id"])
        stored = np.asarray(Image.open(path).convert("RGB")).reshape(-1, 3).mean(0)
        assert np.abs(stored - colours[r["image_id"]]).max() < 2, (r["image_id"], stored)


# ------------------------------------------------------------------------------ resized images
def _png(path: Path, width: int, height: int) -> Path:
    Image.new("RGB", (width, height), (10, 200, 30)).save(path)
    return path


def test_resized_shape_is_what_preprocess_resizes_to() -> None:
    from torchvision.transforms import InterpolationMode
    from torchvision.transforms import functional as TF

    for w, h, size in ((40, 7, 16), (7, 40, 32), (33, 33, 24), (1000, 3, 8)):
        got = TF.resize(Image.new("RGB", (w, h)), data.resize_target(size), interpolation=InterpolationMode.BICUBIC)
        assert got.size == data.resized_shape(w, h, size), (w, h, size)


def test_a_long_strip_is_bounded_by_its_resized_pixels(tmp_path: Path, monkeypatch) -> None:
    """A strip under the decode bound whose short-side resize would be over it is corrupt: skipped,
    or with on_corrupt fail refused naming it, before any pixel is resized."""
    monkeypatch.setattr(data, "MAX_IMAGE_PIXELS", 10_000)
    folder = tmp_path / "imgs"
    folder.mkdir()
    _png(folder / "a_ok.png", 40, 40)
    _png(folder / "b_strip.png", 2000, 1)  # 2,000 pixels; resized for 32 px: 74,000 x 37
    images = load_folder(folder, 32)
    assert images.names == ["a_ok.png"]
    assert [Path(p).name for p, _ in images.skipped] == ["b_strip.png"] and "74000x37" in images.skipped[0][1]
    with pytest.raises(DataError, match=r"b_strip\.png.*74000x37.*MAX_IMAGE_PIXELS"):
        load_folder(folder, 32, on_corrupt="fail")
    with pytest.raises(ValueError, match="resized"):
        data.preprocess(Image.new("RGB", (2000, 1)), 32)  # every caller of preprocess is bounded


# ------------------------------------------------------------------------------------ archives
def _zeros_member(name: str, size: int) -> tuple[tarfile.TarInfo, bytes]:
    return tarfile.TarInfo(name), bytes(size)


def test_an_archive_that_expands_far_beyond_its_size_is_refused(tmp_path: Path, monkeypatch) -> None:
    """4 MB of zeros in a few kB of gzip: over 20x the archive and the 1 MiB floor set here; nothing
    is left in the cache, and the knob lets a trusted archive through."""
    monkeypatch.setattr(archives, "MIN_EXTRACT_BYTES", 1 << 20)
    monkeypatch.delenv(archives.LIMIT_ENV, raising=False)
    bomb = _tar(tmp_path / "bomb.tar.gz", _good_members() + [_zeros_member("train/c0/zeros.png", 4 << 20)])
    assert bomb.stat().st_size < 50_000
    cache = tmp_path / "cache"
    with pytest.raises(ArchiveError) as err:
        extract_archive(bomb, cache)
    msg = str(err.value)
    assert "bomb.tar.gz" in msg and "more than" in msg and archives.LIMIT_ENV in msg and "zeros.png" in msg, msg
    assert list(cache.iterdir()) == []  # no half extraction
    monkeypatch.setenv(archives.LIMIT_ENV, "0.01")
    assert (extract_archive(bomb, cache) / "train" / "c0" / "zeros.png").stat().st_size == 4 << 20
    monkeypatch.setenv(archives.LIMIT_ENV, "lots")
    with pytest.raises(ArchiveError, match=f"{archives.LIMIT_ENV}=lots is not a number"):
        archives.extract_limit(1)


def test_archive_member_size_and_count_are_bounded(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(archives, "MAX_MEMBER_BYTES", 5000)  # the good members' PNGs are under 5 kB
    big = _tar(tmp_path / "big.tar.gz", _good_members() + [(tarfile.TarInfo("val/c1/big.bin"), b"\1" * 5001)])
    with pytest.raises(ArchiveError, match=r"big\.bin holds 5,001 bytes.*MAX_MEMBER_BYTES"):
        extract_archive(big, tmp_path / "cache")
    monkeypatch.setattr(archives, "MAX_MEMBER_BYTES", 1 << 30)
    monkeypatch.setattr(archives, "MAX_MEMBERS", 10)
    many = _tar(tmp_path / "many.tar.gz", _good_members() + [(tarfile.TarInfo(f"val/e{i}"), b"") for i in range(5)])
    with pytest.raises(ArchiveError, match=r"more than 10 members.*MAX_MEMBERS"):
        extract_archive(many, tmp_path / "cache")
    assert list((tmp_path / "cache").iterdir()) == []


def test_a_hard_link_counts_its_target(tmp_path: Path, monkeypatch) -> None:
    """Where a link cannot be made tarfile writes a copy: each link costs its target's bytes."""
    monkeypatch.setattr(archives, "MIN_EXTRACT_BYTES", 300_000)
    monkeypatch.setattr(archives, "MAX_EXPANSION", 1)
    members = _good_members() + [(tarfile.TarInfo("val/c0/data.bin"), np.random.default_rng(0).bytes(100_000))]
    for i in range(5):
        link = tarfile.TarInfo(f"val/c0/link{i}.bin")
        link.type, link.linkname = tarfile.LNKTYPE, "val/c0/data.bin"
        members.append((link, b""))
    with pytest.raises(ArchiveError, match="link"):
        extract_archive(_tar(tmp_path / "links.tar.gz", members), tmp_path / "cache")


# ------------------------------------------------------------------------------ tokens per image
def test_too_many_tokens_per_image_is_refused_before_any_work(tmp_path: Path, capsys) -> None:
    with pytest.raises(ValueError, match=r"65,537 tokens per image.*4x4 px in 1024x1024 px.*MAX_TOKENS"):
        create_model("mjp_vit_cifar_patch4_32", img_size=1024, patch_size=4, depth=1)
    kwargs = {"img_size": 1024, "patch_size": 4, "embed_dim": 48, "depth": 1, "num_heads": 1}
    models = [{"name": "Big", "arch": "mjp_vit_cifar_patch4_32", "variant": "plain", "kwargs": kwargs}]
    out = tmp_path / "out"
    assert cli(small_config(tmp_path, models=models, **{"data.image_size": 1024}), out) == 3
    one_line_error(capsys.readouterr().err, "Big", "65,537 tokens", "patch_size")
    assert not (out / "results.jsonl").exists()


def test_every_shipped_preset_is_within_the_token_bound() -> None:
    for preset in sorted((ROOT / "configs").glob("*.yaml")):
        cfg = validate(C.load_config(preset))
        for index in range(len(cfg.models)):
            spec = model_spec(cfg, index)
            with torch.device("meta"):
                model = create_model(spec["arch"], **spec_kwargs(spec))  # raises over the bound
            tokens = model.patch_embed.num_patches + model.num_prefix_tokens
            assert tokens <= MAX_TOKENS, (preset.name, spec["name"], tokens)
    assert yaml.safe_load((ROOT / "configs" / "paper.yaml").read_text())["data"]["image_size"] == 224
