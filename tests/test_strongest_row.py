"""The ``strongest`` row: per image, the best reconstruction over every attacker
run on it, picked by PSNR against the ground truth, derived at report time from a real run's
results.jsonl (never stored there).

The run: a tiny in-process benchmark (32 px, depth-2 design-A ViTs, 2 clients x 1 round, settings a
and c) of a no-PE row and an MJP row under three attackers: APRIL's closed form (fails on the
no-PE row: it needs dL/dP), a short Inverting Gradients, and an attacker whose condition never
holds (it fails on every image and must never win).
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml
from helpers import register_condition_failure

from benchmark.aggregate import STRONGEST, rows_frame, strongest_rows
from fedmjp.stats import bootstrap_ci
from benchmark.store import read_jsonl
from benchmark.sweep_table import gather_rows, strongest, sweep_table
from run_benchmark import main

ROOT = Path(__file__).resolve().parents[1]
CAP = 100.0
ATTACKERS = ["april_analytic", "IG", "test_strongest_never"]


register_condition_failure("test_strongest_never")  # every image is a failure row


@pytest.fixture(scope="module")
def run_folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("strongest")
    arch, kw = "mjp_vit_cifar_patch4_32", {"depth": 2}
    cfg = {
        "name": "strongest", "seed": 0, "device": "cpu", "settings": ["a", "c"], "gamma": 0.27,
        "data": {"source": "embedded", "image_size": 32, "num_images": 2, "num_classes": 10},
        "federation": {"engine": "inprocess", "rounds": 1, "clients": 2, "precision": "float64", "lr": 0.01},
        "models": [{"name": "DeiT-noPE", "arch": arch, "variant": "nope", "kwargs": kw, "april": "surgery"},
                   {"name": "DeiT+MJP", "arch": arch, "variant": "mjp", "kwargs": kw, "april": "surgery"}],
        "attacks": [{"name": "april_analytic"},
                    {"name": "invertinggradients_batched", "label": "IG", "options": {"iterations": 8}},
                    {"name": "test_strongest_never"}],
        "metrics": {"lpips_backbone": None},  # the route: $FEDMJP_DATA/lpips where the data folder holds it
        "report": {"grid_images": 2, "tile": 32},
    }
    path = folder / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    out = folder / "out"
    assert main(["--config", str(path), "--output", str(out), "--no-progress"]) == 0
    return out


def _per_image_best(rows: pd.DataFrame) -> pd.DataFrame:
    """The expected strongest rows, computed independently: per image, the non-failed attacker row
    of maximal PSNR (ties to the attacker listed first)."""
    ok = rows[~rows["failed"]].copy()
    ok["_o"] = ok["attack"].map({a: i for i, a in enumerate(ATTACKERS)})
    out = []
    for _, g in ok.groupby(["model", "setting", "image_id"]):
        # exact copies (above the cap) tie, as do PSNRs on the same 1e-3 dB step (rounding noise)
        score = (g["psnr"].clip(upper=CAP) / 1e-3).round()
        out.append(g[score == score.max()].sort_values("_o").iloc[0])
    return pd.DataFrame(out).drop(columns="_o")


def test_results_store_no_strongest_rows(run_folder: Path) -> None:
    rows = read_jsonl(run_folder / "results.jsonl")
    assert {r["attack"] for r in rows} == set(ATTACKERS)
    assert len(rows) == 2 * 2 * 2 * 3  # models x settings x images x attackers


def test_strongest_row_is_the_per_image_maximum(run_folder: Path) -> None:
    rows = rows_frame(read_jsonl(run_folder / "results.jsonl"))
    # the run exercises what the rule is about: APRIL fails on the no-PE row, the never-attacker everywhere
    assert rows[(rows["attack"] == "april_analytic") & (rows["model"] == "DeiT-noPE")]["failed"].all()
    assert rows[rows["attack"] == "test_strongest_never"]["failed"].all()
    want = _per_image_best(rows).set_index(["model", "setting", "image_id"]).sort_index()
    got = strongest_rows(rows).set_index(["model", "setting", "image_id"]).sort_index()
    assert list(got.index) == list(want.index) and len(got) == 2 * 2 * 2
    assert (got["attack"] == STRONGEST).all() and not got["failed"].any()
    assert list(got["winner"]) == list(want["attack"])
    assert "test_strongest_never" not in set(got["winner"])
    assert set(got.loc["DeiT-noPE", "winner"]) == {"IG"}  # the only attacker that ran there
    # every metric of the row is the chosen reconstruction's own value
    for col in ("psnr", "ssim", "mse", "fft2d", "lpips", "correct", "psnr_unshuffled", "psnr_shuffled"):
        pd.testing.assert_series_equal(got[col], want[col], check_names=False)
    # and it is at least every attacker's value on that image (capped: exact copies tie)
    for attack, g in rows[~rows["failed"]].groupby("attack"):
        g = g.set_index(["model", "setting", "image_id"])
        assert (got.loc[g.index, "psnr"].clip(upper=CAP) >= g["psnr"].clip(upper=CAP)).all(), attack

    full = pd.read_csv(run_folder / "table_full.csv")
    assert list(dict.fromkeys(full["attack"])) == [*ATTACKERS, STRONGEST]
    for (model, setting), w in want.groupby(level=["model", "setting"]):
        r = full[(full["model"] == model) & (full["setting"] == setting) & (full["attack"] == STRONGEST)].iloc[0]
        capped = np.minimum(w["psnr"].to_numpy(float), CAP)
        assert r["n"] == 2 and r["n_failed"] == 0
        assert r["psnr_mean"] == pytest.approx(capped.mean(), rel=1e-12)
        assert r["ssim_mean"] == pytest.approx(w["ssim"].mean(), rel=1e-12)
        # intervals the same way as every other row
        assert (r["psnr_ci_low"], r["psnr_ci_high"]) == pytest.approx(bootstrap_ci(capped), rel=1e-12)
        counts = w["attack"].value_counts()
        for attack, n in counts.items():
            assert f"{attack} {n}/2" in r["winners"]
        assert "test_strongest_never" not in r["winners"]
        # the most-leaked image: the highest capped PSNR and SSIM, the lowest LPIPS of the chosen images
        assert r["psnr_worst"] == pytest.approx(capped.max(), rel=1e-12)
        assert r["ssim_worst"] == pytest.approx(w["ssim"].max(), rel=1e-12)
        assert r["lpips_worst"] == pytest.approx(w["lpips"].min(), rel=1e-12)
        # the strongest mean is at least the best single attacker's
        single = full[(full["model"] == model) & (full["setting"] == setting) & (full["attack"] != STRONGEST)]
        assert r["psnr_mean"] >= single["psnr_mean"].max() - 1e-9
    md = (run_folder / "table.md").read_text()
    assert "| strongest" in md and "Winners" in md and "highest PSNR against the ground" in md
    assert "PSNR max" in md and "most-leaked image" in md
    assert "AlexNet trunk with its v0.1 linear heads" in md  # the LPIPS net, named
    table = pd.read_csv(run_folder / "table.csv")
    assert "strongest" in table["Attack"].tolist()
    # the paper table's PSNR max is table_full's psnr_worst, row for row
    shown = pd.to_numeric(table["PSNR max"], errors="coerce")  # "—" where every image failed
    assert list(shown) == pytest.approx(list(full["psnr_worst"]), abs=5e-3, nan_ok=True)
    assert shown.notna().sum() == full["psnr_worst"].notna().sum() > 0


def test_an_image_every_attacker_failed_is_failed(run_folder: Path) -> None:
    rows = rows_frame(read_jsonl(run_folder / "results.jsonl"))
    # on the no-PE row, APRIL and the never-attacker both fail: so does their strongest row
    pair = rows[(rows["model"] == "DeiT-noPE") & rows["attack"].isin(["april_analytic", "test_strongest_never"])]
    got = strongest_rows(pair)
    assert len(got) == 4 and got["failed"].all() and got["winner"].isna().all()
    assert got["reason"].str.contains("april_analytic: condition failed").all()
    assert got["reason"].str.contains("test_strongest_never: ").all()
    assert not got["error"].astype(bool).any()
    # a single attacker has no strongest row
    assert strongest_rows(rows[rows["attack"] == "IG"]).empty


def test_sweep_table_and_privacy_utility_use_the_strongest_row(run_folder: Path) -> None:
    rows = gather_rows([{"gamma": 0.27}], [run_folder])
    table = sweep_table(rows)
    best = table[table["attack"] == STRONGEST].set_index(["model", "setting"])
    assert len(best) == 4 and best["winners"].notna().all()
    full = pd.read_csv(run_folder / "table_full.csv")
    full = full[full["attack"] == STRONGEST].set_index(["model", "setting"])
    for key, r in best.iterrows():
        assert r["psnr"] == pytest.approx(full.loc[key, "psnr_mean"], rel=1e-12)
        assert r["psnr_worst"] == pytest.approx(full.loc[key, "psnr_worst"], rel=1e-12)
        assert r["lpips_worst"] == pytest.approx(full.loc[key, "lpips_worst"], rel=1e-12)
        assert r["winners"] == full.loc[key, "winners"]
        assert r["n"] == 2 and r["failed"] == 0
    picked = strongest(table)
    assert set(picked["attack"]) == {STRONGEST} and len(picked) == 4
    assert not math.isnan(picked["psnr"].mean())
