"""The test suite's own settings: a hung test fails after pyproject.toml's default timeout
(pytest-timeout) instead of holding CI, and scripts/test.sh reports the slowest tests and keeps the
slow ones out of ``--fast`` only, so that what leaves the fast loop stays in the full suite.
"""
from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_every_test_runs_under_a_default_timeout(pytestconfig: pytest.Config) -> None:
    assert pytestconfig.pluginmanager.hasplugin("timeout"), "pytest-timeout is not installed (the test extra)"
    ini = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    # long enough for the slowest legitimate test on a loaded 2-core machine, short of a CI job's limit
    assert 300 <= float(ini["timeout"]) <= 1800
    assert float(pytestconfig.getini("timeout")) == float(ini["timeout"])


def test_the_test_script_reports_durations_and_fast_only_deselects_slow() -> None:
    script = (ROOT / "scripts" / "test.sh").read_text()
    call = next(line for line in script.splitlines() if line.startswith("python3 -m pytest"))
    assert re.search(r"--durations=\d+", call), call
    assert 'marker=(-m "not slow")' in script and "--fast" in script
