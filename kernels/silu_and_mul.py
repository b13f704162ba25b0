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
        slot = tl.load(slots_ptr + row)
        slot_row = tl.maximum(slot, 0).to(tl.int64)
        offs_r = tl.arange(0, BLOCK_R)
        r_mask = (offs_r < rank) & (slot >= 0)
        y = tl.load(
            shrunk_ptr + row * stride_yt + slot_row * stride_ys + offs_r * stride_yr,
            mask=r_mask,
            other=0.0,
        ).to(tl.float32)
        b_rows = b_ptr + slot_row * stride_bl + offs_r[None, :] * stride_br
        tile_mask = mask[:, None] & r_mask[None, :]
        b_gate = tl.load(b_rows + offs[:, None] * stride_bn, mask=tile_mask, other=0.0)
        b_up = tl.load(b_rows + (half + offs[:, None]) * stride_bn, mask=tile_mask, other=0.0)
        gate_delta = tl.sum(b_gate.to(tl.float32) * y[None, :], axis=1)
        up_delta = tl.sum(b_up.to(tl.float32) * y[None, :], axis=1)
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


def silu_and_mul(
    x: torch.Tensor,
    shrunk: torch.Tensor | None = None,
    lora_b: torch.Tensor | None = None,
    token_slots: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton launch of the Semantics above: x [T, 2I] (rows may be strided, features
    contiguous) -> [T, I]; with `shrunk`, `lora_b` and `token_slots` (all or none) the
    pending expand is added first. Programs of (row, column chunk)."""
    if x.dim() != 2 or x.stride(-1) != 1 or x.shape[1] % 2:
        raise ValueError(f"x must be [T, 2I] with contiguous features, got {tuple(x.shape)}")
    num_rows, width = x.shape
    half = width // 2
    has_lora = shrunk is not None
    if has_lora and (
        lora_b is None
        or token_slots is None
        or lora_b.shape[1:] != (width, shrunk.shape[2])
        or shrunk.shape[:2] != (num_rows, lora_b.shape[0])
    ):
        raise ValueError(
            f"the pending expand does not fit x {tuple(x.shape)}: shrunk "
            f"{None if shrunk is None else tuple(shrunk.shape)}, lora_b "
            f"{None if lora_b is None else tuple(lora_b.shape)}"
        )
    out = torch.empty(num_rows, half, dtype=x.dtype, device=x.device)
    if num_rows == 0 or half == 0:
        return out
    rank = shrunk.shape[2] if has_lora else 0
    block_r = max(16, triton.next_power_of_2(rank))
    limit = _EXPAND_TILE // block_r if has_lora else _CHUNK
    chunk = max(16, min(triton.next_power_of_2(half), limit))
    unused = x.new_empty(0)
    _silu_and_mul_kernel[(num_rows, triton.cdiv(half, chunk))](
        x,
        out,
        shrunk if has_lora else unused,
        lora_b if has_lora else unused,
        token_slots if has_lora else unused,
        half,
        rank,
        x.stride(0),
        out.stride(0),
        *(shrunk.stride() if has_lora else (0, 0, 0)),
        *(lora_b.stride() if has_lora else (0, 0, 0)),
        HAS_LORA=has_lora,
        CHUNK=chunk,
        BLOCK_R=block_r,
    )
    return out
