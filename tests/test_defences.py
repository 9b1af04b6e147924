"""Defences: each transform's arithmetic, DP-SGD and its accountant, input mixing, the client path
through Flower's in-process engine (local DP against APRIL, central DP against the tap)."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd
import pytest
import torch
from helpers import psnr as _psnr
from pydantic import ValidationError

import attacks
import defences as D
import fedmjp  # noqa: F401  (registers the mjp_* models)
from clients import partition, runconfig, update
from clients.defence import defended_local_update
from defences.spec import LocalDp
from server.federation import run_federation

# 32 px design-A ViT (T = 65 <= D = 192): APRIL's closed form is exact on float64 gradients.
APRIL = {"model-kwargs": {"depth": 2}, "model-april": "trained", "model-variant": "plain", "num-images": 4,
         "image-size": 32, "num-server-rounds": 1, "precision": "float64", "server-eval": False, "setting": "a"}


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _big_update(seed: int = 0, n: int = 400_000) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"a.weight": torch.randn(n // 2, generator=g).view(-1, 100), "b.bias": 3 * torch.randn(n // 2, generator=g)}


# ------------------------------------------------------------------------------------- spec
def test_spec_defaults_and_errors_name_the_valid_choices():
    assert D.validate_defence(None).as_dict() == {"name": "none"}
    spec = D.validate_defence({"name": "local_dp", "sigma": 0.5})
    assert spec.as_dict() == {"name": "local_dp", "clip": 1.0, "sigma": 0.5, "noise": "gaussian"}
    # typed and immutable past the boundary: attributes, the built-in's own class, no assignment
    assert isinstance(spec, LocalDp) and (spec.clip, spec.sigma, spec.noise) == (1.0, 0.5, "gaussian")
    assert spec.label == "local_dp(clip=1.0, sigma=0.5, noise=gaussian)"
    assert D.validate_defence(spec) is spec and D.validate_defence("prune").keep == 0.1
    with pytest.raises(ValidationError, match="frozen"):
        spec.sigma = 1.0
    with pytest.raises(ValueError, match="local_dp.*prune.*quantize"):
        D.validate_defence({"name": "dp"})
    with pytest.raises(ValueError, match="valid: name, clip, sigma, noise"):
        D.validate_defence({"name": "local_dp", "sgima": 0.1})
    for bad in ({"name": "prune", "keep": 0}, {"name": "quantize", "bits": 0}, {"name": "local_dp", "clip": -1},
                {"name": "local_dp", "noise": "uniform"}, {"name": "mixup", "k": 1.5}, {"name": "dp_sgd", "delta": 0}):
        with pytest.raises(ValueError):
            D.validate_defence(bad)
    with pytest.raises(ValueError, match="defence"):
        runconfig.resolve_config({"defence": '{"name": "nope"}'})
    assert runconfig.resolve_config({"defence": {"name": "fedavg", "steps": 3}}).local_steps == 3


# ------------------------------------------------------------------------------------- transforms
def test_clip_scales_the_whole_update_to_the_bound():
    u = _big_update()
    norm = D.update_norm(u)
    clipped = D.clip_update(u, 1.0)
    assert D.update_norm(clipped) == pytest.approx(1.0, rel=1e-5)
    assert D.cosine_similarity(clipped, u) == pytest.approx(1.0, abs=1e-6)
    small = D.clip_update(u, 10 * norm)  # under the bound: unchanged
    assert all(torch.equal(small[k], u[k]) for k in u)


@pytest.mark.parametrize("noise", ["gaussian", "laplace"])
def test_noise_scale_matches_sigma_times_clip(noise):
    zero = {"w": torch.zeros(1_000_000, dtype=torch.float64)}
    clip, sigma = 2.0, 0.3
    out = D.local_dp(zero, clip, sigma, torch.Generator().manual_seed(1), noise)["w"]
    expected = sigma * clip * (1.0 if noise == "gaussian" else math.sqrt(2.0))
    s = float(out.std())
    # standard error of the sample std: sd((x - m)^2) / (2 s sqrt(n)), estimated from the sample
    se = float(((out - out.mean()) ** 2).std()) / (2 * s * math.sqrt(out.numel()))
    assert abs(s - expected) < 5 * se
    assert abs(float(out.mean())) < 5 * s / math.sqrt(out.numel())


def test_prune_keeps_the_largest_share():
    u = _big_update()
    out = D.prune_update(u, 0.05)
    n = sum(v.numel() for v in u.values())
    kept = sum(int((v != 0).sum()) for v in out.values())
    assert kept == math.ceil(0.05 * n)
    smallest_kept = min(float(v[v != 0].abs().min()) for v in out.values() if (v != 0).any())
    largest_dropped = max(float(u[k][out[k] == 0].abs().max()) for k in u)
    assert smallest_kept >= largest_dropped


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_quantize_uses_at_most_2_to_the_k_levels(bits):
    u = _big_update(n=20_000)
    out = D.quantize_update(u, bits)
    for k, v in out.items():
        levels = torch.unique(v)
        # <= 2^k levels; all but possibly the outermost level on the side without the max are hit
        assert 2 ** bits - 1 <= len(levels) <= 2 ** bits
        if bits == 1:
            assert torch.allclose(v.abs(), u[k].abs().mean().expand_as(v))
        else:  # nearest of 2^k levels on [-m, m]: error <= half a step
            m = float(u[k].abs().max())
            grid = torch.linspace(-m, m, 2 ** bits)
            assert bool((levels[:, None] - grid[None]).abs().min(dim=1).values.max() < 1e-5 * m)
            assert float((v - u[k]).abs().max()) <= m / (2 ** bits - 1) + 1e-6


def test_stochastic_quantize_is_unbiased():
    x = torch.linspace(-1, 1, 101, dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    draws = torch.stack([D.quantize_tensor(x, 2, stochastic=True, generator=g) for _ in range(4000)])
    assert len(torch.unique(draws)) <= 4
    se = draws.std(dim=0) / math.sqrt(len(draws))
    assert bool(((draws.mean(dim=0) - x).abs() <= 5 * se + 1e-12).all())


def test_mixup_is_a_convex_combination_with_mixed_labels():
    g = torch.Generator().manual_seed(0)
    pool, pool_y = torch.rand(6, 3, 8, 8, generator=g), torch.tensor([0, 1, 2, 3, 4, 5])
    x, y = pool[:2], pool_y[:2]
    m = D.mix_batch(x, y, pool, pool_y, 10, k=3, alpha=1.0, sign_flip=False, generator=g)
    assert torch.allclose(m.weights.sum(1), torch.ones(2, dtype=torch.float64))
    assert torch.allclose(m.targets.sum(1), torch.ones(2))
    assert float(m.images.min()) >= 0 and float(m.images.max()) <= 1
    assert float((m.images - x).abs().max()) > 1e-3  # the client sends something else than x
    flipped = D.mix_batch(x, y, pool, pool_y, 10, k=3, alpha=1.0, sign_flip=True, generator=g)
    assert float(flipped.images.min()) < 0


# ------------------------------------------------------------------------------------- DP-SGD
def test_rdp_accountant_reproduces_abadi_et_al_mnist():
    # Abadi et al. 2016 / TF Privacy's MNIST tutorial: q = 256/60000, sigma = 1.1, 60 epochs,
    # delta 1e-5 -> eps 2.92 with the classical RDP conversion; Opacus' conversion (Balle et al.
    # 2020) is tighter: 2.60. A wrong q, step count or delta lands far outside this band.
    eps = D.dp_sgd_epsilon(256 / 60000, 1.1, 60 * 60000 // 256, 1e-5)
    assert 2.5 <= eps <= 2.92
    assert D.dp_sgd_epsilon(256 / 60000, 1.1, 30 * 60000 // 256, 1e-5) < eps  # fewer steps, less spent
    assert D.dp_sgd_epsilon(0.01, 2.0, 1000, 1e-5) < D.dp_sgd_epsilon(0.01, 1.0, 1000, 1e-5)
    assert D.dp_sgd_epsilon(1.0, 0.0, 1, 1e-5) == math.inf


def test_private_gradient_clips_each_example():
    torch.manual_seed(0)
    lin = torch.nn.Linear(5, 3).double()
    x, y = torch.randn(4, 5, dtype=torch.float64) * 10, torch.tensor([0, 1, 2, 0])
    loss_i = lambda i: torch.nn.functional.cross_entropy(lin(x[i:i + 1]), y[i:i + 1])  # noqa: E731
    params = list(lin.parameters())
    g = torch.Generator().manual_seed(0)
    exact, _ = D.private_gradient(loss_i, params, 4, clip=1e9, sigma=0.0, generator=g)
    ref = torch.autograd.grad(torch.nn.functional.cross_entropy(lin(x), y), params)
    assert all(torch.allclose(a, b) for a, b in zip(exact, ref))
    clipped, _ = D.private_gradient(loss_i, params, 4, clip=0.01, sigma=0.0, generator=g)
    assert math.sqrt(sum(float(c.pow(2).sum()) for c in clipped)) <= 0.01 + 1e-12


# ------------------------------------------------------------------------------------- client path
def test_client_reports_cosine_and_epsilon():
    cfg = {**APRIL, "precision": "float32", "defence": {"name": "prune", "keep": 0.1}}
    state = update.load_global_model(runconfig.resolve_config(cfg)).state_dict()
    sent, _, _, info = defended_local_update(runconfig.resolve_config(cfg), state, 0, 1, 2, torch.device("cpu"))
    n = sum(v.numel() for v in sent.values())
    assert sum(int((v != 0).sum()) for v in sent.values()) <= math.ceil(0.1 * n)
    assert 0.3 < info["defence-cos"] < 1.0
    dp_cfg = {**cfg, "defence": {"name": "dp_sgd", "clip": 0.5, "sigma": 1.0}}
    sent, _, _, info = defended_local_update(runconfig.resolve_config(dp_cfg), state, 0, 1, 2, torch.device("cpu"))
    assert info["dp-epsilon"] == pytest.approx(D.dp_sgd_epsilon(0.5, 1.0, 1, 1e-5))  # 1 of 2 owned images
    assert info["defence-cos"] < 0.5  # 1 image, sigma 1: noise dominates


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks that a CUDA request fails on a CPU-only machine")
def test_defended_update_reads_the_device_key():
    """The ClientApp passes no device: the run config's ``device`` decides, as in local_update."""
    cfg = {**APRIL, "precision": "float32", "defence": {"name": "prune", "keep": 0.5}}
    state = update.load_global_model(runconfig.resolve_config(cfg)).state_dict()
    sent, _, _, _ = defended_local_update(runconfig.resolve_config({**cfg, "device": "cpu"}), state, 0, 1, 2)
    assert all(v.device.type == "cpu" for v in sent.values())
    with pytest.raises(ValueError, match="cuda"):
        # 'auto' would have run on the CPU
        defended_local_update(runconfig.resolve_config({**cfg, "device": "cuda"}), state, 0, 1, 2)


