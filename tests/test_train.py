"""Central training: a few steps on a tiny ImageFolder, exact resume, DDP on two CPU processes."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from fedmjp.archives import resolve_data_path
from fedmjp.train import main as train_main
from fedmjp.train import run_training
from fedmjp.train_data import build_transform
from fedmjp.trainconfig import TrainConfig, load_config, parse_overrides
from fedmjp.trainutils import load_checkpoint_state, model_from_checkpoint

from helpers import make_imagefolder, tiny_train_config as tiny_config

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory) -> Path:
    return make_imagefolder(tmp_path_factory.mktemp("imgs"))


def test_config_overrides_are_yaml_data(tmp_path):
    overrides = parse_overrides(["--gamma", "0.2", "--per-sample=true", "--train_subset", "null",
                                 "--model_kwargs", "{depth: 2}"])
    assert overrides == {"gamma": 0.2, "per_sample": True, "train_subset": None, "model_kwargs": {"depth": 2}}
    with pytest.raises(ValueError, match="valid:"):
        parse_overrides(["--no_such_key", "1"])
    (tmp_path / "c.yaml").write_text("variant: jp\nepochs: 7\n")
    cfg = load_config(tmp_path / "c.yaml", {"epochs": 3})
    assert (cfg.variant, cfg.epochs) == ("jp", 3)


def test_recipes_build(tmp_path):
    """Every shipped recipe parses and builds its model (one block deep, to stay quick)."""
    from fedmjp.factory import create_model
    from fedmjp.trainutils import model_kwargs

    names = set()
    for path in sorted((REPO / "configs" / "train").glob("*.yaml")):
        cfg = load_config(path)
        model = create_model(cfg.model, **{**model_kwargs(cfg, 10), "depth": 1})
        assert model.num_classes == 10 and model.patch_embed.img_size == (cfg.img_size, cfg.img_size), path.name
        names.add(path.stem)
    five = {"vit_s", "deit_s", "deit_s_nope", "deit_s_mjp", "deit_s_mjp_nounk"}
    assert five <= names and {"cifar_" + n.replace("_s", "", 1) for n in five} <= names


def test_archive_extracted_once(tmp_path, tiny_data):
    archive = tmp_path / "tiny.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(tiny_data, arcname="tiny")
    cache = tmp_path / "cache"
    root = resolve_data_path(archive, cache)
    assert (root / "train" / "class0").is_dir() and root.name == "tiny"
    marker = next(cache.glob("*/.fedmjp_extracted"))
    stamp = marker.stat().st_mtime_ns
    assert resolve_data_path(archive, cache) == root
    assert marker.stat().st_mtime_ns == stamp  # second call found the marker and skipped extraction


def test_randaugment_never_posterizes_to_zero_bits():
    tf = build_transform(TrainConfig(img_size=32), is_train=True)
    ops = [op for t in tf.transforms for op in getattr(t, "ops", ()) if op.name.startswith("Posterize")]
    assert ops and all(op.level_fn(10.0, op.hparams)[0] >= 1 for op in ops)


def test_crop_min_sets_the_random_resized_crops_smallest_area():
    from timm.data.transforms import RandomResizedCropAndInterpolation

    for crop_min in (0.08, 0.6):
        crop = build_transform(TrainConfig(img_size=64, crop_min=crop_min), is_train=True).transforms[0]
        assert isinstance(crop, RandomResizedCropAndInterpolation) and tuple(crop.scale) == (crop_min, 1.0)


def test_train_few_steps_writes_checkpoint_and_metrics(tmp_path, tiny_data):
    cfg = tiny_config(tiny_data, tmp_path / "run", epochs=1, mixup=0.8, cutmix=1.0)
    result = run_training(cfg, progress=False)
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 1
    row = json.loads(lines[0])
    for key in ("epoch", "loss", "dal_loss", "train_acc", "val_top1", "images_per_s", "lr", "time"):
        assert key in row, key
    assert row["step"] == 4 and row["dal_loss"] > 0 and np.isfinite(row["loss"])
    state = load_checkpoint_state(result.checkpoint)  # weights_only=True
    assert state["epoch"] == 1 and state["step"] == 4 and state["config"]["variant"] == "mjp"
    model, _ = model_from_checkpoint(result.checkpoint)
    for k, v in result.model.state_dict().items():
        assert torch.equal(v, model.state_dict()[k]), k
    assert not list(tmp_path.glob("run/*.tmp"))


def test_resume_equals_uninterrupted(tmp_path, tiny_data):
    """Stop after epoch 1, resume: same epoch/step, bit-identical weights and optimizer state."""
    full = run_training(tiny_config(tiny_data, tmp_path / "full"), progress=False)
    part = run_training(tiny_config(tiny_data, tmp_path / "part", stop_epoch=1), progress=False)
    mid = load_checkpoint_state(part.checkpoint)
    assert (mid["epoch"], mid["step"]) == (1, 4)
    # The CLI finds <output_dir>/last.pth by itself.
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(tiny_config(tiny_data, tmp_path / "elsewhere").to_dict()))
    assert train_main(["--config", str(tmp_path / "tiny.yaml"), "--output-dir", str(tmp_path / "part"),
                       "--no-progress"]) == 0
    a, b = load_checkpoint_state(full.checkpoint), load_checkpoint_state(part.checkpoint)
    assert (b["epoch"], b["step"]) == (a["epoch"], a["step"]) == (2, 8)
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    for pid, sa in a["optimizer"]["state"].items():
        sb = b["optimizer"]["state"][pid]
        assert all(torch.equal(sa[k], sb[k]) for k in sa), pid
    ra = [json.loads(x) for x in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
    rb = [json.loads(x) for x in (tmp_path / "part" / "metrics.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in ra] == [r["loss"] for r in rb]


_DDP_WORKER = textwrap.dedent("""
    import sys, torch
    import torch.distributed as dist
    from fedmjp.train import run_training
    from fedmjp.trainconfig import config_from_dict
    import json
    cfg = config_from_dict(json.loads(open(sys.argv[1]).read()))
    dist.init_process_group("gloo")
    result = run_training(cfg, progress=False)
    torch.save(result.model.state_dict(), f"{sys.argv[2]}/rank{dist.get_rank()}.pt")
    dist.destroy_process_group()
