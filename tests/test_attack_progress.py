"""An optimisation attack shows its progress within an update (attacks.api.progress).

Every long attack reports from its iteration loops; the benchmark turns the reports into the bar's
postfix, or (bars off) a log line at most every LOG_EVERY_S seconds. Reporting never changes a result.
"""
from __future__ import annotations

import functools
import logging
import re
import threading
from pathlib import Path

import pytest
import timm
import torch
from helpers import MD, bundled_images, normalize, run, write_config

import attacks
import fedmjp  # noqa: F401  (registers the models)
from attacks.api import progress
from attacks.api.progress import Reporter, Step


def test_a_run_with_bars_off_logs_the_iterations_of_its_optimisation_attack(tmp_path: Path, monkeypatch,
                                                                              caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(progress, "LOG_EVERY_S", 0.0)  # every report a line (10 s in a real run)
    config = write_config(tmp_path, **{
        "settings": ["a"], "data.image_size": 16, "data.num_images": 2, "federation.rounds": 1,
        "models": [{"name": "DeiT", "arch": "mjp_vit_cifar_patch4_32", "variant": "plain",
                    "kwargs": {"depth": 2, "img_size": 16}, "april": "surgery"}],
        "attack": {"name": "invertinggradients_batched", "options": {"iterations": 6}},
        "metrics": {"lpips": False}, "report": {"grid_images": 0, "tile": 16}})
    caplog.set_level(logging.INFO, logger="benchmark.group_attacker")
    assert run(config, tmp_path / "out") == 0
    lines = [r.getMessage() for r in caplog.records if r.name == "benchmark.group_attacker"]
    pattern = re.compile(r"^DeiT/clean: attack invertinggradients_batched on round 1, partitions 0, 1: "
                         r"iteration (\d) of 6 \(restart 1 of 1\), \d+ s$")
    seen = [int(m.group(1)) for m in map(pattern.match, lines) if m]
    assert seen == list(range(6)), lines


def _update(model: torch.nn.Module, B: int = 1, plan=None) -> dict:
    x = bundled_images(B, 16).to(next(model.parameters()).dtype)
    x = model.shuffle_images(x, plan) if plan is not None else x
    kwargs = {} if plan is None else {"unk_mask": plan.mask}
    return attacks.compute_update(model, normalize(x).to(x.dtype), torch.tensor([3, 5][:B]), **kwargs)


def _tiny(**kwargs) -> torch.nn.Module:
    torch.manual_seed(0)
    return timm.create_model("mjp_vit_cifar_patch4_32", img_size=16, **{"variant": "mjp", "embed_dim": 48,
                                                                         "num_heads": 2, "depth": 1, **kwargs}).eval()


@functools.lru_cache(maxsize=1)
def _cases():
    """(attack, its options, model, update, metadata, the stage its reports must name)."""
    plain = _tiny()
    labelled = dict(MD, labels=torch.tensor([3]))
    design_a = _tiny(first_block="april", depth=2, embed_dim=192, num_heads=3).double()
    plan = design_a.draw_plan(1, gamma=0.27, seed=3)
    mjp_update = _update(design_a, plan=plan)
    pre_norm = _tiny(variant="plain", depth=2).double()
    return [
        ("invertinggradients_batched", dict(iterations=3), plain, _update(plain), labelled, "restart 1 of 1"),
        ("april_optimization", dict(iterations=3), plain, _update(plain), labelled, "restart 1 of 1"),
        ("ig_closed_start", dict(iterations=3, restarts=1, start_attacks=[]), plain, _update(plain), labelled,
         "still converging"),
        ("invertinggradients_batched", dict(iterations=3, converge_window=2), plain, _update(plain), labelled,
         "still converging"),
        ("batch_match", dict(iterations=3), plain, _update(plain, 2), dict(MD, num_images=2), "L-BFGS"),
        ("mjp_adaptive", dict(refine="match", iterations=2, rounds=1), design_a, mjp_update, MD, "gradient matching"),
        ("mjp_adaptive", dict(refine="span", span_iterations=2, starts=1), design_a, mjp_update, MD, "span fit"),
        ("invertinggradients", dict(iterations=2), plain, _update(plain), labelled, "breaching's attacker"),
        ("block0_roots", dict(starts=2, rounds=1, iterations=2, warm_start=False), pre_norm, _update(pre_norm), MD, "roots found"),
    ]


@pytest.mark.parametrize("case", range(9))
def test_every_long_attack_reports_from_its_loop_and_gives_the_same_result(case: int) -> None:
    name, options, model, update, meta, stage = _cases()[case]
    silent = attacks.create_attack(name, **options).reconstruct(model, update, meta)
    steps: list[Step] = []

    def show(step: Step) -> None:  # records, then fails like a broken display
        steps.append(step)
        raise RuntimeError("display gone")

    with progress.reporting(Reporter(show, every_s=0.0)):
        reported = attacks.create_attack(name, **options).reconstruct(model, update, meta)
    assert [s for s in steps if s.attack == name and stage in s.note], [(s.attack, s.note) for s in steps]
    assert reported.failed == silent.failed and reported.reason == silent.reason
    assert torch.equal(reported.images, silent.images)


def test_a_reporter_belongs_to_its_thread_and_shows_at_most_one_step_per_interval() -> None:
    steps: list[Step] = []
    elsewhere: list[Step] = []
    with progress.reporting(Reporter(steps.append, every_s=3600.0)):
        worker = threading.Thread(target=lambda: progress.report("x", 1, 2))
        worker.start()
        worker.join()
        for it in range(100):
            progress.report("x", it, 100, "stage")
    with progress.reporting(Reporter(elsewhere.append, every_s=0.0)):
        pass
    progress.report("x", 5, 100)  # no reporter: nothing to show it
    assert [(s.done, s.total, s.text()) for s in steps] == [(0, 100, "iteration 0 of 100 (stage)")]
    assert not elsewhere
