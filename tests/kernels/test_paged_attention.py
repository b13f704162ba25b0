"""Triton paged attention (decode with and without split-K, chunked prefill) against the
slow float64 reference, over edge cases: length 1, lengths at and across block
boundaries, key tiles spanning blocks and blocks spanning tiles, GQA groups that are
not powers of two, a head size that is not, and never-written cache slots (NaN: any
read of them would show up in the output).

Off CUDA the kernels run under the Triton interpreter, so shapes stay small
(LORAPLEX_TEST_DEVICE, see tests/conftest.py, picks the device).

Tolerances (out compared with torch.testing.assert_close against the fp64 reference
rounded to the dtype): fp32 1e-5 (fp32 products and sums); fp16 2e-3 and bf16 2e-2
(q.K in the dtype, P rounded to the dtype for P.V, fp32 accumulation).
"""

from __future__ import annotations

import os

import pytest
import torch

from loraplex.kernels import paged_attention as triton_attention
from loraplex.kernels.reference import reference_paged_attention

DEVICE = torch.device(os.environ.get("LORAPLEX_TEST_DEVICE", "cpu"))
"""Set by tests/conftest.py: 'cuda' on a GPU, else 'cpu' (the Triton interpreter)."""
TOLERANCES = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
DTYPES = list(TOLERANCES)


