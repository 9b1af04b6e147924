"""Secure aggregation with Flower's own SecAgg+ (SecAggPlusWorkflow / secaggplus_mod, no sum by hand):
the tap sees one K-client aggregate per round, equal to the clients' example-weighted mean to the
protocol's quantisation, and never a single client's update."""
from __future__ import annotations

import pytest
import torch

import fedmjp  # noqa: F401  (registers the mjp_* models)
from clients import runconfig
from clients.defence import defended_local_update
from fedmjp.config import ConfigError
from server.federation import run_federation
from server.tap import AGGREGATE_ID, load_tapped_updates

CFG = {"model-kwargs": {"depth": 2}, "num-images": 8, "image-size": 32, "setting": "c", "precision": "float64",
       "lr": 0.05, "secagg": True, "device": "cpu"}
CLIENTS = 3


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def secagg_run(tmp_path_factory):
    """3 clients x 2 rounds under SecAgg+, tapped in memory and to a folder."""
    out = tmp_path_factory.mktemp("secagg")
    taps: list = []
    result = run_federation(runconfig.resolve_config({**CFG, "num-server-rounds": 2, "out-dir": str(out)}),
                            tap=taps.append,
                            engine="inprocess", num_supernodes=CLIENTS)
    return result, taps, out


def _client_updates(result, update, partitions):
    """Each client's own update, recomputed from the weights the server sent (the clients' compute
    is deterministic), with its example count."""
    cfg = result.run_config
    out = {}
    for p in partitions:
        sent, _, batch, _ = defended_local_update(cfg, update.global_state, p, update.server_round, CLIENTS,
                                                  torch.device("cpu"))
        out[p] = (sent, int(batch.labels.numel()))
    return out


def _mean(clients: dict) -> dict[str, torch.Tensor]:
    total = sum(n for _, n in clients.values())
    names = next(iter(clients.values()))[0]
    return {k: sum(u[k].double() * n for u, n in clients.values()) / total for k in names}


def _max_diff(a: dict, b: dict) -> float:
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def _step(cfg: runconfig.RunConfig) -> float:
    """SecAgg+'s quantisation step on an update of weight 1 (max_weight = batch-size)."""
    return 2 * cfg.secagg_clipping_range / cfg.secagg_quantization_range


def test_the_tap_sees_one_aggregate_per_round(secagg_run) -> None:
    result, taps, _ = secagg_run
    assert result.ok and not result.failures
    assert [u.server_round for u in taps] == [1, 2]
    for u in taps:
        assert u.is_aggregate and u.node_id == u.partition_id == AGGREGATE_ID
        assert u.num_clients == CLIENTS and u.num_examples == CLIENTS * result.run_config.batch_size
        assert u.partition_ids == [0, 1, 2] and len(set(u.node_ids)) == CLIENTS
        assert u.metadata["aggregation"] == "secaggplus-mean" and u.kind == "gradients"
    assert [h["replies"] for h in result.history] == [CLIENTS, CLIENTS]


def test_aggregate_is_the_weighted_mean_to_the_quantisation_and_no_single_update(secagg_run) -> None:
    result, taps, _ = secagg_run
    step = _step(result.run_config)
    for u in taps:
        clients = _client_updates(result, u, u.partition_ids)
        mean = _mean(clients)
        aggregate = {k: v for k, v in u.arrays.items()}
        assert aggregate.keys() == mean.keys()
        # No entry reaches the clipping range here, so the only error is the stochastic rounding:
        # each client's entry is off by less than one step, the mean of K by less than one step.
        assert max(float(v.abs().max()) for v in mean.values()) < result.run_config.secagg_clipping_range
        error = _max_diff(aggregate, mean)
        assert 0 < error < step  # quantised (not the exact mean), and within the protocol's step
        for own, _ in clients.values():  # the tap holds no client's own update
            assert _max_diff(aggregate, own) > 1000 * step


def test_the_global_step_uses_the_aggregate(secagg_run) -> None:
    result, taps, _ = secagg_run
    first, second = taps
    lr = result.run_config.lr
    for name, grad in first.arrays.items():
        expected = (first.global_state[name].double() - lr * grad.double()).to(first.global_state[name].dtype)
        assert torch.equal(second.global_state[name], expected)


