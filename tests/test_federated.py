"""Federated rounds: ClientApp/ServerApp through the in-process engine, one run through Flower's
simulation engine (Ray), fault handling, the honest-but-curious tap and the ground-truth path."""
from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
import torch

import fedmjp  # noqa: F401  (registers the mjp_* models)
from clients import partition, runconfig, update
from fedmjp.factory import model_input
from fedmjp.jigsaw import unshuffle_images
from server import run as server_run
from server.federation import LocalGrid, run_federation
from server.rounds import ServerOutcome
from server.tap import load_tapped_updates

ROOT = Path(__file__).resolve().parents[1]
TINY = {"model-kwargs": {"depth": 2}, "num-images": 8, "image-size": 32, "num-server-rounds": 2}


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _weighted_mean(updates, name):
    total = sum(u.num_examples for u in updates)
    return sum(u.arrays[name].double() * u.num_examples for u in updates) / total


@pytest.fixture(scope="module")
def fedsgd_run(tmp_path_factory):
    """2 clients x 2 rounds, FedSGD, setting c, tapped in memory and to a folder."""
    out = tmp_path_factory.mktemp("fl")
    taps = []
    cfg = runconfig.resolve_config({**TINY, "setting": "c", "gamma": 0.27, "lr": 0.05, "out-dir": str(out),
                                    "server-eval": True})
    result = run_federation(cfg, tap=taps.append, engine="inprocess", num_supernodes=2)
    return result, taps, out


def test_defaults_mirror_pyproject():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]
    assert config["config"] == runconfig.DEFAULTS
    assert config["components"] == {"serverapp": "server.server_app:app", "clientapp": "clients.client_app:app"}


def test_tap_sees_every_update_with_round_and_node(fedsgd_run):
    result, taps, _ = fedsgd_run
    assert len(taps) == 4
    assert [u.server_round for u in taps] == [1, 1, 2, 2]
    node_ids = LocalGrid(None, 2, {}, seed=result.run_config.seed).node_ids
    for r in (1, 2):
        this_round = [u for u in taps if u.server_round == r]
        assert sorted(u.node_id for u in this_round) == sorted(node_ids)
        assert sorted(u.partition_id for u in this_round) == [0, 1]
    assert result.node_partitions == {u.node_id: u.partition_id for u in taps}
    assert all(u.kind == "gradients" and u.num_examples == 1 for u in taps)
    meta = taps[0].metadata
    assert meta["setting"] == "c" and meta["batch-size"] == 1 and len(meta["input-mean"]) == 3
    assert result.ok and result.failures == [] and [h["replies"] for h in result.history] == [2, 2]
    assert "eval-acc" in result.history[-1]


def test_fedsgd_step_is_minus_lr_times_mean_gradient(fedsgd_run):
    result, taps, _ = fedsgd_run
    lr = result.run_config.lr
    round1 = [u for u in taps if u.server_round == 1]
    round2 = [u for u in taps if u.server_round == 2]
    expected_after_1 = {k: v - lr * _weighted_mean(round1, k).float() if k in round1[0].arrays else v
                        for k, v in round1[0].global_state.items()}
    for k, v in expected_after_1.items():
        torch.testing.assert_close(round2[0].global_state[k], v, rtol=0, atol=1e-6)
    for k, v in round2[0].global_state.items():
        want = v - lr * _weighted_mean(round2, k).float() if k in round2[0].arrays else v
        torch.testing.assert_close(result.final_state[k], want, rtol=0, atol=1e-6)
    assert any((result.final_state[k] != round1[0].global_state[k]).any() for k in round1[0].arrays)


def test_tapped_update_matches_the_ground_truth_path(fedsgd_run):
    """The benchmark rebuilds x / x~ with private_batch; the update the server saw came from them."""
    result, taps, _ = fedsgd_run
    for u in taps:
        batch = partition.private_batch(result.run_config, u.partition_id, u.server_round)
        assert batch.plan is not None and batch.shuffled is not None
        model = update.load_global_model(result.run_config, u.global_state)
        grads, _ = update.fedsgd_gradients(model, batch)
        for name, g in grads.items():
            torch.testing.assert_close(u.arrays[name], g, rtol=1e-5, atol=1e-7)  # float32 noise floor
        # The gradient was computed on x~, not on x.
        plain = partition.PrivateBatch(batch.images, batch.labels, batch.image_ids, batch.indices, None, None, 0.0)
        grads_x, _ = update.fedsgd_gradients(model, plain)
        assert not torch.equal(grads_x["patch_embed.proj.weight"], u.arrays["patch_embed.proj.weight"])


