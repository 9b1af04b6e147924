"""Label counts from the update (attacks/closed_form/labels.py): exact on real updates of the shipped CIFAR DeiTs
where the per-image equations are overdetermined (B <= C / 2 with the head's LayerNorm; any B < C
with the last block's fc2 gradient), the bias rule with its note where the head's gradient cannot
hold the batch (B >= C classes)."""
from __future__ import annotations

from pathlib import Path

import pytest
import timm
import torch

import attacks
import fedmjp  # noqa: F401  (registers the models)
from attacks.optimization.batch_match import head_norm, norm_input_grad_name
from attacks.closed_form.labels import recover_label_counts
from fedmjp.checkpoint import load_checkpoint
from fedmjp.archives import resolve_data_path
from tests.helpers import MEAN, STD, bundled_images, crop_resize

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CHECKPOINTS = Path(__file__).resolve().parents[1] / "checkpoints"
CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")


def _deit(name: str = "cifar_deit", variant: str = "plain") -> torch.nn.Module:
    torch.manual_seed(0)
    model = timm.create_model("mjp_vit_cifar_patch4_32", variant=variant, first_block="april", depth=4)
    load_checkpoint(model, CHECKPOINTS / f"{name}.safetensors")
    return model.eval().double()


@pytest.fixture(scope="module")
def cifar_val(team_data) -> Path:
    """The CIFAR-10 validation folder (one sub-folder per class) of the team's archive."""
    return resolve_data_path(team_data.path("cifar10.tar.gz")) / "val"


def _cifar_batch(folder: Path, labels: list[int], model: torch.nn.Module) -> torch.Tensor:
    """Normalised model inputs [B, 3, 32, 32]: the next unused validation image of each label."""
    from PIL import Image

    used: dict[int, int] = {}
    images = []
    for y in labels:
        files = sorted((folder / CLASSES[y]).glob("*.jpg"))
        images.append(crop_resize(Image.open(files[used.get(y, 0)]), 32))
        used[y] = used.get(y, 0) + 1
    mean = torch.tensor(model.default_cfg["mean"]).double()[:, None, None]
    std = torch.tensor(model.default_cfg["std"]).double()[:, None, None]
    return (torch.stack(images).double() - mean) / std


@pytest.mark.parametrize("name,variant,labels", [
    ("cifar_deit", "plain", [3, 3, 5, 8]),
    ("cifar_deit_mjp", "mjp", [0, 7, 7, 2]),
    ("cifar_deit", "plain", [9, 9, 9, 3, 3, 1, 1, 6]),
])
def test_counts_exact_on_cifar_updates_with_repeated_classes(cifar_val: Path, name: str, variant: str,
                                                            labels: list[int]) -> None:
    """B = 4 (head and LayerNorm alone) and B = 8 (with the last block's fc2 gradient, which spans the
    gradients at the LayerNorm's input) with repeated classes: the counts, which the bias's sign
    cannot give for a repeated class, come out exact, and the whole head update is reproduced."""
    model = _deit(name, variant)
    y = torch.tensor(labels)
    upd = attacks.compute_update(model, _cifar_batch(cifar_val, labels, model), y)
    gamma, beta = head_norm(model)
    pre = norm_input_grad_name(model) if len(labels) > 5 else None  # B <= C / 2 needs no more than the head
    got = recover_label_counts(upd["head.bias"], upd["head.weight"], model.head.weight, model.head.bias, len(y),
                               norm_weight=gamma, norm_bias=beta, norm_input_grad=upd[pre] if pre else None)
    assert got.method == "fit", got.notes
    assert got.counts.tolist() == torch.bincount(y, minlength=10).tolist()
    assert got.residual < 1e-10  # float64 rounding of the update (measured ~1e-13)


def test_counts_without_the_layernorm_at_four() -> None:
    """Without the LayerNorm's equations each image still has C - 1 - B = 5 >= 4 equations: exact at B = 4."""
    model = _deit()
    y = torch.tensor([6, 2, 6, 4])
    xn = (bundled_images(4, 32) - MEAN.double()[:, None, None]) / STD.double()[:, None, None]
    upd = attacks.compute_update(model, xn, y)
    got = recover_label_counts(upd["head.bias"], upd["head.weight"], model.head.weight, model.head.bias, 4,
                               starts=1, iterations=1)
    assert got.method == "fit", got.notes
    assert got.counts.tolist() == torch.bincount(y, minlength=10).tolist()


def test_counts_from_a_float32_update_at_four() -> None:
    """A float32 model and update (the acceptance scales with the update's epsilon): exact at B = 4."""
    model = _deit().float()
    y = torch.tensor([1, 8, 1, 3])
    xn = (bundled_images(4, 32, start=3) - MEAN.double()[:, None, None]) / STD.double()[:, None, None]
    upd = attacks.compute_update(model, xn.float(), y)
    gamma, beta = head_norm(model)
    got = recover_label_counts(upd["head.bias"], upd["head.weight"], model.head.weight, model.head.bias, 4,
                               starts=1, iterations=1, norm_weight=gamma, norm_bias=beta)
    assert got.method == "fit", got.notes
    assert got.counts.tolist() == torch.bincount(y, minlength=10).tolist()


def test_batch_of_c_or_more_takes_the_bias_rule_and_says_why() -> None:
    """B >= C: the head's gradient has rank <= C - 1 < B (each delta_b sums to zero), so the features'
    span is not in it; the bias rule answers, and the result says so."""
    model = _deit()
    y = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 3])
    xn = (torch.cat([bundled_images(7, 32), bundled_images(4, 32, start=2).flip(-1)])
          - MEAN.double()[:, None, None]) / STD.double()[:, None, None]
    upd = attacks.compute_update(model, xn, y)
    assert int(torch.linalg.matrix_rank(upd["head.weight"])) <= 9
    gamma, beta = head_norm(model)
    got = recover_label_counts(upd["head.bias"], upd["head.weight"], model.head.weight, model.head.bias, 11,
                               norm_weight=gamma, norm_bias=beta)
    assert got.method == "bias_only"
    assert "11 images >= 10 classes" in got.notes[0]
    assert int(got.counts.sum()) == 11


def test_head_norm_is_the_final_layernorm_of_a_token_pooled_vit() -> None:
    model = _deit()
    gamma, beta = head_norm(model)
    assert gamma is model.norm.weight and beta is model.norm.bias
    pooled = timm.create_model("vit_tiny_patch16_224", num_classes=10, global_pool="avg", img_size=32, depth=1)
    assert head_norm(pooled)[0] is pooled.fc_norm.weight
    assert norm_input_grad_name(model) == "blocks.3.mlp.fc2.weight"
    assert norm_input_grad_name(pooled) is None  # every token reaches an averaged head
