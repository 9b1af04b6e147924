"""Training output folders get the benchmark's guarantees: one training at a time (a lock), a resume
that trains what the checkpoint trained (or records the change), and metrics that agree with the
checkpoint after a kill between the two writes."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from fedmjp.folder_lock import release_lock, take_lock
from fedmjp.train import EXIT_BAD_CONFIG, EXIT_LOCKED
from fedmjp.train import main as train_main
from fedmjp.train import reconcile_metrics, run_training
from fedmjp.trainutils import load_checkpoint_state
from helpers import make_imagefolder, tiny_train_config


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory) -> Path:
    return make_imagefolder(tmp_path_factory.mktemp("imgs"))


@pytest.fixture(scope="module")
def one_epoch(tmp_path_factory, tiny_data) -> Path:
    """A folder holding epoch 0 of a two-epoch run (stop_epoch 1); tests copy it."""
    out = tmp_path_factory.mktemp("runs") / "one"
    run_training(tiny_train_config(tiny_data, out, stop_epoch=1), progress=False)
    return out


def _copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(".lock"))
    return dst


def _cli(tmp_path: Path, data: Path, out: Path, *extra: str, **changes) -> int:
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(tiny_train_config(data, out, **changes).to_dict()))
    return train_main(["--config", str(cfg), "--no-progress", *extra])


def _snapshot(folder: Path) -> dict:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file() and p.name != ".lock"}


def test_a_second_training_on_a_locked_folder_is_refused_before_writing(tmp_path, tiny_data, one_epoch, capsys):
    out = _copy(one_epoch, tmp_path / "run")
    before = _snapshot(out)
    held = take_lock(out)  # the other training
    try:
        assert _cli(tmp_path, tiny_data, out) == EXIT_LOCKED
    finally:
        release_lock(held)
    err = capsys.readouterr().err
    assert str(out) in err and "another training" in err and "pid" in err
    assert _snapshot(out) == before


def test_a_resume_that_changes_the_training_is_refused_naming_the_keys(tmp_path, tiny_data, one_epoch, capsys):
    out = _copy(one_epoch, tmp_path / "run")
    before = _snapshot(out)
    assert _cli(tmp_path, tiny_data, out, lr=5e-3, gamma=0.25) == EXIT_BAD_CONFIG
    err = capsys.readouterr().err
    assert "lr: 0.001 in the checkpoint, 0.005 now" in err and "gamma: 0.5 in the checkpoint, 0.25 now" in err
    assert "--allow-config-change" in err
    assert _snapshot(out) == before  # nothing written, the checkpoint and metrics untouched


def test_a_resume_with_another_model_is_a_named_error_even_when_allowed(tmp_path, tiny_data, one_epoch, capsys):
    """--allow-config-change lets a schedule change through; a model whose weights do not fit the
    checkpoint is still a one-line error, not a traceback."""
    out = _copy(one_epoch, tmp_path / "run")
    before = _snapshot(out)
    kwargs = {"depth": 2, "embed_dim": 48, "num_heads": 3}
    assert _cli(tmp_path, tiny_data, out, model_kwargs=kwargs) == EXIT_BAD_CONFIG
    assert "model_kwargs" in capsys.readouterr().err
    assert _cli(tmp_path, tiny_data, out, "--allow-config-change", model_kwargs=kwargs) == EXIT_BAD_CONFIG
    err = capsys.readouterr().err
    assert "does not fit this config" in err and "Traceback" not in err
    assert _snapshot(out) == before


def test_an_allowed_change_goes_on_and_is_recorded_with_its_epoch(tmp_path, tiny_data, one_epoch):
    out = _copy(one_epoch, tmp_path / "run")
    assert _cli(tmp_path, tiny_data, out, "--allow-config-change", lr=5e-3) == 0
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert saved["lr"] == 5e-3
    assert saved["config_changes"] == [{"from_epoch": 1, "changes": {"lr": [1e-3, 5e-3]}}]
    assert load_checkpoint_state(out / "last.pth")["epoch"] == 2


def test_run_only_keys_change_freely_on_resume(tmp_path, tiny_data, one_epoch):
    out = _copy(one_epoch, tmp_path / "run")
    assert _cli(tmp_path, tiny_data, out, eval_every=2, log_interval=3) == 0
    assert "config_changes" not in yaml.safe_load((out / "config.yaml").read_text())


def test_metrics_agree_with_the_checkpoint_after_a_kill_between_the_writes(tmp_path, tiny_data, one_epoch):
    """A kill right after last.pth was replaced loses that epoch's metrics line; a resume restores it
    from the checkpoint, and drops lines of epochs the checkpoint does not hold."""
    out = _copy(one_epoch, tmp_path / "run")
    state = load_checkpoint_state(out / "last.pth")
    (out / "metrics.jsonl").write_text(json.dumps({"epoch": 7, "loss": 1.0}) + "\n")  # epoch 0 lost, a stray one
    assert _cli(tmp_path, tiny_data, out) == 0
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in rows] == [0, 1]
    assert rows[0] == json.loads(json.dumps(state["metrics"]))


def test_reconcile_keeps_an_agreeing_file_byte_for_byte(tmp_path):
    path = tmp_path / "metrics.jsonl"
    text = json.dumps({"epoch": 0, "loss": 2.0}) + "\n" + json.dumps({"epoch": 1, "loss": 1.5}) + "\n"
    path.write_text(text)
    stamp = path.stat().st_mtime_ns
    reconcile_metrics(path, {"epoch": 2, "metrics": {"epoch": 1, "loss": 1.5}})
    assert path.read_text() == text and path.stat().st_mtime_ns == stamp
    reconcile_metrics(path, {"epoch": 1, "metrics": {"epoch": 0, "loss": 2.0}})  # a resume from an older checkpoint
    assert [json.loads(x)["epoch"] for x in path.read_text().splitlines()] == [0]


def test_a_bad_config_on_a_new_folder_leaves_no_folder(tmp_path, tiny_data, capsys):
    out = tmp_path / "new"
    assert _cli(tmp_path, tiny_data, out, num_classes=1) == EXIT_BAD_CONFIG  # the data has 2 classes
    assert "num_classes" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize("flag, value, words", [
    ("--img_size", "100000", ["img_size", "[1, 1024]"]),
    ("--batch_size", "1000000000", ["batch_size", "[1, 65536]"]),
    ("--num_workers", "100000", ["num_workers", "[0, 256]"]),
    ("--threads", "1000000", ["threads", "[1, 1024]"]),  # 1e6 threads crashed the process
    ("--num_classes", "1000000000", ["num_classes", "[1, 100000]"]),
    ("--model_kwargs", "{embed_dim: 200000}", ["model_kwargs", "embed_dim"]),  # checked on the meta device
])
def test_training_sizes_are_bounded_before_anything_is_written(tmp_path, tiny_data, capsys, flag, value, words):
    """Sizes that set a training's memory, processes or threads are refused with the key and its
    range (exit 2), and no output folder is left."""
    out = tmp_path / "out"
    assert _cli(tmp_path, tiny_data, out, flag, value) == EXIT_BAD_CONFIG
    err = capsys.readouterr().err
    assert "Traceback" not in err
    for w in words:
        assert w in err, err
    assert not out.exists()
