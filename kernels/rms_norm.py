"""RMSNorm with the residual add fused in: one read of x and the residual, one write of
the normed rows and of the new residual (the torch path makes five passes).

Semantics (x, residual, out, residual_out [T, hidden]; weight [hidden]; dtype = x's):
    s   = x + residual                      rounded to dtype (no add without residual)
    out = weight * (fp32(s) / sqrt(mean(fp32(s)^2) + eps)).to(dtype)     in dtype
    residual_out = s

The dtype roundings are those of the torch path (`torch_layers.rms_norm`, the
reference in tests, and HF's LlamaRMSNorm), so
fp32 results agree to rounding and half-precision ones to one ulp.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    residual_out_ptr,
    hidden,
    eps,
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(residual_out_ptr + row * stride_ro + offs, x, mask=mask)
    h = x.to(tl.float32)
    inv_rms = 1.0 / tl.sqrt_rn(tl.sum(h * h, axis=0) / hidden + eps)
    normed = (h * inv_rms).to(x.dtype).to(tl.float32)
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (w * normed).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton launch of the Semantics above: x, residual [T, hidden] (rows may be strided,
    features contiguous) -> (out, residual_out), fresh [T, hidden] tensors; without a
    residual, residual_out is x itself. One program per row."""
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"x must be [T, hidden] with contiguous features, got {tuple(x.shape)}")
    if residual is not None and (residual.shape != x.shape or residual.stride(-1) != 1):
        raise ValueError(f"residual {tuple(residual.shape)} does not match x {tuple(x.shape)}")
    num_rows, hidden = x.shape
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    residual_out = x if residual is None else torch.empty_like(out)
    if num_rows:
        _rms_norm_kernel[(num_rows,)](
            x,
            x if residual is None else residual,
            weight,
            out,
            residual_out,
            hidden,
            eps,
            x.stride(0),
            x.stride(0) if residual is None else residual.stride(0),
            out.stride(0),
            residual_out.stride(0),
            HAS_RESIDUAL=residual is not None,
            BLOCK=triton.next_power_of_2(hidden),
        )
    return out, residual_out
