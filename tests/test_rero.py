"""The ReRo bound of a Gaussian-DP release (defences/rero.py), the prior's best fixed guess
(metrics/prior.py) and the ceilings they give the frontier (benchmark/frontier.py)."""
from __future__ import annotations

import math

import pandas as pd
import pytest
import torch
from scipy.stats import norm

from defences import validate_defence
from defences.rero import needed_baseline, release_mu, rero_bound
from metrics.prior import MAX_PRIOR_IMAGES, guess_psnr, guess_share


# ------------------------------------------------------------------------------------- the bound
@pytest.mark.parametrize("kappa, mu", [(1e-3, 1.0), (0.05, 0.5), (0.2, 2.0)])
def test_the_bound_is_the_power_of_the_best_test_of_the_gaussian_mechanism(kappa, mu):
    """The bound is tight for the Gaussian mechanism: an attacker that sees y = mu [z present] + N(0, 1)
    and answers "present" above the threshold that a fixed guess's kappa allows reaches it with
    Phi(Phi^-1(kappa) + mu). Sampled here (4e5 draws: the standard error is below 1e-3)."""
    g = torch.Generator().manual_seed(0)
    threshold = float(norm.isf(kappa))  # P[N(0,1) > t] = kappa: the guess's rate without the image
    y = torch.randn(400_000, generator=g, dtype=torch.float64) + mu
    power = float((y > threshold).double().mean())
    assert rero_bound(kappa, mu) == pytest.approx(power, abs=4e-3)
    assert rero_bound(kappa, mu) > kappa


def test_the_bound_at_its_ends_and_its_inverse():
    assert rero_bound(0.3, 0.0) == 0.3 and rero_bound(0.0, 5.0) == 0.0 and rero_bound(1.0, 0.1) == 1.0
    assert rero_bound(1e-9, math.inf) == 1.0 and needed_baseline(0.5, math.inf) == 0.0
    for success, mu in ((0.5, 1.0), (0.9, 3.0), (0.1, 0.2)):
        assert rero_bound(needed_baseline(success, mu), mu) == pytest.approx(success, rel=1e-9)
    assert needed_baseline(0.5, 1.0) == pytest.approx(norm.cdf(-1.0))  # 0.1587: a fixed guess's share
    for bad in ((-0.1, 1.0), (1.5, 1.0), (0.5, -1.0), (0.5, math.nan)):
        with pytest.raises(ValueError):
            rero_bound(*bad)
    for bad in ((0.0, 1.0), (1.0, 1.0), (0.5, -2.0)):
        with pytest.raises(ValueError):
            needed_baseline(*bad)


def test_release_mu_by_defence():
    dp_sgd = validate_defence({"name": "dp_sgd", "clip": 1.0, "sigma": 2.0})
    assert release_mu(dp_sgd, 1, 1) == pytest.approx(0.5)
    assert release_mu(dp_sgd, 8, 4) == pytest.approx(1.0)  # sqrt(4) / 2: the steps compose
    local = validate_defence({"name": "local_dp", "clip": 1.0, "sigma": 1e-2})
    assert release_mu(local, 1, 1) == pytest.approx(100.0) and release_mu(local, 4, 1) == pytest.approx(200.0)
    for other in ({"name": "central_dp"}, {"name": "local_dp", "noise": "laplace"}, {"name": "prune", "keep": 0.1},
                  {"name": "quantize", "bits": 8}, None):
        assert release_mu(validate_defence(other), 1, 1) is None
    with pytest.raises(ValueError):
        release_mu(dp_sgd, 0, 1)


def test_local_dps_mu_is_what_the_defence_applies():
    """The defence and its mu change together: a batch-1 update under local_dp moves, from the update
    without the image (0), by at most clip, in units of the noise it adds (sigma clip): at most mu."""
    from defences.transforms import local_dp

    g = torch.Generator().manual_seed(0)
    clean = {"w": torch.randn(3000, generator=g, dtype=torch.float64) * 5.0}
    sigma, clip = 0.5, 1.0
    shift = local_dp(clean, clip, 0.0, torch.Generator())["w"]  # what the image adds: its clipped update
    noise = local_dp(clean, clip, sigma, torch.Generator().manual_seed(1))["w"] - shift
    mu = release_mu(validate_defence({"name": "local_dp", "clip": clip, "sigma": sigma}), 1, 1)
    assert float(noise.std()) == pytest.approx(sigma * clip, rel=0.05)
    assert float(shift.norm()) / (sigma * clip) == pytest.approx(mu, rel=1e-9)  # ||u|| > clip: the bound is met


