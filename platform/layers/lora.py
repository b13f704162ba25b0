"""Slot-stacked LoRA weights of one projection, owned by the projection layer.

The adapter slot manager (adapters/slots.py) writes adapters into the stacks; the
projection adds the per-token delta through kernels/lora.py (layout documented there).
A fused projection with S slices packs slot l's adapter of rank r as

    a[l, s*r : s*r + r_s, :]              = A_s          (r_s <= r: that slice's rank)
    b[l, off_s : off_s + out_s, s*r : s*r + r_s] = B_s * scaling

so the first S * r columns of a slot carry everything (the torch path reads only those).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LoRAStack:
    a: torch.Tensor
    """[max_loras, num_slices * max_rank, in_features]"""
    b: torch.Tensor
    """[max_loras, out_features, num_slices * max_rank]; on the 'cpu' backend a view of
    rank-major storage [max_loras, width, out_features] (each column B[l, :, r] is
    contiguous, as the native kernel reads it)."""
    num_slices: int
    backend: str
    """kernels/lora.py backend name: 'torch', 'cpu' or 'triton'."""

    @classmethod
    def allocate(
        cls,
        max_loras: int,
        max_rank: int,
        in_features: int,
        out_features: int,
        num_slices: int,
        dtype: torch.dtype,
        device: torch.device,
        backend: str,
    ) -> LoRAStack:
        width = num_slices * max_rank
        if backend == "cpu":
            b = torch.zeros(max_loras, width, out_features, dtype=dtype, device=device)
            b = b.transpose(1, 2)
        else:
            b = torch.zeros(max_loras, out_features, width, dtype=dtype, device=device)
        return cls(
            a=torch.zeros(max_loras, width, in_features, dtype=dtype, device=device),
            b=b,
            num_slices=num_slices,
            backend=backend,
        )

    @property
    def num_bytes(self) -> int:
        return self.a.numel() * self.a.element_size() + self.b.numel() * self.b.element_size()
