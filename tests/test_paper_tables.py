"""experiments.paper_tables and experiments.corruptions: bootstrap intervals, the seeded corruption cache, the
command end to end (on generated images, and on the CIFAR-10 validation set where present), bad inputs."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from helpers import make_imagefolder

from experiments.corruptions import cached_corruption, corrupt_images, image_seed, images_key
from experiments.paper_measures import interval
from experiments.paper_tables import main as tables_main
from fedmjp.evaluate import build_eval_loader, evaluate_gammas
from fedmjp.stats import bootstrap_interval, mean_stat
from fedmjp.trainutils import model_from_checkpoint

ROOT = Path(__file__).resolve().parents[1]
DEIT = ROOT / "checkpoints" / "cifar_deit.safetensors"
MJP = ROOT / "checkpoints" / "cifar_deit_mjp.safetensors"


def _images(n: int = 4, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, 32, 32, 3), dtype=np.uint8)


# ------------------------------------------------------------------------------------------------
# bootstrap intervals

def test_interval_contains_point_and_shrinks_with_more_images():
    rng = np.random.default_rng(1)
    small = rng.random(100) < 0.6
    large = rng.random(2500) < 0.6
    a, b = interval(small, n_resamples=999), interval(large, n_resamples=999)
    for iv, values in ((a, small), (b, large)):
        assert iv["value"] == pytest.approx(100 * values.mean())
        assert iv["low"] < iv["value"] < iv["high"]
    # the width falls like 1 / sqrt(n): 25 x the images, about a fifth of the width
    ratio = (b["high"] - b["low"]) / (a["high"] - a["low"])
    assert 0.12 < ratio < 0.3
    # the same seed gives the same interval, another seed another one
    assert interval(small, n_resamples=999) == a
    assert interval(small, n_resamples=999, seed=5) != a


def test_paired_interval_is_tighter_than_unpaired_for_correlated_models():
    """Two models right on mostly the same images: the paired difference is resolved far more
    tightly than the two separate intervals suggest."""
    rng = np.random.default_rng(2)
    base = rng.random(2000) < 0.5
    comp = base.copy()
    flip = rng.choice(2000, 60, replace=False)
    comp[flip[:50]] = True  # 50 images gained, at most 10 lost
    comp[flip[50:]] = False
    diff = interval(comp.astype(float) - base, n_resamples=999)
    assert diff["value"] == pytest.approx(100 * (comp.mean() - base.mean()))
    assert diff["low"] > 0  # resolved
    single = interval(base, n_resamples=999)
    assert diff["high"] - diff["low"] < 0.5 * (single["high"] - single["low"])


def test_ratio_statistic_and_degenerate_data():
    rng = np.random.default_rng(3)
    x = rng.random((500, 4)) < 0.4
    y = x.copy()
    ratio = lambda idx: 100 * (y[idx].sum(-2) / x[idx].sum(-2)).mean(-1)
    point, low, high = bootstrap_interval(ratio, 500, n_resamples=499)
    assert point == low == high == 100.0  # a model against itself
    point, low, high = bootstrap_interval(mean_stat(np.ones(50)), 50, n_resamples=499)
    assert point == low == high == 100.0


# ------------------------------------------------------------------------------------------------
# corruptions: seeds and cache

def test_corruption_seeds_differ_per_image_and_repeat_per_seed():
    img = _images(1)
    twins = np.repeat(img, 2, axis=0)  # the same picture at two indices
    out = corrupt_images(twins, [0, 1], "gaussian_noise", 3, seed=0)
    assert not np.array_equal(out[0], out[1])
    again = corrupt_images(twins, [0, 1], "gaussian_noise", 3, seed=0)
    np.testing.assert_array_equal(out, again)
    other = corrupt_images(twins, [0, 1], "gaussian_noise", 3, seed=1)
    assert not np.array_equal(out, other)
    # one image's result does not depend on the others in the batch
    np.testing.assert_array_equal(corrupt_images(twins[1:], [1], "gaussian_noise", 3, seed=0)[0], out[1])
    assert len({image_seed(0, i, c, s) for i in range(3) for c in ("fog", "snow") for s in (1, 2)}) == 12


@pytest.mark.parametrize("name", ["impulse_noise", "glass_blur"])
def test_corruptions_with_their_own_generator_are_seeded(name):
    """These two draw from a generator of their own (skimage's, numba's), not NumPy's global one."""
    state = np.random.get_state()
    a = corrupt_images(_images(2), [3, 4], name, 2, seed=0)
    b = corrupt_images(_images(2), [3, 4], name, 2, seed=0)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, corrupt_images(_images(2), [5, 6], name, 2, seed=0))
    after = np.random.get_state()
    assert after[0] == state[0] and np.array_equal(after[1], state[1])  # the global generator is left alone


