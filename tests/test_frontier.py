"""The privacy-utility frontier (benchmark/frontier.py) and the DP accountant (benchmark/accounting.py)."""
from __future__ import annotations

import json
import math

import pandas as pd
import pytest


def _row(index, model, setting, attack, psnr, lpips, image, defence="none", point=None, top1=0.5, low=0.49,
         high=0.51, eps=None):
    point = point or {}
    row = {"model": model, "label": model, "setting": setting, "attack": attack, "round": 1, "client": 0,
           "batch_index": image, "image_id": f"img{image}", "failed": False, "psnr": psnr, "ssim": 0.5, "mse": 0.1,
           "lpips": lpips, "defence": defence, "sweep_index": index, "sweep": json.dumps(point),
           "utility_top1": top1, "utility_top1_low": low, "utility_top1_high": high}
    if eps is not None:
        row.update({"utility_dp_epsilon": eps, "utility_dp_delta": 1e-5})
    row.update({f"sweep.{k}": (json.dumps(v, sort_keys=True) if isinstance(v, (dict, list)) else v)
                for k, v in point.items()})
    return row


def _sweep_rows():
    """Three points on DeiT (a): none, local_dp sigma 1e-3 and 1e-2; one MJP point on DeiT+MJP (c);
    two attackers and two images per point, so that the strongest row is a per-image choice."""
    rows = []
    points = [
        (0, "DeiT", "a", "none", {"defence": {"name": "none"}}, 0.60, None, [(100.0, 0.0, 30.0, 0.2), (90.0, 0.0, 40.0, 0.1)]),
        (1, "DeiT", "a", "local_dp", {"defence": {"name": "local_dp", "clip": 1.0, "sigma": 1e-3}}, 0.56, 7.5,
         [(12.0, 0.5, 20.0, 0.3), (18.0, 0.4, 16.0, 0.35)]),
        (2, "DeiT", "a", "local_dp", {"defence": {"name": "local_dp", "clip": 1.0, "sigma": 1e-2}}, 0.40, 0.9,
         [(11.0, 0.6, 10.0, 0.7), (12.0, 0.55, 13.0, 0.6)]),
        (3, "DeiT+MJP", "c", "none", {"gamma": 0.27, "settings": ["c"]}, 0.52, None,
         [(15.0, 0.3, 17.0, 0.25), (16.0, 0.3, 14.0, 0.4)]),
    ]
    for index, model, setting, defence, point, top1, eps, images in points:
        for image, (p_a, l_a, p_b, l_b) in enumerate(images):
            for attack, psnr, lpips in (("april_robust", p_a, l_a), ("ig_closed_start", p_b, l_b)):
                rows.append(_row(index, model, setting, attack, psnr, lpips, image, defence, point, top1,
                                 top1 - 0.01, top1 + 0.01, eps))
    return rows


def test_frontier_points_are_the_sweeps_strongest_rows():
    from benchmark.frontier import frontier_points
    from benchmark.sweep_table import strongest, sweep_table

    table = sweep_table(_sweep_rows())
    points = frontier_points(table)
    best = strongest(table)
    assert len(points) == len(best) == 4
    for _, p in points.iterrows():
        row = best[(best["sweep_index"] == p["sweep_index"]) & (best["model"] == p["model"])
                   & (best["setting"] == p["setting"])]
        assert len(row) == 1 and row["attack"].iloc[0] == "strongest"
        assert p["psnr"] == pytest.approx(row["psnr"].iloc[0]) and p["lpips"] == pytest.approx(row["lpips"].iloc[0])
        assert p["top1"] == pytest.approx(100 * row["utility_top1"].iloc[0])
    # per image the higher PSNR: point 1 takes 20 (IG) and 18 (robust), so its mean is 19
    assert points.set_index("sweep_index").loc[1, "psnr"] == pytest.approx(19.0)
    kinds = points.set_index("sweep_index")
    assert list(kinds["curve"]) == ["none", "local_dp", "local_dp", "MJP"]
    assert kinds.loc[2, "param"] == 1e-2 and kinds.loc[2, "epsilon"] == pytest.approx(0.9)
    assert "eps 0.9" in kinds.loc[2, "point_label"] and kinds.loc[3, "param"] == 0.27


def test_interpolation_matches_a_hand_computation():
    from benchmark.frontier import interpolate, privacy_at

    curve = pd.DataFrame({"top1": [70.0, 66.0, 60.0], "psnr": [30.0, 20.0, 15.0], "lpips": [0.1, 0.3, 0.6]})
    # 63 lies half way along the segment 66 -> 60: 20 + 0.5 (15 - 20) = 17.5
    assert interpolate(curve, 63.0, "psnr") == pytest.approx(17.5)
    assert interpolate(curve, 68.0, "lpips") == pytest.approx(0.2)
    assert math.isnan(interpolate(curve, 75.0, "psnr")) and math.isnan(interpolate(curve, 59.0, "psnr"))
    got = privacy_at(curve, 63.0, 62.0, 64.0)
    # at 64: 20 - 5 (2/6) = 18.333; at 62: 20 - 5 (4/6) = 16.667
    assert got["psnr_low"] == pytest.approx(16.0 + 2 / 3) and got["psnr_high"] == pytest.approx(18.0 + 1 / 3)
    assert got["lpips"] == pytest.approx(0.45)
    # an interval end beyond the curve leaves that side open
    assert math.isnan(privacy_at(curve, 61.0, 58.0, 64.0)["psnr_low"])
    # a curve that turns back: the first crossing from the weak end is taken
    back = pd.DataFrame({"top1": [70.0, 60.0, 68.0], "psnr": [30.0, 10.0, 0.0], "lpips": [0.0, 0.0, 0.0]})
    assert interpolate(back, 65.0, "psnr") == pytest.approx(20.0)


