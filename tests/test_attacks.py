"""APRIL closed form, the attack interface and our batched gradient matching (CPU, small models)."""
from __future__ import annotations

import pytest
import timm
import torch

import attacks
import fedmjp  # noqa: F401  (registers the mjp_* models)
from helpers import MD, bundled_images, normalize, psnr


def real_images(n: int = 1, size: int = 32) -> torch.Tensor:
    """[n, 3, size, size] float32 in [0, 1]: scikit-image's bundled photographs (centre crop, bilinear)."""
    return bundled_images(n, size).float()


def april_model(variant: str = "plain", **kw) -> torch.nn.Module:
    """32 px, patch 4, D = 192 (T = 65 <= D, 3p^2 = 48 <= D); depth 2 (the closed form reads block 0)."""
    torch.manual_seed(0)
    kw.setdefault("depth", 2)
    return timm.create_model("mjp_vit_cifar_patch4_32", variant=variant, first_block="april", **kw).eval().double()


# --------------------------------------------------------------------------------- interface
def test_registry_lists_names_for_unknown():
    names = attacks.attack_names()
    for required in ("april_analytic", "april_optimization", "invertinggradients", "deepleakage", "modern",
                     "seethroughgradients", "invertinggradients_batched"):
        assert required in names
    with pytest.raises(ValueError, match="april_analytic"):
        attacks.create_attack("nope")
    with pytest.raises(ValueError):
        attacks.create_attack("april_analytic", precision="float16")
    with pytest.raises(ValueError):
        attacks.create_attack("invertinggradients_batched", not_an_option=1)


def test_each_attack_declares_its_options_as_one_schema():
    """Every built-in attack's options are one pydantic schema: checked when the config is (ranges,
    choices and cross-checks too, not only when the attack is built), each message naming the
    option, what it takes and, for an unknown one, the valid ones."""
    from attacks.api.base import AttackOptions
    from attacks.api.registry import attack_class, attack_options, option_schema

    # built-in only: test modules register attacks of their own when pytest imports them
    built_in = [n for n in attacks.attack_names() if attack_class(n).__module__.startswith("attacks.")]
    assert {"april_robust", "batch_match", "ig_closed_start", "mjp_adaptive", "invertinggradients"} <= set(built_in)
    for name in built_in:
        schema = option_schema(attack_class(name))
        assert issubclass(schema, AttackOptions) and "raise_errors" in schema.model_fields, name
        assert attacks.create_attack(name).options == schema(), name  # the defaults build
    assert attack_options("ig_closed_start", {"iterations": "1e2", "start_attacks": ("pe_closed_form",)}) == {
        "iterations": 100, "start_attacks": ["pe_closed_form"]}
    for name, options, message in (
            ("ig_closed_start", {"converge_window": 0}, "config key 'options.converge_window' must be an integer >= 1, got 0"),
            ("april_robust", {"sigma": 0.1}, "sigma needs the clip it multiplies"),
            ("april_robust", {"quant_bits": 40}, "config key 'options.quant_bits' must be an integer in [1, 32], got 40"),
            ("mjp_adaptive", {"starts": 0}, "config key 'options.starts' must be an integer >= 1, got 0"),
            ("batch_match", {"signed": "hard"}, "unknown option(s) ['signed']; valid: raise_errors, iterations"),
            ("invertinggradients_batched", {"label_strategy": "x"}, "unknown value 'x'; valid: bias, idlg")):
        with pytest.raises(ValueError) as err:
            attack_options(name, options)
        assert str(err.value).startswith(f"bad options for attack {name!r}: ") and message in str(err.value), err.value
    with pytest.raises(ValueError, match="sigma needs the clip"):
        attacks.AprilRobust(sigma=0.1)  # the class itself checks them too


# --------------------------------------------------------------------------------- APRIL analytic
def test_april_analytic_rebuilds_real_image_and_agrees_with_breaching():
    model = april_model()
    x = real_images(1).double()
    y = torch.tensor([0])
    update = attacks.compute_update(model, normalize(x), y)
    res = attacks.create_attack("april_analytic").reconstruct(model, update, MD)
    assert not res.failed and res.images.shape == (1, 3, 32, 32) and res.images.dtype == torch.float32
    assert psnr(res.images, x) > 100
    s = res.stats[0]
    assert s["rank_G_Z"] == 65 and s["cls_residual"] < 1e-5 and s["system_residual"] < 1e-8
    assert s["notes"] == []
    # breaching's own AprilAttacker on the same gradients (see attacks.optimization.breaching_adapter.BreachingApril)
    ref = attacks.create_attack("april_analytic_breaching").reconstruct(model, update, MD)
    assert not ref.failed
    assert (ref.images - res.images).abs().max() < 1e-6


