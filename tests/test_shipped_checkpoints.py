"""The trained checkpoints shipped in checkpoints/ (docs/checkpoints.md), and the safetensors
export/load path that writes and reads them.

The shipped files must match the sha256 written in checkpoints/README.md and docs/checkpoints.md,
rebuild their architecture from their header alone, load into the model a preset's row builds, and
classify real images; their top-1 is checked on CIFAR-10 validation images when the team data is
there (skips otherwise).
"""
from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import yaml

from fedmjp.checkpoint import CheckpointError, load_checkpoint, read_state_dict
from fedmjp.factory import create_model
from fedmjp.models import MJPVisionTransformer
from fedmjp.trainutils import export_weights, model_from_checkpoint, save_checkpoint, weights_state

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Shipped:
    """What a shipped file must be: its MJP variant, the preset whose rows load it, its geometry
    (blocks, width, classes, patch, image side, tokens) and a loose lower bound of its top-1 (percent)
    on 500 CIFAR-10 validation images, well below the accuracy measured on the full 10k
    (docs/checkpoints.md): it catches a broken file, loader or transform, not noise."""

    variant: str
    preset: str
    geometry: tuple[int, int, int, int, int, int]
    min_top1: float


SHIPPED = {
    "cifar_deit.safetensors": Shipped("plain", "cifar.yaml", (4, 192, 10, 4, 32, 65), 64.0),
    "cifar_deit_mjp.safetensors": Shipped("mjp", "cifar.yaml", (4, 192, 10, 4, 32, 65), 62.0),
    "deits224.safetensors": Shipped("plain", "paper_std.yaml", (2, 384, 10, 16, 224, 197), 30.0),
    "deits224_mjp.safetensors": Shipped("mjp", "paper_std.yaml", (2, 384, 10, 16, 224, 197), 30.0),
}
DOCS = (ROOT / "checkpoints" / "README.md", ROOT / "docs" / "checkpoints.md")


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _documented_sha256(doc: Path, name: str) -> set[str]:
    """Every 64-hex string on the lines of ``doc`` that name ``name``."""
    return {m for line in doc.read_text().splitlines() if name in line
            for m in re.findall(r"\b[0-9a-f]{64}\b", line)}


def _bundled_images(size: int = 32) -> torch.Tensor:
    """Three of scikit-image's photographs (astronaut, coffee, chelsea the cat) at ``size`` px, [3, 3, H, W] in [0, 1]."""
    import torch.nn.functional as F
    from skimage import data

    imgs = [torch.from_numpy(f()).permute(2, 0, 1).float() / 255 for f in (data.astronaut, data.coffee, data.chelsea)]
    return torch.stack([F.interpolate(x[None], size=(size, size), mode="bilinear", antialias=True,
                                      align_corners=False)[0] for x in imgs]).clamp(0, 1)


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_shipped_file_matches_documented_sha256(name):
    path = ROOT / "checkpoints" / name
    assert path.is_file(), f"{path} is not shipped"
    assert path.stat().st_size < 25 * 2**20, "weights only, float16: a few MB"
    digest = _sha256(path)
    for doc in DOCS:
        assert _documented_sha256(doc, name) == {digest}, f"{doc} does not document sha256 {digest} of {name}"


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_shipped_file_rebuilds_its_architecture(name):
    want = SHIPPED[name]
    model, state = model_from_checkpoint(ROOT / "checkpoints" / name)
    assert isinstance(model, MJPVisionTransformer) and not model.training
    assert model.variant == want.variant
    depth, width, classes, patch, side, tokens = want.geometry
    assert (len(model.blocks), model.embed_dim, model.num_classes) == (depth, width, classes)
    assert tuple(model.patch_embed.patch_size) == (patch, patch) and tuple(model.patch_embed.img_size) == (side, side)
    assert model.pos_embed.shape[1] == tokens <= width  # T <= D: the batch-1 reads hold
    assert state["epoch"] == state["config"]["epochs"], "a finished training run"
    assert state["config"]["data_path"] is None  # no machine path of the training host
    # The float16 weights come back as float32 and equal to the file.
    raw = read_state_dict(ROOT / "checkpoints" / name)
    for key, value in model.state_dict().items():
        assert value.dtype == torch.float32 and torch.equal(value, raw[key]), key


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_shipped_file_loads_into_the_preset_rows(name):
    """The preset's row for this file builds the same model; load_checkpoint fits it strictly."""
    rows = yaml.safe_load((ROOT / "configs" / SHIPPED[name].preset).read_text())["models"]
    row = next(r for r in rows if str(r.get("checkpoint", "")).endswith("/" + name))
    assert row["variant"] == SHIPPED[name].variant
    model = create_model(row["arch"], variant=row["variant"], **row.get("kwargs", {}))
    report = load_checkpoint(model, ROOT / row["checkpoint"])
    assert not report.official_format and report.dropped == []


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_shipped_model_classifies_real_images(name):
    from fedmjp.factory import model_input

    torch.manual_seed(0)
    model, _ = model_from_checkpoint(ROOT / "checkpoints" / name)
    header = weights_state(ROOT / "checkpoints" / name)
    fresh = create_model(header["model_name"], **header["model_kwargs"])
    x = model_input(model, _bundled_images(SHIPPED[name].geometry[4]))
    with torch.no_grad():
        logits, fresh_logits = model(x), fresh.eval()(x)
    assert logits.shape == (3, 10) and torch.isfinite(logits).all()
    # Trained, the model is confident about some photograph; fresh weights are close to uniform.
    assert logits.softmax(-1).max() > 0.3 > fresh_logits.softmax(-1).max()


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_shipped_model_top1_on_cifar10_val(name, team_data, tmp_path):
    from fedmjp.evaluate import build_eval_loader, evaluate_model

    archive = team_data.path("cifar10.tar.gz")
    torch.set_num_threads(1)
    model, state = model_from_checkpoint(ROOT / "checkpoints" / name)
    loader = build_eval_loader(state["config"], str(archive), batch_size=250, num_workers=0, max_images=500)
    row = evaluate_model(model, loader, gamma=0.27)
    assert row["images"] == 500
    assert row["top1"] >= SHIPPED[name].min_top1, row