def test_folder_tap_and_outcome_roundtrip(fedsgd_run):
    result, taps, out = fedsgd_run
    stored = load_tapped_updates(out / "updates")
    assert [(u.server_round, u.node_id, u.partition_id) for u in stored] == \
        [(u.server_round, u.node_id, u.partition_id) for u in sorted(taps, key=lambda t: (t.server_round, t.node_id))]
    for a, b in zip(stored, sorted(taps, key=lambda t: (t.server_round, t.node_id))):
        assert a.arrays.keys() == b.arrays.keys()
        assert all(torch.equal(a.arrays[k], b.arrays[k]) for k in a.arrays)
        assert torch.equal(a.global_state["pos_embed"], b.global_state["pos_embed"])
    outcome = ServerOutcome.load(out)
    assert outcome.ok and len(outcome.history) == 2
    assert all(torch.equal(outcome.final_state[k], v) for k, v in result.final_state.items())
    assert server_run.main(["--check", str(out)]) == 0


@pytest.mark.parametrize("setting,gamma", [("a", 0.27), ("b", 0.27), ("c", 0.27), ("c", 0.5)])
def test_settings_shuffle_with_configured_gamma(setting, gamma):
    cfg = runconfig.resolve_config({**TINY, "setting": setting, "gamma": gamma, "batch-size": 2, "per-sample": True})
    N = 64  # 32 px / patch 4
    for r in (1, 2, 3):
        batch = partition.private_batch(cfg, 1, r)
        assert batch.images.shape == (2, 3, 32, 32) and len(batch.image_ids) == 2
        if setting == "a":
            assert batch.plan is None and batch.shuffled is None and batch.gamma == 0.0
            continue
        target = int(N * gamma)
        counts = batch.plan.mask.sum(dim=1)
        # Block-wise selection never overshoots and may fall a little short (BEiT generator).
        assert (counts <= target).all() and (counts >= 0.75 * target).all(), counts
        assert batch.gamma == gamma
        torch.testing.assert_close(unshuffle_images(batch.shuffled, batch.plan, 4), batch.images)
        assert not torch.equal(batch.shuffled, batch.images)
    again = partition.private_batch(cfg, 1, 3)
    assert again.image_ids == batch.image_ids
    if setting != "a":
        assert torch.equal(again.plan.perm, batch.plan.perm)


@pytest.mark.parametrize("partitioner", ["iid", "dirichlet"])
def test_partitions_are_disjoint_cover_and_seeded(partitioner):
    # Dirichlet by label needs several images per class: 8 images in 2 classes.
    cfg = runconfig.resolve_config({**TINY, "partitioner": partitioner, "num-partitions": 3, "num-classes": 2})
    parts = [partition.partition_indices(cfg, p) for p in range(3)]
    flat = sorted(i for p in parts for i in p)
    assert flat == list(range(8)) and all(parts)
    assert parts == [partition.partition_indices(cfg, p) for p in range(3)]
    walked = [partition.private_batch(cfg, 0, r).indices.item() for r in range(1, len(parts[0]) + 1)]
    assert sorted(walked) == parts[0]  # rounds walk through the partition before repeating


def test_fedsgd_gradients_match_attacks_compute_update():
    attacks = pytest.importorskip("attacks")
    cfg = runconfig.resolve_config({**TINY, "setting": "b"})
    batch = partition.private_batch(cfg, 0, 1)
    model = update.load_global_model(cfg)
    grads, _ = update.fedsgd_gradients(model, batch)
    x = model_input(model, batch.shuffled)
    ref = attacks.compute_update(model, x, batch.labels, unk_mask=batch.plan.mask)
    for name, g in grads.items():
        torch.testing.assert_close(g, ref[name].cpu(), rtol=1e-5, atol=1e-7)


