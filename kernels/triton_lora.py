"""Triton kernels for batched multi-LoRA (punica-style BGMV / SGMV shrink and expand).

Contract, shapes and the slow reference are in `lora.py`; `triton_add_lora` there calls
the four launch functions below. Names: T tokens, D decode tokens, S prefill segments,
K = in features, N = out features, R = rank columns, L = adapter slots.

BGMV ("batched gather matrix-vector", decode tokens, one token per program row):

    _bgmv_shrink_kernel   grid (D, SPLIT_K)
        Program (t, s) reads token t's slot, then sums x[t, k] * A[slot, r, k] over the
        K blocks s, s + SPLIT_K, s + 2 * SPLIT_K, ... for all R columns at once
        (BLOCK_R = next power of two >= R). SPLIT_K = 1 stores y[t]; SPLIT_K > 1 (few
        tokens on a big GPU) zeroes y first and adds the partial sums with atomics.
    _bgmv_expand_kernel   grid (D, cdiv(N, BLOCK_N))
        Program (t, n) computes out[t, n-block] += B[slot, n-block, :] @ y[t], looping
        over R in BLOCK_R chunks.

    Few tokens give no tile dimension >= 16, so BGMV multiplies elementwise and reduces
    with tl.sum instead of tl.dot (which needs every dimension >= 16).

SGMV ("segmented gather matrix-vector", prefill chunks: runs of tokens sharing a slot):

    _sgmv_shrink_kernel   grid (S, cdiv(max_seg_len, BLOCK_M), cdiv(R, BLOCK_R) * SPLIT_K)
        Program (g, m, r * SPLIT_K + s) takes BLOCK_M tokens of segment g (returns at
        once past the segment's end) and computes y[rows, r-block] = x[rows] @
        A[slot, r-block].T with tl.dot over the BLOCK_K chunks s, s + SPLIT_K, ... of K.
        SPLIT_K > 1 (few short segments, as in a decode graph's step: a grid of a few
        programs each looping over all of K would leave the GPU idle) adds the partial
        sums into y, zeroed first, with atomics.
    _sgmv_expand_kernel   grid (S, cdiv(max_seg_len, BLOCK_M), cdiv(N, BLOCK_N))
        Program (g, m, n) computes out[rows, n-block] += y[rows] @ B[slot, n-block].T,
        looping over R in BLOCK_R chunks. y may hold every slot's shrink ([T, L, R],
        from `dense_shrink`: one cuBLAS matmul over all slots' A, for a decode graph's
        few tokens); the program then reads y[rows, slot].

Every kernel accumulates in fp32. Expand is a read-modify-write of `out`: each output
element belongs to exactly one program (segments and blocks are disjoint), so no atomics.
Slot -1 (base model): shrink writes zeros, expand leaves the row alone. Tokens outside
every segment are never touched by SGMV kernels. All tensors are addressed through their
strides, so row slices such as `x[:D]` need no copy.

tl.dot precision: the shrink multiplies x and A in their own dtype (bf16 / fp16 tensor
cores, fp32 accumulator); expand multiplies the fp32 y by B widened to fp32, as TF32 for
half-precision models (B is exact in TF32; y keeps 10 mantissa bits, more than bf16) and
as IEEE fp32 for fp32 models. Under the Triton interpreter (CPU tensors) dot operands are
widened to fp32 first, because the interpreter multiplies bf16 bit patterns as integers.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

_MAX_TILE = 4096
"""Elements of one BGMV weight tile: 32 fp32 registers per thread at 4 warps."""


@triton.jit
def _bgmv_shrink_kernel(
    x_ptr,
    a_ptr,
    slots_ptr,
    y_ptr,
    K,
    R,
    stride_xt,
    stride_xk,
    stride_al,
    stride_ar,
    stride_ak,
    stride_yt,
    stride_yr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
):
    token = tl.program_id(0)
    split = tl.program_id(1)
    slot = tl.load(slots_ptr + token)
    offs_r = tl.arange(0, BLOCK_R)
    offs_k = tl.arange(0, BLOCK_K)
    r_mask = offs_r < R
    acc = tl.zeros([BLOCK_R, BLOCK_K], dtype=tl.float32)
    if slot >= 0:
        x_row = x_ptr + token.to(tl.int64) * stride_xt
        a_rows = a_ptr + slot.to(tl.int64) * stride_al + offs_r[:, None] * stride_ar
        for k0 in range(split * BLOCK_K, K, SPLIT_K * BLOCK_K):
            k = k0 + offs_k
            k_mask = k < K
            xv = tl.load(x_row + k * stride_xk, mask=k_mask, other=0.0).to(tl.float32)
            av = tl.load(
                a_rows + k[None, :] * stride_ak,
                mask=r_mask[:, None] & k_mask[None, :],
                other=0.0,
            ).to(tl.float32)
            acc += av * xv[None, :]
    y = tl.sum(acc, axis=1)
    y_ptrs = y_ptr + token.to(tl.int64) * stride_yt + offs_r * stride_yr
    if SPLIT_K == 1:
        tl.store(y_ptrs, y, mask=r_mask)
    else:
        tl.atomic_add(y_ptrs, y, mask=r_mask)


@triton.jit
def _bgmv_expand_kernel(
    y_ptr,
    b_ptr,
    slots_ptr,
    out_ptr,
    N,
    R,
    stride_yt,
    stride_yr,
    stride_bl,
    stride_bn,
    stride_br,
    stride_ot,
    stride_on,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    token = tl.program_id(0)
    pid_n = tl.program_id(1)
    slot = tl.load(slots_ptr + token)
    if slot < 0:
        return
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_r = tl.arange(0, BLOCK_R)
    y_row = y_ptr + token.to(tl.int64) * stride_yt
    b_rows = b_ptr + slot.to(tl.int64) * stride_bl + offs_n[:, None] * stride_bn
    acc = tl.zeros([BLOCK_N, BLOCK_R], dtype=tl.float32)
    for r0 in range(0, R, BLOCK_R):
        r = r0 + offs_r
        r_mask = r < R
        yv = tl.load(y_row + r * stride_yr, mask=r_mask, other=0.0).to(tl.float32)
        bv = tl.load(
            b_rows + r[None, :] * stride_br, mask=n_mask[:, None] & r_mask[None, :], other=0.0
        ).to(tl.float32)
        acc += bv * yv[None, :]
    delta = tl.sum(acc, axis=1)
    out_ptrs = out_ptr + token.to(tl.int64) * stride_ot + offs_n * stride_on
    old = tl.load(out_ptrs, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(out_ptrs, (old + delta).to(out_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def _sgmv_shrink_kernel(
    x_ptr,
    a_ptr,
    y_ptr,
    seg_starts_ptr,
    seg_lens_ptr,
    seg_slots_ptr,
    K,
    R,
    stride_xt,
    stride_xk,
    stride_al,
    stride_ar,
    stride_ak,
    stride_yt,
    stride_yr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    WIDEN: tl.constexpr,
    PRECISION: tl.constexpr,
):
    seg = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_r = tl.program_id(2) // SPLIT_K
    split = tl.program_id(2) % SPLIT_K
    seg_len = tl.load(seg_lens_ptr + seg)
    if pid_m * BLOCK_M >= seg_len:
        return
    seg_start = tl.load(seg_starts_ptr + seg)
    slot = tl.load(seg_slots_ptr + seg)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < seg_len
    rows = (seg_start + offs_m).to(tl.int64)
    offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    r_mask = offs_r < R
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    if slot >= 0:
        x_rows = x_ptr + rows[:, None] * stride_xt
        # A[slot] read transposed: a [BLOCK_K, BLOCK_R] tile of A[slot].T.
        a_cols = a_ptr + slot.to(tl.int64) * stride_al + offs_r[None, :] * stride_ar
        for k0 in range(split * BLOCK_K, K, SPLIT_K * BLOCK_K):
            k = k0 + offs_k
            k_mask = k < K
            xt = tl.load(
                x_rows + k[None, :] * stride_xk, mask=m_mask[:, None] & k_mask[None, :], other=0.0
            )
            at = tl.load(
                a_cols + k[:, None] * stride_ak, mask=k_mask[:, None] & r_mask[None, :], other=0.0
            )
            if WIDEN:
                xt = xt.to(tl.float32)
                at = at.to(tl.float32)
            acc = tl.dot(xt, at, acc, input_precision=PRECISION)
    y_ptrs = y_ptr + rows[:, None] * stride_yt + offs_r[None, :] * stride_yr
    if SPLIT_K == 1:
        tl.store(y_ptrs, acc, mask=m_mask[:, None] & r_mask[None, :])
    else:
        tl.atomic_add(y_ptrs, acc, mask=m_mask[:, None] & r_mask[None, :])


@triton.jit
def _sgmv_expand_kernel(
    y_ptr,
    b_ptr,
    out_ptr,
    seg_starts_ptr,
    seg_lens_ptr,
    seg_slots_ptr,
    N,
    R,
    stride_yt,
    stride_ys,
    stride_yr,
    stride_bl,
    stride_bn,
    stride_br,
    stride_ot,
    stride_on,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    PRECISION: tl.constexpr,
):
    seg = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_n = tl.program_id(2)
    seg_len = tl.load(seg_lens_ptr + seg)
    slot = tl.load(seg_slots_ptr + seg)
    if (pid_m * BLOCK_M >= seg_len) | (slot < 0):
        return
    seg_start = tl.load(seg_starts_ptr + seg)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < seg_len
    rows = (seg_start + offs_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_r = tl.arange(0, BLOCK_R)
    y_rows = y_ptr + rows[:, None] * stride_yt + slot.to(tl.int64) * stride_ys
    # B[slot] read transposed: a [BLOCK_R, BLOCK_N] tile of B[slot].T.
    b_cols = b_ptr + slot.to(tl.int64) * stride_bl + offs_n[None, :] * stride_bn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for r0 in range(0, R, BLOCK_R):
        r = r0 + offs_r
        r_mask = r < R
        yt = tl.load(
            y_rows + r[None, :] * stride_yr, mask=m_mask[:, None] & r_mask[None, :], other=0.0
        )
        bt = tl.load(
            b_cols + r[:, None] * stride_br, mask=r_mask[:, None] & n_mask[None, :], other=0.0
        )
        acc = tl.dot(yt.to(tl.float32), bt.to(tl.float32), acc, input_precision=PRECISION)
    out_ptrs = out_ptr + rows[:, None] * stride_ot + offs_n[None, :] * stride_on
    out_mask = m_mask[:, None] & n_mask[None, :]
    old = tl.load(out_ptrs, mask=out_mask, other=0.0).to(tl.float32)
    tl.store(out_ptrs, (old + acc).to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def token_shrink(
    shrunk_ptr, slots_ptr, row, rank, stride_yt, stride_ys, stride_yr, BLOCK_R: tl.constexpr
):
    """Token `row`'s shrink of its own slot, for a kernel adding a pending expand
    (lora.py `PendingExpand`): (its slot clamped to >= 0 for addressing, the rank
    offsets, their mask (none for slot -1), y [BLOCK_R] fp32, zero where masked)."""
    slot = tl.load(slots_ptr + row)
    slot_row = tl.maximum(slot, 0).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = (offs_r < rank) & (slot >= 0)
    y = tl.load(
        shrunk_ptr + row * stride_yt + slot_row * stride_ys + offs_r * stride_yr,
        mask=r_mask,
        other=0.0,
    ).to(tl.float32)
    return slot_row, offs_r, r_mask, y


@triton.jit
def token_delta(
    b_ptr, slot_row, cols, col_mask, offs_r, r_mask, y, stride_bl, stride_bn, stride_br
):
    """delta[c] = sum_r B[slot, cols[c], r] * y[r] in fp32 (0 where masked), from
    `token_shrink`'s values: one token's expand over the output columns `cols`."""
    b = tl.load(
        b_ptr + slot_row * stride_bl + cols[:, None] * stride_bn + offs_r[None, :] * stride_br,
        mask=col_mask[:, None] & r_mask[None, :],
        other=0.0,
    ).to(tl.float32)
    return tl.sum(b * y[None, :], axis=1)


# ----------------------------------------------------------------------------- launchers


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _parallelism(device: torch.device) -> int:
    """Programs worth launching to fill the device: two per SM on CUDA, 1 elsewhere (the
    interpreter runs programs one after another, so fewer, larger ones are faster)."""
    if device.type != "cuda":
        return 1
    return 2 * _num_sms(device.index if device.index is not None else torch.cuda.current_device())


def _bgmv_shrink_split_k(device: torch.device, num_tokens: int, k_blocks: int) -> int:
    """Splits K across programs when the decode batch alone cannot fill the device."""
    return max(1, min(k_blocks, triton.cdiv(_parallelism(device), num_tokens), 16))


def _sgmv_shrink_split_k(device: torch.device, live_programs: int, k_blocks: int) -> int:
    """Splits K across programs when the segments' row tiles alone cannot fill the
    device (decode-sized segments); 1 off CUDA."""
    if device.type != "cuda":
        return 1
    return max(1, min(k_blocks, _parallelism(device) // max(live_programs, 1), 16))


def _sgmv_block_m(
    device: torch.device, num_segments: int, max_seg_len: int, other_blocks: int
) -> int:
    """Largest BLOCK_M in (64, 32, 16) whose grid still fills the device; 16 off CUDA,
    where the interpreter's cost is per element, not per program."""
    if device.type != "cuda":
        return 16
    for block_m in (64, 32):
        if num_segments * triton.cdiv(max_seg_len, block_m) * other_blocks >= _parallelism(device):
            return block_m
    return 16


