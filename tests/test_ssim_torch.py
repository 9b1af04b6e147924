"""The float64 SSIM of metrics.structural (NumPy/SciPy on the CPU, torch on any device) against
scikit-image, the reference: per-image values, the
full map (``full=True``) and region means, on photographs bundled with scikit-image (at the
benchmark's sizes and at odd ones), and on odd reconstructions (constant, saturated, noise).

Tolerances: both compute in float64 like scikit-image but in another order; measured
differences are <= 1e-13 per image and ~1e-12 on the map (largest where the denominators are near
C1 * C2). 1e-10 and 1e-9 sit well above that rounding noise and well below the 1e-6 required.
"""
from __future__ import annotations

import numpy as np
import pytest
import skimage.data
import torch
from skimage.metrics import structural_similarity

from helpers import bundled_images
import metrics as M
from metrics.regions import masked_map_mean, masked_ssim
from metrics.structural import ssim_with_map, ssim_with_map_torch

TOL_VALUE = 1e-10
TOL_MAP = 1e-9


def _skimage(rec: torch.Tensor, ref: torch.Tensor, full: bool = False):
    """scikit-image on one [3, H, W] pair, channels last (the layout its docs use)."""
    return structural_similarity(rec.double().permute(1, 2, 0).numpy(), ref.double().permute(1, 2, 0).numpy(),
                                 data_range=1.0, channel_axis=-1, gaussian_weights=True, sigma=1.5,
                                 use_sample_covariance=False, full=full)


def _reconstructions(ref: torch.Tensor) -> dict[str, torch.Tensor]:
    """Reconstructions an attack may return, from close to degenerate."""
    g = torch.Generator().manual_seed(0)
    noise = torch.randn(ref.shape, generator=g, dtype=torch.float64)
    return {
        "noise 0.05": (ref + 0.05 * noise).clamp(0, 1),
        "noise 0.3": (ref + 0.3 * noise).clamp(0, 1),
        "uniform noise": torch.rand(ref.shape, generator=g, dtype=torch.float64),
        "constant 0.5": torch.full_like(ref, 0.5),
        "black": torch.zeros_like(ref),
        "white": torch.ones_like(ref),
        "saturated": (3 * ref - 1).clamp(0, 1),
        "other image": ref.flip(0),
        "float32 copy": ref.float(),
    }


def _check_values(rec: torch.Tensor, ref: torch.Tensor) -> None:
    got = {"torch": M.ssim_torch(rec, ref), "scipy": M.ssim_scipy(rec, ref), "default": M.ssim(rec, ref)}
    got_map_value, smap = ssim_with_map(rec, ref)
    # The torch map code (what tensors on a GPU get) checked on the CPU too.
    torch_map_value, torch_map = ssim_with_map_torch(rec, ref)
    assert smap.dtype == torch.float64 and smap.shape == ref.shape
    for i in range(ref.shape[0]):
        want, want_map = _skimage(rec[i], ref[i], full=True)
        for name, values in got.items():
            assert values.dtype == torch.float64 and abs(values[i].item() - want) < TOL_VALUE, name
        assert abs(got_map_value[i].item() - want) < TOL_VALUE
        assert abs(torch_map_value[i].item() - want) < TOL_VALUE
        assert np.abs(smap[i].permute(1, 2, 0).numpy() - want_map).max() < TOL_MAP
        assert np.abs(torch_map[i].permute(1, 2, 0).numpy() - want_map).max() < TOL_MAP


@pytest.mark.parametrize("size", [224, 32])
def test_matches_skimage_on_real_images(size: int) -> None:
    ref = bundled_images(2, size, start=3)
    for name, rec in _reconstructions(ref).items():
        _check_values(rec, ref)
    # A constant reference (a blank image in a batch) against real content, and both constant.
    blank = torch.full_like(ref, 0.3)
    _check_values(ref, blank)
    _check_values(blank, blank)


