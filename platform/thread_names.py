"""OS names for threads, so that /proc, `top -H` and py-spy tell an engine's compute
threads from the rest of a server process (tools/serve_bench/cpu_breakdown.py).
Imports nothing heavy: the bench client reads the name too."""

from __future__ import annotations

import ctypes
import sys

COMPUTE_THREAD_NAME = "loraplex-step"
"""The OS name of the thread that steps a served engine (AsyncEngine's loop thread).
Linux gives a new thread its creator's name, so the OpenMP workers its parallel regions
start carry it too: `bench serve --cpu-breakdown` counts every other thread's CPU as the
serving cost (tools/serve_bench/cpu_breakdown.py)."""
PR_SET_NAME = 15
"""prctl option that names the calling thread (at most 15 bytes, Linux)."""


def name_this_thread(name: str) -> None:
    """Names the calling OS thread (what /proc/<pid>/task/<tid>/comm, `top -H` and py-spy
    show); nothing where prctl is missing."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return
    libc.prctl(PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)
