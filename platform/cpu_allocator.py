"""Keeps glibc malloc from handing large freed blocks back to the kernel.

glibc serves allocations above its mmap threshold (128 KiB, raised dynamically up to
32 MiB) with fresh `mmap` pages and trims freed memory at the top of the heap once it
exceeds the trim threshold. A CPU engine step allocates and frees tensors of several
MB per layer (fused projections, MLP activations), so by default every step
page-faults its scratch memory in again (hundreds of thousands of minor faults per
benchmark run, and visibly slower prefill steps).

`keep_freed_memory()` pins the mmap threshold at its maximum and raises the trim
threshold, so freed blocks stay in the heap and the next step reuses them. The cost is
that the process keeps up to `TRIM_THRESHOLD` of freed memory mapped, which is what
a long-running engine wants. Allocations above `MMAP_THRESHOLD` (32 MiB, glibc's
ceiling) are still mapped fresh each time. Every thread that allocates may get its own
arena with its own trim threshold, so a process that builds and drops several engines
(each stepping on its own thread) can keep gigabytes of freed memory:
`release_freed_memory()` hands the free pages of every arena back (`malloc_trim`), and
`LLMEngine.shutdown` calls it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import sys

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3

MMAP_THRESHOLD = 32 * 2**20
"""glibc's largest allowed mmap threshold (HEAP_MAX_SIZE / 2 on 64-bit)."""
TRIM_THRESHOLD = 2**30
TOP_PAD = 64 * 2**20


@functools.cache
def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        return ctypes.CDLL(name)
    except OSError:
        return None


def release_freed_memory() -> bool:
    """Returns the free memory of every malloc arena to the kernel; True when glibc did
    (False on other platforms or C libraries)."""
    libc = _libc()
    trim = getattr(libc, "malloc_trim", None)
    if trim is None:
        return False
    trim.argtypes = (ctypes.c_size_t,)
    trim.restype = ctypes.c_int
    trim(0)
    return True


@functools.cache
def keep_freed_memory() -> bool:
    """Applies the malloc settings once per process; True when glibc accepted them
    (False on other platforms or C libraries, where nothing changes)."""
    mallopt = getattr(_libc(), "mallopt", None)
    if mallopt is None:
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    accepted = all(
        mallopt(option, value) == 1
        for option, value in (
            (_M_MMAP_THRESHOLD, MMAP_THRESHOLD),
            (_M_TRIM_THRESHOLD, TRIM_THRESHOLD),
            (_M_TOP_PAD, TOP_PAD),
        )
    )
    logger.info(
        "malloc keeps freed memory (mmap threshold %d MiB, trim threshold %d MiB): %s",
        MMAP_THRESHOLD // 2**20,
        TRIM_THRESHOLD // 2**20,
        "applied" if accepted else "not accepted by this C library",
    )
    return accepted
