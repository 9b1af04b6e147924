"""Fault injection and fuzzing: every input a user or a hostile file can give ends in a one-line
error with its exit status (benchmark/errors.py), or works; nothing is written through a symbolic
link or into a folder that is not a run; no temporary file is left behind.

One test per cause (issue 32), on tiny runs (1 model row of a depth-2 32 px ViT, 2 embedded images,
2 clients x 1 round, setting a, LPIPS off: ~2 s each), then property-based fuzzing (Hypothesis) of
config values and image files, bounded in examples and time. New causes found later go here.
"""
from __future__ import annotations

import io
import json
import os
import signal
import struct
import subprocess
import sys
import tarfile
import time
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from PIL import Image

from helpers import tiny_config, write_config

ROOT = Path(__file__).resolve().parents[1]
#: The tiny run of every test: 1 row, 2 images, 2 clients x 1 round, setting a, no LPIPS.
SMALL = {"federation.rounds": 1, "settings": ["a"], "data.num_images": 2, "metrics": {"lpips": False},
         "report": {"grid_images": 2, "tile": 32}}


def small_config(folder: Path, **changes) -> Path:
    models = changes.pop("models", [dict(tiny_config()["models"][0])])
    return write_config(folder, **{**SMALL, "models": models, **changes})


def cli(config: Path, output: Path, *extra: str) -> int:
    from run_benchmark import main

    return main(["--config", str(config), "--output", str(output), "--no-progress", *extra])


def _without_logging_errors(err: str) -> str:
    """stderr without the "--- Logging error ---" reports of a log handler that still holds a
    stream an earlier test captured (Flower's own handler under pytest; not the product's output)."""
    import re

    return re.sub(r"--- Logging error ---.*?Arguments: [^\n]*\n", "", err, flags=re.S)


def one_line_error(err: str, *words: str) -> str:
    """The stderr of a refused run: an ``error:`` line naming ``words``, no traceback."""
    err = _without_logging_errors(err)
    assert "Traceback" not in err, err
    line = [ln for ln in err.splitlines() if ln.startswith("error: ")]
    assert len(line) == 1, err
    for w in words:
        assert w in line[0], (w, line[0])
    return line[0]


def temp_files(folder: Path) -> list[str]:
    """Temporary files a write may leave behind (``.<name>.<hex>.tmp``, ``.<name>.tmp-PID``)."""
    return [str(p) for p in folder.rglob(".*") if ".tmp" in p.name]


# ------------------------------------------------------------------------------ the output folder
def test_symlinked_lock_is_never_followed(tmp_path: Path, capsys) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    out = tmp_path / "out"
    out.mkdir()
    (out / ".lock").symlink_to(victim)
    assert cli(small_config(tmp_path), out) == 6
    one_line_error(capsys.readouterr().err, ".lock", "symbolic link")
    assert victim.read_text() == "precious\n"
    assert sorted(os.listdir(out)) == [".lock"]
    # the lock itself refuses a link even when called directly (no check before it)
    from benchmark.errors import OutputConflictError
    from benchmark.store import RunFolder

    with pytest.raises(OutputConflictError, match="symbolic link"):
        RunFolder(out).lock()
    assert victim.read_text() == "precious\n"


def test_symlinked_table_in_a_finished_run_is_refused(tmp_path: Path, capsys) -> None:
    config, out = small_config(tmp_path), tmp_path / "out"
    assert cli(config, out) == 0
    victim = tmp_path / "victim.md"
    victim.write_text("precious\n")
    (out / "table.md").unlink()
    (out / "table.md").symlink_to(victim)
    assert cli(config, out) == 6
    one_line_error(capsys.readouterr().err, "table.md", "symbolic link")
    assert victim.read_text() == "precious\n"
    # a link below images/ too
    (out / "table.md").unlink()
    png = next((out / "images").rglob("*.png"))
    png.unlink()
    png.symlink_to(victim)
    assert cli(config, out) == 6
    assert victim.read_text() == "precious\n"


def test_output_folder_that_is_a_link_is_refused(tmp_path: Path, capsys) -> None:
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real, target_is_directory=True)
    assert cli(small_config(tmp_path), tmp_path / "link") == 6
    one_line_error(capsys.readouterr().err, "link", "symbolic link")
    assert os.listdir(real) == []


