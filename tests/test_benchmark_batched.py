"""The benchmark's batched and distributed attack paths give the rows of the one-at-a-time path.

Each round's updates go to each attacker in one ``reconstruct_many`` call (the closed form solves
them in one batched least-squares problem, Inverting Gradients optimises them together); with
``attack_workers`` they go to real Ray actors. The attacks are deterministic functions of (model,
update, metadata), so the rows must equal those of one ``reconstruct`` call per update in this
process, to the precision of the arithmetic (batched BLAS sums in another order).
"""
from __future__ import annotations

from pathlib import Path

import pytest
from helpers import assert_same_scores, metric_rows, write_config

from benchmark import config as C
from benchmark.pipeline import run_benchmark
from benchmark.validation import validate

IG_ITERATIONS = 8


def _config(folder: Path, **changes) -> dict:
    """The tiny two-row config of test_benchmark, settings a and c, the closed form and IG."""
    attacks = [{"name": "april_analytic"},
               {"name": "invertinggradients_batched", "label": "IG", "options": {"iterations": IG_ITERATIONS}}]
    path = write_config(folder, **{"settings": ["a", "c"], "attacks": attacks, **changes})
    return validate(C.load_config(path))


def _assert_close_ig(got: list[dict], want: list[dict]) -> None:
    """IG rows: float32 optimisation with signed steps; a batched matmul may round differently
    from a batch-1 one (~1e-7 relative), and after a few signed Adam steps that moves a pixel by at
    most a few lr-sized steps. Compare the scores to 1e-3 and everything else exactly."""
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert a.keys() == b.keys()
        for k in a:
            if isinstance(a[k], float) and isinstance(b[k], float):
                assert a[k] == pytest.approx(b[k], rel=1e-3, abs=1e-3, nan_ok=True), k
            else:
                assert a[k] == b[k], k


def _split(rows: list[dict]) -> tuple[list[dict], list[dict]]:
    return [r for r in rows if r["attack"] != "IG"], [r for r in rows if r["attack"] == "IG"]


@pytest.fixture(scope="module")
def one_at_a_time(tmp_path_factory) -> list[dict]:
    folder = tmp_path_factory.mktemp("single")
    out = folder / "out"
    run_benchmark(_config(folder), str(out), progress=False, batched=False)
    return metric_rows(out / "results.jsonl")


def test_batched_rounds_give_the_rows_of_one_update_at_a_time(one_at_a_time: list[dict], tmp_path: Path) -> None:
    out = tmp_path / "batched"
    summary = run_benchmark(_config(tmp_path), str(out), progress=False, batched=True)
    rows = metric_rows(out / "results.jsonl")
    assert summary.new_rows == len(rows) == 2 * 2 * 4 * 2  # models x settings x images x attackers
    april, ig = _split(rows)
    april_ref, ig_ref = _split(one_at_a_time)
    assert_same_scores(april, april_ref)
    _assert_close_ig(ig, ig_ref)
    assert min(float(r["psnr"]) for r in april if r["model"] == "DeiT" and r["setting"] == "a") >= 100  # exact copies (the cap)


@pytest.mark.slow
def test_two_ray_workers_give_the_same_rows_and_shut_down(one_at_a_time: list[dict], tmp_path: Path) -> None:
    import ray

    out = tmp_path / "ray"
    cfg = _config(tmp_path, attack_workers=2)
    run_benchmark(cfg, str(out), progress=False)
    assert not ray.is_initialized()  # Ray started for the run is shut down with it
    rows = metric_rows(out / "results.jsonl")
    april, ig = _split(rows)
    april_ref, ig_ref = _split(one_at_a_time)
    assert_same_scores(april, april_ref)
    _assert_close_ig(ig, ig_ref)


def test_attack_workers_are_checked(tmp_path: Path) -> None:
    import os

    with pytest.raises(C.ConfigError, match="attack_workers must be <="):
        _config(tmp_path, attack_workers=(os.cpu_count() or 1) + 1)
    with pytest.raises(C.ConfigError, match="config key 'attack_workers' must be an integer >= 0"):
        _config(tmp_path, attack_workers=-1)


def test_a_second_build_of_a_seeded_model_equals_a_fresh_one() -> None:
    """build_model fills later builds of a (arch, variant, kwargs, seed) from stored tensors:
    every parameter and buffer (non-persistent ones too) and the output equal a fresh build, and
    the copies share no storage."""
    import torch

    from fedmjp import factory

    spec = {"arch": "mjp_vit_cifar_patch4_32", "variant": "mjp", "kwargs": {"depth": 2}, "april": "surgery",
            "seed": 7}
    factory.FRESH_TEMPLATES.clear()
    first = factory.build_model(spec)
    second = factory.build_model(spec)
    assert len(factory.FRESH_TEMPLATES) == 1
    tensors = lambda m: {**dict(m.named_parameters()), **dict(m.named_buffers())}
    a, b = tensors(first), tensors(second)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not any(v.is_meta for v in b.values())
    x = torch.rand(2, 3, 32, 32)
    mask = first.draw_plan(2, gamma=0.27, seed=1).mask
    assert torch.equal(first(x, unk_mask=mask), second(x, unk_mask=mask))
    with torch.no_grad():
        next(second.parameters()).add_(1.0)
    assert torch.equal(next(factory.build_model(spec).parameters()), next(first.parameters()))
    assert not torch.equal(next(factory.build_model({**spec, "seed": 8}).parameters()), next(first.parameters()))