# ------------------------------------------------------------------------------------- the prior
def _grey_prior(levels):
    """Flat grey images at ``levels``: PSNR(a, b) = -20 log10 |a - b|."""
    return torch.stack([torch.full((3, 4, 4), float(v)) for v in levels])


def test_the_best_fixed_guess_of_a_grey_prior_by_hand():
    prior = _grey_prior([0.1, 0.2, 0.3, 0.6])
    # mean 0.3: distances 0.2, 0.1, 0, 0.3 -> PSNR 13.98, 20, inf, 10.46; the image 0.2 against the others:
    # 0.1, 0.1, 0.4 -> 20, 20, 7.96 (2 of 3)
    assert guess_share(prior, 19.0) == pytest.approx(2 / 3)
    assert guess_share(prior, 25.0) == pytest.approx(1 / 4)  # only the mean reaches 0.3 exactly
    assert guess_psnr(prior, 0.5) == pytest.approx(20.0)  # the mean's second best, and 0.2's
    assert guess_psnr(prior, 0.6) == pytest.approx(20.0)  # 0.2 reaches 20 dB on 2 of its 3
    assert guess_psnr(prior, 0.2) == math.inf  # below one image of the sample: not resolved
    extra = torch.full((1, 3, 4, 4), 0.15)  # 0.05 from 0.1 and 0.2: 26.02 dB on 2 of 4
    assert guess_share(prior, 25.0, guesses=extra) == pytest.approx(1 / 2)
    assert guess_psnr(prior, 0.5, guesses=extra) == pytest.approx(-20 * math.log10(0.05), abs=1e-4)


def test_the_prior_is_bounded_and_checked():
    with pytest.raises(ValueError, match="at least 2"):
        guess_psnr(torch.rand(1, 3, 4, 4), 0.5)
    with pytest.raises(ValueError, match="smaller sample"):
        guess_share(torch.zeros(MAX_PRIOR_IMAGES + 1, 3, 1, 1), 10.0)
    with pytest.raises(ValueError, match=r"\[B, 3, H, W\]"):
        guess_share(torch.rand(4, 4, 4), 10.0)
    with pytest.raises(ValueError, match="share"):
        guess_psnr(torch.rand(4, 3, 4, 4), 1.5)
    with pytest.raises(ValueError, match="differ in size"):
        guess_psnr(torch.rand(4, 3, 4, 4), 0.5, guesses=torch.rand(1, 3, 5, 5))