def test_folder_that_is_not_a_run_is_refused_and_force_writes_into_it(tmp_path: Path, capsys) -> None:
    out = tmp_path / "home"
    out.mkdir()
    (out / "table.csv").write_text("my own table\n")
    (out / "notes.txt").write_text("keep me\n")
    config = small_config(tmp_path)
    assert cli(config, out) == 6
    one_line_error(capsys.readouterr().err, str(out), "not a fedmjp run folder", "--force")
    assert sorted(os.listdir(out)) == ["notes.txt", "table.csv"]
    assert (out / "table.csv").read_text() == "my own table\n"
    # --force: the run writes there (its own names replaced), other files are kept
    assert cli(config, out, "--force") == 0
    assert (out / "notes.txt").read_text() == "keep me\n"
    assert (out / "table.csv").read_text() != "my own table\n" and (out / "config.yaml").is_file()
    # now a run folder: the same command resumes without --force
    assert cli(config, out) == 0
    from run_benchmark import parser

    assert "--force" in parser().format_help()


def test_output_under_a_file_or_equal_to_a_file(tmp_path: Path, capsys) -> None:
    config = small_config(tmp_path)
    afile = tmp_path / "afile"
    afile.write_text("x")
    assert cli(config, afile / "out") == 10
    one_line_error(capsys.readouterr().err, str(afile), "not a folder")
    assert cli(config, afile) == 10
    one_line_error(capsys.readouterr().err, str(afile), "is a file")
    assert afile.read_text() == "x"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_read_only_output(tmp_path: Path, capsys) -> None:
    config, out = small_config(tmp_path), tmp_path / "out"
    assert cli(config, out) == 0
    for folder in (out, tmp_path / "ro"):
        folder.mkdir(exist_ok=True)
        folder.chmod(0o555)
        try:
            target = folder if folder == out else folder / "new"
            assert cli(config, target) == 10
            one_line_error(capsys.readouterr().err, "read-only")
        finally:
            folder.chmod(0o755)


def test_unwritable_output_is_one_line_with_exit_10(tmp_path: Path, capsys, monkeypatch) -> None:
    """The write path itself (what a read-only folder or a full disk does to ``os.open``), also for
    root, which no permission stops: a one-line error, no temporary file."""
    import errno

    from benchmark import store

    config, out = small_config(tmp_path), tmp_path / "out"
    real_open = os.open

    def full_disk(path, flags, *args):
        if str(path).startswith(str(out)) and flags & os.O_CREAT and "config.yaml" in str(path):
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real_open(path, flags, *args)

    monkeypatch.setattr(store.os, "open", full_disk)
    assert cli(config, out) == 10
    one_line_error(capsys.readouterr().err, "config.yaml", "No space left on device")
    assert temp_files(out) == []
    monkeypatch.undo()
    assert cli(config, out) == 0  # the corrected situation: the same command runs


@pytest.mark.parametrize("content", [b"key: [unclosed\n", b"- a\n- b\n", b"\x00\xff\xfe binary"])
def test_damaged_config_yaml(tmp_path: Path, capsys, content: bytes) -> None:
    config, out = small_config(tmp_path), tmp_path / "out"
    assert cli(config, out) == 0
    (out / "config.yaml").write_bytes(content)
    before = (out / "results.jsonl").read_text()
    assert cli(config, out) == 6
    one_line_error(capsys.readouterr().err, "config.yaml", "damaged", "--output")
    assert (out / "results.jsonl").read_text() == before


@pytest.mark.parametrize("text", ["not json", "[1, 2]"])
def test_damaged_provenance_json(tmp_path: Path, capsys, text: str) -> None:
    config, out = small_config(tmp_path), tmp_path / "out"
    assert cli(config, out) == 0
    (out / "provenance.json").write_text(text)
    assert cli(config, out) == 6
    one_line_error(capsys.readouterr().err, "provenance.json", "damaged", "--output")
    (out / "provenance.json").unlink()  # what the message offers: resume without the record
    assert cli(config, out) == 0


def test_relative_output_in_a_config_is_relative_to_the_project_root(tmp_path: Path, monkeypatch) -> None:
    import argparse

    from benchmark.config import BenchmarkConfig
    from run_benchmark import output_folder

    monkeypatch.chdir(tmp_path)
    args, cfg = argparse.Namespace(output=None), BenchmarkConfig(output="runs/x")
    assert output_folder(args, cfg) == ROOT / "runs" / "x"
    assert output_folder(argparse.Namespace(output="y"), cfg) == tmp_path / "y"


