"""``python -m fedmjp.train`` with a bad value: one line ``error: ...`` naming the key (or file), exit
status 2, no traceback, and nothing written (no output dir; an existing one's files untouched).

Each case is a value that, unchecked, crashes with a traceback (after creating the output dir) or
trains silently. The command is called in-process (``fedmjp.train.main``)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from fedmjp.config import ConfigError
from fedmjp.train import EXIT_BAD_CONFIG, main
from fedmjp.trainconfig import TrainConfig, check_config, load_config

from helpers import make_imagefolder

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "configs" / "train" / "cifar_vit.yaml"
#: What every call adds to the bad value: a one-step run of the CIFAR ViT recipe.
QUICK = ["--epochs", "1", "--max_steps_per_epoch", "1", "--num_workers", "0", "--threads", "1", "--no-progress"]


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory) -> Path:
    return make_imagefolder(tmp_path_factory.mktemp("imgs"), classes=2, per_class=4)


def _run(capsys, args: list[str]) -> tuple[int, str]:
    code = main(args)
    return code, capsys.readouterr().err


def _assert_one_line_error(code: int, err: str, *names: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == EXIT_BAD_CONFIG == 2, err
    assert "Traceback" not in err, err
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for name in names:
        assert name in lines[0], (name, lines[0])
    return lines[0]


# (bad arguments, words the error line must hold: the key, or the file)
BAD_VALUES = [
    # crashed with a traceback before
    (["--batch_size", "0"], ["'batch_size'", "[1, 65536]"]),
    (["--epochs", "0"], ["'epochs'", "[1, 100000]"]),
    (["--epochs", "-1"], ["'epochs'"]),
    (["--lr", "-1"], ["'lr'", "> 0"]),
    (["--img_size", "0"], ["'img_size'"]),
    (["--drop_path", "2"], ["drop_path", "in [0.0, 1.0)"]),
    (["--train_subset", "0"], ["'train_subset'"]),
    (["--num_workers", "-1"], ["'num_workers'", "[0, 256]"]),
    (["--model", "nope_model"], ["'model'", "nope_model", "mjp_vit_cifar_patch4_32"]),
    (["--opt", "nada"], ["'opt'", "adamw"]),
    (["--sched", "nada"], ["'sched'", "cosine"]),
    (["--auto_augment", "garbage"], ["'auto_augment'", "rand-m9"]),
    (["--interpolation", "nada"], ["'interpolation'", "bicubic"]),
    (["--gamma", "nan"], ["'gamma'"]),
    (["--gamma", ".nan"], ["'gamma'", "[0.0, 1.0]"]),
    (["--bogus", "3"], ["'bogus'", "valid"]),
    # trained silently before
    (["--gamma", "1.5"], ["'gamma'", "[0.0, 1.0]"]),
    (["--crop_min", "0"], ["'crop_min'", "(0.0, 1.0]"]),
    (["--crop_min", "1.5"], ["'crop_min'"]),
    (["--shuffle_prob", "3"], ["'shuffle_prob'"]),
    (["--num_classes", "0"], ["'num_classes'"]),
    (["--warmup_epochs", "-3"], ["'warmup_epochs'"]),
    (["--mixup", "-1"], ["'mixup'"]),
    (["--eval_every", "0"], ["'eval_every'"]),
    (["--mixup_mode", "nada"], ["'mixup_mode'", "pair"]),
    # keys that depend on each other or on the data
    (["--batch_size", "1", "--mixup", "0.8"], ["'batch_size'", "mixup"]),
    (["--num_classes", "1"], ["'num_classes'", "2 class folders"]),
    (["--sched", "wsd", "--warmup_epochs", "1"], ["'sched'", "wsd"]),
    (["--device", "nada"], ["'device'"]),
    (["--seed", "-1"], ["'seed'"]),
    (["--output_dir", "''"], ["output_dir"]),
    (["stray"], ["stray", "--key value"]),
]


@pytest.mark.parametrize("bad,names", BAD_VALUES, ids=[" ".join(b) for b, _ in BAD_VALUES])
def test_bad_value_is_one_line_and_writes_nothing(tmp_path, capsys, tiny_data, bad, names):
    out = tmp_path / "out"
    code, err = _run(capsys, ["--config", str(RECIPE), "--data_path", str(tiny_data), "--output_dir", str(out),
                              *QUICK, *bad])
    _assert_one_line_error(code, err, *names)
    assert not out.exists()


def test_missing_config_file_names_it(tmp_path, capsys, tiny_data):
    out = tmp_path / "out"
    code, err = _run(capsys, ["--config", str(tmp_path / "nofile.yaml"), "--data_path", str(tiny_data),
                              "--output_dir", str(out), *QUICK])
    _assert_one_line_error(code, err, "nofile.yaml", "does not exist")
    assert not out.exists()


@pytest.mark.parametrize("flag", ["--data_path", "--data-path"])
def test_missing_data_path_names_it(tmp_path, capsys, flag):
    out = tmp_path / "out"
    code, err = _run(capsys, ["--config", str(RECIPE), flag, str(tmp_path / "nowhere"), "--output_dir", str(out),
                              *QUICK])
    _assert_one_line_error(code, err, "'data_path'", "nowhere", "does not exist")
    assert not out.exists()


def test_data_path_without_val_or_classes(tmp_path, capsys):
    (tmp_path / "data" / "train" / "a").mkdir(parents=True)
    out = tmp_path / "out"
    code, err = _run(capsys, ["--config", str(RECIPE), "--data_path", str(tmp_path / "data"), "--output_dir", str(out),
                              *QUICK])
    _assert_one_line_error(code, err, "'data_path'", "val")
    assert not out.exists()


def test_unset_data_path(tmp_path, capsys):
    code, err = _run(capsys, ["--config", str(RECIPE), "--output_dir", str(tmp_path / "out"), *QUICK])
    _assert_one_line_error(code, err, "'data_path'", "--data-path")


def test_output_dir_that_cannot_be_created(tmp_path, capsys, tiny_data):
    (tmp_path / "afile").write_text("x")
    for out, words in ((tmp_path / "afile" / "out", ["'output_dir'", "is not a folder"]),
                       (tmp_path / "afile", ["'output_dir'", "is not a folder"])):
        code, err = _run(capsys, ["--config", str(RECIPE), "--data_path", str(tiny_data), "--output_dir", str(out),
                                  *QUICK])
        _assert_one_line_error(code, err, *words)
    assert (tmp_path / "afile").read_text() == "x"


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="no /proc")
def test_output_dir_in_proc(capsys, tiny_data):
    code, err = _run(capsys, ["--config", str(RECIPE), "--data_path", str(tiny_data), "--output_dir", "/proc/x",
                              *QUICK])
    _assert_one_line_error(code, err, "'output_dir'", "/proc/x")
    assert not os.path.exists("/proc/x")


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root writes a read-only folder")
def test_output_dir_not_writable(tmp_path, capsys, tiny_data):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        code, err = _run(capsys, ["--config", str(RECIPE), "--data_path", str(tiny_data),
                                  "--output_dir", str(locked / "out"), *QUICK])
    finally:
        locked.chmod(0o700)
    _assert_one_line_error(code, err, "'output_dir'", "cannot be created")


def test_missing_resume_file(tmp_path, capsys, tiny_data):
    out = tmp_path / "out"
    code, err = _run(capsys, ["--config", str(RECIPE), "--data_path", str(tiny_data), "--output_dir", str(out),
                              "--resume", str(tmp_path / "none.pth"), *QUICK])
    _assert_one_line_error(code, err, "--resume", "none.pth")
    assert not out.exists()


def test_existing_run_is_left_alone(tmp_path, capsys, tiny_data):
    """A bad value aimed at a folder that holds a run's checkpoint changes nothing in it."""
    out = tmp_path / "out"
    out.mkdir()
    files = {"last.pth": b"weights of 3 epochs", "metrics.jsonl": b'{"epoch": 2}\n', "config.yaml": b"epochs: 3\n"}
    for name, data in files.items():
        (out / name).write_bytes(data)
    for bad in (["--gamma", "1.5"], ["--model", "nope_model"], ["--num_classes", "1"]):
        code, err = _run(capsys, ["--config", str(RECIPE), "--data_path", str(tiny_data), "--output_dir", str(out),
                                  *QUICK, *bad])
        _assert_one_line_error(code, err, bad[0][2:])
        assert {p.name: p.read_bytes() for p in out.iterdir()} == files


