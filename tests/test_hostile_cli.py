"""The command line's paths and sweeps, a checkpoint replaced mid-run, and signals during a long step:
each ends in one line with its exit status (benchmark/errors.py), or the run uses what it read first.

On the tiny runs of tests/test_hostile_inputs.py (1 row of a depth-2 32 px ViT, 2 embedded images,
2 clients x 1 round, LPIPS off).
"""
from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from test_hostile_inputs import ROOT, cli, one_line_error, small_config


def _loop(tmp_path: Path) -> Path:
    """A symbolic link that points at itself (resolving it never ends)."""
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    return loop


# ------------------------------------------------------------------ paths from flags and the environment
@pytest.mark.parametrize("flag", ["--images", "--output"])
def test_a_path_flag_that_is_a_symlink_loop_is_one_line(tmp_path: Path, capsys, flag: str) -> None:
    loop = _loop(tmp_path)
    config, out = small_config(tmp_path), tmp_path / "out"
    args = [flag, str(loop)] if flag == "--images" else []
    code = cli(config, loop if flag == "--output" else out, *args)
    assert code == 3
    one_line_error(capsys.readouterr().err, flag, str(loop), "loop of symbolic links")
    assert not out.exists()


def test_a_data_folder_that_is_a_symlink_loop_is_one_line(tmp_path: Path, capsys, monkeypatch) -> None:
    """FEDMJP_DATA naming a loop: a run that reads the data folder says so (exit 4); one that does
    not (embedded images) runs, as with the variable unset."""
    loop = _loop(tmp_path)
    monkeypatch.setenv("FEDMJP_DATA", str(loop))
    config, out = small_config(tmp_path), tmp_path / "out"
    assert cli(config, out, "--images", "$FEDMJP_DATA/images") == 4
    one_line_error(capsys.readouterr().err, "FEDMJP_DATA", str(loop), "loop of symbolic links")
    assert cli(config, out, "--dry-run") == 0


def test_evaluation_with_a_data_folder_that_is_a_symlink_loop_is_one_line(tmp_path: Path, capsys,
                                                                          monkeypatch) -> None:
    from fedmjp.evaluate import EXIT_BAD_INPUT, main

    loop = _loop(tmp_path)
    monkeypatch.setenv("FEDMJP_DATA", str(loop))
    code = main(["--checkpoint", str(ROOT / "checkpoints" / "cifar_deit.safetensors"), "--data-path",
                 "$FEDMJP_DATA/cifar10.tar.gz", "--output-dir", str(tmp_path / "eval"), "--device", "cpu"])
    assert code == EXIT_BAD_INPUT
    one_line_error(capsys.readouterr().err, "FEDMJP_DATA", str(loop))
    assert not (tmp_path / "eval").exists()


# ------------------------------------------------------------------ sweeps
@pytest.mark.parametrize("flags, words", [
    (["--sweep", "gamma=0.1", "--sweep", "gamma=0.5"], ["--sweep gamma", "twice"]),
    (["--sweep", "gamma=0.1,0.1,0.10"], ["gamma=0.1", "more than once"]),
    (["--sweep", "defence.sigma=0,0.0"], ["defence.sigma", "more than once"]),
])
def test_sweep_flags_that_repeat_a_key_or_a_value_are_refused(tmp_path: Path, capsys, flags, words) -> None:
    config, out = small_config(tmp_path), tmp_path / "out"
    assert cli(config, out, *flags) == 3
    one_line_error(capsys.readouterr().err, *words)
    assert not out.exists()


@pytest.mark.parametrize("sweep", [{"gamma": [0.5, 0.50]}, [{"gamma": 0.5}, {"gamma": 0.5}]])
def test_a_config_sweep_that_repeats_a_point_is_refused(tmp_path: Path, capsys, sweep) -> None:
    config, out = small_config(tmp_path, sweep=sweep), tmp_path / "out"
    assert cli(config, out) == 3
    one_line_error(capsys.readouterr().err, "gamma", "more than once")
    assert not out.exists()


# ------------------------------------------------------------------ the output folder
@pytest.mark.parametrize("extra", [[], ["--force"]])
def test_the_file_system_root_as_output_is_a_system_folder(tmp_path: Path, capsys, extra) -> None:
    assert cli(small_config(tmp_path), Path("/"), *extra) == 6
    line = one_line_error(capsys.readouterr().err, "output folder / ", "system folder")
    assert "symbolic link" not in line


