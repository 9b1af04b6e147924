"""Train-mode clients: drop-path (and dropout) act in the client's forward, seeded, unknown to the server."""
from __future__ import annotations

import pytest
import torch

import fedmjp  # noqa: F401  (registers the mjp_* models)
from clients import runconfig, update
from clients.defence import defended_local_update
from fedmjp.config import ConfigError

CFG = {"model-kwargs": {"depth": 3}, "num-images": 4, "image-size": 32, "setting": "c", "device": "cpu",
       "precision": "float64"}


@pytest.fixture(scope="module")
def state() -> dict[str, torch.Tensor]:
    return update.load_global_model(runconfig.resolve_config(CFG)).state_dict()


def _update(state: dict, **keys) -> dict[str, torch.Tensor]:
    grads, _, _ = update.local_update(runconfig.resolve_config({**CFG, **keys}), state, 0, 1, 2)
    return grads


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_drop_path_changes_the_update_and_zero_does_not(state) -> None:
    plain = _update(state)
    assert _same(_update(state, **{"train-mode": True, "drop-path": 0.0}), plain)
    dropped = _update(state, **{"train-mode": True, "drop-path": 0.5})
    assert not _same(dropped, plain)
    # The deepest blocks' branches are dropped per sample: some gradient of the last block differs.
    name = "blocks.2.mlp.fc2.weight"
    assert not torch.equal(dropped[name], plain[name])
    # The cached round model is restored afterwards: eval mode again gives the plain update.
    assert _same(_update(state), plain)


def test_train_mode_is_seeded_by_seed_partition_and_round(state) -> None:
    keys = {"train-mode": True, "drop-path": 0.5}
    draws = [_update(state, **keys) for _ in range(2)]
    assert _same(draws[0], draws[1])
    others = [update.local_update(runconfig.resolve_config({**CFG, **keys, "seed": s}), state, 0, 1, 2)[0]
              for s in (1, 2, 3)]
    assert any(not _same(o, draws[0]) for o in others)  # a different seed draws other masks


def test_train_mode_reaches_defended_updates(state) -> None:
    keys = {"train-mode": True, "drop-path": 0.5, "defence": {"name": "mixup", "k": 2}}
    cpu = torch.device("cpu")
    sent, _, _, _ = defended_local_update(runconfig.resolve_config({**CFG, **keys}), state, 0, 1, 2, cpu)
    plain, _, _, _ = defended_local_update(runconfig.resolve_config({**CFG, "defence": {"name": "mixup", "k": 2}}),
                                           state, 0, 1, 2, cpu)
    assert not _same(sent, plain)


@pytest.mark.parametrize("keys, message", [
    ({"drop-path": 0.1}, "drop-path=0.1 needs train-mode=true"),
    ({"train-mode": True, "drop-path": 1.0}, "drop-path"),
    ({"train-mode": True, "drop-path": -0.1}, "drop-path"),
    ({"train-mode": "yes"}, "train-mode"),
])
def test_bad_train_mode_keys_are_named(keys, message) -> None:
    with pytest.raises(ConfigError, match=message):
        runconfig.resolve_config({**CFG, **keys})
