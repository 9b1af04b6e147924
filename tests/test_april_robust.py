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
    with pytest.raises(ValueError, match="config key 'options.prior': unknown value 'l2'; valid: smooth, tv, gaussian"):
        attacks.create_attack("april_robust", prior="l2")
    with pytest.raises(ValueError, match="use_qkv"):
        attacks.create_attack("april_robust", use_qkv="always")


# ------------------------------------------------------------------ Kerckhoffs: the defence spec in metadata
def test_local_dp_spec_in_metadata_gives_the_solve_of_the_explicit_options(case):
    model, _, update = case
    noisy = local_dp(update, 1.0, 1e-5, torch.Generator().manual_seed(0))
    spec = dict(name="local_dp", clip=1.0, sigma=1e-5, noise="gaussian")
    by_meta = attacks.create_attack("april_robust", iterations=2).reconstruct(model, noisy, dict(MD, defence=spec))
    by_opts = attacks.create_attack("april_robust", iterations=2, sigma=1e-5, clip=1.0).reconstruct(model, noisy, MD)
    unknown = attacks.create_attack("april_robust", iterations=2, known_defence=False).reconstruct(
        model, noisy, dict(MD, defence=spec))
    assert not by_meta.failed and not by_opts.failed
    assert torch.equal(by_meta.images, by_opts.images)
    assert by_meta.stats[0]["noise_model"]["source"] == "defence metadata"
    assert by_opts.stats[0]["noise_model"]["source"] == "options"
    assert unknown.stats[0]["noise_model"]["source"] == "estimate"
    assert not torch.equal(unknown.images, by_meta.images)
    assert any(n.startswith("noise model (defence metadata): local_dp") for n in by_meta.stats[0]["notes"])


def test_each_defence_spec_becomes_its_noise_model(case):
    model, _, update = case
    noisy = local_dp(update, 1.0, 1e-5, torch.Generator().manual_seed(0))

    def model_of(spec, **md):
        res = attacks.create_attack("april_robust", iterations=1).reconstruct(model, noisy, dict(MD, defence=spec, **md))
        assert not res.failed, res.reason
        return res.stats[0]["noise_model"]

    assert model_of(dict(name="local_dp", clip=2.0, sigma=1e-5, noise="laplace"))["std"] == pytest.approx(2e-5 * 2 ** 0.5)
    assert model_of(dict(name="dp_sgd", clip=1.0, sigma=3e-5))["std"] == pytest.approx(3e-5)  # / batch size 1
    # a FedAvg delta of lr 0.1: noise added to the delta is 1 / lr larger in gradient units
    assert model_of(dict(name="local_dp", clip=1.0, sigma=1e-5), update_type="delta", lr=0.1)["std"] == pytest.approx(1e-4)
    q = model_of(dict(name="quantize", bits=8, stochastic=True))
    assert (q["quant_bits"], q["quant_stochastic"], q["std"]) == (8, True, 0.0)
    assert model_of(dict(name="prune", keep=0.1))["prune_keep"] == 0.1
    assert model_of(dict(name="central_dp", clip=1.0, sigma=0.1))["source"] == "defence metadata"


@pytest.mark.parametrize("spec", [dict(name="local_dp", clip=1.0, sigma=-1.0), dict(name="no_such_defence"),
                                  dict(name="quantize", bits=8, levels=3)])
def test_invalid_or_unknown_defence_spec_is_treated_as_unknown(case, spec):
    model, _, update = case
    noisy = local_dp(update, 1.0, 1e-5, torch.Generator().manual_seed(0))
    res = attacks.create_attack("april_robust", iterations=2).reconstruct(model, noisy, dict(MD, defence=spec))
    ref = attacks.create_attack("april_robust", iterations=2, known_defence=False).reconstruct(model, noisy, MD)
    assert not res.failed, res.reason
    assert res.stats[0]["noise_model"]["source"] == "estimate"
    assert any("treated as unknown" in n for n in res.stats[0]["notes"])
    assert torch.equal(res.images, ref.images)


def test_explicit_options_win_over_the_metadata(case):
    model, _, update = case
    noisy = local_dp(update, 1.0, 1e-5, torch.Generator().manual_seed(0))
    res = attacks.create_attack("april_robust", iterations=1, sigma=1e-5, clip=1.0).reconstruct(
        model, noisy, dict(MD, defence=dict(name="quantize", bits=8)))
    s = res.stats[0]
    assert s["noise_model"]["source"] == "options" and s["noise_model"]["quant_bits"] is None
    assert any("metadata defence" in n and "not used" in n for n in s["notes"])


