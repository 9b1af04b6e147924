"""The bench scripts' own computations on tiny inputs (the timings themselves are the scripts' job):
the vmap route gives the clients' gradients, and the parts of the benchmark's work run on a tiny
config and cover every update."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from helpers import tiny_config

from benchmark import config as C

ROOT = Path(__file__).resolve().parents[1]


def load_bench(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("variant,setting", [("plain", "a"), ("mjp", "b")])
def test_vmap_gradients_equal_the_clients_loop(variant: str, setting: str) -> None:
    from clients.partition import private_batch
    from clients.runconfig import resolve_config
    from clients.update import fedsgd_gradients, load_global_model

    bench = load_bench("vmap_victims")
    cfg = resolve_config({"model-arch": "mjp_vit_cifar_patch4_32", "model-variant": variant,
                          "model-kwargs": {"depth": 2}, "model-april": "surgery", "images": "embedded",
                          "num-images": 3, "num-partitions": 3, "setting": setting, "device": "cpu"})
    model = load_global_model(cfg)
    batches = [private_batch(cfg, c, 1, 3) for c in range(3)]
    assert (batches[0].unk_mask is not None) == (variant == "mjp")
    for fused in (True, False):
        bench.set_fused(model, fused)
        got = bench.vmap_gradients(model, batches)
        bench.set_fused(model, True)
        for c, batch in enumerate(batches):
            want = fedsgd_gradients(model, batch)[0]
            assert got.keys() == want.keys()
            scale = max(float(g.abs().max()) for g in want.values())
            for k in want:  # float32: summation order only
                assert float((got[k][c] - want[k]).abs().max()) <= 1e-5 * scale, (k, fused)


def test_parts_of_the_benchmark_cover_every_update() -> None:
    bench = load_bench("benchmark_overhead")
    cfg = C.validate(tiny_config(settings=["a", "b", "c"]))
    parts, n = bench.bare_parts(cfg, bench.bare_work(cfg))
    assert n == 2 * 2 * 2 * 2  # models x groups x rounds x clients
    assert set(parts) == {"victim gradients", "Acc. forward", "attack", "metrics"}
    assert all(v > 0 for v in parts.values())
