"""Which kernel family the engine runs: 'triton' on CUDA, 'torch' elsewhere.

`LORAPLEX_KERNEL_BACKEND=torch|triton` forces one for every kernel (attention, fused
layers, LoRA), e.g. to check the Triton path under the interpreter on a CPU
(`TRITON_INTERPRET=1`, set before anything imports a Triton kernel module).
"""

from __future__ import annotations

import os

import torch

KERNEL_BACKEND_ENV = "LORAPLEX_KERNEL_BACKEND"
KERNEL_BACKENDS = ("torch", "triton")


def kernel_backend(device: torch.device) -> str:
    """The forced backend if the env var names one, else 'triton' on CUDA and 'torch'
    elsewhere; ValueError for an unknown forced name."""
    forced = os.environ.get(KERNEL_BACKEND_ENV)
    if forced:
        if forced not in KERNEL_BACKENDS:
            raise ValueError(f"{KERNEL_BACKEND_ENV}={forced!r}; use one of {list(KERNEL_BACKENDS)}")
        return forced
    return "triton" if device.type == "cuda" else "torch"
