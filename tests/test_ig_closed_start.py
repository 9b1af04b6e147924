"""``ig_closed_start`` (attacks/matching.py): cosine gradient matching from a closed-form start, run
to convergence, with MJP's detected mask in the forward. Real images (scikit-image's bundled
photographs), 32 px design-A ViTs of depth 2, fresh weights, float64 clients."""
from __future__ import annotations

import pytest
import timm
import torch

import attacks
import fedmjp  # noqa: F401  (registers the mjp_* models)
from helpers import MD, bundled_images, normalize, psnr


def model_of(variant: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return timm.create_model("mjp_vit_cifar_patch4_32", variant=variant, first_block="april", depth=2).eval().double()


def plain_update(model, index: int):
    x = bundled_images(1, 32, start=index)
    return x, attacks.compute_update(model, normalize(x), torch.tensor([index % 10]))


def meta(label: int) -> dict:
    return {**MD, "num_images": 1, "image_size": (3, 32, 32), "labels": torch.tensor([label])}


def test_options_are_checked() -> None:
    with pytest.raises(ValueError, match="converge_window"):
        attacks.create_attack("ig_closed_start", converge_window=0)
    with pytest.raises(ValueError, match="no PE term"):
        attacks.create_attack("ig_closed_start", pe_weight=1.0)


def test_clean_update_keeps_the_exact_closed_form_start() -> None:
    """On a clean update the closed form is exact; matching from it must not trade it for a
    smoother image (the start competes by the cosine term)."""
    model = model_of("plain")
    x, update = plain_update(model, 0)
    res = attacks.create_attack("ig_closed_start", iterations=60, converge_window=20, restarts=1).reconstruct(
        model, update, meta(0))
    assert not res.failed
    st = res.stats[0]
    assert st["trials"][0]["start"].split(" ")[0] in ("april_robust", "pe_closed_form", "april_analytic")
    assert psnr(res.images, x) > 40.0  # float32 matching around an exact start


def test_converges_records_the_curve_and_batching_changes_nothing() -> None:
    """A perturbed update (8-bit quantisation: no exact start), a short window: every update stops
    on its own before the cap once its best objective stalls, and the stored curve shows it; two
    updates attacked together give what each gives alone."""
    from defences.transforms import quantize_update

    model = model_of("plain")
    ups, mds, xs = [], [], []
    for i in range(2):
        x, u = plain_update(model, i)
        ups.append(quantize_update(u, 8))
        mds.append(meta(i))
        xs.append(x)
    opts = dict(iterations=400, lr=0.01, converge_window=10, converge_tol=1e-2, restarts=1, curve_every=5)
    together = attacks.create_attack("ig_closed_start", **opts).reconstruct_many(model, ups, mds)
    for k, res in enumerate(together):
        st = res.stats[0]
        trial = st["trials"][0]
        assert trial["converged"] and trial["iterations_run"] < 400
        curve = st["objective_curve"]
        values = [v for _, v in curve]
        assert values == sorted(values, reverse=True)  # the running best never rises
        assert curve[-1][0] == trial["iterations_run"]
        alone = attacks.create_attack("ig_closed_start", **opts).reconstruct(model, ups[k], mds[k])
        # float32 sums batched in another order may cross the stopping threshold a step apart
        assert abs(alone.stats[0]["trials"][0]["iterations_run"] - trial["iterations_run"]) <= 2
        assert torch.allclose(alone.images, res.images, atol=2e-3)


def test_mjp_update_gets_the_detected_mask_and_an_mjp_aware_start() -> None:
    model = model_of("mjp")
    x = bundled_images(1, 32, start=2)
    plan = model.draw_plan(1, gamma=0.27, seed=3)
    x_t = model.shuffle_images(x, plan)
    update = attacks.compute_update(model, normalize(x_t), torch.tensor([2]), unk_mask=plan.mask)
    res = attacks.create_attack("ig_closed_start", iterations=30, converge_window=10, restarts=1).reconstruct(
        model, update, meta(2))
    assert not res.failed
    st = res.stats[0]
    n_shuffled = int(plan.mask.sum())
    assert any(f"E_unk at the {n_shuffled} positions" in note for note in st["notes"])
    assert st["trials"][0]["start"].split(" ")[0] in ("mjp_adaptive", "april_robust", "pe_closed_form")
    # unk_embed's gradient is matched too (the masked forward uses it)
    plain = attacks.create_attack("invertinggradients_batched", iterations=1).reconstruct(model, update, meta(2))
    assert st["matched_parameters"] == plain.stats[0]["matched_parameters"] + 1


def test_unknown_start_falls_back_to_a_random_draw() -> None:
    model = model_of("plain")
    _, update = plain_update(model, 1)
    res = attacks.create_attack("ig_closed_start", iterations=5, converge_window=5, restarts=1,
                                start_attacks=["no_such_attack"]).reconstruct(model, update, meta(1))
    st = res.stats[0]
    assert st["trials"][0]["start"] == "random"
    assert any("no_such_attack is not a registered attack" in n for n in st["notes"])
