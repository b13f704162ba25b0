"""Rotary embedding fused with the KV-cache write: q and k are rotated in place and k
(rotated) and v go straight into their cache slots, in one pass over the step's tokens.

Semantics (neox half-split layout, as `torch_layers.apply_rotary`), for token t with
cos / sin = cos[t] / sin[t] ([Dh/2], in the model dtype), halves x1 = x[..., :Dh/2],
x2 = x[..., Dh/2:], and s = slot_mapping[t]:
    rot(x) = cat(x1 * cos - x2 * sin, x2 * cos + x1 * sin)   computed in fp32, stored in dtype
    q[t] <- rot(q[t]);  k[t] <- rot(k[t])                    (in place, every head)
    kv_cache[0, s // B, :, s % B] = k[t];  kv_cache[1, s // B, :, s % B] = v[t]   (s >= 0 only)

Shapes: q [T, H, Dh], k / v [T, Hkv, Dh] (any token and head strides, contiguous Dh,
e.g. views into the fused qkv output), cos / sin [T, Dh/2], kv_cache [2, N, Hkv, B, Dh],
slot_mapping [T] int. A negative slot skips the cache write (padding tokens).

Against the torch path (which rounds each product to the dtype): fp32 agrees to
rounding; half precision may differ by one ulp in a few elements.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(
    x_ptr, stride_h, num_heads, cos, sin, offs_h, offs_half, half_mask, HALF: tl.constexpr
):
    """Loads x [heads, Dh] of one token, returns its rotated halves (fp32)."""
    mask = (offs_h[:, None] < num_heads) & half_mask[None, :]
    first = x_ptr + offs_h[:, None] * stride_h + offs_half[None, :]
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
    return x1 * cos[None, :] - x2 * sin[None, :], x2 * cos[None, :] + x1 * sin[None, :], mask


@triton.jit
def _rotary_write_kv_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    cos_ptr,
    sin_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    num_heads,
    num_kv_heads,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ct,
    stride_st,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    BLOCK_SIZE: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_KV: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    offs_half = tl.arange(0, BLOCK_HALF)
    half_mask = offs_half < HALF
    cos = tl.load(cos_ptr + token * stride_ct + offs_half, mask=half_mask, other=0.0)
    sin = tl.load(sin_ptr + token * stride_st + offs_half, mask=half_mask, other=0.0)
    cos = cos.to(tl.float32)
    sin = sin.to(tl.float32)

    offs_h = tl.arange(0, BLOCK_H)
    q_row = q_ptr + token * stride_qt
    q1, q2, q_mask = _rotate_heads(
        q_row, stride_qh, num_heads, cos, sin, offs_h, offs_half, half_mask, HALF
    )
    q_first = q_row + offs_h[:, None] * stride_qh + offs_half[None, :]
    tl.store(q_first, q1.to(q_ptr.dtype.element_ty), mask=q_mask)
    tl.store(q_first + HALF, q2.to(q_ptr.dtype.element_ty), mask=q_mask)

    offs_kv = tl.arange(0, BLOCK_KV)
    k_row = k_ptr + token * stride_kt
    k1, k2, kv_mask = _rotate_heads(
        k_row, stride_kh, num_kv_heads, cos, sin, offs_kv, offs_half, half_mask, HALF
    )
    k1 = k1.to(k_ptr.dtype.element_ty)
    k2 = k2.to(k_ptr.dtype.element_ty)
    k_first = k_row + offs_kv[:, None] * stride_kh + offs_half[None, :]
    tl.store(k_first, k1, mask=kv_mask)
    tl.store(k_first + HALF, k2, mask=kv_mask)

    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot >= 0:
        cache_row = (
            (slot // BLOCK_SIZE) * stride_cache_block
            + (slot % BLOCK_SIZE) * stride_cache_slot
            + offs_kv[:, None] * stride_cache_head
            + offs_half[None, :]
        )
        tl.store(k_cache_ptr + cache_row, k1.to(k_cache_ptr.dtype.element_ty), mask=kv_mask)
        tl.store(k_cache_ptr + cache_row + HALF, k2.to(k_cache_ptr.dtype.element_ty), mask=kv_mask)
        v_first = v_ptr + token * stride_vt + offs_kv[:, None] * stride_vh + offs_half[None, :]
        v1 = tl.load(v_first, mask=kv_mask, other=0.0)
        v2 = tl.load(v_first + HALF, mask=kv_mask, other=0.0)
        tl.store(v_cache_ptr + cache_row, v1.to(v_cache_ptr.dtype.element_ty), mask=kv_mask)
        tl.store(v_cache_ptr + cache_row + HALF, v2.to(v_cache_ptr.dtype.element_ty), mask=kv_mask)


def rotary_write_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Triton launch of the Semantics above (in place on q, k and kv_cache); one program
    per token covering all its heads."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if head_dim % 2 or k.shape != v.shape or k.shape[0] != num_tokens or k.shape[2] != head_dim:
        raise ValueError(
            f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: need [T, H, Dh] and "
            "[T, Hkv, Dh] with an even Dh"
        )
    if kv_cache.shape[0] != 2 or (kv_cache.shape[2], kv_cache.shape[4]) != (num_kv_heads, head_dim):
        raise ValueError(
            f"kv_cache {tuple(kv_cache.shape)} is not [2, N, {num_kv_heads}, B, {head_dim}]"
        )
    if cos.shape != (num_tokens, head_dim // 2) or sin.shape != cos.shape:
        raise ValueError(
            f"cos / sin must be [{num_tokens}, {head_dim // 2}], got {tuple(cos.shape)}"
        )
    if any(t.stride(-1) != 1 for t in (q, k, v, cos, sin, kv_cache)):
        raise ValueError("q, k, v, cos, sin and kv_cache need a contiguous last dimension")
    if num_tokens == 0:
        return
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    half = head_dim // 2
    _rotary_write_kv_kernel[(num_tokens,)](
        q,
        k,
        v,
        cos,
        sin,
        k_cache,
        v_cache,
        slot_mapping,
        num_heads,
        num_kv_heads,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        cos.stride(0),
        sin.stride(0),
        k_cache.stride(0),
        k_cache.stride(2),
        k_cache.stride(1),
        BLOCK_SIZE=kv_cache.shape[3],
        HALF=half,
        BLOCK_HALF=triton.next_power_of_2(half),
        BLOCK_H=triton.next_power_of_2(num_heads),
        BLOCK_KV=triton.next_power_of_2(num_kv_heads),
    )