def test_a_folder_of_own_files_is_refused_as_not_a_run_before_its_links(tmp_path: Path, capsys) -> None:
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("mine\n")
    (out / "link").symlink_to(out / "notes.txt")
    assert cli(small_config(tmp_path), out) == 6
    one_line_error(capsys.readouterr().err, str(out), "not a fedmjp run folder")
    assert sorted(p.name for p in out.iterdir()) == ["link", "notes.txt"]


# ------------------------------------------------------------------ one checkpoint read per run
def test_a_checkpoint_replaced_between_federations_is_not_read_again(tmp_path: Path) -> None:
    """Settings a and b: two federations. The checkpoint file is replaced by other weights once the
    first one finished; the second one's global model still holds the first file's weights, and
    provenance.json names the hash of that file."""
    from benchmark.config import load_config
    from benchmark.entries import model_spec
    from benchmark.pipeline import run_benchmark
    from benchmark.validation import validate
    from fedmjp.factory import build_model
    from server.federation import run_federation

    checkpoint = tmp_path / "weights.pt"
    cfg = validate(load_config(small_config(tmp_path, settings=["a", "b"])))
    first = {k: v.clone() for k, v in build_model({**model_spec(cfg, 0), "april": None}).state_dict().items()}
    torch.save(first, checkpoint)
    digest = hashlib.sha256(checkpoint.read_bytes()).hexdigest()
    row = {**cfg.models[0].model_dump(), "checkpoint": str(checkpoint)}
    cfg = validate(load_config(small_config(tmp_path, settings=["a", "b"], models=[row])))

    seen: list[dict[str, torch.Tensor]] = []

    def federate(resolved, tap, engine):
        def first_update(update):
            if len(seen) < calls[0]:
                seen.append({k: v.detach().cpu().clone() for k, v in update.global_state.items()})
            tap(update)

        calls[0] += 1
        result = run_federation(resolved, tap=first_update, engine=engine)
        torch.save({k: v + 1.0 if v.is_floating_point() else v for k, v in first.items()}, checkpoint)
        return result

    calls = [0]
    summary = run_benchmark(cfg, str(tmp_path / "out"), federate=federate, progress=False)
    assert summary.federations == 2 and len(seen) == 2
    for state in seen:  # both federations started from the first file's weights
        shared = [k for k in state if k in first]
        assert shared and all(torch.equal(state[k].to(first[k].dtype), first[k]) for k in shared)
    record = json.loads((tmp_path / "out" / "provenance.json").read_text())
    assert record["checkpoints"][cfg.models[0].name] == digest


# ------------------------------------------------------------------ signals during a long step
SLEEPY = '''
import time
from pathlib import Path

from attacks import Attack


class Sleepy(Attack):
    """An attack whose one step takes ten minutes (a huge forward, a long solve)."""

    name = "sleepy"

    def _reconstruct(self, model, update, meta):
        Path(__file__).with_name("started").touch()
        time.sleep(600)
        raise RuntimeError("never reached")
'''


@pytest.mark.slow
@pytest.mark.parametrize("signum, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_ends_the_run_while_an_attack_step_runs_long(tmp_path: Path, signum: int, code: int) -> None:
    """4 rounds: the server fills the attack thread's inbox while its first attack sleeps, so the
    main thread waits on the hand-over; the signal still ends the run within seconds."""
    (tmp_path / "sleepy_attack.py").write_text(SLEEPY)
    config = small_config(tmp_path, **{"attack": {"name": "sleepy_attack:Sleepy"}, "federation.rounds": 4,
                                       "data.num_images": 8})
    out = tmp_path / "out"
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH", "")) if p)}
    proc = subprocess.Popen([sys.executable, str(ROOT / "run_benchmark.py"), "--config", str(config), "--output",
                             str(out), "--no-progress"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=ROOT, env=env)
    try:
        deadline = time.time() + 240
        while time.time() < deadline and proc.poll() is None and not (tmp_path / "started").exists():
            time.sleep(0.05)
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        time.sleep(1.0)  # the server runs on and fills the inbox
        sent = time.monotonic()
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=60)
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == code, err[-3000:]
    assert took < 30, took
    assert "finished rows are kept" in err and "Traceback" not in err
