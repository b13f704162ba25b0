"""Dense projections on a CPU: which half-precision matmuls this CPU runs natively,
oneDNN's prepacked weights, and the fp32 widening where it has none.

Semantics (every function here):
    linear(x, W, b) = x @ W.T + b      x [T, in], W [out, in], b [out] or None -> [T, out]
in x's dtype, equal to F.linear up to accumulation order.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F


@functools.cache
def cpu_lacks_half_matmul(dtype: torch.dtype) -> bool:
    """True when this CPU has no native bf16 / fp16 matmul (no AVX512-BF16, AMX or
    AVX512-FP16): oneDNN then emulates it, several times slower than fp32."""
    if dtype == torch.bfloat16:
        return not torch.ops.mkldnn._is_mkldnn_bf16_supported()
    if dtype == torch.float16:
        return not torch.ops.mkldnn._is_mkldnn_fp16_supported()
    return False


@functools.cache
def onednn_prepacking(dtype: torch.dtype) -> bool:
    """True when oneDNN can prepack CPU weights of `dtype` for its linear kernels (fp32,
    and bf16 / fp16 where this CPU multiplies them natively). For the model's
    projection shapes the prepacked kernels beat MKL's F.linear on the CPUs measured
    (`loraplex bench offline --ceiling` times both)."""
    ops = torch.ops.mkldnn
    if not torch.backends.mkldnn.is_available() or not hasattr(ops, "_reorder_linear_weight"):
        return False
    return dtype == torch.float32 or (
        dtype in (torch.bfloat16, torch.float16) and not cpu_lacks_half_matmul(dtype)
    )


class PackedWeight:
    """A CPU weight [out, in] reordered once into oneDNN's blocked layout.

    Semantics: packed(x, b) = x @ W.T + b, x [T, in] (W's dtype) -> [T, out]; the same
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
