"""fedmjp.allocator: glibc keeps freed memory for reuse; FEDMJP_MALLOC=default opts out."""
from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

glibc_only = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                                reason="glibc only")

CODE = "from fedmjp.allocator import tune_malloc; print(tune_malloc(), tune_malloc())"


def _run(**env: str) -> str:
    done = subprocess.run([sys.executable, "-c", CODE], env={**os.environ, **env}, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@glibc_only
def test_tune_malloc_applies_once_on_glibc_and_can_be_turned_off():
    assert _run(FEDMJP_MALLOC="") == "True True"
    assert _run(FEDMJP_MALLOC="default") == "False False"


# A client thread's round in miniature, six times: ~72 MB of 2.4 MB gradient-like tensors (a DeiT-S
# reply's largest arrays), their bytes copies (the encoded reply), then both freed; prints the page
# faults of the last three rounds (steady state), then glibc's malloc_stats (one "Arena i:" per arena)
# goes to stderr.
STEADY = """
import ctypes, resource, sys, threading, torch
import fedmjp.allocator as allocator
allocator.ARENA_MAX = int(sys.argv[1])
print(allocator.tune_malloc())
torch.set_num_threads(1)  # the pages are touched (and faulted) by this thread, not an OpenMP worker
faults = []
def client():
    for i in range(6):
        before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        grads = [torch.ones(600_000) for _ in range(30)]
        reply = [bytes(memoryview(g.numpy()).cast("B")) for g in grads]  # the encoded reply
        del grads, reply
        faults.append(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before)
thread = threading.Thread(target=client)
thread.start()
thread.join()
print(sum(faults[3:]), flush=True)
ctypes.CDLL("libc.so.6").malloc_stats()
"""


def _steady(arena_max: int) -> tuple[int, int]:
    """(page faults of the thread's last three rounds, glibc arenas) with ``M_ARENA_MAX`` at
    ``arena_max`` (0: glibc's default, up to 8 per core)."""
    env = {k: v for k, v in os.environ.items()  # glibc's own tunables off: they would set the arenas
           if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    done = subprocess.run([sys.executable, "-c", STEADY, str(arena_max)], env={**env, "FEDMJP_MALLOC": ""},
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    applied, faults = done.stdout.split()
    assert applied == "True"
    return int(faults), sum(line.startswith("Arena ") for line in done.stderr.splitlines())


@glibc_only
def test_a_threads_freed_memory_is_reused_without_page_faults():
    """A thread's own arena unmaps an emptied 64 MiB heap whatever the trim threshold, so each round
    would fault its ~35,000 pages in again; with one arena the main heap keeps them."""
    pages = 3 * 2 * 30 * 600_000 * 4 // 4096  # touched in three rounds
    faults, arenas = _steady(1)
    assert arenas == 1 and faults < pages // 20
    faults, arenas = _steady(0)  # the control: glibc's per-thread arena, and the faults come back
    assert arenas >= 2 and faults > pages // 10
