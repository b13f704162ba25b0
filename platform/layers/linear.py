"""Projection layers: one weight holding one or more stacked output slices.

Fused projections (q/k/v, gate/up) are one matmul on CPU; `output_sizes` records
each slice so a LoRA wrapper can later add per-slice deltas around `forward`.
Parameters are allocated uninitialized: every value comes from the checkpoint.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn


class MergedLinear(nn.Module):
    """y = x @ W.T + b with W = cat(W_0, W_1, ...) along the output dimension.

    Shapes: x [T, in_features] -> y [T, sum(output_sizes)]; slice i of y is
    y[:, offsets[i]:offsets[i] + output_sizes[i]].
    """

    def __init__(
        self,
        in_features: int,
        output_sizes: Sequence[int],
        bias: bool,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.output_sizes = tuple(int(n) for n in output_sizes)
        self.out_features = sum(self.output_sizes)
        shape = (self.out_features, in_features)
        self.weight = nn.Parameter(torch.empty(shape, dtype=dtype, device=device))
        self.bias = (
            nn.Parameter(torch.empty(self.out_features, dtype=dtype, device=device))
            if bias
            else None
        )

    @property
    def offsets(self) -> tuple[int, ...]:
        """Start row of each output slice in `weight`."""
        starts = [0]
        for size in self.output_sizes[:-1]:
            starts.append(starts[-1] + size)
        return tuple(starts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    @torch.no_grad()
    def load_slice(self, index: int, name: str, tensor: torch.Tensor) -> None:
        """Copies a checkpoint tensor into slice `index` of `weight` or `bias` (`name`)."""
        target = self.weight if name == "weight" else self.bias
        if target is None:
            raise ValueError(f"{type(self).__name__} has no {name}")
        start, size = self.offsets[index], self.output_sizes[index]
        part = target[start : start + size]
        if tuple(part.shape) != tuple(tensor.shape):
            raise ValueError(
                f"shape mismatch for {name} slice {index}: checkpoint {tuple(tensor.shape)}, "
                f"expected {tuple(part.shape)}"
            )
        part.copy_(tensor)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, output_sizes={self.output_sizes}, "
            f"bias={self.bias is not None}"
        )


class Linear(MergedLinear):
    """A single-slice projection: y = x @ W.T + b, x [T, in] -> y [T, out]."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__(in_features, (out_features,), bias, dtype, device)
