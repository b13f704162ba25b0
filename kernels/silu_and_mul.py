"""SiLU-and-mul of a fused gate/up projection's output in one Triton kernel, optionally
with the LoRA expand that projection left pending (a folded shrink,
platform/layers/linear.py `forward_deferred`): on a GPU the torch path is two kernels
(silu, then the product), and the expand a third.

Semantics (x [T, 2I], gate = x[:, :I], up = x[:, I:]; dtype = x's):
    with a pending expand (lora.py `PendingExpand`: shrunk [T, L, R], b [L, 2I, R],
    token_slots [T]):
        gate, up = (x + delta).to(dtype) split in two,
        delta[t] = shrunk[t, s_t] @ b[s_t].T where s_t = token_slots[t] >= 0, else 0
    out = (silu(gate).to(dtype) * up).to(dtype)            [T, I], contiguous

silu and the product are computed in fp32 and rounded as the torch path rounds
(`torch_layers.silu_and_mul`: F.silu's bf16 output, then the bf16 product); the exp may
differ from torch's in the last fp32 bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraplex.kernels.lora import PendingExpand
from loraplex.kernels.triton_lora import token_delta, token_shrink


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,
    out_ptr,
    shrunk_ptr,
    b_ptr,
    slots_ptr,
    half,
    rank,
    stride_x,
    stride_o,
    stride_yt,
    stride_ys,
    stride_yr,
    stride_bl,
    stride_bn,
    stride_br,
    HAS_LORA: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * CHUNK + tl.arange(0, CHUNK)
    mask = offs < half
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + half + offs, mask=mask, other=0.0)
    if HAS_LORA:
        slot_row, offs_r, r_mask, y = token_shrink(
            shrunk_ptr, slots_ptr, row, rank, stride_yt, stride_ys, stride_yr, BLOCK_R
        )
        gate_delta = token_delta(
            b_ptr, slot_row, offs, mask, offs_r, r_mask, y, stride_bl, stride_bn, stride_br
        )
        up_delta = token_delta(
            b_ptr, slot_row, half + offs, mask, offs_r, r_mask, y, stride_bl, stride_bn, stride_br
        )
        gate = (gate.to(tl.float32) + gate_delta).to(gate.dtype)
        up = (up.to(tl.float32) + up_delta).to(up.dtype)
    g = gate.to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
    tl.store(
        out_ptr + row * stride_o + offs,
        (silu * up.to(tl.float32)).to(out_ptr.dtype.element_ty),
        mask=mask,
    )


_CHUNK = 1024
"""Columns of one program without LoRA."""
_EXPAND_TILE = 4096
"""Elements of one B tile with LoRA (CHUNK x BLOCK_R, two of them: gate and up rows)."""


def silu_and_mul(x: torch.Tensor, pending: PendingExpand | None = None) -> torch.Tensor:
    """Triton launch of the Semantics above: x [T, 2I] (rows may be strided, features
    contiguous) -> [T, I]; with `pending`, its expand is added first. Programs of (row,
    column chunk)."""
    if x.dim() != 2 or x.stride(-1) != 1 or x.shape[1] % 2:
        raise ValueError(f"x must be [T, 2I] with contiguous features, got {tuple(x.shape)}")
    num_rows, width = x.shape
    half = width // 2
    has_lora = pending is not None
    if has_lora:
        shrunk, lora_b = pending.shrunk, pending.b
        token_slots = pending.token_slots.contiguous()  # read as slots_ptr + row
        if lora_b.shape[1:] != (width, shrunk.shape[2]) or shrunk.shape[:2] != (
            num_rows,
            lora_b.shape[0],
        ):
            raise ValueError(
                f"the pending expand does not fit x {tuple(x.shape)}: shrunk "
                f"{tuple(shrunk.shape)}, lora_b {tuple(lora_b.shape)}"
            )
    else:
        shrunk = lora_b = token_slots = x.new_empty(0, 0, 0)
    out = torch.empty(num_rows, half, dtype=x.dtype, device=x.device)
    if num_rows == 0 or half == 0:
        return out
    rank = shrunk.shape[2]
    block_r = max(16, triton.next_power_of_2(rank))
    limit = _EXPAND_TILE // block_r if has_lora else _CHUNK
    chunk = max(16, min(triton.next_power_of_2(half), limit))
    _silu_and_mul_kernel[(num_rows, triton.cdiv(half, chunk))](
        x,
        out,
        shrunk,
        lora_b,
        token_slots,
        half,
        rank,
        x.stride(0),
        out.stride(0),
        *shrunk.stride(),
        *lora_b.stride(),
        HAS_LORA=has_lora,
        CHUNK=chunk,
        BLOCK_R=block_r,
    )
    return out
