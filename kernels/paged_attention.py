"""Triton paged attention: decode (split-K flash decoding) and chunked prefill.

Layouts are those of the torch path (`torch_paged_attention.py`, whose
`reference_paged_attention` is the oracle both paths are tested against):

    kv_cache      [2, N, Hkv, B, Dh]   0 = K, 1 = V; token p of a sequence with block
                                       table `table` sits in block table[p // B], row p % B
                                       (read through strides: any layout of N, Hkv, B works)
    block_tables  [S, W] int           block ids (entries past a sequence's end are never read)
    q             [T, H, Dh]           any strides (e.g. a view into the fused qkv output)
    H = Hkv * G                        query head h reads kv head h // G (GQA)

Every key is addressed on its own (block id from the table, then its row), so any
block size works, and a tile of keys may span several blocks. Scores, softmax and the
accumulator are fp32; the output is written in q's dtype.

Decode (one new token per sequence, its K/V already in the cache):

    _decode_kernel   grid (D, Hkv, num_splits)
        Program (d, kvh, s) takes the G query heads of kv head kvh as the rows of one
        [BLOCK_G, Dh] tile (BLOCK_G >= 16 so tl.dot applies; padding rows are masked), so
        each K/V tile is read once for the whole group. It runs an online softmax over
        keys s * P .. min((s + 1) * P, L) - 1 (P = partition size), BLOCK_N keys at a time.
        One split: it writes acc / l. Several splits: it writes its max m, sum l and
        unnormalized acc to fp32 partials, and
    _decode_reduce_kernel   grid (D, H)
        combines the valid splits s < cdiv(L, P): out = sum_s e^(m_s - M) acc_s /
        sum_s e^(m_s - M) l_s with M = max_s m_s.

Prefill (chunks of q_len >= 1 new tokens per sequence, every K/V of the sequence,
the chunk's own included, already in the cache):

    _prefill_kernel   grid (P, cdiv(max q_len, BLOCK_M), H)
        Program (p, m, h) takes BLOCK_M queries of chunk p for head h; query i sits at
        absolute position a = L - q_len + i and sees keys 0 .. a (causal, aligned
        bottom-right). Keys run to the tile's last query position only.

tl.dot operands: fp32 models multiply in IEEE fp32; half-precision models multiply q.K
in their dtype and P.V with P rounded to the dtype (the flash-attention convention),
accumulating in fp32. Under the interpreter (CPU tensors) operands are widened to fp32,
because it multiplies bf16 bit patterns as integers.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

_DECODE_PARTIALS = "triton_decode_partials"
_PREFILL_TENSORS = "triton_prefill_tensors"


@triton.jit
def _attend_tile(
    q,
    m_i,
    l_i,
    acc,
    k_cache_ptr,
    v_cache_ptr,
    table,
    pos,
    n_mask,
    visible,
    kv_head,
    scale,
    offs_d,
    d_mask,
    stride_cb,
    stride_cs,
    stride_ch,
    BLOCK_SIZE: tl.constexpr,
    WIDEN: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """One online-softmax step over the keys at positions `pos` (read through the block
    table where `n_mask`); `visible` ([rows, keys] or [1, keys]) masks the scores.
    Returns the new (m, l, acc)."""
    block_ids = tl.load(table + pos // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
    rows = block_ids * stride_cb + (pos % BLOCK_SIZE) * stride_cs + kv_head * stride_ch
    kv_mask = n_mask[:, None] & d_mask[None, :]
    k = tl.load(k_cache_ptr + rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(v_cache_ptr + rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
    if WIDEN:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
    scores = tl.where(visible, scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(scores - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def _decode_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    out_ptr,
    part_acc_ptr,
    part_stats_ptr,
    scale,
    GROUPS,
    HEAD_DIM,
    stride_qt,
    stride_qh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    stride_ot,
    stride_oh,
    stride_pat,
    stride_pah,
    stride_pas,
    stride_pst,
    stride_psh,
    stride_pss,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PARTITION: tl.constexpr,
    ONE_SPLIT: tl.constexpr,
    WIDEN: tl.constexpr,
    PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    start = split * PARTITION
    if start >= seq_len:
        return
    end = tl.minimum(start + PARTITION, seq_len)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    g_mask = offs_g < GROUPS
    d_mask = offs_d < HEAD_DIM
    heads = kv_head * GROUPS + offs_g
    q_ptrs = q_ptr + seq.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    if WIDEN:
        q = q.to(tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + offs_n
        n_mask = pos < end
        m_i, l_i, acc = _attend_tile(
            q,
            m_i,
            l_i,
            acc,
            k_cache_ptr,
            v_cache_ptr,
            table,
            pos,
            n_mask,
            n_mask[None, :],
            kv_head,
            scale,
            offs_d,
            d_mask,
            stride_cb,
            stride_cs,
            stride_ch,
            BLOCK_SIZE,
            WIDEN,
            PRECISION,
        )
    out_mask = g_mask[:, None] & d_mask[None, :]
    if ONE_SPLIT:
        out_ptrs = (
            out_ptr + seq.to(tl.int64) * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
        )
        tl.store(out_ptrs, (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        acc_ptrs = (
            part_acc_ptr
            + seq.to(tl.int64) * stride_pat
            + heads[:, None] * stride_pah
            + split * stride_pas
            + offs_d[None, :]
        )
        tl.store(acc_ptrs, acc, mask=out_mask)
        stats = part_stats_ptr + seq.to(tl.int64) * stride_pst + heads * stride_psh
        tl.store(stats + split * stride_pss, m_i, mask=g_mask)
        tl.store(stats + split * stride_pss + 1, l_i, mask=g_mask)


@triton.jit
def _decode_reduce_kernel(
    part_acc_ptr,
    part_stats_ptr,
    seq_lens_ptr,
    out_ptr,
    HEAD_DIM,
    stride_pat,
    stride_pah,
    stride_pas,
    stride_pst,
    stride_psh,
    stride_pss,
    stride_ot,
    stride_oh,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PARTITION: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    num_splits = tl.cdiv(seq_len, PARTITION)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < num_splits
    d_mask = offs_d < HEAD_DIM
    stats = part_stats_ptr + seq.to(tl.int64) * stride_pst + head * stride_psh + offs_s * stride_pss
    m_s = tl.load(stats, mask=s_mask, other=float("-inf"))
    l_s = tl.load(stats + 1, mask=s_mask, other=0.0)
    weights = tl.where(s_mask, tl.exp(m_s - tl.max(m_s, axis=0)), 0.0)
    acc_ptrs = (
        part_acc_ptr
        + seq.to(tl.int64) * stride_pat
        + head * stride_pah
        + offs_s[:, None] * stride_pas
        + offs_d[None, :]
    )
    acc = tl.load(acc_ptrs, mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    out = tl.sum(acc * weights[:, None], axis=0) / tl.sum(l_s * weights, axis=0)
    out_ptrs = out_ptr + seq.to(tl.int64) * stride_ot + head * stride_oh + offs_d
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=d_mask)


@triton.jit
def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    query_starts_ptr,
    query_lens_ptr,
    seq_lens_ptr,
    out_ptr,
    scale,
    GROUPS,
    HEAD_DIM,
    stride_qt,
    stride_qh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    stride_ot,
    stride_oh,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    WIDEN: tl.constexpr,
    PRECISION: tl.constexpr,
):
    chunk = tl.program_id(0)
    tile = tl.program_id(1)
    head = tl.program_id(2)
    q_len = tl.load(query_lens_ptr + chunk).to(tl.int32)
    if tile * BLOCK_M >= q_len:
        return
    q_start = tl.load(query_starts_ptr + chunk).to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + chunk).to(tl.int32)
    kv_head = head // GROUPS
    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    m_mask = offs_m < q_len
    d_mask = offs_d < HEAD_DIM
    positions = seq_len - q_len + offs_m
    q_rows = (q_start + offs_m) * stride_qt + head * stride_qh
    q = tl.load(
        q_ptr + q_rows[:, None] + offs_d[None, :], mask=m_mask[:, None] & d_mask[None, :], other=0.0
    )
    if WIDEN:
        q = q.to(tl.float32)
    table = block_tables_ptr + chunk.to(tl.int64) * stride_bt
    key_end = tl.minimum(seq_len, seq_len - q_len + (tile + 1) * BLOCK_M)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for n0 in range(0, key_end, BLOCK_N):
        pos = n0 + offs_n
        n_mask = pos < key_end
        visible = n_mask[None, :] & (pos[None, :] <= positions[:, None])
        m_i, l_i, acc = _attend_tile(
            q,
            m_i,
            l_i,
            acc,
            k_cache_ptr,
            v_cache_ptr,
            table,
            pos,
            n_mask,
            visible,
            kv_head,
            scale,
            offs_d,
            d_mask,
            stride_cb,
            stride_cs,
            stride_ch,
            BLOCK_SIZE,
            WIDEN,
            PRECISION,
        )
    out_rows = (q_start + offs_m) * stride_ot + head * stride_oh
    tl.store(
        out_ptr + out_rows[:, None] + offs_d[None, :],
        (acc / l_i[:, None]).to(out_ptr.dtype.element_ty),
        mask=m_mask[:, None] & d_mask[None, :],
    )


# ----------------------------------------------------------------------------- launchers


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _on_gpu(device: torch.device) -> bool:
    return device.type == "cuda"


_PRECISION = "ieee"
"""tl.dot precision of fp32 operands (exact fp32 products, as the torch path)."""


def _check_cache(q: torch.Tensor, kv_cache: torch.Tensor) -> tuple[int, int, int]:
    """(block size, kv heads, query heads per kv head) after checking shapes and strides."""
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError(f"kv_cache must be [2, N, Hkv, B, Dh], got {tuple(kv_cache.shape)}")
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = kv_cache.shape[2]
    if kv_cache.shape[4] != head_dim or num_heads % num_kv_heads:
        raise ValueError(
            f"q [T, {num_heads}, {head_dim}] does not fit kv_cache {tuple(kv_cache.shape)}"
        )
    if kv_cache.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError("q and kv_cache need a contiguous last (head_dim) dimension")
    if q.dtype != kv_cache.dtype:
        raise ValueError(f"q is {q.dtype} but the cache is {kv_cache.dtype}")
    return kv_cache.shape[3], num_kv_heads, num_heads // num_kv_heads


_MIN_KEY_TILE = 16
"""tl.dot needs every tile dimension >= 16."""


def _decode_block_n(device: torch.device, partition_size: int | None) -> int:
    """Keys per decode tile: 64 on the GPU (16 under the interpreter, whose cost is per
    element); a forced `partition_size` must be a multiple of 16 and gets the largest
    tile of 64, 32, 16 (16 off the GPU) that divides it."""
    widest = 64 if _on_gpu(device) else _MIN_KEY_TILE
    if partition_size is None:
        return widest
    if partition_size <= 0 or partition_size % _MIN_KEY_TILE:
        raise ValueError(f"partition_size {partition_size} is not a multiple of {_MIN_KEY_TILE}")
    block_n = widest
    while partition_size % block_n:
        block_n //= 2
    return block_n


def decode_partition_size(
    device: torch.device, num_programs: int, max_seq_len: int, block_n: int
) -> int:
    """Keys per split: one split when the (sequence, kv head) programs alone fill the GPU
    (or off the GPU, where the interpreter runs programs one by one); else enough splits
    of at least 256 keys to reach two programs per SM."""
    whole = triton.cdiv(max_seq_len, block_n) * block_n
    if not _on_gpu(device):
        return whole
    index = device.index if device.index is not None else torch.cuda.current_device()
    wanted = triton.cdiv(2 * _num_sms(index), max(num_programs, 1))
    splits = max(1, min(wanted, triton.cdiv(max_seq_len, 256)))
    return triton.cdiv(triton.cdiv(max_seq_len, splits), block_n) * block_n


def decode_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    partition_size: int | None = None,
    scratch: dict[str, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Semantics: out[d, h] = softmax(scale * q[d, h] . K_d[:, h // G]) @ V_d[:, h // G]
    over the keys 0 .. seq_lens[d] - 1 of sequence d (the torch path's contract).

    q [D, H, Dh]; kv_cache [2, N, Hkv, B, Dh]; block_tables [D, W] int32/int64;
    seq_lens [D] int with 1 <= seq_lens[d] <= W * B; out [D, H, Dh] (allocated if None).
    `partition_size` (a multiple of 16 keys) forces split-K; None picks one.
    `scratch` (the step's AttentionMetadata.cache) keeps the split-K partials across layers.
    """
    num_decodes, num_heads, head_dim = q.shape
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_decodes == 0:
        return out
    block_size, num_kv_heads, groups = _check_cache(q, kv_cache)
    block_n = _decode_block_n(q.device, partition_size)
    max_seq_len = block_tables.shape[1] * block_size
    partition = partition_size or decode_partition_size(
        q.device, num_decodes * num_kv_heads, max_seq_len, block_n
    )
    num_splits = triton.cdiv(max_seq_len, partition)
    block_d = triton.next_power_of_2(head_dim)
    part_acc, part_stats = _decode_partials(
        scratch, num_decodes, num_heads, num_splits, head_dim, q.device
    )
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    _decode_kernel[(num_decodes, num_kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        out,
        part_acc,
        part_stats,
        scale,
        groups,
        head_dim,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(2),
        k_cache.stride(1),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        part_acc.stride(0),
        part_acc.stride(1),
        part_acc.stride(2),
        part_stats.stride(0),
        part_stats.stride(1),
        part_stats.stride(2),
        BLOCK_SIZE=block_size,
        BLOCK_G=max(16, triton.next_power_of_2(groups)),
        BLOCK_D=block_d,
        BLOCK_N=block_n,
        PARTITION=partition,
        ONE_SPLIT=num_splits == 1,
        WIDEN=not _on_gpu(q.device),
        PRECISION=_PRECISION,
    )
    if num_splits > 1:
        _decode_reduce_kernel[(num_decodes, num_heads)](
            part_acc,
            part_stats,
            seq_lens,
            out,
            head_dim,
            part_acc.stride(0),
            part_acc.stride(1),
            part_acc.stride(2),
            part_stats.stride(0),
            part_stats.stride(1),
            part_stats.stride(2),
            out.stride(0),
            out.stride(1),
            BLOCK_S=triton.next_power_of_2(num_splits),
            BLOCK_D=block_d,
            PARTITION=partition,
        )
    return out


def _decode_partials(
    scratch: dict[str, torch.Tensor] | None,
    num_decodes: int,
    num_heads: int,
    num_splits: int,
    head_dim: int,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 acc [D, H, splits, Dh] and (m, l) stats [D, H, splits, 2]; one-element dummies
    for a single split. Reused from `scratch` when the shapes match."""
    if num_splits == 1:
        dummy = torch.empty(1, 1, 1, 1, dtype=torch.float32, device=device)
        return dummy, dummy
    shape = (num_decodes, num_heads, num_splits)
    cached = scratch.get(_DECODE_PARTIALS) if scratch is not None else None
    if cached is not None and cached.shape[:3] == shape:
        return cached[..., :head_dim], cached[..., head_dim:]
    both = torch.empty(*shape, head_dim + 2, dtype=torch.float32, device=device)
    if scratch is not None:
        scratch[_DECODE_PARTIALS] = both
    return both[..., :head_dim], both[..., head_dim:]


def _prefill_tiles(device: torch.device, dtype: torch.dtype) -> tuple[int, int]:
    """(BLOCK_M queries, BLOCK_N keys) per prefill tile. 16 x 16 under the interpreter.
    On the GPU 64 x 64 for half precision; fp32 (IEEE dot, no tensor-core layouts) at
    64 x 64 spills thousands of registers per thread and runs far slower than 32 x 32
    (kernels/README.md has the H100 figures)."""
    if not _on_gpu(device):
        return 16, 16
    if dtype == torch.float32:
        return 32, 32
    return 64, 64


def prefill_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_lens: list[int],
    seq_lens: list[int],
    scale: float,
    out: torch.Tensor | None = None,
    scratch: dict[str, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Semantics: for chunk p with q_len = query_lens[p], L = seq_lens[p], its query i sits
    at absolute position a = L - q_len + i and
        out[i, h] = softmax(scale * q[i, h] . K_p[0..a, h // G]) @ V_p[0..a, h // G]

    q [Tp, H, Dh] holds the chunks' queries back to back (Tp = sum(query_lens)); every
    key 0 .. L-1 of each chunk, its own included, is already in kv_cache [2, N, Hkv, B, Dh];
    block_tables [P, W] int -> out [Tp, H, Dh] (allocated if None). `scratch` keeps the
    per-step device copies of the chunk offsets and lengths across layers.
    """
    num_heads, head_dim = q.shape[1], q.shape[2]
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if not query_lens:
        return out
    block_size, _, groups = _check_cache(q, kv_cache)
    starts, q_lens, s_lens = _prefill_tensors(scratch, query_lens, seq_lens, q.device)
    block_m, block_n = _prefill_tiles(q.device, q.dtype)
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    grid = (len(query_lens), triton.cdiv(max(query_lens), block_m), num_heads)
    _prefill_kernel[grid](
        q,
        k_cache,
        v_cache,
        block_tables,
        starts,
        q_lens,
        s_lens,
        out,
        scale,
        groups,
        head_dim,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(2),
        k_cache.stride(1),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_N=block_n,
        WIDEN=not _on_gpu(q.device),
        PRECISION=_PRECISION,
    )
    return out


def _prefill_tensors(
    scratch: dict[str, torch.Tensor] | None,
    query_lens: list[int],
    seq_lens: list[int],
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """int32 query starts, query lengths and sequence lengths on the device (one copy
    per step: a [3, P] tensor kept in `scratch`)."""
    cached = scratch.get(_PREFILL_TENSORS) if scratch is not None else None
    if cached is None:
        starts = [0]
        for q_len in query_lens[:-1]:
            starts.append(starts[-1] + q_len)
        cached = torch.tensor([starts, query_lens, seq_lens], dtype=torch.int32).to(device)
        if scratch is not None:
            scratch[_PREFILL_TENSORS] = cached
    return cached[0], cached[1], cached[2]
