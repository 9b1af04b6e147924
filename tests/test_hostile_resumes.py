"""A resume never mixes results: rows rebuilt from other images or by other code refuse the resume
(exit 6) naming what differs, unless forced (which records it); a display-only key (report.tile)
resumes without computing a row again. On the tiny runs of tests/test_hostile_inputs.py;
docs/security.md describes the rules tested.
"""
from __future__ import annotations

from pathlib import Path

from PIL import Image

from test_hostile_inputs import cli, one_line_error, small_config


# ------------------------------------------------------------------ mixed results after a code change
def test_a_resume_on_changed_images_is_refused(tmp_path: Path, capsys) -> None:
    """The attack images' digest (decoded pixels, names, labels) is in provenance.json: replacing one
    file of the image folder between a run and its resume refuses the resume (exit 6) naming the
    images, so no table mixes rows rebuilt from two image sets."""
    import json

    import numpy as np

    folder = tmp_path / "images"
    folder.mkdir()
    rng = np.random.default_rng(0)
    for i in range(2):
        Image.fromarray((rng.random((16, 16, 3)) * 255).astype("uint8")).save(folder / f"{i}.png")
    config, out = small_config(tmp_path), tmp_path / "out"
    assert cli(config, out, "--dry-run", "--images", str(folder)) == 0
    assert json.loads((out / "provenance.json").read_text())["images"]["count"] == 2
    assert cli(config, out, "--dry-run", "--images", str(folder)) == 0  # same files: resumes
    Image.fromarray((rng.random((16, 16, 3)) * 255).astype("uint8")).save(folder / "1.png")
    capsys.readouterr()
    assert cli(config, out, "--dry-run", "--images", str(folder)) == 6
    one_line_error(capsys.readouterr().err, "images.sha256", "--force")


def test_a_resume_by_changed_code_is_refused_naming_the_file_unless_forced(tmp_path: Path, capsys) -> None:
    """provenance.json holds a fingerprint of every source file of the project; rows made by other
    code (here: a stored record whose attacks/closed_form/april.py differs, dirty flag equal) refuse the resume
    and name the file; --force resumes and records what differed."""
    import json

    config, out = small_config(tmp_path), tmp_path / "out"
    assert cli(config, out, "--dry-run") == 0
    record = json.loads((out / "provenance.json").read_text())
    assert record["code"]["files"]["attacks/closed_form/april.py"] and len(record["code"]["fingerprint"]) == 64
    assert not any(name.startswith("tests/") for name in record["code"]["files"])  # a test edit changes nothing
    record["code"]["files"]["attacks/closed_form/april.py"] = "0" * 16
    record["code"]["fingerprint"] = "0" * 64
    (out / "provenance.json").write_text(json.dumps(record))
    capsys.readouterr()
    assert cli(config, out, "--dry-run") == 6
    one_line_error(capsys.readouterr().err, "code.files.attacks/closed_form/april.py", "--force")
    assert cli(config, out, "--dry-run", "--force") == 0
    now = json.loads((out / "provenance.json").read_text())
    assert now["code"]["fingerprint"] != "0" * 64
    assert any("attacks/closed_form/april.py" in d for d in now["resumes"][-1]["forced_differences"])
    assert cli(config, out, "--dry-run") == 0  # the record now describes this code
    assert len(json.loads((out / "provenance.json").read_text())["resumes"]) == 3


def test_a_sweep_point_of_other_code_resumes_with_force(tmp_path: Path, capsys) -> None:
    """A sweep's point folders carry their own provenance: rows of other code refuse the resume with
    the message's remedy, --force, and --force reaches every point (it resumes, recording what differed)."""
    import json

    config, out = small_config(tmp_path), tmp_path / "out"
    assert cli(config, out, "--dry-run", "--sweep", "gamma=0.27") == 0
    point = next((out / "points").iterdir())
    record = json.loads((point / "provenance.json").read_text())
    record["code"]["files"]["attacks/closed_form/april.py"] = "0" * 16
    record["code"]["fingerprint"] = "0" * 64
    (point / "provenance.json").write_text(json.dumps(record))
    capsys.readouterr()
    assert cli(config, out, "--dry-run", "--sweep", "gamma=0.27") == 6
    one_line_error(capsys.readouterr().err, "code.files.attacks/closed_form/april.py", "--force")
    assert cli(config, out, "--dry-run", "--sweep", "gamma=0.27", "--force") == 0
    now = json.loads((point / "provenance.json").read_text())
    assert any("attacks/closed_form/april.py" in d for d in now["resumes"][-1]["forced_differences"])


# ------------------------------------------------------------------ display-only keys
def test_a_report_layout_change_resumes_and_an_oversized_tile_is_refused(tmp_path: Path, capsys) -> None:
    """report.tile changes no row: a run stored with one tile size resumes with another (no exit 6,
    no row computed again, the grid redrawn at the new size); a tile past its bound is a config
    error naming the key and its range before anything is written."""
    from PIL import Image

    config, out = small_config(tmp_path), tmp_path / "out"
    assert cli(config, out, "--set", "report.tile=100000") == 3
    one_line_error(capsys.readouterr().err, "report.tile", "256")
    assert not out.exists()
    assert cli(config, out) == 0
    rows = (out / "results.jsonl").read_bytes()
    small = Image.open(out / "grid_a.png").size
    assert cli(config, out, "--set", "report.tile=64") == 0
    assert (out / "results.jsonl").read_bytes() == rows
    assert Image.open(out / "grid_a.png").size > small
