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
        'dynamic':     per token t: v = x[t] * c (fp32; c = 1 / input_gain per input
                       channel, or 1), a[t] = max_k |v[k]| / 127, xq[t] = round(v / a[t]),
                       (xq @ q.T) * a[:, None] * s[None, :] + b    (int32 accumulation),
                       at every T: the native VNNI kernel where the CPU has
                       AVX512-VNNI (`cpu_ops.int8_linear_rows`: the quantizing, the
                       product and the rescaling in one op, the weight packed once),
                       else torch's int8 matmul, rows padded up past DYNAMIC_MIN_ROWS

With an input gain g [in] (`from_float(W, 'dynamic', input_gain=g)`, g > 0), q and s
quantize W * g per output channel and the activations are divided by g before they are
quantized: the weight is still W (dequantize(q, s) / g), but an input channel that
the gain makes large (an RMSNorm's weight before the projection) no longer sets every
token's activation scale. That is SmoothQuant's migration with the norm's weight as
the activation statistic (no calibration data). The engine smooths the projections an
RMSNorm feeds (q/k/v, gate/up, and a quantized LM head); on the default model the
perplexity over bf16 went from +2.4% to +2.2%, +1.6% with the LM head in int8 too
(docs/benchmarks.md).

`reference_int8_linear` is the plain-torch statement of both, for tests.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from loraplex.kernels import cpu_ops

INT8_MODES = ("dynamic", "weight_only")
DYNAMIC_MIN_ROWS = 16
"""torch's CPU int8 x int8 matmul takes more than 16 rows: fewer are padded to 17 where
the native VNNI kernel does not run."""
VNNI_WIDE_ROWS = 8
"""From this many rows on the VNNI kernel multiplies tiles of 8 rows by 48 channels,
below it tiles of up to 4 rows by 96 channels (kernels/csrc/cpu_ops.cpp)."""
VNNI_CHANNELS = 16
"""Output channels per block of the VNNI layout (`pack_vnni`)."""


def pack_vnni(quantized: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [N, K] int8 -> (packed [ceil(N/16), ceil(K/4), 16, 4] int8, zero padded, where
    packed[b, k4, c, e] = q[16 b + c, 4 k4 + e]; col_sums [N] int32 = q.sum(1)): the
    operands of `cpu_ops.int8_linear_rows`."""
    n, k = quantized.shape
    blocks, k4s = -(-n // VNNI_CHANNELS), -(-k // 4)
    padded = torch.zeros(blocks * VNNI_CHANNELS, k4s * 4, dtype=torch.int8)
    padded[:n, :k] = quantized
    packed = padded.reshape(blocks, VNNI_CHANNELS, k4s, 4).permute(0, 2, 1, 3).contiguous()
    return packed, quantized.sum(dim=1, dtype=torch.int32).contiguous()


@functools.cache
def cpu_has_vnni() -> bool:
    """Whether this CPU has AVX512-VNNI (what the native rows kernel is fast with)."""
    return "avx512_vnni" in cpu_ops.cpu_identity().partition("|")[2].split()


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """See the module docstring."""
    wide = weight.detach().float()
    scale = wide.abs().amax(dim=1) / 127.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    quantized = torch.round(wide / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return quantized.contiguous(), scale.contiguous()


def dequantize(quantized: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return quantized.float() * scale[:, None]


def _quantize_rows(
    x: torch.Tensor, input_scales: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, in] (times input_scales [in], per channel) -> (xq [T, in] int8, a [T, 1]
    float32), per token (row)."""
    wide = x.float() if input_scales is None else x.float() * input_scales
    scale = wide.abs().amax(dim=1, keepdim=True) / 127.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return torch.round(wide / scale).clamp_(-127, 127).to(torch.int8), scale


MIN_INPUT_GAIN = 1e-4
"""Input gains are clamped to at least this (relative to the largest): a channel an
RMSNorm zeroes carries zeros, and its weight column is only scaled down."""


def smoothing_gain(norm_weight: torch.Tensor) -> torch.Tensor:
    """The input gain that smooths a projection fed by an RMSNorm of weight
    `norm_weight` [in]: |norm_weight| in fp32, clamped to MIN_INPUT_GAIN times its
    largest value (see the module docstring)."""
    gain = norm_weight.detach().float().abs()
    floor = max(float(gain.max()) * MIN_INPUT_GAIN, torch.finfo(torch.float32).tiny)
    return gain.clamp(min=floor)


class Int8Weight:
    """A projection's weight held as int8 per-channel (see the module docstring); takes
    the place of `PackedWeight` in a projection (`__call__(x, bias)`). `native`: the
    dynamic mode quantizes activations and rescales the int32 products with the native
    CPU ops (kernels/cpu_ops.py, one pass each) instead of a chain of torch ops, or,
    where the CPU has AVX512-VNNI, runs the whole product as the native VNNI kernel at
    every batch (faster than torch's int8 matmul from 1 to 2,048 rows on the default
    model's shapes, docs/benchmarks.md). The dynamic mode keeps q.T (torch's int8
    matmul) and, for that kernel, the VNNI packing; q is then a view of q.T."""

    def __init__(
        self,
        quantized: torch.Tensor,
        scale: torch.Tensor,
        mode: str,
        native: bool = False,
        input_gain: torch.Tensor | None = None,
    ) -> None:
        """An int8 weight q [out, in] and its scales [out] as given (values in
        [-128, 127]: dequantize(q, scale) / input_gain is the weight); `from_float`
        quantizes one. `input_gain` [in] (dynamic mode only): see the module docstring."""
        if mode not in INT8_MODES:
            raise ValueError(f"int8 mode must be one of {INT8_MODES}, got {mode!r}")
        if input_gain is not None and mode != "dynamic":
            raise ValueError("an input gain applies to the dynamic int8 mode only")
        self.input_scales = None if input_gain is None else (1.0 / input_gain.float()).contiguous()
        """[in] fp32: what each activation channel is multiplied by before it is
        quantized (1 / input_gain), or None."""
        self.mode = mode
        self.native = native
        quantized = quantized.to(torch.int8)
        self.scale = scale.float().reshape(-1).contiguous()
        self.scale_bf16 = self.scale.to(torch.bfloat16)
        self.quantized_t: torch.Tensor | None = None
        """[in, out]: the layout torch's int8 matmul reads (dynamic mode)."""
        self.vnni: tuple[torch.Tensor, torch.Tensor] | None = None
        """`pack_vnni(q)` (dynamic mode, native, on a CPU with AVX512-VNNI)."""
        if mode == "dynamic":
            self.quantized_t = quantized.t().contiguous()
            if native and cpu_has_vnni():
                self.vnni = pack_vnni(quantized)
            self._quantized = None
        else:
            self._quantized = quantized.contiguous()

    @property
    def quantized(self) -> torch.Tensor:
        """q [out, in] int8."""
        return self._quantized if self._quantized is not None else self.quantized_t.t()

    @property
    def out_features(self) -> int:
        return self.scale.shape[0]

    @classmethod
    def from_float(
        cls,
        weight: torch.Tensor,
        mode: str,
        native: bool = False,
        input_gain: torch.Tensor | None = None,
    ) -> Int8Weight:
        """`weight` [out, in] quantized per output channel (`quantize_per_channel`), after
        its input channels are multiplied by `input_gain` [in] where given."""
        if input_gain is None:
            return cls(*quantize_per_channel(weight), mode, native)
        gain = smoothing_gain(input_gain)
        scaled = weight.detach().float() * gain
        return cls(*quantize_per_channel(scaled), mode, native, input_gain=gain)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.mode == "weight_only":
            out = torch.ops.aten._weight_int8pack_mm(
                x.to(torch.bfloat16).contiguous(), self._quantized, self.scale_bf16
            )
            out = out.to(x.dtype)
            if bias is not None:
                out += bias
            return out
        rows = x.shape[0]
        if self.vnni is not None:
            packed, col_sums = self.vnni
            return cpu_ops.int8_linear_rows(
                x.contiguous(),
                self.input_scales,
                packed,
                col_sums,
                self.scale,
                bias,
                self.out_features,
            )
        # torch's int8 matmul takes more than DYNAMIC_MIN_ROWS rows: fewer are padded
        padding = max(0, DYNAMIC_MIN_ROWS + 1 - rows)
        if self.native:
            xq, row_scale = cpu_ops.quantize_rows_int8(x.contiguous(), self.input_scales)
            acc = torch._int_mm(F.pad(xq, (0, 0, 0, padding)), self.quantized_t)[:rows]
            return cpu_ops.dequantize_int32(acc.contiguous(), row_scale, self.scale, bias, x.dtype)
        xq, row_scale = _quantize_rows(x, self.input_scales)
        out = torch._int_mm(F.pad(xq, (0, 0, 0, padding)), self.quantized_t)[:rows].float()
        out.mul_(row_scale).mul_(self.scale)
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
    input_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """`Int8Weight(...)(x, bias)` in plain torch (fp32 arithmetic), for tests."""
    if mode == "dynamic":
        xq, row_scale = _quantize_rows(x, input_scales)
        out = (xq.double() @ quantized.double().T).float() * row_scale * scale
    else:
        out = x.to(torch.bfloat16).float() @ dequantize(quantized, scale).T
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)