def test_local_dp_defeats_april_on_a_real_image():
    """Design-A model, float64 client, embedded real photographs: > 100 dB clean, < 20 dB with a
    strong local DP, through the ClientApp and the server's tap (in-process engine)."""
    attack = attacks.create_attack("april_analytic")
    out = {}
    for name, defence in (("clean", {"name": "none"}), ("dp", {"name": "local_dp", "clip": 1.0, "sigma": 0.1})):
        taps = []
        cfg = runconfig.resolve_config({**APRIL, "defence": json.dumps(defence)})
        run_federation(cfg, tap=taps.append, engine="inprocess", num_supernodes=2)
        u = taps[0]
        model = update.load_global_model(cfg).double()
        batch = partition.private_batch(cfg, u.partition_id, 1, 2)
        md = {"mean": torch.tensor(u.metadata["input-mean"]), "std": torch.tensor(u.metadata["input-std"])}
        res = attack.reconstruct(model, {k: v.double() for k, v in u.arrays.items()}, md)
        out[name] = _psnr(res.images, batch.images)
        out[name + "-cos"] = u.metrics["defence-cos"]
    assert out["clean"] > 100 and out["clean-cos"] == 1.0
    assert out["dp"] < 20 and out["dp-cos"] < 0.5


def test_central_dp_leaves_the_tapped_update_unchanged():
    cfg = {**APRIL, "precision": "float32", "num-server-rounds": 1}
    runs = {}
    for name, defence in (("none", {"name": "none"}), ("central", {"name": "central_dp", "clip": 0.01, "sigma": 1.0})):
        taps = []
        result = run_federation(runconfig.resolve_config({**cfg, "defence": json.dumps(defence)}), tap=taps.append,
                                engine="inprocess", num_supernodes=2)
        runs[name] = (sorted(taps, key=lambda u: u.partition_id), result.final_state)
    (taps_a, final_a), (taps_b, final_b) = runs["none"], runs["central"]
    assert len(taps_a) == len(taps_b) == 2
    for a, b in zip(taps_a, taps_b):
        assert a.arrays.keys() == b.arrays.keys()
        assert all(torch.equal(a.arrays[k], b.arrays[k]) for k in a.arrays)  # the server saw the clean update
    # ... while Flower's wrapper did clip and noise what it aggregated (the global model differs)
    diff = max(float((final_a[k] - final_b[k]).abs().max()) for k in final_a)
    assert diff > 1e-3