def test_corruption_cache_is_hit_on_the_second_call(tmp_path):
    images = _images(3)
    first, info1 = cached_corruption(images, [0, 1, 2], "motion_blur", 4, seed=0, cache_dir=tmp_path)
    files = sorted(p.name for p in tmp_path.rglob("*") if p.is_file())
    assert files == ["motion_blur-s4-seed0.json", "motion_blur-s4-seed0.npy"]
    assert not info1["cached"] and info1["cpu_s"] >= 0
    npy = next(tmp_path.rglob("*.npy"))
    written = npy.read_bytes()
    second, info2 = cached_corruption(images, [0, 1, 2], "motion_blur", 4, seed=0, cache_dir=tmp_path)
    assert info2 == {"cached": True, "cpu_s": info1["cpu_s"]}
    assert second.tobytes() == first.tobytes() and npy.read_bytes() == written
    assert first.dtype == np.uint8 and first.shape == images.shape
    # another seed, severity or subset is another entry
    cached_corruption(images, [0, 1, 2], "motion_blur", 4, seed=1, cache_dir=tmp_path)
    cached_corruption(images[:2], [0, 1], "motion_blur", 4, seed=0, cache_dir=tmp_path)
    assert len(list(tmp_path.rglob("*.npy"))) == 3
    assert images_key(images, [0, 1, 2]) != images_key(images, [0, 1, 5])
    # a damaged cache file is recomputed, giving the same bytes
    npy.write_bytes(b"not an array")
    third, info3 = cached_corruption(images, [0, 1, 2], "motion_blur", 4, seed=0, cache_dir=tmp_path)
    assert not info3["cached"] and third.tobytes() == first.tobytes()


# ------------------------------------------------------------------------------------------------
# the command

def _common(out: Path) -> list[str]:
    return ["--checkpoints", str(DEIT), str(MJP), "--out", str(out), "--n-resamples", "199", "--threads", "1"]


def test_command_end_to_end_on_generated_images(tmp_path, monkeypatch, no_data_folder):
    monkeypatch.setenv("FEDMJP_CACHE", str(tmp_path / "cache"))
    data = make_imagefolder(tmp_path / "data", classes=3, per_class=6)
    out = tmp_path / "docs" / "tables.md"
    argv = _common(out) + ["--data-path", str(data), "--gammas", "0.27,0.5", "--gamma-sweep", "0.5,1",
                           "--corruption-images", "10", "--corruptions", "fog,pixelate", "--severities", "1,5"]
    assert tables_main(argv) == 0
    text = out.read_text()
    record = json.loads(out.with_suffix(".json").read_text())
    for name in ("tables_gamma_sweep.png", "tables_corruptions.png"):
        assert (out.parent / name).read_bytes()[:4] == b"\x89PNG"
        assert f"]({name})" in text
    tables, corr = record["tables"], record["corruptions"]
    assert tables["images"] == 18 and tables["sweep"] == [0.27, 0.5, 1.0]
    # the figures are evaluate_gammas' on the same images
    model, state = model_from_checkpoint(MJP)
    loader = build_eval_loader(state["config"], str(data), num_workers=0)
    rows = evaluate_gammas(model, loader, [0.27, 0.5, 1.0], seed=0)
    got = tables["models"]["DeiT+MJP"]
    assert got["top1"]["value"] == pytest.approx(rows[0]["top1"])
    assert got["by_gamma"]["0.5"]["consistency"]["value"] == pytest.approx(rows[1]["consistency"])
    assert got["by_gamma"]["1.0"]["diff_norm"]["value"] == pytest.approx(rows[2]["diff_norm"], rel=1e-6)
    assert corr["images"] == 10 and corr["corruptions"] == ["fog", "pixelate"] and corr["severities"] == [1, 5]
    for m in corr["models"].values():
        ce = [m["ce"][c]["value"] for c in ("fog", "pixelate")]
        assert m["mce"]["value"] == pytest.approx(np.mean(ce))
        assert np.mean([100 - v for v in m["top1"]["fog"]]) == pytest.approx(m["ce"]["fog"]["value"])
    assert "| **mCE** |" in text and "| fog |" in text and "224 px" in text
    assert not any(c["cached"] for c in corr["cost"].values())
    # a second run reads the corrupted images from the cache and gives the same figures
    assert tables_main(argv + ["--skip-tables"]) == 0
    again = json.loads(out.with_suffix(".json").read_text())["corruptions"]
    assert all(c["cached"] for c in again["cost"].values())
    assert again["models"] == corr["models"] and again["relative_mce"] == corr["relative_mce"]


