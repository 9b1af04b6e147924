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
    assert db(fits.patches, placed) > 100.0
    placed[torch.tensor([19, 36])] = False
    assert db(short.patches, placed) < 40.0


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


def test_a_defended_batch_of_2_is_a_failed_row_naming_why() -> None:
    """The noise-aware read has no membership step: a defended B = 2 update is refused, naming it."""
    model, *_ = _mjp_client()
    spec = validate_defence({"name": "quantize", "bits": 16})
    meta = attacks.AttackMetadata(2, (3, 32, 32), torch.zeros(3), torch.ones(3), None, defence=spec)
    x = torch.zeros(2, 3, 32, 32, dtype=torch.float64)
    update = attacks.compute_update(model, x, torch.tensor([1, 2]))
    res = attacks.create_attack("block0_roots").reconstruct(model, update, meta)
    assert res.failed and "B = 2" in res.reason and "membership" in res.reason, res.reason