# ------------------------------------------------------------------------------------- benchmark config + sweep
def _bench_cfg(tmp_path, **top) -> dict:
    """One design-A MJP row (surgery), 4 embedded images, 2 clients x 1 round, float64, no LPIPS."""
    from benchmark import config as C
    from benchmark.validation import validate

    cfg = C.conform({
        "name": "tiny", "device": "cpu", "settings": ["c"], "gamma": 0.27,
        "data": {"source": "embedded", "image_size": 32, "num_images": 4, "num_classes": 10},
        "federation": {"engine": "inprocess", "rounds": 1, "clients": 2, "precision": "float64", "lr": 0.01},
        "models": [{"name": "DeiT+MJP", "arch": "mjp_vit_cifar_patch4_32", "variant": "mjp",
                    "kwargs": {"depth": 2}, "april": "surgery"}],
        "attack": {"name": "april_analytic"}, "metrics": {"lpips": False}, "report": {"grid_images": 0},
        **top})
    return validate(cfg)


def test_benchmark_defence_key_row_override_and_errors(tmp_path):
    from benchmark import cli
    from benchmark.entries import model_spec
    from benchmark.errors import ConfigError
    from benchmark.inputs import ModelRow, client_run_config
    from benchmark.validation import validate

    args = cli.build_parser().parse_args(["--set", "defence={name: local_dp, clip: 1.0, sigma: 0.5}",
                                          "--set", "defence.clip=2.0", "--output", str(tmp_path / "out")])
    cfg = cli.resolve(args)
    assert cfg.defence.as_dict() == {"name": "local_dp", "clip": 2.0, "sigma": 0.5, "noise": "gaussian"}
    cfg.models[0].defence = D.validate_defence({"name": "prune", "keep": 0.2})  # a row's own replaces the top one
    cfg = validate(cfg)
    row = ModelRow(0, cfg.models[0].name, "x", model_spec(cfg, 0), None, False)
    assert client_run_config(cfg, row, "shuffled").defence.as_dict() == {"name": "prune", "keep": 0.2}
    row1 = ModelRow(1, cfg.models[1].name, "x", model_spec(cfg, 1), None, False)
    assert client_run_config(cfg, row1, "shuffled").defence.name == "local_dp"
    for bad, pattern in (("defence={name: dpp}", "valid: none, local_dp"), ("defence.sgima=1", "valid: name, clip"),
                         ("sweep={defence.sigma: [0, -1]}", "sweep point defence.sigma=-1")):
        with pytest.raises(ConfigError, match=pattern):
            cli.resolve(cli.build_parser().parse_args(["--set", "defence={name: local_dp}", "--set", bad,
                                                       "--output", str(tmp_path / "bad")]))
    assert not (tmp_path / "bad").exists() and not (tmp_path / "out").exists()