def test_same_checkpoint_twice_gives_relative_mce_100(tmp_path, monkeypatch, no_data_folder):
    monkeypatch.setenv("FEDMJP_CACHE", str(tmp_path / "cache"))
    data = make_imagefolder(tmp_path / "data", classes=2, per_class=5)
    out = tmp_path / "same.md"
    argv = ["--checkpoints", str(MJP), str(MJP), "--out", str(out), "--n-resamples", "99", "--data-path", str(data),
            "--skip-tables", "--corruption-images", "6", "--corruptions", "contrast", "--severities", "2"]
    assert tables_main(argv) == 0
    corr = json.loads(out.with_suffix(".json").read_text())["corruptions"]
    # a ratio of equal sums: 100 up to float64 rounding (bootstrap resamples reorder the sums)
    assert corr["relative_mce"] == pytest.approx({"value": 100.0, "low": 100.0, "high": 100.0}, rel=1e-9)
    assert corr["difference"]["mce"]["value"] == 0.0
    assert len(corr["models"]) == 2  # labelled apart by file name


@pytest.mark.slow
def test_command_on_cifar10_validation_subset(team_data, tmp_path):
    archive = team_data.path("cifar10.tar.gz")  # extracted once into the user's cache, as the product does
    out = tmp_path / "cifar.md"
    argv = _common(out) + ["--data-path", str(archive), "--max-images", "64", "--gamma-sweep", "0.27",
                           "--corruption-cache", str(tmp_path / "corruptions"),
                           "--corruption-images", "24", "--corruptions", "glass_blur,impulse_noise",
                           "--severities", "1,3"]
    assert tables_main(argv) == 0
    record = json.loads(out.with_suffix(".json").read_text())
    tables = record["tables"]
    assert tables["images"] == 64 and tables["gammas"] == [0.1, 0.27, 0.5]
    for label in ("DeiT", "DeiT+MJP"):
        top1 = tables["models"][label]["top1"]
        assert top1["low"] <= top1["value"] <= top1["high"]
        assert top1["value"] > 20  # trained: far above the 10 % of chance on CIFAR-10
    text = out.read_text()
    # the command shows the data folder as $FEDMJP_DATA, never where it is on this machine
    assert "--data-path '$FEDMJP_DATA/cifar10.tar.gz'" in text and str(archive.parent) not in text
    assert "| glass_blur |" in text and "| impulse_noise |" in text
    assert len(list((tmp_path / "corruptions").rglob("*.npy"))) == 4  # 2 corruptions x 2 severities


@pytest.fixture(scope="module")
def other_architecture(tmp_path_factory) -> Path:
    """A 1-block, width-48 model trained for 2 epochs (architecture differs from the shipped files)."""
    from helpers import tiny_train_config

    from fedmjp.train import run_training

    root = tmp_path_factory.mktemp("arch")
    data = make_imagefolder(root / "data")
    return run_training(tiny_train_config(data, root / "run"), progress=False).checkpoint


def _error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0], err
    return err[0]


def test_bad_inputs_end_in_one_error_line(tmp_path, capsys, monkeypatch, other_architecture, no_data_folder):
    monkeypatch.setenv("FEDMJP_CACHE", str(tmp_path / "cache"))
    data = make_imagefolder(tmp_path / "data", classes=2, per_class=2)
    base = ["--data-path", str(data), "--out", str(tmp_path / "t.md")]
    assert tables_main(["--checkpoints", str(DEIT), str(tmp_path / "missing.safetensors")] + base) == 2
    assert "missing.safetensors does not exist" in _error_line(capsys)
    assert tables_main(["--checkpoints", str(DEIT), str(other_architecture)] + base) == 2
    line = _error_line(capsys)
    assert "differ in architecture" in line and "depth" in line and "embed_dim" in line
    assert tables_main(["--checkpoints", str(DEIT), str(MJP), "--corruptions", "fgo"] + base) == 2
    assert "unknown corruption 'fgo'" in _error_line(capsys)
    assert tables_main(["--checkpoints", str(DEIT), str(MJP), "--severities", "6"] + base) == 2
    assert "severity 6" in _error_line(capsys)
    assert tables_main(["--checkpoints", str(DEIT), str(MJP), "--data-path", str(tmp_path / "nowhere"),
                        "--out", str(tmp_path / "t.md")]) == 2
    assert "does not exist" in _error_line(capsys)
    text_file = tmp_path / "notes.safetensors"
    text_file.write_text("not a checkpoint")
    assert tables_main(["--checkpoints", str(DEIT), str(text_file)] + base) == 2
    assert "cannot load checkpoint" in _error_line(capsys)
    with pytest.raises(SystemExit) as stop:  # argparse: usage and one error line, exit status 2
        tables_main(["--checkpoints", str(DEIT), str(MJP), "--gammas", "0.27,1.5"] + base)
    assert stop.value.code == 2
    assert "gamma 1.5 is outside [0, 1]" in capsys.readouterr().err
    assert not (tmp_path / "t.md").exists()
