"""Attacking what a federation captured (benchmark/captured.py) and the ``fedmjp`` entry point.

A tiny federation (2 clients, 1 round, a depth-1 ViT with APRIL's surgery, float64 clients) writes
its out-dir as ``flwr run`` would; the capture is then attacked through the benchmark's pipeline:
APRIL's closed form on those updates is exact, so a near-perfect PSNR shows that the updates, the
model and the rebuilt ground truth belong together. Every bad capture or flag is one error.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest
import torch

from benchmark.errors import ConfigError, InputDataError

ROOT = Path(__file__).resolve().parents[1]
KEYS = {"setting": "c", "num-server-rounds": 1, "num-images": 2, "model-kwargs": {"depth": 1},
        "model-april": "surgery", "model-variant": "plain", "model-name": "ViT", "precision": "float64", "seed": 3}


def make_capture(out: Path, **extra: object) -> Path:
    from clients.runconfig import resolve_config
    from server.federation import run_federation

    result = run_federation(resolve_config({**KEYS, "out-dir": str(out), **extra}), engine="inprocess",
                            num_supernodes=2)
    assert result.ok
    return out


@pytest.fixture(scope="module")
def capture(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_capture(tmp_path_factory.mktemp("cap") / "fl")


def args(*argv: str):
    from benchmark.cli import build_parser

    p = build_parser()
    p.add_argument("--from-captured")
    return p.parse_args(["--attack", "april_analytic", "--set", "metrics.lpips=false", *argv])


def attack(folder: Path, output: Path, *argv: str):
    from benchmark.captured import from_captured
    from benchmark.pipeline import run_benchmark

    cfg, federate = from_captured(args("--from-captured", str(folder), *argv))
    return run_benchmark(cfg, str(output), federate=federate, progress=False)


def test_a_capture_is_attacked_scored_and_resumed(capture: Path, tmp_path: Path) -> None:
    from benchmark.store import RunFolder

    summary = attack(capture, tmp_path / "out")
    rows = RunFolder(tmp_path / "out").rows()
    # 2 clients x 1 round x settings b, c (the captured gradient group): every row scored
    assert summary.new_rows == 4 and summary.failed_rows == 0, rows
    assert {r["setting"] for r in rows} == {"b", "c"} and {r["partition_id"] for r in rows} == {0, 1}
    assert all(r["model"] == "ViT" for r in rows)
    # the same rows as the benchmark's own federation of that run config: updates, model and the
    # rebuilt ground truth belong together
    from benchmark.captured import from_captured
    from benchmark.pipeline import run_benchmark

    cfg, _ = from_captured(args("--from-captured", str(capture)))
    run_benchmark(cfg, str(tmp_path / "live"), progress=False)
    live = {(r["setting"], r["partition_id"]): r for r in RunFolder(tmp_path / "live").rows()}
    for r in rows:
        other = live[(r["setting"], r["partition_id"])]
        assert (r["image_id"], r["psnr"], r["ssim"]) == (other["image_id"], other["psnr"], other["ssim"])
    assert (tmp_path / "out" / "table.md").is_file() and (tmp_path / "out" / "table.csv").is_file()
    again = attack(capture, tmp_path / "out")
    assert again.new_rows == 0 and again.kept_rows == 4


def test_one_setting_of_the_group(capture: Path, tmp_path: Path) -> None:
    attack(capture, tmp_path / "out", "--setting", "c")
    from benchmark.store import RunFolder

    assert {r["setting"] for r in RunFolder(tmp_path / "out").rows()} == {"c"}


@pytest.mark.parametrize("argv, needle", [
    (("--setting", "a"), "scored in setting(s) b, c only"),
    (("--rounds", "3"), "--rounds does not go with --from-captured"),
    (("--images", "embedded"), "--images does not go with --from-captured"),
    (("--set", "federation.lr=0.5"), "federation.lr does not go with --from-captured"),
    (("--set", "models.0.arch=x"), "models.0.arch does not go with --from-captured"),
])
def test_flags_the_capture_fixes_are_refused(capture: Path, argv: tuple, needle: str) -> None:
    from benchmark.captured import from_captured

    with pytest.raises(ConfigError, match=None) as err:
        from_captured(args("--from-captured", str(capture), *argv))
    assert needle in str(err.value)


def test_bad_folders_are_one_line(capture: Path, tmp_path: Path) -> None:
    from benchmark.captured import load_capture

    with pytest.raises(InputDataError, match="no such folder"):
        load_capture(tmp_path / "missing")
    with pytest.raises(InputDataError, match="give its out-dir"):
        load_capture(capture / "updates")
    (tmp_path / "empty").mkdir()
    with pytest.raises(InputDataError, match="federation.json"):
        load_capture(tmp_path / "empty")


def test_updates_without_the_run_config_are_refused(capture: Path, tmp_path: Path) -> None:
    from benchmark.captured import load_capture

    copy = tmp_path / "old"
    shutil.copytree(capture, copy)
    for path in (copy / "updates").glob("round-*-node-*.pt"):
        payload = torch.load(path, weights_only=True)
        header = json.loads(payload["header"])
        header["metadata"].pop("run-config")
        torch.save({**payload, "header": json.dumps(header)}, path)
    with pytest.raises(InputDataError, match="do not carry the server's run config"):
        load_capture(copy)


def test_no_ground_truth_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    from benchmark.captured import from_captured
    from PIL import Image

    images = tmp_path / "private"
    (images / "a").mkdir(parents=True)
    for i in range(2):
        Image.new("RGB", (32, 32), (40 * i, 90, 200)).save(images / "a" / f"{i}.png")
    folder = make_capture(tmp_path / "fl", images=str(images))
    shutil.rmtree(images)  # the clients' images live on their machines, not here
    with pytest.raises(InputDataError, match="no ground truth"):
        from_captured(args("--from-captured", str(folder), "--output", str(tmp_path / "out")))
    assert not (tmp_path / "out").exists()


def test_entry_point_is_declared_and_answers_fast() -> None:
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    module, _, func = scripts["fedmjp"].partition(":")
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", f"import sys; from {module} import {func}; sys.exit({func}())",
                           "--help"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert time.perf_counter() - t0 < 10 and done.returncode == 0, done.stderr
    for command in ("run", "attack-captured", "check-server", "train", "stop-superlink"):
        assert f"  {command} " in done.stdout
    # the dispatcher loads no model code for --help
    probe = subprocess.run([sys.executable, "-c", f"import sys; import {module}; {module}.main(['--help']); "
                            "print('torch' in sys.modules, 'flwr' in sys.modules)"],
                           cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert probe.stdout.strip().endswith("False False"), probe.stdout + probe.stderr
    bad = subprocess.run([sys.executable, "-m", module, "nonsense"], cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    assert bad.returncode == 2 and "unknown command 'nonsense'" in bad.stderr and "Traceback" not in bad.stderr


def test_check_server_is_server_run_check(capture: Path, tmp_path: Path) -> None:
    from benchmark.console import main

    assert main(["check-server", str(capture)]) == 0
    assert main(["check-server", str(tmp_path / "missing")]) != 0


def test_setup_installs_the_entry_point(tmp_path: Path) -> None:
    """``scripts/setup.sh`` (pip install -e, run by scripts/test.sh before the tests) puts a working
    ``fedmjp`` next to the Python that runs the suite, as pyproject.toml's [project.scripts] says."""
    script = Path(sys.executable).parent / "fedmjp"
    assert script.is_file(), f"{script} is missing: install the project with bash scripts/setup.sh"
    res = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert res.returncode == 0 and "attack-captured" in res.stdout, res.stderr
