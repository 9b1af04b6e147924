"""``likelihood_match`` (attacks/optimization/likelihood_match.py): its residual is the likelihood of
the defence the client applies, and on a real 8-bit update it improves on its start."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import timm
import torch

import attacks
import fedmjp  # noqa: F401  (registers the mjp_* models)
from attacks.optimization.breaching_adapter import attack_copy
from attacks.optimization.likelihood_match import defence_residual
from defences.spec import validate_defence
from defences.transforms import apply_update_defence
from fedmjp.checkpoint import load_checkpoint
from fedmjp.data import load_images
from helpers import MEAN, STD, bundled_images, normalize, psnr

CHECKPOINT = Path(__file__).resolve().parents[1] / "checkpoints" / "cifar_deit.safetensors"


def _tiny(variant: str = "plain") -> torch.nn.Module:
    torch.manual_seed(0)
    return timm.create_model("mjp_vit_cifar_patch4_32", img_size=16, patch_size=4, depth=2, embed_dim=48,
                             num_heads=3, variant=variant, first_block="standard").eval().double()


def _residual_at(model, update, meta, x, rounding="cells") -> torch.Tensor:
    fun = defence_residual(attack_copy(model, torch.float64), update, meta, meta.labels, rounding)[0]
    with torch.no_grad():
        return fun(meta.normalize(x).reshape(-1))


@pytest.mark.parametrize("spec", [
    {"name": "quantize", "bits": 8}, {"name": "quantize", "bits": 4, "stochastic": True},
    {"name": "prune", "keep": 0.1}, {"name": "local_dp", "clip": 1.0, "sigma": 1e-3}])
def test_the_residual_is_the_likelihood_of_the_defence_applied(spec: dict) -> None:
    """At the client's own image the residual is what the defence's error model says: zero (to float64
    rounding) inside
    every quantisation cell and on the kept entries, unit variance per entry under the Gaussian
    noise (chi-square over ~50k entries: 2 % is many standard deviations). Another image's residual
    is far larger. A defence whose transform changes without its model breaks one of these."""
    model = _tiny()
    x, other = bundled_images(2, 16)[:1], bundled_images(2, 16)[1:]
    y = torch.tensor([3])
    spec = validate_defence(spec)
    meta = attacks.AttackMetadata(1, (3, 16, 16), MEAN.double(), STD.double(), y, defence=spec)
    update = apply_update_defence(attacks.compute_update(model, normalize(x), y), spec,
                                  torch.Generator().manual_seed(0))
    r = _residual_at(model, update, meta, x)
    away = _residual_at(model, update, meta, other)
    if spec.name == "local_dp":
        assert abs(float(r.pow(2).mean()) - 1) < 0.02
        assert float(away.pow(2).mean()) > 2
    else:
        # zero to float64 rounding (the recomputed gradient differs from the client's in the 13th digit)
        assert float(r.abs().max()) < 1e-8
        assert float(away.pow(2).sum()) > 1.0


def test_likelihood_match_beats_its_start_on_a_real_8bit_update() -> None:
    """The shipped CIFAR DeiT as trained, a bundled photograph's 8-bit update, the quantiser known:
    three Gauss-Newton iterations (CG 20) on the whole update's rounding likelihood lift
    april_robust's read by about 1 dB (29.15 -> 30.18 dB, bench/likelihood_match.py --images
    embedded --num-images 2 --iterations 3 --cg-iterations 20) and more than halve the residual."""
    torch.manual_seed(0)
    model = timm.create_model("mjp_vit_cifar_patch4_32", variant="plain", first_block="standard", depth=4)
    load_checkpoint(model, CHECKPOINT)
    model = model.eval().double()
    ims = load_images("embedded", 32, 2, 10)
    x, y = ims.images[1:2].double(), ims.labels[1:2]
    spec = validate_defence({"name": "quantize", "bits": 8})
    meta = attacks.AttackMetadata(1, (3, 32, 32), MEAN.double(), STD.double(), y, defence=spec)
    q = apply_update_defence(attacks.compute_update(model, meta.normalize(x), y), spec, torch.Generator())
    start = attacks.create_attack("april_robust").reconstruct(model, q, meta)
    got = attacks.create_attack("likelihood_match", iterations=3, cg_iterations=20, start="april_robust"
                                ).reconstruct(model, q, meta)
    assert not start.failed and not got.failed, (start.reason, got.reason)
    assert psnr(got.images, x) > psnr(start.images, x) + 0.5
    st = got.stats[0]
    assert st["residual_end"] < st["residual_start"] / 2
    assert "start: april_robust" in st["notes"]


@pytest.mark.parametrize("spec", [None, {"name": "quantize", "bits": 16},
                                  {"name": "quantize", "bits": 16, "stochastic": True},
                                  {"name": "local_dp", "clip": 1.0, "sigma": 1e-5}])
def test_an_mjp_clients_update_gives_its_shuffled_positions_and_x_tilde_fits_it(spec: dict | None) -> None:
    """An MJP client's update (E_unk at every third position): the rows of dL/dP at the defence's own
    level (exact zeros; a quantiser's levels next to 0, where a zero lands; the DP noise's
    chi-square) are the client's shuffled positions, no more, no fewer, and with E_unk there the
    residual at x~ is the defence's own (zero in every cell, unit variance under the noise) while
    the plain forward's at the same image is far larger. The attack then fits x~ and returns it
    unshuffled by the jigsaw solver for setting (c)."""
    from attacks.optimization.likelihood_match import LikelihoodMatch

    model = _tiny("mjp")
    x, y = bundled_images(1, 16), torch.tensor([1])
    mask = torch.zeros(1, 16, dtype=torch.bool)
    mask[:, ::3] = True
    spec = validate_defence(spec) if spec is not None else None
    meta = attacks.AttackMetadata(1, (3, 16, 16), MEAN.double(), STD.double(), y, defence=spec)
    update = attacks.compute_update(model, normalize(x), y, unk_mask=mask)
    if spec is not None:
        update = apply_update_defence(update, spec, torch.Generator().manual_seed(0))
    attack = LikelihoodMatch(iterations=1, cg_iterations=2)
    notes: list[str] = []
    read = attack._shuffled(model, update, meta, notes)
    assert read is not None and torch.equal(read[0], mask[0]), notes
    S, clean = read
    work = attack_copy(model, torch.float64)
    r = defence_residual(work, clean, meta, y, "cells", S, update)[0]
    plain = defence_residual(work, clean, meta, y, "cells", None, update)[0]
    with torch.no_grad():
        at, off = r(normalize(x).reshape(-1)), plain(normalize(x).reshape(-1))
    if spec is not None and spec.name == "local_dp":
        assert abs(float(at.pow(2).mean()) - 1) < 0.05 and float(off.pow(2).mean()) > 2
    else:
        assert float(at.abs().max()) < 1e-8 and float(off.pow(2).sum()) > 1e-3
    got = attack.reconstruct(model, update, meta)
    assert not got.failed, got.reason
    assert got.unshuffled is not None and got.stats[0]["shuffled_positions"] == int(mask.sum())


def test_an_mjp_update_whose_patch_rows_all_sit_at_the_quantisers_zero_level_is_a_failed_row() -> None:
    """At 8 bits the tiny fresh model's class-token row of dL/dP sets the quantiser's scale and every
    patch row lands on the levels next to 0: no position can be told shuffled, and the row says so."""
    model = _tiny("mjp")
    x, y = bundled_images(1, 16), torch.tensor([1])
    mask = torch.zeros(1, 16, dtype=torch.bool)
    mask[:, ::3] = True
    spec = validate_defence({"name": "quantize", "bits": 8})
    meta = attacks.AttackMetadata(1, (3, 16, 16), MEAN.double(), STD.double(), y, defence=spec)
    update = apply_update_defence(attacks.compute_update(model, normalize(x), y, unk_mask=mask), spec,
                                  torch.Generator())
    got = attacks.create_attack("likelihood_match", iterations=1, cg_iterations=2).reconstruct(model, update, meta)
    assert got.failed and got.error is None
    assert "every patch row of dL/dP is at the quantiser's nearest-to-zero level" in got.reason


def test_the_sketch_preconditioner_is_bounded_and_reaches_the_solver() -> None:
    """sketch_rows: negative is refused when built, more than 4 x the image's entries is a failed row
    naming the bound, and a valid one runs the preconditioned solve (its CG steps counted)."""
    with pytest.raises(ValueError, match="sketch_rows"):
        attacks.create_attack("likelihood_match", sketch_rows=-1)
    model = _tiny("plain")
    x, y = bundled_images(1, 16), torch.tensor([1])
    spec = validate_defence({"name": "quantize", "bits": 8})
    meta = attacks.AttackMetadata(1, (3, 16, 16), MEAN.double(), STD.double(), y, defence=spec)
    q = apply_update_defence(attacks.compute_update(model, normalize(x), y), spec, torch.Generator())
    big = attacks.create_attack("likelihood_match", iterations=1, cg_iterations=2, sketch_rows=4 * 768 + 1,
                                start="mean").reconstruct(model, q, meta)
    assert big.failed and "sketch_rows" in big.reason
    got = attacks.create_attack("likelihood_match", iterations=1, cg_iterations=3, sketch_rows=16,
                                start="mean").reconstruct(model, q, meta)
    assert not got.failed and 1 <= got.stats[0]["cg_steps"] and got.stats[0]["residual_end"] < got.stats[0]["residual_start"]


def test_the_auto_start_takes_the_read_of_smaller_residual_and_keeps_it_for_the_updates_other_rows() -> None:
    """``start: auto`` (the default) runs block0_roots and april_robust and starts from the read whose data
    residual is smaller: on an MJP client's clean update block0_roots reads x~ exactly (residual at the
    rounding floor, april_robust's first-layer read decades above it), so the fit starts and ends there.
    Both reads go into the update's estimate store, and a second row of the same update reuses them.
    Under a defence where block0_roots refuses (this geometry: 1 + C p^2 >= D), april_robust's read is
    the start and the refusal is noted."""
    from dataclasses import replace

    from attacks.api.estimates import EstimateStore

    model = _tiny("mjp")
    x, y = bundled_images(1, 16), torch.tensor([1])
    mask = torch.zeros(1, 16, dtype=torch.bool)
    mask[:, ::3] = True
    store = EstimateStore()
    meta = attacks.AttackMetadata(1, (3, 16, 16), MEAN.double(), STD.double(), y, estimates=store)
    update = attacks.compute_update(model, normalize(x), y, unk_mask=mask)
    got = attacks.create_attack("likelihood_match", iterations=1, cg_iterations=2).reconstruct(model, update, meta)
    assert not got.failed, got.reason
    notes = got.stats[0]["notes"]
    chosen = [n for n in notes if n.startswith("start: ")]
    assert len(chosen) == 1 and chosen[0].startswith("start: block0_roots (residual "), notes
    ours, theirs = (float(v) for v in re.findall(r"residual ([0-9.e+-]+); april_robust's ([0-9.e+-]+)", chosen[0])[0])
    assert ours < 1e-6 * theirs, chosen
    keep = ~mask[0].reshape(4, 4).repeat_interleave(4, 0).repeat_interleave(4, 1)
    assert float((got.images[0].double() - x[0]).abs()[:, keep].max()) < 1e-6  # x~'s unshuffled region
    assert store.computed == 2 and store.reused == 0
    again = attacks.create_attack("likelihood_match", iterations=1, cg_iterations=2, rounding="cells").reconstruct(
        model, update, meta)
    assert not again.failed and store.computed == 2 and store.reused == 2, store
    spec = validate_defence({"name": "quantize", "bits": 16})
    sent = apply_update_defence(update, spec, torch.Generator().manual_seed(0))
    defended = attacks.create_attack("likelihood_match", iterations=1, cg_iterations=2).reconstruct(
        model, sent, replace(meta, defence=spec, estimates=None))
    notes = defended.stats[0]["notes"]
    assert any(n.startswith("start: block0_roots failed (") for n in notes) and "start: april_robust" in notes, notes


def test_bad_start_options_fail_when_built() -> None:
    with pytest.raises(ValueError, match="start_options"):
        attacks.create_attack("likelihood_match", start_options={"nonsense": 1})
    # checked against the start attacker they go to
    with pytest.raises(ValueError, match="invertinggradients_batched's.*nonsense"):
        attacks.create_attack("likelihood_match", start="invertinggradients_batched", start_options={"nonsense": 1})
    attacks.create_attack("likelihood_match", start="invertinggradients_batched", start_options={"defence_model": True})
    with pytest.raises(ValueError, match="start is 'auto'"):  # the default tries two starts
        attacks.create_attack("likelihood_match", start_options={"iterations": 3})
    with pytest.raises(ValueError, match="start is 'mean'"):
        attacks.create_attack("likelihood_match", start="mean", start_options={"iterations": 3})


def test_the_prior_rows_are_the_patch_priors_energy() -> None:
    """The MAP variant's prior rows: their sum of squares is the weight times the Gaussian patch
    prior's own energy (PatchPriorTerm, the quadratic april_robust uses) on a real photograph."""
    from types import SimpleNamespace

    from attacks.closed_form.priors import load_patch_prior
    from attacks.closed_form.robust_terms import PatchPriorTerm
    from attacks.optimization.likelihood_match import patch_prior_residual

    prior = load_patch_prior()
    x = bundled_images(1, 32).double()
    meta = attacks.AttackMetadata(1, (3, 32, 32), MEAN.double(), STD.double(), torch.tensor([0]))
    theta = meta.normalize(x)
    rows = patch_prior_residual(prior, meta.mean, meta.std, (1, 3, 32, 32), 0.25)(theta.reshape(-1))
    term = PatchPriorTerm(prior, meta, SimpleNamespace(channels=3, grid=(8, 8)), torch.device("cpu"))
    energy, _ = term.energy(theta)
    assert float(rows.pow(2).sum()) == pytest.approx(0.25 * energy, rel=1e-10)
    with pytest.raises(ValueError, match="prior is 'none'"):
        attacks.create_attack("likelihood_match", prior_weight=0.1)
    with pytest.raises(ValueError):
        attacks.create_attack("likelihood_match", prior="gaussian", prior_path="/nonexistent/prior.npz")
