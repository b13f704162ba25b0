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

from loraplex.kernels.lora import PendingExpand
from loraplex.kernels.triton_lora import token_delta, token_shrink


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
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    pending: PendingExpand | None = None,
    *,
    one_pass: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton launch of the Semantics above: x, residual [T, hidden] (rows may be strided,
    features contiguous) -> (out, residual_out), fresh [T, hidden] tensors; without a
    residual, residual_out is x itself. One program per row. With `pending`, the LoRA
    expand x's projection left undone is added first (`_rms_norm_expand`)."""
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"x must be [T, hidden] with contiguous features, got {tuple(x.shape)}")
    if residual is not None and (residual.shape != x.shape or residual.stride(-1) != 1):
        raise ValueError(f"residual {tuple(residual.shape)} does not match x {tuple(x.shape)}")
    if pending is not None:
        return _rms_norm_expand(x, residual, weight, eps, pending, one_pass)
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
def _expanded_sum(
    x_ptr,
    residual_ptr,
    residual_out_ptr,
    b_ptr,
    row,
    offs,
    mask,
    slot_row,
    offs_r,
    r_mask,
    y,
    stride_x,
    stride_r,
    stride_ro,
    stride_bl,
    stride_bn,
    stride_br,
    HAS_RESIDUAL: tl.constexpr,
):
    """s = x + delta (rounded to x's dtype), + residual (rounded again), over columns
    `offs` of `row`; stored as the new residual and returned."""
    delta = token_delta(
        b_ptr, slot_row, offs, mask, offs_r, r_mask, y, stride_bl, stride_bn, stride_br
    )
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    s = (x.to(tl.float32) + delta).to(x.dtype)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + offs, mask=mask, other=0.0)
        s = (s.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
    tl.store(residual_out_ptr + row * stride_ro + offs, s, mask=mask)
    return s


@triton.jit
def _normalized_store(out_ptr, weight_ptr, row, offs, mask, s, inv_rms, stride_o):
    normed = (s.to(tl.float32) * inv_rms).to(s.dtype).to(tl.float32)
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (w * normed).to(out_ptr.dtype.element_ty), mask=mask)


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
    slot_row, offs_r, r_mask, y = token_shrink(
        shrunk_ptr, slots_ptr, row, rank, stride_yt, stride_ys, stride_yr, BLOCK_R
    )
    if ONE_PASS:  # the row in one tile (CHUNK >= hidden): the sums stay in registers
        offs = tl.arange(0, CHUNK)
        mask = offs < hidden
        s = _expanded_sum(
            x_ptr, residual_ptr, residual_out_ptr, b_ptr, row, offs, mask, slot_row, offs_r,
            r_mask, y, stride_x, stride_r, stride_ro, stride_bl, stride_bn, stride_br,
            HAS_RESIDUAL,
        )  # fmt: skip
        h = s.to(tl.float32)
        inv_rms = 1.0 / tl.sqrt_rn(tl.sum(h * h, axis=0) / hidden + eps)
        _normalized_store(out_ptr, weight_ptr, row, offs, mask, s, inv_rms, stride_o)
    else:
        squares = tl.zeros([CHUNK], dtype=tl.float32)
        for start in range(0, hidden, CHUNK):
            offs = start + tl.arange(0, CHUNK)
            mask = offs < hidden
            s = _expanded_sum(
                x_ptr, residual_ptr, residual_out_ptr, b_ptr, row, offs, mask, slot_row,
                offs_r, r_mask, y, stride_x, stride_r, stride_ro, stride_bl, stride_bn,
                stride_br, HAS_RESIDUAL,
            )  # fmt: skip
            h = s.to(tl.float32)
            squares += h * h
        inv_rms = 1.0 / tl.sqrt_rn(tl.sum(squares, axis=0) / hidden + eps)
        tl.debug_barrier()  # the sums stored above, read back by other threads of the program
        for start in range(0, hidden, CHUNK):
            offs = start + tl.arange(0, CHUNK)
            mask = offs < hidden
            s = tl.load(residual_out_ptr + row * stride_ro + offs, mask=mask, other=0.0)
            _normalized_store(out_ptr, weight_ptr, row, offs, mask, s, inv_rms, stride_o)


_EXPAND_TILE = 4096
"""Elements of one program's B tile (CHUNK x BLOCK_R) in the two-pass form: 32 fp32
registers a thread at 4 warps."""
_ONE_PASS_TILE = 32768
"""Largest B tile (the whole row x BLOCK_R) taken in one pass, at 16 warps (64 fp32
registers a thread): hidden 2048 at rank columns 16. The two-pass form loops over the
row twice with its loads one chunk at a time; with it, an H200 measured no gain for a
decode graph's LoRA step (docs/benchmarks.md, "On a GPU")."""


def _rms_norm_expand(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    pending: PendingExpand,
    one_pass: bool | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`rms_norm` of x plus the LoRA expand its projection left pending (a folded shrink,
    platform/layers/linear.py), in one kernel instead of an expand kernel and a norm.

    Semantics: x' = x + delta rounded to x's dtype, with delta[t] = shrunk[t, s_t] @
    b[s_t].T for each token t of slot s_t = token_slots[t] >= 0 (0 where s_t = -1);
    then the Semantics above on x' (so residual_out = x' + residual, always a fresh
    tensor). The roundings are those of the expand kernel followed by the norm.

    x, residual [T, hidden]; pending.shrunk [T, L, R] (x's dtype or fp32, any strides),
    pending.b [L, hidden, R], pending.token_slots [T] int64. One program per row: the
    whole row in one tile where its B tile fits (`_ONE_PASS_TILE`), else over the row in
    chunks, a first pass adding and storing the sums, a second normalizing them.
    `one_pass` forces the form (benchmarks, tests)."""
    shrunk, lora_b = pending.shrunk, pending.b
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
        _rms_norm_expand_kernel[(num_rows,)](
            x,
            x if residual is None else residual,
            weight,
            out,
            residual_out,
            shrunk,
            lora_b,
            pending.token_slots.contiguous(),  # read as slots_ptr + row
            hidden,
            rank,
            eps,
            x.stride(0),
            x.stride(0) if residual is None else residual.stride(0),
            out.stride(0),
            residual_out.stride(0),
            *shrunk.stride(),
            *lora_b.stride(),
            HAS_RESIDUAL=residual is not None,
            CHUNK=chunk,
            BLOCK_R=block_r,
            ONE_PASS=one_pass,
            num_warps=max(4, min(16, chunk * block_r // 2048)),
        )
    return out, residual_out
