"""pe_closed_form: X = (G^T)^+ dL/dW_e on any ViT with a learned additive PE (scikit-image's images)."""
from __future__ import annotations

import time

import pytest
import skimage.data
import skimage.transform
import timm
import torch
from timm.models.vision_transformer import VisionTransformer

import attacks
from helpers import normalize, psnr
import fedmjp  # noqa: F401  (registers the mjp_* models)
from attacks.closed_form.pe_closed_form import images_to_patches, patches_to_images, pe_closed_form_system, pe_conditions

MEAN = torch.tensor([0.485, 0.456, 0.406], dtype=torch.float64)
STD = torch.tensor([0.229, 0.224, 0.225], dtype=torch.float64)
MD = dict(mean=MEAN, std=STD)


def image(name: str, size: int) -> torch.Tensor:
    """[1, 3, size, size] float64 in [0, 1]: one of scikit-image's bundled photographs."""
    a = skimage.transform.resize(getattr(skimage.data, name)(), (size, size), anti_aliasing=True)
    return torch.from_numpy(a).permute(2, 0, 1)[None].double()


def small_vit(**kw) -> torch.nn.Module:
    """A standard pre-norm timm ViT (no surgery): 32 px, patch 4, D = 192, N = 64 <= D."""
    torch.manual_seed(0)
    kw = dict(dict(img_size=32, patch_size=4, embed_dim=192, depth=2, num_heads=3, num_classes=10), **kw)
    return VisionTransformer(**kw).eval().double()


def attack(model, x, labels=(1,), **md):
    update = attacks.compute_update(model, normalize(x), torch.tensor(labels))
    return attacks.create_attack("pe_closed_form").reconstruct(model, update, dict(MD, **md)), update


@pytest.mark.parametrize("kw", [{}, dict(reg_tokens=2), dict(reg_tokens=1, no_embed_class=True),
                                dict(class_token=False, global_pool="avg")],
                         ids=["cls", "cls+registers", "no_embed_class", "no_prefix"])
def test_exact_on_standard_prenorm_vit(kw):
    model = small_vit(**kw)
    x = image("astronaut", 32)
    res, _ = attack(model, x)
    assert not res.failed, res.reason
    assert res.images.shape == (1, 3, 32, 32) and res.images.dtype == torch.float32
    assert psnr(res.images, x) > 100
    s = res.stats[0]
    assert s["rank"] == 64 and s["residual"] < 1e-10 and s["bias_residual"] < 1e-12 and s["notes"] == []
    assert 1 < s["condition_number"] < 1e6


def test_exact_on_fedmjp_models_with_and_without_surgery():
    x = image("coffee", 32)
    for first in ("standard", "april"):
        torch.manual_seed(1)
        model = timm.create_model("mjp_vit_cifar_patch4_32", variant="plain", depth=2, first_block=first).eval().double()
        res, _ = attack(model, x)
        assert not res.failed and psnr(res.images, x) > 100, (first, res.reason)


def test_patch_order_round_trip():
    info = pe_conditions(small_vit())
    x = torch.rand(2, 3, 32, 32, dtype=torch.float64)
    assert torch.equal(patches_to_images(images_to_patches(x, info), info), x)


def test_float32_client_is_approximate_and_says_nothing_false():
    model = small_vit().float()
    x = image("chelsea", 32)
    update = attacks.compute_update(model, normalize(x).float(), torch.tensor([3]))
    res = attacks.create_attack("pe_closed_form").reconstruct(model, update, MD)
    assert not res.failed
    assert 50 < psnr(res.images, x) < 140  # float32 rounding of the gradient, not an exact copy
    assert 0 < res.stats[0]["bias_residual"] < 1e-5


