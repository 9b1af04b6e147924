"""block0_roots on a defended update (attacks/structure/noisy.py): the read to the defence's noise,
on the shipped DeiT+MJP as trained and a bundled photograph, against the exact read's refusal."""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import pytest
import torch

import attacks
from attacks.structure.noisy import best_fits, fill_from_prior, read_defended
from attacks.structure.warm import fc1_inputs
from defences.spec import validate_defence
from defences.transforms import apply_update_defence
from fedmjp.data import load_images
from fedmjp.trainutils import model_from_checkpoint

CHECKPOINTS = Path(__file__).resolve().parents[1] / "checkpoints"


@lru_cache(maxsize=1)
def _mjp_client(photo: int = 0):
    """(the shipped DeiT+MJP in float64, the photograph's model input, its MJP mask [1, 64] (17
    positions shuffled), its fc1 inputs [65, D] in token order, its clean update, the model's mean/std)."""
    model, _ = model_from_checkpoint(CHECKPOINTS / "cifar_deit_mjp.safetensors")
    for blk in model.blocks:
        blk.attn.fused_attn = False
    model = model.double().eval()
    ims = load_images("embedded", 32, photo + 1, 10)
    mean = torch.tensor(model.default_cfg["mean"], dtype=torch.float64)
    std = torch.tensor(model.default_cfg["std"], dtype=torch.float64)
    x = ((ims.images[photo:photo + 1].double() - mean[:, None, None]) / std[:, None, None])
    mask = torch.zeros(1, 64, dtype=torch.bool)
    mask[0, torch.randperm(64, generator=torch.Generator().manual_seed(photo))[:17]] = True
    update = attacks.compute_update(model, x, torch.tensor([int(ims.labels[photo])]), unk_mask=mask)
    return model, x, mask, fc1_inputs(model, x, mask[0]), update, mean, std


def _region_psnr(model_input: torch.Tensor, x: torch.Tensor, mask: torch.Tensor, std: torch.Tensor) -> float:
    """PSNR (pixels in [0, 1]) of x~'s unshuffled region: the positions that kept their embedding."""
    keep = ~mask[0].reshape(8, 8).repeat_interleave(4, 0).repeat_interleave(4, 1)
    err = ((model_input - x)[0] * std[:, None, None]).pow(2)[:, keep].mean()
    return float(-10 * torch.log10(err))


@pytest.mark.slow
def test_a_16_bit_update_of_an_mjp_client_gives_x_tilde() -> None:
    """The issue's bar, the attack as a user runs it: a 16-bit quantised update of the shipped DeiT+MJP
    on a bundled photograph, the defence in the metadata, default options. The exact read refuses it
    (its rank test sees no span of rank T); the noise-aware read gives x~'s unshuffled region above
    40 dB (measured 53.0), where every other attacker scores 13.4 dB on x~ at 16 bits
    (docs/results/attacks.md, "x~ under defences")."""
    model, x, mask, _, update, mean, std = _mjp_client()
    spec = validate_defence({"name": "quantize", "bits": 16})
    sent = apply_update_defence(update, spec, torch.Generator().manual_seed(0))
    meta = attacks.AttackMetadata(1, (3, 32, 32), mean, std, None, defence=spec)
    exact = attacks.create_attack("block0_roots", noise_aware=False).reconstruct(model, sent, meta)
    assert exact.failed and "rank" in exact.reason, exact.reason
    res = attacks.create_attack("block0_roots").reconstruct(model, sent, meta)
    assert not res.failed, res.reason
    st = res.stats[0]
    assert st["shuffled_positions"] == 17 and res.unshuffled is not None
    assert st["roots_found"] >= 63, st  # measured 65 of 65
    got = meta.normalize(res.images.double())
    assert _region_psnr(got, x, mask, std) > 40.0
    rounds = st["roots_per_round"]
    # the search ends when every root is found or after NOISY_PATIENCE empty rounds, not at 40 rounds
    assert len(rounds) < 40 and (sum(rounds) + st["warm_roots"] == 65 or rounds[-2:] == [0, 0]), st


@pytest.mark.slow
def test_an_8_bit_update_whose_read_would_be_mostly_prior_is_a_failed_row() -> None:
    """After 8-bit rounding the search keeps a handful of roots: more positions would come from the
    image prior than from the update, and the read refuses, naming the counts, rather than return
    an image below the flat one (measured 9-10 dB against its 12.6 on CIFAR-10)."""
    model, _, _, _, update, mean, std = _mjp_client()
    spec = validate_defence({"name": "quantize", "bits": 8})
    sent = apply_update_defence(update, spec, torch.Generator().manual_seed(0))
    meta = attacks.AttackMetadata(1, (3, 32, 32), mean, std, None, defence=spec)
    res = attacks.create_attack("block0_roots").reconstruct(model, sent, meta)
    assert res.failed and "image prior's, more than the update's" in res.reason, res.reason