def test_fedavg_round_adds_mean_delta():
    taps = []
    cfg = runconfig.resolve_config({**TINY, "mode": "fedavg", "local-steps": 2, "lr": 0.05, "num-server-rounds": 1,
                                    "server-eval": False})
    result = run_federation(cfg, tap=taps.append, engine="inprocess", num_supernodes=2)
    assert len(taps) == 2 and all(u.kind == "delta" for u in taps)
    for k, v in taps[0].global_state.items():
        want = v + _weighted_mean(taps, k).float() if k in taps[0].arrays else v
        torch.testing.assert_close(result.final_state[k], want, rtol=0, atol=1e-6)
    # The delta is exactly what local SGD on the ground-truth batch produces.
    u = taps[0]
    model = update.load_global_model(result.run_config, u.global_state)
    delta, _ = update.fedavg_update(model, partition.private_batch(result.run_config, u.partition_id, 1), 2, 0.05)
    for name, d in delta.items():
        torch.testing.assert_close(u.arrays[name], d, rtol=1e-5, atol=1e-7)  # float32 noise floor


def test_client_that_raises_does_not_stop_the_round():
    taps = []
    result = run_federation(runconfig.resolve_config({**TINY, "fail-partition": 1, "server-eval": False}),
                            tap=taps.append, engine="inprocess", num_supernodes=2)
    assert result.ok and [h["replies"] for h in result.history] == [1, 1]
    assert len(taps) == 2 and {u.partition_id for u in taps} == {0}
    assert [f.server_round for f in result.failures] == [1, 2]
    assert all("injected failure in partition 1" in f.reason for f in result.failures)
    assert len({f.node_id for f in result.failures} | {u.node_id for u in taps}) == 2


def test_slow_client_times_out_and_is_recorded():
    """The fast client needs well under a second once warm; the timeout leaves it 10x that on a
    loaded 2-core machine, and the slow one sleeps twice the timeout."""
    cfg = {**TINY, "slow-partition": 0, "slow-seconds": 16.0, "round-timeout": 8.0, "num-server-rounds": 1,
           "server-eval": False}
    resolved = runconfig.resolve_config(cfg)
    # warm the data and model caches: the fast client must finish in time
    update.fedsgd_gradients(update.load_global_model(resolved), partition.private_batch(resolved, 1, 1))
    result = run_federation(resolved, engine="inprocess", num_supernodes=2)
    assert result.ok and result.history[0]["replies"] == 1
    assert [f.reason for f in result.failures] == ["no reply within the round timeout"]


def test_exit_status_reflects_a_round_without_updates():
    args = ["--engine", "inprocess", "--clients", "1", "-c",
            "fail-partition=0 num-server-rounds=1 server-eval=false num-images=4 model-kwargs='{\"depth\": 1}'"]
    assert server_run.main(args) == 1
    ok_args = args[:-1] + [args[-1].replace("fail-partition=0", "fail-partition=-1")]
    assert server_run.main(ok_args) == 0
    assert server_run.exit_code([], 2, strict=True) == 1 and server_run.exit_code([], 2, strict=False) == 0


@pytest.mark.slow
def test_flower_simulation_engine_end_to_end():
    """Flower's run_simulation (Ray): same apps; a raising client is an error reply, not a crash;
    the result equals the in-process engine's."""
    cfg = runconfig.resolve_config({**TINY, "setting": "c", "fail-partition": 1, "server-eval": False})
    taps = []
    sim = run_federation(cfg, tap=taps.append, engine="simulation", num_supernodes=2, client_cpus=1, num_cpus=2)
    assert sim.engine == "simulation" and sim.ok
    assert [u.server_round for u in taps] == [1, 2] and {u.partition_id for u in taps} == {0}
    assert [f.server_round for f in sim.failures] == [1, 2]
    assert all("injected failure in partition 1" in f.reason for f in sim.failures)
    local = run_federation(cfg, engine="inprocess", num_supernodes=2)
    for k, v in local.final_state.items():
        torch.testing.assert_close(sim.final_state[k], v, rtol=0, atol=1e-6)


def _update(rnd: int, node: int, arrays: dict, n: int, global_state: dict):
    from server.tap import TappedUpdate

    return TappedUpdate(rnd, node, node, "gradients", arrays, global_state, n, {"loss": 1.0}, {})