class PagedLayout:
    """A NaN-filled cache whose blocks are handed out from a shuffled pool; only the
    slots of positions 0 .. L-1 of each sequence get random K/V."""

    def __init__(
        self,
        seq_lens: list[int],
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        seed: int = 0,
    ) -> None:
        gen = torch.Generator().manual_seed(seed)
        counts = [-(-length // block_size) for length in seq_lens]
        num_blocks = sum(counts) + 3
        pool = torch.randperm(num_blocks, generator=gen).tolist()
        self.tables: list[list[int]] = []
        for count in counts:
            self.tables.append(pool[:count])
            pool = pool[count:]
        shape = (2, num_blocks, num_kv_heads, block_size, head_dim)
        cache = torch.full(shape, float("nan"))
        for table, length in zip(self.tables, seq_lens, strict=True):
            for p in range(length):
                cache[:, table[p // block_size], :, p % block_size] = torch.randn(
                    2, num_kv_heads, head_dim, generator=gen
                )
        self.cache = cache.to(dtype)
        self.seq_lens = seq_lens
        self.gen = gen

    def block_tables(self, extra_columns: int = 0) -> torch.Tensor:
        """[S, W] int64, rows padded with block 0 (padding is never read)."""
        width = max(len(t) for t in self.tables) + extra_columns
        return torch.tensor([t + [0] * (width - len(t)) for t in self.tables], dtype=torch.int64)

    def queries(self, num_tokens: int, num_heads: int, dtype: torch.dtype) -> torch.Tensor:
        head_dim = self.cache.shape[-1]
        return torch.randn(num_tokens, num_heads, head_dim, generator=self.gen).to(dtype)


def check(out: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert not out.isnan().any(), "a never-written (NaN) cache slot was read"
    tol = TOLERANCES[dtype]
    torch.testing.assert_close(out.cpu().float(), expected.float(), atol=tol, rtol=tol)


DECODE_CASES = [
    # (seq_lens, block_size, num_heads, num_kv_heads, head_dim, partition_size)
    ([1, 2, 15, 16, 17, 33], 16, 4, 2, 32, None),  # length 1, block boundaries
    ([1, 5, 8, 9, 31], 4, 6, 2, 32, None),  # a key tile spans 4 blocks; G = 3
    ([3, 40, 70], 32, 4, 4, 32, None),  # a block spans 2 key tiles; G = 1
    ([1, 17, 48, 49, 100], 16, 8, 1, 32, 16),  # split-K, one split per tile; G = 8 (MQA)
    ([20, 64, 65, 127], 8, 4, 2, 24, 32),  # split-K with 2-tile splits; Dh not a power of 2
    ([9, 12], 1, 2, 1, 16, None),  # block size 1
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", DECODE_CASES, ids=lambda c: f"L{c[0]}-B{c[1]}-P{c[5]}")
def test_decode_matches_reference(case, dtype):
    seq_lens, block_size, num_heads, num_kv_heads, head_dim, partition = case
    layout = PagedLayout(seq_lens, block_size, num_kv_heads, head_dim, dtype)
    q = layout.queries(len(seq_lens), num_heads, dtype)
    tables = layout.block_tables(extra_columns=1)
    out = triton_attention.decode_attention(
        q.to(DEVICE),
        layout.cache.to(DEVICE),
        tables.to(DEVICE),
        torch.tensor(seq_lens).to(DEVICE),
        head_dim**-0.5,
        partition_size=partition,
    )
    expected = reference_paged_attention(
        q, layout.cache, layout.tables, seq_lens, [1] * len(seq_lens), head_dim**-0.5
    )
    check(out, expected, dtype)


def test_decode_writes_into_a_strided_output_and_reads_a_strided_query():
    """q and out as views with row strides wider than H * Dh (as in the fused qkv
    output and the engine's shared output buffer); split partials reused from scratch."""
    seq_lens, heads, kv_heads, head_dim = [5, 18, 40], 4, 2, 16
    layout = PagedLayout(seq_lens, 8, kv_heads, head_dim, torch.float32)
    wide = layout.queries(3, heads + 2 * kv_heads, torch.float32).to(DEVICE)
    q = wide[:, :heads]
    out_buffer = torch.zeros(3, heads + 1, head_dim, device=DEVICE)
    out = out_buffer[:, 1:]
    scratch: dict[str, torch.Tensor] = {}
    cache = layout.cache.to(DEVICE)
    args = (layout.block_tables().to(DEVICE), torch.tensor(seq_lens).to(DEVICE), head_dim**-0.5)
    for _ in range(2):
        triton_attention.decode_attention(
            q, cache, *args, out=out, partition_size=16, scratch=scratch
        )
    expected = reference_paged_attention(
        q.cpu(), layout.cache, layout.tables, seq_lens, [1] * 3, 0.25
    )
    check(out, expected, torch.float32)
    assert out_buffer[:, 0].eq(0).all()
    assert len(scratch) == 1


PREFILL_CASES = [
    # (query_lens, seq_lens, block_size, num_heads, num_kv_heads, head_dim)
    ([7, 16, 1, 33], [7, 16, 1, 33], 16, 4, 2, 32),  # fresh chunks, one query-tile edge each
    ([5, 1, 20], [21, 17, 52], 16, 4, 2, 32),  # chunks after cached prefixes
    ([3, 9, 4], [3, 30, 12], 4, 6, 2, 24),  # G = 3, Dh not a power of 2, small blocks
    ([40], [70], 32, 2, 2, 16),  # several query tiles after a cached prefix
    ([6, 2], [6, 11], 1, 2, 1, 16),  # block size 1
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", PREFILL_CASES, ids=lambda c: f"q{c[0]}-L{c[1]}-B{c[2]}")
def test_prefill_matches_reference(case, dtype):
    query_lens, seq_lens, block_size, num_heads, num_kv_heads, head_dim = case
    layout = PagedLayout(seq_lens, block_size, num_kv_heads, head_dim, dtype)
    q = layout.queries(sum(query_lens), num_heads, dtype)
    out = triton_attention.prefill_attention(
        q.to(DEVICE),
        layout.cache.to(DEVICE),
        layout.block_tables().to(DEVICE),
        query_lens,
        seq_lens,
        head_dim**-0.5,
    )
    expected = reference_paged_attention(
        q, layout.cache, layout.tables, seq_lens, query_lens, head_dim**-0.5
    )
    check(out, expected, dtype)


def test_empty_batches_return_empty_outputs():
    cache = torch.zeros(2, 2, 1, 4, 16)
    q = torch.zeros(0, 2, 16)
    tables = torch.zeros(0, 1, dtype=torch.int64)
    assert triton_attention.decode_attention(q, cache, tables, torch.zeros(0), 1.0).shape == q.shape
    assert triton_attention.prefill_attention(q, cache, tables, [], [], 1.0).shape == q.shape


def test_mismatched_shapes_and_dtypes_are_refused():
    cache = torch.zeros(2, 2, 2, 4, 16)
    tables = torch.zeros(1, 1, dtype=torch.int64)
    lens = torch.ones(1, dtype=torch.int64)
    with pytest.raises(ValueError, match="does not fit"):
        triton_attention.decode_attention(torch.zeros(1, 3, 16), cache, tables, lens, 1.0)
    with pytest.raises(ValueError, match="bfloat16"):
        triton_attention.decode_attention(
            torch.zeros(1, 2, 16, dtype=torch.bfloat16), cache, tables, lens, 1.0
        )
    with pytest.raises(ValueError, match="multiple"):
        triton_attention.decode_attention(
            torch.zeros(1, 2, 16), cache, tables, lens, 1.0, partition_size=20
        )
