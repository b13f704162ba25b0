"""Int4 weight-only projections (W4A16) on a CPU: the group-wise int4 weights of a
compressed-tensors `pack-quantized` checkpoint (what llm-compressor's GPTQ, AWQ and
round-to-nearest W4A16 recipes write), multiplied with unquantized activations.

Semantics:
    q [out, in] int4 values in [-8, 7] (held as int8); g = group_size; G = ceil(in / g)
    scale [out, G] fp32; zero [out, G] int4 values in [-8, 7], or None (symmetric: 0)

    dequantize_int4(q, scale, zero, g)[n, k] = (q[n, k] - zero[n, k // g]) * scale[n, k // g]
                                                                    float32 [out, in]

    Int4Weight(q, scale, zero, g, dtype)(x, b)                      x [T, in] -> [T, out]
        = x @ W.T + b with W = dequantize_int4(...), in one of two products:
        T <= INT4_GEMV_ROWS where torch's int4 kernel takes the layout (`gemv`):
              torch's `_weight_int4pack_mm_for_cpu` (x in its dtype, W's zero term
              -zero * scale rounded to that dtype)
        else: W dequantized to x's dtype (one native pass, `cpu_ops.dequantize_int4`, or
              torch ops), then x @ W.T as a float matmul

    pack_int4(q [R, C]) -> int32 [R, ceil(C / 8)]: value j of each 8 in bits 4j .. 4j + 3,
        stored as q + 8 (compressed-tensors' `pack_to_int32` layout: `weight_packed`
        packs the input dimension, `weight_zero_point` the output one, transposed)
    unpack_int4(packed, C) is its inverse.

`reference_int4_linear` is the plain-torch statement of the product, for tests.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from loraplex.kernels import cpu_ops
from loraplex.kernels.int_packing import pack_ints, unpack_ints

INT4_GEMV_ROWS = 16
"""Up to this many rows torch's int4 kernel multiplies (it reads half a byte per weight,
3.5x faster than bf16 at one row); past it, dequantizing the weight and a float matmul
are faster (docs/benchmarks.md, "Int4 checkpoints")."""
TORCH_GROUP_SIZES = (256, 128, 64, 32)
"""The group sizes torch's CPU int4 kernel takes."""
TORCH_CHANNEL_MULTIPLE = 16
"""torch's CPU int4 packing takes output channels in multiples of 16."""


def pack_int4(quantized: torch.Tensor) -> torch.Tensor:
    """q [R, C] int8 in [-8, 7] -> int32 [R, ceil(C / 8)] (see the module docstring)."""
    return pack_ints(quantized, 4)


def unpack_int4(packed: torch.Tensor, columns: int) -> torch.Tensor:
    """int32 [R, ceil(C / 8)] -> q [R, C] int8 in [-8, 7] (`pack_int4`'s inverse)."""
    return unpack_ints(packed, columns, 4)


