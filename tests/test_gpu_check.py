"""bench/gpu_check.py: the prepared GPU check runs end to end on the CPU (``--device cpu --quick``),
records every part, keeps going past a failing or overlong part, and refuses bad input in one line."""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from test_bench_scripts import load_bench


@pytest.mark.slow
def test_quick_cpu_run_records_every_part_ok(tmp_path: Path) -> None:
    bench = load_bench("gpu_check")
    code = bench.main(["--device", "cpu", "--quick", "--out", str(tmp_path)])
    record = json.loads((tmp_path / "gpu_check.json").read_text())
    assert list(record["parts"]) == [name for name, _, _ in bench.PARTS]
    # every part runs with --quick, data folder or not (the CIFAR preset falls back to bundled images,
    # LPIPS to a seeded trunk)
    for name, part in record["parts"].items():
        assert part["status"] == "ok", (name, part.get("error"), part.get("result", {}).get("checks"))
    assert code == 0
    parts = {n: p.get("result", {}) for n, p in record["parts"].items()}
    assert {r["attack"] for r in parts["closed_forms"]["rows"]} == {"pe_closed_form", "april_analytic"}
    # a clean float64 update: the closed form is exact on both copies of the update
    plain64 = [r for r in parts["closed_forms"]["rows"] if r["update"] == "float64 clients, plain"]
    assert all(r["psnr_cpu"] > 80 and r["psnr_device_vs_cpu"] > 80 for r in plain64)
    assert parts["pytest_cuda"]["exit_status"] in (0, 5)
    assert parts["mjp_adaptive"]["checks"]["span fit ran"] and parts["mjp_adaptive"]["span_iterations_run"] > 0
    assert parts["metrics"]["lpips_pairs_per_s"] > 0 and parts["metrics"]["ssim_pairs_per_s"] > 0
    assert parts["preset_default"]["rows"] > 0 and parts["preset_cifar"]["rows"] > 0
    assert parts["projection"]["updates"] == 5 * 2 * 999
    assert all(v is not None for v in parts["projection"]["s_per_image"].values())
    assert parts["span_lm"]["checks"]["span_lm 32 px: device = CPU"] and len(parts["span_lm"]["iterations"]) == 1
    assert "| closed_forms | ok |" in (tmp_path / "gpu_check.md").read_text()
    assert "span_lm at 32 px" in (tmp_path / "gpu_check.md").read_text()


def test_a_failing_or_overlong_part_is_recorded_and_the_next_part_runs(tmp_path: Path, monkeypatch) -> None:
    bench = load_bench("gpu_check")

    def broken(ctx):
        raise RuntimeError("boom\nsecond line of the message")

    def slow(ctx, seconds):
        time.sleep(5)
        return {"checks": {}}

    monkeypatch.setattr(bench, "PARTS", [("broken", 10, broken), ("slow", 0.2, slow), ("env", 30, bench.part_env)])
    code = bench.main(["--device", "cpu", "--quick", "--out", str(tmp_path), "--budget-scale", "1"])
    parts = json.loads((tmp_path / "gpu_check.json").read_text())["parts"]
    assert parts["broken"]["status"] == "error" and "boom" in parts["broken"]["error"]
    table = (tmp_path / "gpu_check.md").read_text().splitlines()
    assert any(ln.startswith("| broken |") and "second line" in ln for ln in table)  # one row, one line
    assert parts["slow"]["status"] == "timeout" and parts["slow"]["seconds"] < 4
    assert parts["env"]["status"] == "ok" and parts["env"]["result"]["device"] == "cpu"
    assert code == 1


@pytest.mark.parametrize("argv,message", [
    (["--device", "tpu"], "device"),
    (["--device", "cuda:7"], "cuda:7"),  # no CUDA here; on a GPU machine, no eighth GPU
    (["--device", "cpu", "--budget-scale", "0"], "--budget-scale"),
])
def test_bad_arguments_are_one_line_errors(tmp_path: Path, capsys, argv, message) -> None:
    bench = load_bench("gpu_check")
    assert bench.main([*argv, "--quick", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and message in err and "\n" not in err


def test_a_lost_cuda_context_stops_the_in_process_parts_not_the_others(tmp_path: Path, monkeypatch) -> None:
    """After a device-side assert every CUDA call of the process fails: the parts after it that run in
    this process are 'not run' with the part that lost it named, the parts with their own processes run."""
    bench = load_bench("gpu_check")
    ran = []

    def asserting(ctx):
        raise RuntimeError("CUDA error: device-side assert triggered")

    def in_process(ctx):
        ran.append("in_process")
        return {"checks": {}}

    def own_process(ctx):
        ran.append("env")
        return {"checks": {}}

    monkeypatch.setattr(bench, "PARTS", [("closed_forms", 10, asserting), ("metrics", 10, in_process),
                                         ("env", 10, own_process)])
    record = bench.run_parts(bench.Context(device=torch.device("cpu"), quick=True, out=tmp_path, data=None),
                             None, 1.0, "test")
    assert ran == ["in_process", "env"]  # on the CPU a CUDA error loses nothing
    ran.clear()
    monkeypatch.setattr(bench.Context, "cuda", property(lambda self: True))
    monkeypatch.setattr(bench.Context, "sync", lambda self: None)
    record = bench.run_parts(bench.Context(device=torch.device("cpu"), quick=True, out=tmp_path, data=None),
                             None, 1.0, "test")
    parts = record["parts"]
    assert parts["closed_forms"]["status"] == "error"
    assert parts["metrics"]["status"] == "not run" and "closed_forms" in parts["metrics"]["error"]
    assert ran == ["env"] and parts["env"]["status"] == "ok"