def _sgmv_expand_block_m(
    out: torch.Tensor, num_segments: int, max_seg_len: int, n_blocks: int
) -> int:
    """16 rows when the segments average 16 tokens or fewer (a decode graph's table,
    sized for one adapter taking every row, would otherwise pick 64-row tiles for 8-row
    segments), else as `_sgmv_block_m`. H100, Llama-3.2-1B projections, 8 segments of 8
    rows, in a graph: 17.8 us per layer against 26.5 us with 64-row tiles."""
    if out.shape[0] <= 16 * num_segments:
        return 16
    return _sgmv_block_m(out.device, num_segments, max_seg_len, n_blocks)


_SHRINK_SMEM_BUDGET = 160 * 1024
"""Bytes of shared memory the pipelined x and A tiles of one SGMV shrink program may
take (the H100 allows 227 KB per block)."""


def _sgmv_shrink_k_tile(x: torch.Tensor, block_m: int, block_r: int) -> tuple[int, int]:
    """(BLOCK_K, num_stages) of the SGMV shrink. Half precision on the GPU: K tiles up to
    256 wide, 4 stages deep, narrowed to fit `_SHRINK_SMEM_BUDGET` (about twice as fast
    as 64-wide tiles and 3 stages on an H100; kernels/README.md has the figures). fp32
    (IEEE dot, little gain from wider tiles) and the interpreter keep 64 and 3."""
    widest = triton.next_power_of_2(x.shape[1])
    if x.device.type != "cuda" or x.dtype == torch.float32:
        return max(16, min(64, widest)), 3
    block_k = max(16, min(256, widest))
    tile_bytes = 4 * (block_m + block_r) * x.element_size()  # x and A rows, 4 stages
    while block_k > 16 and tile_bytes * block_k > _SHRINK_SMEM_BUDGET:
        block_k //= 2
    return block_k, 4


