"""Paged attention in plain torch (the CPU path) plus a slow reference for tests.

KV cache of one layer: [2, num_blocks, B, Hkv, Dh] (0 = K, 1 = V). Token p of a
sequence with block table `table` lives in slot table[p // B] * B + p % B.
Heads: H query heads share Hkv kv heads in groups of G = H / Hkv (query head h reads
kv head h // G).

Per-step derived tensors (gather buffers, masks, slot lists) go into a `scratch`
dict (the step's `AttentionMetadata.cache`), so every layer after the first reuses them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_DECODE_MASK = "torch_decode_mask"
_DECODE_BUFFER = "torch_decode_kv"
_PREFILL_SLOTS = "torch_prefill_slots"
_PREFILL_MASKS = "torch_prefill_masks"


def write_kv(
    kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Semantics: for each token t, with s = slot_mapping[t]:
        kv_cache[0, s // B, s % B] = k[t];  kv_cache[1, s // B, s % B] = v[t]
    kv_cache [2, N, B, Hkv, Dh]; k, v [T, Hkv, Dh] (cache dtype); slot_mapping [T] int64.
    """
    num_kv_heads, head_dim = kv_cache.shape[-2:]
    flat = kv_cache.view(2, -1, num_kv_heads, head_dim)
    flat[0].index_copy_(0, slot_mapping, k)
    flat[1].index_copy_(0, slot_mapping, v)


