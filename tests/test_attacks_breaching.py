"""breaching's optimisation attacks through our adapter: each runs a few iterations on a small ViT."""
from __future__ import annotations

import pytest
import timm
import torch

import attacks
import fedmjp  # noqa: F401

from helpers import MD, bundled_images, normalize


@pytest.fixture(scope="module")
def case():
    torch.manual_seed(0)
    # variant mjp: E_unk and the DAL head exist but are not used by the plain forward (adapter drops them)
    model = timm.create_model("mjp_vit_cifar_patch4_32", variant="mjp", img_size=16, embed_dim=48,
                              num_heads=2, depth=1).eval()
    x = bundled_images(1, 16).float()
    y = torch.tensor([4])
    return model, x, y, attacks.compute_update(model, normalize(x), y)


@pytest.mark.parametrize("name,iterations,labels", [
    ("invertinggradients", 6, True),
    ("modern", 6, False),
    ("seethroughgradients", 6, False),
    ("deepleakage", 2, False),
])
def test_breaching_attack_lowers_objective(case, name, iterations, labels):
    model, x, y, update = case
    md = dict(MD, labels=y) if labels else dict(MD)
    res = attacks.create_attack(name, iterations=iterations, raise_errors=True).reconstruct(model, update, md)
    assert not res.failed, res.reason
    s = res.stats[0]
    assert s["iterations"] == iterations and s["matched_parameters"] > 0
    assert s["objective_min"] < s["objective_first"]
    assert res.images.shape == (1, 3, 16, 16) and 0 <= res.images.min() and res.images.max() <= 1
    assert res.labels is not None and res.labels.numel() == 1


def test_breaching_label_strategy_and_config(case):
    model, x, y, update = case
    # breaching's bias-based strategy; note iDLG's weight-row rule assumes non-negative (ReLU)
    # features before the classifier and is unreliable on a ViT (LayerNorm features are signed).
    res = attacks.create_attack("invertinggradients", iterations=1, label_strategy="bias-corrected").reconstruct(
        model, update, MD)
    assert not res.failed and int(res.labels) == int(y)
    cfg = attacks.load_attack_config("invertinggradients", {"optim.max_iterations": 7})
    assert cfg.optim.max_iterations == 7 and cfg.objective.type == "cosine-similarity"
    assert cfg.regularization.total_variation.scale == 0.2
    with pytest.raises(ValueError):
        attacks.load_attack_config("no_such_attack")


def test_breaching_non_finite_is_a_failed_result(case):
    model, x, y, update = case
    bad = {k: torch.full_like(v, float("nan")) for k, v in update.items()}
    res = attacks.create_attack("invertinggradients", iterations=3).reconstruct(model, bad, dict(MD, labels=y))
    assert res.failed and "non-finite" in res.reason
