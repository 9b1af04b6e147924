"""Hostile plug-ins: attacks, defences and models that return the wrong thing, change what they are
given, or raise what an ``except Exception`` does not catch. Each becomes a failed row or a clear
plug-in error with its exit status (benchmark/errors.py); the other attackers' rows are kept and a
resumed run goes on.

The plug-ins are defined here and named by reference (``test_hostile_plugins:Name``: pytest puts
this folder on ``sys.path``). The end-to-end checks are tiny runs (1 model row of a depth-2 32 px
ViT, 2 images, 2 clients x 1 round, setting c, LPIPS off).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from attacks import Attack, AttackResult
from defences.spec import UpdateDefence
from helpers import tiny_config, write_config

MODULE = __name__.rpartition(".")[2]
SMALL = {"federation.rounds": 1, "settings": ["c"], "data.num_images": 2, "metrics": {"lpips": False},
         "report": {"grid_images": 2, "tile": 32}}


def _good(meta) -> AttackResult:
    images = meta.mean.float().clamp(0, 1).view(1, -1, 1, 1).expand(meta.num_images, *meta.image_size).clone()
    return AttackResult(images, [{"objective": 0.0, "notes": []} for _ in range(meta.num_images)])


class Hostile(Attack):
    """Returns a result broken the way ``kind`` says (or raises, or changes what it was given)."""

    name = "hostile"

    def __init__(self, kind: str = "size", raise_errors: bool = False) -> None:
        super().__init__(raise_errors)
        self.kind = kind

    def _reconstruct(self, model, update, meta):
        good, k = _good(meta), self.kind
        if k == "size":
            return AttackResult(torch.zeros(meta.num_images, 3, 16, 16), good.stats)
        if k == "gray":
            return AttackResult(good.images[:, :1].clone(), good.stats)
        if k == "fewer":
            return AttackResult(good.images[:-1].clone(), good.stats[:-1])
        if k == "extra":
            return AttackResult(torch.cat([good.images, good.images]), good.stats * 2)
        if k == "numpy":
            return AttackResult(good.images.numpy(), good.stats)
        if k == "none":
            return None
        if k == "stats":
            return AttackResult(good.images, "not a list")
        if k == "stat_items":
            return AttackResult(good.images, [0.5] * meta.num_images)
        if k == "unshuffled":
            return AttackResult(good.images, good.stats, unshuffled=good.images[:, :, :4])
        if k == "labels":
            return AttackResult(good.images, good.stats, labels=torch.full((meta.num_images,), -3))
        if k == "long_reason":
            from attacks import AttackFailure

            raise AttackFailure("x" * 500_000)
        if k == "exit":
            raise SystemExit(0)
        if k == "interrupt":
            raise KeyboardInterrupt
        if k == "model":
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(0.5)
            return good
        if k == "update":
            for v in update.values():
                v.mul_(100.0)
            return good
        if k == "train":
            model.train()
            return good
        raise AssertionError(k)


class HostileDefence(UpdateDefence):
    """Sends an update broken the way ``kind`` says."""

    defaults = {"kind": "half"}

    def apply(self, update, spec, generator):
        k = spec["kind"]
        if k == "exit":
            raise SystemExit(3)
        if k == "interrupt":
            raise KeyboardInterrupt
        casts = {"half": torch.float16, "int": torch.int64, "bool": torch.bool, "complex": torch.complex128}
        if k in casts:
            return {n: v.to(casts[k]) for n, v in update.items()}
        if k == "huge":
            return {n: torch.full_like(v, 1e300) for n, v in update.items()}
        if k == "nan":
            return {n: torch.full_like(v, float("nan")) for n, v in update.items()}
        if k == "missing":
            return dict(list(update.items())[1:])
        if k == "shape":
            return {n: v.reshape(-1) for n, v in update.items()}
        if k == "numpy":
            return {n: v.numpy() for n, v in update.items()}
        raise AssertionError(k)


class DiesOnce(Attack):
    """Kills its own process (an attack worker under ``attack_workers``: what Ray's memory monitor
    does to a worker) the first time it runs, leaving ``marker``; afterwards it returns a flat image."""

    name = "dies_once"

    def __init__(self, marker: str = "", raise_errors: bool = False) -> None:
        super().__init__(raise_errors)
        self.marker = Path(marker)

    def _reconstruct(self, model, update, meta):
        import os
        import signal

        if not self.marker.exists():
            self.marker.write_text("died")
            os.kill(os.getpid(), signal.SIGKILL)
        return _good(meta)


def small_config(folder: Path, **changes) -> Path:
    return write_config(folder, **{**SMALL, "models": [dict(tiny_config()["models"][0])], **changes})


def cli(config: Path, output: Path, *extra: str) -> int:
    from run_benchmark import main

    return main(["--config", str(config), "--output", str(output), "--no-progress", *extra])


def rows_of(output: Path) -> list[dict]:
    return [json.loads(x) for x in (output / "results.jsonl").read_text().splitlines() if x.strip()]


# ------------------------------------------------------------------------------ an attack's result
def _case(n: int = 2):
    from attacks.api.base import AttackMetadata

    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Dropout(0.1), torch.nn.Linear(3 * 8 * 8, 10)).eval()
    meta = AttackMetadata.parse({"num_images": n, "image_size": [3, 8, 8]}, model)
    update = {k: torch.randn_like(p) for k, p in model.named_parameters()}
    return model, update, meta


BAD_RESULTS = {"size": "shape", "gray": "shape", "fewer": "shape", "numpy": "numpy", "none": "None",
               "stats": "stats", "stat_items": "stats[0]", "unshuffled": "unshuffled", "labels": "labels"}


@pytest.mark.parametrize("kind", sorted(BAD_RESULTS))
@pytest.mark.parametrize("path", ["reconstruct", "run_attack"])
def test_a_bad_result_is_an_error_row_naming_the_attack(kind: str, path: str) -> None:
    """Wrong size, gray, fewer images, a numpy array, None, bad stats or a bad optional field: a
    failed result (an error, exit status 8) whose reason names the attack and what was wrong."""
    from benchmark.workers import run_attack

    model, update, meta = _case()
    attack = Hostile(kind)
    result = attack.reconstruct(model, update, meta) if path == "reconstruct" else \
        run_attack(attack, model, [update], [meta])[0][0]
    assert result.failed and result.error is not None
    assert "'hostile' returned a bad result" in result.reason and BAD_RESULTS[kind] in result.reason, result.reason
    assert tuple(result.images.shape) == (2, 3, 8, 8) and len(result.stats) == 2


def test_extra_images_at_batch_one_are_refused() -> None:
    model, update, meta = _case(n=1)
    result = Hostile("extra").reconstruct(model, update, meta)
    assert result.failed and "expected (B, C, H, W) = (1, 3, 8, 8)" in result.reason


class ManyOverride(Attack):
    """Overrides reconstruct_many (past Attack's guard): returns one result too few, or exits."""

    name = "many_override"

    def __init__(self, kind: str = "short", raise_errors: bool = False) -> None:
        super().__init__(raise_errors)
        self.kind = kind

    def reconstruct_many(self, model, updates, metadatas=None):
        if self.kind == "exit":
            raise SystemExit(2)
        return [_good(m) for m in metadatas][:-1]


@pytest.mark.parametrize("kind, words", [("short", "1 result(s) for 2 update(s)"), ("exit", "SystemExit")])
def test_an_attack_that_overrides_the_guard_is_checked_by_the_runner(kind: str, words: str) -> None:
    from benchmark.workers import run_attack

    model, update, meta = _case()
    results, _ = run_attack(ManyOverride(kind), model, [update, update], [meta, meta])
    assert len(results) == 2 and all(r.failed and r.error for r in results)
    assert words in results[0].reason


def test_a_long_reason_is_capped() -> None:
    from attacks.api.errors import REASON_LIMIT

    model, update, meta = _case()
    result = Hostile("long_reason").reconstruct(model, update, meta)
    assert result.failed and len(result.reason) < REASON_LIMIT + 40
    assert result.reason.endswith(f"... ({500_000 - REASON_LIMIT} characters cut)")
    assert all(len(s["reason"]) < REASON_LIMIT + 40 for s in result.stats)


# ------------------------------------------------------------------- what an except Exception misses
@pytest.fixture
def recording_sigint():
    """The CLI's SIGINT handler (it records the user's signal), installed for the test."""
    import signal

    import run_benchmark

    handler = run_benchmark._SignalHandler(KeyboardInterrupt)
    previous = signal.signal(signal.SIGINT, handler)
    yield handler
    signal.signal(signal.SIGINT, previous)


def test_system_exit_of_an_attack_is_an_error_row() -> None:
    model, update, meta = _case()
    result = Hostile("exit").reconstruct(model, update, meta)
    assert result.failed and result.error and "SystemExit" in result.reason


def test_an_attacks_own_keyboard_interrupt_is_an_error_row(recording_sigint) -> None:
    model, update, meta = _case()
    result = Hostile("interrupt").reconstruct(model, update, meta)
    assert result.failed and result.error and "KeyboardInterrupt" in result.reason
    recording_sigint.received = 2  # the user's Ctrl-C arrived: it stops the run
    with pytest.raises(KeyboardInterrupt):
        Hostile("interrupt").reconstruct(model, update, meta)


# ----------------------------------------------------------------- what the attackers of a round share
@pytest.mark.parametrize("kind, words", [("model", "the model's '2.weight'"), ("update", None),
                                         ("train", "train/eval mode")])
def test_an_attack_that_changes_the_model_or_update_fails_and_the_next_sees_them_intact(kind, words) -> None:
    """A change to the shared model fails the attacker and is undone; the update is each attacker's
    own copy, so a change to it is the attacker's own business and reaches nobody else."""
    from benchmark.workers import AttackCall, run_calls

    model, update, meta = _case()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    original = {k: v.clone() for k, v in update.items()}
    seen = []

    class Witness(Attack):
        name = "witness"

        def _reconstruct(self, model_, update_, meta_):
            seen.append((model_.training, {k: v.clone() for k, v in model_.state_dict().items()},
                         {k: v.clone() for k, v in update_.items()}))
            return _good(meta_)

    calls = [AttackCall(0, [update], [meta]), AttackCall(1, [update], [meta])]
    (bad, _), (good, _) = run_calls([Hostile(kind), Witness()], model, calls)
    if words is None:
        assert not bad[0].failed, bad[0].reason
    else:
        assert bad[0].failed and bad[0].error and "changed the model in place" in bad[0].reason
        assert words in bad[0].reason, bad[0].reason
    assert not good[0].failed
    training, got_state, got_update = seen[0]
    assert not training and all(torch.equal(got_state[k], v) for k, v in state.items())
    assert all(torch.equal(got_update[k], v) for k, v in original.items())
    assert all(torch.equal(update[k], v) for k, v in original.items())


# ------------------------------------------------------------------------------ a defence's output
DEFENCE_PROBLEMS = {"half": "dtype torch.float16", "int": "dtype torch.int64", "bool": "dtype torch.bool",
                    "complex": "dtype torch.complex128", "huge": "beyond", "nan": "non-finite",
                    "missing": "missing", "shape": "shape", "numpy": "not a torch tensor",
                    "exit": "sys.exit(3)", "interrupt": "KeyboardInterrupt"}


@pytest.mark.parametrize("kind", sorted(DEFENCE_PROBLEMS))
def test_a_bad_defence_output_is_a_plugin_error_naming_it(kind: str, recording_sigint) -> None:
    from clients import runconfig, update
    from clients.defence import defended_local_update
    from fedmjp.plugins import PluginError

    cfg = runconfig.resolve_config({"model-kwargs": {"depth": 1}, "model-variant": "plain", "num-images": 2,
                                    "image-size": 32, "num-server-rounds": 1, "precision": "float64",
                                    "server-eval": False, "setting": "a",
                                    "defence": {"name": f"{MODULE}:HostileDefence", "kind": kind}})
    state = update.load_global_model(cfg).state_dict()
    with pytest.raises(PluginError) as err:
        defended_local_update(cfg, state, 0, 1, 2, torch.device("cpu"))
    assert f"defence '{MODULE}:HostileDefence" in str(err.value) and DEFENCE_PROBLEMS[kind] in str(err.value)


def test_system_exit_of_a_model_constructor_is_a_config_error(monkeypatch) -> None:
    from fedmjp import factory

    def exits(pretrained=False, **kwargs):
        raise SystemExit(0)

    monkeypatch.setattr(factory, "model_plugin", lambda arch: exits)
    monkeypatch.setattr(factory.timm, "is_model", lambda arch: False)
    with pytest.raises(ValueError, match=r"model 'exits_on_build'.*sys\.exit\(0\)"):
        factory.create_model("exits_on_build")


# ------------------------------------------------------------------------------------- end to end
@pytest.mark.parametrize("kind", ["gray", "model"])
def test_a_hostile_attacker_fails_its_rows_and_the_others_are_scored(tmp_path: Path, kind: str) -> None:
    """Exit 8 with the attacker's rows failed (reason kept), the next attacker scored on the model
    the server sent, and the same command resumes."""
    config = small_config(tmp_path, attacks=[{"name": f"{MODULE}:Hostile", "options": {"kind": kind}},
                                             {"name": "april_analytic"}])
    out = tmp_path / "out"
    assert cli(config, out) == 8
    rows = rows_of(out)
    bad = [r for r in rows if r["attack"] != "april_analytic"]
    good = [r for r in rows if r["attack"] == "april_analytic"]
    assert len(bad) == len(good) == 2
    assert all(r["failed"] and r["error"] and "'hostile'" in r["reason"] for r in bad)
    assert not any(r["failed"] for r in good) and min(r["psnr"] for r in good) > 13.5
    assert cli(config, out) in (0, 8)  # resumes: no traceback from the stored rows
    assert len(rows_of(out)) >= 4


def test_a_sweep_with_an_attack_error_fails_after_writing_its_tables(tmp_path: Path) -> None:
    """A sweep exits as a single run would (8: an attack raised), after every point's tables and the
    sweep's own are written, not 0."""
    config = small_config(tmp_path, attacks=[{"name": f"{MODULE}:Hostile", "options": {"kind": "gray"}}])
    out = tmp_path / "out"
    assert cli(config, out, "--sweep", "gamma=0.1,0.2") == 8
    assert (out / "sweep.csv").is_file() and len(list((out / "points").iterdir())) == 2


@pytest.mark.slow
def test_an_attack_worker_that_dies_is_exit_11_and_the_same_command_resumes(tmp_path: Path) -> None:
    """A Ray attack worker killed under an attack (Ray's memory monitor does this when the machine
    runs low) ends the run with one line naming the attacker and how to resume (exit 11), not a
    traceback; the same command then finishes the run."""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    marker = tmp_path / "died"
    config = small_config(tmp_path, attacks=[{"name": "april_analytic"},
                                             {"name": f"{MODULE}:DiesOnce", "options": {"marker": str(marker)}}])
    out = tmp_path / "out"
    command = [sys.executable, str(root / "run_benchmark.py"), "--config", str(config), "--output", str(out),
               "--no-progress", "--attack-workers", "1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), str(root), os.environ.get("PYTHONPATH", "")])}
    first = subprocess.run(command, capture_output=True, text=True, cwd=root, env=env, timeout=600)
    assert first.returncode == 11, first.stderr[-3000:]
    assert marker.exists()
    assert "Traceback" not in first.stderr, first.stderr[-3000:]
    line = next(x for x in first.stderr.splitlines() if x.startswith("error: "))
    assert "DiesOnce" in line or "dies_once" in line, line
    assert "died" in line and "resume" in line, line
    again = subprocess.run(command, capture_output=True, text=True, cwd=root, env=env, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    rows = rows_of(out)
    assert len(rows) == 4 and not any(r["failed"] for r in rows)