# ----------------------------------------------------------------------------------- export round trip
def _tiny_checkpoint(path: Path, variant: str = "mjp") -> torch.nn.Module:
    torch.manual_seed(1)
    kwargs = dict(num_classes=10, img_size=32, drop_path_rate=0.0, variant=variant, depth=1)
    model = create_model("mjp_vit_cifar_patch4_32", **kwargs)
    save_checkpoint(path, {"format": "fedmjp-train-v1", "model": model.state_dict(), "epoch": 2, "step": 10,
                           "model_name": "mjp_vit_cifar_patch4_32", "model_kwargs": kwargs,
                           "config": {"epochs": 2, "img_size": 32, "data_path": "/secret/place"},
                           "metrics": {"val_top1": 12.5}})
    return model


def test_export_round_trip(tmp_path):
    model = _tiny_checkpoint(tmp_path / "last.pth")
    out = export_weights(tmp_path / "last.pth", tmp_path / "w.safetensors", source_commit="abc123")
    state = weights_state(out)
    assert state["model_name"] == "mjp_vit_cifar_patch4_32" and state["epoch"] == 2
    assert state["config"]["data_path"] is None and state["metrics"] == {"val_top1": 12.5}
    assert state["source_commit"] == "abc123" and state["model_kwargs"]["variant"] == "mjp"
    rebuilt, _ = model_from_checkpoint(out)
    for key, value in model.state_dict().items():
        # float16 in the file: equal to the float16 rounding of the original
        assert torch.equal(rebuilt.state_dict()[key], value.half().float()), key
    other = create_model("mjp_vit_cifar_patch4_32", num_classes=10, variant="mjp", depth=1)
    load_checkpoint(other, out)  # the benchmark's loader reads the same file
    assert torch.equal(other.pos_embed, rebuilt.pos_embed)


def test_safetensors_errors_are_one_line(tmp_path):
    from safetensors.torch import save_file

    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00not json")
    with pytest.raises(CheckpointError, match="bad.safetensors.*not a valid safetensors file"):
        read_state_dict(bad)
    plain = tmp_path / "plain.safetensors"  # weights without fedmjp's header: no architecture to build
    save_file({"w": torch.zeros(2)}, str(plain))
    with pytest.raises(ValueError, match="plain.safetensors has no fedmjp architecture"):
        model_from_checkpoint(plain)
    model = create_model("mjp_vit_cifar_patch4_32", num_classes=10, variant="mjp", depth=1)
    with pytest.raises(CheckpointError, match="does not fit"):
        load_checkpoint(model, plain)


def test_train_missing_rebuilds_a_missing_weights_file(tmp_path):
    """A row whose checkpoint is a .safetensors file: finished while the file exists; without it,
    --train-missing trains the recipe into the recipe's output_dir and writes the file."""
    from helpers import RECIPE, make_imagefolder

    from benchmark.config import BenchmarkConfig
    from benchmark.training import train_jobs, train_missing

    data = make_imagefolder(tmp_path / "data")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({**RECIPE, "output_dir": str(tmp_path / "run")}))
    weights = tmp_path / "shipped" / "w.safetensors"
    cfg = BenchmarkConfig.model_validate({"train_data": str(data), "models": [
        {"name": "ViT", "arch": "mjp_vit_cifar_patch4_32", "checkpoint": str(weights), "recipe": str(recipe)}]})
    (job,) = train_jobs(cfg)
    assert (job.epochs_done, job.checkpoint, job.export_to) == (0, tmp_path / "run" / "last.pth", weights)
    assert [j.row for j in train_missing(cfg, progress=False)] == ["ViT"]
    state = weights_state(weights)
    assert state["epoch"] == RECIPE["epochs"] and state["model_kwargs"]["depth"] == 2
    (job,) = train_jobs(cfg)
    assert job.done and train_missing(cfg, progress=False) == []
