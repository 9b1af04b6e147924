"""Off a terminal (CI logs, pipes, nohup, `> log`), progress bars turn themselves off: the log gets one
line per epoch / federation, never thousands of bar frames."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml
from helpers import RECIPE, make_imagefolder, write_config

ROOT = Path(__file__).resolve().parents[1]


def _no_bar_frames(text: str) -> None:
    assert "\r" not in text, text[-2000:]
    assert "it/s]" not in text and "upd/s]" not in text and "fed/s]" not in text, text[-2000:]


def test_benchmark_log_has_no_bar_frames(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "run_benchmark.py"), "--config", str(write_config(tmp_path)),
                           "--output", str(tmp_path / "out"), "--dry-run", "--models", "DeiT", "--setting", "a"],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _no_bar_frames(proc.stderr)
    assert "federation and attacks took" in proc.stderr  # the per-federation line instead


def test_training_log_has_one_line_per_epoch(tmp_path: Path) -> None:
    data = make_imagefolder(tmp_path / "data")
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(dict(RECIPE, epochs=2)))
    proc = subprocess.run([sys.executable, "-m", "fedmjp.train", "--config", str(tmp_path / "recipe.yaml"),
                           "--data-path", str(data), "--output-dir", str(tmp_path / "run")],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _no_bar_frames(proc.stderr)
    assert [line.split("epoch ")[1][:2] for line in proc.stderr.splitlines() if " epoch " in line and "{" in line] \
        == ["0:", "1:"]