def test_folder_tap_stores_the_aggregate(secagg_run) -> None:
    result, taps, out = secagg_run
    stored = load_tapped_updates(out / "updates")
    assert sorted(p.name for p in (out / "updates").glob("round-*.pt")) == [
        "round-0001-aggregate.pt", "round-0001-global.pt", "round-0002-aggregate.pt", "round-0002-global.pt"]
    assert [(u.server_round, u.num_clients, u.partition_ids) for u in stored] == [(1, 3, [0, 1, 2]), (2, 3, [0, 1, 2])]
    assert all(_max_diff(dict(s.arrays), dict(t.arrays)) == 0 for s, t in zip(stored, taps))


@pytest.mark.slow
def test_the_aggregate_reproduces_and_a_dropout_is_recovered(secagg_run) -> None:
    """The stochastic rounding is seeded: the same round gives the same aggregate. A client that
    drops after the key exchange is unmasked by its neighbours' shares (SecAgg+'s dropout
    recovery): the aggregate covers the others."""
    result, taps, _ = secagg_run
    again: list = []
    run_federation(runconfig.resolve_config({**CFG, "num-server-rounds": 1}), tap=again.append, engine="inprocess",
                   num_supernodes=CLIENTS)
    assert _max_diff(dict(again[0].arrays), dict(taps[0].arrays)) == 0
    dropped: list = []
    outcome = run_federation(runconfig.resolve_config({**CFG, "num-server-rounds": 1, "fail-partition": 1}),
                             tap=dropped.append,
                             engine="inprocess", num_supernodes=CLIENTS)
    assert outcome.ok and len(outcome.failures) == 1 and "injected failure" in outcome.failures[0].reason
    (u,) = dropped
    assert u.num_clients == 2 and u.partition_ids == [0, 2] and u.num_examples == 2
    mean = _mean(_client_updates(result, u, [0, 2]))
    assert _max_diff(dict(u.arrays), mean) < _step(result.run_config)


@pytest.mark.parametrize("keys, message", [
    ({"min-nodes": 1}, "secagg=true needs min-nodes >= 2"),
    ({"min-nodes": 4, "secagg-quantization-range": 2 ** 31}, "secagg-quantization-range=2147483648 is too large"),
    # 2 clients x 2**31 levels reach the modulus itself: the aggregate came back non-finite
    ({"min-nodes": 2, "secagg-quantization-range": 2 ** 31}, "secagg-quantization-range=2147483648 is too large"),
    ({"defence": {"name": "central_dp", "sigma": 1.0, "clip": 1.0}}, "does not combine with defence central_dp"),
    ({"secagg-num-shares": 0.0}, "secagg-num-shares"),
    ({"secagg-reconstruction-threshold": 1.5}, "secagg-reconstruction-threshold"),
    ({"secagg-clipping-range": -1.0}, "secagg-clipping-range"),
    ({"secagg-quantization-range": 1}, "secagg-quantization-range"),
    ({"secagg": "yes"}, "secagg"),
])
def test_bad_secagg_keys_are_named(keys, message) -> None:
    with pytest.raises(ConfigError, match=message):
        runconfig.resolve_config({**CFG, **keys})


@pytest.mark.slow
def test_secagg_through_flowers_simulation_engine() -> None:
    """2 clients x 1 round on Ray: the real engine serialises every SecAgg+ message."""
    taps: list = []
    result = run_federation(runconfig.resolve_config({**CFG, "num-server-rounds": 1}),
                            tap=taps.append, engine="simulation",
                            num_supernodes=2, client_cpus=1)
    assert result.ok, result.failures
    (u,) = taps
    assert u.is_aggregate and u.num_clients == 2 and u.partition_ids == [0, 1]
    clients = {p: defended_local_update(result.run_config, u.global_state, p, 1, 2, torch.device("cpu"))
               for p in (0, 1)}
    mean = _mean({p: (c[0], int(c[2].labels.numel())) for p, c in clients.items()})
    assert _max_diff(dict(u.arrays), mean) < _step(result.run_config)
