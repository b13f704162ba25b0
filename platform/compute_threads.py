"""Torch's intra-op threads on a CPU: how many, and on which thread.

Two facts of libgomp (the OpenMP runtime of torch's CPU wheels) that an engine whose
step loop runs on a background thread (AsyncEngine) must respect:

- **Count per thread.** `torch.set_num_threads(n)` records n globally, but OpenMP keeps
  a thread count per calling thread, and a new thread starts from the process default,
  `OMP_NUM_THREADS`, which Ray sets to a replica's `num_cpus` (1 for 0.5). Until torch
  re-applies its count in that thread, its GEMMs run single-threaded.
  `use_compute_threads` sets the count for
  the calling thread; every thread that runs a model forward calls it first.
- **One master per process.** Each thread that opens a parallel region gets its own
  pool of worker threads, and once a process holds more pool threads than CPUs,
  libgomp makes every worker sleep almost at once between regions instead of spinning.
  An engine built on one thread and stepped on another has two pools, and its workers
  then sleep thousands of times a burst instead of never (docs/benchmarks.md: "Where the served
  path's time goes" has the figures). `AsyncEngine.build` therefore builds, warms up
  and steps the engine on its loop thread. `GOMP_SPINCOUNT` does not lift the limit,
  and `OMP_WAIT_POLICY=ACTIVE` makes the idle pool spin, which is slower still.
"""

from __future__ import annotations

import os

import torch


def default_compute_threads() -> int:
    """The CPUs this process may run on (its affinity mask, not the machine's count)."""
    return len(os.sched_getaffinity(0))


def use_compute_threads(num_threads: int) -> None:
    torch.set_num_threads(num_threads)
