"""README's `flwr run .` lines work as written: read from README.md, pasted into a shell that has no
FLWR_* variable of the test suite (only PATH, HOME and a temporary FLWR_HOME), in this environment.

The local SuperLink that `flwr run` starts keeps running after it returns; the README's next line
(`fedmjp stop-superlink`) stops it: after both lines no process naming the temporary FLWR_HOME may
be left (one left is killed, and the test fails). Its two ports are moved to free ones so that a
SuperLink someone left running on the defaults (started without the variable) cannot answer instead.
"""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from proc_utils import free_port, kill_pids, pids_with_argument

from server.rounds import ServerOutcome
from server.tap import load_tapped_updates

ROOT = Path(__file__).resolve().parents[1]
#: the pattern a fresh-clone check uses: `flwr run .` on the local default federation
FLWR_LINE = re.compile(r"^\s*([A-Z_]+=[^ ]+ )*flwr run \. (--|-c|$)")


def readme_flwr_lines() -> list[str]:
    """Every `flwr run .` line of README.md, continuation lines (trailing backslash) joined."""
    lines = (ROOT / "README.md").read_text().splitlines()
    found = []
    for i, line in enumerate(lines):
        if FLWR_LINE.match(line):
            cmd = line.strip()
            j = i
            while cmd.endswith("\\"):
                j += 1
                cmd = cmd[:-1] + " " + lines[j].strip()
            found.append(cmd)
    return found


def readme_stop_line() -> str:
    """The README's line that stops the SuperLink `flwr run` left running."""
    lines = [line.split("#")[0].strip() for line in (ROOT / "README.md").read_text().splitlines()]
    found = [line for line in lines if line == "fedmjp stop-superlink"]
    assert found, "README.md lost its `fedmjp stop-superlink` line after `flwr run`"
    return found[0]


def fedmjp_on_path(tmp_path: Path) -> str:
    """A PATH entry with ``fedmjp``: the installed one next to this Python, else the same entry
    point (pyproject's [project.scripts]) run from this checkout."""
    if shutil.which("fedmjp", path=str(Path(sys.executable).parent)):
        return str(Path(sys.executable).parent)
    shim = tmp_path / "bin"
    shim.mkdir(exist_ok=True)
    (shim / "fedmjp").write_text(f"#!/bin/sh\ncd {ROOT} && exec {sys.executable} -m benchmark.console \"$@\"\n")
    (shim / "fedmjp").chmod(0o755)
    return str(shim)


def test_readme_has_a_self_contained_flwr_line() -> None:
    lines = readme_flwr_lines()
    assert lines, "README.md lost its `flwr run .` line"
    for cmd in lines:
        # the line itself carries the switch: pasted alone it must not build a second environment
        assert "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1" in cmd.split("flwr run")[0], cmd
        assert "out-dir=" in cmd, cmd


def test_requires_python_admits_only_what_flwr_supports() -> None:
    import tomllib

    spec = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    assert spec.replace(" ", "") == ">=3.11"


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("flwr", path=str(Path(sys.executable).parent)) is None,
                    reason="Flower CLI not installed next to this Python")
@pytest.mark.parametrize("cmd", readme_flwr_lines())
def test_readme_flwr_line_runs_as_written(cmd: str, tmp_path: Path) -> None:
    out = tmp_path / "fl-out"
    cmd = re.sub(r"out-dir='[^']*'", f"out-dir='{out}'", cmd)
    home = tmp_path / "flwr-home"
    cmd = f"{cmd}\n{readme_stop_line()}"  # pasted as the README shows them: the run, then the stop
    env = {"PATH": f"{fedmjp_on_path(tmp_path)}:{Path(sys.executable).parent}:/usr/bin:/bin", "HOME": str(tmp_path),
           "FLWR_HOME": str(home),
           "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(free_port()), "FLWR_LOCAL_CONTROL_API_PORT": str(free_port())}
    for attempt in range(2):
        left: list[int] = []
        try:
            done = subprocess.run(["bash", "-c", cmd], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
            left = pids_with_argument(str(home))
        finally:
            kill_pids(pids_with_argument(str(home)))
        # `flwr run` gives its local SuperLink a fixed 15 s to start (flwr/cli/local_superlink.py,
        # LOCAL_SUPERLINK_STARTUP_TIMEOUT): on a loaded 2-core machine it can miss it. That is Flower's
        # start-up, not the README's line: one more try, on fresh ports, before judging the line.
        if "Failed to start local SuperLink within" not in done.stdout + done.stderr:
            break
        env.update(FLWR_LOCAL_SUPERLINK_HTTP_API_PORT=str(free_port()), FLWR_LOCAL_CONTROL_API_PORT=str(free_port()))
    log = done.stdout[-3000:] + done.stderr[-3000:]
    assert done.returncode == 0, log
    assert not left, f"processes left after the README's lines: {left}\n{log}"
    assert "stopped the local SuperLink" in done.stdout, log
    # Flower's exit code 608 (runtime dependency installation failed) or a uv call: as words, so that a
    # timing like 'seconds': '7.1608e-01' in the log cannot match
    assert not re.search(r"code\W{0,3}608\b", log, re.I) and not re.search(r"\buv\b", done.stderr, re.I), log
    outcome = ServerOutcome.load(out)  # flwr run exits 0 on a failed run: check what the server wrote
    assert outcome.ok and outcome.failures == [], log
    updates = load_tapped_updates(out / "updates")
    assert len(updates) >= 2 and {u.partition_id for u in updates} == {0, 1}
