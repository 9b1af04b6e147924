"""Hostile cases of the Flower side: the server's out-dir (links, reuse, damaged files), run-config
keys the benchmark owns, out-of-range federation values, client faults and hung clients."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from clients import runconfig
from server import run as server_run
from server.federation import run_federation
from server.outdir import MARKER, OutDir, OutDirError
from server.rounds import ServerOutcome
from server.tap import load_tapped_updates

ROOT = Path(__file__).resolve().parents[1]
TINY = {"model-kwargs": {"depth": 1}, "num-images": 4, "image-size": 32, "num-server-rounds": 2}

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _run(out: Path, **keys) -> object:
    return run_federation(runconfig.resolve_config({**TINY, "out-dir": str(out), **keys}), engine="inprocess",
                          num_supernodes=2)


# ------------------------------------------------------------------------------------ the out-dir
def test_a_link_planted_in_the_out_dir_is_never_written_through(tmp_path: Path, capsys) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    out = tmp_path / "out"
    out.mkdir()
    (out / "federation.json").symlink_to(victim)
    with pytest.raises(OutDirError, match="not a server run's"):
        _run(out)
    code = server_run.main(["--engine", "inprocess", "--clients", "2", "-c", f"out-dir='{out}' num-images=4",
                            "-c", "num-server-rounds=1"])
    assert code == 3 and "not a server run's" in capsys.readouterr().err
    assert victim.read_text() == "precious"


def test_the_guarded_writer_replaces_a_link_not_its_target(tmp_path: Path) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    out = OutDir.open(tmp_path / "out")
    try:
        (out.updates / "round-0001-global.pt").symlink_to(victim)
        out.save_torch("updates/round-0001-global.pt", {"w": torch.zeros(2)})
    finally:
        out.close()
    assert victim.read_text() == "precious"
    assert not (tmp_path / "out" / "updates" / "round-0001-global.pt").is_symlink()


def test_a_killed_run_is_cleared_and_a_finished_one_is_kept(tmp_path: Path) -> None:
    out = tmp_path / "out"
    _run(out)
    first = (out / "federation.json").read_text()
    with pytest.raises(OutDirError, match="finished run"):  # a finished run is never overwritten
        _run(out)
    assert (out / "federation.json").read_text() == first
    # A run killed after its first round: its marker says unfinished, its updates stay behind.
    (out / "federation.json").unlink()
    (out / MARKER).write_text(json.dumps({"run": "killed", "finished": False}))
    assert server_run.main(["--check", str(out)]) == 3  # no finished run to pass on
    stale = sorted((out / "updates").glob("round-*-node-*.pt"))
    assert len(stale) == 4
    _run(out, seed=1)  # other node ids: the stale files would sit beside the new ones
    assert len(load_tapped_updates(out / "updates")) == 4  # 2 rounds x 2 clients, one run
    assert not any(p.exists() for p in stale)
    assert server_run.main(["--check", str(out)]) == 0


def test_a_second_process_is_refused_while_one_holds_the_out_dir(tmp_path: Path) -> None:
    held = OutDir.open(tmp_path / "out")
    try:
        with pytest.raises(OutDirError, match="in use by another run"):
            _run(tmp_path / "out")
    finally:
        held.close()


def _finished(folder: Path, summary: object = None) -> Path:
    folder.mkdir()
    (folder / MARKER).write_text(json.dumps({"run": "r", "finished": True}))
    if summary is not None:
        (folder / "federation.json").write_text(json.dumps(summary))
    return folder


GOOD = {"run": "r", "ok": True, "history": [{"round": 1, "replies": 2, "sampled": 2}], "failures": [],
        "node_partitions": {}}


@pytest.mark.parametrize("case", ["missing", "history-5", "binary", "empty", "a-folder", "garbage-state", "list"])
def test_check_of_a_damaged_out_dir_is_one_line_and_exit_3(tmp_path: Path, capsys, case: str) -> None:
    folder = tmp_path / "out"
    if case != "missing":
        _finished(folder)
        path = folder / "federation.json"
        if case == "history-5":
            path.write_text(json.dumps({"history": 5}))
        elif case == "binary":
            path.write_bytes(b"\x80\xff\x00\x13")
        elif case == "empty":
            path.write_text("")
        elif case == "a-folder":
            path.mkdir()
        elif case == "list":
            path.write_text("[1, 2]")
        else:
            path.write_text(json.dumps(GOOD))
            (folder / "final_state.pt").write_bytes(b"not a torch file")
    assert server_run.main(["--check", str(folder)]) == 3
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and len(err.splitlines()) == 1 and "Traceback" not in err


@pytest.mark.parametrize("summary", [{**GOOD, "history": []}, {**GOOD, "ok": False}],
                         ids=["empty-history", "ok-false"])
def test_check_fails_an_empty_or_failed_run(tmp_path: Path, summary: dict) -> None:
    assert server_run.main(["--check", str(_finished(tmp_path / "out", summary))]) == 1
    assert server_run.main(["--check", str(_finished(tmp_path / "good", GOOD))]) == 0


# ------------------------------------------------------------------------------- run-config values
@pytest.mark.parametrize("key, value", [("round-timeout", -1.0), ("round-timeout", float("nan")),
                                        ("fraction-train", 0.0), ("fraction-train", -3.0), ("min-nodes", 0),
                                        ("num-images", -5), ("slow-seconds", -1.0)])
def test_out_of_range_federation_values_are_config_errors(key: str, value: object) -> None:
    with pytest.raises(runconfig.ConfigError, match=f"'{key}' must be"):
        runconfig.resolve_config({key: value})
    assert server_run.main(["--engine", "inprocess", "-c", f"{key}={value}".replace("nan", "nan")]) == 3


@pytest.mark.parametrize("options, owner", [("{setting: a}", "settings"), ("{out-dir: /tmp/x}", "output"),
                                            ("{num-images: 2}", "data.num_images"),
                                            ("{model-variant: mjp}", "models[i].variant"),
                                            ("{min-nodes: 1}", "federation.clients")])
def test_benchmark_owned_keys_are_refused_in_federation_options(options: str, owner: str) -> None:
    from benchmark import config as C
    from benchmark.errors import ConfigError
    from benchmark.validation import validate

    key = options.strip("{}").split(":")[0]
    with pytest.raises(ConfigError, match=rf"federation\.options\.{key} .*set {re.escape(owner)}"):
        validate(C.apply_overrides(C.load_config(), [f"federation.options={options}"]))


@pytest.mark.parametrize("options", ["{round-timeout: -1}", "{round-timeout: .nan}", "{fraction-train: 0}",
                                     "{fraction-train: -3}"])
def test_federation_options_are_range_checked(options: str) -> None:
    from benchmark import config as C
    from benchmark.errors import ConfigError
    from benchmark.validation import validate

    with pytest.raises(ConfigError, match="must be a number in"):
        validate(C.apply_overrides(C.load_config(), [f"federation.options={options}"]))


# ----------------------------------------------------------------------------------- client faults
def _benchmark(tmp_path: Path, **changes):
    from benchmark.pipeline import raise_for_errors, run_benchmark
    from benchmark.validation import validate
    from tests.helpers import tiny_config

    cfg = validate(tiny_config(**{"models": tiny_config()["models"][:1], "federation.rounds": 1, **changes}))
    summary = run_benchmark(cfg, str(tmp_path / "out"), progress=False)
    return summary, lambda: raise_for_errors(summary)


def test_a_failed_client_leaves_failed_rows_and_an_exit_that_says_resume(tmp_path: Path) -> None:
    from benchmark.errors import FederationFailed
    from benchmark.store import read_jsonl

    summary, check = _benchmark(tmp_path, **{"federation.options": {"fail-partition": 1}})
    assert (tmp_path / "out" / "table.md").exists()
    with pytest.raises(FederationFailed, match="run the same command again to resume"):
        check()
    assert FederationFailed.exit_code == 7
    failed = [r for r in read_jsonl(tmp_path / "out" / "results.jsonl") if r["failed"]]
    assert len(failed) == 1 and failed[0]["partition_id"] == 1 and "injected failure" in failed[0]["reason"]


def test_a_secagg_dropout_leaves_failed_rows_for_the_round(tmp_path: Path) -> None:
    from benchmark.errors import FederationFailed
    from benchmark.store import read_jsonl

    changes = {"federation.secagg": True, "federation.clients": 3, "data.num_images": 6,
               "federation.options": {"fail-partition": 1}}
    summary, check = _benchmark(tmp_path, **changes)
    with pytest.raises(FederationFailed, match="resume"):
        check()
    rows = list(read_jsonl(tmp_path / "out" / "results.jsonl"))
    # every image of the round (3 clients x batch 1) has a row, failed with the dropout named
    assert len(rows) == 3 and all(r["failed"] and "dropped out" in r["reason"] for r in rows)
    again, check = _benchmark(tmp_path, **changes)  # a re-run retries them, never "0 new"
    assert again.new_rows == 3 and len(list(read_jsonl(tmp_path / "out" / "results.jsonl"))) == 3


# ---------------------------------------------------------------------------------- hung clients
def test_a_hung_client_does_not_keep_the_process_alive(tmp_path: Path) -> None:
    script = ("from clients.runconfig import resolve_config\n"
              "from server.federation import run_federation\n"
              f"cfg = resolve_config({{**{TINY!r}, 'num-server-rounds': 1, 'round-timeout': 8.0, "
              "'slow-partition': 1, 'slow-seconds': 120.0})\n"
              "r = run_federation(cfg, engine='inprocess', num_supernodes=2)\n"
              "print('failures', len(r.failures))\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=100)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "failures" in done.stdout
    assert time.monotonic() - start < 90  # the hung client sleeps 120 s; the process does not wait for it
