"""``ig_closed_start`` (attacks/optimization/ig_closed_start.py): cosine gradient matching from a closed-form start, run
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
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['pe_weight'\]"):  # april_optimization's alone
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


@pytest.mark.slow
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
        # float32 sums batched in another order may cross the stopping threshold a few steps apart
        # (measured: 34 vs 37 and 37 vs 35 steps, the kept images equal to the last bit)
        assert abs(alone.stats[0]["trials"][0]["iterations_run"] - trial["iterations_run"]) <= 5
        assert torch.allclose(alone.images, res.images, atol=2e-3)


@pytest.mark.slow
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


def test_mjp_start_takes_mjp_adaptive_s_estimate_from_the_update_s_store(monkeypatch) -> None:
    """With the update's estimate store in its metadata (a benchmark round), the start reads the x~
    an mjp_adaptive with the same options put there instead of computing it again; without it, it
    computes it: the same result either way."""
    import dataclasses

    import attacks.optimization.mjp_adaptive as mjp
    from attacks.api.estimates import EstimateStore

    monkeypatch.setattr(mjp, "SPAN_ITERATIONS", 30)  # the default options' span fit, shortened
    model = model_of("mjp")
    x = bundled_images(1, 32, start=2)
    plan = model.draw_plan(1, gamma=0.27, seed=3)
    update = attacks.compute_update(model, normalize(model.shuffle_images(x, plan)), torch.tensor([2]),
                                    unk_mask=plan.mask)
    store = EstimateStore()
    shared = dataclasses.replace(attacks.AttackMetadata.parse(meta(2), model), estimates=store)
    assert not attacks.create_attack("mjp_adaptive").reconstruct(model, update, shared).failed
    assert (store.computed, store.reused) == (1, 0)
    ig = attacks.create_attack("ig_closed_start", iterations=3, restarts=1, start_attacks=["mjp_adaptive"])
    assert ig.shares_estimates
    res = ig.reconstruct(model, update, shared)
    assert (store.computed, store.reused) == (1, 1)
    alone = ig.reconstruct(model, update, meta(2))
    assert not res.failed and res.stats[0]["trials"][0]["start"].startswith("mjp_adaptive")
    assert torch.equal(res.images, alone.images)
    # the default starts include batch_match's fitted batch at B > 1, which is shared too
    assert attacks.create_attack("ig_closed_start", mjp_mask=False).shares_estimates
    assert not attacks.create_attack("ig_closed_start", mjp_mask=False, start_attacks=["mjp_adaptive"]).shares_estimates
    assert not attacks.create_attack("ig_closed_start", start_attacks=["april_robust"]).shares_estimates


def test_batch_update_starts_from_batch_match_s_fitted_batch_in_the_update_s_store() -> None:
    """At B = 2 no closed form applies: the first restart starts from batch_match's fitted batch,
    which a batch_match with the same options already put in the update's store (a benchmark round:
    fitted once) or which the start fits itself; the same images either way."""
    import dataclasses

    from attacks.api.estimates import EstimateStore
    from attacks.optimization.ig_closed_start import BATCH_START

    model = model_of("plain")
    x = bundled_images(2, 32, start=0)
    labels = torch.tensor([0, 1])
    update = attacks.compute_update(model, normalize(x), labels)
    md = {**MD, "num_images": 2, "image_size": (3, 32, 32), "labels": labels}
    store = EstimateStore()
    shared = dataclasses.replace(attacks.AttackMetadata.parse(md, model), estimates=store)
    fast = {**BATCH_START, "iterations": 5}
    row = attacks.create_attack("batch_match", **fast)
    assert row.shares_estimates
    fitted = row.reconstruct(model, update, shared)
    assert not fitted.failed and (store.computed, store.reused) == (1, 0)
    ig = attacks.create_attack("ig_closed_start", iterations=2, restarts=1, start_options={"batch_match": fast})
    assert ig.shares_estimates
    res = ig.reconstruct(model, update, shared)
    assert (store.computed, store.reused) == (1, 1)
    assert not res.failed and res.stats[0]["trials"][0]["start"].startswith("batch_match")
    alone = ig.reconstruct(model, update, md)
    assert torch.equal(res.images, alone.images)
    # the row reads its fit back too: the same images, the reuse in its notes
    again = attacks.create_attack("batch_match", **fast).reconstruct(model, update, shared)
    assert torch.equal(again.images, fitted.images)
    assert any("fitted batch reused" in note for note in again.stats[0]["notes"])


def test_start_options_are_checked_when_the_attack_is_built() -> None:
    with pytest.raises(ValueError, match=r"start_options\['batch_match'\].*options.tv"):
        attacks.create_attack("ig_closed_start", start_options={"batch_match": {"tv": "x"}})
    with pytest.raises(ValueError, match="not in start_attacks"):
        attacks.create_attack("ig_closed_start", start_attacks=["pe_closed_form"], start_options={"batch_match": {}})
    with pytest.raises(ValueError, match="unknown attack 'nope'"):
        attacks.create_attack("ig_closed_start", start_options={"nope": {}})


def test_unknown_start_falls_back_to_a_random_draw() -> None:
    model = model_of("plain")
    _, update = plain_update(model, 1)
    res = attacks.create_attack("ig_closed_start", iterations=5, converge_window=5, restarts=1,
                                start_attacks=["no_such_attack"]).reconstruct(model, update, meta(1))
    st = res.stats[0]
    assert st["trials"][0]["start"] == "random"
    assert any("no_such_attack is not a registered attack" in n for n in st["notes"])


def test_defence_terms_vanish_at_the_clients_gradient() -> None:
    """The modelled defences' data terms are zero at the gradient the client actually had (the
    pruned support and the quantiser's bins exactly, the noise's likelihood in expectation) and
    positive at another image's gradient."""
    from attacks.api.base import AttackMetadata
    from attacks.optimization.match_terms import defence_match
    from defences.transforms import local_dp, prune_update, quantize_update

    model = model_of("plain")
    _, clean = plain_update(model, 0)
    _, other = plain_update(model, 1)
    names = [n for n in clean if n != "unk_embed"]
    as_k = lambda u: {n: u[n].float()[None] for n in names}  # noqa: E731
    for spec, sent in (({"name": "prune", "keep": 0.1}, prune_update(clean, 0.1)),
                       ({"name": "quantize", "bits": 8, "stochastic": False}, quantize_update(clean, 8)),
                       ({"name": "quantize", "bits": 1, "stochastic": False}, quantize_update(clean, 1)),
                       ({"name": "local_dp", "clip": 1e3, "sigma": 1e-6, "noise": "gaussian"},
                        local_dp(clean, 1e3, 1e-6, torch.Generator().manual_seed(0)))):
        parsed = AttackMetadata.parse({**meta(0), "defence": spec}, model)
        match, notes = defence_match(as_k(sent), [sent], [parsed], names)
        assert match.kind != "cosine" and notes
        at_truth, elsewhere = float(match.data(as_k(clean))[0]), float(match.data(as_k(other))[0])
        if spec["name"] == "local_dp":  # noise of scale 1e-6: the likelihood term is ~0 (its mean) at the truth
            assert abs(at_truth) < 0.05 and elsewhere > 10, (at_truth, elsewhere)
        else:
            assert abs(at_truth) < 1e-5 and elsewhere > 1e-3, (spec, at_truth, elsewhere)
        assert float(match.cosine(as_k(clean))[0]) > 0 or spec["name"] == "local_dp"


