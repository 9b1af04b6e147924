"""utility.split: train (benchmark/utility.py): FedAvg over partitions of a dataset's train/ split,
top-1 with its bootstrap interval on its val/ split, the learning curve and the DP epsilon."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from PIL import Image


def _dataset(root, train_per_class=4, val_per_class=2, classes=10):
    """An ImageFolder root with train/ and val/ class folders of seeded 32 px noise images whose
    mean colour depends on the class (so that a model can learn something)."""
    rng = np.random.default_rng(0)
    for split, n in (("train", train_per_class), ("val", val_per_class)):
        for c in range(classes):
            folder = root / split / f"class{c:02d}"
            folder.mkdir(parents=True)
            for i in range(n):
                base = np.full((32, 32, 3), 20 * c, dtype=np.int16)
                img = np.clip(base + rng.integers(0, 60, (32, 32, 3)), 0, 255).astype(np.uint8)
                Image.fromarray(img).save(folder / f"{i:03d}.png")
    return root


def _raw(source, **utility) -> dict:
    u = {"split": "train", "rounds": 2, "source": str(source), "num_train": 0, "num_eval": 20, "clients": 2,
         "local_steps": 1, "batch_size": 4, "lr": 0.05, "curve": [1], "curve_eval": 20, **utility}
    return {
        "name": "tiny", "device": "cpu", "settings": ["a"],
        "data": {"source": "embedded", "image_size": 32, "num_images": 2, "num_classes": 10},
        "federation": {"engine": "inprocess", "rounds": 1, "clients": 2, "precision": "float64"},
        "models": [{"name": "DeiT", "arch": "mjp_vit_cifar_patch4_32", "variant": "plain", "kwargs": {"depth": 1}}],
        "attack": {"name": "april_analytic"}, "metrics": {"lpips": False}, "report": {"grid_images": 0},
        "utility": u}


def _cfg(tmp_path, source, **utility):
    from benchmark import config as C
    from benchmark.validation import validate

    return validate(C.conform(_raw(source, **utility)))


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return _dataset(tmp_path_factory.mktemp("data"))


def test_train_split_trains_on_train_and_scores_val_with_an_interval(tmp_path, dataset, one_torch_thread):
    from benchmark.pipeline import build_rows
    from benchmark.utility import defence_utility, per_image_correct

    cfg = _cfg(tmp_path, dataset)
    row = build_rows(cfg, torch.device("cpu"))[0]
    out = defence_utility(cfg, row)
    assert out["utility_split"] == "train" and out["utility_train_images"] == 40 and out["utility_num_eval"] == 20
    assert out["utility_top1_low"] <= out["utility_top1"] <= out["utility_top1_high"]
    assert out["utility_top1_high"] - out["utility_top1_low"] > 0.05  # 20 images: a wide interval
    # the curve: after round 1 (from the tap) and after the last round (the final model, same images)
    assert [r for r, _ in out["utility_curve"]] == [1, 2]
    assert out["utility_curve"][-1][1] == pytest.approx(out["utility_top1"])
    assert "utility_dp_epsilon" not in out
    # the start is scored on the same 20 val images: the untouched row's own model gives it
    from fedmjp.data import load_images

    val = load_images(str(dataset / "val"), 32, 20, 10)
    assert out["utility_top1_start"] == pytest.approx(per_image_correct(row.model, val.images, val.labels).mean())


def test_lr_zero_leaves_the_start_and_dp_sgd_gets_its_epsilon(tmp_path, dataset, one_torch_thread):
    from benchmark.accounting import federation_epsilon
    from benchmark.pipeline import build_rows
    from benchmark.utility import defence_utility
    from defences.spec import validate_defence

    cfg = _cfg(tmp_path, dataset, lr=0.0, curve=[], rounds=1)
    row = build_rows(cfg, torch.device("cpu"))[0]
    frozen = defence_utility(cfg, row)
    assert frozen["utility_top1"] == pytest.approx(frozen["utility_top1_start"])
    spec = {"name": "dp_sgd", "clip": 1.0, "sigma": 1.0, "delta": 1e-4}
    cfg = _cfg(tmp_path, dataset, rounds=1, curve=[], partition="dirichlet", dirichlet_alpha=1.0)
    cfg.defence = validate_defence(spec)
    out = defence_utility(cfg, build_rows(cfg, torch.device("cpu"))[0])
    assert out["utility_partition"] == "dirichlet(1)" and out["utility_dp_delta"] == 1e-4
    assert math.isfinite(out["utility_dp_epsilon"]) and out["utility_dp_epsilon"] > 0
    # q = batch / the smallest partition, which Dirichlet makes smaller than the IID 20
    assert out["utility_dp_epsilon"] > federation_epsilon(validate_defence(spec), 1, 1, 4, 20, 1e-5)["dp_epsilon"]


def test_a_source_without_val_split_names_the_key(tmp_path, one_torch_thread):
    from benchmark.errors import InputDataError
    from benchmark.pipeline import build_rows
    from benchmark.utility import defence_utility

    root = _dataset(tmp_path / "only_train", val_per_class=1)
    import shutil

    shutil.rmtree(root / "val")
    cfg = _cfg(tmp_path, root)
    with pytest.raises(InputDataError, match=r"utility.source .*no val/ folder"):
        defence_utility(cfg, build_rows(cfg, torch.device("cpu"))[0])


def test_a_real_sweep_writes_the_frontier_of_its_own_rows(tmp_path, dataset, one_torch_thread):
    """run_sweep with utility.split train: frontier_points.csv holds one point per grid point, each
    the sweep.csv `strongest` row's PSNR/LPIPS and the point's utility; the finished-points reader
    (for a sweep still running) rebuilds the same table from the point folders."""
    import pandas as pd
    import yaml

    from benchmark.frontier import finished_points_csv
    from benchmark.sweep import run_sweep
    from benchmark.sweep_table import strongest

    from benchmark import config as C
    from benchmark.validation import validate

    raw = {**_raw(dataset, rounds=1, curve=[]), "attacks": [{"name": "april_analytic"}, {"name": "pe_closed_form"}],
           "sweep": [{"defence": {"name": "none"}}, {"defence": {"name": "prune", "keep": 0.1}}]}
    cfg = validate(C.conform(raw))
    out = run_sweep(cfg, str(tmp_path / "sweep"), progress=False)
    table = pd.read_csv(out["csv"])
    best = strongest(table)
    points = pd.read_csv(tmp_path / "sweep" / "frontier_points.csv")
    assert len(points) == len(best) == 2 and (tmp_path / "sweep" / "frontier.png").is_file()
    for _, p in points.iterrows():
        row = best[best["sweep_index"] == p["sweep_index"]].iloc[0]
        assert row["attack"] == "strongest"
        assert p["psnr"] == pytest.approx(row["psnr"]) and p["top1"] == pytest.approx(100 * row["utility_top1"])
    assert list(points["curve"]) == ["none", "prune"]
    config = tmp_path / "sweep.yaml"
    config.write_text(yaml.safe_dump(raw, sort_keys=False))  # the point labels keep the keys in their order
    csv, _, n = finished_points_csv(config, tmp_path / "sweep")
    again = pd.read_csv(csv)
    assert n == 2 and list(again["sweep_index"].unique()) == [0, 1]
    assert sorted(again["psnr"].fillna(-1).round(6)) == sorted(table["psnr"].fillna(-1).round(6))


def test_the_server_optimiser_of_the_utility_section_reaches_the_federation(tmp_path, dataset, one_torch_thread):
    from benchmark.pipeline import build_rows
    from benchmark.utility import defence_utility, utility_run_config

    cfg = _cfg(tmp_path, dataset, rounds=1, curve=[], server_opt="fedadam", server_lr=0.01, server_tau=1e-6,
               server_schedule="cosine")
    row = build_rows(cfg, torch.device("cpu"))[0]
    _, resolved = utility_run_config(cfg, row, str(dataset / "train"))
    assert (resolved.mode, resolved.server_opt, resolved.server_lr, resolved.server_tau, resolved.server_schedule) \
        == ("fedavg", "fedadam", 0.01, 1e-6, "cosine")
    from server.federation import run_federation

    runs = []

    def federate(*args, **kwargs):
        runs.append(run_federation(*args, **kwargs))
        return runs[-1]

    start = {k: v.clone() for k, v in row.model.state_dict().items()}
    out = defence_utility(cfg, row, federate)
    assert (out["utility_server_opt"], out["utility_server_lr"], out["utility_server_schedule"]) == ("fedadam", 0.01, "cosine")
    # Adam's first step moves a weight by server_lr * |d| / (|d| + tau), about server_lr for all
    # but the smallest deltas, where plain FedAvg would move it by the delta itself (lr 0.05 * gradient)
    moved = torch.cat([(runs[0].final_state[k].float() - start[k].float()).abs().flatten()
                       for k in start if start[k].is_floating_point() and k in runs[0].final_state])
    assert 0.009 < float(moved.median()) <= 0.01 + 1e-6
