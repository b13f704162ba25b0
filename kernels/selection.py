"""Which kernel family the engine runs: 'triton' on CUDA; on a CPU 'cpu' (the torch
path with native hot spots, kernels/cpu_ops.py) when those build here, else 'torch'.
The engine picks the name once per device (`kernel_backend`) and builds its model with
it; every layer then calls the one backend object of that name (`backends.py`).

`LORAPLEX_KERNEL_BACKEND=torch|cpu|triton` forces one for every kernel (attention,
fused layers, LoRA), e.g. `torch` for the plain reference path, or `triton` to check
the Triton path under the interpreter on a CPU (`TRITON_INTERPRET=1`, set before
anything imports a Triton kernel module).
"""

from __future__ import annotations

import os

import torch

from loraplex.kernels.backends import KernelBackend, get_backend

KERNEL_BACKEND_ENV = "LORAPLEX_KERNEL_BACKEND"
KERNEL_BACKENDS = ("torch", "cpu", "triton")


def kernel_backend(device: torch.device) -> str:
    """The forced backend if the env var names one, else 'triton' on CUDA, 'cpu' on a
    CPU where the native kernels build (first call builds them) and 'torch' otherwise;
    ValueError for an unknown forced name."""
    forced = os.environ.get(KERNEL_BACKEND_ENV)
    if forced:
        if forced not in KERNEL_BACKENDS:
            raise ValueError(f"{KERNEL_BACKEND_ENV}={forced!r}; use one of {list(KERNEL_BACKENDS)}")
        return forced
    if device.type == "cuda":
        return "triton"
    if device.type == "cpu":
        from loraplex.kernels import cpu_ops

        if cpu_ops.load():
            return "cpu"
    return "torch"


def select_backend(device: torch.device) -> KernelBackend:
    """The backend object `kernel_backend(device)` names (one shared object per name)."""
    return get_backend(kernel_backend(device))
