"""Non-finite values are refused or defined where they arise: a checkpoint of NaNs (benchmark and
evaluation), FFT2D of black and near-black images, central DP noise that overflows the global
model (refused with the config, and named by the server's own check). On the tiny runs of
tests/test_hostile_inputs.py; docs/security.md describes the rules tested.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from test_hostile_inputs import cli, one_line_error, small_config


# ------------------------------------------------------------------ checkpoints
def test_a_checkpoint_of_nans_is_refused_naming_the_key(tmp_path: Path, capsys) -> None:
    """An all-NaN checkpoint is a checkpoint error (exit 5) naming a key, for the benchmark, and a
    ValueError for evaluation (fedmjp.evaluate scored such a model 18.75 % top-1 before)."""
    from fedmjp.factory import create_model
    from fedmjp.trainutils import model_from_checkpoint
    from helpers import tiny_config

    row = dict(tiny_config()["models"][0])
    model = create_model(row["arch"], **{"variant": row["variant"], **row["kwargs"]})
    state = {k: torch.full_like(v, float("nan")) if v.is_floating_point() else v
             for k, v in model.state_dict().items()}
    bad = tmp_path / "nan.pth"
    torch.save(state, bad)
    row.pop("april", None)
    assert cli(small_config(tmp_path, models=[dict(row, checkpoint=str(bad))]), tmp_path / "out") == 5
    one_line_error(capsys.readouterr().err, str(bad), "NaN", "cls_token")
    train_ckpt = tmp_path / "last.pth"
    torch.save({"model": state, "model_name": row["arch"], "model_kwargs": {"variant": row["variant"],
                                                                          **row["kwargs"]}}, train_ckpt)
    with pytest.raises(ValueError, match="NaN or infinite"):
        model_from_checkpoint(train_ckpt)


# ------------------------------------------------------------------ metrics and the server's noise
def test_fft2d_of_black_and_near_black_images_is_defined_by_the_image_scale() -> None:
    """FFT2D's zero-energy rule holds for energy below half an 8-bit step (relative to the [0, 1]
    scale), not for exact zero only: an all-black image and a 1e-6-bright one (PSNR 120 dB) are
    identical for FFT2D and FFT2D-H, through the metric functions and through score_all; a real
    image against either is orthogonal."""
    import metrics as M

    black, dim, real = torch.zeros(1, 3, 16, 16), torch.full((1, 3, 16, 16), 1e-6), torch.rand(1, 3, 16, 16)
    for rec in (black, dim):
        assert M.fft2d(rec, black).item() == 0.0
        assert M.fft2d_hermitian(rec, black).item() == 1.0
        scores = M.score_all(rec, black, ("fft2d", "fft2d_hermitian", "psnr"))
        assert scores["fft2d"].item() == 0.0 and scores["fft2d_hermitian"].item() == 1.0
        assert M.fft2d(real, rec).item() == 1.0 and M.fft2d_hermitian(real, rec).item() == 0.0
    assert M.score_all(dim, black, ("psnr",))["psnr"].item() == pytest.approx(120.0)
    assert M.fft2d(real * 0.01 + 0.01, black).item() == 1.0  # dark but above the level: not black
    assert M.fft2d(real * 0.01 + 0.01, real * 0.01 + 0.01).item() == pytest.approx(0.0, abs=1e-12)


def test_central_dp_noise_that_overflows_the_global_model_is_refused_and_named_where_it_arises(
        tmp_path: Path, capsys) -> None:
    """sigma 1e308 is refused with the config (sigma x clip beyond what a float32 model holds); the
    server's own check after noising (defence in depth, e.g. for a plug-in strategy) names the
    defence, its sigma and the first non-finite array."""
    import numpy as np
    from flwr.app import Array, ArrayRecord

    from server.central_dp import TappedCentralDp

    assert cli(small_config(tmp_path), tmp_path / "out", "--set", "defence={name: central_dp, sigma: 1e308}") == 3
    one_line_error(capsys.readouterr().err, "central_dp", "sigma x clip")
    assert not (tmp_path / "out").exists()

    server = object.__new__(TappedCentralDp)  # only the noising hook and its attributes
    server.noise_multiplier, server.clipping_norm, server.num_sampled_clients = 1e308, 1.0, 2
    server.seed, server.server_round, server.global_fault = 0, 1, None
    arrays = ArrayRecord({"cls_token": Array(np.zeros((1, 4), np.float32))})
    server._add_noise_to_aggregated_arrays(arrays)
    assert server.global_fault is not None
    assert "sigma=1e+308" in server.global_fault and "cls_token" in server.global_fault
