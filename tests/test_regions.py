"""metrics.regions: unshuffled-region scores and set scores of the shuffled patches, on hand-made
examples whose true values are known."""
from __future__ import annotations

import math

import pytest
import torch

from metrics.regions import REGION_COLUMNS, from_patches, match_shuffled, region_scores, to_patches

P = 4  # patch side; 16 px images -> 4 x 4 = 16 patches


def _images(seed: int = 0) -> torch.Tensor:
    """Two 16 px images of distinct random patches in [0.2, 0.8] (room for offsets)."""
    g = torch.Generator().manual_seed(seed)
    return 0.2 + 0.6 * torch.rand(2, 3, 16, 16, generator=g, dtype=torch.float64)


def _mask() -> torch.Tensor:
    mask = torch.zeros(2, 16, dtype=torch.bool)
    mask[0, [1, 5, 6, 12]] = True
    mask[1, [0, 3, 15]] = True
    return mask


def _permute_within(images: torch.Tensor, mask: torch.Tensor, seed: int = 1) -> torch.Tensor:
    """Move the patches at S to other positions of S (a derangement: no patch stays)."""
    patches = to_patches(images, P).clone()
    for b in range(images.shape[0]):
        pos = torch.nonzero(mask[b]).flatten()
        rolled = pos.roll(1)
        patches[b, pos] = patches[b, rolled]
    return from_patches(patches, 16, 16)


def test_patches_round_trip() -> None:
    x = _images()
    assert torch.equal(from_patches(to_patches(x, P), 16, 16), x)
    # patch 1 of row 0 is pixels [0:4, 4:8]
    assert torch.equal(to_patches(x, P)[0, 1], x[0, :, 0:4, 4:8])


def test_set_score_ignores_the_arrangement_within_s() -> None:
    x, mask = _images(), _mask()
    rec = _permute_within(x, mask)  # the right patches, wrongly arranged: what no attacker can avoid
    assert not torch.allclose(rec, x)
    scores = region_scores(rec, x, mask, P)
    assert set(scores) == set(REGION_COLUMNS)
    assert torch.all(scores["mse_shuffled"] == 0) and torch.all(scores["psnr_shuffled"] == 100.0)
    assert torch.all(scores["mse_unshuffled"] == 0)
    arranged, assignment = match_shuffled(rec, x, mask, P)
    assert torch.allclose(arranged, x)
    # reconstructed patch at S[k-1] holds the true patch of S[k]
    pos = torch.nonzero(mask[0]).flatten().tolist()
    assert assignment[0] == pos[1:] + pos[:1]


def test_known_offsets_per_region() -> None:
    x, mask = _images(), _mask()
    rec = _permute_within(x, mask).clone()
    pix = mask.reshape(2, 4, 4).repeat_interleave(P, 1).repeat_interleave(P, 2)[:, None].expand_as(x)
    rec = torch.where(pix, rec + 0.1, rec - 0.05)  # shuffled patches +0.1, the rest -0.05
    scores = region_scores(rec, x, mask, P)
    assert torch.allclose(scores["mse_shuffled"], torch.full((2,), 0.01, dtype=torch.float64))
    assert torch.allclose(scores["mse_unshuffled"], torch.full((2,), 0.0025, dtype=torch.float64))
    assert torch.allclose(scores["psnr_shuffled"], torch.full((2,), 20.0, dtype=torch.float64))
    # an order-sensitive score of the same region would see the misarrangement
    order_mse = ((rec - x) ** 2)[pix].mean()
    assert order_mse > 0.02
    assert torch.all(scores["ssim_unshuffled"] < 1) and torch.all(scores["ssim_unshuffled"] > 0.5)


def test_empty_region_is_nan_and_bad_shapes_are_errors() -> None:
    x = _images()
    scores = region_scores(x, x, torch.zeros(2, 16, dtype=torch.bool), P)
    assert all(math.isnan(v) for v in scores["mse_shuffled"].tolist())
    assert torch.all(scores["psnr_unshuffled"] == 100.0)
    with pytest.raises(ValueError, match=r"mask must be \[B, N\]"):
        region_scores(x, x, torch.zeros(2, 15, dtype=torch.bool), P)
    with pytest.raises(ValueError, match="multiple of the patch size"):
        region_scores(x, x, torch.zeros(2, 16, dtype=torch.bool), 5)