""")


@pytest.mark.slow
def test_ddp_two_cpu_processes_agree(tmp_path, tiny_data):
    cfg = tiny_config(tiny_data, tmp_path / "ddp", epochs=1, aug_repeats=3, per_sample=False)
    (tmp_path / "cfg.json").write_text(json.dumps(cfg.to_dict()))
    (tmp_path / "worker.py").write_text(_DDP_WORKER)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         str(tmp_path / "worker.py"), str(tmp_path / "cfg.json"), str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    w0 = torch.load(tmp_path / "rank0.pt", weights_only=True)
    w1 = torch.load(tmp_path / "rank1.pt", weights_only=True)
    for k in w0:
        assert torch.equal(w0[k], w1[k]), k
    state = load_checkpoint_state(tmp_path / "ddp" / "last.pth")
    assert all(torch.equal(state["model"][k], w0[k]) for k in w0)
    # 16 images x 3 repeats / 2 ranks / batch 4 -> RepeatAugSampler gives each rank 8 samples: 2 steps
    assert state["step"] == 2
    row = json.loads((tmp_path / "ddp" / "metrics.jsonl").read_text().splitlines()[0])
    assert row["images"] == 16 and row["val_images"] == 16


@pytest.mark.parametrize("amp", ["bf16", "fp16"])
def test_amp_paths_run(tmp_path, tiny_data, amp):
    """bf16 autocast and fp16 autocast + GradScaler (the CUDA paths) also run under CPU autocast."""
    result = run_training(tiny_config(tiny_data, tmp_path / amp, epochs=1, amp=amp), progress=False)
    assert np.isfinite(result.metrics["loss"])
    state = load_checkpoint_state(result.checkpoint)
    assert (state["scaler"] is not None) == (amp == "fp16")