def test_april_analytic_batched_matches_single_and_delta_updates():
    model = april_model()
    x = real_images(3).double()
    y = torch.tensor([0, 1, 2])
    updates = attacks.compute_per_sample_updates(model, normalize(x), y)
    attack = attacks.create_attack("april_analytic")
    many = attack.reconstruct_many(model, updates, MD)
    for i, r in enumerate(many):
        assert psnr(r.images, x[i:i + 1]) > 100
        single = attack.reconstruct(model, updates[i], MD)
        assert (single.images - r.images).abs().max() < 1e-6
    lr = 0.05
    delta = {k: -lr * g for k, g in updates[0].items()}
    r = attack.reconstruct(model, delta, dict(MD, update_type="delta", lr=lr, local_steps=1))
    assert psnr(r.images, x[:1]) > 100


def test_april_analytic_reads_only_the_arrays_it_uses_from_a_servers_update(monkeypatch):
    """The server hands updates on as :class:`clients.records.LazyState`: the closed form must
    copy only what it solves with out of the client's message, and give the same answer."""
    from clients import records

    model = april_model()
    x = real_images(1).double()
    update = attacks.compute_update(model, normalize(x), torch.tensor([0]))
    received = records.LazyState(records.encode_state(update))
    decoded, decode = [], records.decode_tensor
    monkeypatch.setattr(records, "decode_tensor", lambda array: decoded.append(array) or decode(array))
    got = attacks.create_attack("april_analytic").reconstruct(model, received, MD)
    want = attacks.create_attack("april_analytic").reconstruct(model, update, MD)
    assert not got.failed and torch.equal(got.images, want.images)
    assert 1 <= len(decoded) <= 3 < len(update)  # pos_embed, qkv weight (cls_token where the PE skips it)


def test_april_patch_embedding_pseudo_inverse_is_reused_only_for_the_same_weights(monkeypatch):
    """The closed form's SVD of the patch embedding runs once per distinct W_e: every round of a
    fixed-weight federation hits the cache; a changed weight or rcond does not."""
    from attacks.closed_form import april

    model = april_model()
    x = real_images(2).double()
    updates = attacks.compute_per_sample_updates(model, normalize(x), torch.tensor([0, 1]))
    svds, svd = [], torch.linalg.svd
    monkeypatch.setattr(torch.linalg, "svd", lambda *a, **k: svds.append(1) or svd(*a, **k))
    monkeypatch.setattr(april, "_PINV_CACHE", april.cachetools.LRUCache(maxsize=8))
    attack = attacks.create_attack("april_analytic")
    first = attack.reconstruct_many(model, updates, MD)
    again = attack.reconstruct_many(model, updates, MD)  # the next round, same weights
    assert len(svds) == 1 and all(torch.equal(a.images, b.images) for a, b in zip(first, again))
    with torch.no_grad():
        model.patch_embed.proj.weight[0, 0, 0, 0] += 1e-3
    changed = attack.reconstruct_many(model, updates, MD)
    assert len(svds) == 2 and not torch.equal(changed[0].images, first[0].images)
    attacks.create_attack("april_analytic", rcond=1e-12).reconstruct_many(model, updates, MD)
    assert len(svds) == 3


def test_april_analytic_two_prefix_tokens():
    model = april_model(reg_tokens=1)
    assert model.num_prefix_tokens == 2
    x = real_images(1).double()
    update = attacks.compute_update(model, normalize(x), torch.tensor([1]))
    res = attacks.create_attack("april_analytic").reconstruct(model, update, MD)
    assert res.stats[0]["T"] == 66 and psnr(res.images, x) > 100


def test_april_analytic_mjp_setting_c_scores_far_worse():
    model = april_model("mjp")
    x = real_images(1).double()
    plan = model.draw_plan(1, gamma=0.27, seed=3)
    mask = plan.mask
    assert mask.any()
    x_shuffled = model.shuffle_images(x, plan)
    update = attacks.compute_update(model, normalize(x_shuffled), torch.tensor([0]), unk_mask=mask)
    # rows of dL/dP at the shuffled positions are exactly zero, E_unk got their gradient
    g_pe = update["pos_embed"][0, model.num_prefix_tokens:]
    assert torch.all(g_pe[mask[0]] == 0) and torch.all(g_pe[~mask[0]].abs().amax(1) > 0)
    assert update["unk_embed"].abs().sum() > 0
    res = attacks.create_attack("april_analytic").reconstruct(model, update, MD)
    assert not res.failed
    s = res.stats[0]
    assert s["zero_pe_grad_rows"] == int(mask.sum()) and s["rank_G_Z"] == 65 - int(mask.sum())
    assert any("rank-deficient" in n for n in s["notes"])
    clean = attacks.compute_update(model, normalize(x), torch.tensor([0]))
    p_clean = psnr(attacks.create_attack("april_analytic").reconstruct(model, clean, MD).images, x)
    p_c = psnr(res.images, x)  # setting (c): compared with the original x
    assert p_clean > 100 and p_c < 30
    detect = attacks.create_attack("april_analytic", pe_mode="detect_unk").reconstruct(model, update, MD)
    assert not detect.failed and psnr(detect.images, x) < 40


