"""Small process-level helpers shared by the command-line tools."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def tune_allocator() -> bool:
    """Keep freed memory in the process (glibc) so large per-step tensors skip page faults.

    PyTorch's CPU allocator takes every large tensor straight from ``malloc``, which
    maps fresh pages for blocks above glibc's mmap threshold and returns them on free;
    touching the new pages again at every step costs about 0.5 ms per MB on the machines
    this project runs on (6-7% of a training step at the benchmark sizes, measured with
    ``crtn-bench``). Raising the mmap and trim thresholds makes glibc reuse the memory
    instead, like a caching allocator (the resident size then stays at its peak).

    A no-op on non-glibc systems or when ``CRTN_NO_MALLOC_TUNING`` is set. Call it once,
    before large allocations. Returns whether the thresholds were set.
    """
    if os.environ.get("CRTN_NO_MALLOC_TUNING") or not sys.platform.startswith("linux"):
        return False
    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and others have no mallopt
        return False
    ok = mallopt(_M_MMAP_THRESHOLD, 1 << 30) == 1
    ok = mallopt(_M_TRIM_THRESHOLD, (1 << 31) - 1) == 1 and ok
    return ok
