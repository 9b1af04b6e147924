"""Registered PSNR (metrics/registered.py) is breaching's ``registered_psnr_compute`` on the same
pairs of real photographs (batches of one, where breaching's batch mixing does not enter), at least
the plain PSNR, and forgives a shift that the plain PSNR punishes."""
from __future__ import annotations

import math

import pytest
import torch
from breaching.analysis.metrics import registered_psnr_compute

import metrics
from fedmjp.data import load_images


@pytest.fixture(scope="module")
def photos() -> torch.Tensor:
    return load_images("embedded", 32, 3, 10).images


def _pairs(photos: torch.Tensor) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"noisy": (photos + 0.05 * torch.randn(photos.shape, generator=g)).clamp(0, 1),
            "shifted": torch.roll(photos, 2, dims=-1)}


def test_registered_psnr_is_breachings_per_image(photos: torch.Tensor) -> None:
    for name, rec in _pairs(photos).items():
        ours = metrics.psnr_registered(rec, photos)
        assert ours.dtype == torch.float64 and ours.shape == (len(photos),)
        theirs = [registered_psnr_compute(rec[i:i + 1], photos[i:i + 1], factor=1.0)[0] for i in range(len(photos))]
        # breaching computes in float32: equal to its rounding
        assert ours.tolist() == pytest.approx(theirs, abs=1e-3), name
        assert (ours >= metrics.psnr(rec, photos) - 1e-9).all(), name


def test_registration_forgives_a_shift(photos: torch.Tensor) -> None:
    shifted = _pairs(photos)["shifted"]
    gain = metrics.psnr_registered(shifted, photos) - metrics.psnr(shifted, photos)
    assert float(gain.median()) > 5.0  # a 2 px shift that the similarity transform undoes
    assert math.isinf(float(metrics.psnr_registered(photos[:1], photos[:1])[0]))  # an exact copy


def test_registered_psnr_is_scored_by_name(photos: torch.Tensor) -> None:
    rows = metrics.score("a", photos[:2].flip(-1), photos[:2], metrics=("psnr", "psnr_registered"))
    assert all(r["psnr_registered"] >= r["psnr"] for r in rows)
    with pytest.raises(ValueError, match="shape"):
        metrics.psnr_registered(photos[:1], photos[:2])


@pytest.mark.parametrize("side", [1, 3, 8])
def test_images_too_small_for_five_pyramid_levels_are_scored(photos: torch.Tensor, side: int) -> None:
    small = torch.nn.functional.interpolate(photos[:1], size=(side, side), mode="area")
    rec = (small + 0.05).clamp(0, 1)
    assert float(metrics.psnr_registered(rec, small)[0]) >= float(metrics.psnr(rec, small)[0]) - 1e-9
