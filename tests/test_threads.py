"""fedmjp.threads: a process whose daemon thread is still inside torch ends with the status it chose.

Without :func:`fedmjp.threads.exit_process` (``sys.exit`` with such a thread alive), CPython's
finalisation ends the thread inside a C++ frame and the process aborts with 134 ("terminate called
without an active exception"); the CLI's "error: ... File too large ...; resume" run ended that way
(tests/test_hostile_inputs.py::test_file_size_limit).
"""
from __future__ import annotations

import subprocess
import sys
import textwrap
import time

SCRIPT = textwrap.dedent("""
    import atexit, sys, time
    import torch
    from fedmjp.threads import exit_process, start_daemon

    def churn():  # frees tensors for ever: the GIL is taken back inside torch's C++ code
        while True:
            xs = [torch.ones(64) for _ in range(200)]
            del xs

    def short():
        time.sleep(0.3)

    atexit.register(lambda: print("finalised", flush=True))
    start_daemon(churn if sys.argv[1] == "forever" else short, "worker")
    time.sleep(0.3)
    print("rows written", end="")  # no newline and no flush: exit_process must flush it
    exit_process(10, grace=float(sys.argv[2]))
""")


def _run(kind: str, grace: float) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", SCRIPT, kind, str(grace)], capture_output=True, text=True,
                          timeout=120, env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin",
                                            "PYTHONPATH": ":".join(sys.path)})
    return proc, time.monotonic() - t0


def test_a_thread_still_inside_torch_does_not_turn_the_status_into_an_abort() -> None:
    # with sys.exit instead, 8 runs of 8 aborted with 134 (on 2 cores, CPython 3.11)
    proc, _ = _run("forever", 0.2)
    assert proc.returncode == 10, proc.stderr[-2000:]
    assert "terminate called" not in proc.stderr
    assert proc.stdout.startswith("rows written")  # flushed before leaving
    assert "finalised" not in proc.stdout  # left without finalising: the thread never ended


def test_threads_that_finish_within_the_grace_get_a_normal_exit() -> None:
    proc, _ = _run("short", 5.0)
    assert proc.returncode == 10, proc.stderr[-2000:]
    assert proc.stdout == "rows writtenfinalised\n"  # atexit handlers ran: the interpreter finalised


def test_the_grace_bounds_the_wait() -> None:
    import threading

    from fedmjp.threads import running, start_daemon, wait_for_daemons

    # Other tests in this process may leave daemon threads of their own (a client hung past its
    # round timeout), so only this test's thread is asserted on.
    stop = threading.Event()
    thread = start_daemon(stop.wait, "waits", 30.0)
    t0 = time.monotonic()
    left = wait_for_daemons(0.5)
    waited = time.monotonic() - t0
    stop.set()
    assert 0.45 < waited < 5.0 and thread in left  # waited for the grace, then gave up on the thread
    thread.join(5.0)
    assert not thread.is_alive() and thread not in running()  # a thread that ends leaves the list