# ------------------------------------------------------------------------------------ the frontier
def test_the_frontier_gives_each_dp_point_its_ceiling(tmp_path):
    from benchmark.frontier import points_markdown, rero_ceilings

    prior = torch.rand(200, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    points = pd.DataFrame([
        {"sweep_index": 0, "model": "DeiT", "setting": "a", "curve": "none", "point_label": "none", "rero_mu": math.nan},
        {"sweep_index": 1, "model": "DeiT", "setting": "a", "curve": "dp_sgd", "point_label": "sigma 1", "rero_mu": 1.0},
        {"sweep_index": 2, "model": "DeiT", "setting": "a", "curve": "local_dp", "point_label": "sigma 1e-4",
         "rero_mu": 1e4},
        {"sweep_index": 3, "model": "DeiT", "setting": "a", "curve": "central_dp", "point_label": "sigma 1",
         "rero_mu": math.nan},
    ]).assign(top1=50.0, top1_low=49.0, top1_high=51.0, epsilon=math.nan, delta=math.nan, psnr=12.0, lpips=0.5, n=2)
    got = rero_ceilings(points, prior)
    assert math.isnan(got["rero_ceiling"][0]) and math.isnan(got["rero_ceiling"][3])
    assert got["rero_ceiling"][1] == pytest.approx(guess_psnr(prior, norm.cdf(-1.0)))
    assert got["rero_ceiling"][2] == math.inf  # mu 1e4: no share the 200 images resolve
    # a stronger release allows more: the ceiling falls as mu does
    weaker = rero_ceilings(points.assign(rero_mu=[math.nan, 0.3, 2.0, math.nan]), prior)["rero_ceiling"]
    assert weaker[1] < got["rero_ceiling"][1] < weaker[2]
    text = points_markdown(got)
    assert "| 1 | " in text and f"{got['rero_ceiling'][1]:.1f} |" in text
    assert "none the prior resolves" in text and "the tap sees the clean update" in text


def test_the_frontier_cli_reads_a_prior(tmp_path):
    """``python -m benchmark.frontier DIR --prior embedded``: the DP point of a sweep.csv gets its ceiling;
    a bad prior is a clear error, not a traceback."""
    from benchmark.frontier import main
    from benchmark.sweep_table import sweep_table
    from tests.test_frontier import _sweep_rows

    rows = _sweep_rows()
    for r in rows:
        if r["defence"] == "local_dp":
            r["rero_mu"] = 2.0 if r["sweep_index"] == 2 else 0.5
    sweep_table(rows).to_csv(tmp_path / "sweep.csv", index=False)
    assert main([str(tmp_path), "--prior", "embedded", "--prior-images", "8", "--image-size", "16"]) == 0
    text = (tmp_path / "frontier.md").read_text()
    assert "ReRo median ceiling" in text
    points = pd.read_csv(tmp_path / "frontier_points.csv")
    assert set(points.loc[points["curve"] == "local_dp", "rero_mu"]) == {0.5, 2.0}
    with pytest.raises(SystemExit):
        main([str(tmp_path), "--prior", str(tmp_path / "missing"), "--prior-images", "8"])
    with pytest.raises(SystemExit):
        main([str(tmp_path), "--prior", "embedded", "--prior-images", "1"])


def test_every_row_of_a_gaussian_dp_update_carries_its_mu():
    """The benchmark's rows (benchmark/rows.py: RowContext.defence_columns) carry the tapped update's mu
    for a Gaussian DP defence at the client, at the federation's batch size and local steps, and it
    survives results.jsonl; other defences carry none."""
    from benchmark.rows import ResultRow, RowContext

    def ctx(defence, batch, steps):
        return RowContext(model="DeiT", label="DeiT", trained=True, arch="a", variant="plain", april=None, group="g",
                          seed=0, defence=validate_defence(defence),
                          federation={"batch_size": batch, "local_steps": steps, "labels": "known"})

    cols = ctx({"name": "dp_sgd", "sigma": 0.5}, 4, 4).defence_columns({"defence-cos": 0.9, "dp-epsilon": 3.0})
    assert cols["rero_mu"] == pytest.approx(4.0) and cols["dp_epsilon"] == 3.0
    assert ctx({"name": "local_dp", "sigma": 0.1}, 1, 1).defence_columns({})["rero_mu"] == pytest.approx(10.0)
    for other in ({"name": "central_dp"}, {"name": "quantize", "bits": 8}, None):
        assert "rero_mu" not in ctx(other, 1, 1).defence_columns({})
    row = ResultRow(model="DeiT", setting="a", round=1, partition_id=0, batch_index=0, image_id="x", attack="a",
                    failed=False, **{k: v for k, v in cols.items()})
    assert ResultRow.from_json(row.to_json()).rero_mu == pytest.approx(4.0)


def test_the_frontier_plot_marks_the_ceilings(tmp_path):
    """frontier.png draws each bounded DP point's ceiling in the PSNR panel and names it in the legend."""
    import matplotlib

    matplotlib.use("Agg")
    from unittest import mock

    import matplotlib.axes

    from benchmark.frontier import frontier_points, frontier_plot, rero_ceilings
    from benchmark.sweep_table import sweep_table
    from tests.test_frontier import _sweep_rows

    rows = _sweep_rows()
    for r in rows:
        if r["defence"] == "local_dp":
            r["rero_mu"] = 1.0
    points = rero_ceilings(frontier_points(sweep_table(rows)), torch.rand(64, 3, 8, 8))
    calls = []
    real = matplotlib.axes.Axes.scatter

    def spy(self, *args, **kwargs):
        calls.append(kwargs.get("label"))
        return real(self, *args, **kwargs)

    with mock.patch.object(matplotlib.axes.Axes, "scatter", spy):
        frontier_plot(points, tmp_path / "f.png")
    assert calls.count("ReRo median ceiling (DP)") == 1 and (tmp_path / "f.png").stat().st_size > 0


def test_a_sweep_with_a_dp_point_takes_its_prior_from_the_attack_images(tmp_path, caplog):
    """benchmark/sweep.py: the ReRo prior is loaded from the run's data source only where some point
    carries rero_mu; a source that cannot be read leaves the ceilings out with a warning."""
    from types import SimpleNamespace

    from benchmark.sweep import _rero_prior

    def cfg(source):
        return SimpleNamespace(data=SimpleNamespace(source=source, image_size=16))

    dp = pd.DataFrame({"rero_mu": [math.nan, 2.0]})
    prior = _rero_prior(cfg("embedded"), dp)
    assert prior is not None and prior.shape[1:] == (3, 16, 16) and len(prior) >= 2
    assert _rero_prior(cfg("embedded"), pd.DataFrame({"rero_mu": [math.nan]})) is None
    assert _rero_prior(cfg("embedded"), pd.DataFrame({"psnr": [10.0]})) is None
    with caplog.at_level("WARNING"):
        assert _rero_prior(cfg(str(tmp_path / "missing")), dp) is None
    assert "ReRo ceilings are left out" in caplog.text