# ------------------------------------------------------------------ the Gaussian patch prior
def test_shipped_patch_prior_loads_with_its_provenance():
    from attacks.closed_form.priors import DEFAULT_PRIOR, load_patch_prior

    prior = load_patch_prior()
    assert (prior.patch, prior.channels, prior.image_size, prior.dim) == (4, 3, 32, 48)
    assert np.all((prior.mean > 0) & (prior.mean < 1))
    assert np.linalg.eigvalsh(prior.cov).min() > 0
    note = __import__("json").loads(DEFAULT_PRIOR.with_suffix(".json").read_text())
    assert note["patch"] == 4 and len(note["data_sha256"]) == 64 and note["command"].startswith("python -m attacks.closed_form.priors")
    assert DEFAULT_PRIOR.stat().st_size < 50_000  # statistics only


def test_gaussian_prior_refuses_a_model_of_another_patch_size():
    torch.manual_seed(0)
    model = timm.create_model("mjp_vit_cifar_patch4_32", variant="plain", depth=1, patch_size=8).eval().double()
    x = image("coffee")
    update = attacks.compute_update(model, normalize(x), torch.tensor([2]))
    noisy = quantize_update(update, 8)
    res = attacks.create_attack("april_robust", prior="gaussian").reconstruct(model, noisy, MD)
    assert res.failed and "4 x 4 x 3 patches" in res.reason and "8 x 8 x 3" in res.reason
    assert "python -m attacks.closed_form.priors" in res.reason
    auto = attacks.create_attack("april_robust", prior="auto", iterations=2).reconstruct(model, noisy, MD)
    assert not auto.failed and auto.stats[0]["prior"] == "smooth"
    assert any("smoothness prior is used instead" in n for n in auto.stats[0]["notes"])


def test_missing_prior_file_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="not found.*python -m attacks.closed_form.priors"):
        attacks.create_attack("april_robust", prior="gaussian", prior_path=str(tmp_path / "none.npz"))


def test_gaussian_prior_keeps_the_clean_update_exact(case):
    model, x, update = case
    res = attacks.create_attack("april_robust", prior="gaussian").reconstruct(model, update, dict(MD, defence={"name": "none"}))
    assert not res.failed and psnr(res.images, x) > 100


def test_gaussian_prior_improves_on_smooth_after_8bit_quantisation(case):
    """The astronaut and coffee photographs, 8-bit quantisation known from the metadata."""
    model, x, update = case
    spec = dict(name="quantize", bits=8)
    xs = [x, image("coffee")]
    ups = [update, attacks.compute_update(model, normalize(xs[1]), torch.tensor([2]))]
    out = {}
    for prior in ("smooth", "gaussian"):
        atk = attacks.create_attack("april_robust", prior=prior, iterations=4)
        out[prior] = [psnr(atk.reconstruct(model, quantize_update(u, 8), dict(MD, defence=spec)).images, xi)
                      for u, xi in zip(ups, xs)]
    assert np.mean(out["gaussian"]) >= np.mean(out["smooth"]) + 0.5, out


def test_patch_prior_builder_on_an_image_folder(tmp_path):
    pytest.importorskip("sklearn")
    from PIL import Image

    from attacks.closed_form.priors import load_patch_prior
    from attacks.closed_form.priors.__main__ import main

    rng = np.random.default_rng(0)
    arrays = []
    for i in range(6):
        folder = tmp_path / "data" / "train" / f"c{i % 2}"
        folder.mkdir(parents=True, exist_ok=True)
        a = rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)
        Image.fromarray(a).save(folder / f"{i}.png")
        arrays.append(a)
    out = tmp_path / "p2.npz"
    assert main(["--data-path", str(tmp_path / "data"), "--patch", "2", "--out", str(out), "--lw-samples", "50"]) == 0
    prior = load_patch_prior(out)
    x = np.stack(arrays).astype(np.float64).transpose(0, 3, 1, 2) / 255
    rows = np.lib.stride_tricks.sliding_window_view(x, (2, 2), axis=(2, 3)).transpose(0, 2, 3, 1, 4, 5).reshape(-1, 12)
    assert prior.patch == 2 and prior.image_size == 8
    np.testing.assert_allclose(prior.mean, rows.mean(0), atol=1e-12)
    assert (out.with_suffix(".json")).is_file()
    with pytest.raises(SystemExit):  # argparse's error: the path is named
        main(["--data-path", str(tmp_path / "missing"), "--patch", "2", "--out", str(out)])
    (tmp_path / "empty").mkdir()
    assert main(["--data-path", str(tmp_path / "empty"), "--patch", "2", "--out", str(out)]) == 2  # no train/
