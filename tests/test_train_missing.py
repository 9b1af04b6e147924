"""``run_benchmark.py --train-missing``: rows that name a training recipe get their checkpoint trained
(or a stopped training finished) before they are attacked; finished checkpoints are left alone."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from helpers import RECIPE, make_imagefolder

from benchmark.store import read_jsonl
from fedmjp.train import run_training
from fedmjp.trainconfig import load_config
from fedmjp.trainutils import load_checkpoint_state
from run_benchmark import main


def _setup(tmp_path: Path) -> tuple[Path, Path, Path]:
    data = make_imagefolder(tmp_path / "data")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(RECIPE))
    ckpt = tmp_path / "ckpt" / "last.pth"
    config = tmp_path / "bench.yaml"
    config.write_text(yaml.safe_dump({
        "name": "tm", "device": "cpu", "settings": ["a"], "train_data": str(data),
        "data": {"source": str(data / "val"), "image_size": 32, "num_images": 2, "num_classes": 2},
        "federation": {"rounds": 1, "clients": 2, "precision": "float64", "lr": 0.0},
        "models": [{"name": "ViT", "arch": "mjp_vit_cifar_patch4_32", "variant": "plain", "april": "surgery",
                    "kwargs": {"depth": 2, "embed_dim": 96, "num_heads": 3, "num_classes": 2},
                    "checkpoint": str(ckpt), "recipe": str(recipe)}],
        "metrics": {"lpips": False}, "report": {"grid_images": 1, "tile": 32},
    }))
    return config, recipe, ckpt


def test_train_missing_finishes_a_stopped_training_then_attacks(tmp_path: Path, capsys) -> None:
    config, recipe, ckpt = _setup(tmp_path)
    out = tmp_path / "out"
    args = ["--config", str(config), "--output", str(out), "--no-progress"]
    assert main(args) == 5  # no checkpoint yet: the error says how to get one
    assert "--train-missing" in capsys.readouterr().err and not out.exists()
    # a training run stopped after epoch 1 of 2: never attacked as it is
    run_training(load_config(recipe, {"data_path": str(tmp_path / "data"), "output_dir": str(ckpt.parent),
                                      "stop_epoch": 1}), progress=False)
    assert main(args) == 5
    assert "holds 1 of the 2 epochs" in capsys.readouterr().err
    # --train-missing resumes it (epoch 1 is kept, not redone) and then attacks the finished model
    assert main(args + ["--train-missing"]) == 0
    assert "trained: ViT" in capsys.readouterr().out
    assert load_checkpoint_state(ckpt)["epoch"] == 2
    epochs = [json.loads(line)["epoch"] for line in (ckpt.parent / "metrics.jsonl").read_text().splitlines()]
    assert epochs == [0, 1]
    rows = read_jsonl(out / "results.jsonl")
    assert len(rows) == 2 and all(r["trained"] and not r["failed"] for r in rows)
    # a finished checkpoint is never trained again
    before = ckpt.stat().st_mtime_ns
    assert main(args + ["--train-missing"]) == 0
    assert "trained: nothing" in capsys.readouterr().out and ckpt.stat().st_mtime_ns == before


@pytest.mark.slow
def test_train_missing_before_a_sweep(tmp_path: Path, capsys) -> None:
    """A sweep attacks the same checkpoints at every point: --train-missing trains them once, first."""
    config, _, ckpt = _setup(tmp_path)
    out = tmp_path / "sweep"
    args = ["--config", str(config), "--output", str(out), "--no-progress", "--sweep", "federation.lr=0.0,0.01"]
    assert main(args) == 5 and not ckpt.exists()
    capsys.readouterr()
    assert main(args + ["--train-missing"]) == 0
    assert "trained: ViT" in capsys.readouterr().out and load_checkpoint_state(ckpt)["epoch"] == 2
    rows = read_jsonl(out / "results.jsonl")
    assert len(rows) == 4 and all(r["trained"] and not r["failed"] for r in rows)


def test_train_missing_checks_every_recipe_before_training_any(tmp_path: Path, capsys) -> None:
    """A recipe that only timm's registry refuses (an unknown optimizer) in the second row stops the
    run before the first row trains: nothing is written, the message names the row and the key."""
    config, recipe, ckpt = _setup(tmp_path)
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({**RECIPE, "opt": "no_such_optimizer"}))
    cfg = yaml.safe_load(config.read_text())
    second = {**cfg["models"][0], "name": "ViT2", "recipe": str(bad), "checkpoint": str(tmp_path / "ckpt2" / "last.pth")}
    cfg["models"].append(second)
    config.write_text(yaml.safe_dump(cfg))
    out = tmp_path / "out"
    assert main(["--config", str(config), "--output", str(out), "--no-progress", "--train-missing"]) == 3
    err = capsys.readouterr().err
    assert "ViT2" in err and "'opt'" in err and "no_such_optimizer" in err
    assert not ckpt.exists() and not ckpt.parent.exists() and not (tmp_path / "ckpt2").exists()
