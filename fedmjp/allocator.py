"""Keep freed memory for reuse in glibc's malloc: large CPU tensors stop paying page faults.

The benchmark allocates and frees tens of megabytes per client update: a DeiT-S state is ~88 MB,
sent and received as Flower messages (serialised to bytes and back), cloned, and the backward pass
allocates a gradient of every weight. glibc serves blocks above its mmap threshold (128 KiB, raised
dynamically up to 32 MiB) with fresh mmaps and gives freed heap memory back to the OS above its
trim threshold, so each of those allocations faults its pages in again: measured on a 2-core
machine, Flower's encode and decode of a DeiT-S state took 66 ms each, and 16-18 ms with the
settings below; one DeiT-S/224 forward+backward 279 ms, and 219 ms.

:func:`tune_malloc` sets ``M_MMAP_THRESHOLD`` to 32 MiB (glibc's maximum: every weight array and
activation below it comes from the heap) and ``M_TRIM_THRESHOLD`` to 1 GiB (freed heap memory is
kept for the next allocation), the same knobs as the ``MALLOC_MMAP_THRESHOLD_`` /
``MALLOC_TRIM_THRESHOLD_`` environment variables, set from inside the process because users run
``python run_benchmark.py`` in a plain shell. PyTorch's CPU tuning guide reaches the same end with
jemalloc or tcmalloc preloaded; this needs no extra library. Trade-off: the process keeps its peak
heap instead of returning it to the OS between rounds. ``FEDMJP_MALLOC=default`` leaves glibc as is.
Elsewhere (macOS, musl, Windows) this is a no-op.
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
MMAP_THRESHOLD = 32 * 1024 * 1024  # glibc's upper limit on 64-bit
TRIM_THRESHOLD = 1024**3  # mallopt takes an int

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
    ok = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    if not ok:
        _logger.debug("glibc mallopt refused the thresholds; malloc left as is")
    return ok