def test_april_analytic_refuses_prenorm_and_t_gt_d_and_flags_underdetermined():
    torch.manual_seed(0)
    plain = timm.create_model("mjp_vit_cifar_patch4_32", variant="plain", depth=1).eval().double()
    x = real_images(1).double()
    upd = attacks.compute_update(plain, normalize(x), torch.tensor([0]))
    res = attacks.create_attack("april_analytic").reconstruct(plain, upd, MD)
    assert res.failed and "design A" in res.reason and "pre-norm" in res.reason
    assert res.images.shape == (1, 3, 32, 32) and res.stats[0]["failed"]
    with pytest.raises(attacks.AprilConditionError, match="pre-norm"):
        attacks.check_conditions(plain)

    narrow = april_model(embed_dim=48, num_heads=2, depth=1)  # T = 65 > D = 48
    upd = attacks.compute_update(narrow, normalize(x), torch.tensor([0]))
    res = attacks.create_attack("april_analytic").reconstruct(narrow, upd, MD)
    assert res.failed and "T = 65" in res.reason and "D = 48" in res.reason

    coarse = april_model(patch_size=8, embed_dim=96, num_heads=2, depth=1)  # 3*64 = 192 > D = 96
    upd = attacks.compute_update(coarse, normalize(x), torch.tensor([0]))
    res = attacks.create_attack("april_analytic").reconstruct(coarse, upd, MD)
    assert not res.failed
    assert any("underdetermined: minimum-norm solution" in n for n in res.stats[0]["notes"])


def test_failures_become_results():
    model = april_model(depth=1)
    x = real_images(1).double()
    upd = attacks.compute_update(model, normalize(x), torch.tensor([0]))
    bad = {k: torch.full_like(v, float("nan")) for k, v in upd.items()}
    res = attacks.create_attack("april_analytic").reconstruct(model, bad, MD)
    assert res.failed and res.reason and torch.all(res.images == 0)
    res = attacks.create_attack("april_analytic").reconstruct(model, {"pos_embed": upd["pos_embed"]}, MD)
    assert res.failed and "qkv" in res.reason
    res = attacks.create_attack("april_analytic").reconstruct(model, upd, dict(MD, num_images=2))
    assert res.failed and res.images.shape[0] == 2 and "batch size 1" in res.reason
    ig = attacks.create_attack("invertinggradients_batched", iterations=2)
    res = ig.reconstruct(model.float(), {k: v.float() for k, v in bad.items()}, dict(MD, labels=torch.tensor([0])))
    assert res.failed and "non-finite" in res.reason


# --------------------------------------------------------------------------------- optimisation
def small_vit(variant: str = "mjp") -> torch.nn.Module:
    torch.manual_seed(0)
    return timm.create_model("mjp_vit_cifar_patch4_32", variant=variant, img_size=16, embed_dim=48,
                             num_heads=2, depth=1).eval()


def test_batched_ig_matches_breaching_invertinggradients():
    """Same objective, schedule and initialisation: B = 1 gives breaching's iterates."""
    model = small_vit()
    x = real_images(1, 16)
    y = torch.tensor([3])
    upd = attacks.compute_update(model, normalize(x), y)
    md = dict(MD, labels=y)
    ours = attacks.create_attack("invertinggradients_batched", iterations=4, seed=1).reconstruct(model, upd, md)
    ref = attacks.create_attack("invertinggradients", iterations=4, seed=1).reconstruct(model, upd, md)
    assert not ours.failed and not ref.failed
    assert ours.stats[0]["objective_first"] == pytest.approx(ref.stats[0]["objective_first"], rel=1e-4)
    assert ours.stats[0]["objective_min"] < ours.stats[0]["objective_first"]
    assert (ours.images - ref.images).abs().max() < 1e-3


def test_batched_ig_many_and_april_optimization_lower_objective():
    model = small_vit()
    x = real_images(3, 16)
    y = torch.tensor([1, 5, 7])
    updates = attacks.compute_per_sample_updates(model, normalize(x), y)
    res = attacks.create_attack("invertinggradients_batched", iterations=5).reconstruct_many(model, updates, MD)
    assert [int(r.labels) for r in res] == [1, 5, 7]  # recovered from the classifier bias gradient
    for r in res:
        assert not r.failed and r.images.shape == (1, 3, 16, 16)
        assert 0 <= r.images.min() and r.images.max() <= 1
        assert r.stats[0]["objective_min"] < r.stats[0]["objective_first"]
    prenorm = small_vit("plain")  # pre-norm block 0: april_optimization still applies
    upd = attacks.compute_update(prenorm, normalize(x[:1]), y[:1])
    r = attacks.create_attack("april_optimization", iterations=5).reconstruct(prenorm, upd, MD)
    assert not r.failed and r.stats[0]["objective_min"] < r.stats[0]["objective_first"]