def group_count(in_features: int, group_size: int) -> int:
    return -(-in_features // group_size)


def quantize_int4(
    weight: torch.Tensor, group_size: int | None, symmetric: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Round-to-nearest int4 of `weight` [out, in] per group of `group_size` inputs
    (None: one group per output channel): (q int8 [out, in], scale [out, G] in the
    weight's dtype, zero int8 [out, G] or None when `symmetric`). Symmetric: scale =
    max |w| / 7.5, q = round(w / scale) within [-8, 7]; asymmetric: the range [min(w, 0),
    max(w, 0)] over 15 steps, zero = round(-min / scale) - 8. q is rounded with the
    scale as stored (in the weight's dtype)."""
    out_features, in_features = weight.shape
    size = in_features if group_size is None else group_size
    groups = group_count(in_features, size)
    wide = F.pad(weight.detach().float(), (0, groups * size - in_features))
    grouped = wide.view(out_features, groups, size)
    if symmetric:
        scale = grouped.abs().amax(dim=2) / 7.5
        zero = None
    else:
        low = grouped.amin(dim=2).clamp(max=0.0)
        high = grouped.amax(dim=2).clamp(min=0.0)
        scale = (high - low) / 15.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale)).to(weight.dtype)
    stored = scale.float()
    if not symmetric:
        zero = (torch.round(-low / stored) - 8).clamp_(-8, 7)
    offset = 0.0 if zero is None else zero.unsqueeze(2)
    q = (torch.round(grouped / stored.unsqueeze(2)) + offset).clamp_(-8, 7)
    q = q.view(out_features, -1)[:, :in_features].to(torch.int8).contiguous()
    return q, scale.contiguous(), None if zero is None else zero.to(torch.int8).contiguous()


def dequantize_int4(
    quantized: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, group_size: int
) -> torch.Tensor:
    """See the module docstring (fp32)."""
    columns = torch.arange(quantized.shape[1]) // group_size
    values = quantized.float()
    if zero is not None:
        values = values - zero.float()[:, columns]
    return values * scale.float()[:, columns]


@dataclass(frozen=True)
class TorchInt4Pack:
    """A weight in the layout of torch's CPU int4 kernel: `packed` (its
    `_convert_weight_to_int4pack_for_cpu` of q + 8, output channels padded to a multiple
    of 16 and inputs to a multiple of `group_size`, with zeros), `scales_and_zeros`
    [padded in / group_size, padded out, 2] in the activations' dtype."""

    packed: torch.Tensor
    scales_and_zeros: torch.Tensor
    group_size: int
    padded_in: int


def torch_int4_pack(
    quantized: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor | None,
    group_size: int,
    dtype: torch.dtype,
) -> TorchInt4Pack | None:
    """The weight in torch's CPU int4 layout, or None where its group sizes cannot
    express `group_size` (torch's group must divide it: 32, 64, 128 or 256)."""
    size = next((s for s in TORCH_GROUP_SIZES if group_size % s == 0), None)
    if size is None:
        return None
    out_features, in_features = quantized.shape
    padded_in = group_count(in_features, size) * size
    padded_out = -(-out_features // TORCH_CHANNEL_MULTIPLE) * TORCH_CHANNEL_MULTIPLE
    unsigned = torch.full((padded_out, padded_in), 8, dtype=torch.int32)
    unsigned[:out_features, :in_features] = quantized.to(torch.int32) + 8
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(unsigned, 2)
    # torch group j lies inside checkpoint group (j * size) // group_size
    groups = (torch.arange(padded_in // size) * size) // group_size
    scales = torch.zeros(padded_out, groups.numel())
    scales[:out_features] = scale.float()[:, groups]
    zeros = torch.zeros_like(scales)
    if zero is not None:
        zeros[:out_features] = -zero.float()[:, groups] * scales[:out_features]
    scales_and_zeros = torch.stack([scales.t(), zeros.t()], dim=2).to(dtype).contiguous()
    return TorchInt4Pack(packed, scales_and_zeros, size, padded_in)


class Int4Weight:
    """A projection's weight held as group-wise int4 (see the module docstring); takes
    the place of `PackedWeight` in a projection (`__call__(x, bias)`). Holds the packed
    values (half a byte per weight, the checkpoint's layout) and, where torch's int4
    kernel takes the group size, its own packing of them for small batches. `native`:
    dequantize with the native CPU op."""

    def __init__(
        self,
        quantized: torch.Tensor,
        scale: torch.Tensor,
        zero: torch.Tensor | None,
        group_size: int,
        dtype: torch.dtype,
        native: bool = False,
    ) -> None:
        if quantized.dim() != 2 or group_size < 1:
            raise ValueError("need q [out, in] and a group size >= 1")
        self.out_features, self.in_features = quantized.shape
        groups = group_count(self.in_features, group_size)
        if tuple(scale.shape) != (self.out_features, groups):
            raise ValueError(f"scale must be [{self.out_features}, {groups}], got {scale.shape}")
        if zero is not None and tuple(zero.shape) != tuple(scale.shape):
            raise ValueError(f"zero must be [{self.out_features}, {groups}], got {zero.shape}")
        self.group_size = group_size
        self.dtype = dtype
        self.native = native
        self.packed = pack_int4(quantized.to(torch.int8))
        self.scale = scale.float().contiguous()
        self.zero = None if zero is None else zero.to(torch.int8).contiguous()
        self.gemv = torch_int4_pack(quantized, self.scale, self.zero, group_size, dtype)

    @property
    def quantized(self) -> torch.Tensor:
        """q [out, in] int8 in [-8, 7]."""
        return unpack_int4(self.packed, self.in_features)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """W [out, in] in `dtype` (the module docstring's dequantize_int4, rounded)."""
        if self.native and cpu_ops.load():
            return cpu_ops.dequantize_int4(
                self.packed, self.scale, self.zero, self.group_size, self.in_features, dtype
            )
        return dequantize_int4(self.quantized, self.scale, self.zero, self.group_size).to(dtype)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        gemv = self.gemv
        if gemv is not None and x.shape[0] <= INT4_GEMV_ROWS and x.dtype == self.dtype:
            padding = gemv.padded_in - self.in_features
            padded = (F.pad(x, (0, padding)) if padding else x).contiguous()
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(
                padded, gemv.packed, gemv.group_size, gemv.scales_and_zeros
            )
            if out.shape[1] != self.out_features:  # output channels padded to 16
                out = out[:, : self.out_features].contiguous()
            if bias is not None:
                out += bias
            return out
        return F.linear(x, self.dequantized(x.dtype), bias)


def reference_int4_linear(
    x: torch.Tensor,
    quantized: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor | None,
    group_size: int,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """`Int4Weight(...)(x, bias)` in plain torch (fp32 arithmetic), for tests."""
    out = x.float() @ dequantize_int4(quantized, scale, zero, group_size).T
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)
