"""Keep freed memory for reuse in glibc's malloc: large CPU tensors stop paying page faults.

The benchmark allocates and frees tens of megabytes per client update: a DeiT-S state is ~88 MB,
sent and received as Flower messages (serialised to bytes and back), cloned, and the backward pass
allocates a gradient of every weight. glibc serves blocks above its mmap threshold (128 KiB, raised
dynamically up to 32 MiB) with fresh mmaps and gives freed heap memory back to the OS above its
trim threshold, so each of those allocations faults its pages in again (docs/speed.md, "What the
engine does for speed", measures what the settings below save).

:func:`tune_malloc` sets ``M_MMAP_THRESHOLD`` to 32 MiB (glibc's maximum: every weight array and
activation below it comes from the heap), ``M_TRIM_THRESHOLD`` to 1 GiB (freed heap memory is
kept for the next allocation) and ``M_ARENA_MAX`` to 1 (every thread allocates from the one main
heap), the same knobs as the ``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_`` /
``MALLOC_ARENA_MAX`` environment variables, set from inside the process because users run
``python run_benchmark.py`` in a plain shell; call it before the process starts threads (the arena
limit binds threads that have not allocated yet).

Why one arena: the clients of the in-process engine and the attack thread would each get a
per-thread arena, made of 64 MiB heap mappings that the trim threshold does not cover: when a heap
empties, ``heap_trim`` unmaps it whole. A DeiT-S client empties and refills its heaps every round
(gradients, the 88 MB reply), so every round would fault its pages in again. ``M_TOP_PAD`` at a
heap's size (64 MiB) keeps those heaps too, but each arena then holds its own peak, so one arena
costs less memory as well (docs/speed.md).

PyTorch's CPU tuning guide reaches the same end with jemalloc or tcmalloc preloaded; this needs no
extra library. Trade-off: the process keeps its peak heap instead of returning it to the OS between
rounds. ``FEDMJP_MALLOC=default`` leaves glibc as is. Elsewhere (macOS, musl, Windows) this is a no-op.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os
import platform

_logger = logging.getLogger(__name__)

#: mallopt parameter numbers from glibc's <malloc.h>.
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8
MMAP_THRESHOLD = 32 * 1024 * 1024  # glibc's upper limit on 64-bit
TRIM_THRESHOLD = 1024**3  # mallopt takes an int
ARENA_MAX = 1

@functools.cache
def tune_malloc() -> bool:
    """Apply the settings above once per process; True if glibc took them. The outcome is cached
    (the ClientApp calls this every round; ``platform.libc_ver`` reads the interpreter's binary)."""
    if os.environ.get("FEDMJP_MALLOC", "").strip().lower() == "default":
        return False
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = all(bool(mallopt(param, value)) for param, value in (
        (M_MMAP_THRESHOLD, MMAP_THRESHOLD), (M_TRIM_THRESHOLD, TRIM_THRESHOLD), (M_ARENA_MAX, ARENA_MAX)))
    if not ok:
        _logger.debug("glibc mallopt refused the settings; malloc left as is")
    return ok
