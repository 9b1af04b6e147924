"""april_robust: the first layer's equations as one regularised least squares (scikit-image's images)."""
from __future__ import annotations

import numpy as np
import pytest
import skimage.data
import skimage.transform
import timm
import torch

import attacks
from helpers import normalize, psnr
import fedmjp  # noqa: F401  (registers the mjp_* models)
from defences.transforms import local_dp, prune_update, quantize_update

MEAN = torch.tensor([0.485, 0.456, 0.406], dtype=torch.float64)
STD = torch.tensor([0.229, 0.224, 0.225], dtype=torch.float64)
MD = dict(mean=MEAN, std=STD)


def image(name: str, size: int = 32) -> torch.Tensor:
    a = skimage.transform.resize(getattr(skimage.data, name)(), (size, size), anti_aliasing=True)
    return torch.from_numpy(a).permute(2, 0, 1)[None].double()


@pytest.fixture(scope="module")
def case():
    """A design-A CIFAR-scale DeiT (depth 2, fresh weights) and a float64 update of one photograph."""
    torch.manual_seed(0)
    model = timm.create_model("mjp_vit_cifar_patch4_32", variant="plain", depth=2, first_block="april").eval().double()
    x = image("astronaut")
    return model, x, attacks.compute_update(model, normalize(x), torch.tensor([1]))


def test_exact_on_clean_float64_update(case):
    model, x, update = case
    res = attacks.create_attack("april_robust").reconstruct(model, update, MD)
    assert not res.failed, res.reason
    assert psnr(res.images, x) > 100
    assert any(n.startswith("consistent update") for n in res.stats[0]["notes"])


def test_exact_on_clean_update_of_standard_prenorm_vit():
    torch.manual_seed(0)
    model = timm.create_model("mjp_vit_cifar_patch4_32", variant="plain", depth=2).eval().double()
    x = image("coffee")
    update = attacks.compute_update(model, normalize(x), torch.tensor([2]))
    res = attacks.create_attack("april_robust").reconstruct(model, update, MD)
    assert not res.failed and psnr(res.images, x) > 100


def test_degrades_monotonically_with_local_dp_sigma(case):
    """Mean PSNR over 2 noise seeds falls as sigma grows, with sigma known or not."""
    model, x, update = case
    sigmas = (1e-7, 1e-5, 1e-3)
    for known in (True, False):
        means = []
        for sigma in sigmas:
            opts = dict(sigma=sigma, clip=1.0) if known else {}
            atk = attacks.create_attack("april_robust", iterations=4, **opts)
            vals = [psnr(atk.reconstruct(model, local_dp(update, 1.0, sigma, torch.Generator().manual_seed(s)), MD).images, x)
                    for s in range(2)]
            means.append(float(np.mean(vals)))
        assert means[0] > means[1] + 0.5 > means[2] + 0.5, (known, means)


def test_noise_read_off_the_redundancy_matches_the_truth(case):
    model, _, update = case
    sigma = 1e-5
    noisy = local_dp(update, 1.0, sigma, torch.Generator().manual_seed(0))
    s = attacks.create_attack("april_robust", iterations=1).reconstruct(model, noisy, MD).stats[0]
    assert 0.7 * sigma < s["noise_std_from_redundancy"] < 1.4 * sigma


@pytest.mark.parametrize("prior", ["smooth", "tv"])
def test_beats_the_exact_closed_forms_after_8bit_quantisation(case, prior):
    model, x, update = case
    q = quantize_update(update, 8)
    robust = psnr(attacks.create_attack("april_robust", quant_bits=8, prior=prior, iterations=4).reconstruct(model, q, MD).images, x)
    april = psnr(attacks.create_attack("april_analytic").reconstruct(model, q, MD).images, x)
    assert robust > april + 3, (robust, april)


def test_pruned_entries_are_missing_and_said_so(case):
    model, x, update = case
    pruned = prune_update(update, 0.1)
    res = attacks.create_attack("april_robust").reconstruct(model, pruned, MD)
    s = res.stats[0]
    assert not res.failed and s["observed_fraction"]["We"] < 1.0
    assert any("first-layer signal is gone" in n for n in s["notes"])  # top-10 % keeps no entry of dL/dP here
    april = attacks.create_attack("april_analytic").reconstruct(model, pruned, MD)
    assert psnr(res.images, x) > psnr(april.images, x)  # the mean patch beats APRIL's mean image


def test_refuses_batch_above_one_and_bad_options(case):
    model, _, _ = case
    x = torch.cat([image("astronaut"), image("coffee")])
    update = attacks.compute_update(model, normalize(x), torch.tensor([1, 2]))
    res = attacks.create_attack("april_robust").reconstruct(model, update, dict(MD, num_images=2))
    assert res.failed and "batch size 1" in res.reason
    with pytest.raises(ValueError, match="sigma needs the clip"):
        attacks.create_attack("april_robust", sigma=0.1)
    with pytest.raises(ValueError, match="prior must be"):
        attacks.create_attack("april_robust", prior="l2")
    with pytest.raises(ValueError, match="use_qkv"):
        attacks.create_attack("april_robust", use_qkv="always")