# ------------------------------------------------------------------------------------ image archives
def _tar(path: Path, members: list[tuple[tarfile.TarInfo, bytes]]) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for info, data in members:
            info.size = len(data) if info.isfile() else 0
            tar.addfile(info, io.BytesIO(data) if info.isfile() else None)
    return path


def _png_bytes(seed: int = 0) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 255, (40, 40, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def _good_members() -> list[tuple[tarfile.TarInfo, bytes]]:
    return [(tarfile.TarInfo(f"{split}/c{c}/{i}.png"), _png_bytes(c * 10 + i))
            for split in ("train", "val") for c in range(2) for i in range(2)]


def _archive_case(tmp_path: Path, name: str) -> Path:
    if name == "dotdot":
        return _tar(tmp_path / "a.tar.gz", _good_members() + [(tarfile.TarInfo("../../evil.txt"), b"x")])
    if name == "absolute-symlink":
        link = tarfile.TarInfo("val/c0/link.png")
        link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
        return _tar(tmp_path / "a.tar.gz", _good_members() + [(link, b"")])
    if name == "absolute-name":
        return _tar(tmp_path / "a.tar.gz", _good_members() + [(tarfile.TarInfo("/tmp/evil.txt"), b"x")])
    if name == "device":
        dev = tarfile.TarInfo("val/c0/dev")
        dev.type = tarfile.CHRTYPE
        return _tar(tmp_path / "a.tar.gz", _good_members() + [(dev, b"")])
    if name == "random-bytes":
        path = tmp_path / "a.tar.gz"
        path.write_bytes(np.random.default_rng(0).integers(0, 256, 5000, dtype=np.uint8).tobytes())
        return path
    if name == "no-train-val":
        return _tar(tmp_path / "a.tar.gz", [(tarfile.TarInfo(f"images/{i}.png"), _png_bytes(i)) for i in range(3)])
    raise AssertionError(name)


@pytest.mark.parametrize("case, words", [("dotdot", ["unsafe member", "evil"]),
                                         ("absolute-symlink", ["unsafe member", "link.png"]),
                                         ("absolute-name", ["unsafe member", "evil"]),
                                         ("device", ["unsafe member"]),
                                         ("random-bytes", ["not a readable tar archive"]),
                                         ("no-train-val", ["no train/ folder"])])
def test_unusable_archives_exit_4_and_leave_nothing(tmp_path: Path, capsys, monkeypatch, case, words) -> None:
    cache = tmp_path / "cache"
    monkeypatch.setenv("FEDMJP_CACHE", str(cache))
    archive = _archive_case(tmp_path, case)
    out = tmp_path / "out"
    assert cli(small_config(tmp_path), out, "--images", str(archive)) == 4
    one_line_error(capsys.readouterr().err, str(archive), *words)
    assert not out.exists()
    assert not (tmp_path / "evil.txt").exists() and not (tmp_path.parent / "evil.txt").exists()
    left = list((cache / "data").iterdir()) if (cache / "data").is_dir() else []
    assert left == [], left  # no .name.tmpPID folder, no half extraction


def test_good_archive_is_extracted_once(tmp_path: Path, monkeypatch) -> None:
    from fedmjp.data import load_images

    monkeypatch.setenv("FEDMJP_CACHE", str(tmp_path / "cache"))
    archive = _tar(tmp_path / "ok.tar.gz", _good_members())
    images = load_images(archive, 32, 4, 10)
    assert len(images) == 4 and images.names[0].startswith("c0/")
    assert [p.name.startswith(".") for p in (tmp_path / "cache" / "data").iterdir()] == [False]


def test_cache_that_is_a_file(tmp_path: Path, capsys, monkeypatch) -> None:
    afile = tmp_path / "cachefile"
    afile.write_text("x")
    monkeypatch.setenv("FEDMJP_CACHE", str(afile))
    archive = _tar(tmp_path / "ok.tar.gz", _good_members())
    assert cli(small_config(tmp_path), tmp_path / "out", "--images", str(archive)) == 4
    one_line_error(capsys.readouterr().err, "FEDMJP_CACHE", str(afile))
    assert afile.read_text() == "x"


# ------------------------------------------------------------------------------------------ images
def _png_header_only(path: Path, width: int, height: int) -> Path:
    """A valid-looking PNG whose header claims ``width`` x ``height`` 8-bit grey pixels (a few bytes
    of data): what a decompression bomb looks like before it is decoded."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\x00" * 64))
                     + chunk(b"IEND", b""))
    return path


@pytest.mark.parametrize("side", [100_000, 10_000])  # above Pillow's own error limit; between ours and it
def test_decompression_bomb_is_a_corrupt_file(tmp_path: Path, side: int) -> None:
    from fedmjp.data import DataError, load_folder

    folder = tmp_path / "imgs"
    folder.mkdir()
    (folder / "a.png").write_bytes(_png_bytes(1))
    _png_header_only(folder / "b_bomb.png", side, side)
    (folder / "c.png").write_bytes(_png_bytes(2))
    t0 = time.perf_counter()
    images = load_folder(folder, 32, on_corrupt="skip")
    assert time.perf_counter() - t0 < 10
    assert images.names == ["a.png", "c.png"]
    assert "b_bomb.png" in images.skipped[-1][0] and "pixels" in images.skipped[-1][1] + "pixels"
    with pytest.raises(DataError, match="b_bomb.png"):
        load_folder(folder, 32, on_corrupt="fail")


def test_decompression_bomb_under_on_corrupt_skip_does_not_stop_a_run(tmp_path: Path) -> None:
    folder = tmp_path / "imgs"
    folder.mkdir()
    for i in range(2):
        (folder / f"{i}.png").write_bytes(_png_bytes(i))
    _png_header_only(folder / "2_bomb.png", 100_000, 100_000)
    assert cli(small_config(tmp_path), tmp_path / "out", "--images", str(folder), "--on-corrupt", "skip") == 0


def test_16_bit_and_other_modes_are_scaled_not_clipped(tmp_path: Path) -> None:
    import skimage.data

    from fedmjp.data import load_folder, preprocess

    grey = skimage.data.camera()  # uint8 photograph
    ref = preprocess(Image.fromarray(grey), 64)
    folder = tmp_path / "imgs"
    folder.mkdir()
    Image.fromarray((grey.astype(np.uint16) * 257)).save(folder / "a16.png")  # I;16 in Pillow
    Image.fromarray(grey.astype(np.float32) / 255.0, "F").save(folder / "b_float.tiff")
    Image.fromarray(grey.astype(np.int32) * 257, "I").save(folder / "c_int.tiff")
    Image.fromarray(skimage.data.astronaut()).convert("CMYK").save(folder / "d_cmyk.jpg")
    images = load_folder(folder, 64, on_corrupt="fail")
    for i in range(3):
        assert (images.images[i] - ref).abs().max() <= 1.5 / 255, images.names[i]
    assert float(images.images[0].mean()) < 0.8  # not all white, as 16-bit values clipped at 255 would be
    # every mode Pillow can hold: [3, 64, 64] in [0, 1]
    for mode in ("I", "F", "I;16", "I;16B", "LA", "La", "P", "PA", "CMYK", "1", "RGBa", "YCbCr", "LAB", "HSV"):
        t = preprocess(Image.new(mode, (50, 70)), 64)
        assert t.shape == (3, 64, 64) and 0 <= float(t.min()) <= float(t.max()) <= 1, mode


def test_long_image_names_are_stored(tmp_path: Path) -> None:
    folder = tmp_path / "imgs"
    folder.mkdir()
    names = ["a" * 236 + ".png", "a" * 235 + "b.png"]  # 240 characters, the same first 235
    for i, name in enumerate(names):
        (folder / name).write_bytes(_png_bytes(i))
    out = tmp_path / "out"
    assert cli(small_config(tmp_path), out, "--images", str(folder)) == 0
    stored = [p for p in (out / "images").rglob("*.png")]
    assert len(stored) == 4 and all(len(p.name) <= 255 for p in stored)
    assert len({p.name for p in stored}) == 4  # distinct names stay distinct
    assert (out / "grid_a.png").is_file()


def test_model_names_that_share_a_file_name_are_refused(tmp_path: Path, capsys) -> None:
    row = tiny_config()["models"][0]
    config = small_config(tmp_path, models=[dict(row, name="X Y"), dict(row, name="X_Y")])
    out = tmp_path / "out"
    assert cli(config, out) == 3
    one_line_error(capsys.readouterr().err, "'X Y'", "'X_Y'", "rename")
    assert not out.exists()


# ---------------------------------------------------------------------------------- failed runs
def test_failed_run_is_retried_and_the_fixed_checkpoint_runs(tmp_path: Path, capsys) -> None:
    from benchmark import config as C
    from benchmark.entries import model_spec
    from benchmark.store import read_jsonl
    from benchmark.validation import validate
    from fedmjp.factory import build_model

    row = dict(tiny_config()["models"][0])
    spec = model_spec(validate(C.load_config(small_config(tmp_path / "spec"))), 0)
    state = build_model(dict(spec, april=None)).state_dict()
    ckpt = tmp_path / "model.pth"
    # finite weights whose forward pass overflows: every client's update is non-finite (a NaN
    # checkpoint is refused when it is read, exit 5, tests/test_non_finite_values.py)
    torch.save({k: torch.full_like(v, 3e38) if v.is_floating_point() else v for k, v in state.items()}, ckpt)
    config = small_config(tmp_path, models=[dict(row, checkpoint=str(ckpt))], **{"federation.precision": "float32"})
    out = tmp_path / "out"
    assert cli(config, out) == 7
    assert all(r["failed"] for r in read_jsonl(out / "results.jsonl"))
    assert cli(config, out) == 7  # a failed run is not a finished run: its rows are tried again
    assert "0 new" not in capsys.readouterr().out
    torch.save(state, ckpt)  # the fixed checkpoint (another sha256): the folder takes it
    assert cli(config, out) == 0
    rows = read_jsonl(out / "results.jsonl")
    assert len(rows) == 2 and not any(r["failed"] for r in rows)
    assert len(read_jsonl(out / "results.retried.jsonl")) == 4


def test_condition_failures_stay_failed(tmp_path: Path) -> None:
    """An attack's condition failure is a result, kept on resume (only run failures are retried)."""
    from benchmark.store import is_run_failure

    assert not is_run_failure({"failed": True, "reason": "rank condition not met"})
    assert is_run_failure({"failed": True, "reason": "client failed: injected failure"})
    config, out = small_config(tmp_path), tmp_path / "out"
    assert cli(config, out, "--set", "federation.options={fail-partition: 1}") == 7  # rows to resume
    lines = (out / "results.jsonl").read_text()
    assert cli(config, out, "--set", "federation.options={fail-partition: 1}") == 7
    rows = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and sum(r["failed"] for r in rows) == 1  # retried, failed again, not doubled
    assert len(lines.splitlines()) == 2


@pytest.mark.parametrize("device", ["meta", "mps", "xla", "cuda:7"])
def test_bad_device_is_refused_before_anything_is_written(tmp_path: Path, capsys, device: str) -> None:
    if device == "mps" and torch.backends.mps.is_available():
        pytest.skip("this torch has MPS")
    if device == "cuda:7" and torch.cuda.device_count() > 7:
        pytest.skip("this machine has 8 CUDA devices")
    config, out = small_config(tmp_path), tmp_path / "out"
    assert cli(config, out, "--device", device) == 3
    one_line_error(capsys.readouterr().err, repr(device))
    assert not out.exists()
    assert cli(config, out, "--device", "cpu") == 0
    assert cli(config, out, "--device", "auto") == 0 or torch.cuda.is_available()  # same device: resumes


def test_huge_seed_names_the_key(tmp_path: Path, capsys) -> None:
    out = tmp_path / "out"
    assert cli(small_config(tmp_path), out, "--seed", str(10**20)) == 3
    one_line_error(capsys.readouterr().err, "'seed'", "4294967295")
    assert cli(small_config(tmp_path), out, "--set", f"models.0.seed={2**64}") == 3
    one_line_error(capsys.readouterr().err, "'models.0.seed'")
    assert not out.exists()


def _unsafe_pickle(path: Path) -> Path:
    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {path.parent / 'pwned'}",))

    torch.save({"weight": Payload()}, path)
    return path


@pytest.mark.parametrize("kind", ["pickle", "random", "wrong"])
def test_bad_checkpoint_and_lpips_files(tmp_path: Path, capsys, kind: str) -> None:
    bad = tmp_path / "bad.pth"
    if kind == "pickle":
        _unsafe_pickle(bad)
    elif kind == "random":
        bad.write_bytes(np.random.default_rng(0).integers(0, 256, 3000, dtype=np.uint8).tobytes())
    else:
        torch.save(torch.nn.Linear(3, 3).state_dict(), bad)
    row = dict(tiny_config()["models"][0])
    out = tmp_path / "out"
    assert cli(small_config(tmp_path, models=[dict(row, checkpoint=str(bad))]), out) == 5
    line = one_line_error(capsys.readouterr().err, str(bad))
    assert "weights_only" not in line and "Re-running" not in line
    config = small_config(tmp_path / "c2", metrics={"lpips": True, "lpips_backbone": str(bad)})
    assert cli(config, out) == 3
    line = one_line_error(capsys.readouterr().err, str(bad), "metrics.lpips_backbone")
    assert "weights_only" not in line and "Re-running" not in line
    assert not out.exists() and not (tmp_path / "pwned").exists()


def test_unreachable_ray_address_is_a_quick_clear_error(tmp_path: Path, capsys) -> None:
    from proc_utils import free_port

    out = tmp_path / "out"
    t0 = time.perf_counter()
    address = f"ray://127.0.0.1:{free_port()}"
    assert cli(small_config(tmp_path), out, "--ray-address", address) == 3
    assert time.perf_counter() - t0 < 30
    one_line_error(capsys.readouterr().err, address)
    assert not out.exists()


# ------------------------------------------------------------------------------ processes and limits
def _script(output: Path, config: Path, *extra: str) -> list[str]:
    return [sys.executable, str(ROOT / "run_benchmark.py"), "--config", str(config), "--output", str(output),
            "--no-progress", *extra]


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1"}


@pytest.mark.slow
@pytest.mark.parametrize("what", ["config", "rows"])  # the limit: config.yaml cannot be written; results.jsonl outgrows it
def test_file_size_limit(tmp_path: Path, what: str) -> None:
    import math
    import resource

    import torch

    from benchmark.config import load_config
    from benchmark.provenance import collect
    from benchmark.validation import validate

    # ~1.2 kB per row (2 clients x 1 image per round); the "rows" limit lets config.yaml and
    # provenance.json (which grows with the project's files) through, and then rows outgrow it
    config = small_config(tmp_path)
    provenance = len(json.dumps(collect(validate(load_config(config)), torch.device("cpu")), indent=2, sort_keys=True))
    limit = 1 if what == "config" else provenance + 1500
    rounds = max(4, math.ceil(2 * limit / 1200 / 2))
    config, out = small_config(tmp_path, **{"data.num_images": 2 * rounds, "federation.rounds": rounds}), tmp_path / "out"

    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    proc = subprocess.run(_script(out, config), capture_output=True, text=True, cwd=ROOT, env=_env(),
                          preexec_fn=cap, timeout=300)
    assert proc.returncode == 10, proc.stderr[-3000:]
    line = one_line_error(proc.stderr, "File too large", "resume")
    assert temp_files(out) == [], line
    rows_before = (out / "results.jsonl").read_text() if (out / "results.jsonl").exists() else ""
    assert all(json.loads(x) for x in rows_before.splitlines()[:-1])  # rows kept (the last may be torn)
    if what == "rows":
        assert len(rows_before.splitlines()) >= 2, line
    assert cli(config, out) == 0  # the limit lifted: the same command resumes (in this process: faster)
    assert temp_files(out) == []
    from benchmark.store import read_jsonl

    assert len(read_jsonl(out / "results.jsonl")) == 2 * rounds


@pytest.mark.slow
def test_sigterm_keeps_rows_and_says_how_to_resume(tmp_path: Path) -> None:
    config, out = small_config(tmp_path, **{"federation.rounds": 30}), tmp_path / "out"
    proc = subprocess.Popen(_script(out, config), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=ROOT, env=_env())
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None and not (out / "results.jsonl").exists():
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err[-3000:]
    assert "terminated (SIGTERM): finished rows are kept" in err and "to resume" in err
    assert "Traceback" not in err
    assert (out / "results.jsonl").read_text().endswith("\n")


# ------------------------------------------------------------------------------ property-based fuzz
hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

#: Keys and YAML texts a hostile or careless config may hold.
_KEYS = ["seed", "gamma", "device", "output", "data.num_images", "data.image_size", "data.source",
         "data.on_corrupt", "federation.rounds", "federation.clients", "federation.lr", "federation.partition",
         "models.0.name", "models.0.seed", "models.0.checkpoint", "models.0.kwargs", "attack.name",
         "attack.options", "report.tile", "report.grid_images", "metrics.lpips_backbone", "attacks", "settings"]
_YAML = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(lambda f: yaml.safe_dump(f).split("\n")[0]),
    st.text(max_size=30).map(lambda s: json.dumps(s)),
    st.sampled_from(["[1, 2]", "{a: 1}", "~", "true", "''", "[unclosed", "!!python/object:os.system x",
                     "'../../etc'", "'/dev/zero'", "{name: x}", "[{name: nope}]", "all", "'X Y'"]),
)


