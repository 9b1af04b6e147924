"""fedmjp.allocator: glibc keeps freed memory for reuse; FEDMJP_MALLOC=default opts out."""
from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

CODE = "from fedmjp.allocator import tune_malloc; print(tune_malloc(), tune_malloc())"


def _run(**env: str) -> str:
    done = subprocess.run([sys.executable, "-c", CODE], env={**os.environ, **env}, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_tune_malloc_applies_once_on_glibc_and_can_be_turned_off():
    assert _run(FEDMJP_MALLOC="") == "True True"
    assert _run(FEDMJP_MALLOC="default") == "False False"