def decode_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    scratch: dict[str, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Semantics: out[d, h] = softmax(scale * q[d, h] . K_d[:, h // G]) @ V_d[:, h // G]
    over the keys 0 .. seq_lens[d] - 1 of sequence d.

    q [D, H, Dh]; kv_cache [2, N, B, Hkv, Dh]; block_tables [D, W] int64 (padding
    entries are any valid id); seq_lens [D] int64 with 1 <= seq_lens[d] <= W * B
    -> out [D, H, Dh].

    All decodes run at once: whole blocks are gathered into a padded [D, W * B] layout
    (one index_select into a per-step buffer), positions past each length get an
    additive -inf mask (built once per step), and the G query heads of a kv head ride as
    G query rows of one batched matmul - softmax - matmul.
    """
    num_decodes, num_heads, head_dim = q.shape
    if num_decodes == 0:
        return q.new_empty(q.shape)
    scratch = {} if scratch is None else scratch
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    width = block_tables.shape[1]
    max_len = width * block_size
    mask = scratch.get(_DECODE_MASK)
    if mask is None:
        positions = torch.arange(max_len, device=q.device)
        beyond = positions[None, :] >= seq_lens[:, None]
        mask = torch.zeros(beyond.shape, dtype=q.dtype, device=q.device)
        mask = mask.masked_fill_(beyond, float("-inf")).view(num_decodes, 1, 1, max_len)
        scratch[_DECODE_MASK] = mask
    buffer = scratch.get(_DECODE_BUFFER)
    if buffer is None:
        shape = (2, num_decodes * width, block_size, num_kv_heads, head_dim)
        buffer = torch.empty(shape, dtype=kv_cache.dtype, device=kv_cache.device)
        scratch[_DECODE_BUFFER] = buffer
    torch.index_select(kv_cache, 1, block_tables.reshape(-1), out=buffer)
    kv = buffer.view(2, num_decodes, max_len, num_kv_heads, head_dim).transpose(2, 3)
    groups = num_heads // num_kv_heads
    q_grouped = q.reshape(num_decodes, num_kv_heads, groups, head_dim)
    # Two batched matmuls beat SDPA here: one query row per head leaves its flash
    # kernel nothing to tile (measured 1.0 vs 1.5 ms at 64 x 192 keys, 2 cores).
    scores = torch.matmul(q_grouped, kv[0].transpose(-1, -2)).mul_(scale).add_(mask)
    out = torch.matmul(scores.softmax(dim=-1), kv[1])
    return out.reshape(num_decodes, num_heads, head_dim)


def prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_lens: list[int],
    seq_lens: list[int],
    scale: float,
    scratch: dict[str, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Semantics: for prefill sequence p with q_len = query_lens[p], L = seq_lens[p],
    its query i sits at absolute position a = L - q_len + i and
        out[i, h] = softmax(scale * q[i, h] . K_p[0..a, h // G]) @ V_p[0..a, h // G]

    q [Tp, H, Dh], k / v [Tp, Hkv, Dh] (this step's new tokens, already written to the
    cache); kv_cache [2, N, B, Hkv, Dh]; block_tables [P, W] int64; Tp = sum(query_lens)
    -> out [Tp, H, Dh].

    A chunk without cached prefix (L == q_len) attends to its own k/v with a causal
    mask, and a run of consecutive such chunks of equal length shares one batched SDPA
    call; otherwise keys 0..L-1 are gathered from the cache and a bottom-right aligned
    causal mask is applied, one SDPA call per sequence.
    """
    if not query_lens:
        return q.new_empty(q.shape)
    scratch = {} if scratch is None else scratch
    slots, masks = _prefill_gather_plan(block_tables, query_lens, seq_lens, kv_cache, scratch)
    num_kv_heads, head_dim = kv_cache.shape[-2:]
    flat = kv_cache.view(2, -1, num_kv_heads, head_dim)
    outputs = []
    q_start = slot_start = mask_start = 0
    for q_len, seq_len, count in _runs_of_fresh_chunks(query_lens, seq_lens):
        if seq_len == q_len:
            out = F.scaled_dot_product_attention(
                *(_batch_of_chunks(t, q_start, count, q_len) for t in (q, k, v)),
                is_causal=True,
                scale=scale,
                enable_gqa=True,
            )
            outputs.append(out.transpose(1, 2).flatten(0, 1))
            q_start += count * q_len
            continue
        q_i = q[q_start : q_start + q_len].transpose(0, 1)
        seq_slots = slots[slot_start : slot_start + seq_len]
        kv = flat.index_select(1, seq_slots).transpose(1, 2)
        mask = masks[mask_start : mask_start + q_len * seq_len].view(q_len, seq_len)
        out = F.scaled_dot_product_attention(
            q_i, kv[0], kv[1], attn_mask=mask, scale=scale, enable_gqa=True
        )
        slot_start += seq_len
        mask_start += q_len * seq_len
        outputs.append(out.transpose(0, 1))
        q_start += q_len
    return torch.cat(outputs, dim=0)


def _batch_of_chunks(t: torch.Tensor, start: int, count: int, length: int) -> torch.Tensor:
    """`count` consecutive chunks of `length` tokens from t [T, heads, Dh], starting at
    token `start` -> [count, heads, length, Dh] (a view)."""
    chunks = t[start : start + count * length].unflatten(0, (count, length))
    return chunks.transpose(1, 2)


def _runs_of_fresh_chunks(query_lens: list[int], seq_lens: list[int]) -> list[tuple[int, int, int]]:
    """(q_len, seq_len, count): consecutive chunks without cached prefix and of equal
    length merge into one entry; any other chunk is an entry of count 1."""
    runs: list[tuple[int, int, int]] = []
    for q_len, seq_len in zip(query_lens, seq_lens, strict=True):
        if runs and q_len == seq_len and runs[-1][:2] == (q_len, seq_len):
            runs[-1] = (q_len, seq_len, runs[-1][2] + 1)
        else:
            runs.append((q_len, seq_len, 1))
    return runs


def _prefill_gather_plan(
    block_tables: torch.Tensor,
    query_lens: list[int],
    seq_lens: list[int],
    kv_cache: torch.Tensor,
    scratch: dict[str, torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Slots of keys 0..L-1 and flattened [q_len, L] masks, concatenated over the
    sequences that have a cached prefix (in order); computed once per step."""
    if _PREFILL_SLOTS in scratch:
        return scratch[_PREFILL_SLOTS], scratch[_PREFILL_MASKS]
    block_size = kv_cache.shape[2]
    device = block_tables.device
    slot_parts = [torch.empty(0, dtype=torch.int64, device=device)]
    mask_parts = [torch.empty(0, dtype=torch.bool, device=device)]
    for row, (q_len, seq_len) in enumerate(zip(query_lens, seq_lens, strict=True)):
        if seq_len == q_len:
            continue
        positions = torch.arange(seq_len, device=device)
        blocks = block_tables[row].index_select(0, positions // block_size)
        slot_parts.append(blocks * block_size + positions % block_size)
        visible = torch.ones(q_len, seq_len, dtype=torch.bool, device=device)
        mask_parts.append(visible.tril(seq_len - q_len).reshape(-1))
    scratch[_PREFILL_SLOTS] = torch.cat(slot_parts)
    scratch[_PREFILL_MASKS] = torch.cat(mask_parts)
    return scratch[_PREFILL_SLOTS], scratch[_PREFILL_MASKS]


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
    kv_cache [2, N, B, Hkv, Dh] through block_tables[s]. Returns [T, H, Dh] in q.dtype.
    """
    block_size = kv_cache.shape[2]
    num_heads, num_kv_heads = q.shape[1], kv_cache.shape[3]
    groups = num_heads // num_kv_heads
    out = torch.empty(q.shape, dtype=torch.float64)
    token = 0
    for table, seq_len, q_len in zip(block_tables, seq_lens, query_lens, strict=True):
        for i in range(q_len):
            last = seq_len - q_len + i
            slots = [(table[p // block_size], p % block_size) for p in range(last + 1)]
            keys = torch.stack([kv_cache[0, b, o] for b, o in slots]).double()
            values = torch.stack([kv_cache[1, b, o] for b, o in slots]).double()
            for h in range(num_heads):
                scores = (keys[:, h // groups] @ q[token, h].double()) * scale
                out[token, h] = scores.softmax(0) @ values[:, h // groups]
            token += 1
    return out.to(q.dtype)