def test_weighted_mean_is_the_float64_sum_of_count_weighted_updates():
    """The in-place accumulation gives exactly sum(double(u) * n) / total, and leaves the updates
    (float32 and float64 alike) untouched."""
    from server.strategy import TappedFedAvg

    g = torch.Generator().manual_seed(0)
    updates = [_update(1, i, {"w": torch.randn(5, 7, generator=g, dtype=dtype),
                              "b": torch.randn(7, generator=g, dtype=dtype)}, n, {})
               for i, (n, dtype) in enumerate([(1, torch.float32), (3, torch.float64), (2, torch.float32)])]
    before = {(i, k): v.clone() for i, u in enumerate(updates) for k, v in u.arrays.items()}
    mean = TappedFedAvg().weighted_mean(updates)
    for name in ("w", "b"):
        assert torch.equal(mean[name], _weighted_mean(updates, name))
    assert all(torch.equal(u.arrays[k], before[(i, k)]) for i, u in enumerate(updates) for k in u.arrays)


def test_fedsgd_with_zero_step_sends_the_same_weights_without_aggregating(monkeypatch):
    """lr = 0 (the paper's fixed model): every round starts from the initial weights, bit for bit,
    and the strategy never averages the updates (it resends the record it received)."""
    from server.strategy import FedSGD

    calls = []
    original = FedSGD.weighted_mean
    monkeypatch.setattr(FedSGD, "weighted_mean", lambda self, u: calls.append(len(u)) or original(self, u))
    taps = []
    result = run_federation(runconfig.resolve_config({**TINY, "lr": 0.0}), tap=taps.append, engine="inprocess",
                            num_supernodes=2)
    assert result.ok and len(taps) == 4 and calls == []
    first = taps[0].global_state
    for u in taps[1:]:
        assert u.global_state.keys() == first.keys()
        assert all(torch.equal(u.global_state[k], first[k]) for k in first)
    assert all(torch.equal(result.final_state[k], first[k]) for k in first)
    # A non-zero step does aggregate.
    run_federation(runconfig.resolve_config({**TINY, "lr": 0.05, "num-server-rounds": 1}), engine="inprocess",
                   num_supernodes=2)
    assert calls == [2]


def test_server_checks_each_reply_on_views_of_its_bytes():
    """Unknown names, wrong shapes, NaN/inf and truncated payloads are malformed replies; finite
    values whose float32 sum overflows are not (the sum is only a fast path to the exact check)."""
    from flwr.app import Array, ArrayRecord

    from clients.records import encode_state, encode_tensor
    from server.strategy import checked_arrays

    sent = {"w": torch.zeros(4, 3), "b": torch.zeros(3, dtype=torch.float64), "n": torch.zeros((), dtype=torch.int64)}
    good = {"w": torch.full((4, 3), 3e38), "b": torch.full((3,), 1e308, dtype=torch.float64),
            "n": torch.tensor(5)}
    arrays = checked_arrays(encode_state(good), sent)
    assert all(torch.equal(arrays[k], v) for k, v in good.items())
    half = {"w": torch.full((4, 3), 6e4, dtype=torch.float16)}  # float16 sum overflows at 65504
    assert torch.equal(checked_arrays(encode_state(half), {"w": torch.zeros(4, 3)})["w"], half["w"])

    def rejects(update, match):
        with pytest.raises(ValueError, match=match):
            checked_arrays(update if isinstance(update, ArrayRecord) else encode_state(update), sent)

    for bad in (float("nan"), float("inf"), -float("inf")):
        w = torch.ones(4, 3)
        w[2, 1] = bad
        rejects({"w": w}, "w: non-finite")
        rejects({"b": torch.tensor([0.0, bad, 1.0], dtype=torch.float64)}, "b: non-finite")
    rejects({"w": torch.ones(3, 4)}, r"w: shape \(3, 4\) != \(4, 3\)")
    rejects({"extra": torch.ones(1)}, "unknown parameters")
    full = encode_tensor(torch.ones(4, 3))
    cut = Array(dtype=full.dtype, shape=tuple(full.shape), stype=full.stype, data=full.data[:-8])
    rejects(ArrayRecord({"w": cut}), "buffer is smaller")