@pytest.mark.parametrize("name", ["astronaut", "chelsea", "coffee"])
def test_matches_skimage_on_bundled_images(name: str) -> None:
    """scikit-image's own images at odd sizes, cropped to keep the test short."""
    image = torch.from_numpy(getattr(skimage.data, name)()[:123, :97].astype(np.float64) / 255.0)
    ref = image.permute(2, 0, 1)[None].contiguous()
    for rec in _reconstructions(ref).values():
        _check_values(rec, ref)


def test_identical_images_score_exactly_one() -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.rand(3, 3, 40, 37, generator=g, dtype=torch.float64)
    ones = torch.ones(3, dtype=torch.float64)
    assert torch.equal(M.ssim_torch(x, x), ones) and torch.equal(M.ssim_scipy(x, x), ones)
    for value, smap in (ssim_with_map(x, x), ssim_with_map_torch(x, x)):
        assert torch.equal(value, ones) and torch.equal(smap, torch.ones_like(smap))


def test_smallest_images_and_validation() -> None:
    g = torch.Generator().manual_seed(2)
    x, y = torch.rand(2, 2, 3, 11, 11, generator=g, dtype=torch.float64)
    _check_values(x, y)
    with pytest.raises(ValueError, match="at least 11x11"):
        M.ssim(x[..., :10], y[..., :10])
    with pytest.raises(ValueError, match="at least 11x11"):
        ssim_with_map(x[..., :10, :], y[..., :10, :])


def test_masked_ssim_equals_skimage_map_mean() -> None:
    g = torch.Generator().manual_seed(3)
    ref = torch.rand(2, 3, 24, 24, generator=g, dtype=torch.float64)
    rec = (ref + 0.1 * torch.randn(ref.shape, generator=g, dtype=torch.float64)).clamp(0, 1)
    pixels = torch.rand(2, 24, 24, generator=g) < 0.3
    pixels[1] = False  # an empty region gives NaN
    got = masked_ssim(rec, ref, pixels)
    _, want_map = _skimage(rec[0], ref[0], full=True)
    assert abs(got[0].item() - want_map.mean(axis=2)[pixels[0].numpy()].mean()) < TOL_VALUE
    assert torch.isnan(got[1])
    _, smap = ssim_with_map(rec, ref)
    torch.testing.assert_close(masked_map_mean(smap, pixels), got, rtol=1e-14, atol=0, equal_nan=True)
    _, torch_map = ssim_with_map_torch(rec, ref)
    torch.testing.assert_close(masked_map_mean(torch_map, pixels), got, rtol=0, atol=TOL_VALUE, equal_nan=True)


def test_backend_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    g = torch.Generator().manual_seed(4)
    x, y = torch.rand(2, 2, 3, 16, 16, generator=g, dtype=torch.float64)
    sk = M.ssim(x, y, backend="skimage")
    assert torch.equal(sk, M.ssim_skimage(x, y))
    assert torch.equal(M.ssim(x, y, backend="torch"), M.ssim_torch(x, y))
    assert torch.equal(M.ssim(x, y), M.ssim_scipy(x, y))
    assert torch.equal(M.ssim_scipy(x, y, workers=1), M.ssim_scipy(x, y, workers=3))
    assert (M.ssim(x, y) - sk).abs().max() < TOL_VALUE
    monkeypatch.setenv("FEDMJP_SSIM_BACKEND", "skimage")
    assert torch.equal(M.ssim(x, y), sk)
    monkeypatch.setenv("FEDMJP_SSIM_BACKEND", "cuda")
    with pytest.raises(ValueError, match="valid backends: scipy, torch, skimage"):
        M.ssim(x, y)
    with pytest.raises(ValueError, match="valid backends: scipy, torch, skimage"):
        M.ssim(x, y, backend="numpy")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_matches_cpu() -> None:
    g = torch.Generator().manual_seed(5)
    x, y = torch.rand(2, 2, 3, 48, 48, generator=g, dtype=torch.float64)
    assert (M.ssim_torch(x.cuda(), y.cuda()) - M.ssim_torch(x, y)).abs().max() < TOL_VALUE
    assert (ssim_with_map(x.cuda(), y.cuda())[1] - ssim_with_map(x, y)[1]).abs().max() < TOL_MAP