def test_matched_table_interpolates_each_defence_at_mjps_top1_and_back():
    from benchmark.frontier import frontier_points, matched_table
    from benchmark.sweep_table import sweep_table

    points = frontier_points(sweep_table(_sweep_rows()))
    table = matched_table(points)
    at_mjp = table[table["at"] == "defence @ MJP"]
    assert len(at_mjp) == 1
    # local_dp's curve: none (60 %, mean PSNR of the per-image best: (100 + 90) / 2 = 95) -> sigma 1e-3
    # (56 %, 19 dB) -> sigma 1e-2 (40 %, per image 11 and 13: 12 dB); MJP at 52 %: on the second
    # segment, t = (52 - 56) / (40 - 56) = 0.25
    expected = 19.0 + 0.25 * (12.0 - 19.0)
    assert at_mjp["psnr"].iloc[0] == pytest.approx(expected)
    assert at_mjp["own_psnr"].iloc[0] == pytest.approx(16.5)
    assert at_mjp["between"].iloc[0] == "sigma 0.001, eps 7.5 .. sigma 0.01, eps 0.9"
    # the MJP curve is one point: MJP's privacy at the defences' top-1 is not reached
    back = table[table["at"] == "MJP @ defence"]
    assert len(back) == 2 and back["psnr"].isna().all()


def test_frontier_files_and_plot(tmp_path):
    from benchmark.frontier import write_frontier
    from benchmark.sweep_table import sweep_table

    csv = tmp_path / "sweep.csv"
    sweep_table(_sweep_rows()).to_csv(csv, index=False)
    out = write_frontier(csv, tmp_path)
    text = (tmp_path / "frontier.md").read_text()
    assert "local_dp" in text and "eps 7.5" in text
    assert (tmp_path / "frontier.png").stat().st_size > 5000
    assert len(pd.read_csv(out["points"])) == 4


def test_frontier_without_utility_is_a_clear_error():
    from benchmark.frontier import frontier_points
    from benchmark.sweep_table import sweep_table

    rows = [{k: v for k, v in r.items() if not k.startswith("utility")} for r in _sweep_rows()]
    with pytest.raises(ValueError, match="utility_top1"):
        frontier_points(sweep_table(rows))


@pytest.mark.parametrize("sigma,local_steps", [(1.0, 1), (0.7, 3)])
def test_dp_sgd_epsilon_is_opacus_rdp_accountant(sigma, local_steps):
    from opacus.accountants import RDPAccountant

    from benchmark.accounting import federation_epsilon
    from defences.spec import validate_defence

    spec = validate_defence({"name": "dp_sgd", "clip": 1.0, "sigma": sigma, "delta": 1e-5})
    got = federation_epsilon(spec, rounds=40, local_steps=local_steps, batch_size=32, partition_size=2500,
                             delta=1e-3)
    acc = RDPAccountant()
    for _ in range(40):
        acc.step(noise_multiplier=sigma / math.sqrt(local_steps), sample_rate=32 / 2500)
    assert got["dp_epsilon"] == pytest.approx(acc.get_epsilon(delta=1e-5), rel=1e-9)
    assert got["dp_delta"] == 1e-5


def test_local_and_central_dp_epsilon_is_the_gaussian_mechanism():
    from opacus.accountants import RDPAccountant

    from benchmark.accounting import federation_epsilon
    from defences.spec import validate_defence

    for name, multiplier in (("local_dp", 0.8 / 2), ("central_dp", 0.8)):
        spec = validate_defence({"name": name, "clip": 1.0, "sigma": 0.8})
        got = federation_epsilon(spec, rounds=10, local_steps=1, batch_size=32, partition_size=100, delta=1e-5)
        acc = RDPAccountant()
        for _ in range(10):
            acc.step(noise_multiplier=multiplier, sample_rate=1.0)
        assert got["dp_epsilon"] == pytest.approx(acc.get_epsilon(delta=1e-5), rel=1e-9)
    # weaker noise, more epsilon; a Laplace local DP has no Gaussian figure; a non-DP defence none
    weak = federation_epsilon(validate_defence({"name": "local_dp", "sigma": 0.1}), 10, 1, 32, 100, 1e-5)
    assert weak["dp_epsilon"] > got["dp_epsilon"]
    lap = federation_epsilon(validate_defence({"name": "local_dp", "noise": "laplace"}), 10, 1, 32, 100, 1e-5)
    assert math.isnan(lap["dp_epsilon"])
    assert federation_epsilon(validate_defence({"name": "prune"}), 10, 1, 32, 100, 1e-5) == {}


def test_the_psnr_axis_stops_above_the_highest_inexact_point():
    from benchmark.frontier import psnr_cap

    assert psnr_cap(pd.DataFrame({"psnr": [100.0, 17.4, 11.2]})) == pytest.approx(21.4)
    assert math.isinf(psnr_cap(pd.DataFrame({"psnr": [17.4, 11.2]})))
    assert math.isinf(psnr_cap(pd.DataFrame({"psnr": [100.0, 100.0]})))
