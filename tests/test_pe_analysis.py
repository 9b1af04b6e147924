"""experiments.pe_analysis: the paper's position-embedding analyses (Fig. 1, Tables 6 and 8).

The read-outs are checked on embeddings whose answer is known: a 2-D sin-cos PE encodes the grid
exactly (regression error ~0), random Gaussian vectors encode nothing (error at the chance level, the
mean absolute deviation of a uniform index), a PE of the rows alone gives the row and not the column.
The command runs end to end on the shipped checkpoints, and bad inputs end in one error line.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from experiments import pe_analysis as pa
from fedmjp.factory import create_model
from fedmjp.trainutils import save_checkpoint

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = [ROOT / "checkpoints" / "cifar_deit.safetensors", ROOT / "checkpoints" / "cifar_deit_mjp.safetensors"]
GRID = (8, 8)
ARCH = "mjp_vit_cifar_patch4_32"


def _sincos(dim: int = 192) -> np.ndarray:
    return pa.sincos_pe(GRID, dim).pe


def test_chance_level_is_the_mean_absolute_deviation_of_a_uniform_index():
    assert pa.chance_mae(8) == pytest.approx(2.0)
    assert pa.chance_mae(64) == pytest.approx(16.0)
    assert pa.chance_mae(5) == pytest.approx(1.2)  # |0-2|,|1-2|,...: (2+1+0+1+2)/5


def test_grid_coords_are_row_major():
    coords = pa.grid_coords((3, 4))
    assert coords.shape == (12, 2)
    np.testing.assert_array_equal(coords[:, 0], np.arange(12) // 4)
    np.testing.assert_array_equal(coords[:, 1], np.arange(12) % 4)


def test_sincos_reference_is_read_back_exactly():
    pe = _sincos()
    assert pe.shape == (64, 192)
    reg = pa.regression_mae(pe, GRID)
    for method in ("ridge", "ols"):
        assert reg[method]["2d"] < 0.05, reg[method]
        assert reg[method]["row"] < 0.05 and reg[method]["col"] < 0.05
        assert reg[method]["1d"] < 0.3, reg[method]
    assert reg["chance"]["2d"] == pytest.approx(pa.chance_mae(8), rel=0.05)
    assert reg["chance"]["1d"] == pytest.approx(pa.chance_mae(64), rel=0.05)
    res = pa.analyse(pa.sincos_pe(GRID, 192))
    assert pa.grid_verdict(res) == "encoded"


def test_random_embeddings_score_the_chance_level():
    for seed in range(3):
        pe = np.random.default_rng(seed).standard_normal((64, 192))
        reg = pa.regression_mae(pe, GRID)
        assert reg["ridge"]["2d"] == pytest.approx(pa.chance_mae(8), rel=0.15), (seed, reg["ridge"])
        assert reg["ridge"]["1d"] == pytest.approx(pa.chance_mae(64), rel=0.15), (seed, reg["ridge"])
        assert reg["ridge"]["2d"] / reg["chance"]["2d"] > pa.GRID_ABSENT
        res = pa.PEResult(pa.PESource("random", "", pe, GRID), pa.pca_cumulative(pe), pa.components_for(pe), reg)
        assert pa.grid_verdict(res) == "absent"


def test_row_only_embedding_gives_the_row_not_the_column():
    """Catches a swapped row/column order: vectors that depend on the row alone."""
    rows = pa.grid_coords(GRID)[:, 0]
    row_code = pa.sincos_pe((8, 1), 192).pe  # one vector per row
    pe = row_code[rows] + 0.01 * np.random.default_rng(0).standard_normal((64, 192))
    res = pa.analyse(pa.PESource("rows", "", pe, GRID))
    assert res.reg["ridge"]["row"] < 0.25
    assert res.reg["ridge"]["col"] == pytest.approx(pa.chance_mae(8), rel=0.2)
    assert (pa.grid_verdict(res, "row"), pa.grid_verdict(res, "col")) == ("encoded", "absent")


@pytest.mark.parametrize("pe", [_sincos(), np.random.default_rng(0).standard_normal((64, 192))], ids=["sincos", "random"])
def test_pca_variance_table_is_monotone(pe):
    ks = (1, 2, 3, 5, 10, 20, 63)
    table = pa.pca_cumulative(pe, ks)
    values = [table[k] for k in ks]
    assert all(0 < v <= 1 + 1e-9 for v in values)
    assert values == sorted(values)
    assert values[-1] == pytest.approx(1.0)
    k90 = pa.components_for(pe, 0.9)
    assert pa.pca_cumulative(pe, (k90,))[k90] >= 0.9 - 1e-9
    assert k90 == 1 or pa.pca_cumulative(pe, (k90 - 1,))[k90 - 1] < 0.9


def test_sincos_variance_lies_in_at_most_2_x_7_components():
    """Each sin-cos feature is a function of the row alone or of the column alone: rank <= 2 (8 - 1)."""
    assert pa.pca_cumulative(_sincos(), (14,))[14] == pytest.approx(1.0)
    assert pa.components_for(_sincos(), 0.999) <= 14


def test_fresh_pe_is_the_training_initialisation_and_leaves_the_rng_alone():
    state = torch.random.get_rng_state()
    fresh = pa.fresh_pe(ARCH, {"variant": "plain", "depth": 1}, seed=0)
    assert torch.equal(state, torch.random.get_rng_state())
    torch.manual_seed(0)  # what fedmjp.train does before create_model
    model = create_model(ARCH, variant="plain", depth=1)
    np.testing.assert_allclose(fresh.pe, model.pos_embed[0, 1:].detach().double().numpy())
    assert fresh.pe.shape == (64, 192) and fresh.grid == GRID
    assert 0.015 < fresh.pe.std() < 0.025  # trunc-normal std 0.02


def test_checkpoint_pe_drops_cls_and_excludes_e_unk():
    src, state = pa.load_checkpoint_pe(SHIPPED[1])
    assert src.label == "DeiT+MJP" and src.variant == "mjp" and src.grid == GRID
    pos = state["model"]["pos_embed"]
    assert tuple(pos.shape) == (1, 65, 192)
    np.testing.assert_allclose(src.pe, pos[0, 1:].double().numpy())
    unk = state["model"]["unk_embed"].reshape(-1).double().numpy()
    assert not np.any(np.all(np.isclose(src.pe, unk), axis=1))


@pytest.mark.slow
def test_cli_end_to_end_on_the_shipped_checkpoints(tmp_path, capsys):
    out, fig = tmp_path / "pe.md", tmp_path / "fig" / "pe.png"
    argv = ["--checkpoints", *map(str, SHIPPED), "--out", str(out), "--figure", str(fig), "--date", "2026-11-25"]
    assert pa.main(argv) == 0
    assert "wrote" in capsys.readouterr().out
    text = out.read_text()
    for heading in ("## Table 6", "## Table 8", "## Fig. 1", "## How to read it", "## Does the PE learn the 2-D grid"):
        assert heading in text
    for label in ("| DeiT |", "| DeiT+MJP |", "| fresh |", "| 2-D sin-cos |"):
        assert text.count(label) == 3, label  # models table, Table 6, Table 8
    assert "2026-11-25" in text and "python -m experiments.pe_analysis --checkpoints" in text
    # The table's numbers are the analysis of the file's PE.
    src, _ = pa.load_checkpoint_pe(SHIPPED[1])
    reg = pa.regression_mae(src.pe, src.grid)
    assert f"| DeiT+MJP | {reg['ridge']['1d']:.2f} +- {reg['ridge']['1d_sd']:.2f} | {reg['ridge']['2d']:.2f}" in text
    from PIL import Image

    with Image.open(fig) as im:
        assert im.width > 600 and im.height > 600


def _save_pth(path: Path, **kwargs) -> Path:
    torch.manual_seed(0)
    model = create_model(ARCH, depth=1, **kwargs)
    save_checkpoint(path, {"model": model.state_dict(), "model_name": ARCH, "model_kwargs": {"depth": 1, **kwargs}})
    return path


def _error_line(argv: list[str], capsys) -> str:
    assert pa.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    return err


def test_missing_checkpoint_is_one_error_line(tmp_path, capsys):
    missing = tmp_path / "nope.safetensors"
    err = _error_line(["--checkpoints", str(missing), "--out", str(tmp_path / "x.md")], capsys)
    assert str(missing) in err and "does not exist" in err
    assert not (tmp_path / "x.md").exists()


def test_unreadable_file_is_one_error_line(tmp_path, capsys):
    bad = tmp_path / "garbage.safetensors"
    bad.write_bytes(b"not a safetensors file at all")
    err = _error_line(["--checkpoints", str(bad), "--out", str(tmp_path / "x.md")], capsys)
    assert str(bad) in err and "cannot read" in err


def test_checkpoint_without_learned_pe_is_one_error_line(tmp_path, capsys):
    ckpt = _save_pth(tmp_path / "nope.pth", variant="nope")
    err = _error_line(["--checkpoints", str(ckpt), "--out", str(tmp_path / "x.md")], capsys)
    assert str(ckpt) in err and "no learned position embedding" in err


def test_non_square_grid_is_one_error_line(tmp_path, capsys):
    ckpt = _save_pth(tmp_path / "wide.pth", variant="plain", img_size=(32, 48))
    err = _error_line(["--checkpoints", str(ckpt), "--out", str(tmp_path / "x.md")], capsys)
    assert str(ckpt) in err and "8 x 12" in err and "not square" in err


def test_mixed_architectures_are_one_error_line(tmp_path, capsys):
    small = _save_pth(tmp_path / "small.pth", variant="plain", img_size=16)
    err = _error_line(["--checkpoints", str(SHIPPED[0]), str(small), "--out", str(tmp_path / "x.md")], capsys)
    assert str(small) in err and "one architecture" in err


@pytest.mark.slow
def test_error_exit_of_the_module_has_no_traceback(tmp_path):
    missing = tmp_path / "missing.safetensors"
    proc = subprocess.run([sys.executable, "-m", "experiments.pe_analysis", "--checkpoints", str(missing),
                           "--out", str(tmp_path / "x.md")], capture_output=True, text=True, cwd=ROOT, check=False,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("error: checkpoint") and "Traceback" not in proc.stderr
    assert str(missing) in proc.stderr
