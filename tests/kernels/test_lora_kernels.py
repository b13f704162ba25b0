"""Triton multi-LoRA kernels (BGMV / SGMV shrink and expand), the torch path and the
native CPU path (per-token kernel for decodes, fp32 rank-major slots), each against
the slow fp32 reference of `kernels/lora.py`, over adapter-popularity patterns,
mixed ranks, fused projections, batch kinds and edge cases.

Off CUDA the kernels run under the Triton interpreter (conftest sets TRITON_INTERPRET=1),
which is slow: shapes stay tiny. LORAPLEX_TEST_DEVICE (tests/conftest.py) picks the
device; the native CPU path is checked on 'cpu' only. Token layouts follow the runner:
decodes first (one token per sequence, sorted by slot), then prefill chunks (contiguous
per sequence, sorted by slot); -1 marks base-model sequences.

Tolerances (on out = out + delta, compared in fp32 with torch.testing.assert_close):
    fp32: rtol = atol = 1e-4    (both paths accumulate in fp32)
    fp16: rtol = atol = 4e-3    (a few fp16 roundings of values of order 1)
    bf16: rtol = atol = 2e-2    (bf16 keeps 8 mantissa bits; the torch path also rounds
                                 y and the delta to bf16 before adding)
"""

from __future__ import annotations

import os
import random

import pytest
import torch

from loraplex.kernels import triton_lora
from loraplex.kernels.lora import (
    LoRABatch,
    cpu_add_lora,
    torch_add_lora,
    triton_add_lora,
)
from loraplex.kernels.reference import reference_expand, reference_shrink

DEVICE = torch.device(os.environ.get("LORAPLEX_TEST_DEVICE", "cpu"))
"""Set by tests/conftest.py: 'cuda' on a GPU, else 'cpu' (the Triton interpreter)."""
TOLERANCES = {
    torch.float32: 1e-4,
    torch.float16: 4e-3,
    torch.bfloat16: 2e-2,
}
NUM_SLOTS = 6
IN_FEATURES = 80
OUT_FEATURES = 96
RANK = 16
SLOT_RANKS = (4, 8, 16, 16, 8, 4)
"""Real rank per slot: A rows / B columns past it are zero (R = 16 columns stacked)."""
DECODE_SEQS = 12
PREFILL_LENS = (5, 17, 1, 9, 3)
PATTERNS = ("identical", "distinct", "uniform", "zipf", "skewed")


def draw_slots(pattern: str, count: int, rng: random.Random) -> list[int]:
    """Slot per sequence for an adapter-popularity pattern over NUM_SLOTS slots."""
    if pattern == "identical":
        return [2] * count
    if pattern == "distinct":
        return [i % NUM_SLOTS for i in range(count)]
    if pattern == "uniform":
        return [rng.randrange(NUM_SLOTS) for _ in range(count)]
    if pattern == "zipf":
        weights = [1.0 / (rank + 1) ** 1.2 for rank in range(NUM_SLOTS)]
        return rng.choices(range(NUM_SLOTS), weights=weights, k=count)
    if pattern == "skewed":
        return [1 if rng.random() < 0.7 else rng.choice((0, 3, 5)) for _ in range(count)]
    raise ValueError(pattern)


def build_slots(
    pattern: str,
    decode_seqs: int,
    prefill_lens: tuple[int, ...],
    seed: int = 0,
    base_fraction: float = 0.2,
) -> tuple[list[int], int]:
    """Token slots laid out as the runner does, with about `base_fraction` of the
    sequences on the base model (-1). Returns (token_slots, num_decode_tokens)."""
    rng = random.Random(seed)

    def with_base(slots: list[int]) -> list[int]:
        return [-1 if rng.random() < base_fraction else slot for slot in slots]

    decodes = sorted(with_base(draw_slots(pattern, decode_seqs, rng)))
    prefill_slots = with_base(draw_slots(pattern, len(prefill_lens), rng))
    prefills = sorted(zip(prefill_slots, prefill_lens, strict=True), key=lambda seq: seq[0])
    tokens = decodes + [slot for slot, length in prefills for _ in range(length)]
    return tokens, len(decodes)