@pytest.mark.slow
@pytest.mark.parametrize("spec", [{"name": "quantize", "bits": 8, "stochastic": False}, {"name": "prune", "keep": 0.1}])
def test_modelled_defence_does_at_least_as_well_as_ignoring_it(spec) -> None:
    """A real photograph, the same seeded start and budget: matching through the quantiser's bins or
    on the pruned support reconstructs at least as well as cosine matching that ignores the defence
    (measured: 8-bit 12.51 vs 12.36 dB, prune 0.1 11.65 vs 11.59 dB; float32 sums move a run by
    ~0.05 dB, hence the 0.3 dB tolerance)."""
    from defences import apply_update_defence

    model = model_of("plain")
    x, clean = plain_update(model, 0)
    full = {"name": spec["name"], **spec}
    sent = apply_update_defence(clean, full, torch.Generator().manual_seed(0))
    md = {**meta(0), "defence": full}
    got = {}
    for modelled in (False, True):
        res = attacks.create_attack("ig_closed_start", iterations=400, restarts=1,
                                    defence_model=modelled).reconstruct(model, sent, md)
        assert not res.failed
        got[modelled] = psnr(res.images, x)
        assert any(f"defence {spec['name']}" in n for n in res.stats[0]["notes"]) == modelled
    assert got[True] >= got[False] - 0.3, got


def test_a_graph_that_cannot_be_recorded_falls_back_to_the_same_eager_steps() -> None:
    """``cuda_graph`` records each step as a CUDA graph (tests/test_cuda.py checks it on a GPU). Where
    recording fails (here: no CUDA device) the steps run eagerly through the same objective: the
    same iterations and the same image to the last bit, and the result says why."""
    from defences.transforms import quantize_update

    model = model_of("plain")
    _, update = plain_update(model, 0)
    update = quantize_update(update, 8)
    opts = dict(iterations=12, lr=0.01, converge_window=12, restarts=1, start_attacks=["pe_closed_form"])
    eager = attacks.create_attack("ig_closed_start", **opts).reconstruct(model, update, meta(0))
    forced = attacks.create_attack("ig_closed_start", **opts)
    forced.cuda_graph = True  # what the option sets on a CUDA device
    fallback = forced.reconstruct(model, update, meta(0))
    assert not eager.failed and not fallback.failed, (eager.reason, fallback.reason)
    assert "recording a CUDA graph failed" in fallback.stats[0]["steps_run_as"]
    assert "steps_run_as" not in eager.stats[0]
    assert fallback.stats[0]["iterations"] == eager.stats[0]["iterations"]
    assert torch.equal(fallback.images, eager.images)
    assert not attacks.create_attack("ig_closed_start", cuda_graph=True).cuda_graph  # ignored on the CPU