@settings(max_examples=50, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(key=st.sampled_from(_KEYS), text=_YAML)
def test_fuzz_config_values_give_a_config_error_or_a_config(key: str, text: str) -> None:
    """Any value for any key: a validated config, or a ConfigError (exit status 3) naming the key,
    never another exception (the CLI would print a traceback)."""
    from benchmark import config as C
    from benchmark.store import check_names
    from benchmark.validation import validate

    base = C.apply_overrides(C.conform(tiny_config()), [])
    try:
        cfg = validate(C.apply_overrides(base, [f"{key}={text}"]))
        check_names(cfg)
    except C.ConfigError as err:
        assert str(err).strip() and "\n" not in str(err).strip(), str(err)


_MODES = st.sampled_from(["1", "L", "P", "RGB", "RGBA", "CMYK", "LA", "I", "F", "I;16", "YCbCr"])


@settings(max_examples=50, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(data=st.data(), mode=_MODES, fmt=st.sampled_from(["PNG", "TIFF", "JPEG", "BMP", "GIF", "raw"]),
       truncate=st.integers(min_value=0, max_value=400))
def test_fuzz_image_files_load_or_are_skipped(tmp_path_factory, data, mode: str, fmt: str, truncate: int) -> None:
    """Any small image in any mode and format, whole or cut short, or random bytes: it loads as
    [3, 32, 32] in [0, 1] or is skipped as corrupt; nothing else is raised."""
    from fedmjp.data import load_folder

    folder = tmp_path_factory.mktemp("fuzz")
    w = data.draw(st.integers(1, 24))
    h = data.draw(st.integers(1, 24))
    seed = data.draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    if fmt == "raw":
        payload = rng.integers(0, 256, max(truncate, 1), dtype=np.uint8).tobytes()
        suffix = ".png"
    else:
        img = Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).convert(mode) \
            if mode not in ("I", "F", "I;16") else Image.fromarray(
                (rng.random((h, w)) * {"I": 2**20, "F": 1e6, "I;16": 65535}[mode]).astype(
                    {"I": np.int32, "F": np.float32, "I;16": np.uint16}[mode]))
        buf = io.BytesIO()
        try:
            img.save(buf, fmt)
        except (OSError, ValueError, KeyError):
            return  # Pillow cannot write this mode in this format
        payload = buf.getvalue()
        if truncate and truncate < len(payload):
            payload = payload[:truncate]
        suffix = {"PNG": ".png", "TIFF": ".tiff", "JPEG": ".jpg", "BMP": ".bmp", "GIF": ".gif"}[fmt]
    (folder / f"x{suffix}").write_bytes(payload)
    (folder / "y.png").write_bytes(_png_bytes(seed % 7))
    images = load_folder(folder, 32, on_corrupt="skip")
    assert images.images.shape[1:] == (3, 32, 32)
    assert float(images.images.min()) >= 0 and float(images.images.max()) <= 1
    assert "y.png" in images.names and len(images.names) + len(images.skipped) == 2


def test_report_and_sweep_outputs_never_written_through_links(tmp_path):
    """Tables, grids and plots go through the store's atomic writer: a link planted where a table or
    plot will be written is replaced by the file, its target left as it was."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from benchmark.store import append_line, save_figure, write_text

    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    folder = tmp_path / "run"
    folder.mkdir()
    for name in ("table.md", "plot.png", "utility.jsonl"):
        (folder / name).symlink_to(victim)
    write_text(folder / "table.md", "| a |\n")
    fig = plt.figure()
    save_figure(fig, folder / "plot.png", dpi=20)
    plt.close(fig)
    assert victim.read_text() == "precious"
    assert not (folder / "table.md").is_symlink() and (folder / "table.md").read_text() == "| a |\n"
    assert not (folder / "plot.png").is_symlink() and (folder / "plot.png").read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(OSError):
        append_line(folder / "utility.jsonl", "{}")
    assert victim.read_text() == "precious"
