"""The command line answers before the model code loads: ``--help`` imports neither torch, timm,
Flower nor matplotlib, and the parser's written-out choices are the config's."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PROBE = """
import contextlib, io, sys
sys.argv = ["run_benchmark.py", "--help"]
import run_benchmark
with contextlib.redirect_stdout(io.StringIO()) as out:
    try:
        run_benchmark.main(["--help"])
    except SystemExit:
        pass
assert "--estimate" in out.getvalue() and "--list" in out.getvalue()
print(",".join(m for m in ("torch", "timm", "flwr", "matplotlib", "pandas") if m in sys.modules))
"""


def test_help_imports_no_heavy_module() -> None:
    got = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert got.returncode == 0, got.stderr
    assert got.stdout.strip() == "", f"--help imported {got.stdout.strip()}"


def test_a_config_error_loads_no_flower_matplotlib_or_pipeline() -> None:
    probe = ("import sys, run_benchmark\n"
             "rc = run_benchmark.main(['--set', 'federation.lr=abc'])\n"
             "print(rc, ','.join(m for m in ('flwr', 'matplotlib', 'ray', 'benchmark.pipeline') if m in sys.modules))")
    got = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert got.stdout.split() == ["3"], got.stdout + got.stderr
    assert "federation.lr" in got.stderr and "Traceback" not in got.stderr


def test_written_out_choices_are_the_configs() -> None:
    from benchmark import cli
    from benchmark.config import ENGINES
    from fedmjp.settings import SETTINGS

    assert cli.SETTING_CHOICES == (*SETTINGS, "all")
    assert cli.ENGINE_CHOICES == ENGINES


def test_list_names_the_presets_model_rows_and_each_attacks_needs(capsys) -> None:
    from run_benchmark import main

    assert main(["--list"]) == 0
    out = capsys.readouterr().out
    for row in ("ViT", "DeiT-noPE", "DeiT+MJP", "DeiT-std"):  # configs/default.yaml's rows, the --models names
        assert f"\n  {row} " in out
    assert "no checkpoint" in out
    april = next(line for line in out.splitlines() if line.strip().startswith("april_analytic "))
    assert "batch 1 per update" in april and "labels not needed" in april


def test_estimate_prints_the_plan_and_exits_without_a_folder(tmp_path: Path, capsys) -> None:
    from run_benchmark import main

    out = tmp_path / "run"
    assert main(["--estimate", "--setting", "all", "--set", "federation.batch_size=4", "--num-images", "8",
                 "--clients", "2", "--output", str(out)]) == 0
    text = capsys.readouterr().out
    assert not out.exists()
    line = next(x for x in text.splitlines() if x.startswith("batch_match"))
    # 5 model rows x 2 federations (clean, shuffled) x 2 rounds x 2 clients; rows: x 4 images x 3 settings
    assert line.split()[2:4] == ["40", "240"]
    assert "estimate:" in text


def test_every_built_in_attack_declares_its_threat_model() -> None:
    """--list's line per attack says what it needs: each built-in declares a Threat (no fallback text)."""
    from attacks.api.registry import _REGISTRY, Threat, attack_summary, attack_threat

    built_in = [n for n, cls in _REGISTRY.items() if getattr(cls, "__module__", "").startswith("attacks.")]
    assert len(built_in) >= 16  # other test modules register their own attacks in this process: not these
    for name in sorted(built_in):
        assert isinstance(attack_threat(name), Threat), name
        assert not attack_summary(name).startswith("threat model not declared"), name


def test_the_estimate_prefers_costs_measured_on_weights_like_the_rows() -> None:
    """An optimisation attack's cost on trained weights is not its cost on fresh ones: a trained row
    is estimated from trained entries, a fresh row from fresh ones, each scaled by its size."""
    from benchmark.estimate import ModelSize, per_call

    costs = [{"attack": "a", "device": "cpu", "params": 100, "tokens": 10, "batch_size": 1, "image_size": 32,
              "trained": False, "seconds": 1.0},
             {"attack": "a", "device": "cpu", "params": 100, "tokens": 10, "batch_size": 1, "image_size": 32,
              "trained": True, "seconds": 60.0}]
    size = ModelSize(200, 10)
    assert per_call(costs, "a", "cpu", size, 1, 32, None, trained=False) == 2.0
    assert per_call(costs, "a", "cpu", size, 1, 32, None, trained=True) == 120.0
    assert per_call(costs[:1], "a", "cpu", size, 1, 32, None, trained=True) == 2.0  # none alike: the nearest
    assert per_call(costs, "b", "cpu", size, 1, 32, None) is None
