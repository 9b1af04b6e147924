"""The server's step on the mean client delta (server.strategy.ServerOptimizer: FedAvg, FedAvgM,
FedAdam), checked against the update rules written out by hand and through a real federation."""
from __future__ import annotations

import math

import pytest
import torch

import fedmjp  # noqa: F401  (registers the mjp_* models)
from clients import runconfig
from fedmjp.config import ConfigError
from server.federation import run_federation
from server.strategy import ServerOptimizer, TappedFedAvg

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(3, 4, generator=g), "b": torch.randn(4, generator=g)}


def test_fedavg_at_server_lr_one_is_plain_fedavg():
    assert ServerOptimizer("fedavg").plain and TappedFedAvg(server_opt=ServerOptimizer("fedavg")).server_opt is None
    assert not ServerOptimizer("fedavg", lr=0.5).plain


def test_fedavgm_follows_heavy_ball_momentum_by_hand():
    w0, d1, d2 = _state(0), _state(1), _state(2)
    opt = ServerOptimizer("fedavgm", lr=0.7, momentum=0.9)
    w1 = opt.step(w0, d1)
    w2 = opt.step(w1, d2)
    for k in w0:
        v1 = d1[k].double()
        want1 = w0[k].double() + 0.7 * v1
        v2 = 0.9 * v1 + d2[k].double()
        want2 = want1.float().double() + 0.7 * v2
        torch.testing.assert_close(w1[k], want1.float(), rtol=0, atol=1e-6)
        torch.testing.assert_close(w2[k], want2.float(), rtol=0, atol=1e-6)


def test_fedadam_follows_adam_on_the_negative_delta_by_hand():
    w, deltas = _state(0), [_state(s) for s in (1, 2, 3)]
    lr, b1, b2, tau = 0.01, 0.9, 0.99, 1e-3
    opt = ServerOptimizer("fedadam", lr=lr, momentum=b1, beta2=b2, tau=tau)
    want = {k: v.double() for k, v in w.items()}
    m = {k: torch.zeros_like(v) for k, v in want.items()}
    v2 = {k: torch.zeros_like(v) for k, v in want.items()}
    for t, d in enumerate(deltas, start=1):
        w = opt.step(w, d)
        for k in want:
            g = -d[k].double()
            m[k] = b1 * m[k] + (1 - b1) * g
            v2[k] = b2 * v2[k] + (1 - b2) * g * g
            step = lr * (m[k] / (1 - b1 ** t)) / ((v2[k] / (1 - b2 ** t)).sqrt() + tau)
            want[k] = want[k].float().double() - step
            torch.testing.assert_close(w[k], want[k].float(), rtol=0, atol=1e-6)
    # Adam's first step moves every coordinate by lr |d| / (|d| + tau) along the delta: about lr
    # whatever the delta's size, once it is well above tau
    d = {k: (1 + v.abs()) * torch.where(v < 0, -1.0, 1.0) for k, v in _state(1).items()}
    moved = ServerOptimizer("fedadam", lr=lr, tau=tau).step(_state(0), d)["w"] - _state(0)["w"]
    assert bool((moved * d["w"] > 0).all())
    assert float(moved.abs().min()) > 0.99 * lr and float(moved.abs().max()) <= lr * (1 + 1e-6)


def test_cosine_schedule_anneals_the_server_lr_over_the_rounds():
    rounds, lr = 4, 0.8
    opt = ServerOptimizer("fedavg", lr=lr, schedule="cosine", rounds=rounds)
    assert not opt.plain
    w, d = _state(0), _state(1)
    for r in range(rounds):
        w_next = opt.step(w, d)
        factor = lr * (1 + math.cos(math.pi * r / rounds)) / 2
        torch.testing.assert_close(w_next["w"], w["w"] + factor * d["w"], rtol=0, atol=1e-6)
        w = w_next
    with pytest.raises(ValueError, match="server-schedule"):
        ServerOptimizer("fedavg", schedule="step")


def test_the_step_starts_from_the_weights_sent_not_its_own_copy():
    # Whatever changed the weights after the last step (central DP's noise) is where the next starts.
    w0, d = _state(0), _state(1)
    opt = ServerOptimizer("fedavg", lr=0.5)
    w1 = opt.step(w0, d)
    noisy = {k: v + 1.0 for k, v in w1.items()}
    w2 = opt.step(noisy, d)
    for k in w0:
        torch.testing.assert_close(w2[k], noisy[k] + 0.5 * d[k], rtol=0, atol=1e-6)


def test_a_round_that_updates_other_parameters_is_refused():
    opt = ServerOptimizer("fedadam")
    opt.step(_state(0), _state(1))
    with pytest.raises(ValueError, match="same parameters"):
        opt.step(_state(0), {"w": _state(1)["w"]})


@pytest.mark.parametrize("values, words", [
    ({"server-opt": "fedadam"}, "needs mode=fedavg"),
    ({"server-opt": "fedavg", "server-lr": 0.5}, "needs mode=fedavg"),
    ({"mode": "fedavg", "server-opt": "fedavgm", "secagg": True, "min-nodes": 2}, "not supported with it"),
    ({"mode": "fedavg", "server-opt": "adam"}, "server-opt"),
    ({"mode": "fedavg", "server-momentum": 1.0}, "server-momentum"),
    ({"server-schedule": "cosine"}, "needs mode=fedavg"),
    ({"mode": "fedavg", "server-schedule": "linear"}, "server-schedule"),
])
def test_server_keys_are_checked_with_a_message_naming_them(values, words):
    with pytest.raises(ConfigError, match=words):
        runconfig.resolve_config(values)


def test_a_federation_with_fedadam_steps_adam_on_the_tapped_mean_delta():
    taps = []
    cfg = runconfig.resolve_config({"model-kwargs": {"depth": 1}, "num-images": 4, "image-size": 32,
                                    "num-server-rounds": 1, "mode": "fedavg", "lr": 0.05, "server-opt": "fedadam",
                                    "server-lr": 0.003})
    result = run_federation(cfg, tap=taps.append, engine="inprocess", num_supernodes=2)
    assert len(taps) == 2
    total = sum(u.num_examples for u in taps)
    for k, w in taps[0].global_state.items():
        if k not in taps[0].arrays:
            torch.testing.assert_close(result.final_state[k], w, rtol=0, atol=0)
            continue
        mean = sum(u.arrays[k].double() * u.num_examples for u in taps) / total
        # Adam's first step: lr * g / (|g| + tau) with bias correction, g = -mean delta
        want = w.double() + 0.003 * mean / (mean.abs() + 1e-3)
        torch.testing.assert_close(result.final_state[k], want.float(), rtol=0, atol=1e-6)
    assert math.isfinite(result.history[0]["train-loss"])