def test_help_documents_the_exit_status(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    assert "Exit status" in capsys.readouterr().out


# ------------------------------------------------------------------------------ what still works
@pytest.mark.parametrize("recipe", sorted((REPO / "configs" / "train").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_recipes_validate(recipe):
    cfg = load_config(recipe)
    assert check_config(cfg) is cfg


def test_defaults_validate():
    assert check_config(TrainConfig()) == TrainConfig()


@pytest.mark.parametrize("changes", [
    {"opt": "lookahead_adamw"}, {"opt": "SGD"}, {"sched": "wsd", "epochs": 30}, {"auto_augment": None},
    {"auto_augment": "augmix-m3-w3"}, {"auto_augment": "original-mstd0.5"}, {"interpolation": "bilinear"},
    {"remode": "const"}, {"mixup_mode": "elem"}, {"model": "vit_tiny_patch16_224"}, {"clip_grad": None},
    {"gamma": 0.0}, {"gamma": 1.0}, {"smoothing": 0.0}, {"warmup_epochs": 0}, {"seed": 2**32 - 1},
    {"batch_size": 1, "mixup": 0.0, "cutmix": 0.0},
])
def test_good_values_validate(changes):
    check_config(TrainConfig(**changes))


def test_scheduler_names_are_timms():
    """Every name of the sched choice is one timm builds and steps per update."""
    import typing

    import torch
    from timm.scheduler import create_scheduler_v2

    from fedmjp.trainconfig import Scheduler

    for name in typing.get_args(Scheduler):
        opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
        sched, _ = create_scheduler_v2(opt, sched=name, num_epochs=10, warmup_epochs=1, step_on_epochs=False,
                                       updates_per_epoch=4)
        sched.step_update(num_updates=1)


def test_interpolations_are_timms():
    import typing

    from timm.data.transforms import str_to_interp_mode

    from fedmjp.trainconfig import Interpolation

    for name in typing.get_args(Interpolation):
        str_to_interp_mode(name)


def test_config_error_is_a_value_error():
    """Callers that catch ValueError (benchmark/training.py) still catch the new checks."""
    with pytest.raises(ValueError):
        check_config(TrainConfig(model="nope_model"))
    assert issubclass(ConfigError, ValueError)


def test_good_tiny_run(tmp_path, capsys, tiny_data):
    out = tmp_path / "out"
    code = main(["--config", str(RECIPE), "--data-path", str(tiny_data), "--output-dir", str(out), *QUICK,
                 "--batch_size", "4", "--val_subset", "4"])
    assert code == 0, capsys.readouterr().err
    assert (out / "last.pth").is_file() and (out / "config.yaml").is_file()
    assert not list(out.glob(".fedmjp-write-check-*"))