def test_sweep_writes_one_row_per_grid_point_and_the_plots(tmp_path):
    from benchmark.sweep import run_sweep

    cfg = _bench_cfg(tmp_path, defence={"name": "local_dp", "clip": 1.0},
                     sweep={"defence.sigma": [0.0, 0.1], "gamma": [0.0, 0.5]})
    out = run_sweep(cfg, str(tmp_path / "sweep"), progress=False)
    table = pd.read_csv(out["csv"])
    assert len(table) == 4 and list(table["sweep_index"]) == [0, 1, 2, 3]
    assert set(table["sweep.defence.sigma"]) == {0.0, 0.1} and set(table["sweep.gamma"]) == {0.0, 0.5}
    assert (table["n"] == 2).all()  # 2 clients x 1 round x batch 1 per point
    rows = [json.loads(line) for line in open(Path(out["folder"]) / "results.jsonl")]
    assert len(rows) == 8 and all("sweep" in r and "defence_cos" in r for r in rows)
    noisy = table[table["sweep.defence.sigma"] == 0.1]
    assert (noisy["defence_cos"] < 0.5).all() and (table[table["sweep.defence.sigma"] == 0.0]["defence_cos"] > 0.999).all()
    for name in ("privacy_utility.png", "sweep_psnr.png", "sweep_defence_cos.png"):
        assert (Path(out["folder"]) / name).stat().st_size > 1000


