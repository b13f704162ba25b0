"""Paged attention in plain torch (the reference CPU path; its fp64 oracle is in
reference.py).

KV cache of one layer: [2, num_blocks, Hkv, B, Dh] (0 = K, 1 = V), head-major inside
a block: the B keys of one kv head in one block are one contiguous [B, Dh] run. Token p
of a sequence with block table `table` lives in block table[p // B], row p % B (its
slot is table[p // B] * B + p % B). Heads: H query heads share Hkv kv heads in groups
of G = H / Hkv (query head h reads kv head h // G).

Head-major blocks let one index_select over (block, kv head) pairs gather a batch's
keys straight into the [D, Hkv, L, Dh] layout batched matmuls read, with no transpose
copy (a [B, Hkv, Dh] layout needs one).

Per-step derived tensors (gather indices and buffers, masks) go into a `scratch` dict
(the step's `AttentionMetadata.cache`), so every layer after the first reuses them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_DECODE_MASK = "torch_decode_mask"
_DECODE_INDEX = "torch_decode_index"
_DECODE_BUFFER = "torch_decode_kv"
_PREFILL_INDEX = "torch_prefill_index"
_PREFILL_MASKS = "torch_prefill_masks"


def block_head_index(block_tables: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """[S, W] block ids -> [S * Hkv * W] rows of the cache viewed as [N * Hkv, B, Dh],
    ordered (sequence, kv head, block): gathering them yields [S, Hkv, W * B, Dh]."""
    heads = torch.arange(num_kv_heads, device=block_tables.device)
    return (block_tables[:, None, :] * num_kv_heads + heads[None, :, None]).reshape(-1)


def write_kv(
    kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Semantics: for each token t, with s = slot_mapping[t]:
        kv_cache[0, s // B, :, s % B] = k[t];  kv_cache[1, s // B, :, s % B] = v[t]
    kv_cache [2, N, Hkv, B, Dh]; k, v [T, Hkv, Dh] (cache dtype); slot_mapping [T] int64.
    """
    block_size = kv_cache.shape[3]
    blocks, rows = slot_mapping // block_size, slot_mapping % block_size
    # [N, B, Hkv, Dh] views of K and V: index (block, row) puts a token's heads in place.
    kv_cache[0].transpose(1, 2)[blocks, rows] = k
    kv_cache[1].transpose(1, 2)[blocks, rows] = v


