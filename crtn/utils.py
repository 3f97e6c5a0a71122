"""Small process-level helpers shared by the command-line tools."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import torch

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def tune_allocator() -> bool:
    """Keep freed memory in the process (glibc) so large per-step tensors skip page faults.

    PyTorch's CPU allocator takes every large tensor straight from ``malloc``, which
    maps fresh pages for blocks above glibc's mmap threshold and returns them on free;
    touching the new pages again at every step costs about 0.5 ms per MB on the machines
    this project runs on (6-7% of a training step at the benchmark sizes, measured with
    ``crtn-bench``). Raising the mmap and trim thresholds makes glibc reuse the memory
    instead, like a caching allocator (the resident size then stays at its peak). The heap can
    fragment: with many differently sized per-step tensors (selection inside attention) the
    resident size can grow well past the live tensors for hundreds of steps, and the steps that
    grow it still fault in fresh pages. The faults stop long before the resident size levels off,
    and the step's ratio to Transformer-XL's stays what it was while they lasted
    (docs/results.md, "The heap's growth and the side-by-side ratios").

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


def flush_denormals() -> bool:
    """Make this process's CPU arithmetic flush denormal floats to zero (FTZ and DAZ).

    As a model trains, some float32 values (small gradients, Adam's second moments, products of
    near-zero activations) fall below 1.2e-38, where x86 CPUs take a slow path for every
    operation on them, and a CPU run slows down as it goes (docs/results.md, "The default cache",
    measures it on the recall task, with the same losses either way). Flushing changes only
    values below float32's normal range.

    The mode is a per-thread register that a new thread copies from the one that creates it, so
    this must run before the first parallel operation of the process, when the intra-op threads
    do not exist yet; the command-line apps call it as their job starts. A no-op on CUDA tensors.

    Returns:
        whether the mode is on and a parallel product of denormals comes out zero in every
        thread: False on a CPU without the mode, or when threads created earlier keep the old mode.
    """
    if not torch.set_flush_denormal(True):
        return False
    probe = torch.full((1 << 20,), 1e-30) * 1e-10  # 1e-40 is denormal: large enough to run on every thread
    return not bool(probe.count_nonzero())


def atomic_write(path: str | Path, write: Callable[[IO[bytes]], Any], mode: int | None = 0o666) -> None:
    """Write ``path`` all at once or not at all: ``write(f)`` fills a temporary file in the same folder,
    which is flushed, fsynced and renamed over ``path`` (``os.replace``). A process killed at any point
    leaves either the old file or the new one, never a torn one; on an error (e.g. ``ENOSPC``) the
    temporary file is removed and the old file is untouched.

    Args:
        mode: permission bits of the new file before the umask (``tempfile`` creates 0600); None: keep.

    Raises:
        OSError: the folder cannot be written, the disk is full...
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        if mode is not None:
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(tmp, mode & ~umask)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def atomic_write_text(path: str | Path, text: str) -> None:
    """:func:`atomic_write` of a UTF-8 text."""
    data = text.encode("utf-8")
    atomic_write(path, lambda f: f.write(data))