def test_the_best_fits_of_the_true_roots_place_every_token_and_the_shuffled_set() -> None:
    """Step 3 on the clean update from the true roots in any order: every root takes its own position
    by the assignment, the E_unk roots the shuffled positions, and every positioned patch is exact;
    with two roots left out, step 2's solves are biased (fc2's update holds every token), and the
    patches placed fall below 40 dB: why the read refits them to their roots (step 6)."""
    model, x, mask, truth, update, _, std = _mjp_client()
    shuffled = mask[0]
    own = torch.arange(65)
    own[1:][shuffled] = 65
    clean = {k: v.double() for k, v in update.items()}
    order = torch.randperm(65, generator=torch.Generator().manual_seed(1))
    keep = torch.ones(65, dtype=torch.bool)
    keep[torch.tensor([20, 37])] = False
    with torch.no_grad():
        fits = best_fits(model, clean, truth[order], shuffled)
        short = best_fits(model, clean, truth[keep], shuffled)
    from patchgrid import patchify
    want = patchify(x, 4)[0].flatten(1)
    placed = ~shuffled

    def db(p: torch.Tensor, where: torch.Tensor) -> float:
        return float(-10 * torch.log10(((p - want)[where] * std.repeat_interleave(16)).pow(2).mean()))
    assert torch.equal(fits.position, own[order])
    assert sorted(fits.spot[fits.position == 65].tolist()) == (shuffled.nonzero().flatten() + 1).tolist()
    assert db(fits.patches[0], placed) > 100.0
    placed[torch.tensor([19, 36])] = False
    assert db(short.patches[0], placed) < 40.0


def test_the_prior_fills_a_hole_from_its_neighbours() -> None:
    """Step 4: a position without a root is inpainted from the positioned patches around it, closer to
    the photograph than its mean colour; where none is positioned, every position keeps the mean
    colour (0)."""
    model, x, mask, *_ = _mjp_client()
    from patchgrid import patchify
    patches = patchify(x, 4)[0].flatten(1).clone()
    known = torch.ones(64, dtype=torch.bool)
    known[27] = False  # an inner position
    truth = patches[27].clone()
    patches[27] = 0.0
    image = fill_from_prior(model, patches, known, known)
    got = patchify(image, 4)[0].flatten(1)
    assert torch.equal(got[known], patches[known])
    assert float((got[27] - truth).pow(2).mean()) < 0.5 * float(truth.pow(2).mean())
    none = torch.zeros(64, dtype=torch.bool)
    assert float(fill_from_prior(model, patches, none, none).abs().max()) == 0.0


def test_a_read_without_a_patch_root_is_the_mean_colour_not_an_error() -> None:
    """Where the search kept the class token's root alone (seen after 8-bit rounding), no patch has a
    root to refit: the read is the mean colour everywhere, every position from the prior."""
    model, _, mask, truth, update, _, _ = _mjp_client()
    clean = {k: v.double() for k, v in update.items()}
    read = read_defended(model, clean, truth[:1], mask[0])
    assert float(read.images.abs().max()) == 0.0 and bool(read.filled.all())


def test_defended_batches_it_does_not_read_are_failed_rows_naming_why() -> None:
    """The noise-aware membership step reads plain clients: a defended B = 2 update of MJP clients is
    refused, naming it; and past B T = D - 1 (B = 3 here) no token is a root of the truncated spans."""
    model, *_ = _mjp_client()
    spec = validate_defence({"name": "quantize", "bits": 16})
    mask = torch.zeros(2, 64, dtype=torch.bool)
    mask[:, ::4] = True
    for B, kw, why in ((2, {"unk_mask": mask}, "membership"), (3, {}, "B T = 195 > D - 1")):
        meta = attacks.AttackMetadata(B, (3, 32, 32), torch.zeros(3), torch.ones(3), None, defence=spec)
        x = torch.zeros(B, 3, 32, 32, dtype=torch.float64)
        update = attacks.compute_update(model, x, torch.tensor([1, 2, 3][:B]), **kw)
        res = attacks.create_attack("block0_roots").reconstruct(model, update, meta)
        assert res.failed and f"B = {B}" in res.reason and why in res.reason, res.reason


def test_at_b2_the_best_fits_of_the_roots_give_each_token_its_position_and_image() -> None:
    """Step 3 at B = 2 (a plain client), on a 16-bit update of two bundled photographs: from the true
    roots in any order every root takes its own position by the assignment with two roots per position,
    and the membership (attention indicators, then the root-residual repair) puts every root in its
    own image, up to the images' order. Two roots left out (the search's misses) bias step 2's solves
    for every token (fc2's update holds them all): then 105 of 128 positions and 119 memberships come
    out right (the same on the clean update), which the patches' refit to their roots and the prior
    rounds' extra roots have to recover."""
    model, _ = model_from_checkpoint(CHECKPOINTS / "cifar_deit.safetensors")
    for blk in model.blocks:
        blk.attn.fused_attn = False
    model = model.double().eval()
    ims = load_images("embedded", 32, 2, 10)
    mean = torch.tensor(model.default_cfg["mean"], dtype=torch.float64)
    std = torch.tensor(model.default_cfg["std"], dtype=torch.float64)
    x = (ims.images[:2].double() - mean[:, None, None]) / std[:, None, None]
    truth = torch.cat([fc1_inputs(model, x[b:b + 1]) for b in range(2)])  # [130, D], image-major
    spec = validate_defence({"name": "quantize", "bits": 16})
    sent = apply_update_defence(attacks.compute_update(model, x, ims.labels[:2]), spec, torch.Generator())
    grads = {k: v.double() for k, v in sent.items()}
    for left_out in (0, 2):
        keep = torch.ones(130, dtype=torch.bool)
        keep[torch.tensor([5, 99][:left_out], dtype=torch.long)] = False
        order = keep.nonzero().flatten()[torch.randperm(int(keep.sum()), generator=torch.Generator().manual_seed(2))]
        with torch.no_grad():
            fits = best_fits(model, grads, truth[order], torch.zeros(64, dtype=torch.bool), batch=2)
        own = order // 65
        positions = int((fits.position == order % 65).sum())
        members = max(int((fits.image == own).sum()), int((fits.image == 1 - own).sum()))
        if left_out == 0:
            assert positions == members == 130, (positions, members)
        else:
            assert positions >= 95 and members >= 110, (positions, members)  # measured 105, 119
