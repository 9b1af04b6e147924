"""The clients: the server evaluates on a public split, never on private images, and the benchmark's
device reaches the clients' local update."""
from __future__ import annotations

import pytest
import torch

from clients import partition, runconfig, update
from fedmjp.devices import resolve_device


def test_server_eval_uses_a_public_split() -> None:
    cfg = runconfig.resolve_config({"num-images": 8, "image-size": 32})
    private = partition.private_image_set(cfg)
    public = partition.public_eval_set(cfg)
    assert len(public) > 0 and not set(public.names) & set(private.names)
    assert runconfig.DEFAULTS["server-eval"] is False and runconfig.DEFAULTS["device"] == "auto"
    with pytest.raises(ValueError, match="public split"):
        partition.public_eval_set(runconfig.resolve_config({"num-images": 0, "image-size": 32}))


def test_benchmark_device_reaches_the_clients() -> None:
    from benchmark import config as C
    from benchmark.entries import model_spec
    from benchmark.inputs import ModelRow, client_run_config
    from benchmark.validation import validate

    cfg = validate(C.apply_overrides(C.load_config(), ["device=cpu"]))
    row = ModelRow(0, "x", "x", model_spec(cfg, 0), torch.nn.Identity(), False)
    run_config = client_run_config(cfg, row, "shuffled")
    assert run_config.device == "cpu"
    with pytest.raises(ValueError, match="cuda"):
        resolve_device("cuda:99" if torch.cuda.is_available() else "cuda")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks that a CUDA request fails on a CPU-only machine")
def test_local_update_reads_the_device_key() -> None:
    cfg = {"num-images": 4, "image-size": 32, "model-kwargs": {"depth": 1}}
    state = update.load_global_model(runconfig.resolve_config(cfg)).state_dict()
    _, _, batch = update.local_update(runconfig.resolve_config({**cfg, "device": "cpu"}), state, 0, 1)
    assert batch.images.shape[0] == 1
    with pytest.raises(ValueError, match="cuda"):
        # 'auto' would have run on the CPU
        update.local_update(runconfig.resolve_config({**cfg, "device": "cuda"}), state, 0, 1)
