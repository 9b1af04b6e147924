"""Daemon worker threads, and the end of a process that may still run some.

The federation's client threads (``server.federation.DaemonPool``) and the benchmark's attack
threads are daemon threads, so that a client hung past its round timeout, or an attack inside a
long step after an abort, never keeps the process alive. A daemon thread still running when the
interpreter finalises is a hazard of its own, though: CPython ends it with ``pthread_exit`` the
moment it asks for the GIL again, and when that happens inside a C++ frame (torch frees a tensor
with the GIL released, then takes it back) the forced unwind meets a ``noexcept`` frame and
``std::terminate`` aborts the whole process, so the status the CLI chose (10: a full disk, 130:
Ctrl-C) becomes 134 (SIGABRT, "terminate called without an active exception").

:func:`exit_process` is therefore how the project's command-line programs end: it gives the daemon
threads started through :func:`start_daemon` a bounded time to finish their current call, and if
one is still running it flushes the output and leaves without finalising (``os._exit``), which
skips nothing the run needs (rows and tables are written and synced before the CLI returns).
Pinned by tests/test_threads.py and tests/test_hostile_inputs.py::test_file_size_limit.
"""
from __future__ import annotations

import logging
import os
import sys
import threading
import time
import weakref
from typing import Any, Callable, NoReturn

#: How long :func:`exit_process` waits, in all, for the daemon threads to finish their current call
#: (a client's local training on the tiny model, a scoring step) before it leaves without them.
EXIT_GRACE_SECONDS = 5.0

_started: "weakref.WeakSet[threading.Thread]" = weakref.WeakSet()
_lock = threading.Lock()


def start_daemon(target: Callable[..., Any], name: str, *args: Any) -> threading.Thread:
    """Start ``target(*args)`` in a daemon thread that :func:`exit_process` waits for."""
    thread = threading.Thread(target=target, name=name, args=args, daemon=True)
    with _lock:
        _started.add(thread)
    thread.start()
    return thread


def running() -> list[threading.Thread]:
    """The daemon threads of :func:`start_daemon` still alive (the calling thread left out)."""
    with _lock:
        threads = list(_started)
    return [t for t in threads if t.is_alive() and t is not threading.current_thread()]


def wait_for_daemons(grace: float = EXIT_GRACE_SECONDS) -> list[threading.Thread]:
    """Join the live daemon threads for at most ``grace`` seconds in all; returns those still alive."""
    deadline = time.monotonic() + max(0.0, grace)
    for thread in running():
        thread.join(timeout=max(0.0, deadline - time.monotonic()))
    return running()


def exit_process(code: int, grace: float = EXIT_GRACE_SECONDS) -> NoReturn:
    """End the process with status ``code``: a normal exit once the daemon threads have finished
    (within ``grace`` seconds), else flush and ``os._exit(code)`` (see the module's docstring)."""
    if not wait_for_daemons(grace):
        sys.exit(code)
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):  # a closed or missing stream: nothing left to flush
            pass
    os._exit(code)