def read_slots(kv_cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """The inverse of `write_kv`: kv_cache [2, N, Hkv, B, Dh], slots [S] -> [2, S, Hkv, Dh]."""
    block_size = kv_cache.shape[3]
    return kv_cache.transpose(2, 3)[:, slots // block_size, slots % block_size]


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

    q [D, H, Dh]; kv_cache [2, N, Hkv, B, Dh]; block_tables [D, W] int64 (padding
    entries are any valid id); seq_lens [D] int64 with 1 <= seq_lens[d] <= W * B
    -> out [D, H, Dh].

    All decodes run at once: one index_select gathers every (sequence, kv head, block)
    run into a per-step [2, D, Hkv, W * B, Dh] buffer, positions past each length get an
    additive -inf mask (built once per step), and the G query heads of a kv head ride as
    G query rows of one batched matmul - softmax - matmul.
    """
    num_decodes, num_heads, head_dim = q.shape
    if num_decodes == 0:
        return q.new_empty(q.shape)
    scratch = {} if scratch is None else scratch
    num_blocks, num_kv_heads, block_size = kv_cache.shape[1:4]
    width = block_tables.shape[1]
    max_len = width * block_size
    mask = scratch.get(_DECODE_MASK)
    if mask is None:
        positions = torch.arange(max_len, device=q.device)
        beyond = positions[None, :] >= seq_lens[:, None]
        mask = torch.zeros(beyond.shape, dtype=q.dtype, device=q.device)
        mask = mask.masked_fill_(beyond, float("-inf")).view(num_decodes, 1, 1, max_len)
        scratch[_DECODE_MASK] = mask
        scratch[_DECODE_INDEX] = block_head_index(block_tables, num_kv_heads)
        shape = (2, num_decodes * num_kv_heads * width, block_size, head_dim)
        scratch[_DECODE_BUFFER] = torch.empty(shape, dtype=kv_cache.dtype, device=q.device)
    buffer = scratch[_DECODE_BUFFER]
    flat = kv_cache.view(2, num_blocks * num_kv_heads, block_size, head_dim)
    torch.index_select(flat, 1, scratch[_DECODE_INDEX], out=buffer)
    kv = buffer.view(2, num_decodes * num_kv_heads, max_len, head_dim)
    groups = num_heads // num_kv_heads
    q_grouped = q.reshape(num_decodes * num_kv_heads, groups, head_dim)
    # Two 3-d bmm calls beat SDPA (one query row per head leaves its flash kernel nothing
    # to tile) and a 4-d matmul at decode shapes.
    scores = torch.bmm(q_grouped, kv[0].transpose(1, 2)).mul_(scale)
    scores = scores.view(num_decodes, num_kv_heads, groups, max_len).add_(mask)
    probs = scores.softmax(dim=-1).view(num_decodes * num_kv_heads, groups, max_len)
    return torch.bmm(probs, kv[1]).view(num_decodes, num_heads, head_dim)


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
    cache); kv_cache [2, N, Hkv, B, Dh]; block_tables [P, W] int64; Tp = sum(query_lens)
    -> out [Tp, H, Dh].

    A chunk without cached prefix (L == q_len) attends to its own k/v with a causal
    mask, and a run of consecutive such chunks of equal length shares one batched SDPA
    call; otherwise keys 0..L-1 are gathered from the cache and a bottom-right aligned
    causal mask is applied, one SDPA call per sequence.
    """
    if not query_lens:
        return q.new_empty(q.shape)
    scratch = {} if scratch is None else scratch
    index, masks = _prefill_gather_plan(block_tables, query_lens, seq_lens, kv_cache, scratch)
    num_blocks, num_kv_heads, block_size, head_dim = kv_cache.shape[1:]
    flat = kv_cache.view(2, num_blocks * num_kv_heads, block_size, head_dim)
    outputs = []
    q_start = index_start = mask_start = 0
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
        count = num_kv_heads * -(-seq_len // block_size)
        kv = flat.index_select(1, index[index_start : index_start + count])
        kv = kv.view(2, num_kv_heads, -1, head_dim)[:, :, :seq_len]
        mask = masks[mask_start : mask_start + q_len * seq_len].view(q_len, seq_len)
        out = F.scaled_dot_product_attention(
            q_i, kv[0], kv[1], attn_mask=mask, scale=scale, enable_gqa=True
        )
        index_start += count
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
    """(block, kv head) gather rows of keys 0..L-1 (see `block_head_index`) and flattened
    [q_len, L] masks, concatenated over the sequences that have a cached prefix (in
    order); computed once per step."""
    if _PREFILL_INDEX in scratch:
        return scratch[_PREFILL_INDEX], scratch[_PREFILL_MASKS]
    num_kv_heads, block_size = kv_cache.shape[2:4]
    device = block_tables.device
    index_parts = [torch.empty(0, dtype=torch.int64, device=device)]
    mask_parts = [torch.empty(0, dtype=torch.bool, device=device)]
    for row, (q_len, seq_len) in enumerate(zip(query_lens, seq_lens, strict=True)):
        if seq_len == q_len:
            continue
        blocks = block_tables[row : row + 1, : -(-seq_len // block_size)]
        index_parts.append(block_head_index(blocks, num_kv_heads))
        visible = torch.ones(q_len, seq_len, dtype=torch.bool, device=device)
        mask_parts.append(visible.tril(seq_len - q_len).reshape(-1))
    scratch[_PREFILL_INDEX] = torch.cat(index_parts)
    scratch[_PREFILL_MASKS] = torch.cat(mask_parts)
    return scratch[_PREFILL_INDEX], scratch[_PREFILL_MASKS]