def test_reconstruct_many_equals_one_by_one():
    model = small_vit()
    xs = [image(n, 32) for n in ("astronaut", "coffee", "chelsea")]
    updates = [attacks.compute_update(model, normalize(x), torch.tensor([i])) for i, x in enumerate(xs)]
    atk = attacks.create_attack("pe_closed_form")
    many = atk.reconstruct_many(model, updates, MD)
    for r, u, x in zip(many, updates, xs):
        one = atk.reconstruct(model, u, MD)
        assert torch.allclose(r.images, one.images, atol=1e-6) and psnr(r.images, x) > 100


def test_refuses_no_pe_with_reason():
    torch.manual_seed(0)
    model = timm.create_model("mjp_vit_cifar_patch4_32", variant="nope", depth=2).eval().double()
    res, _ = attack(model, image("astronaut", 32))
    assert res.failed and "no learned position embedding" in res.reason and res.error is None


def test_refuses_batch_above_one_with_reason():
    model = small_vit()
    x = torch.cat([image("astronaut", 32), image("coffee", 32)])
    res, _ = attack(model, x, labels=(1, 2), num_images=2)
    assert res.failed and "batch size 1" in res.reason and "cannot be separated" in res.reason
    assert len(res.stats) == 2 and res.error is None


def test_refuses_dynamic_img_size_and_other_grid():
    res, _ = attack(small_vit(dynamic_img_size=True), image("astronaut", 32))
    assert res.failed and "dynamic_img_size" in res.reason
    model = small_vit()
    update = attacks.compute_update(model, normalize(image("astronaut", 32)), torch.tensor([1]))
    res = attacks.create_attack("pe_closed_form").reconstruct(model, update, dict(MD, image_size=(3, 64, 64)))
    assert res.failed and "resampled PE" in res.reason


def test_underdetermined_when_n_exceeds_d_is_noted():
    model = small_vit(embed_dim=48, num_heads=3)  # N = 64 > D = 48
    res, _ = attack(model, image("astronaut", 32))
    assert not res.failed and res.stats[0]["rank"] <= 48
    assert any("N = 64 patches > D = 48" in n for n in res.stats[0]["notes"])


def test_mjp_zero_rows_are_detected_and_system_exposed():
    torch.manual_seed(0)
    model = timm.create_model("mjp_vit_cifar_patch4_32", variant="mjp", depth=2).eval().double()
    x = image("astronaut", 32)
    plan = model.draw_plan(1, gamma=0.27, seed=3)
    xt = model.shuffle_images(x, plan)
    update = attacks.compute_update(model, normalize(xt), torch.tensor([1]), unk_mask=plan.mask)
    system = pe_closed_form_system(model, update)
    S = plan.mask[0]
    assert torch.equal(system.zero_rows, S)
    # the unknown rows' sum is dL/dE_unk, and G_U^T X_U + G_S^T X_S = dL/dW_e with the true G_S
    assert torch.allclose(system.G.sum(0) + system.g_unk, system.db_e, atol=1e-14)
    X = images_to_patches(normalize(xt), system.info)[0]
    resid = system.dW_e - system.G.T @ X
    assert resid.norm() > 1e-6 * system.dW_e.norm()  # the shuffled rows' term is missing from G
    res = attacks.create_attack("pe_closed_form").reconstruct(model, update, MD)
    s = res.stats[0]
    assert not res.failed and s["zero_pe_grad_rows"] == int(S.sum()) and s["rank"] == 64 - int(S.sum())
    assert any(n.startswith("MJP:") for n in s["notes"])


@pytest.mark.slow
def test_exact_on_timm_deit_small_224():
    torch.manual_seed(0)
    model = timm.create_model("deit_small_patch16_224").eval().double()
    x = image("astronaut", 224)
    t0 = time.perf_counter()
    res, _ = attack(model, x)
    assert not res.failed and psnr(res.images, x) > 100, res.reason
    s = res.stats[0]
    assert s["rank"] == 196 and s["N"] == 196 and s["D"] == 384 and s["notes"] == []
    assert time.perf_counter() - t0 < 60
