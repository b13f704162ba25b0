"""Slow, obviously correct implementations of the kernels' contracts: test oracles
only, never called by the engine. Each follows the "Semantics:" docstring of the module
it checks (torch_paged_attention.py, rotary_kv.py, lora.py) in the widest precision
that is cheap to run.
"""

from __future__ import annotations

import torch


def reference_paged_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: list[list[int]],
    seq_lens: list[int],
    query_lens: list[int],
    scale: float,
) -> torch.Tensor:
    """Slow float64 oracle, one query token and head at a time.

    q [T, H, Dh] holds each sequence's query_lens[s] tokens contiguously, in sequence
    order; its last token sits at position seq_lens[s] - 1. Keys are read from
    kv_cache [2, N, Hkv, B, Dh] through block_tables[s]. Returns [T, H, Dh] in q.dtype.
    """
    num_kv_heads, block_size = kv_cache.shape[2:4]
    num_heads = q.shape[1]
    groups = num_heads // num_kv_heads
    out = torch.empty(q.shape, dtype=torch.float64)
    token = 0
    for table, seq_len, q_len in zip(block_tables, seq_lens, query_lens, strict=True):
        for i in range(q_len):
            last = seq_len - q_len + i
            slots = [(table[p // block_size], p % block_size) for p in range(last + 1)]
            keys = torch.stack([kv_cache[0, b, :, o] for b, o in slots]).double()
            values = torch.stack([kv_cache[1, b, :, o] for b, o in slots]).double()
            for h in range(num_heads):
                scores = (keys[:, h // groups] @ q[token, h].double()) * scale
                out[token, h] = scores.softmax(0) @ values[:, h // groups]
            token += 1
    return out.to(q.dtype)


def reference_rotary_write_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain torch, fp32 rotation: returns the rotated (q, k) and writes the cache."""

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.float().chunk(2, dim=-1)
        c, s = cos.float()[:, None], sin.float()[:, None]
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)

    q_rot, k_rot = rotate(q), rotate(k)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    block_size = kv_cache.shape[3]
    blocks, rows = slots // block_size, slots % block_size
    kv_cache[0].transpose(1, 2)[blocks, rows] = k_rot[keep]
    kv_cache[1].transpose(1, 2)[blocks, rows] = v[keep]
    return q_rot, k_rot


def reference_shrink(
    x: torch.Tensor, lora_a: torch.Tensor, token_slots: torch.Tensor
) -> torch.Tensor:
    """Slow, obviously correct shrink in fp32 (tests' oracle). Returns y [T, R] fp32."""
    y = torch.zeros(x.shape[0], lora_a.shape[1], dtype=torch.float32, device=x.device)
    for t, slot in enumerate(token_slots.tolist()):
        if slot >= 0:
            y[t] = x[t].float() @ lora_a[slot].float().T
    return y


def reference_expand(
    y: torch.Tensor, lora_b: torch.Tensor, token_slots: torch.Tensor, out: torch.Tensor
) -> torch.Tensor:
    """Slow, obviously correct expand in fp32: returns out + delta as fp32 (out untouched)."""
    result = out.float().clone()
    for t, slot in enumerate(token_slots.tolist()):
        if slot >= 0:
            result[t] += y[t].float() @ lora_b[slot].float().T
    return result
