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


@triton.jit
def _rms_norm_expand_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    residual_out_ptr,
    shrunk_ptr,
    b_ptr,
    slots_ptr,
    hidden,
    rank,
    eps,
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    stride_yt,
    stride_ys,
    stride_yr,
    stride_bl,
    stride_bn,
    stride_br,
    HAS_RESIDUAL: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_R: tl.constexpr,
    ONE_PASS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + row)
    slot_row = tl.maximum(slot, 0).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = (offs_r < rank) & (slot >= 0)
    y = tl.load(
        shrunk_ptr + row * stride_yt + slot_row * stride_ys + offs_r * stride_yr,
        mask=r_mask,
        other=0.0,
    ).to(tl.float32)
    if ONE_PASS:  # the row in one tile (CHUNK >= hidden): no store read back
        offs = tl.arange(0, CHUNK)
        mask = offs < hidden
        x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
        b = tl.load(
            b_ptr + slot_row * stride_bl + offs[:, None] * stride_bn + offs_r[None, :] * stride_br,
            mask=mask[:, None] & r_mask[None, :],
            other=0.0,
        ).to(tl.float32)
        s = (x.to(tl.float32) + tl.sum(b * y[None, :], axis=1)).to(x.dtype)
        if HAS_RESIDUAL:
            r = tl.load(residual_ptr + row * stride_r + offs, mask=mask, other=0.0)
            s = (s.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(residual_out_ptr + row * stride_ro + offs, s, mask=mask)
        h = s.to(tl.float32)
        inv_rms = 1.0 / tl.sqrt_rn(tl.sum(h * h, axis=0) / hidden + eps)
        normed = (h * inv_rms).to(s.dtype).to(tl.float32)
        w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(
            out_ptr + row * stride_o + offs, (w * normed).to(out_ptr.dtype.element_ty), mask=mask
        )
        return
    squares = tl.zeros([CHUNK], dtype=tl.float32)
    for start in range(0, hidden, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        mask = offs < hidden
        x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
        b = tl.load(
            b_ptr + slot_row * stride_bl + offs[:, None] * stride_bn + offs_r[None, :] * stride_br,
            mask=mask[:, None] & r_mask[None, :],
            other=0.0,
        ).to(tl.float32)
        s = (x.to(tl.float32) + tl.sum(b * y[None, :], axis=1)).to(x.dtype)
        if HAS_RESIDUAL:
            r = tl.load(residual_ptr + row * stride_r + offs, mask=mask, other=0.0)
            s = (s.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(residual_out_ptr + row * stride_ro + offs, s, mask=mask)
        h = s.to(tl.float32)
        squares += h * h
    inv_rms = 1.0 / tl.sqrt_rn(tl.sum(squares, axis=0) / hidden + eps)
    tl.debug_barrier()  # the sums stored above, read back by other threads of the program
    for start in range(0, hidden, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        mask = offs < hidden
        s = tl.load(residual_out_ptr + row * stride_ro + offs, mask=mask, other=0.0)
        normed = (s.to(tl.float32) * inv_rms).to(s.dtype).to(tl.float32)
        w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(
            out_ptr + row * stride_o + offs, (w * normed).to(out_ptr.dtype.element_ty), mask=mask
        )


_EXPAND_TILE = 4096
"""Elements of one program's B tile (CHUNK x BLOCK_R) in the two-pass form: 32 fp32
registers a thread at 4 warps."""
_ONE_PASS_TILE = 32768
"""Largest B tile (the whole row x BLOCK_R) taken in one pass, at 16 warps (64 fp32
registers a thread): hidden 2048 at rank columns 16. The two-pass form loops over the
row twice with its loads one chunk at a time, which an H200 measured no faster than the
expand kernel and the norm it replaces at 64 decode rows."""


def rms_norm_expand(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    shrunk: torch.Tensor,
    lora_b: torch.Tensor,
    token_slots: torch.Tensor,
    *,
    one_pass: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`rms_norm` of x plus the LoRA expand its projection left pending (a folded shrink,
    platform/layers/linear.py), in one kernel instead of an expand kernel and a norm.

    Semantics: x' = x + delta rounded to x's dtype, with delta[t] = shrunk[t, s_t] @
    lora_b[s_t].T for each token t of slot s_t = token_slots[t] >= 0 (0 where s_t = -1);
    then the Semantics above on x' (so residual_out = x' + residual, always a fresh
    tensor). The roundings are those of the expand kernel followed by the norm.

    x, residual [T, hidden] (rows may be strided, features contiguous), shrunk
    [T, L, R] (x's dtype or fp32, any strides), lora_b [L, hidden, R], token_slots [T]
    int64. One program per row: the whole row in one tile where its B tile fits
    (`_ONE_PASS_TILE`), else over the row in chunks, a first pass adding and storing the
    sums, a second normalizing them. `one_pass` forces the form (benchmarks, tests)."""
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"x must be [T, hidden] with contiguous features, got {tuple(x.shape)}")
    if residual is not None and (residual.shape != x.shape or residual.stride(-1) != 1):
        raise ValueError(f"residual {tuple(residual.shape)} does not match x {tuple(x.shape)}")
    num_rows, hidden = x.shape
    rank = shrunk.shape[2]
    if lora_b.shape[1:] != (hidden, rank) or shrunk.shape[:2] != (num_rows, lora_b.shape[0]):
        raise ValueError(
            f"shrunk {tuple(shrunk.shape)} and lora_b {tuple(lora_b.shape)} do not fit x "
            f"{tuple(x.shape)}"
        )
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    residual_out = torch.empty_like(out)
    if num_rows:
        block_r = max(16, triton.next_power_of_2(rank))
        row = max(16, triton.next_power_of_2(hidden))
        if one_pass is None:
            one_pass = row * block_r <= _ONE_PASS_TILE
        chunk = row if one_pass else max(16, min(row, _EXPAND_TILE // block_r))
        warps = max(4, min(16, chunk * block_r // 2048))
        _rms_norm_expand_kernel[(num_rows,)](
            x,
            x if residual is None else residual,
            weight,
            out,
            residual_out,
            shrunk,
            lora_b,
            token_slots,
            hidden,
            rank,
            eps,
            x.stride(0),
            x.stride(0) if residual is None else residual.stride(0),
            out.stride(0),
            residual_out.stride(0),
            shrunk.stride(0),
            shrunk.stride(1),
            shrunk.stride(2),
            lora_b.stride(0),
            lora_b.stride(1),
            lora_b.stride(2),
            HAS_RESIDUAL=residual is not None,
            CHUNK=chunk,
            BLOCK_R=block_r,
            ONE_PASS=one_pass,
            num_warps=warps,
        )
    return out, residual_out
