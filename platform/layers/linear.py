"""Projection layers: one weight holding one or more stacked output slices.

Fused projections (q/k/v, gate/up) are one matmul on CPU; `output_sizes` records
each slice. With LoRA enabled a projection also holds a `LoRAStack` (its slots'
adapter weights) and adds each token's adapter delta after the base matmul.
Parameters are allocated uninitialized: every value comes from the checkpoint.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from loraplex.kernels.lora import LoRABatch, add_lora
from loraplex.platform.layers.lora import LoRAStack


@functools.cache
def cpu_lacks_half_matmul(dtype: torch.dtype) -> bool:
    """True when this CPU has no native bf16 / fp16 matmul (no AVX512-BF16, AMX or
    AVX512-FP16): oneDNN then emulates it about 5x slower than fp32."""
    if dtype == torch.bfloat16:
        return not torch.ops.mkldnn._is_mkldnn_bf16_supported()
    if dtype == torch.float16:
        return not torch.ops.mkldnn._is_mkldnn_fp16_supported()
    return False


@functools.cache
def onednn_prepacking(dtype: torch.dtype) -> bool:
    """True when oneDNN can prepack CPU weights of `dtype` for its linear kernels.

    Measured on the 2-core dev machine (AMD EPYC, AVX-512): fp32 projections of the
    default model run 2.2-3.4x faster than F.linear (MKL sgemm), bf16 ones 1.1-1.4x."""
    ops = torch.ops.mkldnn
    if not torch.backends.mkldnn.is_available() or not hasattr(ops, "_reorder_linear_weight"):
        return False
    return dtype == torch.float32 or (
        dtype in (torch.bfloat16, torch.float16) and not cpu_lacks_half_matmul(dtype)
    )


class PackedWeight:
    """A CPU weight [out, in] reordered once into oneDNN's blocked layout.

    Semantics: packed(x) = x @ W.T + b, x [T, in] (W's dtype) -> [T, out]; the same
    as F.linear(x, W, b) up to accumulation order."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach())

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, bias, "none", [], "")

    @classmethod
    def maybe(cls, weight: torch.Tensor) -> PackedWeight | None:
        """A packed copy when `weight` is a CPU tensor oneDNN can prepack, else None."""
        if weight.device.type != "cpu" or not onednn_prepacking(weight.dtype):
            return None
        return cls(weight)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear; on a CPU without native half-precision matmul, half weights are widened
    to fp32 for the product (exactly: bf16 -> fp32 is lossless) and the result is cast
    back, which keeps weights and activations in half precision at fp32 speed."""
    if x.device.type == "cpu" and cpu_lacks_half_matmul(weight.dtype):
        wide_bias = bias.float() if bias is not None else None
        return F.linear(x.float(), weight.float(), wide_bias).to(x.dtype)
    return F.linear(x, weight, bias)


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
        self.lora: LoRAStack | None = None
        self.packed: PackedWeight | None = None
        """oneDNN copy of `weight` (CPU), made by `pack` once the weights are loaded."""

    @property
    def offsets(self) -> tuple[int, ...]:
        """Start row of each output slice in `weight`."""
        starts = [0]
        for size in self.output_sizes[:-1]:
            starts.append(starts[-1] + size)
        return tuple(starts)

    def forward(self, x: torch.Tensor, lora: LoRABatch | None = None) -> torch.Tensor:
        """x [T, in] -> [T, out]; adds each token's adapter delta when `lora` is given."""
        if self.packed is not None:
            out = self.packed(x, self.bias)
        else:
            out = linear(x, self.weight, self.bias)
        if lora is not None and self.lora is not None:
            stack = self.lora
            add_lora(out, x, stack.a, stack.b, lora, stack.backend, stack.num_slices)
        return out

    def pack(self) -> None:
        """Prepacks the loaded weight for oneDNN where that is faster (CPU only)."""
        self.packed = PackedWeight.maybe(self.weight)

    def enable_lora(self, max_loras: int, max_rank: int, backend: str) -> LoRAStack:
        """Allocates this projection's zeroed adapter slots. On the torch path a half
        precision model keeps its slots in fp32, as PEFT keeps adapter weights: tiny
        fp32 matmuls cost less per call on a CPU, and the delta is rounded only once."""
        dtype = self.weight.dtype
        if backend == "torch" and dtype in (torch.bfloat16, torch.float16):
            dtype = torch.float32
        self.lora = LoRAStack.allocate(
            max_loras,
            max_rank,
            self.in_features,
            self.out_features,
            len(self.output_sizes),
            dtype,
            self.weight.device,
            backend,
        )
        return self.lora

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
