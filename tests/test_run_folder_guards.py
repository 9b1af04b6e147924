"""A run folder refuses to mix results: a provenance difference refuses a resume, a corrupt line of
results.jsonl is quarantined (not truncating what follows), and a lock stops a second writer."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmark.errors import OutputLockedError
from benchmark.store import RunFolder, read_jsonl
from helpers import run as _run
from helpers import write_config

ROOT = Path(__file__).resolve().parents[1]
ARCH = "mjp_vit_cifar_patch4_32"
MJP_ROW = {"name": "MJP", "arch": ARCH, "variant": "mjp", "kwargs": {"depth": 2}, "april": "surgery"}


def _config(tmp: Path, **changes) -> Path:
    """helpers.tiny_config with one MJP row, one round, one grid image; then ``changes``."""
    return write_config(tmp, **{"federation.rounds": 1, "models": [MJP_ROW], "report.grid_images": 1, **changes})


def test_provenance_difference_refuses_resume(tmp_path: Path, capsys) -> None:
    cfg, out = _config(tmp_path), tmp_path / "out"
    assert _run(cfg, out, "--dry-run") == 0
    record = json.loads((out / "provenance.json").read_text())
    assert set(record) >= {"code", "libraries", "device", "checkpoints"}
    record["code"]["dirty"] = not record["code"]["dirty"]  # only warns
    (out / "provenance.json").write_text(json.dumps(record))
    assert _run(cfg, out, "--dry-run") == 0
    record["libraries"]["timm"] = "0.0.1"
    record["device"] = "cuda:0 (elsewhere)"
    (out / "provenance.json").write_text(json.dumps(record))
    capsys.readouterr()
    assert _run(cfg, out, "--dry-run") == 6
    err = capsys.readouterr().err
    assert "libraries.timm: '0.0.1'" in err and "device:" in err


def test_corrupt_middle_line_is_quarantined_not_truncating(tmp_path: Path) -> None:
    path = tmp_path / "results.jsonl"
    path.write_text('{"a": 1}\n{"a": 2\n{"a": 3}\n{"a": 4')  # corrupt line 2, torn line 4
    assert read_jsonl(path) == [{"a": 1}, {"a": 3}]
    assert read_jsonl(path, repair=True) == [{"a": 1}, {"a": 3}]
    assert path.read_text() == '{"a": 1}\n{"a": 3}\n'
    quarantined = [json.loads(line) for line in (tmp_path / "results.quarantine.jsonl").read_text().splitlines()]
    assert [(q["line"], q["text"]) for q in quarantined] == [(2, '{"a": 2\n'), (4, '{"a": 4')]


def test_lock_stops_a_second_writer(tmp_path: Path, capsys) -> None:
    held = RunFolder(tmp_path / "out")
    held.lock()
    try:
        with pytest.raises(OutputLockedError, match=str(tmp_path / "out")):
            RunFolder(tmp_path / "out").lock()
        code = subprocess.run([sys.executable, "-c", (
            "import sys; from benchmark.store import RunFolder\n"
            "from benchmark.errors import OutputLockedError\n"
            f"try: RunFolder({str(tmp_path / 'out')!r}).lock()\n"
            "except OutputLockedError: sys.exit(9)\n")], cwd=ROOT).returncode
        assert code == 9  # another process too
    finally:
        held.unlock()
    RunFolder(tmp_path / "out").lock()  # released


def test_code_version_is_read_once_per_process(tmp_path: Path) -> None:
    """A long sweep's later points carry the commit its process started with, not a later HEAD."""
    import subprocess

    from benchmark.provenance import code_version

    def git(*args: str) -> None:
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path, check=True,
                       capture_output=True)

    git("init", "-q")
    (tmp_path / "a.txt").write_text("1")
    git("add", "a.txt")
    git("commit", "-qm", "one")
    first = code_version(tmp_path)
    (tmp_path / "a.txt").write_text("2")
    git("commit", "-qam", "two")
    assert code_version(tmp_path) == first and first["commit"] != "unknown" and first["dirty"] is False
    first["commit"] = "mutated"  # callers get a copy
    assert code_version(tmp_path)["commit"] != "mutated"


def test_stored_config_reads_back_as_the_run_config(tmp_path: Path) -> None:
    """config.yaml is written with the configs' own dumper: a text value that YAML 1.2 reads as a
    number (a model label '1e-4') stays text, the folder's stored config equals the run's, and the
    stored file itself resumes the run as --config."""
    from fedmjp.config import dump_yaml
    from helpers import tiny_config

    cfg = tmp_path / "label.yaml"
    cfg.write_text(dump_yaml(tiny_config(**{"federation.rounds": 1, "models": [{**MJP_ROW, "label": "1e-4"}]})))
    out = tmp_path / "out"
    assert _run(cfg, out, "--dry-run") == 0
    stored = RunFolder(out).stored_config()
    assert stored is not None and stored["models"][0]["label"] == "1e-4"
    assert "'1e-4'" in (out / "config.yaml").read_text()
    assert _run(out / "config.yaml", out, "--dry-run") == 0