def make_weights(
    dtype: torch.dtype,
    in_features: int = IN_FEATURES,
    out_features: int = OUT_FEATURES,
    rank: int = RANK,
    slot_ranks: tuple[int, ...] | None = SLOT_RANKS,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stacked lora_a [L, R, in], lora_b [L, out, R]; with `slot_ranks`, slot l only has
    slot_ranks[l] nonzero A rows / B columns. Scaled so the delta is of order 1."""
    gen = torch.Generator().manual_seed(seed)
    lora_a = torch.randn(NUM_SLOTS, rank, in_features, generator=gen) / in_features**0.5
    lora_b = torch.randn(NUM_SLOTS, out_features, rank, generator=gen) / rank**0.5
    if slot_ranks is not None:
        for slot, slot_rank in enumerate(slot_ranks):
            lora_a[slot, slot_rank:] = 0
            lora_b[slot, :, slot_rank:] = 0
    return lora_a.to(DEVICE, dtype), lora_b.to(DEVICE, dtype)


def make_activations(
    num_tokens: int, in_features: int, out_features: int, dtype: torch.dtype, seed: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, in_features, generator=gen)
    out = torch.randn(num_tokens, out_features, generator=gen)
    return x.to(DEVICE, dtype), out.to(DEVICE, dtype)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    tol = TOLERANCES[dtype]
    torch.testing.assert_close(actual.float(), expected.float(), rtol=tol, atol=tol)


def rank_major_fp32(lora_b: torch.Tensor) -> torch.Tensor:
    """lora_b as the 'cpu' backend stores it: fp32, each column B[l, :, r] contiguous."""
    return lora_b.float().transpose(1, 2).contiguous().transpose(1, 2)


def check_add_lora(
    slots: list[int],
    num_decode_tokens: int,
    dtype: torch.dtype = torch.float32,
    lora_a: torch.Tensor | None = None,
    lora_b: torch.Tensor | None = None,
) -> torch.Tensor:
    """Runs both paths on one batch, checks each against the reference and against each
    other, and returns the reference result (fp32)."""
    if lora_a is None or lora_b is None:
        lora_a, lora_b = make_weights(dtype)
    batch = LoRABatch.from_token_slots(slots, num_decode_tokens, DEVICE)
    x, out = make_activations(len(slots), lora_a.shape[2], lora_b.shape[1], dtype)
    expected = reference_expand(
        reference_shrink(x, lora_a, batch.token_slots), lora_b, batch.token_slots, out
    )
    via_triton = out.clone()
    triton_add_lora(via_triton, x, lora_a, lora_b, batch)
    via_torch = out.clone()
    torch_add_lora(via_torch, x, lora_a, lora_b, batch)
    assert via_triton.dtype == dtype
    assert_close(via_triton, expected, dtype)
    assert_close(via_torch, expected, dtype)
    assert_close(via_triton, via_torch, dtype)
    base = batch.token_slots < 0
    assert torch.equal(via_triton[base], out[base]), "base-model rows must stay untouched"
    if DEVICE.type == "cpu":
        via_cpu = out.clone()
        cpu_add_lora(via_cpu, x, lora_a.float(), rank_major_fp32(lora_b), batch)
        assert_close(via_cpu, expected, dtype)
        assert torch.equal(via_cpu[base], out[base])
    return expected


BATCH_KINDS = {
    "decode": (DECODE_SEQS, ()),
    "prefill": (0, PREFILL_LENS),
    "mixed": (DECODE_SEQS, PREFILL_LENS),
}


@pytest.mark.parametrize("kind", sorted(BATCH_KINDS))
@pytest.mark.parametrize("pattern", PATTERNS)
def test_add_lora_popularity_patterns(pattern: str, kind: str) -> None:
    decode_seqs, prefill_lens = BATCH_KINDS[kind]
    slots, num_decodes = build_slots(pattern, decode_seqs, prefill_lens)
    check_add_lora(slots, num_decodes)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("pattern", ["zipf", "distinct"])
def test_add_lora_half_precision(pattern: str, dtype: torch.dtype) -> None:
    slots, num_decodes = build_slots(pattern, DECODE_SEQS, PREFILL_LENS, seed=3)
    check_add_lora(slots, num_decodes, dtype)


def test_mixed_ranks_match_truncated_adapters() -> None:
    """Zero padding past each slot's rank gives exactly the rank-r adapter's delta."""
    slots, num_decodes = build_slots("distinct", DECODE_SEQS, PREFILL_LENS, base_fraction=0)
    lora_a, lora_b = make_weights(torch.float32)
    expected = check_add_lora(slots, num_decodes, torch.float32, lora_a, lora_b)
    x, out = make_activations(len(slots), IN_FEATURES, OUT_FEATURES, torch.float32)
    for t, slot in enumerate(slots):
        rank = SLOT_RANKS[slot]
        delta = x[t] @ lora_a[slot, :rank].T @ lora_b[slot, :, :rank].T
        torch.testing.assert_close(expected[t], out[t] + delta, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fused_projection(dtype: torch.dtype) -> None:
    """q/k/v-style fusion: R = 3 * 8 stacked A rows, block-diagonal B; the delta of each
    output slice is that slice's own rank-8 LoRA."""
    slice_rank, slice_sizes = 8, (32, 16, 16)
    lora_a, lora_b = make_weights(
        torch.float32, out_features=sum(slice_sizes), rank=3 * slice_rank, slot_ranks=None
    )
    row = 0
    for s, size in enumerate(slice_sizes):
        block = slice(s * slice_rank, (s + 1) * slice_rank)
        lora_b[:, row : row + size, : s * slice_rank] = 0
        lora_b[:, row : row + size, block.stop :] = 0
        row += size
    lora_a, lora_b = lora_a.to(dtype), lora_b.to(dtype)
    slots, num_decodes = build_slots("uniform", 6, (7, 4), seed=5)
    expected = check_add_lora(slots, num_decodes, dtype, lora_a, lora_b)
    x, out = make_activations(len(slots), IN_FEATURES, sum(slice_sizes), dtype)
    batch = LoRABatch.from_token_slots(slots, num_decodes, DEVICE)
    row = 0
    for s, size in enumerate(slice_sizes):
        block = slice(s * slice_rank, (s + 1) * slice_rank)
        y = reference_shrink(x, lora_a[:, block], batch.token_slots)
        part = reference_expand(
            y, lora_b[:, row : row + size, block], batch.token_slots, out[:, row : row + size]
        )
        torch.testing.assert_close(expected[:, row : row + size], part, rtol=1e-5, atol=1e-5)
        row += size


EDGE_CASES = {
    "single-decode": ([3], 1),
    "single-prefill-token": ([4], 0),
    "length-1-segments": ([0, 5, 1, 1, 1, 1, 2, 3, 3, 3], 2),
    "base-between-segments": ([-1, 2, 2, 2, -1, -1, 2, 2, 0], 2),
    "all-base": ([-1, -1, -1, -1], 2),
    "empty": ([], 0),
}


@pytest.mark.parametrize("case", sorted(EDGE_CASES))
def test_edge_cases(case: str) -> None:
    slots, num_decodes = EDGE_CASES[case]
    check_add_lora(slots, num_decodes)


@pytest.mark.parametrize("split_k", [1, 2, 3])
def test_bgmv_shrink_strided_views(split_k: int) -> None:
    """Row and column slices as inputs and output; every row of y[:D] written (zeros for
    -1), nothing else. R = 48 gives BLOCK_R = 64 (masked tail) and BLOCK_K = 64: two K
    blocks (one a tail) over 1, 2 or 3 splits (one of them empty)."""
    rank, in_features = 48, 96
    lora_a, _ = make_weights(torch.float32, in_features=in_features, rank=rank, slot_ranks=None)
    slots = torch.tensor([0, 0, 1, -1, 3, 5, 5, -1], device=DEVICE)
    decodes = 6
    wide = torch.randn(10, in_features + 20, device=DEVICE)
    x = wide[:, 7 : 7 + in_features]
    y_wide = torch.full((10, rank + 3), float("nan"), device=DEVICE)
    y = y_wide[:, :rank]
    triton_lora.bgmv_shrink(x[:decodes], lora_a, slots[:decodes], y[:decodes], split_k=split_k)
    expected = reference_shrink(x[:decodes], lora_a, slots[:decodes])
    torch.testing.assert_close(y[:decodes], expected, rtol=1e-4, atol=1e-4)
    assert torch.isnan(y_wide[decodes:]).all()
    assert torch.isnan(y_wide[:, rank:]).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_bgmv_expand_strided_views(dtype: torch.dtype) -> None:
    _, lora_b = make_weights(dtype)
    slots = torch.tensor([-1, 1, 2, 2, 4, -1, 0], device=DEVICE)
    decodes = 6
    y = torch.randn(len(slots), RANK, device=DEVICE)
    wide = torch.randn(len(slots), OUT_FEATURES + 9, device=DEVICE).to(dtype)
    before = wide.clone()
    out = wide[:, 5 : 5 + OUT_FEATURES]
    triton_lora.bgmv_expand(y[:decodes], lora_b, slots[:decodes], out[:decodes])
    expected = reference_expand(
        y[:decodes], lora_b, slots[:decodes], before[:decodes, 5 : 5 + OUT_FEATURES]
    )
    assert_close(out[:decodes], expected, dtype)
    unchanged = torch.ones_like(wide, dtype=torch.bool)
    unchanged[:decodes, 5 : 5 + OUT_FEATURES] = (slots[:decodes] < 0)[:, None]
    assert torch.equal(wide[unchanged], before[unchanged])


@pytest.mark.parametrize("block_m", [16, 32])
def test_sgmv_leaves_other_rows_untouched(block_m: int) -> None:
    """Decode and base tokens are in no prefill segment: SGMV writes none of their rows
    (the shrink's K unsplit: a split zeroes y first). Segment lengths cross BLOCK_M
    boundaries."""
    lora_a, lora_b = make_weights(torch.float32)
    slots = [0, 1, 1] + [2] * 33 + [-1] * 3 + [4] * 16 + [5]
    batch = LoRABatch.from_token_slots(slots, 3, DEVICE)
    x, out = make_activations(len(slots), IN_FEATURES, OUT_FEATURES, torch.float32)
    segs = (batch.seg_starts, batch.seg_lens, batch.seg_slots, batch.max_seg_len)
    y = torch.full((len(slots), RANK), 7.0, device=DEVICE)
    triton_lora.sgmv_shrink(x, lora_a, *segs, y, block_m=block_m, split_k=1)
    result = out.clone()
    triton_lora.sgmv_expand(y, lora_b, *segs, result, block_m=block_m)
    in_segment = torch.zeros(len(slots), dtype=torch.bool, device=DEVICE)
    for start, length in zip(batch.seg_starts.tolist(), batch.seg_lens.tolist(), strict=True):
        in_segment[start : start + length] = True
    prefill_slots = torch.where(in_segment, batch.token_slots, -1)
    expected_y = reference_shrink(x, lora_a, prefill_slots)
    torch.testing.assert_close(y[in_segment], expected_y[in_segment], rtol=1e-4, atol=1e-4)
    assert (y[~in_segment] == 7.0).all()
    expected = reference_expand(expected_y, lora_b, prefill_slots, out)
    torch.testing.assert_close(result, expected, rtol=1e-4, atol=1e-4)
    assert torch.equal(result[~in_segment], out[~in_segment])


@pytest.mark.parametrize("split_k", [2, 3])
def test_sgmv_split_k_as_in_a_decode_graph(split_k: int) -> None:
    """A decode graph's segment table: short segments, unused entries (length 0, slot -1)
    and max_seg_len sized for the worst case. Off CUDA, K = 200 is four 64-wide blocks,
    the last a tail: 2 splits take two blocks each, 3 splits take two, one and one. y is
    zeroed first, so rows outside the segments read 0, and the expand (narrow output
    blocks) adds the reference's delta."""
    in_features, rank = 200, 48
    lora_a, lora_b = make_weights(
        torch.float32, in_features=in_features, rank=rank, slot_ranks=None
    )
    slots = [0, 0, 1, 3, 3, 3, -1, -1]
    x, out = make_activations(len(slots), in_features, OUT_FEATURES, torch.float32)
    as_int32 = {"dtype": torch.int32, "device": DEVICE}
    segs = (
        torch.tensor([0, 2, 3, 0, 0], **as_int32),
        torch.tensor([2, 1, 3, 0, 0], **as_int32),
        torch.tensor([0, 1, 3, -1, -1], **as_int32),
        len(slots),
    )
    y = torch.full((len(slots), rank), 7.0, device=DEVICE)
    triton_lora.sgmv_shrink(x, lora_a, *segs, y, split_k=split_k)
    token_slots = torch.tensor(slots, device=DEVICE)
    expected_y = reference_shrink(x, lora_a, token_slots)
    torch.testing.assert_close(y, expected_y, rtol=1e-4, atol=1e-4)
    result = out.clone()
    triton_lora.sgmv_expand(y, lora_b, *segs, result, block_n=32)
    expected = reference_expand(expected_y, lora_b, token_slots, out)
    torch.testing.assert_close(result, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_dense_shrink_then_expand_by_slot(dtype: torch.dtype) -> None:
    """Every slot's shrink in one matmul, y [T, L, R]; the expand reads each segment's
    slot from it (a graph's table: unused entries of length 0 and slot -1), rows outside
    the segments untouched."""
    lora_a, lora_b = make_weights(dtype)
    slots = [0, 0, 1, 4, 4, 4, -1, 5]
    x, out = make_activations(len(slots), IN_FEATURES, OUT_FEATURES, dtype)
    as_int32 = {"dtype": torch.int32, "device": DEVICE}
    segs = (
        torch.tensor([0, 2, 3, 7, 0], **as_int32),
        torch.tensor([2, 1, 3, 1, 0], **as_int32),
        torch.tensor([0, 1, 4, 5, -1], **as_int32),
        len(slots),
    )
    y = triton_lora.dense_shrink(x, lora_a)
    assert y.shape == (len(slots), NUM_SLOTS, RANK) and y.dtype == dtype
    result = out.clone()
    triton_lora.sgmv_expand(y, lora_b, *segs, result)
    token_slots = torch.tensor(slots, device=DEVICE)
    expected_y = reference_shrink(x, lora_a, token_slots)
    expected = reference_expand(expected_y, lora_b, token_slots, out)
    assert_close(result, expected, dtype)
    assert torch.equal(result[6], out[6])


@pytest.mark.parametrize("rank", [1, 5, 130])
def test_odd_shapes(rank: int) -> None:
    """Ranks that are not powers of two (and one past the largest R block), feature sizes
    that leave tails in every block."""
    in_features, out_features = 91, 95
    lora_a, lora_b = make_weights(
        torch.float32, in_features, out_features, rank=rank, slot_ranks=None
    )
    slots, num_decodes = build_slots("uniform", 5, (19, 2), seed=rank)
    check_add_lora(slots, num_decodes, torch.float32, lora_a, lora_b)


def test_sgmv_segment_without_slot_is_inert() -> None:
    """Defensive: a segment with slot -1 (LoRABatch never makes one) gets y = 0 and no
    delta, like a base-model token under BGMV. lora_b is a view after another slot, so
    reading "slot -1" would find real, nonzero memory."""
    lora_a, padded_b = make_weights(torch.float32)
    lora_b = padded_b[1:]
    x, out = make_activations(6, IN_FEATURES, OUT_FEATURES, torch.float32)
    as_int32 = {"dtype": torch.int32, "device": DEVICE}
    segs = (
        torch.tensor([0, 3], **as_int32),
        torch.tensor([3, 3], **as_int32),
        torch.tensor([-1, 2], **as_int32),
        3,
    )
    y = torch.full((6, RANK), 7.0, device=DEVICE)
    result = out.clone()
    triton_lora.sgmv_expand(y, lora_b, *segs, result)
    assert torch.equal(result[:3], out[:3])
    triton_lora.sgmv_shrink(x, lora_a, *segs, y)
    assert (y[:3] == 0).all()
    slots = torch.tensor([-1, -1, -1, 2, 2, 2], device=DEVICE)
    torch.testing.assert_close(y, reference_shrink(x, lora_a, slots), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_ranks", [False, True])
def test_torch_path_with_fp32_slots_for_a_half_model(dtype: torch.dtype, with_ranks: bool) -> None:
    """The engine keeps torch- and cpu-path slots in fp32 for half models. Adjacent equal-length
    segments (one batched matmul pair) and lone ones (two matmuls) both equal the
    reference, with or without trimming each slot to its rank."""
    lora_a, lora_b = make_weights(torch.float32)
    slots = [0, 1, 2, 3] + [1, 1, 4, 4, 5, 5] + [2] * 5 + [-1, -1] + [3] * 3
    ranks = SLOT_RANKS if with_ranks else None
    batch = LoRABatch.from_token_slots(slots, 4, DEVICE, ranks)
    x, out = make_activations(len(slots), IN_FEATURES, OUT_FEATURES, dtype)
    expected = reference_expand(
        reference_shrink(x, lora_a, batch.token_slots), lora_b, batch.token_slots, out
    )
    paths = [(torch_add_lora, lora_b)]
    if DEVICE.type == "cpu":
        paths.append((cpu_add_lora, rank_major_fp32(lora_b)))
    for add_lora, b in paths:
        got = out.clone()
        add_lora(got, x, lora_a, b, batch)
        assert got.dtype == dtype
        assert_close(got, expected, dtype)
        assert torch.equal(got[batch.token_slots < 0], out[batch.token_slots < 0])


def test_batch_from_runs_merges_sequences_of_one_slot() -> None:
    """The runner's runs (one per scheduled sequence): equal slots that touch merge into
    one segment, never across the decodes' end; base runs belong to no segment; a run
    that would cross the decodes' end is refused."""
    runs = [(1, 1), (1, 1), (-1, 1), (2, 1), (2, 4), (2, 3), (-1, 2), (0, 5), (0, 0), (0, 1)]
    batch = LoRABatch.from_runs(runs, 4, DEVICE)
    assert batch.segments == ((0, 2, 1), (3, 4, 2), (4, 11, 2), (13, 19, 0))
    assert batch.seg_starts.tolist() == [4, 13] and batch.seg_lens.tolist() == [7, 6]
    expected = [slot for slot, count in runs for _ in range(count)]
    assert batch.token_slots.tolist() == expected
    same = LoRABatch.from_token_slots(expected, 4, DEVICE)
    assert same.segments == batch.segments
    with pytest.raises(ValueError, match="crosses"):
        LoRABatch.from_runs([(1, 3), (1, 2)], 4, DEVICE)