def test_sweep_point_list_keeps_values_typed_and_checks_each_point(tmp_path):
    from benchmark.errors import ConfigError
    from benchmark.sweep_points import grid_points
    from benchmark.validation import point_config

    points = [{"defence": {"name": "local_dp", "sigma": 1e-6}}, {"gamma": 0.5}]
    cfg = _bench_cfg(tmp_path, sweep=points)
    assert grid_points(cfg) == points
    first = point_config(cfg, points[0])
    assert first.defence.sigma == 1e-6 and first.sweep == {}
    assert point_config(cfg, points[1]).gamma == 0.5
    with pytest.raises(ConfigError, match="sweep point gamma=2"):
        _bench_cfg(tmp_path, sweep=[{"gamma": 2}])
    with pytest.raises(ConfigError, match="unknown config key 'gama'"):
        _bench_cfg(tmp_path, sweep=[{"gama": 0.1}])


def test_utility_measures_held_out_top1_after_fedavg(tmp_path):
    from benchmark.pipeline import build_rows
    from benchmark.utility import defence_utility

    cfg = _bench_cfg(tmp_path, utility={"rounds": 1, "source": "embedded", "num_train": 4, "num_eval": 6,
                                        "clients": 2, "local_steps": 1, "batch_size": 2, "lr": 0.0})
    row = build_rows(cfg, torch.device("cpu"))[0]
    frozen = defence_utility(cfg, row)  # lr 0 and no defence: the global model does not move
    assert frozen["utility_start"] == "fresh" and frozen["utility_num_eval"] == 6
    assert frozen["utility_top1"] == frozen["utility_top1_start"]
    cfg.utility.num_train = 1000
    with pytest.raises(ValueError, match="none left"):
        defence_utility(cfg, row)


