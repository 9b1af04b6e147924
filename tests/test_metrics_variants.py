"""Tests for the one-pass scorer, the official metric variants, 8-bit scores, LPIPS resizing and the
LPIPS weight routes. References are independent: scikit-image, SciPy, NumPy, torchvision, lpips."""
from __future__ import annotations

import math
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import scipy.ndimage as ndi
import torch
import torchvision
from PIL import Image
from skimage.metrics import structural_similarity
from torchvision.transforms.functional import to_tensor

from helpers import bundled_images
import metrics as M
from metrics import perceptual


def _load(n: int, size: int) -> torch.Tensor:
    return bundled_images(n, size, start=2)


@pytest.fixture(scope="module")
def real() -> torch.Tensor:
    """[3, 3, 48, 48] float64 photographs (scikit-image's bundled ones)."""
    return _load(3, 48)


def _noisy(x: torch.Tensor, sigma: float, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (x + sigma * torch.randn(x.shape, generator=g, dtype=x.dtype)).clamp(0, 1)


def _distortions(x: torch.Tensor) -> list[torch.Tensor]:
    return [_noisy(x, 0.05), torch.nn.functional.avg_pool2d(x, 3, 1, 1), x * 0.9 + 0.05, x.flip(0)]


# ------------------------------------------------------------------------ ssim_torch vs scikit-image


def test_ssim_torch_matches_skimage_on_real_images_float32_and_float64() -> None:
    ref = _load(2, 224)  # full size, as the benchmark scores
    for rec in _distortions(ref):
        for dtype in (torch.float64, torch.float32):
            a, b = rec.to(dtype), ref.to(dtype)
            got = M.ssim_torch(a, b)
            for i in range(2):
                want = structural_similarity(a[i].double().numpy(), b[i].double().numpy(), data_range=1.0,
                                             channel_axis=0, gaussian_weights=True, sigma=1.5,
                                             use_sample_covariance=False)
                assert abs(got[i].item() - want) < 1e-6


def test_ssim_identical_is_exactly_one(real: torch.Tensor) -> None:
    assert torch.equal(M.ssim_torch(real, real), torch.ones(3, dtype=torch.float64))
    assert torch.equal(M.ssim_official(real, real), torch.ones(3, dtype=torch.float64))


# ------------------------------------------------------------------------------------ ssim_official


def _official_ssim_scipy(x: np.ndarray, y: np.ndarray) -> float:
    """eval/basic.py's _ssim evaluated directly: 2-D 11x11 Gaussian (sigma 1.5), zero padding 5,
    per channel, mean over the whole [3, H, W] map; here with SciPy's 2-D correlate in float64."""
    k = np.exp(-((np.arange(11) - 5) ** 2) / (2 * 1.5**2))
    k /= k.sum()
    win = np.outer(k, k)

    def filt(a: np.ndarray) -> np.ndarray:
        return np.stack([ndi.correlate(c, win, mode="constant", cval=0.0) for c in a])

    mu1, mu2 = filt(x), filt(y)
    s1, s2, s12 = filt(x * x) - mu1**2, filt(y * y) - mu2**2, filt(x * y) - mu1 * mu2
    c1, c2 = 0.01**2, 0.03**2
    smap = ((2 * mu1 * mu2 + c1) * (2 * s12 + c2)) / ((mu1**2 + mu2**2 + c1) * (s1 + s2 + c2))
    return float(smap.mean())


def test_ssim_official_matches_direct_formula(real: torch.Tensor) -> None:
    for rec in _distortions(real):
        got = M.ssim_official(rec, real)
        want = [_official_ssim_scipy(rec[i].numpy(), real[i].numpy()) for i in range(3)]
        np.testing.assert_allclose(got.numpy(), want, rtol=0, atol=1e-6)
    # Not the same metric as ours: zero padding darkens the border windows.
    rec = _noisy(real, 0.1)
    assert (M.ssim_official(rec, real) - M.ssim(rec, real)).abs().max() > 1e-3


# ------------------------------------------------------------------------------------ fft2d_clamped


def _old_scipy_cosine(u: np.ndarray, v: np.ndarray) -> float:
    """SciPy <= 1.5's cosine(u, v) (what the official script ran with Python 3.6), for complex input:
    correlation(centered=False) = abs(1 - avg(u*v) / sqrt(avg(u*u) avg(v*v))), then
    max(0, min(dist, 2.0)) with Python's builtins."""
    uv, uu, vv = np.average(u * v), np.average(np.square(u)), np.average(np.square(v))
    with np.errstate(divide="ignore", invalid="ignore"):
        dist = np.abs(1.0 - uv / np.sqrt(uu * vv))
    return max(0, min(dist, 2.0))


def _official_fft2d(rec: np.ndarray, ref: np.ndarray) -> float:
    """eval/cal_fft2d.py: cosine of the flattened fft2 of [1, 3, H, W] images, then the modulus."""
    d = _old_scipy_cosine(np.fft.fft2(ref[None]).flatten(), np.fft.fft2(rec[None]).flatten())
    return float(np.sqrt(d.real**2 + d.imag**2))


def test_fft2d_clamped_matches_old_scipy_arithmetic(real: torch.Tensor) -> None:
    for rec in _distortions(real):
        got = M.fft2d_clamped(rec, real)
        want = [_official_fft2d(rec[i].numpy(), real[i].numpy()) for i in range(3)]
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(got, M.fft2d(rec, real))  # no clamping needed for these


def test_fft2d_clamped_zero_energy_and_clamp() -> None:
    x = torch.rand(1, 3, 16, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    black = torch.zeros_like(x)
    for a, b in ((black, x), (x, black), (black, black)):
        want = _official_fft2d(a[0].numpy(), b[0].numpy())
        assert want == 0.0  # what the official script really returned: 0/0 -> NaN -> max(0, NaN) = 0
        assert M.fft2d_clamped(a, b).item() == 0.0
    assert M.fft2d(black, x).item() == 1.0  # our documented convention for the plain column differs
    # <x, Rx> nearly 0: the indefinite form gives |1 - r| > 2, which SciPy clamped to 2.
    eps = 1e-3
    u, v = torch.zeros(1, 3, 16, 16, dtype=torch.float64), torch.zeros(1, 3, 16, 16, dtype=torch.float64)
    u[..., 1, 1], u[..., 15, 15], v[..., 15, 15], v[..., 1, 1] = 1.0, eps, 1.0, eps
    assert M.fft2d(u, v).item() > 2.0
    assert M.fft2d_clamped(u, v).item() == 2.0 == _official_fft2d(u[0].numpy(), v[0].numpy())


# ------------------------------------------------------------------------------------------- 8-bit


def test_quantize_8bit_equals_png_round_trip(real: torch.Tensor, tmp_path: Path) -> None:
    x = torch.cat([_noisy(real, 0.2).float(), torch.linspace(0, 1, 3 * 48 * 48).view(1, 3, 48, 48)])
    q = M.quantize_8bit(x)
    for i in range(x.shape[0]):
        path = tmp_path / f"{i}.png"
        torchvision.utils.save_image(x[i], path)
        assert torch.equal(q[i], to_tensor(Image.open(path).convert("RGB")))
    assert q.dtype == torch.float32 and M.quantize_8bit(real).dtype == torch.float64
    with pytest.raises(ValueError, match="floating-point"):
        M.quantize_8bit((x * 255).to(torch.uint8))


def test_8bit_metrics_in_scorer(real: torch.Tensor) -> None:
    rec = _noisy(real, 0.03)
    rec[0, 0, 0, 0] = 1.0 + 0.5e-6  # within the range tolerance
    names = ("psnr", "psnr_8bit", "ssim_8bit", "mse_8bit", "fft2d_clamped_8bit")
    rows = M.score("a", rec, real, metrics=names)
    q_rec, q_ref = M.quantize_8bit(rec.clamp(0, 1)), M.quantize_8bit(real)
    assert [r["psnr_8bit"] for r in rows] == pytest.approx(M.psnr(q_rec, q_ref).tolist(), abs=1e-12)
    assert [r["ssim_8bit"] for r in rows] == pytest.approx(M.ssim(q_rec, q_ref).tolist(), abs=1e-12)
    assert [r["fft2d_clamped_8bit"] for r in rows] == pytest.approx(M.fft2d_clamped(q_rec, q_ref).tolist(), abs=1e-12)
    # The registry's 8-bit function is the same value; and quantisation does change the value.
    torch.testing.assert_close(M.get_metric("ssim_8bit").fn(rec, real), M.ssim(q_rec, q_ref))
    assert all(r["psnr"] != r["psnr_8bit"] for r in rows)


# ---------------------------------------------------------------------------------------- score_all


def test_score_all_equals_each_function(real: torch.Tensor) -> None:
    rec = _noisy(real, 0.1)
    names = ["mse", "psnr", "ssim", "fft2d", "fft2d_hermitian", "ssim_official", "fft2d_clamped"]
    got = M.score_all(rec, real, names)
    assert list(got) == names
    for name in names:
        want = M.get_metric(name).fn(rec, real)
        assert got[name].dtype == torch.float64 and got[name].shape == (3,)
        torch.testing.assert_close(got[name], want, rtol=0, atol=1e-12)
    psnr = M.score_all(real, real, ["psnr", "mse"])
    assert torch.isinf(psnr["psnr"]).all() and torch.equal(psnr["mse"], torch.zeros(3, dtype=torch.float64))
    with pytest.raises(ValueError, match="valid metrics"):
        M.score_all(rec, real, ["nope"])
    with pytest.raises(ValueError, match="NaN"):
        M.score_all(torch.full_like(rec, float("nan")), real, ["mse"])


# ------------------------------------------------------------------------------------- LPIPS resize


@pytest.fixture(scope="module")
def lpips_model(alexnet_features: Path):
    """LPIPS on the conftest's AlexNet trunk (trained where the data folder holds it, else seeded random)."""
    return M.get_lpips_model("cpu", backbone_path=alexnet_features)


def test_lpips_resize_small_images(real: torch.Tensor, lpips_model) -> None:
    small = torch.nn.functional.interpolate(real, size=(32, 32), mode="bilinear", antialias=True).clamp(0, 1)
    rec = _noisy(small, 0.1)
    auto = M.lpips(rec, small, model=lpips_model)
    none = M.lpips(rec, small, model=lpips_model, resize=None)
    forced = M.lpips(rec, small, model=lpips_model, resize=64)
    torch.testing.assert_close(auto, forced)  # "auto" upsamples 32 px to 64 px
    assert (auto - none).abs().min() > 1e-3  # the option changes the value
    assert torch.equal(M.lpips(small, small, model=lpips_model), torch.zeros(3, dtype=torch.float64))
    # At 64 px and above "auto" leaves images alone.
    big = _load(2, 64)
    torch.testing.assert_close(M.lpips(_noisy(big, 0.1), big, model=lpips_model),
                               M.lpips(_noisy(big, 0.1), big, model=lpips_model, resize=None), rtol=0, atol=0)
    with pytest.raises(ValueError, match="resize"):
        M.lpips(rec, small, model=lpips_model, resize=-3)


# ------------------------------------------------------------------------------------- LPIPS routes


@pytest.fixture
def no_local_weights(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """No $FEDMJP_LPIPS_BACKBONE, no data folder, no installed trunk, an empty torch hub cache; returns TORCH_HOME."""
    monkeypatch.delenv(M.BACKBONE_ENV, raising=False)
    monkeypatch.delenv(perceptual.DATA_ENV, raising=False)
    home = tmp_path / "torch_home"
    monkeypatch.setenv("TORCH_HOME", str(home))
    monkeypatch.setattr(perceptual, "installed_trunk_file", lambda: tmp_path / "no_installed_trunk.pth")
    return home


def test_lpips_route_data_folder(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, real: torch.Tensor, lpips_model,
                                 alexnet_features: Path) -> None:
    """Route 3: $FEDMJP_DATA/lpips/alexnet_features.pth; a config path may name the data folder too."""
    data = tmp_path / "data"
    (data / "lpips").mkdir(parents=True)
    (data / "lpips" / "alexnet_features.pth").write_bytes(alexnet_features.read_bytes())
    monkeypatch.delenv(M.BACKBONE_ENV, raising=False)
    monkeypatch.setenv(perceptual.DATA_ENV, str(data))
    in_data = (data / "lpips" / "alexnet_features.pth").resolve()
    model = M.get_lpips_model()
    assert M.lpips_source(model) == f"data:{in_data}"
    named = M.get_lpips_model(backbone_path="$FEDMJP_DATA/lpips/alexnet_features.pth")
    assert M.lpips_source(named) == f"argument:{in_data}"
    monkeypatch.delenv(perceptual.DATA_ENV)
    with pytest.raises(M.LpipsUnavailable, match="FEDMJP_DATA is not set"):
        M.get_lpips_model(backbone_path="$FEDMJP_DATA/lpips/alexnet_features.pth")
    rec = _noisy(real, 0.1)
    torch.testing.assert_close(M.lpips(rec, real, model=model), M.lpips(rec, real, model=lpips_model))


def test_lpips_unavailable_without_weights(no_local_weights: Path) -> None:
    with pytest.raises(M.LpipsUnavailable, match=M.BACKBONE_ENV) as err:
        M.get_lpips_model(allow_download=False)
    assert "alexnet_features.pth" in str(err.value) and "allow_download=False" in str(err.value)
    assert isinstance(err.value, RuntimeError) and M.LPIPSWeightsError is M.LpipsUnavailable
    with pytest.raises(M.LpipsUnavailable, match="not found"):
        M.get_lpips_model(backbone_path=no_local_weights / "missing.pth")


def test_lpips_unavailable_offline_fails_fast(no_local_weights: Path) -> None:
    if perceptual.reachable(perceptual.TORCHVISION_ALEXNET_URL, 2.0):
        pytest.skip("a network is reachable here: this test is about machines without one")
    t0 = time.perf_counter()
    with pytest.raises(M.LpipsUnavailable, match="cannot be reached"):
        M.get_lpips_model()  # downloads allowed, none possible
    assert time.perf_counter() - t0 < 3 * perceptual.CONNECT_TIMEOUT_S
    assert not (no_local_weights / "hub" / "checkpoints" / "alexnet-owt-7be5be79.pth").exists()


def test_lpips_torchvision_cache_route_offline(no_local_weights: Path, real: torch.Tensor, lpips_model,
                                               alexnet_features: Path) -> None:
    # A valid torchvision AlexNet checkpoint under the name torchvision expects: the fixture's trunk,
    # random classifier. torchvision checks the hash only after a download, not for a cached file.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        state = torchvision.models.alexnet(weights=None).state_dict()
    state.update(torch.load(alexnet_features, map_location="cpu", weights_only=True))
    cached = no_local_weights / "hub" / "checkpoints" / "alexnet-owt-7be5be79.pth"
    cached.parent.mkdir(parents=True)
    torch.save(state, cached)
    assert M.resolve_lpips_route() == M.LpipsRoute("torchvision-cache", cached)
    model = M.get_lpips_model()
    assert M.lpips_source(model) == f"torchvision-cache:{cached}"
    rec = _noisy(real, 0.1)
    torch.testing.assert_close(M.lpips(rec, real, model=model), M.lpips(rec, real, model=lpips_model))
    assert math.isfinite(M.lpips(rec, real, model=model).sum().item())


def test_reachable_bounds_the_name_lookup_too(monkeypatch) -> None:
    """A resolver that hangs (no network, unreachable DNS) must not stall the LPIPS route check
    beyond its timeout; a host that listens is reachable."""
    import socket
    import threading

    real_lookup = socket.getaddrinfo
    release = threading.Event()
    monkeypatch.setattr(socket, "getaddrinfo", lambda *a, **k: release.wait(30) and [])
    t0 = time.perf_counter()
    assert perceptual.reachable("https://download.example.invalid/x.pth", 0.5) is False
    assert time.perf_counter() - t0 < 5.0
    release.set()
    monkeypatch.setattr(socket, "getaddrinfo", real_lookup)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        assert perceptual.reachable(f"http://127.0.0.1:{server.getsockname()[1]}/", 5.0) is True
