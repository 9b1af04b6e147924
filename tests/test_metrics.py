"""Tests for metrics/: agreement with scikit-image, NumPy and lpips; validation; scorer; aggregation."""
from __future__ import annotations

import math
import os
import warnings
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from skimage.metrics import mean_squared_error, peak_signal_noise_ratio, structural_similarity

from helpers import bundled_images
import metrics as M

SIZE = 64


@pytest.fixture(scope="module")
def real() -> torch.Tensor:
    """[4, 3, 64, 64] float64 photographs (scikit-image's bundled ones)."""
    return bundled_images(4, SIZE)


def _distort(x: torch.Tensor, sigma: float, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (x + sigma * torch.randn(x.shape, generator=g, dtype=x.dtype)).clamp(0, 1)


def _synthetic(b: int = 3, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(b, 3, 32, 40, generator=g, dtype=torch.float64)
    # A smooth image and a shifted copy are more image-like than independent noise.
    y = torch.roll(x, shifts=(2, -3), dims=(-2, -1)) * 0.8 + 0.1
    return x, y


def _pairs(real: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(_distort(real, 0.05), real), (real.flip(0), real), _synthetic()]


# --------------------------------------------------------------- pixel metrics vs scikit-image


def test_mse_psnr_ssim_match_skimage(real: torch.Tensor) -> None:
    for rec, ref in _pairs(real):
        got_mse, got_psnr, got_ssim = M.mse(rec, ref), M.psnr(rec, ref), M.ssim(rec, ref)
        assert got_mse.dtype == got_psnr.dtype == got_ssim.dtype == torch.float64
        assert got_mse.shape == (rec.shape[0],)
        for i in range(rec.shape[0]):
            a = rec[i].permute(1, 2, 0).numpy()  # HWC, channel_axis=-1: a different layout from ours
            b = ref[i].permute(1, 2, 0).numpy()
            assert got_mse[i].item() == pytest.approx(mean_squared_error(b, a), abs=1e-6)
            assert got_psnr[i].item() == pytest.approx(peak_signal_noise_ratio(b, a, data_range=1.0), abs=1e-6)
            ref_ssim = structural_similarity(
                b, a, data_range=1.0, channel_axis=-1, gaussian_weights=True, sigma=1.5, use_sample_covariance=False
            )
            assert got_ssim[i].item() == pytest.approx(ref_ssim, abs=1e-6)


def test_float32_input_and_identical_images(real: torch.Tensor) -> None:
    x = real.float()
    assert torch.equal(M.mse(x, x), torch.zeros(4, dtype=torch.float64))
    assert torch.isinf(M.psnr(x, x)).all()
    assert torch.allclose(M.ssim(x, x), torch.ones(4, dtype=torch.float64))


def test_ssim_threads_do_not_change_values(real: torch.Tensor) -> None:
    rec = _distort(real, 0.1)
    sk = M.ssim(rec, real, workers=1, backend="skimage")
    assert torch.equal(sk, M.ssim(rec, real, workers=3, backend="skimage"))
    # The default (torch) backend gives scikit-image's values up to float64 rounding.
    assert (M.ssim(rec, real) - sk).abs().max() < 1e-10


# --------------------------------------------------------------------------------- FFT2D


def _official_fft2d_numpy(rec: np.ndarray, ref: np.ndarray) -> float:
    """The official eval/cal_fft2d.py definition evaluated directly: [1,3,H,W] -> per-channel fft2,
    flattened, SciPy-style cosine distance with plain (non-conjugated) dot products, then modulus."""
    u = np.fft.fft2(ref[None]).ravel()
    v = np.fft.fft2(rec[None]).ravel()
    dist = 1.0 - np.dot(u, v) / np.sqrt(np.dot(u, u) * np.dot(v, v))
    return float(np.sqrt(dist.real**2 + dist.imag**2))


def test_fft2d_equals_official_definition(real: torch.Tensor) -> None:
    g = torch.Generator().manual_seed(3)
    rand = (torch.rand(5, 3, 24, 17, generator=g, dtype=torch.float64),
            torch.rand(5, 3, 24, 17, generator=g, dtype=torch.float64) ** 3)
    for rec, ref in [rand, *_pairs(real)]:
        got = M.fft2d(rec, ref)
        want = [_official_fft2d_numpy(rec[i].numpy(), ref[i].numpy()) for i in range(rec.shape[0])]
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-9, atol=1e-12)
        # Symmetric in its arguments, like the official cosine distance.
        torch.testing.assert_close(M.fft2d(ref, rec), got)
    assert torch.allclose(M.fft2d(real, real), torch.zeros(4, dtype=torch.float64), atol=1e-12)


def test_fft2d_hermitian_properties(real: torch.Tensor) -> None:
    rec = _distort(real, 0.2)
    assert torch.allclose(M.fft2d_hermitian(real, real), torch.ones(4, dtype=torch.float64))
    for c in (0.3, 0.77):
        torch.testing.assert_close(M.fft2d_hermitian(c * rec, real), M.fft2d_hermitian(rec, real))
        torch.testing.assert_close(M.fft2d_hermitian(rec, c * real), M.fft2d_hermitian(rec, real))
    assert torch.allclose(M.fft2d_hermitian(0.5 * real, real), torch.ones(4, dtype=torch.float64))
    # Against the Fourier-space definition Re<F(x), F(y)> / (|F(x)| |F(y)|).
    for i in range(4):
        fx, fy = np.fft.fft2(rec[i].numpy()).ravel(), np.fft.fft2(real[i].numpy()).ravel()
        want = np.real(np.vdot(fy, fx)) / (np.linalg.norm(fx) * np.linalg.norm(fy))
        assert M.fft2d_hermitian(rec, real)[i].item() == pytest.approx(want, abs=1e-12)
    assert (M.fft2d_hermitian(rec, real) < 1).all()


def test_fourier_zero_energy_conventions() -> None:
    z, x = torch.zeros(1, 3, 16, 16), torch.rand(1, 3, 16, 16)
    assert M.fft2d(z, z).item() == 0.0 and M.fft2d(z, x).item() == 1.0
    assert M.fft2d_hermitian(z, z).item() == 1.0 and M.fft2d_hermitian(x, z).item() == 0.0


def test_point_reflect() -> None:
    y = torch.arange(12.0).reshape(1, 1, 3, 4)
    r = M.point_reflect(y)
    for i in range(3):
        for j in range(4):
            assert r[0, 0, i, j] == y[0, 0, (-i) % 3, (-j) % 4]


# --------------------------------------------------------------------------------- LPIPS


@pytest.fixture(scope="module")
def lpips_model(alexnet_features: Path):
    """LPIPS on the conftest's AlexNet trunk (trained where the data folder holds it, else seeded random)."""
    return M.get_lpips_model("cpu", backbone_path=alexnet_features)


def test_lpips_identity_and_ordering(real: torch.Tensor, lpips_model) -> None:
    d0 = M.lpips(real, real, model=lpips_model)
    assert d0.dtype == torch.float64 and d0.shape == (4,)
    assert torch.allclose(d0, torch.zeros(4, dtype=torch.float64), atol=1e-6)
    mild = M.lpips(_distort(real, 0.03), real, model=lpips_model)
    strong = M.lpips(_distort(real, 0.3), real, model=lpips_model)
    assert (mild > 1e-4).all() and (strong > mild).all()


def test_lpips_matches_package_called_directly(real: torch.Tensor, lpips_model, alexnet_features: Path) -> None:
    import lpips as lpips_pkg

    with warnings.catch_warnings():  # torchvision's deprecation of lpips' `pretrained=` argument
        warnings.simplefilter("ignore", UserWarning)
        ref_model = lpips_pkg.LPIPS(net="alex", version="0.1", pretrained=True, pnet_rand=True, verbose=False)
    ref_model.eval()
    feats = torch.load(alexnet_features, map_location="cpu", weights_only=True)
    slice_of = {0: 1, 3: 2, 6: 3, 8: 4, 10: 5}  # lpips' AlexNet keeps torchvision's layer indices
    ref_model.net.load_state_dict(
        {f"slice{slice_of[int(k.split('.')[1])]}.{k.split('.', 1)[1]}": v for k, v in feats.items()}
    )
    rec = _distort(real, 0.1)
    with torch.no_grad():
        want = ref_model(rec.float(), real.float(), normalize=True).flatten().double()
    torch.testing.assert_close(M.lpips(rec, real, model=lpips_model, batch_size=3), want, atol=1e-6, rtol=1e-5)


def test_lpips_model_cached_and_env_var(monkeypatch: pytest.MonkeyPatch, lpips_model, alexnet_features: Path) -> None:
    assert M.get_lpips_model(torch.device("cpu"), backbone_path=str(alexnet_features)) is lpips_model
    assert M.lpips_source(lpips_model) == f"argument:{alexnet_features.resolve()}"
    monkeypatch.setenv(M.BACKBONE_ENV, str(alexnet_features))
    from_env = M.get_lpips_model()
    assert from_env is M.get_lpips_model() and M.lpips_source(from_env) == f"env:{alexnet_features.resolve()}"


def test_lpips_feature_cache_gives_the_packages_values_and_reuses_features(real: torch.Tensor, lpips_model) -> None:
    """Cached features give LPIPS.forward's values (float32 noise floor; bit for bit on the CPUs
    tried), whatever mix of cached and new images a batch holds, and each image is computed once."""
    cache = M.LpipsFeatureCache(lpips_model, keep_mb=64)
    rec_a, rec_b = _distort(real, 0.1, seed=1), _distort(real, 0.2, seed=2)
    want = M.lpips(rec_a, real, model=lpips_model)
    got = M.lpips(rec_a, real, cache=cache)  # 4 + 4 computed
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    assert (cache.computed, cache.reused) == (8, 0)
    # Setting (b) then (c): the same reconstruction against another reference, then against x again.
    torch.testing.assert_close(M.lpips(rec_a, real.flip(0), cache=cache), M.lpips(rec_a, real.flip(0), model=lpips_model),
                               atol=1e-6, rtol=0)
    assert (cache.computed, cache.reused) == (8, 8)  # real.flip(0) holds the same four images
    mixed = torch.cat([real[:2], _distort(real[:2], 0.3, seed=3)])  # two kept references, two new images
    torch.testing.assert_close(M.lpips(rec_b, mixed, cache=cache), M.lpips(rec_b, mixed, model=lpips_model),
                               atol=1e-6, rtol=0)
    assert (cache.computed, cache.reused) == (14, 10)
    # The same pixels in another tensor (a copy, another batch position) are a hit; another dtype or
    # resize target is not.
    M.lpips(rec_a[2:3].clone(), real[1:2].clone(), cache=cache)
    assert cache.computed == 14
    M.lpips(rec_a.float(), real, cache=cache)
    M.lpips(rec_a, real, cache=cache, resize=96)
    assert cache.computed == 14 + 4 + 8
    assert (M.lpips(real, real, cache=cache) == 0).all()
    with pytest.raises(ValueError, match="another LPIPS model"):
        M.lpips(rec_a, real, model=torch.nn.Linear(1, 1), cache=cache)  # type: ignore[arg-type]


def test_lpips_feature_cache_keeps_references_first_come_within_its_budget(real: torch.Tensor, lpips_model) -> None:
    """References are kept while they fit, first come (a cyclic pass over the same images never
    evicts what comes next); reconstructions only enter the recent part, which evicts the oldest."""
    rec = _distort(real, 0.1)
    probe = M.LpipsFeatureCache(lpips_model, keep_mb=64)
    M.lpips(rec[:1], real[:1], cache=probe)
    per_image = probe.stats()["kept_bytes"]  # the features of one 64 px image
    assert probe.stats()["kept_images"] == 1 and per_image > 0
    cache = M.LpipsFeatureCache(lpips_model, keep_mb=0, recent_mb=0)
    cache.keep_bytes = 2 * per_image  # room for two references, none for recent images
    for _ in range(3):  # the same four references, three passes
        M.lpips(rec, real, cache=cache)
    assert cache.stats()["kept_images"] == 2 and cache.stats()["kept_bytes"] == 2 * per_image
    # Pass 1 computes 8 and keeps references 0 and 1; passes 2 and 3 find those two and compute the
    # other six again: 8 + 6 + 6.
    assert (cache.computed, cache.reused) == (20, 4)

    recent = M.LpipsFeatureCache(lpips_model, keep_mb=0, recent_mb=0)
    recent.recent_bytes = 3 * per_image  # three images, least recently used out first
    r, x = rec[:3], real[:2]
    # The reconstruction's side is looked up (and stored) before the reference's.
    M.lpips(r[0:1], x[0:1], cache=recent)  # r0, x0 computed: [r0, x0]
    M.lpips(r[1:2], x[0:1], cache=recent)  # r1 computed, x0 found: [r0, r1, x0]
    M.lpips(r[2:3], x[1:2], cache=recent)  # r2 and x1 computed; r0, then r1 out: [x0, r2, x1]
    M.lpips(r[2:3], x[0:1], cache=recent)  # both found: [x1, r2, x0]
    M.lpips(r[0:1], x[0:1], cache=recent)  # r0 computed again (x1 out), x0 found: [r2, r0, x0]
    assert (recent.computed, recent.reused) == (6, 4) and recent.stats()["recent_images"] == 3
    M.lpips(r[1:2], x[1:2], cache=recent)  # both out by now
    assert (recent.computed, recent.reused) == (8, 4)


def test_lpips_cache_budget_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(M.CACHE_ENV, raising=False)
    ram_mb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") >> 20
    assert M.cache_budget_mb() == min(M.lpips_cache.DEFAULT_CACHE_MB, ram_mb // 8) > 0
    monkeypatch.setenv(M.CACHE_ENV, "0")
    assert M.cache_budget_mb() == 0
    for bad in ("-1", "2.5", "lots"):
        monkeypatch.setenv(M.CACHE_ENV, bad)
        with pytest.raises(ValueError, match=f"{M.CACHE_ENV} must be a whole number of megabytes >= 0, got '{bad}'"):
            M.cache_budget_mb()


# ---------------------------------------------------------------------------- validation

ALL = [M.mse, M.psnr, M.ssim, M.fft2d, M.fft2d_hermitian, M.lpips, M.ssim_official, M.fft2d_clamped, M.ssim_torch]


@pytest.mark.parametrize("fn", ALL, ids=lambda f: f.__name__)
def test_validation(fn) -> None:
    good = torch.rand(2, 3, 16, 16) * 0.5 + 0.25
    high, low = good.clone(), good.clone()
    high[1, 2, 3, 4], low[0, 1, 2, 3] = 1.5, -0.1
    bad = {
        "4-D": torch.rand(3, 16, 16),
        "3 \\(RGB\\) channels": torch.rand(2, 1, 16, 16),
        "floating-point": (good * 255).to(torch.uint8),
        "NaN or Inf.*\\[1\\]": good.clone().index_put_((torch.tensor([1]),), torch.tensor(float("nan"))),
        "values in \\[0, 1\\].*max 1.5": high,
        "values in \\[0, 1\\].*min -0.1": low,
    }
    for pattern, tensor in bad.items():
        with pytest.raises(ValueError, match=pattern):
            fn(tensor, good)
        with pytest.raises(ValueError, match="reference"):
            fn(good, tensor)
    with pytest.raises(ValueError, match="same shape"):
        fn(good, torch.rand(2, 3, 16, 17))
    inf = good.clone()
    inf[0, 0, 0, 0] = float("inf")
    with pytest.raises(ValueError, match="NaN or Inf"):
        fn(inf, good)


def test_range_tolerance_accepted() -> None:
    x = torch.rand(2, 3, 16, 16, dtype=torch.float64)
    y = x.clone()
    y[0, 0, 0, 0], y[1, 0, 0, 0] = 1 + 0.5 * M.RANGE_TOLERANCE, -0.5 * M.RANGE_TOLERANCE
    assert torch.isfinite(M.psnr(y, x)).all()


# ---------------------------------------------------------------------- registry and scorer


def test_registry() -> None:
    base = {"mse", "psnr", "ssim", "fft2d", "fft2d_hermitian", "lpips", "ssim_official", "fft2d_clamped",
            "psnr_registered"}
    eight = {f"{m}_8bit" for m in ("mse", "fft2d", "psnr", "ssim", "lpips", "ssim_official", "fft2d_clamped")}
    assert set(M.METRICS) == base | eight
    assert M.get_metric("ssim").fn is M.ssim
    with pytest.raises(ValueError, match="valid metrics: mse, fft2d, psnr, ssim, lpips, fft2d_hermitian, ssim_official"):
        M.get_metric("nope")
    assert M.PAPER_COLUMN_ORDER == ("acc", "mse", "fft2d", "psnr", "ssim", "lpips")
    labels = [M.PAPER_COLUMN_LABELS[c] for c in M.PAPER_COLUMN_ORDER]
    assert labels == ["Acc. ↑", "MSE ↑", "FFT2D ↑", "PSNR ↓", "SSIM ↓", "LPIPS ↑"]


def test_score_settings(real: torch.Tensor) -> None:
    x = real
    x_tilde = real.flip(-1)
    rec = _distort(real, 0.1)
    names = ("mse", "psnr", "ssim", "fft2d", "fft2d_hermitian")
    for setting, ref in (("a", x), ("b", x_tilde), ("c", x)):
        rows = M.score(setting, rec, x, x_tilde, metrics=names, extra={"model": "m"})
        assert len(rows) == 4 and all(r["setting"] == setting and r["model"] == "m" for r in rows)
        assert not any(r["failed"] for r in rows)
        for name in names:
            want = M.get_metric(name).fn(rec, ref)
            assert [r[name] for r in rows] == pytest.approx(want.tolist(), abs=1e-12)
    assert M.score("b", rec, x, x_tilde, metrics=("mse",))[0]["reference"] == "x_tilde"
    with pytest.raises(ValueError, match="valid settings: a, b, c"):
        M.score("d", rec, x, x_tilde)
    with pytest.raises(ValueError, match="x_tilde is required"):
        M.score("b", rec, x)
    with pytest.raises(ValueError, match="valid metrics"):
        M.score("a", rec, x, metrics=("mse", "bogus"))
    with pytest.raises(ValueError, match="shape"):
        M.score("a", rec[:, :, :32], x)


def test_score_failed_and_clamped_rows(real: torch.Tensor) -> None:
    rec = _distort(real, 0.1)
    rec[1, 0, 3, 3] = float("nan")
    rec[2, 2, 0, 0] = float("-inf")
    rec[3] = rec[3] * 1.5  # out of range: clipped by default
    rows = M.score("a", rec, real, metrics=("mse", "ssim"))
    assert [r["index"] for r in rows] == [0, 1, 2, 3]
    assert [r["failed"] for r in rows] == [False, True, True, False]
    assert rows[1]["failure"] == rows[2]["failure"] == "non-finite reconstruction"
    assert math.isnan(rows[1]["mse"]) and math.isnan(rows[2]["ssim"])
    assert rows[3]["clamped"] and not rows[0]["clamped"]
    assert rows[3]["mse"] == pytest.approx(M.mse(rec[3:].clamp(0, 1), real[3:]).item())
    assert rows[0]["mse"] == pytest.approx(M.mse(rec[:1], real[:1]).item())
    strict = M.score("a", rec, real, metrics=("mse",), clamp=False)
    assert strict[3]["failed"] and "outside [0, 1]" in strict[3]["failure"]
    all_bad = M.score("c", torch.full_like(real, float("nan")), real, metrics=("mse",))
    assert all(r["failed"] for r in all_bad) and len(all_bad) == 4


def test_score_with_lpips(real: torch.Tensor, lpips_model) -> None:
    rec = _distort(real, 0.1)
    rows = M.score("a", rec, real, metrics=M.PAPER_METRICS, lpips_model=lpips_model)
    assert [r["lpips"] for r in rows] == pytest.approx(M.lpips(rec, real, model=lpips_model).tolist())


# ---------------------------------------------------------------------------- aggregation


def test_aggregate_matches_pandas_by_hand() -> None:
    rng = np.random.default_rng(0)
    rows = []
    for model in ("deit_s", "deit_s_mjp"):
        for setting in ("a", "c"):
            for i in range(5):
                failed = model == "deit_s_mjp" and setting == "c" and i < 2
                rows.append({"model": model, "setting": setting, "index": i, "failed": failed,
                             "failure": "non-finite reconstruction" if failed else None,
                             "mse": math.nan if failed else float(rng.random()),
                             "psnr": math.nan if failed else float(rng.uniform(5, 40)),
                             "ssim": math.nan if failed else float(rng.random())})
    rows[0]["psnr"] = math.inf  # identical images
    rows[1]["psnr"] = 150.0
    table = M.aggregate(rows, by=("model", "setting"))
    assert list(table.columns[:4]) == ["model", "setting", "n", "n_failed"]
    df = pd.DataFrame(rows)
    ok = df[~df["failed"]].copy()
    ok["psnr"] = ok["psnr"].clip(upper=M.PSNR_CAP_DB)
    want = ok.groupby(["model", "setting"])[["mse", "psnr", "ssim"]].agg(["mean", "std", "count"])
    for _, row in table.iterrows():
        key = (row["model"], row["setting"])
        assert row["n"] == 5
        assert row["n_failed"] == (2 if key == ("deit_s_mjp", "c") else 0)
        for m in ("mse", "psnr", "ssim"):
            for s in ("mean", "std", "count"):
                assert row[f"{m}_{s}"] == pytest.approx(want.loc[key, (m, s)], rel=1e-12)
    first = table[(table["model"] == "deit_s") & (table["setting"] == "a")].iloc[0]
    assert first["psnr_n_capped"] == 2 and first["psnr_count"] == 5
    # The most-leaked image of each group: the highest PSNR / SSIM, the lowest MSE, failed rows out.
    most = ok.groupby(["model", "setting"]).agg(psnr=("psnr", "max"), ssim=("ssim", "max"), mse=("mse", "min"))
    for _, row in table.iterrows():
        key = (row["model"], row["setting"])
        for m in ("mse", "psnr", "ssim"):
            assert row[f"{m}_worst"] == most.loc[key, m]
    assert first["psnr_worst"] == M.PSNR_CAP_DB  # the exact copy, capped like the mean
    # Without a cap the inf propagates; one group over everything with by=().
    assert math.isinf(M.aggregate(rows, psnr_cap_db=None)["psnr_mean"].iloc[0])
    overall = M.aggregate(rows, by=())
    assert len(overall) == 1 and overall["n"].iloc[0] == 20 and overall["n_failed"].iloc[0] == 2
    assert overall["mse_mean"].iloc[0] == pytest.approx(ok["mse"].mean())
    with pytest.raises(ValueError, match="grouping columns"):
        M.aggregate(rows, by=("attack",))


def test_aggregate_all_failed_group(real: torch.Tensor) -> None:
    good = M.score("a", real, real, metrics=("mse", "psnr"), extra={"model": "ok"})
    bad = M.score("a", torch.full_like(real, float("nan")), real, metrics=("mse", "psnr"), extra={"model": "bad"})
    table = M.aggregate(good + bad).set_index("model")
    assert table.loc["bad", "n_failed"] == 4 and table.loc["bad", "mse_count"] == 0
    assert math.isnan(table.loc["bad", "mse_mean"])
    assert table.loc["ok", "psnr_mean"] == M.PSNR_CAP_DB and table.loc["ok", "psnr_n_capped"] == 4