def _dot_precision(dtype: torch.dtype) -> str:
    """IEEE for fp32 models (tight accuracy); TF32 is only used with exact-in-TF32 B."""
    return "ieee" if dtype == torch.float32 else "tf32"


def _check_common(activations: torch.Tensor, weights: torch.Tensor, y: torch.Tensor | None) -> None:
    if weights.dim() != 3:
        raise ValueError(f"stacked LoRA weights must be [L, ., .], got {tuple(weights.shape)}")
    if weights.dtype != activations.dtype:
        raise ValueError(f"LoRA weights are {weights.dtype}, activations {activations.dtype}")
    if y is not None and y.dtype != torch.float32:
        raise ValueError(f"y must be float32, got {y.dtype}")


def bgmv_shrink(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    token_slots: torch.Tensor,
    y: torch.Tensor,
    *,
    split_k: int | None = None,
) -> None:
    """Semantics: y[t] = x[t] @ lora_a[s_t].T, y[t] = 0 where s_t = -1 (y written, not
    accumulated).

    x [D, K] (fp32 / bf16 / fp16), lora_a [L, R, K] (x's dtype), token_slots [D] int64,
    y [D, R] fp32. `split_k` overrides the K split (default: chosen to fill the GPU;
    > 1 sums partial products with fp32 atomics, so the low bits are order-dependent).
    """
    _check_common(x, lora_a, y)
    num_tokens, k_dim = x.shape
    rank = lora_a.shape[1]
    if num_tokens == 0 or rank == 0:
        return
    if k_dim == 0:
        y.zero_()
        return
    block_r = triton.next_power_of_2(rank)
    block_k = max(16, min(512, _MAX_TILE // block_r, triton.next_power_of_2(k_dim)))
    if split_k is None:
        split_k = _bgmv_shrink_split_k(x.device, num_tokens, triton.cdiv(k_dim, block_k))
    if split_k > 1:
        y.zero_()
    _bgmv_shrink_kernel[(num_tokens, split_k)](
        x,
        lora_a,
        token_slots,
        y,
        k_dim,
        rank,
        x.stride(0),
        x.stride(1),
        lora_a.stride(0),
        lora_a.stride(1),
        lora_a.stride(2),
        y.stride(0),
        y.stride(1),
        BLOCK_R=block_r,
        BLOCK_K=block_k,
        SPLIT_K=split_k,
        num_warps=4,
    )


def bgmv_expand(
    y: torch.Tensor, lora_b: torch.Tensor, token_slots: torch.Tensor, out: torch.Tensor
) -> None:
    """Semantics: out[t] += y[t] @ lora_b[s_t].T, out[t] unchanged where s_t = -1.

    y [D, R] fp32, lora_b [L, N, R] (out's dtype), token_slots [D] int64, out [D, N]
    (fp32 / bf16 / fp16), updated in place with an fp32 sum rounded once.
    """
    _check_common(out, lora_b, y)
    num_tokens, n_dim = out.shape
    rank = lora_b.shape[2]
    if num_tokens == 0 or rank == 0 or n_dim == 0:
        return
    block_r = min(64, triton.next_power_of_2(rank))
    block_n = max(16, min(256, _MAX_TILE // block_r, triton.next_power_of_2(n_dim)))
    _bgmv_expand_kernel[(num_tokens, triton.cdiv(n_dim, block_n))](
        y,
        lora_b,
        token_slots,
        out,
        n_dim,
        rank,
        y.stride(0),
        y.stride(1),
        lora_b.stride(0),
        lora_b.stride(1),
        lora_b.stride(2),
        out.stride(0),
        out.stride(1),
        BLOCK_N=block_n,
        BLOCK_R=block_r,
        num_warps=4,
    )


def sgmv_shrink(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    seg_starts: torch.Tensor,
    seg_lens: torch.Tensor,
    seg_slots: torch.Tensor,
    max_seg_len: int,
    y: torch.Tensor,
    *,
    block_m: int | None = None,
    split_k: int | None = None,
) -> None:
    """Semantics: y[t] = x[t] @ lora_a[g_slot].T for every token t of every segment g
    (tokens seg_starts[g] .. seg_starts[g] + seg_lens[g] - 1). Other rows of y are
    untouched, except with a K split > 1, which zeroes all of y first.

    x [T, K] (fp32 / bf16 / fp16), lora_a [L, R, K] (x's dtype), seg_starts / seg_lens /
    seg_slots [S] int32 (absolute token starts), max_seg_len = max(seg_lens), y [T, R] fp32.
    `block_m` (16, 32 or 64 tokens per program) overrides the default chosen from the grid;
    `split_k` the K split (default: chosen to fill the GPU when the segments' row tiles
    cannot; > 1 sums partial products with fp32 atomics, so the low bits are
    order-dependent).
    """
    _check_common(x, lora_a, y)
    num_segments = seg_starts.numel()
    k_dim = x.shape[1]
    rank = lora_a.shape[1]
    if num_segments == 0 or max_seg_len == 0 or rank == 0:
        return
    block_r = max(16, min(128, triton.next_power_of_2(rank)))
    r_blocks = triton.cdiv(rank, block_r)
    if block_m is None:
        block_m = _sgmv_block_m(x.device, num_segments, max_seg_len, r_blocks)
    block_k, num_stages = _sgmv_shrink_k_tile(x, block_m, block_r)
    m_blocks = triton.cdiv(max_seg_len, block_m)
    if split_k is None:
        # Row tiles that hold a token: at most one partial tile per segment beyond the
        # full tiles of all T rows (a graph's table sizes max_seg_len for the worst case).
        live = min(num_segments * m_blocks, triton.cdiv(x.shape[0], block_m) + num_segments)
        split_k = _sgmv_shrink_split_k(x.device, live * r_blocks, triton.cdiv(k_dim, block_k))
    if split_k > 1:
        y.zero_()
    grid = (num_segments, m_blocks, r_blocks * split_k)
    _sgmv_shrink_kernel[grid](
        x,
        lora_a,
        y,
        seg_starts,
        seg_lens,
        seg_slots,
        k_dim,
        rank,
        x.stride(0),
        x.stride(1),
        lora_a.stride(0),
        lora_a.stride(1),
        lora_a.stride(2),
        y.stride(0),
        y.stride(1),
        BLOCK_M=block_m,
        BLOCK_R=block_r,
        BLOCK_K=block_k,
        SPLIT_K=split_k,
        WIDEN=x.device.type != "cuda",
        PRECISION=_dot_precision(x.dtype),
        num_warps=4,
        num_stages=num_stages,
    )


def dense_shrink(x: torch.Tensor, lora_a: torch.Tensor) -> torch.Tensor:
    """Semantics: y[t, l] = x[t] @ lora_a[l].T for every token t and every slot l: one
    dense matmul over all slots' A, y [T, L, R] in x's dtype (rounded once, as PEFT's
    lora_A output is), for `sgmv_expand` to read each token's slot from.

    x [T, K], lora_a [L, R, K] contiguous. For few tokens and few slots (a decode
    graph's step) this one GEMM replaces the SGMV shrink's launch: a decode of 8 rows per
    adapter leaves that kernel latency-bound."""
    num_slots, rank, k_dim = lora_a.shape
    return torch.mm(x, lora_a.view(num_slots * rank, k_dim).T).view(-1, num_slots, rank)


def sgmv_expand(
    y: torch.Tensor,
    lora_b: torch.Tensor,
    seg_starts: torch.Tensor,
    seg_lens: torch.Tensor,
    seg_slots: torch.Tensor,
    max_seg_len: int,
    out: torch.Tensor,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
) -> None:
    """Semantics: out[t] += y[t] @ lora_b[g_slot].T for every token t of every segment g
    (tokens seg_starts[g] .. seg_starts[g] + seg_lens[g] - 1); other rows of out untouched.

    y [T, R] fp32, or [T, L, R] (fp32 or out's dtype) holding every slot's shrink, of
    which token t reads y[t, g_slot] (`dense_shrink`). lora_b [L, N, R] (out's dtype),
    seg_starts / seg_lens / seg_slots [S] int32 (absolute token starts), max_seg_len =
    max(seg_lens), out [T, N] (fp32 / bf16 / fp16), updated in place with an fp32 sum
    rounded once. `block_m` as in `sgmv_shrink`; `block_n` (output columns per program)
    overrides the default.
    """
    if y.dim() == 3:
        _check_common(out, lora_b, None)
        if y.dtype not in (torch.float32, out.dtype) or y.shape[1] != lora_b.shape[0]:
            raise ValueError(f"per-slot y must be [T, L, R] fp32 or {out.dtype}, got {y.dtype}")
    else:
        _check_common(out, lora_b, y)
    num_segments = seg_starts.numel()
    n_dim = out.shape[1]
    rank = lora_b.shape[2]
    if num_segments == 0 or max_seg_len == 0 or rank == 0 or n_dim == 0:
        return
    block_r = max(16, min(64, triton.next_power_of_2(rank)))
    if block_n is None:
        block_n = max(16, min(128, triton.next_power_of_2(n_dim)))
    n_blocks = triton.cdiv(n_dim, block_n)
    if block_m is None:
        block_m = _sgmv_expand_block_m(out, num_segments, max_seg_len, n_blocks)
    grid = (num_segments, triton.cdiv(max_seg_len, block_m), n_blocks)
    _sgmv_expand_kernel[grid](
        y,
        lora_b,
        out,
        seg_starts,
        seg_lens,
        seg_slots,
        n_dim,
        rank,
        y.stride(0),
        y.stride(1) if y.dim() == 3 else 0,
        y.stride(-1),
        lora_b.stride(0),
        lora_b.stride(1),
        lora_b.stride(2),
        out.stride(0),
        out.stride(1),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_R=block_r,
        PRECISION=_dot_precision(out.dtype),
        num_warps=4 if block_m * block_n <= 64 * 64 else 8,
    )