def test_utility_trains_and_scores_the_model_as_deployed_not_the_attackers_surgery_copy(tmp_path, monkeypatch):
    """``april: surgery`` is the attacker's view: a utility federation whose clients trained (and
    whose score read) the design-A copy would measure a model nobody deploys (on a trained
    checkpoint that copy is near chance)."""
    from benchmark import utility
    from benchmark.pipeline import build_rows
    from fedmjp import evaluate
    from fedmjp.models import is_april_model
    from server.federation import run_federation

    cfg = _bench_cfg(tmp_path, utility={"rounds": 1, "source": "embedded", "num_train": 4, "num_eval": 4,
                                        "clients": 2, "local_steps": 1, "batch_size": 2, "lr": 0.01})
    row = build_rows(cfg, torch.device("cpu"))[0]
    assert is_april_model(row.model) and row.acc_model is not None and not is_april_model(row.acc_model)
    seen = {"scored": [], "april": []}
    real_top1 = evaluate.loss_and_top1

    def top1(model, *args, **kwargs):
        seen["scored"].append(is_april_model(model))
        return real_top1(model, *args, **kwargs)

    def federate(resolved, **kwargs):
        seen["april"].append(resolved.model_april)
        return run_federation(resolved, **kwargs)

    monkeypatch.setattr(evaluate, "loss_and_top1", top1)
    out = utility.defence_utility(cfg, row, federate=federate)
    assert seen == {"scored": [False, False], "april": [""]}
    assert 0.0 <= out["utility_top1"] <= 1.0


def test_central_dp_noise_is_seeded_by_run_seed_and_round():
    """Flower draws central DP's noise from NumPy's unseeded global state; the tapped wrapper draws it
    from (seed, round): the same seed gives the same noised global weights (a resumed run reproduces
    them), another seed other ones, and the noise still has Flower's std."""
    import numpy as np
    from flwr.supercore.differential_privacy import compute_stdv

    cfg = {**APRIL, "precision": "float32", "num-server-rounds": 2,
           "defence": json.dumps({"name": "central_dp", "clip": 0.01, "sigma": 1.0})}
    finals = []
    for i, seed in enumerate((0, 0, 1)):
        np.random.seed(100 + i)  # NumPy's global state (Flower's source) differs between the runs
        result = run_federation(runconfig.resolve_config({**cfg, "seed": seed}), engine="inprocess", num_supernodes=2)
        finals.append(result.final_state)
    same, other = finals[0], finals[2]
    assert all(torch.equal(same[k], finals[1][k]) for k in same)
    assert any(not torch.equal(same[k], other[k]) for k in same)
    # 2 rounds of noise of Flower's std on top of the (clipped, tiny) mean update
    clean = run_federation(runconfig.resolve_config({**cfg, "defence": json.dumps({"name": "none"}), "lr": 0.0}),
                           engine="inprocess", num_supernodes=2).final_state
    std = compute_stdv(1.0, 0.01, 2)
    noise = torch.cat([(same[k] - clean[k]).flatten() for k in same if same[k].is_floating_point()])
    assert 0.9 < float(noise.std()) / (std * 2 ** 0.5) < 1.1


def test_each_defence_states_what_it_does_to_an_update():
    """One observation model per built-in defence (defences/spec.py), read by april_robust and
    ig_closed_start's defence model; the noise in gradient units follows the update type."""
    from attacks.api.base import AttackMetadata
    from defences.spec import SCHEMAS

    clean = {name for name, schema in SCHEMAS.items() if not schema().observation().perturbs}
    assert clean == {"none", "central_dp", "mixup", "fedavg"}
    dp = D.validate_defence({"name": "local_dp", "clip": 2.0, "sigma": 0.01}).observation()
    assert (dp.noise, dp.noise_scale, dp.clip, dp.per_example) == ("gaussian", 0.02, 2.0, False)
    sgd = D.validate_defence({"name": "dp_sgd", "clip": 1.0, "sigma": 0.5}).observation()
    meta = AttackMetadata(4, (3, 8, 8), torch.zeros(3), torch.ones(3), None, "delta", lr=0.1, local_steps=4)
    assert meta.defence_noise(dp) == pytest.approx((0.02 / 0.4, 2.0 / 0.4))  # added to the delta: / (lr steps)
    assert meta.defence_noise(sgd) == pytest.approx((0.5 / 4 / 2, 1.0))  # per step's mean gradient, / sqrt(steps)
    q = D.validate_defence({"name": "quantize", "bits": 4, "stochastic": True}).observation()
    assert (q.quant_bits, q.quant_stochastic, q.noise) == (4, True, None)
    assert D.validate_defence({"name": "prune", "keep": 0.2}).observation().prune_keep == 0.2
