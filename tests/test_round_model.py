"""clients.update.round_model reloads the global weights only when they can differ from the model's."""
from __future__ import annotations

import torch

from clients.runconfig import RunConfig, resolve_config
from clients.update import fedsgd_gradients, load_global_model, local_sgd, round_model
from clients.partition import private_batch


def _state(cfg: RunConfig) -> dict:
    return {k: v.clone() for k, v in load_global_model(cfg).state_dict().items()}


def test_the_same_state_is_loaded_once_and_again_after_any_write() -> None:
    cfg = resolve_config({"precision": "float64"})
    state, device = _state(cfg), torch.device("cpu")
    model = round_model(cfg, state, device)
    first = next(model.parameters())
    version = first._version
    fedsgd_gradients(model, private_batch(cfg, 0, 1, 2))  # gradients leave the weights alone
    assert round_model(cfg, state, device) is model and first._version == version  # not copied again

    batch = private_batch(cfg, 0, 1, 2)
    local_sgd(model, lambda: torch.nn.functional.cross_entropy(model(batch.model_input.double()), batch.labels),
              1, 0.5)  # FedAvg's local step writes the weights in place
    assert not torch.equal(first.detach(), state[next(iter(dict(model.named_parameters())))].double())
    model = round_model(cfg, state, device)  # same state object, but the model was trained: reloaded
    for name, value in model.state_dict().items():
        assert torch.equal(value, state[name].to(value.dtype)), name

    other = {k: v + 1 for k, v in state.items()}  # a new state object: loaded
    model = round_model(cfg, other, device)
    assert all(torch.equal(v, other[k].to(v.dtype)) for k, v in model.state_dict().items())
