"""Torch paged attention vs the slow float64 reference, over edge-case layouts."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from loraplex.kernels.attention_metadata import AttentionMetadata
from loraplex.kernels.backends import get_backend
from loraplex.kernels.reference import reference_paged_attention
from loraplex.kernels.torch_paged_attention import (
    decode_attention,
    prefill_attention,
    read_slots,
    write_kv,
)

BLOCK_SIZE = 4
NUM_BLOCKS = 40
HEAD_DIM = 16
TRITON_DEVICE = torch.device(os.environ.get("LORAPLEX_TEST_DEVICE", "cpu"))
"""Where the Triton backend runs (tests/conftest.py): compiled on a GPU, else interpreted."""


def make_tables(seq_lens: list[int], generator: torch.Generator) -> list[list[int]]:
    """Disjoint block tables drawn from a shuffled pool (block 0 included)."""
    pool = torch.randperm(NUM_BLOCKS, generator=generator).tolist()
    tables = []
    for seq_len in seq_lens:
        count = -(-seq_len // BLOCK_SIZE)
        tables.append(pool[:count])
        pool = pool[count:]
    return tables


def pad(tables: list[list[int]]) -> torch.Tensor:
    width = max((len(t) for t in tables), default=0)
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int64).reshape(
        len(tables), width
    )


def random_cache(num_kv_heads: int, dtype: torch.dtype, generator: torch.Generator):
    shape = (2, NUM_BLOCKS, num_kv_heads, BLOCK_SIZE, HEAD_DIM)
    return torch.randn(shape, generator=generator).to(dtype)


def slots_of(table: list[int], positions: range) -> list[int]:
    return [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in positions]


def tolerance(dtype: torch.dtype) -> dict[str, float]:
    return {"atol": 2e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 3e-2, "rtol": 3e-2}


HEADS = [(4, 2), (4, 4), (6, 1)]
DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("num_heads,num_kv_heads", HEADS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_matches_reference(num_heads, num_kv_heads, dtype):
    gen = torch.Generator().manual_seed(1)
    seq_lens = [1, 4, 5, 8, 13, 2]
    tables = make_tables(seq_lens, gen)
    cache = random_cache(num_kv_heads, dtype, gen)
    q = torch.randn(len(seq_lens), num_heads, HEAD_DIM, generator=gen).to(dtype)
    scale = HEAD_DIM**-0.5
    scratch: dict[str, torch.Tensor] = {}
    lens = torch.tensor(seq_lens)
    out = decode_attention(q, cache, pad(tables), lens, scale, scratch)
    again = decode_attention(q, cache, pad(tables), lens, scale, scratch)
    expected = reference_paged_attention(q, cache, tables, seq_lens, [1] * len(seq_lens), scale)
    torch.testing.assert_close(out, expected, **tolerance(dtype))
    assert torch.equal(out, again)
    assert scratch, "derived gather tensors are cached for later layers"


PREFILL_LAYOUTS = {
    "mixed": ([1, 4, 3, 5, 1, 8], [1, 4, 7, 8, 9, 8]),
    # runs of fresh chunks of equal length share one SDPA call; cached ones break runs
    "fresh_runs": ([4, 4, 4, 3, 5, 5, 2, 2], [4, 4, 4, 7, 5, 5, 2, 9]),
}


@pytest.mark.parametrize("num_heads,num_kv_heads", HEADS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", list(PREFILL_LAYOUTS))
def test_prefill_matches_reference(num_heads, num_kv_heads, dtype, layout):
    gen = torch.Generator().manual_seed(2)
    query_lens, seq_lens = PREFILL_LAYOUTS[layout]
    tables = make_tables(seq_lens, gen)
    cache = random_cache(num_kv_heads, dtype, gen)
    q = torch.randn(sum(query_lens), num_heads, HEAD_DIM, generator=gen).to(dtype)
    new_slots = [
        s
        for table, q_len, seq_len in zip(tables, query_lens, seq_lens, strict=True)
        for s in slots_of(table, range(seq_len - q_len, seq_len))
    ]
    k, v = read_slots(cache, torch.tensor(new_slots))
    scale = HEAD_DIM**-0.5
    out = prefill_attention(q, k, v, cache, pad(tables), query_lens, seq_lens, scale, {})
    expected = reference_paged_attention(q, cache, tables, seq_lens, query_lens, scale)
    torch.testing.assert_close(out, expected, **tolerance(dtype))


def test_write_kv_places_tokens_in_their_slots():
    cache = torch.zeros(2, NUM_BLOCKS, 2, BLOCK_SIZE, HEAD_DIM)
    k, v = torch.randn(3, 2, HEAD_DIM), torch.randn(3, 2, HEAD_DIM)
    slots = torch.tensor([4 * 7 + 3, 0, 4 * 39 + 1])
    write_kv(cache, k, v, slots)
    for t, (block, offset) in enumerate([(7, 3), (0, 0), (39, 1)]):
        assert torch.equal(cache[0, block, :, offset], k[t])
        assert torch.equal(cache[1, block, :, offset], v[t])
    assert torch.equal(read_slots(cache, slots), torch.stack((k, v)))
    assert int((cache != 0).any(-1).any(2).sum()) == 6  # K and V rows of three tokens


@pytest.mark.parametrize("backend", ["torch", "cpu", "triton"])
@pytest.mark.parametrize("num_decodes", [0, 3])
def test_layer_kernels_mixed_step_matches_reference(num_decodes, backend):
    """A step of decodes then prefill chunks through each kernel backend's attention."""
    gen = torch.Generator().manual_seed(3)
    num_heads, num_kv_heads = 4, 2
    decode_lens = [5, 8, 1][:num_decodes]
    query_lens, prefill_lens = [6, 2, 3], [6, 9, 12]
    tables = make_tables(decode_lens + prefill_lens, gen)
    cache = random_cache(num_kv_heads, torch.float32, gen)
    all_query = [1] * num_decodes + query_lens
    all_lens = decode_lens + prefill_lens
    slots = [
        s
        for table, q_len, seq_len in zip(tables, all_query, all_lens, strict=True)
        for s in slots_of(table, range(seq_len - q_len, seq_len))
    ]
    total = len(slots)
    q = torch.randn(total, num_heads, HEAD_DIM, generator=gen)
    k = torch.randn(total, num_kv_heads, HEAD_DIM, generator=gen)
    v = torch.randn(total, num_kv_heads, HEAD_DIM, generator=gen)
    meta = AttentionMetadata(
        block_size=BLOCK_SIZE,
        slot_mapping=torch.tensor(slots),
        num_decode_tokens=num_decodes,
        decode_block_tables=pad(tables[:num_decodes]),
        decode_seq_lens=torch.tensor(decode_lens, dtype=torch.int64),
        prefill_query_lens=query_lens,
        prefill_seq_lens=prefill_lens,
        prefill_block_tables=pad(tables[num_decodes:]),
    )
    write_kv(cache, k, v, meta.slot_mapping)
    expected = reference_paged_attention(q, cache, tables, all_lens, all_query, HEAD_DIM**-0.5)
    if backend == "triton":
        q, k, v, cache = (t.to(TRITON_DEVICE) for t in (q, k, v, cache))
        meta = dataclasses.replace(
            meta,
            slot_mapping=meta.slot_mapping.to(TRITON_DEVICE),
            decode_block_tables=meta.decode_block_tables.to(TRITON_DEVICE),
            decode_seq_lens=meta.decode_seq_lens.to(TRITON_DEVICE),
            prefill_block_tables=meta.prefill_block_tables.to(TRITON_DEVICE),
        )
    out = get_backend(backend).attention(q, k, v, cache, meta, HEAD_DIM**-0.5)
    torch.testing.assert_close(out.cpu(), expected, atol=2e-5, rtol=1e-5)


def test_unknown_backend_names_registered_ones():
    with pytest.raises(ValueError, match="torch"):
        get_backend("nope")
