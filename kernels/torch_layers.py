"""The layer ops in plain torch: the 'torch' backend's implementation, and the
reference the native CPU and Triton kernels are tested against.

Semantics:
    rms_norm(x, residual, weight, eps) -> (normed, new residual)
        x, residual [T, hidden] (residual may be None), weight [hidden]:
        h = x + residual (or x); normed = weight * (h / sqrt(mean(h^2) + eps)) with the
        normalisation in fp32 and rounded to x's dtype before the weight multiplies.
    silu_and_mul(x) -> silu(gate) * up, gate, up = x.chunk(2, -1): x [T, 2I] -> [T, I].
    apply_rotary(x, cos, sin) -> x rotated (neox half-split layout):
        x [T, heads, Dh], cos / sin [T, 1, Dh/2]; with x1, x2 the halves of x,
        out = cat(x1 * cos - x2 * sin, x2 * cos + x1 * sin) in x's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    if residual is not None:
        x = residual + x
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype), x


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
