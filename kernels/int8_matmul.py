"""Int8 projections on a CPU: weights quantized per output channel, multiplied either
with half-precision activations (weight-only) or with activations quantized per token
on the fly (W8A8, dynamic).

Semantics:
    quantize_per_channel(W [out, in] float) -> (q [out, in] int8, s [out] float32)
        s[n] = max_k |W[n, k]| / 127 (1 where that row is all zero),
        q[n, k] = round(W[n, k] / s[n]), within [-127, 127]
    dequantize(q, s) = q * s[:, None]                                   float32 [out, in]

    Int8Weight(q, s, mode)(x, b)                                    x [T, in] -> [T, out]
        'weight_only': x @ dequantize(q, s).T + b, the product in bf16 (x rounded to
                       bf16, fp32 accumulation), returned in x's dtype
        'dynamic':     per token t: a[t] = max_k |x[t, k]| / 127, xq[t] = round(x[t] / a[t]),
                       (xq @ q.T) * a[:, None] * s[None, :] + b    (int32 accumulation),
                       for T > DYNAMIC_MIN_ROWS; smaller T (decode at a small batch,
                       where reading the weight is the cost) take the weight-only product

`reference_int8_linear` is the plain-torch statement of both, for tests.
"""

from __future__ import annotations

import torch

from loraplex.kernels import cpu_ops

INT8_MODES = ("dynamic", "weight_only")
DYNAMIC_MIN_ROWS = 16
"""torch's CPU int8 x int8 matmul takes more than 16 rows; fewer rows use the
weight-only product (measured faster there: docs/benchmarks.md)."""


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """See the module docstring."""
    wide = weight.detach().float()
    scale = wide.abs().amax(dim=1) / 127.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    quantized = torch.round(wide / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return quantized.contiguous(), scale.contiguous()


def dequantize(quantized: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return quantized.float() * scale[:, None]


def _quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, in] -> (xq [T, in] int8, a [T, 1] float32), per token (row)."""
    wide = x.float()
    scale = wide.abs().amax(dim=1, keepdim=True) / 127.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return torch.round(wide / scale).clamp_(-127, 127).to(torch.int8), scale


class Int8Weight:
    """A projection's weight held as int8 per-channel (see the module docstring); takes
    the place of `PackedWeight` in a projection (`__call__(x, bias)`). `native`: the
    dynamic mode quantizes activations and rescales the int32 products with the native
    CPU ops (kernels/cpu_ops.py, one pass each) instead of a chain of torch ops."""

    def __init__(
        self, quantized: torch.Tensor, scale: torch.Tensor, mode: str, native: bool = False
    ) -> None:
        """An int8 weight q [out, in] and its scales [out] as given (values in
        [-128, 127]: dequantize(q, scale) is the weight); `from_float` quantizes one."""
        if mode not in INT8_MODES:
            raise ValueError(f"int8 mode must be one of {INT8_MODES}, got {mode!r}")
        self.mode = mode
        self.native = native
        self.quantized = quantized.to(torch.int8).contiguous()
        self.scale = scale.float().reshape(-1).contiguous()
        self.scale_bf16 = self.scale.to(torch.bfloat16)
        self.quantized_t = self.quantized.t().contiguous() if mode == "dynamic" else None
        """[in, out]: the layout torch's int8 matmul reads."""

    @classmethod
    def from_float(cls, weight: torch.Tensor, mode: str, native: bool = False) -> Int8Weight:
        """`weight` [out, in] quantized per output channel (`quantize_per_channel`)."""
        return cls(*quantize_per_channel(weight), mode, native)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.mode == "dynamic" and x.shape[0] > DYNAMIC_MIN_ROWS:
            if self.native:
                xq, row_scale = cpu_ops.quantize_rows_int8(x.contiguous())
                acc = torch._int_mm(xq, self.quantized_t)
                return cpu_ops.dequantize_int32(acc, row_scale, self.scale, bias, x.dtype)
            xq, row_scale = _quantize_rows(x)
            out = torch._int_mm(xq, self.quantized_t).float()
            out.mul_(row_scale).mul_(self.scale)
        else:
            out = torch.ops.aten._weight_int8pack_mm(
                x.to(torch.bfloat16).contiguous(), self.quantized, self.scale_bf16
            )
        out = out.to(x.dtype)
        if bias is not None:
            out += bias
        return out


def reference_int8_linear(
    x: torch.Tensor,
    quantized: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None,
    mode: str,
) -> torch.Tensor:
    """`Int8Weight(...)(x, bias)` in plain torch (fp32 arithmetic), for tests."""
    weight = dequantize(quantized, scale)
    if mode == "dynamic" and x.shape[0] > DYNAMIC_MIN_ROWS:
        xq, row_scale = _quantize_rows(x)
        out = (xq.float() @ quantized.float().T) * row_scale * scale
    else:
        out = x.to(torch.bfloat16).float() @ weight.T
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)
